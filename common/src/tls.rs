//! A private CA and a serving certificate it signs, for endpoints that need TLS without
//! an external issuer: the hub's gRPC endpoint (`flotilla-hub certs`) and the agent's
//! conversion webhook.

use secrecy::SecretString;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};

/// PEM of a CA, of a certificate it signed, and of that certificate's key (which
/// `Debug` prints redacted).
#[derive(Debug)]
pub struct SelfSigned {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: SecretString,
}

/// A fresh CA named `ca_name` and a certificate named `name`, valid for `hosts` (DNS
/// names or IP addresses).
pub fn self_signed(
    ca_name: &str,
    name: &str,
    hosts: &[String],
) -> Result<SelfSigned, rcgen::Error> {
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca.distinguished_name.push(DnType::CommonName, ca_name);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate()?)?;
    let mut params = CertificateParams::new(hosts.to_vec())?;
    params.distinguished_name.push(DnType::CommonName, name);
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &ca)?;
    Ok(SelfSigned {
        ca_pem: ca.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem().into(),
    })
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
        let ca = der(ca_pem);
        let anchors = [anchor_from_trusted_cert(&ca)?.to_owned()];
        let leaf = der(cert_pem);
        let leaf = EndEntityCert::try_from(&leaf)?;
        leaf.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            &[],
            UnixTime::now(),
            KeyUsage::server_auth(),
            None,
            None,
        )?;
        let name = ServerName::try_from(name).expect("a DNS name or an IP address");
        leaf.verify_is_valid_for_subject_name(&name)
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
