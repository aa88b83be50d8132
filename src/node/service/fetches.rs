//! Attributes blob downloads to the boot that made them. Blob URLs in a boot script carry
//! `?boot=<id>`; the blob route wraps its body in `Tracked`, which reports, when the body
//! is done or dropped, how many bytes went out and whether the last one did. Records go
//! through a bounded queue to one writer task, so a download never waits on the database,
//! and are written in batches, one transaction each; `flush` lets attestation read what
//! was recorded before it judges.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::Stream;
use tokio::sync::{mpsc, oneshot};

use crate::api::Digest;
use crate::store::Fetch;
use crate::store::Store;

/// Records waiting for the writer; past this, records are dropped and counted (a flood of
/// downloads with made-up boot ids must not grow memory). A dropped record fails its
/// boot's attestation, so this holds a storm's worth: 10,000 nodes' 2-3 downloads each
/// overflowed 8,192 while the writer waited on the write lock (about 10 MiB when full).
const QUEUE: usize = 65_536;

/// Records written per transaction at most: whatever queued while the last one
/// committed goes in the next, so the write rate follows the load.
const BATCH: usize = 1024;

enum Message {
    Record(String, Fetch),
    Flush(oneshot::Sender<()>),
}

#[derive(Clone)]
pub struct FetchRecorder {
    tx: mpsc::Sender<Message>,
    dropped: Arc<AtomicU64>,
    metrics: crate::metrics::Metrics,
}

/// A boot id as we issue them: 16 lowercase hex digits. Anything else is not recorded.
pub fn plausible_boot_id(id: &str) -> bool {
    id.len() == 16 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

impl FetchRecorder {
    /// Starts the writer task (it ends when every recorder is dropped).
    pub fn start(store: Store, metrics: crate::metrics::Metrics) -> Self {
        let (tx, mut rx) = mpsc::channel(QUEUE);
        let timed = metrics.clone();
        tokio::spawn(crate::store::own_task(async move {
            let mut batch = Vec::with_capacity(BATCH);
            while rx.recv_many(&mut batch, BATCH).await > 0 {
                // Every record queued before a flush in this batch is written below,
                // before that flush is answered.
                let mut records = Vec::with_capacity(batch.len());
                let mut flushes = Vec::new();
                for msg in batch.drain(..) {
                    match msg {
                        Message::Record(boot, fetch) => records.push((boot, fetch)),
                        Message::Flush(done) => flushes.push(done),
                    }
                }
                if !records.is_empty() {
                    let started = std::time::Instant::now();
                    match store.record_fetches(&records).await {
                        Ok(_) => timed.fetch_commit(started.elapsed().as_secs_f64()),
                        Err(e) => {
                            tracing::warn!(records = records.len(), error = %e, "cannot record blob fetches")
                        }
                    }
                }
                for done in flushes {
                    let _ = done.send(());
                }
            }
        }));
        Self {
            tx,
            dropped: Arc::new(AtomicU64::new(0)),
            metrics,
        }
    }

    fn record(&self, boot: String, fetch: Fetch) {
        if self.tx.try_send(Message::Record(boot, fetch)).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            self.metrics.fetch_record_dropped();
        }
    }

    /// Records a download made another way than through `track` (a TFTP transfer named
    /// with `?boot=`); a boot id not of our shape is ignored.
    pub fn record_done(&self, boot: &str, fetch: Fetch) {
        if plausible_boot_id(boot) {
            self.record(boot.to_string(), fetch);
        }
    }

    /// Returns once every record queued before this call is written.
    pub async fn flush(&self) {
        let (done, wait) = oneshot::channel();
        if self.tx.send(Message::Flush(done)).await.is_ok() {
            let _ = wait.await;
        }
    }

    /// Records waiting to be written.
    pub fn queued(&self) -> usize {
        QUEUE - self.tx.capacity()
    }

    /// Records dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Wraps a blob body of `len` bytes from `offset` so its progress is recorded for
    /// `boot`.
    pub fn track<S>(
        &self,
        boot: String,
        digest: Digest,
        whole: bool,
        offset: u64,
        len: u64,
        body: S,
    ) -> Tracked<S> {
        Tracked {
            body,
            recorder: self.clone(),
            boot,
            len,
            fetch: Fetch {
                digest,
                started_at_ms: crate::clock::now_ms(),
                finished_at_ms: None,
                offset,
                bytes: 0,
                whole,
            },
            recorded: false,
        }
    }
}

/// A blob body that reports its progress when it ends or is dropped.
pub struct Tracked<S> {
    body: S,
    recorder: FetchRecorder,
    boot: String,
    /// The body's length: hyper stops polling once Content-Length bytes are out, so the
    /// end is the last byte, not the stream's end.
    len: u64,
    fetch: Fetch,
    /// Recorded at the last byte already; the drop records nothing more.
    recorded: bool,
}

impl<S> Stream for Tracked<S>
where
    S: Stream<Item = std::io::Result<Bytes>> + Unpin,
{
    type Item = std::io::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        let next = Pin::new(&mut this.body).poll_next(cx);
        if let Poll::Ready(Some(Ok(chunk))) = &next {
            this.fetch.bytes += chunk.len() as u64;
            if this.fetch.bytes >= this.len && this.fetch.finished_at_ms.is_none() {
                this.fetch.finished_at_ms = Some(crate::clock::now_ms());
                // Queued before hyper writes the last chunk, so before the node can have
                // it and attest: an attestation's flush then always finds it. Queued at
                // the drop instead, a fast node attested first now and then (found by the
                // boot-storm simulator: 2 of 1,000 nodes).
                this.recorder.record(this.boot.clone(), this.fetch.clone());
                this.recorded = true;
            }
        }
        next
    }
}

impl<S> Drop for Tracked<S> {
    fn drop(&mut self) {
        if self.recorded {
            return;
        }
        self.recorder
            .record(std::mem::take(&mut self.boot), self.fetch.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_boot_id_shape_is_recorded() {
        assert!(plausible_boot_id("0123456789abcdef"));
        for bad in [
            "",
            "0123456789ABCDEF",
            "0123456789abcde",
            "../../etc/passwd0",
            "0123456789abcdeg",
        ] {
            assert!(!plausible_boot_id(bad), "{bad}");
        }
    }
}
