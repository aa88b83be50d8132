//! Test harness: an in-process server on 127.0.0.1:0, bundle builders (well-formed and
//! hostile), and helpers to look at what the data directory holds.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use bootfleet::config::{FileConfig, Overrides, ServerConfig};
use bootfleet::image::bundle::BundleLimits;
use tokio_util::sync::CancellationToken;

pub struct TestServer {
    pub addr: SocketAddr,
    /// The admin API's own listener, when the settings give it one (`admin_listen`).
    pub admin_addr: Option<SocketAddr>,
    /// The HTTPS listener, when the settings give one (`[http] tls_listen`).
    pub tls_addr: Option<SocketAddr>,
    pub token: String,
    pub data: tempfile::TempDir,
    pub http: reqwest::Client,
    /// Where the admin helpers (`get`, `post`, `put`, `json`...) send, and with which
    /// client: the plain listener, or HTTPS after `use_https`.
    admin_base: String,
    admin_http: reqwest::Client,
    shutdown: CancellationToken,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl TestServer {
    pub async fn start() -> Self {
        Self::start_with(BundleLimits::default()).await
    }

    pub async fn start_with(limits: BundleLimits) -> Self {
        Self::start_configured(|cfg| cfg.limits = limits).await
    }

    /// A server whose settings `configure` adjusts first.
    pub async fn start_configured(configure: impl FnOnce(&mut ServerConfig)) -> Self {
        let data = tempfile::tempdir().unwrap();
        let mut cfg = ServerConfig::resolve(
            FileConfig::default(),
            Overrides {
                data_dir: Some(data.path().to_path_buf()),
                listen: Some("127.0.0.1:0".parse().unwrap()),
                ..Default::default()
            },
        );
        configure(&mut cfg);
        let state = bootfleet::server::open_state(&cfg).await.unwrap();
        let token = state.http.token.secret().to_string();
        let listener = bootfleet::server::listen(cfg.listen).unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        bootfleet::server::start_dhcp(&cfg, &state, shutdown.clone())
            .await
            .expect("DHCP starts");
        bootfleet::server::start_tftp(&cfg, &state, shutdown.clone())
            .await
            .expect("TFTP starts");
        let admin = cfg
            .admin_listen
            .map(|a| bootfleet::server::listen(a).unwrap());
        let admin_addr = admin.as_ref().map(|l| l.local_addr().unwrap());
        let tls = cfg
            .http
            .tls_listen
            .map(|a| bootfleet::server::listen(a).unwrap());
        let tls_addr = tls.as_ref().map(|l| l.local_addr().unwrap());
        let listeners = bootfleet::server::Listeners {
            boot: listener,
            admin,
            tls,
        };
        let task = tokio::spawn(bootfleet::server::run_on(
            listeners,
            state,
            shutdown.clone(),
        ));
        Self {
            addr,
            admin_addr,
            tls_addr,
            token,
            data,
            http: bootfleet::http_client::builder().build().unwrap(),
            admin_base: format!("http://{addr}"),
            admin_http: bootfleet::http_client::builder().build().unwrap(),
            shutdown,
            task: Some(task),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Sends the admin helpers over HTTPS (`[http] tls_listen`) with `client`, which
    /// trusts the test's CA: the plain listener no longer serves the admin API.
    pub fn use_https(&mut self, client: reqwest::Client) {
        self.admin_base = format!("https://{}", self.tls_addr.expect("an HTTPS listener"));
        self.admin_http = client;
    }

    fn admin_url(&self, path: &str) -> String {
        format!("{}{path}", self.admin_base)
    }

    pub fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.admin_http
            .get(self.admin_url(path))
            .bearer_auth(&self.token)
    }

    /// GETs an admin path; asserts 200 and returns the body as text (`/metrics`).
    pub async fn text(&self, path: &str) -> String {
        let r = self.get(path).send().await.unwrap();
        assert_eq!(r.status(), 200, "GET {path}");
        r.text().await.unwrap()
    }

    /// The value of an unlabelled series in `/metrics` (`bootfleet_store_writes_total`).
    pub async fn metric(&self, series: &str) -> u64 {
        let metrics = self.text("/metrics").await;
        let line = metrics
            .lines()
            .find(|l| l.strip_prefix(series).is_some_and(|v| v.starts_with(' ')))
            .unwrap_or_else(|| panic!("{series} is not exported"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    pub fn post(&self, path: &str) -> reqwest::RequestBuilder {
        self.admin_http
            .post(self.admin_url(path))
            .bearer_auth(&self.token)
    }

    pub fn put(&self, path: &str) -> reqwest::RequestBuilder {
        self.admin_http
            .put(self.admin_url(path))
            .bearer_auth(&self.token)
    }

    pub fn delete(&self, path: &str) -> reqwest::RequestBuilder {
        self.admin_http
            .delete(self.admin_url(path))
            .bearer_auth(&self.token)
    }

    /// Publishes `bundle`; returns status and JSON body.
    pub async fn publish(&self, bundle: Vec<u8>) -> (u16, serde_json::Value) {
        self.publish_query(bundle, "").await
    }

    pub async fn publish_query(&self, bundle: Vec<u8>, query: &str) -> (u16, serde_json::Value) {
        let r = self
            .post(&format!("/api/v1/images{query}"))
            .body(bundle)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    }

    /// Assigns image REF `image` to node `mac` (any spelling); asserts it was accepted.
    pub async fn assign(&self, mac: &str, image: &str) {
        let r = self
            .put(&format!("/api/v1/nodes/{mac}/image"))
            .json(&serde_json::json!({ "image": image }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "assign {image} to {mac}");
    }

    /// Sets label `key=value` on node `mac`; asserts it was accepted.
    pub async fn label(&self, mac: &str, key: &str, value: &str) {
        let r = self
            .http
            .patch(self.url(&format!("/api/v1/nodes/{mac}/labels")))
            .bearer_auth(&self.token)
            .json(&serde_json::json!({ "set": { key: value } }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "label {key}={value} on {mac}");
    }

    /// POSTs to an admin route with no body; returns the JSON answer.
    pub async fn post_json(&self, path: &str) -> serde_json::Value {
        self.post(path).send().await.unwrap().json().await.unwrap()
    }

    pub async fn json(&self, path: &str) -> (u16, serde_json::Value) {
        let r = self.get(path).send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    }

    pub fn blob_dir(&self) -> PathBuf {
        self.data.path().join("blobs").join("sha256")
    }

    /// Names in the blob directory (visible blobs and temp files).
    pub fn blob_dir_entries(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.blob_dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// Asserts the store holds no image, no blob and no temp file.
    pub async fn assert_empty(&self) {
        assert_eq!(
            self.blob_dir_entries(),
            Vec::<String>::new(),
            "blob directory"
        );
        let (status, images) = self.json("/api/v1/images").await;
        assert_eq!(status, 200);
        assert_eq!(images, serde_json::json!([]), "images");
    }

    pub async fn stop(mut self) {
        self.shutdown.cancel();
        self.task.take().unwrap().await.unwrap().unwrap();
    }
}

/// One tar entry; `kind` lets tests write entries a well-behaved tool never would.
pub struct Entry {
    pub name: String,
    pub kind: tar::EntryType,
    pub data: Vec<u8>,
    pub mtime: u64,
    pub link: Option<String>,
}

pub fn file(name: &str, data: &[u8]) -> Entry {
    Entry {
        name: name.into(),
        kind: tar::EntryType::Regular,
        data: data.to_vec(),
        mtime: 1_700_000_000,
        link: None,
    }
}

pub fn special(name: &str, kind: tar::EntryType, link: Option<&str>) -> Entry {
    Entry {
        name: name.into(),
        kind,
        data: Vec::new(),
        mtime: 0,
        link: link.map(String::from),
    }
}

/// A tar holding `entries` exactly as given: names are written raw into the header,
/// bypassing the tar crate's own path checks, as a hostile client would.
pub fn tar_of(entries: &[Entry]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for e in entries {
        let mut header = tar::Header::new_old();
        let name = e.name.as_bytes();
        assert!(name.len() < 100, "test names stay in the old header");
        header.as_old_mut().name[..name.len()].copy_from_slice(name);
        if let Some(link) = &e.link {
            header.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        header.set_entry_type(e.kind);
        header.set_size(e.data.len() as u64);
        header.set_mode(0o644);
        header.set_mtime(e.mtime);
        header.set_cksum();
        builder.append(&header, e.data.as_slice()).unwrap();
    }
    builder.into_inner().unwrap()
}

pub fn manifest(name: &str, version: &str) -> String {
    format!(
        "name = \"{name}\"\nversion = \"{version}\"\n\n[boot]\nkernel = \"vmlinuz\"\ninitrds = [\"initrd.img\"]\ncmdline = \"console=ttyS0 quiet\"\n\n[pins]\nkernel = \"6.1.0-28-cloud-amd64\"\nnvidia-driver = \"550.127.05\"\n\n[validation]\ngpus = 8\ngpu-model = \"H100\"\n"
    )
}

/// A good bundle: manifest, kernel, initrd.
pub fn good_entries(name: &str, version: &str, kernel: &[u8]) -> Vec<Entry> {
    vec![
        file("manifest.toml", manifest(name, version).as_bytes()),
        file("vmlinuz", kernel),
        file("initrd.img", b"initrd bytes"),
    ]
}

pub fn good_bundle(name: &str, version: &str, kernel: &[u8]) -> Vec<u8> {
    tar_of(&good_entries(name, version, kernel))
}

pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

pub fn zstd(bytes: &[u8]) -> Vec<u8> {
    zstd::stream::encode_all(bytes, 3).unwrap()
}

/// Pseudo-random bytes (xorshift), so tests need no RNG crate and are reproducible.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2).wrapping_add(1); // odd and distinct per seed
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The `bootfleet` binary built for these tests.
/// A PyPI tool the test command installs into a venv of its own under
/// `/opt/bootfleet-test/VENV` (or where `env` points); a clear failure when it is missing.
pub fn venv_tool(venv: &str, program: &str, package: &str, env: &str) -> PathBuf {
    let path = std::env::var_os(env)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(format!("/opt/bootfleet-test/{venv}/bin/{program}")));
    assert!(
        path.exists(),
        "{program} not found at {}: run the test command (scripts/test), which installs \
         {package} into /opt/bootfleet-test/{venv}, or set {env}",
        path.display()
    );
    path
}

pub fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_bootfleet"))
}

/// Runs `script` with `sh` (a `Command` for `sh`, perhaps under another user) in the
/// background: the shell started here returns at once and is reaped, the script lives
/// on. The test servers' watchdogs use it.
pub fn run_detached(mut sh: std::process::Command, script: &str, what: &str) {
    let started = sh
        .args(["-c", &format!("({script}) &")])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(started.success(), "cannot start {what}");
}

/// A tmpfs mounted for one test, unmounted when dropped.
pub struct Tmpfs(tempfile::TempDir);

impl Tmpfs {
    pub fn mount(size: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("mount runs (apt-get install mount; the tests run as root)")
            .success();
        assert!(ok, "cannot mount a tmpfs (the tests run as root)");
        Self(dir)
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.0.path())
            .status();
    }
}

/// xorshift64: reproducible, no RNG crate.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One to four mutations of `p`, as fuzzers make them: a byte changed, a cut, a byte
/// inserted (at `insert_from` or later), random bytes appended.
pub fn mutate(rng: &mut Rng, p: &mut Vec<u8>, insert_from: usize) {
    for _ in 0..1 + rng.below(4) {
        match rng.below(4) {
            0 if !p.is_empty() => {
                let at = rng.below(p.len());
                p[at] = rng.next() as u8;
            }
            0 => {}
            1 => p.truncate(rng.below(p.len() + 1)),
            2 => {
                let at = insert_from + rng.below(p.len().saturating_sub(insert_from).max(1));
                let at = at.min(p.len());
                p.insert(at, rng.next() as u8);
            }
            _ => p.extend((0..rng.below(40)).map(|_| rng.next() as u8)),
        }
    }
}

/// The string `field` of each object in the JSON array `list` (steps' names, history's
/// target states).
pub fn strings<'a>(list: &'a serde_json::Value, field: &str) -> Vec<&'a str> {
    list.as_array()
        .unwrap_or_else(|| panic!("not an array: {list}"))
        .iter()
        .map(|item| {
            item[field]
                .as_str()
                .unwrap_or_else(|| panic!("no {field} in {item}"))
        })
        .collect()
}
