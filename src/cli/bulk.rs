//! Admin commands over many nodes at once (`node assign`, `node reimage` with several
//! MACs or `--selector`): which nodes, one request each in turn, and a result per node.
//! One refusal (a disruption budget spent) does not stop the rest; the command fails if
//! any node did.

use reqwest::Method;
use serde::Serialize;

use super::client::{Client, UsageError};
use super::output::{OutputFormat, emit};
use crate::api::Mac;
use crate::api::node::{Node, NodeQuery};

/// What one node's request came to.
#[derive(Debug, Serialize)]
pub struct NodeResult {
    pub mac: Mac,
    /// The server's answer, when it accepted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answer: Option<serde_json::Value>,
    /// Why not, when it refused or could not be reached.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The nodes meant: `macs` as given, or the nodes `selector` matches (never both).
pub async fn targets(
    client: &Client,
    macs: &[String],
    selector: Option<String>,
) -> anyhow::Result<Vec<Mac>> {
    match (macs.is_empty(), selector) {
        (false, Some(_)) => Err(UsageError("give MACs or --selector, not both".into()).into()),
        (true, None) => Err(UsageError("give at least one MAC, or --selector".into()).into()),
        (false, None) => macs
            .iter()
            .map(|m| {
                m.parse::<Mac>()
                    .map_err(|e| UsageError(format!("{m}: {e}")).into())
            })
            .collect(),
        (true, Some(selector)) => {
            let query = NodeQuery {
                selector: Some(selector.clone()),
                ..Default::default()
            };
            let nodes: Vec<Node> = client
                .send(client.request(Method::GET, "/api/v1/nodes").query(&query))
                .await?;
            if nodes.is_empty() {
                anyhow::bail!("no node matches --selector {selector:?}");
            }
            Ok(nodes.into_iter().map(|n| n.mac).collect())
        }
    }
}

/// A result's answer as its text line: `line` of the type the server sent, or the JSON
/// as it came when it is not that type.
pub fn as_text<T: serde::de::DeserializeOwned>(
    v: &serde_json::Value,
    line: impl Fn(&T) -> String,
) -> String {
    serde_json::from_value::<T>(v.clone())
        .map(|t| line(&t))
        .unwrap_or_else(|_| v.to_string())
}

/// Runs `one` for each node in turn; prints a line (or, as JSON, the list) of results;
/// fails naming how many were refused.
pub async fn run_each<F, Fut>(
    nodes: &[Mac],
    out: OutputFormat,
    text: impl Fn(&serde_json::Value) -> String,
    one: F,
) -> anyhow::Result<()>
where
    F: Fn(Mac) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<serde_json::Value>>,
{
    run_bounded(nodes, 1, out, text, one).await
}

/// As `run_each`, with up to `width` requests in flight; results print in the nodes'
/// order as they complete in it.
pub async fn run_bounded<F, Fut>(
    nodes: &[Mac],
    width: usize,
    out: OutputFormat,
    text: impl Fn(&serde_json::Value) -> String,
    one: F,
) -> anyhow::Result<()>
where
    F: Fn(Mac) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<serde_json::Value>>,
{
    use futures_util::StreamExt as _;
    let mut pending = futures_util::stream::iter(nodes.iter().map(|mac| {
        let fut = one(*mac);
        async move { (*mac, fut.await) }
    }))
    .buffered(width.max(1));
    let mut results = Vec::with_capacity(nodes.len());
    while let Some((mac, outcome)) = pending.next().await {
        let result = match outcome {
            Ok(answer) => NodeResult {
                mac,
                answer: Some(answer),
                error: None,
            },
            Err(e) => NodeResult {
                mac,
                answer: None,
                error: Some(format!("{e:#}")),
            },
        };
        if out == OutputFormat::Text {
            match (&result.answer, &result.error) {
                (Some(a), _) => println!("{}", text(a)),
                (_, Some(e)) => println!("{mac}: error: {e}"),
                _ => {}
            }
        }
        results.push(result);
    }
    if out == OutputFormat::Json {
        emit(out, &results, |_| {})?;
    }
    let failed = results.iter().filter(|r| r.error.is_some()).count();
    if failed > 0 {
        anyhow::bail!("{failed} of {} node(s) refused or failed", results.len());
    }
    Ok(())
}
