//! Detail: every cluster of one FederatedMyApp, on demand. The status on the host is
//! bounded (past 50 clusters it lists the most urgent ones); the leading hub, which holds
//! every report, serves the whole fold on its HTTP port, `GET /apps/<namespace>/<name>`
//! (JSON), and `flotilla-hub status NAME` prints it: through the host apiserver's proxy
//! to the Pod labelled `flotilla.io/leader=true`, or straight from `--hub-url`.

use std::fmt::Write as _;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use flotilla_crds::FederatedMyApp;
use flotilla_crds::federated::FederatedMyAppStatus;
use flotilla_plan::index::AppKey;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::runtime::reflector::Store;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use flotilla_common::kubeconfig::KubeArgs;

use crate::status::StatusBoard;

/// What `/apps/<namespace>/<name>` answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AppDetail {
    /// `namespace/name`.
    pub app: String,
    /// The status with every cluster listed and every message whole.
    pub status: FederatedMyAppStatus,
}

#[derive(Clone)]
struct Served {
    board: Arc<StatusBoard>,
    apps: Store<FederatedMyApp>,
    leading: watch::Receiver<bool>,
}

/// The routes the hub adds to its HTTP port.
pub fn routes(
    board: Arc<StatusBoard>,
    apps: Store<FederatedMyApp>,
    leading: watch::Receiver<bool>,
) -> Router {
    Router::new()
        .route("/apps/{namespace}/{name}", get(app_detail))
        .with_state(Served {
            board,
            apps,
            leading,
        })
}

async fn app_detail(
    State(s): State<Served>,
    Path((namespace, name)): Path<(String, String)>,
) -> Response {
    if !*s.leading.borrow() {
        let why = "this hub is a standby; the leading hub (the Pod labelled flotilla.io/leader=true) serves /apps";
        return (StatusCode::SERVICE_UNAVAILABLE, why).into_response();
    }
    let key = AppKey::new(namespace, name);
    match s.board.detail(&key, &s.apps) {
        Some(status) => axum::Json(AppDetail {
            app: key.to_string(),
            status,
        })
        .into_response(),
        None => (
            StatusCode::NOT_FOUND,
            format!("no FederatedMyApp {key} is planned on this hub"),
        )
            .into_response(),
    }
}

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// The FederatedMyApp's name.
    pub name: String,
    #[arg(short = 'n', long, default_value = "default")]
    pub namespace: String,
    /// The hub's HTTP address (e.g. `http://127.0.0.1:8080`, a port-forward). Default:
    /// the Pod labelled `flotilla.io/leader=true` in `--hub-namespace`, through the host
    /// apiserver's proxy (needs `get pods/proxy` there).
    #[arg(long, value_name = "URL")]
    pub hub_url: Option<String>,
    #[arg(long, default_value = "flotilla-system")]
    pub hub_namespace: String,
    /// The hub Pod's HTTP port (its `--http-addr`).
    #[arg(long, default_value_t = 8080)]
    pub hub_http_port: u16,
    #[arg(short = 'o', long, value_enum, default_value_t = StatusOutput::Table)]
    pub output: StatusOutput,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusOutput {
    Table,
    Json,
    Yaml,
}

/// `flotilla-hub status NAME`: asks the leading hub, prints every cluster.
pub async fn status(kube: &KubeArgs, args: &StatusArgs) -> anyhow::Result<()> {
    let path = format!("/apps/{}/{}", args.namespace, args.name);
    let body = match &args.hub_url {
        Some(url) => {
            let config =
                kube::Config::new(url.parse().with_context(|| format!("--hub-url {url}"))?);
            let client = kube::Client::try_from(config)?;
            get_text(&client, &path).await
        }
        None => {
            let client = kube
                .client()
                .await
                .context("connecting to the host cluster")?;
            let pod = leader_pod(&client, &args.hub_namespace).await?;
            let proxied = format!(
                "/api/v1/namespaces/{}/pods/{pod}:{}/proxy{path}",
                args.hub_namespace, args.hub_http_port
            );
            get_text(&client, &proxied).await
        }
    }
    .with_context(|| {
        format!(
            "asking the leading hub for {}/{}",
            args.namespace, args.name
        )
    })?;
    let detail: AppDetail =
        serde_json::from_str(&body).with_context(|| format!("the hub answered: {body}"))?;
    print!("{}", render(&detail, args.output)?);
    Ok(())
}

async fn get_text(client: &kube::Client, path: &str) -> anyhow::Result<String> {
    let req = axum::http::Request::get(path).body(Vec::new())?;
    Ok(client.request_text(req).await?)
}

/// The name of the hub Pod that leads (it labels itself).
async fn leader_pod(client: &kube::Client, namespace: &str) -> anyhow::Result<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let leaders = pods
        .list(&ListParams::default().labels("flotilla.io/leader=true"))
        .await
        .with_context(|| format!("listing the hub Pods in {namespace}"))?;
    match leaders.items.first().and_then(|p| p.metadata.name.clone()) {
        Some(name) => Ok(name),
        None => bail!(
            "no Pod in {namespace} is labelled flotilla.io/leader=true (is the hub running there? --hub-url reaches one elsewhere)"
        ),
    }
}

/// The detail as a table (conditions, counts, one line per cluster), JSON or YAML.
pub fn render(detail: &AppDetail, output: StatusOutput) -> anyhow::Result<String> {
    Ok(match output {
        StatusOutput::Json => serde_json::to_string_pretty(detail)? + "\n",
        StatusOutput::Yaml => serde_yaml::to_string(detail)?,
        StatusOutput::Table => table(detail),
    })
}

fn table(detail: &AppDetail) -> String {
    let s = &detail.status;
    let mut out = format!("FederatedMyApp {}\n", detail.app);
    for c in &s.conditions {
        let _ = writeln!(
            out,
            "{}={} ({}): {}",
            c.type_, c.status, c.reason, c.message
        );
    }
    let _ = writeln!(
        out,
        "clusters: placed {}, applied {}, ready {}, pending {}, disconnected {}, failed {}, failed over {}",
        s.placed_clusters,
        s.applied_clusters,
        s.ready_clusters,
        s.pending_clusters,
        s.disconnected_clusters,
        s.failed_clusters,
        s.failed_over_clusters
    );
    let mut rows = vec![[
        "CLUSTER".to_owned(),
        "READY".into(),
        "REPLICAS".into(),
        "READY-REPLICAS".into(),
        "REASON".into(),
        "MESSAGE".into(),
    ]];
    for c in &s.clusters {
        rows.push([
            c.name.clone(),
            c.ready.to_string(),
            // Under spec.autoscaling, the cluster's bounds.
            match (c.min_replicas, c.replicas) {
                (Some(min), Some(max)) => format!("{min}..{max}"),
                (_, replicas) => replicas.map_or("-".into(), |r| r.to_string()),
            },
            c.ready_replicas.to_string(),
            c.scheduling_reason.map_or("-".into(), |r| format!("{r:?}")),
            c.message.clone(),
        ]);
    }
    let widths: Vec<usize> = (0..5)
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    for row in rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            match widths.get(i) {
                Some(w) => {
                    let _ = write!(line, "{cell:<w$}  ");
                }
                None => line.push_str(cell),
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_crds::federated::{ClusterStatus, SchedulingReason};

    #[test]
    fn the_table_lists_every_cluster() {
        let detail = AppDetail {
            app: "default/web".into(),
            status: FederatedMyAppStatus {
                placed_clusters: 2,
                ready_clusters: 1,
                applied_clusters: 2,
                clusters: vec![
                    ClusterStatus {
                        name: "cluster1".into(),
                        ready: true,
                        replicas: Some(2),
                        ready_replicas: 2,
                        scheduling_reason: Some(SchedulingReason::Weight),
                        ..Default::default()
                    },
                    ClusterStatus {
                        name: "autoscaled".into(),
                        ready: true,
                        min_replicas: Some(2),
                        replicas: Some(4),
                        ready_replicas: 3,
                        scheduling_reason: Some(SchedulingReason::Weight),
                        ..Default::default()
                    },
                    ClusterStatus {
                        name: "a-long-cluster-name".into(),
                        ready_replicas: 0,
                        message: "0 replica(s) ready".into(),
                        ..Default::default()
                    },
                ],
                ..Default::default()
            },
        };
        let out = render(&detail, StatusOutput::Table).unwrap();
        assert_eq!(
            out,
            "FederatedMyApp default/web\n\
             clusters: placed 2, applied 2, ready 1, pending 0, disconnected 0, failed 0, failed over 0\n\
             CLUSTER              READY  REPLICAS  READY-REPLICAS  REASON  MESSAGE\n\
             cluster1             true   2         2               Weight\n\
             autoscaled           true   2..4      3               Weight\n\
             a-long-cluster-name  false  -         0               -       0 replica(s) ready\n"
        );
        let json = render(&detail, StatusOutput::Json).unwrap();
        assert_eq!(serde_json::from_str::<AppDetail>(&json).unwrap(), detail);
    }
}
