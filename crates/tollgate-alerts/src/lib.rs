//! The budget alerts' deliverer: a background loop (in `tollgate worker` and
//! `tollgate all`; any number of pods may run it) that leases due alerts from
//! the outbox ([`AlertOutbox`]), POSTs each as JSON to `[alerts] url` with a
//! `Tollgate-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`
//! header (Stripe's scheme) and a `Tollgate-Alert-Id` header, acks it on a 2xx
//! answer, and otherwise retries it after an exponential back-off with
//! jitter (1 s doubling to 60 s), until `[alerts] keep` after the crossing,
//! when it is dropped and counted as failed. Never on a request's path.
//!
//! Delivery is at least once: a deliverer paused past its lease (or whose ack
//! was lost) can send an alert another deliverer sends too. The receiver
//! drops such a duplicate by its `Tollgate-Alert-Id`.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::task::JoinSet;
use tollgate_core::alerts::{AlertOutbox, Leased};
use tollgate_core::config::Alerts;
use tollgate_core::metrics::Metrics;

/// The signature header: `t=<unix seconds>,v1=<hex HMAC-SHA256>`.
pub const SIGNATURE_HEADER: &str = "Tollgate-Signature";
/// The alert's unique id, the same on every attempt.
pub const ID_HEADER: &str = "Tollgate-Alert-Id";

/// Alerts one round leases at most.
const BATCH: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum AlertsError {
    #[error(
        "[alerts] secret_env names {0}, which is not set or empty: set it to the webhook's \
         signing secret"
    )]
    MissingSecret(String),
    #[error("[alerts] url: {0}")]
    Client(String),
}

/// The HMAC secret from `[alerts] secret_env`: an error names the variable
/// when it is unset or empty (a start-up error).
pub fn secret_from_env(alerts: &Alerts) -> Result<Vec<u8>, AlertsError> {
    match std::env::var(&alerts.secret_env) {
        Ok(s) if !s.is_empty() => Ok(s.into_bytes()),
        _ => Err(AlertsError::MissingSecret(alerts.secret_env.clone())),
    }
}

/// The `Tollgate-Signature` value of `body` sent at `t` (unix seconds).
pub fn sign(secret: &[u8], t: u64, body: &str) -> String {
    format!(
        "t={t},v1={}",
        hmac_hex(secret, format!("{t}.{body}").as_bytes())
    )
}

/// Hex HMAC-SHA256 of `message`.
fn hmac_hex(secret: &[u8], message: &[u8]) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    ring::hmac::sign(&key, message)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Checks a `Tollgate-Signature` value against `body` (what a receiver does;
/// the timestamp's freshness is the receiver's to judge).
pub fn verify(secret: &[u8], header: &str, body: &str) -> bool {
    let mut t = None;
    let mut v1 = None;
    for part in header.split(',') {
        match part.split_once('=') {
            Some(("t", v)) => t = v.parse::<u64>().ok(),
            Some(("v1", v)) => v1 = Some(v),
            _ => {}
        }
    }
    let (Some(t), Some(v1)) = (t, v1) else {
        return false;
    };
    let Some(tag) = unhex(v1) else {
        return false;
    };
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    ring::hmac::verify(&key, format!("{t}.{body}").as_bytes(), &tag).is_ok()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The deliverer of one process.
#[derive(Debug, Clone)]
pub struct Deliverer {
    outbox: Arc<dyn AlertOutbox>,
    metrics: Arc<Metrics>,
    client: reqwest::Client,
    url: String,
    secret: Arc<[u8]>,
    keep: Duration,
    lease: Duration,
    /// The first retry's back-off, doubled per attempt up to `max_backoff`
    /// (each then jittered down by up to half).
    pub first_backoff: Duration,
    pub max_backoff: Duration,
    /// How long an idle round sleeps before looking again.
    pub poll: Duration,
    /// What the bodies' amounts count (the deployment's `currency`).
    pub currency: tollgate_core::money::Currency,
}

impl Deliverer {
    pub fn new(
        alerts: &Alerts,
        secret: Vec<u8>,
        outbox: Arc<dyn AlertOutbox>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, AlertsError> {
        // reqwest is built without a TLS crypto provider of its own.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .timeout(alerts.timeout)
            .connect_timeout(alerts.timeout.min(Duration::from_secs(10)))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| AlertsError::Client(e.to_string()))?;
        Ok(Self {
            outbox,
            metrics,
            client,
            url: alerts.url.clone(),
            secret: secret.into(),
            keep: alerts.keep,
            // Past every attempt of a round (each bounded by the timeout).
            lease: alerts.timeout * 2 + Duration::from_secs(5),
            first_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(60),
            poll: Duration::from_millis(500),
            currency: tollgate_core::money::Currency::Tokens,
        })
    }

    /// Delivers until `shutdown` resolves (an attempt under way is dropped:
    /// its lease ends and the alert is due again).
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) {
        tracing::info!(url = %self.url, "budget alerts deliverer starting");
        tokio::pin!(shutdown);
        let mut depth_at = tokio::time::Instant::now();
        loop {
            let busy = tokio::select! {
                () = &mut shutdown => break,
                busy = self.round() => busy,
            };
            if depth_at.elapsed() >= Duration::from_secs(5) {
                depth_at = tokio::time::Instant::now();
                match self.outbox.depth().await {
                    Ok(d) => self.metrics.alert_outbox(d),
                    Err(e) => tracing::warn!(error = %e, "could not read the alerts' outbox depth"),
                }
            }
            if !busy {
                tokio::select! {
                    () = &mut shutdown => break,
                    () = tokio::time::sleep(self.poll) => {}
                }
            }
        }
        tracing::info!("budget alerts deliverer stopped");
    }

    /// One round: leases what is due and attempts each. True when it had
    /// alerts (look again at once).
    pub async fn round(&self) -> bool {
        let taken = match self.outbox.take(BATCH, self.lease).await {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "could not take due budget alerts");
                return false;
            }
        };
        if taken.dropped > 0 {
            tracing::warn!(
                dropped = taken.dropped,
                "budget alerts dropped unsent: a subject's outbox was full"
            );
            self.counted(
                "failed",
                taken.dropped,
                Some("dropped unsent: the subject's outbox was full"),
            )
            .await;
        }
        if taken.alerts.is_empty() {
            return false;
        }
        // One task per outbox, its alerts in turn: each ack or retry moves the
        // outbox's pointer, and in order the last one leaves it right.
        let mut by_outbox: std::collections::BTreeMap<String, Vec<Leased>> = Default::default();
        for leased in taken.alerts {
            by_outbox
                .entry(leased.outbox.clone())
                .or_default()
                .push(leased);
        }
        let mut set = JoinSet::new();
        for (_, alerts) in by_outbox {
            let me = self.clone();
            set.spawn(async move {
                for leased in alerts {
                    me.attempt(leased).await;
                }
            });
        }
        while set.join_next().await.is_some() {}
        true
    }

    async fn attempt(&self, leased: Leased) {
        let alert = &leased.alert;
        let age = Duration::from_millis(leased.now_ms.saturating_sub(alert.at_ms));
        if age > self.keep {
            self.give_up(&leased, "kept past [alerts] keep").await;
            return;
        }
        let body = alert.body(self.currency);
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let sent = self
            .client
            .post(&self.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(SIGNATURE_HEADER, sign(&self.secret, t, &body))
            .header(ID_HEADER, &alert.id)
            .body(body)
            .send()
            .await;
        let failure = match sent {
            Ok(r) if r.status().is_success() => None,
            Ok(r) => Some(format!("answered {}", r.status().as_u16())),
            Err(e) => Some(e.without_url().to_string()),
        };
        let Some(failure) = failure else {
            match self.outbox.ack(&leased).await {
                Ok(()) => self.counted("delivered", 1, None).await,
                // Sent: its lease ends and it is sent again (the receiver
                // drops the duplicate by its id).
                Err(e) => {
                    tracing::warn!(id = %alert.id, error = %e, "could not ack a delivered alert")
                }
            }
            return;
        };
        let backoff = self.backoff(leased.attempt);
        if age + backoff > self.keep {
            self.give_up(&leased, &failure).await;
            return;
        }
        tracing::info!(
            id = %alert.id,
            attempt = leased.attempt,
            failure,
            retry_in_ms = backoff.as_millis() as u64,
            "budget alert not delivered; retrying"
        );
        self.counted("retried", 1, Some(&failure)).await;
        if let Err(e) = self.outbox.retry(&leased, backoff).await {
            tracing::warn!(id = %alert.id, error = %e, "could not reschedule an alert; due again at its lease's end");
        }
    }

    async fn give_up(&self, leased: &Leased, why: &str) {
        tracing::warn!(id = %leased.alert.id, attempts = leased.attempt, why, "budget alert given up");
        if let Err(e) = self.outbox.ack(leased).await {
            tracing::warn!(id = %leased.alert.id, error = %e, "could not drop a given up alert");
            return;
        }
        self.counted("failed", 1, Some(why)).await;
    }

    /// Counts attempts that ended in `result`: in this process's metrics, and
    /// in the store for every pod's dashboard (a failure to note them there
    /// is logged: the alert itself is not affected).
    async fn counted(&self, result: &'static str, n: u64, detail: Option<&str>) {
        self.metrics.alert_delivery(result, n);
        if let Err(e) = self.outbox.note(result, n, detail).await {
            tracing::debug!(error = %e, result, "could not note an alert delivery for the dashboard");
        }
    }

    /// `first_backoff * 2^(attempt-1)`, at most `max_backoff`, jittered down
    /// to between half and all of it.
    fn backoff(&self, attempt: u32) -> Duration {
        let doubling = 2u32.saturating_pow(attempt.saturating_sub(1).min(20));
        let full = self
            .first_backoff
            .saturating_mul(doubling)
            .min(self.max_backoff);
        let r = getrandom::u32().unwrap_or(u32::MAX / 2);
        let frac = 0.5 + 0.5 * (f64::from(r) / f64::from(u32::MAX));
        full.mul_f64(frac)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        assert_eq!(
            hmac_hex(b"Jefe", b"what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn signatures_verify_and_bind_the_body_and_time() {
        let s = sign(b"k", 1700000000, "{\"a\":1}");
        assert!(s.starts_with("t=1700000000,v1="));
        assert_eq!(s.len(), "t=1700000000,v1=".len() + 64);
        assert!(verify(b"k", &s, "{\"a\":1}"));
        assert!(!verify(b"other", &s, "{\"a\":1}"));
        assert!(!verify(b"k", &s, "{\"a\":2}"));
        let later = s.replace("t=1700000000", "t=1700000001");
        assert!(!verify(b"k", &later, "{\"a\":1}"));
    }
}
