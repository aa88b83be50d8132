//! `bootfleet-agent`, the program a booted node runs: it finds its boot on the kernel
//! command line, collects raw facts (system, GPUs, XIDs), posts attestation, validation
//! and heartbeats, and carries out the answer. It judges nothing: the server does.
//! Collection sits behind narrow interfaces (a root directory for /proc and /sys, a
//! `GpuSource`), so recorded readings drive the real path in tests.

pub mod boot_params;
pub mod checks;
pub mod facts;
pub mod gpu;
pub mod ib_peers;
pub mod run;
pub mod stage1;
pub mod tpm;
pub mod xid;
