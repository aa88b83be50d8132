//! Redfish over HTTPS: the system resource's `PowerState`, the `ComputerSystem.Reset`
//! action, `Boot.BootSourceOverride*` for a one-time network boot, inventory from the same
//! resource. Sessions where the BMC offers them (and deleted afterwards: BMCs keep few),
//! basic auth where it does not.
//!
//! Quirks handled, after the anchors that document them:
//! - some BMCs accept a boot override and silently revert it (bmclib#459, Supermicro; rufio
//!   reported success): the override is read back after every write;
//! - some demand `If-Match` with the resource's ETag on PATCH (HPE iLO 5, sushy's
//!   `etag` handling): the ETag from the GET is sent when there is one, and a 412 gets
//!   one fresh read and retry;
//! - sushy-tools (and libvirt-backed BMCs) keep overrides `Continuous`, not `Once`:
//!   `Continuous` with target `Pxe` is accepted (a bootfleet node network-boots anyway);
//! - a reset may answer 202 with a task monitor: it is polled until it is no longer 202;
//! - errors carry `error.@Message.ExtendedInfo[].Message`, which is what is shown.

use std::time::Duration;

use async_trait::async_trait;

use crate::api::Mac;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use super::secrets::Credentials;
use super::tls::Trust;
use super::{Driver, Op, PowerError};
use crate::api::power::{BmcInventory, PowerState};

/// How the client authenticates after `login`.
enum Auth {
    Session {
        token: String,
        location: Option<String>,
    },
    Basic,
}

pub struct Redfish {
    client: reqwest::Client,
    /// `https://host:port`
    origin: String,
    /// The system's path, when the address named it; found from `/redfish/v1/Systems`
    /// otherwise.
    system: tokio::sync::OnceCell<String>,
    creds: Credentials,
    auth: tokio::sync::OnceCell<Auth>,
    timeout: Duration,
}

const SYSTEMS: &str = "/redfish/v1/Systems";

impl Redfish {
    pub fn new(
        address: &str,
        trust: &Trust,
        creds: Credentials,
        timeout: Duration,
    ) -> Result<Self, PowerError> {
        let url = url::Url::parse(address)
            .map_err(|e| PowerError::Config(format!("Redfish address {address:?}: {e}")))?;
        match url.scheme() {
            "https" => {}
            "http" if matches!(trust, Trust::Insecure) => {}
            "http" => {
                return Err(PowerError::Config(format!(
                    "Redfish address {address:?} is plain http: credentials would cross the network in clear; use https, or mark the BMC insecure"
                )));
            }
            s => {
                return Err(PowerError::Config(format!(
                    "Redfish address {address:?}: scheme {s} is not https"
                )));
            }
        }
        let host = url.host_str().ok_or_else(|| {
            PowerError::Config(format!("Redfish address {address:?} has no host"))
        })?;
        let origin = match url.port() {
            Some(p) => format!("{}://{host}:{p}", url.scheme()),
            None => format!("{}://{host}", url.scheme()),
        };
        let path = url.path().trim_end_matches('/');
        let system = tokio::sync::OnceCell::new();
        if path.starts_with(&format!("{SYSTEMS}/")) {
            let _ = system.set(path.to_string());
        } else if !path.is_empty() {
            return Err(PowerError::Config(format!(
                "Redfish address {address:?}: the path must be empty or {SYSTEMS}/ID"
            )));
        }
        let client = crate::http_client::builder()
            .connect_timeout(timeout.min(Duration::from_secs(10)))
            .timeout(timeout)
            .no_proxy()
            // A BMC that redirects is followed only within itself (sushy answers an alias
            // with 307 to the system's UUID).
            .redirect(reqwest::redirect::Policy::limited(3))
            .tls_backend_preconfigured(
                super::tls::client_config(trust).map_err(PowerError::Config)?,
            )
            .build()
            .map_err(|e| PowerError::Config(format!("Redfish client: {e}")))?;
        Ok(Self {
            client,
            origin,
            system,
            creds,
            auth: tokio::sync::OnceCell::new(),
            timeout,
        })
    }

    fn url(&self, path: &str) -> String {
        if path.starts_with("http://") || path.starts_with("https://") {
            path.to_string()
        } else {
            format!("{}{path}", self.origin)
        }
    }

    /// A session if the BMC makes one, else basic auth.
    async fn login(&self) -> Result<&Auth, PowerError> {
        self.auth
            .get_or_try_init(|| async {
                let body =
                    json!({"UserName": self.creds.username, "Password": self.creds.password});
                let resp = self
                    .client
                    .post(self.url("/redfish/v1/SessionService/Sessions"))
                    .json(&body)
                    .send()
                    .await
                    .map_err(|e| self.transport(e))?;
                let status = resp.status();
                if status.is_success()
                    && let Some(token) = resp.headers().get("x-auth-token")
                {
                    let token = token.to_str().unwrap_or_default().to_string();
                    let location = resp
                        .headers()
                        .get("location")
                        .and_then(|l| l.to_str().ok())
                        .map(str::to_string);
                    return Ok(Auth::Session { token, location });
                }
                // No session: the BMC has no SessionService (404, 405, 501), or guards
                // even its session endpoint with basic auth (sushy-tools answers 401).
                // Basic auth is tried; wrong credentials fail there with the BMC's words.
                Ok(Auth::Basic)
            })
            .await
    }

    fn transport(&self, e: reqwest::Error) -> PowerError {
        if e.is_timeout() {
            return PowerError::Timeout(self.timeout);
        }
        // The chain holds rustls's reason (a pin mismatch, an unknown issuer).
        let mut chain = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            chain = format!("{chain}: {s}");
            source = s.source();
        }
        if chain.contains("certificate") || chain.contains("fingerprint") || chain.contains("tls") {
            PowerError::Tls(chain)
        } else {
            PowerError::Unreachable(chain)
        }
    }

    /// One request, authenticated; an error status becomes the BMC's message.
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        if_match: Option<&str>,
    ) -> Result<(StatusCode, reqwest::header::HeaderMap, Value), PowerError> {
        let auth = self.login().await?;
        let mut req = self.client.request(method, self.url(path));
        req = match auth {
            Auth::Session { token, .. } => req.header("X-Auth-Token", token),
            Auth::Basic => req.basic_auth(&self.creds.username, Some(&self.creds.password)),
        };
        if let Some(tag) = if_match {
            req = req.header("If-Match", tag);
        }
        if let Some(b) = body {
            req = req.json(b);
        }
        let resp = req.send().await.map_err(|e| self.transport(e))?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let value = body_of(resp).await;
        if status.is_success() {
            return Ok((status, headers, value));
        }
        let text = error_text(status, &value);
        Err(match status {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => PowerError::Auth(text),
            _ => PowerError::Refused(text),
        })
    }

    async fn system_path(&self) -> Result<&str, PowerError> {
        self.system
            .get_or_try_init(|| async {
                let (_, _, v) = self.call(Method::GET, SYSTEMS, None, None).await?;
                let members = v["Members"].as_array().cloned().unwrap_or_default();
                match members.as_slice() {
                    [one] => one["@odata.id"]
                        .as_str()
                        .map(|s| s.trim_end_matches('/').to_string())
                        .ok_or_else(|| PowerError::Refused("Systems member without @odata.id".into())),
                    [] => Err(PowerError::Refused("the BMC lists no systems".into())),
                    many => Err(PowerError::Config(format!(
                        "the BMC manages {} systems; give the one to use in the address (https://HOST{SYSTEMS}/ID)",
                        many.len()
                    ))),
                }
            })
            .await
            .map(String::as_str)
    }

    async fn system(&self) -> Result<(Value, Option<String>), PowerError> {
        let path = self.system_path().await?.to_string();
        let (_, headers, v) = self.call(Method::GET, &path, None, None).await?;
        let etag = headers
            .get("etag")
            .and_then(|t| t.to_str().ok())
            .map(str::to_string)
            .or_else(|| v["@odata.etag"].as_str().map(str::to_string));
        Ok((v, etag))
    }

    /// Polls a task monitor until the task is no longer running, within the timeout.
    async fn wait_task(&self, monitor: &str) -> Result<(), PowerError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            let (status, _, v) = self.call(Method::GET, monitor, None, None).await?;
            if status != StatusCode::ACCEPTED {
                return match v["TaskState"].as_str() {
                    Some("Exception" | "Killed" | "Cancelled") => Err(PowerError::Refused(
                        format!("task {monitor} ended {}", v["TaskState"]),
                    )),
                    _ => Ok(()),
                };
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(PowerError::Timeout(self.timeout));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

async fn body_of(resp: reqwest::Response) -> Value {
    let bytes = resp.bytes().await.unwrap_or_default();
    serde_json::from_slice(&bytes).unwrap_or(Value::Null)
}

/// The BMC's own words for an error: each `@Message.ExtendedInfo` Message, else the
/// error's `message`, else the status.
pub fn error_text(status: StatusCode, body: &Value) -> String {
    let err = &body["error"];
    let infos: Vec<String> = err["@Message.ExtendedInfo"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| i["Message"].as_str().map(str::to_string))
        .collect();
    let words = if !infos.is_empty() {
        infos.join("; ")
    } else if let Some(m) = err["message"].as_str() {
        m.to_string()
    } else {
        status.canonical_reason().unwrap_or("error").to_string()
    };
    format!("{} {words}", status.as_u16())
}

/// The Redfish PowerState as ours.
pub fn power_state(s: Option<&str>) -> PowerState {
    match s {
        Some("On") => PowerState::On,
        Some("Off") => PowerState::Off,
        _ => PowerState::Changing,
    }
}

/// The ResetType for `op`, from what the system allows (all of them when it does not say).
pub fn reset_type(op: Op, allowed: &[String]) -> &'static str {
    let ok = |t: &str| allowed.is_empty() || allowed.iter().any(|a| a == t);
    match op {
        Op::On => "On",
        Op::ForceOff => "ForceOff",
        Op::GracefulOff => "GracefulShutdown",
        // PowerCycle is a true off-and-on; ForceRestart (a reset) is what sushy and
        // many BMCs offer instead.
        Op::Cycle if ok("PowerCycle") && !allowed.is_empty() => "PowerCycle",
        Op::Cycle => "ForceRestart",
    }
}

/// Whether a read-back override is a network boot that will happen.
pub fn override_kept(boot: &Value) -> Result<String, String> {
    let target = boot["BootSourceOverrideTarget"].as_str().unwrap_or("None");
    let enabled = boot["BootSourceOverrideEnabled"]
        .as_str()
        .unwrap_or("Disabled");
    let seen = format!("{target} {enabled}");
    if target == "Pxe" && matches!(enabled, "Once" | "Continuous") {
        Ok(seen)
    } else {
        Err(seen)
    }
}

#[async_trait]
impl Driver for Redfish {
    async fn state(&self) -> Result<PowerState, PowerError> {
        let (v, _) = self.system().await?;
        Ok(power_state(v["PowerState"].as_str()))
    }

    async fn act(&self, op: Op) -> Result<(), PowerError> {
        let (v, _) = self.system().await?;
        let reset = &v["Actions"]["#ComputerSystem.Reset"];
        let target = reset["target"]
            .as_str()
            .map(str::to_string)
            .unwrap_or(format!(
                "{}/Actions/ComputerSystem.Reset",
                self.system_path().await?
            ));
        let allowed: Vec<String> = reset["ResetType@Redfish.AllowableValues"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str().map(str::to_string))
            .collect();
        let body = json!({"ResetType": reset_type(op, &allowed)});
        let (status, headers, _) = self.call(Method::POST, &target, Some(&body), None).await?;
        if status == StatusCode::ACCEPTED
            && let Some(monitor) = headers.get("location").and_then(|l| l.to_str().ok())
        {
            self.wait_task(monitor).await?;
        }
        Ok(())
    }

    async fn netboot_once(&self) -> Result<String, PowerError> {
        let path = self.system_path().await?.to_string();
        let (v, mut etag) = self.system().await?;
        let mut boot = json!({
            "BootSourceOverrideTarget": "Pxe",
            "BootSourceOverrideEnabled": "Once",
        });
        // UEFI where the system says it boots UEFI (a legacy override on a UEFI machine is
        // what some BMCs refuse, and others accept and ignore).
        if let Some(mode) = v["Boot"]["BootSourceOverrideMode"].as_str() {
            boot["BootSourceOverrideMode"] = json!(mode);
        }
        let patch = json!({ "Boot": boot });
        for attempt in 0..2 {
            match self
                .call(Method::PATCH, &path, Some(&patch), etag.as_deref())
                .await
            {
                Ok(_) => break,
                Err(PowerError::Refused(m)) if attempt == 0 && m.starts_with("412") => {
                    etag = self.system().await?.1;
                }
                Err(e) => return Err(e),
            }
        }
        let (after, _) = self.system().await?;
        override_kept(&after["Boot"]).map_err(|seen| {
            PowerError::NotKept(format!(
                "the BMC accepted a one-time network boot but reads back {seen}"
            ))
        })
    }

    async fn inventory(&self) -> Result<BmcInventory, PowerError> {
        let (v, _) = self.system().await?;
        let text = |k: &str| v[k].as_str().filter(|s| !s.is_empty()).map(str::to_string);
        Ok(BmcInventory {
            manufacturer: text("Manufacturer"),
            model: text("Model"),
            serial: text("SerialNumber"),
            bios_version: text("BiosVersion"),
            uuid: text("UUID"),
            macs: Vec::new(),
        })
    }

    async fn nic_macs(&self) -> Result<Vec<Mac>, PowerError> {
        let (v, _) = self.system().await?;
        let Some(collection) = v["EthernetInterfaces"]["@odata.id"].as_str() else {
            return Ok(Vec::new());
        };
        let (_, _, list) = self.call(Method::GET, collection, None, None).await?;
        let mut macs = Vec::new();
        // A host has a handful of NICs; a BMC listing more is not believed past 32.
        for member in list["Members"].as_array().into_iter().flatten().take(32) {
            let Some(path) = member["@odata.id"].as_str() else {
                continue;
            };
            let (_, _, nic) = self.call(Method::GET, path, None, None).await?;
            let mac = ["MACAddress", "PermanentMACAddress"]
                .iter()
                .find_map(|k| nic[k].as_str()?.parse::<Mac>().ok());
            if let Some(mac) = mac.filter(|m| !macs.contains(m)) {
                macs.push(mac);
            }
        }
        Ok(macs)
    }

    async fn close(&self) {
        if let Some(Auth::Session {
            token,
            location: Some(location),
        }) = self.auth.get()
        {
            let _ = self
                .client
                .delete(self.url(location))
                .header("X-Auth-Token", token)
                .send()
                .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_show_extended_info_then_message_then_status() {
        let v = json!({"error": {"message": "general", "@Message.ExtendedInfo": [
            {"Message": "The property Foo is read-only."}, {"Message": "Try again."}]}});
        assert_eq!(
            error_text(StatusCode::BAD_REQUEST, &v),
            "400 The property Foo is read-only.; Try again."
        );
        let v = json!({"error": {"message": "Fake system x was not found",
            "@Message.ExtendedInfo": [{"MessageId": "Base.1.0.GeneralError"}]}});
        assert_eq!(
            error_text(StatusCode::NOT_FOUND, &v),
            "404 Fake system x was not found"
        );
        assert_eq!(
            error_text(StatusCode::BAD_GATEWAY, &Value::Null),
            "502 Bad Gateway"
        );
    }

    #[test]
    fn overrides_that_revert_are_caught() {
        assert!(
            override_kept(
                &json!({"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once"})
            )
            .is_ok()
        );
        assert!(override_kept(&json!({"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Continuous"})).is_ok());
        assert_eq!(
            override_kept(
                &json!({"BootSourceOverrideTarget": "Hdd", "BootSourceOverrideEnabled": "Disabled"})
            ),
            Err("Hdd Disabled".into())
        );
        assert!(
            override_kept(
                &json!({"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Disabled"})
            )
            .is_err()
        );
    }

    #[test]
    fn reset_types_follow_what_the_system_allows() {
        let sushy: Vec<String> = [
            "On",
            "ForceOff",
            "GracefulShutdown",
            "GracefulRestart",
            "ForceRestart",
            "Nmi",
            "ForceOn",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(reset_type(Op::Cycle, &sushy), "ForceRestart");
        assert_eq!(
            reset_type(Op::Cycle, &["PowerCycle".to_string()]),
            "PowerCycle"
        );
        assert_eq!(reset_type(Op::Cycle, &[]), "ForceRestart");
        assert_eq!(reset_type(Op::GracefulOff, &sushy), "GracefulShutdown");
        assert_eq!(power_state(Some("PoweringOn")), PowerState::Changing);
    }

    #[test]
    fn plain_http_needs_insecure_and_paths_must_name_a_system() {
        let creds = || Credentials {
            username: "u".into(),
            password: "p".into(),
        };
        let t = Duration::from_secs(5);
        let e = Redfish::new("http://10.0.0.9", &Trust::SystemRoots, creds(), t)
            .err()
            .unwrap();
        assert!(e.to_string().contains("plain http"));
        assert!(Redfish::new("http://10.0.0.9", &Trust::Insecure, creds(), t).is_ok());
        let e = Redfish::new("https://10.0.0.9/other", &Trust::SystemRoots, creds(), t)
            .err()
            .unwrap();
        assert!(e.to_string().contains("Systems/ID"));
        let r = Redfish::new(
            "https://10.0.0.9:8443/redfish/v1/Systems/abc/",
            &Trust::SystemRoots,
            creds(),
            t,
        )
        .unwrap();
        assert_eq!(
            r.system.get().map(String::as_str),
            Some("/redfish/v1/Systems/abc")
        );
        assert_eq!(r.origin, "https://10.0.0.9:8443");
    }
}
