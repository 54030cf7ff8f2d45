//! The counters of a plan's model limits (`lua/budget/lib/model_limits.lua`
//! in memory): per model limit (its tag: pattern and calendar), one counter
//! per calendar period, kept until the period ends, so a user holds at most
//! one live counter per model limit its charges counted under (O(model
//! limits)). A charge adds to the current period of each model limit of its
//! plan it counts under, and keeps their tags; a settle, refund, release or
//! a hold's end lands in the counter of each of its tags whose period holds
//! the charge's time (a period that ended is gone: nothing current changes).

use std::sync::Arc;

use tollgate_core::config::ModelLimit;
use tollgate_core::ledger::WindowUse;
use tollgate_core::period::Span;

struct Count {
    tag: Arc<str>,
    span: Span,
    total: u64,
}

#[derive(Default)]
pub(crate) struct ModelCounts {
    counts: Vec<Count>,
}

/// The period of `m` that `now` falls in (out of the calendar's range: a
/// period of one millisecond, as `Periods` does).
fn span_at(m: &ModelLimit, now: u64) -> Span {
    m.period.period_at(now).unwrap_or(Span {
        start_ms: now,
        end_ms: now.saturating_add(1),
    })
}

impl ModelCounts {
    /// Drops the counters of periods that ended.
    pub(crate) fn sync(&mut self, now: u64) {
        self.counts.retain(|c| c.span.end_ms > now);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// What `m` counts now, in its current period.
    fn used(&self, m: &ModelLimit, now: u64) -> (Span, u64) {
        let span = span_at(m, now);
        let total = self
            .counts
            .iter()
            .find(|c| c.span == span && *c.tag == *m.tag)
            .map_or(0, |c| c.total);
        (span, total)
    }

    /// Whether `cost` fits every one of `limits` (those the charge counts under).
    pub(crate) fn fits(&self, limits: &[&ModelLimit], cost: u64, now: u64) -> bool {
        limits
            .iter()
            .all(|m| self.used(m, now).1.saturating_add(cost) <= m.limit)
    }

    /// `limits` as they stand, each with the retry_after of `cost` (0: it
    /// fits; else until its period ends: nothing leaves a period before).
    pub(crate) fn windows(
        &self,
        limits: &[&ModelLimit],
        cost: u64,
        now: u64,
    ) -> (Vec<WindowUse>, Vec<u64>) {
        limits
            .iter()
            .map(|m| {
                let (span, used) = self.used(m, now);
                let w = WindowUse::period(m.limit, span, used, now).for_model(&m.pattern);
                let retry = if used.saturating_add(cost) > m.limit {
                    span.end_ms.saturating_sub(now)
                } else {
                    0
                };
                (w, retry)
            })
            .unzip()
    }

    /// Counts a new charge of `cost` in the current period of each of
    /// `limits`; returns their tags, for the event to keep.
    pub(crate) fn add_now(
        &mut self,
        limits: &[&ModelLimit],
        cost: u64,
        now: u64,
    ) -> Option<Box<[Arc<str>]>> {
        if limits.is_empty() {
            return None;
        }
        let mut tags = Vec::with_capacity(limits.len());
        for m in limits {
            let span = span_at(m, now);
            match self
                .counts
                .iter_mut()
                .find(|c| c.span == span && *c.tag == *m.tag)
            {
                Some(c) => {
                    c.total += cost;
                    tags.push(Arc::clone(&c.tag));
                }
                None => {
                    let tag: Arc<str> = Arc::from(m.tag.as_str());
                    tags.push(Arc::clone(&tag));
                    self.counts.push(Count {
                        tag,
                        span,
                        total: cost,
                    });
                }
            }
        }
        Some(tags.into_boxed_slice())
    }

    /// A charge spent at `at` that counted under `tags` changed cost from
    /// `previous` to `cost` (0: it left): the counters that counted it follow.
    pub(crate) fn recost(&mut self, tags: &[Arc<str>], at: u64, previous: u64, cost: u64) {
        for c in &mut self.counts {
            if c.span.contains(at) && tags.contains(&c.tag) {
                c.total = (c.total + cost).saturating_sub(previous);
            }
        }
    }
}
