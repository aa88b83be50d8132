//! SQL for named API tokens: created and revoked each with its event.

use async_trait::async_trait;

use super::PgStore;
use crate::api::event::{TokenEventData, kind};
use crate::store::{StoreError, TokenRow, TokenStore, rows};

/// `SELECT` and the columns `rows::token` reads, then the rest of the query.
macro_rules! select_tokens {
    ($rest:literal) => {
        concat!(
            "SELECT name, role, created_at_ms, created_by, revoked_at_ms, revoked_by FROM api_tokens ",
            $rest
        )
    };
}

#[async_trait]
impl TokenStore for PgStore {
    async fn create_token(&self, row: &TokenRow, secret_sha256: &str) -> Result<bool, StoreError> {
        let mut tx = self.tx().await?;
        let done = sqlx::query(
            "INSERT INTO api_tokens (name, role, secret_sha256, created_at_ms, created_by)
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
        )
        .bind(&row.name)
        .bind(row.role.as_str())
        .bind(secret_sha256)
        .bind(row.created_at_ms)
        .bind(&row.created_by)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            return Ok(false);
        }
        let data = TokenEventData {
            name: row.name.clone(),
            role: row.role,
        };
        super::events::insert_event(&mut tx, kind::TOKEN_CREATED, None, &data, row.created_at_ms)
            .await?;
        tx.commit().await?;
        self.notify_events();
        Ok(true)
    }
    async fn token_by_hash(&self, secret_sha256: &str) -> Result<Option<TokenRow>, StoreError> {
        let row: Option<rows::TokenColumns> =
            sqlx::query_as(select_tokens!("WHERE secret_sha256 = $1"))
                .bind(secret_sha256)
                .fetch_optional(&self.pool)
                .await?;
        row.map(rows::token).transpose()
    }
    async fn token_named(&self, name: &str) -> Result<Option<TokenRow>, StoreError> {
        let row: Option<rows::TokenColumns> = sqlx::query_as(select_tokens!("WHERE name = $1"))
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        row.map(rows::token).transpose()
    }
    async fn tokens(&self) -> Result<Vec<TokenRow>, StoreError> {
        let rows: Vec<rows::TokenColumns> = sqlx::query_as(select_tokens!("ORDER BY name"))
            .fetch_all(&self.pool)
            .await?;
        rows.into_iter().map(rows::token).collect()
    }
    async fn revoke_token(
        &self,
        name: &str,
        by: &str,
        at_ms: i64,
    ) -> Result<Option<(TokenRow, bool)>, StoreError> {
        let mut tx = self.tx().await?;
        // Locked, so two servers revoking at once write one revocation and one event.
        let row: Option<rows::TokenColumns> =
            sqlx::query_as(select_tokens!("WHERE name = $1 FOR UPDATE"))
                .bind(name)
                .fetch_optional(&mut *tx)
                .await?;
        let Some(mut row) = row.map(rows::token).transpose()? else {
            return Ok(None);
        };
        if row.revoked_at_ms.is_some() {
            return Ok(Some((row, false)));
        }
        sqlx::query("UPDATE api_tokens SET revoked_at_ms = $1, revoked_by = $2 WHERE name = $3")
            .bind(at_ms)
            .bind(by)
            .bind(name)
            .execute(&mut *tx)
            .await?;
        let data = TokenEventData {
            name: row.name.clone(),
            role: row.role,
        };
        super::events::insert_event(&mut tx, kind::TOKEN_REVOKED, None, &data, at_ms).await?;
        row.revoked_at_ms = Some(at_ms);
        row.revoked_by = Some(by.to_string());
        tx.commit().await?;
        self.notify_events();
        Ok(Some((row, true)))
    }
}
