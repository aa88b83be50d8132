//! The console's render time against the JSON API's for the same data (bench/ui.sh):
//! headless Chromium (chromedriver on --driver) logs in to a running server and loads the
//! fleet page and the node list's first page ROUNDS times each; each load is timed from
//! navigation to its figures on screen, and set against fetching the JSON those pages
//! draw from (`/api/v1/fleet`; `/api/v1/nodes?limit=50`) and the whole node list.
//! An example, not a binary of the package: it uses the tests' WebDriver client.

use std::time::{Duration, Instant};

use fantoccini::{ClientBuilder, Locator};

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = arg("--server", "http://127.0.0.1:8080");
    let token = std::fs::read_to_string(arg("--token-file", "./bootfleet-data/admin.token"))?;
    let token = token.trim();
    let driver = arg("--driver", "http://127.0.0.1:9515");
    let rounds: usize = arg("--rounds", "10").parse()?;
    let profile = tempfile::tempdir()?;
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({ "binary": "/usr/bin/chromium", "args": [
            "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--window-size=1400,1000",
            format!("--user-data-dir={}", profile.path().display()),
        ]}),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    let c = ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&driver)
        .await?;
    c.goto(&format!("{server}/ui/")).await?;
    c.wait()
        .for_element(Locator::Id("token"))
        .await?
        .send_keys(token)
        .await?;
    c.find(Locator::Id("login")).await?.click().await?;
    c.wait().for_element(Locator::Css("#state-ready")).await?;

    let http = bootfleet::http_client::builder().build()?;
    let fetch = |path: &'static str| {
        let (http, url) = (http.clone(), format!("{server}{path}"));
        async move {
            let t = Instant::now();
            let r = http.get(url).bearer_auth(token).send().await?;
            let bytes = r.bytes().await?.len();
            Ok::<_, reqwest::Error>((t.elapsed().as_secs_f64() * 1000.0, bytes))
        }
    };
    let mut pages: Vec<(&str, &str, &str, Vec<f64>)> = vec![
        ("fleet page", "#/", "#state-ready", Vec::new()),
        ("node list page", "#/nodes", "#node-count", Vec::new()),
    ];
    let mut apis: Vec<(&str, &'static str, Vec<f64>, usize)> = vec![
        ("GET /api/v1/fleet", "/api/v1/fleet", Vec::new(), 0),
        (
            "GET /api/v1/nodes?limit=50",
            "/api/v1/nodes?limit=50",
            Vec::new(),
            0,
        ),
        ("GET /api/v1/nodes (all)", "/api/v1/nodes", Vec::new(), 0),
    ];
    for _ in 0..rounds {
        for (_, hash, wait_for, times) in pages.iter_mut() {
            // From a blank page, so every load draws from nothing.
            c.goto("about:blank").await?;
            let t = Instant::now();
            c.goto(&format!("{server}/ui/{hash}")).await?;
            c.wait()
                .at_most(Duration::from_secs(60))
                .for_element(Locator::Css(wait_for))
                .await?;
            times.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        for (_, path, times, size) in apis.iter_mut() {
            let (ms, bytes) = fetch(path).await?;
            times.push(ms);
            *size = bytes;
        }
    }
    c.close().await?;
    let fleet_api = median(apis[0].2.clone());
    let list_api = median(apis[1].2.clone());
    for (name, _, _, times) in pages {
        let m = median(times);
        let base = if name == "fleet page" {
            fleet_api
        } else {
            list_api
        };
        println!(
            "{name:<28} median {m:>8.1} ms ({:.1}x the JSON it draws from)",
            m / base
        );
    }
    for (name, _, times, bytes) in apis {
        println!("{name:<28} median {:>8.1} ms, {bytes} bytes", median(times));
    }
    Ok(())
}
