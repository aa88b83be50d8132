//! Importing an OCI image as a two-stage bootfleet image: the root filesystem becomes one
//! squashfs blob with its dm-verity tree, the kernel comes from the image's `/boot`, the
//! stage-1 initramfs is built from the image's own modules, and the pins are read out of
//! the content. The result is a staged image, published like a bundle.
//!
//! Pass one reads every layer's headers into the merged tree (`oci::tree`); the kernel,
//! the modules and the pins are found in it; pass two streams the root into `mksquashfs`
//! and copies out the few files stage 1 needs on the way. The layers are read twice and
//! the root is never unpacked onto the disk.

pub mod kernel;
pub mod modinfo;
pub mod pins;
pub mod squashfs;
pub mod stage1;

use std::collections::BTreeMap;
use std::io::{self, Read, Write};

use super::blobstore::{BlobStore, TempBlob};
use super::bundle::StagedImage;
use super::manifest::Manifest;
use super::oci::archive::{SpoolLimits, Staging};
use super::oci::flatten::Captures;
use super::oci::layer::LayerBlob;
use super::oci::spec::Compression;
use super::oci::tree::{Kind, RootPath, Rules, normalize};
use super::oci::{OciError, OciImage, Root, build_root};
use crate::api::image::{Artifact, ImportReport, Role};
use stage1::{Stage1, Stage1Tools};

/// The server's settings for imports (`[images]`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ImportSettings {
    /// A static busybox for stage 1 [default: /bin/busybox, Debian's busybox-static].
    pub busybox: std::path::PathBuf,
    /// The bootfleet-agent binary for stage 1 and `--install-agent` [default: beside the
    /// server's own binary].
    pub agent: std::path::PathBuf,
    /// Bytes one import may spool (its blobs, compressed).
    pub max_import_bytes: u64,
    /// Bytes of the unpacked root (each file once).
    pub max_root_bytes: u64,
    /// Entries over all layers.
    pub max_entries: usize,
}

impl Default for ImportSettings {
    fn default() -> Self {
        let rules = Rules::default();
        let tools = Stage1Tools::default();
        Self {
            busybox: tools.busybox,
            agent: tools.agent,
            max_import_bytes: SpoolLimits::default().max_bytes,
            max_root_bytes: rules.max_root_bytes,
            max_entries: rules.max_entries,
        }
    }
}

impl ImportSettings {
    pub fn tools(&self) -> Stage1Tools {
        Stage1Tools {
            busybox: self.busybox.clone(),
            agent: self.agent.clone(),
        }
    }

    pub fn spool_limits(&self) -> SpoolLimits {
        SpoolLimits {
            max_bytes: self.max_import_bytes,
            ..SpoolLimits::default()
        }
    }
}

/// What the admin asked for, beyond the image itself.
#[derive(Debug, Clone, Default)]
pub struct ImportPlan {
    pub name: String,
    pub version: String,
    pub cmdline: String,
    pub pins: BTreeMap<String, String>,
    /// `[validation]` as the admin wrote it (JSON).
    pub validation: Option<serde_json::Value>,
    pub allow_devices: bool,
    /// Adds `/usr/local/bin/bootfleet-agent` and its enabled systemd unit to the root.
    pub install_agent: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error(transparent)]
    Oci(#[from] OciError),
    #[error("{0}")]
    Refused(String),
    #[error("storage error while importing: {0}")]
    Io(#[from] io::Error),
}

/// The systemd unit `install_agent` puts in the root (the one `deploy/` ships).
const AGENT_UNIT: &str = include_str!("../../../deploy/systemd/bootfleet-agent.service");

/// The artifacts' names in the manifest an import writes.
const KERNEL: &str = "vmlinuz";
const STAGE1: &str = "stage1.img";
const ROOTFS: &str = "rootfs.squashfs";

/// Builds the image (blocking: run it on the blocking pool).
pub fn build(
    staging: &mut Staging,
    image: &OciImage,
    plan: &ImportPlan,
    settings: &ImportSettings,
    blobs: &BlobStore,
) -> Result<(StagedImage, ImportReport), ImportError> {
    let mut layers = image.layers.clone();
    if plan.install_agent {
        layers.push(agent_layer(staging, &settings.agent)?);
    }
    let rules = Rules {
        allow_devices: plan.allow_devices,
        max_entries: settings.max_entries,
        max_root_bytes: settings.max_root_bytes,
    };
    let root = build_root(&layers, &rules, &keep)?;
    let kernel = kernel::find(&root.tree, plan.pins.get("kernel").map(String::as_str))
        .map_err(ImportError::Refused)?;
    let in_modules = |name: &str| [kernel.modules.as_slice(), b"/", name.as_bytes()].concat();
    let text = |path: &[u8]| {
        root.kept_file(path)
            .map(|b| String::from_utf8_lossy(b).into_owned())
    };
    let modules_dep = text(&in_modules("modules.dep")).ok_or_else(|| {
        ImportError::Refused(format!(
            "the image has no modules.dep for kernel {} (run depmod in the image)",
            kernel.release
        ))
    })?;
    let builtin = text(&in_modules("modules.builtin")).unwrap_or_default();
    let config = text(format!("boot/config-{}", kernel.release).as_bytes());
    let optional = [kernel::NIC_MODULES, kernel::CACHE_MODULES].concat();
    let order = kernel::load_order(&modules_dep, &builtin, &optional, kernel::ROOT_MODULES)
        .map_err(ImportError::Refused)?;
    let pin_modules = pin_module_files(&modules_dep);

    // Pass two: the root into mksquashfs, the files stage 1 and the pins need copied out.
    let mut wanted: Vec<RootPath> = vec![kernel.image.clone()];
    wanted.extend(order.files.iter().map(|f| in_modules(f)));
    wanted.extend(pin_modules.values().map(|f| in_modules(f)));
    check_copied_sizes(&root, &kernel.image, &wanted[1..])?;
    let (captures, copies) = capture_files(staging, &root, &wanted)?;
    let rootfs = blobs.scratch();
    let compressor = squashfs::compressor(config.as_deref());
    squashfs::pack(&root.tree, &layers, captures, rootfs.path(), compressor)?;
    let verity = squashfs::verity_format(rootfs.path())?;
    let rootfs = blobs.adopt(rootfs)?;
    let copied = |path: &[u8]| -> Result<Vec<u8>, ImportError> {
        let file = copies.get(path).ok_or_else(|| {
            ImportError::Refused(format!(
                "{} is not a regular file of the image",
                String::from_utf8_lossy(path)
            ))
        })?;
        Ok(std::fs::read(file)?)
    };

    let kernel_blob = blob_of(blobs, &copied(&kernel.image)?)?;
    let mut stage1 = Stage1::new(&settings.tools())?;
    let mut modules = Vec::new();
    for file in &order.files {
        let bytes =
            modinfo::decompress(file, copied(&in_modules(file))?).map_err(ImportError::Refused)?;
        modules.push((kernel::module_name(file), bytes));
    }
    let loaded: Vec<String> = modules.iter().map(|(n, _)| n.clone()).collect();
    stage1.add_modules(modules);
    let mut writer = blobs.temp_writer()?;
    stage1.write(&mut writer)?;
    let stage1_blob = writer.finish()?;

    let mut found = BTreeMap::from([("kernel".to_string(), kernel.release.clone())]);
    for (pin, file) in &pin_modules {
        let bytes =
            modinfo::decompress(file, copied(&in_modules(file))?).map_err(ImportError::Refused)?;
        let info =
            modinfo::parse(&bytes).map_err(|e| ImportError::Refused(format!("{file}: {e}")))?;
        if let Some(v) = info.get("version").filter(|v| !v.is_empty()) {
            found.insert(pin.to_string(), v.clone());
        }
    }
    if let Some(v) = root
        .kept_file(b"usr/local/cuda/version.json")
        .and_then(pins::cuda_version)
    {
        found.insert("cuda".into(), v);
    }
    let merged = pins::merge(&plan.pins, &found).map_err(ImportError::Refused)?;

    let manifest_text = manifest_toml(plan, &merged, &verity)?;
    let manifest = Manifest::parse(&manifest_text)
        .map_err(|e| ImportError::Refused(format!("the import's manifest: {e}")))?;
    let temps = vec![kernel_blob, stage1_blob, rootfs];
    let artifacts: Vec<Artifact> = manifest
        .artifact_paths()
        .into_iter()
        .zip(&temps)
        .map(|((role, path), t)| Artifact {
            role,
            path: path.to_string(),
            digest: t.digest,
            size: t.size,
        })
        .collect();
    // The temps above are in this order; the manifest must name them so.
    if artifacts.iter().map(|a| a.role).collect::<Vec<_>>()
        != [Role::Kernel, Role::Initrd, Role::Rootfs]
    {
        return Err(ImportError::Refused(
            "the import's manifest names its artifacts out of order".into(),
        ));
    }
    let report = ImportReport {
        kernel_release: kernel.release,
        pins: merged,
        derived_pins: found
            .keys()
            .filter(|k| !plan.pins.contains_key(*k))
            .cloned()
            .collect(),
        root_bytes: root.tree.root_bytes(),
        rootfs_bytes: temps[2].size,
        verity_root_hash: verity.root_hash.clone(),
        compressor: compressor.to_string(),
        stage1_modules: loaded,
        absent_network_drivers: order
            .absent
            .into_iter()
            .filter(|m| kernel::NIC_MODULES.contains(&m.as_str()))
            .collect(),
        layers: image.layers.len(),
        dropped_acls: root.tree.dropped_acls,
    };
    Ok((
        StagedImage::new(manifest, manifest_text, artifacts, temps),
        report,
    ))
}

/// The small files pass one keeps: what finds the modules and reads the CUDA version.
fn keep(raw: &[u8], size: u64) -> bool {
    if size > 16 << 20 {
        return false;
    }
    let Ok(path) = normalize(raw) else {
        return false;
    };
    let Ok(path) = std::str::from_utf8(&path) else {
        return false;
    };
    let parts: Vec<&str> = path.split('/').collect();
    match parts.as_slice() {
        ["lib" | "usr", ..]
            if path.ends_with("/modules.dep") || path.ends_with("/modules.builtin") =>
        {
            path.contains("lib/modules/")
        }
        ["boot", name] => name.starts_with("config-"),
        ["usr", "local", cuda, "version.json"] => cuda.starts_with("cuda"),
        _ => false,
    }
}

/// The modules whose `version` is a pin: `nvidia-driver` from nvidia.ko, `ofed` from
/// mlx5_core.ko (MLNX_OFED stamps it; the inbox driver has none), by their files in
/// `modules.dep`.
fn pin_module_files(modules_dep: &str) -> BTreeMap<&'static str, String> {
    let mut out = BTreeMap::new();
    for line in modules_dep.lines() {
        let Some((file, _)) = line.split_once(':') else {
            continue;
        };
        match kernel::module_name(file).as_str() {
            "nvidia" => out.insert("nvidia-driver", file.trim().to_string()),
            "mlx5_core" => out.insert("ofed", file.trim().to_string()),
            _ => None,
        };
    }
    out
}

/// The kernel and the modules an import reads into memory (the kernel, stage 1's
/// modules, the pin modules) are bounded before pass two copies them out.
const MAX_KERNEL_BYTES: u64 = 256 << 20;
const MAX_MODULE_BYTES: u64 = 512 << 20;
const MAX_MODULES_BYTES: u64 = 1 << 30;

fn check_copied_sizes(root: &Root, kernel: &[u8], modules: &[RootPath]) -> Result<(), ImportError> {
    let size = |path: &[u8]| {
        root.tree
            .resolve(path)
            .and_then(|p| match root.tree.get(&p)?.kind {
                Kind::File { size, .. } => Some(size),
                _ => None,
            })
            .unwrap_or(0)
    };
    let too_big = |what: String, size: u64, limit: u64| {
        ImportError::Refused(format!(
            "{what} is {size} bytes, over the {limit} an import reads"
        ))
    };
    if size(kernel) > MAX_KERNEL_BYTES {
        return Err(too_big(
            format!("the kernel {}", String::from_utf8_lossy(kernel)),
            size(kernel),
            MAX_KERNEL_BYTES,
        ));
    }
    let mut total = 0u64;
    for m in modules {
        let s = size(m);
        if s > MAX_MODULE_BYTES {
            return Err(too_big(
                format!("the module {}", String::from_utf8_lossy(m)),
                s,
                MAX_MODULE_BYTES,
            ));
        }
        total += s;
    }
    if total > MAX_MODULES_BYTES {
        return Err(too_big(
            "stage 1's modules".into(),
            total,
            MAX_MODULES_BYTES,
        ));
    }
    Ok(())
}

/// Scratch files for the root paths pass two copies out, by path (links followed).
fn capture_files(
    staging: &Staging,
    root: &Root,
    wanted: &[RootPath],
) -> Result<(Captures, BTreeMap<RootPath, std::path::PathBuf>), ImportError> {
    let mut captures = Captures::new();
    let mut copies = BTreeMap::new();
    for (i, path) in wanted.iter().enumerate() {
        let Some(resolved) = root.tree.resolve(path) else {
            continue;
        };
        if !matches!(
            root.tree.get(&resolved).map(|n| &n.kind),
            Some(Kind::File { .. })
        ) {
            continue;
        }
        if let Some(file) = copies.get(&resolved) {
            copies.insert(path.clone(), std::path::PathBuf::clone(file));
            continue;
        }
        let file = staging.scratch(&format!("capture-{i}"));
        captures.insert(resolved.clone(), std::fs::File::create(&file)?);
        copies.insert(resolved, file.clone());
        copies.insert(path.clone(), file);
    }
    Ok((captures, copies))
}

fn blob_of(blobs: &BlobStore, bytes: &[u8]) -> io::Result<TempBlob> {
    let mut w = blobs.temp_writer()?;
    w.write_all(bytes)?;
    w.finish()
}

/// A layer of the agent and its enabled unit, added on top of the image's own.
fn agent_layer(staging: &mut Staging, agent: &std::path::Path) -> Result<LayerBlob, ImportError> {
    std::fs::metadata(agent).map_err(|e| {
        ImportError::Refused(format!(
            "installing the agent needs its binary at {} ({e}); set [images] agent",
            agent.display()
        ))
    })?;
    let agent = stage1::stripped(agent)?;
    let mut tar = tar::Builder::new(Vec::new());
    let mut add = |path: &str, mode: u32, bytes: &[u8]| -> io::Result<()> {
        let mut h = tar::Header::new_gnu();
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_size(bytes.len() as u64);
        h.set_entry_type(tar::EntryType::Regular);
        tar.append_data(&mut h, path, bytes)
    };
    add("usr/local/bin/bootfleet-agent", 0o755, &agent)?;
    add(
        "etc/systemd/system/bootfleet-agent.service",
        0o644,
        AGENT_UNIT.as_bytes(),
    )?;
    let mut link = tar::Header::new_gnu();
    link.set_mode(0o777);
    link.set_mtime(0);
    link.set_entry_type(tar::EntryType::Symlink);
    tar.append_link(
        &mut link,
        "etc/systemd/system/multi-user.target.wants/bootfleet-agent.service",
        "/etc/systemd/system/bootfleet-agent.service",
    )?;
    let bytes = tar.into_inner()?;
    let diff_id = staging.add_blob(&mut bytes.as_slice(), None, "the agent layer")?;
    Ok(LayerBlob {
        path: staging.blob_path(&diff_id),
        compression: Compression::None,
        diff_id,
    })
}

/// The manifest an import publishes: the admin's name, version, command line and
/// validation, the merged pins, and the rootfs with its verity parameters.
fn manifest_toml(
    plan: &ImportPlan,
    pins: &BTreeMap<String, String>,
    verity: &squashfs::Verity,
) -> Result<String, ImportError> {
    #[derive(serde::Serialize)]
    struct Out<'a> {
        name: &'a str,
        version: &'a str,
        boot: Boot<'a>,
        rootfs: super::manifest::RootfsSpec,
        pins: &'a BTreeMap<String, String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        validation: Option<toml::Value>,
    }
    #[derive(serde::Serialize)]
    struct Boot<'a> {
        kernel: &'a str,
        initrds: [&'a str; 1],
        rootfs: &'a str,
        cmdline: &'a str,
    }
    let validation = plan
        .validation
        .as_ref()
        .map(|v| {
            toml::Value::try_from(v).map_err(|e| ImportError::Refused(format!("validation: {e}")))
        })
        .transpose()?;
    let out = Out {
        name: &plan.name,
        version: &plan.version,
        boot: Boot {
            kernel: KERNEL,
            initrds: [STAGE1],
            rootfs: ROOTFS,
            cmdline: &plan.cmdline,
        },
        rootfs: super::manifest::RootfsSpec {
            format: "squashfs".into(),
            verity: Some(verity.clone()),
        },
        pins,
        validation,
    };
    let body = toml::to_string(&out)
        .map_err(|e| ImportError::Refused(format!("the import's manifest: {e}")))?;
    Ok(format!(
        "# Written by bootfleet image import: the root is {ROOTFS} (squashfs + dm-verity),\n# booted in two stages through {STAGE1}.\n{body}"
    ))
}

/// Reads an uploaded archive into `staging` and finds its image.
pub fn stage_archive(
    staging: &mut Staging,
    input: impl Read,
    reference: Option<&str>,
) -> Result<OciImage, ImportError> {
    staging.spool_archive(input)?;
    Ok(staging.archive_image(reference)?)
}
