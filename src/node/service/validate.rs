//! The agent's validation report: judged against the image's `[validation]` section; the
//! node becomes ready only if every check passes, else validation-failed with reasons.

use super::attest::{AttestError, Refusal};
use super::{BootError, NodeService};
use crate::api::Mac;
use crate::api::agent::{ValidateRequest, ValidationVerdict};
use crate::node::controller::ControlError;
use crate::node::state::NodeEvent;
use crate::node::validate::{Expectations, judge};
use crate::store::Attached;

/// A boot's validation verdict as stored: what the timeline and the drift baseline read
/// back (`passed`, and the GPUs validated).
#[derive(serde::Serialize)]
struct StoredValidation<'a> {
    passed: bool,
    failures: &'a [crate::api::agent::Failure],
    gpus: &'a [String],
}

impl NodeService {
    pub async fn validate(
        &self,
        caller: &super::attest::Caller,
        req: &ValidateRequest,
    ) -> Result<ValidationVerdict, AttestError> {
        let result = self.validate_inner(caller, req).await;
        self.noted("validate", &req.boot_id, &req.mac, result).await
    }

    async fn validate_inner(
        &self,
        caller: &super::attest::Caller,
        req: &ValidateRequest,
    ) -> Result<ValidationVerdict, AttestError> {
        // The token's boot as checked says whether it attested and passed: no read of
        // its stored verdict.
        let boot = Self::claims(caller, &req.boot_id, &req.mac)?;
        if !boot.attested_and_passed() {
            return Err(Refusal::NotAttested.into());
        }
        let Some(image) = self.image(&boot.image).await? else {
            return Err(Refusal::BadToken.into());
        };
        let expect = Expectations::from_manifest(&image.manifest.spec, &image.manifest.pins);
        let mut verdict = judge(&req.report, &expect);
        if let Some(topology) = &self.fabric {
            let cabling = crate::fabric::cabling::check(&req.report.ib_ports, topology);
            verdict.passed &= cabling.is_empty();
            verdict.failures.extend(cabling);
        }
        // The GPUs validated: stored with the verdict and kept with the drift baseline.
        let gpus: Vec<String> = req.report.gpus.iter().map(|g| g.uuid.clone()).collect();
        let stored = serde_json::to_string(&StoredValidation {
            passed: verdict.passed,
            failures: &verdict.failures,
            gpus: &gpus,
        })
        .expect("verdict serialises");
        let mac = &req.mac;
        let not_now = |e: ControlError| match e {
            ControlError::NotAllowed(e) => AttestError::NotNow(e.to_string()),
            // Removed since its token was checked: the token names no node any more.
            ControlError::UnknownNode(_) => Refusal::BadToken.into(),
            e => AttestError::Boot(BootError::from(e)),
        };
        let started = format!("boot {}: validation report received", req.boot_id);
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
        // The verdict and the transition it causes commit together, or neither does.
        let validation = Attached::Validation {
            boot_id: &req.boot_id,
            verdict_json: &stored,
        };
        let event = NodeEvent::Validated {
            passed: verdict.passed,
        };
        // Through validating (unless a revalidation put it there) and on, in one write;
        // the node as written is what the health rules below look at.
        let node = self
            .controller
            .apply_via(
                mac,
                (NodeEvent::ValidationStarted, &started),
                event,
                &reason,
                Some(&validation),
            )
            .await
            .map_err(not_now)?;
        self.baselines.validated(mac, &req.boot_id, gpus);
        self.time_validated(boot, &verdict);
        if !verdict.passed {
            self.after_failure(mac, &reason).await?;
        } else {
            if !req.report.figures.is_empty() {
                let image = boot.image.to_string();
                self.judge_figures(&node, &req.boot_id, &image, &req.report.figures)
                    .await?;
            }
            self.degrade_again(mac, &req.boot_id).await?;
        }
        Ok(verdict)
    }

    /// Counts the verdict by the checks that failed, and times attest to validation and
    /// script to ready.
    fn time_validated(&self, boot: &crate::store::BootForAttest, verdict: &ValidationVerdict) {
        use crate::metrics::phase;
        let metrics = self.controller.metrics();
        metrics.validation(
            verdict.passed,
            verdict.failures.iter().map(|f| f.check.as_str()),
        );
        let now = crate::clock::now_ms();
        if let Some(attested) = boot.attestation {
            metrics.boot_phase(phase::VALIDATE, (now - attested.at_ms) as f64 / 1000.0);
        }
        if verdict.passed {
            metrics.boot_phase(phase::READY, (now - boot.created_at_ms) as f64 / 1000.0);
        }
    }

    /// The failure policy: reimage (attempt n of K, within the disruption budget), then
    /// quarantine. Over budget the node stays validation-failed; a human or the fleet
    /// controller sees it in the events.
    async fn after_failure(&self, mac: &Mac, reason: &str) -> Result<(), AttestError> {
        use crate::node::policy::FailureAction;
        let store = &self.store;
        let failures = store.validation_failures_since_ready(mac).await?;
        let node = store.node(mac).await?.ok_or(Refusal::BadToken)?;
        match self.policy.after_failed_validation(&node.labels, failures) {
            FailureAction::Reimage { attempt, of } => {
                let why = format!("failure policy, attempt {attempt} of {of}: {reason}");
                if let Err(e) = self.reimage.request(mac, &why, None, None).await {
                    tracing::warn!(%mac, error = %e, "failed validation: cannot reimage");
                }
            }
            FailureAction::Quarantine => {
                let why = format!(
                    "failed validation {failures} times since last ready; needs a human or a hardware ticket: {reason}"
                );
                self.controller
                    .apply(mac, NodeEvent::QuarantineImposed, &why)
                    .await
                    .map_err(BootError::from)?;
            }
        }
        Ok(())
    }
}
