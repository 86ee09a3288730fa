//! A private CA and a serving certificate it signs, for endpoints that need TLS without
//! an external issuer: the hub's gRPC endpoint (`flotilla-hub certs`) and the agent's
//! conversion webhook.

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};

/// PEM of a CA, of a certificate it signed, and of that certificate's key.
pub struct SelfSigned {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
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
        key_pem: key.serialize_pem(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_certificate_is_for_the_hosts_and_signed_by_a_separate_ca() {
        let s = self_signed("test CA", "test", &["localhost".into(), "127.0.0.1".into()]).unwrap();
        assert!(s.ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(s.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(s.key_pem.contains("PRIVATE KEY"));
        assert_ne!(s.ca_pem, s.cert_pem);
    }
}
