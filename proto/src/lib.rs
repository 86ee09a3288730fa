//! The hub–agent wire protocol, `flotilla.federation.v1` (see `proto/federation.proto`).

#![allow(clippy::all)]

pub mod v1 {
    tonic::include_proto!("flotilla.federation.v1");
}
