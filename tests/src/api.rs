//! Test support for the api role: serve an [`ApiState`] in-process on port 0,
//! and a stand-in worker that runs jobs with a configurable failure rate.
//!
//! The stand-in takes jobs through the [`JobSource`] contract exactly as the
//! worker role does, and answers from a fake provider (echo, or a provider
//! failure with probability `fail_rate`), so the api's paths (sync result,
//! 502 with refund, async polling) run end to end on both job backends.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;
use tollgate_api::state::ApiState;
use tollgate_core::job::{Failure, Taker};
use tollgate_core::{
    id::RequestId,
    job::{Charge, FailureCause, JobSource},
};

/// An api served on `127.0.0.1:0`, stopped when dropped.
#[derive(Debug)]
pub struct ApiServer {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
}

impl ApiServer {
    pub async fn start(state: ApiState) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(tollgate_api::run(state, listener, async move {
            let _ = stopped.await;
        }));
        Self {
            addr,
            stop: Some(stop),
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Runs jobs of the given operations until dropped.
#[derive(Debug)]
pub struct StandInWorker {
    stop: Arc<AtomicBool>,
    /// Ids of the jobs it completed successfully.
    pub succeeded: Arc<Mutex<Vec<RequestId>>>,
    pub failed: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl StandInWorker {
    /// `fail_rate` in [0, 1]: the share of jobs that fail as provider failures.
    /// `delay`: how long each fake provider call takes.
    pub fn start(
        source: Arc<dyn JobSource>,
        operations: &[&str],
        fail_rate: f64,
        delay: Duration,
    ) -> Self {
        Self::failing_with(source, operations, fail_rate, FailureCause::Provider, delay)
    }

    /// Like [`start`](Self::start), failing jobs with `cause`.
    pub fn failing_with(
        source: Arc<dyn JobSource>,
        operations: &[&str],
        fail_rate: f64,
        cause: FailureCause,
        delay: Duration,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let succeeded = Arc::new(Mutex::new(Vec::new()));
        let failed = Arc::new(AtomicU64::new(0));
        let counter = Arc::new(AtomicU64::new(0));
        let name = format!("standin-{}", &RequestId::generate().as_str()[..8]);
        let tasks = operations
            .iter()
            .map(|op| {
                let (source, stop, succeeded, failed, counter) = (
                    Arc::clone(&source),
                    Arc::clone(&stop),
                    Arc::clone(&succeeded),
                    Arc::clone(&failed),
                    Arc::clone(&counter),
                );
                let (op, worker) = (op.to_string(), format!("{name}-{op}"));
                tokio::spawn(async move {
                    while !stop.load(Ordering::SeqCst) {
                        let lease = match source
                            .take(
                                &op,
                                Taker::new(
                                    &worker,
                                    Duration::from_millis(100),
                                    Duration::from_secs(30),
                                ),
                            )
                            .await
                        {
                            Ok(Some(l)) => l,
                            Ok(None) => continue,
                            Err(_) => {
                                tokio::time::sleep(Duration::from_millis(50)).await;
                                continue;
                            }
                        };
                        // As the worker role does: claim the charge first.
                        match source.start(&lease).await {
                            Ok(true) => {}
                            Ok(false) => continue,
                            Err(_) => {
                                let _ = source.hand_back(&lease).await;
                                continue;
                            }
                        }
                        tokio::time::sleep(delay).await;
                        // Deterministic spread: every n-th job fails.
                        let n = counter.fetch_add(1, Ordering::SeqCst);
                        let fail = fail_rate >= 1.0
                            || ((n + 1) as f64 * fail_rate).floor()
                                > (n as f64 * fail_rate).floor();
                        if fail {
                            if source
                                .fail(
                                    &lease,
                                    Failure::new(
                                        cause,
                                        Charge::of(cause),
                                        "mock provider: HTTP 500",
                                    ),
                                )
                                .await
                                .is_ok()
                            {
                                failed.fetch_add(1, Ordering::SeqCst);
                            }
                        } else {
                            let result =
                                serde_json::json!({"echo": lease.job.input, "operation": op});
                            if let Ok(tollgate_core::job::Finish::Recorded) =
                                source.complete(&lease, result).await
                            {
                                succeeded
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .push(lease.job.id.clone());
                            }
                        }
                    }
                })
            })
            .collect();
        Self {
            stop,
            succeeded,
            failed,
            tasks,
        }
    }

    pub fn succeeded(&self) -> Vec<RequestId> {
        self.succeeded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Stops taking jobs and waits for the tasks to end.
    pub async fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
    }
}

impl Drop for StandInWorker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}
