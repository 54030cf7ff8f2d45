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

/// The usage a stream reported so far.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Usage(Map<String, Value>);

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
        for usage in [v.get("usage"), v.pointer("/message/usage")]
            .into_iter()
            .flatten()
        {
            if let Value::Object(fields) = usage {
                for (k, v) in fields {
                    if !v.is_null() {
                        self.0.insert(k.clone(), v.clone());
                    }
                }
            }
        }
    }

    /// The streamed job's answer: `{"usage": {...}}` (empty when none was
    /// reported).
    pub fn answer(&self) -> Value {
        serde_json::json!({ "usage": Value::Object(self.0.clone()) })
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
