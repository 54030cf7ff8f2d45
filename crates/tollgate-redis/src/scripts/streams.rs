//! The streams family (`lua/streams/`): a streamed answer's entries, worker
//! to api, and their trimming.

use crate::keys::JobKeys;

eval_scripts!(static STREAM_EVAL in "streams" {
    STREAM_PUSH = "stream_push";
    STREAM_TRIM = "stream_trim";
});

/// One entry of a streamed job's answer (`stream_push.lua`).
#[derive(Debug, Clone, Copy)]
pub struct StreamPush<'a> {
    pub run: u32,
    pub seq: u64,
    /// `d` data, `x` end, `e` error.
    pub kind: &'static str,
    pub text: &'a str,
    /// The most unread bytes: an append finding that many is refused.
    pub backlog: u64,
    pub ttl_ms: u64,
    /// The answer's head (JSON) riding with this entry, or `""`.
    pub head: &'a str,
    /// The bytes this entry counts for (`streams::entry_bytes`).
    pub size: u64,
}

/// `stream_push.lua`'s answer: appended.
pub const STREAM_APPENDED: i64 = 1;
/// `stream_push.lua`'s answer: the reader went away.
pub const STREAM_CANCELLED: i64 = 0;
/// `stream_push.lua`'s answer: the stream's unread backlog is full.
pub const STREAM_FULL: i64 = 2;

/// `stream_push.lua`: [`STREAM_APPENDED`], [`STREAM_CANCELLED`] or
/// [`STREAM_FULL`].
pub fn stream_push<'a>(
    keys: &JobKeys,
    id: &str,
    push: StreamPush<'_>,
) -> redis::ScriptInvocation<'a> {
    let mut inv = STREAM_PUSH.prepare_invoke();
    inv.key(keys.stream(id))
        .key(keys.stream_cancel(id))
        .key(keys.stream_bytes(id));
    inv.arg(push.run)
        .arg(push.seq)
        .arg(push.kind)
        .arg(push.text)
        .arg(push.backlog)
        .arg(push.ttl_ms)
        .arg(push.head)
        .arg(push.size);
    inv
}

/// What a reader read of one stream and releases (`stream_trim.lua`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamTrim {
    /// The job's id.
    pub id: String,
    /// Entries with an id below this one were read (`XTRIM MINID`).
    pub minid: String,
    /// The bytes they counted for.
    pub bytes: u64,
}

/// `stream_trim.lua` for streams of one operation (`keys`): how many it trimmed.
pub fn stream_trim<'a>(keys: &JobKeys, trims: &[StreamTrim]) -> redis::ScriptInvocation<'a> {
    let mut inv = STREAM_TRIM.prepare_invoke();
    for t in trims {
        inv.key(keys.stream(&t.id)).key(keys.stream_bytes(&t.id));
        inv.arg(&t.minid).arg(t.bytes);
    }
    inv
}
