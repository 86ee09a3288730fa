//! `flotilla-hub run`: wires the stores, the planner, the controller, the gRPC server,
//! the status and membership writers and the HTTP endpoints into one supervised process:
//! when any of them stops, the process stops, non-zero, naming it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_common::http::{self, Readiness};
use flotilla_common::kubeconfig::KubeArgs;
use flotilla_common::leader;
use flotilla_common::listed;
use flotilla_common::metrics::Metrics;
use flotilla_common::supervise::Supervisor;
use flotilla_common::tenancy::TenancyArgs;
use flotilla_crds::MemberCluster;
use flotilla_crds::tenancy::NamespacePolicy;
use flotilla_plan::admission::Admission;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client};
use tokio::sync::{mpsc, watch};

use crate::controller::{self, Context, Notices};
use crate::detail;
use crate::dispatch::Dispatcher;
use crate::edge::{self, EdgeLimits, RefusalMetrics};
use crate::inventory::{self, InventoryArgs};
use crate::membership::{self, Membership};
use crate::planner::{self, Planner};
use crate::renew::{RenewalMetrics, Renewer};
use crate::server::{self, FederationService};
use crate::serving::ServingCert;
use crate::status::{StatusBoard, StatusWriter};
use crate::writes::WriteMetrics;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Address agents dial (gRPC over TLS).
    #[arg(long, default_value = "0.0.0.0:7443", env = "FLOTILLA_GRPC_ADDR")]
    pub grpc_addr: SocketAddr,
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, default_value = "0.0.0.0:8080", env = "FLOTILLA_HTTP_ADDR")]
    pub http_addr: SocketAddr,
    /// PEM certificate the gRPC server presents (see `flotilla-hub certs`). Read again when
    /// it or the key changes (a mounted Secret that cert-manager renews): new connections
    /// get the new one, open sessions keep theirs.
    #[arg(long, env = "FLOTILLA_TLS_CERT")]
    pub tls_cert: PathBuf,
    #[arg(long, env = "FLOTILLA_TLS_KEY")]
    pub tls_key: PathBuf,
    /// How often the certificate and key files are read for a change.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub tls_reload_interval: Duration,
    /// A MemberCluster turns NotReady after this long without a heartbeat.
    #[arg(long, default_value = "40s", value_parser = humantime::parse_duration)]
    pub heartbeat_grace: Duration,
    /// Status writes of one FederatedMyApp are coalesced over this window when the host
    /// is quiet; it widens with the backlog, up to 5s.
    #[arg(long, default_value = "200ms", value_parser = humantime::parse_duration)]
    pub status_window: Duration,
    /// FederatedMyApp status writes per second, on average (a token bucket).
    #[arg(long, default_value_t = 50.0)]
    pub status_writes_per_second: f64,
    /// FederatedMyApp status writes at once, beyond the average.
    #[arg(long, default_value_t = 100)]
    pub status_write_burst: u32,
    /// One MemberCluster's capacity is written at most this often (agents report it only
    /// when it moved by 5 % and one default request, or a node came or went).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub capacity_write_interval: Duration,
    /// How long an agent token is valid. The hub renews it over the agent's session with
    /// a third of this left; a token past it is refused (`join --rotate` issues a new one).
    #[arg(long, default_value = "30d", value_parser = parse_lifetime, env = "FLOTILLA_TOKEN_LIFETIME")]
    pub token_lifetime: Duration,
    /// A deletion waits at most this long for a cluster whose agent only claims the
    /// MyApp (this hub never placed or sent it there, and the spec does not place it
    /// there); it is sent the Delete all the same. Clusters the hub placed it on, and
    /// every cluster of an orphaning delete, are waited for however long it takes.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    pub claim_wait: Duration,
    /// Names this instance in Events (the pod name in a cluster).
    #[arg(long, env = "POD_NAME")]
    pub instance: Option<String>,
    #[command(flatten)]
    pub edge: EdgeLimits,
    #[command(flatten)]
    pub tenancy: TenancyArgs,
    /// A namespace without a ClusterGrant places its FederatedMyApps on no cluster (the
    /// mode for a hub shared by several teams). Without this flag such a namespace
    /// places on every cluster, and deleting a namespace's last grant widens it again.
    #[arg(long, env = "FLOTILLA_REQUIRE_NAMESPACE_GRANT")]
    pub require_namespace_grant: bool,
    #[command(flatten)]
    pub leader: leader::LeaderArgs,
    #[command(flatten)]
    pub inventory: InventoryArgs,
}

/// A token lifetime: at least 3 s, so that its last third is more than a tick or two.
pub fn parse_lifetime(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if d < Duration::from_secs(3) {
        return Err(format!("{s}: a token lifetime is at least 3s"));
    }
    Ok(d)
}

impl RunArgs {
    /// What the planner admits.
    pub fn admission(&self) -> Admission {
        admission(&self.tenancy)
    }
}

/// What a hub with these flags admits: the system namespaces, its own and the
/// configured ones are refused.
pub fn admission(tenancy: &TenancyArgs) -> Admission {
    let (own, configured) = (&tenancy.flotilla_namespace, &tenancy.forbidden_namespaces);
    Admission {
        namespaces: NamespacePolicy::new(own, configured),
        ..Admission::default()
    }
}

/// Every object of kind `K` on the host, into `writer`'s store ([`watch`]).
fn watch_all<K>(
    client: &Client,
    writer: reflector::store::Writer<K>,
) -> (
    impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    listed::Listed,
)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    watch(Api::all(client.clone()), watcher::Config::default(), writer)
}

/// The objects of `api` that `config` selects, trimmed ([`trim`]) into `writer`'s
/// store, retried with backoff; with when it has listed. Every cache of the hub.
pub(crate) fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
    writer: reflector::store::Writer<K>,
) -> (
    impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    listed::Listed,
)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let events = watcher(api, config);
    listed::track(reflector(writer, events.modify(trim)).default_backoff())
}

/// What the hub's caches do not keep: nothing in the hub reads `managedFields` or the
/// copy of the object `kubectl apply` leaves in an annotation. (A FederatedMyApp's
/// status is kept whole: the writer compares and patches against it, the planner reads
/// the division and `observedGeneration` in it, conditions keep their transition times.)
fn trim<K: kube::Resource>(object: &mut K) {
    let meta = object.meta_mut();
    meta.managed_fields = None;
    if let Some(annotations) = meta.annotations.as_mut() {
        annotations.remove(LAST_APPLIED);
    }
}

const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

pub async fn run(kube: &KubeArgs, args: RunArgs) -> anyhow::Result<()> {
    let shutdown = flotilla_common::shutdown::on_signal().context("installing signal handlers")?;
    // Before any file is open: each agent holds one.
    let open_files =
        edge::raise_open_files_limit(&args.edge).context("raising the open-files limit")?;
    let config = kube
        .config()
        .await
        .context("connecting to the host cluster (kubeconfig or in-cluster)")?;
    let client = Client::try_from(config.clone()).context("building the host cluster's client")?;
    // A standby stays warm (stores listed, every app planned) and ready, but writes
    // nothing and serves no agent: only the leader does (the Service routes to it).
    let (leading, campaign) = leader::elect(config, &args.leader, leader::HUB, shutdown.clone())?;
    let serving = ServingCert::load(args.tls_cert.clone(), args.tls_key.clone())
        .context("loading the serving certificate")?;
    let tls = serving.server_config();

    let dispatcher = Arc::new(Dispatcher::with_claim_wait(args.claim_wait));
    let mut metrics = Metrics::default();
    dispatcher.metrics.register(metrics.registry_mut());
    let readiness = Readiness::default();
    let planned_gate = readiness.gate("initial-plan");
    let writes = WriteMetrics::default();
    writes.register(metrics.registry_mut());
    let refusals = RefusalMetrics::default();
    refusals.register(metrics.registry_mut());
    let renewals = RenewalMetrics::default();
    renewals.register(metrics.registry_mut());
    let metrics = Arc::new(metrics);
    let status = Arc::new(StatusBoard::default());
    let membership = Arc::new(
        Membership::new(args.heartbeat_grace)
            .with_status(status.clone())
            .with_capacity_interval(args.capacity_write_interval)
            .with_metrics(writes.clone()),
    );
    let (members, members_writer) = reflector::store::<MemberCluster>();
    let (apps, apps_writer) = reflector::store();
    let (notices, woken) = Notices::new(leading.clone());
    let notices = Arc::new(notices);
    let ctx = Arc::new(Context {
        client: client.clone(),
        status: status.clone(),
        notices: notices.clone(),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: "flotilla-hub".into(),
                instance: args.instance.clone(),
            },
        ),
        metrics: metrics.clone(),
        leading: leading.clone(),
    });
    let (members_changed, members_changed_rx) = watch::channel(Default::default());
    let (member_events, members_listed) = watch_all(&client, members_writer);
    let (inventory_members_listed, inventory_writes) = (members_listed.clone(), writes.clone());
    let (app_events, apps_listed) = watch_all(&client, apps_writer);
    let (grants, grants_writer) = reflector::store();
    let (grant_events, grants_listed) = watch_all(&client, grants_writer);
    let (grants_changed, grants_changed_rx) = watch::channel(());
    let inventory_apps_listed = apps_listed.clone();
    let (triggers, triggers_rx) = mpsc::unbounded_channel();
    status.notify_planner(triggers.clone());
    let (applied, applied_rx) = mpsc::unbounded_channel();

    let mut tasks = Supervisor::new(shutdown.clone(), Duration::from_secs(10));
    tasks.spawn("leader-election", async move {
        campaign.await;
        Ok(())
    });
    let watch = membership::watch_members(
        member_events,
        members.clone(),
        dispatcher.clone(),
        membership.clone(),
        members_changed,
        client.clone(),
    );
    let stop = shutdown.clone();
    tasks.spawn("membercluster-watch", async move {
        tokio::select! {
            ended = watch => ended,
            _ = stop.cancelled() => Ok(()),
        }
    });
    let watch = planner::watch_apps(app_events, triggers, applied);
    let stop = shutdown.clone();
    tasks.spawn("federatedmyapp-watch", async move {
        tokio::select! {
            ended = watch => ended,
            _ = stop.cancelled() => Ok(()),
        }
    });
    let watch = planner::watch_grants(grant_events, grants_changed);
    let stop = shutdown.clone();
    tasks.spawn("clustergrant-watch", async move {
        tokio::select! {
            ended = watch => ended,
            _ = stop.cancelled() => Ok(()),
        }
    });
    let admission = args.admission();
    let forbidden: Vec<&str> = admission.namespaces.namespaces().map(|(n, _)| n).collect();
    tracing::info!(
        ?forbidden,
        "FederatedMyApps in these namespaces are refused"
    );
    match args.require_namespace_grant {
        true => tracing::info!("a namespace without a ClusterGrant places on no cluster"),
        false => tracing::info!(
            "a namespace without a ClusterGrant places on every cluster (--require-namespace-grant to refuse)"
        ),
    }
    let planner = Planner {
        admission,
        dispatcher: dispatcher.clone(),
        status: status.clone(),
        notices,
        apps: apps.clone(),
        members: members.clone(),
        grants,
        require_grant: args.require_namespace_grant,
    };
    let inputs = planner::Inputs {
        apps: triggers_rx,
        members: members_changed_rx,
        grants: grants_changed_rx,
        apps_listed: apps_listed.clone(),
        members_listed,
        grants_listed,
    };
    tasks.spawn(
        "planner",
        planner.run(inputs, planned_gate, shutdown.clone()),
    );
    let applied = tokio_stream::wrappers::UnboundedReceiverStream::new(applied_rx);
    tasks.spawn(
        "controller",
        controller::run(
            ctx.clone(),
            apps.clone(),
            applied,
            woken,
            apps_listed,
            shutdown.clone(),
        ),
    );
    let renewer = Arc::new(Renewer::new(
        Api::all(client.clone()),
        members.clone(),
        dispatcher.clone(),
        args.token_lifetime,
        renewals,
    ));
    tasks.spawn("token-renewal", renewer.clone().run(shutdown.clone()));
    let service = FederationService {
        renewer,
        dispatcher,
        status: status.clone(),
        membership: membership.clone(),
        host: Arc::new(membership::HostMembers {
            members: members.clone(),
            recorder: ctx.recorder.clone(),
        }),
        leading: leading.clone(),
        admissions: Default::default(),
        refusals,
    };
    tasks.spawn("serving-certificate-reload", {
        let (serving, shutdown) = (serving.clone(), shutdown.clone());
        async move {
            serving.watch(args.tls_reload_interval, shutdown).await;
            Ok(())
        }
    });
    tasks.spawn(
        "grpc",
        server::serve(args.grpc_addr, tls, args.edge, service, shutdown.clone()),
    );
    let writer = StatusWriter {
        client: client.clone(),
        apps: apps.clone(),
        recorder: ctx.recorder.clone(),
        metrics: writes,
        window: args.status_window,
        rate: args.status_writes_per_second,
        burst: args.status_write_burst,
    };
    tasks.spawn(
        "status-writer",
        status
            .clone()
            .write_loop(writer, leading.clone(), shutdown.clone()),
    );
    let publisher = inventory::Publisher {
        client: client.clone(),
        namespace: args.inventory.namespace(&args.tenancy.flotilla_namespace),
        members: members.clone(),
        members_listed: inventory_members_listed,
        apps: apps.clone(),
        apps_listed: inventory_apps_listed,
        board: status.clone(),
        leading: leading.clone(),
        metrics: inventory_writes,
    };
    tasks.spawn(
        "cluster-inventory",
        inventory::publish(publisher, shutdown.clone()),
    );
    tasks.spawn("membercluster-status-writer", {
        let shutdown = shutdown.clone();
        let leading = leading.clone();
        async move {
            membership
                .write_loop(client, members, leading, shutdown)
                .await
        }
    });
    let addr = args.http_addr;
    let router =
        http::router(metrics, readiness).merge(detail::routes(status, apps, leading.clone()));
    let endpoints = http::serve(addr, router, shutdown);
    tasks.spawn("http", async move {
        endpoints
            .await
            .with_context(|| format!("serving /healthz, /readyz, /metrics on {addr}"))
    });
    tracing::info!(grpc = %args.grpc_addr, http = %args.http_addr, open_files, "flotilla-hub starting");
    tasks.run().await?;
    tracing::info!("flotilla-hub stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::cli::{Cli, Command};

    /// `--forbidden-namespace` (repeated or comma-separated) and the hub's own namespace
    /// reach the planner's admission, beside the system namespaces.
    #[test]
    fn the_tenancy_flags_reach_the_admission() {
        let args = ["flotilla-hub", "run", "--tls-cert", "c", "--tls-key", "k"];
        let flags = [
            "--forbidden-namespace",
            "vault,argocd",
            "--forbidden-namespace",
            "ci",
            "--flotilla-namespace",
            "ops",
        ];
        let cli = Cli::try_parse_from(args.iter().chain(&flags)).unwrap();
        let Command::Run(run) = cli.command else {
            panic!("parsed as run")
        };
        let admission = run.admission();
        let refused = |ns: &str| admission.namespaces.check(ns).is_err();
        for ns in [
            "vault",
            "argocd",
            "ci",
            "ops",
            "kube-system",
            "kube-public",
            "kube-node-lease",
        ] {
            assert!(refused(ns), "{ns}");
        }
        for ns in ["default", "flotilla-system", "shop"] {
            assert!(!refused(ns), "{ns}");
        }
        assert!(
            !run.require_namespace_grant,
            "grants are not required by default"
        );
        let strict = args.iter().chain(&["--require-namespace-grant"]);
        let Command::Run(run) = Cli::try_parse_from(strict).unwrap().command else {
            panic!("parsed as run")
        };
        assert!(run.require_namespace_grant);
    }
}
