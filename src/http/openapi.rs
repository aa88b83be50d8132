//! The OpenAPI document's frame (title, security schemes, tags, the error answer every
//! operation may give) and `GET /api/v1/openapi.json`. The operations come from the
//! handlers' `#[utoipa::path]` annotations, registered with their routes in one place
//! (`http::admin_routes` and its siblings), so a route cannot lose its operation.
//! `docs/openapi.json` is the checked-in copy: a test keeps it equal to the code, and
//! `bootfleet openapi > docs/openapi.json` rewrites it.

use std::sync::LazyLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::{ContentBuilder, RefOr, ResponseBuilder};
use utoipa::{Modify, PartialSchema};

#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "bootfleet",
        description = "Network-boot provisioning for bare-metal GPU clusters. The admin API \
            (`/api/v1`, but `/api/v1/agent`) takes the admin token or a named token as a bearer \
            token (each named token has a role: admin, operator, fleet-controller, read-only; a \
            route its role does not allow answers 403), or the console's session cookie with its \
            CSRF header; the agent's calls take the boot token its boot script carried; \
            `/metrics` takes any of the API tokens or the scrape-only token. \
            Every error answer is `{\"error\": \"<reason>\"}`."
    ),
    security(("admin" = [])),
    modifiers(&Schemes),
    tags(
        (name = "boot", description = "What nodes fetch while they boot: scripts, blobs, overlays"),
        (name = "agent", description = "The node agent's reports, by boot token"),
        (name = "nodes", description = "Nodes: list, show, assign, label, reimage, remove"),
        (name = "images", description = "Images, tags and blobs"),
        (name = "power", description = "Power control through BMCs"),
        (name = "rollouts", description = "Rollouts of an image across nodes, gated on health"),
        (name = "events", description = "The event log: pages and a live feed"),
        (name = "tokens", description = "Named API tokens with a role: create, list, revoke (admin only)"),
        (name = "health", description = "Liveness and readiness"),
        (name = "metrics", description = "Prometheus metrics"),
        (name = "api", description = "This document")
    )
)]
pub struct ApiDoc;

/// The bearer tokens: the admin's, a boot's (the agent's), the scrape-only token.
struct Schemes;

impl Modify for Schemes {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        for name in ["admin", "boot", "scrape"] {
            components.add_security_scheme(
                name,
                SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
            );
        }
    }
}

/// What the routes' operations need once all are in: the error answer and unique ids.
pub fn finish(doc: &mut utoipa::openapi::OpenApi) {
    error_answers(doc);
    operation_ids(doc);
}

/// Every operation's `default` answer: the error body, whatever the status.
fn error_answers(doc: &mut utoipa::openapi::OpenApi) {
    let error = ResponseBuilder::new()
        .description("An error: 4xx for a request refused, 5xx for a server fault.")
        .content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(RefOr::Ref(utoipa::openapi::Ref::from_schema_name(
                    "ErrorBody",
                ))))
                .build(),
        )
        .build();
    let components = doc.components.get_or_insert_with(Default::default);
    components
        .schemas
        .insert("ErrorBody".into(), crate::api::ErrorBody::schema());
    for item in doc.paths.paths.values_mut() {
        for op in item_operations(item) {
            op.responses
                .responses
                .entry("default".into())
                .or_insert_with(|| RefOr::T(error.clone()));
        }
    }
}

/// Operation ids from the tag and the handler's name (`nodes_list`, `images_list`):
/// the handlers' names alone repeat across modules, and generators want them unique.
fn operation_ids(doc: &mut utoipa::openapi::OpenApi) {
    for item in doc.paths.paths.values_mut() {
        for op in item_operations(item) {
            let tag = op.tags.as_ref().and_then(|t| t.first()).cloned();
            if let (Some(tag), Some(id)) = (tag, op.operation_id.as_mut()) {
                *id = format!("{tag}_{id}");
            }
        }
    }
}

fn item_operations(
    item: &mut utoipa::openapi::PathItem,
) -> impl Iterator<Item = &mut utoipa::openapi::path::Operation> {
    [
        &mut item.get,
        &mut item.put,
        &mut item.post,
        &mut item.delete,
        &mut item.patch,
        &mut item.head,
        &mut item.options,
        &mut item.trace,
    ]
    .into_iter()
    .filter_map(Option::as_mut)
}

/// The document as served and checked in: built once, pretty, with a final newline.
pub fn json() -> &'static str {
    static JSON: LazyLock<String> = LazyLock::new(|| {
        let mut text = super::openapi()
            .to_pretty_json()
            .expect("an OpenAPI document serializes");
        text.push('\n');
        text
    });
    &JSON
}

/// `GET /api/v1/openapi.json`.
#[utoipa::path(
    get, path = "/openapi.json", tag = "api",
    responses((status = 200, description = "This document (OpenAPI 3.1)", body = Object))
)]
pub async fn document() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], json()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checked_in_document_is_what_the_code_declares() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.json");
        let checked_in = std::fs::read_to_string(path).expect("docs/openapi.json is there");
        assert!(
            checked_in == json(),
            "docs/openapi.json differs from the routes' declarations: run \
             `cargo run -- openapi > docs/openapi.json` and review the diff"
        );
    }

    /// Every operation: a unique id, a tag, an answer for success and the error answer;
    /// every `$ref` names a schema that is there.
    #[test]
    fn every_operation_is_whole_and_every_reference_resolves() {
        let doc: serde_json::Value = serde_json::from_str(json()).unwrap();
        let mut ids = std::collections::BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                let id = op["operationId"].as_str().unwrap();
                assert!(
                    ids.insert(id.to_string()),
                    "{method} {path}: id {id} repeats"
                );
                assert!(op["tags"][0].is_string(), "{method} {path}: no tag");
                let answers = op["responses"].as_object().unwrap();
                assert!(
                    answers.contains_key("default"),
                    "{method} {path}: no error answer"
                );
                assert!(
                    answers.keys().any(|k| k.starts_with('2')),
                    "{method} {path}: no success answer"
                );
            }
        }
        assert!(ids.len() > 40, "{} operations", ids.len());
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        let mut refs = Vec::new();
        collect_refs(&doc, &mut refs);
        for r in refs {
            let name = r.strip_prefix("#/components/schemas/").unwrap_or(&r);
            assert!(schemas.contains_key(name), "{r} names no schema");
        }
    }

    fn collect_refs(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v.as_str()) {
                        ("$ref", Some(r)) => out.push(r.to_string()),
                        _ => collect_refs(v, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| collect_refs(v, out)),
            _ => {}
        }
    }

    /// The admin API is behind the admin token; the agent's calls behind a boot's; what
    /// nodes fetch while they boot and the health checks behind nothing.
    #[test]
    fn each_operation_names_the_token_it_takes() {
        let doc: serde_json::Value = serde_json::from_str(json()).unwrap();
        let default = &doc["security"];
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                let security = op.get("security").unwrap_or(default);
                let names: Vec<&str> = security
                    .as_array()
                    .unwrap()
                    .iter()
                    .flat_map(|s| s.as_object().unwrap().keys().map(String::as_str))
                    .collect();
                let expected: &[&str] =
                    if path.starts_with("/api/v1/agent/") || path == "/boot/overlay" {
                        &["boot"]
                    } else if path.starts_with("/api/v1/") {
                        &["admin"]
                    } else if path.starts_with("/metrics") {
                        &["admin", "scrape"]
                    } else {
                        &[]
                    };
                assert_eq!(names, expected, "{method} {path}");
            }
        }
    }
}
