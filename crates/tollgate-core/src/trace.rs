//! [`TraceParent`]: a W3C Trace Context `traceparent`
//! (`00-<trace id>-<parent id>-<flags>`), so that one call carries one trace
//! id from the api through its job to the provider, and every log line about it,
//! in any role, names it (`trace_id`).
//!
//! The api accepts a caller's `traceparent` or starts a trace; the job stores it;
//! the worker sends a child of it upstream. An invalid header is ignored and a new
//! trace started, as the specification asks.

use std::fmt;

use crate::clock::{Clock, SystemClock};

/// A `traceparent` of version 00.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TraceParent {
    trace_id: String,
    parent_id: String,
    flags: u8,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn random_hex<const N: usize>() -> String {
    let mut bytes = [0u8; N];
    // A failing system RNG leaves zeros: the ids are then invalid (all zero),
    // so fall back to the clock's bits rather than send an invalid header.
    if getrandom::fill(&mut bytes).is_err() || bytes.iter().all(|b| *b == 0) {
        let micros = SystemClock.now_us().max(1);
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (micros >> ((i % 8) * 8)) as u8 | 1;
        }
    }
    hex(&bytes)
}

fn is_lower_hex(s: &str, len: usize) -> bool {
    s.len() == len
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl TraceParent {
    /// A new trace (sampled).
    pub fn generate() -> Self {
        Self {
            trace_id: random_hex::<16>(),
            parent_id: random_hex::<8>(),
            flags: 1,
        }
    }

    /// Parses a `traceparent` header value; `None` when it is not a valid
    /// version-00 value (an all-zero id is invalid too).
    pub fn parse(value: &str) -> Option<Self> {
        let mut parts = value.trim().split('-');
        let (version, trace_id, parent_id, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || version != "00" {
            return None;
        }
        let valid = is_lower_hex(trace_id, 32)
            && is_lower_hex(parent_id, 16)
            && is_lower_hex(flags, 2)
            && trace_id.bytes().any(|b| b != b'0')
            && parent_id.bytes().any(|b| b != b'0');
        valid.then(|| Self {
            trace_id: trace_id.to_owned(),
            parent_id: parent_id.to_owned(),
            flags: u8::from_str_radix(flags, 16).unwrap_or(0),
        })
    }

    /// The caller's trace continued (`header` valid), or a new one.
    pub fn continue_or_start(header: Option<&str>) -> Self {
        header.and_then(Self::parse).unwrap_or_else(Self::generate)
    }

    /// The same trace, with a new parent id: what a hop sends to the next one.
    pub fn child(&self) -> Self {
        Self {
            trace_id: self.trace_id.clone(),
            parent_id: random_hex::<8>(),
            flags: self.flags,
        }
    }

    /// The 32 hex digits every log line about the call carries as `trace_id`.
    pub fn trace_id(&self) -> &str {
        &self.trace_id
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            self.trace_id, self.parent_id, self.flags
        )
    }
}

impl serde::Serialize for TraceParent {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for TraceParent {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).ok_or_else(|| serde::de::Error::custom("not a valid traceparent"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_valid_and_refuses_invalid() {
        let v = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let tp = TraceParent::parse(v).unwrap();
        assert_eq!(tp.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(tp.to_string(), v);
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_child_keeps_the_trace_and_a_new_trace_is_valid() {
        let tp = TraceParent::generate();
        assert_eq!(TraceParent::parse(&tp.to_string()), Some(tp.clone()));
        let child = tp.child();
        assert_eq!(child.trace_id(), tp.trace_id());
        assert_ne!(child.to_string(), tp.to_string());
        assert_ne!(TraceParent::generate().trace_id(), tp.trace_id());
    }
}
