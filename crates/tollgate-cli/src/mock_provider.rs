//! `tollgate mock-provider`: a mock upstream with its own rate limit, a failure
//! rate and counters at `GET /stats`, until SIGINT or SIGTERM.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use tollgate_mock_provider::MockOptions;

use crate::process::exit;
use crate::process::{fail, shutdown_signal};

#[derive(Debug, Args)]
pub struct MockProviderArgs {
    /// Address to listen on, e.g. 127.0.0.1:9100 (port 0: any free port, printed).
    #[arg(long, env = "TOLLGATE_LISTEN", default_value = "127.0.0.1:9100")]
    listen: String,

    /// Requests per second accepted; beyond it the mock answers 429.
    #[arg(long, default_value_t = 50.0)]
    rate: f64,

    /// Bucket capacity of the mock's own rate limit.
    #[arg(long, default_value_t = 10)]
    burst: u64,

    /// Fraction of accepted requests answered 500, between 0 and 1.
    #[arg(long, default_value_t = 0.0)]
    fail_rate: f64,

    /// Time spent on each accepted request, in ms.
    #[arg(long, default_value_t = 0)]
    latency_ms: u64,

    /// Time between two events (one token each) of a streamed answer, in ms.
    #[arg(long, default_value_t = 0)]
    token_interval_ms: u64,

    /// Open each streamed event with an SSE comment `: sent_us=<µs since the
    /// epoch>`, its send time (what `tollgate-bench stream` measures from).
    #[arg(long)]
    stamp_events: bool,
}

pub async fn run(args: MockProviderArgs) -> ExitCode {
    let options = MockOptions {
        rate: args.rate,
        burst: args.burst,
        fail_rate: args.fail_rate,
        latency: Duration::from_millis(args.latency_ms),
        token_interval: Duration::from_millis(args.token_interval_ms),
        stamp_events: args.stamp_events,
    };
    if let Err(e) = options.validate() {
        return fail(exit::BAD_INPUT, e);
    }
    let listener = match tokio::net::TcpListener::bind(&args.listen).await {
        Ok(l) => l,
        Err(e) => {
            return fail(
                exit::BAD_INPUT,
                format!("cannot listen on {}: {e}", args.listen),
            )
        }
    };
    if let Ok(addr) = listener.local_addr() {
        // The one line on stdout: what a script (or a test) needs to connect.
        println!("listening on {addr}");
    }
    match tollgate_mock_provider::run(listener, options, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(exit::FAILURE, e),
    }
}
