//! `bootfleet node import FILE`: an inventory as CSV (a header row naming `mac`, and
//! `image`, `labels` and the BMC columns when given; labels as `k=v` separated by spaces
//! or `;`; `bmc` as `https://...` for Redfish or `ipmi://HOST[:PORT]`, with
//! `bmc_credential` and optionally `bmc_ca`, `bmc_fingerprint`, `bmc_insecure`). The whole
//! file is checked before anything is sent, so a bad row changes nothing; then each node
//! is given its BMC, assigned its image and given its labels, one result a node.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use reqwest::Method;

use super::client::{Client, UsageError};
use super::output::OutputFormat;
use crate::api::Mac;
use crate::api::node::{AssignRequest, Bmc, LabelRequest, Node};
use crate::api::power::BmcProtocol;
use crate::api::refs::ImageRef;

/// The columns a file may have.
const COLUMNS: [&str; 7] = [
    "mac",
    "image",
    "labels",
    "bmc",
    "bmc_credential",
    "bmc_ca",
    "bmc_fingerprint",
];
/// And this one, a yes/no.
const INSECURE: &str = "bmc_insecure";

/// One node of the inventory, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub mac: Mac,
    pub image: Option<ImageRef>,
    pub labels: BTreeMap<String, String>,
    pub bmc: Option<Bmc>,
}

/// The BMC columns of one row, checked as far as the CLI can (the server checks the
/// rest when it is sent: that the credential exists, the fingerprint's form).
fn bmc_of(
    address: Option<&str>,
    credential: Option<&str>,
    ca: Option<&str>,
    fingerprint: Option<&str>,
    insecure: Option<&str>,
) -> Result<Option<Bmc>, String> {
    let Some(address) = address else {
        if credential.or(ca).or(fingerprint).or(insecure).is_some() {
            return Err("BMC settings without a bmc address".into());
        }
        return Ok(None);
    };
    let (protocol, address) = if let Some(host) = address.strip_prefix("ipmi://") {
        (BmcProtocol::Ipmi, host.to_string())
    } else if address.starts_with("https://") || address.starts_with("http://") {
        (BmcProtocol::Redfish, address.to_string())
    } else {
        return Err(format!(
            "bmc {address:?} is neither https://... (Redfish) nor ipmi://HOST[:PORT]"
        ));
    };
    let credential = credential.ok_or("a bmc needs its bmc_credential (a secret's name)")?;
    let insecure = match insecure.map(|v| v.to_ascii_lowercase()) {
        None => false,
        Some(v) if ["yes", "true", "1"].contains(&v.as_str()) => true,
        Some(v) if ["no", "false", "0"].contains(&v.as_str()) => false,
        Some(v) => return Err(format!("bmc_insecure {v:?} is not yes or no")),
    };
    if protocol == BmcProtocol::Ipmi && (ca.is_some() || fingerprint.is_some() || insecure) {
        return Err("bmc_ca, bmc_fingerprint and bmc_insecure are for Redfish BMCs".into());
    }
    Ok(Some(Bmc {
        protocol,
        address,
        credential: Some(credential.to_string()),
        ca: ca.map(str::to_string),
        fingerprint: fingerprint.map(str::to_string),
        insecure,
        quirks: Vec::new(),
    }))
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
        let h = h.to_ascii_lowercase();
        if !COLUMNS.contains(&h.as_str()) && h != INSECURE {
            return Err(format!(
                "column {h:?} is not one of {}, {INSECURE}",
                COLUMNS.join(", ")
            ));
        }
    }
    let mac_at = column("mac").ok_or("the header row names no mac column")?;
    let (image_at, labels_at) = (column("image"), column("labels"));
    let bmc_at = [
        column("bmc"),
        column("bmc_credential"),
        column("bmc_ca"),
        column("bmc_fingerprint"),
        column(INSECURE),
    ];
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
        let [address, credential, ca, fingerprint, insecure] = bmc_at.map(field);
        let bmc = bmc_of(address, credential, ca, fingerprint, insecure)
            .map_err(|e| format!("line {line}: {e}"))?;
        if image.is_none() && labels.is_empty() && bmc.is_none() {
            return Err(format!(
                "line {line}: {mac} has neither an image, labels nor a BMC"
            ));
        }
        rows.push(Row {
            mac,
            image,
            labels,
            bmc,
        });
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
                "{}: image {}, labels {}, bmc {}",
                r.mac,
                image.as_deref().unwrap_or("(unchanged)"),
                if labels.is_empty() {
                    "(unchanged)".into()
                } else {
                    labels.join(" ")
                },
                r.bmc
                    .as_ref()
                    .map_or("(unchanged)".into(), |b| b.to_string())
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
            // The BMC first: it registers a MAC the server has not seen yet.
            if let Some(bmc) = &row.bmc {
                let req = client
                    .request(Method::PUT, &format!("/api/v1/nodes/{mac}/bmc"))
                    .json(bmc);
                node = Some(client.send(req).await?);
            }
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
                node.expect("a row has an image, labels or a BMC"),
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
        assert!(err("mac,bmc\n52:54:00:00:00:01,10.0.0.9\n").contains("ipmi://"));
        assert!(err("mac,bmc\n52:54:00:00:00:01,ipmi://10.0.0.9\n").contains("bmc_credential"));
        assert!(err("mac,bmc_credential\n52:54:00:00:00:01,c\n").contains("without a bmc"));
        assert!(
            err("mac,bmc,bmc_credential,bmc_ca\n52:54:00:00:00:01,ipmi://h,c,ca.pem\n")
                .contains("for Redfish")
        );
        assert!(
            err("mac,bmc,bmc_credential,bmc_insecure\n52:54:00:00:00:01,https://h,c,maybe\n")
                .contains("yes or no")
        );
        assert!(err("mac,bmcs\n52:54:00:00:00:01,x\n").contains("bmc_insecure"));
        assert!(err("image\nx:1\n").contains("no mac column"));
        let rows = parse(
            "mac,bmc,bmc_credential,bmc_fingerprint,bmc_insecure\n\
             52:54:00:00:00:03,ipmi://10.1.12.6:623,rack12,,\n\
             52:54:00:00:00:04,https://10.1.12.7,rack12,ab:cd,no\n",
        )
        .unwrap();
        let ipmi = rows[0].bmc.as_ref().unwrap();
        assert_eq!(
            (ipmi.protocol, ipmi.address.as_str()),
            (BmcProtocol::Ipmi, "10.1.12.6:623")
        );
        let redfish = rows[1].bmc.as_ref().unwrap();
        assert_eq!(redfish.protocol, BmcProtocol::Redfish);
        assert_eq!(redfish.fingerprint.as_deref(), Some("ab:cd"));
        assert_eq!(redfish.credential.as_deref(), Some("rack12"));
        assert!(!redfish.insecure);
        assert!(err("mac,image\n52:54:00:00:00:01,\n").contains("neither"));
        assert!(err("mac,image\n").contains("no node"));
    }
}
