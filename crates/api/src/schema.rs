//! OpenAPI schemas for the types that serialize themselves as strings (`Mac`, `Digest`,
//! `NodeState`): the derive cannot see through a hand-written `Serialize`, so each says
//! here what its string looks like. Built only with the `openapi` feature (the server's).

use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
use utoipa::{PartialSchema, ToSchema};

use crate::{Digest, Mac, NodeState};

fn text(description: &str, pattern: Option<&str>, example: &str) -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .description(Some(description))
        .pattern(pattern)
        .examples([serde_json::Value::from(example)])
}

impl PartialSchema for Mac {
    fn schema() -> RefOr<Schema> {
        // What `Mac::from_str` takes: colons or dashes (one kind throughout), either case.
        text(
            "A MAC address; answers write it lower-case with colons.",
            Some("^([0-9A-Fa-f]{2}:){5}[0-9A-Fa-f]{2}$|^([0-9A-Fa-f]{2}-){5}[0-9A-Fa-f]{2}$"),
            "52:54:00:12:34:56",
        )
        .into()
    }
}
impl ToSchema for Mac {}

impl PartialSchema for Digest {
    fn schema() -> RefOr<Schema> {
        text(
            "A content digest: `sha256:` and 64 lower-case hex digits.",
            Some("^sha256:[0-9a-f]{64}$"),
            "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
        )
        .into()
    }
}
impl ToSchema for Digest {}

impl PartialSchema for NodeState {
    fn schema() -> RefOr<Schema> {
        names(NodeState::ALL.map(NodeState::as_str))
    }
}

/// A string that is one of `values`: an enum's wire names.
pub(crate) fn names(values: impl IntoIterator<Item = &'static str>) -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(values))
        .into()
}
impl ToSchema for NodeState {}
