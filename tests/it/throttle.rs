//! The throttle conformance suite: every semantic case, written once, run against
//! the in-process bucket and the Redis throttle (with an in-process throttler
//! role). Both run on real time: the Redis clock is Redis `TIME`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tollgate_core::{
    config::Config,
    id::RequestId,
    throttle::{Grant, Position, Share, Throttle, ThrottleError, Waiter},
};
use tollgate_memory::throttle::MemoryThrottle;
use tollgate_redis::{
    keys::KeySpace,
    pool::PoolOptions,
    throttle::{RedisDispatchers, RedisThrottle, RedisThrottleOptions},
};
use tollgate_tests::throttle::{max_excess, run_waiters};
use tollgate_tests::{random_prefix, RedisServer, TestCluster};
use tollgate_throttler::ThrottlerConfig;

pub const CONFIG: &str = r#"
[plans.free]
limit = 1
window = "1h"
[providers.steady]
rate = 20
burst = 5
max_wait = "10s"
[providers.slow]
rate = 2
burst = 1
max_wait = "10s"
[providers.tempo]
rate = 5
burst = 1
max_wait = "10s"
[providers.turnstile]
rate = 5
burst = 1
max_wait = "10s"
fairness = "fifo"
[providers.wicket]
rate = 0.05
burst = 1
max_wait = "10s"
[providers.wicket-fifo]
rate = 0.05
burst = 1
max_wait = "10s"
fairness = "fifo"
[providers.x-late]
rate = 20
burst = 5
max_wait = "10s"
late_allowance = "100ms"
[providers.y-slots]
rate = 100
burst = 10
max_wait = "10s"
max_concurrent = 2
[providers.z-adaptive]
rate = 20
burst = 2
max_wait = "10s"
adaptive = true
# Re-dating: at most 2 re-dated grants open at once, the level at most 3
# since a grant for it to be re-dated (6 - 1 - 2); late past 250 ms.
[providers.v-redate]
rate = 4
burst = 6
max_wait = "10s"
[providers.w-limits]
max_wait = "10s"
limits = [{ rate = 40, per = "1s", burst = 4 }, { tokens = 100, per = "1s", burst = 30 }]
[providers.w-fifo]
max_wait = "10s"
fairness = "fifo"
limits = [{ rate = 40, per = "1s", burst = 4 }, { tokens = 100, per = "1s", burst = 30 }]
# A grant used late (a waiter descheduled past 1/rate on a loaded machine) is
# lost and the call queues again, behind the lighter call: the order this
# provider's test checks is the queue's, so its grants may be used late.
late_allowance = "100ms"
# A pool of one member: served as that member, with w-limits' limits.
[providers.zz-pool]
max_wait = "10s"
members = [{ name = "only", url = "http://127.0.0.1:9", limits = [{ rate = 40, per = "1s", burst = 4 }, { tokens = 100, per = "1s", burst = 30 }] }]
# A pool of three members with their own limits: each grant takes from one.
[providers.zz-pool3]
max_wait = "30s"
members = [
  { name = "a", url = "http://127.0.0.1:9", limits = [{ rate = 10, per = "1s", burst = 2 }] },
  { name = "b", url = "http://127.0.0.1:9", limits = [{ rate = 20, per = "1s", burst = 4 }, { tokens = 400, per = "1s", burst = 40 }], weight = 2 },
  { name = "c", url = "http://127.0.0.1:9", limits = [{ rate = 5, per = "1s", burst = 1 }], max_concurrent = 2 },
]
# A pool whose members' upstreams a test starts (tests/it/throttle_pool.rs
# puts their urls in place of these).
[providers.zz-failover]
max_wait = "20s"
members = [
  { name = "a", url = "http://127.0.0.1:9/a", limits = [{ rate = 10, per = "1s", burst = 2 }], model = "model-a" },
  { name = "b", url = "http://127.0.0.1:9/b", limits = [{ rate = 10, per = "1s", burst = 2 }] },
  { name = "c", url = "http://127.0.0.1:9/c", limits = [{ rate = 10, per = "1s", burst = 2 }] },
]
[operations.fw]
cost = 1
provider = "zz-failover"
path = "/fw"
# A FIFO pool: its calls have no user, each goes to the member with room.
[providers.zz-pool-fifo]
max_wait = "30s"
fairness = "fifo"
members = [
  { name = "a", url = "http://127.0.0.1:9", limits = [{ rate = 10, per = "1s", burst = 2 }] },
  { name = "b", url = "http://127.0.0.1:9", limits = [{ rate = 20, per = "1s", burst = 3 }, { tokens = 400, per = "1s", burst = 40 }] },
]
# A pool with room to spare.
[providers.zz-roomy]
max_wait = "10s"
members = [
  { name = "a", url = "http://127.0.0.1:9", limits = [{ rate = 1000, per = "1s", burst = 200 }] },
  { name = "b", url = "http://127.0.0.1:9", limits = [{ rate = 1000, per = "1s", burst = 200 }] },
  { name = "c", url = "http://127.0.0.1:9", limits = [{ rate = 1000, per = "1s", burst = 200 }] },
]
"#;

pub fn config() -> Arc<Config> {
    Arc::new(Config::parse(CONFIG, "throttle conformance").expect("test config"))
}

pub fn rid(s: &str) -> RequestId {
    RequestId::new(s).expect("valid request id")
}

/// A running Redis throttle: server, throttler role task, waiter side.
pub struct RedisSetup {
    server: Option<RedisServer>,
    _cluster: Option<TestCluster>,
    pub prefix: String,
    pub throttle: Arc<RedisThrottle>,
    stop: Option<oneshot::Sender<()>>,
    role: Option<tokio::task::JoinHandle<()>>,
}

impl RedisSetup {
    /// With `throttler`, an in-process throttler role serves the queues.
    pub async fn start(throttler: bool, options: RedisThrottleOptions) -> Self {
        let server = RedisServer::start();
        let url = server.url();
        Self::on(&url, Some(server), None, throttler, options, None).await
    }

    /// With a throttler role whose BLMOVE blocks up to `block` when idle.
    pub async fn blocking(block: Duration) -> Self {
        let server = RedisServer::start();
        let url = server.url();
        Self::on(
            &url,
            Some(server),
            None,
            true,
            Default::default(),
            Some(block),
        )
        .await
    }

    /// The same on a Redis Cluster (3 primaries, 3 replicas).
    pub async fn cluster(throttler: bool, options: RedisThrottleOptions) -> Self {
        let cluster = TestCluster::get();
        let url = cluster.url();
        Self::on(&url, None, Some(cluster), throttler, options, None).await
    }

    /// The standalone server (tests of what only it can do: kills, restarts).
    pub fn server(&self) -> &RedisServer {
        self.server.as_ref().expect("a setup on a standalone Redis")
    }

    async fn on(
        url: &str,
        server: Option<RedisServer>,
        cluster: Option<TestCluster>,
        throttler: bool,
        options: RedisThrottleOptions,
        block: Option<Duration>,
    ) -> Self {
        let prefix = random_prefix();
        let keys = KeySpace::new(&prefix).expect("prefix");
        let pool = tollgate_redis::pool::connect(url, &PoolOptions::default())
            .await
            .expect("connect to the test Redis");
        let (stop, role) = if throttler {
            let (tx, rx) = oneshot::channel::<()>();
            let mut cfg = ThrottlerConfig::new(config());
            if let Some(block) = block {
                cfg.block = block;
            }
            let dispatchers = Arc::new(RedisDispatchers {
                pool: pool.clone(),
                keys: keys.clone(),
            });
            let role = tokio::spawn(async move {
                let shutdown = async {
                    let _ = rx.await;
                };
                tollgate_throttler::run(cfg, dispatchers, shutdown)
                    .await
                    .expect("throttler role");
            });
            (Some(tx), Some(role))
        } else {
            (None, None)
        };
        let throttle = RedisThrottle::start(pool, keys, &config(), options);
        assert!(
            throttle.subscribed(Duration::from_secs(5)).await,
            "subscribed"
        );
        Self {
            server,
            _cluster: cluster,
            prefix,
            throttle: Arc::new(throttle),
            stop,
            role,
        }
    }

    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(role) = self.role.take() {
            role.await.expect("throttler role stopped cleanly");
        }
    }
}

async fn memory() -> Arc<dyn Throttle> {
    Arc::new(MemoryThrottle::new(&config()))
}

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod memory_throttle {
            $(
                #[tokio::test]
                async fn $case() {
                    super::$case(super::memory().await).await;
                }
            )*
        }
        mod redis_throttle {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let setup = super::RedisSetup::start(true, Default::default()).await;
                    super::$case(setup.throttle.clone()).await;
                    setup.stop().await;
                }
            )*
        }
        mod cluster_throttle {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let setup = super::RedisSetup::cluster(true, Default::default()).await;
                    super::$case(setup.throttle.clone()).await;
                    setup.stop().await;
                }
            )*
        }
    };
}

conformance!(
    throttle_burst_then_rate,
    throttle_timeout_names_provider_and_wait,
    throttle_dropped_wait_burns_no_token,
    throttle_timed_out_waiters_leave_tokens_to_later_ones,
    throttle_unknown_provider,
    throttle_stats_show_the_bucket_and_its_waiters,
    throttle_fair_a_flood_does_not_starve_a_newcomer,
    throttle_fair_weights_split_the_grants,
    throttle_fair_a_single_user_is_served_in_order,
    throttle_fifo_provider_serves_in_arrival_order,
    throttle_fair_a_user_at_its_cap_waits_for_a_slot_to_end,
    throttle_fair_a_cancelled_waiter_leaves_the_rotation,
    throttle_fair_a_cap_parks_the_rest_in_order,
    throttle_fair_a_user_queueing_again_takes_its_turn,
    throttle_position_of_a_waiting_call,
    throttle_a_pause_holds_every_grant_until_it_ends,
    throttle_a_late_allowance_is_carved_from_the_burst,
    throttle_max_concurrent_holds_a_slot_until_done,
    throttle_adaptive_halves_the_rate_on_a_refusal,
    throttle_limits_a_grant_takes_from_every_limit,
    throttle_a_pool_of_one_grants_from_its_members_limits,
    throttle_limits_usage_gives_back_and_takes_within_bounds,
    throttle_limits_a_heavy_call_waits_its_turn_or_is_refused,
    throttle_a_late_grant_is_redated_while_the_bucket_stays_low,
    throttle_a_late_grant_is_not_redated_past_a_full_bucket,
    throttle_a_late_grant_is_not_redated_past_a_pause,
    throttle_pool_no_member_passes_its_limits,
    throttle_pool_a_user_stays_on_one_member,
    throttle_pool_a_paused_member_is_passed_over,
    throttle_pool_fifo_no_member_passes_its_limits,
);

fn share(weight: u32) -> Share {
    Share {
        weight,
        ..Share::default()
    }
}

/// Takes `provider`'s one token, so that what follows queues.
async fn drain_bucket(t: &Arc<dyn Throttle>, provider: &str) {
    t.acquire(provider, &rid("drain"), Duration::from_secs(10))
        .await
        .unwrap();
}

/// Waits until `provider` has `n` waiters (or fails after 10 s).
async fn until_waiting(t: &Arc<dyn Throttle>, provider: &str, n: u64) {
    for _ in 0..5000 {
        let stats = t.stats().await.unwrap();
        if stats
            .iter()
            .any(|p| p.provider == provider && p.waiters == n)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("{provider} never had {n} waiters");
}

type Granted = tokio::task::JoinHandle<(String, u64)>;

/// Queues one waiter of `user` on `provider` and waits until it is queued;
/// the handle yields its user and grant time.
async fn queue(t: &Arc<dyn Throttle>, provider: &str, user: &str, sh: Share, n: u64) -> Granted {
    let waiter = Waiter::of(&rid(&format!("{user}-{n}")), user, sh);
    let handle = {
        let t = Arc::clone(t);
        let provider = provider.to_owned();
        let user = user.to_owned();
        tokio::spawn(async move {
            let g = t
                .acquire_as(&provider, &waiter, Duration::from_secs(10))
                .await
                .unwrap();
            (user, g.granted_at_us)
        })
    };
    until_waiting(t, provider, n).await;
    handle
}

/// The users of the grants, in grant order.
async fn grant_order(handles: Vec<Granted>) -> Vec<String> {
    let mut grants = Vec::new();
    for h in handles {
        grants.push(h.await.unwrap());
    }
    grants.sort_by_key(|(_, at)| *at);
    grants.into_iter().map(|(u, _)| u).collect()
}

/// User a queues 5 calls, then user b 2: b's calls alternate with a's
/// instead of waiting for a's whole queue (a FIFO would serve b last).
async fn throttle_fair_a_flood_does_not_starve_a_newcomer(t: Arc<dyn Throttle>) {
    drain_bucket(&t, "tempo").await;
    let mut handles = Vec::new();
    for _ in 0..5 {
        handles.push(queue(&t, "tempo", "a", share(1), handles.len() as u64 + 1).await);
    }
    for _ in 0..2 {
        handles.push(queue(&t, "tempo", "b", share(1), handles.len() as u64 + 1).await);
    }
    let order = grant_order(handles).await;
    let last_b = order.iter().rposition(|u| u == "b").unwrap();
    assert!(last_b <= 4, "b's calls waited behind a's flood: {order:?}");
    assert_eq!(order.iter().filter(|u| *u == "a").count(), 5, "{order:?}");
}

/// Users of shares 4 and 1, both waiting: of the first 5 grants, 4 go to the
/// user of share 4.
async fn throttle_fair_weights_split_the_grants(t: Arc<dyn Throttle>) {
    drain_bucket(&t, "tempo").await;
    let mut handles = Vec::new();
    for _ in 0..4 {
        handles.push(queue(&t, "tempo", "pro", share(4), handles.len() as u64 + 1).await);
    }
    for _ in 0..4 {
        handles.push(queue(&t, "tempo", "free", share(1), handles.len() as u64 + 1).await);
    }
    let order = grant_order(handles).await;
    let pro = order[..5].iter().filter(|u| *u == "pro").count();
    assert_eq!(pro, 4, "{order:?}");
}

/// One user waiting gets every slot, in its own arrival order, at the full
/// rate: nothing changes for it.
async fn throttle_fair_a_single_user_is_served_in_order(t: Arc<dyn Throttle>) {
    drain_bucket(&t, "tempo").await;
    let mut handles = Vec::new();
    for n in 1..=4 {
        let waiter = Waiter::of(&rid(&format!("solo-{n}")), "solo", share(1));
        let t2 = Arc::clone(&t);
        handles.push(tokio::spawn(async move {
            let g = t2
                .acquire_as("tempo", &waiter, Duration::from_secs(10))
                .await
                .unwrap();
            (g.request_id.to_string(), g.granted_at_us)
        }));
        until_waiting(&t, "tempo", n).await;
    }
    let order = grant_order(handles).await;
    assert_eq!(order, ["solo-1", "solo-2", "solo-3", "solo-4"]);
}

/// `fairness = "fifo"`: one queue in arrival order, whoever waits.
async fn throttle_fifo_provider_serves_in_arrival_order(t: Arc<dyn Throttle>) {
    drain_bucket(&t, "turnstile").await;
    let mut handles = Vec::new();
    for user in ["a", "a", "a", "b"] {
        handles.push(queue(&t, "turnstile", user, share(1), handles.len() as u64 + 1).await);
    }
    assert_eq!(grant_order(handles).await, ["a", "a", "a", "b"]);
}

/// A user at its max_in_flight waits in its own queue until a call of its
/// ends; another user is not held up meanwhile.
async fn throttle_fair_a_user_at_its_cap_waits_for_a_slot_to_end(t: Arc<dyn Throttle>) {
    let capped = Share {
        max_in_flight: Some(1),
        ..share(1)
    };
    let first = t
        .acquire_as(
            "steady",
            &Waiter::of(&rid("c-1"), "c", capped),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert!(first.user_slot.is_some(), "{first:?}");
    let second = {
        let t = Arc::clone(&t);
        tokio::spawn(async move {
            t.acquire_as(
                "steady",
                &Waiter::of(&rid("c-2"), "c", capped),
                Duration::from_secs(10),
            )
            .await
        })
    };
    until_waiting(&t, "steady", 1).await;
    // The bucket has tokens: another user goes ahead of the capped one.
    t.acquire_as(
        "steady",
        &Waiter::of(&rid("o-1"), "other", share(1)),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!second.is_finished(), "granted past the user's cap");
    let users = t.stats().await.unwrap()[1].users;
    assert_eq!(users, 1, "the capped user still counts as waiting");
    t.done(&first).await.unwrap();
    let second = second.await.unwrap().unwrap();
    t.done(&second).await.unwrap();
    // Twice is harmless.
    t.done(&second).await.unwrap();
}

async fn next_grant(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Grant>) -> Grant {
    tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("a grant within 5 s")
        .expect("a grant")
}

/// Under a cap of 2, a user's 4 calls go out in its own order, never more than
/// 2 at once; another user's calls pass the parked ones. Tags: c 0 1 2 3, o 0 1.
async fn throttle_fair_a_cap_parks_the_rest_in_order(t: Arc<dyn Throttle>) {
    let capped = Share {
        max_in_flight: Some(2),
        ..share(1)
    };
    drain_bucket(&t, "tempo").await;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let calls = [
        ("c", capped),
        ("c", capped),
        ("c", capped),
        ("c", capped),
        ("o", share(1)),
        ("o", share(1)),
    ];
    for (n, (user, sh)) in (1..).zip(calls) {
        let waiter = Waiter::of(&rid(&format!("{user}-{n}")), user, sh);
        let (t2, tx) = (Arc::clone(&t), tx.clone());
        tokio::spawn(async move {
            let g = t2
                .acquire_as("tempo", &waiter, Duration::from_secs(10))
                .await
                .unwrap();
            let _ = tx.send(g);
        });
        until_waiting(&t, "tempo", n).await;
    }
    let mut first = Vec::new();
    for _ in 0..4 {
        first.push(next_grant(&mut rx).await);
    }
    let ids: Vec<String> = first.iter().map(|g| g.request_id.to_string()).collect();
    assert_eq!(ids, ["c-1", "o-5", "c-2", "o-6"]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(rx.try_recv().is_err(), "granted past the cap");
    let tempo = t.stats().await.unwrap().remove(2);
    assert_eq!((tempo.waiters, tempo.users), (2, 1), "{tempo:?}");
    // A parked call still has its place: behind c-3, nobody else ahead.
    let c4 = t.position("tempo", "c", &rid("c-4")).await.unwrap();
    let expected = Position {
        ahead: 1,
        others_ahead: 0,
        users: 1,
        weight: 1,
        paused: Duration::ZERO,
    };
    assert_eq!(c4, Some(expected));
    t.done(&first[0]).await.unwrap();
    let third = next_grant(&mut rx).await;
    assert_eq!(third.request_id.as_str(), "c-3");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(rx.try_recv().is_err(), "granted past the cap");
    t.done(&first[2]).await.unwrap();
    let fourth = next_grant(&mut rx).await;
    assert_eq!(fourth.request_id.as_str(), "c-4");
    for g in [&third, &fourth] {
        t.done(g).await.unwrap();
    }
}

/// A user whose calls come one at a time (each queued as soon as the last
/// is served) gets its turn and no more: against a flood, every other grant.
/// Its next call starts at the finish tag of its last, which is above the
/// virtual clock: were that forgotten once the user had nothing waiting, the
/// call would start at the clock, ahead of the flood, again and again.
async fn throttle_fair_a_user_queueing_again_takes_its_turn(t: Arc<dyn Throttle>) {
    drain_bucket(&t, "tempo").await;
    let mut handles = Vec::new();
    for _ in 0..4 {
        handles.push(queue(&t, "tempo", "flood", share(1), handles.len() as u64 + 1).await);
    }
    let one_by_one = {
        let t = Arc::clone(&t);
        tokio::spawn(async move {
            let mut grants = Vec::new();
            for n in 0..4 {
                let waiter = Waiter::of(&rid(&format!("again-{n}")), "again", share(1));
                let g = t
                    .acquire_as("tempo", &waiter, Duration::from_secs(10))
                    .await
                    .unwrap();
                grants.push(("again".to_owned(), g.granted_at_us));
            }
            grants
        })
    };
    let mut grants = Vec::new();
    for h in handles {
        grants.push(h.await.unwrap());
    }
    grants.extend(one_by_one.await.unwrap());
    grants.sort_by_key(|(_, at)| *at);
    let order: Vec<&str> = grants.iter().map(|(u, _)| u.as_str()).collect();
    assert_eq!(
        order,
        ["flood", "again", "flood", "again", "flood", "again", "flood", "again"]
    );
}

/// A waiter that gives up takes its user out of the rotation: no user is
/// left waiting, and the next token goes to the next caller.
async fn throttle_fair_a_cancelled_waiter_leaves_the_rotation(t: Arc<dyn Throttle>) {
    drain_bucket(&t, "tempo").await;
    let e = t
        .acquire_as(
            "tempo",
            &Waiter::of(&rid("gone-1"), "gone", share(1)),
            Duration::from_millis(50),
        )
        .await
        .unwrap_err();
    assert!(matches!(e, ThrottleError::Timeout { .. }), "{e:?}");
    let tempo = t.stats().await.unwrap().remove(2);
    assert_eq!((tempo.waiters, tempo.users), (0, 0), "{tempo:?}");
    let g = t
        .acquire_as(
            "tempo",
            &Waiter::of(&rid("next-1"), "next", share(1)),
            Duration::from_secs(5),
        )
        .await;
    assert!(g.is_ok(), "{g:?}");
}

/// A fresh bucket is full; a slot taken shows as a token fewer; a caller
/// waiting for `slow` (burst 1, 2/s) shows as a waiter until served.
async fn throttle_stats_show_the_bucket_and_its_waiters(t: Arc<dyn Throttle>) {
    let stats = t.stats().await.unwrap();
    let names: Vec<&str> = stats.iter().map(|p| p.provider.as_str()).collect();
    assert_eq!(
        names,
        [
            "slow",
            "steady",
            "tempo",
            "turnstile",
            "v-redate",
            "w-fifo",
            "w-limits",
            "wicket",
            "wicket-fifo",
            "x-late",
            "y-slots",
            "z-adaptive",
            "zz-failover",
            "zz-pool",
            "zz-pool-fifo",
            "zz-pool3",
            "zz-roomy"
        ]
    );
    assert_eq!(
        (stats[0].burst, stats[0].tokens, stats[0].waiters),
        (1, 1.0, 0)
    );
    t.acquire(
        "slow",
        &RequestId::new("s1").unwrap(),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let slow = t.stats().await.unwrap().remove(0);
    assert!(slow.tokens < 1.0, "{slow:?}");
    let waiter = {
        let t = Arc::clone(&t);
        tokio::spawn(async move {
            t.acquire(
                "slow",
                &RequestId::new("s2").unwrap(),
                Duration::from_secs(5),
            )
            .await
        })
    };
    let mut seen = false;
    for _ in 0..200 {
        let slow = t.stats().await.unwrap().remove(0);
        if slow.waiters == 1 {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    waiter.await.unwrap().unwrap();
    assert!(seen, "the waiter was never counted");
    assert_eq!(t.stats().await.unwrap()[0].waiters, 0);
}

/// 25 waiters at once on rate 20/s, burst 5: the bound holds between every two
/// grants, and the last grant comes when the rate allows (20 tokens / 20 per s).
async fn throttle_burst_then_rate(t: Arc<dyn Throttle>) {
    let records = run_waiters(t, "steady", "b", 25, Duration::from_secs(10)).await;
    let times: Vec<u64> = records
        .iter()
        .map(|r| r.granted_at_us.unwrap_or_else(|| panic!("{r:?}")))
        .collect();
    assert!(max_excess(&times, 20.0, 5) <= 1e-6, "{times:?}");
    let span = times.iter().max().unwrap() - times.iter().min().unwrap();
    assert!(span >= 999_000, "the bound makes this >= 1s: {span}µs");
    // Utilisation is a benchmark's figure (BENCHMARKS.md), not a test's: a
    // loaded machine delays grants (2.7 s seen in CI on the cluster). This
    // only catches grants that stall outright.
    assert!(
        span <= 8_000_000,
        "grants stalled: {span}µs for 1s of tokens"
    );
}

async fn throttle_timeout_names_provider_and_wait(t: Arc<dyn Throttle>) {
    t.acquire("slow", &rid("first"), Duration::from_secs(5))
        .await
        .unwrap();
    let started = Instant::now();
    let err = t
        .acquire("slow", &rid("second"), Duration::from_millis(150))
        .await
        .unwrap_err();
    let waited = started.elapsed();
    assert_eq!(err.to_string(), "provider slow: no slot within 150ms");
    assert!(err.is_transient());
    assert!(
        waited >= Duration::from_millis(150) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
}

/// A caller that goes away (its future dropped) does not take the next token.
async fn throttle_dropped_wait_burns_no_token(t: Arc<dyn Throttle>) {
    t.acquire("slow", &rid("first"), Duration::from_secs(5))
        .await
        .unwrap();
    let waiting = {
        let t = Arc::clone(&t);
        tokio::spawn(async move {
            t.acquire("slow", &rid("gone"), Duration::from_secs(9))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    waiting.abort();
    assert!(waiting.await.is_err(), "aborted before its token was due");
    // The token due at 500ms stays in the bucket: a caller after it gets it at once.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let g = t
        .acquire("slow", &rid("next"), Duration::from_millis(300))
        .await;
    assert!(g.is_ok(), "{g:?}");
}

/// Waiters with a short max_wait queued ahead of a patient one time out; the
/// next token goes to the patient one, not to a waiter that left.
async fn throttle_timed_out_waiters_leave_tokens_to_later_ones(t: Arc<dyn Throttle>) {
    let first = t
        .acquire("slow", &rid("first"), Duration::from_secs(5))
        .await
        .unwrap();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..5 {
        let t = Arc::clone(&t);
        set.spawn(async move {
            t.acquire(
                "slow",
                &rid(&format!("short-{i}")),
                Duration::from_millis(100),
            )
            .await
        });
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    let patient = t
        .acquire("slow", &rid("patient"), Duration::from_secs(5))
        .await
        .unwrap();
    while let Some(r) = set.join_next().await {
        let e = r.unwrap().unwrap_err();
        assert!(matches!(e, ThrottleError::Timeout { .. }), "{e:?}");
    }
    let gap = patient.granted_at_us - first.granted_at_us;
    // One token per 500ms: the patient waiter gets the very next one.
    assert!(
        (499_000..1_000_000).contains(&gap),
        "next token after {gap}µs"
    );
}

async fn throttle_unknown_provider(t: Arc<dyn Throttle>) {
    let e = t
        .acquire("nope", &rid("x"), Duration::from_secs(1))
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "unknown provider \"nope\" (providers: slow, steady, tempo, turnstile, v-redate, w-fifo, w-limits, wicket, wicket-fifo, x-late, y-slots, z-adaptive, zz-failover, zz-pool, zz-pool-fifo, zz-pool3, zz-roomy)"
    );
}

/// Where a waiting call stands: its place in its user's queue and the calls
/// of others served before it (fair), or its place in the one queue
/// (FIFO); nothing for a call that is not waiting, or is another user's. The
/// `wicket` providers grant one slot per 20 s: nothing moves while the test
/// looks.
async fn throttle_position_of_a_waiting_call(t: Arc<dyn Throttle>) {
    let position = |provider: &'static str, user: &'static str, id: &'static str| {
        let t = Arc::clone(&t);
        async move { t.position(provider, user, &rid(id)).await.unwrap() }
    };
    drain_bucket(&t, "wicket").await;
    let mut handles = Vec::new();
    for n in 1..=3 {
        handles.push(queue(&t, "wicket", "a", share(1), n).await);
    }
    for n in 4..=5 {
        handles.push(queue(&t, "wicket", "b", share(2), n).await);
    }
    let a3 = position("wicket", "a", "a-3").await;
    // Tags: a 0 1 2, b (share 2) 0 0.5: served a-1 b-4 b-5 a-2 a-3.
    let expected = Position {
        ahead: 2,
        others_ahead: 2,
        users: 2,
        weight: 1,
        paused: Duration::ZERO,
    };
    assert_eq!(a3, Some(expected));
    assert_eq!(a3.unwrap().grants_ahead(), 4);
    let b5 = position("wicket", "b", "b-5").await;
    let expected = Position {
        ahead: 1,
        others_ahead: 1,
        users: 2,
        weight: 2,
        paused: Duration::ZERO,
    };
    assert_eq!(b5, Some(expected));
    assert_eq!(
        position("wicket", "b", "a-3").await,
        None,
        "a's call, b's queue"
    );
    assert_eq!(position("wicket", "a", "a-9").await, None, "never queued");
    assert_eq!(
        position("wicket", "a", "a").await,
        None,
        "a prefix of a ticket"
    );

    drain_bucket(&t, "wicket-fifo").await;
    for (n, user) in [(1, "a"), (2, "a"), (3, "b")] {
        handles.push(queue(&t, "wicket-fifo", user, share(1), n).await);
    }
    let b3 = position("wicket-fifo", "b", "b-3").await;
    let expected = Position {
        ahead: 2,
        others_ahead: 0,
        users: 1,
        weight: 1,
        paused: Duration::ZERO,
    };
    assert_eq!(b3, Some(expected));

    for h in &handles {
        h.abort();
    }
    // Dropped waits are cancelled (in the background on Redis).
    for _ in 0..5000 {
        if position("wicket", "a", "a-1").await.is_none()
            && position("wicket-fifo", "b", "b-3").await.is_none()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("a dropped wait still has a position");
}

/// An upstream's refusal pauses the bucket: nothing is granted before the
/// pause ends, the queue's position shows it, and the rate comes back from an
/// empty bucket (no burst). A refusal naming no pause backs off 1 s, then
/// doubles when the next comes within that long after it ended; while one is
/// in force, a refusal counts nothing and a shorter named pause shortens
/// nothing.
async fn throttle_a_pause_holds_every_grant_until_it_ends(t: Arc<dyn Throttle>) {
    // `steady`: 20/s, burst 5, full. A Retry-After of 0 pauses nothing.
    let none = t.pause("steady", Some(Duration::ZERO)).await.unwrap();
    assert_eq!(none.left, Duration::ZERO);
    t.acquire("steady", &rid("before"), Duration::from_secs(5))
        .await
        .expect("a full bucket's token");
    let started = Instant::now();
    let started_us = tollgate_tests::throttle::now_us();
    let first = t.pause("steady", None).await.unwrap();
    assert_eq!(
        (first.strikes, first.rate),
        (1, 20.0),
        "not adaptive: the rate stays"
    );
    assert!(
        first.left > Duration::from_millis(900) && first.left <= Duration::from_secs(1),
        "{first:?}"
    );
    let again = t.pause("steady", None).await.unwrap();
    assert_eq!(
        again.strikes, 1,
        "a refusal during the pause counts nothing"
    );
    let shorter = t
        .pause("steady", Some(Duration::from_millis(100)))
        .await
        .unwrap();
    assert!(shorter.left > Duration::from_millis(800), "{shorter:?}");
    let stats = t.stats().await.unwrap();
    let steady = stats.iter().find(|p| p.provider == "steady").unwrap();
    assert!(
        (800..=1000).contains(&steady.paused_ms) && steady.tokens < 1.0,
        "{steady:?}"
    );
    // Every waiter waits for the pause's end, then goes at the rate.
    let waiters = tokio::spawn(run_waiters(
        Arc::clone(&t),
        "steady",
        "p",
        4,
        Duration::from_secs(5),
    ));
    until_waiting(&t, "steady", 4).await;
    let position = t
        .position("steady", "", &rid("p-0"))
        .await
        .unwrap()
        .or(t.position("steady", "", &rid("p-1")).await.unwrap())
        .expect("a waiter's place");
    assert!(
        position.paused > Duration::from_millis(500)
            && position.estimated_wait(20.0) >= position.paused,
        "{position:?}"
    );
    let records = waiters.await.unwrap();
    for r in &records {
        assert!(r.error.is_none(), "{r:?}");
        assert!(
            r.resumed_at_us >= started_us + 1_000_000,
            "granted {} µs into a 1 s pause: {r:?}",
            r.resumed_at_us - started_us
        );
    }
    let paused_ms = started.elapsed().as_millis() as u64;
    assert!(
        paused_ms >= 1000 + 150,
        "4 grants from an empty bucket at 20/s end >= 200 ms after the pause: {paused_ms} ms"
    );
    let times: Vec<u64> = records.iter().map(|r| r.granted_at_us.unwrap()).collect();
    let span = times.iter().max().unwrap() - times.iter().min().unwrap();
    // (150 ms at the rate; the in-process driver's timer may wake late for
    // the first grant: a few ms of slack. A burst would be ~0.)
    assert!(
        span >= 135_000,
        "after a pause the bucket refills from empty: 4 grants over {span} µs"
    );
    // The next refusal within a back-off's length after the pause ended
    // doubles it.
    let second = t.pause("steady", None).await.unwrap();
    assert_eq!(second.strikes, 2, "{second:?}");
    assert!(second.left > Duration::from_millis(1900), "{second:?}");
}

/// `x-late`: 20/s, burst 5, grants usable for 100 ms (two tokens' time): the
/// bucket grants from 5 - (20 * 0.1 - 1) = 4, so that calls sent up to 100 ms
/// after their grant still keep the upstream within burst + rate·t + 1; a
/// grant is usable for the allowance, not 1/rate.
async fn throttle_a_late_allowance_is_carved_from_the_burst(t: Arc<dyn Throttle>) {
    let first = t
        .acquire("x-late", &rid("first"), Duration::from_secs(5))
        .await
        .unwrap();
    let left = first
        .use_by
        .expect("a use-by")
        .saturating_duration_since(tokio::time::Instant::now());
    assert!(
        left > Duration::from_millis(60) && left <= Duration::from_millis(100),
        "usable for the allowance, not 1/rate (50 ms): {left:?}"
    );
    let records = run_waiters(t, "x-late", "l", 9, Duration::from_secs(10)).await;
    let mut times: Vec<u64> = records
        .iter()
        .map(|r| r.granted_at_us.unwrap_or_else(|| panic!("{r:?}")))
        .collect();
    times.push(first.granted_at_us);
    assert!(
        max_excess(&times, 20.0, 4) <= 1e-6,
        "granted past burst 4 + rate·t: {times:?}"
    );
    times.sort_unstable();
    // 4 from the bucket, then 6 at 20/s: 300 ms at least.
    let span = times[9] - times[0];
    assert!(span >= 299_000, "{span} µs");
}

/// `v-redate`'s bucket emptied by 6 calls taken on the way in, then one
/// call granted by the queue's server (a throttler, or the bucket's driver)
/// once a token is due: that grant, and when the bucket's 6 went.
async fn redate_setup(t: &Arc<dyn Throttle>) -> (Grant, u64) {
    let mut first = Vec::new();
    for i in 0..6 {
        let g = t
            .acquire(
                "v-redate",
                &rid(&format!("first-{i}")),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
        first.push(g.granted_at_us);
    }
    // Queued, unless a slow machine let a token come meanwhile.
    for i in 0..20 {
        let g = t
            .acquire(
                "v-redate",
                &rid(&format!("queued-{i}")),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
        if g.ticket.is_some() {
            return (g, first.into_iter().max().unwrap());
        }
    }
    panic!("no call queued behind an empty bucket");
}

/// Late past 250 ms (1/rate) with the bucket low since: re-dated, to be used
/// now, within 250 ms from now; the bucket gives no token for it.
async fn throttle_a_late_grant_is_redated_while_the_bucket_stays_low(t: Arc<dyn Throttle>) {
    let (late, _) = redate_setup(&t).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let redated = t
        .redate(&late)
        .await
        .unwrap()
        .expect("re-dated: the bucket held at most 1.2 of its 3 since the grant");
    assert!(
        redated.granted_at_us >= late.granted_at_us + 250_000,
        "{} after {}",
        redated.granted_at_us,
        late.granted_at_us
    );
    let left = redated
        .use_by
        .expect("a use-by")
        .saturating_duration_since(tokio::time::Instant::now());
    assert!(
        left > Duration::ZERO && left <= Duration::from_millis(250),
        "{left:?}"
    );
    assert_eq!(redated.ticket, late.ticket);
    let stats = t.stats().await.unwrap();
    let bucket = stats.iter().find(|p| p.provider == "v-redate").unwrap();
    assert!(
        bucket.tokens < 1.5,
        "no token taken or given: {}",
        bucket.tokens
    );
    t.done(&redated).await.unwrap();
}

/// The grant went late and the bucket refilled to its 6 meanwhile (its
/// refill past the cap wasted): 6 calls take them at once. Re-dated now,
/// the late grant would be a seventh call at once, past burst + rate·t.
async fn throttle_a_late_grant_is_not_redated_past_a_full_bucket(t: Arc<dyn Throttle>) {
    let (late, _) = redate_setup(&t).await;
    // Full again 1.5 s after the grant (0 + 4/s): a margin for a slow machine.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let mut times = vec![late.granted_at_us];
    for i in 0..6 {
        let g = t
            .acquire(
                "v-redate",
                &rid(&format!("full-{i}")),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
        times.push(g.granted_at_us);
    }
    let redated = t.redate(&late).await.unwrap();
    if let Some(r) = &redated {
        // Its call would go now, on a token counted at the grant.
        times[0] = r.granted_at_us;
    }
    let excess = max_excess(&times, 4.0, 6);
    assert!(
        redated.is_none() && excess <= 1e-6,
        "re-dated past a full bucket: {redated:?}, {excess} calls past burst + rate·t"
    );
}

/// A pause since the grant emptied the bucket: a grant made before it is
/// never re-dated (its call would be one the pause's end does not allow).
async fn throttle_a_late_grant_is_not_redated_past_a_pause(t: Arc<dyn Throttle>) {
    let (late, _) = redate_setup(&t).await;
    t.pause("v-redate", Some(Duration::from_millis(100)))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        t.redate(&late).await.unwrap(),
        None,
        "re-dated past a pause"
    );
}

/// `y-slots`: at most 2 calls in flight across every caller, whatever the
/// bucket holds: a slot is held from the grant to `done`; a waiter past its
/// `max_wait` while all are held times out; the slot that ends goes to the
/// next waiter at once (a throttler is woken, not polled).
async fn throttle_max_concurrent_holds_a_slot_until_done(t: Arc<dyn Throttle>) {
    let wait = Duration::from_secs(5);
    let a = t.acquire("y-slots", &rid("s1"), wait).await.unwrap();
    let b = t.acquire("y-slots", &rid("s2"), wait).await.unwrap();
    assert!(a.slot.is_some() && b.slot.is_some(), "{a:?}");
    let e = t
        .acquire("y-slots", &rid("s3"), Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(matches!(e, ThrottleError::Timeout { .. }), "{e:?}");
    let third = {
        let t = Arc::clone(&t);
        tokio::spawn(async move { t.acquire("y-slots", &rid("s4"), wait).await })
    };
    until_waiting(&t, "y-slots", 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!third.is_finished(), "granted with both slots held");
    let ended = Instant::now();
    t.done(&a).await.unwrap();
    let c = third.await.unwrap().expect("the slot that ended");
    assert!(
        ended.elapsed() < Duration::from_millis(500),
        "the ended slot went to the waiter after {:?}",
        ended.elapsed()
    );
    t.done(&a).await.unwrap(); // twice: harmless
    let e = t
        .acquire("y-slots", &rid("s5"), Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(
        matches!(e, ThrottleError::Timeout { .. }),
        "a done twice freed two slots"
    );
    t.done(&b).await.unwrap();
    t.done(&c).await.unwrap();
    let d = t.acquire("y-slots", &rid("s6"), wait).await.unwrap();
    t.done(&d).await.unwrap();
}

/// `z-adaptive` (20/s, burst 2, `adaptive = true`): a refusal halves the rate
/// the bucket refills at; one while the pause is in force (its calls in
/// flight) halves nothing more; the next after it halves again, and the
/// grants after it come at that rate, growing back by 2/s per second.
async fn throttle_adaptive_halves_the_rate_on_a_refusal(t: Arc<dyn Throttle>) {
    let rate = |t: &Arc<dyn Throttle>| {
        let t = Arc::clone(t);
        async move {
            let stats = t.stats().await.unwrap();
            stats
                .iter()
                .find(|p| p.provider == "z-adaptive")
                .unwrap()
                .effective_rate
        }
    };
    assert_eq!(rate(&t).await, 20.0);
    let first = t
        .pause("z-adaptive", Some(Duration::from_millis(200)))
        .await
        .unwrap();
    assert_eq!(first.rate, 10.0);
    let during = t.pause("z-adaptive", None).await.unwrap();
    assert_eq!(
        during.rate, 10.0,
        "a refusal during the pause halves nothing"
    );
    assert!((rate(&t).await - 10.0).abs() < 0.01);
    tokio::time::sleep(Duration::from_millis(250)).await;
    let started = Instant::now();
    let second = t
        .pause("z-adaptive", Some(Duration::from_millis(100)))
        .await
        .unwrap();
    assert!(
        second.rate > 5.0 && second.rate < 5.3,
        "halved again (from ~10.1): {second:?}"
    );
    // From the pause's end, an empty bucket at ~5/s (growing 2/s per s): 3
    // grants take ~0.55 s more (at 20/s they would take 0.15 s).
    let records = run_waiters(Arc::clone(&t), "z-adaptive", "a", 3, Duration::from_secs(5)).await;
    assert!(records.iter().all(|r| r.error.is_none()), "{records:?}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(550),
        "3 grants after the pause at the halved rate took {took:?}"
    );
    assert!(rate(&t).await < 20.0);
}

/// A call of `weight` on `provider`, anonymous.
async fn weighing(
    t: &Arc<dyn Throttle>,
    provider: &str,
    id: &str,
    weight: u64,
) -> Result<Grant, ThrottleError> {
    let waiter = Waiter::anonymous(&rid(id)).weighing(weight);
    t.acquire_as(provider, &waiter, Duration::from_secs(5))
        .await
}

/// What each limit of `provider` holds now, by name.
async fn available(t: &Arc<dyn Throttle>, provider: &str) -> Vec<(String, f64)> {
    let stats = t.stats().await.unwrap();
    let p = stats.iter().find(|p| p.provider == provider).unwrap();
    p.limits
        .iter()
        .map(|l| (l.limit.clone(), l.available))
        .collect()
}

/// `zz-pool`: a pool of one member whose limits are w-limits': its grants
/// take from them (three calls of 10 empty its token burst of 30 at once),
/// the fourth waits for the refill, and they go to the member's url.
async fn throttle_a_pool_of_one_grants_from_its_members_limits(t: Arc<dyn Throttle>) {
    let full = available(&t, "zz-pool").await;
    assert_eq!(
        full,
        vec![
            ("requests/1s".to_owned(), 4.0),
            ("tokens/1s".to_owned(), 30.0)
        ],
        "the member's limits are the pool's"
    );
    let started = Instant::now();
    for i in 0..3 {
        let g = weighing(&t, "zz-pool", &format!("m{i}"), 10).await.unwrap();
        assert_eq!((g.provider.as_str(), g.weight), ("zz-pool", 10));
    }
    let since = started.elapsed().as_secs_f64();
    let after = available(&t, "zz-pool").await;
    assert!(after[1].1 < 0.5 + 100.0 * since, "{after:?}");
    let before = Instant::now();
    weighing(&t, "zz-pool", "m3", 10).await.unwrap();
    let waited = before.elapsed();
    assert!(
        waited >= Duration::from_millis(110) && waited < Duration::from_millis(600),
        "the fourth waited for 10 tokens at ~68/s: {waited:?}"
    );
    // Heavier than the member's token burst: refused before it waits.
    let e = weighing(&t, "zz-pool", "m4", 31).await.unwrap_err();
    assert!(
        matches!(e, ThrottleError::TooHeavy { most: 30, .. }),
        "{e:?}"
    );
    let pool = config();
    let p = pool.provider("zz-pool").unwrap();
    assert_eq!(p.members[0].name, "only");
    assert_eq!(pool.upstream("zz-pool").unwrap().url, "http://127.0.0.1:9");
}

/// `w-limits`: 40 calls and 100 tokens per 1 s (bursts 4 and 30). A grant
/// takes one request and its weight in one step: three calls of weight 10
/// empty the token limit at once, and the fourth waits for 10 tokens (at
/// (100 - 30) / (1 s + the late bound) ≈ 68/s: ~150 ms), though requests
/// are left; calls of weight 1 are bound by the request limit instead.
async fn throttle_limits_a_grant_takes_from_every_limit(t: Arc<dyn Throttle>) {
    let full = available(&t, "w-limits").await;
    assert_eq!(
        full,
        vec![
            ("requests/1s".to_owned(), 4.0),
            ("tokens/1s".to_owned(), 30.0)
        ],
        "a fresh provider's limits are full"
    );
    let started = Instant::now();
    for i in 0..3 {
        let g = weighing(&t, "w-limits", &format!("h{i}"), 10)
            .await
            .unwrap();
        assert_eq!(g.weight, 10);
    }
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "{:?}",
        started.elapsed()
    );
    let after = available(&t, "w-limits").await;
    // What refilled since the first grant (100 tokens and 40 requests a
    // second) is allowed for: a loaded machine stretches it.
    let since = started.elapsed().as_secs_f64();
    assert!(
        after[1].1 < 0.5 + 100.0 * since,
        "three calls of 10 took 30 tokens: {after:?}"
    );
    let refilled = 40.0 * since;
    assert!(
        after[0].1 >= 0.9 && after[0].1 < 1.1 + refilled,
        "and three requests of 4 ({refilled:.2} refilled since): {after:?}"
    );
    let before = Instant::now();
    weighing(&t, "w-limits", "h3", 10).await.unwrap();
    let waited = before.elapsed();
    assert!(
        waited >= Duration::from_millis(110) && waited < Duration::from_millis(600),
        "the fourth waited for 10 tokens at ~68/s: {waited:?}"
    );
    // Weight 1: the request limit binds (35/s after its burst).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let records = run_waiters(
        Arc::clone(&t),
        "w-limits",
        "light",
        12,
        Duration::from_secs(5),
    )
    .await;
    let times: Vec<u64> = records
        .iter()
        .map(|r| r.granted_at_us.unwrap_or_else(|| panic!("{r:?}")))
        .collect();
    assert!(
        max_excess(&times, 35.0, 4) <= 1e-6,
        "light calls went past the request limit: {times:?}"
    );
}

/// `w-limits`: a reported usage below the weight gives the difference back
/// (a waiting call then goes at once), one above takes more (never below
/// empty), and nothing goes past the burst.
async fn throttle_limits_usage_gives_back_and_takes_within_bounds(t: Arc<dyn Throttle>) {
    use tollgate_core::throttle::Usage;
    let g = weighing(&t, "w-limits", "u0", 30).await.unwrap();
    assert!(available(&t, "w-limits").await[1].1 < 2.0);
    assert_eq!(t.usage(&g, 30).await.unwrap(), Usage::Matched);
    assert_eq!(t.usage(&g, 6).await.unwrap(), Usage::GivenBack(24));
    let back = available(&t, "w-limits").await[1].1;
    assert!((24.0..28.0).contains(&back), "24 given back: {back}");
    let started = Instant::now();
    let h = weighing(&t, "w-limits", "u1", 20).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(60),
        "the tokens given back were granted at once: {:?}",
        started.elapsed()
    );
    // It used 40 of its 20: 20 more taken, below empty (~5 were left): the
    // debt of a weight declared too low, which later grants wait for.
    assert_eq!(t.usage(&h, 40).await.unwrap(), Usage::Taken(20));
    let debt = available(&t, "w-limits").await[1].1;
    assert!((-16.0..-12.0).contains(&debt), "taken below empty: {debt}");
    let started = Instant::now();
    weighing(&t, "w-limits", "u2", 5).await.unwrap();
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(200),
        "5 tokens from ~15 below empty at ~68/s: {waited:?}"
    );
    // A call that used far more than a burst owes all of it (up to a
    // minute of the refill), not only one burst.
    assert_eq!(t.usage(&h, 200).await.unwrap(), Usage::Taken(180));
    let owed = available(&t, "w-limits").await[1].1;
    assert!((-200.0..-160.0).contains(&owed), "the whole debt: {owed}");
    // Full again (~210 tokens at ~68/s), a give-back adds nothing past the burst.
    tokio::time::sleep(Duration::from_millis(3600)).await;
    assert_eq!(t.usage(&g, 0).await.unwrap(), Usage::GivenBack(30));
    let capped = available(&t, "w-limits").await[1].1;
    assert!(capped <= 30.0 + 1e-9, "past the burst: {capped}");
}

/// `w-fifo` (the same limits, one queue): a call heavier than the token
/// burst is refused at once; a heavy call queued first is served first
/// (lighter ones behind it do not pass it), when its tokens are there.
async fn throttle_limits_a_heavy_call_waits_its_turn_or_is_refused(t: Arc<dyn Throttle>) {
    let started = Instant::now();
    let e = weighing(&t, "w-fifo", "big", 31).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_millis(500));
    assert!(
        matches!(
            &e,
            ThrottleError::TooHeavy {
                weight: 31,
                most: 30,
                ..
            }
        ) && e.to_string().contains("tokens/1s"),
        "{e}"
    );
    assert!(!e.is_transient());
    weighing(&t, "w-fifo", "all", 30).await.unwrap();
    let heavy = {
        let t = Arc::clone(&t);
        tokio::spawn(async move {
            let g = weighing(&t, "w-fifo", "heavy", 25).await.unwrap();
            (g.granted_at_us, Instant::now())
        })
    };
    until_waiting(&t, "w-fifo", 1).await;
    let light = {
        let t = Arc::clone(&t);
        tokio::spawn(async move {
            weighing(&t, "w-fifo", "light", 1)
                .await
                .unwrap()
                .granted_at_us
        })
    };
    let ((heavy_at, heavy), light_at) = (heavy.await.unwrap(), light.await.unwrap());
    // (Granted in one step, both have the same time: woken in either order.)
    assert!(
        heavy_at <= light_at,
        "the light call passed the heavy one queued before it: {heavy_at} > {light_at}"
    );
    let took = heavy.duration_since(started);
    assert!(
        took >= Duration::from_millis(300),
        "25 tokens from empty at ~68/s take ~370 ms: {took:?}"
    );
}

/// Each call of `calls` (its user, its weight) waits for a slot of `provider`
/// at once, and ends its call as soon as it is granted; the grants' members
/// and times, in grant order.
async fn pool_grants(
    t: &Arc<dyn Throttle>,
    provider: &str,
    calls: Vec<(String, u64)>,
) -> Vec<(String, u64)> {
    let handles: Vec<_> = calls
        .into_iter()
        .enumerate()
        .map(|(i, (user, weight))| {
            let t = Arc::clone(t);
            let provider = provider.to_owned();
            tokio::spawn(async move {
                let waiter =
                    Waiter::of(&rid(&format!("{user}-{i}")), &user, share(1)).weighing(weight);
                let g = t
                    .acquire_as(&provider, &waiter, Duration::from_secs(30))
                    .await
                    .unwrap();
                t.done(&g).await.unwrap();
                (
                    g.member.expect("a pool's grant names its member"),
                    g.granted_at_us,
                )
            })
        })
        .collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out.sort_by_key(|(_, at)| *at);
    out
}

/// `zz-pool3`: three members of 10, 20 and 5 calls per second (bursts 2,
/// 4 and 1; b weighted 2, with a token limit too; c at most 2 in flight).
/// 120 calls of 4 users at once, far above what the pool grants: no member
/// ever passes its own request bucket (burst + rate·t over the grant
/// times, the bound `throttle_limits.rs` checks per provider), every member
/// is used, and the pool grants at near the sum of its members' rates.
async fn throttle_pool_no_member_passes_its_limits(t: Arc<dyn Throttle>) {
    let config = config();
    let p = config.provider("zz-pool3").unwrap();
    let calls = (0..120).map(|i| (format!("u{}", i % 4), 5)).collect();
    let grants = pool_grants(&t, "zz-pool3", calls).await;
    assert_eq!(grants.len(), 120);
    let (mut rates, mut bursts) = (0.0, 0.0);
    for m in p.pool() {
        let own = p.as_member(m);
        let times: Vec<u64> = grants
            .iter()
            .filter(|(name, _)| *name == m.name)
            .map(|(_, at)| *at)
            .collect();
        let excess = max_excess(&times, own.rate, own.bucket_burst() as u64);
        assert!(
            excess <= 1e-3,
            "member {} passed its bucket (rate {}, burst {}) by {excess}: {} grants",
            m.name,
            own.rate,
            own.bucket_burst(),
            times.len()
        );
        assert!(
            times.len() >= 5,
            "member {} was hardly used: {grants:?}",
            m.name
        );
        rates += own.rate;
        bursts += own.bucket_burst();
    }
    // The pool's throughput: 120 grants take (120 - bursts) / rates at
    // full use of every member; a loaded machine delays some.
    let span = (grants[119].1 - grants[0].1) as f64 / 1e6;
    let ideal = (120.0 - bursts) / rates;
    assert!(
        span <= ideal * 1.4 + 0.3,
        "120 grants took {span:.2} s; the members' rates allow {ideal:.2} s"
    );
}

/// `zz-roomy`: with room to spare, each user's calls stay on one member
/// (providers' prompt caches are per account), and new users are spread.
async fn throttle_pool_a_user_stays_on_one_member(t: Arc<dyn Throttle>) {
    let mut by_user: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for round in 0..20 {
        let calls = (0..6).map(|u| (format!("s{u}"), 1)).collect::<Vec<_>>();
        let users: Vec<String> = calls.iter().map(|(u, _)| u.clone()).collect();
        // One call of each user at a time, in parallel: rid per round.
        let handles: Vec<_> = users
            .iter()
            .map(|user| {
                let t = Arc::clone(&t);
                let user = user.clone();
                tokio::spawn(async move {
                    let waiter = Waiter::of(&rid(&format!("{user}-r{round}")), &user, share(1));
                    let g = t
                        .acquire_as("zz-roomy", &waiter, Duration::from_secs(10))
                        .await
                        .unwrap();
                    t.done(&g).await.unwrap();
                    (user, g.member.unwrap())
                })
            })
            .collect();
        for h in handles {
            let (user, member) = h.await.unwrap();
            by_user.entry(user).or_default().push(member);
        }
    }
    let mut firsts = std::collections::BTreeSet::new();
    for (user, members) in &by_user {
        let first = &members[0];
        let same = members.iter().filter(|m| *m == first).count();
        assert!(
            same * 100 >= members.len() * 95,
            "{user}'s calls moved between members: {members:?}"
        );
        firsts.insert(first.clone());
    }
    assert!(
        firsts.len() >= 2,
        "new users all went to one member: {by_user:?}"
    );
}

/// A member whose upstream refused (`Throttle::pause_member`, as a 429
/// with `Retry-After`) grants nothing until the pause ends, to anyone; the
/// other members take its calls, and it is back after.
async fn throttle_pool_a_paused_member_is_passed_over(t: Arc<dyn Throttle>) {
    let pause = t
        .pause_member("zz-roomy", "a", Some(Duration::from_millis(1500)))
        .await
        .unwrap();
    assert!(pause.left > Duration::from_millis(1400), "{pause:?}");
    let paused_at = Instant::now();
    let calls = (0..60).map(|i| (format!("p{}", i % 12), 1)).collect();
    let during = pool_grants(&t, "zz-roomy", calls).await;
    assert!(
        paused_at.elapsed() < Duration::from_millis(1400),
        "too slow to test the pause"
    );
    assert!(
        during.iter().all(|(m, _)| m != "a"),
        "a paused member was granted: {during:?}"
    );
    assert!(during.iter().any(|(m, _)| m == "b") && during.iter().any(|(m, _)| m == "c"));
    // A member the pool does not list pauses nothing.
    let none = t.pause_member("zz-roomy", "zz", None).await.unwrap();
    assert_eq!(none.left, Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(1600).saturating_sub(paused_at.elapsed())).await;
    let calls = (0..30).map(|i| (format!("q{i}"), 1)).collect();
    let after = pool_grants(&t, "zz-roomy", calls).await;
    assert!(
        after.iter().any(|(m, _)| m == "a"),
        "the member is back after its pause: {after:?}"
    );
}

/// `zz-pool-fifo`: a FIFO pool of two members (10 and 20 calls per second,
/// b with a token limit too): 60 calls of weight 8 at once are all granted,
/// in arrival order's queue, no member passing its own bucket, both used.
async fn throttle_pool_fifo_no_member_passes_its_limits(t: Arc<dyn Throttle>) {
    let config = config();
    let p = config.provider("zz-pool-fifo").unwrap();
    let calls = (0..60).map(|i| (format!("f{i}"), 8)).collect();
    let grants = pool_grants(&t, "zz-pool-fifo", calls).await;
    assert_eq!(grants.len(), 60);
    for m in p.pool() {
        let own = p.as_member(m);
        let times: Vec<u64> = grants
            .iter()
            .filter(|(name, _)| *name == m.name)
            .map(|(_, at)| *at)
            .collect();
        let excess = max_excess(&times, own.rate, own.bucket_burst() as u64);
        assert!(
            excess <= 1e-3,
            "member {} passed its bucket by {excess}",
            m.name
        );
        assert!(
            times.len() >= 10,
            "member {} was hardly used: {grants:?}",
            m.name
        );
    }
}
