//! A real S3 server for the tests: `s3s-fs` (the s3s project's S3 server over a
//! directory; `scripts/test` installs it with cargo), on 127.0.0.1, its objects plain
//! files under a temporary root so a test can damage one. One is shared by the test
//! binary (each test its own bucket); a test that takes the store away starts its own.
//! A watchdog stops each when this test binary exits.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

pub const ACCESS_KEY: &str = "bootfleet-test-access";
pub const SECRET_KEY: &str = "bootfleet-test-secret-0123456789";

pub struct S3 {
    pub endpoint: String,
    /// Buckets are directories here, objects files.
    pub root: PathBuf,
    base: PathBuf,
    host: String,
    port: u16,
    /// The server's pid (for a test that stops it).
    pid_file: PathBuf,
}

static SHARED: OnceLock<S3> = OnceLock::new();
static BUCKETS: AtomicUsize = AtomicUsize::new(0);

fn binary() -> PathBuf {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap_or_default();
    let installed = home.join("bin").join("s3s-fs");
    if installed.exists() {
        return installed;
    }
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|p| p.join("s3s-fs"))
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!(
                "s3s-fs not found: cargo install s3s-fs --version 0.14.1 --features binary --locked"
            )
        })
}

/// Starts an s3s-fs of its own (it lives until `kill` or the test binary's end).
pub fn start() -> S3 {
    start_on("127.0.0.1")
}

/// One listening on `host` (an address servers in other namespaces reach).
pub fn start_on(host: &str) -> S3 {
    let base = tempfile::Builder::new()
        .prefix("bootfleet-s3-")
        .tempdir()
        .unwrap()
        .keep();
    let port = {
        let l = std::net::TcpListener::bind((host, 0)).unwrap();
        l.local_addr().unwrap().port()
    };
    let data = base.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let s3 = S3 {
        endpoint: format!("http://{host}:{port}"),
        root: data,
        pid_file: base.join("pid"),
        base,
        host: host.to_string(),
        port,
    };
    s3.spawn();
    s3
}

pub fn shared() -> &'static S3 {
    SHARED.get_or_init(start)
}

impl S3 {
    /// Runs the server on its port and root, with a watchdog that stops it, and removes
    /// its files, once this test binary is gone.
    fn spawn(&self) {
        let script = format!(
            "{bin} --host {host} --port {port} --access-key {ACCESS_KEY} --secret-key {SECRET_KEY} \
               {data} >>{base}/log 2>&1 & s=$!; echo $s >{pid}; \
             while [ -d /proc/{me} ]; do sleep 0.5; done; \
             kill $s 2>/dev/null; wait $s; rm -rf {base}",
            bin = binary().display(),
            host = self.host,
            port = self.port,
            data = self.root.display(),
            base = self.base.display(),
            pid = self.pid_file.display(),
            me = std::process::id(),
        );
        let _ = std::fs::remove_file(&self.pid_file);
        crate::harness::run_detached(std::process::Command::new("sh"), &script, "s3s-fs");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !self.pid_file.exists()
            || std::net::TcpStream::connect((self.host.as_str(), self.port)).is_err()
        {
            assert!(
                std::time::Instant::now() < deadline,
                "s3s-fs did not start: {}",
                std::fs::read_to_string(self.base.join("log")).unwrap_or_default()
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// Starts the server again after `kill`, on the same port with the same objects.
    pub fn restart(&self) {
        self.spawn();
    }
    /// `[blobs]` for a new bucket of this server, with the credentials file in `dir`.
    pub fn config(&self, dir: &Path) -> bootfleet::image::objects::ObjectsConfig {
        let bucket = format!(
            "bf-{}-{}",
            std::process::id(),
            BUCKETS.fetch_add(1, Ordering::Relaxed)
        );
        self.config_for(dir, &bucket)
    }

    /// `[blobs]` for `bucket` (servers sharing one pass the same).
    pub fn config_for(&self, dir: &Path, bucket: &str) -> bootfleet::image::objects::ObjectsConfig {
        let credentials = dir.join("s3.credentials");
        std::fs::write(
            &credentials,
            format!("access_key_id = \"{ACCESS_KEY}\"\nsecret_access_key = \"{SECRET_KEY}\"\n"),
        )
        .unwrap();
        bootfleet::image::objects::ObjectsConfig {
            url: Some(format!("s3://{bucket}/fleet")),
            endpoint: Some(self.endpoint.clone()),
            region: None,
            credentials_file: Some(credentials),
            ..Default::default()
        }
    }

    /// Where s3s-fs keeps `digest`'s object in `bucket` (a plain file).
    pub fn object_path(&self, bucket: &str, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
        self.root
            .join(bucket)
            .join("fleet")
            .join("sha256")
            .join(hex)
    }

    /// The ETag the server gives `digest`'s object in `bucket` (a multipart upload's is
    /// `"<md5 of the parts' md5s>-<parts>"`).
    pub async fn etag(&self, bucket: &str, digest: &str) -> String {
        use rusty_s3::S3Action as _;
        let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
        let b = rusty_s3::Bucket::new(
            self.endpoint.parse().unwrap(),
            rusty_s3::UrlStyle::Path,
            bucket.to_string(),
            "us-east-1".to_string(),
        )
        .unwrap();
        let creds = rusty_s3::Credentials::new(ACCESS_KEY, SECRET_KEY);
        let url = b
            .head_object(Some(&creds), &format!("fleet/sha256/{hex}"))
            .sign(std::time::Duration::from_secs(60));
        let r = bootfleet::http_client::builder()
            .build()
            .unwrap()
            .head(url)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "HEAD {digest}: {}", r.status());
        r.headers()["etag"].to_str().unwrap().to_string()
    }

    /// Stops this server (kill -9): the object store goes away.
    pub fn kill(&self) {
        let pid = std::fs::read_to_string(&self.pid_file).unwrap();
        let ok = std::process::Command::new("kill")
            .args(["-9", pid.trim()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill s3s-fs");
    }
}

/// nginx in front of an S3 server, speaking HTTPS with a certificate for 127.0.0.1 from
/// a CA of its own (openssl): what a TLS-terminated object store looks like to bootfleet.
pub struct TlsFront {
    /// `https://127.0.0.1:<port>`
    pub endpoint: String,
    /// The CA's certificate (PEM), for `[blobs] ca_file`.
    pub ca_file: PathBuf,
    nginx: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        let _ = self.nginx.kill();
        let _ = self.nginx.wait();
    }
}

impl S3 {
    /// An HTTPS front for this server (nginx, one process, stopped when dropped).
    pub fn tls_front(&self) -> TlsFront {
        let dir = tempfile::tempdir().unwrap();
        let issue = "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=s3-ca 2>/dev/null && \
             openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout s3.key -out s3.csr -subj /CN=127.0.0.1 2>/dev/null && \
             printf 'subjectAltName=IP:127.0.0.1\\nbasicConstraints=CA:FALSE\\n' > s3.ext && \
             openssl x509 -req -in s3.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out s3.pem -days 2 -extfile s3.ext 2>/dev/null";
        let ok = std::process::Command::new("sh")
            .args(["-c", issue])
            .current_dir(dir.path())
            .status()
            .expect("openssl (the test command installs it)")
            .success();
        assert!(ok, "openssl could not issue the S3 front's certificate");
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let d = dir.path().display();
        // One process (no workers to change user to): reads the files of this test.
        let conf = format!(
            "daemon off; master_process off; pid {d}/nginx.pid; error_log {d}/error.log;
             events {{}}
             http {{
               access_log off;
               client_body_temp_path {d}/body; proxy_temp_path {d}/proxy;
               fastcgi_temp_path {d}/fcgi; uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
               server {{
                 listen 127.0.0.1:{port} ssl;
                 ssl_certificate {d}/s3.pem; ssl_certificate_key {d}/s3.key;
                 client_max_body_size 0;
                 proxy_request_buffering off; proxy_buffering off;
                 location / {{
                   proxy_pass http://127.0.0.1:{s3};
                   proxy_http_version 1.1;
                   proxy_set_header Host $http_host;
                 }}
               }}
             }}",
            s3 = self.port,
        );
        std::fs::write(dir.path().join("nginx.conf"), conf).unwrap();
        let nginx = std::process::Command::new("nginx")
            .args([
                "-e",
                &format!("{d}/error.log"),
                "-c",
                &format!("{d}/nginx.conf"),
            ])
            .spawn()
            .expect("nginx (the test command installs it)");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "nginx did not start: {}",
                std::fs::read_to_string(dir.path().join("error.log")).unwrap_or_default()
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        TlsFront {
            endpoint: format!("https://127.0.0.1:{port}"),
            ca_file: dir.path().join("ca.pem"),
            nginx,
            _dir: dir,
        }
    }
}
