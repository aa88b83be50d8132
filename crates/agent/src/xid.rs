//! XIDs from the kernel log: `NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off
//! the bus.` NVML reports XIDs only as live events, so past ones come from the log.

use bootfleet_api::agent::Xid;

/// The XID in one kernel log line, if it has one.
pub fn parse_line(line: &str) -> Option<Xid> {
    let rest = &line[line.find("NVRM: Xid")? + "NVRM: Xid".len()..];
    let rest = rest.trim_start();
    let (bus, rest) = match rest.strip_prefix("(PCI:") {
        Some(r) => {
            let end = r.find(')')?;
            (
                Some(r[..end].to_string()),
                r[end + 1..].trim_start_matches(':').trim_start(),
            )
        }
        None => (None, rest.trim_start_matches(':').trim_start()),
    };
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    Some(Xid {
        code: digits.parse().ok()?,
        pci_bus_id: bus,
        line: line.trim().chars().take(512).collect(),
    })
}

/// XIDs in the kernel log since boot: `/dev/kmsg` under `root`, read without blocking.
pub fn from_kernel_log(root: &std::path::Path) -> Vec<Xid> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let path = root.join("dev/kmsg");
    let Ok(mut f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(&path)
    else {
        return Vec::new();
    };
    let mut out = Vec::new();
    // /dev/kmsg returns one record per read; a regular file (tests) returns them all.
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(n) = f.read(&mut buf) {
        if n == 0 {
            break;
        }
        out.extend(
            String::from_utf8_lossy(&buf[..n])
                .lines()
                .filter_map(parse_line),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xid_lines_as_the_driver_writes_them() {
        let x = parse_line("4,1234,567890,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=2314, name=python3, GPU has fallen off the bus.").unwrap();
        assert_eq!((x.code, x.pci_bus_id.as_deref()), (79, Some("0000:3b:00")));
        let x = parse_line("[  12.3] NVRM: Xid (PCI:0000:9a:00): 63, pid='<unknown>', Row Remapper: New row marked for remapping").unwrap();
        assert_eq!(x.code, 63);
        assert_eq!(
            parse_line("NVRM: loading NVIDIA UNIX x86_64 Kernel Module 550.127.05"),
            None
        );
        assert_eq!(parse_line("NVRM: Xid (PCI:0000:3b:00): abc"), None);
    }
}
