//! The OCI image and Docker archive documents an import reads: index, manifest, config,
//! and `docker save`'s `manifest.json`. Only the fields the import needs; unknown fields
//! are ignored (the specs allow them), wrong types are refused by serde.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::api::Digest;

pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";

/// Where the image's own ref name is written in an index (what `skopeo copy ...:TAG` puts).
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// A content descriptor: what a blob is, its digest and size.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: Digest,
    pub size: u64,
    #[serde(default)]
    pub platform: Option<Platform>,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Platform {
    pub architecture: String,
    pub os: String,
    #[serde(default)]
    pub variant: Option<String>,
}

/// `index.json` of a layout, or an image index / manifest list from a registry.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Index {
    pub schema_version: u32,
    #[serde(default)]
    pub media_type: Option<String>,
    pub manifests: Vec<Descriptor>,
}

/// An image manifest (OCI, or Docker's schema 2, which has the same shape).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageManifest {
    pub schema_version: u32,
    #[serde(default)]
    pub media_type: Option<String>,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
}

/// The image configuration: the platform and the layers' uncompressed digests.
#[derive(Debug, Clone, Deserialize)]
pub struct ImageConfig {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
    pub rootfs: RootFs,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RootFs {
    #[serde(rename = "type")]
    pub kind: String,
    pub diff_ids: Vec<Digest>,
}

/// One image of `docker save`'s `manifest.json` (a list of them).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct DockerArchiveImage {
    pub config: String,
    #[serde(default)]
    pub repo_tags: Option<Vec<String>>,
    pub layers: Vec<String>,
}

/// How a layer blob is compressed, from its media type (and, for Docker archives whose
/// layers carry no media type, from its first bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    /// The compression a layer media type names; None for a type that is not a layer
    /// this import can read (foreign or encrypted layers, for example).
    pub fn of_media_type(media_type: &str) -> Option<Self> {
        match media_type {
            "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.docker.image.rootfs.diff.tar" => Some(Self::None),
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip" => Some(Self::Gzip),
            "application/vnd.oci.image.layer.v1.tar+zstd"
            | "application/vnd.docker.image.rootfs.diff.tar.zstd" => Some(Self::Zstd),
            _ => None,
        }
    }

    /// Sniffs the compression from a blob's first bytes.
    pub fn sniff(head: &[u8]) -> Self {
        if head.starts_with(&[0x1f, 0x8b]) {
            Self::Gzip
        } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Self::Zstd
        } else {
            Self::None
        }
    }
}

/// The platform an import takes from a multi-platform index.
pub fn is_wanted_platform(p: &Platform) -> bool {
    p.os == "linux" && p.architecture == "amd64"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_skopeo_and_docker_write() {
        let index: Index = serde_json::from_str(
            r#"{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json",
            "digest":"sha256:0000000000000000000000000000000000000000000000000000000000000000","size":7,
            "annotations":{"org.opencontainers.image.ref.name":"bookworm"}}]}"#,
        )
        .unwrap();
        assert_eq!(index.manifests[0].annotations[REF_NAME], "bookworm");
        let docker: Vec<DockerArchiveImage> = serde_json::from_str(
            r#"[{"Config":"abc.json","RepoTags":["x:1"],"Layers":["d1/layer.tar"]}]"#,
        )
        .unwrap();
        assert_eq!(docker[0].layers, ["d1/layer.tar"]);
        let config: ImageConfig = serde_json::from_str(
            r#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]},"config":{"Cmd":["/sbin/init"]}}"#,
        )
        .unwrap();
        assert_eq!(config.rootfs.kind, "layers");
    }

    #[test]
    fn layer_compression_from_type_or_bytes() {
        assert_eq!(
            Compression::of_media_type("application/vnd.oci.image.layer.v1.tar+gzip"),
            Some(Compression::Gzip)
        );
        assert_eq!(
            Compression::of_media_type("application/vnd.oci.image.layer.v1.tar+encrypted"),
            None
        );
        assert_eq!(Compression::sniff(&[0x1f, 0x8b, 8]), Compression::Gzip);
        assert_eq!(Compression::sniff(b"etc/"), Compression::None);
    }
}
