//! Auth: the credentials agents present. A token is `<cluster>.<secret>`, issued by
//! `flotilla-hub join`, sent as `authorization: Bearer <token>` over TLS; the MemberCluster
//! of that name stores the SHA-256 of the whole token, never the token itself. Clearing
//! the hash (or deleting the MemberCluster) revokes it.
//!
//! A token expires (`spec.tokenExpiresAt`); before it does, the hub renews it over the
//! agent's session (see `renew`). While a renewal is under way the MemberCluster holds two
//! hashes: the current token and the next one, both accepted, until the agent proves it
//! holds the next (it acknowledges it, or opens a session with it) and the next becomes
//! the current one. So no crash on either side, at any step, leaves the agent without a
//! token the hub accepts.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use flotilla_crds::{MemberCluster, MemberClusterSpec};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::runtime::reflector::{ObjectRef, Store};
use secrecy::SecretString;
use sha2::{Digest, Sha256};

/// Who a session is: the cluster, and the hash of the token it proved that with (to
/// notice a later revocation or rotation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub cluster: String,
    pub token_hash: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("missing bearer token (authorization: Bearer <token>)")]
    Missing,
    #[error("malformed token: expected <cluster>.<secret> as issued by flotilla-hub join")]
    Malformed,
    #[error("unknown or revoked credential for cluster {0:?}")]
    Refused(String),
    #[error(
        "the credential for cluster {cluster:?} expired at {at}; issue a new one with `flotilla-hub join {cluster} --rotate`"
    )]
    Expired { cluster: String, at: Timestamp },
}

/// Which of a MemberCluster's tokens a hash is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Token {
    Current,
    /// The renewed token the hub sent and the agent has not yet proven it holds.
    Next,
}

/// Why a hash is not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotAccepted {
    /// Not one of the cluster's tokens (revoked, rotated, never issued).
    Unknown,
    /// One of them, expired at this time.
    Expired(Timestamp),
}

/// Whether `spec` accepts the token of hash `hash` at `now`: the current token until it
/// expires (none set: never), the next one until it expires, and only while a current one
/// is set (clearing `tokenSha256` revokes both).
pub fn accepts(spec: &MemberClusterSpec, hash: &str, now: Timestamp) -> Result<Token, NotAccepted> {
    let current = spec.token_sha256.as_deref().ok_or(NotAccepted::Unknown)?;
    let (held, expires) = if current == hash {
        (Token::Current, &spec.token_expires_at)
    } else if spec.next_token_sha256.as_deref() == Some(hash) {
        (Token::Next, &spec.next_token_expires_at)
    } else {
        return Err(NotAccepted::Unknown);
    };
    match expires {
        Some(at) if now >= at.0 => Err(NotAccepted::Expired(at.0)),
        _ => Ok(held),
    }
}

/// When a token issued at `now` for `lifetime` expires, to the second (what a
/// MemberCluster stores); far-future lifetimes saturate at the largest timestamp.
pub fn expiry(now: Timestamp, lifetime: Duration) -> Timestamp {
    let at = SignedDuration::try_from(lifetime)
        .ok()
        .and_then(|d| now.checked_add(d).ok())
        .unwrap_or(Timestamp::MAX);
    Timestamp::from_second(at.as_second()).unwrap_or(Timestamp::MAX)
}

/// What the hub does about one session's credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// Valid for more than a third of a lifetime: nothing yet.
    Keep,
    /// No expiry, or a third of a lifetime or less left: issue the next token.
    Renew,
    /// The session holds the next token: make it the current one.
    Promote,
    /// Expired, or no longer one of the cluster's tokens: end the session.
    End(NotAccepted),
}

/// The step for a session that holds the token of hash `hash` (see [`Renewal`]).
pub fn renewal(
    spec: &MemberClusterSpec,
    hash: &str,
    now: Timestamp,
    lifetime: Duration,
) -> Renewal {
    match accepts(spec, hash, now) {
        Err(why) => Renewal::End(why),
        Ok(Token::Next) => Renewal::Promote,
        Ok(Token::Current) => {
            let Some(at) = &spec.token_expires_at else {
                return Renewal::Renew;
            };
            let third = SignedDuration::try_from(lifetime / 3).unwrap_or(SignedDuration::MAX);
            if at.0.duration_since(now) <= third {
                Renewal::Renew
            } else {
                Renewal::Keep
            }
        }
    }
}

/// A fresh token for `cluster`: 256 random bits after the cluster's name (`Debug`
/// prints it redacted).
pub fn issue(cluster: &str) -> SecretString {
    let mut secret = [0u8; 32];
    rand::fill(&mut secret);
    format!(
        "{cluster}.{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret)
    )
    .into()
}

/// What the MemberCluster stores: the hex SHA-256 of the whole token.
pub fn token_sha256(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// The cluster a token claims, and the token; nothing is checked yet.
fn parse(authorization: Option<&str>) -> Result<(&str, &str), AuthError> {
    let token = authorization
        .and_then(|h| h.strip_prefix("Bearer "))
        .ok_or(AuthError::Missing)?;
    match token.rsplit_once('.') {
        Some((cluster, secret)) if !cluster.is_empty() && !secret.is_empty() => {
            Ok((cluster, token))
        }
        _ => Err(AuthError::Malformed),
    }
}

/// Where MemberClusters are read by name: the hub's reflector store.
pub trait MemberLookup: Send + Sync {
    fn member(&self, name: &str) -> Option<Arc<MemberCluster>>;
}

impl MemberLookup for Store<MemberCluster> {
    fn member(&self, name: &str) -> Option<Arc<MemberCluster>> {
        self.get(&ObjectRef::new(name))
    }
}

/// The session's identity, if the token is one the cluster it names accepts at `now`.
pub fn authenticate(
    members: &(impl MemberLookup + ?Sized),
    authorization: Option<&str>,
    now: Timestamp,
) -> Result<Identity, AuthError> {
    let (cluster, token) = parse(authorization)?;
    let identity = Identity {
        cluster: cluster.to_owned(),
        token_hash: token_sha256(token),
    };
    // Comparing digests, not secrets: timing reveals nothing usable about the token.
    match members.member(cluster) {
        Some(m) if m.metadata.deletion_timestamp.is_none() => {
            match accepts(&m.spec, &identity.token_hash, now) {
                Ok(_) => Ok(identity),
                Err(NotAccepted::Expired(at)) => Err(AuthError::Expired {
                    cluster: identity.cluster,
                    at,
                }),
                Err(NotAccepted::Unknown) => Err(AuthError::Refused(identity.cluster)),
            }
        }
        _ => Err(AuthError::Refused(identity.cluster)),
    }
}

/// Whether the MemberCluster no longer accepts this identity's token: gone, being
/// deleted, revoked, rotated or expired.
pub fn revoked(members: &(impl MemberLookup + ?Sized), identity: &Identity) -> bool {
    members.member(&identity.cluster).is_none_or(|m| {
        m.metadata.deletion_timestamp.is_some()
            || accepts(&m.spec, &identity.token_hash, Timestamp::now()).is_err()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::runtime::{reflector, watcher};
    use secrecy::ExposeSecret;

    fn store(members: &[(&str, Option<&str>, bool)]) -> Store<MemberCluster> {
        let (store, mut writer) = reflector::store::<MemberCluster>();
        writer.apply_watcher_event(&watcher::Event::Init);
        for (name, token, deleting) in members {
            let mut m = MemberCluster::new(name, Default::default());
            m.spec.token_sha256 = token.map(token_sha256);
            if *deleting {
                m.metadata.deletion_timestamp = Some(Time(Default::default()));
            }
            writer.apply_watcher_event(&watcher::Event::InitApply(m));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        store
    }

    #[test]
    fn an_issued_token_never_shows_in_debug_output() {
        let token = issue("paris");
        let shown = format!("{token:?}");
        assert!(!shown.contains(token.expose_secret()), "{shown}");
        assert!(!shown.contains("paris."), "{shown}");
    }

    /// A token as the agent holds it: its file's text.
    fn issued(cluster: &str) -> String {
        issue(cluster).expose_secret().to_owned()
    }

    fn bearer(token: &str) -> String {
        format!("Bearer {token}")
    }

    fn authenticate_now(
        s: &Store<MemberCluster>,
        authorization: Option<&str>,
    ) -> Result<Identity, AuthError> {
        authenticate(s, authorization, Timestamp::now())
    }

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(second).unwrap()
    }

    /// A spec holding `current` (expiring at `expires`) and, if given, `next`.
    fn spec(
        current: Option<&str>,
        expires: Option<i64>,
        next: Option<(&str, i64)>,
    ) -> MemberClusterSpec {
        MemberClusterSpec {
            token_sha256: current.map(str::to_owned),
            token_expires_at: expires.map(|s| Time(at(s))),
            next_token_sha256: next.map(|(h, _)| h.to_owned()),
            next_token_expires_at: next.map(|(_, s)| Time(at(s))),
            ..Default::default()
        }
    }

    #[test]
    fn a_token_is_accepted_until_the_second_it_expires() {
        let s = spec(Some("h1"), Some(100), None);
        assert_eq!(accepts(&s, "h1", at(99)), Ok(Token::Current));
        assert_eq!(
            accepts(&s, "h1", at(100)),
            Err(NotAccepted::Expired(at(100)))
        );
        assert_eq!(
            accepts(&s, "h1", at(i64::from(i32::MAX))),
            Err(NotAccepted::Expired(at(100)))
        );
        assert_eq!(accepts(&s, "h2", at(0)), Err(NotAccepted::Unknown));
        assert_eq!(accepts(&s, "", at(0)), Err(NotAccepted::Unknown));
        // Issued before expiry existed: never expires (the hub renews it at once).
        let s = spec(Some("h1"), None, None);
        assert_eq!(accepts(&s, "h1", Timestamp::MAX), Ok(Token::Current));
    }

    #[test]
    fn during_a_renewal_both_tokens_are_accepted_each_until_its_own_expiry() {
        let s = spec(Some("h1"), Some(100), Some(("h2", 200)));
        assert_eq!(accepts(&s, "h1", at(50)), Ok(Token::Current));
        assert_eq!(accepts(&s, "h2", at(50)), Ok(Token::Next));
        assert_eq!(
            accepts(&s, "h1", at(150)),
            Err(NotAccepted::Expired(at(100)))
        );
        assert_eq!(accepts(&s, "h2", at(150)), Ok(Token::Next));
        assert_eq!(
            accepts(&s, "h2", at(200)),
            Err(NotAccepted::Expired(at(200)))
        );
        // Revoking (clearing the current hash) revokes the next token too.
        let s = spec(None, None, Some(("h2", 200)));
        assert_eq!(accepts(&s, "h2", at(50)), Err(NotAccepted::Unknown));
        // A next hash equal to the current one is the current one.
        let s = spec(Some("h1"), Some(100), Some(("h1", 200)));
        assert_eq!(
            accepts(&s, "h1", at(150)),
            Err(NotAccepted::Expired(at(100)))
        );
    }

    #[test]
    fn expiry_is_whole_seconds_and_saturates() {
        let now = Timestamp::from_millisecond(1_000_999).unwrap();
        assert_eq!(expiry(now, Duration::from_secs(9)), at(1_009));
        assert_eq!(expiry(now, Duration::from_millis(500)), at(1_001));
        assert_eq!(expiry(now, Duration::ZERO), at(1_000));
        assert_eq!(
            expiry(now, Duration::MAX),
            Timestamp::from_second(Timestamp::MAX.as_second()).unwrap()
        );
    }

    #[test]
    fn renewal_starts_with_a_third_of_the_lifetime_left_and_promotes_the_next_token() {
        let life = Duration::from_secs(90);
        let s = spec(Some("h1"), Some(100), None);
        assert_eq!(renewal(&s, "h1", at(10), life), Renewal::Keep);
        assert_eq!(renewal(&s, "h1", at(69), life), Renewal::Keep);
        assert_eq!(renewal(&s, "h1", at(70), life), Renewal::Renew);
        assert_eq!(renewal(&s, "h1", at(99), life), Renewal::Renew);
        assert_eq!(
            renewal(&s, "h1", at(100), life),
            Renewal::End(NotAccepted::Expired(at(100)))
        );
        assert_eq!(
            renewal(&s, "h0", at(10), life),
            Renewal::End(NotAccepted::Unknown)
        );
        // A token without expiry is renewed at once, which gives it one.
        assert_eq!(
            renewal(&spec(Some("h1"), None, None), "h1", at(10), life),
            Renewal::Renew
        );
        // A token issued for longer than today's lifetime waits for a third of today's.
        assert_eq!(
            renewal(&s, "h1", at(10), Duration::from_secs(30)),
            Renewal::Keep
        );
        assert_eq!(
            renewal(&s, "h1", at(90), Duration::from_secs(30)),
            Renewal::Renew
        );
        // Staged: the session on the current token keeps renewing (a lost renewal is
        // replaced); the one on the next token promotes it.
        let s = spec(Some("h1"), Some(100), Some(("h2", 190)));
        assert_eq!(renewal(&s, "h1", at(80), life), Renewal::Renew);
        assert_eq!(renewal(&s, "h2", at(80), life), Renewal::Promote);
        assert_eq!(renewal(&s, "h2", at(150), life), Renewal::Promote);
        assert_eq!(
            renewal(&s, "h2", at(190), life),
            Renewal::End(NotAccepted::Expired(at(190)))
        );
    }

    #[test]
    fn an_expired_token_is_refused_with_how_to_recover() {
        let good = issued("paris");
        let (store, mut writer) = reflector::store::<MemberCluster>();
        writer.apply_watcher_event(&watcher::Event::Init);
        let mut m = MemberCluster::new("paris", spec(Some(&token_sha256(&good)), Some(100), None));
        m.metadata.name = Some("paris".into());
        writer.apply_watcher_event(&watcher::Event::InitApply(m));
        writer.apply_watcher_event(&watcher::Event::InitDone);
        assert!(authenticate(&store, Some(&bearer(&good)), at(99)).is_ok());
        let err = authenticate(&store, Some(&bearer(&good)), at(100)).unwrap_err();
        assert_eq!(
            err,
            AuthError::Expired {
                cluster: "paris".into(),
                at: at(100)
            }
        );
        assert!(
            err.to_string().contains("flotilla-hub join paris --rotate"),
            "{err}"
        );
    }

    #[test]
    fn issued_tokens_name_their_cluster_and_differ() {
        let (a, b) = (issue("paris"), issue("paris"));
        let (a, b) = (a.expose_secret(), b.expose_secret());
        assert_ne!(a, b);
        let (cluster, secret) = a.split_once('.').unwrap();
        assert_eq!(cluster, "paris");
        // 256 bits, URL-safe base64 without padding: safe in a file, an env var, a header.
        assert_eq!(secret.len(), 43);
        assert!(
            secret
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        );
        let s = store(&[("paris", Some(a), false)]);
        assert_eq!(
            authenticate_now(&s, Some(&bearer(a))),
            Ok(Identity {
                cluster: "paris".into(),
                token_hash: token_sha256(a)
            })
        );
    }

    #[test]
    fn cluster_names_with_dots_authenticate() {
        let t = issued("eu.paris.prod");
        let s = store(&[("eu.paris.prod", Some(&t), false)]);
        assert_eq!(
            authenticate_now(&s, Some(&bearer(&t))).unwrap().cluster,
            "eu.paris.prod"
        );
    }

    #[test]
    fn missing_and_malformed_headers_are_refused_with_what_to_send() {
        let s = store(&[]);
        for (header, want) in [
            (None, AuthError::Missing),
            (Some("Basic abc"), AuthError::Missing),
            (Some("Bearer"), AuthError::Missing),
            (Some("Bearer nodot"), AuthError::Malformed),
            (Some("Bearer .secret"), AuthError::Malformed),
            (Some("Bearer paris."), AuthError::Malformed),
        ] {
            assert_eq!(authenticate_now(&s, header), Err(want), "{header:?}");
        }
    }

    #[test]
    fn wrong_revoked_deleted_or_unknown_credentials_are_refused() {
        let good = issued("paris");
        let other = issued("berlin");
        let refused = |c: &str| Err(AuthError::Refused(c.into()));
        // Another cluster's token cannot be relabelled: the hash covers the name.
        let forged = format!("paris.{}", other.split_once('.').unwrap().1);
        let s = store(&[
            ("paris", Some(&good), false),
            ("berlin", Some(&other), false),
        ]);
        assert_eq!(
            authenticate_now(&s, Some(&bearer(&forged))),
            refused("paris")
        );
        assert_eq!(
            authenticate_now(&s, Some(&bearer(&issued("ghost")))),
            refused("ghost")
        );
        let s = store(&[("paris", None, false)]);
        assert_eq!(authenticate_now(&s, Some(&bearer(&good))), refused("paris"));
        let s = store(&[("paris", Some(&good), true)]);
        assert_eq!(authenticate_now(&s, Some(&bearer(&good))), refused("paris"));
    }

    #[test]
    fn rotation_revokes_the_old_token_only() {
        let (old, new) = (issued("paris"), issued("paris"));
        let s = store(&[("paris", Some(&new), false)]);
        let id = |t: &str| Identity {
            cluster: "paris".into(),
            token_hash: token_sha256(t),
        };
        assert!(revoked(&s, &id(&old)));
        assert!(!revoked(&s, &id(&new)));
        assert!(
            revoked(&store(&[]), &id(&new)),
            "a deleted MemberCluster revokes"
        );
    }
}
