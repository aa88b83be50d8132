//! The quote-verification benchmark: a real TPM (swtpm, through the agent's tpm2-tools
//! path) measures an OVMF-sized boot log and quotes it once; the server's verification
//! of that evidence (signature, nonce, PCR digest, log replay, PCR 4 policy) then runs
//! over and over on one thread.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;
use sha2::{Digest as _, Sha256};

use crate::tpm::eventlog::{self, kind};
use crate::tpm::verify::{self, Loadable};
use crate::tpm::wire::Public;

#[derive(Debug, Serialize)]
pub struct QuoteBench {
    pub events: usize,
    pub log_bytes: usize,
    pub verified: u64,
    pub seconds: f64,
    pub per_second: f64,
    pub micros_each: f64,
    /// Every verification passed (a benchmark of a failing check measures nothing).
    pub passed: bool,
}

impl std::fmt::Display for QuoteBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "quote verification, one thread: {} in {:.2} s = {:.0}/s ({:.1} µs each); \
             log of {} events, {} bytes; all passed: {}",
            self.verified,
            self.seconds,
            self.per_second,
            self.micros_each,
            self.events,
            self.log_bytes,
            self.passed
        )
    }
}

/// An event log the size of a real OVMF network boot's (about 40 events, 4 KB):
/// firmware blobs, boot variables, separators, iPXE and the kernel twice in PCR 4.
fn ovmf_sized_log(ipxe: [u8; 32], kernel: [u8; 32]) -> Vec<(u32, u32, [u8; 32], Vec<u8>)> {
    let h = |b: &[u8]| -> [u8; 32] { Sha256::digest(b).into() };
    const EV_EFI_VARIABLE_BOOT: u32 = 0x8000_0002;
    const EV_EFI_PLATFORM_FIRMWARE_BLOB: u32 = 0x8000_0008;
    const EV_EFI_VARIABLE_DRIVER_CONFIG: u32 = 0x8000_0001;
    let mut log = Vec::new();
    for i in 0..2u8 {
        log.push((0, EV_EFI_PLATFORM_FIRMWARE_BLOB, h(&[i; 16]), vec![i; 16]));
    }
    for i in 0..8u8 {
        log.push((1, EV_EFI_VARIABLE_BOOT, h(&[i; 96]), vec![i; 96]));
    }
    for i in 0..5u8 {
        log.push((7, EV_EFI_VARIABLE_DRIVER_CONFIG, h(&[i; 64]), vec![i; 64]));
    }
    let action = b"Calling EFI Application from Boot Option".to_vec();
    for _ in 0..3 {
        log.push((4, kind::EFI_ACTION, h(&action), action.clone()));
    }
    for pcr in 0..8 {
        log.push((pcr, kind::SEPARATOR, h(&[0; 4]), vec![0; 4]));
    }
    for app in [ipxe, kernel, kernel] {
        log.push((4, kind::EFI_BOOT_SERVICES_APPLICATION, app, vec![0x42; 120]));
    }
    let exit = b"Exit Boot Services Invocation".to_vec();
    log.push((5, kind::EFI_ACTION, h(&exit), exit));
    log.push((9, 0x6, h(b"vmlinuz console=ttyS0"), vec![0x17; 80]));
    log
}

/// Measures the log into the TPM at `tcti`, quotes it, then verifies for `duration`.
pub fn run(tcti: &str, duration: Duration) -> anyhow::Result<QuoteBench> {
    use bootfleet_agent::tpm::Tpm;
    let (ipxe, kernel) = ([0x11; 32], [0x22; 32]);
    let log = ovmf_sized_log(ipxe, kernel);
    for (pcr, _, digest, _) in &log {
        let out = std::process::Command::new("tpm2_pcrextend")
            .arg(format!("{pcr}:sha256={}", hex::encode(digest)))
            .env("TPM2TOOLS_TCTI", tcti)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "tpm2_pcrextend: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let events: Vec<(u32, u32, [u8; 32], &[u8])> = log
        .iter()
        .map(|(p, k, d, data)| (*p, *k, *d, data.as_slice()))
        .collect();
    let log_bytes = eventlog::write(&events);
    // Its files live in a directory of its own, removed when it is dropped.
    let tpm = Tpm::new(tcti, &std::env::temp_dir()).map_err(anyhow::Error::msg)?;
    let keys = tpm.keys().map_err(anyhow::Error::msg)?;
    let nonce = verify::nonce(b"bench secret", "bench-boot");
    let quote = tpm
        .quote(&nonce, &verify::QUOTED_PCRS)
        .map_err(anyhow::Error::msg)?;
    let ak = Public::from_tpm2b(&keys.ak_public)?;
    let loadable = [
        Loadable {
            name: "iPXE".into(),
            digest: ipxe,
            is_kernel: false,
        },
        Loadable {
            name: "kernel".into(),
            digest: kernel,
            is_kernel: true,
        },
    ];
    let pcrs: BTreeMap<u8, [u8; 32]> = quote.pcrs.clone();
    let evidence = verify::Evidence {
        attest: &quote.attest,
        signature: &quote.signature,
        pcrs: &pcrs,
        event_log: &log_bytes,
    };
    let expected = verify::Expected {
        ak: &ak,
        nonce,
        loadable: &loadable,
    };
    let start = Instant::now();
    let (mut verified, mut passed) = (0u64, true);
    while start.elapsed() < duration {
        for _ in 0..100 {
            let (_, mismatches) = verify::verify(&evidence, &expected, b"ek");
            passed &= mismatches.is_empty();
            verified += 1;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(QuoteBench {
        events: log.len(),
        log_bytes: log_bytes.len(),
        verified,
        seconds,
        per_second: verified as f64 / seconds,
        micros_each: seconds * 1e6 / verified as f64,
        passed,
    })
}
