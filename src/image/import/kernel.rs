//! Which kernel an image boots and which of its modules stage 1 needs: read from the
//! image's own `/boot`, `/lib/modules/<release>/modules.dep` and `modules.builtin`, so
//! the kernel and the modules stage 1 loads always come from the same build. Pure.

use std::collections::{BTreeMap, BTreeSet};

use crate::image::oci::tree::{Kind, RootPath, Tree};

/// The kernel an image boots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    /// `uname -r`: the name of its `/lib/modules` directory and of `/boot/vmlinuz-*`.
    pub release: String,
    /// The kernel image, links followed.
    pub image: RootPath,
    /// `/lib/modules/<release>`, links followed.
    pub modules: RootPath,
}

/// The modules stage 1 loads, when they are modules (not built in): the network drivers
/// of common boot NICs (any that exist) and what mounting a verified root needs (each
/// must exist, as a module or built in).
pub const NIC_MODULES: &[&str] = &[
    "virtio_pci",
    "virtio_net",
    "e1000",
    "e1000e",
    "igb",
    "ixgbe",
    "i40e",
    "ice",
    "bnxt_en",
    "tg3",
    "mlx5_core",
];
pub const ROOT_MODULES: &[&str] = &["loop", "squashfs", "overlay", "dm_verity"];
/// What a node's local root cache (`rootfs-cache=` label) needs, when the kernel has it:
/// disk controllers and ext4.
pub const CACHE_MODULES: &[&str] = &["virtio_blk", "nvme", "ahci", "sd_mod", "ext4"];

/// Finds the kernel: a `/boot/vmlinuz-<release>` with its `/lib/modules/<release>`.
/// With several, `pinned` (the manifest's `pins.kernel`) chooses.
pub fn find(tree: &Tree, pinned: Option<&str>) -> Result<Kernel, String> {
    let mut found = BTreeMap::new();
    if let (Some(boot), Some(modules)) = (tree.resolve(b"boot"), tree.resolve(b"lib/modules")) {
        for (name, _) in tree.children(&boot) {
            let Some(release) = name.strip_prefix(b"vmlinuz-") else {
                continue;
            };
            let Ok(release) = std::str::from_utf8(release) else {
                continue;
            };
            let image = tree.resolve(&join(&boot, name.to_vec()));
            let dir = tree.resolve(&join(&modules, release.as_bytes().to_vec()));
            if let (Some(image), Some(dir)) = (image, dir)
                && matches!(tree.get(&image).map(|n| &n.kind), Some(Kind::File { .. }))
                && matches!(tree.get(&dir).map(|n| &n.kind), Some(Kind::Dir))
            {
                found.insert(release.to_string(), (image, dir));
            }
        }
    }
    let choose = |release: &str| {
        found.get(release).map(|(image, modules)| Kernel {
            release: release.to_string(),
            image: image.clone(),
            modules: modules.clone(),
        })
    };
    let names = || found.keys().cloned().collect::<Vec<_>>().join(", ");
    match (found.len(), pinned) {
        (0, _) => Err(
            "the image has no kernel: a /boot/vmlinuz-<release> with its /lib/modules/<release> (install a kernel package in the image)"
                .into(),
        ),
        (_, Some(pin)) => choose(pin).ok_or_else(|| {
            format!("pins.kernel is {pin:?}, but the image's kernels are {}", names())
        }),
        (1, None) => Ok(choose(found.keys().next().expect("one")).expect("found")),
        (_, None) => Err(format!(
            "the image has several kernels ({}): choose one with pins.kernel",
            names()
        )),
    }
}

fn join(dir: &[u8], name: Vec<u8>) -> RootPath {
    if dir.is_empty() {
        name
    } else {
        [dir, b"/", &name].concat()
    }
}

/// A module's name from its file (`dm-verity.ko.zst` -> `dm_verity`).
pub fn module_name(file: &str) -> String {
    let base = file.rsplit('/').next().unwrap_or(file);
    let stem = base.split(".ko").next().unwrap_or(base);
    stem.replace('-', "_")
}

/// The modules to load, dependencies first, as paths relative to the modules directory.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LoadOrder {
    pub files: Vec<String>,
    /// Optional modules (drivers) this kernel has neither as modules nor built in.
    pub absent: Vec<String>,
}

/// Resolves `optional` (drivers: any the kernel has) and `required` modules against
/// `modules.dep` and `modules.builtin`, with every dependency, in an order `insmod` can
/// follow.
pub fn load_order(
    modules_dep: &str,
    modules_builtin: &str,
    optional: &[&str],
    required: &[&str],
) -> Result<LoadOrder, String> {
    let mut deps: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
    for line in modules_dep.lines() {
        let Some((file, rest)) = line.split_once(':') else {
            continue;
        };
        let file = file.trim().to_string();
        let listed = rest.split_whitespace().map(String::from).collect();
        deps.insert(module_name(&file), (file, listed));
    }
    let builtin: BTreeSet<String> = modules_builtin
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(module_name)
        .collect();
    let mut order = LoadOrder::default();
    let mut placed = BTreeSet::new();
    for (name, required) in optional
        .iter()
        .map(|n| (*n, false))
        .chain(required.iter().map(|n| (*n, true)))
    {
        if builtin.contains(name) {
            continue;
        }
        if !deps.contains_key(name) {
            if required {
                return Err(format!(
                    "the image's kernel has no {name} (neither a module in modules.dep nor built in): stage 1 needs it to mount the verified root"
                ));
            }
            order.absent.push(name.to_string());
            continue;
        }
        place(name, &deps, &mut placed, &mut order.files, 0)?;
    }
    Ok(order)
}

/// Appends `name` after its dependencies (depth-first; `modules.dep` lists every
/// dependency of a module, so the recursion only orders them).
fn place(
    name: &str,
    deps: &BTreeMap<String, (String, Vec<String>)>,
    placed: &mut BTreeSet<String>,
    out: &mut Vec<String>,
    depth: usize,
) -> Result<(), String> {
    if placed.contains(name) {
        return Ok(());
    }
    if depth > 64 {
        return Err(format!("modules.dep: the dependencies of {name} loop"));
    }
    let (file, listed) = deps.get(name).ok_or_else(|| {
        format!("modules.dep names {name} as a dependency but lists no file for it")
    })?;
    for dep in listed {
        place(&module_name(dep), deps, placed, out, depth + 1)?;
    }
    placed.insert(name.to_string());
    out.push(file.clone());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::oci::tree::{Entry, EntryKind, Meta, Origin, Rules};

    const DEP: &str = "\
kernel/drivers/net/virtio_net.ko: kernel/drivers/net/net_failover.ko kernel/net/core/failover.ko
kernel/drivers/net/net_failover.ko: kernel/net/core/failover.ko
kernel/net/core/failover.ko:
kernel/drivers/virtio/virtio_pci.ko: kernel/drivers/virtio/virtio_pci_modern_dev.ko
kernel/drivers/virtio/virtio_pci_modern_dev.ko:
kernel/drivers/md/dm-verity.ko: kernel/drivers/md/dm-bufio.ko kernel/drivers/md/dm-mod.ko
kernel/drivers/md/dm-bufio.ko:
kernel/drivers/md/dm-mod.ko:
kernel/fs/squashfs/squashfs.ko.zst:
kernel/fs/overlayfs/overlay.ko:
";

    #[test]
    fn dependencies_load_first_and_builtins_are_skipped() {
        let order = load_order(
            DEP,
            "kernel/drivers/block/loop.ko\n",
            &["virtio_pci", "virtio_net", "mlx5_core"],
            ROOT_MODULES,
        )
        .unwrap();
        assert_eq!(
            order.files,
            [
                "kernel/drivers/virtio/virtio_pci_modern_dev.ko",
                "kernel/drivers/virtio/virtio_pci.ko",
                "kernel/net/core/failover.ko",
                "kernel/drivers/net/net_failover.ko",
                "kernel/drivers/net/virtio_net.ko",
                "kernel/fs/squashfs/squashfs.ko.zst",
                "kernel/fs/overlayfs/overlay.ko",
                "kernel/drivers/md/dm-bufio.ko",
                "kernel/drivers/md/dm-mod.ko",
                "kernel/drivers/md/dm-verity.ko",
            ]
        );
        assert_eq!(order.absent, ["mlx5_core"]);
    }

    #[test]
    fn a_missing_root_module_is_refused_by_name() {
        let e = load_order(DEP, "", &[], ROOT_MODULES).unwrap_err();
        assert!(e.contains("no loop"), "{e}");
    }

    fn tree(paths: &[(&str, EntryKind)]) -> Tree {
        let mut t = Tree::default();
        let entries = paths
            .iter()
            .enumerate()
            .map(|(i, (p, k))| Entry {
                path: p.as_bytes().to_vec(),
                kind: k.clone(),
                meta: Meta::implied_dir(),
                origin: Origin {
                    layer: 0,
                    entry: i as u32,
                },
            })
            .collect();
        t.apply_layer(entries, &Rules::default()).unwrap();
        t
    }

    #[test]
    fn the_kernel_is_found_through_merged_usr() {
        let file = EntryKind::File { size: 1 };
        let t = tree(&[
            ("lib", EntryKind::Symlink(b"usr/lib".to_vec())),
            ("boot/vmlinuz-6.1.0-57-cloud-amd64", file.clone()),
            ("boot/vmlinuz-6.1.0-99-cloud-amd64", file.clone()),
            (
                "usr/lib/modules/6.1.0-57-cloud-amd64/modules.dep",
                file.clone(),
            ),
        ]);
        let k = find(&t, None).unwrap();
        assert_eq!(k.release, "6.1.0-57-cloud-amd64");
        assert_eq!(k.modules, b"usr/lib/modules/6.1.0-57-cloud-amd64");
        assert_eq!(k.image, b"boot/vmlinuz-6.1.0-57-cloud-amd64");
        let e = find(&t, Some("6.1.0-1-amd64")).unwrap_err();
        assert!(e.contains("6.1.0-57-cloud-amd64"), "{e}");
        let e = find(&tree(&[("etc/hostname", file)]), None).unwrap_err();
        assert!(e.contains("no kernel"), "{e}");
    }

    #[test]
    fn module_names_fold_dashes_and_suffixes() {
        assert_eq!(
            module_name("kernel/drivers/md/dm-verity.ko.xz"),
            "dm_verity"
        );
        assert_eq!(module_name("mlx5_core.ko"), "mlx5_core");
    }
}
