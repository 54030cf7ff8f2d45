//! The totals of a log's calendar-period limits (`lua/budget/lib/periods.lua`
//! in memory): one counter per period, keyed by the period's start and end,
//! kept until the period ends. Charges, refunds and settles land in the
//! period the charge was made in: a change to an event spent before the
//! current period began changes nothing current, nor does one to an event
//! the counter never counted (its `since`, below).

use tollgate_core::config::Limit;
use tollgate_core::period::Span;

struct Count {
    span: Span,
    total: u64,
    /// The counter's era: from when it has counted the log's charges of its
    /// span without a break, and until when, if no current limit uses it
    /// though its period has not ended (a plan change to another
    /// calendar). A change to an event spent outside it is none of its
    /// business (the counter was made after the event, or was another
    /// calendar's while the event was spent). Current again, it starts a new
    /// era: a charge of its first era then gives nothing back (the safe
    /// side: it stays counted).
    since: u64,
    until: Option<u64>,
}

#[derive(Default)]
pub(crate) struct Periods {
    /// The current period of each period limit of the call's plan, in the
    /// plan's order (set by `sync`).
    current: Vec<Span>,
    /// Every period counted and not ended.
    counts: Vec<Count>,
    /// The time of the last `sync`.
    now: u64,
}

impl Periods {
    /// The periods `now` falls in, for `limits` (the windows' are skipped);
    /// drops the counters of periods that ended, ends the era of those no
    /// current limit uses and starts one for those current again.
    pub(crate) fn sync(&mut self, now: u64, limits: &[Limit]) {
        self.current.clear();
        self.now = now;
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
        self.counts.retain(|c| c.span.end_ms > now);
        for c in &mut self.counts {
            let current = self.current.contains(&c.span);
            if !current && c.until.is_none() {
                c.until = Some(now);
            } else if current && c.until.is_some() {
                (c.since, c.until) = (now, None);
            }
        }
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
            .find(|c| c.span == span)
            .map_or(0, |c| c.total);
        Some((span, total))
    }

    /// Counts a new event of `cost` in every current period.
    pub(crate) fn add_now(&mut self, cost: u64) {
        for span in &self.current {
            match self.counts.iter_mut().find(|c| c.span == *span) {
                Some(c) => c.total += cost,
                None => self.counts.push(Count {
                    span: *span,
                    total: cost,
                    since: self.now,
                    until: None,
                }),
            }
        }
    }

    /// An event spent at `at` changed cost from `previous` to `cost` (0: it
    /// was removed): every counter that counted it follows. A period that
    /// ended is gone already: nothing current changes.
    pub(crate) fn recost(&mut self, at: u64, previous: u64, cost: u64) {
        for c in &mut self.counts {
            if c.span.contains(at) && at >= c.since && c.until.is_none_or(|u| at < u) {
                c.total = (c.total + cost).saturating_sub(previous);
            }
        }
    }

    /// Counts an event moved in with the time `at` it was spent: in every
    /// current period it was spent in, whose since goes back to it.
    pub(crate) fn add_at(&mut self, at: u64, cost: u64) {
        for span in &self.current {
            if !span.contains(at) {
                continue;
            }
            match self.counts.iter_mut().find(|c| c.span == *span) {
                Some(c) => {
                    c.total += cost;
                    c.since = c.since.min(at);
                }
                None => self.counts.push(Count {
                    span: *span,
                    total: cost,
                    since: at,
                    until: None,
                }),
            }
        }
    }
}
