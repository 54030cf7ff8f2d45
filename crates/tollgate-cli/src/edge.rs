//! The flags of the api's edge (`tollgate api`, `tollgate all`): how long a
//! client may take to send a request and how many connections it may hold
//! ([`tollgate_api::edge::Edge`]).

use std::time::Duration;

use clap::Args;
use tollgate_api::edge::{self, Edge, Listener};

use crate::store::Failure;

#[derive(Debug, Args)]
pub struct EdgeArgs {
    /// How long a request's head may take to arrive, and a keep-alive
    /// connection may stay idle, in ms; then the connection is closed.
    #[arg(long, env = "TOLLGATE_HEADER_TIMEOUT_MS", default_value_t = millis(edge::DEFAULT_HEADER_TIMEOUT))]
    header_timeout_ms: u64,

    /// How long a request's body may take to arrive, in ms.
    #[arg(long, env = "TOLLGATE_BODY_TIMEOUT_MS", default_value_t = millis(edge::DEFAULT_BODY_TIMEOUT))]
    body_timeout_ms: u64,

    /// Connections open at once; one more is closed as soon as it is accepted.
    #[arg(long, env = "TOLLGATE_MAX_CONNECTIONS", default_value_t = edge::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,

    /// Connections open at once from one peer address (the TCP peer: behind a
    /// proxy, the proxy's).
    #[arg(long, env = "TOLLGATE_MAX_CONNECTIONS_PER_CLIENT", default_value_t = edge::DEFAULT_MAX_PER_CLIENT)]
    max_connections_per_client: usize,
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

    /// `tcp` under these bounds.
    pub fn listener(&self, tcp: tokio::net::TcpListener) -> Result<Listener, Failure> {
        Ok(Listener::new(tcp, self.edge()?))
    }
}
