//! Hand-back: a managed MyApp that no autoscaler scales runs the replicas the federation
//! assigns it (its [`replicas::ASSIGNED_ANNOTATION`]). When an autoscaler goes, or went
//! while no agent ran, the value it left behind is replaced by the federation's; so is a
//! hand-made `kubectl scale`. A MyApp an autoscaler scales is never touched here.
//!
//! Looked at once every MyApp and autoscaler has been listed, then whenever a MyApp or an
//! autoscaler changes; a failed hand-back is tried again after [`RETRY`].

use std::time::Duration;

use flotilla_crds::MyApp;
use futures::StreamExt;
use kube::{Api, Client, ResourceExt};
use tokio::sync::broadcast::error::RecvError;
use tokio_util::time::DelayQueue;
use tracing::{info, warn};

use crate::autoscale::{Autoscalers, Target};
use crate::cache::{Key, Managed, Stores, is_managed};
use crate::replicas;
use crate::sync::FIELD_MANAGER;

pub const RETRY: Duration = Duration::from_secs(5);

/// Gives replicas back until the feeds end (the agent stops acting).
pub async fn run(client: Client, managed: Managed, autoscalers: Autoscalers) {
    let mut apps = managed.changes.subscribe();
    let mut scaled = autoscalers.subscribe();
    if managed.listed().await.is_err() || autoscalers.listed().await.is_err() {
        return;
    }
    let mut retries = DelayQueue::new();
    let mut due = managed.store.keys();
    loop {
        for key in due.drain(..) {
            if let Err(e) = give_back(&client, &managed.store, &autoscalers, &key).await {
                warn!(app = %key, error = %e, "giving spec.replicas back to the federation; retrying");
                retries.insert(key, RETRY);
            }
        }
        let next = tokio::select! {
            change = apps.recv() => change,
            change = scaled.recv() => change,
            Some(retry) = retries.next() => Ok(retry.into_inner()),
        };
        match next {
            Ok(key) => due.push(key),
            Err(RecvError::Lagged(_)) => due = managed.store.keys(),
            Err(RecvError::Closed) => return,
        }
    }
}

/// Whether an autoscaler scales the MyApp itself (one on its Deployment leaves the
/// MyApp's replicas to the federation).
fn scales_the_myapp(autoscaler: Option<crate::autoscale::Autoscaler>) -> bool {
    autoscaler.is_some_and(|a| a.target == Target::MyApp)
}

async fn give_back(
    client: &Client,
    store: &Stores,
    autoscalers: &Autoscalers,
    key: &Key,
) -> Result<(), kube::Error> {
    let Some(app) = store.get(key).filter(|app| is_managed(app)) else {
        return Ok(());
    };
    let Some(assigned) = replicas::assigned(&*app) else {
        return Ok(()); // applied before the agent recorded it: nothing to give back
    };
    let running = app.spec.replicas.unwrap_or(replicas::DEFAULT);
    if running == assigned
        || app.metadata.deletion_timestamp.is_some()
        || scales_the_myapp(autoscalers.of(key))
        // The cache may not show yet the autoscaler that just scaled it.
        || scales_the_myapp(autoscalers.of_fresh(key).await?)
    {
        return Ok(());
    }
    info!(app = %key, from = running, to = assigned, "no autoscaler scales the MyApp: its spec.replicas return to the federation's");
    let api: Api<MyApp> = Api::namespaced(client.clone(), &key.namespace);
    let name = (key.namespace.as_str(), key.name.as_str());
    replicas::hand_back(&api, name, app.resource_version(), assigned, FIELD_MANAGER).await
}
