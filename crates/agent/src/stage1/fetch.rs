//! Fetching a blob of known size and sha256 over plain HTTP into a file: parallel range
//! streams, each resumed from its last written byte when its connection is cut, then the
//! whole file hashed and compared with the digest.
//!
//! The destination contract: bytes go to `<dest>.part` (created with O_EXCL, mode 0600,
//! its whole size reserved up front), which is renamed to `dest` (without replacing an
//! existing file) only once its sha256 matches. On any error, and when the future is
//! dropped (cancelled, or its deadline passed), the `.part` file is removed: a file at
//! `dest` is always complete and verified, and a failed fetch leaves nothing behind. A
//! process killed outright can leave `<dest>.part`; the next fetch refuses it (EEXIST,
//! naming the path) rather than guess whose it is, and the caller removes it.

use std::error::Error as _;
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bootfleet_api::Digest;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_RANGE, RANGE, RETRY_AFTER};
use sha2::{Digest as _, Sha256};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinSet;

use super::Stage1Error;

/// Bytes gathered before one positioned write: large enough that the hop to the blocking
/// pool costs nothing next to the copy, small enough that a cut loses little.
const FLUSH_AT: usize = 1 << 20;

/// How a fetch behaves. `Default` is what a node booting a multi-GiB root over a LAN
/// wants; tests shorten the times.
#[derive(Debug, Clone)]
pub struct FetchOptions {
    /// Parallel range streams for a large blob (0 counts as 1).
    pub streams: usize,
    /// Below this size a single stream is used: more connections would not pay for
    /// themselves.
    pub single_stream_below: u64,
    /// A request that brings no byte for this long (no answer, or a silent body) is cut
    /// and resumed.
    pub stall_timeout: Duration,
    /// Tries in a row of one range that bring no new byte before giving up. Any progress
    /// resets the count, so a flaky but moving transfer never gives up.
    pub tries: u32,
    /// Back-off between tries: doubles from `first_backoff` up to `max_backoff`, and
    /// starts again from `first_backoff` after a try that made progress.
    pub first_backoff: Duration,
    pub max_backoff: Duration,
    /// A server's Retry-After is honoured up to this long.
    pub max_retry_after: Duration,
    /// The whole fetch (not the hashing) must end within this long.
    pub deadline: Option<Duration>,
    /// Bytes written so far, published after each write (never decreasing). The caller
    /// samples it at its own pace (`*rx.borrow()`) to report progress.
    pub progress: Option<watch::Sender<u64>>,
}

impl Default for FetchOptions {
    fn default() -> Self {
        Self {
            streams: 4,
            single_stream_below: 64 << 20,
            stall_timeout: Duration::from_secs(30),
            tries: 8,
            first_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(8),
            max_retry_after: Duration::from_secs(60),
            deadline: None,
            progress: None,
        }
    }
}

/// What a finished fetch did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FetchStats {
    pub bytes: u64,
    /// From the start to the verified file in place, hashing included.
    pub seconds: f64,
    /// Of which hashing the file.
    pub verify_seconds: f64,
    /// Range streams used (1 when the blob is small or the server ignores Range).
    pub streams: usize,
    /// Requests that continued a range after its connection was cut, stalled or ended
    /// short.
    pub resumes: u32,
    /// Requests repeated after a 5xx, a 429, or a connection that could not be made.
    pub retries: u32,
}

/// `{server}/blobs/sha256/{hex}?boot={boot}`: the boot id tells the server whose lease
/// the download belongs to.
pub fn blob_url(server: &str, digest: &Digest, boot: &str) -> String {
    format!(
        "{}/blobs/sha256/{}?boot={}",
        server.trim_end_matches('/'),
        digest.hex(),
        percent_encode(boot)
    )
}

/// Downloads `url` (a blob of `size` bytes whose sha256 is `digest`) to `dest`; see the
/// module documentation for what is on disk after success and after failure.
/// `client` should carry no total-request timeout: a part of a multi-GiB blob can take
/// minutes, and stalls are caught by `opts.stall_timeout` (a client timeout would only
/// cut each part and make it resume).
pub async fn fetch_blob(
    client: &reqwest::Client,
    url: &str,
    size: u64,
    digest: &Digest,
    dest: &Path,
    opts: &FetchOptions,
) -> Result<FetchStats, Stage1Error> {
    let started = Instant::now();
    refuse_existing(dest)?;
    let part = part_path(dest);
    let file = create_part(&part)?;
    let guard = RemoveOnDrop(Some(part.clone()));
    reserve(&file, size)
        .map_err(|e| Stage1Error::io(format!("reserve {size} bytes for"), &part, e))?;
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        url: url.to_string(),
        size,
        path: part.clone(),
        file: Arc::new(file),
        stall: opts.stall_timeout,
        tries: opts.tries.max(1),
        first_backoff: opts.first_backoff,
        max_backoff: opts.max_backoff.max(opts.first_backoff),
        max_retry_after: opts.max_retry_after,
        progress: Progress {
            done: AtomicU64::new(0),
            tx: opts.progress.clone(),
        },
    });
    let streams = streams_for(size, opts);
    let counts = match opts.deadline {
        None => download(&ctx, streams).await?,
        Some(limit) => tokio::time::timeout(limit, download(&ctx, streams))
            .await
            .map_err(|_| Stage1Error::Deadline {
                url: url.to_string(),
                after: limit,
                done: ctx.progress.done.load(Ordering::Relaxed),
                size,
            })??,
    };
    let hashing = Instant::now();
    let found = hash_file(ctx.file.clone(), size, &part).await?;
    if found != *digest {
        return Err(Stage1Error::DigestMismatch {
            path: dest.to_path_buf(),
            expected: *digest,
            found,
        });
    }
    rename_noreplace(&part, dest)?;
    guard.disarm();
    Ok(FetchStats {
        bytes: size,
        seconds: started.elapsed().as_secs_f64(),
        verify_seconds: hashing.elapsed().as_secs_f64(),
        streams: counts.streams,
        resumes: counts.resumes,
        retries: counts.retries,
    })
}

/// What every part task shares.
struct Ctx {
    client: reqwest::Client,
    url: String,
    size: u64,
    /// The `.part` file, for error messages.
    path: PathBuf,
    file: Arc<File>,
    stall: Duration,
    tries: u32,
    first_backoff: Duration,
    max_backoff: Duration,
    max_retry_after: Duration,
    progress: Progress,
}

struct Progress {
    done: AtomicU64,
    tx: Option<watch::Sender<u64>>,
}

impl Progress {
    fn add(&self, n: u64) {
        let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
        if let Some(tx) = &self.tx {
            // Parts publish concurrently: keep the largest so the value never goes back.
            tx.send_if_modified(|v| {
                let newer = done > *v;
                if newer {
                    *v = done;
                }
                newer
            });
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    streams: usize,
    resumes: u32,
    retries: u32,
}

/// Whether the server answered the first range with 206 (the other parts may start) or
/// with 200 (it ignores Range: the first part takes the whole blob, alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ranges {
    Honoured,
    Ignored,
}

fn streams_for(size: u64, opts: &FetchOptions) -> usize {
    if size < opts.single_stream_below {
        1
    } else {
        opts.streams.max(1)
    }
}

/// `n` contiguous inclusive ranges covering `0..size` (fewer when `size < n`).
fn split(size: u64, n: usize) -> Vec<(u64, u64)> {
    let len = size.div_ceil(n.max(1) as u64).max(1);
    (0..size)
        .step_by(len as usize)
        .map(|start| (start, (start + len).min(size) - 1))
        .collect()
}

/// Runs the parts: the first alone until the server's first answer shows whether it
/// honours Range, then the others beside it.
async fn download(ctx: &Arc<Ctx>, streams: usize) -> Result<Counts, Stage1Error> {
    if ctx.size == 0 {
        return Ok(Counts::default());
    }
    let parts = split(ctx.size, streams);
    // Dropping the set (an error below, or the caller's deadline) aborts every part.
    let mut set = JoinSet::new();
    let (tx, rx) = oneshot::channel();
    set.spawn(fetch_part(ctx.clone(), parts[0], Some(tx)));
    // An error before the first answer drops `tx`; that part's result below says why.
    if parts.len() > 1 && rx.await == Ok(Ranges::Honoured) {
        for &range in &parts[1..] {
            set.spawn(fetch_part(ctx.clone(), range, None));
        }
    }
    let mut total = Counts::default();
    while let Some(joined) = set.join_next().await {
        let counts = match joined {
            Ok(result) => result?,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => return Err(Stage1Error::Invalid(format!("a fetch task ended: {e}"))),
        };
        total.streams += 1;
        total.resumes += counts.resumes;
        total.retries += counts.retries;
    }
    Ok(total)
}

/// What a request's status line means for the part.
enum Answer {
    Body(reqwest::Response, Ranges),
    Retry {
        why: String,
        after: Option<Duration>,
    },
}

/// Why a body stopped before the end of its range.
enum Interrupted {
    /// The connection was cut, stalled or ended short: resume.
    Cut(String),
    /// Writing failed: final.
    Fatal(Stage1Error),
}

/// Fetches `start..=end` (the first part may grow to the whole blob if the server ignores
/// Range), resuming from the last written byte until done or out of tries.
async fn fetch_part(
    ctx: Arc<Ctx>,
    (start, mut end): (u64, u64),
    mut announce: Option<oneshot::Sender<Ranges>>,
) -> Result<Counts, Stage1Error> {
    let mut pos = start;
    let mut counts = Counts::default();
    let mut failures = 0;
    let mut wait = ctx.first_backoff;
    let mut buf = Vec::with_capacity(FLUSH_AT);
    loop {
        let before = pos;
        let (why, after, cut) = match request(&ctx, pos, end).await? {
            Answer::Body(response, ranges) => {
                if let Some(tx) = announce.take() {
                    let _ = tx.send(ranges);
                }
                if ranges == Ranges::Ignored {
                    end = ctx.size - 1;
                }
                match copy_body(&ctx, response, &mut pos, end, &mut buf).await {
                    Ok(()) => return Ok(counts),
                    Err(Interrupted::Fatal(e)) => return Err(e),
                    Err(Interrupted::Cut(why)) => (why, None, true),
                }
            }
            Answer::Retry { why, after } => (why, after, false),
        };
        if pos > before {
            failures = 0;
            wait = ctx.first_backoff;
        } else {
            failures += 1;
        }
        if failures >= ctx.tries {
            return Err(Stage1Error::GaveUp {
                url: ctx.url.clone(),
                start: pos,
                end,
                tries: failures,
                last: why,
            });
        }
        tokio::time::sleep(after.map_or(wait, |a| a.min(ctx.max_retry_after))).await;
        wait = (wait * 2).min(ctx.max_backoff);
        if cut {
            counts.resumes += 1;
        } else {
            counts.retries += 1;
        }
    }
}

/// Asks for `pos..=end` and sorts the answer: a body to read, a reason to retry, or a
/// final error.
async fn request(ctx: &Ctx, pos: u64, end: u64) -> Result<Answer, Stage1Error> {
    let sent = ctx
        .client
        .get(&ctx.url)
        .header(RANGE, format!("bytes={pos}-{end}"))
        .send();
    let response = match tokio::time::timeout(ctx.stall, sent).await {
        Err(_) => return Ok(retry(format!("no answer in {:?}", ctx.stall), None)),
        Ok(Err(e)) if e.is_builder() => {
            return Err(Stage1Error::Invalid(format!(
                "GET {}: {}",
                ctx.url,
                chain(&e)
            )));
        }
        Ok(Err(e)) => return Ok(retry(chain(&e), None)),
        Ok(Ok(r)) => r,
    };
    let protocol = |detail: String| Stage1Error::Protocol {
        url: ctx.url.clone(),
        detail,
    };
    match response.status() {
        StatusCode::PARTIAL_CONTENT => {
            check_content_range(&response, pos, end, ctx.size).map_err(protocol)?;
            Ok(Answer::Body(response, Ranges::Honoured))
        }
        // The server ignored Range and sends the whole blob: usable only from byte 0.
        StatusCode::OK if pos == 0 => match response.content_length() {
            Some(len) if len != ctx.size => Err(protocol(format!(
                "the server sends {len} bytes, expected {}",
                ctx.size
            ))),
            _ => Ok(Answer::Body(response, Ranges::Ignored)),
        },
        StatusCode::OK => Err(protocol(format!(
            "the server ignored Range bytes={pos}-{end} (answered 200): cannot resume at a non-zero offset"
        ))),
        s if s.is_server_error() || s == StatusCode::TOO_MANY_REQUESTS => Ok(retry(
            format!("the server answered {s}"),
            retry_after(&response),
        )),
        s => Err(Stage1Error::Http {
            url: ctx.url.clone(),
            status: s.as_u16(),
        }),
    }
}

fn retry(why: String, after: Option<Duration>) -> Answer {
    Answer::Retry { why, after }
}

/// A 206 must carry exactly the range asked for, of a blob of the expected size.
fn check_content_range(
    response: &reqwest::Response,
    pos: u64,
    end: u64,
    size: u64,
) -> Result<(), String> {
    let header = response
        .headers()
        .get(CONTENT_RANGE)
        .and_then(|v| v.to_str().ok())
        .ok_or("206 without a readable Content-Range")?;
    let (first, last, total) = parse_content_range(header)
        .ok_or_else(|| format!("206 with a malformed Content-Range {header:?}"))?;
    if (first, last) != (pos, end) || total.is_some_and(|t| t != size) {
        return Err(format!(
            "asked for bytes {pos}-{end}/{size}, the server sent Content-Range {header:?}"
        ));
    }
    Ok(())
}

/// `bytes a-b/total` (total may be `*`).
fn parse_content_range(header: &str) -> Option<(u64, u64, Option<u64>)> {
    let (range, total) = header.trim().strip_prefix("bytes ")?.split_once('/')?;
    let (first, last) = range.split_once('-')?;
    let total = match total {
        "*" => None,
        t => Some(t.parse().ok()?),
    };
    Some((first.parse().ok()?, last.parse().ok()?, total))
}

/// Retry-After in seconds (the HTTP-date form is rare from a server on the boot LAN and
/// falls back to our own back-off).
fn retry_after(response: &reqwest::Response) -> Option<Duration> {
    let value = response.headers().get(RETRY_AFTER)?.to_str().ok()?;
    value.trim().parse().ok().map(Duration::from_secs)
}

/// Copies the body into the file from `*pos`, up to `end`; `*pos` follows the bytes
/// written, so that a cut resumes exactly there.
async fn copy_body(
    ctx: &Ctx,
    mut response: reqwest::Response,
    pos: &mut u64,
    end: u64,
    buf: &mut Vec<u8>,
) -> Result<(), Interrupted> {
    loop {
        let want = end + 1 - (*pos + buf.len() as u64);
        if want == 0 {
            return flush(ctx, pos, buf).await.map_err(Interrupted::Fatal);
        }
        let why = match tokio::time::timeout(ctx.stall, response.chunk()).await {
            Ok(Ok(Some(chunk))) => {
                // A server that sends more than asked (or the whole blob to part 0)
                // is read only as far as needed; the connection is dropped after.
                let take = chunk.len().min(usize::try_from(want).unwrap_or(usize::MAX));
                buf.extend_from_slice(&chunk[..take]);
                if buf.len() >= FLUSH_AT {
                    flush(ctx, pos, buf).await.map_err(Interrupted::Fatal)?;
                }
                continue;
            }
            Ok(Ok(None)) => format!(
                "the body ended at byte {} of {end}",
                *pos + buf.len() as u64
            ),
            Ok(Err(e)) => chain(&e),
            Err(_) => format!("no byte for {:?}", ctx.stall),
        };
        // Keep what did arrive: the resumed request starts after it.
        flush(ctx, pos, buf).await.map_err(Interrupted::Fatal)?;
        return Err(Interrupted::Cut(why));
    }
}

/// Writes `buf` at `*pos` (a positioned write: the parts share one file) on the blocking
/// pool, then advances `*pos` and the progress.
async fn flush(ctx: &Ctx, pos: &mut u64, buf: &mut Vec<u8>) -> Result<(), Stage1Error> {
    if buf.is_empty() {
        return Ok(());
    }
    let data = std::mem::take(buf);
    let (file, offset) = (ctx.file.clone(), *pos);
    let (data, written) = tokio::task::spawn_blocking(move || {
        let written = file.write_all_at(&data, offset);
        (data, written)
    })
    .await
    .map_err(|e| Stage1Error::Invalid(format!("a write task ended: {e}")))?;
    let len = data.len() as u64;
    written.map_err(|e| {
        Stage1Error::io(
            format!("write {len} bytes at offset {offset} to"),
            &ctx.path,
            e,
        )
    })?;
    *buf = data;
    buf.clear();
    *pos += len;
    ctx.progress.add(len);
    Ok(())
}

/// sha256 of the first `size` bytes of `file`, read on the blocking pool.
async fn hash_file(file: Arc<File>, size: u64, path: &Path) -> Result<Digest, Stage1Error> {
    let hashed = tokio::task::spawn_blocking(move || {
        let mut hasher = Sha256::new();
        let mut buf = vec![0; FLUSH_AT];
        let mut offset = 0;
        while offset < size {
            let want = buf
                .len()
                .min(usize::try_from(size - offset).unwrap_or(usize::MAX));
            let n = file.read_at(&mut buf[..want], offset)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the file ends at {offset} of {size} bytes"),
                ));
            }
            hasher.update(&buf[..n]);
            offset += n as u64;
        }
        Ok(Digest::from_hasher(hasher))
    })
    .await
    .map_err(|e| Stage1Error::Invalid(format!("the hashing task ended: {e}")))?;
    hashed.map_err(|e| Stage1Error::io("hash", path, e))
}

fn part_path(dest: &Path) -> PathBuf {
    let mut name = dest.as_os_str().to_owned();
    name.push(".part");
    PathBuf::from(name)
}

/// An early check, so that a second fetch to the same place fails before downloading GiBs
/// (the final rename refuses to replace too).
fn refuse_existing(dest: &Path) -> Result<(), Stage1Error> {
    match fs::symlink_metadata(dest) {
        Ok(_) => Err(Stage1Error::io(
            "refuse to replace",
            dest,
            io::Error::from(io::ErrorKind::AlreadyExists),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Stage1Error::io("stat", dest, e)),
    }
}

fn create_part(path: &Path) -> Result<File, Stage1Error> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| Stage1Error::io("create", path, e))
}

/// Sizes the file up front with fallocate rather than `set_len`: on tmpfs it takes the
/// memory now, so a blob bigger than the RAM left fails at once with ENOSPC rather than
/// after minutes of download. Filesystems without fallocate get a sparse file.
fn reserve(file: &File, size: u64) -> io::Result<()> {
    if size == 0 {
        return Ok(());
    }
    let len =
        libc::off_t::try_from(size).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: fallocate on a file descriptor we own, with no pointers.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) } == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EOPNOTSUPP | libc::ENOSYS) => file.set_len(size),
        _ => Err(err),
    }
}

/// rename(2) that refuses to replace an existing `to` (RENAME_NOREPLACE; where the
/// filesystem lacks it, a check then a plain rename).
fn rename_noreplace(from: &Path, to: &Path) -> Result<(), Stage1Error> {
    let fail = |e| Stage1Error::io(format!("rename {} to", from.display()), to, e);
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| fail(io::Error::from(io::ErrorKind::InvalidInput)))
    };
    let (cfrom, cto) = (c(from)?, c(to)?);
    // SAFETY: two NUL-terminated paths that outlive the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            cfrom.as_ptr(),
            libc::AT_FDCWD,
            cto.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EINVAL | libc::ENOSYS) => {
            refuse_existing(to)?;
            fs::rename(from, to).map_err(fail)
        }
        _ => Err(fail(err)),
    }
}

/// Removes the `.part` file unless disarmed: on an error return and on cancellation
/// alike.
struct RemoveOnDrop(Option<PathBuf>);

impl RemoveOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = fs::remove_file(path);
        }
    }
}

/// An error and its causes on one line: reqwest's own message ("error sending request")
/// hides the useful part (connection refused, reset, unexpected end of file).
fn chain(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// Percent-encodes all but RFC 3986's unreserved characters (a boot id is hex, but the
/// URL must stay one URL whatever it is given).
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests;
