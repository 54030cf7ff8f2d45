//! Logging setup: tracing to stderr, human or JSON, filtered by `RUST_LOG`.

use tracing_subscriber::EnvFilter;

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
}

/// Installs the global subscriber. `RUST_LOG` overrides the default level
/// (`info`). Colours only on a terminal: a container's or a file's log holds
/// plain text, not ANSI escape codes (`NO_COLOR` turns them off everywhere).
pub fn init(format: Format) {
    use std::io::IsTerminal;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    match format {
        Format::Text => builder.init(),
        Format::Json => builder.json().init(),
    }
}
