//! A pool's members are seen (issue 50 item 5): the throttle's stats,
//! Prometheus, the dashboard's overview and a job's timeline name each
//! member (never its secret), on memory and Redis. Before, a pool's stats
//! showed the provider's own bucket, which no grant ever writes: full and
//! never paused.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tollgate_core::config::Config;
use tollgate_core::metrics::Metrics;
use tollgate_core::throttle::{Grant, ProviderStats, Share, Throttle, Waiter};
use tollgate_memory::throttle::MemoryThrottle;
use tollgate_providers::CallOptions;
use tollgate_tests::upstream::Upstream;

use crate::throttle::{rid, RedisSetup};

/// A throttle of the conformance config (its pools: `zz-pool3`, three
/// members with their own limits; `zz-failover`), kept with its Redis.
pub struct Pod {
    throttle: Arc<dyn Throttle>,
    setup: Option<RedisSetup>,
}

impl Pod {
    async fn memory() -> Self {
        Self {
            throttle: Arc::new(MemoryThrottle::new(&crate::throttle::config())),
            setup: None,
        }
    }

    async fn redis() -> Self {
        let setup = RedisSetup::start(true, Default::default()).await;
        Self {
            throttle: setup.throttle.clone(),
            setup: Some(setup),
        }
    }

    async fn cluster() -> Self {
        let setup = RedisSetup::cluster(true, Default::default()).await;
        Self {
            throttle: setup.throttle.clone(),
            setup: Some(setup),
        }
    }

    async fn stop(self) {
        if let Some(s) = self.setup {
            s.stop().await;
        }
    }
}

async fn pool_of(t: &dyn Throttle, provider: &str) -> ProviderStats {
    let stats = t.stats().await.expect("stats");
    stats
        .into_iter()
        .find(|s| s.provider == provider)
        .expect("the pool's stats")
}

fn names(s: &ProviderStats) -> Vec<&str> {
    s.members.iter().map(|m| m.member.as_str()).collect()
}

/// Each member's limits (name, burst, rate), as the stats show them.
fn limits(s: &ProviderStats) -> Vec<Vec<(String, f64, f64)>> {
    s.members
        .iter()
        .map(|m| {
            m.limits
                .iter()
                .map(|l| (l.limit.clone(), l.burst, l.rate))
                .collect()
        })
        .collect()
}

async fn stats_name_each_member_and_its_pause(pod: Pod) {
    let t = &*pod.throttle;
    let s = pool_of(t, "zz-pool3").await;
    assert_eq!(names(&s), ["a", "b", "c"], "{s:?}");
    // Each member's own limits, as its config makes them (a windowed
    // limit's bucket refills below its rate: burst + rate·per within it).
    let config = crate::throttle::config();
    let p = config.provider("zz-pool3").expect("zz-pool3");
    let want: Vec<Vec<(String, f64, f64)>> = p
        .pool()
        .iter()
        .map(|m| {
            let own = p.as_member(m);
            let mut l = vec![(own.rate_name(), own.bucket_burst(), own.rate)];
            l.extend(
                own.limits
                    .iter()
                    .map(|x| (x.name(), x.burst as f64, x.rate)),
            );
            l
        })
        .collect();
    assert_eq!(limits(&s), want, "{s:?}");
    assert_eq!(
        want.iter().map(|l| (l.len(), l[0].1)).collect::<Vec<_>>(),
        [(1, 2.0), (2, 4.0), (1, 1.0)]
    );
    assert_eq!(want[1][1].0, "tokens/1s");
    // The provider's row is the pool's: its members' request buckets summed.
    let rate: f64 = want.iter().map(|l| l[0].2).sum();
    assert_eq!(
        (s.burst, s.rate, s.effective_rate),
        (7, rate, rate),
        "{s:?}"
    );
    assert_eq!(s.limits.len(), 1, "{s:?}");
    assert_eq!((s.limits[0].burst, s.limits[0].rate), (7.0, rate));
    assert!((s.tokens - 7.0).abs() < 1e-6, "a full pool: {s:?}");

    // Three grants to three users: each member's grants, tokens and slots.
    let mut grants: Vec<Grant> = Vec::new();
    for u in ["u1", "u2", "u3"] {
        let w = Waiter::of(&rid(&format!("seen-{u}")), u, Share::default());
        grants.push(
            t.acquire_as("zz-pool3", &w, Duration::from_secs(5))
                .await
                .expect("granted"),
        );
    }
    let s = pool_of(t, "zz-pool3").await;
    let granted_to = |name: &str| {
        grants
            .iter()
            .filter(|g| g.member.as_deref() == Some(name))
            .count() as u64
    };
    let total: u64 = s.members.iter().map(|m| m.grants).sum();
    assert_eq!(total, 3, "{s:?}");
    for m in &s.members {
        assert_eq!(m.grants, granted_to(&m.member), "{s:?}");
        // c has max_concurrent: its grants hold slots until done.
        let held = if m.member == "c" { m.grants } else { 0 };
        assert_eq!(m.in_flight, held, "{s:?}");
        let l = &m.limits[0];
        assert!(l.available <= l.burst && l.available >= 0.0, "{s:?}");
    }
    // Taken from the members, seen in the pool's row (refills allowed).
    let sum: f64 = s.members.iter().map(|m| m.limits[0].available).sum();
    assert!((s.tokens - sum).abs() < 1e-6, "{s:?}");
    assert!(s.tokens < 6.0, "three tokens taken from 7: {s:?}");
    for g in &grants {
        t.done(g).await.expect("done");
    }
    let s = pool_of(t, "zz-pool3").await;
    assert!(s.members.iter().all(|m| m.in_flight == 0), "{s:?}");

    // b is backed off: it shows paused, the others and the pool do not.
    t.pause_member("zz-pool3", "b", Some(Duration::from_secs(5)))
        .await
        .expect("paused");
    let s = pool_of(t, "zz-pool3").await;
    let paused: Vec<u64> = s.members.iter().map(|m| m.paused_ms).collect();
    assert!(paused[1] > 4000 && paused[1] <= 5000, "{s:?}");
    assert_eq!((paused[0], paused[2], s.paused_ms), (0, 0, 0), "{s:?}");
    // Every member paused: the pool is, until the first comes back.
    t.pause_member("zz-pool3", "a", Some(Duration::from_secs(2)))
        .await
        .expect("paused");
    t.pause_member("zz-pool3", "c", Some(Duration::from_secs(3)))
        .await
        .expect("paused");
    let s = pool_of(t, "zz-pool3").await;
    assert!(s.paused_ms > 1000 && s.paused_ms <= 2000, "{s:?}");
    // A provider served as one upstream lists no members.
    assert!(pool_of(t, "steady").await.members.is_empty());
    pod.stop().await;
}

mod stats {
    use super::*;
    on_each_backend!(
        [stats_name_each_member_and_its_pause]
        memory => super::Pod::memory().await,
        redis => super::Pod::redis().await,
        cluster => super::Pod::cluster().await,
    );
}

/// The value of the series `line_start` (its name and labels) in `text`.
fn series(text: &str, line_start: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(line_start)?.trim().parse().ok())
}

/// Calls through a pool's client, a member refusing one: Prometheus shows
/// each member's grants, calls by outcome and back-offs, and its buckets.
async fn metrics_name_each_member(pod: Pod) {
    let upstreams = [
        Upstream::unlimited(Duration::ZERO).await,
        Upstream::unlimited(Duration::ZERO).await,
        Upstream::unlimited(Duration::ZERO).await,
    ];
    let config: Config = crate::throttle_pool::config(&upstreams);
    let metrics = Arc::new(Metrics::new(&config));
    let clients = tollgate_providers::from_config(&config, Arc::clone(&pod.throttle), &metrics)
        .expect("clients");
    let client = &clients["zz-failover"];
    // b refuses its first call: 429 with Retry-After: 5.
    upstreams[1].refuse_at(Instant::now(), "5");
    for i in 0..9 {
        let job = tollgate_tests::jobs::job(
            &format!("m{i}"),
            &format!("v{i}"),
            "fw",
            "zz-failover",
            json!({}),
        );
        client
            .call(&job, CallOptions::default())
            .await
            .expect("answered");
    }
    let jobs = tollgate_memory::backends(Arc::new(config.clone())).jobs;
    let failed = metrics
        .refresh(jobs.as_ref(), pod.throttle.as_ref(), Duration::from_secs(5))
        .await;
    assert!(failed.is_empty(), "{failed:?}");
    let text = metrics.render();
    let at = |name: &str, member: &str, extra: &str| {
        series(
            &text,
            &format!("{name}{{provider=\"zz-failover\",member=\"{member}\"{extra}}}"),
        )
    };
    let shown = || {
        text.lines()
            .filter(|l| l.contains("pool_member"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let mut grants = 0.0;
    let mut ok = 0.0;
    for m in ["a", "b", "c"] {
        let g = at("tollgate_pool_member_grants_total", m, "").expect("grants");
        assert!(g >= 1.0, "member {m}: {}", shown());
        grants += g;
        ok += at("tollgate_pool_member_calls_total", m, ",outcome=\"ok\"").expect("ok");
        let tokens = at("tollgate_pool_member_tokens", m, "").expect("tokens");
        assert!((0.0..=2.0).contains(&tokens), "member {m}: {}", shown());
        assert!(at("tollgate_pool_member_effective_rate", m, "").is_some());
    }
    // Nine answered, one refused (and granted again elsewhere).
    assert_eq!((grants, ok), (10.0, 9.0), "{}", shown());
    let refused = at("tollgate_pool_member_calls_total", "b", ",outcome=\"429\"");
    assert_eq!(refused, Some(1.0), "{}", shown());
    let pauses: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|m| at("tollgate_pool_member_pauses_total", m, ""))
        .collect();
    assert_eq!(pauses, [Some(0.0), Some(1.0), Some(0.0)], "{}", shown());
    let paused = at("tollgate_pool_member_paused_seconds", "b", "").expect("paused");
    assert!(paused > 3.0 && paused <= 5.0, "{}", shown());
    assert_eq!(
        at("tollgate_pool_member_paused_seconds", "a", ""),
        Some(0.0)
    );
    // No member label names anything but a configured member.
    metrics.member_granted("zz-failover", "not-a-member");
    metrics.member_granted("steady", "a");
    let text = metrics.render();
    assert!(!text.contains("not-a-member"), "{}", shown());
    assert!(!text.contains("provider=\"steady\",member="), "{}", shown());
    pod.stop().await;
}

mod metrics {
    use super::*;
    on_each_backend!(
        [metrics_name_each_member]
        memory => super::Pod::memory().await,
        redis => super::Pod::redis().await,
    );
}

/// A pool of three of the api's config (`crate::api::test_config_with`).
const SEEN: &str = r#"
[providers.seen]
max_wait = "10s"
members = [
  { name = "east", url = "http://127.0.0.1:9", limits = [{ rate = 10, per = "1s", burst = 2 }] },
  { name = "west", url = "http://127.0.0.1:9", limits = [{ rate = 20, per = "1s", burst = 4 }] },
  { name = "north", url = "http://127.0.0.1:9", limits = [{ rate = 5, per = "1s", burst = 1 }] },
]
"#;

async fn seen_memory() -> crate::api::Harness {
    let backends = tollgate_memory::backends(crate::api::test_config_with(SEEN));
    let state = tollgate_api::state::ApiState::new(&backends, crate::api::settings());
    crate::api::Harness {
        app: tollgate_api::router(state.clone()),
        state,
        source: backends.source,
        redis: None,
        _cluster: None,
    }
}

async fn seen_redis() -> crate::api::Harness {
    let server = tollgate_tests::RedisServer::start();
    let state = crate::api::redis_state_with(
        &server.url(),
        &tollgate_tests::random_prefix(),
        crate::api::settings(),
        crate::api::test_config_with(SEEN),
    )
    .await;
    let source = crate::api::redis_source(&server.url(), &state).await;
    crate::api::Harness {
        app: tollgate_api::router(state.clone()),
        state,
        source,
        redis: Some(server),
        _cluster: None,
    }
}

/// `/admin/overview` lists a pool's members under its row, each with its
/// own bucket and pause; the OpenAPI schema describes them.
async fn the_overview_lists_each_member(h: crate::api::Harness) {
    h.state
        .throttle
        .pause_member("seen", "west", Some(Duration::from_secs(5)))
        .await
        .expect("paused");
    let r = h.get("/admin/overview", crate::api::ADMIN, &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let row = r.body["providers"]
        .as_array()
        .expect("providers")
        .iter()
        .find(|p| p["provider"] == "seen")
        .expect("the pool's row")
        .clone();
    let members = row["members"].as_array().expect("members");
    let names: Vec<&str> = members
        .iter()
        .filter_map(|m| m["member"].as_str())
        .collect();
    assert_eq!(names, ["east", "west", "north"], "{row}");
    let bursts: Vec<f64> = members
        .iter()
        .map(|m| m["limits"][0]["burst"].as_f64().expect("burst"))
        .collect();
    assert_eq!(bursts, [2.0, 4.0, 1.0], "{row}");
    let paused: Vec<u64> = members
        .iter()
        .map(|m| m["paused_ms"].as_u64().expect("paused_ms"))
        .collect();
    assert!(paused[1] > 4000 && paused[1] <= 5000, "{row}");
    assert_eq!((paused[0], paused[2]), (0, 0), "{row}");
    assert_eq!(
        (row["burst"].as_u64(), row["paused_ms"].as_u64()),
        (Some(7), Some(0)),
        "{row}"
    );
    assert!(row["member_grants_per_sec"].is_object(), "{row}");
    // A provider served as one upstream: no members.
    let llm = r.body["providers"]
        .as_array()
        .expect("providers")
        .iter()
        .find(|p| p["provider"] == "llm")
        .expect("llm");
    assert_eq!(llm["members"], json!([]));
    let schema = tollgate_api::dashboard::schema(tollgate_core::money::Currency::Tokens);
    let item = &schema["properties"]["providers"]["items"];
    assert!(item["required"]
        .as_array()
        .unwrap()
        .contains(&json!("members")));
    let member = &item["properties"]["members"]["items"];
    for field in ["member", "paused_ms", "in_flight", "grants", "limits"] {
        assert!(
            member["required"]
                .as_array()
                .unwrap()
                .contains(&json!(field)),
            "{field}"
        );
    }
}

mod overview {
    use super::*;
    on_each_backend!(
        [the_overview_lists_each_member]
        memory => super::seen_memory().await,
        redis => super::seen_redis().await,
    );
}

/// A job's timeline names the member its grant went to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_seen_the_timeline_names_the_member_granted() {
    let h = seen_memory().await;
    let w = Waiter::of(&rid("seen-job-1"), "alice", Share::default());
    let grant = h
        .state
        .throttle
        .acquire_as("seen", &w, Duration::from_secs(5))
        .await
        .expect("granted");
    let member = grant
        .member
        .clone()
        .expect("a pool's grant names its member");
    let r = h
        .get("/admin/jobs/seen-job-1", crate::api::ADMIN, &[])
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let timeline = r.body["jobs"][0]["timeline"].as_array().expect("timeline");
    let granted = timeline
        .iter()
        .find(|e| e["step"] == "granted")
        .unwrap_or_else(|| panic!("no granted step: {}", r.body));
    assert_eq!(granted["member"], json!(member), "{}", r.body);
    assert!(
        granted["what"]
            .as_str()
            .unwrap()
            .contains(&format!("member {member}")),
        "{}",
        r.body
    );
}
