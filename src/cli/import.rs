//! `bootfleet node import FILE`: an inventory as CSV (a header row naming `mac`, and
//! `image` and `labels` when given; labels as `k=v` separated by spaces or `;`). The whole
//! file is checked before anything is sent, so a bad row changes nothing; then each node
//! is assigned its image and given its labels, one result a node. A `bmc` column is
//! refused until power control can use it.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use reqwest::Method;

use super::client::{Client, UsageError};
use super::output::OutputFormat;
use crate::api::Mac;
use crate::api::node::{AssignRequest, LabelRequest, Node};
use crate::api::refs::ImageRef;

/// One node of the inventory, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub mac: Mac,
    pub image: Option<ImageRef>,
    pub labels: BTreeMap<String, String>,
}

/// Parses the inventory; the first problem found is an error naming its line.
pub fn parse(text: &str) -> Result<Vec<Row>, String> {
    let mut reader = csv::ReaderBuilder::new()
        .trim(csv::Trim::All)
        .comment(Some(b'#'))
        .from_reader(text.as_bytes());
    let headers = reader.headers().map_err(|e| e.to_string())?.clone();
    let column = |name: &str| headers.iter().position(|h| h.eq_ignore_ascii_case(name));
    for h in headers.iter() {
        if !["mac", "image", "labels"].contains(&h.to_ascii_lowercase().as_str()) {
            return Err(format!(
                "column {h:?} is not one of mac, image, labels{}",
                if h.eq_ignore_ascii_case("bmc") {
                    " (BMC addresses are not taken yet: power control is not built)"
                } else {
                    ""
                }
            ));
        }
    }
    let mac_at = column("mac").ok_or("the header row names no mac column")?;
    let (image_at, labels_at) = (column("image"), column("labels"));
    let mut rows: Vec<Row> = Vec::new();
    for record in reader.records() {
        let record = record.map_err(|e| e.to_string())?;
        let line = record.position().map_or(0, |p| p.line());
        let field = |at: Option<usize>| at.and_then(|i| record.get(i)).filter(|v| !v.is_empty());
        let mac: Mac = field(Some(mac_at))
            .ok_or_else(|| format!("line {line}: no MAC"))?
            .parse()
            .map_err(|e| format!("line {line}: {e}"))?;
        if rows.iter().any(|r| r.mac == mac) {
            return Err(format!("line {line}: {mac} is listed twice"));
        }
        let image = field(image_at)
            .map(ImageRef::parse)
            .transpose()
            .map_err(|e| format!("line {line}: {e}"))?;
        let mut labels = BTreeMap::new();
        for pair in field(labels_at)
            .unwrap_or("")
            .split([' ', ';'])
            .filter(|p| !p.is_empty())
        {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| format!("line {line}: label {pair:?} is not key=value"))?;
            labels.insert(k.to_string(), v.to_string());
        }
        if image.is_none() && labels.is_empty() {
            return Err(format!(
                "line {line}: {mac} has neither an image nor labels"
            ));
        }
        rows.push(Row { mac, image, labels });
    }
    if rows.is_empty() {
        return Err("the file lists no node".into());
    }
    Ok(rows)
}

/// Checks `path` whole, then (unless `dry_run`) assigns and labels each node in turn.
pub async fn run(
    client: &Client,
    path: &Path,
    dry_run: bool,
    out: OutputFormat,
) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let rows = parse(&text).map_err(|e| UsageError(format!("{}: {e}", path.display())))?;
    if dry_run {
        for r in &rows {
            let image = r.image.as_ref().map(|i| i.to_string());
            let labels: Vec<String> = r.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            println!(
                "{}: image {}, labels {}",
                r.mac,
                image.as_deref().unwrap_or("(unchanged)"),
                if labels.is_empty() {
                    "(unchanged)".into()
                } else {
                    labels.join(" ")
                }
            );
        }
        println!("{} node(s) checked; nothing sent (--dry-run)", rows.len());
        return Ok(());
    }
    let by_mac: BTreeMap<Mac, &Row> = rows.iter().map(|r| (r.mac, r)).collect();
    let macs: Vec<Mac> = rows.iter().map(|r| r.mac).collect();
    let line = |n: &Node| {
        format!(
            "{}: {} {}",
            n.mac,
            n.assigned.as_deref().unwrap_or("-"),
            n.labels
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" ")
        )
    };
    let text = |v: &serde_json::Value| super::bulk::as_text(v, line);
    super::bulk::run_each(&macs, out, text, |mac| {
        let row = by_mac[&mac];
        async move {
            let mut node: Option<Node> = None;
            if let Some(image) = &row.image {
                let req = client
                    .request(Method::PUT, &format!("/api/v1/nodes/{mac}/image"))
                    .json(&AssignRequest {
                        image: image.to_string(),
                    });
                node = Some(client.send(req).await?);
            }
            if !row.labels.is_empty() {
                let req = client
                    .request(Method::PATCH, &format!("/api/v1/nodes/{mac}/labels"))
                    .json(&LabelRequest {
                        set: row.labels.clone(),
                        remove: Vec::new(),
                    });
                node = Some(client.send(req).await?);
            }
            Ok(serde_json::to_value(
                node.expect("a row has an image or labels"),
            )?)
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inventory_is_checked_whole_with_the_line_of_each_problem() {
        let rows = parse(
            "# rack 12\nmac,image,labels\n52:54:00:00:00:01, gpu-node:stable, rack=r12;sku=hgx\n52-54-00-00-00-02,,rack=r12 pool=batch\n",
        )
        .unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(
            rows[0].image.as_ref().unwrap().to_string(),
            "gpu-node:stable"
        );
        assert_eq!(rows[0].labels["sku"], "hgx");
        assert_eq!(rows[1].image, None);
        assert_eq!(rows[1].labels["pool"], "batch");
        let err = |text: &str| parse(text).unwrap_err();
        assert!(err("mac,image\nnot-a-mac,x:1\n").contains("line 2"));
        assert!(err("mac,image\n52:54:00:00:00:01,x:1\n52:54:00:00:00:01,x:2\n").contains("twice"));
        assert!(err("mac,labels\n52:54:00:00:00:01,rack\n").contains("key=value"));
        assert!(err("mac,bmc\n52:54:00:00:00:01,10.0.0.9\n").contains("power control"));
        assert!(err("image\nx:1\n").contains("no mac column"));
        assert!(err("mac,image\n52:54:00:00:00:01,\n").contains("neither"));
        assert!(err("mac,image\n").contains("no node"));
    }
}
