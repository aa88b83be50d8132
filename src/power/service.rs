//! A power action for one node: its BMC settings and secret turned into a driver, the
//! BMC probed before anything changes (reachable, credentials, certificate), a disruptive
//! action counted against the disruption budget (the node becomes reimaging: a stateless
//! node that goes down comes back by booting), the action within the rate limits, and a
//! row plus a `node.power` event for every outcome.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::api::Mac;
use crate::api::NodeState;
use crate::api::node::Bmc;
use crate::api::power::{
    BmcProtocol, BmcRegistration, PowerAction, PowerDone, PowerState, PowerStatus,
    RegisteredPowerDone,
};
use crate::node::reimage::{ReimageError, ReimageService};
use crate::store::{PowerRow, Store, StoreError};

use super::secrets::Secrets;
use super::tls::Trust;
use super::{Driver, Op, PowerError};

/// `[power]` in the settings file.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PowerSettings {
    /// Where credentials and CA files are read by name [default: `<data_dir>/secrets`].
    pub secrets_dir: Option<std::path::PathBuf>,
    /// Each BMC call's limit, in seconds.
    pub timeout_secs: u64,
    /// BMC calls in flight at once, overall.
    pub max_concurrent: usize,
    /// Power-ons and cycles started per minute, overall: a rack powering on at once is
    /// what trips its breakers.
    pub starts_per_minute: u32,
    /// Tries of the reimage fallback before the node is quarantined for a human.
    pub attempts: u32,
    /// Seconds between the fallback's tries, doubled after each failure.
    pub retry_secs: u64,
}

impl Default for PowerSettings {
    fn default() -> Self {
        Self {
            secrets_dir: None,
            timeout_secs: 20,
            max_concurrent: 64,
            starts_per_minute: 120,
            attempts: 3,
            retry_secs: 60,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ActionError {
    #[error("{0}")]
    BadRequest(String),
    #[error("no node {0}")]
    UnknownNode(Mac),
    #[error("no machine registered by its BMC with id {0}")]
    UnknownRegistration(i64),
    /// The node has no BMC set.
    #[error("node {0} has no BMC; set one with `bootfleet node bmc set`")]
    NoBmc(Mac),
    /// The BMC failed; recorded.
    #[error(transparent)]
    Bmc(#[from] PowerError),
    #[error(transparent)]
    Reimage(#[from] ReimageError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Spaces power-ons and cycles `interval` apart overall.
struct StartPacer {
    interval: Duration,
    next: tokio::sync::Mutex<tokio::time::Instant>,
}

impl StartPacer {
    fn new(per_minute: u32) -> Self {
        Self {
            interval: Duration::from_secs(60) / per_minute.max(1),
            next: tokio::sync::Mutex::new(tokio::time::Instant::now()),
        }
    }

    /// The instant the next start may go, asked at `now`; books it.
    async fn book(&self, now: tokio::time::Instant) -> tokio::time::Instant {
        let mut next = self.next.lock().await;
        let at = (*next).max(now);
        *next = at + self.interval;
        at
    }

    async fn wait_turn(&self) {
        let at = self.book(tokio::time::Instant::now()).await;
        tokio::time::sleep_until(at).await;
    }
}

pub struct PowerService {
    store: Store,
    reimage: ReimageService,
    secrets: Secrets,
    settings: PowerSettings,
    in_flight: tokio::sync::Semaphore,
    pacer: StartPacer,
    /// One call at a time per BMC address: BMCs serve few at once and some lose
    /// overlapping changes.
    per_bmc: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl PowerService {
    pub fn new(
        store: Store,
        reimage: ReimageService,
        secrets: Secrets,
        settings: PowerSettings,
    ) -> Self {
        Self {
            in_flight: tokio::sync::Semaphore::new(settings.max_concurrent.max(1)),
            pacer: StartPacer::new(settings.starts_per_minute),
            store,
            reimage,
            secrets,
            settings,
            per_bmc: Mutex::default(),
        }
    }

    /// The secrets directory credentials are read from by name (BMCs, registries).
    pub fn secrets(&self) -> &Secrets {
        &self.secrets
    }

    pub fn settings(&self) -> &PowerSettings {
        &self.settings
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(self.settings.timeout_secs.max(1))
    }

    /// Checks a BMC's settings (the names and fingerprint it gives) before they are kept.
    pub fn check(&self, bmc: &Bmc) -> Result<(), String> {
        check_settings(bmc)
    }

    /// The driver for `bmc`, with its secret read now (so a rotated password applies at
    /// the next call).
    pub fn driver(&self, bmc: &Bmc) -> Result<Box<dyn Driver>, PowerError> {
        check_settings(bmc).map_err(PowerError::Config)?;
        let name = bmc
            .credential
            .as_deref()
            .ok_or_else(|| PowerError::Config("the BMC names no credential".into()))?;
        let creds = self
            .secrets
            .credentials(name)
            .map_err(|e| PowerError::Config(e.to_string()))?;
        Ok(match bmc.protocol {
            BmcProtocol::Ipmi => Box::new(
                super::ipmi::Ipmi::new(&bmc.address, creds, self.timeout())?
                    .with_quirks(&bmc.quirks),
            ),
            BmcProtocol::Redfish => {
                let trust = if bmc.insecure {
                    tracing::warn!(security = true, bmc = %bmc.address, "BMC marked insecure: its certificate is not checked");
                    Trust::Insecure
                } else if let Some(fp) = &bmc.fingerprint {
                    Trust::Fingerprint(
                        super::tls::parse_fingerprint(fp).map_err(PowerError::Config)?,
                    )
                } else if let Some(ca) = &bmc.ca {
                    Trust::Ca(
                        self.secrets
                            .pem(ca)
                            .map_err(|e| PowerError::Config(e.to_string()))?,
                    )
                } else {
                    Trust::SystemRoots
                };
                Box::new(super::redfish::Redfish::new(
                    &bmc.address,
                    &trust,
                    creds,
                    self.timeout(),
                )?)
            }
        })
    }

    async fn bmc_of(&self, mac: &Mac) -> Result<(crate::store::NodeRecord, Bmc), ActionError> {
        let node = self
            .store
            .node(mac)
            .await?
            .ok_or(ActionError::UnknownNode(*mac))?;
        let bmc = node.bmc.clone().ok_or(ActionError::NoBmc(*mac))?;
        Ok((node, bmc))
    }

    fn lane(&self, bmc: &Bmc) -> Arc<tokio::sync::Mutex<()>> {
        self.per_bmc
            .lock()
            .expect("not poisoned")
            .entry(bmc.address.clone())
            .or_default()
            .clone()
    }

    /// Sets (or forgets) `mac`'s BMC after checking its settings (an unknown MAC is
    /// registered); the secret it names is read at each use, not now (it may be put in
    /// place after).
    pub async fn set_bmc(
        &self,
        mac: &Mac,
        bmc: Option<&Bmc>,
    ) -> Result<crate::api::node::Node, ActionError> {
        if let Some(b) = bmc {
            check_settings(b).map_err(ActionError::BadRequest)?;
            // A machine may be known by its BMC before it ever boots: it is recorded
            // now, and matched when it boots by its MAC.
            self.reimage
                .controller
                .discover(mac, None, "registered with its BMC by an admin")
                .await
                .map_err(|e| ActionError::BadRequest(e.to_string()))?;
        }
        let node = self
            .store
            .set_bmc(mac, bmc)
            .await?
            .ok_or(ActionError::UnknownNode(*mac))?;
        Ok(node.into())
    }

    /// What the BMC says of the machine's power, with its inventory.
    pub async fn status(&self, mac: &Mac) -> Result<PowerStatus, ActionError> {
        let (_, bmc) = self.bmc_of(mac).await?;
        let held = self.hold(&bmc).await?;
        let d = held.driver.as_ref();
        let answer = async { Ok::<_, PowerError>((d.state().await?, d.inventory().await?)) }.await;
        let (state, inventory) = held.end(answer).await?;
        Ok(PowerStatus {
            node: *mac,
            bmc: bmc.to_string(),
            state,
            inventory,
        })
    }

    /// Carries out `action` on `mac` for `reason`, recorded whatever the outcome; a
    /// disruptive action first passes the disruption budget.
    pub async fn act(
        &self,
        mac: &Mac,
        action: PowerAction,
        reason: &str,
        netboot: Option<bool>,
    ) -> Result<PowerDone, ActionError> {
        self.run(mac, action, reason, netboot, true).await
    }

    /// For a node the budget already counts (a reimage it admitted): the action with the
    /// default network boot, and no second claim.
    pub async fn act_counted(
        &self,
        mac: &Mac,
        action: PowerAction,
        reason: &str,
    ) -> Result<PowerDone, ActionError> {
        self.run(mac, action, reason, None, false).await
    }

    async fn run(
        &self,
        mac: &Mac,
        action: PowerAction,
        reason: &str,
        netboot: Option<bool>,
        claim: bool,
    ) -> Result<PowerDone, ActionError> {
        let reason = checked_reason(reason)?;
        let netboot = netboot.unwrap_or(matches!(action, PowerAction::On | PowerAction::Cycle));
        if netboot && matches!(action, PowerAction::Off | PowerAction::SoftOff) {
            return Err(ActionError::BadRequest(format!(
                "a network boot is set for `on` and `cycle`, not for `{action}`"
            )));
        }
        let (_, bmc) = self.bmc_of(mac).await?;
        let started = crate::clock::now_ms();
        let outcome = self
            .carry_out(mac, &bmc, action, reason, netboot, claim)
            .await;
        let row = PowerRow {
            at_ms: crate::clock::now_ms(),
            action: action.as_str().into(),
            reason: reason.into(),
            outcome: match &outcome {
                Ok(_) => "ok".into(),
                Err(e) => e.to_string(),
            },
            took_ms: crate::clock::now_ms() - started,
        };
        match &outcome {
            Ok(_) => tracing::info!(%mac, %action, reason, "power action done"),
            Err(e) => tracing::warn!(%mac, %action, reason, error = %e, "power action failed"),
        }
        // Budget refusals and bad requests changed nothing on the BMC: not power actions.
        if !matches!(
            outcome,
            Err(ActionError::Reimage(_) | ActionError::BadRequest(_))
        ) {
            self.store.record_power(mac, &row).await?;
        }
        let netboot_seen = outcome?;
        let node = self
            .store
            .node(mac)
            .await?
            .ok_or(ActionError::UnknownNode(*mac))?;
        Ok(PowerDone {
            node: *mac,
            action,
            netboot: netboot_seen,
            node_state: node.state,
        })
    }

    /// Registers a machine known only by its BMC: the BMC is asked for the system UUID and
    /// NIC MACs it will be matched by when it boots (refused when it reports neither). A
    /// node already known by one of those MACs is given the BMC at once.
    pub async fn register(&self, bmc: &Bmc) -> Result<BmcRegistration, ActionError> {
        check_settings(bmc).map_err(ActionError::BadRequest)?;
        let held = self.hold(bmc).await?;
        let d = held.driver.as_ref();
        let found =
            async { Ok::<_, PowerError>((d.inventory().await?.uuid, d.nic_macs().await?)) }.await;
        let (uuid, macs) = held.end(found).await?;
        let uuid = crate::node::controller::meaningful_uuid(uuid.as_deref());
        if uuid.is_none() && macs.is_empty() {
            return Err(ActionError::BadRequest(format!(
                "the BMC at {} reports neither a system UUID nor NIC MACs, so its machine cannot be matched when it boots; give the node's MAC with `bootfleet node bmc set MAC`",
                bmc.address
            )));
        }
        let registration = self.store.register_bmc(bmc, uuid.as_deref(), &macs).await?;
        for mac in &macs {
            if self.store.node(mac).await?.is_some()
                && self
                    .store
                    .match_bmc_registration(mac, None)
                    .await?
                    .is_some()
            {
                break;
            }
        }
        Ok(registration)
    }

    /// The machines registered by their BMC and not matched yet.
    pub async fn registrations(&self) -> Result<Vec<BmcRegistration>, ActionError> {
        Ok(self.store.bmc_registrations().await?)
    }

    /// Forgets a registration.
    pub async fn unregister(&self, id: i64) -> Result<(), ActionError> {
        match self.store.remove_bmc_registration(id).await? {
            true => Ok(()),
            false => Err(ActionError::UnknownRegistration(id)),
        }
    }

    /// A power action on a machine known only by its BMC (no node yet, so no budget:
    /// nothing runs there that bootfleet gave it), paced like the rest and recorded as a
    /// `bmc.power` event.
    pub async fn act_registered(
        &self,
        id: i64,
        action: PowerAction,
        reason: &str,
    ) -> Result<RegisteredPowerDone, ActionError> {
        let reason = checked_reason(reason)?;
        let registration = self
            .store
            .bmc_registration(id)
            .await?
            .ok_or(ActionError::UnknownRegistration(id))?;
        let bmc = &registration.bmc;
        let netboot = matches!(action, PowerAction::On | PowerAction::Cycle);
        // No node, so no budget to claim: nothing runs there that bootfleet gave it.
        let outcome = async {
            let held = self.hold(bmc).await?;
            let done = self
                .steps(None, held.driver.as_ref(), action, reason, netboot)
                .await;
            held.end(done).await
        }
        .await;
        let data = serde_json::json!({
            "id": id,
            "action": action.as_str(),
            "reason": reason,
            "outcome": match &outcome { Ok(_) => "ok".to_string(), Err(e) => e.to_string() },
        });
        self.store.record_bmc_power(&data).await?;
        Ok(RegisteredPowerDone {
            id,
            action,
            netboot: outcome?,
        })
    }

    async fn carry_out(
        &self,
        mac: &Mac,
        bmc: &Bmc,
        action: PowerAction,
        reason: &str,
        netboot: bool,
        claim: bool,
    ) -> Result<Option<String>, ActionError> {
        let held = self.hold(bmc).await?;
        let done = self
            .steps(
                claim.then_some(mac),
                held.driver.as_ref(),
                action,
                reason,
                netboot,
            )
            .await;
        held.end(done).await
    }

    /// `bmc`'s driver, within the server-wide bound and alone on that BMC.
    async fn hold(&self, bmc: &Bmc) -> Result<Held<'_>, ActionError> {
        let slot = self.in_flight.acquire().await.expect("never closed");
        let lane = self.lane(bmc).lock_owned().await;
        let driver = self.driver(bmc)?;
        Ok(Held {
            _slot: slot,
            _lane: lane,
            driver,
        })
    }

    /// The probe, the budget claimed for `claim_for` (when the action disrupts), the
    /// one-time network boot, then the action.
    async fn steps(
        &self,
        claim_for: Option<&Mac>,
        driver: &dyn Driver,
        action: PowerAction,
        reason: &str,
        netboot: bool,
    ) -> Result<Option<String>, ActionError> {
        // The probe: an unreachable BMC, wrong credentials or a certificate that does not
        // match fail here, before the node or the machine changes.
        let before = driver.state().await?;
        // Then the budget, before the BMC is asked to change anything: a node it refuses
        // is left as it was.
        if let Some(mac) = claim_for.filter(|_| action.disrupts()) {
            self.claim_budget(mac, action, reason).await?;
        }
        let seen = if netboot {
            Some(driver.netboot_once().await?)
        } else {
            None
        };
        let op = op_for(action, before);
        if matches!(op, Op::On | Op::Cycle) {
            self.pacer.wait_turn().await;
        }
        driver.act(op).await?;
        Ok(seen)
    }

    /// Moves the node to reimaging within the disruption budget (already reimaging is
    /// fine: it is counted once).
    async fn claim_budget(
        &self,
        mac: &Mac,
        action: PowerAction,
        reason: &str,
    ) -> Result<(), ActionError> {
        let node = self
            .store
            .node(mac)
            .await?
            .ok_or(ActionError::UnknownNode(*mac))?;
        if node.state == NodeState::Reimaging {
            return Ok(());
        }
        self.reimage
            .request(
                mac,
                &format!("power {action} through the BMC: {reason}"),
                None,
                None,
            )
            .await?;
        Ok(())
    }
}

/// A driver held by `PowerService::hold`; `end` closes its session on the BMC (BMCs hold
/// few) and then lets the next caller at that BMC.
struct Held<'a> {
    _slot: tokio::sync::SemaphorePermit<'a>,
    _lane: tokio::sync::OwnedMutexGuard<()>,
    driver: Box<dyn Driver>,
}

impl Held<'_> {
    async fn end<T>(self, result: T) -> T {
        self.driver.close().await;
        result
    }
}

/// A power action's reason, trimmed: 1-1024 characters.
fn checked_reason(reason: &str) -> Result<&str, ActionError> {
    let reason = reason.trim();
    if reason.is_empty() || reason.len() > 1024 {
        return Err(ActionError::BadRequest(
            "a power action needs a reason (1-1024 characters)".into(),
        ));
    }
    Ok(reason)
}

/// The driver's operation for `action` on a machine that was `before`.
fn op_for(action: PowerAction, before: PowerState) -> Op {
    match action {
        PowerAction::On => Op::On,
        PowerAction::Off => Op::ForceOff,
        PowerAction::SoftOff => Op::GracefulOff,
        // A machine that is off is cycled by turning it on.
        PowerAction::Cycle if before == PowerState::Off => Op::On,
        PowerAction::Cycle => Op::Cycle,
    }
}

/// What a BMC's settings must be before they are kept.
pub fn check_settings(bmc: &Bmc) -> Result<(), String> {
    for name in [&bmc.credential, &bmc.ca].into_iter().flatten() {
        if !super::secrets::valid_name(name) {
            return Err(format!(
                "invalid secret name {name:?}: 1-128 characters from A-Z a-z 0-9 . _ -, not starting with a dot"
            ));
        }
    }
    if bmc.credential.is_none() {
        return Err(
            "a BMC needs a credential (the name of a file in the secrets directory)".into(),
        );
    }
    match bmc.protocol {
        BmcProtocol::Ipmi => {
            if bmc.ca.is_some() || bmc.fingerprint.is_some() || bmc.insecure {
                return Err("ca, fingerprint and insecure are for Redfish BMCs".into());
            }
            super::ipmi::split_host_port(&bmc.address)?;
        }
        BmcProtocol::Redfish => {
            if let Some(q) = bmc.quirks.first() {
                return Err(format!("quirk {} is for IPMI BMCs", q.as_str()));
            }
            if let Some(fp) = &bmc.fingerprint {
                super::tls::parse_fingerprint(fp)?;
            }
            let trusts = [bmc.ca.is_some(), bmc.fingerprint.is_some(), bmc.insecure];
            if trusts.iter().filter(|t| **t).count() > 1 {
                return Err("give one of ca, fingerprint or insecure".into());
            }
            let trust = if bmc.insecure {
                Trust::Insecure
            } else {
                Trust::SystemRoots
            };
            let creds = super::secrets::Credentials {
                username: String::new(),
                password: String::new(),
            };
            super::redfish::Redfish::new(&bmc.address, &trust, creds, Duration::from_secs(1))
                .map_err(|e| e.to_string())?;
        }
    }
    if bmc.address.len() > 512 {
        return Err("a BMC address is at most 512 characters".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bmc(protocol: BmcProtocol, address: &str) -> Bmc {
        Bmc {
            protocol,
            address: address.into(),
            credential: Some("rack12".into()),
            ca: None,
            fingerprint: None,
            insecure: false,
            quirks: Vec::new(),
        }
    }

    #[test]
    fn settings_are_checked_before_they_are_kept() {
        assert!(check_settings(&bmc(BmcProtocol::Ipmi, "10.0.0.9:623")).is_ok());
        assert!(check_settings(&bmc(BmcProtocol::Redfish, "https://10.0.0.9")).is_ok());
        assert!(check_settings(&bmc(BmcProtocol::Redfish, "http://10.0.0.9")).is_err());
        let mut b = bmc(BmcProtocol::Redfish, "https://10.0.0.9");
        b.credential = Some("../admin.token".into());
        assert!(
            check_settings(&b)
                .unwrap_err()
                .contains("invalid secret name")
        );
        let mut b = bmc(BmcProtocol::Redfish, "https://10.0.0.9");
        b.fingerprint = Some("ab".repeat(32));
        b.insecure = true;
        assert!(check_settings(&b).unwrap_err().contains("one of"));
        let mut b = bmc(BmcProtocol::Ipmi, "10.0.0.9");
        b.insecure = true;
        assert!(check_settings(&b).is_err());
        let mut b = bmc(BmcProtocol::Ipmi, "10.0.0.9");
        b.credential = None;
        assert!(check_settings(&b).is_err());
    }

    #[tokio::test]
    async fn starts_are_booked_an_interval_apart() {
        let pacer = StartPacer::new(60);
        let t0 = tokio::time::Instant::now();
        let slots = [
            pacer.book(t0).await,
            pacer.book(t0).await,
            pacer.book(t0).await,
        ];
        assert_eq!(
            slots,
            [t0, t0 + Duration::from_secs(1), t0 + Duration::from_secs(2)]
        );
        // After a quiet spell the next start goes at once.
        let later = t0 + Duration::from_secs(10);
        assert_eq!(pacer.book(later).await, later);
    }
}
