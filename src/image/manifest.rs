//! The image manifest (`manifest.toml`, written by admins): parsing and validation.

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;
use serde::de::IgnoredAny;

use super::bundle_path::normalize_path;
use crate::api::image::Role;
use crate::api::refs::{check_label, check_name};

/// The manifest as checked: every section has a strict schema, so a mistyped key
/// (`gpu_model`) or a wrong type (`gpus = "eight"`) is refused at publish with its line,
/// column and the valid keys, never read as a default. Parsed before `RawManifest`,
/// which keeps `[validation]` as written for the canonical form.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StrictManifest {
    // Checked in full by `RawManifest`.
    #[serde(rename = "name")]
    _name: IgnoredAny,
    #[serde(rename = "version")]
    _version: IgnoredAny,
    #[serde(rename = "boot")]
    _boot: IgnoredAny,
    #[serde(default, rename = "pins")]
    _pins: Pins,
    #[serde(default)]
    validation: ValidationSpec,
    #[serde(rename = "rootfs")]
    _rootfs: Option<IgnoredAny>,
}

/// `[pins]`: the versions the node must run, by the names the agent reports (an
/// unreportable pin would fail every boot's attestation, so it is refused here). The
/// values are checked as strings by `RawManifest`.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Pins {
    /// `uname -r`.
    #[serde(rename = "kernel")]
    _kernel: Option<IgnoredAny>,
    /// The loaded NVIDIA kernel module's version.
    #[serde(rename = "nvidia-driver")]
    _nvidia_driver: Option<IgnoredAny>,
    /// The MLNX_OFED release.
    #[serde(rename = "ofed")]
    _ofed: Option<IgnoredAny>,
    /// `/usr/local/cuda/version.json`'s CUDA version.
    #[serde(rename = "cuda")]
    _cuda: Option<IgnoredAny>,
}

/// `[validation]`: what "GPU Ready" means for this image. Every key is optional; the
/// defaults are the validator's (`node::validate`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ValidationSpec {
    /// GPUs the node must have (0: a CPU-only image).
    pub gpus: Option<u64>,
    /// A substring of every GPU's name (`H100`).
    pub gpu_model: Option<String>,
    pub min_gpu_memory_mib: Option<u64>,
    pub pcie_gen: Option<u64>,
    pub pcie_width: Option<u64>,
    /// Active NVLinks each GPU must have.
    pub nvlinks: Option<u64>,
    /// ECC must be on [default: on when GPUs are expected].
    pub ecc: Option<bool>,
    pub max_temperature_c: Option<u64>,
    pub fatal_xids: Option<Vec<u32>>,
    /// DCGM diagnostics level, 1 to 4.
    pub dcgm_level: Option<u64>,
    /// InfiniBand ports that must be up (ACTIVE).
    pub ib_ports: Option<u64>,
    /// The rate each up port must run at, at least, Gb/s (`400` for NDR).
    pub ib_rate_gbps: Option<u64>,
    /// The link width each up port must have (`4X`).
    pub ib_width: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawManifest {
    name: String,
    version: String,
    boot: RawBoot,
    #[serde(default)]
    pins: BTreeMap<String, String>,
    #[serde(default)]
    validation: toml::Table,
    rootfs: Option<RootfsSpec>,
}

/// `[rootfs]`: how the `[boot] rootfs` blob is built and checked. An import writes it;
/// with `verity`, nodes mount the root through dm-verity (two-stage boot).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RootfsSpec {
    /// `squashfs`.
    pub format: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verity: Option<crate::api::image::Verity>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBoot {
    kernel: String,
    #[serde(default)]
    initrds: Vec<String>,
    rootfs: Option<String>,
    #[serde(default)]
    cmdline: String,
}

/// A validated manifest. Artifact paths are normalised bundle paths.
#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    pub name: String,
    pub version: String,
    pub kernel: String,
    pub initrds: Vec<String>,
    pub rootfs: Option<String>,
    pub cmdline: String,
    pub pins: BTreeMap<String, String>,
    /// `[rootfs]`: the rootfs blob's format and dm-verity parameters.
    pub rootfs_spec: Option<RootfsSpec>,
    /// `[validation]` as written, as JSON (sorted keys), for the canonical form.
    pub validation: serde_json::Value,
    /// `[validation]`, typed: what the validator reads.
    pub spec: ValidationSpec,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ManifestError {
    #[error("manifest.toml: {0}")]
    Toml(String),
    #[error("manifest.toml: {0}")]
    Invalid(String),
}

impl Manifest {
    pub fn parse(text: &str) -> Result<Self, ManifestError> {
        // toml's message already says "at line L, column C" and quotes the line; for an
        // unknown key serde names the valid ones.
        let toml_error = |e: toml::de::Error| ManifestError::Toml(e.to_string().trim().into());
        let raw: RawManifest = toml::from_str(text).map_err(toml_error)?;
        let invalid = |m: String| ManifestError::Invalid(m);
        let validation = toml_to_json(&toml::Value::Table(raw.validation.clone()))
            .map_err(|e| invalid(format!("validation: {e}")))?;
        let strict: StrictManifest = toml::from_str(text).map_err(toml_error)?;
        if let Some(level) = strict.validation.dcgm_level
            && !(1..=4).contains(&level)
        {
            return Err(invalid(format!(
                "validation.dcgm-level {level}: DCGM diagnostics levels are 1 to 4"
            )));
        }
        check_name(&raw.name).map_err(|e| invalid(e.to_string()))?;
        check_label("version", &raw.version).map_err(|e| invalid(e.to_string()))?;
        if raw.boot.initrds.is_empty() {
            return Err(invalid("boot.initrds must name at least one initrd".into()));
        }
        if raw.boot.cmdline.contains(['\n', '\r', '\0']) {
            return Err(invalid(
                "boot.cmdline must be one line (no newline or NUL)".into(),
            ));
        }
        let norm = |field: &str, p: &str| {
            normalize_path(p).map_err(|e| invalid(format!("{field} {p:?}: {e}")))
        };
        let kernel = norm("boot.kernel", &raw.boot.kernel)?;
        let initrds = raw
            .boot
            .initrds
            .iter()
            .map(|p| norm("boot.initrds", p))
            .collect::<Result<Vec<_>, _>>()?;
        let rootfs = raw
            .boot
            .rootfs
            .as_deref()
            .map(|p| norm("boot.rootfs", p))
            .transpose()?;
        let mut seen = BTreeSet::new();
        for p in std::iter::once(&kernel)
            .chain(&initrds)
            .chain(rootfs.as_ref())
        {
            if p == "manifest.toml" {
                return Err(invalid("manifest.toml cannot be a boot artifact".into()));
            }
            if !seen.insert(p.as_str()) {
                return Err(invalid(format!("artifact {p:?} is named twice in [boot]")));
            }
        }
        if let Some(spec) = &raw.rootfs {
            if rootfs.is_none() {
                return Err(invalid(
                    "[rootfs] describes a boot.rootfs, but none is named".into(),
                ));
            }
            if spec.format != "squashfs" {
                return Err(invalid(format!(
                    "rootfs.format {:?}: only \"squashfs\" is booted",
                    spec.format
                )));
            }
            if let Some(verity) = &spec.verity {
                verity
                    .check()
                    .map_err(|e| invalid(format!("rootfs.verity: {e}")))?;
            }
        }
        for (key, value) in &raw.pins {
            if key.is_empty() || value.trim().is_empty() {
                return Err(invalid(format!(
                    "pins.{key:?} needs a non-empty key and an exact version string"
                )));
            }
        }
        Ok(Manifest {
            name: raw.name,
            version: raw.version,
            kernel,
            initrds,
            rootfs,
            cmdline: raw.boot.cmdline,
            pins: raw.pins,
            rootfs_spec: raw.rootfs,
            validation,
            spec: strict.validation,
        })
    }

    /// Every artifact path with its role, in canonical order: kernel, initrds, rootfs.
    pub fn artifact_paths(&self) -> Vec<(Role, &str)> {
        std::iter::once((Role::Kernel, self.kernel.as_str()))
            .chain(self.initrds.iter().map(|p| (Role::Initrd, p.as_str())))
            .chain(self.rootfs.iter().map(|p| (Role::Rootfs, p.as_str())))
            .collect()
    }
}

/// TOML to JSON with sorted keys; datetimes become strings, non-finite floats are refused
/// (JSON cannot carry them, and the canonical form must be JSON).
fn toml_to_json(v: &toml::Value) -> Result<serde_json::Value, String> {
    use serde_json::Value as J;
    Ok(match v {
        toml::Value::String(s) => J::String(s.clone()),
        toml::Value::Integer(i) => J::from(*i),
        toml::Value::Float(f) => serde_json::Number::from_f64(*f)
            .map(J::Number)
            .ok_or_else(|| format!("{f} is not a finite number"))?,
        toml::Value::Boolean(b) => J::Bool(*b),
        toml::Value::Datetime(d) => J::String(d.to_string()),
        toml::Value::Array(a) => J::Array(a.iter().map(toml_to_json).collect::<Result<_, _>>()?),
        toml::Value::Table(t) => {
            let sorted: BTreeMap<&String, &toml::Value> = t.iter().collect();
            let mut map = serde_json::Map::new();
            for (k, v) in sorted {
                map.insert(k.clone(), toml_to_json(v)?);
            }
            J::Object(map)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "gpu-node"
version = "2026.12.0"

[boot]
kernel = "vmlinuz"
initrds = ["initrd.img", "./extra/modules.cpio"]
rootfs = "rootfs.squashfs"
cmdline = "console=ttyS0 quiet"

[pins]
kernel = "6.1.0-28-cloud-amd64"
nvidia-driver = "550.127.05"

[validation]
gpus = 8
gpu-model = "H100"
"#;

    #[test]
    fn parses_the_design_example() {
        let m = Manifest::parse(GOOD).unwrap();
        assert_eq!(m.name, "gpu-node");
        assert_eq!(m.initrds, ["initrd.img", "extra/modules.cpio"]);
        assert_eq!(m.pins["nvidia-driver"], "550.127.05");
        assert_eq!(m.validation["gpus"], 8);
        assert_eq!(
            m.artifact_paths()
                .iter()
                .map(|(r, _)| r.as_str())
                .collect::<Vec<_>>(),
            ["kernel", "initrd", "initrd", "rootfs"]
        );
    }

    fn err(text: &str) -> String {
        Manifest::parse(text).unwrap_err().to_string()
    }

    #[test]
    fn toml_errors_name_line_and_column() {
        let e = err("name = \"x\"\nversion = \n");
        assert!(e.contains("line 2"), "{e}");
        assert!(e.contains("column"), "{e}");
        // A schema error in [validation] names its line too.
        let e = err(&GOOD.replace("gpus = 8", "gpus = \"eight\""));
        assert!(e.contains("line 16"), "{e}");
    }

    #[test]
    fn validation_is_read_typed() {
        let m = Manifest::parse(GOOD).unwrap();
        assert_eq!(m.spec.gpus, Some(8));
        assert_eq!(m.spec.gpu_model.as_deref(), Some("H100"));
        assert_eq!(m.spec.dcgm_level, None);
    }

    #[test]
    fn refuses_bad_manifests_with_reasons() {
        let base = GOOD.replace("./extra/modules.cpio", "modules.cpio");
        for (text, needle) in [
            (base.replace("gpu-node", "GPU node"), "invalid image name"),
            (base.replace("2026.12.0", "a/b"), "invalid version"),
            (base.replace("\"vmlinuz\"", "\"../vmlinuz\""), "boot.kernel"),
            (base.replace("\"vmlinuz\"", "\"/vmlinuz\""), "boot.kernel"),
            (base.replace("\"vmlinuz\"", "\"initrd.img\""), "named twice"),
            (base.replace("initrds = [", "initrd = ["), "unknown field"),
            (
                base.replace(
                    "initrds = [\"initrd.img\", \"modules.cpio\"]",
                    "initrds = []",
                ),
                "at least one initrd",
            ),
            (base.replace("\"550.127.05\"", "550"), "invalid type"),
            (base.replace("gpus = 8", "gpus = nan"), "finite"),
            // Every section is strict: a typo or a wrong type is refused, never a default.
            (base.replace("gpus = 8", "gpus = \"eight\""), "invalid type"),
            (
                base.replace("gpu-model", "gpu_model"),
                "unknown field `gpu_model`",
            ),
            (base.replace("gpu-model", "gpu_model"), "`gpu-model`"),
            (
                base.replace("gpus = 8", "gpus = 8\nfatal-xids = [\"79\"]"),
                "invalid type",
            ),
            (
                base.replace("gpus = 8", "gpus = 8\ndcgm-level = 9"),
                "levels are 1 to 4",
            ),
            (
                base.replace("nvidia-driver", "nvidia_driver"),
                "unknown field `nvidia_driver`",
            ),
            (
                base.replace(
                    "nvidia-driver = \"550.127.05\"",
                    "nvidia-driver = \"550.127.05\"\ndcgm = \"3.3\"",
                ),
                "unknown field `dcgm`",
            ),
        ] {
            let e = err(&text);
            assert!(e.contains(needle), "expected {needle:?} in {e:?}");
        }
    }
}
