//! Row decoding both backends share: the columns each query selects, as Rust tuples of
//! the types SQLite and PostgreSQL both return (TEXT as String, BIGINT as i64), and how
//! they become the store's records. A value that does not parse is `Corrupt`, named.

use std::str::FromStr;

use crate::api::event::Event;
use crate::api::image::{Artifact, Image, Role};
use crate::api::node::StateChange;
use crate::api::{Digest, Mac, NodeState};
use crate::clock::format_ms;
use crate::store::{BootFacts, Fetch, LeaseRow, NodeRecord, StoreError};

pub(crate) fn parse_digest(s: &str) -> Result<Digest, StoreError> {
    Digest::from_str(s).map_err(|e| StoreError::Corrupt(e.to_string()))
}

pub(crate) fn mac(s: &str) -> Result<Mac, StoreError> {
    s.parse()
        .map_err(|e: crate::api::MacError| StoreError::Corrupt(e.to_string()))
}

pub(crate) fn state(s: &str) -> Result<NodeState, StoreError> {
    NodeState::parse(s).ok_or_else(|| StoreError::Corrupt(format!("state {s:?}")))
}

/// A JSON column, named in the error.
pub(crate) fn json(
    column: &str,
    text: Option<String>,
) -> Result<Option<serde_json::Value>, StoreError> {
    text.map(|t| serde_json::from_str(&t))
        .transpose()
        .map_err(|e| StoreError::Corrupt(format!("{column}: {e}")))
}

/// Every column of `nodes`, in `NODE_COLUMNS` order.
pub(crate) type NodeRow = (
    String,
    Option<String>,
    Option<String>,
    String,
    Option<String>,
    String,
    String,
    i64,
    i64,
    i64,
    Option<String>,
    bool,
);

/// The columns `NodeRow` holds, in its order.
macro_rules! node_columns {
    () => {
        "mac, uuid, hostname, labels, assigned_ref, state, state_reason, version, created_at_ms, updated_at_ms, bmc, revalidate_requested"
    };
}

pub(crate) use node_columns;

/// The columns `NodeRow` holds, for `SELECT`s of both backends.
macro_rules! select_nodes {
    ($rest:literal) => {
        concat!(
            "SELECT ",
            $crate::store::rows::node_columns!(),
            " FROM nodes ",
            $rest
        )
    };
}

pub(crate) use select_nodes;

pub(crate) fn node(r: NodeRow) -> Result<NodeRecord, StoreError> {
    let corrupt = |m: String| StoreError::Corrupt(m);
    Ok(NodeRecord {
        mac: mac(&r.0)?,
        uuid: r.1,
        hostname: r.2,
        labels: serde_json::from_str(&r.3).map_err(|e| corrupt(format!("labels: {e}")))?,
        assigned: r.4,
        state: state(&r.5)?,
        state_reason: r.6,
        version: r.7,
        created_at: format_ms(r.8),
        updated_at: format_ms(r.9),
        bmc: r
            .10
            .map(|b| serde_json::from_str(&b))
            .transpose()
            .map_err(|e| corrupt(format!("bmc: {e}")))?,
        revalidate_requested: r.11,
    })
}

pub(crate) fn nodes(rows: Vec<NodeRow>) -> Result<Vec<NodeRecord>, StoreError> {
    rows.into_iter().map(node).collect()
}

/// Every node's state, labels and newest boot's image, the same on both backends but
/// for the column that orders boots as inserted (the newest is the one begun last,
/// whatever the clock said).
macro_rules! census {
    ($insertion_order:literal) => {
        concat!(
            "SELECT n.state, n.labels, n.updated_at_ms,
    (SELECT b.image_digest FROM boots b WHERE b.mac = n.mac
      ORDER BY b.",
            $insertion_order,
            " DESC LIMIT 1)
  FROM nodes n"
        )
    };
}
pub(crate) const CENSUS_SQLITE: &str = census!("rowid");
pub(crate) const CENSUS_POSTGRES: &str = census!("seq");

/// `state, labels, updated_at_ms, newest boot's image` of `CENSUS_*`.
pub(crate) type CensusTuple = (String, String, i64, Option<String>);

pub(crate) fn census(rows: Vec<CensusTuple>) -> Result<Vec<crate::store::CensusRow>, StoreError> {
    rows.into_iter()
        .map(|(s, labels, since_ms, image)| {
            Ok(crate::store::CensusRow {
                state: state(&s)?,
                since_ms,
                labels: serde_json::from_str(&labels)
                    .map_err(|e| StoreError::Corrupt(format!("labels: {e}")))?,
                image: image.as_deref().map(parse_digest).transpose()?,
            })
        })
        .collect()
}

/// `from_state, to_state, reason, at_ms, actor` of `node_history`.
pub(crate) type HistoryRow = (Option<String>, String, String, i64, Option<String>);

pub(crate) fn history(rows: Vec<HistoryRow>) -> Result<Vec<StateChange>, StoreError> {
    rows.into_iter()
        .map(|(from, to, reason, at, actor)| {
            Ok(StateChange {
                from: from.as_deref().map(state).transpose()?,
                to: state(&to)?,
                reason,
                at: format_ms(at),
                actor,
            })
        })
        .collect()
}

/// `mac, state, last seen` of the sweeper's query.
pub(crate) fn last_seen(
    rows: Vec<(String, String, i64)>,
) -> Result<Vec<(Mac, NodeState, i64)>, StoreError> {
    rows.into_iter()
        .map(|(m, s, seen)| Ok((mac(&m)?, state(&s)?, seen)))
        .collect()
}

/// `seq, at_ms, kind, mac, data, actor` of `events`.
pub(crate) type EventRow = (i64, i64, String, Option<String>, String, Option<String>);

pub(crate) fn events(rows: Vec<EventRow>) -> Result<Vec<Event>, StoreError> {
    rows.into_iter()
        .map(|(seq, at, kind, node, data, actor)| {
            Ok(Event {
                seq,
                at: format_ms(at),
                kind,
                node: node.as_deref().map(mac).transpose()?,
                data: serde_json::from_str(&data)
                    .map_err(|e| StoreError::Corrupt(format!("event {seq}: {e}")))?,
                actor,
            })
        })
        .collect()
}

pub(crate) fn event_data(data: &(impl serde::Serialize + Sync)) -> Result<String, StoreError> {
    serde_json::to_string(data).map_err(|e| StoreError::Corrupt(format!("event data: {e}")))
}

/// `mac, ip, expires_ms` of `dhcp_leases`.
pub(crate) fn leases(rows: Vec<(String, String, i64)>) -> Result<Vec<LeaseRow>, StoreError> {
    rows.into_iter()
        .map(|(m, ip, expires_ms)| {
            Ok(LeaseRow {
                mac: mac(&m)?,
                ip: ip
                    .parse()
                    .map_err(|_| StoreError::Corrupt(format!("lease address {ip:?}")))?,
                expires_ms,
            })
        })
        .collect()
}

/// `digest, started_at_ms, finished_at_ms, offset_bytes, bytes, whole` of `boot_fetches`.
pub(crate) type FetchRow = (String, i64, Option<i64>, i64, i64, bool);

pub(crate) fn fetches(rows: Vec<FetchRow>) -> Result<Vec<Fetch>, StoreError> {
    rows.into_iter()
        .map(|(d, started, finished, offset, bytes, whole)| {
            Ok(Fetch {
                digest: parse_digest(&d)?,
                started_at_ms: started,
                finished_at_ms: finished,
                offset: offset.max(0) as u64,
                bytes: bytes.max(0) as u64,
                whole,
            })
        })
        .collect()
}

/// The columns of `boots` that `BootRow` holds, for `SELECT`s of both backends.
macro_rules! select_boots {
    ($rest:literal) => {
        concat!(
            "SELECT id, image_digest, created_at_ms, attested_at_ms, verdict, report, validated_at_ms, validation, preboot FROM boots ",
            $rest
        )
    };
}

pub(crate) use select_boots;

pub(crate) type BootRow = (
    String,
    String,
    i64,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<String>,
    Option<String>,
);

pub(crate) fn boot(row: BootRow, fetches: Vec<Fetch>) -> Result<BootFacts, StoreError> {
    let (id, image, created, attested, verdict, report, validated, validation, preboot) = row;
    Ok(BootFacts {
        image: parse_digest(&image)?,
        created_at_ms: created,
        attested_at_ms: attested,
        verdict: json("boots.verdict", verdict)?,
        report: json("boots.report", report)?,
        validated_at_ms: validated,
        validation: json("boots.validation", validation)?,
        preboot: json("boots.preboot", preboot)?,
        fetches,
        id,
    })
}

/// `digest, name, version, created_at_ms` of `images`.
pub(crate) type ImageRow = (String, String, String, i64);
/// `role, path, blob_digest, size` of `image_artifacts`.
pub(crate) type ArtifactRow = (String, String, String, i64);

pub(crate) fn image(
    (d, name, version, created): ImageRow,
    artifacts: Vec<ArtifactRow>,
    tags: Vec<(String, String)>,
) -> Result<Image, StoreError> {
    Ok(Image {
        digest: parse_digest(&d)?,
        name,
        version,
        created_at: format_ms(created),
        artifacts: artifacts
            .into_iter()
            .map(|(role, path, d, size)| {
                Ok(Artifact {
                    role: Role::parse(&role)
                        .ok_or_else(|| StoreError::Corrupt(format!("role {role}")))?,
                    path,
                    digest: parse_digest(&d)?,
                    size: size as u64,
                })
            })
            .collect::<Result<_, StoreError>>()?,
        tags: tags.into_iter().map(|(n, t)| format!("{n}:{t}")).collect(),
        // Filled by the registry from `broken_blobs`.
        broken: None,
    })
}

/// `from_digest, to_digest, actor, at_ms` of `tag_history`.
pub(crate) fn tag_history(
    tag: &crate::api::refs::TagName,
    rows: Vec<(Option<String>, String, String, i64)>,
) -> Result<Vec<crate::api::image::TagMove>, StoreError> {
    rows.into_iter()
        .map(|(from, to, actor, at)| {
            Ok(crate::api::image::TagMove {
                tag: tag.to_string(),
                from: from.as_deref().map(parse_digest).transpose()?,
                to: parse_digest(&to)?,
                from_version: None,
                to_version: String::new(),
                actor,
                at: format_ms(at),
            })
        })
        .collect()
}

/// `name, tag, image_digest, updated_at_ms` of `tags`.
pub(crate) fn tags(
    rows: Vec<(String, String, String, i64)>,
) -> Result<Vec<crate::api::image::Tag>, StoreError> {
    rows.into_iter()
        .map(|(name, tag, d, at)| {
            Ok(crate::api::image::Tag {
                tag: format!("{name}:{tag}"),
                digest: parse_digest(&d)?,
                updated_at: format_ms(at),
            })
        })
        .collect()
}

/// `name, tag` of `tags`, `mac` of `nodes`, and `mac, state` of `nodes`: what uses an image.
pub(crate) fn image_users(
    tags: Vec<(String, String)>,
    assigned: Vec<(String,)>,
    last_booted: Vec<(String, String)>,
) -> Result<crate::store::ImageUsers, StoreError> {
    Ok(crate::store::ImageUsers {
        tags: tags.into_iter().map(|(n, t)| format!("{n}:{t}")).collect(),
        assigned: assigned
            .iter()
            .map(|(m,)| mac(m))
            .collect::<Result<_, _>>()?,
        last_booted: last_booted
            .iter()
            .map(|(m, s)| Ok((mac(m)?, state(s)?)))
            .collect::<Result<_, StoreError>>()?,
    })
}

/// `at_ms, action, reason, outcome, took_ms` of `power_actions`.
pub(crate) type PowerRowTuple = (i64, String, String, String, i64);

pub(crate) fn power_row(r: PowerRowTuple) -> crate::store::PowerRow {
    crate::store::PowerRow {
        at_ms: r.0,
        action: r.1,
        reason: r.2,
        outcome: r.3,
        took_ms: r.4,
    }
}

/// `id, bmc, uuid, macs, registered_ms` of `bmc_registrations`.
pub(crate) type RegistrationTuple = (i64, String, Option<String>, String, i64);

pub(crate) fn registration(
    r: RegistrationTuple,
) -> Result<crate::api::power::BmcRegistration, StoreError> {
    Ok(crate::api::power::BmcRegistration {
        id: r.0,
        bmc: serde_json::from_str(&r.1)
            .map_err(|e| StoreError::Corrupt(format!("registration bmc: {e}")))?,
        uuid: r.2,
        macs: serde_json::from_str(&r.3)
            .map_err(|e| StoreError::Corrupt(format!("registration macs: {e}")))?,
        registered: format_ms(r.4),
    })
}

/// The `LIKE` pattern that finds `mac` in a registration's JSON list of MACs.
pub(crate) fn mac_pattern(mac: &Mac) -> String {
    format!("%\"{mac}\"%")
}

/// A `rollouts` row as both backends read it.
#[derive(sqlx::FromRow)]
pub(crate) struct RolloutRowRaw {
    id: i64,
    spec: String,
    digest: String,
    state: String,
    state_reason: String,
    wave: i64,
    version: i64,
    created_at_ms: i64,
    updated_at_ms: i64,
}

/// The columns `RolloutRowRaw` holds, for `SELECT`s of both backends.
macro_rules! select_rollouts {
    ($rest:literal) => {
        concat!(
            "SELECT id, spec, digest, state, state_reason, wave, version, created_at_ms, updated_at_ms FROM rollouts ",
            $rest
        )
    };
}
pub(crate) use select_rollouts;

pub(crate) fn rollout(r: RolloutRowRaw) -> Result<crate::store::RolloutRow, StoreError> {
    use crate::api::rollout::RolloutState;
    Ok(crate::store::RolloutRow {
        id: r.id,
        spec_json: r.spec,
        digest: r
            .digest
            .parse()
            .map_err(|e| StoreError::Corrupt(format!("rollout {} digest: {e}", r.id)))?,
        state: RolloutState::parse(&r.state)
            .ok_or_else(|| StoreError::Corrupt(format!("rollout {} state {:?}", r.id, r.state)))?,
        state_reason: r.state_reason,
        wave: u32::try_from(r.wave).unwrap_or(u32::MAX),
        version: r.version,
        created_at_ms: r.created_at_ms,
        updated_at_ms: r.updated_at_ms,
    })
}

/// A `rollout_nodes` row as both backends read it.
#[derive(sqlx::FromRow)]
pub(crate) struct RolloutNodeRaw {
    mac: String,
    wave: i64,
    position: i64,
    status: String,
    previous_assigned: Option<String>,
    previous_digest: Option<String>,
    reason: String,
    started_at_ms: Option<i64>,
    finished_at_ms: Option<i64>,
}

/// The columns `RolloutNodeRaw` holds, for `SELECT`s of both backends.
macro_rules! select_rollout_nodes {
    ($rest:literal) => {
        concat!(
            "SELECT mac, wave, position, status, previous_assigned, previous_digest, reason, started_at_ms, finished_at_ms FROM rollout_nodes ",
            $rest
        )
    };
}
pub(crate) use select_rollout_nodes;

pub(crate) fn rollout_node(r: RolloutNodeRaw) -> Result<crate::store::RolloutNodeRow, StoreError> {
    use crate::api::rollout::StepStatus;
    let corrupt = |what: &str| StoreError::Corrupt(format!("rollout node {}: {what}", r.mac));
    Ok(crate::store::RolloutNodeRow {
        mac: r.mac.parse().map_err(|_| corrupt("mac"))?,
        wave: u32::try_from(r.wave).map_err(|_| corrupt("wave"))?,
        position: u32::try_from(r.position).map_err(|_| corrupt("position"))?,
        status: StepStatus::parse(&r.status).ok_or_else(|| corrupt("status"))?,
        previous_assigned: r.previous_assigned,
        previous_digest: r
            .previous_digest
            .map(|d| d.parse())
            .transpose()
            .map_err(|_| corrupt("previous digest"))?,
        reason: r.reason,
        started_at_ms: r.started_at_ms,
        finished_at_ms: r.finished_at_ms,
    })
}

/// `name, role, created_at_ms, created_by, revoked_at_ms, revoked_by` of `api_tokens`.
pub(crate) type TokenColumns = (String, String, i64, String, Option<i64>, Option<String>);

pub(crate) fn token(
    (name, role, created_at_ms, created_by, revoked_at_ms, revoked_by): TokenColumns,
) -> Result<crate::store::TokenRow, StoreError> {
    Ok(crate::store::TokenRow {
        role: role
            .parse()
            .map_err(|e| StoreError::Corrupt(format!("token {name}: {e}")))?,
        name,
        created_at_ms,
        created_by,
        revoked_at_ms,
        revoked_by,
    })
}

/// A `tpm_enrolments` row: mac, ek_name, certified (0/1), enrolled_at_ms.
pub(crate) type TpmEnrolmentRow = (String, String, i64, i64);

pub(crate) fn tpm_enrolment(
    (mac_text, ek_name, certified, enrolled_at_ms): TpmEnrolmentRow,
) -> Result<crate::store::TpmEnrolment, StoreError> {
    Ok(crate::store::TpmEnrolment {
        mac: mac(&mac_text)?,
        ek_name,
        certified: certified != 0,
        enrolled_at_ms,
    })
}

/// A `tpm_challenges` row: boot_id, mac, ak_public, ek_name, secret_sha256, issued_at_ms.
pub(crate) type TpmChallengeTuple = (String, String, String, String, String, i64);

pub(crate) fn tpm_challenge(
    (boot_id, mac_text, ak_public, ek_name, secret_sha256, issued_at_ms): TpmChallengeTuple,
) -> Result<crate::store::TpmChallengeRow, StoreError> {
    Ok(crate::store::TpmChallengeRow {
        boot_id,
        mac: mac(&mac_text)?,
        ak_public,
        ek_name,
        secret_sha256,
        issued_at_ms,
    })
}

/// A boot as the token check reads it: mac, image, token hash, created, the node's newest
/// boot's id, attested at, the verdict's `passed`.
pub(crate) type BootForAttestRow = (
    String,
    String,
    String,
    i64,
    String,
    Option<i64>,
    Option<bool>,
);

pub(crate) fn boot_for_attest(
    id: &str,
    (mac_text, image, token, created_at_ms, latest, attested_at, passed): BootForAttestRow,
) -> Result<crate::store::BootForAttest, StoreError> {
    Ok(crate::store::BootForAttest {
        mac: mac(&mac_text)?,
        image: parse_digest(&image)?,
        token_sha256: parse_digest(&token)?,
        created_at_ms,
        latest: latest == id,
        attestation: attested_at.map(|at_ms| crate::store::Attestation {
            at_ms,
            passed: passed == Some(true),
        }),
    })
}
