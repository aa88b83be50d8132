//! What can be checked without device-mapper: layouts, request numbers, the ioctl
//! buffer, the verity table (against veritysetup where it is installed), parsing, and
//! the loop device where /dev/loop-control works.

use std::io::{Read, Write};
use std::process::Command;

use super::*;

#[test]
fn structs_have_the_kernel_layout() {
    assert_eq!(size_of::<DmIoctl>(), 312);
    assert_eq!(size_of::<DmTargetSpec>(), 40);
    assert_eq!(offset_of!(DmIoctl, data_size), 12);
    assert_eq!(offset_of!(DmIoctl, data_start), 16);
    assert_eq!(offset_of!(DmIoctl, target_count), 20);
    assert_eq!(offset_of!(DmIoctl, flags), 28);
    assert_eq!(offset_of!(DmIoctl, dev), 40);
    assert_eq!(offset_of!(DmIoctl, name), 48);
    assert_eq!(offset_of!(DmIoctl, uuid), 176);
    assert_eq!(offset_of!(DmIoctl, data), 305);
    assert_eq!(offset_of!(DmTargetSpec, next), 20);
    assert_eq!(offset_of!(DmTargetSpec, target_type), 24);
    // No padding anywhere (what `Plain` relies on): each size is the sum of its fields.
    assert_eq!(4 * 3 + 4 * 7 + 8 + DM_NAME_LEN + DM_UUID_LEN + 7, HEADER);
    assert_eq!(8 + 8 + 4 + 4 + DM_MAX_TYPE_NAME, SPEC);
    assert_eq!(size_of::<LoopInfo64>(), 232);
    assert_eq!(offset_of!(LoopInfo64, lo_flags), 52);
    assert_eq!(offset_of!(LoopInfo64, lo_init), 216);
    assert_eq!(size_of::<LoopConfig>(), 304);
    assert_eq!(offset_of!(LoopConfig, info), 8);
}

#[test]
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn request_numbers_are_the_kernels() {
    // As strace prints them: _IOWR(0xfd, cmd, struct dm_ioctl) with a 312-byte size.
    assert_eq!(dm_request(DM_VERSION_CMD) as u64, 0xc138_fd00);
    assert_eq!(dm_request(DM_DEV_CREATE_CMD) as u64, 0xc138_fd03);
    assert_eq!(dm_request(DM_DEV_REMOVE_CMD) as u64, 0xc138_fd04);
    assert_eq!(dm_request(DM_DEV_SUSPEND_CMD) as u64, 0xc138_fd06);
    assert_eq!(dm_request(DM_TABLE_LOAD_CMD) as u64, 0xc138_fd09);
    assert_eq!(dm_request(DM_TABLE_STATUS_CMD) as u64, 0xc138_fd0c);
}

fn params() -> VerityParams {
    VerityParams {
        data_blocks: 2048,
        hash_start_block: 2048,
        data_block_size: 4096,
        hash_block_size: 4096,
        algorithm: "sha256".into(),
        root_hash: "c89d2eaf92c86ab7b7ec029030d28720b5b43c9d6fe2c26c4852dccf17bb57da".into(),
        salt: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef".into(),
    }
}

#[test]
fn a_table_load_buffer_holds_header_spec_and_parameters() {
    let p = params();
    let table = p.table("7:0", "7:0");
    let target = DmTarget {
        start: 0,
        length: p.sectors(),
        target_type: "verity".into(),
        params: table.clone(),
    };
    let buf = encode(
        DmIoctl::new("bootfleet-root", DM_READONLY_FLAG),
        &[target],
        0,
    );

    let h = DmIoctl::read(&buf).unwrap();
    assert_eq!(h.version, [4, 0, 0]);
    assert_eq!(h.data_start as usize, 312);
    assert_eq!(h.data_size as usize, buf.len());
    assert_eq!(h.target_count, 1);
    assert_eq!(h.flags, DM_READONLY_FLAG);
    assert_eq!(c_string(&h.name), "bootfleet-root");
    assert_eq!(&buf[48..48 + 15], b"bootfleet-root\0");

    let spec = DmTargetSpec::read(&buf[312..]).unwrap();
    assert_eq!((spec.sector_start, spec.length), (0, 2048 * 8));
    assert_eq!(c_string(&spec.target_type), "verity");
    assert_eq!(spec.next % 8, 0);
    assert_eq!(spec.next as usize, align8(40 + table.len() + 1));
    let params_at = 312 + 40;
    assert_eq!(&buf[params_at..params_at + table.len()], table.as_bytes());
    assert_eq!(buf[params_at + table.len()], 0, "NUL-terminated");
    assert_eq!(buf.len(), 312 + spec.next as usize);
    assert_eq!(buf.len() % 8, 0);
}

#[test]
fn each_next_of_a_load_counts_from_its_own_spec() {
    let targets = [("linear", "7:0 0"), ("error", ""), ("zero", "")].map(|(t, p)| DmTarget {
        start: 0,
        length: 8,
        target_type: t.into(),
        params: p.into(),
    });
    let buf = encode(DmIoctl::new("x", 0), &targets, 4096);
    assert_eq!(buf.len(), 4096, "padded to the capacity asked for");
    assert_eq!(DmIoctl::read(&buf).unwrap().data_size, 4096);
    let mut at = HEADER;
    for t in &targets {
        let spec = DmTargetSpec::read(&buf[at..]).unwrap();
        assert_eq!(c_string(&spec.target_type), t.target_type);
        assert_eq!(c_string(&buf[at + SPEC..]), t.params);
        assert_eq!(spec.next % 8, 0);
        at += spec.next as usize;
    }
}

/// A reply as the kernel's retrieve_status writes it: `next` counts from the first spec.
fn status_reply(targets: &[(&str, &str)]) -> Vec<u8> {
    let mut payload = Vec::new();
    for (i, (kind, params)) in targets.iter().enumerate() {
        let at = payload.len();
        let mut target_type = [0; DM_MAX_TYPE_NAME];
        target_type[..kind.len()].copy_from_slice(kind.as_bytes());
        let next = align8(at + SPEC + params.len() + 1);
        let spec = DmTargetSpec {
            sector_start: i as u64 * 100,
            length: 100,
            status: 0,
            next: next as u32,
            target_type,
        };
        payload.extend_from_slice(spec.bytes());
        payload.extend_from_slice(params.as_bytes());
        payload.resize(next, 0);
    }
    let mut h = DmIoctl::new("root", DM_STATUS_TABLE_FLAG);
    h.target_count = targets.len() as u32;
    h.data_size = (HEADER + payload.len()) as u32;
    let mut buf = h.bytes().to_vec();
    buf.extend_from_slice(&payload);
    buf.resize(16 << 10, 0xAA); // the rest of the caller's buffer, untouched
    buf
}

#[test]
fn a_table_status_reply_decodes() {
    let line = params().table("7:0", "7:0");
    let buf = status_reply(&[("verity", &line), ("linear", "8:0 2048")]);
    let targets = decode_targets(&buf).unwrap();
    assert_eq!(targets.len(), 2);
    assert_eq!(targets[0].to_string(), format!("0 100 verity {line}"));
    assert_eq!(targets[1].to_string(), "100 100 linear 8:0 2048");
    assert_eq!(
        VerityTable::parse(&targets[0].to_string()).unwrap().params,
        params()
    );

    let mut truncated = buf.clone();
    truncated[HEADER + SPEC..].fill(b'a');
    assert!(decode_targets(&truncated).is_err(), "no NUL, no string");
}

#[test]
fn the_table_line_is_verity_format_1_in_the_kernels_order() {
    assert_eq!(
        params().table("7:0", "7:0"),
        "1 7:0 7:0 4096 4096 2048 2048 sha256 \
         c89d2eaf92c86ab7b7ec029030d28720b5b43c9d6fe2c26c4852dccf17bb57da \
         0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    );
    assert_eq!(params().sectors(), 16384);
    let unsalted = VerityParams {
        salt: "-".into(),
        ..params()
    };
    assert!(unsalted.table("/dev/loop0", "/dev/loop0").ends_with(" -"));
    unsalted.validate().unwrap();
}

#[test]
fn table_lines_parse_back() {
    let p = params();
    let line = p.table("7:0", "7:0");
    let t = VerityTable::parse(&line).unwrap();
    assert_eq!((t.data_dev.as_str(), t.hash_dev.as_str()), ("7:0", "7:0"));
    assert_eq!(t.params, p);
    assert!(t.opt_params.is_empty());
    assert_eq!(t.to_string(), line);

    // What the kernel reports can carry optional arguments; dmsetup puts the target
    // before it.
    let kernel = format!("0 16384 verity {line} 2 ignore_zero_blocks panic_on_corruption");
    let t: VerityTable = kernel.parse().unwrap();
    assert_eq!(t.params, p);
    assert_eq!(t.opt_params, ["ignore_zero_blocks", "panic_on_corruption"]);
    assert_eq!(format!("0 16384 verity {t}"), kernel);

    for bad in [
        String::new(),
        line.replacen('1', "0", 1),
        line.replace(" 2048 2048 ", " 2048 x "),
        format!("{line} 2 ignore_zero_blocks"),
        "1 7:0 7:0 4096".into(),
    ] {
        assert!(
            VerityTable::parse(&bad).is_err(),
            "{bad:?} should be refused"
        );
    }
}

#[test]
fn parameters_the_kernel_would_refuse_are_refused_first() {
    params().validate().unwrap();
    let cases = [
        VerityParams {
            hash_start_block: 2047,
            ..params()
        },
        VerityParams {
            data_block_size: 1000,
            ..params()
        },
        VerityParams {
            hash_block_size: 256,
            ..params()
        },
        VerityParams {
            data_blocks: 0,
            ..params()
        },
        VerityParams {
            root_hash: "c89d2".into(),
            ..params()
        },
        VerityParams {
            root_hash: "zz".into(),
            ..params()
        },
        VerityParams {
            salt: String::new(),
            ..params()
        },
        VerityParams {
            algorithm: "sha 256".into(),
            ..params()
        },
        VerityParams {
            data_blocks: u64::MAX,
            ..params()
        },
    ];
    for p in cases {
        assert!(p.validate().is_err(), "{p:?} should be refused");
    }
    let overlap = VerityParams {
        hash_start_block: 2047,
        ..params()
    };
    assert!(
        overlap
            .validate()
            .unwrap_err()
            .to_string()
            .contains("overlaps")
    );
}

#[test]
fn names_and_device_numbers() {
    check_name("bootfleet-root").unwrap();
    for bad in ["", "a/b", "control", ".", "..", &"x".repeat(128)] {
        assert!(check_name(bad).is_err(), "{bad:?}");
    }
    check_name(&"x".repeat(127)).unwrap();
    // huge_encode_dev: minor's low byte, major, then minor's high bits from bit 20.
    assert_eq!(split_dev(0xfd00), (253, 0));
    assert_eq!(split_dev(0x10_fd2c), (253, 300));
    assert_eq!(split_dev(0x0700), (7, 0));
}

/// The deterministic 8 MiB of data the pinned root hash above was computed over.
fn data() -> Vec<u8> {
    (0..8u64 << 20)
        .map(|i| ((i * 2_654_435_761) >> 13) as u8)
        .collect()
}

fn veritysetup(args: &[&str]) -> std::process::Output {
    Command::new("veritysetup").args(args).output().unwrap()
}

/// `veritysetup format` lays the image out, and its report, our table and
/// `veritysetup verify` run with what our table line says agree: the fields mean what we
/// think, in the order we write them. Needs veritysetup (cryptsetup-bin; the test
/// command installs it).
#[test]
fn the_table_agrees_with_veritysetup() {
    assert!(
        Command::new("veritysetup")
            .arg("--version")
            .output()
            .is_ok(),
        "veritysetup is not installed: apt-get install cryptsetup-bin"
    );
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("root.img");
    fs::write(&image, data()).unwrap();
    let image = image.to_str().unwrap();
    let p = params();
    let formatted = veritysetup(&[
        "format",
        "--no-superblock",
        "--hash-offset=8388608",
        "--data-blocks=2048",
        &format!("--salt={}", p.salt),
        image,
        image,
    ]);
    assert!(formatted.status.success(), "{formatted:?}");
    let report = String::from_utf8(formatted.stdout).unwrap();
    let field = |name: &str| {
        report
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| panic!("no {name} in {report}"))
    };
    let reported = VerityParams {
        data_blocks: field("Data blocks:").parse().unwrap(),
        hash_start_block: 8388608 / field("Hash block size:").parse::<u64>().unwrap(),
        data_block_size: field("Data block size:").parse().unwrap(),
        hash_block_size: field("Hash block size:").parse().unwrap(),
        algorithm: field("Hash algorithm:"),
        root_hash: field("Root hash:"),
        salt: field("Salt:"),
    };
    assert_eq!(reported, p, "veritysetup's report:\n{report}");

    // Verify with arguments taken from our table line, not from `p`.
    let t = VerityTable::parse(&p.table(image, image)).unwrap().params;
    let verify = |root: &str| {
        veritysetup(&[
            "verify",
            "--no-superblock",
            &format!(
                "--hash-offset={}",
                t.hash_start_block * u64::from(t.hash_block_size)
            ),
            &format!("--data-blocks={}", t.data_blocks),
            &format!("--data-block-size={}", t.data_block_size),
            &format!("--hash-block-size={}", t.hash_block_size),
            &format!("--hash={}", t.algorithm),
            &format!("--salt={}", t.salt),
            image,
            image,
            root,
        ])
    };
    let ok = verify(&t.root_hash);
    assert!(ok.status.success(), "{ok:?}");
    let wrong = format!("00{}", &t.root_hash[2..]);
    assert!(
        !verify(&wrong).status.success(),
        "a wrong root hash verifies"
    );
}

/// Loop devices work here when run as root with /dev/loop-control (the test says so if
/// not, rather than pass without checking anything).
fn loop_preconditions() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "attaching a loop device needs root: run this test as root"
    );
    assert!(
        Path::new(LOOP_CONTROL).exists(),
        "{LOOP_CONTROL} is missing: this host (or container) has no loop devices"
    );
}

fn sysfs(device: &Path, attribute: &str) -> Option<String> {
    let name = device.file_name()?.to_str()?;
    fs::read_to_string(format!("/sys/block/{name}/{attribute}"))
        .ok()
        .map(|s| s.trim().to_string())
}

#[test]
fn a_loop_device_attaches_read_only_and_clears_itself() {
    loop_preconditions();
    let dir = tempfile::tempdir().unwrap();
    let backing = dir.path().join("root.img");
    let content: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    fs::write(&backing, &content).unwrap();
    for bind in [Bind::Configure, Bind::SetFd] {
        let device = attach(&backing, true, bind).unwrap();
        let path = device.path().to_path_buf();
        assert_eq!(sysfs(&path, "ro").as_deref(), Some("1"), "{bind:?}");
        assert_eq!(
            sysfs(&path, "loop/autoclear").as_deref(),
            Some("1"),
            "{bind:?}"
        );
        assert_eq!(
            sysfs(&path, "loop/backing_file").map(PathBuf::from),
            Some(backing.canonicalize().unwrap()),
            "{bind:?}"
        );
        let mut head = vec![0; 8192];
        File::open(&path).unwrap().read_exact(&mut head).unwrap();
        assert_eq!(head, content[..8192], "{bind:?}");
        // Linux lets a read-only block device be opened for writing; the write fails.
        let written = OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|mut f| f.write_all(&[0; 4096]));
        assert!(written.is_err(), "{bind:?}: wrote to a read-only loop");

        drop(device);
        // Autoclear: the last close detached it.
        let detached = (0..40).any(|_| {
            let gone = sysfs(&path, "loop/backing_file").is_none();
            if !gone {
                std::thread::sleep(Duration::from_millis(50));
            }
            gone
        });
        assert!(detached, "{bind:?}: {} still attached", path.display());
    }
}

#[test]
fn create_verity_refuses_before_touching_the_kernel() {
    let err = create_verity("control", Path::new("/dev/loop0"), &params()).unwrap_err();
    assert!(
        err.to_string().contains("not a device-mapper name"),
        "{err}"
    );
    let bad = VerityParams {
        hash_start_block: 1,
        ..params()
    };
    assert!(create_verity("root", Path::new("/dev/loop0"), &bad).is_err());
    let dir = tempfile::tempdir().unwrap();
    let err = create_verity("root", dir.path(), &params()).unwrap_err();
    assert!(err.to_string().contains("not a block device"), "{err}");
}
