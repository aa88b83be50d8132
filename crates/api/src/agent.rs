//! What the node agent sends and what it is answered: attestation (what the node runs),
//! validation (raw GPU readings, XIDs, check results) and heartbeats (facts compared with
//! the attested baseline; the answer carries the next action). The agent reports raw
//! readings; every judgement is the server's.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Digest, Mac};

/// `POST /api/v1/agent/attest`, with the boot token as bearer.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttestRequest {
    pub boot_id: String,
    pub mac: Mac,
    pub report: AttestReport,
    /// The TPM's quote, from a node that asked for a TPM challenge this boot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<TpmEvidence>,
}

/// `POST /api/v1/agent/tpm/challenge`, with the boot token as bearer: the node's TPM
/// keys. Binary TPM structures travel as lowercase hex.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TpmChallengeRequest {
    pub boot_id: String,
    pub mac: Mac,
    /// The endorsement key's TPM2B_PUBLIC (`tpm2_createek -f tss`).
    pub ek_public: String,
    /// The EK certificate from the TPM's NV index 0x01c00002 (DER), where it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ek_certificate: Option<String>,
    /// The attestation key's TPM2B_PUBLIC: a restricted signing key made in the same TPM.
    pub ak_public: String,
}

/// A credential only the TPM holding the enrolled EK can open, for the AK it names
/// (`tpm2_activatecredential -i`: tpm2-tools' blob), and the PCRs to quote.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TpmChallengeAnswer {
    pub credential: String,
    pub pcrs: Vec<u8>,
}

/// What the agent's TPM answered, sent with its attestation.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TpmEvidence {
    /// The secret the credential carried, as ActivateCredential recovered it. The quote's
    /// qualifying data is SHA-256("bootfleet-quote\0" ‖ secret ‖ boot id).
    pub secret: String,
    /// The TPMS_ATTEST the TPM signed (`tpm2_quote -m`).
    pub attest: String,
    /// Its TPMT_SIGNATURE (`tpm2_quote -s`).
    pub signature: String,
    /// The SHA-256 PCR values quoted, by index.
    pub pcrs: BTreeMap<u8, String>,
    /// The firmware's event log (`/sys/kernel/security/tpm0/binary_bios_measurements`).
    pub event_log: String,
}

/// What a boot's TPM evidence showed: shown on the node's page.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TpmFindings {
    /// The TPM Name of the node's endorsement key (hex).
    pub ek_name: String,
    /// The quoted SHA-256 PCR values (hex), by index.
    pub pcrs: BTreeMap<u8, String>,
    /// What the firmware measured, and what each was matched to.
    pub measurements: Vec<TpmMeasurement>,
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TpmMeasurement {
    pub pcr: u32,
    pub event: String,
    pub digest: String,
    /// What it is ("snponly.efi", "kernel vmlinuz"); None: nothing this boot was
    /// given.
    pub matched: Option<String>,
}

/// What the agent reports about the system it booted.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttestReport {
    /// The image digest the node believes it booted (from its command line or initrd).
    pub image_digest: Digest,
    /// `uname -r`.
    pub kernel_release: String,
    /// `/proc/cmdline`.
    pub cmdline: String,
    /// Versions the node runs, by the manifest's pin names (`nvidia-driver`, `ofed`...).
    #[serde(default)]
    pub versions: BTreeMap<String, String>,
    /// Digests of the artifacts the node verified after download.
    #[serde(default)]
    pub artifacts: Vec<Digest>,
    /// Loaded kernel modules and their versions: not judged here, kept as the baseline
    /// that drift is measured against.
    #[serde(default)]
    pub modules: BTreeMap<String, String>,
    /// The dm-verity root hash of the device the root file system is read through (a
    /// two-stage boot's `bootfleet-root`), as the kernel's table says; absent when the
    /// root is not on dm-verity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verity_root_hash: Option<String>,
    /// Set by stage 1 alone, when it could not fetch, verify or mount the root: why. The
    /// boot then fails attestation with this reason and never runs the image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage1_failure: Option<String>,
}

/// One difference between what the boot was given and what the node reported.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mismatch {
    pub field: String,
    pub expected: String,
    pub found: String,
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    pub passed: bool,
    pub mismatches: Vec<Mismatch>,
    /// The TPM evidence's findings, when the boot sent some.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<TpmFindings>,
}

/// `POST /api/v1/agent/validate`, with the boot token as bearer.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ValidateRequest {
    pub boot_id: String,
    pub mac: Mac,
    pub report: ValidationReport,
}

/// PCIe link state: current and maximum generation and width.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PcieLink {
    pub gen_current: u32,
    pub gen_max: u32,
    pub width_current: u32,
    pub width_max: u32,
}

/// ECC error counters (NVML volatile = since driver load, aggregate = lifetime).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EccCounts {
    pub volatile_corrected: u64,
    pub volatile_uncorrected: u64,
    pub aggregate_corrected: u64,
    pub aggregate_uncorrected: u64,
}

/// Row remapping (NVML field values NVML_FI_DEV_REMAPPED_*), A100 and later.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowRemap {
    pub correctable: u64,
    pub uncorrectable: u64,
    pub pending: bool,
    pub failure: bool,
}

/// Retired pages (pre-A100 page retirement).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetiredPages {
    pub single_bit: u64,
    pub double_bit: u64,
    pub pending: bool,
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvLink {
    pub link: u32,
    pub active: bool,
}

/// One GPU as the agent saw it through NVML. Every reading is optional: an older GPU or
/// a failed query leaves it out, and a check that needs it says so. Unknown fields are
/// accepted: a newer agent may report more than this server judges.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GpuFacts {
    pub index: u32,
    pub uuid: String,
    pub serial: Option<String>,
    pub name: String,
    pub memory_mib: Option<u64>,
    pub pci_bus_id: Option<String>,
    pub pcie: Option<PcieLink>,
    pub ecc_enabled: Option<bool>,
    pub ecc: Option<EccCounts>,
    pub retired_pages: Option<RetiredPages>,
    pub row_remap: Option<RowRemap>,
    pub temperature_c: Option<u32>,
    pub power_w: Option<f64>,
    pub throttle_reasons: Vec<String>,
    /// NVML could not say why the clocks are held down (`throttle_reasons` is then
    /// empty, which must not read as "not throttled").
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub throttle_unreadable: bool,
    pub sm_clock_mhz: Option<u32>,
    pub sm_clock_max_mhz: Option<u32>,
    /// PCIe replays since the driver loaded.
    pub pcie_replay: Option<u64>,
    /// NVLink errors summed over the links (CRC flit, CRC data, replay, recovery).
    pub nvlink_errors: Option<u64>,
    pub persistence_mode: Option<bool>,
    pub mig_enabled: Option<bool>,
    pub nvlinks: Vec<NvLink>,
    /// An NVML error for this GPU ("Unknown Error", "GPU is lost"...).
    pub error: Option<String>,
}

/// An XID from the kernel log (`NVRM: Xid (PCI:0000:3b:00): 79, ...`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Xid {
    pub code: u32,
    pub pci_bus_id: Option<String>,
    #[serde(default)]
    pub line: String,
}

/// An optional check the agent ran (a compute probe, one DCGM diagnostic test...).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckResult {
    pub name: String,
    pub passed: bool,
    #[serde(default)]
    pub detail: String,
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ValidationReport {
    /// Why NVML could not be used ("NVML unavailable: ..."); GPUs are then unknown.
    pub nvml_error: Option<String>,
    /// The NVIDIA driver version NVML (or /proc/driver/nvidia/version) reports.
    pub driver_version: Option<String>,
    pub gpus: Vec<GpuFacts>,
    /// XIDs since boot.
    pub xids: Vec<Xid>,
    /// DCGM diagnostic results, one per test, when the image asked for them.
    pub dcgm: Option<Vec<CheckResult>>,
    pub checks: Vec<CheckResult>,
    /// Performance figures the agent's probes measured (GEMM throughput, HBM bandwidth,
    /// NVLink bandwidth, an NCCL all-reduce...): the server compares each with the
    /// node's peers' to catch a node that passes every check but runs slow.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub figures: Vec<Figure>,
    /// The InfiniBand ports (sysfs), for the image's `ib-*` expectations.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ib_ports: Vec<IbPortSample>,
}

/// One performance probe's figure: higher is better (a throughput, a bandwidth).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Figure {
    /// `gemm_tflops`, `hbm_gbps`, `nvlink_gbps`, `nccl_allreduce_gbps`...
    pub name: String,
    pub value: f64,
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub check: String,
    /// The GPU index, when the failure is one GPU's.
    pub gpu: Option<u32>,
    pub reason: String,
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ValidationVerdict {
    pub passed: bool,
    pub failures: Vec<Failure>,
}

/// `POST /api/v1/agent/heartbeat`, with the boot token as bearer.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatRequest {
    pub boot_id: String,
    pub mac: Mac,
    /// What the node runs now; compared with the attested baseline when the node is ready.
    #[serde(default)]
    pub facts: Option<NodeFacts>,
    /// Each GPU's readings now, for the server's metrics (`/metrics/gpus`) and its health
    /// rules (`[health]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<GpuSample>,
    /// Each InfiniBand port's readings now (from sysfs), for the health rules.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ib_ports: Vec<IbPortSample>,
}

/// The most XID codes a sample carries (`GpuSample::recent_xids`).
pub const RECENT_XIDS: usize = 16;

/// An InfiniBand GUID, whatever its spelling: smpquery's `0x0000000000200001`, sysfs's
/// `506b:4b03:005c:2a18`, the wire's `0x` and 16 hex digits.
pub fn ib_guid(text: &str) -> Option<u64> {
    let hex = text.trim().trim_start_matches("0x").replace(':', "");
    u64::from_str_radix(&hex, 16).ok()
}

/// A PCI address as `bus:device`, whatever its spelling: NVML's `00000000:3B:00.0` and
/// the kernel log's `0000:3b:00` name one GPU.
pub fn pci_bus_key(id: &str) -> String {
    let id = id.to_ascii_lowercase();
    let id = id.strip_suffix(".0").unwrap_or(&id);
    let parts: Vec<&str> = id.split(':').collect();
    match parts.as_slice() {
        [.., bus, dev] => format!("{bus}:{dev}"),
        _ => id.to_string(),
    }
}

/// One GPU's readings in a heartbeat: what dcgm-exporter would show of it. Every reading
/// is optional (a failed query leaves it out); unknown fields are accepted, for newer
/// agents.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GpuSample {
    pub index: u32,
    pub uuid: String,
    /// The model, as NVML names it (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    pub pci_bus_id: Option<String>,
    pub temperature_c: Option<u32>,
    pub power_w: Option<f64>,
    pub ecc: Option<EccCounts>,
    /// XIDs the kernel logged for this GPU since the node booted.
    pub xids: u64,
    /// The codes of the newest of those XIDs, oldest first (at most `RECENT_XIDS`): the
    /// server takes the ones past the count it saw last as new.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub recent_xids: Vec<u32>,
    /// The SM clock now and its maximum, MHz.
    pub sm_clock_mhz: Option<u32>,
    pub sm_clock_max_mhz: Option<u32>,
    /// Why the clocks are held down now, NVML's names (`HW_THERMAL_SLOWDOWN`,
    /// `SW_THERMAL_SLOWDOWN`, `SW_POWER_CAP`...); None when it could not be read.
    pub throttle_reasons: Option<Vec<String>>,
    pub row_remap: Option<RowRemap>,
    /// PCIe replays since the driver loaded.
    pub pcie_replay: Option<u64>,
    /// NVLink errors summed over the GPU's links (CRC flit, CRC data, replay, recovery).
    pub nvlink_errors: Option<u64>,
    /// Readings that could not be taken, by name (`sm_clock`, `ecc`, `throttle_reasons`,
    /// ...): never healthy by default.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<String>,
}

/// One InfiniBand port as sysfs shows it (`/sys/class/infiniband/DEV/ports/N`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct IbPortSample {
    /// `mlx5_0/1`: the device and the port number.
    pub port: String,
    /// `ACTIVE`, `DOWN`, `INIT`... (the word of `state`).
    pub state: Option<String>,
    /// The link rate, Gb/s.
    pub rate_gbps: Option<f64>,
    /// The link width (`4X`), from the rate's text (`400 Gb/sec (4X NDR)`).
    pub width: Option<String>,
    /// `counters/link_downed`: times the link went down (since the driver loaded).
    pub link_downed: Option<u64>,
    pub symbol_errors: Option<u64>,
    pub link_error_recovery: Option<u64>,
    pub rcv_errors: Option<u64>,
    /// Readings that could not be taken, by name.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<String>,
    /// The HCA's node GUID (`0x` and 16 hex digits), from sysfs `node_guid`: what the
    /// declared topology knows the node's ports by. Reported at validation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_guid: Option<String>,
    /// The node at the other end of the cable, as a directed-route SMP found it
    /// (`bootfleet-agent --ib-peers`); at validation only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer: Option<IbPeer>,
}

/// The far end of an InfiniBand port's cable.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IbPeer {
    /// Its node GUID, `0x` and 16 hex digits.
    pub guid: String,
    /// Its port the cable reaches.
    pub port: u32,
    /// Its node description (a switch's name), when it answered one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// What the agent reports with each heartbeat (all optional: an agent may send less).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeFacts {
    pub kernel_release: Option<String>,
    pub cmdline: Option<String>,
    /// Versions by pin name (`nvidia-driver`, `ofed`...).
    #[serde(default)]
    pub versions: BTreeMap<String, String>,
    /// Loaded kernel modules and their versions (`nvidia` -> `550.127.05`); empty when
    /// not reported, as when `modules_sha256` stands for them.
    #[serde(default)]
    pub modules: BTreeMap<String, String>,
    /// The digest of the node's module list (`modules_digest`), sent instead of the list
    /// while it is the one the last answer named (`HeartbeatAnswer::baseline_modules_sha256`):
    /// a GPU server's list is some 5 KB, and it rarely changes within a boot. Another
    /// digest is not a drift: the answer names the baseline's, and the agent sends its
    /// list next, which names what differs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modules_sha256: Option<Digest>,
    /// UUIDs of the GPUs visible now; None when not reported.
    pub gpus: Option<Vec<String>>,
}

/// A module list's digest, the same on both sides: SHA-256 of its compact JSON object,
/// keys in byte order (as a `BTreeMap` writes them), strings escaped as serde_json
/// escapes them (`{"nvidia":"550.127.05"}`). An agent in another language that writes it
/// otherwise is never told "unchanged", and keeps sending its list.
pub fn modules_digest(modules: &BTreeMap<String, String>) -> Digest {
    Digest::of(&serde_json::to_vec(modules).expect("a map of strings is JSON"))
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Difference {
    pub field: String,
    pub was: String,
    pub now: String,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: was {}, now {}", self.field, self.was, self.now)
    }
}

/// What the node is to do next, in a heartbeat's answer.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NextAction {
    None,
    /// Run the validation again and post it (asked by an admin, or after a silence).
    Revalidate,
    /// Reboot now: a reimage was requested (on a stateless node, a reboot is a reimage).
    Reboot,
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HeartbeatAnswer {
    pub action: NextAction,
    /// What differs from the attested baseline, when anything does.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drift: Vec<Difference>,
    /// The digest (`modules_digest`) of the module list this boot's heartbeats are
    /// compared with; absent before there is one. While its own list has this digest, the
    /// agent may send the digest alone (`NodeFacts::modules_sha256`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_modules_sha256: Option<Digest>,
}

/// The qualifying data a boot's quote carries: SHA-256("bootfleet-quote\0" ‖ secret ‖
/// boot id), bound to the secret only the enrolled TPM could recover and to the boot.
pub fn tpm_nonce(secret: &[u8], boot_id: &str) -> [u8; 32] {
    use sha2::{Digest as _, Sha256};
    let mut h = Sha256::new();
    h.update(b"bootfleet-quote\0");
    h.update(secret);
    h.update(boot_id.as_bytes());
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    /// The encoding is part of the contract: servers of two versions, or an agent of
    /// another, must agree on it.
    #[test]
    fn a_module_lists_digest_is_fixed() {
        let list = [("nvidia".to_string(), "550.127.05".to_string())].into();
        assert_eq!(
            super::modules_digest(&list).to_string(),
            "sha256:fcc5db880ea853f83c62d00b2caf5660f90cfcc81f4e9abd31017e370d842a01"
        );
    }
}
