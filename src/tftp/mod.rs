//! Read-only TFTP for boot binaries and artifacts: pure codec, option negotiation and
//! transfer state machine, plus a thin tokio socket loop.

pub mod client;
pub mod exercise;
pub mod files;
pub mod metrics;
pub mod options;
pub mod packet;
mod pktinfo;
pub mod server;
pub mod transfer;
