//! The root as one reproducible read-only file system with its dm-verity hash tree
//! appended: `mksquashfs - OUT -tar` reads the flattened root from a pipe, then
//! `veritysetup format` writes the hash tree after the data in the same file.
//!
//! Why squashfs and not erofs: Debian 12's squashfs-tools (4.5.1) reads a tar on stdin,
//! so owners, modes, devices and file capabilities come from the image's own headers and
//! the server needs no root and never writes the image's files (setuid binaries, device
//! nodes) onto its disk; its output is reproducible by default and it compresses on every
//! core. erofs-utils 1.5 builds only from a directory (tar input came in 1.7). Every
//! distribution kernel mounts squashfs.

use std::io::{self, Read};
use std::path::Path;
use std::process::{Command, Stdio};

use crate::image::oci::flatten::{self, Captures};
use crate::image::oci::layer::LayerBlob;
use crate::image::oci::tree::Tree;

pub use crate::api::image::{VERITY_BLOCK as BLOCK, Verity};

/// The squashfs compressor, chosen from what the image's kernel can read.
pub fn compressor(kernel_config: Option<&str>) -> &'static str {
    let has = |option: &str| {
        kernel_config.is_some_and(|c| c.lines().any(|l| l.trim() == format!("{option}=y")))
    };
    if has("CONFIG_SQUASHFS_ZSTD") {
        "zstd"
    } else if has("CONFIG_SQUASHFS_XZ") {
        "xz"
    } else {
        // Every squashfs-capable kernel reads gzip (CONFIG_SQUASHFS_ZLIB).
        "gzip"
    }
}

/// Writes the root into a new squashfs at `out`.
pub fn pack(
    tree: &Tree,
    layers: &[LayerBlob],
    captures: Captures,
    out: &Path,
    compressor: &str,
) -> io::Result<()> {
    let root = &tree.root;
    let mut cmd = Command::new("mksquashfs");
    cmd.arg("-")
        .arg(out)
        .args([
            "-tar",
            "-noappend",
            "-quiet",
            "-no-progress",
            "-comp",
            compressor,
        ])
        // zstd's default (15) compresses a root at a few MB/s a core; 6 keeps most of
        // the ratio at several times the speed.
        .args(if compressor == "zstd" {
            &["-Xcompression-level", "6"][..]
        } else {
            &[][..]
        })
        .arg("-root-mode")
        .arg(format!("{:o}", root.mode))
        .arg("-root-uid")
        .arg(root.uid.to_string())
        .arg("-root-gid")
        .arg(root.gid.to_string())
        // In -tar mode squashfs-tools 4.5.1 ignores -root-time and stamps the root with
        // the clock (two imports of one image differed there). SOURCE_DATE_EPOCH at the
        // image's newest time sets the root's and the file system's time and clamps
        // nothing.
        .env("SOURCE_DATE_EPOCH", newest_mtime(tree).to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| tool_error("mksquashfs", e))?;
    let stdin = child.stdin.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let written = flatten::write_root(
        tree,
        layers,
        io::BufWriter::with_capacity(1 << 20, stdin),
        captures,
    );
    let status = child.wait()?;
    let errors = errors.join().unwrap_or_default();
    written.map_err(|e| {
        io::Error::other(format!(
            "writing the root to mksquashfs: {e} {}",
            errors.trim()
        ))
    })?;
    if !status.success() {
        return Err(io::Error::other(format!(
            "mksquashfs failed ({status}): {}",
            errors.trim()
        )));
    }
    Ok(())
}

/// The newest time in the root (squashfs keeps 32-bit times).
fn newest_mtime(tree: &Tree) -> u64 {
    tree.nodes()
        .map(|(_, n)| n.meta.mtime)
        .chain(std::iter::once(tree.root.mtime))
        .max()
        .unwrap_or(0)
        .min(u64::from(u32::MAX))
}

/// Appends the dm-verity hash tree to `file` and returns its parameters.
pub fn verity_format(file: &Path) -> io::Result<Verity> {
    let size = std::fs::metadata(file)?.len();
    if size == 0 || !size.is_multiple_of(BLOCK) {
        return Err(io::Error::other(format!(
            "the squashfs is {size} bytes, not a whole number of {BLOCK}-byte blocks"
        )));
    }
    let data_blocks = size / BLOCK;
    let output = Command::new("veritysetup")
        // Its report is parsed: in the one language it is parsed in.
        .env("LC_ALL", "C")
        .args(["format", "--no-superblock", "--salt=-", "--hash=sha256"])
        .arg(format!("--data-block-size={BLOCK}"))
        .arg(format!("--hash-block-size={BLOCK}"))
        .arg(format!("--data-blocks={data_blocks}"))
        .arg(format!("--hash-offset={size}"))
        .arg(file)
        .arg(file)
        .output()
        .map_err(|e| tool_error("veritysetup", e))?;
    if !output.status.success() {
        return Err(io::Error::other(format!(
            "veritysetup format failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let root_hash = text
        .lines()
        .find_map(|l| l.strip_prefix("Root hash:"))
        .map(|h| h.trim().to_string())
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| io::Error::other(format!("veritysetup printed no root hash: {text}")))?;
    Ok(Verity {
        root_hash,
        hash_offset: size,
        data_blocks,
        algorithm: "sha256".into(),
        salt: "-".into(),
    })
}

/// Checks a file's hash tree against `verity` (in user space; no device mapper needed).
pub fn verity_verify(file: &Path, verity: &Verity) -> io::Result<bool> {
    let status = Command::new("veritysetup")
        .args(["verify", "--no-superblock"])
        .arg(format!("--salt={}", verity.salt))
        .arg(format!("--hash={}", verity.algorithm))
        .arg(format!("--data-block-size={BLOCK}"))
        .arg(format!("--hash-block-size={BLOCK}"))
        .arg(format!("--data-blocks={}", verity.data_blocks))
        .arg(format!("--hash-offset={}", verity.hash_offset))
        .arg(file)
        .arg(file)
        .arg(&verity.root_hash)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| tool_error("veritysetup", e))?;
    Ok(status.success())
}

fn tool_error(tool: &str, e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::NotFound {
        let package = if tool == "mksquashfs" {
            "squashfs-tools"
        } else {
            "cryptsetup-bin"
        };
        io::Error::other(format!(
            "{tool} is not installed on the server: apt-get install {package}"
        ))
    } else {
        io::Error::other(format!("{tool}: {e}"))
    }
}
