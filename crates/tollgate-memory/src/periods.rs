//! The totals of a log's calendar-period limits (`lua/budget/lib/periods.lua`
//! in memory): one counter per period, keyed by the period's start and end,
//! kept until the period ends. Charges, refunds and settles land in the
//! period the charge was made in: a change to an event spent before the
//! current period began changes nothing current.

use tollgate_core::config::Limit;
use tollgate_core::period::Span;

#[derive(Default)]
pub(crate) struct Periods {
    /// The current period of each period limit of the call's plan, in the
    /// plan's order (set by `sync`).
    current: Vec<Span>,
    /// Every period counted and not ended: (period, total).
    counts: Vec<(Span, u64)>,
}

impl Periods {
    /// The periods `now` falls in, for `limits` (the windows' are skipped);
    /// drops the counters of periods that ended.
    pub(crate) fn sync(&mut self, now: u64, limits: &[Limit]) {
        self.current.clear();
        for l in limits {
            if let Some(c) = l.period {
                // Out of the calendar's range (years past 9999): a period of
                // one millisecond, so nothing is counted across it.
                let span = c.period_at(now).unwrap_or(Span {
                    start_ms: now,
                    end_ms: now.saturating_add(1),
                });
                self.current.push(span);
            }
        }
        self.counts.retain(|(span, _)| span.end_ms > now);
    }

    /// Whether no period counter is left (a user with none can be swept).
    pub(crate) fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// The current period of the `j`-th period limit and its total.
    pub(crate) fn get(&self, j: usize) -> Option<(Span, u64)> {
        let span = *self.current.get(j)?;
        let total = self
            .counts
            .iter()
            .find(|(s, _)| *s == span)
            .map_or(0, |(_, t)| *t);
        Some((span, total))
    }

    /// Counts a new event of `cost` in every current period.
    pub(crate) fn add_now(&mut self, cost: u64) {
        for span in &self.current {
            match self.counts.iter_mut().find(|(s, _)| s == span) {
                Some((_, t)) => *t += cost,
                None => self.counts.push((*span, cost)),
            }
        }
    }

    /// An event spent at `at` changed cost from `previous` to `cost` (0: it
    /// was removed): every counted period it was spent in follows. A period
    /// that ended is gone already: nothing current changes.
    pub(crate) fn recost(&mut self, at: u64, previous: u64, cost: u64) {
        for (span, total) in &mut self.counts {
            if span.contains(at) {
                *total = (*total + cost).saturating_sub(previous);
            }
        }
    }

    /// Counts an event moved in with the time `at` it was spent: in every
    /// current period it was spent in.
    pub(crate) fn add_at(&mut self, at: u64, cost: u64) {
        for span in &self.current {
            if !span.contains(at) {
                continue;
            }
            match self.counts.iter_mut().find(|(s, _)| s == span) {
                Some((_, t)) => *t += cost,
                None => self.counts.push((*span, cost)),
            }
        }
    }
}
