//! tollgate's integration tests: one binary (see matklad, "Delete Cargo Integration
//! Tests"). Redis tests start their own `redis-server` through `tollgate_tests`.

mod cli;
mod concurrency;
mod ledger;
mod redis_ledger;
