//! One cancellation token for the whole process, fired by SIGTERM (the kubelet) or
//! Ctrl-C, so that the controllers, the webhook and the HTTP server stop together.

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

pub fn on_signal() -> std::io::Result<CancellationToken> {
    let token = CancellationToken::new();
    let mut term = signal(SignalKind::terminate())?;
    let fired = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => tracing::info!("interrupt: shutting down"),
        }
        fired.cancel();
    });
    Ok(token)
}
