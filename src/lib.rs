//! bootfleet: network-boot, stateless provisioning for bare-metal GPU clusters.
//! See ARCHITECTURE.md for the codemap and the invariants each module keeps.

pub use bootfleet_api as api;

pub mod audit;
pub mod auth;
pub mod boot;
pub mod cli;
pub mod clock;
pub mod config;
pub mod dhcp;
pub mod events;
pub mod fabric;
pub mod health;
pub mod heap;
pub mod http;
pub mod http_client;
pub mod image;
pub mod leader;
pub mod metrics;
pub mod node;
pub mod power;
pub mod registry;
pub mod rollout;
pub mod server;
pub mod store;
pub mod storm;
pub mod tftp;
pub mod tpm;
pub mod udp_buffer;
