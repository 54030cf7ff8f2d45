//! One HTTP answer read into what the call does next: [`Step`]. The rules for
//! which answers are retried with the same Idempotency-Key live here, and
//! only here (docs/src/clients.md has them as a table):
//!
//! - a transport error, or any `503` (tollgate's store unreachable, the
//!   server overloaded, a job abandoned): retry, after `Retry-After` when
//!   given. The call may have been charged; the same key finds its job.
//! - a `502`/`504` whose problem says `"charged": false`: the job failed and
//!   its charge was released, so its key is free again: retry (a new attempt,
//!   charged and run again). `"charged": true` (the upstream may have done the
//!   work) is final: a retry with that key would only repeat the failure.
//! - a `502`/`503`/`504` that is not a problem body: a proxy's, the request
//!   may not have reached tollgate: retry.
//! - everything else is final; a budget `429` too, unless the policy waits
//!   for budget.

use std::time::Duration;

use reqwest::header::HeaderMap;
use serde::Deserialize;
use serde_json::Value;

use crate::error::Error;
use crate::outcome::{Done, Failure, Outcome, Pending, Problem, Window};

/// What to do after one answer.
#[derive(Debug)]
pub(crate) enum Step {
    /// The call's end.
    Final(Result<Outcome, Error>),
    /// Retry with the same key after `hint` (the server's) or a backoff;
    /// `otherwise` is the end if no retry is left.
    Retry {
        hint: Option<Duration>,
        otherwise: Result<Outcome, Error>,
    },
}

/// A job as `POST /v1/ops/..` (200/202) and `GET /v1/jobs/{id}` show it.
#[derive(Debug, Deserialize)]
pub(crate) struct JobView {
    pub job_id: String,
    #[serde(default)]
    pub operation: String,
    pub status: String,
    pub provider_queue: Option<Value>,
    pub result: Option<Value>,
    pub error: Option<JobErrorView>,
    #[serde(default, deserialize_with = "crate::amount::minor")]
    pub cost: u64,
    /// Money: its ISO 4217 code (absent: tokens).
    #[serde(default)]
    pub currency: Option<String>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct JobErrorView {
    pub cause: String,
    #[serde(default)]
    pub message: String,
    pub charged: Option<bool>,
    pub upstream_status: Option<u16>,
    pub upstream_body: Option<Value>,
}

/// The status an operation call answers a job that failed with `cause`.
fn cause_status(cause: &str) -> u16 {
    match cause {
        "unanswered" | "throttle_timeout" | "expired" => 504,
        "abandoned" => 503,
        _ => 502,
    }
}

impl JobView {
    /// The job as an outcome: `Pending` unless it is final.
    pub(crate) fn outcome(self) -> Outcome {
        match (self.status.as_str(), self.error) {
            ("succeeded", _) => Outcome::Done(Done {
                job_id: self.job_id,
                operation: self.operation,
                result: self.result.unwrap_or(Value::Null),
                cost: self.cost,
                currency: self.currency.unwrap_or_else(|| "tokens".into()),
                attempts: 0,
            }),
            ("failed", Some(e)) => {
                if let Some(upstream_status) = e.upstream_status {
                    return Outcome::Rejected {
                        upstream_status,
                        detail: Some(e.message),
                        body: e.upstream_body,
                        job_id: Some(self.job_id),
                    };
                }
                if e.cause == "throttle_timeout" {
                    return Outcome::ProviderBusy {
                        retry_after: Duration::ZERO,
                        job_id: Some(self.job_id),
                        detail: Some(e.message),
                    };
                }
                Outcome::Failed(Failure {
                    status: cause_status(&e.cause),
                    kind: e.cause.replace('_', "-"),
                    cause: Some(e.cause),
                    charged: e.charged,
                    job_id: Some(self.job_id),
                    detail: Some(e.message),
                    attempts: 0,
                })
            }
            _ => Outcome::Pending(Pending {
                job_id: self.job_id,
                status: self.status,
                provider_queue: self.provider_queue,
                attempts: 0,
            }),
        }
    }
}

/// `Retry-After` in seconds (tollgate never sends the date form).
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

/// The plan's windows from `RateLimit-Policy` (`"budget";q=1000;w=43200, ...`)
/// and the state of one of them from `RateLimit` (`"budget";r=4;t=17`).
pub(crate) fn windows(headers: &HeaderMap) -> Vec<Window> {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let items = |s: &str| -> Vec<(String, Vec<(String, u64)>)> {
        s.split(',')
            .filter_map(|item| {
                let mut parts = item.split(';');
                let name = parts.next()?.trim().trim_matches('"').to_owned();
                if name.is_empty() {
                    return None;
                }
                let params = parts
                    .filter_map(|p| {
                        let (k, v) = p.split_once('=')?;
                        Some((k.trim().to_owned(), v.trim().parse().ok()?))
                    })
                    .collect();
                Some((name, params))
            })
            .collect()
    };
    let param = |ps: &[(String, u64)], k: &str| ps.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
    let state = items(&text("ratelimit"));
    items(&text("ratelimit-policy"))
        .into_iter()
        .filter_map(|(policy, ps)| {
            let now = state.iter().find(|(n, _)| *n == policy).map(|(_, s)| s);
            Some(Window {
                limit: param(&ps, "q")?,
                window: Duration::from_secs(param(&ps, "w")?),
                remaining: now.and_then(|s| param(s, "r")),
                reset_after: now.and_then(|s| param(s, "t")).map(Duration::from_secs),
                policy,
            })
        })
        .collect()
}

fn protocol(status: u16, body: &[u8]) -> Error {
    let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
    Error::Protocol(format!("HTTP {status}: {text}"))
}

/// Reads the answer to an operation call (or a job's status, `job_read`).
pub(crate) fn classify(status: u16, headers: &HeaderMap, body: &[u8], job_read: bool) -> Step {
    if status == 200 || status == 202 {
        return Step::Final(match serde_json::from_slice::<JobView>(body) {
            Ok(view) if status == 202 || job_read || view.status == "succeeded" => {
                Ok(view.outcome())
            }
            _ => Err(protocol(status, body)),
        });
    }
    let problem = serde_json::from_slice::<Problem>(body)
        .ok()
        .filter(|p| !p.kind.is_empty());
    let Some(problem) = problem else {
        // Not tollgate's answer: a proxy's gateway error or unavailability
        // means the request may not have arrived. Retrying is safe with the key.
        return match status {
            502..=504 => Step::Retry {
                hint: retry_after(headers),
                otherwise: Err(protocol(status, body)),
            },
            _ => Step::Final(Err(protocol(status, body))),
        };
    };
    let hint = retry_after(headers);
    match (status, problem.slug()) {
        (429, "quota-exceeded") => Step::Final(Ok(Outcome::BudgetExhausted {
            // Exact when given; else Retry-After, rounded up to seconds.
            retry_after: problem
                .retry_after_ms
                .map(Duration::from_millis)
                .or(hint)
                .unwrap_or_default(),
            windows: windows(headers),
            detail: problem.detail,
        })),
        (429, "stored-bytes-exceeded") => Step::Final(Ok(Outcome::StoredBytesExceeded {
            stored_bytes: problem.stored_bytes.unwrap_or_default(),
            max_stored_bytes: problem.max_stored_bytes.unwrap_or_default(),
        })),
        (401 | 403 | 429, _) => Step::Final(Err(Error::Auth {
            problem: Box::new(problem),
            retry_after: hint,
        })),
        (_, "upstream-rejected") => Step::Final(Ok(Outcome::Rejected {
            upstream_status: problem.upstream_status.unwrap_or(status),
            detail: problem.detail,
            body: problem.upstream_body,
            job_id: problem.job_id,
        })),
        (503, _) => Step::Retry {
            hint: Some(hint.unwrap_or(Duration::from_secs(1))),
            otherwise: Err(Error::Unavailable {
                problem: Box::new(problem),
                retry_after: hint,
            }),
        },
        (502 | 504, _) => {
            let released = problem.charged == Some(false);
            let end = if problem.slug() == "throttle-timeout" {
                Outcome::ProviderBusy {
                    retry_after: hint.unwrap_or_default(),
                    job_id: problem.job_id,
                    detail: problem.detail,
                }
            } else {
                failed(status, problem)
            };
            if released {
                Step::Retry {
                    hint,
                    otherwise: Ok(end),
                }
            } else {
                Step::Final(Ok(end))
            }
        }
        (410, _) => Step::Final(Ok(failed(status, problem))),
        (500..=599, _) => Step::Final(Err(Error::Server {
            problem: Box::new(problem),
        })),
        _ => Step::Final(Err(Error::Invalid {
            problem: Box::new(problem),
        })),
    }
}

fn failed(status: u16, p: Problem) -> Outcome {
    Outcome::Failed(Failure {
        status,
        kind: p.slug().to_owned(),
        cause: p.cause,
        charged: p.charged,
        job_id: p.job_id,
        detail: p.detail,
        attempts: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap_or_else(|_| panic!("{v}")));
        }
        h
    }

    fn problem(status: u16, slug: &str, extra: Value) -> Vec<u8> {
        let mut p = json!({"type": format!("/problems/{slug}"), "title": "t", "status": status});
        if let (Some(p), Some(e)) = (p.as_object_mut(), extra.as_object()) {
            p.extend(e.clone());
        }
        p.to_string().into_bytes()
    }

    #[test]
    fn a_budget_429_is_final_with_the_exact_retry_after_and_every_window() {
        let h = headers(&[
            ("retry-after", "17"),
            (
                "ratelimit-policy",
                "\"budget-12h\";q=1000;w=43200, \"budget-1m\";q=100;w=60",
            ),
            ("ratelimit", "\"budget-1m\";r=4;t=17"),
        ]);
        let body = problem(429, "quota-exceeded", json!({"retry_after_ms": 16_001}));
        let Step::Final(Ok(Outcome::BudgetExhausted {
            retry_after,
            windows,
            ..
        })) = classify(429, &h, &body, false)
        else {
            panic!("not final BudgetExhausted")
        };
        assert_eq!(retry_after, Duration::from_millis(16_001));
        assert_eq!(windows.len(), 2);
        assert_eq!(windows[0].limit, 1000);
        assert_eq!(windows[0].window, Duration::from_secs(43_200));
        assert_eq!(windows[0].remaining, None);
        assert_eq!(windows[1].policy, "budget-1m");
        assert_eq!(windows[1].remaining, Some(4));
        assert_eq!(windows[1].reset_after, Some(Duration::from_secs(17)));
    }

    #[test]
    fn which_answers_are_retried() {
        let none = HeaderMap::new();
        let retried = |status, body: &[u8]| {
            matches!(classify(status, &none, body, false), Step::Retry { .. })
        };
        assert!(retried(
            503,
            &problem(503, "backend-unavailable", json!({}))
        ));
        assert!(retried(503, &problem(503, "overloaded", json!({}))));
        assert!(retried(
            502,
            &problem(502, "provider-failure", json!({"charged": false}))
        ));
        assert!(retried(
            504,
            &problem(504, "throttle-timeout", json!({"charged": false}))
        ));
        assert!(!retried(
            504,
            &problem(504, "upstream-unanswered", json!({"charged": true}))
        ));
        assert!(!retried(
            502,
            &problem(502, "bad-upstream-response", json!({"charged": true}))
        ));
        assert!(!retried(502, &problem(502, "provider-failure", json!({}))));
        assert!(retried(502, b"<html>bad gateway</html>"));
        assert!(!retried(429, &problem(429, "quota-exceeded", json!({}))));
        assert!(!retried(422, &problem(422, "upstream-rejected", json!({}))));
        assert!(!retried(500, &problem(500, "internal", json!({}))));
        assert!(!retried(401, &problem(401, "unauthorized", json!({}))));
    }

    #[test]
    fn a_503_waits_at_least_its_retry_after() {
        let h = headers(&[("retry-after", "3")]);
        let Step::Retry { hint, otherwise } =
            classify(503, &h, &problem(503, "overloaded", json!({})), false)
        else {
            panic!("a 503 is retried")
        };
        assert_eq!(hint, Some(Duration::from_secs(3)));
        assert!(matches!(otherwise, Err(Error::Unavailable { .. })));
    }

    #[test]
    fn an_upstream_rejection_is_typed() {
        let body = problem(
            422,
            "upstream-rejected",
            json!({"upstream_status": 400, "detail": "rejected", "upstream_body": {"error": "bad"}, "job_id": "j"}),
        );
        let Step::Final(Ok(Outcome::Rejected {
            upstream_status,
            body,
            job_id,
            ..
        })) = classify(422, &HeaderMap::new(), &body, false)
        else {
            panic!("not Rejected")
        };
        assert_eq!(upstream_status, 400);
        assert_eq!(body, Some(json!({"error": "bad"})));
        assert_eq!(job_id.as_deref(), Some("j"));
    }

    #[test]
    fn jobs_read_back_as_outcomes() {
        let view = |v: Value| classify(200, &HeaderMap::new(), v.to_string().as_bytes(), true);
        let Step::Final(Ok(Outcome::Pending(p))) = view(json!({"job_id": "a", "operation": "o",
            "status": "waiting_for_provider", "provider_queue": {"position": 2}, "cost": 8,
            "enqueued_at": "x"}))
        else {
            panic!("pending")
        };
        assert_eq!(p.status, "waiting_for_provider");
        let Step::Final(Ok(Outcome::Failed(f))) = view(json!({"job_id": "a", "operation": "o",
            "status": "failed", "error": {"cause": "unanswered", "message": "m", "charged": true},
            "cost": 8, "enqueued_at": "x"}))
        else {
            panic!("failed")
        };
        assert_eq!((f.status, f.charged), (504, Some(true)));
        let Step::Final(Ok(Outcome::ProviderBusy { .. })) = view(json!({"job_id": "a",
            "operation": "o", "status": "failed", "error": {"cause": "throttle_timeout",
            "message": "m", "charged": false}, "cost": 8, "enqueued_at": "x"}))
        else {
            panic!("busy")
        };
    }
}
