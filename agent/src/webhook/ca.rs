//! The webhook's CA, shared by every agent replica of a member through one Secret: the
//! first replica creates it, the others (and every restart) read it, so the CRD's
//! `caBundle` names a CA whose certificates every replica serves, whichever the
//! apiserver reaches, and it does not change at a restart.

use std::collections::BTreeMap;

use flotilla_common::tls::Ca;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use secrecy::ExposeSecret;
use tracing::info;

/// The CA's name in the certificates it signs.
const CA_NAME: &str = "flotilla-agent webhook CA";
/// The Secret's keys (as cert-manager names a CA's).
const CERT_KEY: &str = "ca.crt";
const KEY_KEY: &str = "ca.key";

#[derive(thiserror::Error, Debug)]
pub enum CaError {
    #[error("reading Secret {namespace}/{name}: {source}")]
    Read {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("creating Secret {namespace}/{name}: {source}")]
    Create {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("Secret {namespace}/{name}: {why}")]
    Invalid {
        namespace: String,
        name: String,
        why: String,
    },
    #[error("generating the webhook CA: {0}")]
    Generate(#[from] rcgen::Error),
}

impl CaError {
    /// A refusal of the agent's credential or rights: retrying does not help.
    pub fn needs_a_person(&self) -> bool {
        match self {
            CaError::Read { source, .. } | CaError::Create { source, .. } => {
                matches!(source, kube::Error::Api(s) if matches!(s.code, 401 | 403))
            }
            CaError::Invalid { .. } | CaError::Generate(_) => true,
        }
    }
}

/// The CA a Secret holds, or why it holds none usable.
pub fn from_secret(secret: &Secret) -> Result<Ca, String> {
    let data = secret.data.as_ref();
    let field = |key: &str| {
        let bytes = data
            .and_then(|d| d.get(key))
            .ok_or_else(|| format!("no key {key:?}"))?;
        String::from_utf8(bytes.0.clone()).map_err(|_| format!("{key:?} is not PEM text"))
    };
    let ca = Ca {
        cert_pem: field(CERT_KEY)?,
        key_pem: field(KEY_KEY)?.into(),
    };
    if !ca.key_matches() {
        return Err(format!(
            "{KEY_KEY:?} is not the key of the certificate in {CERT_KEY:?} (or either is not PEM)"
        ));
    }
    Ok(ca)
}

/// The Secret named `name` that holds `ca`.
pub fn to_secret(namespace: &str, name: &str, ca: &Ca) -> Secret {
    let data = BTreeMap::from([
        (
            CERT_KEY.to_owned(),
            ByteString(ca.cert_pem.clone().into_bytes()),
        ),
        (
            KEY_KEY.to_owned(),
            ByteString(ca.key_pem.expose_secret().as_bytes().to_vec()),
        ),
    ]);
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/name".to_owned(),
                "flotilla-agent".to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        data: Some(data),
        type_: Some("Opaque".into()),
        ..Secret::default()
    }
}

/// The CA in Secret `namespace/name`: read if it exists, else made and created. A
/// create that conflicts means another replica created it meanwhile: its CA is read.
/// A Secret that holds no usable CA is an error (it is never overwritten: a person may
/// have put a CA there on purpose).
pub async fn shared(client: Client, namespace: &str, name: &str) -> Result<Ca, CaError> {
    let api: Api<Secret> = Api::namespaced(client, namespace);
    let read = |source| CaError::Read {
        namespace: namespace.into(),
        name: name.into(),
        source,
    };
    let usable = |secret: &Secret| {
        from_secret(secret).map_err(|why| CaError::Invalid {
            namespace: namespace.into(),
            name: name.into(),
            why,
        })
    };
    if let Some(secret) = api.get_opt(name).await.map_err(read)? {
        return usable(&secret);
    }
    let ca = Ca::generate(CA_NAME)?;
    match api
        .create(&PostParams::default(), &to_secret(namespace, name, &ca))
        .await
    {
        Ok(_) => {
            info!(secret = %format!("{namespace}/{name}"), "created the webhook CA");
            Ok(ca)
        }
        Err(kube::Error::Api(s)) if s.code == 409 => usable(&api.get(name).await.map_err(read)?),
        Err(source) => Err(CaError::Create {
            namespace: namespace.into(),
            name: name.into(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_round_trips_its_ca() {
        let ca = Ca::generate(CA_NAME).unwrap();
        let secret = to_secret("flotilla-system", "flotilla-agent-webhook-ca", &ca);
        assert_eq!(
            secret.metadata.namespace.as_deref(),
            Some("flotilla-system")
        );
        let back = from_secret(&secret).unwrap();
        assert_eq!(back.cert_pem, ca.cert_pem);
        assert_eq!(back.key_pem.expose_secret(), ca.key_pem.expose_secret());
    }

    /// A Secret that holds no usable CA is refused, saying what is wrong with it.
    #[test]
    fn unusable_secrets_are_refused_naming_the_key() {
        let ca = Ca::generate(CA_NAME).unwrap();
        let other = Ca::generate(CA_NAME).unwrap();
        let mut empty = to_secret("ns", "s", &ca);
        empty.data = None;
        assert_eq!(from_secret(&empty).unwrap_err(), "no key \"ca.crt\"");
        let mut no_key = to_secret("ns", "s", &ca);
        no_key.data.as_mut().unwrap().remove(KEY_KEY);
        assert_eq!(from_secret(&no_key).unwrap_err(), "no key \"ca.key\"");
        let mut binary = to_secret("ns", "s", &ca);
        binary
            .data
            .as_mut()
            .unwrap()
            .insert(CERT_KEY.into(), ByteString(vec![0xff, 0xfe]));
        assert_eq!(
            from_secret(&binary).unwrap_err(),
            "\"ca.crt\" is not PEM text"
        );
        let mixed = to_secret(
            "ns",
            "s",
            &Ca {
                cert_pem: ca.cert_pem.clone(),
                key_pem: other.key_pem.clone(),
            },
        );
        assert!(
            from_secret(&mixed).unwrap_err().contains("is not the key"),
            "a key of another CA"
        );
    }

    #[test]
    fn only_refusals_and_bad_content_wait_for_a_person() {
        let api = |code: u16| {
            kube::Error::Api(kube::core::Status::failure("x", "").with_code(code).boxed())
        };
        let read = |code| CaError::Read {
            namespace: "ns".into(),
            name: "s".into(),
            source: api(code),
        };
        assert!(read(403).needs_a_person());
        assert!(read(401).needs_a_person());
        assert!(!read(500).needs_a_person());
        assert!(!read(429).needs_a_person());
        let invalid = CaError::Invalid {
            namespace: "ns".into(),
            name: "s".into(),
            why: "no key".into(),
        };
        assert!(invalid.needs_a_person());
        assert_eq!(invalid.to_string(), "Secret ns/s: no key");
    }
}
