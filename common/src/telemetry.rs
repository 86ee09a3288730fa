//! Logging through `tracing`: human-readable by default, one JSON object per line with
//! `--log-json`. `RUST_LOG` overrides the default filter.

use tracing_subscriber::EnvFilter;

const DEFAULT_FILTER: &str = "info,kube_runtime=warn,kube_client=warn";

pub fn init(json: bool) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}
