//! What is not an [`Outcome`](crate::Outcome): the call could not be made,
//! or tollgate refused it as it is. Retrying the same request will not help,
//! except for [`Error::Transport`] and [`Error::Unavailable`], which the client
//! already retried until its deadline.

use std::time::Duration;

use crate::outcome::Problem;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A client setting that cannot work (a base URL without a scheme, a key
    /// or user id that is not a valid header value).
    #[error("invalid client setting: {0}")]
    Config(String),
    /// No answer (connection refused or cut, timed out) through every retry
    /// the deadline allowed.
    #[error("no answer from tollgate: {0}")]
    Transport(#[source] reqwest::Error),
    /// Missing, unknown or revoked credentials (401), a credential that may
    /// not do this (403), or too many bad keys from this address (429).
    #[error("refused credentials: {problem}")]
    Auth {
        problem: Box<Problem>,
        retry_after: Option<Duration>,
    },
    /// tollgate refused the request as it is (400, 404, 409, 413, 415, 422):
    /// a malformed body, an unknown operation or job, an Idempotency-Key
    /// reused with another body, a cost over the plan's whole budget.
    #[error("refused request: {problem}")]
    Invalid { problem: Box<Problem> },
    /// tollgate could not serve the call (503: its store unreachable, the
    /// server overloaded) through every retry the deadline allowed. The call
    /// may have been charged: resend it with the same Idempotency-Key.
    #[error("tollgate unavailable: {problem}")]
    Unavailable {
        problem: Box<Problem>,
        retry_after: Option<Duration>,
    },
    /// tollgate failed (500).
    #[error("tollgate failed: {problem}")]
    Server { problem: Box<Problem> },
    /// An answer the client does not understand (not tollgate's, or a newer
    /// one's): the status and the start of the body.
    #[error("unexpected answer: {0}")]
    Protocol(String),
}

impl Error {
    /// The problem body tollgate sent, when it sent one.
    pub fn problem(&self) -> Option<&Problem> {
        match self {
            Self::Auth { problem, .. }
            | Self::Invalid { problem }
            | Self::Unavailable { problem, .. }
            | Self::Server { problem } => Some(problem),
            Self::Config(_) | Self::Transport(_) | Self::Protocol(_) => None,
        }
    }
}
