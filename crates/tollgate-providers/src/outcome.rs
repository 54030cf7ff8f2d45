//! The outcome policy, written once: every attempt at an upstream call is
//! classed by what the upstream could have done with it ([`Class`]), and the
//! class alone decides whether the attempt is tried again and, when the call
//! fails for good, what becomes of the job's charge ([`Tally::failure`]).
//!
//! | class | may have worked | charge | retry |
//! |---|---|---|---|
//! | never sent (no connection, a stale grant) | no | released | free |
//! | refused (429, 503, other 4xx) | no | released | 429/503 within `retries` |
//! | input rejected (400, 413, 414, 415, 422) | no | released | no: the client's input must change |
//! | unanswered (sent, no whole answer) | yes | **stands** | only with `retry_unanswered` |
//! | answered 2xx, body not JSON | yes | **stands** | no |
//! | answered 5xx (but 503) | maybe | released, **absorbed** | within `retries` |
//!
//! When in doubt whether a request left, it may have: only an error that
//! proves nothing was written (no connection was made, our own stale-grant
//! check) is [`Class::NeverSent`].

use tollgate_core::job::{Charge, FailureCause};

use crate::AttemptError;

/// What one attempt could have made the upstream do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Nothing reached the upstream.
    NeverSent,
    /// The upstream refused before doing work; `overload` (429, 503): it may
    /// take the request a moment later. Other refusals (401, 403, 404, ...)
    /// are the operator's misconfiguration, not the client's: 502.
    Refused { overload: bool },
    /// The upstream rejected the input (400, 413, 414, 415, 422): no work
    /// done, and the same input would be rejected again.
    Rejected,
    /// Sent, and no whole answer came back: it may have done the work.
    Unanswered,
    /// Answered 2xx, with a body that is not JSON: it did the work.
    BadAnswer,
    /// Answered 5xx (but 503): it may have worked, and failed.
    ServerError,
}

/// The reason an absorbed 5xx is counted under (`tollgate_absorbed_calls_total`).
pub const SERVER_ERROR: &str = "server_error";

impl Class {
    /// The class of a failed attempt (`None`: a stale grant, which is no attempt).
    pub fn of(e: &AttemptError) -> Option<Self> {
        Some(match e {
            AttemptError::Late { .. } => return None,
            AttemptError::NotSent { .. } => Self::NeverSent,
            AttemptError::Unanswered { .. } => Self::Unanswered,
            AttemptError::BadBody { .. } => Self::BadAnswer,
            AttemptError::Status { status, .. } => match status {
                429 | 503 => Self::Refused { overload: true },
                400 | 413 | 414 | 415 | 422 => Self::Rejected,
                500..=599 => Self::ServerError,
                _ => Self::Refused { overload: false },
            },
        })
    }

    /// Whether another attempt may follow this one (within `retries`).
    pub fn retry(self, retry_unanswered: bool) -> bool {
        match self {
            Self::NeverSent | Self::ServerError | Self::Refused { overload: true } => true,
            Self::Unanswered => retry_unanswered,
            Self::Refused { overload: false } | Self::Rejected | Self::BadAnswer => false,
        }
    }
}

/// What the attempts of one call came to, for the charge: one charge covers
/// every attempt, so the attempt that may have done the most work decides.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    answered: bool,
    unanswered: bool,
    absorbed: Option<&'static str>,
}

impl Tally {
    pub fn record(&mut self, class: Class) {
        match class {
            Class::BadAnswer => self.answered = true,
            Class::Unanswered => self.unanswered = true,
            Class::ServerError => self.absorbed = Some(SERVER_ERROR),
            Class::NeverSent | Class::Refused { .. } | Class::Rejected => {}
        }
    }

    /// The job's cause and charge when the call fails for good, `cause` being
    /// what the last step alone would say: an upstream that may have done the
    /// work keeps the charge; otherwise it is released, absorbed when a 5xx
    /// came back on the way.
    pub fn failure(&self, cause: FailureCause) -> (FailureCause, Charge) {
        if self.answered {
            (FailureCause::BadResponse, Charge::Keep)
        } else if self.unanswered {
            (FailureCause::Unanswered, Charge::Keep)
        } else {
            (
                cause,
                Charge::Release {
                    absorbed: self.absorbed,
                },
            )
        }
    }
}

/// The failure of a run after an earlier run that started and was lost
/// ([`Lease::ran_before`](tollgate_core::job::Lease::ran_before)): that run
/// may have made the upstream work, so the charge stands whatever this one
/// came to.
pub fn after_lost_run(cause: FailureCause, charge: Charge) -> (FailureCause, Charge) {
    match charge {
        Charge::Keep => (cause, charge),
        Charge::Release { .. } => (FailureCause::Unanswered, Charge::Keep),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(s: u16) -> AttemptError {
        AttemptError::Status {
            status: s,
            retry_after: None,
            message: String::new(),
        }
    }

    #[test]
    fn classes_follow_what_the_upstream_could_have_done() {
        let c = |e: AttemptError| Class::of(&e).unwrap();
        assert_eq!(c(status(429)), Class::Refused { overload: true });
        assert_eq!(c(status(503)), Class::Refused { overload: true });
        for s in [400, 413, 414, 415, 422] {
            assert_eq!(c(status(s)), Class::Rejected, "{s}");
        }
        for s in [401, 403, 404, 405, 409] {
            assert_eq!(c(status(s)), Class::Refused { overload: false }, "{s}");
        }
        assert!(!Class::Rejected.retry(true));
        assert_eq!(c(status(500)), Class::ServerError);
        assert_eq!(c(status(504)), Class::ServerError);
        let unsent = AttemptError::NotSent {
            message: String::new(),
        };
        assert_eq!(c(unsent), Class::NeverSent);
        assert!(!Class::Unanswered.retry(false));
        assert!(Class::Unanswered.retry(true));
        assert!(!Class::BadAnswer.retry(true));
        assert!(!Class::Refused { overload: false }.retry(true));
    }

    #[test]
    fn the_attempt_that_may_have_done_the_most_decides_the_charge() {
        let mut t = Tally::default();
        t.record(Class::Refused { overload: true });
        assert_eq!(
            t.failure(FailureCause::Provider),
            (FailureCause::Provider, Charge::RELEASE)
        );
        t.record(Class::ServerError);
        assert_eq!(
            t.failure(FailureCause::ThrottleTimeout),
            (
                FailureCause::ThrottleTimeout,
                Charge::Release {
                    absorbed: Some(SERVER_ERROR)
                }
            )
        );
        t.record(Class::Unanswered);
        assert_eq!(
            t.failure(FailureCause::Provider),
            (FailureCause::Unanswered, Charge::Keep)
        );
        let mut t = Tally::default();
        t.record(Class::BadAnswer);
        assert_eq!(
            t.failure(FailureCause::Provider),
            (FailureCause::BadResponse, Charge::Keep)
        );
    }

    #[test]
    fn a_run_after_a_lost_started_one_keeps_the_charge() {
        let absorbed = Charge::Release {
            absorbed: Some(SERVER_ERROR),
        };
        for (cause, charge) in [
            (FailureCause::Provider, Charge::RELEASE),
            (FailureCause::ThrottleTimeout, Charge::RELEASE),
            (FailureCause::Expired, Charge::RELEASE),
            (FailureCause::Provider, absorbed),
        ] {
            assert_eq!(
                after_lost_run(cause, charge),
                (FailureCause::Unanswered, Charge::Keep)
            );
        }
        assert_eq!(
            after_lost_run(FailureCause::BadResponse, Charge::Keep),
            (FailureCause::BadResponse, Charge::Keep)
        );
    }
}
