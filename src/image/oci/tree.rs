//! The root filesystem an OCI image describes, as an in-memory tree of paths and metadata:
//! its layers applied in order, whiteouts and opaque directories included. File contents
//! stay in the layer blobs; a file node names the layer entry that holds its bytes.
//!
//! Pure: the tree never touches a disk, so an entry cannot escape anything while it is
//! applied, and the rules below are the whole gate for untrusted layers:
//! - a path is relative and normalised; `..` is refused, a leading `/` or `./` dropped;
//! - nothing is written through a symbolic link: every ancestor of an entry (and of a
//!   whiteout) that exists must be a directory (a symlink, then a write under it, is
//!   refused, not followed);
//! - a hard link names a regular file already in the tree;
//! - device files only when the import allows them; xattrs only in the namespaces
//!   squashfs keeps (`user.`, `security.`, `trusted.`), except POSIX ACLs
//!   (`system.posix_acl_*`, which systemd puts on /var/log/journal): squashfs cannot
//!   hold them, so they are dropped and counted (access only narrows to the mode bits);
//! - bounded: entries per import, path and link lengths, the root's total file bytes.
//!
//! Whiteouts follow the OCI image spec: `.wh.NAME` hides NAME of the layers below,
//! `.wh..wh..opq` hides every lower child of its directory; both act before the layer's
//! own entries, so a layer never hides what it adds itself.

use std::collections::BTreeMap;
use std::fmt;

/// A path in the root: relative, normalised, no trailing `/`; empty for the root itself.
/// Bytes, not strings: file names in real images need not be UTF-8.
pub type RootPath = Vec<u8>;

/// Where an entry was read: the layer's position in the manifest and the entry's
/// position in that layer's tar stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Origin {
    pub layer: u32,
    pub entry: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    /// Permission bits with setuid, setgid and sticky (`& 0o7777`).
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
    /// Seconds since the epoch.
    pub mtime: u64,
    pub xattrs: BTreeMap<String, Vec<u8>>,
}

impl Meta {
    /// A directory a layer implies without an entry of its own (its parent of a file).
    pub fn implied_dir() -> Self {
        Self {
            mode: 0o755,
            uid: 0,
            gid: 0,
            mtime: 0,
            xattrs: BTreeMap::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    Dir,
    /// A regular file; `data` is the entry that carries its bytes (itself, or the file a
    /// hard link names: every path with the same `data` is one inode).
    File {
        size: u64,
        data: Origin,
    },
    Symlink(Vec<u8>),
    Char(u32, u32),
    Block(u32, u32),
    Fifo,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub kind: Kind,
    pub meta: Meta,
    pub origin: Origin,
}

/// What a layer's tar header says, before it is applied.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The name as written in the layer.
    pub path: Vec<u8>,
    pub kind: EntryKind,
    pub meta: Meta,
    pub origin: Origin,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryKind {
    Dir,
    File { size: u64 },
    Symlink(Vec<u8>),
    HardLink(Vec<u8>),
    Char(u32, u32),
    Block(u32, u32),
    Fifo,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// Character and block devices are kept (an image that needs them says so).
    pub allow_devices: bool,
    /// Entries over all layers.
    pub max_entries: usize,
    /// Bytes of the final root's files, each inode once.
    pub max_root_bytes: u64,
}

impl Default for Rules {
    fn default() -> Self {
        Self {
            allow_devices: false,
            max_entries: 2_000_000,
            max_root_bytes: 64 << 30,
        }
    }
}

/// Longest path and symlink target (Linux's PATH_MAX).
pub const MAX_PATH: usize = 4096;
const WHITEOUT: &[u8] = b".wh.";
const OPAQUE: &[u8] = b".wh..wh..opq";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeError {
    pub origin: Origin,
    pub path: String,
    pub reason: String,
}

impl fmt::Display for TreeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "layer {} entry {:?}: {}",
            self.origin.layer + 1,
            self.path,
            self.reason
        )
    }
}

impl std::error::Error for TreeError {}

#[derive(Debug, Clone)]
pub struct Tree {
    pub root: Meta,
    nodes: BTreeMap<RootPath, Node>,
    entries: usize,
    /// POSIX ACLs dropped (entries that had one).
    pub dropped_acls: u64,
}

impl Default for Tree {
    fn default() -> Self {
        Self {
            root: Meta::implied_dir(),
            nodes: BTreeMap::new(),
            entries: 0,
            dropped_acls: 0,
        }
    }
}

impl Tree {
    /// Applies one layer's entries (in stream order): whiteouts first, then the rest.
    pub fn apply_layer(&mut self, entries: Vec<Entry>, rules: &Rules) -> Result<(), TreeError> {
        self.entries += entries.len();
        if self.entries > rules.max_entries {
            let origin = entries
                .last()
                .map(|e| e.origin)
                .unwrap_or(Origin { layer: 0, entry: 0 });
            return Err(TreeError {
                origin,
                path: String::new(),
                reason: format!("the image has more than {} entries", rules.max_entries),
            });
        }
        let mut additions = Vec::with_capacity(entries.len());
        for entry in entries {
            let refuse = |reason: String| TreeError {
                origin: entry.origin,
                path: String::from_utf8_lossy(&entry.path).into_owned(),
                reason,
            };
            let path = normalize(&entry.path).map_err(refuse)?;
            let (parent, name) = split(&path);
            if name == WHITEOUT || (name.starts_with(b".wh..wh.") && name != OPAQUE) {
                // A bare `.wh.` would hide its own directory; other `.wh..wh.` names are
                // reserved by the spec.
                return Err(refuse("a reserved whiteout name".into()));
            }
            if name == OPAQUE {
                self.check_ancestors(&path).map_err(refuse)?;
                self.clear_children(parent);
            } else if let Some(hidden) = name.strip_prefix(WHITEOUT) {
                self.check_ancestors(&path).map_err(refuse)?;
                let target = join(parent, hidden);
                self.remove_subtree(&target);
            } else {
                additions.push((path, entry));
            }
        }
        for (path, entry) in additions {
            self.add(path, entry, rules)?;
        }
        let bytes = self.root_bytes();
        if bytes > rules.max_root_bytes {
            return Err(TreeError {
                origin: Origin {
                    layer: self
                        .nodes
                        .values()
                        .map(|n| n.origin.layer)
                        .max()
                        .unwrap_or(0),
                    entry: 0,
                },
                path: String::new(),
                reason: format!(
                    "the root's files pass {} bytes together ({bytes}), over the import limit",
                    rules.max_root_bytes
                ),
            });
        }
        Ok(())
    }

    fn add(&mut self, path: RootPath, mut entry: Entry, rules: &Rules) -> Result<(), TreeError> {
        let acls = entry.meta.xattrs.len();
        entry
            .meta
            .xattrs
            .retain(|name, _| !name.starts_with("system.posix_acl_"));
        if entry.meta.xattrs.len() != acls {
            self.dropped_acls += 1;
        }
        let refuse = |reason: String| TreeError {
            origin: entry.origin,
            path: String::from_utf8_lossy(&path).into_owned(),
            reason,
        };
        if path.is_empty() {
            // The root's own entry (`./`): only its metadata.
            return match entry.kind {
                EntryKind::Dir => {
                    self.root = entry.meta;
                    Ok(())
                }
                _ => Err(refuse("the root must be a directory".into())),
            };
        }
        check_xattrs(&entry.meta).map_err(refuse)?;
        self.make_ancestors(&path, entry.origin).map_err(refuse)?;
        let kind = match entry.kind {
            EntryKind::Dir => {
                if let Some(node) = self.nodes.get_mut(&path)
                    && node.kind == Kind::Dir
                {
                    // A directory again: new metadata, its lower children stay.
                    node.meta = entry.meta;
                    node.origin = entry.origin;
                    return Ok(());
                }
                Kind::Dir
            }
            EntryKind::File { size } => Kind::File {
                size,
                data: entry.origin,
            },
            EntryKind::Symlink(target) => {
                if target.is_empty() || target.len() > MAX_PATH || target.contains(&0) {
                    return Err(refuse(
                        "a symbolic link's target must be 1 to 4096 bytes without NUL".into(),
                    ));
                }
                Kind::Symlink(target)
            }
            EntryKind::HardLink(target) => {
                let target =
                    normalize(&target).map_err(|e| refuse(format!("hard link target: {e}")))?;
                match self.nodes.get(&target) {
                    Some(Node {
                        kind: kind @ Kind::File { .. },
                        meta,
                        ..
                    }) => {
                        // One inode: the link shares the target's data and metadata.
                        let (kind, meta) = (kind.clone(), meta.clone());
                        self.replace(
                            path,
                            Node {
                                kind,
                                meta,
                                origin: entry.origin,
                            },
                        );
                        return Ok(());
                    }
                    _ => {
                        return Err(refuse(format!(
                            "hard link to {:?}, which is not a regular file of the image",
                            String::from_utf8_lossy(&target)
                        )));
                    }
                }
            }
            EntryKind::Char(major, minor) | EntryKind::Block(major, minor)
                if !rules.allow_devices =>
            {
                let _ = (major, minor);
                return Err(refuse(
                    "device files are refused unless the import allows them (--allow-devices)"
                        .into(),
                ));
            }
            // 0:0 is an overlayfs whiteout: the node's overlay would hide the path.
            EntryKind::Char(0, 0) => {
                return Err(refuse(
                    "a 0:0 character device is an overlayfs whiteout; use an OCI whiteout".into(),
                ));
            }
            EntryKind::Char(major, minor) => Kind::Char(major, minor),
            EntryKind::Block(major, minor) => Kind::Block(major, minor),
            EntryKind::Fifo => Kind::Fifo,
        };
        self.replace(
            path,
            Node {
                kind,
                meta: entry.meta,
                origin: entry.origin,
            },
        );
        Ok(())
    }

    /// Puts `node` at `path`; whatever was there goes, with its children if a directory.
    fn replace(&mut self, path: RootPath, node: Node) {
        self.remove_subtree(&path);
        self.nodes.insert(path, node);
    }

    /// Every ancestor of `path` that exists is a directory.
    fn check_ancestors(&self, path: &[u8]) -> Result<(), String> {
        for ancestor in ancestors(path) {
            match self.nodes.get(ancestor) {
                None
                | Some(Node {
                    kind: Kind::Dir, ..
                }) => {}
                Some(node) => return Err(not_a_directory(ancestor, &node.kind)),
            }
        }
        Ok(())
    }

    /// Creates the missing ancestors of `path` as implied directories; refuses a path
    /// under anything that is not a directory.
    fn make_ancestors(&mut self, path: &[u8], origin: Origin) -> Result<(), String> {
        self.check_ancestors(path)?;
        for ancestor in ancestors(path) {
            self.nodes.entry(ancestor.to_vec()).or_insert_with(|| Node {
                kind: Kind::Dir,
                meta: Meta::implied_dir(),
                origin,
            });
        }
        Ok(())
    }

    fn remove_subtree(&mut self, path: &[u8]) {
        self.nodes.remove(path);
        self.clear_children(path);
    }

    fn clear_children(&mut self, dir: &[u8]) {
        let doomed: Vec<RootPath> = self.descendants(dir).map(|(p, _)| p.clone()).collect();
        for p in doomed {
            self.nodes.remove(&p);
        }
    }

    /// Every node below `dir` (the whole tree for the root), in path order.
    pub fn descendants<'a>(
        &'a self,
        dir: &[u8],
    ) -> impl Iterator<Item = (&'a RootPath, &'a Node)> + 'a {
        let (start, end) = if dir.is_empty() {
            (Vec::new(), None)
        } else {
            let mut start = dir.to_vec();
            start.push(b'/');
            let mut end = dir.to_vec();
            end.push(b'/' + 1);
            (start, Some(end))
        };
        self.nodes
            .range(start..)
            .take_while(move |(p, _)| end.as_ref().is_none_or(|e| p.as_slice() < e.as_slice()))
    }

    /// The direct children of `dir`, by name.
    pub fn children<'a>(&'a self, dir: &'a [u8]) -> impl Iterator<Item = (&'a [u8], &'a Node)> {
        let skip = if dir.is_empty() { 0 } else { dir.len() + 1 };
        self.descendants(dir)
            .map(move |(p, n)| (&p[skip..], n))
            .filter(|(name, _)| !name.contains(&b'/'))
    }

    pub fn get(&self, path: &[u8]) -> Option<&Node> {
        self.nodes.get(path)
    }

    /// Every node in path order (parents before children).
    pub fn nodes(&self) -> impl Iterator<Item = (&RootPath, &Node)> {
        self.nodes.iter()
    }

    /// Bytes of the root's files, each inode once.
    pub fn root_bytes(&self) -> u64 {
        let mut seen = std::collections::HashSet::new();
        self.nodes
            .values()
            .filter_map(|n| match n.kind {
                Kind::File { size, data } if seen.insert(data) => Some(size),
                _ => None,
            })
            .sum()
    }

    /// `path` with every symbolic link on the way followed, inside the root (what the
    /// node will see; absolute targets start at the root, `..` stops there). None when
    /// something on the way is missing or the links loop.
    pub fn resolve(&self, path: &[u8]) -> Option<RootPath> {
        let mut hops = 0;
        let mut done: Vec<Vec<u8>> = Vec::new();
        let mut todo: Vec<Vec<u8>> = components(path).rev().map(<[u8]>::to_vec).collect();
        while let Some(part) = todo.pop() {
            match part.as_slice() {
                b"." => continue,
                b".." => {
                    done.pop();
                    continue;
                }
                _ => {}
            }
            done.push(part);
            let here = done.join(&b'/');
            match &self.nodes.get(&here)?.kind {
                Kind::Symlink(target) => {
                    hops += 1;
                    if hops > 40 {
                        return None;
                    }
                    done.pop();
                    if target.starts_with(b"/") {
                        done.clear();
                    }
                    todo.extend(components(target).rev().map(<[u8]>::to_vec));
                }
                Kind::Dir => {}
                _ if todo.is_empty() => {}
                _ => return None,
            }
        }
        Some(done.join(&b'/'))
    }
}

fn components(path: &[u8]) -> impl DoubleEndedIterator<Item = &[u8]> {
    path.split(|b| *b == b'/').filter(|c| !c.is_empty())
}

fn not_a_directory(ancestor: &[u8], kind: &Kind) -> String {
    let name = String::from_utf8_lossy(ancestor);
    match kind {
        Kind::Symlink(_) => format!(
            "its parent {name:?} is a symbolic link: an entry may not be written through a link"
        ),
        _ => format!("its parent {name:?} is not a directory"),
    }
}

/// The proper ancestors of `path`, shortest first (`a`, `a/b` for `a/b/c`).
fn ancestors(path: &[u8]) -> impl Iterator<Item = &[u8]> {
    path.iter()
        .enumerate()
        .filter(|(_, b)| **b == b'/')
        .map(move |(i, _)| &path[..i])
}

fn split(path: &[u8]) -> (&[u8], &[u8]) {
    match path.iter().rposition(|b| *b == b'/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => (&[], path),
    }
}

fn join(parent: &[u8], name: &[u8]) -> RootPath {
    if parent.is_empty() {
        name.to_vec()
    } else {
        [parent, b"/", name].concat()
    }
}

/// A layer's name as a root path: leading `/` and `./` dropped, empty and `.` parts
/// skipped; `..`, NUL, control characters and over-long names refused. The empty path is
/// the root.
pub fn normalize(raw: &[u8]) -> Result<RootPath, String> {
    if raw.len() > MAX_PATH {
        return Err(format!("the name is longer than {MAX_PATH} bytes"));
    }
    if raw.iter().any(|b| *b < 0x20 || *b == 0x7f) {
        return Err("the name holds a control character".into());
    }
    let mut parts: Vec<&[u8]> = Vec::new();
    for part in raw.split(|b| *b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => return Err("'..' would leave the root".into()),
            other => {
                if other.len() > 255 {
                    return Err("a name part is longer than 255 bytes".into());
                }
                parts.push(other)
            }
        }
    }
    Ok(parts.join(&b'/'))
}

fn check_xattrs(meta: &Meta) -> Result<(), String> {
    for name in meta.xattrs.keys() {
        // The root is an overlayfs lower layer on the node: overlayfs would act on these
        // (redirects, opaque directories), so the node would see another tree.
        if name.starts_with("trusted.overlay.") || name.starts_with("user.overlay.") {
            return Err(format!(
                "extended attribute {name:?} is overlayfs's own; an image may not carry it"
            ));
        }
        if !["user.", "security.", "trusted."]
            .iter()
            .any(|ns| name.starts_with(ns))
        {
            return Err(format!(
                "extended attribute {name:?} is in a namespace squashfs cannot keep (user., security., trusted. only)"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(mode: u32) -> Meta {
        Meta {
            mode,
            ..Meta::implied_dir()
        }
    }

    struct Layer {
        index: u32,
        entries: Vec<Entry>,
    }

    impl Layer {
        fn new(index: u32) -> Self {
            Self {
                index,
                entries: Vec::new(),
            }
        }
        fn push(mut self, path: &str, kind: EntryKind) -> Self {
            let origin = Origin {
                layer: self.index,
                entry: self.entries.len() as u32,
            };
            self.entries.push(Entry {
                path: path.as_bytes().to_vec(),
                kind,
                meta: meta(0o644),
                origin,
            });
            self
        }
        fn file(self, path: &str, size: u64) -> Self {
            self.push(path, EntryKind::File { size })
        }
        fn dir(self, path: &str) -> Self {
            self.push(path, EntryKind::Dir)
        }
    }

    fn build(layers: Vec<Layer>) -> Result<Tree, TreeError> {
        let mut tree = Tree::default();
        for layer in layers {
            tree.apply_layer(layer.entries, &Rules::default())?;
        }
        Ok(tree)
    }

    fn paths(tree: &Tree) -> Vec<String> {
        tree.nodes()
            .map(|(p, _)| String::from_utf8_lossy(p).into_owned())
            .collect()
    }

    #[test]
    fn layers_stack_and_imply_parents() {
        let tree = build(vec![
            Layer::new(0).dir("./etc/").file("./etc/passwd", 10),
            Layer::new(1).file("etc/passwd", 20).file("/usr/bin/env", 5),
        ])
        .unwrap();
        assert_eq!(
            paths(&tree),
            ["etc", "etc/passwd", "usr", "usr/bin", "usr/bin/env"]
        );
        match tree.get(b"etc/passwd").unwrap().kind {
            Kind::File { size, data } => {
                assert_eq!(size, 20);
                assert_eq!(data, Origin { layer: 1, entry: 0 });
            }
            ref other => panic!("{other:?}"),
        }
        assert_eq!(tree.root_bytes(), 25);
    }

    #[test]
    fn whiteouts_hide_lower_layers_only() {
        let tree = build(vec![
            Layer::new(0)
                .file("a/keep", 1)
                .file("a/gone", 1)
                .file("b/x", 1)
                .file("b/y/z", 1),
            Layer::new(1)
                .file("a/.wh.gone", 0)
                .file("b/new", 1)
                .file("b/.wh..wh..opq", 0)
                // A whiteout of something this layer adds does not hide it.
                .file("c/file", 1)
                .file("c/.wh.file", 0),
        ])
        .unwrap();
        assert_eq!(paths(&tree), ["a", "a/keep", "b", "b/new", "c", "c/file"]);
    }

    #[test]
    fn a_file_over_a_directory_hides_its_children() {
        let tree = build(vec![
            Layer::new(0).file("d/x", 1),
            Layer::new(1).file("d", 3),
        ])
        .unwrap();
        assert_eq!(paths(&tree), ["d"]);
        // And a directory again over a directory keeps the children.
        let tree = build(vec![
            Layer::new(0).file("d/x", 1),
            Layer::new(1).push("d", EntryKind::Dir),
        ])
        .unwrap();
        assert_eq!(paths(&tree), ["d", "d/x"]);
    }

    #[test]
    fn hard_links_share_the_inode() {
        let tree = build(vec![
            Layer::new(0)
                .file("bin/a", 7)
                .push("bin/b", EntryKind::HardLink(b"./bin/a".to_vec())),
        ])
        .unwrap();
        assert_eq!(
            tree.get(b"bin/a").unwrap().kind,
            tree.get(b"bin/b").unwrap().kind
        );
        assert_eq!(tree.root_bytes(), 7);
        let err = build(vec![
            Layer::new(0).push("bin/b", EntryKind::HardLink(b"bin/missing".to_vec())),
        ])
        .unwrap_err();
        assert!(err.reason.contains("not a regular file"), "{err}");
    }

    #[test]
    fn hostile_entries_are_refused_with_their_layer_and_name() {
        let cases: Vec<(Vec<Layer>, &str)> = vec![
            (vec![Layer::new(0).file("../etc/passwd", 1)], "'..'"),
            (vec![Layer::new(0).file("a/../../x", 1)], "'..'"),
            (vec![Layer::new(0).file("a/../.wh.x", 0)], "'..'"),
            (vec![Layer::new(0).file("a\nb", 1)], "control character"),
            // A symlink, then a write through it.
            (
                vec![
                    Layer::new(0).push("etc", EntryKind::Symlink(b"/host/etc".to_vec())),
                    Layer::new(1).file("etc/passwd", 1),
                ],
                "symbolic link",
            ),
            (
                vec![
                    Layer::new(0)
                        .push("lnk", EntryKind::Symlink(b"..".to_vec()))
                        .file("lnk/x", 1),
                ],
                "symbolic link",
            ),
            // A whiteout through a symlink.
            (
                vec![
                    Layer::new(0).push("lnk", EntryKind::Symlink(b"/".to_vec())),
                    Layer::new(1).file("lnk/.wh.etc", 0),
                ],
                "symbolic link",
            ),
            (
                vec![Layer::new(0).file("f", 1).file("f/g", 1)],
                "not a directory",
            ),
            (
                vec![Layer::new(0).push("dev/sda", EntryKind::Block(8, 0))],
                "device files",
            ),
            (
                vec![Layer::new(0).push("l", EntryKind::HardLink(b"../../etc/shadow".to_vec()))],
                "'..'",
            ),
            (vec![Layer::new(0).file("", 1)], "root must be a directory"),
            (vec![Layer::new(0).file("etc/.wh.", 0)], "reserved whiteout"),
            (
                vec![Layer::new(0).file(".wh..wh.plnk", 0)],
                "reserved whiteout",
            ),
        ];
        for (layers, needle) in cases {
            let err = build(layers).unwrap_err().to_string();
            assert!(err.contains(needle), "expected {needle:?} in {err:?}");
            assert!(err.starts_with("layer "), "{err}");
        }
    }

    #[test]
    fn limits_and_xattr_namespaces() {
        let mut tree = Tree::default();
        let rules = Rules {
            max_root_bytes: 10,
            ..Rules::default()
        };
        let err = tree
            .apply_layer(Layer::new(0).file("a", 6).file("b", 6).entries, &rules)
            .unwrap_err();
        assert!(err.reason.contains("over the import limit"), "{err}");
        let rules = Rules {
            max_entries: 1,
            ..Rules::default()
        };
        let err = Tree::default()
            .apply_layer(Layer::new(0).file("a", 1).file("b", 1).entries, &rules)
            .unwrap_err();
        assert!(err.reason.contains("more than 1 entries"), "{err}");
        let mut layer = Layer::new(0).file("a", 1).file("b", 1);
        layer.entries[0]
            .meta
            .xattrs
            .insert("system.nfs4_acl".into(), vec![1]);
        let err = build(vec![layer]).unwrap_err();
        assert!(err.reason.contains("namespace"), "{err}");
        // overlayfs's own attributes and whiteouts would make the node see another tree.
        let mut layer = Layer::new(0).file("d/x", 1);
        layer.entries[0]
            .meta
            .xattrs
            .insert("trusted.overlay.opaque".into(), b"y".to_vec());
        assert!(build(vec![layer]).unwrap_err().reason.contains("overlayfs"));
        let devices = Rules {
            allow_devices: true,
            ..Rules::default()
        };
        let err = Tree::default()
            .apply_layer(
                Layer::new(0)
                    .push("etc/gone", EntryKind::Char(0, 0))
                    .entries,
                &devices,
            )
            .unwrap_err();
        assert!(err.reason.contains("whiteout"), "{err}");
        assert!(
            Tree::default()
                .apply_layer(
                    Layer::new(0)
                        .push("dev/null", EntryKind::Char(1, 3))
                        .entries,
                    &devices
                )
                .is_ok()
        );
        // POSIX ACLs are dropped and counted: squashfs cannot keep them.
        let mut layer = Layer::new(0).file("a", 1);
        layer.entries[0]
            .meta
            .xattrs
            .insert("system.posix_acl_access".into(), vec![2]);
        let tree = build(vec![layer]).unwrap();
        assert_eq!(tree.dropped_acls, 1);
        assert!(tree.get(b"a").unwrap().meta.xattrs.is_empty());
    }

    #[test]
    fn resolve_follows_links_inside_the_root() {
        let tree = build(vec![
            Layer::new(0)
                .push("lib", EntryKind::Symlink(b"usr/lib".to_vec()))
                .file("usr/lib/modules/6.1/modules.dep", 1)
                .push("vmlinuz", EntryKind::Symlink(b"/boot/vmlinuz-6.1".to_vec()))
                .file("boot/vmlinuz-6.1", 1)
                .push("up", EntryKind::Symlink(b"../../../boot".to_vec()))
                .push("loop", EntryKind::Symlink(b"loop".to_vec())),
        ])
        .unwrap();
        let r = |p: &str| {
            tree.resolve(p.as_bytes())
                .map(|p| String::from_utf8(p).unwrap())
        };
        assert_eq!(
            r("lib/modules/6.1/modules.dep").as_deref(),
            Some("usr/lib/modules/6.1/modules.dep")
        );
        assert_eq!(r("vmlinuz").as_deref(), Some("boot/vmlinuz-6.1"));
        assert_eq!(r("up/vmlinuz-6.1").as_deref(), Some("boot/vmlinuz-6.1"));
        assert_eq!(r("loop"), None);
        assert_eq!(r("lib/missing"), None);
        let children: Vec<_> = tree
            .children(b"usr/lib/modules")
            .map(|(n, _)| n.to_vec())
            .collect();
        assert_eq!(children, [b"6.1".to_vec()]);
    }
}
