//! One real PostgreSQL server for this test binary (Debian's `postgresql`), started on
//! first use: `initdb` into a temporary directory, listening on a Unix socket there only
//! (no TCP port, nothing reachable from outside), run as the unprivileged `postgres` user
//! when the tests run as root. Each test gets a database of its own. A watchdog beside
//! the server stops it and removes its directory when this test binary exits.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

pub struct Postgres {
    socket_dir: PathBuf,
}

static SERVER: OnceLock<Postgres> = OnceLock::new();
static DATABASES: AtomicUsize = AtomicUsize::new(0);
const PORT: u16 = 5432;

fn bindir() -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|p| p.join("initdb").exists() && p.join("postgres").exists())
        .collect();
    found.sort();
    found.pop().unwrap_or_else(|| {
        panic!("PostgreSQL not found under /usr/lib/postgresql: apt-get install postgresql")
    })
}

/// `cmd` as the user PostgreSQL runs as: `postgres` when we are root (initdb refuses
/// root), else ourselves.
fn as_db_user(program: &Path) -> Command {
    if running_as_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// /proc/self belongs to the process's effective user.
fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(1)
        == 0
}

fn start() -> Postgres {
    let bin = bindir();
    let dir = tempfile::Builder::new()
        .prefix("bootfleet-pg-")
        .tempdir()
        .unwrap()
        .keep();
    if running_as_root() {
        let ok = Command::new("chown")
            .args(["postgres:postgres"])
            .arg(&dir)
            .status()
            .unwrap()
            .success();
        assert!(
            ok,
            "chown postgres {}: is the postgresql package installed?",
            dir.display()
        );
    }
    let data = dir.join("data");
    let out = as_db_user(&bin.join("initdb"))
        .args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
            "-E",
            "UTF8",
            "-D",
        ])
        .arg(&data)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "initdb failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The watchdog: the server lives while this test binary does.
    let script = format!(
        "{postgres} -D {data} -k {dir} -p {PORT} -c listen_addresses= -c fsync=off \
           -c max_connections=400 -c shared_buffers=64MB >{dir}/log 2>&1 & pg=$!; \
         while [ -d /proc/{me} ] && kill -0 $pg 2>/dev/null; do sleep 0.5; done; \
         kill -INT $pg 2>/dev/null; wait $pg; rm -rf {dir}",
        postgres = bin.join("postgres").display(),
        data = data.display(),
        dir = dir.display(),
        me = std::process::id(),
    );
    crate::harness::run_detached(as_db_user(Path::new("sh")), &script, "PostgreSQL");
    let socket = dir.join(format!(".s.PGSQL.{PORT}"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !socket.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "PostgreSQL did not start: {}",
            std::fs::read_to_string(dir.join("log")).unwrap_or_default()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Postgres { socket_dir: dir }
}

impl Postgres {
    fn url(&self, db: &str) -> String {
        format!(
            "postgres://postgres@localhost/{db}?host={}&port={PORT}",
            self.socket_dir.display()
        )
    }
}

/// A superuser connection to the shared server's `postgres` database.
pub async fn admin() -> sqlx::PgConnection {
    let server = SERVER.get_or_init(start);
    use sqlx::Connection as _;
    // The server may still be starting up behind its socket: retry briefly.
    let mut tries = 0;
    loop {
        match sqlx::PgConnection::connect(&server.url("postgres")).await {
            Ok(c) => return c,
            Err(_) if tries < 100 => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => panic!("cannot connect to the test PostgreSQL: {e}"),
        }
    }
}

/// Takes a test's database away (no new connections, every open one cut) or gives it
/// back: the store of that test's servers goes unreachable, as in a database outage.
pub async fn set_reachable(url: &str, reachable: bool) {
    let name = url
        .split_once("@localhost/")
        .and_then(|(_, rest)| rest.split('?').next())
        .unwrap();
    let mut admin = admin().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE {name} ALLOW_CONNECTIONS {reachable}"
    )))
    .execute(&mut admin)
    .await
    .unwrap();
    if !reachable {
        sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
            .bind(name)
            .execute(&mut admin)
            .await
            .unwrap();
    }
}

/// A new, empty database on the shared server; its URL.
pub async fn database() -> String {
    let server = SERVER.get_or_init(start);
    let name = format!(
        "bf_{}_{}",
        std::process::id(),
        DATABASES.fetch_add(1, Ordering::Relaxed)
    );
    let mut admin = admin().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .unwrap();
    server.url(&name)
}
