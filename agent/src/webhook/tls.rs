//! The webhook's TLS identity: PEM files given on the command line (e.g. mounted from a
//! cert-manager Secret), or a CA and a serving certificate generated at start, whose CA
//! the agent then publishes as the CRD's `caBundle`.

use std::path::Path;
use std::sync::Arc;

use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use secrecy::{ExposeSecret, SecretString};

#[derive(thiserror::Error, Debug)]
pub enum TlsError {
    #[error("generating the self-signed certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing PEM: {0}")]
    Pem(#[from] rustls_pki_types::pem::Error),
    #[error("no certificate in the PEM")]
    NoCertificate,
    #[error("building the TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A serving certificate chain and key, in PEM (`Debug` prints the key redacted).
#[derive(Debug)]
pub struct Identity {
    pub cert_pem: String,
    pub key_pem: SecretString,
    /// The CA that signed `cert_pem`, when the agent made it: what clients must trust.
    pub ca_pem: Option<String>,
}

impl Identity {
    /// A fresh CA and a serving certificate it signs, valid for `hosts` (DNS names or IP
    /// addresses): for a webhook whose CA nobody else needs to trust across restarts.
    pub fn self_signed(hosts: &[String]) -> Result<Self, TlsError> {
        let s = flotilla_common::tls::self_signed(
            "flotilla-agent webhook CA",
            "flotilla-agent webhook",
            hosts,
        )?;
        Ok(Self {
            cert_pem: s.cert_pem,
            key_pem: s.key_pem,
            ca_pem: Some(s.ca_pem),
        })
    }

    /// A serving certificate for `hosts` signed by `ca` (the CA the replicas share).
    pub fn issued_by(ca: &flotilla_common::tls::Ca, hosts: &[String]) -> Result<Self, TlsError> {
        let s = ca.issue("flotilla-agent webhook", hosts)?;
        Ok(Self {
            cert_pem: s.cert_pem,
            key_pem: s.key_pem,
            ca_pem: Some(s.ca_pem),
        })
    }

    pub fn from_files(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|source| TlsError::Read {
                path: path.display().to_string(),
                source,
            })
        };
        Ok(Self {
            cert_pem: read(cert)?,
            key_pem: read(key)?.into(),
            ca_pem: None,
        })
    }

    /// A rustls server configuration for this identity (ring provider, HTTP/2 and 1.1).
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let chain = CertificateDer::pem_slice_iter(self.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()?;
        if chain.is_empty() {
            return Err(TlsError::NoCertificate);
        }
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.expose_secret().as_bytes())?;
        let mut config =
            ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()?
                .with_no_client_auth()
                .with_single_cert(chain, key)?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_signed_identity_serves_and_names_its_ca() {
        let identity = Identity::self_signed(&["localhost".into(), "127.0.0.1".into()]).unwrap();
        let ca = identity.ca_pem.as_deref().unwrap();
        assert!(ca.starts_with("-----BEGIN CERTIFICATE-----"));
        assert_ne!(
            ca, identity.cert_pem,
            "the serving certificate is not its own CA"
        );
        identity.server_config().unwrap();
    }

    #[test]
    fn debug_output_never_shows_the_key() {
        let identity = Identity::self_signed(&["localhost".into()]).unwrap();
        let body = identity.key_pem.expose_secret().lines().nth(1).unwrap();
        let shown = format!("{identity:?}");
        assert!(
            !shown.contains("PRIVATE KEY") && !shown.contains(body),
            "{shown}"
        );
        assert!(shown.contains("cert_pem"), "{shown}");
    }

    #[test]
    fn garbage_pem_is_an_error_not_a_panic() {
        let identity = Identity {
            cert_pem: "nothing".into(),
            key_pem: "nothing".into(),
            ca_pem: None,
        };
        assert!(identity.server_config().is_err());
        assert!(
            Identity::from_files(
                Path::new("/nonexistent/cert"),
                Path::new("/nonexistent/key")
            )
            .is_err()
        );
    }
}
