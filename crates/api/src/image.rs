//! Images and tags as the admin API shows them, and the answers of publish, tag, verify
//! and garbage collection.

use serde::{Deserialize, Serialize};

use crate::Digest;

/// The manifest's name inside a bundle (a tar, or a directory the CLI tars).
pub const MANIFEST_NAME: &str = "manifest.toml";

/// The boot artifacts' roles; the order here is the canonical order.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Kernel,
    Initrd,
    Rootfs,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Kernel => "kernel",
            Role::Initrd => "initrd",
            Role::Rootfs => "rootfs",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Role::Kernel, Role::Initrd, Role::Rootfs]
            .into_iter()
            .find(|r| r.as_str() == s)
    }
}

/// One stored artifact of an image.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifact {
    pub role: Role,
    pub path: String,
    pub digest: Digest,
    pub size: u64,
}

/// An image as listed and shown.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Image {
    pub digest: Digest,
    pub name: String,
    pub version: String,
    pub created_at: String,
    pub artifacts: Vec<Artifact>,
    /// Tags currently pointing here, as `name:tag`.
    pub tags: Vec<String>,
    /// Why the image cannot be booted (a blob `image verify` found damaged or missing);
    /// absent when whole. A re-publish of the bundle restores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broken: Option<String>,
}

/// `GET /api/v1/images/{ref}`: the image and its manifest as the admin wrote it.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageDetail {
    #[serde(flatten)]
    pub image: Image,
    pub manifest: String,
}

/// A tag and where it points now.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Tag {
    pub tag: String,
    pub digest: Digest,
    pub updated_at: String,
}

/// One move of a tag: who moved it, when, from where to where.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TagMove {
    pub tag: String,
    pub from: Option<Digest>,
    pub to: Digest,
    /// The version of the image `from` names (a tag points at images of its own name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_version: Option<String>,
    /// The version of the image `to` names.
    #[serde(default)]
    pub to_version: String,
    pub actor: String,
    pub at: String,
}

/// `PUT /api/v1/tags/{name}/{tag}`: the REF the tag is to point to.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TagRequest {
    pub image: String,
}

/// The answer to a publish (201 when created, 200 when the same content was there).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PublishOutcome {
    pub digest: Digest,
    pub name: String,
    pub version: String,
    /// False when the same content was already published (a no-op).
    pub created: bool,
    pub bytes: u64,
    pub tag: Option<TagResult>,
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TagResult {
    pub tag: String,
    pub digest: Digest,
    pub from: Option<Digest>,
    pub changed: bool,
}

/// `POST /api/v1/blobs/verify`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct VerifyReport {
    pub checked: usize,
    pub bytes: u64,
    /// Blobs whose content no longer matches their name; now quarantined.
    pub quarantined: Vec<Digest>,
    /// Blobs an image needs that the store does not have (or that were quarantined);
    /// with an object store, those missing from it.
    pub missing: Vec<Digest>,
    /// With an object store: objects whose bytes no longer hash to their name (never
    /// served; replace them by publishing the image again).
    #[serde(default)]
    pub damaged_objects: Vec<Digest>,
}

/// `POST /api/v1/blobs/gc`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GcReport {
    /// Blobs removed from this server's data directory.
    pub removed: Vec<Digest>,
    pub bytes_freed: u64,
    /// Blobs images still need.
    pub kept: usize,
    /// Objects removed from the shared object store (none without `[blobs]`, and none
    /// younger than `[blobs] gc_grace_secs`).
    #[serde(default)]
    pub objects_removed: Vec<Digest>,
    #[serde(default)]
    pub object_bytes_freed: u64,
}

/// The block size of every dm-verity tree bootfleet writes (data and hash blocks).
pub const VERITY_BLOCK: u64 = 4096;

/// A rootfs blob's dm-verity parameters: format 1, no superblock, 4096-byte blocks, the
/// hash tree after the data in the same blob. Part of the manifest (`[rootfs.verity]`),
/// hence of the image digest; stage 1 gets them on the kernel command line
/// (`bootfleet.verity=`) and the node's kernel checks every block it reads against
/// `root_hash`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Verity {
    /// 64 hex digits.
    pub root_hash: String,
    /// Bytes of file-system data; the hash tree starts here.
    pub hash_offset: u64,
    pub data_blocks: u64,
    /// The hash (`sha256`).
    pub algorithm: String,
    /// Hex, or `-` for none.
    pub salt: String,
}

impl Verity {
    /// Why these parameters cannot describe a bootfleet rootfs blob, if they cannot.
    pub fn check(&self) -> Result<(), String> {
        let hex = |s: &str| {
            s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        if self.root_hash.len() != 64 || !hex(&self.root_hash) {
            return Err("verity root-hash must be 64 lowercase hex digits".into());
        }
        if self.algorithm != "sha256" {
            return Err(format!(
                "verity algorithm {:?}: only sha256 is used",
                self.algorithm
            ));
        }
        if self.salt != "-"
            && (self.salt.is_empty() || !self.salt.len().is_multiple_of(2) || !hex(&self.salt))
        {
            return Err("verity salt must be lowercase hex or \"-\"".into());
        }
        if self.data_blocks == 0
            || self.data_blocks.checked_mul(VERITY_BLOCK) != Some(self.hash_offset)
        {
            return Err(format!(
                "verity hash-offset must be data-blocks x {VERITY_BLOCK} (the tree follows the data)"
            ));
        }
        Ok(())
    }

    /// `bootfleet.verity=`'s value: `ALGORITHM:ROOT_HASH:DATA_BLOCKS:HASH_OFFSET:SALT`.
    pub fn kernel_arg(&self) -> String {
        format!(
            "{}:{}:{}:{}:{}",
            self.algorithm, self.root_hash, self.data_blocks, self.hash_offset, self.salt
        )
    }

    pub fn parse_kernel_arg(value: &str) -> Option<Self> {
        let mut parts = value.split(':');
        let v = Self {
            algorithm: parts.next()?.to_string(),
            root_hash: parts.next()?.to_string(),
            data_blocks: parts.next()?.parse().ok()?,
            hash_offset: parts.next()?.parse().ok()?,
            salt: parts.next()?.to_string(),
        };
        (parts.next().is_none() && v.check().is_ok()).then_some(v)
    }
}

#[cfg(test)]
mod verity_tests {
    use super::*;

    #[test]
    fn kernel_arg_round_trips_and_is_checked() {
        let v = Verity {
            root_hash: "ab".repeat(32),
            hash_offset: 8192,
            data_blocks: 2,
            algorithm: "sha256".into(),
            salt: "-".into(),
        };
        assert_eq!(Verity::parse_kernel_arg(&v.kernel_arg()), Some(v.clone()));
        assert!(Verity::parse_kernel_arg("sha256:xx:2:8192:-").is_none());
        let bad = Verity {
            hash_offset: 4096,
            ..v
        };
        assert!(bad.check().unwrap_err().contains("hash-offset"));
    }
}

/// `POST /api/v1/images/import`: an OCI image to import as a two-stage image. From a
/// registry (`source` = `docker://HOST[:PORT]/REPO[:TAG|@DIGEST]`, this as the JSON body),
/// or from an archive in the body (an OCI layout as a tar, an `oci-archive` or a
/// `docker-archive`; this as the `spec` query parameter, JSON).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ImportRequest {
    pub name: String,
    pub version: String,
    /// `name:tag` to point at the image once published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// A registry to pull from; absent when the body is the archive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The image of an archive that holds several (its ref name or repo tag).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    /// The kernel command line of the image (stage 1's own words are added at boot).
    #[serde(default)]
    pub cmdline: String,
    /// Pins the content must agree with (the import adds what it finds).
    #[serde(default)]
    pub pins: std::collections::BTreeMap<String, String>,
    /// `[validation]`, as in a manifest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation: Option<serde_json::Value>,
    /// Keep character and block devices of the image.
    #[serde(default)]
    pub allow_devices: bool,
    /// Add the server's bootfleet-agent and its enabled systemd unit to the root.
    #[serde(default)]
    pub install_agent: bool,
    /// A registry login by name: a TOML file with `registry` (the HOST[:PORT] it is
    /// for), `username` and `password` in the server's secrets directory, never sent
    /// over the API and only ever to its own registry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry_credential: Option<String>,
    /// Speak plain HTTP to the registry (a registry on a trusted local network).
    #[serde(default)]
    pub plain_http: bool,
}

/// What an import found in the image and built from it.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ImportReport {
    pub kernel_release: String,
    /// The image's pins: the admin's, and those read from the content.
    pub pins: std::collections::BTreeMap<String, String>,
    /// The pins the import added (found in the content, not given).
    pub derived_pins: Vec<String>,
    /// Bytes of the root's files.
    pub root_bytes: u64,
    /// Bytes of the rootfs blob (squashfs and its hash tree).
    pub rootfs_bytes: u64,
    pub verity_root_hash: String,
    pub compressor: String,
    /// Modules stage 1 loads, in order.
    pub stage1_modules: Vec<String>,
    /// Boot-NIC drivers the image's kernel lacks (neither module nor built in).
    pub absent_network_drivers: Vec<String>,
    pub layers: usize,
    /// Files whose POSIX ACLs were dropped (squashfs cannot hold them).
    #[serde(default)]
    pub dropped_acls: u64,
}

/// The answer to an import: the publish's, and the import's report.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ImportOutcome {
    #[serde(flatten)]
    pub publish: PublishOutcome,
    pub import: ImportReport,
}
