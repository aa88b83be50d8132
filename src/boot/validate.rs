//! The agent's validation report: judged against the image's `[validation]` section; the
//! node becomes ready only if every check passes, else validation-failed with reasons.

use serde::{Deserialize, Serialize};

use super::attest::{AttestError, Refusal};
use super::service::{BootError, BootService};
use crate::node::controller::ControlError;
use crate::node::mac::Mac;
use crate::node::state::{NodeEvent, NodeState};
use crate::node::validate::{ValidationReport, ValidationVerdict, judge};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ValidateRequest {
    pub boot_id: String,
    pub mac: Mac,
    pub report: ValidationReport,
}

impl BootService {
    pub async fn validate(
        &self,
        token: &str,
        req: &ValidateRequest,
    ) -> Result<ValidationVerdict, AttestError> {
        let result = self.validate_inner(token, req).await;
        self.note_refusal("validate", &req.boot_id, &req.mac, &result)
            .await;
        result
    }

    async fn validate_inner(
        &self,
        token: &str,
        req: &ValidateRequest,
    ) -> Result<ValidationVerdict, AttestError> {
        let boot = self.authenticate(token, &req.boot_id, &req.mac).await?;
        let store = &self.registry.store;
        let facts = store
            .boot_by_id(&req.boot_id)
            .await?
            .ok_or(Refusal::BadToken)?;
        let attested = facts
            .verdict
            .as_ref()
            .and_then(|v| v.get("passed"))
            .and_then(|p| p.as_bool())
            == Some(true);
        if !attested {
            return Err(Refusal::NotAttested.into());
        }
        let Some(image) = self.image(&boot.image).await? else {
            return Err(Refusal::BadToken.into());
        };
        let verdict = judge(&req.report, &image.manifest.validation);
        let gpus: Vec<&str> = req.report.gpus.iter().map(|g| g.uuid.as_str()).collect();
        let stored = serde_json::json!({
            "passed": verdict.passed,
            "failures": verdict.failures,
            "gpus": gpus,
        });
        store
            .record_validation(&req.boot_id, &stored.to_string())
            .await?;
        let mac = &req.mac;
        let node = store.node(mac).await?.ok_or(Refusal::BadToken)?;
        let not_now = |e: ControlError| match e {
            ControlError::NotAllowed(e) => AttestError::NotNow(e.to_string()),
            e => AttestError::Boot(BootError::from(e)),
        };
        if node.state != NodeState::Validating {
            let reason = format!("boot {}: validation report received", req.boot_id);
            self.controller
                .apply(mac, NodeEvent::ValidationStarted, &reason)
                .await
                .map_err(not_now)?;
        }
        let reason = if verdict.passed {
            format!(
                "boot {}: validated: {} GPU(s), every check passed",
                req.boot_id,
                req.report.gpus.len()
            )
        } else {
            let named: Vec<&str> = verdict.failures.iter().map(|f| f.reason.as_str()).collect();
            format!(
                "boot {}: validation failed: {}",
                req.boot_id,
                named.join("; ")
            )
        };
        self.controller
            .apply(
                mac,
                NodeEvent::Validated {
                    passed: verdict.passed,
                },
                &reason,
            )
            .await
            .map_err(not_now)?;
        Ok(verdict)
    }
}
