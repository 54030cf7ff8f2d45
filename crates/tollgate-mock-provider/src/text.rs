//! The mock's deterministic model: an answer's words follow from the input
//! alone, each word is one token, and usage counts words, so a test can
//! predict the text and the usage of any call.

use serde_json::Value;

/// The words of the answer to `prompt`, at most `max_tokens` of them (each a
/// token): `mock answer to: ` and the prompt's words. Never empty.
pub fn answer(prompt: &str, max_tokens: Option<u64>) -> Vec<String> {
    let mut words: Vec<String> = ["mock", "answer", "to:"]
        .into_iter()
        .map(str::to_owned)
        .chain(prompt.split_whitespace().map(str::to_owned))
        .collect();
    let cap = max_tokens.map_or(usize::MAX, |m| {
        usize::try_from(m.max(1)).unwrap_or(usize::MAX)
    });
    words.truncate(cap);
    words
}

/// The tokens of `words` as a stream sends them: the first as it is, each
/// other with its leading space; joined they are [`answer_text`].
pub fn pieces(words: &[String]) -> Vec<String> {
    words
        .iter()
        .enumerate()
        .map(|(i, w)| if i == 0 { w.clone() } else { format!(" {w}") })
        .collect()
}

pub fn answer_text(words: &[String]) -> String {
    words.join(" ")
}

/// Tokens of a text: its words, at least 1.
pub fn count(text: &str) -> u64 {
    (text.split_whitespace().count() as u64).max(1)
}

/// The text of a message's `content`: a string, or the `text` of each block
/// of an array (`[{"type": "text", "text": ...}]`), space-joined.
pub fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

/// The prompt of a chat body: every message's text (and `system`'s), in order.
pub fn prompt(body: &Value) -> String {
    let system = body.get("system").map(content_text);
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|m| m.get("content").map(content_text).unwrap_or_default());
    system
        .into_iter()
        .chain(messages)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The last message's text: what the answer repeats.
pub fn last_message(body: &Value) -> String {
    body.get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.last())
        .and_then(|m| m.get("content"))
        .map(content_text)
        .unwrap_or_default()
}

/// A deterministic unit-ish vector of `dims` floats for `text` (FNV-1a
/// seeded, then a xorshift per component).
pub fn embedding(text: &str, dims: usize) -> Vec<f32> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (0..dims)
        .map(|_| {
            h ^= h << 13;
            h ^= h >> 7;
            h ^= h << 17;
            // In [-1, 1), exactly representable in f32.
            ((h >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn answers_follow_from_the_input() {
        let w = answer("say  hello world", None);
        assert_eq!(answer_text(&w), "mock answer to: say hello world");
        assert_eq!(pieces(&w).concat(), answer_text(&w));
        assert_eq!(answer("x y", Some(2)).len(), 2);
        assert_eq!(answer("", Some(0)).len(), 1);
        let body = json!({"system": "be brief", "messages": [
            {"role": "user", "content": "one two"},
            {"role": "user", "content": [{"type": "text", "text": "three"}]}]});
        assert_eq!(prompt(&body), "be brief one two three");
        assert_eq!(last_message(&body), "three");
        assert_eq!(count(&prompt(&body)), 5);
        assert_eq!(count(""), 1);
        assert_eq!(embedding("a", 4), embedding("a", 4));
        assert_ne!(embedding("a", 4), embedding("b", 4));
        assert!(embedding("a", 64).iter().all(|x| (-1.0..1.0).contains(x)));
    }
}
