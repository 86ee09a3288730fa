//! Auth: the credentials agents present. A token is `<cluster>.<secret>`, issued by
//! `flotilla-hub join`, sent as `authorization: Bearer <token>` over TLS; the MemberCluster
//! of that name stores the SHA-256 of the whole token, never the token itself. Clearing
//! the hash (or deleting the MemberCluster) revokes it.

use std::sync::Arc;

use base64::Engine;
use flotilla_crds::MemberCluster;
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

pub fn member(store: &Store<MemberCluster>, name: &str) -> Option<Arc<MemberCluster>> {
    store.get(&ObjectRef::new(name))
}

/// The session's identity, if the token is current for the cluster it names.
pub fn authenticate(
    members: &Store<MemberCluster>,
    authorization: Option<&str>,
) -> Result<Identity, AuthError> {
    let (cluster, token) = parse(authorization)?;
    let identity = Identity {
        cluster: cluster.to_owned(),
        token_hash: token_sha256(token),
    };
    // Comparing digests, not secrets: timing reveals nothing usable about the token.
    if revoked(members, &identity) {
        return Err(AuthError::Refused(identity.cluster));
    }
    Ok(identity)
}

/// Whether the MemberCluster no longer accepts this identity's token: gone, being
/// deleted, revoked or rotated.
pub fn revoked(members: &Store<MemberCluster>, identity: &Identity) -> bool {
    member(members, &identity.cluster).is_none_or(|m| {
        m.spec.token_sha256.as_deref() != Some(identity.token_hash.as_str())
            || m.metadata.deletion_timestamp.is_some()
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
            authenticate(&s, Some(&bearer(a))),
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
            authenticate(&s, Some(&bearer(&t))).unwrap().cluster,
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
            assert_eq!(authenticate(&s, header), Err(want), "{header:?}");
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
        assert_eq!(authenticate(&s, Some(&bearer(&forged))), refused("paris"));
        assert_eq!(
            authenticate(&s, Some(&bearer(&issued("ghost")))),
            refused("ghost")
        );
        let s = store(&[("paris", None, false)]);
        assert_eq!(authenticate(&s, Some(&bearer(&good))), refused("paris"));
        let s = store(&[("paris", Some(&good), true)]);
        assert_eq!(authenticate(&s, Some(&bearer(&good))), refused("paris"));
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
