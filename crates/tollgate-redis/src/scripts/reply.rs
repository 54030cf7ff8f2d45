//! The values a script's reply is made of, read one way for every family:
//! each returns `None` for a value of another shape, and the caller turns
//! that into its own "unexpected reply" error.

use redis::Value;

/// A string (bulk or simple), as UTF-8.
pub fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// An integer.
pub fn signed(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        _ => None,
    }
}

/// A non-negative integer.
pub fn int(v: &Value) -> Option<u64> {
    signed(v).and_then(|i| u64::try_from(i).ok())
}

/// A string, or an integer as its decimal text (a field a script may answer
/// either way: a hash field read back, or a number it computed).
pub fn loose_text(v: &Value) -> Option<String> {
    match v {
        Value::Int(i) => Some(i.to_string()),
        other => text(other),
    }
}

/// A non-negative integer, or a string of one (see [`loose_text`]).
pub fn loose_int(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        other => text(other)?.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_reader_takes_its_shape_only() {
        let bulk = Value::BulkString(b"42".to_vec());
        let neg = Value::Int(-3);
        assert_eq!(text(&bulk).as_deref(), Some("42"));
        assert_eq!(text(&Value::Int(4)), None);
        assert_eq!(text(&Value::BulkString(vec![0xff])), None);
        assert_eq!(signed(&neg), Some(-3));
        assert_eq!(int(&neg), None);
        assert_eq!(int(&bulk), None);
        assert_eq!(loose_text(&Value::Int(7)).as_deref(), Some("7"));
        assert_eq!(loose_int(&bulk), Some(42));
        assert_eq!(loose_int(&neg), None);
        assert_eq!(loose_int(&Value::Nil), None);
    }
}
