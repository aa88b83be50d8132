//! The InfiniBand cabling the operator declares (`[fabric] topology`, in `ibnetdiscover`'s
//! format) against what each node's ports reach at validation, so a swapped, moved or
//! missing cable is named by port: `topology.rs` reads the declaration, `cabling.rs`
//! judges a node's report against it (pure, both).

pub mod cabling;
pub mod topology;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// `[fabric]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FabricSettings {
    /// The fabric as it should be cabled, as `ibnetdiscover` prints it (run it once on a
    /// fabric known to be right, or write it from the cabling plan). Read at start; a
    /// file that does not parse stops the start. Unset: cabling is not checked.
    pub topology: Option<PathBuf>,
}

impl FabricSettings {
    /// The declared topology, read and parsed; None when none is declared.
    pub fn load(&self) -> Result<Option<topology::Topology>, String> {
        let Some(path) = &self.topology else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("[fabric] topology {}: {e}", path.display()))?;
        topology::parse(&text)
            .map(Some)
            .map_err(|e| format!("[fabric] topology {}: {e}", path.display()))
    }
}
