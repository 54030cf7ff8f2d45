//! The built-in mock provider: answers in-process, for providers configured
//! without a `url` (the embedded demo and tests). Still throttled like any other.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde_json::json;
use tollgate_core::{config::Config, job::Job};

use crate::{send_check, Answer, AttemptError, AttemptOptions, Transport};

/// Echoes the job: `{"mock": true, "operation", "provider", "echo": input,
/// "usage": {"total_tokens": n}}`, where n is the input's `mock_total_tokens`
/// when it is a number, else 100 per token of the operation's estimate (its
/// `cost`), so a `settle` rule with `per = 100` settles to the estimate unless
/// the caller asks otherwise. (A job's own `cost` is what was reserved: the
/// most, for an operation that settles.) It honours `max_tokens` as an LLM
/// API does ([`honoured`]).
#[derive(Debug, Clone, Default)]
pub struct BuiltinMock {
    estimates: Arc<BTreeMap<String, u64>>,
}

impl BuiltinMock {
    /// The mock of `config`'s operations.
    pub fn new(config: &Config) -> Self {
        Self {
            estimates: Arc::new(
                config
                    .operations()
                    .map(|o| (o.name.clone(), o.cost))
                    .collect(),
            ),
        }
    }
}

#[async_trait]
impl Transport for BuiltinMock {
    /// Nothing is prepared before the send: the grant is checked, then the
    /// answer made (with a sink, passed on as one event).
    async fn attempt(&self, job: &Job, opts: AttemptOptions<'_>) -> Result<Answer, AttemptError> {
        send_check(opts.use_by)?;
        let estimate = self
            .estimates
            .get(&job.operation)
            .copied()
            .unwrap_or(job.cost);
        let asked = job.input["mock_total_tokens"]
            .as_u64()
            .unwrap_or(estimate.saturating_mul(100));
        let tokens = honoured(asked, &job.input);
        let body = json!({
            "mock": true,
            "operation": job.operation,
            "provider": job.provider,
            "echo": job.input,
            "usage": { "total_tokens": tokens },
        });
        opts.whole(body).await
    }
}

/// The tokens a call that would use `asked` reports when its input sets a
/// whole-number `max_tokens`: its prompt (the bytes of the input's `prompt`
/// text, at most `asked`) and at most `max_tokens` of the rest, as an LLM API
/// never writes more output than `max_tokens`.
fn honoured(asked: u64, input: &serde_json::Value) -> u64 {
    let Some(max) = input["max_tokens"].as_u64() else {
        return asked;
    };
    let prompt = input["prompt"]
        .as_str()
        .map_or(0, |p| p.len() as u64)
        .min(asked);
    prompt + (asked - prompt).min(max)
}

#[cfg(test)]
mod tests {
    use super::honoured;
    use serde_json::json;

    #[test]
    fn the_mock_honours_max_tokens() {
        assert_eq!(honoured(800, &json!({})), 800);
        assert_eq!(honoured(800, &json!({"max_tokens": 5})), 5);
        assert_eq!(honoured(800, &json!({"max_tokens": 0, "prompt": "abc"})), 3);
        assert_eq!(honoured(2, &json!({"max_tokens": 0, "prompt": "abc"})), 2);
        assert_eq!(honoured(800, &json!({"max_tokens": 900})), 800);
    }
}
