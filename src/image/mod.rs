//! Images: blob store, manifests, bundles, canonical digests, names and tags.
//! Knows nothing of nodes, HTTP or SQL.

pub mod blobstore;
pub mod bundle;
pub mod bundle_path;
pub mod cache;
pub mod canonical;
pub mod exercise;
pub mod import;
pub mod manifest;
pub mod objects;
pub mod oci;
pub mod tar_guard;
