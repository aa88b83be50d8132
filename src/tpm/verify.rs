//! Verifies one boot's TPM evidence, pure: the quote's signature by the boot's
//! attestation key, its nonce, the PCR values it covers, the event log replayed to
//! them, and what the firmware measured into PCR 4 against what the boot was given.
//! Every failure is a named mismatch; what matched is kept for the node's page.

use std::collections::BTreeMap;

use sha2::{Digest as _, Sha256};

pub use crate::api::agent::tpm_nonce as nonce;

use super::eventlog::{self, kind};
use super::wire::{Public, Quote, alg, rsassa_signature};
use crate::api::agent::{Mismatch, TpmFindings, TpmMeasurement};

/// The PCRs every quote must cover: firmware (0–7) and the Linux EFI stub's (9).
pub const QUOTED_PCRS: [u8; 9] = [0, 1, 2, 3, 4, 5, 6, 7, 9];

/// What the firmware may load for this boot, by Authenticode SHA-256.
#[derive(Debug, Clone)]
pub struct Loadable {
    /// What a person calls it: "snponly.efi", "kernel vmlinuz".
    pub name: String,
    pub digest: [u8; 32],
    /// The image's kernel: the one application that must be measured.
    pub is_kernel: bool,
}

/// One boot's evidence, as the agent sent it.
pub struct Evidence<'a> {
    pub attest: &'a [u8],
    pub signature: &'a [u8],
    pub pcrs: &'a BTreeMap<u8, [u8; 32]>,
    pub event_log: &'a [u8],
}

/// What the evidence must show.
pub struct Expected<'a> {
    /// The attestation key the boot's challenge was made for.
    pub ak: &'a Public,
    pub nonce: [u8; 32],
    pub loadable: &'a [Loadable],
}

pub fn verify(
    evidence: &Evidence<'_>,
    expected: &Expected<'_>,
    ek_name: &[u8],
) -> (TpmFindings, Vec<Mismatch>) {
    let mut mismatches = Vec::new();
    let mut findings = TpmFindings {
        ek_name: hex::encode(ek_name),
        pcrs: evidence
            .pcrs
            .iter()
            .map(|(i, v)| (*i, hex::encode(v)))
            .collect(),
        measurements: Vec::new(),
    };
    // 1. Signed by the AK the TPM proved it holds; everything after rests on this.
    if let Err(why) = signed(evidence, expected.ak) {
        mismatches.push(miss(
            "tpm.quote",
            "a quote signed by the attestation key bound to the node's EK".into(),
            why,
        ));
        return (findings, mismatches);
    }
    let quote = match Quote::parse(evidence.attest) {
        Ok(q) => q,
        Err(e) => {
            mismatches.push(miss("tpm.quote", "a TPM2 quote".into(), e.to_string()));
            return (findings, mismatches);
        }
    };
    // 2. Fresh: this boot's nonce, not an old quote's.
    if quote.extra_data != expected.nonce {
        mismatches.push(miss(
            "tpm.nonce",
            format!("this boot's challenge {}", hex::encode(expected.nonce)),
            format!(
                "{} (a replayed or another boot's quote)",
                hex::encode(&quote.extra_data)
            ),
        ));
        return (findings, mismatches);
    }
    // 3. The PCR values reported are the ones quoted.
    let selected: Vec<u8> = quote
        .selection
        .iter()
        .filter(|(h, _)| *h == alg::SHA256)
        .flat_map(|(_, p)| p.iter().copied())
        .collect();
    if quote.selection.len() != 1 || QUOTED_PCRS.iter().any(|p| !selected.contains(p)) {
        mismatches.push(miss(
            "tpm.pcrs",
            format!("SHA-256 PCRs {QUOTED_PCRS:?} quoted"),
            format!("{:?}", quote.selection),
        ));
        return (findings, mismatches);
    }
    let mut h = Sha256::new();
    for p in &selected {
        match evidence.pcrs.get(p) {
            Some(v) => h.update(v),
            None => {
                mismatches.push(miss(
                    "tpm.pcrs",
                    format!("PCR {p}'s value"),
                    "(not reported)".into(),
                ));
                return (findings, mismatches);
            }
        }
    }
    if h.finalize()[..] != quote.pcr_digest[..] {
        mismatches.push(miss(
            "tpm.pcrs",
            "the PCR values the quote signed".into(),
            "other values reported beside it".into(),
        ));
        return (findings, mismatches);
    }
    findings.pcrs.retain(|p, _| selected.contains(p));
    // 4. The event log replays to the quoted values, PCR by PCR.
    let events = match eventlog::parse(evidence.event_log) {
        Ok(e) => e,
        Err(e) => {
            mismatches.push(miss(
                "tpm.eventlog",
                "a crypto-agile TCG event log".into(),
                e.to_string(),
            ));
            return (findings, mismatches);
        }
    };
    let replayed = eventlog::replay(&events);
    for p in &selected {
        let quoted = evidence.pcrs[p];
        let got = replayed.get(&u32::from(*p)).copied().unwrap_or([0; 32]);
        if got != quoted {
            mismatches.push(miss(
                &format!("tpm.pcr{p}"),
                format!("the quoted value {}", hex::encode(quoted)),
                format!("the event log replays to {}", hex::encode(got)),
            ));
        }
    }
    if !mismatches.is_empty() {
        return (findings, mismatches);
    }
    // 5. What the firmware loaded: only what this boot was given, ending in its kernel.
    let apps: Vec<[u8; 32]> = events
        .iter()
        .filter(|e| e.pcr == 4 && e.kind == kind::EFI_BOOT_SERVICES_APPLICATION)
        .filter_map(|e| e.sha256)
        .collect();
    let known = |d: &[u8; 32]| expected.loadable.iter().find(|l| l.digest == *d);
    let allowed = || {
        expected
            .loadable
            .iter()
            .map(|l| format!("{} sha256:{}", l.name, hex::encode(l.digest)))
            .collect::<Vec<_>>()
            .join(" or ")
    };
    for d in &apps {
        let matched = known(d);
        findings.measurements.push(TpmMeasurement {
            pcr: 4,
            event: "EV_EFI_BOOT_SERVICES_APPLICATION".into(),
            digest: format!("sha256:{}", hex::encode(d)),
            matched: matched.map(|l| l.name.clone()),
        });
        if matched.is_none() {
            mismatches.push(miss(
                "tpm.pcr4",
                allowed(),
                format!(
                    "sha256:{} (EV_EFI_BOOT_SERVICES_APPLICATION)",
                    hex::encode(d)
                ),
            ));
        }
    }
    let kernel = expected.loadable.iter().find(|l| l.is_kernel);
    let last_is_kernel = apps.last().and_then(known).is_some_and(|l| l.is_kernel);
    if let Some(kernel) = kernel
        && !last_is_kernel
        && mismatches.is_empty()
    {
        mismatches.push(miss(
            "tpm.pcr4",
            format!(
                "{} sha256:{} loaded last",
                kernel.name,
                hex::encode(kernel.digest)
            ),
            match apps.last() {
                Some(d) => format!("sha256:{} loaded last", hex::encode(d)),
                None => "(no EFI application measured: not a UEFI measured boot)".into(),
            },
        ));
    }
    (findings, mismatches)
}

fn miss(field: &str, expected: String, found: String) -> Mismatch {
    Mismatch {
        field: field.into(),
        expected,
        found,
    }
}

/// Whether the signature over the exact attest bytes is the AK's (RSASSA, SHA-256).
fn signed(evidence: &Evidence<'_>, ak: &Public) -> Result<(), String> {
    let (hash, sig) = rsassa_signature(evidence.signature).map_err(|e| e.to_string())?;
    if hash != alg::SHA256 {
        return Err(format!("signature hash 0x{hash:04x}, not SHA-256"));
    }
    let key = ring::signature::UnparsedPublicKey::new(
        &ring::signature::RSA_PKCS1_2048_8192_SHA256,
        ak.rsa_public_key_der(),
    );
    key.verify(evidence.attest, &sig)
        .map_err(|_| "the signature does not verify with the attestation key".to_string())
}
