//! The hub–agent wire protocol, `flotilla.federation.v1` (see `proto/federation.proto`),
//! the object key both sides index by, and the one way an agent dials the hub; and KEDA's
//! external scaler interface (`proto/externalscaler.proto`), which the agent serves.

pub mod client;
pub mod codec;
mod key;

pub use flotilla_crds::AppKey;
pub use key::WireKey;

#[allow(clippy::all)]
pub mod v1 {
    tonic::include_proto!("flotilla.federation.v1");
}

#[allow(clippy::all)]
pub mod externalscaler {
    tonic::include_proto!("externalscaler");
}

/// Redacted: the token never reaches a log line through a `{:?}` of a message.
impl std::fmt::Debug for v1::RenewToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RenewToken")
            .field("token", &"[REDACTED]")
            .field("expires_at_unix", &self.expires_at_unix)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_renewal_never_shows_its_token_in_debug_output() {
        let message = super::v1::HubMessage {
            kind: Some(super::v1::hub_message::Kind::RenewToken(
                super::v1::RenewToken {
                    token: "paris.s3cr3t".into(),
                    expires_at_unix: 7,
                },
            )),
        };
        let shown = format!("{message:?}");
        assert!(!shown.contains("s3cr3t"), "{shown}");
        assert!(shown.contains("expires_at_unix: 7"), "{shown}");
    }
}
