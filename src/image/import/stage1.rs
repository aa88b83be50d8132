//! The stage-1 initramfs an import builds for two-stage boot: busybox, the node agent
//! (which fetches and verifies the root and sets up dm-verity), the image's own kernel
//! modules for the boot NIC and the verified root, and `/init`. iPXE loads only this and
//! the kernel; stage 1 brings the multi-GiB root over HTTP itself (resumable, several
//! ranges at once, its DHCP lease renewed meanwhile), mounts it read-only through
//! dm-verity under a tmpfs overlay and switch_roots into the image's init.
//!
//! Reproducible: entries sorted, times 0, owner root, gzip without a name or time; the
//! same agent, busybox and modules give the same bytes.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where stage 1's parts come from on the server.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stage1Tools {
    /// A static busybox (Debian's busybox-static).
    pub busybox: PathBuf,
    /// The node agent's binary; its shared libraries (from `ldd`) go with it.
    pub agent: PathBuf,
}

impl Default for Stage1Tools {
    fn default() -> Self {
        let agent = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|d| d.join("bootfleet-agent")))
            .unwrap_or_else(|| PathBuf::from("/usr/local/bin/bootfleet-agent"));
        Self {
            busybox: PathBuf::from("/bin/busybox"),
            agent,
        }
    }
}

/// The initramfs's files, path -> (mode, content). Directories and device nodes are
/// added by `write`.
#[derive(Default)]
pub struct Stage1 {
    files: BTreeMap<String, (u32, Vec<u8>)>,
}

impl Stage1 {
    /// Busybox, the agent and its libraries, the init script and the udhcpc script.
    pub fn new(tools: &Stage1Tools) -> io::Result<Self> {
        let mut s = Self::default();
        let read = |p: &Path, what: &str| {
            std::fs::read(p).map_err(|e| {
                io::Error::other(format!(
                    "stage 1 needs {what} at {} ({e}); set [images] in the server's settings",
                    p.display()
                ))
            })
        };
        let busybox = read(
            &tools.busybox,
            "a static busybox (apt-get install busybox-static)",
        )?;
        if !shared_libraries(&tools.busybox)?.is_empty() {
            return Err(io::Error::other(format!(
                "{} is linked dynamically; stage 1 has no libraries for it: use a static busybox (apt-get install busybox-static)",
                tools.busybox.display()
            )));
        }
        s.add("bin/busybox", 0o755, busybox);
        s.add(
            "bin/bootfleet-agent",
            0o755,
            read(&tools.agent, "the bootfleet-agent binary")?,
        );
        for lib in shared_libraries(&tools.agent)? {
            let bytes = read(&lib, "a library of the agent")?;
            let path = lib.to_string_lossy().trim_start_matches('/').to_string();
            s.add(&path, 0o755, bytes);
        }
        s.add("init", 0o755, INIT.as_bytes().to_vec());
        s.add(
            "etc/udhcpc.script",
            0o755,
            UDHCPC_SCRIPT.as_bytes().to_vec(),
        );
        Ok(s)
    }

    pub fn add(&mut self, path: &str, mode: u32, content: Vec<u8>) {
        self.files.insert(path.to_string(), (mode, content));
    }

    /// Adds the modules to load, in order (`lib/modules/stage1/NNN-name.ko`; `/init`
    /// loads them in name order).
    pub fn add_modules(&mut self, modules: Vec<(String, Vec<u8>)>) {
        for (i, (name, bytes)) in modules.into_iter().enumerate() {
            self.add(
                &format!("lib/modules/stage1/{i:03}-{name}.ko"),
                0o644,
                bytes,
            );
        }
    }

    /// The initramfs: a gzip-compressed newc cpio.
    pub fn write(&self, out: impl Write) -> io::Result<()> {
        let gz = flate2::GzBuilder::new()
            .mtime(0)
            .write(out, flate2::Compression::best());
        let mut dirs: std::collections::BTreeSet<String> = [
            "bin", "dev", "etc", "lib", "newroot", "proc", "run", "sys", "tmp",
        ]
        .iter()
        .map(|d| d.to_string())
        .collect();
        for path in self.files.keys() {
            let mut p = Path::new(path.as_str());
            while let Some(parent) = p.parent().filter(|p| !p.as_os_str().is_empty()) {
                dirs.insert(parent.to_string_lossy().into_owned());
                p = parent;
            }
        }
        let mut entries: BTreeMap<&str, Node<'_>> = BTreeMap::new();
        for d in &dirs {
            entries.insert(d, Node::Dir);
        }
        for (p, (mode, bytes)) in &self.files {
            entries.insert(p, Node::File(*mode, bytes));
        }
        // The kernel opens /dev/console before /init runs (devtmpfs is not mounted yet).
        entries.insert("dev/console", Node::Console);
        let mut w = gz;
        for (ino, (name, node)) in entries.into_iter().enumerate() {
            let b = cpio::newc::Builder::new(name)
                .ino(ino as u32 + 1)
                .uid(0)
                .gid(0)
                .mtime(0)
                .nlink(1);
            w = match node {
                Node::Dir => b.mode(0o040755).nlink(2).write(w, 0).finish()?,
                Node::Console => b
                    .mode(0o020600)
                    .rdev_major(5)
                    .rdev_minor(1)
                    .write(w, 0)
                    .finish()?,
                Node::File(mode, bytes) => {
                    let size = u32::try_from(bytes.len())
                        .map_err(|_| io::Error::other(format!("{name} is over 4 GiB")))?;
                    let mut f = b.mode(0o100000 | mode).write(w, size);
                    f.write_all(bytes)?;
                    f.finish()?
                }
            };
        }
        cpio::newc::trailer(w)?.finish()?;
        Ok(())
    }
}

enum Node<'a> {
    Dir,
    Console,
    File(u32, &'a [u8]),
}

/// `binary` without its symbols and debug information (`strip`, binutils): a debug build
/// of the agent is 100 MB, stripped a fraction of it, and iPXE moves every byte.
pub fn stripped(binary: &Path) -> io::Result<Vec<u8>> {
    let out = std::env::temp_dir().join(format!("bootfleet-strip-{:016x}", rand::random::<u64>()));
    let status = Command::new("strip")
        .arg("--strip-all")
        .arg("-o")
        .arg(&out)
        .arg(binary)
        .status();
    let result = match status {
        Ok(s) if s.success() => std::fs::read(&out),
        Ok(s) => Err(io::Error::other(format!("strip {}: {s}", binary.display()))),
        Err(e) => Err(io::Error::other(format!(
            "strip (binutils) is needed to build stage 1: {e}"
        ))),
    };
    let _ = std::fs::remove_file(&out);
    result
}

/// The shared libraries a binary needs, from `ldd` (none for a static binary).
fn shared_libraries(binary: &Path) -> io::Result<Vec<PathBuf>> {
    let output = Command::new("ldd")
        .arg(binary)
        .output()
        .map_err(|e| io::Error::other(format!("ldd (libc-bin) is needed to build stage 1: {e}")))?;
    let text = String::from_utf8_lossy(&output.stdout);
    // ldd says a binary is static on stderr (glibc) or stdout (musl).
    let said = format!("{text}{}", String::from_utf8_lossy(&output.stderr));
    if said.contains("not a dynamic executable") || said.contains("statically linked") {
        return Ok(Vec::new());
    }
    let mut libs = Vec::new();
    for line in text.lines() {
        // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` or
        // `/lib64/ld-linux-x86-64.so.2 (0x...)`.
        let path = match line.split_once("=>") {
            Some((_, right)) => right.split_whitespace().next(),
            None => line
                .split_whitespace()
                .next()
                .filter(|p| p.starts_with('/')),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(p));
        }
    }
    if libs.is_empty() {
        return Err(io::Error::other(format!(
            "ldd {} found no libraries and did not say it is static: {text}",
            binary.display()
        )));
    }
    Ok(libs)
}

const UDHCPC_SCRIPT: &str = r#"#!/bin/busybox sh
# Called by udhcpc on every lease change. It keeps running during the root's download so
# the lease is renewed (a lease that lapses mid-download drops the node's address).
case "$1" in
  bound)
    ip addr flush dev "$interface"
    ip addr add "$ip/${mask:-24}" dev "$interface"
    [ -n "$router" ] && ip route add default via "${router%% *}" dev "$interface" 2>/dev/null
    : ;;
  renew)
    # Never a gap in the middle of the root's download: replace, do not flush.
    ip addr replace "$ip/${mask:-24}" dev "$interface"
    [ -n "$router" ] && ip route replace default via "${router%% *}" dev "$interface" 2>/dev/null
    : ;;
  deconfig) ip addr flush dev "$interface" ;;
esac
"#;

/// Stage 1's init. The agent does the parts that need care (the download, its checks,
/// dm-verity, reporting to the server); this script does the plumbing around them.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
# /run moves into the root at the end (as dracut does), sized as a system's /run is.
# The root's blob, the overlay's writable layer and stage 1's state live in RAM under
# /run/bootfleet: root's alone (users share /run/lock), as large as RAM allows.
mount -t tmpfs -o mode=0755,size=20% run /run
mkdir -p /run/bootfleet
mount -t tmpfs -o mode=0700,size=95% bootfleet /run/bootfleet
mkdir -p /run/bootfleet/lower /run/bootfleet/rw
network=""
stop() {
  echo "bootfleet stage 1: $*"
  # Once the network is up the server hears why: the boot fails attestation with it.
  [ -n "$network" ] && timeout 20 /bin/bootfleet-agent stage1-fail "$*" >/dev/null 2>&1
  echo "bootfleet stage 1: rebooting in 30 s"
  sleep 30
  reboot -f
}
# Where PATH points inside the new root, links followed there (an absolute link names
# the new root's file, not this initramfs's).
resolve() {
  p=$1
  for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16; do
    t=$(readlink "/newroot$p") || break
    case "$t" in /*) p=$t ;; *) p=${p%/*}/$t ;; esac
  done
  echo "$p"
}
echo "bootfleet stage 1: loading modules"
for m in /lib/modules/stage1/*.ko; do
  [ -e "$m" ] || continue
  insmod "$m" 2>/dev/null || echo "bootfleet stage 1: insmod ${m##*/} failed"
done
ip link set lo up
mac=$(sed -n 's/.*bootfleet\.mac=\([^ ]*\).*/\1/p' /proc/cmdline | tr 'A-F-' 'a-f:')
iface=""
# Drivers probe asynchronously: give the NIC a few seconds to appear.
for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
  for dev in /sys/class/net/*; do
    [ "$(cat "$dev/address" 2>/dev/null)" = "$mac" ] && iface=${dev##*/}
  done
  [ -n "$iface" ] && break
  sleep 0.5
done
[ -n "$iface" ] || stop "no network interface has the boot MAC $mac (is its driver in the image's kernel?)"
ip link set "$iface" up
# Without -q udhcpc stays in the background after its lease and renews it.
udhcpc -i "$iface" -s /etc/udhcpc.script -t 30 -T 1 -n -p /run/bootfleet/udhcpc.pid \
  || stop "no DHCP lease on $iface"
network=1
# rootfs-cache=LABEL: keep the root on the node's file system with that label, so the
# next boot into the same image reads it from there. A missing or broken one only costs
# the cache: the root then goes to RAM as without it.
cache=""
label=$(sed -n 's/.*bootfleet\.rootfs_cache=\([^ ]*\).*/\1/p' /proc/cmdline)
if [ -n "$label" ]; then
  part=""
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    part=$(findfs "LABEL=$label" 2>/dev/null) && break
    sleep 0.5
  done
  mkdir -p /run/bootfleet/cache
  if [ -n "$part" ] && mount -o noatime "$part" /run/bootfleet/cache; then
    cache="--cache /run/bootfleet/cache"
  else
    echo "bootfleet stage 1: no file system labelled $label to cache the root on; the root goes to RAM"
  fi
fi
root=$(/bin/bootfleet-agent stage1 --dir /run/bootfleet $cache) || stop "the root could not be fetched or verified (see above)"
mount -t squashfs -o ro "$root" /run/bootfleet/lower || stop "the verified root did not mount"
mount -t tmpfs -o mode=0755 rw /run/bootfleet/rw
mkdir -p /run/bootfleet/rw/upper /run/bootfleet/rw/work
mount -t overlay overlay \
  -o lowerdir=/run/bootfleet/lower,upperdir=/run/bootfleet/rw/upper,workdir=/run/bootfleet/rw/work /newroot \
  || stop "the overlay did not mount"
/bin/bootfleet-agent stage1-overlay --into /newroot || stop "the node's overlay could not be applied (see above)"
# /sbin/init is a link in most images (merged /usr, into systemd): where it lands inside
# the new root must be a program, or switch_root would fail as PID 1 (a kernel panic).
[ -x "/newroot$(resolve /sbin/init)" ] || stop "the image has no /sbin/init"
pid=$(cat /run/bootfleet/udhcpc.pid 2>/dev/null)
if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then
  for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
fi
# The root is in RAM now: the image's own network stack takes over from a clean link.
# udev renames interfaces only while they are down (a link left up stays "being
# renamed" and systemd-networkd never configures it), and the image's DHCP client
# gets the same lease for the same MAC.
ip addr flush dev "$iface"
ip link set "$iface" down
echo "bootfleet stage 1: switching to the image's root"
mount --move /run /newroot/run
mount --move /dev /newroot/dev
mount --move /sys /newroot/sys
mount --move /proc /newroot/proc
exec switch_root /newroot /sbin/init
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_initramfs_is_reproducible_and_readable() {
        let mut s = Stage1::default();
        s.add("init", 0o755, b"#!/bin/sh\n".to_vec());
        s.add_modules(vec![("virtio_net".into(), b"\x7fELF".to_vec())]);
        let mut a = Vec::new();
        s.write(&mut a).unwrap();
        let mut b = Vec::new();
        s.write(&mut b).unwrap();
        assert_eq!(a, b);
        let mut cpio = flate2::read::GzDecoder::new(a.as_slice());
        let mut names = Vec::new();
        loop {
            let reader = cpio::newc::Reader::new(&mut cpio).unwrap();
            if reader.entry().is_trailer() {
                break;
            }
            names.push(reader.entry().name().to_string());
            reader.finish().unwrap();
        }
        assert!(
            names.contains(&"lib/modules/stage1/000-virtio_net.ko".to_string()),
            "{names:?}"
        );
        assert!(names.contains(&"dev/console".to_string()), "{names:?}");
        assert!(names.contains(&"newroot".to_string()), "{names:?}");
    }
}
