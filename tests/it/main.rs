//! tollgate's integration tests: one binary (see matklad, "Delete Cargo Integration
//! Tests"). Redis tests start their own `redis-server` through `tollgate_tests`.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

/// Runs each case once per backend, in a module named after it:
/// `on_each_backend!([case_a, case_b] memory => ARG, redis => ARG)`, where
/// each `case` is an `async fn case(arg)` beside the call and each `ARG` its
/// argument on that backend, written as seen from inside the module (paths
/// through `super::`). `threads N,` first sets the runtime's worker threads
/// (default 2).
macro_rules! on_each_backend {
    (threads $n:literal, $cases:tt $($backend:ident => $arg:expr),+ $(,)?) => {
        $( on_each_backend!(@module $n, $backend, $arg, $cases); )+
    };
    ($cases:tt $($backend:ident => $arg:expr),+ $(,)?) => {
        $( on_each_backend!(@module 2, $backend, $arg, $cases); )+
    };
    (@module $n:literal, $backend:ident, $arg:expr, [$($case:ident),* $(,)?]) => {
        mod $backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = $n)]
                async fn $case() {
                    super::$case($arg).await;
                }
            )*
        }
    };
}

mod admin_surface;
mod alerts;
mod all;
mod api;
mod api_edges;
mod api_full;
mod api_redis;
mod auth_abuse;
mod charging;
mod charging_model;
mod cli;
mod client;
mod cluster_failover;
mod cluster_pubsub;
mod concurrency;
mod credits;
mod credits_api;
mod dashboard;
mod dashboard_history;
mod dashboard_sessions;
mod durability;
mod edge_keys;
mod glossary;
mod jobs;
mod jobs_processes;
mod key_format;
mod ledger;
mod ledger_jobs;
mod model_limits;
mod money;
mod money_json;
mod observability;
mod openapi;
mod orgs;
mod outcomes;
mod periods;
mod pool_seen;
mod redis_ledger;
mod redis_outages;
mod redis_tls;
mod script_time;
mod service_keys;
mod slow_clients;
mod spend;
mod stored_bytes;
mod stream_readers;
mod streaming;
mod throttle;
mod throttle_late;
mod throttle_limits;
mod throttle_pause;
mod throttle_pool;
mod throttle_redis;
mod throttle_slots;
mod trace;
mod usage_redis;
