//! tollgate's integration tests: one binary (see matklad, "Delete Cargo Integration
//! Tests"). Redis tests start their own `redis-server` through `tollgate_tests`.

#![allow(clippy::unwrap_used)] // a failed unwrap is a failed test

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
mod dashboard;
mod dashboard_history;
mod dashboard_sessions;
mod durability;
mod edge_keys;
mod jobs;
mod jobs_processes;
mod key_format;
mod ledger;
mod ledger_jobs;
mod observability;
mod openapi;
mod orgs;
mod outcomes;
mod redis_ledger;
mod redis_outages;
mod redis_tls;
mod script_time;
mod service_keys;
mod slow_clients;
mod stored_bytes;
mod streaming;
mod throttle;
mod throttle_late;
mod throttle_limits;
mod throttle_pause;
mod throttle_redis;
mod throttle_slots;
mod trace;
mod usage_redis;
