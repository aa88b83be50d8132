//! The node's TPM 2.0, driven through tpm2-tools (Debian's `tpm2-tools`, in the image):
//! the endorsement key and its certificate, an attestation key made under it, the
//! credential the server sent opened (ActivateCredential), and a quote of the boot PCRs.
//! tpm2-tools rather than a Rust TSS: it is the TCG stack every distribution ships and
//! audits, and the server, not the node, is where the checking happens.
//!
//! Each step flushes transient objects afterwards: a TPM reached without the kernel's
//! resource manager (swtpm's socket in the tests) holds only three.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The TPM device itself, not the kernel's resource manager (`/dev/tpmrm0`): the RM
/// flushes a connection's sessions when it closes, and the EK's policy session must
/// outlive the tool that started it. The agent is the TPM's only user while it attests.
pub const DEVICE_TCTI: &str = "device:/dev/tpm0";
/// The firmware's measured-boot log, as Linux exposes it (securityfs).
pub const EVENT_LOG: &str = "sys/kernel/security/tpm0/binary_bios_measurements";

pub struct Tpm {
    tcti: String,
    work: PathBuf,
}

/// The TPM's keys, as the challenge sends them.
pub struct Keys {
    pub ek_public: Vec<u8>,
    pub ek_certificate: Option<Vec<u8>>,
    pub ak_public: Vec<u8>,
}

pub struct Quote {
    pub attest: Vec<u8>,
    pub signature: Vec<u8>,
    pub pcrs: BTreeMap<u8, [u8; 32]>,
}

impl Tpm {
    /// A TPM reached through `tcti`, with its key files in a new directory under `work`.
    pub fn new(tcti: &str, work: &Path) -> Result<Self, String> {
        let work = work.join(format!("bootfleet-tpm-{}", std::process::id()));
        std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
        Ok(Tpm {
            tcti: tcti.to_string(),
            work,
        })
    }

    fn run(&self, tool: &str, args: &[&str]) -> Result<Vec<u8>, String> {
        let out = Command::new(tool)
            .args(args)
            .current_dir(&self.work)
            .env("TPM2TOOLS_TCTI", &self.tcti)
            .output()
            .map_err(|e| format!("{tool}: {e} (apt-get install tpm2-tools)"))?;
        // Best effort: nothing may be loaded, and that is fine.
        let _ = Command::new("tpm2_flushcontext")
            .arg("-t")
            .current_dir(&self.work)
            .env("TPM2TOOLS_TCTI", &self.tcti)
            .output();
        if !out.status.success() {
            return Err(format!(
                "{tool} {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(out.stdout)
    }

    fn read(&self, name: &str) -> Result<Vec<u8>, String> {
        std::fs::read(self.work.join(name)).map_err(|e| format!("{name}: {e}"))
    }

    /// The EK (created from the TCG default RSA template, the same key every time),
    /// its certificate where the TPM has one, and a new AK under the EK.
    pub fn keys(&self) -> Result<Keys, String> {
        self.run(
            "tpm2_createek",
            &["-c", "ek.ctx", "-G", "rsa", "-u", "ek.pub", "-f", "tss"],
        )?;
        // The RSA EK certificate's NV index (TCG EK Credential Profile); absent on many
        // TPMs, which is for the server's policy to judge.
        let ek_certificate = self
            .run("tpm2_nvread", &["0x01c00002", "-o", "ek.der"])
            .ok()
            .and_then(|_| self.read("ek.der").ok());
        self.run(
            "tpm2_createak",
            &[
                "-C", "ek.ctx", "-c", "ak.ctx", "-G", "rsa", "-g", "sha256", "-s", "rsassa", "-u",
                "ak.pub", "-n", "ak.name", "-f", "tss",
            ],
        )?;
        Ok(Keys {
            ek_public: self.read("ek.pub")?,
            ek_certificate,
            ak_public: self.read("ak.pub")?,
        })
    }

    /// Opens the credential (tpm2-tools' blob) with the EK, for the AK: the secret.
    pub fn activate(&self, credential: &[u8]) -> Result<Vec<u8>, String> {
        std::fs::write(self.work.join("cred.blob"), credential)
            .map_err(|e| format!("cred.blob: {e}"))?;
        // The EK is usable only under its policy: a policy session that satisfied
        // PolicySecret(endorsement hierarchy), in one invocation so that it is not lost
        // between tools.
        let script = "tpm2_startauthsession --policy-session -S s.ctx \
            && tpm2_policysecret -S s.ctx -c e >/dev/null \
            && tpm2_activatecredential -c ak.ctx -C ek.ctx -i cred.blob -o secret.out -P session:s.ctx; \
            rc=$?; tpm2_flushcontext s.ctx 2>/dev/null; exit $rc";
        self.run("sh", &["-c", script])?;
        self.read("secret.out")
    }

    /// Quotes the SHA-256 `pcrs` with `nonce`, and reads their values.
    pub fn quote(&self, nonce: &[u8; 32], pcrs: &[u8]) -> Result<Quote, String> {
        let list: Vec<String> = pcrs.iter().map(u8::to_string).collect();
        let selection = format!("sha256:{}", list.join(","));
        let nonce = hex::encode(nonce);
        self.run(
            "tpm2_quote",
            &[
                "-c",
                "ak.ctx",
                "-l",
                &selection,
                "-q",
                &nonce,
                "-m",
                "quote.msg",
                "-s",
                "quote.sig",
                "-g",
                "sha256",
            ],
        )?;
        let text = self.run("tpm2_pcrread", &[&selection])?;
        Ok(Quote {
            attest: self.read("quote.msg")?,
            signature: self.read("quote.sig")?,
            pcrs: parse_pcrread(&String::from_utf8_lossy(&text))?,
        })
    }
}

impl Drop for Tpm {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.work);
    }
}

/// Mounts securityfs at /sys/kernel/security, where the kernel shows the event log
/// (an initramfs's /init may not have); a failure is left to the log's read to report.
pub fn mount_securityfs() {
    let target = c"/sys/kernel/security";
    let fs = c"securityfs";
    // SAFETY: NUL-terminated constants; no data argument.
    let rc = unsafe {
        libc::mount(
            fs.as_ptr(),
            target.as_ptr(),
            fs.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        eprintln!(
            "bootfleet-agent: tpm: mount securityfs: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// `tpm2_pcrread`'s SHA-256 lines: `  4 : 0x<64 hex>`.
fn parse_pcrread(text: &str) -> Result<BTreeMap<u8, [u8; 32]>, String> {
    let mut pcrs = BTreeMap::new();
    for line in text.lines() {
        let Some((index, value)) = line.split_once(':') else {
            continue;
        };
        let (Ok(index), Some(value)) = (
            index.trim().parse::<u8>(),
            value
                .trim()
                .strip_prefix("0x")
                .and_then(|v| hex::decode(v).ok()),
        ) else {
            continue;
        };
        let value: [u8; 32] = value
            .try_into()
            .map_err(|_| format!("PCR {index}: not a SHA-256 value"))?;
        pcrs.insert(index, value);
    }
    Ok(pcrs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pcrread_output_is_read_per_index() {
        let text = "  sha256:\n    0 : 0x00000000000000000000000000000000000000000000000000000000000000AA\n    9 : 0x0100000000000000000000000000000000000000000000000000000000000000\n";
        let pcrs = parse_pcrread(text).unwrap();
        assert_eq!(pcrs.len(), 2);
        assert_eq!(pcrs[&0][31], 0xaa);
        assert_eq!(pcrs[&9][0], 1);
        assert!(parse_pcrread("    4 : 0x00ff\n").is_err());
    }
}
