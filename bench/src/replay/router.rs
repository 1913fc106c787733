//! The `kv-aware` assignment policy: a router that consumes the KV events
//! of every daemon (a snapshot, then the live events) into an index of
//! which daemon holds which block, and sends each request to the daemon
//! holding the longest prefix of its blocks (ties: the one with the fewest
//! requests in flight), as a cache-aware router in front of engines does
//! (Dynamo's KV router, vLLM's and LMCache's KV events).
//!
//! The index is a hint: a block evicted since its event arrived is a miss
//! for the request, never a wrong byte (the request pins and validates).
//! A gap in a daemon's sequence numbers, or its stream ending (cut off as
//! too slow), drops what the router knew of that daemon and watches again
//! from a snapshot.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use kvmesh_client::{Client, Key, KvEventKind, Namespace};
use parking_lot::Mutex;

/// Most daemons the router indexes (one bit each).
pub(crate) const DAEMONS_MAX: usize = 64;

pub(crate) struct Router {
    /// Per block: bit d set when daemon d holds it.
    held: Mutex<HashMap<Key, u64>>,
    inflight: Vec<AtomicU64>,
    /// Events applied, resynchronisations (gaps or streams that ended).
    pub(crate) events: AtomicU64,
    pub(crate) resyncs: AtomicU64,
    stop: AtomicBool,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Router {
    /// Starts watching every daemon; returns once each has delivered its
    /// snapshot.
    pub(crate) async fn start(clients: &[Client], nss: &[Namespace]) -> anyhow::Result<Arc<Router>> {
        anyhow::ensure!(clients.len() <= DAEMONS_MAX, "kv-aware routes among at most {DAEMONS_MAX} daemons");
        let r = Arc::new(Router {
            held: Mutex::new(HashMap::new()),
            inflight: (0..clients.len()).map(|_| AtomicU64::new(0)).collect(),
            events: AtomicU64::new(0),
            resyncs: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            tasks: Mutex::new(Vec::new()),
        });
        let mut ready = Vec::new();
        for (d, (c, ns)) in clients.iter().zip(nss).enumerate() {
            let (tx, rx) = tokio::sync::oneshot::channel();
            ready.push(rx);
            let task = tokio::spawn(Arc::clone(&r).watch(d, c.clone(), ns.clone(), tx));
            r.tasks.lock().push(task);
        }
        for rx in ready {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(30), rx).await;
        }
        Ok(r)
    }

    /// Keeps daemon `d`'s bits in the index up to date until stopped.
    async fn watch(self: Arc<Self>, d: usize, c: Client, ns: Namespace, ready: tokio::sync::oneshot::Sender<()>) {
        let bit = 1u64 << d;
        let mut ready = Some(ready);
        while !self.stop.load(Ordering::Relaxed) {
            // Forget what was known of d: the snapshot says it again.
            self.held.lock().retain(|_, b| {
                *b &= !bit;
                *b != 0
            });
            let mut stream = match c.watch_events(&ns, true).await {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("kv-aware: watch of daemon {} failed: {e}; retrying", d + 1);
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    continue;
                }
            };
            let mut last: Option<u64> = None;
            loop {
                let b = match stream.message().await {
                    Ok(Some(b)) => b,
                    Ok(None) | Err(_) => break,
                };
                let mut held = self.held.lock();
                if b.snapshot {
                    for e in &b.events {
                        let k = e.key.map(|k| Key::from_parts(k.hi, k.lo));
                        if let Some(k) = k {
                            *held.entry(k).or_default() |= bit;
                        }
                    }
                    last = Some(b.snapshot_seq);
                    if b.snapshot_done
                        && let Some(tx) = ready.take()
                    {
                        let _ = tx.send(());
                    }
                    continue;
                }
                let mut gap = false;
                for e in &b.events {
                    if last.is_some_and(|l| e.seq != l + 1) {
                        gap = true;
                        break;
                    }
                    last = Some(e.seq);
                    let Some(k) = e.key.map(|k| Key::from_parts(k.hi, k.lo)) else { continue };
                    match KvEventKind::try_from(e.kind) {
                        Ok(KvEventKind::Stored) => *held.entry(k).or_default() |= bit,
                        Ok(KvEventKind::Removed | KvEventKind::Evicted | KvEventKind::Invalidated) => {
                            if let Some(v) = held.get_mut(&k) {
                                *v &= !bit;
                                if *v == 0 {
                                    held.remove(&k);
                                }
                            }
                        }
                        _ => {}
                    }
                }
                self.events.fetch_add(b.events.len() as u64, Ordering::Relaxed);
                if gap {
                    break;
                }
            }
            if !self.stop.load(Ordering::Relaxed) {
                self.resyncs.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The daemon for a request of `keys`: the longest prefix held, then the
    /// fewest requests in flight, then the lowest index.
    pub(crate) fn pick(&self, keys: &[Key]) -> usize {
        let n = self.inflight.len();
        let all = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
        let mut prefix = vec![0usize; n];
        {
            let held = self.held.lock();
            let mut alive = all;
            for (i, k) in keys.iter().enumerate() {
                alive &= held.get(k).copied().unwrap_or(0);
                if alive == 0 {
                    break;
                }
                for (d, p) in prefix.iter_mut().enumerate() {
                    if alive & (1 << d) != 0 {
                        *p = i + 1;
                    }
                }
            }
        }
        (0..n).min_by_key(|&d| (std::cmp::Reverse(prefix[d]), self.inflight[d].load(Ordering::Relaxed), d)).unwrap_or(0)
    }

    /// A request started on / left daemon `d`.
    pub(crate) fn begin(&self, d: usize) {
        self.inflight[d].fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn end(&self, d: usize) {
        self.inflight[d].fetch_sub(1, Ordering::Relaxed);
    }

    /// Stops the watch tasks.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks.lock().drain(..) {
            t.abort();
        }
    }
}
