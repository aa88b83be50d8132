//! bootfleet integration tests: one binary, one module per area.

mod auth;
mod blobs;
mod bundles;
mod harness;
mod nodes;
mod process;
mod publish;
mod tftp;
mod tidy;
