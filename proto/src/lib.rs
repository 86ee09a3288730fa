//! The hub–agent wire protocol, `flotilla.federation.v1` (see `proto/federation.proto`),
//! the object key both sides index by, and the one way an agent dials the hub.

pub mod client;
mod key;

pub use flotilla_crds::AppKey;
pub use key::WireKey;

#[allow(clippy::all)]
pub mod v1 {
    tonic::include_proto!("flotilla.federation.v1");
}
