//! Roles exactly one server plays at a time, among servers sharing a store: the webhook
//! sender (one delivery of each event, in order) and the sweeper (one judge of silence).
//! A role is a lease in the store (`LeaderStore`), renewed every `RENEW` and lapsing
//! `TTL` after its last renewal: when its holder dies another server takes it within
//! `TTL` + `RENEW`. A holder that cannot renew stops acting at once, before its lease
//! can lapse, so two servers act together only if one is paused past its whole lease
//! (webhook delivery is at-least-once anyway, and every state change compare-and-sets).

use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::clock::now_ms;
use crate::store::Store;

/// How long a lease lasts after its last renewal.
pub const TTL: Duration = Duration::from_secs(15);
/// How often the holder renews (and others try to take it).
pub const RENEW: Duration = Duration::from_secs(5);

pub const WEBHOOKS: &str = "webhooks";
pub const SWEEPER: &str = "sweeper";
/// Carries reimages through BMCs to nodes that do not answer (`power::fallback`).
pub const POWER: &str = "power";
/// Moves rollouts along (`rollout::run`).
pub const ROLLOUTS: &str = "rollouts";

/// This process's name in the `leaders` table: host, pid and a random part (a pid
/// repeats across restarts and containers).
pub fn holder_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown-host".into());
    format!(
        "{host}:{}:{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

/// Holds `role` for `holder` while it can, until `stop`, then gives it up (a task of
/// `tasks`, so a clean shutdown resigns before the store closes). The receiver reads
/// true while this server holds the role.
pub fn hold(
    store: Store,
    role: &'static str,
    holder: String,
    tasks: &tokio_util::task::TaskTracker,
    stop: CancellationToken,
) -> watch::Receiver<bool> {
    let (leading, rx) = watch::channel(false);
    tasks.spawn(crate::store::own_task(async move {
        loop {
            let now = match store.lead(role, &holder, now_ms(), TTL.as_millis() as i64).await {
                Ok(held) => held,
                Err(e) => {
                    tracing::warn!(role, error = %e, "cannot renew the role's lease; stepping down");
                    false
                }
            };
            leading.send_if_modified(|was| {
                if *was != now {
                    tracing::info!(role, leading = now, "role changed hands");
                }
                std::mem::replace(was, now) != now
            });
            tokio::select! {
                () = tokio::time::sleep(RENEW) => {}
                () = stop.cancelled() => break,
            }
        }
        leading.send_replace(false);
        if let Err(e) = store.resign(role, &holder).await {
            tracing::warn!(role, error = %e, "cannot give up the role; it lapses by itself");
        }
    }));
    rx
}

/// What `hold_one` reads of its roles.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Held {
    /// The role this server holds (its index), None while none: every role is held by
    /// another server, or the store cannot be reached.
    pub mine: Option<usize>,
    /// The roles some server holds (indices, ascending), read each renewal period;
    /// empty when it could not be read.
    pub live: Vec<usize>,
}

/// Holds one of `roles` at a time for `holder` (the first free, in order: servers
/// sharing a store each take another), until `stop`, then gives it up (a holder that
/// cannot renew steps down at once). The receiver reads which, and which are held.
pub fn hold_one(
    store: Store,
    roles: Vec<String>,
    holder: String,
    tasks: &tokio_util::task::TaskTracker,
    stop: CancellationToken,
) -> watch::Receiver<Held> {
    let (held_tx, rx) = watch::channel(Held::default());
    tasks.spawn(crate::store::own_task(async move {
        let publish = |mine: Option<usize>, live: Option<Vec<usize>>| {
            held_tx.send_if_modified(|was| {
                if was.mine != mine {
                    tracing::info!(role = mine.map(|k| roles[k].as_str()), "role changed hands");
                }
                let next = Held {
                    mine,
                    live: live.unwrap_or_else(|| was.live.clone()),
                };
                std::mem::replace(was, next.clone()) != next
            });
        };
        let mut held: Option<usize> = None;
        loop {
            if let Some(k) = held {
                match lead_within(&store, &roles[k], &holder).await {
                    Ok(true) => {}
                    Ok(false) => held = None,
                    Err(e) => {
                        tracing::warn!(role = roles[k], error = %e, "cannot renew the role's lease; stepping down");
                        held = None;
                    }
                }
                // Stepped down before trying the others: each try may take a while.
                publish(held, None);
            }
            if held.is_none() {
                for (k, role) in roles.iter().enumerate() {
                    if let Ok(true) = lead_within(&store, role, &holder).await {
                        held = Some(k);
                        break;
                    }
                }
            }
            let live = match tokio::time::timeout(RENEW, store.held_roles(now_ms())).await {
                Ok(Ok(held_roles)) => (0..roles.len())
                    .filter(|k| held_roles.contains(&roles[*k]))
                    .collect(),
                _ => Vec::new(),
            };
            publish(held, Some(live));
            tokio::select! {
                () = tokio::time::sleep(RENEW) => {}
                () = stop.cancelled() => break,
            }
        }
        held_tx.send_replace(Held::default());
        if let Some(k) = held
            && let Err(e) = store.resign(&roles[k], &holder).await
        {
            tracing::warn!(role = roles[k], error = %e, "cannot give up the role; it lapses by itself");
        }
    }));
    rx
}

/// Takes or renews `role` for `holder`, in at most `RENEW`: a renewal stuck behind a
/// busy store must end, and its holder step down, well before the lease lapses for the
/// others.
async fn lead_within(
    store: &Store,
    role: &str,
    holder: &str,
) -> Result<bool, crate::store::StoreError> {
    let call = store.lead(role, holder, now_ms(), TTL.as_millis() as i64);
    match tokio::time::timeout(RENEW, call).await {
        Ok(result) => result,
        Err(_) => Err(crate::store::StoreError::Unavailable(
            sqlx::Error::PoolTimedOut,
        )),
    }
}

/// Waits until `leading` reads true; false if `stop` came first.
pub async fn until_leading(leading: &mut watch::Receiver<bool>, stop: &CancellationToken) -> bool {
    tokio::select! {
        got = leading.wait_for(|l| *l) => got.is_ok(),
        () = stop.cancelled() => false,
    }
}
