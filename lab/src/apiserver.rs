//! What an apiserver itself counts: the requests it served (`apiserver_request_total`
//! from its own `/metrics`), the bytes of their bodies and of the watch events they
//! caused, and who holds a Lease. The load test and the host-writes benchmark count
//! Flotilla's writes here, on the server, not in the client that makes them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use parking_lot::Mutex;

/// The verbs that change what the apiserver stores.
const WRITE_VERBS: [&str; 5] = ["POST", "PUT", "PATCH", "APPLY", "DELETE"];

/// The counters read here.
const REQUESTS: &str = "apiserver_request_total";
const BODY_BYTES: &str = "apiserver_request_body_size_bytes_sum";
const EVENT_BYTES: &str = "apiserver_watch_events_sizes_sum";

/// One sample: its name, labels and value.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

impl Sample {
    fn label(&self, name: &str) -> &str {
        self.labels.get(name).map_or("", String::as_str)
    }

    /// A write the apiserver carried out (2xx).
    fn is_write(&self) -> bool {
        self.name == REQUESTS
            && WRITE_VERBS.contains(&self.label("verb"))
            && self.label("code").starts_with('2')
    }
}

/// The apiserver's counters at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Requests {
    samples: Vec<Sample>,
}

impl Requests {
    /// Reads them from the apiserver `client` talks to (it must be allowed `/metrics`).
    pub async fn read(client: &kube::Client) -> Result<Requests> {
        let req = http::Request::get("/metrics").body(Vec::new())?;
        let text = client
            .request_text(req)
            .await
            .context("reading the apiserver's /metrics")?;
        Ok(Requests::parse(&text))
    }

    /// The samples of the counters read here, out of Prometheus text.
    pub fn parse(text: &str) -> Requests {
        let samples = text
            .lines()
            .filter_map(|l| {
                let (name, rest) = l.split_once('{')?;
                [REQUESTS, BODY_BYTES, EVENT_BYTES]
                    .contains(&name)
                    .then_some((name, rest))
            })
            .filter_map(|(name, rest)| {
                let (labels, value) = rest.rsplit_once("} ")?;
                Some(Sample {
                    name: name.to_owned(),
                    labels: parse_labels(labels),
                    value: value.trim().parse().ok()?,
                })
            })
            .collect();
        Requests { samples }
    }

    /// What was counted since `earlier`.
    pub fn since(&self, earlier: &Requests) -> Requests {
        let samples = self
            .samples
            .iter()
            .map(|s| {
                let before = earlier
                    .samples
                    .iter()
                    .find(|e| e.name == s.name && e.labels == s.labels);
                Sample {
                    name: s.name.clone(),
                    labels: s.labels.clone(),
                    value: s.value - before.map_or(0.0, |b| b.value),
                }
            })
            .filter(|s| s.value != 0.0)
            .collect();
        Requests { samples }
    }

    /// Writes carried out on `resource` (with `subresource`, "" for the object itself).
    pub fn writes(&self, resource: &str, subresource: &str) -> u64 {
        self.samples
            .iter()
            .filter(|s| s.is_write() && s.label("resource") == resource)
            .filter(|s| s.label("subresource") == subresource)
            .map(|s| s.value)
            .sum::<f64>() as u64
    }

    /// Bytes of the request bodies sent to `resource` (its subresources included), and
    /// of the watch events about it (the object as stored, once per watcher).
    pub fn bytes(&self, resource: &str) -> (u64, u64) {
        let sum = |name: &str| {
            let of = self.samples.iter().filter(|s| s.name == name);
            of.filter(|s| s.label("resource") == resource)
                .map(|s| s.value)
                .sum::<f64>() as u64
        };
        (sum(BODY_BYTES), sum(EVENT_BYTES))
    }

    /// Writes carried out, by `resource[/subresource]`.
    pub fn writes_by_resource(&self) -> BTreeMap<String, u64> {
        let mut by = BTreeMap::new();
        for s in self.samples.iter().filter(|s| s.is_write()) {
            let key = match s.label("subresource") {
                "" => s.label("resource").to_owned(),
                sub => format!("{}/{sub}", s.label("resource")),
            };
            *by.entry(key).or_insert(0.0) += s.value;
        }
        by.into_iter().map(|(k, v)| (k, v as u64)).collect()
    }
}

/// `a="x",b="y"` as a map (values as printed; the labels read here hold no escapes).
fn parse_labels(s: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    let mut rest = s;
    while let Some((name, after)) = rest.split_once("=\"") {
        let Some((value, tail)) = after.split_once('"') else {
            break;
        };
        labels.insert(name.trim_start_matches(',').to_owned(), value.to_owned());
        rest = tail;
    }
    labels
}

/// Who holds Lease `namespace/name`, and the transitions it records.
pub async fn lease(client: &kube::Client, namespace: &str, name: &str) -> Result<(String, i32)> {
    let lease = Api::<Lease>::namespaced(client.clone(), namespace)
        .get(name)
        .await
        .with_context(|| format!("reading Lease {namespace}/{name}"))?;
    let spec = lease.spec.unwrap_or_default();
    Ok((
        spec.holder_identity.unwrap_or_default(),
        spec.lease_transitions.unwrap_or(0),
    ))
}

/// One Lease to watch: what to call it, a client of its cluster, its namespace and name.
#[derive(Clone)]
pub struct LeaseRef {
    pub what: String,
    pub client: kube::Client,
    pub namespace: String,
    pub name: String,
}

impl LeaseRef {
    async fn read(&self) -> Result<(String, i32)> {
        lease(&self.client, &self.namespace, &self.name).await
    }
}

/// Leases watched during a test: every change of holder seen (polled every 250 ms), and
/// the transitions each records itself.
pub struct Leases {
    first: Vec<(LeaseRef, (String, i32))>,
    seen: Arc<Mutex<BTreeMap<String, u32>>>,
    poll: tokio::task::JoinHandle<()>,
}

impl Leases {
    pub async fn watch(leases: Vec<LeaseRef>) -> Result<Leases> {
        let mut first = Vec::new();
        for l in leases {
            let state = l.read().await?;
            first.push((l, state));
        }
        let seen: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
        let mut holders: Vec<(LeaseRef, String)> = first
            .iter()
            .map(|(l, (h, _))| (l.clone(), h.clone()))
            .collect();
        let counted = seen.clone();
        let poll = tokio::spawn(async move {
            loop {
                for (l, holder) in &mut holders {
                    if let Ok((now, _)) = l.read().await
                        && now != *holder
                    {
                        *counted.lock().entry(l.what.clone()).or_default() += 1;
                        *holder = now;
                    }
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        });
        Ok(Leases { first, seen, poll })
    }

    /// Per Lease, the largest of: the holder changes seen, the transitions it recorded,
    /// and whether its holder now differs from the first.
    pub async fn transitions(&self) -> Result<BTreeMap<String, u32>> {
        let mut out = BTreeMap::new();
        for (l, (holder, recorded)) in &self.first {
            let (now_holder, now_recorded) = l.read().await?;
            let recorded = u32::try_from(now_recorded - recorded).unwrap_or(0);
            let seen = self.seen.lock().get(&l.what).copied().unwrap_or(0);
            let changed = u32::from(now_holder != *holder);
            out.insert(l.what.clone(), recorded.max(seen).max(changed));
        }
        Ok(out)
    }
}

impl Drop for Leases {
    fn drop(&mut self) {
        self.poll.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP apiserver_request_total [STABLE] Counter of apiserver requests
# TYPE apiserver_request_total counter
apiserver_request_total{code="200",component="apiserver",dry_run="",group="core.kubefed.io",resource="federatedmyapps",scope="resource",subresource="status",verb="PATCH",version="v1beta1"} 12
apiserver_request_total{code="409",component="apiserver",dry_run="",group="core.kubefed.io",resource="federatedmyapps",scope="resource",subresource="status",verb="PATCH",version="v1beta1"} 3
apiserver_request_total{code="200",component="apiserver",dry_run="",group="core.kubefed.io",resource="federatedmyapps",scope="resource",subresource="",verb="APPLY",version="v1beta1"} 5
apiserver_request_total{code="200",component="apiserver",dry_run="",group="coordination.k8s.io",resource="leases",scope="resource",subresource="",verb="PUT",version="v1"} 40
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="configmaps",scope="namespace",subresource="",verb="LIST",version="v1"} 7
apiserver_request_total_other{code="200"} 99
apiserver_request_body_size_bytes_sum{group="core.kubefed.io",resource="federatedmyapps",verb="patch"} 5000
apiserver_request_body_size_bytes_count{group="core.kubefed.io",resource="federatedmyapps",verb="patch"} 15
apiserver_watch_events_sizes_sum{group="core.kubefed.io",resource="federatedmyapps",version="v1beta1"} 70000
"#;

    #[test]
    fn writes_are_counted_by_resource_verb_and_code() {
        let r = Requests::parse(TEXT);
        assert_eq!(
            r.writes("federatedmyapps", "status"),
            12,
            "the conflicts wrote nothing"
        );
        assert_eq!(r.writes("federatedmyapps", ""), 5);
        assert_eq!(r.writes("configmaps", ""), 0, "LIST is no write");
        let by = r.writes_by_resource();
        assert_eq!(by["leases"], 40);
        assert_eq!(by["federatedmyapps/status"], 12);
        let later = Requests::parse(&TEXT.replace("} 12", "} 20"));
        assert_eq!(later.since(&r).writes("federatedmyapps", "status"), 8);
        assert_eq!(later.since(&r).writes("leases", ""), 0);
        assert_eq!(r.bytes("federatedmyapps"), (5000, 70000));
        assert_eq!(r.bytes("leases"), (0, 0));
    }
}
