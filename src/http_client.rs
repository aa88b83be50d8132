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

/// The system's roots of trust as a client configuration, made once a process and
/// shared. reqwest builds its default (the platform verifier) anew for every client, and
/// on Linux that reads and decodes every certificate the system holds: tens of
/// milliseconds, which a process building a client per simulated node or per BMC would
/// pay thousands of times (it was a fifth of the storm simulator's CPU).
pub fn system_roots() -> Result<rustls::ClientConfig, String> {
    use rustls_platform_verifier::BuilderVerifierExt as _;
    // Only a success is kept: a system without its CA bundle yet is asked again next
    // time. The roots are those of the first success (a CA bundle updated later is read
    // by the next process).
    static SHARED: std::sync::OnceLock<rustls::ClientConfig> = std::sync::OnceLock::new();
    if let Some(config) = SHARED.get() {
        return Ok(config.clone());
    }
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_platform_verifier()
        .map_err(|e| format!("the system's roots of trust: {e}"))?
        .with_no_client_auth();
    Ok(SHARED.get_or_init(|| config).clone())
}

/// A client builder that trusts the system's roots, from the shared configuration.
pub fn shared_roots_builder() -> Result<reqwest::ClientBuilder, String> {
    Ok(builder().tls_backend_preconfigured(system_roots()?))
}

/// A client builder that trusts only the CAs in `pem`.
pub fn trusting(pem: &str) -> Result<reqwest::ClientBuilder, String> {
    install_provider();
    Ok(reqwest::Client::builder().tls_backend_preconfigured(ca_config(pem)?))
}
