//! The canonical form of an image and its digest: same content, same digest.
//!
//! The canonical form is compact JSON, keys sorted, no whitespace:
//! `{"artifacts":[{"digest":..,"path":..,"role":..,"size":..},..],"cmdline":..,
//!   "name":..,"pins":{..},"rootfs":{..},"schema":"bootfleet.image.v1","validation":{..},
//!   "version":..}`
//! (`rootfs`, the `[rootfs]` section with the dm-verity root hash, only when the manifest
//! has one, so images without it keep their digests) with artifacts in role order (kernel, initrds as listed, rootfs). Tar order, mtimes,
//! owners, compression and TOML comments or layout do not enter it; any artifact byte,
//! path, pin, the command line or a validation value does.

use super::manifest::Manifest;
use crate::api::Digest;
use crate::api::image::Artifact;

pub const SCHEMA: &str = "bootfleet.image.v1";

/// The canonical bytes. `artifacts` must be in `manifest.artifact_paths()` order.
pub fn canonical_form(manifest: &Manifest, artifacts: &[Artifact]) -> Vec<u8> {
    // serde_json::json! builds maps in key order only without `preserve_order`; sort
    // explicitly so a feature flag elsewhere in the tree cannot change image digests.
    let mut value = serde_json::json!({
        "schema": SCHEMA,
        "name": manifest.name,
        "version": manifest.version,
        "cmdline": manifest.cmdline,
        "artifacts": artifacts,
        "pins": manifest.pins,
        "validation": manifest.validation,
    });
    // Only when present: images without one keep the digests they always had.
    if let Some(rootfs) = &manifest.rootfs_spec {
        value["rootfs"] = serde_json::to_value(rootfs).expect("plain data serialises");
    }
    let value = sorted(value);
    serde_json::to_vec(&value).expect("JSON values always serialise")
}

pub fn image_digest(canonical: &[u8]) -> Digest {
    Digest::of(canonical)
}

fn sorted(v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        J::Object(map) => {
            let mut entries: Vec<_> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            J::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        J::Array(a) => J::Array(a.into_iter().map(sorted).collect()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::image::Role;

    fn manifest(extra: &str) -> Manifest {
        Manifest::parse(&format!(
            "name = \"n\"\nversion = \"1\"\n[boot]\nkernel = \"k\"\ninitrds = [\"i\"]\ncmdline = \"c\"\n[pins]\nofed = \"2\"\nkernel = \"1\"\n{extra}"
        ))
        .unwrap()
    }

    fn artifacts(kernel: &[u8]) -> Vec<Artifact> {
        vec![
            Artifact {
                role: Role::Kernel,
                path: "k".into(),
                digest: Digest::of(kernel),
                size: kernel.len() as u64,
            },
            Artifact {
                role: Role::Initrd,
                path: "i".into(),
                digest: Digest::of(b"i"),
                size: 1,
            },
        ]
    }

    #[test]
    fn form_is_sorted_compact_json() {
        let text = String::from_utf8(canonical_form(&manifest(""), &artifacts(b"k"))).unwrap();
        assert!(
            text.starts_with("{\"artifacts\":[{\"digest\":\"sha256:"),
            "{text}"
        );
        assert!(
            text.contains("\"pins\":{\"kernel\":\"1\",\"ofed\":\"2\"}"),
            "{text}"
        );
        assert!(!text.contains(' '), "{text}");
    }

    #[test]
    fn layout_does_not_matter_but_content_does() {
        let a = image_digest(&canonical_form(&manifest(""), &artifacts(b"k")));
        let comments = image_digest(&canonical_form(
            &manifest("# a comment\n[validation]\n"),
            &artifacts(b"k"),
        ));
        assert_eq!(a, comments);
        let other_kernel = image_digest(&canonical_form(&manifest(""), &artifacts(b"K")));
        assert_ne!(a, other_kernel);
        let other_validation = image_digest(&canonical_form(
            &manifest("[validation]\ngpus = 8\n"),
            &artifacts(b"k"),
        ));
        assert_ne!(a, other_validation);
    }
}
