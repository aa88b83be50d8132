//! CPU time and peak resident memory of other processes (the server under test), from
//! /proc: utime + stime in clock ticks, VmHWM, and RssAnon.

/// Linux's USER_HZ, what /proc/<pid>/stat counts in on every architecture we run on.
const TICKS_PER_SEC: f64 = 100.0;

/// CPU seconds `pid` has used so far (user + system).
pub fn cpu_secs(pid: u32) -> std::io::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces: count fields after its ')'.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| std::io::Error::other("unreadable /proc stat"))?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // After ')' come field 3 (state) onward: utime is field 14, stime 15.
    let tick = |i: usize| -> std::io::Result<f64> {
        fields
            .get(i - 3)
            .and_then(|f| f.parse::<f64>().ok())
            .ok_or_else(|| std::io::Error::other("unreadable /proc stat"))
    };
    Ok((tick(14)? + tick(15)?) / TICKS_PER_SEC)
}

/// Peak resident set of `pid` in MiB (VmHWM).
pub fn peak_rss_mib(pid: u32) -> std::io::Result<f64> {
    status_mib(pid, "VmHWM")
}

/// Anonymous resident memory of `pid` now, in MiB (RssAnon): without the page-cache
/// pages it maps.
pub fn anon_rss_mib(pid: u32) -> std::io::Result<f64> {
    status_mib(pid, "RssAnon")
}

fn status_mib(pid: u32, field: &str) -> std::io::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map(|kib| kib / 1024.0)
        .ok_or_else(|| std::io::Error::other(format!("no {field} in /proc/{pid}/status")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_own_process_has_cpu_time_and_a_peak_rss() {
        let me = std::process::id();
        let spin = std::time::Instant::now();
        while spin.elapsed() < std::time::Duration::from_millis(50) {}
        assert!(cpu_secs(me).unwrap() > 0.0);
        assert!(peak_rss_mib(me).unwrap() > 1.0);
        let anon = anon_rss_mib(me).unwrap();
        assert!(anon > 0.0 && anon <= peak_rss_mib(me).unwrap());
        assert!(cpu_secs(u32::MAX).is_err());
    }
}
