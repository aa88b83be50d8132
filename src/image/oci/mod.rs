//! OCI images as an import reads them: where they come from (an uploaded OCI or Docker
//! archive, a registry), their documents, and their layers applied into one root tree
//! that is written out as a single tar for `mksquashfs`. Untrusted input throughout:
//! every blob is checked against its digest, every layer entry against the tree's rules.

pub mod archive;
pub mod flatten;
pub mod layer;
pub mod pull;
pub mod spec;
pub mod tree;

use std::collections::BTreeMap;

use crate::api::Digest;
use layer::LayerBlob;
use tree::{Origin, Rules, Tree};

#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// The content (or the source) is refused; the text says why.
    #[error("{0}")]
    Refused(String),
    /// The registry could not be reached or answered with an error.
    #[error("{0}")]
    Unreachable(String),
    #[error("storage error while importing: {0}")]
    Io(#[from] std::io::Error),
}

/// An image whose documents were read and whose blobs are staged, checked by digest.
#[derive(Debug, Clone)]
pub struct OciImage {
    pub config_digest: Digest,
    /// In manifest order, the base first.
    pub layers: Vec<LayerBlob>,
}

/// The merged root and the bytes of the small files pass one kept.
pub struct Root {
    pub tree: Tree,
    pub kept: BTreeMap<Origin, Vec<u8>>,
}

/// Pass one: every layer's headers applied in order.
pub fn build_root(
    layers: &[LayerBlob],
    rules: &Rules,
    keep: layer::Keep<'_>,
) -> Result<Root, OciError> {
    let mut root = Root {
        tree: Tree::default(),
        kept: BTreeMap::new(),
    };
    let mut budget = layer::Budget::for_rules(rules);
    for (index, blob) in layers.iter().enumerate() {
        let read = layer::read_entries(blob, index as u32, keep, &mut budget).map_err(|e| {
            OciError::Refused(format!("layer {} ({}): {e}", index + 1, blob.diff_id))
        })?;
        root.tree
            .apply_layer(read.entries, rules)
            .map_err(|e| OciError::Refused(e.to_string()))?;
        root.kept.extend(read.kept);
    }
    Ok(root)
}

impl Root {
    /// The bytes of a kept file at `path` (links followed), if pass one kept the entry
    /// that is there now.
    pub fn kept_file(&self, path: &[u8]) -> Option<&[u8]> {
        let resolved = self.tree.resolve(path)?;
        match self.tree.get(&resolved)?.kind {
            tree::Kind::File { data, .. } => self.kept.get(&data).map(Vec::as_slice),
            _ => None,
        }
    }
}
