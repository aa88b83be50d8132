//! Against a small HTTP/1.1 server written here, whose misbehaviours are switched on per
//! test: cut connections, silent connections, 5xx, 404, Range ignored, a wrong
//! Content-Range, a flipped byte.

use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::AtomicUsize;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// What the server does; the counters are spent one per connection.
#[derive(Default)]
struct Behaviour {
    data: Vec<u8>,
    /// Answer every request with this status and no body.
    status: Option<u16>,
    /// Send the whole blob with 200 whatever the Range.
    ignore_range: bool,
    /// Answer 206 with a Content-Range one byte off.
    wrong_content_range: bool,
    /// The next this many bodies stop after `cut_after` bytes (connection closed).
    cut: AtomicUsize,
    /// The next this many bodies go silent after `cut_after` bytes (connection held).
    stall: AtomicUsize,
    cut_after: usize,
    /// The next this many requests get 503 with `Retry-After: 0`.
    busy: AtomicUsize,
    requests: AtomicUsize,
    ranged_requests: AtomicUsize,
}

fn take(counter: &AtomicUsize) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

async fn serve(b: Behaviour) -> (String, Arc<Behaviour>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/blobs/sha256/x", listener.local_addr().unwrap());
    let b = Arc::new(b);
    let server = b.clone();
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            tokio::spawn(answer(conn, server.clone()));
        }
    });
    (url, b)
}

/// One request per connection (`Connection: close`): a resumed range is always a new
/// connection, as after a real cut.
async fn answer(mut conn: TcpStream, b: Arc<Behaviour>) {
    let Some(head) = read_head(&mut conn).await else {
        return;
    };
    b.requests.fetch_add(1, Ordering::SeqCst);
    let range = head.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.eq_ignore_ascii_case("range")
            .then(|| value.trim().to_string())
    });
    if range.is_some() {
        b.ranged_requests.fetch_add(1, Ordering::SeqCst);
    }
    if let Some(status) = b.status {
        let _ = conn
            .write_all(
                format!("HTTP/1.1 {status} Nope\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await;
        return;
    }
    if take(&b.busy) {
        let _ = conn
            .write_all(b"HTTP/1.1 503 Busy\r\nRetry-After: 0\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .await;
        return;
    }
    let len = b.data.len();
    let asked = range.as_deref().and_then(|r| {
        let (a, z) = r.strip_prefix("bytes=")?.split_once('-')?;
        Some((
            a.parse::<usize>().ok()?,
            z.parse::<usize>().ok()?.min(len - 1),
        ))
    });
    let (head, body) = match asked {
        Some((a, z)) if !b.ignore_range => {
            let shown = if b.wrong_content_range { a + 1 } else { a };
            (
                format!(
                    "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {shown}-{z}/{len}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    z + 1 - a
                ),
                &b.data[a..=z],
            )
        }
        _ => (
            format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"),
            &b.data[..],
        ),
    };
    if conn.write_all(head.as_bytes()).await.is_err() {
        return;
    }
    let (cut, stall) = (take(&b.cut), take(&b.stall));
    let sent = if cut || stall {
        b.cut_after.min(body.len())
    } else {
        body.len()
    };
    for chunk in body[..sent].chunks(64 << 10) {
        if conn.write_all(chunk).await.is_err() {
            return;
        }
    }
    if stall {
        // Silent, but open: only the client's stall timeout gets it out.
        tokio::time::sleep(Duration::from_secs(20)).await;
    }
}

async fn read_head(conn: &mut TcpStream) -> Option<String> {
    let mut head = Vec::new();
    let mut byte = [0; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if conn.read(&mut byte).await.ok()? == 0 || head.len() > 8192 {
            return None;
        }
        head.push(byte[0]);
    }
    String::from_utf8(head).ok()
}

/// A few MiB that is no multiple of anything.
fn blob() -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..(3 << 20) + 4321)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn client() -> reqwest::Client {
    // Under `cargo test --workspace` reqwest carries the server's `rustls-no-provider`
    // feature and refuses to build a client until a process-wide provider is installed;
    // built for this crate alone it has no TLS, and installing one changes nothing.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder().build().unwrap()
}

fn quick(streams: usize) -> FetchOptions {
    FetchOptions {
        streams,
        single_stream_below: 0,
        stall_timeout: Duration::from_secs(5),
        first_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(40),
        ..FetchOptions::default()
    }
}

struct Run {
    dir: tempfile::TempDir,
    dest: PathBuf,
}

impl Run {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("root.img");
        Self { dir, dest }
    }

    async fn fetch(
        &self,
        url: &str,
        data: &[u8],
        opts: &FetchOptions,
    ) -> Result<FetchStats, Stage1Error> {
        let size = data.len() as u64;
        fetch_blob(&client(), url, size, &Digest::of(data), &self.dest, opts).await
    }

    /// Nothing but what the test put there: no `.part`, no partial `dest`.
    fn assert_empty(&self) {
        let left: Vec<_> = fs::read_dir(self.dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
    }
}

#[tokio::test]
async fn a_small_blob_comes_whole_in_one_stream() {
    let data = blob();
    let (url, server) = serve(Behaviour {
        data: data.clone(),
        ..Behaviour::default()
    })
    .await;
    let run = Run::new();
    let (tx, rx) = watch::channel(0);
    // Four streams asked for, but the blob is under the default 64 MiB threshold.
    let opts = FetchOptions {
        progress: Some(tx),
        ..FetchOptions::default()
    };
    let stats = run.fetch(&url, &data, &opts).await.unwrap();
    assert_eq!(fs::read(&run.dest).unwrap(), data);
    assert_eq!((stats.streams, stats.resumes, stats.retries), (1, 0, 0));
    assert_eq!(stats.bytes, data.len() as u64);
    assert_eq!(server.requests.load(Ordering::SeqCst), 1);
    assert_eq!(server.ranged_requests.load(Ordering::SeqCst), 1);
    assert_eq!(*rx.borrow(), data.len() as u64);
    let mode = fs::metadata(&run.dest).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    assert!(!part_path(&run.dest).exists());
}

#[tokio::test]
async fn a_large_blob_comes_in_four_ranges() {
    let data = blob();
    let (url, server) = serve(Behaviour {
        data: data.clone(),
        ..Behaviour::default()
    })
    .await;
    let run = Run::new();
    let stats = run.fetch(&url, &data, &quick(4)).await.unwrap();
    assert_eq!(fs::read(&run.dest).unwrap(), data);
    assert_eq!((stats.streams, stats.resumes), (4, 0));
    assert_eq!(server.ranged_requests.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn cut_connections_resume_where_they_stopped() {
    let data = blob();
    let (url, server) = serve(Behaviour {
        data: data.clone(),
        cut: AtomicUsize::new(6),
        cut_after: 100_000,
        ..Behaviour::default()
    })
    .await;
    let run = Run::new();
    let stats = run.fetch(&url, &data, &quick(4)).await.unwrap();
    assert_eq!(fs::read(&run.dest).unwrap(), data);
    assert_eq!(stats.resumes, 6);
    assert_eq!(server.requests.load(Ordering::SeqCst), 4 + 6);
}

#[tokio::test]
async fn a_silent_connection_is_cut_and_resumed() {
    let data = blob();
    let (url, _server) = serve(Behaviour {
        data: data.clone(),
        stall: AtomicUsize::new(2),
        cut_after: 50_000,
        ..Behaviour::default()
    })
    .await;
    let run = Run::new();
    let opts = FetchOptions {
        stall_timeout: Duration::from_millis(300),
        ..quick(2)
    };
    let stats = run.fetch(&url, &data, &opts).await.unwrap();
    assert_eq!(fs::read(&run.dest).unwrap(), data);
    assert_eq!(stats.resumes, 2);
}

#[tokio::test]
async fn a_busy_server_is_retried_after_its_retry_after() {
    let data = blob();
    let (url, _server) = serve(Behaviour {
        data: data.clone(),
        busy: AtomicUsize::new(2),
        ..Behaviour::default()
    })
    .await;
    let run = Run::new();
    let stats = run.fetch(&url, &data, &quick(4)).await.unwrap();
    assert_eq!(fs::read(&run.dest).unwrap(), data);
    assert_eq!((stats.retries, stats.resumes), (2, 0));
}

#[tokio::test]
async fn a_server_that_stays_busy_is_given_up_on() {
    let data = blob();
    let (url, server) = serve(Behaviour {
        data: data.clone(),
        busy: AtomicUsize::new(usize::MAX),
        ..Behaviour::default()
    })
    .await;
    let run = Run::new();
    let opts = FetchOptions {
        tries: 3,
        ..quick(4)
    };
    let err = run.fetch(&url, &data, &opts).await.unwrap_err();
    assert!(matches!(err, Stage1Error::GaveUp { tries: 3, .. }), "{err}");
    assert!(err.to_string().contains("503"), "{err}");
    assert_eq!(server.requests.load(Ordering::SeqCst), 3);
    run.assert_empty();
}

#[tokio::test]
async fn a_flipped_byte_is_a_digest_mismatch_naming_both() {
    let data = blob();
    let mut served = data.clone();
    served[1 << 20] ^= 0x40;
    let (url, _server) = serve(Behaviour {
        data: served.clone(),
        ..Behaviour::default()
    })
    .await;
    let run = Run::new();
    let err = run.fetch(&url, &data, &quick(4)).await.unwrap_err();
    let Stage1Error::DigestMismatch {
        expected, found, ..
    } = &err
    else {
        panic!("expected a digest mismatch, got {err}");
    };
    assert_eq!(
        (*expected, *found),
        (Digest::of(&data), Digest::of(&served))
    );
    let text = err.to_string();
    assert!(text.contains(&expected.to_string()) && text.contains(&found.to_string()));
    run.assert_empty();
}

#[tokio::test]
async fn not_found_is_final_and_leaves_nothing() {
    let data = blob();
    let (url, server) = serve(Behaviour {
        data: data.clone(),
        status: Some(404),
        ..Behaviour::default()
    })
    .await;
    let run = Run::new();
    let err = run.fetch(&url, &data, &quick(4)).await.unwrap_err();
    assert!(
        matches!(err, Stage1Error::Http { status: 404, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("404"), "{err}");
    assert_eq!(server.requests.load(Ordering::SeqCst), 1, "not retried");
    run.assert_empty();
}

#[tokio::test]
async fn a_server_ignoring_range_sends_the_whole_blob_once() {
    let data = blob();
    let (url, server) = serve(Behaviour {
        data: data.clone(),
        ignore_range: true,
        ..Behaviour::default()
    })
    .await;
    let run = Run::new();
    let stats = run.fetch(&url, &data, &quick(4)).await.unwrap();
    assert_eq!(fs::read(&run.dest).unwrap(), data);
    assert_eq!(stats.streams, 1);
    assert_eq!(server.requests.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_server_ignoring_range_cannot_be_resumed() {
    let data = blob();
    let (url, _server) = serve(Behaviour {
        data: data.clone(),
        ignore_range: true,
        cut: AtomicUsize::new(1),
        cut_after: 100_000,
        ..Behaviour::default()
    })
    .await;
    let run = Run::new();
    let err = run.fetch(&url, &data, &quick(4)).await.unwrap_err();
    assert!(matches!(err, Stage1Error::Protocol { .. }), "{err}");
    assert!(err.to_string().contains("ignored Range"), "{err}");
    run.assert_empty();
}

#[tokio::test]
async fn a_content_range_other_than_asked_is_refused() {
    let data = blob();
    let (url, _server) = serve(Behaviour {
        data: data.clone(),
        wrong_content_range: true,
        ..Behaviour::default()
    })
    .await;
    let run = Run::new();
    let err = run.fetch(&url, &data, &quick(4)).await.unwrap_err();
    assert!(matches!(err, Stage1Error::Protocol { .. }), "{err}");
    assert!(err.to_string().contains("Content-Range"), "{err}");
    run.assert_empty();
}

#[tokio::test]
async fn the_deadline_ends_a_stuck_fetch_and_removes_the_part() {
    let data = blob();
    let (url, _server) = serve(Behaviour {
        data: data.clone(),
        stall: AtomicUsize::new(usize::MAX),
        cut_after: 10_000,
        ..Behaviour::default()
    })
    .await;
    let run = Run::new();
    let opts = FetchOptions {
        deadline: Some(Duration::from_millis(300)),
        ..quick(1)
    };
    let err = run.fetch(&url, &data, &opts).await.unwrap_err();
    assert!(matches!(err, Stage1Error::Deadline { .. }), "{err}");
    run.assert_empty();
}

#[tokio::test]
async fn an_existing_part_or_destination_is_not_touched() {
    let data = blob();
    let (url, server) = serve(Behaviour {
        data: data.clone(),
        ..Behaviour::default()
    })
    .await;
    let run = Run::new();
    let part = part_path(&run.dest);
    fs::write(&part, b"someone else's").unwrap();
    let err = run.fetch(&url, &data, &quick(1)).await.unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EEXIST), "{err}");
    assert_eq!(fs::read(&part).unwrap(), b"someone else's");
    fs::rename(&part, &run.dest).unwrap();
    let err = run.fetch(&url, &data, &quick(1)).await.unwrap_err();
    assert!(err.to_string().contains("refuse to replace"), "{err}");
    assert_eq!(fs::read(&run.dest).unwrap(), b"someone else's");
    assert_eq!(server.requests.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn an_empty_blob_needs_no_request() {
    let (url, server) = serve(Behaviour::default()).await;
    let run = Run::new();
    run.fetch(&url, &[], &quick(4)).await.unwrap();
    assert_eq!(fs::read(&run.dest).unwrap(), b"");
    assert_eq!(server.requests.load(Ordering::SeqCst), 0);
}

#[test]
fn ranges_cover_the_blob_without_overlap() {
    assert_eq!(split(10, 4), vec![(0, 2), (3, 5), (6, 8), (9, 9)]);
    assert_eq!(split(3, 4), vec![(0, 0), (1, 1), (2, 2)]);
    assert_eq!(split(8, 1), vec![(0, 7)]);
    assert_eq!(split(0, 4), vec![]);
}

#[test]
fn content_range_and_urls_parse() {
    assert_eq!(
        parse_content_range("bytes 0-99/1000"),
        Some((0, 99, Some(1000)))
    );
    assert_eq!(parse_content_range("bytes 5-9/*"), Some((5, 9, None)));
    assert_eq!(parse_content_range("items 0-1/2"), None);
    let d = Digest::of(b"x");
    assert_eq!(
        blob_url("http://10.0.0.1:8080/", &d, "ab cd"),
        format!("http://10.0.0.1:8080/blobs/sha256/{}?boot=ab%20cd", d.hex())
    );
}
