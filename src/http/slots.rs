//! The connection slots of one listener (`max_connections`), handed to waiting
//! connections in arrival order, with one exception: a node agent's call goes before
//! the rest. An agent call is a node's last steps (attest, validate, heartbeat): short,
//! and what stands between that node and ready; in a boot storm every other waiting
//! connection is a boot script or a download that starts a node's work rather than ends
//! it. Finishing the nodes already far along first readies the median node seconds
//! sooner at the same total (measured in BENCHMARKS.md). Anyone can send a request
//! line that looks like an agent call, so agent calls hold at most half the slots
//! while other connections wait: a flood of them cannot shut boots out.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

pub struct Slots {
    cap: usize,
    state: Mutex<State>,
}

struct State {
    free: usize,
    /// Slots held by agent calls now.
    agent_held: usize,
    agent: VecDeque<oneshot::Sender<Slot>>,
    rest: VecDeque<oneshot::Sender<Slot>>,
}

/// One connection's slot, given back (to the next waiter, or as free) when dropped.
pub struct Slot {
    /// None once handed on (a slot whose waiter had gone is taken back unreleased).
    slots: Option<Arc<Slots>>,
    agent: bool,
}

impl Slots {
    pub fn new(cap: usize) -> Arc<Self> {
        Arc::new(Self {
            cap,
            state: Mutex::new(State {
                free: cap,
                agent_held: 0,
                agent: VecDeque::new(),
                rest: VecDeque::new(),
            }),
        })
    }

    /// Slots held now.
    pub fn held(&self) -> usize {
        self.cap - self.lock().free
    }

    /// Whether a slot is free now (no connection waits, then).
    pub fn any_free(&self) -> bool {
        self.lock().free > 0
    }

    /// A slot: at once if one is free, else when one is given back and it is this
    /// caller's turn.
    pub async fn acquire(self: &Arc<Self>, agent: bool) -> Slot {
        let waiting = {
            let mut state = self.lock();
            if state.free > 0 {
                state.free -= 1;
                state.agent_held += usize::from(agent);
                return Slot {
                    slots: Some(self.clone()),
                    agent,
                };
            }
            let (tx, rx) = oneshot::channel();
            if agent {
                state.agent.push_back(tx);
            } else {
                state.rest.push_back(tx);
            }
            rx
        };
        waiting
            .await
            .expect("a waiter's sender is only dropped with its slot sent")
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("not poisoned")
    }
}

impl State {
    /// The next waiter and whether it is an agent call: agent calls first while they
    /// hold under half the slots (at least one), else the rest, else agent calls.
    fn next(&mut self, cap: usize) -> Option<(oneshot::Sender<Slot>, bool)> {
        let agent_room = self.agent_held < (cap / 2).max(1);
        if agent_room && let Some(tx) = self.agent.pop_front() {
            return Some((tx, true));
        }
        if let Some(tx) = self.rest.pop_front() {
            return Some((tx, false));
        }
        self.agent.pop_front().map(|tx| (tx, true))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let Some(slots) = self.slots.take() else {
            return;
        };
        let mut state = slots.lock();
        state.agent_held -= usize::from(self.agent);
        while let Some((tx, agent)) = state.next(slots.cap) {
            state.agent_held += usize::from(agent);
            let handed = Slot {
                slots: Some(slots.clone()),
                agent,
            };
            match tx.send(handed) {
                Ok(()) => return,
                // That waiter went away (its connection's task ended): the next one.
                Err(mut back) => {
                    back.slots = None;
                    state.agent_held -= usize::from(agent);
                }
            }
        }
        state.free += 1;
    }
}

/// Whether the request waiting on `tcp` is a node agent's call, from its first bytes
/// (peeked, left for the server to read); a client that has sent nothing within a
/// moment is not one.
pub async fn is_agent_call(tcp: &tokio::net::TcpStream) -> bool {
    const AGENT: &[u8] = b"POST /api/v1/agent/";
    let mut head = [0u8; AGENT.len()];
    let peek = tokio::time::timeout(std::time::Duration::from_millis(20), async {
        // The request may arrive in pieces: look until there is enough, or it ends.
        loop {
            match tcp.peek(&mut head).await {
                Ok(n) if n == head.len() || n == 0 => return n,
                Ok(n) if head[..n] != AGENT[..n] => return n,
                Ok(_) => tokio::time::sleep(std::time::Duration::from_millis(1)).await,
                Err(_) => return 0,
            }
        }
    })
    .await;
    matches!(peek, Ok(n) if n == AGENT.len() && head == AGENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn agent_calls_go_first_up_to_half_the_slots_then_arrival_order() {
        let slots = Slots::new(4);
        let mut held: Vec<Slot> = Vec::new();
        for _ in 0..4 {
            held.push(slots.acquire(false).await);
        }
        assert_eq!(slots.held(), 4);
        assert!(!slots.any_free());
        let (order_tx, mut order) = tokio::sync::mpsc::unbounded_channel();
        let mut waiters = Vec::new();
        // In this order: rest 0, agent 1, rest 2, agent 3, agent 4, agent 5.
        for (i, agent) in [false, true, false, true, true, true]
            .into_iter()
            .enumerate()
        {
            let (slots, order_tx) = (slots.clone(), order_tx.clone());
            waiters.push(tokio::spawn(async move {
                let slot = slots.acquire(agent).await;
                order_tx.send(i).unwrap();
                slot
            }));
            tokio::task::yield_now().await;
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let mut given = Vec::new();
        for _ in 0..4 {
            held.pop();
            given.push(order.recv().await.unwrap());
        }
        // Agents 1 and 3 first (two of four slots), then the rest in order (0, 2),
        // and agent 4 waits behind them while agents hold half.
        assert_eq!(given, [1, 3, 0, 2]);
        assert!(order.try_recv().is_err());
        assert_eq!(slots.held(), 4);
    }

    #[tokio::test]
    async fn agent_calls_are_told_apart_by_their_request_line() {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        for (sent, agent) in [
            (&b"POST /api/v1/agent/attest HTTP/1.1\r\n"[..], true),
            (b"POST /api/v1/agent/heartbeat HTTP/1.1\r\n", true),
            (b"GET /boot/node.ipxe?mac=x HTTP/1.1\r\n", false),
            (b"POST /api/v1/images HTTP/1.1\r\n", false),
            (b"POST /api/v1/agen", false),
            (b"", false),
        ] {
            let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
            client.write_all(sent).await.unwrap();
            let (server, _) = listener.accept().await.unwrap();
            assert_eq!(is_agent_call(&server).await, agent, "{sent:?}");
            // Peeked, not read: the server still reads the whole request.
            let mut again = vec![0u8; sent.len()];
            if !sent.is_empty() {
                server.peek(&mut again).await.unwrap();
                assert_eq!(again, sent);
            }
        }
    }

    #[tokio::test]
    async fn a_waiter_gone_is_skipped_and_slots_come_back_free() {
        let slots = Slots::new(1);
        let first = slots.acquire(false).await;
        let gone = tokio::spawn({
            let slots = slots.clone();
            async move { slots.acquire(false).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        gone.abort();
        let _ = gone.await;
        let next = tokio::spawn({
            let slots = slots.clone();
            async move { slots.acquire(true).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        drop(first);
        let next = next.await.unwrap();
        assert_eq!(slots.held(), 1);
        drop(next);
        assert_eq!(slots.held(), 0);
        assert!(slots.any_free());
    }
}
