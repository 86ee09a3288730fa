//! Renew: agents' tokens renewed over their sessions before they expire, with no outage
//! and no manual step.
//!
//! On every tick, for each connected session ([`auth::renewal`] decides):
//! 1. With a third of its lifetime left, a new token is issued and its hash recorded as
//!    the MemberCluster's `nextTokenSha256` (a JSON patch that tests the current hash, so
//!    a revocation or `join --rotate` meanwhile wins); only then is the token sent
//!    (`RenewToken`). Both tokens are now accepted.
//! 2. The agent stores it and answers `TokenRenewed` with its hash; the session now
//!    counts as holding it.
//! 3. The next token becomes the current one (a JSON patch testing both hashes), and the
//!    old one is accepted no more.
//!
//! A crash anywhere leaves the agent a token the hub accepts: before 3 the current one
//! is still accepted; an agent that stored the new token and restarted opens a session
//! with it, which promotes it (step 3) the same way. Once sent, a next token is never
//! replaced while the agent may hold it: an unanswered one is sent again (on this or the
//! agent's next session), not swapped for another. Only a next hub, which never sent it,
//! stages a new one, after the agent opened its session with the current token (the
//! agent finishes every store before it dials again). A session whose token expired
//! (an agent that could not store a renewal) is ended; its agent is refused with the
//! error naming `join --rotate`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_crds::MemberCluster;
use flotilla_proto::v1 as pb;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::Store;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use secrecy::{ExposeSecret, SecretString};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::auth::{self, MemberLookup as _, NotAccepted, Renewal};
use crate::dispatch::{ClusterQueue, Dispatcher};

/// A token recorded as a cluster's next one and sent, not yet made current. Kept so
/// that a retry sends the same token again: once sent, the agent may hold it, so it is
/// never replaced by another while it can still be (see [`Renewer::step`]).
struct Pending {
    /// The session it was last sent on.
    session: u64,
    hash: String,
    token: SecretString,
    expires: Timestamp,
    sent: Instant,
    /// The agent said it stored the token.
    acked: bool,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// `flotilla_hub_token_renewals_total{result}`: `sent`, `renewed` (the agent holds the
/// new token and the old one is retired), `failed` (recording it, or the agent storing
/// it), `expired` (a session ended because its token expired).
#[derive(Clone, Default)]
pub struct RenewalMetrics {
    renewals: Family<ResultLabels, Counter>,
}

impl RenewalMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "flotilla_hub_token_renewals",
            "Agent token renewals, by result",
            self.renewals.clone(),
        );
    }

    fn count(&self, result: &'static str) {
        self.renewals.get_or_create(&ResultLabels { result }).inc();
    }
}

enum Staged {
    /// Nothing staged by this hub that the MemberCluster still names: stage a new token.
    None,
    /// Sent on this session recently: wait for the answer.
    InFlight,
    /// Sent, unanswered or refused, or sent on an earlier session: send it again.
    Resend,
}

pub struct Renewer {
    pub api: Api<MemberCluster>,
    pub members: Store<MemberCluster>,
    pub dispatcher: Arc<Dispatcher>,
    /// How long an issued token is valid.
    pub lifetime: Duration,
    pub metrics: RenewalMetrics,
    pending: Mutex<HashMap<String, Pending>>,
    /// Sessions already warned that their agent cannot renew.
    warned: Mutex<HashMap<String, u64>>,
    /// The hash each cluster's last promotion made current.
    retired: Mutex<HashMap<String, String>>,
}

impl Renewer {
    pub fn new(
        api: Api<MemberCluster>,
        members: Store<MemberCluster>,
        dispatcher: Arc<Dispatcher>,
        lifetime: Duration,
        metrics: RenewalMetrics,
    ) -> Self {
        Self {
            api,
            members,
            dispatcher,
            lifetime,
            metrics,
            pending: Mutex::default(),
            warned: Mutex::default(),
            retired: Mutex::default(),
        }
    }

    /// How often sessions are looked at: often enough that a renewal starts early in the
    /// last third of a lifetime (a tenth of it), at least once a minute.
    fn tick(&self) -> Duration {
        (self.lifetime / 10).clamp(Duration::from_millis(200), Duration::from_secs(60))
    }

    /// Looks at every session each tick until `shutdown`.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) -> anyhow::Result<()> {
        let mut tick = tokio::time::interval(self.tick());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tick.tick() => {}
            }
            for session in self.dispatcher.sessions() {
                self.step(&session).await;
            }
            self.forget_ended();
        }
    }

    fn forget_ended(&self) {
        let live: HashMap<String, u64> = (self.dispatcher.sessions().iter())
            .map(|q| (q.cluster().to_owned(), q.id()))
            .collect();
        let live_session = |cluster: &String, session: u64| live.get(cluster) == Some(&session);
        // Kept until it expires, not until its session ends: the agent may hold it.
        let now = Timestamp::now();
        self.pending.lock().retain(|_, p| now < p.expires);
        self.warned
            .lock()
            .retain(|cluster, session| live_session(cluster, *session));
    }

    async fn step(&self, session: &ClusterQueue) {
        let cluster = session.cluster();
        let Some(member) = self.members.member(cluster) else {
            return;
        };
        let hash = session.identity().token_hash;
        match auth::renewal(&member.spec, &hash, Timestamp::now(), self.lifetime) {
            Renewal::Keep => {}
            Renewal::End(NotAccepted::Expired(at)) => {
                warn!(%cluster, expired = %at, "the agent's token expired: ending its session; `flotilla-hub join {cluster} --rotate` issues a new one");
                self.metrics.count("expired");
                self.dispatcher.close(cluster);
            }
            // Revoked or rotated: the MemberCluster watch ends such sessions.
            Renewal::End(NotAccepted::Unknown) => {}
            Renewal::Promote => self.promote(session, &member, &hash).await,
            Renewal::Renew => {
                if self.settle(session) {
                    return;
                }
                if !session.renews_token() {
                    // A token without expiry held by an older agent stays as it is.
                    if member.spec.token_expires_at.is_none() {
                        return;
                    }
                    let first = self.warned.lock().insert(cluster.to_owned(), session.id())
                        != Some(session.id());
                    if first {
                        warn!(%cluster, expires = ?member.spec.token_expires_at.as_ref().map(|t| t.0), "the agent cannot store a renewed token (an older version): upgrade it before its token expires");
                    }
                    return;
                }
                match self.staged(session, &member) {
                    Staged::InFlight => {}
                    Staged::Resend => self.resend(session),
                    Staged::None => self.renew(session, &member).await,
                }
            }
        }
    }

    /// What became of the token this hub last staged for the session's cluster. A token
    /// staged and sent is sent again rather than replaced while the MemberCluster still
    /// names it: the agent may have stored it without its answer arriving (a session that
    /// ended, an answer in flight), and replacing it would leave that agent with a token
    /// no longer accepted. A token staged by an earlier hub is replaced: this hub cannot
    /// send it, and the agent opened its session with the current one, which it reads
    /// after every store of the session before has finished (the agent waits for them).
    fn staged(&self, session: &ClusterQueue, member: &MemberCluster) -> Staged {
        let retry = (self.lifetime / 20).clamp(Duration::from_secs(1), Duration::from_secs(300));
        let pending = self.pending.lock();
        let Some(p) = pending.get(session.cluster()) else {
            return Staged::None;
        };
        let named = member.spec.next_token_sha256.as_deref() == Some(p.hash.as_str());
        if !named || Timestamp::now() >= p.expires {
            Staged::None
        } else if p.session == session.id() && p.sent.elapsed() < retry {
            Staged::InFlight
        } else {
            Staged::Resend
        }
    }

    /// Sends the staged token again, on this session.
    fn resend(&self, session: &ClusterQueue) {
        let mut pending = self.pending.lock();
        let Some(p) = pending.get_mut(session.cluster()) else {
            return;
        };
        (p.session, p.sent, p.acked) = (session.id(), Instant::now(), false);
        session.renew_token(pb::RenewToken {
            token: p.token.expose_secret().to_owned(),
            expires_at_unix: p.expires.as_second(),
        });
        self.metrics.count("sent");
        info!(cluster = %session.cluster(), expires = %p.expires, "renewed token sent to the agent again");
    }

    /// Records a new token as the cluster's next one, then sends it to the agent.
    async fn renew(&self, session: &ClusterQueue, member: &MemberCluster) {
        let cluster = session.cluster();
        let Some(current) = &member.spec.token_sha256 else {
            return;
        };
        let token = auth::issue(cluster);
        let hash = auth::token_sha256(token.expose_secret());
        let expires = auth::expiry(Timestamp::now(), self.lifetime);
        // Tests the current hash: a revocation or a `join --rotate` since is never undone.
        let patch = json!([
            {"op": "test", "path": "/spec/tokenSha256", "value": current},
            {"op": "add", "path": "/spec/nextTokenSha256", "value": hash},
            {"op": "add", "path": "/spec/nextTokenExpiresAt", "value": expires.to_string()},
        ]);
        if let Err(e) = self.patch(cluster, patch).await {
            self.metrics.count("failed");
            warn!(%cluster, error = %e, "recording the MemberCluster's next token failed; retried on the next tick");
            return;
        }
        self.pending.lock().insert(
            cluster.to_owned(),
            Pending {
                session: session.id(),
                hash,
                token: token.clone(),
                expires,
                sent: Instant::now(),
                acked: false,
            },
        );
        session.renew_token(pb::RenewToken {
            token: token.expose_secret().to_owned(),
            expires_at_unix: expires.as_second(),
        });
        self.metrics.count("sent");
        info!(%cluster, %expires, "renewed token sent to the agent");
    }

    /// The agent's answer to a renewal.
    pub async fn renewed(&self, session: &ClusterQueue, answer: pb::TokenRenewed) {
        let cluster = session.cluster();
        {
            let mut pending = self.pending.lock();
            let Some(p) = (pending.get_mut(cluster))
                .filter(|p| p.session == session.id() && p.hash == answer.token_sha256)
            else {
                warn!(%cluster, "an answer to no renewal sent to this session, ignored");
                return;
            };
            if !answer.error.is_empty() {
                self.metrics.count("failed");
                // Stays pending: the next renewal waits for the retry interval.
                warn!(%cluster, error = %answer.error, "the agent could not store its renewed token; it keeps the current one");
                return;
            }
            p.acked = true;
        }
        if self.settle(session)
            && let Some(member) = self.members.member(cluster)
        {
            let hash = session.identity().token_hash;
            self.promote(session, &member, &hash).await;
        }
    }

    /// Once the agent acknowledged the renewal and the store shows its hash as the next
    /// token, the session counts as holding it (so that retiring the old one does not end
    /// it). True when the session now holds the next token.
    fn settle(&self, session: &ClusterQueue) -> bool {
        let cluster = session.cluster();
        let pending = self.pending.lock();
        let Some(p) = pending
            .get(cluster)
            .filter(|p| p.session == session.id() && p.acked)
        else {
            return false;
        };
        let staged = self
            .members
            .member(cluster)
            .is_some_and(|m| m.spec.next_token_sha256.as_deref() == Some(p.hash.as_str()));
        if staged {
            session.set_token_hash(&p.hash);
        }
        staged
    }

    /// The session holds the next token: it becomes the current one, the old one retired.
    async fn promote(&self, session: &ClusterQueue, member: &MemberCluster, hash: &str) {
        let cluster = session.cluster();
        let (Some(current), Some(expires)) = (
            &member.spec.token_sha256,
            &member.spec.next_token_expires_at,
        ) else {
            return;
        };
        // The store may still show it as the next token just after the promotion.
        if self.retired.lock().get(cluster).is_some_and(|h| h == hash) {
            return;
        }
        let patch = json!([
            {"op": "test", "path": "/spec/tokenSha256", "value": current},
            {"op": "test", "path": "/spec/nextTokenSha256", "value": hash},
            {"op": "replace", "path": "/spec/tokenSha256", "value": hash},
            {"op": "add", "path": "/spec/tokenExpiresAt", "value": expires.0.to_string()},
            {"op": "remove", "path": "/spec/nextTokenSha256"},
            {"op": "remove", "path": "/spec/nextTokenExpiresAt"},
        ]);
        match self.patch(cluster, patch).await {
            Ok(()) => {
                self.pending.lock().remove(cluster);
                self.retired
                    .lock()
                    .insert(cluster.to_owned(), hash.to_owned());
                self.metrics.count("renewed");
                info!(%cluster, expires = %expires.0, "token renewed: the agent holds the new one, the old one is retired");
            }
            Err(e) => {
                self.metrics.count("failed");
                warn!(%cluster, error = %e, "retiring the old token failed; both stay valid, retried on the next tick");
            }
        }
    }

    async fn patch(&self, cluster: &str, patch: serde_json::Value) -> Result<(), kube::Error> {
        self.api
            .patch(
                cluster,
                &PatchParams::default(),
                &Patch::Json::<()>(crate::writes::json_patch(patch)),
            )
            .await
            .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_crds::MemberClusterSpec;
    use k8s_openapi::jiff::SignedDuration;
    use kube::runtime::reflector;

    use crate::auth::Identity;

    fn renewer(dispatcher: Arc<Dispatcher>) -> Renewer {
        let client =
            kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap()))
                .unwrap();
        let (store, _) = reflector::store::<MemberCluster>();
        Renewer::new(
            Api::all(client),
            store,
            dispatcher,
            Duration::from_secs(90),
            RenewalMetrics::default(),
        )
    }

    fn member(next: Option<&str>) -> MemberCluster {
        let mut m = MemberCluster::new(
            "paris",
            MemberClusterSpec {
                token_sha256: Some("h1".into()),
                next_token_sha256: next.map(str::to_owned),
                ..Default::default()
            },
        );
        m.metadata.name = Some("paris".into());
        m
    }

    fn session(d: &Dispatcher) -> Arc<ClusterQueue> {
        d.planned_for(["paris".to_owned()].into());
        let identity = Identity {
            cluster: "paris".into(),
            token_hash: "h1".into(),
        };
        d.connect(&identity, &Default::default(), Default::default())
            .unwrap()
    }

    fn stage(r: &Renewer, session: &ClusterQueue, hash: &str, expires: Timestamp) {
        r.pending.lock().insert(
            "paris".into(),
            Pending {
                session: session.id(),
                hash: hash.into(),
                token: "paris.t2".into(),
                expires,
                sent: Instant::now(),
                acked: false,
            },
        );
    }

    /// Once sent, a next token may be held by the agent: it is sent again, never
    /// replaced, while the MemberCluster names it and it has not expired.
    #[tokio::test]
    async fn a_sent_token_is_sent_again_rather_than_replaced() {
        let d = Arc::new(Dispatcher::default());
        let r = renewer(d.clone());
        let first = session(&d);
        assert!(matches!(r.staged(&first, &member(None)), Staged::None));
        let later = Timestamp::now() + SignedDuration::from_secs(60);
        stage(&r, &first, "h2", later);
        assert!(matches!(
            r.staged(&first, &member(Some("h2"))),
            Staged::InFlight
        ));
        // The session ended unanswered; the next one gets the same token.
        d.close("paris");
        let second = session(&d);
        assert!(matches!(
            r.staged(&second, &member(Some("h2"))),
            Staged::Resend
        ));
        r.resend(&second);
        let sent = second.next_batch(10).await;
        let token = sent.iter().find_map(|m| match &m.kind {
            Some(pb::hub_message::Kind::RenewToken(t)) => Some(t.token.clone()),
            _ => None,
        });
        assert_eq!(token.as_deref(), Some("paris.t2"));
        assert!(matches!(
            r.staged(&second, &member(Some("h2"))),
            Staged::InFlight
        ));
        // Replaced only once the MemberCluster no longer names it (a rotation, a
        // revocation, an earlier hub's stage overwritten), or once it expired.
        assert!(matches!(
            r.staged(&second, &member(Some("h9"))),
            Staged::None
        ));
        assert!(matches!(r.staged(&second, &member(None)), Staged::None));
        stage(
            &r,
            &second,
            "h2",
            Timestamp::now() - SignedDuration::from_secs(1),
        );
        assert!(matches!(
            r.staged(&second, &member(Some("h2"))),
            Staged::None
        ));
    }

    #[tokio::test]
    async fn the_tick_is_a_tenth_of_the_lifetime_within_bounds() {
        let d = Arc::new(Dispatcher::default());
        let mut r = renewer(d);
        assert_eq!(r.tick(), Duration::from_secs(9));
        r.lifetime = Duration::from_secs(30 * 24 * 3600);
        assert_eq!(r.tick(), Duration::from_secs(60));
        r.lifetime = Duration::from_secs(1);
        assert_eq!(r.tick(), Duration::from_millis(200));
    }
}
