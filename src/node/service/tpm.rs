//! The TPM challenge's logic and the TPM part of a boot's attestation: the EK checked
//! and enrolled (first seen, or refused when another is enrolled), a credential made for
//! the AK, then at attestation the quote and event log judged by `tpm::verify` against
//! this boot's iPXE and kernel. The policy (`[tpm] policy`, a node's `tpm` label over it)
//! says whether a boot without evidence fails.

use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq;

use super::NodeService;
use super::admin::AdminError;
use super::attest::{AttestError, Caller, Refusal};
use crate::api::agent::{
    AttestRequest, Mismatch, TpmChallengeAnswer, TpmChallengeRequest, TpmEvidence, TpmFindings,
};
use crate::api::image::Role;
use crate::store::{TpmChallengeRow, TpmEnrolment};
use crate::tpm::verify::{self, Loadable};
use crate::tpm::wire::{Public, credential_blob};
use crate::tpm::{Enrolment, TpmPolicy, check_ak, check_ek, credential};

fn unhex(what: &str, s: &str) -> Result<Vec<u8>, Refusal> {
    hex::decode(s).map_err(|e| Refusal::Tpm(format!("{what}: not hex: {e}")))
}

fn miss(field: &str, expected: impl Into<String>, found: impl Into<String>) -> Mismatch {
    Mismatch {
        field: field.into(),
        expected: expected.into(),
        found: found.into(),
    }
}

impl NodeService {
    /// `POST /api/v1/agent/tpm/challenge`.
    pub async fn tpm_challenge(
        &self,
        caller: &Caller,
        req: &TpmChallengeRequest,
    ) -> Result<TpmChallengeAnswer, AttestError> {
        let result = self.tpm_challenge_inner(caller, req).await;
        self.noted("tpm-challenge", &req.boot_id, &req.mac, result)
            .await
    }

    async fn tpm_challenge_inner(
        &self,
        caller: &Caller,
        req: &TpmChallengeRequest,
    ) -> Result<TpmChallengeAnswer, AttestError> {
        let boot = Self::claims(caller, &req.boot_id, &req.mac)?;
        if boot.attested() {
            return Err(AttestError::NotNow(format!(
                "boot {} has attested: its TPM challenge is over",
                req.boot_id
            )));
        }
        if self.tpm_policy(&boot.mac).await? == TpmPolicy::Off {
            return Err(AttestError::NotNow(
                "TPM attestation is off for this node ([tpm] policy or its tpm label)".into(),
            ));
        }
        let ek = Public::from_tpm2b(&unhex("ek_public", &req.ek_public)?)
            .map_err(|e| Refusal::Tpm(format!("ek_public: {e}")))?;
        let ak = Public::from_tpm2b(&unhex("ak_public", &req.ak_public)?)
            .map_err(|e| Refusal::Tpm(format!("ak_public: {e}")))?;
        check_ek(&ek).map_err(Refusal::Tpm)?;
        check_ak(&ak).map_err(Refusal::Tpm)?;
        let certified = match (&self.trust.roots, &req.ek_certificate) {
            (None, _) => false,
            (Some(_), None) => {
                return Err(
                    Refusal::Tpm(crate::tpm::ekcert::EkCertError::Missing.to_string()).into(),
                );
            }
            (Some(roots), Some(cert)) => {
                roots
                    .check(&unhex("ek_certificate", cert)?, &ek)
                    .map_err(|e| Refusal::Tpm(e.to_string()))?;
                true
            }
        };
        let ek_name = hex::encode(ek.name());
        let mut secret = [0u8; 32];
        rand::fill(&mut secret);
        let made =
            credential::make(&ek, &ak.name(), &secret).map_err(|e| Refusal::Tpm(e.to_string()))?;
        let now = crate::clock::now_ms();
        let row = TpmChallengeRow {
            boot_id: req.boot_id.clone(),
            mac: boot.mac,
            ak_public: hex::encode(ak_tpm2b(&ak)),
            ek_name: ek_name.clone(),
            secret_sha256: hex::encode(Sha256::digest(secret)),
            issued_at_ms: now,
        };
        let enrolment = TpmEnrolment {
            mac: boot.mac,
            ek_name: ek_name.clone(),
            certified,
            enrolled_at_ms: now,
        };
        let first_seen = self.trust.enrolment == Enrolment::FirstSeen;
        let Some(stored) = self
            .store
            .put_tpm_challenge(&row, &enrolment, first_seen)
            .await?
        else {
            return Err(Refusal::Tpm(format!(
                "no EK is registered for this node ([tpm] enrolment = \"pre-registered\"); \
                 this boot presented EK {ek_name}: bootfleet node tpm enrol {} --ek-name {ek_name}",
                boot.mac
            ))
            .into());
        };
        if stored.ek_name != ek_name {
            return Err(Refusal::Tpm(format!(
                "the node is enrolled with EK {}, and this boot presented EK {ek_name} (a new TPM or \
                 board: bootfleet node tpm forget, or tpm enrol with the new EK)",
                stored.ek_name
            ))
            .into());
        }
        Ok(TpmChallengeAnswer {
            credential: hex::encode(credential_blob(&made.id_object, &made.encrypted_secret)),
            pcrs: verify::QUOTED_PCRS.to_vec(),
        })
    }

    /// The node's policy: its `tpm` label, else `[tpm] policy` (an unknown label value
    /// counts as `required`: a typo must not turn checking off).
    pub(super) async fn tpm_policy(&self, mac: &crate::api::Mac) -> Result<TpmPolicy, AttestError> {
        // The cached read (current as of the last committed write to the node): one per
        // attestation, on the boot path.
        let node = self.store.node_for_dhcp(mac).await?;
        let label = node
            .as_ref()
            .and_then(|n| n.labels.get(crate::tpm::POLICY_LABEL));
        Ok(match label {
            None => self.trust.policy,
            Some(v) => TpmPolicy::parse(v).unwrap_or(TpmPolicy::Required),
        })
    }

    /// The TPM part of a boot's verdict: what the evidence showed (None: none judged)
    /// and its mismatches.
    pub(super) async fn judge_tpm(
        &self,
        req: &AttestRequest,
        mac: &crate::api::Mac,
        image: &super::CachedImage,
    ) -> Result<(Option<TpmFindings>, Vec<Mismatch>), AttestError> {
        let policy = self.tpm_policy(mac).await?;
        if policy == TpmPolicy::Off {
            return Ok((None, Vec::new()));
        }
        // Without evidence there is nothing to look up: under `preferred` a node that
        // sends none attests as one without a TPM (it could always have said nothing),
        // and the boot path of a fleet without TPMs costs no query.
        let Some(evidence) = &req.tpm else {
            return Ok(match policy {
                TpmPolicy::Required => (
                    None,
                    vec![miss("tpm", "TPM evidence (policy: required)", "none sent")],
                ),
                _ => (None, Vec::new()),
            });
        };
        let Some(challenge) = self.store.tpm_challenge(&req.boot_id).await? else {
            return Ok((
                None,
                vec![miss(
                    "tpm",
                    "a TPM challenge before the quote",
                    "TPM evidence without a challenge",
                )],
            ));
        };
        let loadable = match self.loadable(image).await {
            Ok(l) => l,
            Err(why) => {
                return Ok((
                    None,
                    vec![miss("tpm.kernel", "the image's kernel as a PE image", why)],
                ));
            }
        };
        Ok(judge_evidence(
            evidence,
            &challenge,
            &req.boot_id,
            &loadable,
        ))
    }

    /// What firmware may load for a boot of `image`: the iPXE binaries served, and the
    /// image's kernel.
    async fn loadable(&self, image: &super::CachedImage) -> Result<Vec<Loadable>, String> {
        let kernel = image
            .record
            .artifacts
            .iter()
            .find(|a| a.role == Role::Kernel)
            .ok_or("the image has no kernel")?;
        let digest = kernel.digest;
        let registry = self.registry.clone();
        let trust = self.trust.clone();
        let local = registry
            .local_blob(&digest)
            .await
            .map_err(|e| e.to_string())?;
        if !local {
            return Err(format!("kernel blob {digest} is not stored here"));
        }
        let path = registry.blobs.path_of(&digest);
        // The bytes are checked against their digest as they are read: what is measured
        // against is the image's kernel, whatever the disk holds now.
        let authenticode = tokio::task::spawn_blocking(move || {
            trust.kernel_digest(digest, || {
                let bytes = std::fs::read(&path).map_err(|e| e.to_string())?;
                match crate::api::Digest::of(&bytes) == digest {
                    true => Ok(bytes),
                    false => Err(format!("the stored kernel blob does not match {digest}")),
                }
            })
        })
        .await
        .map_err(|e| e.to_string())??;
        let mut loadable = self.trust.loaders.clone();
        loadable.push(Loadable {
            name: format!("kernel {}", kernel.path),
            digest: authenticode,
            is_kernel: true,
        });
        Ok(loadable)
    }
}

impl NodeService {
    /// `GET /api/v1/nodes/{mac}/tpm`: the EK the node is enrolled with.
    pub async fn tpm_enrolment(
        &self,
        mac: &crate::api::Mac,
    ) -> Result<crate::api::node::TpmEnrolment, AdminError> {
        self.store
            .tpm_enrolment(mac)
            .await?
            .map(view)
            .ok_or_else(|| AdminError::NotFound(format!("node {mac} has no TPM enrolment")))
    }

    /// `PUT /api/v1/nodes/{mac}/tpm`: an operator registers the EK the node's TPM must
    /// present (before its first boot, or a new board's).
    pub async fn enrol_tpm(
        &self,
        mac: &crate::api::Mac,
        req: &crate::api::node::TpmEnrolRequest,
    ) -> Result<crate::api::node::TpmEnrolment, AdminError> {
        let bad = |why: String| AdminError::BadRequest(why);
        let ek_name = match (&req.ek_public, &req.ek_name) {
            (Some(public), None) => {
                let bytes =
                    hex::decode(public).map_err(|e| bad(format!("ek_public: not hex: {e}")))?;
                let ek = Public::from_tpm2b(&bytes).map_err(|e| bad(format!("ek_public: {e}")))?;
                check_ek(&ek).map_err(bad)?;
                hex::encode(ek.name())
            }
            (None, Some(name)) => {
                let name = name.to_ascii_lowercase();
                // nameAlg SHA-256 (000b) and its 32-byte digest.
                if name.len() != 68 || !name.starts_with("000b") || hex::decode(&name).is_err() {
                    return Err(bad(format!(
                        "ek_name {name:?}: a TPM Name is 000b and 64 hex digits (SHA-256)"
                    )));
                }
                name
            }
            _ => return Err(bad("give one of ek_public and ek_name".into())),
        };
        if self.store.node(mac).await?.is_none() {
            return Err(AdminError::NotFound(format!("no node {mac}")));
        }
        let enrolment = TpmEnrolment {
            mac: *mac,
            ek_name,
            certified: false,
            enrolled_at_ms: crate::clock::now_ms(),
        };
        self.store.set_tpm_enrolment(&enrolment).await?;
        Ok(view(enrolment))
    }

    /// `DELETE /api/v1/nodes/{mac}/tpm`: the node's next TPM boot enrols again (or, with
    /// pre-registration, needs a new registration).
    pub async fn forget_tpm(
        &self,
        mac: &crate::api::Mac,
    ) -> Result<crate::api::node::TpmEnrolment, AdminError> {
        let missing = || AdminError::NotFound(format!("node {mac} has no TPM enrolment"));
        let enrolment = self.store.tpm_enrolment(mac).await?.ok_or_else(missing)?;
        match self.store.forget_tpm_enrolment(mac).await? {
            true => Ok(view(enrolment)),
            false => Err(missing()),
        }
    }
}

fn view(e: TpmEnrolment) -> crate::api::node::TpmEnrolment {
    crate::api::node::TpmEnrolment {
        ek_name: e.ek_name,
        certified: e.certified,
        enrolled_at: crate::clock::format_ms(e.enrolled_at_ms),
    }
}

/// The evidence against the boot's challenge: the secret the TPM recovered, then the
/// quote, log and measurements.
fn judge_evidence(
    evidence: &TpmEvidence,
    challenge: &TpmChallengeRow,
    boot_id: &str,
    loadable: &[Loadable],
) -> (Option<TpmFindings>, Vec<Mismatch>) {
    let bad = |field: &str, why: String| (None, vec![miss(field, "well-formed TPM evidence", why)]);
    let Ok(secret) = hex::decode(&evidence.secret) else {
        return bad("tpm.secret", "the secret is not hex".into());
    };
    let presented = hex::encode(Sha256::digest(&secret));
    if !bool::from(
        presented
            .as_bytes()
            .ct_eq(challenge.secret_sha256.as_bytes()),
    ) {
        return (
            None,
            vec![miss(
                "tpm.secret",
                "the secret in this boot's credential",
                "another secret: the credential was not opened by the enrolled TPM",
            )],
        );
    }
    let ak = match hex::decode(&challenge.ak_public)
        .map_err(|e| e.to_string())
        .and_then(|b| Public::from_tpm2b(&b).map_err(|e| e.to_string()))
    {
        Ok(ak) => ak,
        Err(e) => return bad("tpm.ak", format!("the stored AK: {e}")),
    };
    let mut pcrs = std::collections::BTreeMap::new();
    for (i, v) in &evidence.pcrs {
        match hex::decode(v)
            .ok()
            .and_then(|b| <[u8; 32]>::try_from(b).ok())
        {
            Some(v) => pcrs.insert(*i, v),
            None => return bad("tpm.pcrs", format!("PCR {i}: not a SHA-256 value")),
        };
    }
    let (Ok(attest), Ok(signature), Ok(event_log)) = (
        hex::decode(&evidence.attest),
        hex::decode(&evidence.signature),
        hex::decode(&evidence.event_log),
    ) else {
        return bad(
            "tpm.quote",
            "the quote, signature or event log is not hex".into(),
        );
    };
    let ek_name = hex::decode(&challenge.ek_name).unwrap_or_default();
    let (findings, mismatches) = verify::verify(
        &verify::Evidence {
            attest: &attest,
            signature: &signature,
            pcrs: &pcrs,
            event_log: &event_log,
        },
        &verify::Expected {
            ak: &ak,
            nonce: verify::nonce(&secret, boot_id),
            loadable,
        },
        &ek_name,
    );
    (Some(findings), mismatches)
}

/// The AK's TPM2B_PUBLIC again (size ‖ area), as the challenge stores it.
fn ak_tpm2b(ak: &Public) -> Vec<u8> {
    let mut out = (ak.area.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(&ak.area);
    out
}
