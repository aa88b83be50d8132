//! GPU readings behind one narrow interface: `Nvml` reads the real devices through
//! nvml-wrapper (which dlopens libnvidia-ml.so.1 at run time, so the agent starts on a
//! machine without the driver and reports why NVML is unavailable); `Recorded` replays a
//! JSON file of readings, which is how tests drive the real path.

use std::path::PathBuf;

use bootfleet_api::agent::{
    EccCounts, GpuFacts, GpuSample, NvLink, PcieLink, RECENT_XIDS, RetiredPages, RowRemap,
    ValidationReport, Xid, pci_bus_key,
};

/// Readings for the validation report; XIDs and checks are added by the caller.
pub trait GpuSource {
    fn read(&self) -> ValidationReport;
}

/// Replays `path` (a validation report as JSON).
pub struct Recorded(pub PathBuf);

impl GpuSource for Recorded {
    fn read(&self) -> ValidationReport {
        match std::fs::read_to_string(&self.0)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
        {
            Ok(r) => r,
            Err(e) => ValidationReport {
                nvml_error: Some(format!("recorded readings {}: {e}", self.0.display())),
                ..Default::default()
            },
        }
    }
}

/// Each GPU's readings for a heartbeat, with the XIDs the kernel logged for it.
pub fn samples(gpus: &[GpuFacts], xids: &[Xid]) -> Vec<GpuSample> {
    gpus.iter()
        .map(|g| {
            let bus = g.pci_bus_id.as_deref().map(pci_bus_key);
            let codes: Vec<u32> = xids
                .iter()
                .filter(|x| bus.is_some() && x.pci_bus_id.as_deref().map(pci_bus_key) == bus)
                .map(|x| x.code)
                .collect();
            let recent = codes[codes.len().saturating_sub(RECENT_XIDS)..].to_vec();
            // What NVML did not answer, by the name the server's rules use.
            let missing = [
                ("temperature", g.temperature_c.is_none()),
                ("power", g.power_w.is_none()),
                ("ecc", g.ecc.is_none()),
                ("sm_clock", g.sm_clock_mhz.is_none()),
                ("pcie_replay", g.pcie_replay.is_none()),
            ]
            .into_iter()
            .filter(|(_, gone)| *gone)
            .map(|(name, _)| name.to_string())
            .collect();
            GpuSample {
                index: g.index,
                uuid: g.uuid.clone(),
                name: g.name.clone(),
                pci_bus_id: g.pci_bus_id.clone(),
                temperature_c: g.temperature_c,
                power_w: g.power_w,
                ecc: g.ecc,
                xids: codes.len() as u64,
                recent_xids: recent,
                sm_clock_mhz: g.sm_clock_mhz,
                sm_clock_max_mhz: g.sm_clock_max_mhz,
                // None (a missing reading) when NVML did not answer, never "none held".
                throttle_reasons: (g.error.is_none() && !g.throttle_unreadable)
                    .then(|| g.throttle_reasons.clone()),
                row_remap: g.row_remap,
                pcie_replay: g.pcie_replay,
                nvlink_errors: g.nvlink_errors,
                missing,
            }
        })
        .collect()
}

pub struct Nvml;

/// NVLinks a GPU can have (NVML_NVLINK_MAX_LINKS); absent links answer NotSupported.
const MAX_NVLINKS: u32 = 18;

impl GpuSource for Nvml {
    fn read(&self) -> ValidationReport {
        let nvml = match nvml_wrapper::Nvml::init() {
            Ok(n) => n,
            Err(e) => {
                return ValidationReport {
                    nvml_error: Some(format!("NVML unavailable: {e}")),
                    ..Default::default()
                };
            }
        };
        let count = match nvml.device_count() {
            Ok(c) => c,
            Err(e) => {
                return ValidationReport {
                    nvml_error: Some(format!("NVML cannot count GPUs: {e}")),
                    driver_version: nvml.sys_driver_version().ok(),
                    ..Default::default()
                };
            }
        };
        let gpus = (0..count).map(|i| read_gpu(&nvml, i)).collect();
        ValidationReport {
            driver_version: nvml.sys_driver_version().ok(),
            gpus,
            ..Default::default()
        }
    }
}

/// One GPU's readings; a failing query leaves its reading out, a failing handle is the
/// GPU's error ("Unknown Error", "GPU is lost").
fn read_gpu(nvml: &nvml_wrapper::Nvml, index: u32) -> GpuFacts {
    use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
    use nvml_wrapper::enums::device::SampleValue;
    use nvml_wrapper::structs::device::FieldId;
    use nvml_wrapper::sys_exports::field_id::{
        NVML_FI_DEV_REMAPPED_COR, NVML_FI_DEV_REMAPPED_FAILURE, NVML_FI_DEV_REMAPPED_PENDING,
        NVML_FI_DEV_REMAPPED_UNC,
    };
    let device = match nvml.device_by_index(index) {
        Ok(d) => d,
        Err(e) => {
            return GpuFacts {
                index,
                error: Some(e.to_string()),
                ..Default::default()
            };
        }
    };
    let mut g = GpuFacts {
        index,
        uuid: device.uuid().unwrap_or_default(),
        serial: device.serial().ok(),
        name: device.name().unwrap_or_default(),
        memory_mib: device.memory_info().ok().map(|m| m.total >> 20),
        pci_bus_id: device.pci_info().ok().map(|p| p.bus_id),
        ecc_enabled: device.is_ecc_enabled().ok().map(|e| e.currently_enabled),
        temperature_c: device.temperature(TemperatureSensor::Gpu).ok(),
        power_w: device.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
        persistence_mode: device.is_in_persistent_mode().ok(),
        mig_enabled: device.mig_mode().ok().map(|m| m.current == 1),
        ..Default::default()
    };
    if g.uuid.is_empty()
        && let Err(e) = device.uuid()
    {
        g.error = Some(e.to_string());
    }
    if let (Ok(gen_current), Ok(gen_max), Ok(width_current), Ok(width_max)) = (
        device.current_pcie_link_gen(),
        device.max_pcie_link_gen(),
        device.current_pcie_link_width(),
        device.max_pcie_link_width(),
    ) {
        g.pcie = Some(PcieLink {
            gen_current,
            gen_max,
            width_current,
            width_max,
        });
    }
    let ecc = |kind, counter| device.total_ecc_errors(kind, counter).ok();
    if let (Some(vc), Some(vu)) = (
        ecc(MemoryError::Corrected, EccCounter::Volatile),
        ecc(MemoryError::Uncorrected, EccCounter::Volatile),
    ) {
        g.ecc = Some(EccCounts {
            volatile_corrected: vc,
            volatile_uncorrected: vu,
            aggregate_corrected: ecc(MemoryError::Corrected, EccCounter::Aggregate).unwrap_or(0),
            aggregate_uncorrected: ecc(MemoryError::Uncorrected, EccCounter::Aggregate)
                .unwrap_or(0),
        });
    }
    if let Ok(pending) = device.are_pages_pending_retired() {
        g.retired_pages = Some(RetiredPages {
            pending,
            ..Default::default()
        });
    }
    // Row remapping is not wrapped: NVML field values (A100 and later).
    let ids = [
        NVML_FI_DEV_REMAPPED_COR,
        NVML_FI_DEV_REMAPPED_UNC,
        NVML_FI_DEV_REMAPPED_PENDING,
        NVML_FI_DEV_REMAPPED_FAILURE,
    ]
    .map(FieldId);
    if let Ok(values) = device.field_values_for(&ids) {
        let v: Vec<Option<u64>> = values
            .into_iter()
            .map(|s| match s.ok()?.value.ok()? {
                SampleValue::U32(x) => Some(u64::from(x)),
                SampleValue::U64(x) => Some(x),
                SampleValue::I64(x) => u64::try_from(x).ok(),
                SampleValue::F64(x) => Some(x as u64),
            })
            .collect();
        if let [Some(cor), Some(unc), Some(pending), Some(failure)] = v.as_slice() {
            g.row_remap = Some(RowRemap {
                correctable: *cor,
                uncorrectable: *unc,
                pending: *pending != 0,
                failure: *failure != 0,
            });
        }
    }
    match device.current_throttle_reasons() {
        Ok(reasons) => {
            g.throttle_reasons = reasons
                .iter_names()
                .map(|(name, _)| name.to_string())
                .collect();
        }
        Err(_) => g.throttle_unreadable = true,
    }
    {
        use nvml_wrapper::enum_wrappers::device::Clock;
        g.sm_clock_mhz = device.clock_info(Clock::SM).ok();
        g.sm_clock_max_mhz = device.max_clock_info(Clock::SM).ok();
    }
    g.pcie_replay = device.pcie_replay_counter().ok().map(u64::from);
    let mut nvlink_errors: Option<u64> = None;
    for link in 0..MAX_NVLINKS {
        let wrapper = device.link_wrapper_for(link);
        if let Ok(active) = wrapper.is_active() {
            g.nvlinks.push(NvLink { link, active });
            use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
            for counter in [
                ErrorCounter::DlCrcFlit,
                ErrorCounter::DlCrcData,
                ErrorCounter::DlReplay,
                ErrorCounter::DlRecovery,
            ] {
                if let Ok(n) = wrapper.error_counter(counter) {
                    *nvlink_errors.get_or_insert(0) += n;
                }
            }
        }
    }
    g.nvlink_errors = nvlink_errors;
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_count_each_gpus_xids_by_its_pci_address() {
        let gpu = |index, bus: &str| GpuFacts {
            index,
            uuid: format!("GPU-{index}"),
            pci_bus_id: Some(bus.into()),
            temperature_c: Some(40 + index),
            ..Default::default()
        };
        let gpus = [gpu(0, "00000000:3B:00.0"), gpu(1, "00000000:5E:00.0")];
        let xid = |bus: Option<&str>| Xid {
            code: 79,
            pci_bus_id: bus.map(String::from),
            line: String::new(),
        };
        let xids = [xid(Some("0000:3b:00")), xid(Some("0000:3b:00")), xid(None)];
        let s = samples(&gpus, &xids);
        assert_eq!((s[0].xids, s[1].xids), (2, 0));
        assert_eq!(s[1].temperature_c, Some(41));
        assert_eq!(s[0].uuid, "GPU-0");
        assert_eq!(s[0].recent_xids, [79, 79]);
    }

    /// A reading NVML did not give is missing, by name: never "not throttled", never 0.
    #[test]
    fn readings_not_taken_are_missing_not_healthy() {
        let read = GpuFacts {
            index: 0,
            ecc: Some(EccCounts::default()),
            ..Default::default()
        };
        let unreadable = GpuFacts {
            throttle_unreadable: true,
            ..read.clone()
        };
        let s = samples(&[read, unreadable], &[]);
        assert_eq!(s[0].throttle_reasons, Some(vec![]));
        assert_eq!(s[1].throttle_reasons, None);
        assert!(
            s[0].missing.contains(&"sm_clock".to_string()),
            "{:?}",
            s[0].missing
        );
        assert!(!s[0].missing.contains(&"ecc".to_string()));
    }
}
