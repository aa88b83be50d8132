//! SQL for TPM enrolments and challenges (`TpmStore`).

use async_trait::async_trait;

use super::SqliteStore;
use crate::api::Mac;
use crate::api::event::{TpmEnrolledData, kind};
use crate::store::{StoreError, TpmChallengeRow, TpmEnrolment, TpmStore, rows};

/// The `tpm.enrolled` event of `enrol`, in the caller's transaction.
async fn record_enrolled(
    conn: &mut sqlx::SqliteConnection,
    enrol: &TpmEnrolment,
) -> Result<(), StoreError> {
    let data = TpmEnrolledData {
        ek_name: enrol.ek_name.clone(),
        certified: enrol.certified,
    };
    let at = enrol.enrolled_at_ms;
    super::events::insert_event(conn, kind::TPM_ENROLLED, Some(&enrol.mac), &data, at).await
}

#[async_trait]
impl TpmStore for SqliteStore {
    async fn put_tpm_challenge(
        &self,
        challenge: &TpmChallengeRow,
        enrol: &TpmEnrolment,
        enrol_first_seen: bool,
    ) -> Result<Option<TpmEnrolment>, StoreError> {
        let mut tx = self.write_tx().await?;
        let key = enrol.mac.to_string();
        let added = enrol_first_seen
            && sqlx::query(
                "INSERT INTO tpm_enrolments (mac, ek_name, certified, enrolled_at_ms)
                 VALUES (?, ?, ?, ?) ON CONFLICT (mac) DO NOTHING",
            )
            .bind(&key)
            .bind(&enrol.ek_name)
            .bind(i64::from(enrol.certified))
            .bind(enrol.enrolled_at_ms)
            .execute(&mut *tx)
            .await?
            .rows_affected()
                == 1;
        let stored: Option<rows::TpmEnrolmentRow> = sqlx::query_as(
            "SELECT mac, ek_name, certified, enrolled_at_ms FROM tpm_enrolments WHERE mac = ?",
        )
        .bind(&key)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(stored) = stored.map(rows::tpm_enrolment).transpose()? else {
            tx.abandon().await?;
            return Ok(None);
        };
        if stored.ek_name != challenge.ek_name {
            tx.abandon().await?;
            return Ok(Some(stored));
        }
        sqlx::query(
            "INSERT INTO tpm_challenges
               (boot_id, mac, ak_public, ek_name, secret_sha256, issued_at_ms)
             VALUES (?, ?, ?, ?, ?, ?)
             ON CONFLICT (boot_id) DO UPDATE SET ak_public = excluded.ak_public,
               ek_name = excluded.ek_name, secret_sha256 = excluded.secret_sha256,
               issued_at_ms = excluded.issued_at_ms",
        )
        .bind(&challenge.boot_id)
        .bind(challenge.mac.to_string())
        .bind(&challenge.ak_public)
        .bind(&challenge.ek_name)
        .bind(&challenge.secret_sha256)
        .bind(challenge.issued_at_ms)
        .execute(&mut *tx)
        .await?;
        if added {
            record_enrolled(&mut tx, enrol).await?;
        }
        tx.commit().await?;
        if added {
            self.notify_events();
        }
        Ok(Some(stored))
    }

    async fn set_tpm_enrolment(&self, enrol: &TpmEnrolment) -> Result<(), StoreError> {
        let mut tx = self.write_tx().await?;
        sqlx::query(
            "INSERT INTO tpm_enrolments (mac, ek_name, certified, enrolled_at_ms)
             VALUES (?, ?, ?, ?) ON CONFLICT (mac) DO UPDATE SET ek_name = excluded.ek_name,
               certified = excluded.certified, enrolled_at_ms = excluded.enrolled_at_ms",
        )
        .bind(enrol.mac.to_string())
        .bind(&enrol.ek_name)
        .bind(i64::from(enrol.certified))
        .bind(enrol.enrolled_at_ms)
        .execute(&mut *tx)
        .await?;
        record_enrolled(&mut tx, enrol).await?;
        tx.commit().await?;
        self.notify_events();
        Ok(())
    }

    async fn forget_tpm_enrolment(&self, mac: &Mac) -> Result<bool, StoreError> {
        let mut tx = self.write_tx().await?;
        let gone: Option<(String,)> =
            sqlx::query_as("DELETE FROM tpm_enrolments WHERE mac = ? RETURNING ek_name")
                .bind(mac.to_string())
                .fetch_optional(&mut *tx)
                .await?;
        let Some((ek_name,)) = gone else {
            tx.abandon().await?;
            return Ok(false);
        };
        let data = serde_json::json!({ "ek_name": ek_name });
        super::events::insert_event(
            &mut tx,
            kind::TPM_FORGOTTEN,
            Some(mac),
            &data,
            crate::clock::now_ms(),
        )
        .await?;
        tx.commit().await?;
        self.notify_events();
        Ok(true)
    }

    async fn tpm_challenge(&self, boot_id: &str) -> Result<Option<TpmChallengeRow>, StoreError> {
        let found: Option<rows::TpmChallengeTuple> = sqlx::query_as(
            "SELECT boot_id, mac, ak_public, ek_name, secret_sha256, issued_at_ms
             FROM tpm_challenges WHERE boot_id = ?",
        )
        .bind(boot_id)
        .fetch_optional(&self.pool)
        .await?;
        found.map(rows::tpm_challenge).transpose()
    }

    async fn end_tpm_challenge(&self, boot_id: &str) -> Result<(), StoreError> {
        let mut tx = self.write_tx().await?;
        sqlx::query("DELETE FROM tpm_challenges WHERE boot_id = ?")
            .bind(boot_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn tpm_enrolment(&self, mac: &Mac) -> Result<Option<TpmEnrolment>, StoreError> {
        let found: Option<rows::TpmEnrolmentRow> = sqlx::query_as(
            "SELECT mac, ek_name, certified, enrolled_at_ms FROM tpm_enrolments WHERE mac = ?",
        )
        .bind(mac.to_string())
        .fetch_optional(&self.pool)
        .await?;
        found.map(rows::tpm_enrolment).transpose()
    }
}
