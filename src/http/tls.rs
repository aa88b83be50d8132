//! HTTPS for the listeners: rustls (ring, `http_client::provider`, as every client here), the certificate chain
//! and key read from PEM files and reloaded on SIGHUP or when either file changes (polled
//! every few seconds: no inotify dependency, and a certificate manager's rename is seen
//! all the same). A pair that does not load is logged and the one in use kept, so a
//! half-written renewal never takes the API down.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio_util::sync::CancellationToken;

/// How often the files are looked at.
const POLL: Duration = Duration::from_secs(2);

/// The certificate in use, and where it is reloaded from.
#[derive(Debug)]
pub struct Certificates {
    cert_file: PathBuf,
    key_file: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
    /// The files' modification times when last loaded.
    loaded: Mutex<(Option<SystemTime>, Option<SystemTime>)>,
    /// SIGHUP, taken as the certificate is first loaded: a signal sent before the watch
    /// starts waits for it instead of ending the process (SIGHUP's default).
    hup: Mutex<Option<tokio::signal::unix::Signal>>,
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// The chain in `cert_file` and the key in `key_file`, checked to belong together.
pub fn load(cert_file: &Path, key_file: &Path) -> Result<CertifiedKey, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_file)
        .map_err(|e| format!("cannot read {}: {e}", cert_file.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| {
            format!(
                "{} is not a PEM certificate chain: {e}",
                cert_file.display()
            )
        })?;
    if chain.is_empty() {
        return Err(format!("{} holds no certificate", cert_file.display()));
    }
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(|e| {
        format!(
            "cannot read a PEM private key from {}: {e}",
            key_file.display()
        )
    })?;
    let certified = CertifiedKey::from_der(chain, key, &crate::http_client::provider())
        .map_err(|e| format!("{} and {}: {e}", cert_file.display(), key_file.display()))?;
    Ok(certified)
}

impl Certificates {
    /// Loads the pair; on a tokio runtime (SIGHUP is taken there).
    pub fn open(cert_file: PathBuf, key_file: PathBuf) -> Result<Arc<Self>, String> {
        use tokio::signal::unix::{SignalKind, signal};
        let stamps = (modified(&cert_file), modified(&key_file));
        let current = load(&cert_file, &key_file)?;
        let hup = signal(SignalKind::hangup())
            .map_err(|e| tracing::warn!(error = %e, "no SIGHUP handler: certificates reload on change only"))
            .ok();
        Ok(Arc::new(Self {
            cert_file,
            key_file,
            current: RwLock::new(Arc::new(current)),
            loaded: Mutex::new(stamps),
            hup: Mutex::new(hup),
        }))
    }

    /// Loads the files again when `force`d or when either changed since; true when a new
    /// pair is in use.
    pub fn reload(&self, force: bool) -> bool {
        let stamps = (modified(&self.cert_file), modified(&self.key_file));
        let mut loaded = self.loaded.lock().expect("never poisoned");
        if !force && *loaded == stamps {
            return false;
        }
        *loaded = stamps;
        match load(&self.cert_file, &self.key_file) {
            Ok(pair) => {
                *self.current.write().expect("never poisoned") = Arc::new(pair);
                tracing::info!(cert = %self.cert_file.display(), "TLS certificate reloaded");
                true
            }
            Err(error) => {
                tracing::error!(error, "TLS certificate not reloaded: the one in use stays");
                false
            }
        }
    }

    /// Reloads on SIGHUP and when the files change, until `stop`.
    pub async fn watch(self: Arc<Self>, stop: CancellationToken) {
        let mut hup = self.hup.lock().expect("never poisoned").take();
        let mut tick = tokio::time::interval(POLL);
        loop {
            let forced = tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => false,
                Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => true,
            };
            let this = self.clone();
            // Reading and parsing files: off the async workers.
            let _ = tokio::task::spawn_blocking(move || this.reload(forced)).await;
        }
    }

    /// The server configuration that answers every handshake with the pair in use.
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<rustls::ServerConfig>, String> {
        let mut config =
            rustls::ServerConfig::builder_with_provider(crate::http_client::provider())
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?
                .with_no_client_auth()
                .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().expect("never poisoned").clone())
    }
}
