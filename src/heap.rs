//! Hands freed heap back to the OS once a load is over. glibc keeps what a burst freed (a
//! boot storm's connections, a large listing) in its arenas, so the server's resident
//! memory stayed at its peak long after the load ended; `malloc_trim` releases the free
//! pages. Only on glibc; other allocators (musl's) return memory themselves.

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
