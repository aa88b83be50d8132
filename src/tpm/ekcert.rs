//! The endorsement key's certificate: issued for this EK by a CA the operator trusts
//! (a TPM vendor's, or swtpm's local CA in the tests). Checked with webpki, as TLS
//! certificates are, then bound to the EK the node presented.

use rustls::pki_types::{CertificateDer, UnixTime};

use super::wire::Public;

/// tcg-kp-EKCertificate (2.23.133.8.1), the extended key usage of an EK certificate.
const EKU_EK_CERTIFICATE: &[u8] = &[0x67, 0x81, 0x05, 0x08, 0x01];

/// The CAs EK certificates must chain to: roots and any intermediates, all accepted as
/// anchors (vendor chains vary; an operator lists what they trust).
pub struct EkRoots {
    certs: Vec<CertificateDer<'static>>,
}

#[derive(Debug, thiserror::Error)]
pub enum EkCertError {
    #[error("the EK certificate does not chain to a configured EK CA: {0}")]
    Chain(String),
    #[error("the EK certificate is for another key than the EK presented")]
    OtherKey,
    #[error("the TPM presented no EK certificate, and EK CAs are configured")]
    Missing,
}

impl EkRoots {
    /// Loads every certificate from the PEM files.
    pub fn load(files: &[std::path::PathBuf]) -> anyhow::Result<Self> {
        use rustls::pki_types::pem::PemObject;
        let mut certs = Vec::new();
        for f in files {
            let before = certs.len();
            for c in CertificateDer::pem_file_iter(f)
                .map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?
            {
                certs.push(c.map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?);
            }
            anyhow::ensure!(
                certs.len() > before,
                "{}: no certificate in it",
                f.display()
            );
        }
        Ok(EkRoots { certs })
    }

    /// Checks that `cert` (DER) was issued by a configured CA, is valid now, carries
    /// the EK usage where it names usages, and certifies `ek`'s key.
    pub fn check(&self, cert: &[u8], ek: &Public) -> Result<(), EkCertError> {
        let anchors: Vec<_> = self
            .certs
            .iter()
            .filter_map(|c| webpki::anchor_from_trusted_cert(c).ok())
            .collect();
        let der = CertificateDer::from(cert);
        let ee =
            webpki::EndEntityCert::try_from(&der).map_err(|e| EkCertError::Chain(e.to_string()))?;
        ee.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            &self.certs,
            UnixTime::now(),
            webpki::KeyUsage::required_if_present(EKU_EK_CERTIFICATE),
            None,
            None,
        )
        .map_err(|e| EkCertError::Chain(e.to_string()))?;
        // The RSAPublicKey is the last thing in a SubjectPublicKeyInfo (inside its BIT
        // STRING), so the certified key is the EK's exactly when the SPKI ends with it.
        let spki = ee.subject_public_key_info();
        if !spki.as_ref().ends_with(&ek.rsa_public_key_der()) {
            return Err(EkCertError::OtherKey);
        }
        Ok(())
    }
}
