//! Named API tokens and their roles: what `bootfleet token create|list|revoke` sends and
//! reads. A token's secret is shown once, in `TokenCreated`; the server keeps its hash.

use serde::{Deserialize, Serialize};

/// What a token may do. Each role can do what the ones after it can, except that a
/// fleet controller, which acts on nodes, reads less than an operator.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = TokenRole))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// Everything, tokens and BMC credentials included.
    Admin,
    /// Images, tags, nodes, reimages, power and rollouts; not tokens or BMC credentials.
    Operator,
    /// Reads nodes and events; reimages (within the disruption budget, into the node's
    /// assigned image) and revalidates. Nothing else.
    FleetController,
    /// Reads everything an operator reads; changes nothing.
    ReadOnly,
}

impl Role {
    pub const ALL: [Role; 4] = [
        Role::Admin,
        Role::Operator,
        Role::FleetController,
        Role::ReadOnly,
    ];

    /// The wire and database spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Operator => "operator",
            Role::FleetController => "fleet-controller",
            Role::ReadOnly => "read-only",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| {
                format!("unknown role {s:?}: admin, operator, fleet-controller or read-only")
            })
    }
}

/// `POST /api/v1/tokens`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenRequest {
    /// Lowercase letters, digits, `.`, `_` and `-`, at most 64; names the token in the
    /// audit trail, so a name is never given to a second token (even once revoked).
    pub name: String,
    pub role: Role,
}

/// The answer to a created token: the only time its secret is shown (never by `Debug`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Clone, Serialize, Deserialize)]
pub struct TokenCreated {
    pub name: String,
    pub role: Role,
    /// The bearer token. The server keeps only its SHA-256: it cannot be shown again.
    pub token: String,
    pub created_at: String,
}

impl std::fmt::Debug for TokenCreated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenCreated")
            .field("name", &self.name)
            .field("role", &self.role)
            .field("token", &"..")
            .field("created_at", &self.created_at)
            .finish()
    }
}

/// A token as listed: never its secret.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenInfo {
    pub name: String,
    pub role: Role,
    pub created_at: String,
    /// The token that created it.
    pub created_by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_by: Option<String>,
}

/// `GET /api/v1/tokens`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenList {
    pub tokens: Vec<TokenInfo>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_spell_the_same_on_the_wire_and_in_as_str() {
        for role in Role::ALL {
            let wire = serde_json::to_value(role).unwrap();
            assert_eq!(wire, role.as_str());
            assert_eq!(role.as_str().parse::<Role>().unwrap(), role);
        }
        assert!("root".parse::<Role>().is_err());
    }
}
