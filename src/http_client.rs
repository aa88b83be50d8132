//! Every outbound HTTP client is built here: reqwest over rustls with the ring provider
//! (pure Rust and assembly; reqwest's default, aws-lc, is a C library built with cmake).
//! reqwest with `rustls-no-provider` panics when a client is built before a provider is
//! installed, so nothing builds one any other way.

/// rustls's process-wide provider (ring), installed once.
pub fn install_provider() {
    // Err means one is installed already, which is all we need.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// A reqwest client builder with the provider in place.
pub fn builder() -> reqwest::ClientBuilder {
    install_provider();
    reqwest::Client::builder()
}

/// The certificates of a PEM bundle as roots of trust: a private CA's, or a self-signed
/// server's own.
pub fn ca_roots(pem: &str) -> Result<rustls::RootCertStore, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        let cert = cert.map_err(|e| format!("the CA file is not PEM: {e}"))?;
        roots
            .add(cert)
            .map_err(|e| format!("the CA file holds a certificate rustls refuses: {e}"))?;
    }
    if roots.is_empty() {
        return Err("the CA file holds no certificate".into());
    }
    Ok(roots)
}

/// The provider every TLS configuration here is built with (ring), clients and servers.
pub fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    std::sync::Arc::new(rustls::crypto::ring::default_provider())
}

/// A client configuration that trusts only the CAs in `pem` (not the system's roots).
pub fn ca_config(pem: &str) -> Result<rustls::ClientConfig, String> {
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(ca_roots(pem)?)
        .with_no_client_auth())
}

/// A client builder that trusts only the CAs in `pem`.
pub fn trusting(pem: &str) -> Result<reqwest::ClientBuilder, String> {
    install_provider();
    Ok(reqwest::Client::builder().tls_backend_preconfigured(ca_config(pem)?))
}
