//! The attestation endpoint's logic: the token must be this boot's (compared in constant
//! time, newest boot only, within its lifetime), the report must be for the node that
//! booted; then the pure judgement, the stored verdict and the state change. A boot is
//! judged once: a retry gets the stored verdict.

use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq;

use super::{BootError, NodeService};
use crate::api::Digest;

use crate::api::Mac;
use crate::api::agent::{AttestRequest, Verdict};
use crate::api::image::Role;
use crate::node::attest::{Expected, Received, judge};
use crate::node::controller::ControlError;
use crate::node::state::NodeEvent;
use crate::store::Attached;

/// How long a boot token may be used to attest.
pub const TOKEN_LIFETIME_MS: i64 = 24 * 3600 * 1000;

/// Why an agent call was refused before any judgement. Each is logged as a security
/// event and recorded in the event log.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refusal {
    #[error("the boot token is not valid for this boot")]
    BadToken,
    #[error("the boot token has expired")]
    Expired,
    #[error("this boot has not passed attestation; validation and heartbeats come after it")]
    NotAttested,
    #[error("a boot's overlay is served to its stage 1 only, before the boot attests")]
    OverlayAfterAttest,
    #[error("TPM: {0}")]
    Tpm(String),
    #[error("the report names node {claimed}, but boot {boot_id} belongs to {actual}")]
    OtherNode {
        claimed: Mac,
        actual: Mac,
        boot_id: String,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum AttestError {
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// Authentic, but the node's state does not allow it now.
    #[error("{0}")]
    NotNow(String),
    #[error(transparent)]
    Boot(#[from] BootError),
}

/// An agent call's caller, authenticated from its token: the boot the token belongs to.
#[derive(Debug)]
pub struct Caller {
    boot_id: String,
    boot: crate::store::BootForAttest,
}

impl Caller {
    /// The boot the caller's token belongs to.
    pub fn boot(&self) -> &crate::store::BootForAttest {
        &self.boot
    }
}

static UNKNOWN_TOKENS: crate::node::sampled::Sampled =
    crate::node::sampled::Sampled::new("agent calls refused: boot token unknown");

/// Counts a refused unknown token (logged as a count, never as an event row).
fn unknown_token() -> AttestError {
    UNKNOWN_TOKENS.note();
    Refusal::BadToken.into()
}

impl From<crate::store::StoreError> for AttestError {
    fn from(e: crate::store::StoreError) -> Self {
        AttestError::Boot(e.into())
    }
}

impl NodeService {
    pub async fn attest(
        &self,
        caller: &Caller,
        req: &AttestRequest,
    ) -> Result<Verdict, AttestError> {
        let result = self.attest_inner(caller, req).await;
        self.noted("attest", &req.boot_id, &req.mac, result).await
    }

    /// Passes an agent call's result on, logging and recording a refusal as an event
    /// first (a recording failure is logged: the caller is refused either way).
    pub(super) async fn noted<T>(
        &self,
        route: &str,
        boot_id: &str,
        mac: &Mac,
        result: Result<T, AttestError>,
    ) -> Result<T, AttestError> {
        let Err(AttestError::Refused(refusal)) = &result else {
            return result;
        };
        tracing::warn!(security = true, route, boot = %boot_id, %mac, %refusal, "agent report refused");
        // The boot id is the caller's claim: keep it short in the log.
        let boot: String = boot_id.chars().take(64).collect();
        let data = crate::api::event::ReportRefusedData {
            route: route.into(),
            boot,
            reason: refusal.to_string(),
        };
        if let Err(e) = self
            .store
            .record_event(
                crate::api::event::kind::REPORT_REFUSED,
                Some(mac),
                &serde_json::to_value(&data).expect("event data serialises"),
            )
            .await
        {
            tracing::warn!(error = %e, "cannot record a refused report");
        }
        result
    }

    /// The boot an agent call's token was minted for, found from the token alone (it
    /// names its boot: `<boot id>.<secret>`), so that a caller is checked before its
    /// request body is read. The token must match in constant time, belong to the node's
    /// newest boot and be within its lifetime.
    ///
    /// An unknown token is not recorded as an event (anyone can send one, and each would
    /// be a row); it is counted in a log line at most every 10 s.
    pub async fn caller(&self, token: &str) -> Result<Caller, AttestError> {
        let boot_id = match token.split_once('.') {
            Some((id, secret)) if (1..=64).contains(&id.len()) && !secret.is_empty() => id,
            _ => return Err(unknown_token()),
        };
        let Some(boot) = self.store.boot_for_attest(boot_id).await? else {
            return Err(unknown_token());
        };
        let presented = Digest::from_hasher(Sha256::new_with_prefix(token.as_bytes()));
        let same: bool = presented
            .hex()
            .as_bytes()
            .ct_eq(boot.token_sha256.hex().as_bytes())
            .into();
        if !same {
            return Err(unknown_token());
        }
        let mac = boot.mac;
        let caller = Caller {
            boot_id: boot_id.to_string(),
            boot,
        };
        if !caller.boot.latest
            || crate::clock::now_ms() - caller.boot.created_at_ms > TOKEN_LIFETIME_MS
        {
            // A real token, an old one: worth an event, as it was once this node's.
            return self
                .noted("agent", boot_id, &mac, Err(Refusal::Expired.into()))
                .await;
        }
        Ok(caller)
    }

    /// What the report claims must be what the token says: its boot and its node.
    pub(super) fn claims<'c>(
        caller: &'c Caller,
        boot_id: &str,
        mac: &Mac,
    ) -> Result<&'c crate::store::BootForAttest, AttestError> {
        if boot_id != caller.boot_id {
            return Err(Refusal::BadToken.into());
        }
        if *mac != caller.boot.mac {
            return Err(Refusal::OtherNode {
                claimed: *mac,
                actual: caller.boot.mac,
                boot_id: boot_id.to_string(),
            }
            .into());
        }
        Ok(&caller.boot)
    }

    async fn attest_inner(
        &self,
        caller: &Caller,
        req: &AttestRequest,
    ) -> Result<Verdict, AttestError> {
        let store = &self.store;
        let boot = Self::claims(caller, &req.boot_id, &req.mac)?;
        // A retry (the agent's answer was lost, or it timed out under load) gets the
        // verdict already given: a boot is judged once, and its report cannot change it.
        if boot.attested() {
            return self.stored_verdict(&req.boot_id).await;
        }
        let Some(image) = self.image(&boot.image).await? else {
            return Err(Refusal::BadToken.into());
        };
        let artifacts: Vec<Digest> = image.record.artifacts.iter().map(|a| a.digest).collect();
        let by_script: Vec<(String, Digest, u64)> = image
            .record
            .artifacts
            .iter()
            .filter(|a| matches!(a.role, Role::Kernel | Role::Initrd))
            .map(|a| (a.path.clone(), a.digest, a.size))
            .collect();
        let others: Vec<(String, Digest, u64)> = image
            .record
            .artifacts
            .iter()
            .filter(|a| !matches!(a.role, Role::Kernel | Role::Initrd))
            .map(|a| (a.path.clone(), a.digest, a.size))
            .collect();
        // Downloads still being written down would look like missing ones.
        self.fetches.flush().await;
        let fetches = store.fetches(&req.boot_id).await?;
        let received = Received::tally(&fetches);
        let mut verdict = judge(
            &req.report,
            &Expected {
                image_digest: boot.image,
                boot_id: &req.boot_id,
                cmdline: &image.manifest.cmdline,
                pins: &image.manifest.pins,
                artifacts: &artifacts,
                delivered_by_script: &by_script,
                other_sizes: &others,
                received: &received,
                verity_root_hash: image
                    .manifest
                    .rootfs_spec
                    .as_ref()
                    .and_then(|r| r.verity.as_ref())
                    .map(|v| v.root_hash.as_str()),
            },
        );
        let (tpm, tpm_mismatches) = self.judge_tpm(req, &boot.mac, &image).await?;
        verdict.mismatches.extend(tpm_mismatches);
        verdict.passed = verdict.mismatches.is_empty();
        verdict.tpm = tpm;
        let json = serde_json::to_string(&verdict).expect("verdict serialises");
        let report = serde_json::to_string(&req.report).expect("report serialises");
        let reason = if verdict.passed {
            format!("boot {} attested: runs {}", req.boot_id, boot.image)
        } else {
            let named: Vec<String> = verdict
                .mismatches
                .iter()
                .map(|m| format!("{}: expected {}, found {}", m.field, m.expected, m.found))
                .collect();
            format!(
                "boot {} failed attestation: {}",
                req.boot_id,
                named.join("; ")
            )
        };
        // The verdict and the transition it causes commit together, or neither does.
        let attestation = Attached::Attestation {
            boot_id: &req.boot_id,
            passed: verdict.passed,
            verdict_json: &json,
            report_json: &report,
        };
        let event = NodeEvent::Attested {
            passed: verdict.passed,
        };
        match self
            .controller
            .apply_with(&boot.mac, event, &reason, Some(&attestation))
            .await
        {
            Ok(_) => {
                // The challenge is spent: this boot is judged once.
                if req.tpm.is_some()
                    && let Err(e) = self.store.end_tpm_challenge(&req.boot_id).await
                {
                    tracing::warn!(error = %e, boot = %req.boot_id, "cannot remove a spent TPM challenge");
                }
                if verdict.passed {
                    self.baselines
                        .attested(&boot.mac, &req.boot_id, &req.report);
                }
                self.time_attested(boot, &image.record.artifacts, &fetches, verdict.passed);
                Ok(verdict)
            }
            // A concurrent try of the same boot won the race: its verdict is the answer.
            Err(ControlError::AlreadyAttested) => self.stored_verdict(&req.boot_id).await,
            Err(ControlError::NotAllowed(e)) => Err(AttestError::NotNow(e.to_string())),
            Err(e) => Err(BootError::from(e).into()),
        }
    }

    /// Counts the verdict and times the boot so far: script to attest, and each
    /// artifact's download (first byte of its first range to the last byte of its last).
    fn time_attested(
        &self,
        boot: &crate::store::BootForAttest,
        artifacts: &[crate::api::image::Artifact],
        fetches: &[crate::store::Fetch],
        passed: bool,
    ) {
        use crate::metrics::phase;
        let metrics = self.controller.metrics();
        metrics.attestation(passed);
        let now = crate::clock::now_ms();
        metrics.boot_phase(phase::ATTEST, (now - boot.created_at_ms) as f64 / 1000.0);
        for artifact in artifacts {
            let name = match artifact.role {
                Role::Kernel => phase::KERNEL,
                Role::Initrd => phase::INITRD,
                Role::Rootfs => phase::ROOTFS,
            };
            let done = fetches
                .iter()
                .filter(|f| f.digest == artifact.digest)
                .filter_map(|f| f.finished_at_ms.map(|end| (f.started_at_ms, end)));
            let span = done.fold(None, |acc: Option<(i64, i64)>, (s, e)| match acc {
                None => Some((s, e)),
                Some((s0, e0)) => Some((s0.min(s), e0.max(e))),
            });
            if let Some((s, e)) = span {
                metrics.boot_phase(name, (e - s) as f64 / 1000.0);
            }
        }
    }

    /// The verdict stored for `boot_id`, as first given.
    async fn stored_verdict(&self, boot_id: &str) -> Result<Verdict, AttestError> {
        let facts = self.store.boot_by_id(boot_id).await?;
        let verdict = facts
            .and_then(|f| f.verdict)
            .ok_or_else(|| AttestError::NotNow(format!("boot {boot_id} has no verdict yet")))?;
        serde_json::from_value(verdict).map_err(|e| {
            AttestError::Boot(
                crate::store::StoreError::Corrupt(format!("boot {boot_id}'s verdict: {e}")).into(),
            )
        })
    }
}
