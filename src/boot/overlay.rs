//! The per-node overlay of a two-stage boot: files rendered for one node and written by
//! stage 1 into the root's writable layer, never baked into the image, so one image digest
//! serves the whole fleet (Warewulf's runtime overlays are the model).
//!
//! Built in: `/etc/hostname` (the node's `hostname` label, else `node-<mac hex>`),
//! `/etc/machine-id` (derived from the MAC: stable across reboots, distinct per node) and
//! `/etc/hosts`. An operator directory (`overlay_dir`) adds and overrides: every file
//! under `all/` for every node, under `label/KEY=VALUE/` for nodes with that label; a
//! name ending in `.j2` is a minijinja template (the suffix dropped), rendered with
//! `mac`, `hostname`, `labels` and `image` (`name`, `version`, `digest`); others are
//! copied as they are. Read once at start; rendering is pure.

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::Environment;
use serde::Serialize;
use sha2::{Digest as _, Sha256};

use super::script::TemplateError;
use crate::api::{Digest, Mac};

/// One file of the operator's directory.
#[derive(Debug, Clone)]
struct Source {
    /// Path in the node's root, relative.
    path: String,
    mode: u32,
    /// `label/KEY=VALUE/`: only for nodes with that label.
    label: Option<(String, String)>,
    template: bool,
    content: Vec<u8>,
}

/// The operator's overlay files, loaded once.
#[derive(Debug, Clone, Default)]
pub struct Overlay {
    sources: Vec<Source>,
}

/// Who the overlay is for.
#[derive(Debug, Clone, Serialize)]
pub struct OverlayNode<'a> {
    pub mac: Mac,
    /// The name the node is known by (its record's), if any.
    pub known_name: Option<&'a str>,
    pub labels: &'a BTreeMap<String, String>,
    pub image: OverlayImage<'a>,
}

#[derive(Debug, Clone, Serialize)]
pub struct OverlayImage<'a> {
    pub name: &'a str,
    pub version: &'a str,
    pub digest: Digest,
}

/// A rendered file: path in the root, mode, bytes.
pub type OverlayFile = (String, u32, Vec<u8>);

/// The most bytes an operator's overlay directory may hold (stage 1 takes it whole).
const MAX_SOURCE_BYTES: u64 = 8 << 20;

impl Overlay {
    /// Reads `dir` (`all/...`, `label/KEY=VALUE/...`).
    pub fn load(dir: &Path) -> Result<Self, TemplateError> {
        let mut sources = Vec::new();
        let mut total = 0u64;
        let read_err = |path: &Path, source: std::io::Error| TemplateError::Read {
            path: path.to_path_buf(),
            source,
        };
        let mut add = |base: &Path, label: Option<(String, String)>| -> Result<(), TemplateError> {
            for (file, rel) in walk(base).map_err(|e| read_err(base, e))? {
                let meta = std::fs::metadata(&file).map_err(|e| read_err(&file, e))?;
                total += meta.len();
                if total > MAX_SOURCE_BYTES {
                    return Err(TemplateError::Invalid {
                        name: dir.display().to_string(),
                        message: format!("overlay files pass {MAX_SOURCE_BYTES} bytes"),
                    });
                }
                let content = std::fs::read(&file).map_err(|e| read_err(&file, e))?;
                let (path, template) = match rel.strip_suffix(".j2") {
                    Some(p) => (p.to_string(), true),
                    None => (rel.clone(), false),
                };
                use std::os::unix::fs::PermissionsExt;
                sources.push(Source {
                    path,
                    mode: meta.permissions().mode() & 0o7777,
                    label: label.clone(),
                    template,
                    content,
                });
            }
            Ok(())
        };
        let all = dir.join("all");
        if all.is_dir() {
            add(&all, None)?;
        }
        let labels = dir.join("label");
        if labels.is_dir() {
            for entry in std::fs::read_dir(&labels).map_err(|e| read_err(&labels, e))? {
                let entry = entry.map_err(|e| read_err(&labels, e))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                let Some((k, v)) = name.split_once('=') else {
                    return Err(TemplateError::Invalid {
                        name,
                        message: "a label directory is named KEY=VALUE".into(),
                    });
                };
                add(&entry.path(), Some((k.to_string(), v.to_string())))?;
            }
        }
        let overlay = Self { sources };
        // Every template must compile now, not at a node's boot.
        overlay.environment()?;
        Ok(overlay)
    }

    fn environment(&self) -> Result<Environment<'static>, TemplateError> {
        let mut env = super::script::strict_environment();
        for (i, s) in self.sources.iter().enumerate().filter(|(_, s)| s.template) {
            let text =
                String::from_utf8(s.content.clone()).map_err(|_| TemplateError::Invalid {
                    name: s.path.clone(),
                    message: "a template must be UTF-8".into(),
                })?;
            env.add_template_owned(i.to_string(), text)
                .map_err(|e| TemplateError::Invalid {
                    name: s.path.clone(),
                    message: e.to_string(),
                })?;
        }
        Ok(env)
    }

    /// The files for `node`, built-ins first, the operator's over them, by path.
    pub fn render(&self, node: &OverlayNode<'_>) -> Result<Vec<OverlayFile>, TemplateError> {
        let hostname = hostname(node.mac, node.known_name, node.labels);
        let mut files: BTreeMap<String, (u32, Vec<u8>)> = BTreeMap::new();
        files.insert(
            "etc/hostname".into(),
            (0o644, format!("{hostname}\n").into_bytes()),
        );
        files.insert(
            "etc/machine-id".into(),
            (0o444, format!("{}\n", machine_id(node.mac)).into_bytes()),
        );
        files.insert(
            "etc/hosts".into(),
            (
                0o644,
                format!(
                    "127.0.0.1\tlocalhost\n127.0.1.1\t{hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                )
                .into_bytes(),
            ),
        );
        let env = self.environment()?;
        let context = minijinja::context! {
            mac => node.mac.to_string(),
            hostname => hostname,
            labels => node.labels,
            image => minijinja::Value::from(minijinja::value::Serde(&node.image)),
        };
        for (i, s) in self.sources.iter().enumerate() {
            if let Some((k, v)) = &s.label
                && node.labels.get(k) != Some(v)
            {
                continue;
            }
            let content = if s.template {
                env.get_template(&i.to_string())
                    .and_then(|t| t.render(&context))
                    .map_err(|e| TemplateError::Invalid {
                        name: s.path.clone(),
                        message: format!("{e:#}"),
                    })?
                    .into_bytes()
            } else {
                s.content.clone()
            };
            files.insert(s.path.clone(), (s.mode, content));
        }
        Ok(files.into_iter().map(|(p, (m, c))| (p, m, c)).collect())
    }
}

/// The node's host name: its `hostname` label, else the name it is known by, else
/// `node-` and its MAC's hex digits.
pub fn hostname(mac: Mac, known: Option<&str>, labels: &BTreeMap<String, String>) -> String {
    labels
        .get("hostname")
        .map(String::as_str)
        // A label value may hold anything visible: host names only.
        .filter(|h| crate::api::refs::is_hostname(h))
        .or(known)
        .map(String::from)
        .unwrap_or_else(|| format!("node-{}", mac.to_string().replace(':', "")))
}

/// A machine-id (32 lowercase hex digits) derived from the MAC: the same on every boot of
/// the node, different between nodes, never all zeros.
pub fn machine_id(mac: Mac) -> String {
    let d = Sha256::digest(format!("bootfleet machine-id {mac}").as_bytes());
    hex::encode(&d[..16])
}

/// The overlay as the tar stage 1 takes.
pub fn tar(files: &[OverlayFile]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, mode, content) in files {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(*mode);
        h.set_size(content.len() as u64);
        h.set_mtime(0);
        b.append_data(&mut h, path, content.as_slice())
            .expect("writing to memory");
    }
    b.into_inner().expect("writing to memory")
}

/// Every regular file under `base`, with its path relative to it (`/`-separated).
fn walk(base: &Path) -> std::io::Result<Vec<(std::path::PathBuf, String)>> {
    let mut out = Vec::new();
    let mut todo = vec![base.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            if kind.is_dir() {
                todo.push(entry.path());
            } else if kind.is_file() {
                let rel = entry
                    .path()
                    .strip_prefix(base)
                    .expect("under base")
                    .to_string_lossy()
                    .into_owned();
                out.push((entry.path(), rel));
            }
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node<'a>(labels: &'a BTreeMap<String, String>) -> OverlayNode<'a> {
        OverlayNode {
            mac: "52:54:00:12:34:56".parse().unwrap(),
            known_name: None,
            labels,
            image: OverlayImage {
                name: "gpu-node",
                version: "1",
                digest: Digest::of(b"image"),
            },
        }
    }

    #[test]
    fn built_ins_are_derived_from_the_node() {
        let labels = BTreeMap::new();
        let files = Overlay::default().render(&node(&labels)).unwrap();
        let get = |p: &str| {
            String::from_utf8(files.iter().find(|f| f.0 == p).unwrap().2.clone()).unwrap()
        };
        assert_eq!(get("etc/hostname"), "node-525400123456\n");
        let id = get("etc/machine-id");
        assert_eq!(id.trim().len(), 32);
        assert_eq!(id.trim(), machine_id("52:54:00:12:34:56".parse().unwrap()));
        assert_ne!(id.trim(), machine_id("52:54:00:12:34:57".parse().unwrap()));
        assert!(get("etc/hosts").contains("127.0.1.1\tnode-525400123456"));
    }

    #[test]
    fn operator_files_by_label_and_templates() {
        let dir = tempfile::tempdir().unwrap();
        let w = |p: &str, text: &str| {
            let path = dir.path().join(p);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        w("all/root/.ssh/authorized_keys", "ssh-ed25519 AAAA admin\n");
        w(
            "all/etc/motd.j2",
            "{{ hostname }} runs {{ image.name }}:{{ image.version }}\n",
        );
        w(
            "label/role=slurm/etc/slurm/slurm.conf.j2",
            "NodeName={{ hostname }}\n",
        );
        let overlay = Overlay::load(dir.path()).unwrap();
        let mut labels = BTreeMap::from([("hostname".to_string(), "gpu-7".to_string())]);
        let plain = overlay.render(&node(&labels)).unwrap();
        let paths: Vec<&str> = plain.iter().map(|f| f.0.as_str()).collect();
        assert!(!paths.contains(&"etc/slurm/slurm.conf"), "{paths:?}");
        let motd = &plain.iter().find(|f| f.0 == "etc/motd").unwrap().2;
        assert_eq!(motd, b"gpu-7 runs gpu-node:1\n");
        labels.insert("role".into(), "slurm".into());
        let slurm = overlay.render(&node(&labels)).unwrap();
        let conf = &slurm
            .iter()
            .find(|f| f.0 == "etc/slurm/slurm.conf")
            .unwrap()
            .2;
        assert_eq!(conf, b"NodeName=gpu-7\n");
        // A template naming an unknown variable fails when rendered (strict), by name.
        w("all/etc/bad.j2", "{{ nope }}");
        let e = Overlay::load(dir.path())
            .unwrap()
            .render(&node(&labels))
            .unwrap_err();
        assert!(e.to_string().contains("etc/bad"), "{e}");
        w("label/broken/x", "");
        assert!(Overlay::load(dir.path()).is_err());
    }
}
