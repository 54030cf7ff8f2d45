//! tollgate's core: the vocabulary every role shares (ids, plans, providers,
//! operations, config), the [`ledger::Ledger`], [`throttle::Throttle`] and job
//! ([`job::JobQueue`], [`job::JobSource`]) traits that backends implement, the
//! [`backend::Backends`] bundle through which every role reaches them, and the
//! protocols written once for both backends (e.g. [`job::JobQueue::submit`]).
//!
//! Every public name has one path: its module's (nothing is re-exported at the
//! root). Nothing here talks to the network. The backends that implement the
//! traits live beside it: in memory in `tollgate-memory`, on Redis in
//! `tollgate-redis`.

pub mod activity;
pub mod alerts;
pub mod backend;
pub mod clock;
pub mod config;
pub mod correction;
pub mod credits;
pub mod durability;
pub mod duration;
pub mod error;
pub mod fair;
pub mod head;
pub mod id;
pub mod job;
pub mod keystore;
pub mod ledger;
pub mod metrics;
pub mod money;
pub mod observed;
pub mod period;
pub mod price;
pub mod refund;
pub mod session;
pub mod spend;
pub mod stream;
#[cfg(any(test, feature = "test-support"))]
pub mod testing;
pub mod throttle;
pub mod trace;

/// Locks `m`, whether or not a thread panicked while holding it. Every
/// critical section that uses it (in this crate and the backends built on it)
/// is panic-free: no panic leaves the data half-written, so a poisoned lock's
/// data is still consistent.
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
