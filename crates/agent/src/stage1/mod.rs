//! Stage 1 of a two-stage stateless boot, the library half: in the stage-1 initramfs,
//! fetch the image's root filesystem blob (squashfs + dm-verity hash tree) by digest into
//! a file on tmpfs and check its sha256 ([`fetch`]), attach it to a read-only loop device
//! and put a dm-verity device over it ([`dm`]), for the init script to mount and
//! switch_root into. Later, in the real root, [`dm::table_of`] tells the agent which
//! verity root hash it booted with.

pub mod dm;
pub mod fetch;
pub mod overlay;
pub mod root;

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use bootfleet_api::Digest;

pub use dm::{
    DmTarget, LoopDevice, VerityParams, VerityTable, attach_loop, create_verity, remove_device,
    table_of, targets_of,
};
pub use fetch::{FetchOptions, FetchStats, blob_url, fetch_blob};

/// Everything stage 1 can fail with. Each variant names what failed (path, URL, device,
/// ioctl) so that one line on the console is enough to tell an operator what to look at.
#[derive(Debug)]
pub enum Stage1Error {
    /// A file operation failed.
    Io {
        action: String,
        path: PathBuf,
        source: io::Error,
    },
    /// The server gave a final answer (a 4xx other than 429): retrying cannot help.
    Http { url: String, status: u16 },
    /// The server's answer does not fit the request (Content-Range, length, Range ignored
    /// at a non-zero offset): a broken server or proxy, or the wrong blob.
    Protocol { url: String, detail: String },
    /// One range could not be fetched within the allowed tries.
    GaveUp {
        url: String,
        start: u64,
        end: u64,
        tries: u32,
        last: String,
    },
    /// The whole fetch ran past its deadline.
    Deadline {
        url: String,
        after: Duration,
        done: u64,
        size: u64,
    },
    /// Every byte arrived, but they do not hash to the digest asked for.
    DigestMismatch {
        path: PathBuf,
        expected: Digest,
        found: Digest,
    },
    /// An ioctl on a loop or device-mapper device failed.
    Ioctl {
        ioctl: &'static str,
        device: String,
        source: io::Error,
    },
    /// Parameters or a table line that cannot be used as given.
    Invalid(String),
}

impl fmt::Display for Stage1Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io {
                action,
                path,
                source,
            } => write!(f, "{action} {}: {source}", path.display()),
            Self::Http { url, status } => write!(f, "GET {url}: the server answered {status}"),
            Self::Protocol { url, detail } => write!(f, "GET {url}: {detail}"),
            Self::GaveUp {
                url,
                start,
                end,
                tries,
                last,
            } => write!(
                f,
                "GET {url} bytes {start}-{end}: gave up after {tries} tries without progress; last: {last}"
            ),
            Self::Deadline {
                url,
                after,
                done,
                size,
            } => write!(
                f,
                "GET {url}: not done after {after:?} ({done} of {size} bytes)"
            ),
            Self::DigestMismatch {
                path,
                expected,
                found,
            } => write!(
                f,
                "{}: digest mismatch: expected {expected}, found {found}",
                path.display()
            ),
            Self::Ioctl {
                ioctl,
                device,
                source,
            } => write!(
                f,
                "{ioctl} on {device}: {source} (the kernel log may say more)"
            ),
            Self::Invalid(what) => f.write_str(what),
        }
    }
}

impl std::error::Error for Stage1Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } | Self::Ioctl { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl Stage1Error {
    pub(crate) fn io(
        action: impl Into<String>,
        path: impl Into<PathBuf>,
        source: io::Error,
    ) -> Self {
        Self::Io {
            action: action.into(),
            path: path.into(),
            source,
        }
    }

    /// The errno of an I/O or ioctl failure, for callers that branch on it.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Self::Io { source, .. } | Self::Ioctl { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}
