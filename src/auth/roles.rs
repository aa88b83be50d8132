//! What each role may do, as one table over the admin API's routes: a request needs an
//! access level (from its method and route template), and each role grants some levels.
//! A route not named here is a plain read (GET) or an operator's write, so a new write
//! route is never open to a read-only or fleet-controller token by omission.

use axum::http::Method;

use crate::api::token::Role;

/// What a request needs, from least to most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Reads of nodes, their health and the event log: what a fleet controller watches.
    FleetRead,
    /// Every other read (images, tags, rollouts, BMC registrations, ...).
    Read,
    /// Reimage and revalidate a node: a fleet controller's two actions.
    NodeRepair,
    /// Changes to images, tags, nodes, power and rollouts.
    Operate,
    /// Tokens, BMC credentials and TPM enrolments.
    Admin,
}

/// Reads a fleet controller makes, relative to `/api/v1`.
const FLEET_READS: &[&str] = &[
    "/nodes",
    "/nodes/{mac}",
    "/nodes/{mac}/health",
    "/fleet",
    "/events",
    "/events/stream",
    "/openapi.json",
];

/// What a request with `method` to `route` (its template, relative to `/api/v1`) needs.
pub fn needs(method: &Method, route: &str) -> Access {
    let read = method == Method::GET || method == Method::HEAD;
    if route == "/tokens" || route.starts_with("/tokens/") {
        return Access::Admin;
    }
    if read {
        return if FLEET_READS.contains(&route) {
            Access::FleetRead
        } else {
            Access::Read
        };
    }
    match route {
        // They carry (or remove) a BMC's credentials.
        "/nodes/{mac}/bmc" | "/bmcs" | "/bmcs/{id}" => Access::Admin,
        // They decide which TPM, hence which hardware, a node's attestation trusts.
        "/nodes/{mac}/tpm" => Access::Admin,
        "/nodes/{mac}/reimage" | "/nodes/{mac}/revalidate" => Access::NodeRepair,
        _ => Access::Operate,
    }
}

/// Whether `role` grants `access`.
pub fn grants(role: Role, access: Access) -> bool {
    use Access::*;
    match role {
        Role::Admin => true,
        Role::Operator => access != Admin,
        Role::FleetController => matches!(access, FleetRead | NodeRepair),
        Role::ReadOnly => matches!(access, FleetRead | Read),
    }
}

/// Whether `role` may send `method` to `route`.
pub fn allows(role: Role, method: &Method, route: &str) -> bool {
    grants(role, needs(method, route))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_role_gets_what_its_name_says() {
        let post = Method::POST;
        let get = Method::GET;
        // A fleet controller: node reads, reimage, revalidate; nothing else.
        let fc = Role::FleetController;
        assert!(allows(fc, &get, "/nodes/{mac}"));
        assert!(allows(fc, &post, "/nodes/{mac}/reimage"));
        assert!(allows(fc, &post, "/nodes/{mac}/revalidate"));
        assert!(!allows(fc, &post, "/images"));
        assert!(!allows(fc, &Method::PUT, "/tags/{name}/{tag}"));
        assert!(!allows(fc, &get, "/images"));
        assert!(!allows(fc, &get, "/tokens"));
        // Read-only: every read but the tokens, no write.
        let ro = Role::ReadOnly;
        assert!(allows(ro, &get, "/images"));
        assert!(allows(ro, &get, "/nodes"));
        assert!(!allows(ro, &get, "/tokens"));
        assert!(!allows(ro, &post, "/nodes/{mac}/reimage"));
        assert!(!allows(ro, &Method::PATCH, "/nodes/{mac}/labels"));
        // An operator: all but tokens and BMC credentials.
        let op = Role::Operator;
        assert!(allows(op, &post, "/images"));
        assert!(allows(op, &post, "/nodes/{mac}/power"));
        assert!(!allows(op, &Method::PUT, "/nodes/{mac}/bmc"));
        assert!(!allows(op, &post, "/bmcs"));
        assert!(!allows(op, &post, "/tokens"));
        assert!(!allows(op, &Method::DELETE, "/tokens/{name}"));
        // An unknown write is an operator's.
        assert!(!allows(ro, &post, "/something-new"));
        assert!(!allows(fc, &Method::DELETE, "/something-new"));
        assert!(allows(Role::Admin, &Method::DELETE, "/tokens/{name}"));
    }
}
