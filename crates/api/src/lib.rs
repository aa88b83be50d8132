//! bootfleet's wire contract, types only: typed IDs (`Mac`, `Digest`, image REFs), node
//! states, and every request, report, verdict, next action and admin response of the
//! HTTP API. The server, the agent, the CLI and the storm simulator all speak these
//! types; nobody writes an API body by hand. No I/O, no rules: a judgement (attestation,
//! validation, drift, the lifecycle table) lives in the server.

pub mod agent;
pub mod digest;
pub mod event;
pub mod health;
pub mod image;
pub mod mac;
pub mod node;
pub mod power;
pub mod refs;
pub mod rollout;
#[cfg(feature = "openapi")]
pub(crate) mod schema;
pub mod token;

pub use digest::{Digest, DigestError};
pub use mac::{Mac, MacError};
pub use node::NodeState;
pub use refs::{ImageRef, RefError, TagName};

/// `GET /readyz`: whether the server can serve, and what is wrong when it cannot.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Readiness {
    pub ready: bool,
    /// `ok`, or the database error.
    pub database: String,
    /// `ok`, or why a write to the store did not commit (a full disk, a read-only
    /// replica): a server that answers reads but cannot record boots is not ready.
    pub writes: String,
    /// `ok`, or what is wrong with the blob directory (missing, or less free space than a
    /// publish keeps back).
    pub blobs: String,
}

/// The body of every error answer: `{"error": "<reason>"}`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ErrorBody {
    pub error: String,
}
