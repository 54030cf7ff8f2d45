//! The chaos suite's check of the waits for a slot: every waiter got its slot
//! or its timeout error within its limit (`max_wait`, or what was left of it)
//! plus 1 s. The workers trace each wait's beginning and end
//! (`tollgate_providers::WAIT_TARGET`, JSON logs); this pairs them up and
//! judges each, knowing the suite's own faults: a wait in a process the suite
//! paused (SIGSTOP) may end late through no fault of its own, and one in a
//! process killed meanwhile never ends. Nothing else excuses a wait.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use serde_json::Value;

/// The slack over a wait's limit.
pub const SLACK_MS: u64 = 1_000;

/// One traced event of a wait: when (µs since the epoch, the process's wall
/// clock) and what.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Began {
        at_us: u64,
        request_id: String,
        limit_ms: u64,
    },
    Ended {
        at_us: u64,
        request_id: String,
        waited_ms: u64,
        outcome: String,
    },
}

/// The wait events in one process's JSON log (other lines are skipped).
pub fn events(log: &str) -> Vec<Event> {
    log.lines().filter_map(event).collect()
}

fn event(line: &str) -> Option<Event> {
    let v: Value = serde_json::from_str(line.trim()).ok()?;
    if v["target"].as_str()? != tollgate_providers::WAIT_TARGET {
        return None;
    }
    let at_us = rfc3339_us(v["timestamp"].as_str()?)?;
    let f = &v["fields"];
    let request_id = f["request_id"].as_str()?.to_owned();
    if let Some(waited_ms) = f["waited_ms"].as_u64() {
        Some(Event::Ended {
            at_us,
            request_id,
            waited_ms,
            outcome: f["outcome"].as_str()?.to_owned(),
        })
    } else {
        Some(Event::Began {
            at_us,
            request_id,
            limit_ms: f["limit_ms"].as_u64()?,
        })
    }
}

/// `2026-12-01T16:40:00.123456Z` (UTC, any number of fraction digits) in µs
/// since the epoch.
pub fn rfc3339_us(s: &str) -> Option<u64> {
    let s = s.strip_suffix('Z')?;
    let (date, time) = s.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.splitn(3, ':').map(|p| p.parse::<u64>().ok());
    let (hh, mm, ss) = (t.next()??, t.next()??, t.next()??);
    let mut micros = 0u64;
    for (i, c) in frac.chars().take(6).enumerate() {
        micros += u64::from(c.to_digit(10)?) * 10u64.pow(5 - i as u32);
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = u64::try_from(era * 146_097 + doe - 719_468).ok()?;
    Some(((days * 86_400 + hh * 3_600 + mm * 60 + ss) * 1_000_000) + micros)
}

/// What the suite did to one process: when it was paused (start, end µs)
/// and when it was killed or found dead (µs).
#[derive(Debug, Default, Clone)]
pub struct Faults {
    pub paused: Vec<(u64, u64)>,
    pub killed: Vec<u64>,
}

/// The verdict over every process's waits.
#[derive(Debug, Default)]
pub struct Verdict {
    pub waits: usize,
    pub outcomes: BTreeMap<String, usize>,
    /// Ended past their limit + slack in a process paused meanwhile.
    pub paused: usize,
    /// Began in a process killed before they ended.
    pub died: usize,
    /// Ended past their limit + slack otherwise, or never ended in a living
    /// process: `(process, request id, what)`.
    pub broken: Vec<(String, String, String)>,
    /// The most a wait outside the suite's pauses took past its limit, in ms
    /// (negative: under it), and which wait that was.
    pub worst_over_ms: i64,
    pub worst: String,
}

impl Verdict {
    pub fn ok(&self) -> bool {
        self.broken.is_empty()
    }

    pub fn figure(&self) -> String {
        let mut out = format!(
            "{} waits {:?}; worst outside a pause {:+} ms against its limit ({}); {} past it in a paused process, {} died with their process; {} broken",
            self.waits,
            self.outcomes,
            self.worst_over_ms,
            self.worst,
            self.paused,
            self.died,
            self.broken.len()
        );
        for (p, id, what) in self.broken.iter().take(3) {
            let _ = write!(out, "; {p} {id}: {what}");
        }
        out
    }
}

/// Pairs each process's begin and end events and judges every wait.
/// `procs`: per process, its events and the suite's faults on it.
pub fn judge(procs: &[(String, Vec<Event>, Faults)]) -> Verdict {
    let mut v = Verdict {
        worst_over_ms: i64::MIN,
        ..Verdict::default()
    };
    for (name, events, faults) in procs {
        let overlaps_pause =
            |from: u64, to: u64| faults.paused.iter().any(|&(s, e)| s <= to && e >= from);
        // Open waits per request id: (began at, limit).
        let mut open: HashMap<&str, Vec<(u64, u64)>> = HashMap::new();
        for e in events {
            match e {
                Event::Began {
                    at_us,
                    request_id,
                    limit_ms,
                } => open
                    .entry(request_id.as_str())
                    .or_default()
                    .push((*at_us, *limit_ms)),
                Event::Ended {
                    at_us,
                    request_id,
                    waited_ms,
                    outcome,
                } => {
                    v.waits += 1;
                    *v.outcomes.entry(outcome.clone()).or_default() += 1;
                    let began = at_us.saturating_sub(waited_ms * 1_000);
                    // The open wait that began nearest to when this one did
                    // (a process paused past a lease may run a job's wait
                    // twice at once: the abandoned one and the new one).
                    let limit = open.get_mut(request_id.as_str()).and_then(|starts| {
                        let i = (0..starts.len()).min_by_key(|&i| starts[i].0.abs_diff(began))?;
                        Some(starts.swap_remove(i).1)
                    });
                    let Some(limit) = limit else {
                        v.broken.push((
                            name.clone(),
                            request_id.clone(),
                            "an end without a beginning".into(),
                        ));
                        continue;
                    };
                    let over = waited_ms.saturating_sub(limit + SLACK_MS);
                    if overlaps_pause(began, *at_us) {
                        // Excused, and not the worst either: the pause is
                        // the suite's.
                        if over > 0 {
                            v.paused += 1;
                        }
                    } else if over == 0 {
                        let by = *waited_ms as i64 - limit as i64;
                        if by > v.worst_over_ms {
                            v.worst_over_ms = by;
                            v.worst = format!(
                                "{name} {request_id}: {outcome} after {waited_ms} ms of {limit}"
                            );
                        }
                    } else {
                        v.broken.push((
                            name.clone(),
                            request_id.clone(),
                            format!("{outcome} after {waited_ms} ms, limit {limit} ms"),
                        ));
                    }
                }
            }
        }
        for (id, starts) in open {
            for (at, limit) in starts {
                if faults.killed.iter().any(|&k| k >= at) {
                    v.died += 1;
                } else {
                    v.broken.push((
                        name.clone(),
                        id.to_owned(),
                        format!("began (limit {limit} ms) and never ended"),
                    ));
                }
            }
        }
    }
    if v.worst_over_ms == i64::MIN {
        v.worst_over_ms = 0;
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn began(at_us: u64, id: &str, limit_ms: u64) -> Event {
        Event::Began {
            at_us,
            request_id: id.into(),
            limit_ms,
        }
    }

    fn ended(at_us: u64, id: &str, waited_ms: u64) -> Event {
        Event::Ended {
            at_us,
            request_id: id.into(),
            waited_ms,
            outcome: "timeout".into(),
        }
    }

    #[test]
    fn rfc3339_reads_tracing_timestamps() {
        assert_eq!(rfc3339_us("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            rfc3339_us("2026-12-01T16:40:00.123456Z"),
            Some(1_796_143_200_123_456)
        );
        assert_eq!(
            rfc3339_us("2000-02-29T00:00:01.5Z"),
            Some(951_782_401_500_000)
        );
        assert_eq!(rfc3339_us("not a time"), None);
    }

    #[test]
    fn events_are_read_from_json_lines_of_the_wait_target() {
        let log = format!(
            "{}\nnot json\n{}\n{}\n",
            r#"{"timestamp":"2026-12-01T16:40:00.000001Z","level":"DEBUG","fields":{"message":"wait for a slot began","provider":"llm","request_id":"r1","limit_ms":8000},"target":"tollgate::wait"}"#,
            r#"{"timestamp":"2026-12-01T16:40:01Z","level":"WARN","fields":{"message":"x","request_id":"r1"},"target":"tollgate_worker"}"#,
            r#"{"timestamp":"2026-12-01T16:40:02Z","level":"DEBUG","fields":{"message":"wait for a slot ended","provider":"llm","request_id":"r1","waited_ms":2000,"outcome":"granted"},"target":"tollgate::wait"}"#,
        );
        let e = events(&log);
        assert_eq!(
            e,
            vec![
                began(1_796_143_200_000_001, "r1", 8000),
                Event::Ended {
                    at_us: 1_796_143_202_000_000,
                    request_id: "r1".into(),
                    waited_ms: 2000,
                    outcome: "granted".into()
                }
            ]
        );
    }

    #[test]
    fn a_wait_past_its_limit_is_broken_unless_its_process_was_paused() {
        let s = 1_000_000_000;
        let events = vec![
            began(s, "a", 8000),
            ended(s + 9_000_000, "a", 9000), // at the limit + 1 s: fine
            began(s, "b", 8000),
            ended(s + 9_500_000, "b", 9500), // late
        ];
        let v = judge(&[("w".into(), events.clone(), Faults::default())]);
        assert_eq!(v.broken.len(), 1, "{v:?}");
        assert_eq!(v.broken[0].1, "b");
        assert_eq!(v.worst_over_ms, 1000);
        let paused = Faults {
            paused: vec![(s + 2_000_000, s + 6_000_000)],
            killed: vec![],
        };
        let v = judge(&[("w".into(), events, paused)]);
        assert!(v.ok(), "{v:?}");
        assert_eq!(v.paused, 1);
        // Both waits overlap the pause: neither is the worst outside one.
        assert_eq!(v.worst_over_ms, 0, "{v:?}");
    }

    #[test]
    fn a_wait_that_never_ended_is_broken_unless_its_process_died() {
        let events = vec![began(5, "a", 8000)];
        let v = judge(&[("w".into(), events.clone(), Faults::default())]);
        assert!(!v.ok());
        let killed = Faults {
            paused: vec![],
            killed: vec![10],
        };
        let v = judge(&[("w".into(), events.clone(), killed)]);
        assert!(v.ok(), "{v:?}");
        assert_eq!(v.died, 1);
        // Killed before the wait began: no excuse.
        let before = Faults {
            paused: vec![],
            killed: vec![1],
        };
        assert!(!judge(&[("w".into(), events, before)]).ok());
    }

    #[test]
    fn two_waits_of_one_job_at_once_pair_by_their_start() {
        let s = 1_000_000_000;
        // The abandoned wait (began at s) ends after the new one began.
        let events = vec![
            began(s, "a", 8000),
            began(s + 5_000_000, "a", 8000),
            ended(s + 6_000_000, "a", 6000),
            ended(s + 7_000_000, "a", 2000),
        ];
        let v = judge(&[("w".into(), events, Faults::default())]);
        assert!(v.ok(), "{v:?}");
        assert_eq!(v.waits, 2);
    }
}
