//! The built-in mock provider: answers in-process, for providers configured
//! without a `url` (the embedded demo and tests). Still throttled like any other.

use async_trait::async_trait;
use serde_json::{json, Value};
use tollgate_core::job::Job;

use crate::{AttemptError, Transport};

/// Echoes the job: `{"mock": true, "operation", "provider", "echo": input,
/// "usage": {"total_tokens": n}}`, where n is the input's `mock_total_tokens`
/// when it is a number, else 100 per token of the job's cost (so a `settle`
/// rule with `per = 100` keeps the estimate unless the caller asks otherwise).
#[derive(Debug, Clone, Copy, Default)]
pub struct BuiltinMock;

#[async_trait]
impl Transport for BuiltinMock {
    async fn attempt(&self, job: &Job) -> Result<Value, AttemptError> {
        let tokens = job.input["mock_total_tokens"]
            .as_u64()
            .unwrap_or(job.cost.saturating_mul(100));
        Ok(json!({
            "mock": true,
            "operation": job.operation,
            "provider": job.provider,
            "echo": job.input,
            "usage": { "total_tokens": tokens },
        }))
    }
}
