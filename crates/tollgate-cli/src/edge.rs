//! The flags of the api's edge (`tollgate api`, `tollgate all`): where it
//! listens, how long a client may take to send a request, how many
//! connections it may hold ([`tollgate_api::edge::Edge`]), and the request
//! knobs ([`RequestArgs`]).

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;
use tollgate_api::edge::{self, Edge, Listener};
use tollgate_api::state::Settings;

use crate::store::Failure;

#[derive(Debug, Args)]
pub struct EdgeArgs {
    /// Address the api listens on (port 0: any free port).
    #[arg(long, env = "TOLLGATE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// How long a request's head may take to arrive, and a keep-alive
    /// connection may stay idle, in ms; then the connection is closed.
    #[arg(long, env = "TOLLGATE_HEADER_TIMEOUT_MS", default_value_t = millis(edge::DEFAULT_HEADER_TIMEOUT))]
    header_timeout_ms: u64,

    /// How long a request's body may take to arrive in all, in ms, from the
    /// end of its head (a total deadline: a body still arriving then is cut
    /// off, however steadily it trickles).
    #[arg(long, env = "TOLLGATE_BODY_TIMEOUT_MS", default_value_t = millis(edge::DEFAULT_BODY_TIMEOUT))]
    body_timeout_ms: u64,

    /// Connections open at once; one more is closed as soon as it is accepted.
    #[arg(long, env = "TOLLGATE_MAX_CONNECTIONS", default_value_t = edge::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,

    /// Connections open at once from one peer address (the TCP peer: behind a
    /// proxy, the proxy's).
    #[arg(long, env = "TOLLGATE_MAX_CONNECTIONS_PER_CLIENT", default_value_t = edge::DEFAULT_MAX_PER_CLIENT)]
    max_connections_per_client: usize,

    #[command(flatten)]
    pub requests: RequestArgs,
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl EdgeArgs {
    /// The bounds, checked; a bad one fails at start, naming the flags.
    pub fn edge(&self) -> Result<Edge, Failure> {
        let edge = Edge {
            header_timeout: Duration::from_millis(self.header_timeout_ms),
            body_timeout: Duration::from_millis(self.body_timeout_ms),
            max_connections: self.max_connections,
            max_per_client: self.max_connections_per_client,
        };
        edge.validate().map_err(|e| {
            Failure::bad_input(format!(
                "--header-timeout-ms, --body-timeout-ms, --max-connections, --max-connections-per-client: {e}"
            ))
        })?;
        Ok(edge)
    }

    /// A listener on `--listen`, under these bounds.
    pub async fn bind(&self) -> Result<Listener, Failure> {
        let tcp = crate::process::listen(self.listen, "--listen").await?;
        Ok(Listener::new(tcp, self.edge()?))
    }
}

/// The api's request knobs shared by `tollgate api` and `tollgate all`.
#[derive(Debug, Args)]
pub struct RequestArgs {
    /// How long a request to a route that does not wait for a job (every
    /// route but the operation calls, which wait up to the sync timeout) may
    /// take, in ms; then 503 `overloaded` with Retry-After.
    #[arg(long, env = "TOLLGATE_REQUEST_TIMEOUT_MS", default_value_t = millis(tollgate_api::state::DEFAULT_REQUEST_TIMEOUT))]
    request_timeout_ms: u64,

    /// Whether user keys of the format issued before keys had a checksum
    /// (`tg_` + 64 hex digits) are still accepted. Turn off once every such
    /// key was replaced: a key of that format is then refused without a lookup.
    #[arg(long, env = "TOLLGATE_LEGACY_KEYS", default_value_t = true, action = clap::ArgAction::Set)]
    legacy_keys: bool,

    /// Write one line per finished request (target `tollgate::access`: trace
    /// id, user, operation, cost, status, latency), so `grep <trace id>`
    /// finds the api's side of any call, a successful one too. On by
    /// default; `--access-log false` turns it off.
    #[arg(long, env = "TOLLGATE_ACCESS_LOG", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    access_log: bool,

    /// How often the dashboard's history is sampled, in ms (at most one
    /// sample per interval across every api pod; give every pod the same
    /// value). 0: this process samples nothing (the dashboard still shows
    /// what other pods sampled).
    #[arg(long, env = "TOLLGATE_HISTORY_INTERVAL_MS", default_value_t = millis(tollgate_core::activity::HISTORY_INTERVAL))]
    history_interval_ms: u64,
}

impl RequestArgs {
    /// The api's settings these flags make, checked (a bad one fails at
    /// start, naming the flag); the others are the defaults.
    pub fn settings(&self) -> Result<Settings, Failure> {
        Ok(Settings {
            legacy_keys: self.legacy_keys,
            request_timeout: self.request_timeout()?,
            access_log: self.access_log,
            history_interval: self.history_interval()?,
            ..Settings::default()
        })
    }

    fn request_timeout(&self) -> Result<Duration, Failure> {
        if self.request_timeout_ms == 0 {
            return Err(Failure::bad_input(
                "--request-timeout-ms (TOLLGATE_REQUEST_TIMEOUT_MS) must be > 0",
            ));
        }
        Ok(Duration::from_millis(self.request_timeout_ms))
    }

    fn history_interval(&self) -> Result<Option<Duration>, Failure> {
        let interval = Duration::from_millis(self.history_interval_ms);
        if self.history_interval_ms == 0 {
            return Ok(None);
        }
        if interval < tollgate_core::activity::HISTORY_MIN_INTERVAL {
            return Err(Failure::bad_input(format!(
                "--history-interval-ms (TOLLGATE_HISTORY_INTERVAL_MS) must be 0 (off) or at least {}",
                millis(tollgate_core::activity::HISTORY_MIN_INTERVAL)
            )));
        }
        Ok(Some(interval))
    }
}

/// The admin token docker-compose.yml falls back to when none is given.
pub const COMPOSE_ADMIN_TOKEN: &str = "dev-admin-token-change-me";

/// An admin token must have at least 16 characters that are not all blank,
/// none of them a control character; the compose file's default is accepted
/// with a loud warning (it is public).
pub fn check_admin_token(token: &str) -> Result<(), Failure> {
    if token.trim().is_empty() {
        return Err(Failure::bad_input(
            "TOLLGATE_ADMIN_TOKEN (--admin-token) is blank",
        ));
    }
    if token.chars().count() < 16 {
        return Err(Failure::bad_input(
            "TOLLGATE_ADMIN_TOKEN (--admin-token) must be at least 16 characters",
        ));
    }
    if token.trim() != token || token.chars().any(char::is_control) {
        return Err(Failure::bad_input(
            "TOLLGATE_ADMIN_TOKEN (--admin-token) has leading or trailing blanks or control characters",
        ));
    }
    if token == COMPOSE_ADMIN_TOKEN {
        tracing::warn!(
            "TOLLGATE_ADMIN_TOKEN is docker-compose.yml's public default ({COMPOSE_ADMIN_TOKEN}): anyone can use the admin routes; set your own"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_tokens() {
        assert!(check_admin_token(&" ".repeat(20)).is_err());
        assert!(check_admin_token("short").is_err());
        assert!(check_admin_token(" 0123456789abcdef ").is_err());
        assert!(check_admin_token("0123456789abcdef").is_ok());
        assert!(check_admin_token(COMPOSE_ADMIN_TOKEN).is_ok());
    }
}
