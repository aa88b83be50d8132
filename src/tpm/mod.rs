//! TPM-rooted attestation: a node's TPM 2.0 proves which boot chain ran, and the server
//! checks it against what the boot was given. The endorsement key (EK) is enrolled with
//! the node; each boot gets a credential only that TPM can open (`credential`), answers
//! with a quote signed by an attestation key bound to it, with the firmware's event log
//! (`eventlog`); `verify` checks the quote and the log and names the PCR and digest of
//! anything the boot was not given. Pure apart from reading the CA files and the iPXE
//! binaries at start (`Trust::load`); the node service stores and decides.

pub mod credential;
pub mod ekcert;
pub mod eventlog;
pub mod verify;
pub mod wire;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use wire::{Public, alg, attr};

/// Whether a node's boot must bring TPM evidence (`[tpm] policy`, or the node's `tpm`
/// label, which wins).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TpmPolicy {
    /// Evidence is not asked for, and ignored.
    Off,
    /// Evidence is checked when the node sends it; a node without a TPM attests as
    /// before.
    #[default]
    Preferred,
    /// A boot without valid evidence fails attestation.
    Required,
}

impl TpmPolicy {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "off" => Some(Self::Off),
            "preferred" => Some(Self::Preferred),
            "required" => Some(Self::Required),
            _ => None,
        }
    }
}

/// The node label that sets a node's policy over `[tpm] policy`.
pub const POLICY_LABEL: &str = "tpm";

/// How a node's EK comes to be enrolled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Enrolment {
    /// At its first TPM challenge (its certificate checked when CAs are configured).
    #[default]
    FirstSeen,
    /// Only as an operator registered it (`bootfleet node tpm enrol`): a node with no
    /// registered EK is refused its challenge.
    PreRegistered,
}

/// `[tpm]` in the server's configuration.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TpmSettings {
    #[serde(default)]
    pub policy: TpmPolicy,
    #[serde(default)]
    pub enrolment: Enrolment,
    /// PEM files of the CAs that EK certificates must chain to. Empty: EKs are enrolled
    /// on first sight without a certificate check (trust on first use).
    #[serde(default)]
    pub ek_ca_files: Vec<PathBuf>,
}

/// What this server checks TPM evidence with: the policy, the EK CAs, the iPXE binaries
/// it serves and the Authenticode digests of the kernels it has been asked about.
pub struct Trust {
    pub policy: TpmPolicy,
    pub enrolment: Enrolment,
    /// None: EKs are trusted on first use.
    pub roots: Option<ekcert::EkRoots>,
    /// The EFI binaries in the TFTP directory (iPXE's; shim and GRUB's for Secure Boot),
    /// each a boot loader firmware may load.
    pub loaders: Vec<verify::Loadable>,
    /// Kernels' Authenticode digests by their blob's SHA-256 (blobs never change).
    kernels:
        std::sync::Mutex<std::collections::BTreeMap<crate::api::Digest, Result<[u8; 32], String>>>,
}

impl Trust {
    /// Reads `[tpm]`'s CA files and digests every `*.efi` in `ipxe_dir` (a missing
    /// directory gives no loaders: TPM boots then fail naming the loader's digest).
    pub fn load(settings: &TpmSettings, ipxe_dir: &std::path::Path) -> anyhow::Result<Self> {
        let roots = match settings.ek_ca_files.is_empty() {
            true => None,
            false => Some(ekcert::EkRoots::load(&settings.ek_ca_files)?),
        };
        let mut loaders = Vec::new();
        if let Ok(dir) = std::fs::read_dir(ipxe_dir) {
            let mut files: Vec<_> = dir.flatten().map(|e| e.path()).collect();
            files.sort();
            for path in files
                .iter()
                .filter(|p| p.extension().is_some_and(|e| e == "efi"))
            {
                let bytes = std::fs::read(path)?;
                match authenticode_sha256(&bytes) {
                    Ok(digest) => loaders.push(verify::Loadable {
                        // iPXE's binaries, or shim and GRUB for Secure Boot nodes.
                        name: path
                            .file_name()
                            .unwrap_or_default()
                            .to_string_lossy()
                            .into_owned(),
                        digest,
                        is_kernel: false,
                    }),
                    Err(e) => {
                        tracing::warn!(file = %path.display(), error = %e, "an iPXE EFI binary without an Authenticode digest: TPM boots through it will fail")
                    }
                }
            }
        }
        Ok(Trust {
            policy: settings.policy,
            enrolment: settings.enrolment,
            roots,
            loaders,
            kernels: Default::default(),
        })
    }

    /// A kernel's Authenticode digest, computed from `bytes` (read only when this blob
    /// was not asked about before).
    pub fn kernel_digest(
        &self,
        blob: crate::api::Digest,
        bytes: impl FnOnce() -> Result<Vec<u8>, String>,
    ) -> Result<[u8; 32], String> {
        if let Some(known) = self.kernels.lock().expect("not poisoned").get(&blob) {
            return known.clone();
        }
        let digest = bytes().and_then(|b| authenticode_sha256(&b));
        let mut cache = self.kernels.lock().expect("not poisoned");
        if cache.len() >= 256 {
            cache.clear(); // a fleet boots a handful of kernels at a time
        }
        cache.insert(blob, digest.clone());
        digest
    }
}

/// An EK as the TCG's default templates make it: a restricted, fixed RSA-2048
/// decryption key with AES-128-CFB, usable only under its policy.
pub fn check_ek(ek: &Public) -> Result<(), String> {
    let wanted = attr::FIXED_TPM
        | attr::FIXED_PARENT
        | attr::SENSITIVE_DATA_ORIGIN
        | attr::ADMIN_WITH_POLICY
        | attr::RESTRICTED
        | attr::DECRYPT;
    if ek.attributes & wanted != wanted || ek.attributes & attr::SIGN != 0 {
        return Err(format!(
            "the EK's attributes 0x{:08x} are not a restricted, fixed decryption key's",
            ek.attributes
        ));
    }
    if ek.key_bits < 2048 || ek.modulus.len() * 8 != ek.key_bits as usize {
        return Err(format!(
            "the EK is RSA-{}, not RSA-2048 or more",
            ek.key_bits
        ));
    }
    Ok(())
}

/// An AK fit to quote: restricted (it signs only what the TPM itself made), fixed to
/// its TPM, generated inside it, RSASSA with SHA-256 and at least 2048 bits (as
/// go-attestation and Keylime require).
pub fn check_ak(ak: &Public) -> Result<(), String> {
    let wanted = attr::FIXED_TPM
        | attr::FIXED_PARENT
        | attr::SENSITIVE_DATA_ORIGIN
        | attr::RESTRICTED
        | attr::SIGN;
    if ak.attributes & wanted != wanted || ak.attributes & attr::DECRYPT != 0 {
        return Err(format!(
            "the AK's attributes 0x{:08x} are not a restricted, fixed signing key's",
            ak.attributes
        ));
    }
    if ak.scheme != Some((alg::RSASSA, alg::SHA256)) {
        return Err("the AK does not sign with RSASSA and SHA-256".into());
    }
    if ak.key_bits < 2048 || ak.modulus.len() * 8 != ak.key_bits as usize {
        return Err(format!(
            "the AK is RSA-{}, not RSA-2048 or more",
            ak.key_bits
        ));
    }
    Ok(())
}

/// The PE/Authenticode SHA-256 of an EFI binary: what UEFI firmware measures into PCR 4
/// when it loads one (iPXE, a kernel with an EFI stub).
pub fn authenticode_sha256(pe: &[u8]) -> Result<[u8; 32], String> {
    use sha2::Digest as _;
    let file =
        object::read::pe::PeFile64::parse(pe).map_err(|e| format!("not a 64-bit PE image: {e}"))?;
    let mut h = sha2::Sha256::new();
    authenticode::authenticode_digest(&file, &mut h)
        .map_err(|_| "its PE offsets are out of bounds".to_string())?;
    Ok(h.finalize().into())
}
