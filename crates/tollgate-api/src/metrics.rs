//! A small Prometheus registry for the api role, rendered as text at `/metrics`:
//! reservations allowed/denied, refunds, job outcomes seen by the api, request
//! counts, and latency histograms per operation. Hand-rolled (a few maps under
//! one mutex) to keep dependencies lean; label values are escaped.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Debug, Default, Clone)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

#[derive(Debug, Default)]
struct Inner {
    reservations: BTreeMap<(String, &'static str), u64>,
    refunds: BTreeMap<String, u64>,
    job_outcomes: BTreeMap<(String, &'static str), u64>,
    requests: BTreeMap<(String, String, u16), u64>,
    latency: BTreeMap<String, Histogram>,
}

/// The api role's metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    pub fn new() -> Self {
        Self::default()
    }

    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        f(&mut self.inner.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A reservation attempt of `operation`: `allowed` or `denied`.
    pub fn reservation(&self, operation: &str, allowed: bool) {
        let outcome = if allowed { "allowed" } else { "denied" };
        self.with(|m| {
            *m.reservations
                .entry((operation.into(), outcome))
                .or_default() += 1
        });
    }

    /// A refund made by the api (a request that failed before a job took over).
    pub fn refund(&self, operation: &str) {
        self.with(|m| *m.refunds.entry(operation.into()).or_default() += 1);
    }

    /// The final outcome of a job the api waited for: `succeeded` or a failure cause.
    pub fn job_outcome(&self, operation: &str, outcome: &'static str) {
        self.with(|m| {
            *m.job_outcomes
                .entry((operation.into(), outcome))
                .or_default() += 1
        });
    }

    /// One request answered: its route template, method and status.
    /// Counts a request. `route` is a route template (or `unmatched`), so
    /// its values come from the route table; a method outside the standard
    /// ones counts as `other`: a client inventing methods cannot add series.
    pub fn request(&self, route: &str, method: &str, status: u16) {
        let method = method_label(method);
        self.with(|m| {
            *m.requests
                .entry((route.into(), method.into(), status))
                .or_default() += 1
        });
    }

    /// How long one call of `operation` took, end to end in the api.
    pub fn latency(&self, operation: &str, took: Duration) {
        let secs = took.as_secs_f64();
        self.with(|m| {
            let h = m.latency.entry(operation.into()).or_default();
            for (i, bound) in BUCKETS.iter().enumerate() {
                if secs <= *bound {
                    h.counts[i] += 1;
                }
            }
            h.count += 1;
            h.sum += secs;
        });
    }

    /// The Prometheus text exposition (format 0.0.4).
    pub fn render(&self) -> String {
        let m = self.with(|m| {
            (
                m.reservations.clone(),
                m.refunds.clone(),
                m.job_outcomes.clone(),
                m.requests.clone(),
                m.latency.clone(),
            )
        });
        let (reservations, refunds, outcomes, requests, latency) = m;
        let mut out = String::new();
        let _ = writeln!(out, "# HELP tollgate_reservations_total Budget reservations by operation and outcome.\n# TYPE tollgate_reservations_total counter");
        for ((op, outcome), n) in &reservations {
            let _ = writeln!(
                out,
                "tollgate_reservations_total{{operation=\"{}\",outcome=\"{outcome}\"}} {n}",
                escape(op)
            );
        }
        let _ = writeln!(out, "# HELP tollgate_refunds_total Charges of plain (jobless) routes refunded by the api because the handler failed; a job releases its own charge.\n# TYPE tollgate_refunds_total counter");
        for (op, n) in &refunds {
            let _ = writeln!(
                out,
                "tollgate_refunds_total{{operation=\"{}\"}} {n}",
                escape(op)
            );
        }
        let _ = writeln!(out, "# HELP tollgate_job_outcomes_total Final outcomes of the jobs the api waited for (succeeded, provider, throttle_timeout, expired, abandoned).\n# TYPE tollgate_job_outcomes_total counter");
        for ((op, outcome), n) in &outcomes {
            let _ = writeln!(
                out,
                "tollgate_job_outcomes_total{{operation=\"{}\",outcome=\"{outcome}\"}} {n}",
                escape(op)
            );
        }
        let _ = writeln!(out, "# HELP tollgate_http_requests_total HTTP requests by route, method and status.\n# TYPE tollgate_http_requests_total counter");
        for ((route, method, status), n) in &requests {
            let _ = writeln!(
                out,
                "tollgate_http_requests_total{{route=\"{}\",method=\"{}\",status=\"{status}\"}} {n}",
                escape(route),
                escape(method)
            );
        }
        let _ = writeln!(out, "# HELP tollgate_operation_duration_seconds Time from request to response of each operation call.\n# TYPE tollgate_operation_duration_seconds histogram");
        for (op, h) in &latency {
            let op = escape(op);
            for (bound, n) in BUCKETS.iter().zip(h.counts.iter()) {
                let _ = writeln!(
                    out,
                    "tollgate_operation_duration_seconds_bucket{{operation=\"{op}\",le=\"{bound}\"}} {n}"
                );
            }
            let _ = writeln!(
                out,
                "tollgate_operation_duration_seconds_bucket{{operation=\"{op}\",le=\"+Inf\"}} {}\ntollgate_operation_duration_seconds_sum{{operation=\"{op}\"}} {}\ntollgate_operation_duration_seconds_count{{operation=\"{op}\"}} {}",
                h.count, h.sum, h.count
            );
        }
        out
    }
}

/// The label of an HTTP method: one of a fixed set.
fn method_label(method: &str) -> &'static str {
    const KNOWN: [&str; 7] = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"];
    KNOWN.into_iter().find(|m| *m == method).unwrap_or("other")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_histograms() {
        let m = Metrics::new();
        m.reservation("llm.structured", true);
        m.reservation("llm.structured", false);
        m.refund("llm.structured");
        m.job_outcome("llm.structured", "provider");
        m.latency("llm.structured", Duration::from_millis(30));
        m.request("/v1/ops/{operation}", "POST", 200);
        let text = m.render();
        for line in [
            "tollgate_reservations_total{operation=\"llm.structured\",outcome=\"allowed\"} 1",
            "tollgate_reservations_total{operation=\"llm.structured\",outcome=\"denied\"} 1",
            "tollgate_refunds_total{operation=\"llm.structured\"} 1",
            "tollgate_job_outcomes_total{operation=\"llm.structured\",outcome=\"provider\"} 1",
            "tollgate_operation_duration_seconds_bucket{operation=\"llm.structured\",le=\"0.05\"} 1",
            "tollgate_operation_duration_seconds_bucket{operation=\"llm.structured\",le=\"0.025\"} 0",
            "tollgate_operation_duration_seconds_count{operation=\"llm.structured\"} 1",
            "tollgate_http_requests_total{route=\"/v1/ops/{operation}\",method=\"POST\",status=\"200\"} 1",
        ] {
            assert!(text.contains(line), "{line}\n{text}");
        }
        assert_eq!(escape("a\"b\\c\n"), "a\\\"b\\\\c\\n");
    }

    #[test]
    fn invented_methods_share_one_series() {
        let m = Metrics::new();
        for i in 0..100 {
            m.request("unmatched", &format!("X{i}"), 405);
        }
        m.request("unmatched", "GET", 404);
        let text = m.render();
        let series = text
            .lines()
            .filter(|l| l.starts_with("tollgate_http_requests_total{"))
            .count();
        assert_eq!(series, 2, "{text}");
        assert!(
            text.contains("method=\"other\",status=\"405\"} 100"),
            "{text}"
        );
    }
}
