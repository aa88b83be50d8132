//! The store battery: every test here runs on SQLite and on PostgreSQL (`on_both!`), and
//! most open the store twice, as two servers would, and race the two handles (on SQLite
//! two write gates on one file; a server refuses a second process on its database, and
//! each handle's caches know its own writes only). What holds
//! inside one process must hold across servers: compare-and-set, the disruption budget,
//! a token attesting once, answered-once flags, one event order without gaps, one holder
//! per role.

use std::collections::BTreeSet;

use bootfleet::api::{Digest, Mac, NodeState};

use crate::harness::Tmpfs;
use bootfleet::store::{
    Attached, CasOutcome, Fetch, InsertOutcome, KeyClaim, LeaseRow, NewBoot, NewImage,
    ReimageDecision, ReimageOutcome, Store, StoreUrl,
};

/// One database, which tests may open more than once.
enum Db {
    Sqlite(tempfile::TempDir),
    Postgres(String),
}

impl Db {
    async fn sqlite() -> Self {
        Db::Sqlite(tempfile::tempdir().unwrap())
    }
    async fn postgres() -> Self {
        Db::Postgres(crate::pg::database().await)
    }
    /// A handle of its own: another server's view of the same database.
    async fn open(&self) -> Store {
        let url = match self {
            Db::Sqlite(dir) => StoreUrl::Sqlite(dir.path().join("bootfleet.db")),
            Db::Postgres(url) => StoreUrl::parse(url).unwrap(),
        };
        bootfleet::store::open(&url, None, None).await.unwrap()
    }
}

/// `test_name::sqlite` and `test_name::postgres` for each battery function.
macro_rules! on_both {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sqlite() {
                super::$name(super::Db::sqlite().await).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                super::$name(super::Db::postgres().await).await
            }
        }
    )*};
}

on_both!(
    compare_and_set_lets_one_writer_win_across_servers,
    the_budget_holds_when_two_servers_decide_at_once,
    a_boot_attests_once_across_servers,
    a_revalidation_request_is_answered_once,
    events_have_one_order_without_gaps,
    one_server_holds_a_role_until_it_lapses,
    one_publish_of_a_version_wins,
    every_write_is_seen_by_the_next_dhcp_read,
    leases_fetches_tags_and_idempotency_keys_round_trip,
    events_are_pruned_oldest_first_and_numbering_goes_on,
    new_macs_stop_being_recorded_at_the_discovery_cap,
    digest_prefixes_name_one_image_or_none,
    a_node_is_removed_whole_under_its_version,
    an_image_is_removed_with_the_boots_that_ran_it,
    a_bmc_registration_is_matched_once_by_mac_or_uuid,
    rollouts_claim_their_nodes_once_and_steps_move_by_compare_and_set,
    a_token_name_is_taken_once_and_revoked_once_with_its_actor,
    a_revalidation_behind_a_drain_is_queued_moved_and_ended_once,
    a_feed_that_fell_behind_a_pruned_revocation_ends,
    a_state_change_from_an_out_of_date_record_is_retried_from_the_store,
    a_change_through_a_state_writes_both_steps_or_neither,
    a_newer_boot_expires_the_older_token_and_an_attestation_shows_at_once,
    a_boot_begun_after_the_clock_stepped_back_is_still_the_newest,
    a_uuid_kept_by_another_server_stays_the_nodes,
    a_flush_of_heartbeats_keeps_each_nodes_latest,
    callers_going_away_mid_write_leave_every_change_whole,
);

fn mac(i: u32) -> Mac {
    format!("52:54:00:00:{:02x}:{:02x}", i >> 8, i & 0xff)
        .parse()
        .unwrap()
}

/// An image row for boots to point at.
async fn image(store: &Store, name: &str, version: &str) -> Digest {
    let canonical = format!("{name}:{version}");
    let digest = Digest::of(canonical.as_bytes());
    let img = NewImage {
        digest,
        name,
        version,
        manifest_toml: "",
        canonical: canonical.as_bytes(),
        artifacts: &[],
    };
    assert_eq!(
        store.insert_image(&img).await.unwrap(),
        InsertOutcome::Inserted
    );
    digest
}

/// Opens boot `id` of `image` for `mac` as a served script does: the node moves to
/// provisioning with the boot row. Returns the node after.
async fn open_boot(
    store: &Store,
    mac: &Mac,
    id: &str,
    image: &Digest,
    preboot_json: Option<&str>,
) -> bootfleet::store::NodeRecord {
    let node = store.node(mac).await.unwrap().expect("the node exists");
    let token = Digest::of(b"token");
    let boot = Attached::Boot(NewBoot {
        id,
        image,
        token_sha256: &token,
        preboot_json,
    });
    let opened = store
        .set_state(
            mac,
            node.version,
            node.state,
            NodeState::Provisioning,
            "boot",
            Some(&boot),
        )
        .await
        .unwrap();
    match opened {
        CasOutcome::Done(node) => *node,
        other => panic!("boot {id} did not open: {other:?}"),
    }
}

/// What refers to an image is found (tags, assignments, the nodes whose newest boot ran
/// it), and removing it takes its rows and the boot records that ran it.
async fn an_image_is_removed_with_the_boots_that_ran_it(db: Db) {
    let store = db.open().await;
    let old = image(&store, "demo", "1").await;
    let new = image(&store, "demo", "2").await;
    let mac = mac(50);
    store.discover(&mac, None, "test").await.unwrap();
    for (id, digest) in [("boot-old", &old), ("boot-new", &new)] {
        open_boot(&store, &mac, id, digest, None).await;
    }
    store.assign(&mac, "demo:2").await.unwrap();
    store
        .set_tag(
            &bootfleet::api::refs::TagName::parse("demo:stable").unwrap(),
            &new,
            "test",
        )
        .await
        .unwrap();
    let users = store.image_users(&new, "demo:2").await.unwrap();
    assert_eq!(users.tags, ["demo:stable"]);
    assert_eq!(users.assigned, [mac]);
    assert_eq!(users.last_booted.len(), 1);
    assert_eq!(users.last_booted[0].0, mac);
    let users = store.image_users(&old, "demo:1").await.unwrap();
    assert_eq!(
        users,
        bootfleet::store::ImageUsers::default(),
        "the old image is unused"
    );
    // Another node's newest boot ran it (the SQLite store keeps it in memory, for the
    // agent API's token check): it goes too.
    let other = self::mac(51);
    store.discover(&other, None, "test").await.unwrap();
    open_boot(&store, &other, "boot-before", &new, None).await;
    open_boot(&store, &other, "boot-other", &old, None).await;
    let read = store.boot_for_attest("boot-other").await.unwrap();
    assert!(read.is_some_and(|b| b.latest));
    // Resolved before (SQLite keeps the answer in memory): not after.
    let by_digest = bootfleet::api::refs::ImageRef::Digest(old);
    let by_name = bootfleet::api::refs::ImageRef::Named {
        name: "demo".into(),
        label: "1".into(),
    };
    assert_eq!(store.resolve(&by_digest).await.unwrap(), Some(old));
    assert_eq!(store.resolve(&by_name).await.unwrap(), Some(old));

    assert_eq!(
        store.remove_image(&old).await.unwrap(),
        bootfleet::store::Removed::Done
    );
    assert!(store.image(&old).await.unwrap().is_none());
    assert_eq!(store.resolve(&by_digest).await.unwrap(), None);
    assert_eq!(store.resolve(&by_name).await.unwrap(), None);
    let boots: Vec<String> = store
        .boot_facts(&mac, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|b| b.id)
        .collect();
    assert_eq!(boots, ["boot-new"], "the old image's boot went with it");
    assert!(store.boot_for_attest("boot-other").await.unwrap().is_none());
    assert!(store.boot_for_attest("boot-old").await.unwrap().is_none());
    let kept = store.boot_for_attest("boot-new").await.unwrap().unwrap();
    assert_eq!(
        kept.token_sha256,
        Digest::of(b"token"),
        "a newest boot keeps its token"
    );
    // The other node's boot before is its newest again, and its token is no token's.
    let before = store.boot_for_attest("boot-before").await.unwrap().unwrap();
    assert_eq!(
        before.token_sha256.to_string(),
        bootfleet::store::REVOKED_TOKEN_SHA256
    );
    assert!(store.image(&new).await.unwrap().is_some());
    assert_eq!(
        store.remove_image(&old).await.unwrap(),
        bootfleet::store::Removed::Missing
    );
    store.close().await;
}

/// Removing a node takes its history, boots and their downloads with it, in one
/// transaction with a `node.removed` event, and only at the version it was read at.
async fn a_node_is_removed_whole_under_its_version(db: Db) {
    let store = db.open().await;
    let digest = image(&store, "demo", "1").await;
    let mac = mac(40);
    store.discover(&mac, None, "test").await.unwrap();
    let preboot = r#"[{"step":"dhcp ack","at_ms":1,"outcome":"ok"}]"#;
    let node = open_boot(&store, &mac, "boot-rm", &digest, Some(preboot)).await;
    assert!(store.boot_for_attest("boot-rm").await.unwrap().is_some());
    let fetch = Fetch {
        digest,
        started_at_ms: 1,
        finished_at_ms: Some(2),
        offset: 0,
        bytes: 10,
        whole: true,
    };
    store
        .record_fetches(&[("boot-rm".to_string(), fetch)])
        .await
        .unwrap();
    let data = bootfleet::api::event::NodeRemovedData {
        state: node.state,
        reason: "decommissioned".into(),
    };
    let head = store.events_head().await.unwrap();
    assert_eq!(
        store
            .remove_node(&mac, node.version - 1, &data)
            .await
            .unwrap(),
        bootfleet::store::Removed::Stale
    );
    assert!(
        store.node(&mac).await.unwrap().is_some(),
        "a stale removal changes nothing"
    );
    assert_eq!(
        store.remove_node(&mac, node.version, &data).await.unwrap(),
        bootfleet::store::Removed::Done
    );
    assert!(store.node(&mac).await.unwrap().is_none());
    assert!(
        store.node_for_dhcp(&mac).await.unwrap().is_none(),
        "not cached either"
    );
    assert!(store.boot_facts(&mac, 10).await.unwrap().is_empty());
    assert!(
        store.boot_for_attest("boot-rm").await.unwrap().is_none(),
        "its token names no boot, in memory either"
    );
    assert!(store.node_history(&mac).await.unwrap().is_empty());
    assert!(store.fetches("boot-rm").await.unwrap().is_empty());
    let events = store.events_since(head, 10, None).await.unwrap();
    let removed = events.last().expect("an event");
    assert_eq!(removed.kind, "node.removed");
    assert_eq!(removed.data["reason"], "decommissioned");
    assert_eq!(
        store.remove_node(&mac, node.version, &data).await.unwrap(),
        bootfleet::store::Removed::Missing
    );
    // The MAC can come back as a new node.
    let (again, new) = store.discover(&mac, None, "seen again").await.unwrap();
    assert!(new && again.state == NodeState::Discovered);
    store.close().await;
}

/// A digest prefix resolves when one image's digest begins so; when several do, the
/// registry refuses it naming two and asking for more digits.
async fn digest_prefixes_name_one_image_or_none(db: Db) {
    let store = db.open().await;
    let with = |hex_start: &str| -> Digest {
        format!("sha256:{hex_start}{}", "0".repeat(64 - hex_start.len()))
            .parse()
            .unwrap()
    };
    let (a, b, c) = (with("0123abcd1"), with("0123abcd2"), with("feedbeef"));
    for (d, v) in [(a, "1"), (b, "2"), (c, "3")] {
        let canonical = format!("p:{v}");
        let img = NewImage {
            digest: d,
            name: "p",
            version: v,
            manifest_toml: "",
            canonical: canonical.as_bytes(),
            artifacts: &[],
        };
        store.insert_image(&img).await.unwrap();
    }
    let prefix = |p: &str| bootfleet::api::refs::ImageRef::DigestPrefix(p.into());
    assert_eq!(
        store.digests_with_prefix("0123abcd", 5).await.unwrap(),
        [a, b]
    );
    assert_eq!(store.resolve(&prefix("0123abcd")).await.unwrap(), None);
    assert_eq!(store.resolve(&prefix("0123abcd2")).await.unwrap(), Some(b));
    assert_eq!(store.resolve(&prefix("feedbeef")).await.unwrap(), Some(c));
    assert_eq!(store.resolve(&prefix("feedbeee")).await.unwrap(), None);

    let dir = tempfile::tempdir().unwrap();
    let registry = bootfleet::registry::Registry::new(
        store.clone(),
        bootfleet::image::blobstore::BlobStore::open(dir.path()).unwrap(),
        Default::default(),
    );
    let err = registry.resolve(&prefix("0123abcd")).await.unwrap_err();
    assert!(
        err.to_string().contains("ambiguous") && err.to_string().contains(&a.to_string()),
        "{err}"
    );
    assert_eq!(registry.resolve(&prefix("0123abcd1")).await.unwrap(), a);
    store.close().await;
}

async fn compare_and_set_lets_one_writer_win_across_servers(db: Db) {
    let (a, b) = (db.open().await, db.open().await);
    let mac = mac(1);
    let (node, _) = a.discover(&mac, None, "test").await.unwrap();
    let (x, y) = tokio::join!(
        a.set_state(
            &mac,
            node.version,
            node.state,
            NodeState::Provisioning,
            "a",
            None
        ),
        b.set_state(
            &mac,
            node.version,
            node.state,
            NodeState::Reimaging,
            "b",
            None
        ),
    );
    let outcomes = [x.unwrap(), y.unwrap()];
    let done = outcomes
        .iter()
        .filter(|o| matches!(o, CasOutcome::Done(_)))
        .count();
    let stale = outcomes
        .iter()
        .filter(|o| matches!(o, CasOutcome::Stale))
        .count();
    assert_eq!((done, stale), (1, 1), "{outcomes:?}");
    assert_eq!(
        b.node_history(&mac).await.unwrap().len(),
        2,
        "one history row for the one change that landed"
    );
    a.close().await;
    b.close().await;
}

async fn the_budget_holds_when_two_servers_decide_at_once(db: Db) {
    let (a, b) = (db.open().await, db.open().await);
    let nodes: Vec<Mac> = (0..20).map(mac).collect();
    for m in &nodes {
        a.discover(m, None, "test").await.unwrap();
    }
    // At most two reimaging at once, whoever asks.
    let rule = |_: &bootfleet::store::NodeRecord, reimaging: &[bootfleet::store::NodeRecord]| {
        if reimaging.len() >= 2 {
            ReimageDecision::OverBudget(format!("{} reimaging", reimaging.len()))
        } else {
            ReimageDecision::Move(NodeState::Reimaging)
        }
    };
    let asks = nodes.iter().enumerate().map(|(i, m)| {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        async move { store.request_reimage(m, "test", &rule).await.unwrap() }
    });
    let outcomes = futures_util::future::join_all(asks).await;
    let accepted = outcomes
        .iter()
        .filter(|o| matches!(o, ReimageOutcome::Accepted(_)))
        .count();
    assert_eq!(accepted, 2, "{outcomes:?}");
    let reimaging = b
        .nodes()
        .await
        .unwrap()
        .into_iter()
        .filter(|n| n.state == NodeState::Reimaging)
        .count();
    assert_eq!(reimaging, 2);
    a.close().await;
    b.close().await;
}

/// Heartbeats are stored a flush at a time, many nodes to a statement: each node keeps the
/// latest time heard (given twice in one flush, or older than what is stored), and a MAC
/// with no node writes nothing.
async fn a_flush_of_heartbeats_keeps_each_nodes_latest(db: Db) {
    let store = db.open().await;
    let digest = image(&store, "demo", "1").await;
    let (a, b) = (mac(1), mac(2));
    for (m, id) in [(a, "boot-a"), (b, "boot-b")] {
        store.discover(&m, None, "test").await.unwrap();
        open_boot(&store, &m, id, &digest, None).await;
    }
    // Ahead of the boots' state changes, which `last_seen` also counts.
    let h = bootfleet::clock::now_ms() + 3_600_000;
    let seen = |store: Store| async move {
        let mut seen: Vec<(Mac, i64)> = store
            .last_seen()
            .await
            .unwrap()
            .into_iter()
            .map(|(m, _, at)| (m, at))
            .collect();
        seen.sort();
        seen
    };
    store
        .record_heartbeats(&[(a, h), (b, h + 5), (a, h + 10), (b, h + 1), (mac(99), h)])
        .await
        .unwrap();
    assert_eq!(seen(store.clone()).await, vec![(a, h + 10), (b, h + 5)]);
    store.record_heartbeats(&[(a, h + 1)]).await.unwrap();
    assert_eq!(seen(store.clone()).await, vec![(a, h + 10), (b, h + 5)]);
    // More than a statement holds: the last node is in the second.
    let mut flush: Vec<(Mac, i64)> = (0..1500).map(|i| (mac(1000 + i), h)).collect();
    flush.push((b, h + 20));
    store.record_heartbeats(&flush).await.unwrap();
    assert_eq!(seen(store.clone()).await, vec![(a, h + 10), (b, h + 20)]);
    store.close().await;
}

/// Callers going away at any point of a state change (clients disconnecting, a timeout)
/// while others write the same nodes: the store keeps answering, and each change that
/// committed did so whole, its boot row with it; none left a connection mid-transaction.
async fn callers_going_away_mid_write_leave_every_change_whole(db: Db) {
    let store = db.open().await;
    let digest = image(&store, "demo", "1").await;
    let macs: Vec<Mac> = (0..32).map(|i| mac(2000 + i)).collect();
    for m in &macs {
        store.discover(m, None, "test").await.unwrap();
    }
    let boots = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let writers: Vec<_> = (0..16u64)
        .map(|w| {
            let (store, macs, boots) = (store.clone(), macs.clone(), boots.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while std::time::Instant::now() < deadline {
                    i += 1;
                    // Two writers per node: compare-and-set decides between them.
                    let m = macs[((w + i * 7) % macs.len() as u64) as usize];
                    let change = async {
                        let node = store.node(&m).await.unwrap().expect("discovered");
                        let id = format!(
                            "cancel-{}",
                            boots.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                        );
                        let token = Digest::of(id.as_bytes());
                        let boot = Attached::Boot(NewBoot {
                            id: &id,
                            image: &digest,
                            token_sha256: &token,
                            preboot_json: None,
                        });
                        let (to, with) = match node.state {
                            NodeState::Discovered => (NodeState::Provisioning, Some(&boot)),
                            _ => (NodeState::Discovered, None),
                        };
                        let _ = store
                            .set_state(&m, node.version, node.state, to, "churn", with)
                            .await;
                    };
                    let cancel_after = std::time::Duration::from_micros((i * 131 + w * 37) % 1000);
                    if i.is_multiple_of(2) {
                        let _ = tokio::time::timeout(cancel_after, change).await;
                    } else {
                        change.await;
                    }
                }
            })
        })
        .collect();
    for w in writers {
        tokio::time::timeout(std::time::Duration::from_secs(30), w)
            .await
            .expect("a writer wedged")
            .unwrap();
    }
    // And at each step in turn: polled `polls` times, the store's I/O given time to
    // answer between polls, so that each await of a change is where one of them is
    // dropped (in a transaction's BEGIN, a statement, the COMMIT).
    // Three times over: a step the database answers within its poll is missed.
    let steps = (0..3).flat_map(|_| (1..=10).flat_map(|polls| [1, 2, 4].map(|gap| (polls, gap))));
    for (i, (polls, gap_ms)) in steps.enumerate() {
        let m = macs[i % macs.len()];
        let node = store.node(&m).await.unwrap().expect("discovered");
        let to = match node.state {
            NodeState::Discovered => NodeState::Quarantined,
            _ => NodeState::Discovered,
        };
        let mut change =
            Box::pin(store.set_state(&m, node.version, node.state, to, "dropped", None));
        for _ in 0..polls {
            let polled = std::future::poll_fn(|cx| {
                std::task::Poll::Ready(change.as_mut().poll(cx).is_ready())
            })
            .await;
            if polled {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(gap_ms)).await;
        }
        drop(change);
        // Before anything else begins a transaction (one begun on a connection left
        // inside a transaction would end it with its own COMMIT).
        assert_no_transaction_left(&db).await;
    }
    // Still writable, at once: nothing holds a lock or a connection mid-transaction.
    let node = store.node(&macs[0]).await.unwrap().unwrap();
    let next = match node.state {
        NodeState::Discovered => NodeState::Quarantined,
        _ => NodeState::Discovered,
    };
    let after = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        store.set_state(&macs[0], node.version, node.state, next, "after", None),
    )
    .await
    .expect("the store wedged")
    .unwrap();
    assert!(matches!(after, CasOutcome::Done(_)), "{after:?}");
    // Each change into provisioning committed with its boot, and no boot without it.
    let mut changes = 0;
    for m in &macs {
        let history = store.node_history(m).await.unwrap();
        let into = history
            .iter()
            .filter(|c| c.to == NodeState::Provisioning)
            .count();
        let boots = store.boot_facts(m, 100_000).await.unwrap().len();
        assert_eq!(
            into, boots,
            "{m}: {into} changes into provisioning, {boots} boots"
        );
        changes += history.len();
    }
    assert!(
        changes > macs.len() * 4,
        "too few changes to show anything: {changes}"
    );
    assert_no_transaction_left(&db).await;
    store.close().await;
}

/// No connection to the database is left inside a transaction once its caller is gone:
/// on PostgreSQL no session is `idle in transaction`; on SQLite another connection takes
/// the write lock at once. A connection goes back to its pool from a task of its own, so
/// it is given a moment to settle (a passing check ends at once); one left inside a
/// transaction stays so.
async fn assert_no_transaction_left(db: &Db) {
    let settle = std::time::Instant::now() + std::time::Duration::from_secs(10);
    match db {
        Db::Postgres(url) => {
            let mut admin = <sqlx::PgConnection as sqlx::Connection>::connect(url)
                .await
                .unwrap();
            loop {
                let stuck = sqlx::query_as::<_, (i32, String)>(
                    "SELECT pid, query FROM pg_stat_activity
                     WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
                )
                .fetch_all(&mut admin)
                .await
                .unwrap();
                if stuck.is_empty() {
                    return;
                }
                assert!(
                    std::time::Instant::now() < settle,
                    "sessions left inside a transaction (pid, last query): {stuck:?}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
        Db::Sqlite(dir) => {
            use sqlx::ConnectOptions;
            let mut other = sqlx::sqlite::SqliteConnectOptions::new()
                .filename(dir.path().join("bootfleet.db"))
                .busy_timeout(std::time::Duration::ZERO)
                .connect()
                .await
                .unwrap();
            loop {
                match sqlx::query("BEGIN IMMEDIATE").execute(&mut other).await {
                    Ok(_) => {
                        sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
                        return;
                    }
                    Err(e) => assert!(
                        std::time::Instant::now() < settle,
                        "a connection holds the write lock: {e}"
                    ),
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

/// Runs `sql` on the database behind the store's back (what another clock wrote).
async fn execute(db: &Db, sql: &'static str) {
    match db {
        Db::Sqlite(dir) => {
            let path = dir.path().join("bootfleet.db");
            let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", path.display()))
                .await
                .unwrap();
            sqlx::query(sql).execute(&pool).await.unwrap();
            pool.close().await;
        }
        Db::Postgres(url) => {
            let pool = sqlx::PgPool::connect(url).await.unwrap();
            sqlx::query(sql).execute(&pool).await.unwrap();
            pool.close().await;
        }
    }
}

/// The newest boot is the one begun last even when the clock stepped back between two
/// boots (here: the first recorded an hour ahead of now): the database and SQLite's boot
/// cache agree on which token is current, and each boot keeps the time it was begun.
async fn a_boot_begun_after_the_clock_stepped_back_is_still_the_newest(db: Db) {
    let store = db.open().await;
    let digest = image(&store, "demo", "1").await;
    let mac = mac(61);
    store.discover(&mac, None, "test").await.unwrap();
    open_boot(&store, &mac, "boot-1", &digest, None).await;
    execute(
        &db,
        "UPDATE boots SET created_at_ms = created_at_ms + 3600000 WHERE id = 'boot-1'",
    )
    .await;
    open_boot(&store, &mac, "boot-2", &digest, None).await;
    let other = db.open().await;
    for handle in [&store, &other] {
        let old = handle.boot_for_attest("boot-1").await.unwrap().unwrap();
        let new = handle.boot_for_attest("boot-2").await.unwrap().unwrap();
        assert!(!old.latest && new.latest, "the boot begun last is current");
        assert!(
            new.created_at_ms < old.created_at_ms,
            "its own time: {new:?} {old:?}"
        );
    }
    let boots = other.boot_facts(&mac, 10).await.unwrap();
    assert_eq!(boots.first().map(|b| b.id.as_str()), Some("boot-2"));
    store.close().await;
    other.close().await;
}

/// A node known to both servers offers its UUID to each: the first kept stays, even
/// where the other server's memory still holds the node without one.
async fn a_uuid_kept_by_another_server_stays_the_nodes(db: Db) {
    let (a, b) = (db.open().await, db.open().await);
    let mac = mac(62);
    a.discover(&mac, None, "test").await.unwrap();
    b.discover(&mac, None, "test").await.unwrap();
    let (kept, _) = b.discover(&mac, Some("uuid-b"), "test").await.unwrap();
    assert_eq!(kept.uuid.as_deref(), Some("uuid-b"));
    let (found, new) = a.discover(&mac, Some("uuid-a"), "test").await.unwrap();
    assert!(!new);
    assert_eq!(found.uuid.as_deref(), Some("uuid-b"));
    assert_eq!(
        a.node(&mac).await.unwrap().unwrap().uuid.as_deref(),
        Some("uuid-b")
    );
    a.close().await;
    b.close().await;
}

/// What the agent API's token check reads of a boot follows every write at once: a newer
/// boot expires the older one's token, an attestation shows, a revalidation request
/// shows in the heartbeat's read and goes once taken.
async fn a_newer_boot_expires_the_older_token_and_an_attestation_shows_at_once(db: Db) {
    let store = db.open().await;
    let digest = image(&store, "demo", "1").await;
    let mac = mac(60);
    store.discover(&mac, None, "test").await.unwrap();
    let node = open_boot(&store, &mac, "boot-1", &digest, None).await;
    for _ in 0..2 {
        let boot = store.boot_for_attest("boot-1").await.unwrap().unwrap();
        assert!(boot.latest && !boot.attested() && boot.mac == mac && boot.image == digest);
        assert_eq!(boot.token_sha256, Digest::of(b"token"));
    }
    let attest = Attached::Attestation {
        boot_id: "boot-1",
        passed: true,
        verdict_json: r#"{"passed":true}"#,
        report_json: "{}",
    };
    let attested = store
        .set_state(
            &mac,
            node.version,
            node.state,
            NodeState::Validating,
            "attested",
            Some(&attest),
        )
        .await
        .unwrap();
    assert!(matches!(attested, CasOutcome::Done(_)), "{attested:?}");
    let boot = store.boot_for_attest("boot-1").await.unwrap().unwrap();
    assert!(boot.latest && boot.attested_and_passed());
    // As read from the database (another handle: no cache of this write).
    let other = db.open().await;
    let read = other.boot_for_attest("boot-1").await.unwrap().unwrap();
    assert_eq!(read.attestation, boot.attestation, "as kept, so as stored");
    other.close().await;
    let heard = store.node_for_heartbeat(&mac).await.unwrap().unwrap();
    assert_eq!(heard.state, NodeState::Validating);
    assert!(!heard.revalidate_requested);

    open_boot(&store, &mac, "boot-2", &digest, None).await;
    let old = store.boot_for_attest("boot-1").await.unwrap().unwrap();
    assert!(!old.latest, "a newer boot expires the older token");
    let new = store.boot_for_attest("boot-2").await.unwrap().unwrap();
    assert!(new.latest && !new.attested());
    assert!(store.boot_for_attest("boot-9").await.unwrap().is_none());

    assert!(store.request_revalidate(&mac).await.unwrap());
    let heard = store.node_for_heartbeat(&mac).await.unwrap().unwrap();
    assert!(heard.revalidate_requested, "the heartbeat sees the request");
    // The DHCP path keeps the row with the request in memory; taking it must drop that.
    let seen = store.node_for_dhcp(&mac).await.unwrap().unwrap();
    assert!(seen.revalidate_requested);
    assert!(store.take_revalidate(&mac).await.unwrap());
    assert!(!store.take_revalidate(&mac).await.unwrap(), "taken once");
    let heard = store.node_for_heartbeat(&mac).await.unwrap().unwrap();
    assert!(!heard.revalidate_requested);
    assert_eq!(heard.state, NodeState::Provisioning);

    // A write that is not a boot's forgets the newest boot; a read brings it back, and a
    // newer boot still expires it.
    store.assign(&mac, "demo:1").await.unwrap();
    assert!(
        store
            .boot_for_attest("boot-2")
            .await
            .unwrap()
            .is_some_and(|b| b.latest)
    );
    open_boot(&store, &mac, "boot-3", &digest, None).await;
    let old = store.boot_for_attest("boot-2").await.unwrap().unwrap();
    assert!(
        !old.latest,
        "a boot read into memory expires as one written there"
    );
    assert!(
        store
            .boot_for_attest("boot-3")
            .await
            .unwrap()
            .is_some_and(|b| b.latest)
    );
    store.close().await;
}

async fn a_boot_attests_once_across_servers(db: Db) {
    let (a, b) = (db.open().await, db.open().await);
    let digest = image(&a, "demo", "1").await;
    let mac = mac(2);
    a.discover(&mac, None, "test").await.unwrap();
    let node = open_boot(&a, &mac, "boot-1", &digest, None).await;
    let attest = Attached::Attestation {
        boot_id: "boot-1",
        passed: false,
        verdict_json: r#"{"passed":false}"#,
        report_json: "{}",
    };
    let (x, y) = tokio::join!(
        a.set_state(
            &mac,
            node.version,
            node.state,
            NodeState::Validating,
            "a",
            Some(&attest)
        ),
        b.set_state(
            &mac,
            node.version,
            node.state,
            NodeState::Validating,
            "b",
            Some(&attest)
        ),
    );
    let outcomes = [x.unwrap(), y.unwrap()];
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| matches!(o, CasOutcome::Done(_)))
            .count(),
        1,
        "{outcomes:?}"
    );
    // A replay at the node's new version finds the attestation recorded, and leaves no
    // history row behind (SQLite writes it with the attestation's row, then rolls back).
    let now = b.node(&mac).await.unwrap().unwrap();
    let history = b.node_history(&mac).await.unwrap().len();
    let replay = b
        .set_state(
            &mac,
            now.version,
            now.state,
            NodeState::Validating,
            "replay",
            Some(&attest),
        )
        .await
        .unwrap();
    assert_eq!(replay, CasOutcome::AlreadyAttested);
    let boot = b.boot_for_attest("boot-1").await.unwrap().unwrap();
    assert!(boot.attested() && !boot.attested_and_passed() && boot.latest);
    assert_eq!(b.node(&mac).await.unwrap().unwrap().version, now.version);
    assert_eq!(b.node_history(&mac).await.unwrap().len(), history);
    a.close().await;
    b.close().await;
}

async fn a_revalidation_request_is_answered_once(db: Db) {
    let (a, b) = (db.open().await, db.open().await);
    let mac = mac(3);
    assert!(!a.request_revalidate(&mac).await.unwrap(), "unknown node");
    a.discover(&mac, None, "test").await.unwrap();
    let pending = |store: &Store| {
        let store = store.clone();
        async move {
            store
                .node_for_heartbeat(&mac)
                .await
                .unwrap()
                .unwrap()
                .revalidate_requested
        }
    };
    assert!(!pending(&b).await, "nothing asked yet");
    for _ in 0..10 {
        assert!(a.request_revalidate(&mac).await.unwrap());
        assert!(pending(&b).await, "the heartbeat's read sees the request");
        let (x, y) = tokio::join!(a.take_revalidate(&mac), b.take_revalidate(&mac));
        assert_eq!([x.unwrap(), y.unwrap()].iter().filter(|t| **t).count(), 1);
        assert!(!pending(&a).await, "answered once");
    }
    assert!(
        a.node_for_heartbeat(&self::mac(99))
            .await
            .unwrap()
            .is_none()
    );
    a.close().await;
    b.close().await;
}

/// A health revalidation waiting on a drain: queued once per node (two servers at once:
/// one wins), asked once, marked validating once, ended once, each with its `health.drain` event in
/// the same transaction; a removed node takes its row with it.
async fn a_revalidation_behind_a_drain_is_queued_moved_and_ended_once(db: Db) {
    use bootfleet::api::event::HealthDrainData;
    let (a, b) = (db.open().await, db.open().await);
    let step = |s: &str| HealthDrainData {
        step: s.into(),
        reason: "ecc-rising".into(),
    };
    let (one, two) = (mac(41), mac(42));
    for m in [&one, &two] {
        a.discover(m, None, "test").await.unwrap();
    }
    let queued = step("queued");
    let (x, y) = tokio::join!(
        a.queue_revalidation_drain(&one, "ecc-rising", 1_000, &queued),
        b.queue_revalidation_drain(&one, "ecc-rising", 1_001, &queued)
    );
    assert_eq!([x.unwrap(), y.unwrap()].iter().filter(|t| **t).count(), 1);
    let gone = b.queue_revalidation_drain(&two, "gone", 1_500, &queued);
    assert!(gone.await.unwrap());
    let rows = b.revalidation_drains().await.unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    let first = &rows[0];
    assert_eq!(
        (first.mac, first.asked_at_ms, first.validating_at_ms),
        (one, None, None)
    );
    assert!(first.queued_at_ms == 1_000 || first.queued_at_ms == 1_001);
    let asked = step("asked");
    assert!(a.revalidation_asked(&one, 1_800, &asked).await.unwrap());
    assert!(
        !b.revalidation_asked(&one, 1_801, &asked).await.unwrap(),
        "once"
    );
    assert_eq!(
        b.revalidation_drains().await.unwrap()[0].asked_at_ms,
        Some(1_800)
    );
    let moving = step("revalidating");
    assert!(
        a.revalidation_validating(&one, 2_000, &moving)
            .await
            .unwrap()
    );
    assert!(
        !b.revalidation_validating(&one, 2_001, &moving)
            .await
            .unwrap(),
        "once"
    );
    assert_eq!(
        b.revalidation_drains().await.unwrap()[0].validating_at_ms,
        Some(2_000)
    );
    let resumed = step("resumed");
    assert!(b.end_revalidation_drain(&one, &resumed).await.unwrap());
    assert!(
        !a.end_revalidation_drain(&one, &resumed).await.unwrap(),
        "once"
    );
    let node = a.node(&two).await.unwrap().unwrap();
    let data = bootfleet::api::event::NodeRemovedData {
        state: node.state,
        reason: "decommissioned".into(),
    };
    a.remove_node(&two, node.version, &data).await.unwrap();
    assert!(a.revalidation_drains().await.unwrap().is_empty());
    let events = a.events_since(0, 100, None).await.unwrap();
    let steps: Vec<&str> = events
        .iter()
        .filter(|e| e.kind == "health.drain")
        .map(|e| e.data["step"].as_str().unwrap())
        .collect();
    assert_eq!(
        steps,
        ["queued", "queued", "asked", "revalidating", "resumed"]
    );
    a.close().await;
    b.close().await;
}

/// Writers on two servers, a reader following the log as it grows: the reader sees
/// every event exactly once, in one order, and the numbers have no gaps.
async fn events_have_one_order_without_gaps(db: Db) {
    let (a, b) = (db.open().await, db.open().await);
    let reader = db.open().await;
    const PER_WRITER: usize = 60;
    let writer = |store: Store, base: u32| async move {
        for i in 0..PER_WRITER as u32 {
            if i % 2 == 0 {
                store.discover(&mac(base + i), None, "test").await.unwrap();
            } else {
                let data = serde_json::json!({ "i": i });
                store.record_event("test", None, &data).await.unwrap();
            }
        }
    };
    let follow = async {
        let mut seen = Vec::new();
        let mut cursor = 0;
        while seen.len() < 2 * PER_WRITER {
            let page = reader.events_since(cursor, 7, None).await.unwrap();
            for e in &page {
                cursor = e.seq;
                seen.push(e.seq);
            }
            if page.is_empty() {
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
        }
        seen
    };
    let (seen, (), ()) = tokio::join!(follow, writer(a.clone(), 1000), writer(b.clone(), 2000));
    let expected: Vec<i64> = (1..=(2 * PER_WRITER) as i64).collect();
    assert_eq!(seen, expected, "the reader saw every event once, in order");
    assert_eq!(reader.events_head().await.unwrap(), (2 * PER_WRITER) as i64);
    let all = reader.events_since(0, 1000, None).await.unwrap();
    let seqs: Vec<i64> = all.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, expected);
    for s in [a, b, reader] {
        s.close().await;
    }
}

async fn one_server_holds_a_role_until_it_lapses(db: Db) {
    let (a, b) = (db.open().await, db.open().await);
    let (t, ttl) = (1_000_000, 15_000);
    let (x, y) = tokio::join!(
        a.lead("sweeper", "server-a", t, ttl),
        b.lead("sweeper", "server-b", t, ttl)
    );
    let (x, y) = (x.unwrap(), y.unwrap());
    assert!(x ^ y, "exactly one leads: a {x}, b {y}");
    let (holder, other, hs, os) = if x {
        ("server-a", "server-b", &a, &b)
    } else {
        ("server-b", "server-a", &b, &a)
    };
    assert!(
        hs.lead("sweeper", holder, t + 5_000, ttl).await.unwrap(),
        "renews"
    );
    assert!(
        !os.lead("sweeper", other, t + 19_000, ttl).await.unwrap(),
        "renewed lease holds"
    );
    assert!(
        os.lead("webhooks", other, t, ttl).await.unwrap(),
        "roles are apart"
    );
    // The holder dies: past its lease the other takes over, and the old one is refused.
    assert!(
        os.lead("sweeper", other, t + 20_001, ttl).await.unwrap(),
        "takes over"
    );
    assert!(!hs.lead("sweeper", holder, t + 20_002, ttl).await.unwrap());
    os.resign("sweeper", other).await.unwrap();
    assert!(
        hs.lead("sweeper", holder, t + 20_003, ttl).await.unwrap(),
        "free after resign"
    );
    // What is held, as every server reads it: the webhooks lease lapsed at t + 15 s.
    let mut held = os.held_roles(t + 20_004).await.unwrap();
    held.sort();
    assert_eq!(held, vec!["sweeper"]);
    let mut held = os.held_roles(t + 1).await.unwrap();
    held.sort();
    assert_eq!(held, vec!["sweeper", "webhooks"]);
    a.close().await;
    b.close().await;
}

async fn one_publish_of_a_version_wins(db: Db) {
    let (a, b) = (db.open().await, db.open().await);
    let new = |content: &'static [u8]| NewImage {
        digest: Digest::of(content),
        name: "demo",
        version: "7",
        manifest_toml: "",
        canonical: content,
        artifacts: &[],
    };
    let (one, two) = (new(b"one"), new(b"two"));
    let (x, y) = tokio::join!(a.insert_image(&one), b.insert_image(&two));
    let mut outcomes = [x.unwrap(), y.unwrap()];
    outcomes.sort_by_key(|o| format!("{o:?}"));
    assert!(
        matches!(
            outcomes,
            [InsertOutcome::Inserted, InsertOutcome::VersionTaken { .. }]
        ),
        "{outcomes:?}"
    );
    assert_eq!(a.list_images().await.unwrap().len(), 1);
    a.close().await;
    b.close().await;
}

async fn every_write_is_seen_by_the_next_dhcp_read(db: Db) {
    let store = db.open().await;
    let mac = mac(4);
    assert_eq!(store.node_for_dhcp(&mac).await.unwrap(), None);
    store.discover(&mac, None, "test").await.unwrap();
    let seen = store.node_for_dhcp(&mac).await.unwrap().unwrap();
    assert_eq!(seen.assigned, None);
    store.assign(&mac, "demo:stable").await.unwrap();
    let seen = store.node_for_dhcp(&mac).await.unwrap().unwrap();
    assert_eq!(seen.assigned.as_deref(), Some("demo:stable"));
    let set = [("boot".to_string(), "local".to_string())].into();
    store.label(&mac, &set, &[]).await.unwrap();
    let seen = store.node_for_dhcp(&mac).await.unwrap().unwrap();
    assert_eq!(seen.labels.get("boot").map(String::as_str), Some("local"));
    let outcome = store
        .set_state(
            &mac,
            seen.version,
            seen.state,
            NodeState::Quarantined,
            "test",
            None,
        )
        .await
        .unwrap();
    // The answer is the row as written, and the cache holds the same.
    let CasOutcome::Done(written) = outcome else {
        panic!("{outcome:?}")
    };
    let stored = store.node(&mac).await.unwrap().unwrap();
    assert_eq!(*written, stored);
    assert_eq!(stored.state, NodeState::Quarantined);
    assert_eq!(stored.version, seen.version + 1);
    assert_eq!(store.node_for_dhcp(&mac).await.unwrap().unwrap(), stored);
    // SQLite keeps the written row in memory at the commit, without a read.
    let sqlite = matches!(db, Db::Sqlite(_));
    if sqlite {
        assert_eq!(store.node_in_memory(&mac), Some(stored.clone()));
    }
    // Two changes in a row: the cache has the last.
    for (from, to) in [
        (NodeState::Quarantined, NodeState::Discovered),
        (NodeState::Discovered, NodeState::Quarantined),
    ] {
        let at = store.node_for_dhcp(&mac).await.unwrap().unwrap();
        let outcome = store
            .set_state(&mac, at.version, from, to, "test", None)
            .await
            .unwrap();
        assert!(matches!(outcome, CasOutcome::Done(_)), "{outcome:?}");
    }
    let stored = store.node(&mac).await.unwrap().unwrap();
    assert_eq!(stored.version, seen.version + 3);
    assert_eq!(store.node_for_dhcp(&mac).await.unwrap().unwrap(), stored);
    if sqlite {
        assert_eq!(store.node_in_memory(&mac), Some(stored.clone()));
    }
    // A stale version changes nothing.
    let outcome = store
        .set_state(
            &mac,
            seen.version,
            stored.state,
            NodeState::Ready,
            "test",
            None,
        )
        .await
        .unwrap();
    assert!(matches!(outcome, CasOutcome::Stale), "{outcome:?}");
    assert_eq!(store.node_for_dhcp(&mac).await.unwrap().unwrap(), stored);
    // The first UUID a known node offers is kept; a later one is not its word.
    let (found, new) = store.discover(&mac, Some("uuid-2"), "test").await.unwrap();
    assert!(!new);
    assert_eq!(found.uuid.as_deref(), Some("uuid-2"));
    let seen = store.node_for_dhcp(&mac).await.unwrap().unwrap();
    assert_eq!(seen.uuid.as_deref(), Some("uuid-2"));
    let (found, new) = store.discover(&mac, Some("uuid-3"), "test").await.unwrap();
    assert!(!new);
    assert_eq!(found.uuid.as_deref(), Some("uuid-2"));
    // A rediscovery that would change nothing writes nothing (SQLite answers it from
    // memory).
    let writes = store.write_stats().map(|w| w.writes);
    let (found, new) = store.discover(&mac, None, "test").await.unwrap();
    assert!(!new);
    assert_eq!(found, store.node(&mac).await.unwrap().unwrap());
    if sqlite {
        assert_eq!(store.write_stats().map(|w| w.writes), writes);
    }
    store.close().await;
}

async fn leases_fetches_tags_and_idempotency_keys_round_trip(db: Db) {
    let store = db.open().await;
    // Leases: a batch in, one gone.
    let keep: Vec<LeaseRow> = (0..3)
        .map(|i| LeaseRow {
            mac: mac(10 + i),
            ip: std::net::Ipv4Addr::new(10, 0, 0, 10 + i as u8),
            expires_ms: 1000 + i as i64,
        })
        .collect();
    store.save_leases(&keep, &[]).await.unwrap();
    store
        .save_leases(&[], std::slice::from_ref(&keep[1]))
        .await
        .unwrap();
    // Another server bound the third client to another address since: the first
    // server's end of the old lease leaves the new one alone.
    let moved = LeaseRow {
        ip: std::net::Ipv4Addr::new(10, 0, 0, 99),
        ..keep[2].clone()
    };
    store
        .save_leases(std::slice::from_ref(&moved), &[])
        .await
        .unwrap();
    store
        .save_leases(&[], std::slice::from_ref(&keep[2]))
        .await
        .unwrap();
    let mut loaded = store.load_leases().await.unwrap();
    loaded.sort_by_key(|l| l.mac.to_string());
    assert_eq!(loaded, vec![keep[0].clone(), moved.clone()]);
    // Batches written a few to a statement: a MAC given twice keeps its last lease, and
    // an end names the address it ends (the other two MACs hold other ones now).
    let many: Vec<LeaseRow> = (0..1500u32)
        .map(|i| LeaseRow {
            mac: mac(100 + i),
            ip: std::net::Ipv4Addr::from(0x0a01_0000 + i),
            expires_ms: 5000,
        })
        .collect();
    let again = LeaseRow {
        expires_ms: 6000,
        ..many[3].clone()
    };
    let batch: Vec<LeaseRow> = many.iter().cloned().chain([again.clone()]).collect();
    store.save_leases(&batch, &[]).await.unwrap();
    let wrong_ip = LeaseRow {
        ip: std::net::Ipv4Addr::new(10, 9, 9, 9),
        ..many[1].clone()
    };
    // A MAC twice within one statement too.
    let first = LeaseRow {
        expires_ms: 7000,
        ..many[2].clone()
    };
    let last = LeaseRow {
        expires_ms: 8000,
        ..many[2].clone()
    };
    store
        .save_leases(&[first, many[0].clone(), last.clone()], &[])
        .await
        .unwrap();
    let ends: Vec<LeaseRow> = many[4..].iter().cloned().chain([wrong_ip]).collect();
    store.save_leases(&[], &ends).await.unwrap();
    let mut loaded = store.load_leases().await.unwrap();
    loaded.sort_by_key(|l| l.mac.to_string());
    assert_eq!(
        loaded,
        vec![
            keep[0].clone(),
            moved,
            many[0].clone(),
            many[1].clone(),
            last,
            again
        ]
    );
    // Fetches: a made-up boot id records nothing.
    let digest = image(&store, "demo", "1").await;
    let m = mac(20);
    let (node, _) = store.discover(&m, None, "test").await.unwrap();
    let token = Digest::of(b"t");
    let boot = Attached::Boot(NewBoot {
        id: "boot-f",
        image: &digest,
        token_sha256: &token,
        preboot_json: None,
    });
    store
        .set_state(
            &m,
            node.version,
            node.state,
            NodeState::Provisioning,
            "boot",
            Some(&boot),
        )
        .await
        .unwrap();
    let fetch = Fetch {
        digest,
        started_at_ms: 5,
        finished_at_ms: Some(9),
        offset: 7,
        bytes: 42,
        whole: true,
    };
    let recorded = store
        .record_fetches(&[
            ("boot-f".into(), fetch.clone()),
            ("made-up".into(), fetch.clone()),
        ])
        .await
        .unwrap();
    assert_eq!(recorded, 1);
    assert_eq!(store.fetches("boot-f").await.unwrap(), vec![fetch.clone()]);
    let facts = store.boot_facts(&m, 5).await.unwrap();
    assert_eq!(facts.len(), 1);
    assert_eq!(facts[0].fetches.len(), 1);
    // Many at once (more than one statement's worth on SQLite), interleaved with a
    // made-up boot's: all of this boot's recorded, read back in the order given.
    let many: Vec<(String, Fetch)> = (0..700)
        .map(|i| {
            let boot = if i % 7 == 3 { "made-up" } else { "boot-f" };
            let fetch = Fetch {
                started_at_ms: 1000 - i,
                offset: i as u64,
                ..fetch.clone()
            };
            (boot.to_string(), fetch)
        })
        .collect();
    let recorded = store.record_fetches(&many).await.unwrap();
    assert_eq!(recorded, 600);
    let read = store.fetches("boot-f").await.unwrap();
    let offsets: Vec<u64> = read.iter().skip(1).map(|f| f.offset).collect();
    let given: Vec<u64> = (0..700u64).filter(|i| i % 7 != 3).collect();
    assert_eq!(offsets, given);
    // Tags: a move, a repeat, history; what a tag or a digest resolves to follows each
    // write (SQLite keeps the answers in memory between them).
    let tag = bootfleet::api::refs::TagName::parse("demo:stable").unwrap();
    let r = bootfleet::api::refs::ImageRef::Named {
        name: "demo".into(),
        label: "stable".into(),
    };
    assert_eq!(store.resolve(&r).await.unwrap(), None, "no such tag yet");
    let moved = store.set_tag(&tag, &digest, "admin").await.unwrap();
    assert_eq!(moved, bootfleet::store::TagOutcome::Moved { from: None });
    let again = store.set_tag(&tag, &digest, "admin").await.unwrap();
    assert_eq!(again, bootfleet::store::TagOutcome::Unchanged);
    assert_eq!(store.tag_history(&tag).await.unwrap().len(), 1);
    assert_eq!(store.resolve(&r).await.unwrap(), Some(digest));
    let by_digest = bootfleet::api::refs::ImageRef::Digest(Digest::of(b"demo:2"));
    assert_eq!(store.resolve(&by_digest).await.unwrap(), None);
    let second = image(&store, "demo", "2").await;
    assert_eq!(store.resolve(&by_digest).await.unwrap(), Some(second));
    let moved = store.set_tag(&tag, &second, "admin").await.unwrap();
    assert_eq!(
        moved,
        bootfleet::store::TagOutcome::Moved { from: Some(digest) }
    );
    assert_eq!(store.resolve(&r).await.unwrap(), Some(second));
    // Idempotency keys: one claim among racing servers; the first answer stays; a
    // released claim is free again; a stale one is taken over.
    let other = db.open().await;
    let (a, b) = tokio::join!(
        store.claim_idempotency_key("k", &m, 60_000),
        other.claim_idempotency_key("k", &m, 60_000)
    );
    let mut claims = [a.unwrap(), b.unwrap()];
    claims.sort_by_key(|c| format!("{c:?}"));
    assert_eq!(
        claims,
        [
            KeyClaim::Claimed,
            KeyClaim::InProgress { mac: m.to_string() }
        ]
    );
    store.answer_idempotency_key("k", "first").await.unwrap();
    let answered = KeyClaim::Answered {
        mac: m.to_string(),
        response: "first".into(),
    };
    assert_eq!(
        other.claim_idempotency_key("k", &m, 0).await.unwrap(),
        answered
    );
    store.release_idempotency_key("k").await.unwrap();
    assert_eq!(
        store.claim_idempotency_key("k", &m, 0).await.unwrap(),
        answered
    );
    assert_eq!(
        store.claim_idempotency_key("r", &m, 60_000).await.unwrap(),
        KeyClaim::Claimed
    );
    store.release_idempotency_key("r").await.unwrap();
    assert_eq!(
        other.claim_idempotency_key("r", &m, 60_000).await.unwrap(),
        KeyClaim::Claimed
    );
    // Unanswered and older than the stale bound (0 ms here): taken over.
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    assert_eq!(
        store.claim_idempotency_key("r", &m, 0).await.unwrap(),
        KeyClaim::Claimed
    );
    other.close().await;
    // Broken blobs: marked once, listed, cleared by a re-publish (each list read
    // before a write, so that one kept in memory must follow the write).
    let rot = Digest::of(b"rotten");
    let marks = [(rot, "blob is missing".to_string())];
    assert_eq!(store.broken_blobs().await.unwrap(), vec![]);
    assert_eq!(
        store.mark_blobs_broken(&marks).await.unwrap(),
        0,
        "no image needs it"
    );
    store.mark_blobs_broken(&marks).await.unwrap();
    assert_eq!(store.broken_blobs().await.unwrap(), marks.to_vec());
    store.clear_broken_blobs(&[rot]).await.unwrap();
    assert_eq!(store.broken_blobs().await.unwrap(), vec![]);
    let seen: BTreeSet<_> = store
        .nodes()
        .await
        .unwrap()
        .into_iter()
        .map(|n| n.mac)
        .collect();
    assert!(seen.contains(&m));
    store.close().await;
}

async fn events_are_pruned_oldest_first_and_numbering_goes_on(db: Db) {
    let store = db.open().await;
    let data = serde_json::json!({});
    for _ in 0..20 {
        store.record_event("test", None, &data).await.unwrap();
    }
    let head = store.events_head().await.unwrap();
    // By count, in batches: 15 go, the newest 5 stay.
    assert_eq!(store.prune_events(0, 5, 10).await.unwrap(), 10);
    assert_eq!(store.prune_events(0, 5, 10).await.unwrap(), 5);
    assert_eq!(store.prune_events(0, 5, 10).await.unwrap(), 0);
    let left: Vec<i64> = store
        .events_since(0, 100, None)
        .await
        .unwrap()
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(left, ((head - 4)..=head).collect::<Vec<_>>());
    // By age: everything before now, except the newest event.
    let later = bootfleet::clock::now_ms() + 1000;
    assert_eq!(store.prune_events(later, 1_000_000, 100).await.unwrap(), 4);
    assert_eq!(store.events_head().await.unwrap(), head);
    // Numbering goes on after the newest, never restarting.
    store.record_event("test", None, &data).await.unwrap();
    assert_eq!(store.events_head().await.unwrap(), head + 1);
    store.close().await;
}

async fn new_macs_stop_being_recorded_at_the_discovery_cap(db: Db) {
    let store = db.open().await;
    let cap = Some(2);
    for i in 0..2 {
        let found = store
            .discover_within(&mac(300 + i), None, "t", cap)
            .await
            .unwrap();
        assert!(found.unwrap().1, "new");
    }
    assert!(
        store
            .discover_within(&mac(302), None, "t", cap)
            .await
            .unwrap()
            .is_none()
    );
    // Known MACs are answered at the cap; an assignment makes room.
    let (_, new) = store
        .discover_within(&mac(300), None, "t", cap)
        .await
        .unwrap()
        .unwrap();
    assert!(!new);
    store.assign(&mac(300), "demo:1").await.unwrap();
    assert!(
        store
            .discover_within(&mac(302), None, "t", cap)
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(store.nodes().await.unwrap().len(), 3);
    store.close().await;
}

async fn a_bmc_registration_is_matched_once_by_mac_or_uuid(db: Db) {
    use bootfleet::api::power::{Bmc, BmcProtocol};
    let store = db.open().await;
    let bmc = |n: u32| Bmc {
        protocol: BmcProtocol::Ipmi,
        address: format!("10.0.0.{n}"),
        credential: Some("c".into()),
        ca: None,
        fingerprint: None,
        insecure: false,
        quirks: Vec::new(),
    };
    let by_mac = store
        .register_bmc(&bmc(1), None, &[mac(400), mac(401)])
        .await
        .unwrap();
    let uuid = "4c4c4544-0042-3010-8054-b4c04f4d3232";
    store.register_bmc(&bmc(2), Some(uuid), &[]).await.unwrap();
    assert_eq!(store.bmc_registrations().await.unwrap().len(), 2);
    // A MAC no registration lists does not match.
    store.discover(&mac(40), None, "t").await.unwrap();
    assert_eq!(
        store.match_bmc_registration(&mac(40), None).await.unwrap(),
        None
    );
    store.discover(&mac(401), None, "t").await.unwrap();
    assert_eq!(
        store.match_bmc_registration(&mac(401), None).await.unwrap(),
        Some(by_mac.id)
    );
    let node = store.node(&mac(401)).await.unwrap().unwrap();
    assert_eq!(node.bmc.unwrap().address, "10.0.0.1");
    // Matched once: the other MAC of that machine finds nothing now.
    store.discover(&mac(400), None, "t").await.unwrap();
    assert_eq!(
        store.match_bmc_registration(&mac(400), None).await.unwrap(),
        None
    );
    // By UUID; a node that has a BMC already is not given another.
    store.set_bmc(&mac(40), Some(&bmc(9))).await.unwrap();
    assert_eq!(
        store
            .match_bmc_registration(&mac(40), Some(uuid))
            .await
            .unwrap(),
        None
    );
    store.discover(&mac(402), None, "t").await.unwrap();
    assert!(
        store
            .match_bmc_registration(&mac(402), Some(uuid))
            .await
            .unwrap()
            .is_some()
    );
    assert!(store.bmc_registrations().await.unwrap().is_empty());
    // Unregistered: once, with its event; a second time finds nothing.
    let gone = store
        .register_bmc(&bmc(3), None, &[mac(403)])
        .await
        .unwrap();
    assert!(store.remove_bmc_registration(gone.id).await.unwrap());
    assert!(!store.remove_bmc_registration(gone.id).await.unwrap());
    let kinds: Vec<String> = store
        .events_since(0, 100, None)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(kinds.iter().filter(|k| *k == "bmc.matched").count(), 2);
    assert_eq!(kinds.iter().filter(|k| *k == "bmc.unregistered").count(), 1);
    store.close().await;
}

/// PostgreSQL wakes event readers on every server (NOTIFY at commit); SQLite serves one
/// process, whose readers are woken in process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_wakes_event_readers_on_every_server() {
    let db = Db::postgres().await;
    let (a, b) = (db.open().await, db.open().await);
    let mut woken = b.subscribe_events();
    woken.borrow_and_update();
    a.record_event("test", None, &serde_json::json!({}))
        .await
        .unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), woken.changed())
        .await
        .expect("server b is woken by server a's commit")
        .unwrap();
    a.close().await;
    b.close().await;
}

/// "Database or disk is full" for a while, then space again: every write works again,
/// sequential and concurrent (a failed COMMIT must not leave a pooled connection in a
/// transaction that refuses every later write).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_writes_recover_after_the_disk_was_full() {
    let fs = Tmpfs::mount("4m");
    let url = StoreUrl::Sqlite(fs.path().join("bootfleet.db"));
    let store = bootfleet::store::open(&url, None, None).await.unwrap();
    // Fill the disk, then write until the store says it is full.
    let filler = fs.path().join("filler");
    {
        use std::io::Write as _;
        let mut f = std::fs::File::create(&filler).unwrap();
        let chunk = vec![7u8; 64 << 10];
        while f.write_all(&chunk).is_ok() {}
        let _ = f.sync_all();
    }
    let mut failed = 0;
    for i in 0..400u32 {
        let labels = std::collections::BTreeMap::from([("note".to_string(), "x".repeat(200))]);
        let m = mac(2000 + i);
        match store.discover(&m, None, "disk full test").await {
            Ok(_) => {
                if store.label(&m, &labels, &[]).await.is_err() {
                    failed += 1;
                }
            }
            Err(_) => failed += 1,
        }
    }
    assert!(failed > 0, "the disk never filled: the test proves nothing");
    std::fs::remove_file(&filler).unwrap();
    for i in 0..40u32 {
        store
            .discover(&mac(3000 + i), None, "after")
            .await
            .unwrap_or_else(|e| panic!("write {i} after space came back: {e}"));
    }
    store
        .probe_write("readyz", 1)
        .await
        .expect("/readyz's write probe commits again");
    let writes = (0..40u32).map(|i| {
        let store = store.clone();
        tokio::spawn(async move { store.discover(&mac(3100 + i), None, "after").await })
    });
    for w in futures_util::future::join_all(writes).await {
        w.unwrap()
            .expect("a concurrent write after space came back");
    }
    store.close().await;
}

/// Two servers start rollouts over one node at once: one wins, the other keeps nothing.
/// Steps move by compare-and-set; a step's reimage is written with the node's move (and
/// not at all when the budget refuses); an ended rollout gives its nodes back, and
/// rolling it back claims them again unless another holds one.
async fn rollouts_claim_their_nodes_once_and_steps_move_by_compare_and_set(db: Db) {
    use bootfleet::api::rollout::{RolloutState, StepStatus};
    use bootfleet::store::{
        NewRollout, RolloutCreated, RolloutMove, RolloutMoved, RolloutNodeRow, StepMove,
        StepReimage,
    };
    let (a, b) = (db.open().await, db.open().await);
    let old = image(&a, "gpu", "1").await;
    let new = image(&a, "gpu", "2").await;
    let nodes: Vec<Mac> = (0..3).map(mac).collect();
    for m in &nodes {
        a.discover(m, None, "test").await.unwrap();
    }
    open_boot(&a, &nodes[0], "boot-0", &old, None).await;
    let row = |m: &Mac, i: u32| RolloutNodeRow {
        mac: *m,
        wave: i,
        position: i,
        status: StepStatus::Pending,
        previous_assigned: Some("gpu:1".into()),
        previous_digest: Some(old),
        reason: String::new(),
        started_at_ms: None,
        finished_at_ms: None,
    };
    let rows: Vec<RolloutNodeRow> = nodes.iter().zip(0..).map(|(m, i)| row(m, i)).collect();
    let new_rollout = |rows: &'static [RolloutNodeRow]| NewRollout {
        spec_json: "{}",
        digest: &new,
        nodes: rows,
        reason: "test",
    };
    let rows: &'static [RolloutNodeRow] = Box::leak(rows.into_boxed_slice());
    let (whole, part) = (new_rollout(rows), new_rollout(&rows[1..]));
    let (x, y) = tokio::join!(a.create_rollout(&whole), b.create_rollout(&part));
    let (x, y) = (x.unwrap(), y.unwrap());
    let won = match (&x, &y) {
        (RolloutCreated::Created(id), RolloutCreated::Overlap { rollout, .. })
        | (RolloutCreated::Overlap { rollout, .. }, RolloutCreated::Created(id)) => {
            assert_eq!(rollout, id);
            *id
        }
        other => panic!("exactly one rollout must win: {other:?}"),
    };
    let all = b.rollouts().await.unwrap();
    assert_eq!(all.len(), 1, "the loser kept nothing");
    let (r, steps) = b.rollout(won).await.unwrap().unwrap();
    assert_eq!((r.state, r.digest), (RolloutState::Running, new));
    let first = steps[0].mac;
    assert_eq!(b.latest_boot(&nodes[0]).await.unwrap().unwrap().0, old);

    // A step moves once from where it was, and only under the rollout's version.
    let stale = StepMove {
        version: r.version + 1,
        mac: &first,
        from: StepStatus::Pending,
        to: StepStatus::Draining,
        reason: "test",
        started_at_ms: Some(1),
        finished_at_ms: None,
        event_kind: "rollout.node-test",
    };
    assert!(
        !a.move_step(won, &stale).await.unwrap(),
        "moved under a stale version"
    );
    let step = |from, to| StepMove {
        version: r.version,
        mac: &first,
        from,
        to,
        reason: "test",
        started_at_ms: Some(1),
        finished_at_ms: None,
        event_kind: "rollout.node-test",
    };
    let drain = step(StepStatus::Pending, StepStatus::Draining);
    let (p, q) = tokio::join!(a.move_step(won, &drain), b.move_step(won, &drain));
    assert_eq!([p.unwrap(), q.unwrap()].iter().filter(|m| **m).count(), 1);

    // Over the budget: neither the node nor the step moves.
    let refuse = |_: &bootfleet::store::NodeRecord, _: &[bootfleet::store::NodeRecord]| {
        ReimageDecision::OverBudget("full".into())
    };
    let reimage = step(StepStatus::Draining, StepStatus::Reimaging);
    let out = a
        .reimage_step(won, &reimage, "gpu:2", "rollout", &refuse)
        .await
        .unwrap();
    assert!(matches!(out, StepReimage::Refused(_)), "{out:?}");
    let (_, steps) = b.rollout(won).await.unwrap().unwrap();
    assert_eq!(steps[0].status, StepStatus::Draining);
    assert_eq!(b.node(&first).await.unwrap().unwrap().assigned, None);
    // Allowed: the node moves, is assigned, and the step moves, together; once.
    let allow = |_: &bootfleet::store::NodeRecord, _: &[bootfleet::store::NodeRecord]| {
        ReimageDecision::Move(NodeState::Reimaging)
    };
    let (p, q) = tokio::join!(
        a.reimage_step(won, &reimage, "gpu:2", "rollout 1: test", &allow),
        b.reimage_step(won, &reimage, "gpu:2", "rollout 1: test", &allow)
    );
    let outs = [p.unwrap(), q.unwrap()];
    assert_eq!(
        outs.iter().filter(|o| **o == StepReimage::Moved).count(),
        1,
        "{outs:?}"
    );
    assert_eq!(
        outs.iter()
            .filter(|o| **o == StepReimage::StaleStep)
            .count(),
        1,
        "{outs:?}"
    );
    let node = b.node(&first).await.unwrap().unwrap();
    assert_eq!(
        (node.state, node.assigned.as_deref()),
        (NodeState::Reimaging, Some("gpu:2"))
    );
    let history = b.node_history(&first).await.unwrap();
    assert_eq!(
        history
            .iter()
            .filter(|h| h.to == NodeState::Reimaging)
            .count(),
        1
    );

    // A failure counts only from a boot begun since.
    assert_eq!(a.failure_since(&first, 0).await.unwrap(), None);

    // The rollout moves by version; ending it gives its nodes back.
    let (r, _) = a.rollout(won).await.unwrap().unwrap();
    let end = RolloutMove {
        state: RolloutState::Aborted,
        reason: "test",
        wave: 0,
        queue_rollback: &[],
        event_kind: "rollout.aborted",
        reclaim: false,
    };
    let (p, q) = tokio::join!(
        a.move_rollout(won, r.version, &end),
        b.move_rollout(won, r.version, &end)
    );
    let outs = [p.unwrap(), q.unwrap()];
    assert!(
        outs.contains(&RolloutMoved::Moved) && outs.contains(&RolloutMoved::Stale),
        "{outs:?}"
    );
    let first_row: &'static [RolloutNodeRow] =
        std::slice::from_ref(rows.iter().find(|r| r.mac == first).unwrap());
    let other = match a.create_rollout(&new_rollout(first_row)).await.unwrap() {
        RolloutCreated::Created(id) => id,
        o => panic!("the node was not given back: {o:?}"),
    };
    // Rolling the ended one back claims the nodes it reimaged again: refused while
    // another rollout holds one.
    let (r, _) = a.rollout(won).await.unwrap().unwrap();
    let back = RolloutMove {
        state: RolloutState::RollingBack,
        reason: "test",
        wave: 0,
        queue_rollback: &[StepStatus::Reimaging],
        event_kind: "rollout.rolling-back",
        reclaim: true,
    };
    let refused = b.move_rollout(won, r.version, &back).await.unwrap();
    assert_eq!(
        refused,
        RolloutMoved::Overlap {
            mac: first,
            rollout: other
        }
    );
    let (r2, steps) = b.rollout(won).await.unwrap().unwrap();
    assert_eq!(
        (r2.state, steps[0].status),
        (RolloutState::Aborted, StepStatus::Reimaging)
    );
    a.close().await;
    b.close().await;
}

/// A stream read with a named token ends at its revocation even when the feed fell so
/// far behind that the `token.revoked` event was pruned before it got there: the gap in
/// the numbers makes it ask the token itself. A feed whose token stands reads on.
async fn a_feed_that_fell_behind_a_pruned_revocation_ends(db: Db) {
    use bootfleet::api::token::Role;
    use bootfleet::store::TokenRow;
    let (a, b) = (db.open().await, db.open().await);
    for name in ["watcher", "other"] {
        let row = TokenRow {
            name: name.into(),
            role: Role::ReadOnly,
            created_at_ms: 1_000,
            created_by: "test".into(),
            revoked_at_ms: None,
            revoked_by: None,
        };
        assert!(a.create_token(&row, &format!("hash-{name}")).await.unwrap());
    }
    let events = bootfleet::events::EventLog::new(b.clone());
    let cursor = a.events_head().await.unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let mut revoked = events.feed(cursor, None, Some("watcher".into()), stop.clone());
    let mut standing = events.feed(cursor, None, Some("other".into()), stop.clone());
    let data = serde_json::json!({});
    for _ in 0..3 {
        a.record_event("test.before", None, &data).await.unwrap();
    }
    a.revoke_token("watcher", "test", 2_000).await.unwrap();
    // Everything up to now is pruned (the newest is always kept: one more after it).
    a.record_event("test.after", None, &data).await.unwrap();
    a.record_event("test.after", None, &data).await.unwrap();
    let head = a.events_head().await.unwrap();
    assert!(a.prune_events(i64::MAX, 1, 1000).await.unwrap() > 0);
    assert_eq!(a.events_since(0, 10, None).await.unwrap()[0].seq, head);
    let next = tokio::time::timeout(std::time::Duration::from_secs(5), revoked.next())
        .await
        .expect("the feed answers");
    assert!(next.is_none(), "a revoked token's feed went on: {next:?}");
    let next = tokio::time::timeout(std::time::Duration::from_secs(5), standing.next())
        .await
        .expect("the feed answers")
        .expect("a standing token's feed reads on");
    assert_eq!((next.seq, next.kind.as_str()), (head, "test.after"));
    a.close().await;
    b.close().await;
}

/// Two servers creating the same token name: one wins; revoking on both: one revocation,
/// one event; the events name who acted (the task's actor), and the hash finds the row.
async fn a_token_name_is_taken_once_and_revoked_once_with_its_actor(db: Db) {
    use bootfleet::api::token::Role;
    use bootfleet::store::TokenRow;
    let (a, b) = (db.open().await, db.open().await);
    let row = |by: &str| TokenRow {
        name: "ci".into(),
        role: Role::Operator,
        created_at_ms: 1_000,
        created_by: by.into(),
        revoked_at_ms: None,
        revoked_by: None,
    };
    let (ra, rb) = (row("a"), row("b"));
    let (x, y) = tokio::join!(
        bootfleet::audit::acting_as("a".into(), a.create_token(&ra, "hash-a")),
        bootfleet::audit::acting_as("b".into(), b.create_token(&rb, "hash-b")),
    );
    assert!(x.unwrap() ^ y.unwrap(), "exactly one create wins");
    let winner = a.tokens().await.unwrap().remove(0);
    let hash = if winner.created_by == "a" {
        "hash-a"
    } else {
        "hash-b"
    };
    assert_eq!(b.token_by_hash(hash).await.unwrap(), Some(winner.clone()));
    assert_eq!(b.token_by_hash("hash-z").await.unwrap(), None);
    let (x, y) = tokio::join!(
        a.revoke_token("ci", "a", 2_000),
        b.revoke_token("ci", "b", 2_000)
    );
    let (x, y) = (x.unwrap().unwrap(), y.unwrap().unwrap());
    assert!(x.1 ^ y.1, "exactly one revocation: {x:?} {y:?}");
    let done = if x.1 { &x.0 } else { &y.0 };
    assert_eq!(a.revoke_token("nobody", "a", 3_000).await.unwrap(), None);
    let revoked = a.token_by_hash(hash).await.unwrap().unwrap();
    assert_eq!(revoked.revoked_at_ms, Some(2_000));
    assert_eq!(&revoked, done, "the revocation answers the row as stored");
    assert_eq!(b.token_named("ci").await.unwrap().as_ref(), Some(done));
    assert_eq!(b.token_named("nobody").await.unwrap(), None);
    let events = a.events_since(0, 100, None).await.unwrap();
    let kinds: Vec<(&str, Option<&str>)> = events
        .iter()
        .map(|e| (e.kind.as_str(), e.actor.as_deref()))
        .collect();
    assert_eq!(kinds.len(), 2, "{kinds:?}");
    assert_eq!(
        kinds[0],
        ("token.created", Some(winner.created_by.as_str()))
    );
    assert_eq!(kinds[1].0, "token.revoked");
    assert!(kinds[1].1.is_none(), "revoked outside any actor's scope");
}

/// The controller starts a state change from the record the store keeps in memory (SQLite:
/// this handle's DHCP cache); another handle's writes leave that record behind. An event
/// the old state refuses is tried again on a fresh read, and a write on the old version
/// is refused by its compare-and-set and tried again: neither is lost nor misapplied.
async fn a_state_change_from_an_out_of_date_record_is_retried_from_the_store(db: Db) {
    use bootfleet::node::controller::NodeController;
    use bootfleet::node::state::NodeEvent;
    let (a, b) = (db.open().await, db.open().await);
    let mac = mac(900);
    a.discover(&mac, None, "test").await.unwrap();
    let controller = NodeController::new(a.clone());
    let move_on_b = |from: NodeState, to: NodeState| {
        let b = b.clone();
        async move {
            let at = b.node(&mac).await.unwrap().unwrap();
            assert_eq!(at.state, from);
            let outcome = b
                .set_state(&mac, at.version, from, to, "other server", None)
                .await
                .unwrap();
            assert!(matches!(outcome, CasOutcome::Done(_)), "{outcome:?}");
        }
    };
    // a's record says discovered; the node is provisioning: attesting is allowed.
    assert_eq!(
        a.node_for_dhcp(&mac).await.unwrap().unwrap().state,
        NodeState::Discovered
    );
    move_on_b(NodeState::Discovered, NodeState::Provisioning).await;
    let node = controller
        .apply(&mac, NodeEvent::Attested { passed: true }, "test")
        .await
        .unwrap();
    assert_eq!(node.state, NodeState::Booted);
    // a's record says booted, at a version the node has left.
    move_on_b(NodeState::Booted, NodeState::Validating).await;
    let node = controller
        .apply(&mac, NodeEvent::QuarantineImposed, "test")
        .await
        .unwrap();
    assert_eq!(node.state, NodeState::Quarantined);
    let history: Vec<(Option<NodeState>, NodeState)> = a
        .node_history(&mac)
        .await
        .unwrap()
        .iter()
        .map(|c| (c.from, c.to))
        .collect();
    assert_eq!(
        history,
        [
            (None, NodeState::Discovered),
            (Some(NodeState::Discovered), NodeState::Provisioning),
            (Some(NodeState::Provisioning), NodeState::Booted),
            (Some(NodeState::Booted), NodeState::Validating),
            (Some(NodeState::Validating), NodeState::Quarantined),
        ]
    );
    // An event refused by the node's real state is refused.
    assert!(
        controller
            .apply(&mac, NodeEvent::Validated { passed: true }, "test")
            .await
            .is_err()
    );
    a.close().await;
    b.close().await;
}

/// `set_state_via`: both changes with their history, the attached row with the second;
/// on a stale version nothing at all.
async fn a_change_through_a_state_writes_both_steps_or_neither(db: Db) {
    let store = db.open().await;
    let digest = image(&store, "demo", "1").await;
    let mac = mac(901);
    store.discover(&mac, None, "test").await.unwrap();
    let node = open_boot(&store, &mac, "boot-via", &digest, None).await;
    let stale = node.version;
    let outcome = store
        .set_state(
            &mac,
            node.version,
            node.state,
            NodeState::Booted,
            "attested",
            None,
        )
        .await
        .unwrap();
    let CasOutcome::Done(booted) = outcome else {
        panic!("{outcome:?}")
    };
    let validation = Attached::Validation {
        boot_id: "boot-via",
        verdict_json: r#"{"passed":true}"#,
    };
    let via = (NodeState::Validating, "report received");
    // A stale version: nothing written, not even the first step.
    let history = store.node_history(&mac).await.unwrap().len();
    let outcome = store
        .set_state_via(
            &mac,
            stale,
            NodeState::Booted,
            via,
            NodeState::Ready,
            "validated",
            Some(&validation),
        )
        .await
        .unwrap();
    assert!(matches!(outcome, CasOutcome::Stale), "{outcome:?}");
    assert_eq!(store.node(&mac).await.unwrap().unwrap(), *booted);
    assert_eq!(store.node_history(&mac).await.unwrap().len(), history);
    let facts = store.boot_by_id("boot-via").await.unwrap().unwrap();
    assert!(facts.validated_at_ms.is_none());
    let outcome = store
        .set_state_via(
            &mac,
            booted.version,
            NodeState::Booted,
            via,
            NodeState::Ready,
            "validated",
            Some(&validation),
        )
        .await
        .unwrap();
    let CasOutcome::Done(ready) = outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(ready.state, NodeState::Ready);
    assert_eq!(ready.version, booted.version + 2);
    assert_eq!(*ready, store.node(&mac).await.unwrap().unwrap());
    assert_eq!(store.node_for_dhcp(&mac).await.unwrap().unwrap(), *ready);
    let last: Vec<(Option<NodeState>, NodeState, String)> = store
        .node_history(&mac)
        .await
        .unwrap()
        .into_iter()
        .rev()
        .take(2)
        .map(|c| (c.from, c.to, c.reason))
        .collect();
    assert_eq!(
        last,
        [
            (
                Some(NodeState::Validating),
                NodeState::Ready,
                "validated".to_string()
            ),
            (
                Some(NodeState::Booted),
                NodeState::Validating,
                "report received".to_string()
            ),
        ]
    );
    let facts = store.boot_by_id("boot-via").await.unwrap().unwrap();
    assert!(facts.validated_at_ms.is_some());
    // The second step refused (what it carries was written before): the first is not
    // written either.
    let attestation = Attached::Attestation {
        boot_id: "boot-via",
        passed: true,
        verdict_json: r#"{"passed":true}"#,
        report_json: "{}",
    };
    let through = |version| {
        store.set_state_via(
            &mac,
            version,
            NodeState::Ready,
            via,
            NodeState::Ready,
            "again",
            Some(&attestation),
        )
    };
    let again = through(ready.version).await.unwrap();
    let CasOutcome::Done(again) = again else {
        panic!("{again:?}")
    };
    let history = store.node_history(&mac).await.unwrap().len();
    let outcome = through(again.version).await.unwrap();
    assert!(
        matches!(outcome, CasOutcome::AlreadyAttested),
        "{outcome:?}"
    );
    assert_eq!(store.node(&mac).await.unwrap().unwrap(), *again);
    assert_eq!(store.node_history(&mac).await.unwrap().len(), history);
    store.close().await;
}

/// A SQLite database has one server (its write gate and its caches of nodes and boots
/// live in that process): a second on the same data directory is refused, saying why,
/// until the first is gone.
#[tokio::test]
async fn a_second_server_on_one_sqlite_database_is_refused() {
    use bootfleet::config::{FileConfig, Overrides, ServerConfig};
    let data = tempfile::tempdir().unwrap();
    let cfg = ServerConfig::resolve(
        FileConfig::default(),
        Overrides {
            data_dir: Some(data.path().to_path_buf()),
            listen: Some("127.0.0.1:0".parse().unwrap()),
            ..Default::default()
        },
    );
    let first = bootfleet::server::open_state(&cfg).await.unwrap();
    let refused = bootfleet::server::open_state(&cfg)
        .await
        .err()
        .expect("a second server is refused");
    let why = format!("{refused:#}");
    assert!(
        why.contains("another bootfleet server has") && why.contains("bootfleet.db.lock"),
        "{why}"
    );
    first.store.close().await;
    drop(first);
    let again = bootfleet::server::open_state(&cfg)
        .await
        .expect("the first server is gone");
    again.store.close().await;
}
