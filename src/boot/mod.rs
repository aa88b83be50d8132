//! Booting over HTTP and what follows: scripts (pure rendering), boot records and tokens,
//! blob fetches attributed to boots, and the agent's calls (attest, validate, heartbeat).

pub mod attest;
pub mod fetches;
pub mod heartbeat;
pub mod script;
pub mod service;
pub mod timeline;
pub mod validate;
