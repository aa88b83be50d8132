//! Booting renders: iPXE boot scripts from the templates (pure). What a boot records and
//! what the agent's calls do is the node service's (`node::service`).

pub mod script;
