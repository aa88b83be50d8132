//! Rollouts: an image moved onto a selection of nodes in waves (canaries first), each
//! node drained from its workload scheduler, reimaged, and counted only once it is ready
//! (attested and validated) on the new digest; halted past `max_failures`, rolled back
//! exactly (each node to the digest it ran before). Persisted, so a restarted server goes
//! on where it was. `plan.rs` the rules (pure), `service.rs` the admin's requests,
//! `run.rs` the controller (one server at a time), `drain/` the schedulers.

pub mod drain;
pub mod plan;
pub mod revalidate;
pub mod run;
pub mod service;
