//! Reading an upstream's Server-Sent Events: [`Events`] cuts the body into
//! events as its bytes arrive, and [`Usage`] gathers the usage the events
//! report, whatever the protocol: an object `usage` at the top of an event's
//! JSON (OpenAI's last chunk with `stream_options.include_usage`, Anthropic's
//! `message_delta`) or in its `message` (Anthropic's `message_start`), later
//! numbers over earlier ones. A streamed job's answer is `{"usage": {...}}`,
//! so an operation's `settle.from` (`/usage/total_tokens`,
//! `/usage/output_tokens`) reads a stream as it reads a whole answer.

use serde_json::{Map, Value};
use tollgate_core::stream::MAX_EVENT_BYTES;

/// Why a streamed attempt stopped: its reader went away.
pub const CLIENT_GONE: &str = "the client went away mid-stream; the upstream call was cut";
/// Why a streamed attempt stopped: its events could not be passed on.
pub const SINK_FAILED: &str = "passing the stream on failed; the upstream call was cut";

/// The events of an SSE body, cut at each blank line (`\n\n`, `\r\n\r\n`).
#[derive(Debug, Default)]
pub struct Events {
    buf: Vec<u8>,
}

impl Events {
    /// Adds `bytes`; returns the events they completed, each without its
    /// ending blank line (empty events, e.g. keep-alive blank lines, left
    /// out). Err: an event longer than [`MAX_EVENT_BYTES`].
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<String>, String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            let end = find_blank_line(&self.buf);
            let Some((at, len)) = end else { break };
            let event: Vec<u8> = self.buf.drain(..at + len).take(at).collect();
            let text = String::from_utf8_lossy(&event).replace("\r\n", "\n");
            if !text.trim().is_empty() {
                out.push(text);
            }
        }
        if self.buf.len() > MAX_EVENT_BYTES {
            return Err(format!("an event longer than {MAX_EVENT_BYTES} bytes"));
        }
        Ok(out)
    }

    /// What is left once the body ended: an event not closed by a blank line.
    pub fn rest(&mut self) -> Option<String> {
        let text = String::from_utf8_lossy(&std::mem::take(&mut self.buf)).replace("\r\n", "\n");
        (!text.trim().is_empty()).then(|| text.trim_end().to_owned())
    }
}

fn find_blank_line(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// The `data:` of an event, its lines joined (SSE: one `\n` between).
pub fn data(event: &str) -> Option<String> {
    let lines: Vec<&str> = event
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|l| l.strip_prefix(' ').unwrap_or(l))
        .collect();
    (!lines.is_empty()).then(|| lines.join("\n"))
}

/// Whether a request asks its upstream to report usage in its stream
/// (`stream_options.include_usage: true`).
pub fn asks_usage(input: &Value) -> bool {
    input.pointer("/stream_options/include_usage") == Some(&Value::Bool(true))
}

/// The request of a streamed call to an upstream that reports usage only
/// when asked ([`StreamUsage::Ask`](tollgate_core::config::StreamUsage)):
/// `input` with `stream_options.include_usage: true`, or `None` when it asks
/// already (or is not an object: sent as it is, the upstream judges it).
pub fn asking_usage(input: &Value) -> Option<Value> {
    if asks_usage(input) || !input.is_object() {
        return None;
    }
    let mut asked = input.clone();
    let options = &mut asked["stream_options"];
    if !options.is_object() {
        *options = Value::Object(Map::new());
    }
    options["include_usage"] = Value::Bool(true);
    Some(asked)
}

/// One event of a stream whose usage was asked for on the client's behalf,
/// as that client would have had it without asking: `None` for the usage
/// chunk (`"choices": []` and a `usage` object), the event without its
/// top-level `"usage": null` member otherwise (every other chunk carries one
/// once usage is asked for), byte for byte the rest.
pub fn as_unasked(event: &str) -> Option<std::borrow::Cow<'_, str>> {
    use std::borrow::Cow;
    // A chunk is one `data:` line of JSON; anything else passes as it is.
    let lines: Vec<&str> = event.lines().collect();
    let Some(at) = lines.iter().position(|l| l.starts_with("data:")) else {
        return Some(Cow::Borrowed(event));
    };
    if lines.iter().filter(|l| l.starts_with("data:")).count() != 1 {
        return Some(Cow::Borrowed(event));
    }
    let line = lines[at];
    let json = line["data:".len()..].trim_start_matches(' ');
    if !json.contains("\"usage\"") {
        return Some(Cow::Borrowed(event));
    }
    let Ok(Value::Object(chunk)) = serde_json::from_str::<Value>(json) else {
        return Some(Cow::Borrowed(event));
    };
    match chunk.get("usage") {
        Some(Value::Object(_))
            if chunk
                .get("choices")
                .and_then(Value::as_array)
                .is_some_and(Vec::is_empty) =>
        {
            None
        }
        Some(Value::Null) => match without_null_member(json, "usage") {
            Some(stripped) => {
                let prefix = &line[..line.len() - json.len()];
                let mut out = lines.clone();
                let new_line = format!("{prefix}{stripped}");
                out[at] = &new_line;
                Some(Cow::Owned(out.join("\n")))
            }
            None => Some(Cow::Borrowed(event)),
        },
        _ => Some(Cow::Borrowed(event)),
    }
}

/// `json` (an object) without its top-level member `name` whose value is
/// `null`, every other byte kept; `None` when there is no such member.
fn without_null_member(json: &str, name: &str) -> Option<String> {
    let bytes = json.as_bytes();
    let key = format!("\"{name}\"");
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    // Where the current top-level member began (just after the `{` or `,`
    // before it), and that comma's place when there was one.
    let (mut member_start, mut comma) = (0, None);
    for (i, &b) in bytes.iter().enumerate() {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'{' | b'[' => {
                depth += 1;
                if depth == 1 {
                    (member_start, comma) = (i + 1, None);
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            b',' if depth == 1 => (member_start, comma) = (i + 1, Some(i)),
            b'"' => {
                in_string = true;
                let at_key = depth == 1 && json[member_start..i].trim().is_empty();
                if !at_key || !json[i..].starts_with(&key) {
                    continue;
                }
                let rest = json[i + key.len()..].trim_start();
                let Some(value) = rest.strip_prefix(':').map(str::trim_start) else {
                    continue;
                };
                if !value.starts_with("null") {
                    continue;
                }
                let end = json.len() - value.len() + "null".len();
                return Some(match comma {
                    // `,"usage":null` after a member: from its comma.
                    Some(c) => format!("{}{}", &json[..c], &json[end..]),
                    // `"usage":null,` first: to the next member.
                    None => {
                        let tail = json[end..].trim_start();
                        let tail = tail.strip_prefix(',').map_or(tail, str::trim_start);
                        format!("{}{}", &json[..i], tail)
                    }
                });
            }
            _ => {}
        }
    }
    None
}

/// The usage a stream reported so far.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Usage {
    fields: Map<String, Value>,
    /// A final report was seen: an object `usage` at the top of an event
    /// (OpenAI's usage chunk, Anthropic's `message_delta`) or the Responses
    /// API's `response.usage` (`response.completed`). Anthropic's
    /// `message_start` reports a first count only.
    complete: bool,
}

impl Usage {
    /// Reads the usage of one event, if it reports any.
    pub fn see(&mut self, event: &str) {
        let Some(data) = data(event) else { return };
        if !data.contains("usage") {
            return; // Most events: not parsed at all.
        }
        let Ok(v) = serde_json::from_str::<Value>(&data) else {
            return;
        };
        let reports = [
            (v.get("usage"), true),
            (v.pointer("/response/usage"), true),
            (v.pointer("/message/usage"), false),
        ];
        for (usage, last) in reports {
            if let Some(Value::Object(fields)) = usage {
                for (k, v) in fields {
                    if !v.is_null() {
                        self.fields.insert(k.clone(), v.clone());
                    }
                }
                self.complete |= last;
            }
        }
    }

    /// Whether the stream's final usage was seen: what follows it (`[DONE]`,
    /// `message_stop`) adds no work, so a stream cut after it is paid its
    /// usage.
    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// The streamed job's answer: `{"usage": {...}}` (empty when none was
    /// reported).
    pub fn answer(&self) -> Value {
        serde_json::json!({ "usage": Value::Object(self.fields.clone()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn cuts_events_across_chunks() {
        let mut e = Events::default();
        assert_eq!(e.feed(b"data: {\"a\"").unwrap(), Vec::<String>::new());
        assert_eq!(
            e.feed(b":1}\n\ndata: [DONE]\n").unwrap(),
            vec!["data: {\"a\":1}"]
        );
        assert_eq!(
            e.feed(b"\nevent: x\r\ndata: y\r\n\r\n\n\n").unwrap(),
            vec!["data: [DONE]", "event: x\ndata: y"]
        );
        assert_eq!(e.rest(), None);
        e.feed(b"data: tail").unwrap();
        assert_eq!(e.rest().as_deref(), Some("data: tail"));
        assert!(e.feed(&vec![b'x'; MAX_EVENT_BYTES + 1]).is_err());
    }

    #[test]
    fn asks_for_usage_only_where_the_client_did_not() {
        let plain = json!({"model": "m", "stream": true});
        assert_eq!(
            asking_usage(&plain),
            Some(json!({"model": "m", "stream": true, "stream_options": {"include_usage": true}}))
        );
        let other = json!({"stream": true, "stream_options": {"include_obfuscation": false}});
        assert_eq!(
            asking_usage(&other).unwrap()["stream_options"],
            json!({"include_obfuscation": false, "include_usage": true})
        );
        let refused = json!({"stream": true, "stream_options": {"include_usage": false}});
        assert!(asks_usage(&asking_usage(&refused).unwrap()));
        let asked = json!({"stream": true, "stream_options": {"include_usage": true}});
        assert_eq!(asking_usage(&asked), None);
    }

    #[test]
    fn relays_what_a_client_that_did_not_ask_would_have_had() {
        let chunk = r#"data: {"id":"c1","choices":[{"index":0,"delta":{"content":"a \"usage\":null,"}}],"usage":null}"#;
        assert_eq!(
            as_unasked(chunk).unwrap(),
            r#"data: {"id":"c1","choices":[{"index":0,"delta":{"content":"a \"usage\":null,"}}]}"#
        );
        // First, with spaces, nested members of that name kept.
        let first = r#"data: { "usage" : null, "x": {"usage":null}}"#;
        assert_eq!(
            as_unasked(first).unwrap(),
            r#"data: { "x": {"usage":null}}"#
        );
        let only = r#"data:{"usage":null}"#;
        assert_eq!(as_unasked(only).unwrap(), r#"data:{}"#);
        // The usage chunk is not relayed; [DONE], other events, as they are.
        assert_eq!(
            as_unasked(r#"data: {"id":"c1","choices":[],"usage":{"total_tokens":9}}"#),
            None
        );
        for same in [
            "data: [DONE]",
            "event: message_delta\ndata: {\"usage\":{\"output_tokens\":3}}",
            r#"data: {"choices":[{"delta":{}}],"usage":{"total_tokens":9}}"#,
            ": keep-alive",
        ] {
            assert_eq!(as_unasked(same).unwrap(), same);
        }
    }

    #[test]
    fn a_final_report_completes_the_usage() {
        let mut a = Usage::default();
        a.see("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":4,\"output_tokens\":1}}}");
        assert!(!a.is_complete(), "message_start's count is a first one");
        a.see("event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}");
        assert!(a.is_complete());
        let mut o = Usage::default();
        o.see("data: {\"choices\":[],\"usage\":null}");
        assert!(!o.is_complete());
        let mut r = Usage::default();
        r.see("event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":7}}}");
        assert!(r.is_complete());
        assert_eq!(r.answer()["usage"]["output_tokens"], 7);
    }

    #[test]
    fn gathers_openai_and_anthropic_usage() {
        let mut u = Usage::default();
        u.see("data: {\"choices\":[],\"usage\":null}");
        u.see("data: [DONE]");
        assert_eq!(u.answer(), json!({"usage": {}}));
        u.see("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":5,\"total_tokens\":8}}");
        assert_eq!(u.answer()["usage"]["total_tokens"], 8);

        let mut a = Usage::default();
        a.see("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":4,\"output_tokens\":1}}}");
        a.see("event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}");
        assert_eq!(
            a.answer(),
            json!({"usage": {"input_tokens": 4, "output_tokens": 9}})
        );
    }
}
