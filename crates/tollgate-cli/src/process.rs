//! How a tollgate process ends: its exit codes, its one-line errors, and the
//! signals that stop a role.

use std::process::ExitCode;

/// Exit codes shared by every command.
pub mod exit {
    /// Bad input: a flag, an id, a cost or a config the command cannot use.
    pub const BAD_INPUT: u8 = 2;
    /// The budget denied the reservation.
    pub const DENIED: u8 = 3;
    /// A conflict with the current state: the refund of a charge its running
    /// job owns (nothing changed).
    pub const CONFLICT: u8 = 4;
    /// Anything else: Redis unreachable, an unexpected reply.
    pub const FAILURE: u8 = 1;
}

/// Prints `error: {e}` on stderr and returns exit code `code`.
pub(crate) fn fail(code: u8, e: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {e}");
    ExitCode::from(code)
}

/// Binds `addr` for a role's HTTP listener (`flag`: the option that set it,
/// named in the error).
pub(crate) async fn listen(
    addr: std::net::SocketAddr,
    flag: &str,
) -> Result<tokio::net::TcpListener, crate::store::Failure> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| crate::store::Failure::other(format!("cannot listen on {addr} ({flag}): {e}")))
}

/// Resolves on SIGINT or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
