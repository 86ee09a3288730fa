//! The three calls of the election on one `coordination.k8s.io` Lease, as client-go's
//! `LeaseLock` makes them: get, create, and replace conditional on a `resourceVersion`.

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use parking_lot::Mutex;

use super::decide::{Record, Stored};

/// Why a call failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CallError {
    /// The Lease changed since the version the write was conditional on, or a create
    /// found one: someone else wrote first.
    #[error("the Lease was changed by someone else (conflict)")]
    Conflict,
    /// A replace found no Lease (deleted meanwhile).
    #[error("the Lease is gone")]
    Gone,
    #[error("{0}")]
    Failed(String),
}

/// The Lease, as the election reads and writes it. Each call may hang or fail; the
/// caller bounds it.
pub trait LeaseApi: Send + Sync {
    fn get(&self) -> impl Future<Output = Result<Option<Stored>, CallError>> + Send;
    fn create(&self, record: &Record) -> impl Future<Output = Result<Stored, CallError>> + Send;
    /// Replaces the record, only if the Lease is still at `version`.
    fn update(
        &self,
        record: &Record,
        version: &str,
    ) -> impl Future<Output = Result<Stored, CallError>> + Send;
}

/// A Lease on a real apiserver.
pub struct KubeLease {
    api: Api<Lease>,
    name: String,
    /// The object last read or written: a replace keeps its labels, annotations and the
    /// spec fields the election does not manage.
    last: Mutex<Option<Lease>>,
}

impl KubeLease {
    pub fn new(client: kube::Client, namespace: &str, name: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: name.to_owned(),
            last: Mutex::new(None),
        }
    }

    fn keep(&self, lease: Lease) -> Result<Stored, CallError> {
        let stored = stored(&lease)?;
        *self.last.lock() = Some(lease);
        Ok(stored)
    }

    /// The object to send: the last one seen at `version` if there is one, with `record`.
    fn object(&self, record: &Record, version: Option<&str>) -> Lease {
        let last = self.last.lock().clone();
        let mut lease = last
            .filter(|l| version.is_some() && l.metadata.resource_version.as_deref() == version)
            .unwrap_or_else(|| Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..Default::default()
                },
                spec: None,
            });
        lease.metadata.resource_version = version.map(str::to_owned);
        lease.metadata.managed_fields = None;
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        spec.holder_identity = Some(record.holder.clone());
        spec.lease_duration_seconds =
            Some(i32::try_from(record.lease_duration.as_secs()).unwrap_or(i32::MAX));
        spec.acquire_time = record.acquire_time.map(MicroTime);
        spec.renew_time = record.renew_time.map(MicroTime);
        spec.lease_transitions = Some(record.transitions);
        lease
    }
}

impl LeaseApi for KubeLease {
    async fn get(&self) -> Result<Option<Stored>, CallError> {
        match self.api.get_opt(&self.name).await.map_err(failed)? {
            Some(lease) => self.keep(lease).map(Some),
            None => Ok(None),
        }
    }

    async fn create(&self, record: &Record) -> Result<Stored, CallError> {
        let lease = self.object(record, None);
        match self.api.create(&PostParams::default(), &lease).await {
            Ok(lease) => self.keep(lease),
            Err(kube::Error::Api(s)) if s.is_already_exists() || s.is_conflict() => {
                Err(CallError::Conflict)
            }
            Err(e) => Err(failed(e)),
        }
    }

    async fn update(&self, record: &Record, version: &str) -> Result<Stored, CallError> {
        let lease = self.object(record, Some(version));
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(lease) => self.keep(lease),
            Err(kube::Error::Api(s)) if s.is_conflict() => Err(CallError::Conflict),
            Err(kube::Error::Api(s)) if s.is_not_found() => Err(CallError::Gone),
            Err(e) => Err(failed(e)),
        }
    }
}

fn failed(e: kube::Error) -> CallError {
    CallError::Failed(e.to_string())
}

/// The record and version of a Lease read from the apiserver. A Lease without a
/// `resourceVersion` cannot be written conditionally, so it is refused.
fn stored(lease: &Lease) -> Result<Stored, CallError> {
    let version = lease.metadata.resource_version.clone().ok_or_else(|| {
        CallError::Failed("the apiserver sent a Lease without resourceVersion".into())
    })?;
    let spec = lease.spec.clone().unwrap_or_default();
    Ok(Stored {
        record: Record {
            holder: spec.holder_identity.unwrap_or_default(),
            lease_duration: Duration::from_secs(
                spec.lease_duration_seconds
                    .unwrap_or(0)
                    .max(0)
                    .unsigned_abs()
                    .into(),
            ),
            acquire_time: spec.acquire_time.map(|t| t.0),
            renew_time: spec.renew_time.map(|t| t.0),
            transitions: spec.lease_transitions.unwrap_or(0),
        },
        version,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn record() -> Record {
        Record {
            holder: "hub-0".into(),
            lease_duration: Duration::from_secs(15),
            acquire_time: Some(Timestamp::from_second(1_700_000_000).unwrap()),
            renew_time: Some(Timestamp::from_second(1_700_000_002).unwrap()),
            transitions: 2,
        }
    }

    fn kube_lease() -> KubeLease {
        let config = kube::Config::new("https://127.0.0.1:1".parse().unwrap());
        let client = kube::Client::try_from(config).unwrap();
        KubeLease::new(client, "flotilla-system", "flotilla-hub")
    }

    #[tokio::test]
    async fn a_record_round_trips_through_a_lease() {
        let lease = kube_lease();
        let mut object = lease.object(&record(), Some("42"));
        assert_eq!(object.metadata.name.as_deref(), Some("flotilla-hub"));
        assert_eq!(object.metadata.resource_version.as_deref(), Some("42"));
        assert_eq!(
            stored(&object),
            Ok(Stored {
                record: record(),
                version: "42".into()
            })
        );
        object.metadata.resource_version = None;
        assert!(stored(&object).is_err(), "no version: no conditional write");
    }

    #[tokio::test]
    async fn a_replace_keeps_what_the_election_does_not_manage() {
        let lease = kube_lease();
        let mut seen = lease.object(&record(), Some("7"));
        seen.metadata.labels = Some([("team".to_string(), "a".to_string())].into());
        seen.spec.as_mut().unwrap().strategy = Some("OldestEmulationVersion".into());
        lease.keep(seen).unwrap();
        let mut next = record();
        next.holder = "hub-1".into();
        let sent = lease.object(&next, Some("7"));
        assert_eq!(sent.metadata.labels.unwrap()["team"], "a");
        let spec = sent.spec.unwrap();
        assert_eq!(spec.strategy.as_deref(), Some("OldestEmulationVersion"));
        assert_eq!(spec.holder_identity.as_deref(), Some("hub-1"));
        // Another version: only what the election writes, conditional on that version.
        let other = lease.object(&next, Some("8"));
        assert_eq!(other.metadata.labels, None);
        assert_eq!(other.metadata.resource_version.as_deref(), Some("8"));
        // A create carries no version.
        assert_eq!(lease.object(&next, None).metadata.resource_version, None);
    }

    #[test]
    fn a_missing_or_negative_duration_reads_as_zero() {
        let mut lease = Lease {
            metadata: ObjectMeta {
                resource_version: Some("1".into()),
                ..Default::default()
            },
            spec: None,
        };
        assert_eq!(
            stored(&lease).unwrap().record.lease_duration,
            Duration::ZERO
        );
        lease.spec = Some(LeaseSpec {
            lease_duration_seconds: Some(-5),
            ..Default::default()
        });
        assert_eq!(
            stored(&lease).unwrap().record.lease_duration,
            Duration::ZERO
        );
    }
}
