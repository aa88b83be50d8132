//! Keeps the heap from holding on to a load once it is over. glibc gives each thread that
//! allocates under contention an arena of its own, up to 8 per core, and a burst (a boot
//! storm's connections, 32 clients listing 20,000 nodes) leaves each arena fragmented:
//! resident memory stayed near its peak long after the load ended. So arenas are capped
//! at one per core (`limit_arenas`, before any thread starts; tcache keeps most
//! allocations off the arena locks anyway), and free pages are handed back every 10 s
//! (`trim_every`). Only on glibc; other allocators (musl's) return memory themselves.
//! Figures: BENCHMARKS.md, "Issue 13".

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// How often the heap is trimmed. A trim walks the free lists: microseconds on an idle
/// heap, a few milliseconds on one of hundreds of MiB, on a blocking thread.
pub const TRIM_EVERY: Duration = Duration::from_secs(10);

/// Trims the heap every `every` until `stop`.
pub async fn trim_every(every: Duration, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = stop.cancelled() => return,
        }
        let _ = tokio::task::spawn_blocking(trim).await;
    }
}

/// Caps glibc's arenas at one per core (at least 2). Call first thing in `main`, before
/// the runtime's threads exist.
pub fn limit_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let arenas = libc::c_int::try_from(cores.max(2)).unwrap_or(libc::c_int::MAX);
        // SAFETY: mallopt only sets a malloc tunable; called before other threads exist.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, arenas);
        }
    }
}

/// Returns free heap pages to the OS; whether any were.
pub fn trim() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim takes glibc's arena locks itself and touches only free
        // chunks; it is safe to call from any thread at any time.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    /// Freed memory pinned under a live allocation stays with the process until a trim
    /// gives its pages back.
    #[test]
    fn a_trim_returns_freed_pages_under_a_live_allocation() {
        let mut blocks: Vec<Vec<u8>> = (0..4096).map(|i| vec![i as u8; 16 << 10]).collect();
        let pin = vec![1u8; 16 << 10];
        blocks.clear();
        blocks.shrink_to_fit();
        assert!(
            super::trim(),
            "malloc_trim released nothing after 64 MiB was freed"
        );
        assert_eq!(pin[0], 1);
    }
}
