//! `flotilla-hub run`: wires the stores, the controller, the gRPC server, the status and
//! membership writers and the HTTP endpoints into one process.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_common::http::{self, Readiness};
use flotilla_common::metrics::Metrics;
use flotilla_crds::{FederatedMyApp, MemberCluster};
use flotilla_proto::v1::federation_server::FederationServer;
use futures::StreamExt;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::{Controller, WatchStreamExt, predicates, reflector, watcher};
use kube::{Api, Client};
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tracing::{info, warn};

use crate::controller::{self, Context};
use crate::dispatch::Dispatcher;
use crate::membership::Membership;
use crate::server::{FederationService, revoked};
use crate::status::StatusBoard;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Address agents dial (gRPC over TLS).
    #[arg(long, default_value = "0.0.0.0:7443", env = "FLOTILLA_GRPC_ADDR")]
    pub grpc_addr: SocketAddr,
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, default_value = "0.0.0.0:8080", env = "FLOTILLA_HTTP_ADDR")]
    pub http_addr: SocketAddr,
    /// PEM certificate the gRPC server presents (see `flotilla-hub certs`).
    #[arg(long, env = "FLOTILLA_TLS_CERT")]
    pub tls_cert: PathBuf,
    #[arg(long, env = "FLOTILLA_TLS_KEY")]
    pub tls_key: PathBuf,
    /// A MemberCluster turns NotReady after this long without a heartbeat.
    #[arg(long, default_value = "40s", value_parser = humantime::parse_duration)]
    pub heartbeat_grace: Duration,
    /// Status writes of one FederatedMyApp are coalesced over this window.
    #[arg(long, default_value = "200ms", value_parser = humantime::parse_duration)]
    pub status_window: Duration,
    /// Names this instance in Events (the pod name in a cluster).
    #[arg(long, env = "POD_NAME")]
    pub instance: Option<String>,
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let shutdown = flotilla_common::shutdown::on_signal().context("installing signal handlers")?;
    let client = Client::try_default()
        .await
        .context("connecting to the host cluster (kubeconfig or in-cluster)")?;
    let identity = Identity::from_pem(
        std::fs::read(&args.tls_cert)
            .with_context(|| format!("reading {}", args.tls_cert.display()))?,
        std::fs::read(&args.tls_key)
            .with_context(|| format!("reading {}", args.tls_key.display()))?,
    );

    let dispatcher = Arc::new(Dispatcher::default());
    let mut metrics = Metrics::default();
    dispatcher.metrics.register(metrics.registry_mut());
    let metrics = Arc::new(metrics);
    let readiness = Readiness::default();
    let synced = readiness.gate("initial-render");
    let status = Arc::new(StatusBoard::default());
    let membership = Arc::new(Membership::new(args.heartbeat_grace));

    let (members, members_writer) = reflector::store::<MemberCluster>();
    let (apps, apps_writer) = reflector::store::<FederatedMyApp>();
    let reporter = Reporter {
        controller: "flotilla-hub".into(),
        instance: args.instance.clone(),
    };
    let ctx = Arc::new(Context {
        client: client.clone(),
        dispatcher: dispatcher.clone(),
        status: status.clone(),
        members: members.clone(),
        recorder: Recorder::new(client.clone(), reporter),
        metrics: metrics.clone(),
    });

    // MemberCluster events: end revoked sessions, and re-render every app when the set
    // of clusters or their labels change.
    let (rerender_tx, rerender_rx) = futures::channel::mpsc::channel::<()>(1);
    let member_events = reflector(
        members_writer,
        watcher(
            Api::<MemberCluster>::all(client.clone()),
            watcher::Config::default(),
        ),
    )
    .default_backoff()
    .touched_objects();
    let member_loop = {
        let (members, dispatcher) = (members.clone(), dispatcher.clone());
        let mut rerender_tx = rerender_tx;
        async move {
            let mut last = None;
            let mut events = std::pin::pin!(member_events);
            while let Some(event) = events.next().await {
                if let Err(e) = event {
                    warn!(error = %e, "watching MemberClusters");
                    continue;
                }
                for session in dispatcher.sessions() {
                    if revoked(&members, &session.cluster, &session.token_hash) {
                        info!(cluster = %session.cluster, "credential revoked or MemberCluster deleted: closing its session");
                        dispatcher.close(&session.cluster);
                    }
                }
                let now = controller::registered(&members);
                if last.as_ref() != Some(&now) {
                    last = Some(now);
                    let _ = rerender_tx.try_send(());
                }
            }
        }
    };

    let app_events = reflector(
        apps_writer,
        watcher(
            Api::<FederatedMyApp>::all(client.clone()),
            watcher::Config::default(),
        ),
    )
    .default_backoff()
    .applied_objects()
    .predicate_filter(predicates::generation, Default::default());
    let controller = Controller::for_stream(app_events, apps.clone())
        .reconcile_all_on(rerender_rx)
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(controller::reconcile, controller::error_policy, ctx.clone())
        .for_each(|_| async {});

    // Agents are let in only once every app is in the index: a SyncComplete listing too
    // little would make them collect MyApps that are wanted.
    let (ready_tx, ready_rx) = tokio::sync::watch::channel(false);
    let initial = {
        let (apps, members, ctx) = (apps.clone(), members.clone(), ctx.clone());
        async move {
            if apps.wait_until_ready().await.is_err() || members.wait_until_ready().await.is_err() {
                return;
            }
            // Deletions too: an orphaning delete must reach agents as a release, never
            // as a missing entry that they would collect.
            for app in apps.state() {
                let plan = match app.metadata.deletion_timestamp {
                    None => controller::index_app(&app, &ctx),
                    Some(_) => controller::index_deletion(&app, &ctx).0,
                };
                ctx.status.set_plan(&controller::key_of(&app), plan);
            }
            let _ = ready_tx.send(true);
            synced.open();
            info!(
                apps = apps.state().len(),
                clusters = members.state().len(),
                "initial render done; accepting agents"
            );
        }
    };

    let service = FederationService {
        dispatcher: dispatcher.clone(),
        status: status.clone(),
        membership: membership.clone(),
        members: members.clone(),
        ready: ready_rx,
    };
    let grpc = Server::builder()
        .tls_config(ServerTlsConfig::new().identity(identity))
        .context("configuring TLS")?
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .add_service(FederationServer::new(service))
        .serve_with_shutdown(args.grpc_addr, shutdown.clone().cancelled_owned());
    info!(grpc = %args.grpc_addr, http = %args.http_addr, "flotilla-hub starting");

    let connected = {
        let d = dispatcher.clone();
        Arc::new(move |c: &str| d.is_connected(c)) as Arc<dyn Fn(&str) -> bool + Send + Sync>
    };
    let status_loop = status.clone().write_loop(
        client.clone(),
        apps.clone(),
        connected,
        args.status_window,
        shutdown.clone(),
    );
    let membership_loop = membership.write_loop(client.clone(), members.clone(), shutdown.clone());
    let http = http::serve(
        args.http_addr,
        http::router(metrics, readiness),
        shutdown.clone(),
    );

    let (grpc, http, ..) = tokio::join!(
        grpc,
        http,
        controller,
        initial,
        status_loop,
        membership_loop,
        async {
            tokio::select! {
                _ = member_loop => {}
                _ = shutdown.cancelled() => {}
            }
        }
    );
    grpc.context("gRPC server")?;
    http.context("HTTP server")?;
    info!("flotilla-hub stopped");
    Ok(())
}
