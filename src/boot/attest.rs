//! The attestation endpoint's logic: the token must be this boot's (compared in constant
//! time, newest boot only, once, within its lifetime), the report must be for the node
//! that booted; then the pure judgement, the stored verdict and the state change.

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq;

use super::service::{BootError, BootService};
use crate::digest::Digest;
use crate::image::manifest::Manifest;
use crate::node::attest::{AttestReport, Expected, Verdict, judge};
use crate::node::mac::Mac;
use crate::node::state::NodeEvent;

/// How long a boot token may be used to attest.
pub const TOKEN_LIFETIME_MS: i64 = 24 * 3600 * 1000;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttestRequest {
    pub boot_id: String,
    pub mac: Mac,
    pub report: AttestReport,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatRequest {
    pub boot_id: String,
    pub mac: Mac,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NextAction {
    None,
    /// Reboot now: a reimage was requested (on a stateless node, a reboot is a reimage).
    Reboot,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HeartbeatAnswer {
    pub action: NextAction,
}

/// Why an attestation was refused before any judgement. Each is logged as a security event.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refusal {
    #[error("the boot token is not valid for this boot")]
    BadToken,
    #[error("the boot token has expired")]
    Expired,
    #[error("this boot was already attested; a token is used once")]
    Replayed,
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
    #[error(transparent)]
    Boot(#[from] BootError),
}

impl From<crate::store::StoreError> for AttestError {
    fn from(e: crate::store::StoreError) -> Self {
        AttestError::Boot(e.into())
    }
}

impl BootService {
    pub async fn attest(&self, token: &str, req: &AttestRequest) -> Result<Verdict, AttestError> {
        let result = self.attest_inner(token, req).await;
        if let Err(AttestError::Refused(refusal)) = &result {
            tracing::warn!(security = true, boot = %req.boot_id, mac = %req.mac, %refusal, "attestation refused");
        }
        result
    }

    /// The checks every agent call makes: this boot's token, this boot's node, its newest boot.
    async fn authenticate(
        &self,
        token: &str,
        boot_id: &str,
        mac: &Mac,
    ) -> Result<crate::store::nodes::BootForAttest, AttestError> {
        let boot = self
            .registry
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
        if !boot.latest {
            return Err(Refusal::Expired.into());
        }
        Ok(boot)
    }

    /// A heartbeat: the answer is what the node must do next.
    pub async fn heartbeat(
        &self,
        token: &str,
        req: &HeartbeatRequest,
    ) -> Result<HeartbeatAnswer, AttestError> {
        let result = async {
            self.authenticate(token, &req.boot_id, &req.mac).await?;
            let store = &self.registry.store;
            store.record_heartbeat(&req.mac).await?;
            let node = store.node(&req.mac).await?.ok_or(Refusal::BadToken)?;
            let action = if node.state == crate::node::state::NodeState::Reimaging {
                NextAction::Reboot
            } else {
                NextAction::None
            };
            Ok(HeartbeatAnswer { action })
        }
        .await;
        if let Err(AttestError::Refused(refusal)) = &result {
            tracing::warn!(security = true, boot = %req.boot_id, mac = %req.mac, %refusal, "heartbeat refused");
        }
        result
    }

    async fn attest_inner(&self, token: &str, req: &AttestRequest) -> Result<Verdict, AttestError> {
        let store = &self.registry.store;
        let boot = self.authenticate(token, &req.boot_id, &req.mac).await?;
        if crate::store::now_ms() - boot.created_at_ms > TOKEN_LIFETIME_MS {
            return Err(Refusal::Expired.into());
        }
        let record = store.image(&boot.image).await?;
        let manifest = store.manifest_toml(&boot.image).await?;
        let (Some(record), Some(manifest)) = (record, manifest) else {
            return Err(Refusal::BadToken.into());
        };
        let manifest = Manifest::parse(&manifest)
            .map_err(|e| BootError::Store(crate::store::StoreError::Corrupt(e.to_string())))?;
        let artifacts: Vec<Digest> = record.artifacts.iter().map(|a| a.digest).collect();
        let verdict = judge(
            &req.report,
            &Expected {
                image_digest: boot.image,
                boot_id: &req.boot_id,
                cmdline: &manifest.cmdline,
                pins: &manifest.pins,
                artifacts: &artifacts,
            },
        );
        let json = serde_json::to_string(&verdict).expect("verdict serialises");
        if !store.record_attestation(&req.boot_id, &json).await? {
            return Err(Refusal::Replayed.into());
        }
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
        self.controller
            .apply(
                &boot.mac,
                NodeEvent::Attested {
                    passed: verdict.passed,
                },
                &reason,
            )
            .await
            .map_err(BootError::from)?;
        Ok(verdict)
    }
}
