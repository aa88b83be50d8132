//! Named API tokens: created with a role and shown once, kept only as a SHA-256 (a token
//! is 256 random bits, so an unsalted hash is as good as a password hash here, and a
//! lookup by it is one indexed read), looked up on each request so that a revocation
//! takes effect at once on every server sharing the store.

use crate::api::token::{Role, TokenCreated, TokenInfo, TokenRequest};
use crate::clock::{format_ms, now_ms};
use crate::store::{Store, StoreError, TokenRow};

use super::AdminToken;

/// How a named token begins, so that one found in a log or a repository is recognised
/// (and never mistaken for the admin token, which is bare hex).
pub const PREFIX: &str = "bft_";
/// The name the first-start admin token acts under; no named token may take it.
pub const ADMIN_NAME: &str = "admin";

/// Who a request comes from, once authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub name: String,
    pub role: Role,
}

impl Caller {
    pub fn admin() -> Self {
        Self {
            name: ADMIN_NAME.into(),
            role: Role::Admin,
        }
    }
}

/// Why a presented token was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No token has this secret.
    Unknown,
    /// The token was revoked: a real token (a job not yet told), not a guess.
    Revoked,
}

impl Refusal {
    /// The label it is counted under in `/metrics`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Refusal::Unknown => "unknown",
            Refusal::Revoked => "revoked",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ManageError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    NotFound(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

pub struct Tokens {
    store: Store,
    admin: AdminToken,
}

fn sha256_hex(secret: &str) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(secret.as_bytes()))
}

/// Lowercase letters, digits, `.`, `_`, `-`; at most 64, starting with a letter or digit.
fn check_name(name: &str) -> Result<(), ManageError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-'));
    if !ok {
        return Err(ManageError::BadRequest(format!(
            "token name {name:?}: use 1 to 64 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit"
        )));
    }
    if name == ADMIN_NAME {
        return Err(ManageError::BadRequest(format!(
            "the name {ADMIN_NAME:?} is the first-start admin token's"
        )));
    }
    Ok(())
}

fn info(row: TokenRow) -> TokenInfo {
    TokenInfo {
        name: row.name,
        role: row.role,
        created_at: format_ms(row.created_at_ms),
        created_by: row.created_by,
        revoked_at: row.revoked_at_ms.map(format_ms),
        revoked_by: row.revoked_by,
    }
}

impl Tokens {
    pub fn new(store: Store, admin: AdminToken) -> Self {
        Self { store, admin }
    }

    /// The admin token, or a named token that is not revoked.
    pub async fn authenticate(
        &self,
        presented: &str,
    ) -> Result<Result<Caller, Refusal>, StoreError> {
        if self.admin.matches(presented) {
            return Ok(Ok(Caller::admin()));
        }
        if !presented.starts_with(PREFIX) {
            return Ok(Err(Refusal::Unknown));
        }
        Ok(
            match self.store.token_by_hash(&sha256_hex(presented)).await? {
                None => Err(Refusal::Unknown),
                Some(row) if row.revoked_at_ms.is_some() => Err(Refusal::Revoked),
                Some(row) => Ok(Caller {
                    name: row.name,
                    role: row.role,
                }),
            },
        )
    }

    /// The caller a console session names: the admin, or a named token that is still
    /// not revoked (a session ends with its token).
    pub async fn caller_named(&self, name: &str) -> Result<Result<Caller, Refusal>, StoreError> {
        if name == ADMIN_NAME {
            return Ok(Ok(Caller::admin()));
        }
        Ok(match self.store.token_named(name).await? {
            None => Err(Refusal::Unknown),
            Some(row) if row.revoked_at_ms.is_some() => Err(Refusal::Revoked),
            Some(row) => Ok(Caller {
                name: row.name,
                role: row.role,
            }),
        })
    }

    pub async fn create(
        &self,
        req: &TokenRequest,
        by: &Caller,
    ) -> Result<TokenCreated, ManageError> {
        check_name(&req.name)?;
        let secret = format!("{PREFIX}{}", hex::encode(rand::random::<[u8; 32]>()));
        let row = TokenRow {
            name: req.name.clone(),
            role: req.role,
            created_at_ms: now_ms(),
            created_by: by.name.clone(),
            revoked_at_ms: None,
            revoked_by: None,
        };
        if !self.store.create_token(&row, &sha256_hex(&secret)).await? {
            return Err(ManageError::Conflict(format!(
                "a token named {:?} exists or existed; names are never reused, so the audit trail names one token",
                req.name
            )));
        }
        tracing::info!(name = %row.name, role = %row.role, by = %by.name, "token created");
        Ok(TokenCreated {
            name: row.name,
            role: row.role,
            token: secret,
            created_at: format_ms(row.created_at_ms),
        })
    }

    pub async fn list(&self) -> Result<Vec<TokenInfo>, StoreError> {
        Ok(self.store.tokens().await?.into_iter().map(info).collect())
    }

    /// Revokes `name` at once; revoking it again changes nothing.
    pub async fn revoke(&self, name: &str, by: &Caller) -> Result<TokenInfo, ManageError> {
        let Some((row, revoked)) = self.store.revoke_token(name, &by.name, now_ms()).await? else {
            return Err(ManageError::NotFound(format!("no token named {name:?}")));
        };
        if revoked {
            tracing::info!(name, by = %by.name, "token revoked");
        }
        Ok(info(row))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_admin_is_reserved() {
        assert!(check_name("ci-deployer").is_ok());
        assert!(check_name("fleet.controller_2").is_ok());
        for bad in ["", "Ops", "-x", "a b", "admin", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }
}
