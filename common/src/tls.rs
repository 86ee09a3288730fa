//! A private CA and a serving certificate it signs, for endpoints that need TLS without
//! an external issuer: the hub's gRPC endpoint (`flotilla-hub certs`) and the agent's
//! conversion webhook.

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, PublicKeyData,
};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

/// PEM of a CA, of a certificate it signed, and of that certificate's key (which
/// `Debug` prints redacted).
#[derive(Debug)]
pub struct SelfSigned {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: SecretString,
}

/// A CA's certificate and key, in PEM: kept (e.g. in a Secret) to issue certificates
/// that clients trusting `cert_pem` accept, across restarts and replicas.
#[derive(Debug, Clone)]
pub struct Ca {
    pub cert_pem: String,
    pub key_pem: SecretString,
}

/// How long a CA made here is valid.
pub const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 86_400);
/// How long a certificate a CA issues is valid, unless said otherwise.
pub const CERT_VALIDITY: Duration = Duration::from_secs(365 * 86_400);
/// Validity starts this long before now: a client whose clock is a little behind still
/// accepts a certificate issued a moment ago.
const BACKDATE: Duration = Duration::from_secs(3600);

/// Sets `params`' validity: from a little before now, for `valid`.
fn valid_for(params: &mut CertificateParams, valid: Duration) {
    let now = time::OffsetDateTime::now_utc();
    let span = |d: Duration| time::Duration::try_from(d).unwrap_or(time::Duration::MAX);
    params.not_before = now - span(BACKDATE);
    params.not_after = now.saturating_add(span(valid));
}

impl Ca {
    /// A fresh CA named `name`, valid for [`CA_VALIDITY`].
    pub fn generate(name: &str) -> Result<Ca, rcgen::Error> {
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        valid_for(&mut ca, CA_VALIDITY);
        ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        ca.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate()?;
        let ca = CertifiedIssuer::self_signed(ca, key)?;
        Ok(Ca {
            cert_pem: ca.pem(),
            key_pem: ca.key().serialize_pem().into(),
        })
    }

    /// Whether the key is the CA certificate's: one that is not signs certificates that
    /// chain to nothing. False for PEM that does not parse.
    pub fn key_matches(&self) -> bool {
        let (Ok(key), Ok(der)) = (
            KeyPair::from_pem(self.key_pem.expose_secret()),
            CertificateDer::from_pem_slice(self.cert_pem.as_bytes()),
        ) else {
            return false;
        };
        let spki = key.subject_public_key_info();
        der.windows(spki.len()).any(|w| w == spki.as_slice())
    }

    /// A certificate named `name` for `hosts` (DNS names or IP addresses), signed by
    /// this CA with a fresh key (see [`Self::key_matches`] for a CA read from storage),
    /// valid for [`CERT_VALIDITY`].
    pub fn issue(&self, name: &str, hosts: &[String]) -> Result<SelfSigned, rcgen::Error> {
        self.issue_valid_for(name, hosts, CERT_VALIDITY)
    }

    /// [`Self::issue`], valid for `valid`.
    pub fn issue_valid_for(
        &self,
        name: &str,
        hosts: &[String],
        valid: Duration,
    ) -> Result<SelfSigned, rcgen::Error> {
        let ca_key = KeyPair::from_pem(self.key_pem.expose_secret())?;
        let ca_der = CertificateDer::from_pem_slice(self.cert_pem.as_bytes())
            .map_err(|_| rcgen::Error::CouldNotParseCertificate)?;
        let issuer = Issuer::from_ca_cert_der(&ca_der, ca_key)?;
        let mut params = CertificateParams::new(hosts.to_vec())?;
        valid_for(&mut params, valid);
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &issuer)?;
        Ok(SelfSigned {
            ca_pem: self.cert_pem.clone(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem().into(),
        })
    }
}

/// A fresh CA named `ca_name` and a certificate named `name`, valid for `hosts` (DNS
/// names or IP addresses).
pub fn self_signed(
    ca_name: &str,
    name: &str,
    hosts: &[String],
) -> Result<SelfSigned, rcgen::Error> {
    Ca::generate(ca_name)?.issue(name, hosts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::PublicKeyData;
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, ServerName, UnixTime};
    use secrecy::ExposeSecret;
    use webpki::{EndEntityCert, KeyUsage, anchor_from_trusted_cert};

    fn der(pem: &str) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(pem.as_bytes()).expect("one PEM certificate")
    }

    /// Verifies `cert_pem` for TLS server use against `ca_pem` as the only trust anchor,
    /// now, as a TLS client does; then checks it is valid for `name`.
    fn verify(ca_pem: &str, cert_pem: &str, name: &str) -> Result<(), webpki::Error> {
        verify_at(ca_pem, cert_pem, name, UnixTime::now())
    }

    /// [`verify`] as a client whose clock reads `at`.
    fn verify_at(
        ca_pem: &str,
        cert_pem: &str,
        name: &str,
        at: UnixTime,
    ) -> Result<(), webpki::Error> {
        let ca = der(ca_pem);
        let anchors = [anchor_from_trusted_cert(&ca)?.to_owned()];
        let leaf = der(cert_pem);
        let leaf = EndEntityCert::try_from(&leaf)?;
        leaf.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            &[],
            at,
            KeyUsage::server_auth(),
            None,
            None,
        )?;
        let name = ServerName::try_from(name).expect("a DNS name or an IP address");
        leaf.verify_is_valid_for_subject_name(&name)
    }

    /// Validity is bounded: a certificate from a minute ago and up to its validity is
    /// accepted (a client a little behind too), one past it is expired. (A trust
    /// anchor carries no expiry for rustls: the leaf's validity is what bounds it here.)
    #[test]
    fn certificates_and_cas_expire() {
        let in_secs = |d: Duration| {
            let now = UnixTime::now().as_secs();
            UnixTime::since_unix_epoch(Duration::from_secs(now + d.as_secs()))
        };
        let ago = UnixTime::since_unix_epoch(Duration::from_secs(UnixTime::now().as_secs() - 60));
        let ca = Ca::generate("expiring CA").unwrap();
        let day = Duration::from_secs(86_400);
        let s = ca.issue_valid_for("short", &hosts(), 2 * day).unwrap();
        verify_at(&ca.cert_pem, &s.cert_pem, "localhost", ago).unwrap();
        verify_at(&ca.cert_pem, &s.cert_pem, "localhost", in_secs(day)).unwrap();
        let late = verify_at(&ca.cert_pem, &s.cert_pem, "localhost", in_secs(3 * day));
        assert!(
            matches!(late, Err(webpki::Error::CertExpired { .. })),
            "{late:?}"
        );
        let year = ca.issue("default", &hosts()).unwrap();
        verify_at(
            &ca.cert_pem,
            &year.cert_pem,
            "localhost",
            in_secs(364 * day),
        )
        .unwrap();
        assert!(
            verify_at(
                &ca.cert_pem,
                &year.cert_pem,
                "localhost",
                in_secs(366 * day)
            )
            .is_err()
        );
    }

    fn hosts() -> Vec<String> {
        vec!["localhost".into(), "127.0.0.1".into(), "::1".into()]
    }

    #[test]
    fn the_certificate_chains_to_its_ca_and_is_valid_for_every_host() {
        let s = self_signed("test CA", "test", &hosts()).unwrap();
        for host in ["localhost", "127.0.0.1", "::1"] {
            verify(&s.ca_pem, &s.cert_pem, host).unwrap_or_else(|e| panic!("{host}: {e}"));
        }
    }

    #[test]
    fn the_certificate_is_for_nothing_else() {
        let s = self_signed("test CA", "test", &hosts()).unwrap();
        for other in ["example.com", "localhost.example", "127.0.0.2", "::2"] {
            assert!(
                matches!(
                    verify(&s.ca_pem, &s.cert_pem, other),
                    Err(webpki::Error::CertNotValidForName(_))
                ),
                "valid for {other}"
            );
        }
        // The CN is no name a client accepts; only the SANs are.
        assert!(verify(&s.ca_pem, &s.cert_pem, "test").is_err());
    }

    #[test]
    fn another_ca_does_not_vouch_for_it_nor_does_it_vouch_for_itself() {
        let s = self_signed("test CA", "test", &hosts()).unwrap();
        let other = self_signed("test CA", "test", &hosts()).unwrap();
        // Same CA name, other key: the signature does not verify.
        let forged = verify(&other.ca_pem, &s.cert_pem, "localhost");
        assert!(
            matches!(
                forged,
                Err(webpki::Error::InvalidSignatureForPublicKey | webpki::Error::UnknownIssuer)
            ),
            "{forged:?}"
        );
        // A leaf used as an anchor signs nothing: it is no CA.
        assert!(verify(&s.cert_pem, &other.cert_pem, "localhost").is_err());
        assert_ne!(s.ca_pem, s.cert_pem);
    }

    /// A CA kept as PEM and read back issues certificates that chain to it; a CA whose
    /// key is another's is told apart, and what it signs chains to nothing.
    #[test]
    fn a_kept_ca_issues_certificates_that_chain_to_it() {
        let ca = Ca::generate("kept CA").unwrap();
        let kept = Ca {
            cert_pem: ca.cert_pem.clone(),
            key_pem: ca.key_pem.expose_secret().to_owned().into(),
        };
        let a = kept.issue("a", &hosts()).unwrap();
        let b = kept.issue("b", &hosts()).unwrap();
        assert_eq!(a.ca_pem, ca.cert_pem);
        verify(&ca.cert_pem, &a.cert_pem, "localhost").unwrap();
        verify(&ca.cert_pem, &b.cert_pem, "127.0.0.1").unwrap();
        let other = Ca::generate("kept CA").unwrap();
        assert!(ca.key_matches() && kept.key_matches());
        let mismatched = Ca {
            cert_pem: ca.cert_pem.clone(),
            key_pem: other.key_pem.clone(),
        };
        assert!(!mismatched.key_matches());
        let signed = mismatched.issue("c", &hosts()).unwrap();
        assert!(verify(&ca.cert_pem, &signed.cert_pem, "localhost").is_err());
        let garbage = Ca {
            cert_pem: "not PEM".into(),
            key_pem: ca.key_pem.clone(),
        };
        assert!(!garbage.key_matches());
        assert!(garbage.issue("c", &hosts()).is_err());
    }

    #[test]
    fn the_key_is_the_certificate_s() {
        // The private key's public half is the one the certificate carries.
        let s = self_signed("test CA", "test", &hosts()).unwrap();
        let key = KeyPair::from_pem(s.key_pem.expose_secret()).unwrap();
        let cert = der(&s.cert_pem);
        let spki = key.subject_public_key_info();
        assert!(
            cert.windows(spki.len()).any(|w| w == spki.as_slice()),
            "the certificate does not hold the key's public key"
        );
    }

    #[test]
    fn debug_output_never_shows_the_key() {
        let s = self_signed("test CA", "test", &hosts()).unwrap();
        let shown = format!("{s:?}");
        let body = s.key_pem.expose_secret().lines().nth(1).unwrap();
        assert!(
            !shown.contains("PRIVATE KEY") && !shown.contains(body),
            "{shown}"
        );
        assert!(
            shown.contains(&s.cert_pem.escape_debug().to_string()),
            "{shown}"
        );
    }
}
