//! Reimage requests, from an admin, a fleet controller or the drift policy: a reason, an
//! optional new image, the disruption budget (checked in the transaction that moves the
//! node) and `Idempotency-Key` (the same key gets the first answer again).

use crate::api::Mac;
use crate::api::event::kind;
use crate::api::node::ReimageAccepted;
use crate::api::refs::ImageRef;
use crate::registry::{Registry, RegistryError};
use crate::store::StoreError;
use crate::store::nodes::{DisruptionBudget, ReimageOutcome};

#[derive(Clone)]
pub struct ReimageService {
    pub registry: Registry,
    pub budget: DisruptionBudget,
}

#[derive(Debug, thiserror::Error)]
pub enum ReimageError {
    #[error("{0}")]
    BadRequest(String),
    #[error("no node {0}")]
    UnknownNode(Mac),
    /// The state machine does not allow it, or the key was used for another node.
    #[error("{0}")]
    Conflict(String),
    #[error("over the disruption budget: {0}")]
    OverBudget(String),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ReimageService {
    /// Returns the JSON answer (the stored one for a repeated key).
    pub async fn request(
        &self,
        mac: &Mac,
        reason: &str,
        image: Option<&str>,
        key: Option<&str>,
    ) -> Result<String, ReimageError> {
        let reason = reason.trim();
        if reason.is_empty() || reason.len() > 1024 {
            return Err(ReimageError::BadRequest(
                "a reimage needs a reason (1-1024 characters)".into(),
            ));
        }
        let store = &self.registry.store;
        if let Some(key) = key
            && let Some((for_mac, body)) = store.idempotent_response(key).await?
        {
            if for_mac != mac.to_string() {
                return Err(ReimageError::Conflict(format!(
                    "Idempotency-Key {key:?} was used for node {for_mac}"
                )));
            }
            return Ok(body);
        }
        let image = match image {
            Some(r) => {
                let r = ImageRef::parse(r).map_err(|e| ReimageError::BadRequest(e.to_string()))?;
                self.registry.resolve(&r).await?;
                Some(r)
            }
            None => None,
        };
        let reason = format!("reimage requested: {reason}");
        let (node, outcome) = match store.request_reimage(mac, &reason, &self.budget).await? {
            ReimageOutcome::Accepted(n) => (n, "accepted"),
            ReimageOutcome::AlreadyReimaging(n) => (n, "already-reimaging"),
            ReimageOutcome::OverBudget(why) => {
                let data = crate::api::event::ReimageRefusedData {
                    reason: why.clone(),
                    request: reason.clone(),
                };
                store
                    .record_event(kind::REIMAGE_REFUSED, Some(mac), &data)
                    .await?;
                return Err(ReimageError::OverBudget(why));
            }
            ReimageOutcome::NotAllowed(e) => return Err(ReimageError::Conflict(e.to_string())),
            ReimageOutcome::UnknownNode => return Err(ReimageError::UnknownNode(*mac)),
        };
        let node = match image {
            Some(r) => store.assign(mac, &r.to_string()).await?,
            None => node,
        };
        let body = serde_json::to_string(&ReimageAccepted {
            outcome: outcome.into(),
            node: node.into(),
        })
        .expect("serialises");
        if let Some(key) = key {
            store.save_idempotent_response(key, mac, &body).await?;
        }
        Ok(body)
    }
}
