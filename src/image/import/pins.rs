//! Pins checked against the content: the versions an import reads out of the image
//! (kernel release, `nvidia.ko`'s and `mlx5_core.ko`'s modinfo `version`, CUDA's
//! `version.json`) against the pins the admin wrote. A disagreement refuses the import
//! naming both; a version found and not pinned becomes a derived pin, so attestation
//! checks the node against what the image really holds. Pure.

use std::collections::BTreeMap;

/// Merges `found` into `pinned`; refuses the first pin the content contradicts, and any
/// pin of a component the image does not contain.
pub fn merge(
    pinned: &BTreeMap<String, String>,
    found: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>, String> {
    let mut merged = found.clone();
    for (name, want) in pinned {
        match found.get(name) {
            Some(have) if have == want => {}
            Some(have) => {
                return Err(format!(
                    "pins.{name} is {want:?}, but the image contains {name} {have:?}"
                ));
            }
            None => {
                return Err(format!(
                    "pins.{name} is {want:?}, but the image contains no {name} (nothing to check it against)"
                ));
            }
        }
        merged.insert(name.clone(), want.clone());
    }
    Ok(merged)
}

/// CUDA's version from `/usr/local/cuda/version.json` (`{"cuda": {"version": "12.4.1"}}`).
pub fn cuda_version(version_json: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(version_json).ok()?;
    v.get("cuda")?.get("version")?.as_str().map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn agreeing_pins_merge_with_derived_ones() {
        let found = map(&[
            ("kernel", "6.1.0-57-cloud-amd64"),
            ("nvidia-driver", "550.127.05"),
        ]);
        let merged = merge(&map(&[("kernel", "6.1.0-57-cloud-amd64")]), &found).unwrap();
        assert_eq!(merged, found);
    }

    #[test]
    fn a_contradicted_pin_names_both_versions() {
        let found = map(&[("nvidia-driver", "550.127.05")]);
        let e = merge(&map(&[("nvidia-driver", "535.216.03")]), &found).unwrap_err();
        assert!(e.contains("535.216.03") && e.contains("550.127.05"), "{e}");
        let e = merge(&map(&[("ofed", "24.10")]), &found).unwrap_err();
        assert!(e.contains("contains no ofed"), "{e}");
    }

    #[test]
    fn cuda_from_version_json() {
        assert_eq!(
            cuda_version(br#"{"cuda":{"name":"CUDA SDK","version":"12.4.1"},"nvcc":{}}"#)
                .as_deref(),
            Some("12.4.1")
        );
        assert_eq!(cuda_version(b"{}"), None);
    }
}
