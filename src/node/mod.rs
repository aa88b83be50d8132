//! Nodes: the lifecycle state machine (pure). The controller that persists transitions,
//! attestation and validation judgements arrive with issue #5.

pub mod attest;
pub mod controller;
pub mod mac;
pub mod state;
