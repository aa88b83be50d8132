//! Fleet health over time: each node's recent readings from its heartbeats, the
//! `[health]` rules that judge them over windows (thermal throttling, corrected ECC
//! rising, fatal XIDs, InfiniBand links flapping, a GPU gone, readings missing), and the
//! verdicts they give. Pure but for its memory (bounded); the node service, the one writer
//! of node state, acts on the verdicts.

pub mod compact;
pub mod peers;
pub mod rules;
pub mod series;
pub mod track;

pub use rules::{Action, Condition, HealthSettings, Rule};
pub use track::{Health, Verdict};
