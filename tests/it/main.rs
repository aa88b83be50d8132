//! bootfleet integration tests: one binary, one module per area.

mod agent;
mod auth;
mod blobs;
mod bundles;
mod deploy;
mod dhcp_fuzz;
mod dhcp_net;
mod e2e;
mod fake_node;
mod fuzz;
mod harness;
mod layers;
mod lifecycle;
mod limits;
mod nodes;
mod objects;
mod pg;
mod power;
mod process;
mod publish;
mod s3;
mod servers;
mod store;
mod storm;
mod tftp;
mod tidy;
