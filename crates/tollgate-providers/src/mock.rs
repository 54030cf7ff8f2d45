//! The built-in mock provider: answers in-process, for providers configured
//! without a `url` (the embedded demo and tests). Still throttled like any other.

use async_trait::async_trait;
use serde_json::{json, Value};
use tollgate_core::job::Job;

use crate::{AttemptError, Transport};

/// Echoes the job: `{"mock": true, "operation", "provider", "echo": input}`.
#[derive(Debug, Clone, Copy, Default)]
pub struct BuiltinMock;

#[async_trait]
impl Transport for BuiltinMock {
    async fn attempt(&self, job: &Job) -> Result<Value, AttemptError> {
        Ok(json!({
            "mock": true,
            "operation": job.operation,
            "provider": job.provider,
            "echo": job.input,
        }))
    }
}
