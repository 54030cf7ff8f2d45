//! Percentiles of measured durations.

use std::time::Duration;

/// Sorted samples with percentile lookups.
#[derive(Debug)]
pub struct Samples(Vec<Duration>);

impl Samples {
    pub fn new(mut v: Vec<Duration>) -> Self {
        v.sort_unstable();
        Self(v)
    }

    pub fn pct(&self, p: f64) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.0.len() - 1) as f64 * p / 100.0).round() as usize;
        self.0[i]
    }

    pub fn median(&self) -> Duration {
        self.pct(50.0)
    }
}

pub fn median_f64(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

pub fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
