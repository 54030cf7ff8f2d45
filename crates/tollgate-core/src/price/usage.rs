//! [`Usage`]: what one call used, read from its answer in the provider's own
//! words, each token counted once.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::money::MAX_AMOUNT;

/// What one call used, each token in exactly one field: the sum of the five
/// token fields is every token the call was billed for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    /// Input tokens neither read from nor written to a prompt cache.
    pub input: u64,
    /// Input tokens read from a prompt cache.
    pub cached_input: u64,
    /// Input tokens written to a prompt cache (Anthropic's cache creation).
    pub cache_write: u64,
    /// Output tokens that are not reasoning.
    pub output: u64,
    /// Reasoning ("thinking") output tokens, when reported apart.
    pub reasoning: u64,
    /// The count at each unit pointer (a JSON pointer into the whole answer);
    /// a pointer with nothing there counts 0.
    pub units: BTreeMap<String, u64>,
}

impl Usage {
    /// Reads `answer["usage"]` and the counts at `unit_pointers`.
    ///
    /// The format is told by the field names present:
    /// - `prompt_tokens`: OpenAI Chat Completions (or embeddings, with no
    ///   `completion_tokens`: output 0). `prompt_tokens` includes
    ///   `prompt_tokens_details.cached_tokens`, `completion_tokens` includes
    ///   `completion_tokens_details.reasoning_tokens`: both are subtracted.
    /// - else `cache_read_input_tokens` or `cache_creation_input_tokens`:
    ///   Anthropic, whose `input_tokens` excludes both (they add up).
    /// - else `input_tokens` or `output_tokens`: OpenAI's Responses API, whose
    ///   `input_tokens` includes `input_tokens_details.cached_tokens` and
    ///   `output_tokens` includes `output_tokens_details.reasoning_tokens`.
    ///   Without the details (Anthropic without caching, others) the same
    ///   arithmetic subtracts nothing.
    ///
    /// A part reported larger than its whole (cached > prompt, reasoning >
    /// completion) is inconsistent: the part is taken to be the whole, so the
    /// call is charged the whole at the part's price and no token twice.
    ///
    /// `None` (the call is then charged its reservation) when there is no
    /// `usage` object with one of those fields, or when any count read is not
    /// a whole number in `0..=MAX_AMOUNT` (fractions, negatives, strings and
    /// absurd values are all "unreported"). `null` counts as absent.
    pub fn from_answer<'a>(
        answer: &Value,
        unit_pointers: impl IntoIterator<Item = &'a str>,
    ) -> Option<Self> {
        let usage = answer.get("usage")?.as_object()?;
        let has = |k: &str| usage.get(k).is_some_and(|v| !v.is_null());
        let mut u = if has("prompt_tokens") {
            Self::inclusive(
                usage,
                ["prompt_tokens", "prompt_tokens_details"],
                ["completion_tokens", "completion_tokens_details"],
            )?
        } else if has("cache_read_input_tokens") || has("cache_creation_input_tokens") {
            Self {
                input: count(usage.get("input_tokens"))?,
                cached_input: count(usage.get("cache_read_input_tokens"))?,
                cache_write: count(usage.get("cache_creation_input_tokens"))?,
                output: count(usage.get("output_tokens"))?,
                ..Self::default()
            }
        } else if has("input_tokens") || has("output_tokens") {
            Self::inclusive(
                usage,
                ["input_tokens", "input_tokens_details"],
                ["output_tokens", "output_tokens_details"],
            )?
        } else {
            return None;
        };
        u.units = units(answer, unit_pointers)?;
        Some(u)
    }

    /// OpenAI's counts, `[whole, its details object]` for the input and the
    /// output: the input includes its `cached_tokens` and the output its
    /// `reasoning_tokens`, each split off its whole.
    fn inclusive(
        usage: &Map<String, Value>,
        [input, input_details]: [&str; 2],
        [output, output_details]: [&str; 2],
    ) -> Option<Self> {
        let (input, cached_input) = split(
            count(usage.get(input))?,
            count(detail(usage, input_details, "cached_tokens"))?,
        );
        let (output, reasoning) = split(
            count(usage.get(output))?,
            count(detail(usage, output_details, "reasoning_tokens"))?,
        );
        Some(Self {
            input,
            cached_input,
            output,
            reasoning,
            ..Self::default()
        })
    }

    /// Only the counts at `unit_pointers` (every token field 0): the usage of
    /// a call priced by request and units alone, whose answer need not report
    /// tokens. `None` when a count there is not a whole number in
    /// `0..=MAX_AMOUNT`.
    pub fn units_only<'a>(
        answer: &Value,
        unit_pointers: impl IntoIterator<Item = &'a str>,
    ) -> Option<Self> {
        Some(Self {
            units: units(answer, unit_pointers)?,
            ..Self::default()
        })
    }
}

fn units<'a>(
    answer: &Value,
    pointers: impl IntoIterator<Item = &'a str>,
) -> Option<BTreeMap<String, u64>> {
    pointers
        .into_iter()
        .map(|p| Some((p.to_owned(), count(answer.pointer(p))?)))
        .collect()
}

/// `whole` split into (the rest, `part`), the part at most the whole.
fn split(whole: u64, part: u64) -> (u64, u64) {
    let part = part.min(whole);
    (whole - part, part)
}

fn detail<'a>(usage: &'a Map<String, Value>, object: &str, field: &str) -> Option<&'a Value> {
    usage.get(object)?.get(field)
}

/// A count: absent or `null` is 0; a whole number up to [`MAX_AMOUNT`] is
/// itself; anything else is `None` (not a count).
fn count(v: Option<&Value>) -> Option<u64> {
    match v {
        None | Some(Value::Null) => Some(0),
        Some(v) => v.as_u64().filter(|n| *n <= MAX_AMOUNT),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(answer: Value) -> Option<Usage> {
        Usage::from_answer(&answer, [])
    }

    fn tokens(input: u64, cached: u64, write: u64, output: u64, reasoning: u64) -> Option<Usage> {
        Some(Usage {
            input,
            cached_input: cached,
            cache_write: write,
            output,
            reasoning,
            units: BTreeMap::new(),
        })
    }

    #[test]
    fn chat_completions_include_cached_and_reasoning() {
        let u = read(json!({"usage": {
            "prompt_tokens": 1234, "completion_tokens": 567, "total_tokens": 1801,
            "prompt_tokens_details": {"cached_tokens": 1000, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 100}
        }}));
        assert_eq!(u, tokens(234, 1000, 0, 467, 100));
        // No details (older models, compatible servers): nothing subtracted.
        let u = read(
            json!({"usage": {"prompt_tokens": 10, "completion_tokens": 5,
            "prompt_tokens_details": null}}),
        );
        assert_eq!(u, tokens(10, 0, 0, 5, 0));
    }

    #[test]
    fn embeddings_have_no_output() {
        let u = read(json!({"usage": {"prompt_tokens": 8, "total_tokens": 8}}));
        assert_eq!(u, tokens(8, 0, 0, 0, 0));
    }

    #[test]
    fn anthropic_cache_tokens_add_up() {
        let u = read(json!({"usage": {
            "input_tokens": 50, "cache_read_input_tokens": 10000,
            "cache_creation_input_tokens": 2000, "output_tokens": 300
        }}));
        assert_eq!(u, tokens(50, 10000, 2000, 300, 0));
        let u = read(
            json!({"usage": {"input_tokens": 5, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": null, "output_tokens": 1}}),
        );
        assert_eq!(u, tokens(5, 0, 0, 1, 0));
    }

    #[test]
    fn responses_api_includes_cached_and_reasoning() {
        let u = read(json!({"usage": {
            "input_tokens": 2000, "input_tokens_details": {"cached_tokens": 1500},
            "output_tokens": 800, "output_tokens_details": {"reasoning_tokens": 300},
            "total_tokens": 2800
        }}));
        assert_eq!(u, tokens(500, 1500, 0, 500, 300));
        // Plain input/output (Anthropic without caching): the same arithmetic.
        let u = read(json!({"usage": {"input_tokens": 12, "output_tokens": 7}}));
        assert_eq!(u, tokens(12, 0, 0, 7, 0));
    }

    #[test]
    fn a_part_larger_than_its_whole_is_the_whole() {
        let u = read(
            json!({"usage": {"prompt_tokens": 100, "completion_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 150},
            "completion_tokens_details": {"reasoning_tokens": 11}}}),
        );
        assert_eq!(u, tokens(0, 100, 0, 0, 10));
        let u = read(json!({"usage": {"input_tokens": 3,
            "input_tokens_details": {"cached_tokens": 9}}}));
        assert_eq!(u, tokens(0, 3, 0, 0, 0));
    }

    #[test]
    fn unreported_or_unreadable_usage_is_none() {
        for answer in [
            json!({}),
            json!({"usage": null}),
            json!({"usage": "lots"}),
            json!({"usage": {}}),
            json!({"usage": {"total_tokens": 9}}),
            json!({"usage": {"prompt_tokens": -1}}),
            json!({"usage": {"prompt_tokens": 1.5}}),
            json!({"usage": {"prompt_tokens": "12"}}),
            json!({"usage": {"prompt_tokens": 9_007_199_254_740_992u64}}),
            json!({"usage": {"prompt_tokens": 1, "completion_tokens": 1e300}}),
            json!({"usage": {"input_tokens": 1, "cache_read_input_tokens": -4}}),
            json!({"usage": {"input_tokens": 1,
                "input_tokens_details": {"cached_tokens": true}}}),
            json!([1, 2]),
        ] {
            assert_eq!(read(answer.clone()), None, "{answer}");
        }
        let max = json!({"usage": {"prompt_tokens": MAX_AMOUNT}});
        assert_eq!(read(max), tokens(MAX_AMOUNT, 0, 0, 0, 0));
    }

    #[test]
    fn units_are_read_anywhere_in_the_answer() {
        let answer = json!({
            "usage": {"input_tokens": 1, "output_tokens": 2,
                "server_tool_use": {"web_search_requests": 3}},
            "results": [1, 2]
        });
        let u = Usage::from_answer(
            &answer,
            [
                "/usage/server_tool_use/web_search_requests",
                "/usage/missing",
            ],
        )
        .unwrap();
        assert_eq!(u.units["/usage/server_tool_use/web_search_requests"], 3);
        assert_eq!(u.units["/usage/missing"], 0, "nothing there counts 0");
        assert_eq!(
            Usage::from_answer(&answer, ["/results"]),
            None,
            "not a count"
        );
        // No token report: from_answer has nothing, units_only has the units.
        let answer = json!({"meta": {"results": 7}});
        assert_eq!(Usage::from_answer(&answer, ["/meta/results"]), None);
        let u = Usage::units_only(&answer, ["/meta/results"]).unwrap();
        assert_eq!((u.input, u.output, u.units["/meta/results"]), (0, 0, 7));
        assert_eq!(Usage::units_only(&json!({"n": -1}), ["/n"]), None);
    }
}
