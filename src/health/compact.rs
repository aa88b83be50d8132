//! The readings a node keeps for the API, in a few bytes each: numbers narrowed, throttle
//! reasons and port states as codes from NVML's and sysfs's names, port names once a node.
//! At 10,000 nodes of 8 GPUs and 8 ports, a heartbeat's readings are ~300 bytes here
//! against ~1.8 KB as API values with their strings.

use crate::api::agent::{GpuSample, IbPortSample};
use crate::api::health::{GpuReading, HealthReading, PortReading};

/// NVML's clock throttle reason names, a bit each; any other name is `OTHER`.
const THROTTLE: [&str; 11] = [
    "GPU_IDLE",
    "APPLICATIONS_CLOCKS_SETTING",
    "SW_POWER_CAP",
    "HW_SLOWDOWN",
    "SYNC_BOOST",
    "SW_THERMAL_SLOWDOWN",
    "HW_THERMAL_SLOWDOWN",
    "HW_POWER_BRAKE_SLOWDOWN",
    "DISPLAY_CLOCK_SETTING",
    "USER_DEFINED_CLOCKS",
    "OTHER",
];
/// The mask's bit for "could not be read".
const UNREADABLE: u16 = 1 << 15;

/// sysfs port states (the word after the number), a code each; 0 is none, past the list
/// is `OTHER`.
const STATES: [&str; 6] = ["DOWN", "INIT", "ARMED", "ACTIVE", "ACTIVE_DEFER", "OTHER"];

#[derive(Debug, Clone)]
struct Gpu {
    index: u16,
    temperature_c: Option<u16>,
    /// Tenths of a watt.
    power_dw: Option<u32>,
    sm_clock_mhz: Option<u16>,
    throttle: u16,
    ecc_corrected: Option<u64>,
    ecc_uncorrected: Option<u64>,
    xids: u32,
}

#[derive(Debug, Clone)]
struct Port {
    /// Into the node's port names.
    name: u8,
    state: u8,
    rate_gbps: Option<f32>,
    link_downed: Option<u32>,
}

#[derive(Debug, Clone)]
pub struct Reading {
    at_ms: i64,
    gpus: Box<[Gpu]>,
    ports: Box<[Port]>,
}

fn throttle_mask(reasons: Option<&Vec<String>>) -> u16 {
    let Some(reasons) = reasons else {
        return UNREADABLE;
    };
    reasons.iter().fold(0, |mask, r| {
        let bit = THROTTLE
            .iter()
            .position(|k| k == r)
            .unwrap_or(THROTTLE.len() - 1);
        mask | (1 << bit)
    })
}

fn throttle_names(mask: u16) -> Option<Vec<String>> {
    (mask & UNREADABLE == 0).then(|| {
        THROTTLE
            .iter()
            .enumerate()
            .filter(|(bit, _)| mask & (1 << bit) != 0)
            .map(|(_, n)| n.to_string())
            .collect()
    })
}

fn state_code(state: Option<&str>) -> u8 {
    match state {
        None => 0,
        Some(s) => {
            STATES
                .iter()
                .position(|k| *k == s)
                .unwrap_or(STATES.len() - 1) as u8
                + 1
        }
    }
}

fn narrow<T: TryFrom<u64>>(v: u64) -> Option<T> {
    T::try_from(v).ok()
}

impl Reading {
    /// `names`: the node's port names so far; a new one is added (up to 255).
    pub fn new(
        at_ms: i64,
        gpus: &[GpuSample],
        ports: &[IbPortSample],
        names: &mut Vec<String>,
    ) -> Self {
        let gpus = gpus
            .iter()
            .map(|g| Gpu {
                index: g.index.min(u32::from(u16::MAX)) as u16,
                temperature_c: g.temperature_c.and_then(|t| narrow(u64::from(t))),
                power_dw: g
                    .power_w
                    .and_then(|w| narrow((w.max(0.0) * 10.0).round() as u64)),
                sm_clock_mhz: g.sm_clock_mhz.and_then(|c| narrow(u64::from(c))),
                throttle: throttle_mask(g.throttle_reasons.as_ref()),
                ecc_corrected: g.ecc.map(|e| e.volatile_corrected),
                ecc_uncorrected: g.ecc.map(|e| e.volatile_uncorrected),
                xids: g.xids.min(u64::from(u32::MAX)) as u32,
            })
            .collect();
        let ports = ports
            .iter()
            .filter_map(|p| {
                let name = match names.iter().position(|n| *n == p.port) {
                    Some(i) => i,
                    None if names.len() < 255 => {
                        names.push(p.port.chars().take(96).collect());
                        names.len() - 1
                    }
                    None => return None,
                };
                Some(Port {
                    name: name as u8,
                    state: state_code(p.state.as_deref()),
                    rate_gbps: p.rate_gbps.map(|r| r as f32),
                    link_downed: p.link_downed.and_then(narrow),
                })
            })
            .collect();
        Reading { at_ms, gpus, ports }
    }

    /// As the API shows it.
    pub fn view(&self, names: &[String]) -> HealthReading {
        HealthReading {
            at: crate::clock::format_ms(self.at_ms),
            gpus: self
                .gpus
                .iter()
                .map(|g| GpuReading {
                    index: u32::from(g.index),
                    temperature_c: g.temperature_c.map(u32::from),
                    power_w: g.power_dw.map(|d| f64::from(d) / 10.0),
                    sm_clock_mhz: g.sm_clock_mhz.map(u32::from),
                    throttle_reasons: throttle_names(g.throttle),
                    ecc_corrected: g.ecc_corrected,
                    ecc_uncorrected: g.ecc_uncorrected,
                    xids: u64::from(g.xids),
                })
                .collect(),
            ports: self
                .ports
                .iter()
                .map(|p| PortReading {
                    port: names.get(usize::from(p.name)).cloned().unwrap_or_default(),
                    state: p
                        .state
                        .checked_sub(1)
                        .map(|c| STATES[usize::from(c)].to_string()),
                    rate_gbps: p.rate_gbps.map(f64::from),
                    link_downed: p.link_downed.map(u64::from),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::agent::EccCounts;

    #[test]
    fn a_reading_comes_back_as_it_went_in() {
        let gpu = GpuSample {
            index: 3,
            temperature_c: Some(91),
            power_w: Some(612.3),
            sm_clock_mhz: Some(1110),
            throttle_reasons: Some(vec!["HW_THERMAL_SLOWDOWN".into(), "SW_POWER_CAP".into()]),
            ecc: Some(EccCounts {
                volatile_corrected: 12,
                ..Default::default()
            }),
            xids: 2,
            ..Default::default()
        };
        let blind = GpuSample {
            index: 4,
            throttle_reasons: None,
            ..Default::default()
        };
        let port = IbPortSample {
            port: "mlx5_0/1".into(),
            state: Some("ACTIVE".into()),
            rate_gbps: Some(400.0),
            link_downed: Some(5),
            ..Default::default()
        };
        let mut names = Vec::new();
        let r = Reading::new(1_000, &[gpu, blind], &[port.clone(), port], &mut names);
        assert_eq!(names, ["mlx5_0/1"], "a port's name is kept once");
        let v = r.view(&names);
        let g = &v.gpus[0];
        assert_eq!(
            (g.index, g.temperature_c, g.power_w),
            (3, Some(91), Some(612.3))
        );
        assert_eq!(g.sm_clock_mhz, Some(1110));
        assert_eq!(
            g.throttle_reasons.as_deref(),
            Some(
                &[
                    "SW_POWER_CAP".to_string(),
                    "HW_THERMAL_SLOWDOWN".to_string()
                ][..]
            )
        );
        assert_eq!((g.ecc_corrected, g.xids), (Some(12), 2));
        assert_eq!(
            v.gpus[1].throttle_reasons, None,
            "unreadable stays unreadable"
        );
        assert_eq!(v.gpus[1].temperature_c, None);
        let p = &v.ports[0];
        assert_eq!(p.port, "mlx5_0/1");
        assert_eq!(p.state.as_deref(), Some("ACTIVE"));
        assert_eq!((p.rate_gbps, p.link_downed), (Some(400.0), Some(5)));
    }
}
