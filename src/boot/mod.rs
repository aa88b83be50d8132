//! Booting renders: iPXE boot scripts from the templates, and two-stage images'
//! per-node overlays (pure). What a boot records and
//! what the agent's calls do is the node service's (`node::service`).

pub mod overlay;
pub mod script;
