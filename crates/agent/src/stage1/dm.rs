//! Loop and device-mapper devices by ioctl, with no external tool: the stage-1 initramfs
//! has busybox, which has neither dmsetup nor veritysetup. [`attach_loop`] puts the
//! fetched root file on a read-only loop device, [`create_verity`] puts a dm-verity
//! device over it (data and hash tree on the same device, no superblock, as
//! `veritysetup format --no-superblock --hash-offset=...` lays them out), and
//! [`table_of`] reads back the table a running device uses (so the agent, in the real
//! root, can report the root hash it booted with).
//!
//! Why not the `devicemapper` crate (Stratis): its `devicemapper-sys` runs bindgen at
//! build time (libclang on every build machine, for every target), it brings its own
//! nix major version, bitflags, semver, serde, log and more into a binary that must stay
//! small in an initramfs, it is MPL-2.0, and it models the targets Stratis uses (linear,
//! thin, cache...), so the verity table would still be written here. What is needed is
//! six ioctls over two fixed-layout structs, a kernel ABI stable since 2.6.
//!
//! Why libc and not nix's ioctl macros: nix is built here without its `ioctl` feature,
//! and dm's argument is a header followed by a payload whose size is chosen at run time,
//! which nix's typed macros do not fit; libc's `_IOWR` gives the request numbers per
//! architecture and `ioctl(2)` takes the buffer as it is.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, ErrorKind};
use std::mem::{offset_of, size_of};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use super::Stage1Error;

// ---------------------------------------------------------------------------------------
// dm-verity parameters and table lines.

/// A dm-verity device's parameters (format version 1, no superblock). With the data and
/// the hash tree in one file laid out by
/// `veritysetup format --no-superblock --hash-offset=<bytes> --data-blocks=<n> f f`:
/// `data_blocks` is `<n>` (data bytes / `data_block_size`) and `hash_start_block` is
/// `<bytes> / hash_block_size` (without `--no-superblock` the tree would start one block
/// later, after the superblock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerityParams {
    pub data_blocks: u64,
    pub hash_start_block: u64,
    /// 4096 for images bootfleet packs.
    pub data_block_size: u32,
    /// 4096 for images bootfleet packs.
    pub hash_block_size: u32,
    /// A kernel crypto API hash name: "sha256".
    pub algorithm: String,
    /// Hex.
    pub root_hash: String,
    /// Hex, or "-" for no salt.
    pub salt: String,
}

impl VerityParams {
    /// The table parameters the kernel's verity target takes:
    /// `1 <data_dev> <hash_dev> <data_block_size> <hash_block_size> <data_blocks>
    /// <hash_start_block> <algorithm> <root_hash> <salt>`. Devices are paths or
    /// `major:minor`.
    pub fn table(&self, data_dev: &str, hash_dev: &str) -> String {
        format!(
            "1 {data_dev} {hash_dev} {} {} {} {} {} {} {}",
            self.data_block_size,
            self.hash_block_size,
            self.data_blocks,
            self.hash_start_block,
            self.algorithm,
            self.root_hash,
            self.salt
        )
    }

    /// The device's length in 512-byte sectors: the data only.
    pub fn sectors(&self) -> u64 {
        self.data_blocks * u64::from(self.data_block_size) / 512
    }

    /// Refuses what the kernel would refuse with only "Invalid argument" (or, for an
    /// overlap of data and hash tree, would accept and then fail every read).
    pub fn validate(&self) -> Result<(), Stage1Error> {
        let bad = |what: String| Err(Stage1Error::Invalid(format!("verity parameters: {what}")));
        for (name, size) in [
            ("data block size", self.data_block_size),
            ("hash block size", self.hash_block_size),
        ] {
            if !size.is_power_of_two() || !(512..=65536).contains(&size) {
                return bad(format!(
                    "{name} {size} is not a power of two in 512..=65536"
                ));
            }
        }
        if self.data_blocks == 0 {
            return bad("no data blocks".into());
        }
        let data_end = self
            .data_blocks
            .checked_mul(u64::from(self.data_block_size));
        let hash_start = self
            .hash_start_block
            .checked_mul(u64::from(self.hash_block_size));
        match (data_end, hash_start) {
            (Some(d), Some(h)) if h >= d => {}
            (Some(d), Some(h)) => {
                return bad(format!(
                    "the hash tree at byte {h} overlaps the data (bytes 0-{})",
                    d - 1
                ));
            }
            _ => return bad("block counts overflow".into()),
        }
        if self.algorithm.is_empty() || !self.algorithm.bytes().all(|b| b.is_ascii_graphic()) {
            return bad(format!("algorithm {:?}", self.algorithm));
        }
        if !is_hex(&self.root_hash) {
            return bad(format!("root hash {:?} is not hex", self.root_hash));
        }
        if self.salt != "-" && !is_hex(&self.salt) {
            return bad(format!("salt {:?} is neither hex nor \"-\"", self.salt));
        }
        Ok(())
    }
}

fn is_hex(s: &str) -> bool {
    !s.is_empty() && s.len().is_multiple_of(2) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A verity table line read back: the devices (the kernel reports them as
/// `major:minor`), the parameters, and any optional arguments after them (for example
/// `ignore_zero_blocks`), without their leading count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerityTable {
    pub data_dev: String,
    pub hash_dev: String,
    pub params: VerityParams,
    pub opt_params: Vec<String>,
}

impl VerityTable {
    /// Parses what [`VerityParams::table`] writes, what the kernel reports for a verity
    /// target, or a whole `dmsetup table` line (`<start> <length> verity <params>`).
    pub fn parse(line: &str) -> Result<Self, Stage1Error> {
        let bad = |what: &str| Stage1Error::Invalid(format!("verity table {line:?}: {what}"));
        let mut words: Vec<&str> = line.split_whitespace().collect();
        if words.get(2) == Some(&"verity") {
            words.drain(..3);
        }
        if words.len() < 10 {
            return Err(bad("fewer than 10 fields"));
        }
        if words[0] != "1" {
            return Err(bad("only format version 1 is supported"));
        }
        let number = |i: usize, what: &str| -> Result<u64, Stage1Error> {
            words[i].parse().map_err(|_| bad(what))
        };
        let size = |i: usize, what: &str| -> Result<u32, Stage1Error> {
            words[i].parse().map_err(|_| bad(what))
        };
        let params = VerityParams {
            data_block_size: size(3, "data block size")?,
            hash_block_size: size(4, "hash block size")?,
            data_blocks: number(5, "data blocks")?,
            hash_start_block: number(6, "hash start block")?,
            algorithm: words[7].to_string(),
            root_hash: words[8].to_string(),
            salt: words[9].to_string(),
        };
        let opt_params: Vec<String> = match words.get(10) {
            None => Vec::new(),
            Some(count) => {
                let count: usize = count.parse().map_err(|_| bad("optional argument count"))?;
                if words.len() != 11 + count {
                    return Err(bad("optional argument count does not match"));
                }
                words[11..].iter().map(|w| w.to_string()).collect()
            }
        };
        Ok(Self {
            data_dev: words[1].to_string(),
            hash_dev: words[2].to_string(),
            params,
            opt_params,
        })
    }
}

impl FromStr for VerityTable {
    type Err = Stage1Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for VerityTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.params.table(&self.data_dev, &self.hash_dev))?;
        if !self.opt_params.is_empty() {
            write!(
                f,
                " {} {}",
                self.opt_params.len(),
                self.opt_params.join(" ")
            )?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Loop devices.

const LOOP_CONTROL: &str = "/dev/loop-control";
// From linux/loop.h: plain numbers, not _IO-encoded.
const LOOP_SET_FD: libc::Ioctl = 0x4C00;
const LOOP_CLR_FD: libc::Ioctl = 0x4C01;
const LOOP_SET_STATUS64: libc::Ioctl = 0x4C04;
const LOOP_CONFIGURE: libc::Ioctl = 0x4C0A;
const LOOP_CTL_GET_FREE: libc::Ioctl = 0x4C82;
const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_NAME_SIZE: usize = 64;
const LO_KEY_SIZE: usize = 32;
/// Another process can take the device LOOP_CTL_GET_FREE named before we bind it
/// (EBUSY): ask again, a few times.
const LOOP_RACE_TRIES: usize = 8;

/// `struct loop_info64` (linux/loop.h).
#[repr(C)]
#[derive(Clone, Copy)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; LO_KEY_SIZE],
    lo_init: [u64; 2],
}

/// `struct loop_config` (linux/loop.h, kernel 5.8 and later).
#[repr(C)]
#[derive(Clone, Copy)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

impl LoopInfo64 {
    /// Flags, and the backing file's name for `losetup -l` (informational, truncated).
    fn new(backing: &Path, flags: u32) -> Self {
        let mut name = [0; LO_NAME_SIZE];
        let bytes = backing.as_os_str().as_bytes();
        let n = bytes.len().min(LO_NAME_SIZE - 1);
        name[..n].copy_from_slice(&bytes[..n]);
        Self {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: flags,
            lo_file_name: name,
            lo_crypt_name: [0; LO_NAME_SIZE],
            lo_encrypt_key: [0; LO_KEY_SIZE],
            lo_init: [0; 2],
        }
    }
}

/// An attached loop device, held open. It was attached with autoclear: the kernel
/// detaches it when its last holder closes it. So keep this handle until whatever is to
/// use the device (dm-verity, a mount) holds it, then drop it; the loop then lives
/// exactly as long as that user. Dropping it first detaches the device.
pub struct LoopDevice {
    path: PathBuf,
    file: File,
}

impl LoopDevice {
    /// `/dev/loopN`.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl fmt::Debug for LoopDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoopDevice")
            .field("path", &self.path)
            .field("fd", &self.file.as_raw_fd())
            .finish()
    }
}

/// How to bind a loop device: LOOP_CONFIGURE (one call, kernel 5.8 and later) or the
/// older LOOP_SET_FD then LOOP_SET_STATUS64.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bind {
    Configure,
    SetFd,
}

/// Attaches `backing` to a free loop device, read-only if asked, with autoclear (see
/// [`LoopDevice`]).
pub fn attach_loop(backing: &Path, read_only: bool) -> Result<LoopDevice, Stage1Error> {
    attach(backing, read_only, Bind::Configure)
}

fn attach(backing: &Path, read_only: bool, mut bind: Bind) -> Result<LoopDevice, Stage1Error> {
    let file = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .open(backing)
        .map_err(|e| Stage1Error::io("open", backing, e))?;
    let control = OpenOptions::new()
        .read(true)
        .write(true)
        .open(LOOP_CONTROL)
        .map_err(|e| Stage1Error::io("open", LOOP_CONTROL, e))?;
    let mut busy = None;
    for _ in 0..LOOP_RACE_TRIES {
        let n = ioctl_value(&control, LOOP_CTL_GET_FREE, 0)
            .map_err(|e| ioctl_error("LOOP_CTL_GET_FREE", LOOP_CONTROL, e))?;
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let device = open_loop_node(&path, read_only)?;
        match bind_loop(&device, &path, &file, backing, read_only, &mut bind) {
            Ok(()) => return Ok(LoopDevice { path, file: device }),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => busy = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(busy.unwrap_or_else(|| Stage1Error::Invalid("no loop device could be bound".into())))
}

/// Opens `/dev/loopN`, giving devtmpfs a moment if LOOP_CTL_GET_FREE has just added it.
fn open_loop_node(path: &Path, read_only: bool) -> Result<File, Stage1Error> {
    let mut tries = 0;
    loop {
        // Opened read-only for a read-only device: the kernel then refuses writes
        // through it whatever the flags say.
        match OpenOptions::new().read(true).write(!read_only).open(path) {
            Ok(f) => return Ok(f),
            Err(e) if e.kind() == ErrorKind::NotFound && tries < 20 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(Stage1Error::io("open", path, e)),
        }
    }
}

fn bind_loop(
    device: &File,
    path: &Path,
    backing: &File,
    backing_path: &Path,
    read_only: bool,
    bind: &mut Bind,
) -> Result<(), Stage1Error> {
    let ro = if read_only { LO_FLAGS_READ_ONLY } else { 0 };
    let fd = backing.as_raw_fd();
    if *bind == Bind::Configure {
        let mut config = LoopConfig {
            fd: fd as u32,
            block_size: 0,
            info: LoopInfo64::new(backing_path, LO_FLAGS_AUTOCLEAR | ro),
            reserved: [0; 8],
        };
        match ioctl_ptr(device, LOOP_CONFIGURE, &mut config) {
            Ok(_) => return Ok(()),
            // Before 5.8 the loop driver answers an unknown ioctl with EINVAL (ENOTTY
            // later): fall back, and remember it for the next device.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOTTY)) => {
                *bind = Bind::SetFd;
            }
            Err(e) => return Err(ioctl_error("LOOP_CONFIGURE", path, e)),
        }
    }
    // LOOP_SET_FD takes read-only from the modes the backing file and the device were
    // opened with; LOOP_SET_STATUS64 can then add autoclear (read-only is not settable).
    ioctl_value(device, LOOP_SET_FD, fd as libc::c_ulong)
        .map_err(|e| ioctl_error("LOOP_SET_FD", path, e))?;
    let mut info = LoopInfo64::new(backing_path, LO_FLAGS_AUTOCLEAR);
    if let Err(e) = ioctl_ptr(device, LOOP_SET_STATUS64, &mut info) {
        let _ = ioctl_value(device, LOOP_CLR_FD, 0);
        return Err(ioctl_error("LOOP_SET_STATUS64", path, e));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Device-mapper.

const DM_CONTROL: &str = "/dev/mapper/control";
/// Where the kernel says which device number the control node has, for when devtmpfs
/// did not make it.
const DM_CONTROL_SYSFS: &str = "/sys/class/misc/device-mapper/dev";
const DM_NAME_LEN: usize = 128;
const DM_UUID_LEN: usize = 129;
const DM_MAX_TYPE_NAME: usize = 16;
/// The interface version asked for: the kernel accepts any 4.x at or below its own.
const DM_VERSION: [u32; 3] = [4, 0, 0];
const DM_IOCTL_TYPE: u32 = 0xfd;
const DM_VERSION_CMD: u32 = 0;
const DM_DEV_CREATE_CMD: u32 = 3;
const DM_DEV_REMOVE_CMD: u32 = 4;
const DM_DEV_SUSPEND_CMD: u32 = 6;
const DM_TABLE_LOAD_CMD: u32 = 9;
const DM_TABLE_STATUS_CMD: u32 = 12;
const DM_READONLY_FLAG: u32 = 1 << 0;
const DM_STATUS_TABLE_FLAG: u32 = 1 << 4;
const DM_BUFFER_FULL_FLAG: u32 = 1 << 8;
/// A reply buffer for DM_TABLE_STATUS, doubled while the kernel says it is too small.
const STATUS_BUFFER: usize = 16 << 10;
const STATUS_BUFFER_MAX: usize = 4 << 20;

/// `struct dm_ioctl` (linux/dm-ioctl.h, interface 4.x): the header of every dm ioctl's
/// buffer; a payload (target specs and their parameters) follows at `data_start`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DmIoctl {
    version: [u32; 3],
    /// The whole buffer, header included.
    data_size: u32,
    /// Where the payload starts, from the start of the header.
    data_start: u32,
    target_count: u32,
    open_count: i32,
    flags: u32,
    event_nr: u32,
    padding: u32,
    dev: u64,
    name: [u8; DM_NAME_LEN],
    uuid: [u8; DM_UUID_LEN],
    data: [u8; 7],
}

/// `struct dm_target_spec`: one target, its NUL-terminated parameters right after it.
#[repr(C)]
#[derive(Clone, Copy)]
struct DmTargetSpec {
    sector_start: u64,
    length: u64,
    status: i32,
    /// Loading: bytes from this spec to the next. Reading back: bytes from the first spec
    /// to the next.
    next: u32,
    target_type: [u8; DM_MAX_TYPE_NAME],
}

const HEADER: usize = size_of::<DmIoctl>();
const SPEC: usize = size_of::<DmTargetSpec>();

/// Types whose bytes can be copied to and from a buffer as they are.
///
/// # Safety
/// Implementors are `#[repr(C)]`, made only of integers and byte arrays, with no padding
/// (the layout tests check that each size is the sum of its fields), so every byte is
/// initialised and every bit pattern is a valid value.
unsafe trait Plain: Copy {
    fn bytes(&self) -> &[u8] {
        // SAFETY: see the trait: `size_of::<Self>()` initialised bytes at `self`.
        unsafe { std::slice::from_raw_parts((self as *const Self).cast(), size_of::<Self>()) }
    }

    fn read(buf: &[u8]) -> Option<Self> {
        // SAFETY: bounds checked; any bit pattern is valid (see the trait); the read is
        // unaligned since the buffer is bytes.
        (buf.len() >= size_of::<Self>())
            .then(|| unsafe { std::ptr::read_unaligned(buf.as_ptr().cast::<Self>()) })
    }
}

// SAFETY: repr(C), integers and byte arrays, no padding (tested).
unsafe impl Plain for DmIoctl {}
// SAFETY: as above.
unsafe impl Plain for DmTargetSpec {}

impl DmIoctl {
    fn new(name: &str, flags: u32) -> Self {
        let mut h = Self {
            version: DM_VERSION,
            data_size: HEADER as u32,
            data_start: HEADER as u32,
            target_count: 0,
            open_count: 0,
            flags,
            event_nr: 0,
            padding: 0,
            dev: 0,
            name: [0; DM_NAME_LEN],
            uuid: [0; DM_UUID_LEN],
            data: [0; 7],
        };
        // Checked by `check_name`; truncation would only ever hit an unchecked name.
        let n = name.len().min(DM_NAME_LEN - 1);
        h.name[..n].copy_from_slice(&name.as_bytes()[..n]);
        h
    }
}

/// One target of a device's table: `<start> <length> <type> <params>`, in sectors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DmTarget {
    pub start: u64,
    pub length: u64,
    pub target_type: String,
    pub params: String,
}

impl fmt::Display for DmTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {} {}",
            self.start, self.length, self.target_type, self.params
        )
    }
}

const fn align8(n: usize) -> usize {
    (n + 7) & !7
}

fn dm_request(cmd: u32) -> libc::Ioctl {
    libc::_IOWR::<DmIoctl>(DM_IOCTL_TYPE, cmd)
}

/// The buffer of a dm ioctl: `header`, then `targets` each as a spec, its parameters,
/// a NUL and padding to 8 bytes (each `next` counting from its own spec, as a table load
/// wants), then zeros up to `capacity` for the kernel's reply.
fn encode(mut header: DmIoctl, targets: &[DmTarget], capacity: usize) -> Vec<u8> {
    let mut buf = vec![0; HEADER];
    for t in targets {
        let mut target_type = [0; DM_MAX_TYPE_NAME];
        let n = t.target_type.len().min(DM_MAX_TYPE_NAME - 1);
        target_type[..n].copy_from_slice(&t.target_type.as_bytes()[..n]);
        let next = align8(SPEC + t.params.len() + 1);
        let spec = DmTargetSpec {
            sector_start: t.start,
            length: t.length,
            status: 0,
            next: next as u32,
            target_type,
        };
        let at = buf.len();
        buf.extend_from_slice(spec.bytes());
        buf.extend_from_slice(t.params.as_bytes());
        buf.resize(at + next, 0);
    }
    buf.resize(buf.len().max(capacity), 0);
    header.data_start = HEADER as u32;
    header.data_size = buf.len() as u32;
    header.target_count = targets.len() as u32;
    buf[..HEADER].copy_from_slice(header.bytes());
    buf
}

/// The targets of a DM_TABLE_STATUS reply (each `next` counting from the first spec).
fn decode_targets(buf: &[u8]) -> Result<Vec<DmTarget>, String> {
    let h = DmIoctl::read(buf).ok_or("reply shorter than its header")?;
    let end = (h.data_size as usize).min(buf.len());
    let first = h.data_start as usize;
    let mut offset = 0;
    let mut targets = Vec::new();
    for i in 0..h.target_count {
        let at = first + offset;
        let spec = buf
            .get(at..end)
            .and_then(DmTargetSpec::read)
            .ok_or_else(|| format!("target {i} at byte {at} runs past the reply ({end})"))?;
        let params = buf.get(at + SPEC..end).unwrap_or_default();
        let params = params
            .iter()
            .position(|&b| b == 0)
            .map(|nul| &params[..nul])
            .ok_or_else(|| format!("target {i}'s parameters are not terminated"))?;
        targets.push(DmTarget {
            start: spec.sector_start,
            length: spec.length,
            target_type: c_string(&spec.target_type),
            params: String::from_utf8_lossy(params).into_owned(),
        });
        let next = spec.next as usize;
        if i + 1 < h.target_count && next <= offset {
            return Err(format!("target {i} points back to byte {next}"));
        }
        offset = next;
    }
    Ok(targets)
}

fn c_string(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// A dm device name the kernel takes (and that is a file name under /dev/mapper).
fn check_name(name: &str) -> Result<(), Stage1Error> {
    if name.is_empty()
        || name.len() >= DM_NAME_LEN
        || name.contains(['/', '\0'])
        || matches!(name, "." | ".." | "control")
    {
        return Err(Stage1Error::Invalid(format!(
            "{name:?} is not a device-mapper name (1-{} bytes, no '/', not control)",
            DM_NAME_LEN - 1
        )));
    }
    Ok(())
}

/// The kernel's device numbers in dm_ioctl.dev (huge_encode_dev) split as glibc does.
fn split_dev(dev: u64) -> (u32, u32) {
    (
        libc::major(dev as libc::dev_t),
        libc::minor(dev as libc::dev_t),
    )
}

/// /dev/mapper/control, opened; made from sysfs's device number where devtmpfs did not
/// make it (as libdevmapper does).
struct Control(File);

impl Control {
    fn open() -> Result<Self, Stage1Error> {
        match OpenOptions::new().read(true).write(true).open(DM_CONTROL) {
            Ok(f) => return Ok(Self(f)),
            Err(e) if e.kind() != ErrorKind::NotFound => {
                return Err(Stage1Error::io("open", DM_CONTROL, e));
            }
            Err(_) => {}
        }
        let numbers = fs::read_to_string(DM_CONTROL_SYSFS).map_err(|e| {
            Stage1Error::io(
                format!("no {DM_CONTROL}, and device-mapper is not in the kernel (dm_mod not loaded?): read"),
                DM_CONTROL_SYSFS,
                e,
            )
        })?;
        let (major, minor) = numbers
            .trim()
            .split_once(':')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
            .ok_or_else(|| Stage1Error::Invalid(format!("{DM_CONTROL_SYSFS}: {numbers:?}")))?;
        let _ = fs::create_dir_all("/dev/mapper");
        make_node(Path::new(DM_CONTROL), libc::S_IFCHR, major, minor)?;
        OpenOptions::new()
            .read(true)
            .write(true)
            .open(DM_CONTROL)
            .map(Self)
            .map_err(|e| Stage1Error::io("open", DM_CONTROL, e))
    }

    /// Runs dm ioctl `cmd` over `buf` (header and payload, see [`encode`]) and returns
    /// the reply's header.
    fn call(
        &self,
        cmd: u32,
        ioctl: &'static str,
        device: &str,
        buf: &mut [u8],
    ) -> Result<DmIoctl, Stage1Error> {
        ioctl_ptr(&self.0, dm_request(cmd), buf.as_mut_ptr())
            .map_err(|e| ioctl_error(ioctl, device, e))?;
        DmIoctl::read(buf).ok_or_else(|| Stage1Error::Invalid(format!("{ioctl}: short reply")))
    }

    fn simple(
        &self,
        cmd: u32,
        ioctl: &'static str,
        name: &str,
        flags: u32,
    ) -> Result<DmIoctl, Stage1Error> {
        let mut buf = encode(DmIoctl::new(name, flags), &[], 0);
        self.call(cmd, ioctl, name, &mut buf)
    }

    /// The kernel's dm interface version; refuses one this code does not speak.
    fn check_version(&self) -> Result<[u32; 3], Stage1Error> {
        // No device name: the kernel answers its version before it looks at any.
        let mut buf = encode(DmIoctl::new("", 0), &[], 0);
        let reply = self.call(DM_VERSION_CMD, "DM_VERSION", DM_CONTROL, &mut buf)?;
        if reply.version[0] != DM_VERSION[0] {
            return Err(Stage1Error::Invalid(format!(
                "device-mapper interface {:?}: this code speaks 4.x",
                reply.version
            )));
        }
        Ok(reply.version)
    }

    fn create(&self, name: &str) -> Result<(), Stage1Error> {
        // Read-only matters at table load (a verity table must be); said here too, as
        // libdevmapper does.
        self.simple(DM_DEV_CREATE_CMD, "DM_DEV_CREATE", name, DM_READONLY_FLAG)
            .map(drop)
    }

    fn load(&self, name: &str, targets: &[DmTarget]) -> Result<(), Stage1Error> {
        let mut buf = encode(DmIoctl::new(name, DM_READONLY_FLAG), targets, 0);
        self.call(DM_TABLE_LOAD_CMD, "DM_TABLE_LOAD", name, &mut buf)
            .map(drop)
    }

    /// DM_DEV_SUSPEND without DM_SUSPEND_FLAG resumes: the loaded table goes live.
    /// Returns the device number.
    fn resume(&self, name: &str) -> Result<u64, Stage1Error> {
        Ok(self
            .simple(DM_DEV_SUSPEND_CMD, "DM_DEV_SUSPEND (resume)", name, 0)?
            .dev)
    }

    fn remove(&self, name: &str) -> Result<(), Stage1Error> {
        self.simple(DM_DEV_REMOVE_CMD, "DM_DEV_REMOVE", name, 0)
            .map(drop)
    }

    fn table(&self, name: &str) -> Result<Vec<DmTarget>, Stage1Error> {
        let mut capacity = STATUS_BUFFER;
        loop {
            let mut buf = encode(DmIoctl::new(name, DM_STATUS_TABLE_FLAG), &[], capacity);
            let reply = self.call(DM_TABLE_STATUS_CMD, "DM_TABLE_STATUS", name, &mut buf)?;
            if reply.flags & DM_BUFFER_FULL_FLAG == 0 {
                return decode_targets(&buf)
                    .map_err(|e| Stage1Error::Invalid(format!("DM_TABLE_STATUS on {name}: {e}")));
            }
            if capacity >= STATUS_BUFFER_MAX {
                return Err(Stage1Error::Invalid(format!(
                    "DM_TABLE_STATUS on {name}: table larger than {STATUS_BUFFER_MAX} bytes"
                )));
            }
            capacity *= 2;
        }
    }
}

/// Creates dm-verity device `name` over `loop_dev` (data and hash tree on the same
/// device, as laid out by `params`), read-only and live, and returns its node
/// `/dev/dm-<minor>` (devtmpfs makes it; without udev there is no /dev/mapper/<name>).
/// On failure nothing is left: a half-made device is removed.
pub fn create_verity(
    name: &str,
    loop_dev: &Path,
    params: &VerityParams,
) -> Result<PathBuf, Stage1Error> {
    check_name(name)?;
    params.validate()?;
    // By number: the kernel then needs no path lookup (and no /dev node) for the device.
    let (major, minor) = block_device(loop_dev)?;
    let dev = format!("{major}:{minor}");
    let target = DmTarget {
        start: 0,
        length: params.sectors(),
        target_type: "verity".into(),
        params: params.table(&dev, &dev),
    };
    let control = Control::open()?;
    control.check_version()?;
    control.create(name)?;
    let made = control
        .load(name, &[target])
        .and_then(|()| control.resume(name))
        .and_then(|dev| {
            let (major, minor) = split_dev(dev);
            wait_for_node(major, minor)
        });
    if made.is_err()
        && let Err(e) = control.remove(name)
    {
        eprintln!("bootfleet-agent: removing the half-made {name}: {e}");
    }
    made
}

/// Removes dm device `name` (it must not be open: unmount first).
pub fn remove_device(name: &str) -> Result<(), Stage1Error> {
    check_name(name)?;
    Control::open()?.remove(name)
}

/// The live table of dm device `name`, one target per entry.
pub fn targets_of(name: &str) -> Result<Vec<DmTarget>, Stage1Error> {
    check_name(name)?;
    Control::open()?.table(name)
}

/// The live table of dm device `name` as `dmsetup table` prints it, one line per target
/// (`<start> <length> <type> <params>`); for a verity device [`VerityTable::parse`]
/// reads it back, root hash included.
pub fn table_of(name: &str) -> Result<String, Stage1Error> {
    let lines: Vec<String> = targets_of(name)?.iter().map(|t| t.to_string()).collect();
    Ok(lines.join("\n"))
}

/// The major and minor numbers of block device `path`.
fn block_device(path: &Path) -> Result<(u32, u32), Stage1Error> {
    let meta = fs::metadata(path).map_err(|e| Stage1Error::io("stat", path, e))?;
    if !meta.file_type().is_block_device() {
        return Err(Stage1Error::Invalid(format!(
            "{} is not a block device",
            path.display()
        )));
    }
    Ok(split_dev(meta.rdev()))
}

/// `/dev/dm-<minor>`, once devtmpfs has made it; made here if it does not come (a /dev
/// that is not devtmpfs).
fn wait_for_node(major: u32, minor: u32) -> Result<PathBuf, Stage1Error> {
    let path = PathBuf::from(format!("/dev/dm-{minor}"));
    for _ in 0..40 {
        if let Ok(meta) = fs::metadata(&path) {
            if meta.file_type().is_block_device() && split_dev(meta.rdev()) == (major, minor) {
                return Ok(path);
            }
            return Err(Stage1Error::Invalid(format!(
                "{} exists but is not block device {major}:{minor}",
                path.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    make_node(&path, libc::S_IFBLK, major, minor)?;
    Ok(path)
}

fn make_node(path: &Path, kind: libc::mode_t, major: u32, minor: u32) -> Result<(), Stage1Error> {
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Stage1Error::Invalid(format!("{}: NUL in path", path.display())))?;
    // SAFETY: a NUL-terminated path that outlives the call.
    let rc = unsafe { libc::mknod(c_path.as_ptr(), kind | 0o600, libc::makedev(major, minor)) };
    match rc {
        0 => Ok(()),
        _ => {
            let e = io::Error::last_os_error();
            // devtmpfs may have made it in the meantime.
            if e.raw_os_error() == Some(libc::EEXIST) {
                return Ok(());
            }
            Err(Stage1Error::io(
                format!("mknod {major}:{minor} at"),
                path,
                e,
            ))
        }
    }
}

// ---------------------------------------------------------------------------------------
// ioctl(2).

/// `ioctl(fd, request, arg)` with a pointer argument; the kernel reads and writes
/// `*arg`.
fn ioctl_ptr<T>(file: &File, request: libc::Ioctl, arg: *mut T) -> io::Result<libc::c_int> {
    // SAFETY: `arg` points to a live, large enough value of the type (or buffer) the
    // request expects; the kernel copies in and out of it within the call.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), request, arg) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// `ioctl(fd, request, value)` with an integer argument (a file descriptor, or none).
fn ioctl_value(file: &File, request: libc::Ioctl, value: libc::c_ulong) -> io::Result<libc::c_int> {
    // SAFETY: no pointer is passed.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), request, value) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn ioctl_error(ioctl: &'static str, device: impl AsRef<Path>, source: io::Error) -> Stage1Error {
    Stage1Error::Ioctl {
        ioctl,
        device: device.as_ref().display().to_string(),
        source,
    }
}

// Layout checks at compile time too: a wrong struct must not build.
const _: () = {
    assert!(HEADER == 312);
    assert!(SPEC == 40);
    assert!(size_of::<LoopInfo64>() == 232);
    assert!(size_of::<LoopConfig>() == 304);
    assert!(offset_of!(DmIoctl, dev) == 40);
    assert!(offset_of!(DmIoctl, name) == 48);
};

#[cfg(test)]
mod tests;
