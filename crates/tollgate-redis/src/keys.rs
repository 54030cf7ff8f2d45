//! Every Redis key tollgate uses is built here, and only here.
//!
//! Layout: `<prefix>:v1:{u:<user>}:<part>` for budgets, `<prefix>:v1:{p:<provider>}:<part>`
//! for throttles, `<prefix>:v1:{q:<operation>}:<part>` for job queues,
//! `<prefix>:v1:apikey:<sha256>` for API keys, `<prefix>:v1:{activity}:<part>` for
//! the dashboard's activity log, `<prefix>:v1:session:<sha256>` for its
//! sessions. The prefix lets several deployments
//! (and parallel tests) share one Redis; `v1` is the schema version, bumped when a
//! layout changes so old and new pods never misread each other; the hash tag puts
//! all keys of one user in one Redis Cluster slot, as multi-key scripts require.
//! User ids cannot contain `{`, `}` or `:` ([`tollgate_core::id`]), so a user id
//! can neither widen the hash tag nor forge another part of the name.

use tollgate_core::{
    id::{OrgId, UserId},
    keystore::KeyHash,
};

/// Key schema version: part of every key.
pub const SCHEMA: &str = "v1";

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "tollgate";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error(
        "key prefix must be 1 to 64 characters of ASCII letters, digits, or - _ . : (got {0:?})"
    )]
    BadPrefix(String),
}

/// A deployment's key namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpace {
    prefix: String,
}

/// The keys of one user's budget, in the order the budget scripts take them
/// (`lua/budget/lib/state.lua` describes them). Besides these, the scripts keep the
/// index buckets `<base>:e:<n>` in the user's slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetKeys {
    /// String: the user's plan name; never expires.
    pub plan: String,
    /// Sorted set: request id -> end of the hold of a charge no job has claimed.
    pub holds: String,
    /// Stream: the export of every spend, refund and settle (`[export]`); in
    /// the user's slot, as the budget scripts write it.
    pub audit: String,
    /// Stream: one entry per live spend event, in time order (ID = time spent).
    pub log: String,
    /// Hash: the running totals and the size of the index.
    pub meta: String,
    /// Sorted set: nonce -> end of the hold of a held charge an operator
    /// refunded: its job is cancelled (its claim refused) until then.
    pub cancelled: String,
}

/// One subject's alert outbox, in its budget's slot (`lua/alerts/alert_lease.lua`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxKeys {
    /// Hash: alert id -> its record, `n:<id>` its attempts, `#`, `!`.
    pub alerts: String,
    /// Sorted set: alert id -> when it is due.
    pub alertq: String,
    /// The subject's budget meta (its field `a`).
    pub meta: String,
}

impl BudgetKeys {
    /// The keys in the order the budget scripts take them (KEYS[1..6]).
    pub fn ordered(&self) -> [&str; 6] {
        [
            &self.plan,
            &self.holds,
            &self.audit,
            &self.log,
            &self.meta,
            &self.cancelled,
        ]
    }

    /// Hash: index bucket `n` (request id digest -> the event's changing part).
    pub fn bucket(&self, n: u64) -> String {
        format!("{}:e:{n}", self.meta.trim_end_matches(":meta"))
    }

    /// String: the limits an admin set for the user, `limit:window_ms,...`
    /// longest window first (`budget/lib/plan.lua`'s `resolve_plan` reads it with
    /// the plan); absent: the plan's. Never expires, like the plan.
    pub fn limits(&self) -> String {
        format!("{}:limits", self.meta.trim_end_matches(":meta"))
    }

    /// Hash: the totals of the plan's calendar periods, `<start_ms>-<end_ms>`
    /// -> total (`lua/budget/lib/periods.lua`); expires after the last
    /// period it counts ends.
    pub fn periods(&self) -> String {
        format!("{}:p", self.meta.trim_end_matches(":meta"))
    }

    /// Hash: the counters of the plan's model limits, `<tag>:<start_ms>-<end_ms>`
    /// -> total (`lua/budget/lib/model_limits.lua`); expires after the last
    /// period it counts ends.
    pub fn model_counts(&self) -> String {
        format!("{}:m", self.meta.trim_end_matches(":meta"))
    }

    /// String: this location's marker (`lua/budget/lib/state.lua`, `AT`): at a
    /// user's own tag, the pointer to the organisation it lives in.
    pub fn at(&self) -> String {
        format!("{}:at", self.meta.trim_end_matches(":meta"))
    }

    /// Sorted set: events moved in behind later ones, by the time they were
    /// spent (`lua/budget/lib/state.lua`, `MOVED`).
    pub fn moved(&self) -> String {
        format!("{}:mv", self.meta.trim_end_matches(":meta"))
    }

    /// Hash: the hourly spend rollup, `<hour>:<code>` -> amount, and `f`,
    /// the hour of its last fold: the hours of days before `f`'s are counted
    /// in the daily rollup too, the later ones only here
    /// (`lua/budget/lib/rollups.lua`); expires with the daily one.
    pub fn spend_hourly(&self) -> String {
        format!("{}:su", self.meta.trim_end_matches(":meta"))
    }

    /// Hash: the hourly spend rollup as builds before the fold kept it
    /// (every hour also counted in the daily rollup); no longer written,
    /// read by hourly reports until it expires (its keep after its last hour).
    pub fn spend_hourly_before_fold(&self) -> String {
        format!("{}:sh", self.meta.trim_end_matches(":meta"))
    }

    /// Hash: the daily spend rollup, `<day>:<code>` -> amount, and the
    /// dimensions' dictionary, `c<code>` -> `<org>\t<operation>\t<provider>\t<model>`
    /// (`lua/budget/lib/rollups.lua`).
    pub fn spend_daily(&self) -> String {
        format!("{}:sd", self.meta.trim_end_matches(":meta"))
    }
}

/// Where one user's budget lives: its own tag, or its organisation's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The user's budget keys there.
    pub user: BudgetKeys,
    /// The organisation's budget keys (same slot), for a member.
    pub org: Option<BudgetKeys>,
    /// The organisation's name, for a member (the spend rollups count a
    /// charge under it).
    pub org_name: Option<String>,
}

/// The keys of one provider's throttle, sharing the provider's hash tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThrottleKeys {
    /// List: tickets waiting for a slot, oldest first.
    pub queue: String,
    /// Hash: ticket -> `"<deadline_us> <inbox channel>"`; present while waited for.
    pub waiting: String,
    /// Sorted set: ticket -> grant time (µs); the readiness record a waiter finds
    /// after a reconnect. Trimmed after a short while.
    pub granted: String,
    /// Hash: the token bucket (`tokens`, `at`).
    pub bucket: String,
    /// Hash: throttler id -> end of its liveness (ms).
    pub throttlers: String,
    /// Set: every throttler id that may have a processing list (see
    /// `liveness_heartbeat.lua`); it does not expire.
    pub lists: String,
    /// The fair queue (`lua/throttle/lib/fair.lua`). Sorted set: `"<stamp><ticket>"`
    /// -> start tag: every ticket waiting, served least tag first.
    pub tickets: String,
    /// Sorted set: user with tickets parked by its cap -> when to look again (µs).
    pub capped: String,
    /// Hash: user -> `"<tickets waiting> <finish tag of its last ticket>"`;
    /// `:v` -> the virtual clock, `:n` -> the users waiting (see
    /// `lua/throttle/lib/fair.lua`).
    pub tags: String,
    /// Sorted set: ticket -> end of its slot's lease (µs): the calls in
    /// flight under the provider's `max_concurrent` (`lua/throttle/lib/bucket.lua`).
    pub inflight: String,
    base: String,
}

impl ThrottleKeys {
    /// The throttlers of this provider's ticket queue.
    pub fn members(&self) -> Members<'_> {
        Members {
            members: &self.throttlers,
            lists: &self.lists,
            queue: &self.queue,
            head: Head::Left,
        }
    }

    /// List: the tickets throttler `throttler` popped and has not served yet.
    pub fn processing(&self, throttler: &str) -> String {
        format!("{}:processing:{throttler}", self.base)
    }

    /// The prefix of every key of this provider: the fair queue's scripts
    /// build the per-user keys of capped users from it (`lua/throttle/lib/fair.lua`:
    /// `<base>:parked:<user>`, tickets held back by the cap, and
    /// `<base>:held:<user>`, its slots in flight).
    pub fn base(&self) -> &str {
        &self.base
    }

    /// Sorted set: `user`'s tickets parked by its cap (`lua/throttle/lib/fair.lua`).
    pub fn parked(&self, user: &str) -> String {
        format!("{}:parked:{user}", self.base)
    }

    /// The keys of pool member `member` (`lua/throttle/lib/pool.lua`, which
    /// builds the same names from the base): these keys with its own
    /// `bucket` (`<base>:m:<member>:bucket`) and `inflight`
    /// (`<base>:m:<member>:inflight`) in place of the provider's, so that
    /// the scripts acting on one grant's buckets (slot, usage, pause) act
    /// on its member's. The pool's own: `<base>:sticky` (user -> the member
    /// of its last grant), `<base>:m:n` (member -> its grants) and
    /// [`ThrottleKeys::granted_by`].
    pub fn member(&self, member: &str) -> ThrottleKeys {
        let at = format!("{}:m:{member}", self.base);
        ThrottleKeys {
            bucket: format!("{at}:bucket"),
            inflight: format!("{at}:inflight"),
            ..self.clone()
        }
    }

    /// Hash: pool member -> its grants while the pool is busy
    /// (`lua/throttle/lib/pool.lua`'s `<base>:m:n`).
    pub fn member_counts(&self) -> String {
        format!("{}:m:n", self.base)
    }

    /// Hash: ticket -> the pool member its grant took from, beside
    /// `granted` (`lua/throttle/lib/pool.lua`).
    pub fn granted_by(&self) -> String {
        format!("{}:m:granted", self.base)
    }

    /// The grants inbox of process `process` on a Redis Cluster: a sharded
    /// pub/sub channel in the provider's slot, so `throttle_grant.lua`
    /// SPUBLISHes on the shard that owns the provider. A process listens on one
    /// per provider.
    pub fn inbox(&self, process: &str) -> String {
        format!("{}:inbox:{process}", self.base)
    }
}

impl KeySpace {
    pub fn new(prefix: &str) -> Result<Self, KeyError> {
        let ok = !prefix.is_empty()
            && prefix.len() <= 64
            && prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'));
        if !ok {
            return Err(KeyError::BadPrefix(prefix.to_owned()));
        }
        Ok(Self {
            prefix: prefix.to_owned(),
        })
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The `Debug` of the store `name` on this key space: its prefix, never
    /// the pool's addresses.
    pub fn debug_store(&self, f: &mut std::fmt::Formatter<'_>, name: &str) -> std::fmt::Result {
        f.debug_struct(name)
            .field("prefix", &self.prefix())
            .finish_non_exhaustive()
    }

    /// `<prefix>:v1:{u:<user>}:plan|holds|audit|log|meta|cancelled`
    /// (and `e:<n>`)
    pub fn budget(&self, user: &UserId) -> BudgetKeys {
        Self::budget_at(format!("{}:{SCHEMA}:{{u:{}}}", self.prefix, user))
    }

    /// Sorted set: the budget alerts' due set, outbox pointer -> when a
    /// deliverer should look at that outbox (`lua/alerts/alert_take.lua`):
    /// `<prefix>:v1:{alerts}:due`.
    pub fn alert_due(&self) -> String {
        format!("{}:{SCHEMA}:{{alerts}}:due", self.prefix)
    }

    /// Hash: every deliverer's attempts by result (`delivered`, `retried`,
    /// `failed`) and the last failure (`last`: '<ms> <why>'), for the
    /// dashboard: `<prefix>:v1:{alerts}:deliveries`. A few fields, never
    /// expiring (counters since the deployment began).
    pub fn alert_deliveries(&self) -> String {
        format!("{}:{SCHEMA}:{{alerts}}:deliveries", self.prefix)
    }

    /// The outbox of the subject whose budget keys are `<prefix>:v1:<pointer>:*`
    /// (a pointer is `{u:<user>}`, as `lua/budget/lib/alerts.lua`'s `subject`
    /// builds it): `None` for a pointer that is not a hash tag's keys.
    pub fn outbox(&self, pointer: &str) -> Option<OutboxKeys> {
        let ok = pointer.starts_with('{')
            && pointer.contains('}')
            && pointer.len() <= 512
            && !pointer.chars().any(|c| c.is_whitespace() || c.is_control());
        if !ok {
            return None;
        }
        let base = format!("{}:{SCHEMA}:{pointer}", self.prefix);
        Some(OutboxKeys {
            alerts: format!("{base}:alerts"),
            alertq: format!("{base}:alertq"),
            meta: format!("{base}:meta"),
        })
    }

    fn budget_at(base: String) -> BudgetKeys {
        BudgetKeys {
            plan: format!("{base}:plan"),
            holds: format!("{base}:holds"),
            audit: format!("{base}:audit"),
            log: format!("{base}:log"),
            meta: format!("{base}:meta"),
            cancelled: format!("{base}:cancelled"),
        }
    }

    /// A member's budget keys, under its organisation's hash tag so that one
    /// script reaches both: `<prefix>:v1:{o:<org>}:u:<user>:log|meta|...`.
    pub fn member_budget(&self, org: &OrgId, user: &UserId) -> BudgetKeys {
        Self::budget_at(format!("{}:{SCHEMA}:{{o:{org}}}:u:{user}", self.prefix))
    }

    /// The organisation's own budget: `<prefix>:v1:{o:<org>}:org:log|meta|plan|...`.
    pub fn org_budget(&self, org: &OrgId) -> BudgetKeys {
        Self::budget_at(format!("{}:{SCHEMA}:{{o:{org}}}:org", self.prefix))
    }

    /// Where `user`'s budget lives when it is in `org` (`None`: its own tag).
    pub fn location(&self, user: &UserId, org: Option<&OrgId>) -> Location {
        match org {
            None => Location {
                user: self.budget(user),
                org: None,
                org_name: None,
            },
            Some(org) => Location {
                user: self.member_budget(org, user),
                org: Some(self.org_budget(org)),
                org_name: Some(org.to_string()),
            },
        }
    }

    /// Sorted set (all scores 0): the organisation's members, by name.
    pub fn org_members(&self, org: &OrgId) -> String {
        format!("{}:{SCHEMA}:{{o:{org}}}:members", self.prefix)
    }

    /// Sorted set (all scores 0): every organisation, by name.
    pub fn orgs(&self) -> String {
        format!("{}:{SCHEMA}:orgs", self.prefix)
    }

    /// Hash: one API key's record (`user`, `key_id`, `created_ms`, `revoked`),
    /// named by the SHA-256 of the key: `<prefix>:v1:apikey:<sha256 hex>`.
    pub fn api_key(&self, hash: &KeyHash) -> String {
        format!("{}:{SCHEMA}:apikey:{}", self.prefix, hash.as_str())
    }

    /// Set: the ids of every key issued to `user` (revoked ones too): the user
    /// exists for `/admin/users/{user}/*`. `<prefix>:v1:apikey-user:<user>`.
    pub fn api_key_user(&self, user: &UserId) -> String {
        format!("{}:{SCHEMA}:apikey-user:{user}", self.prefix)
    }

    /// Sorted set: the users index, every user issued a key (score 0,
    /// ordered by id: `ZRANGE BYLEX` pages and prefix searches), written
    /// with each key; `tollgate users reindex` adds users whose keys came
    /// before it. `<prefix>:v1:users`.
    pub fn user_index(&self) -> String {
        format!("{}:{SCHEMA}:users", self.prefix)
    }

    /// The `SCAN MATCH` pattern of every [`api_key_user`](Self::api_key_user)
    /// key, and the part of each name before its user id.
    pub fn api_key_user_scan(&self) -> (String, String) {
        let head = format!("{}:{SCHEMA}:apikey-user:", self.prefix);
        (format!("{head}*"), head)
    }

    /// String: a key id's key hash, for revoking by id:
    /// `<prefix>:v1:apikey-id:<key id>`. Callers pass only ids that passed
    /// [`tollgate_core::keystore::is_key_id`].
    pub fn api_key_id(&self, key_id: &str) -> String {
        format!("{}:{SCHEMA}:apikey-id:{key_id}", self.prefix)
    }

    /// Hash: one dashboard session (`role`, `csrf`, `credential`,
    /// `expires_ms`), named by the SHA-256 of its id, expiring with it:
    /// `<prefix>:v1:session:<sha256 hex>`.
    pub fn session(&self, hash: &tollgate_core::session::SessionHash) -> String {
        format!("{}:{SCHEMA}:session:{}", self.prefix, hash.as_str())
    }
}

impl KeySpace {
    /// `<prefix>:v1:{p:<provider>}:queue|waiting|granted|bucket|throttlers|lists|inflight|processing:<id>`,
    /// and the fair queue's `tickets|capped|tags|parked:<user>|held:<user>`.
    /// Provider names are validated like ids when the config is read.
    pub fn throttle(&self, provider: &str) -> ThrottleKeys {
        let base = format!("{}:{SCHEMA}:{{p:{}}}", self.prefix, provider);
        ThrottleKeys {
            queue: format!("{base}:queue"),
            waiting: format!("{base}:waiting"),
            granted: format!("{base}:granted"),
            bucket: format!("{base}:bucket"),
            throttlers: format!("{base}:throttlers"),
            lists: format!("{base}:lists"),
            tickets: format!("{base}:tickets"),
            capped: format!("{base}:capped"),
            tags: format!("{base}:tags"),
            inflight: format!("{base}:inflight"),
            base,
        }
    }

    /// The pub/sub channel of one waiting process on a single Redis:
    /// `<prefix>:v1:inbox:<process>`. Throttlers publish readiness there; on a
    /// cluster each provider has its own ([`ThrottleKeys::inbox`]).
    pub fn inbox(&self, process: &str) -> String {
        format!("{}:{SCHEMA}:inbox:{process}", self.prefix)
    }
}

/// The keys of one operation's job queue, sharing the operation's hash tag: a
/// job's record lives with its queue, so one script moves both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobKeys {
    /// List: queued job ids; pushed on the left, taken from the right.
    pub queue: String,
    /// Sorted set: running job id -> end of its lease (ms).
    pub leases: String,
    /// Sorted set: failed job id -> when it failed (ms): releases not yet confirmed.
    pub releases: String,
    /// Hash: worker id -> end of its liveness lease (ms, Redis TIME).
    pub workers: String,
    /// Set: the worker ids that may have a processing list (never expires).
    pub lists: String,
    /// List: `"<entry> <reason>"` of malformed entries moved aside.
    pub dead: String,
    base: String,
}

impl JobKeys {
    /// The workers of this operation's job queue.
    pub fn members(&self) -> Members<'_> {
        Members {
            members: &self.workers,
            lists: &self.lists,
            queue: &self.queue,
            head: Head::Right,
        }
    }

    /// Hash: the job record (`state`, `user`, `input`, `seq` = fencing token, ...).
    /// Request ids cannot contain `{ } :`, so an id cannot forge another key.
    pub fn job(&self, id: &str) -> String {
        format!("{}:job:{id}", self.base)
    }

    /// The prefix of each user's stored-bytes hash in this queue
    /// (`<prefix><user>`: time bucket end (ms) -> bytes counted until then;
    /// `lua/jobs/lib/job.lua`). The scripts complete it with the record's user.
    pub fn stored_prefix(&self) -> String {
        format!("{}:stored:", self.base)
    }

    /// String: the job a client's retry of a call left unanswered joins
    /// (its request id), by the request's retry key (`job::retry_key`: a hash
    /// of the user, the operation and the body); expiring.
    pub fn retry_target(&self, key: &str) -> String {
        format!("{}:retry:{key}", self.base)
    }

    /// List: the job ids worker `worker` moved out of the queue and holds.
    pub fn processing(&self, worker: &str) -> String {
        format!("{}:processing:{worker}", self.base)
    }

    /// Stream: the events of job `id`'s streamed answer, worker to api
    /// (`lua/streams/stream_push.lua`; its unread bytes bounded, expiring; trimmed
    /// of what its reader read by `lua/streams/stream_trim.lua`).
    pub fn stream(&self, id: &str) -> String {
        format!("{}:stream:{id}", self.base)
    }

    /// String: the bytes appended to job `id`'s stream and not yet released
    /// by its reader (`lua/streams/stream_push.lua` adds, refusing appends once it
    /// reaches `STREAM_BACKLOG_BYTES`; `lua/streams/stream_trim.lua` subtracts),
    /// expiring with the stream.
    pub fn stream_bytes(&self, id: &str) -> String {
        format!("{}:stream-bytes:{id}", self.base)
    }

    /// Stream (at most one entry, expiring): the wake-up of one stream-hub
    /// connection `hub` of an api pod (a random id and a number: no `{ } :`).
    /// The hub's `XREAD BLOCK` reads it beside the streams it multiplexes;
    /// opening (or resuming) a stream `XADD`s to it so that the blocked read
    /// returns and the next one includes the new stream at once.
    pub fn stream_wake(&self, hub: &str) -> String {
        format!("{}:stream-wake:{hub}", self.base)
    }

    /// String: set when the reader of job `id`'s stream went away (the
    /// client disconnected): the next append is refused and the call cut.
    pub fn stream_cancel(&self, id: &str) -> String {
        format!("{}:stream-cancel:{id}", self.base)
    }

    /// The finished-jobs channel of this queue on a Redis Cluster: a sharded
    /// pub/sub channel in the queue's slot (the job scripts SPUBLISH there).
    pub fn done(&self) -> String {
        format!("{}:done", self.base)
    }
}

impl KeySpace {
    /// `<prefix>:v1:{q:<operation>}:queue|leases|refunds|workers|lists|dead|job:<id>|processing:<worker>|retry:<key>|stream:<id>|stream-cancel:<id>|stream-bytes:<id>|stream-wake:<hub>`.
    /// Operation names are validated like ids when the config is read.
    pub fn jobs(&self, operation: &str) -> JobKeys {
        let base = format!("{}:{SCHEMA}:{{q:{}}}", self.prefix, operation);
        JobKeys {
            queue: format!("{base}:queue"),
            leases: format!("{base}:leases"),
            // Stored as `refunds`, its name before the glossary's: an upgrade
            // finds the releases pending in it.
            releases: format!("{base}:refunds"),
            workers: format!("{base}:workers"),
            lists: format!("{base}:lists"),
            dead: format!("{base}:dead"),
            base,
        }
    }

    /// The pub/sub channel on which finished job ids are published on a
    /// single Redis; on a cluster each queue has its own ([`JobKeys::done`]).
    pub fn jobs_done(&self) -> String {
        format!("{}:{SCHEMA}:jobs:done", self.prefix)
    }
}

/// The keys of the activity log (the operations dashboard's recent past),
/// all under the one `{activity}` hash tag so one script writes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActivityKeys {
    /// List: spend events (JSON), newest first, capped.
    pub events: String,
    /// Sorted set: spend key -> when its refund was noted (ms), capped.
    pub refunded: String,
    /// Hash: provider -> grants counted.
    pub grants: String,
    /// Hash: `"<provider> <class>"` -> upstream answers counted.
    pub answers: String,
    /// Hash: operation (or `(plain reserve)`) -> budget denials counted.
    pub denials: String,
    /// List: `"<at_ms> <user> <operation>"` of the newest denials, capped.
    pub denied: String,
    /// Hash: operation (or `(plain reserve)`) -> new charges counted.
    pub calls: String,
    /// Hash: job id -> its timeline, one `"<at_ms> <user> <step>"` per line.
    pub timelines: String,
    /// List: the timelines' job ids, newest first (the oldest goes past the cap).
    pub timeline_order: String,
    /// List: `"<at_ms> <id> <user> <operation> <cause>"` of the newest job failures.
    pub failed: String,
    /// Sorted set: the history's samples (JSON) by their slot's start (ms).
    pub history: String,
    base: String,
}

impl ActivityKeys {
    /// List: `"<at_ms> <waited_us>"` of a provider's newest grants, capped.
    pub fn waits(&self, provider: &str) -> String {
        format!("{}:waits:{provider}", self.base)
    }
}

impl KeySpace {
    /// `<prefix>:v1:{activity}:events|refunded|grants|answers|denials|denied|calls|timelines|timeline_order|failed|history|waits:<provider>`.
    pub fn activity(&self) -> ActivityKeys {
        let base = format!("{}:{SCHEMA}:{{activity}}", self.prefix);
        ActivityKeys {
            events: format!("{base}:events"),
            refunded: format!("{base}:refunded"),
            grants: format!("{base}:grants"),
            answers: format!("{base}:answers"),
            denials: format!("{base}:denials"),
            denied: format!("{base}:denied"),
            calls: format!("{base}:calls"),
            timelines: format!("{base}:timelines"),
            timeline_order: format!("{base}:timeline_order"),
            failed: format!("{base}:failed"),
            history: format!("{base}:history"),
            base,
        }
    }
}

impl Default for KeySpace {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
        }
    }
}

/// The members of a queue that pop ids into processing lists of their own
/// (workers of an operation's job queue, throttlers of a provider's ticket
/// queue): the keys `liveness_heartbeat.lua` and `liveness_reclaim.lua` use.
#[derive(Debug, Clone, Copy)]
pub struct Members<'k> {
    /// Hash: member id -> end of its liveness (ms).
    pub members: &'k str,
    /// Set: every member id that may have a processing list.
    pub lists: &'k str,
    pub queue: &'k str,
    /// The queue's head: where the next id is popped from.
    pub head: Head,
}

/// The end of a queue its ids are popped from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Head {
    Left,
    Right,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_keys_share_the_user_hash_tag() {
        let k = KeySpace::new("tg")
            .unwrap()
            .budget(&UserId::new("alice").unwrap());
        assert_eq!(k.plan, "tg:v1:{u:alice}:plan");
        assert_eq!(k.limits(), "tg:v1:{u:alice}:limits");
        assert_eq!(k.holds, "tg:v1:{u:alice}:holds");
        assert_eq!(k.audit, "tg:v1:{u:alice}:audit");
        assert_eq!(k.log, "tg:v1:{u:alice}:log");
        assert_eq!(k.meta, "tg:v1:{u:alice}:meta");
        assert_eq!(k.cancelled, "tg:v1:{u:alice}:cancelled");
        assert_eq!(k.bucket(7), "tg:v1:{u:alice}:e:7");
    }

    #[test]
    fn throttle_keys_share_the_provider_hash_tag() {
        let k = KeySpace::new("tg").unwrap().throttle("llm");
        assert_eq!(k.queue, "tg:v1:{p:llm}:queue");
        assert_eq!(k.bucket, "tg:v1:{p:llm}:bucket");
        assert_eq!(k.processing("t1"), "tg:v1:{p:llm}:processing:t1");
        for key in [
            &k.waiting,
            &k.granted,
            &k.throttlers,
            &k.lists,
            &k.tickets,
            &k.capped,
            &k.tags,
            &k.parked("u"),
            &k.inbox("p1"),
        ] {
            assert!(key.starts_with("tg:v1:{p:llm}:"), "{key}");
        }
    }

    #[test]
    fn job_keys_share_the_operation_hash_tag() {
        let ks = KeySpace::new("tg").unwrap();
        let k = ks.jobs("llm.structured");
        assert_eq!(k.queue, "tg:v1:{q:llm.structured}:queue");
        assert_eq!(k.job("r1"), "tg:v1:{q:llm.structured}:job:r1");
        assert_eq!(k.processing("w1"), "tg:v1:{q:llm.structured}:processing:w1");
        for key in [
            &k.leases,
            &k.releases,
            &k.workers,
            &k.lists,
            &k.dead,
            &k.done(),
        ] {
            assert!(key.starts_with("tg:v1:{q:llm.structured}:"), "{key}");
        }
    }

    #[test]
    fn activity_keys_share_one_hash_tag() {
        let k = KeySpace::new("tg").unwrap().activity();
        assert_eq!(k.events, "tg:v1:{activity}:events");
        assert_eq!(k.waits("llm"), "tg:v1:{activity}:waits:llm");
        for key in [
            &k.refunded,
            &k.grants,
            &k.answers,
            &k.denials,
            &k.denied,
            &k.calls,
            &k.timelines,
            &k.timeline_order,
            &k.failed,
            &k.history,
        ] {
            assert!(key.starts_with("tg:v1:{activity}:"), "{key}");
        }
    }

    #[test]
    fn prefixes_cannot_open_a_hash_tag() {
        for bad in ["", "a{b", "a}b", "a b", "a*", &"p".repeat(65)] {
            assert!(KeySpace::new(bad).is_err(), "{bad:?}");
        }
        assert!(KeySpace::new("team-a:tollgate").is_ok());
    }
}
