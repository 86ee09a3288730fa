//! What makes the clusters, one module per provider; the code a provider alone needs
//! lives under it.
//!
//! - [`local`] (default): `kwokctl --runtime binary` clusters, control planes as local
//!   processes on 127.0.0.1, pods on fake (KWOK) nodes;
//! - [`realnode`]: real-node mode of the local provider (`up --real-nodes`): one real node
//!   per cluster (kubelet, containerd, kube-proxy in namespaces of their own), the images
//!   built here ([`realnode::oci`]) and Flotilla installed on them as Pods
//!   ([`realnode::pods`]);
//! - [`kind`]: one `kind create cluster` per cluster, for users with Docker.
//!
//! No cargo features: `down` and `status` must find real nodes and kind clusters whatever
//! brought them up, the real-node suite builds images itself, and CI runs both modes.

pub mod kind;
pub mod local;
pub mod realnode;

use crate::env::{Env, Provider};
use anyhow::Result;

/// `ADDRESS:PORT` (a free port) where a host process must listen for the apiservers of
/// `env` to reach it, e.g. an agent's conversion webhook: loopback on the local provider
/// (its apiservers are host processes too), the `kind` network's gateway on kind (the
/// apiservers run in the node containers, whose loopback is their own).
pub fn host_addr_for_apiservers(env: &Env) -> Result<String> {
    match env.provider {
        Provider::Local => crate::support::free_addr(),
        Provider::Kind => Ok(format!(
            "{}:{}",
            kind::gateway()?,
            crate::support::free_port()?
        )),
    }
}
