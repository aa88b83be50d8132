//! Whom a Redfish client trusts, per BMC: the system's roots, a pinned CA, one
//! certificate by its SHA-256 fingerprint, or (explicitly, and logged) anything. BMCs
//! mostly present self-signed certificates made at the factory, so a fingerprint pin is
//! the usual choice; a pinned fingerprint is checked instead of the chain and the name,
//! but the handshake's signature is still verified, so only the holder of that
//! certificate's key passes.

use std::sync::Arc;

use rustls::DigitallySignedStruct;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use sha2::{Digest as _, Sha256};

/// What to trust.
#[derive(Debug, Clone)]
pub enum Trust {
    SystemRoots,
    /// PEM text of the CA certificates (or a BMC's own certificate, when it is not a CA).
    Ca(String),
    /// The SHA-256 of the certificate's DER.
    Fingerprint([u8; 32]),
    Insecure,
}

/// Parses a fingerprint as hex, with or without colons (`openssl x509 -fingerprint
/// -sha256` prints `AB:CD:...`).
pub fn parse_fingerprint(s: &str) -> Result<[u8; 32], String> {
    let hex: String = s.chars().filter(|c| *c != ':').collect();
    let bytes = hex::decode(&hex).map_err(|_| format!("fingerprint {s:?} is not hex"))?;
    bytes
        .try_into()
        .map_err(|_| format!("fingerprint {s:?} is not 32 bytes (SHA-256)"))
}

/// The rustls configuration for `trust` (the system's roots: the process's shared one).
pub fn client_config(trust: &Trust) -> Result<rustls::ClientConfig, String> {
    let provider = crate::http_client::provider();
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let config = match trust {
        Trust::SystemRoots => crate::http_client::system_roots()?,
        Trust::Ca(pem) => crate::http_client::ca_config(pem)?,
        Trust::Fingerprint(pin) => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Pinned {
                pin: Some(*pin),
                algorithms: provider.signature_verification_algorithms,
            }))
            .with_no_client_auth(),
        Trust::Insecure => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Pinned {
                pin: None,
                algorithms: provider.signature_verification_algorithms,
            }))
            .with_no_client_auth(),
    };
    Ok(config)
}

/// Accepts the one certificate whose fingerprint is `pin` (any certificate when None).
#[derive(Debug)]
struct Pinned {
    pin: Option<[u8; 32]>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(pin) = self.pin else {
            return Ok(ServerCertVerified::assertion());
        };
        let seen: [u8; 32] = Sha256::digest(end_entity.as_ref()).into();
        if seen == pin {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(format!(
                "the BMC's certificate has SHA-256 fingerprint {}, not the pinned {}",
                hex::encode(seen),
                hex::encode(pin)
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_parse_with_or_without_colons() {
        let hex = "ab".repeat(32);
        let colons = vec!["AB"; 32].join(":");
        assert_eq!(parse_fingerprint(&hex).unwrap(), [0xab; 32]);
        assert_eq!(parse_fingerprint(&colons).unwrap(), [0xab; 32]);
        assert!(parse_fingerprint("abcd").unwrap_err().contains("32 bytes"));
        assert!(parse_fingerprint("zz").unwrap_err().contains("not hex"));
    }

    #[test]
    fn a_ca_file_without_certificates_is_refused() {
        assert!(client_config(&Trust::Ca("nothing here".into())).is_err());
        assert!(client_config(&Trust::Fingerprint([0; 32])).is_ok());
        assert!(client_config(&Trust::SystemRoots).is_ok());
    }
}
