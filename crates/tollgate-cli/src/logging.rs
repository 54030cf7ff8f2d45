//! Logging setup: tracing to stderr, human or JSON, filtered by `RUST_LOG`.

use tracing_subscriber::EnvFilter;

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
}

/// Installs the global subscriber. `RUST_LOG` overrides the default level (`info`).
pub fn init(format: Format) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        Format::Text => builder.init(),
        Format::Json => builder.json().init(),
    }
}
