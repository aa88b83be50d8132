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
