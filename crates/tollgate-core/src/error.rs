//! [`StoreError`]: the one failure of a backing store (Redis, or the in-memory
//! backend), shared by every backend trait's error type.
//!
//! **Transient** means one thing everywhere: the same call, sent again later
//! unchanged, may succeed (the store was unreachable, restarting, or timed out).
//! A failure that is not transient (the store answered something unexpected)
//! will not go away by retrying. Each layer's error keeps its source, so a log
//! line shows the whole chain.

use std::error::Error;
use std::fmt;
use std::sync::Arc;

/// A failure of the store behind a ledger, job queue, throttle or key store.
#[derive(Clone)]
pub struct StoreError {
    message: String,
    transient: bool,
    source: Option<Arc<dyn Error + Send + Sync>>,
}

impl StoreError {
    /// The store cannot be reached now, or answers "not now": retrying later
    /// may succeed.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            transient: true,
            source: None,
        }
    }

    /// The store answered something unexpected: retrying will not help.
    pub fn backend(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            transient: false,
            source: None,
        }
    }

    /// Keeps `source` as the cause of this error.
    pub fn with_source(mut self, source: impl Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// Worth retrying: the same call may succeed later.
    pub fn is_transient(&self) -> bool {
        self.transient
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreError")
            .field("message", &self.message)
            .field("transient", &self.transient)
            .field("source", &self.source.as_ref().map(|s| s.to_string()))
            .finish()
    }
}

impl Error for StoreError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source.as_deref().map(|s| s as &(dyn Error + 'static))
    }
}

/// Two store errors are equal when they say the same thing (their sources
/// are not compared).
impl PartialEq for StoreError {
    fn eq(&self, other: &Self) -> bool {
        self.transient == other.transient && self.message == other.message
    }
}

impl Eq for StoreError {}
