//! Serving: the certificate the hub presents to agents, read from its files (e.g. a
//! mounted Secret that cert-manager renews) and read again when they change, for new
//! connections; sessions already open keep theirs. A pair that does not load (a key that
//! does not match, a file caught half-written) is logged and the one in use is kept.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use rustls::ServerConfig;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

#[derive(Debug, thiserror::Error)]
pub enum ServingError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: no PEM certificate")]
    NoCertificate { path: PathBuf },
    #[error("{path}: {reason}")]
    Parse { path: PathBuf, reason: String },
    #[error("{cert} and {key} do not make a serving pair: {reason}")]
    Pair {
        cert: PathBuf,
        key: PathBuf,
        reason: String,
    },
}

/// The hub's serving certificate, swapped in place when its files change.
#[derive(Debug)]
pub struct ServingCert {
    cert: PathBuf,
    key: PathBuf,
    current: RwLock<Loaded>,
}

#[derive(Debug)]
struct Loaded {
    /// The files' bytes it was loaded from: a change of either is a reload.
    files: (Vec<u8>, Vec<u8>),
    key: Arc<CertifiedKey>,
}

impl ServingCert {
    /// Loads the pair once; an error here stops the hub (it has nothing to serve with).
    pub fn load(cert: PathBuf, key: PathBuf) -> Result<Arc<Self>, ServingError> {
        let files = read(&cert, &key)?;
        let loaded = certified(&cert, &key, &files)?;
        Ok(Arc::new(Self {
            cert,
            key,
            current: RwLock::new(Loaded { files, key: loaded }),
        }))
    }

    /// A pair given as PEM, never reloaded (tests, benchmarks).
    pub fn from_pem(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<Self>, ServingError> {
        let (cert, key) = (PathBuf::from("(certificate)"), PathBuf::from("(key)"));
        let files = (cert_pem.to_vec(), key_pem.to_vec());
        let loaded = certified(&cert, &key, &files)?;
        Ok(Arc::new(Self {
            cert,
            key,
            current: RwLock::new(Loaded { files, key: loaded }),
        }))
    }

    /// Reads the files again; swaps in the pair when they changed and it loads.
    /// Ok(true) when a new certificate is now served.
    pub fn reload(&self) -> Result<bool, ServingError> {
        let files = read(&self.cert, &self.key)?;
        if self.current.read().files == files {
            return Ok(false);
        }
        let key = certified(&self.cert, &self.key, &files)?;
        *self.current.write() = Loaded { files, key };
        Ok(true)
    }

    /// A rustls configuration that asks this for its certificate on every handshake.
    pub fn server_config(self: &Arc<Self>) -> Arc<ServerConfig> {
        let mut config =
            ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("ring supports the default protocol versions")
                .with_no_client_auth()
                .with_cert_resolver(self.clone());
        // gRPC is HTTP/2 only.
        config.alpn_protocols = vec![b"h2".to_vec()];
        Arc::new(config)
    }

    /// Re-reads the files every `interval` until `shutdown`.
    pub async fn watch(self: Arc<Self>, interval: Duration, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            match self.reload() {
                Ok(true) => {
                    failing = false;
                    info!(cert = %self.cert.display(), "serving certificate reloaded: new connections get it");
                }
                Ok(false) => failing = false,
                // Once per bad pair, not per tick.
                Err(e) => {
                    if !failing {
                        warn!(error = %e, "the serving certificate's files do not load; the one in use is kept");
                    }
                    failing = true;
                }
            }
        }
    }
}

impl ResolvesServerCert for ServingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().key.clone())
    }
}

fn read(cert: &Path, key: &Path) -> Result<(Vec<u8>, Vec<u8>), ServingError> {
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| ServingError::Read {
            path: path.to_owned(),
            source,
        })
    };
    Ok((read(cert)?, read(key)?))
}

fn certified(
    cert: &Path,
    key: &Path,
    (cert_pem, key_pem): &(Vec<u8>, Vec<u8>),
) -> Result<Arc<CertifiedKey>, ServingError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ServingError::Parse {
            path: cert.to_owned(),
            reason: e.to_string(),
        })?;
    if chain.is_empty() {
        return Err(ServingError::NoCertificate {
            path: cert.to_owned(),
        });
    }
    let private = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| ServingError::Parse {
        path: key.to_owned(),
        reason: e.to_string(),
    })?;
    let provider = rustls::crypto::ring::default_provider();
    // Checks that the key is the certificate's.
    CertifiedKey::from_der(chain, private, &provider)
        .map(Arc::new)
        .map_err(|e| ServingError::Pair {
            cert: cert.to_owned(),
            key: key.to_owned(),
            reason: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use secrecy::ExposeSecret;

    fn dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "flotilla-serving-test-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn pair() -> (String, String) {
        let s = flotilla_common::tls::self_signed("ca", "hub", &["localhost".into()]).unwrap();
        (s.cert_pem, s.key_pem.expose_secret().to_owned())
    }

    fn served(s: &ServingCert) -> Vec<u8> {
        s.current.read().key.cert[0].to_vec()
    }

    fn der(pem: &str) -> Vec<u8> {
        CertificateDer::from_pem_slice(pem.as_bytes())
            .unwrap()
            .to_vec()
    }

    #[test]
    fn a_changed_pair_is_served_and_a_bad_one_keeps_the_last_good() {
        let d = dir();
        let (cert, key) = (d.join("tls.crt"), d.join("tls.key"));
        let (c1, k1) = pair();
        std::fs::write(&cert, &c1).unwrap();
        std::fs::write(&key, &k1).unwrap();
        let s = ServingCert::load(cert.clone(), key.clone()).unwrap();
        assert_eq!(served(&s), der(&c1));
        assert!(!s.reload().unwrap(), "unchanged files are no reload");

        let (c2, k2) = pair();
        std::fs::write(&cert, &c2).unwrap();
        std::fs::write(&key, &k2).unwrap();
        assert!(s.reload().unwrap());
        assert_eq!(served(&s), der(&c2));

        // Half-way through a rotation: the new certificate, the old key.
        let (c3, _) = pair();
        std::fs::write(&cert, &c3).unwrap();
        let e = s.reload().unwrap_err();
        assert!(matches!(e, ServingError::Pair { .. }), "{e}");
        assert!(e.to_string().contains("tls.crt"), "{e}");
        assert_eq!(served(&s), der(&c2));
        std::fs::write(&cert, "not a certificate").unwrap();
        assert!(s.reload().is_err());
        std::fs::remove_file(&key).unwrap();
        assert!(matches!(s.reload(), Err(ServingError::Read { .. })));
        assert_eq!(served(&s), der(&c2));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_pair_that_does_not_load_stops_the_start() {
        let d = dir();
        let (cert, key) = (d.join("tls.crt"), d.join("tls.key"));
        let ((c1, _), (_, k2)) = (pair(), pair());
        std::fs::write(&cert, c1).unwrap();
        std::fs::write(&key, k2).unwrap();
        assert!(ServingCert::load(cert, key).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
