//! Nodes: the lifecycle state machine, attestation, validation and drift judgements and
//! lifecycle policy (all pure), who may start a boot (`boot_guard`), which nodes a query
//! means (`selector`), what DHCP and TFTP saw before a boot (`preboot`), and the controller,
//! the one writer of node state.

pub mod attest;
pub mod boot_guard;
pub mod controller;
pub mod directory;
pub mod drift;
pub mod liveness;
pub mod policy;
pub mod preboot;
pub mod reimage;
pub mod sampled;
pub mod selector;
pub mod service;
pub mod state;
pub mod sweeper;
pub mod validate;
