//! The real upstream protocols the mock speaks, so that the official SDKs
//! work against it (through tollgate or directly):
//!
//! - OpenAI `POST …/chat/completions`: an answer, or with `"stream": true`
//!   `chat.completion.chunk` events, the usage chunk when
//!   `stream_options.include_usage`, then `data: [DONE]`;
//! - OpenAI `POST …/embeddings`: floats, or base64 little-endian `f32`s
//!   (`encoding_format`, the SDK's default);
//! - Anthropic `POST …/messages`: a message, or with `"stream": true` the
//!   events `message_start`, `content_block_start`, `content_block_delta`…,
//!   `content_block_stop`, `message_delta` (with the usage), `message_stop`.
//!
//! Text and usage are [`crate::text`]'s (one word, one token). A stream sends
//! one token per event, `token_interval` apart.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::text;

/// The counter of streams cut by their caller.
pub type Cut = std::sync::Arc<std::sync::atomic::AtomicU64>;

/// Which protocol a path speaks, from its end (any base before it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    OpenAiChat,
    OpenAiEmbeddings,
    AnthropicMessages,
}

impl Protocol {
    pub fn of(path: &str) -> Option<Self> {
        let path = path.trim_end_matches('/');
        if path.ends_with("chat/completions") {
            Some(Self::OpenAiChat)
        } else if path.ends_with("embeddings") {
            Some(Self::OpenAiEmbeddings)
        } else if path.ends_with("messages") {
            Some(Self::AnthropicMessages)
        } else {
            None
        }
    }

    /// The answer to `body` (call number `n`, for ids).
    /// `cut` counts the streams whose caller went away before their end.
    pub fn answer(self, body: &Value, n: u64, pace: Pace, cut: Cut) -> Response {
        if !body.is_object() {
            return bad_request(self, "the body must be a JSON object");
        }
        match self {
            Self::OpenAiChat => openai_chat(body, n, pace, cut),
            Self::OpenAiEmbeddings => openai_embeddings(body),
            Self::AnthropicMessages => anthropic_messages(body, n, pace, cut),
        }
    }
}

fn bad_request(protocol: Protocol, message: &str) -> Response {
    let body = match protocol {
        Protocol::AnthropicMessages => json!({
            "type": "error",
            "error": {"type": "invalid_request_error", "message": message},
        }),
        _ => json!({"error": {
            "message": message, "type": "invalid_request_error", "param": null, "code": null,
        }}),
    };
    (StatusCode::BAD_REQUEST, Json(body)).into_response()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn model(body: &Value) -> String {
    body.get("model")
        .and_then(Value::as_str)
        .unwrap_or("mock-model")
        .to_owned()
}

/// The usage fields price sheets read beyond plain counts, reported as the
/// providers do for a model whose name asks for them (so that tests can
/// price every kind): a model named `*cache*` reads half its prompt from a
/// cache (OpenAI: `prompt_tokens_details.cached_tokens`, part of
/// `prompt_tokens`; Anthropic: `cache_read_input_tokens` as much as its
/// input and `cache_creation_input_tokens` half of it, beside
/// `input_tokens`), one named `*reason*` spends a third of its completion on
/// reasoning (`completion_tokens_details.reasoning_tokens`, part of
/// `completion_tokens`).
fn extra_usage(usage: &mut Value, model: &str, anthropic: bool) {
    let n = |k: &str, u: &Value| u.get(k).and_then(Value::as_u64).unwrap_or(0);
    if model.contains("cache") {
        if anthropic {
            let input = n("input_tokens", usage);
            usage["cache_read_input_tokens"] = json!(input);
            usage["cache_creation_input_tokens"] = json!(input / 2);
        } else {
            let cached = n("prompt_tokens", usage) / 2;
            usage["prompt_tokens_details"] = json!({"cached_tokens": cached});
        }
    }
    if model.contains("reason") && !anthropic {
        let reasoning = n("completion_tokens", usage) / 3;
        usage["completion_tokens_details"] = json!({"reasoning_tokens": reasoning});
    }
}

fn streams(body: &Value) -> bool {
    body.get("stream").and_then(Value::as_bool) == Some(true)
}

/// One Server-Sent Event: `event:` when named, one `data:` line.
pub fn sse(event: Option<&str>, data: &str) -> Bytes {
    let mut out = String::with_capacity(data.len() + 32);
    if let Some(e) = event {
        out.push_str("event: ");
        out.push_str(e);
        out.push('\n');
    }
    out.push_str("data: ");
    out.push_str(data);
    out.push_str("\n\n");
    Bytes::from(out)
}

/// How a stream's events go out: `interval` apart, each stamped with its
/// send time when `stamp` ([`crate::MockOptions::stamp_events`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pace {
    pub interval: Duration,
    pub stamp: bool,
}

/// A `text/event-stream` answer of `events`, the first at once, each next one
/// `pace.interval` later.
fn event_stream(events: Vec<Bytes>, pace: Pace, cut: Cut) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
    tokio::spawn(async move {
        for (i, e) in events.into_iter().enumerate() {
            if i > 0 && !pace.interval.is_zero() {
                tokio::time::sleep(pace.interval).await;
            }
            let e = match pace.stamp {
                true => {
                    let us = SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .map_or(0, |d| d.as_micros());
                    let mut stamped = format!(": sent_us={us}\n").into_bytes();
                    stamped.extend_from_slice(&e);
                    Bytes::from(stamped)
                }
                false => e,
            };
            if tx.send(e).await.is_err() {
                cut.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                return; // The caller went away.
            }
        }
    });
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

fn openai_chat(body: &Value, n: u64, pace: Pace, cut: Cut) -> Response {
    if body.get("messages").and_then(Value::as_array).is_none() {
        return bad_request(Protocol::OpenAiChat, "messages: required, an array");
    }
    let max = body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_u64);
    let words = text::answer(&text::last_message(body), max);
    let prompt_tokens = text::count(&text::prompt(body));
    let completion_tokens = words.len() as u64;
    let mut usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    });
    let (id, created, model) = (format!("chatcmpl-mock-{n}"), now_secs(), model(body));
    extra_usage(&mut usage, &model, false);
    if !streams(body) {
        return Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{
                "index": 0, "logprobs": null, "finish_reason": "stop",
                "message": {"role": "assistant", "content": text::answer_text(&words), "refusal": null},
            }],
            "usage": usage,
        }))
        .into_response();
    }
    let include_usage = body
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        == Some(true);
    let chunk = |delta: Value, finish: Value| {
        let mut c = json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        });
        if include_usage {
            c["usage"] = Value::Null;
        }
        sse(None, &c.to_string())
    };
    let mut events = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    events.extend(
        text::pieces(&words)
            .into_iter()
            .map(|p| chunk(json!({"content": p}), Value::Null)),
    );
    events.push(chunk(json!({}), json!("stop")));
    if include_usage {
        let last = json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [], "usage": usage,
        });
        events.push(sse(None, &last.to_string()));
    }
    events.push(sse(None, "[DONE]"));
    event_stream(events, pace, cut)
}

fn openai_embeddings(body: &Value) -> Response {
    let inputs: Vec<String> = match body.get("input") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) if !items.is_empty() => {
            // Strings, or token arrays (their numbers as words).
            items
                .iter()
                .map(|i| match i {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect()
        }
        _ => {
            return bad_request(
                Protocol::OpenAiEmbeddings,
                "input: required, a string or a non-empty array",
            )
        }
    };
    let dims = body
        .get("dimensions")
        .and_then(Value::as_u64)
        .map_or(8, |d| d.clamp(1, 4096) as usize);
    let base64 = body.get("encoding_format").and_then(Value::as_str) == Some("base64");
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, input)| {
            let v = text::embedding(input, dims);
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
                json!(base64_encode(&bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    let tokens: u64 = inputs.iter().map(|i| text::count(i)).sum();
    Json(json!({
        "object": "list", "data": data, "model": model(body),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response()
}

fn anthropic_messages(body: &Value, n: u64, pace: Pace, cut: Cut) -> Response {
    if body.get("messages").and_then(Value::as_array).is_none() {
        return bad_request(Protocol::AnthropicMessages, "messages: Field required");
    }
    let max = body.get("max_tokens").and_then(Value::as_u64);
    let words = text::answer(&text::last_message(body), max);
    let input_tokens = text::count(&text::prompt(body));
    let output_tokens = words.len() as u64;
    let (id, model) = (format!("msg_mock_{n}"), model(body));
    let mut usage = json!({"input_tokens": input_tokens, "output_tokens": output_tokens});
    extra_usage(&mut usage, &model, true);
    if !streams(body) {
        return Json(json!({
            "id": id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text::answer_text(&words)}],
            "stop_reason": "end_turn", "stop_sequence": null,
            "usage": usage,
        }))
        .into_response();
    }
    // The stream's first usage: its input (and cache) counts, 1 output token.
    let mut start_usage = usage.clone();
    start_usage["output_tokens"] = json!(1);
    let ev = |name: &str, data: Value| sse(Some(name), &data.to_string());
    let mut events = vec![
        ev(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": start_usage,
            }}),
        ),
        ev(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "text", "text": ""}}),
        ),
    ];
    events.extend(text::pieces(&words).into_iter().map(|p| {
        ev(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta", "text": p}}),
        )
    }));
    events.push(ev(
        "content_block_stop",
        json!({"type": "content_block_stop", "index": 0}),
    ));
    events.push(ev(
        "message_delta",
        json!({"type": "message_delta",
               "delta": {"stop_reason": "end_turn", "stop_sequence": null},
               "usage": {"output_tokens": output_tokens}}),
    ));
    events.push(ev("message_stop", json!({"type": "message_stop"})));
    event_stream(events, pace, cut)
}

/// Standard base64 with padding (RFC 4648).
fn base64_encode(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648() {
        assert_eq!(base64_encode(b""), "");
        assert_eq!(base64_encode(b"f"), "Zg==");
        assert_eq!(base64_encode(b"fo"), "Zm8=");
        assert_eq!(base64_encode(b"foo"), "Zm9v");
        assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
    }

    #[test]
    fn paths_name_their_protocol() {
        assert_eq!(
            Protocol::of("v1/chat/completions"),
            Some(Protocol::OpenAiChat)
        );
        assert_eq!(
            Protocol::of("openai/v1/embeddings/"),
            Some(Protocol::OpenAiEmbeddings)
        );
        assert_eq!(
            Protocol::of("v1/messages"),
            Some(Protocol::AnthropicMessages)
        );
        assert_eq!(Protocol::of("v1/structured"), None);
    }
}
