//! The attestation endpoint's logic: the token must be this boot's (compared in constant
//! time, newest boot only, once, within its lifetime), the report must be for the node
//! that booted; then the pure judgement, the stored verdict and the state change.

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
    #[error("this boot was already attested; a token is used once")]
    Replayed,
    #[error("this boot has not passed attestation; validation and heartbeats come after it")]
    NotAttested,
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

impl From<crate::store::StoreError> for AttestError {
    fn from(e: crate::store::StoreError) -> Self {
        AttestError::Boot(e.into())
    }
}

impl NodeService {
    pub async fn attest(&self, token: &str, req: &AttestRequest) -> Result<Verdict, AttestError> {
        let result = self.attest_inner(token, req).await;
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

    /// The checks every agent call makes: this boot's token, this boot's node, its newest
    /// boot, within the token's lifetime.
    pub(super) async fn authenticate(
        &self,
        token: &str,
        boot_id: &str,
        mac: &Mac,
    ) -> Result<crate::store::BootForAttest, AttestError> {
        let boot = self
            .store
            .boot_for_attest(boot_id)
            .await?
            .ok_or(Refusal::BadToken)?;
        let presented = Digest::from_hasher(Sha256::new_with_prefix(token.as_bytes()));
        let same: bool = presented
            .hex()
            .as_bytes()
            .ct_eq(boot.token_sha256.hex().as_bytes())
            .into();
        if !same {
            return Err(Refusal::BadToken.into());
        }
        if *mac != boot.mac {
            return Err(Refusal::OtherNode {
                claimed: *mac,
                actual: boot.mac,
                boot_id: boot_id.to_string(),
            }
            .into());
        }
        if !boot.latest || crate::clock::now_ms() - boot.created_at_ms > TOKEN_LIFETIME_MS {
            return Err(Refusal::Expired.into());
        }
        Ok(boot)
    }

    async fn attest_inner(&self, token: &str, req: &AttestRequest) -> Result<Verdict, AttestError> {
        let store = &self.store;
        let boot = self.authenticate(token, &req.boot_id, &req.mac).await?;
        // Checked again where the verdict is written (a race cannot attest twice).
        if boot.attested {
            return Err(Refusal::Replayed.into());
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
        let received = Received::tally(&store.fetches(&req.boot_id).await?);
        let verdict = judge(
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
            },
        );
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
            Ok(_) => Ok(verdict),
            Err(ControlError::AlreadyAttested) => Err(Refusal::Replayed.into()),
            Err(ControlError::NotAllowed(e)) => Err(AttestError::NotNow(e.to_string())),
            Err(e) => Err(BootError::from(e).into()),
        }
    }
}
