//! Pass two of an import: the merged tree written as ONE tar stream, the input of
//! `mksquashfs -tar`. Directories first (path order), then links, devices and FIFOs
//! (path order), then regular files in the order their bytes appear in the layers (the
//! layers are read once more, in order; an inode's first path gets the bytes, the others
//! are hard links to it). The same tree always gives the same stream.
//!
//! Owners, modes, times and xattrs come from the tree, never from a disk: nothing of the
//! image is ever written to the server's file system as files.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;

use tar::{EntryType, Header};

use super::layer::{self, LayerBlob};
use super::tree::{Kind, Meta, Node, Origin, RootPath, Tree};
use crate::image::tar_guard::TarGuard;

/// Files whose bytes the caller wants while they stream past (the kernel, modules):
/// root path -> where to copy them.
pub type Captures = BTreeMap<RootPath, std::fs::File>;

/// Writes the root as a tar to `out`. `layers` are the blobs the tree was built from, in
/// the same order.
pub fn write_root(
    tree: &Tree,
    layers: &[LayerBlob],
    out: impl Write,
    mut captures: Captures,
) -> io::Result<()> {
    let mut builder = tar::Builder::new(out);
    builder.mode(tar::HeaderMode::Complete);
    for (path, node) in tree.nodes() {
        if node.kind == Kind::Dir {
            append_special(&mut builder, path, node)?;
        }
    }
    for (path, node) in tree.nodes() {
        if !matches!(node.kind, Kind::Dir | Kind::File { .. }) {
            append_special(&mut builder, path, node)?;
        }
    }
    // Each inode's paths, in path order, by the entry holding its bytes.
    let mut inodes: HashMap<Origin, Vec<&RootPath>> = HashMap::new();
    for (path, node) in tree.nodes() {
        if let Kind::File { data, .. } = node.kind {
            inodes.entry(data).or_default().push(path);
        }
    }
    let mut remaining = inodes.len();
    for (index, blob) in layers.iter().enumerate() {
        if remaining == 0 {
            break;
        }
        let stream = layer::open(&blob.path, blob.compression)?;
        let mut archive = tar::Archive::new(TarGuard::new(stream));
        for (entry_index, entry) in archive.entries()?.enumerate() {
            let mut entry = entry?;
            let origin = Origin {
                layer: index as u32,
                entry: entry_index as u32,
            };
            let Some(paths) = inodes.get(&origin) else {
                continue;
            };
            remaining -= 1;
            let first = paths[0];
            let node = tree.get(first).expect("an inode's paths are in the tree");
            let Kind::File { size, .. } = node.kind else {
                unreachable!("inodes hold files only")
            };
            let mut header = header_for(&node.meta, EntryType::Regular);
            header.set_size(size);
            append_xattrs(&mut builder, &node.meta)?;
            let capture: Vec<std::fs::File> =
                paths.iter().filter_map(|p| captures.remove(*p)).collect();
            let mut tee = Tee {
                inner: (&mut entry).take(size),
                copies: capture,
            };
            builder.append_data(&mut header, as_path(first), &mut tee)?;
            for other in &paths[1..] {
                let mut link = header_for(&node.meta, EntryType::Link);
                append_xattrs(&mut builder, &node.meta)?;
                builder.append_link(&mut link, as_path(other), as_path(first))?;
            }
        }
    }
    if remaining != 0 {
        return Err(io::Error::other(format!(
            "{remaining} files' contents were not found again in their layers"
        )));
    }
    builder.into_inner()?.flush()
}

fn append_special<W: Write>(
    builder: &mut tar::Builder<W>,
    path: &RootPath,
    node: &Node,
) -> io::Result<()> {
    append_xattrs(builder, &node.meta)?;
    let path = as_path(path);
    match &node.kind {
        Kind::Dir => {
            let mut h = header_for(&node.meta, EntryType::Directory);
            builder.append_data(&mut h, path, io::empty())
        }
        Kind::Symlink(target) => {
            let mut h = header_for(&node.meta, EntryType::Symlink);
            builder.append_link(&mut h, path, std::ffi::OsStr::from_bytes(target))
        }
        Kind::Char(major, minor) | Kind::Block(major, minor) => {
            let kind = if matches!(node.kind, Kind::Char(..)) {
                EntryType::Char
            } else {
                EntryType::Block
            };
            let mut h = header_for(&node.meta, kind);
            h.set_device_major(*major)?;
            h.set_device_minor(*minor)?;
            builder.append_data(&mut h, path, io::empty())
        }
        Kind::Fifo => {
            let mut h = header_for(&node.meta, EntryType::Fifo);
            builder.append_data(&mut h, path, io::empty())
        }
        Kind::File { .. } => unreachable!("files are written with their bytes"),
    }
}

fn as_path(p: &[u8]) -> &std::path::Path {
    std::path::Path::new(std::ffi::OsStr::from_bytes(p))
}

fn header_for(meta: &Meta, kind: EntryType) -> Header {
    let mut h = Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(meta.mode);
    // GNU headers carry large numbers in base-256, so any uid, gid or time fits.
    h.set_uid(meta.uid);
    h.set_gid(meta.gid);
    h.set_mtime(meta.mtime);
    h.set_size(0);
    h
}

/// xattrs go in a PAX header before the entry, as GNU tar writes them
/// (`SCHILY.xattr.<name>`), which is what `mksquashfs -tar` reads.
fn append_xattrs<W: Write>(builder: &mut tar::Builder<W>, meta: &Meta) -> io::Result<()> {
    if meta.xattrs.is_empty() {
        return Ok(());
    }
    let records: Vec<(String, &[u8])> = meta
        .xattrs
        .iter()
        .map(|(k, v)| (format!("SCHILY.xattr.{k}"), v.as_slice()))
        .collect();
    builder.append_pax_extensions(records.iter().map(|(k, v)| (k.as_str(), *v)))
}

/// A reader that copies what it reads into files.
struct Tee<R> {
    inner: R,
    copies: Vec<std::fs::File>,
}

impl<R: Read> Read for Tee<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        for copy in &mut self.copies {
            copy.write_all(&buf[..n])?;
        }
        Ok(n)
    }
}
