//! Images and tags as the admin API shows them, and the answers of publish, tag, verify
//! and garbage collection.

use serde::{Deserialize, Serialize};

use crate::Digest;

/// The manifest's name inside a bundle (a tar, or a directory the CLI tars).
pub const MANIFEST_NAME: &str = "manifest.toml";

/// The boot artifacts' roles; the order here is the canonical order.
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifact {
    pub role: Role,
    pub path: String,
    pub digest: Digest,
    pub size: u64,
}

/// An image as listed and shown.
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
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageDetail {
    #[serde(flatten)]
    pub image: Image,
    pub manifest: String,
}

/// A tag and where it points now.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Tag {
    pub tag: String,
    pub digest: Digest,
    pub updated_at: String,
}

/// One move of a tag: who moved it, when, from where to where.
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
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TagRequest {
    pub image: String,
}

/// The answer to a publish (201 when created, 200 when the same content was there).
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

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TagResult {
    pub tag: String,
    pub digest: Digest,
    pub from: Option<Digest>,
    pub changed: bool,
}

/// `POST /api/v1/blobs/verify`.
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
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GcReport {
    pub removed: Vec<Digest>,
    pub bytes_freed: u64,
    pub kept: usize,
}
