//! Host staging slots: how blocks of pools UCX cannot reach move between
//! daemons (docs/GPU.md, "Data plane between daemons").
//!
//! A GPU pool is device memory; a UCX build without CUDA support (Debian's
//! 1.13) can neither register it nor read it. Such a pool is *staged*: a
//! holder copies a granted slot (device → host) into a staging slot and
//! sends it from there on the getter's send order; a getter receives into a
//! staging slot, validates what arrived there (header, trailer, payload
//! checksum: every remote read is checked before use) and copies the whole
//! slot into its own pool (host → device) before the copy can be registered.
//!
//! The staging slots are one memfd of `slots` slots of the largest staged
//! stride, registered with UCX like a pool but never advertised to peers
//! (nothing reads them one-sided). Half of them (at least one) serve this
//! daemon's reads, the rest its sends, so neither role starves the other.
//! A getter waits for read slots (its reads go in waves of at most that
//! many); a holder takes a send slot at once or refuses that slot of the
//! order (the getter's read fails: a miss, counted in
//! `staging_exhausted`). A slot returns to the free list when its guard
//! drops; a slot UCX may still write (a receive past its deadline) or read
//! (a send that did not end) is quarantined: never reused.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use kvmesh_ffi_os::{ReadRegion, SharedMapping};
use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::memory::PoolMemory;

/// Whether a pool's blocks move through staging slots: UCX cannot reach
/// it (a GPU pool: kvmesh does not register device memory with UCX), or
/// the `stage-host-pools` test hook stages every pool.
pub fn is_staged(memory: &PoolMemory) -> bool {
    memory.is_gpu() || crate::peers::test_hook() == Some(crate::peers::TestHook::StageHostPools)
}

/// The staging slots of a daemon.
pub struct Staging {
    mapping: Arc<SharedMapping>,
    /// Bytes of one staging slot (the largest stride of a staged pool).
    slot_bytes: u64,
    /// The data plane's region index of the staging memory.
    region: u32,
    free: Mutex<Vec<u32>>,
    /// The slots this daemon's reads may hold, and its sends.
    recv: Side,
    send: Side,
    /// Slots read through a staging slot (getter side).
    pub staged_reads: AtomicU64,
    /// Slots sent from a staging slot (holder side).
    pub staged_sends: AtomicU64,
    /// Reads or sends refused: no staging slot free.
    pub exhausted: AtomicU64,
}

/// One side's share of the slots: a permit per slot in use; a quarantined
/// slot's permit is forgotten and counted, so what is left is known.
struct Side {
    permits: Arc<Semaphore>,
    total: usize,
    quarantined: AtomicUsize,
    /// Woken when a slot is quarantined: a wait for more permits than are
    /// left then takes fewer.
    shrunk: tokio::sync::Notify,
}

impl Side {
    fn new(total: usize) -> Side {
        Side {
            permits: Arc::new(Semaphore::new(total)),
            total,
            quarantined: AtomicUsize::new(0),
            shrunk: tokio::sync::Notify::new(),
        }
    }

    /// Slots not quarantined.
    fn left(&self) -> usize {
        self.total.saturating_sub(self.quarantined.load(Ordering::Relaxed))
    }
}

impl Staging {
    /// `slots` (at least 2) staging slots of `slot_bytes` each in a fresh
    /// memfd (locked in RAM when `lock`), for the data plane's region
    /// `region`.
    pub fn new(slots: u32, slot_bytes: u64, region: u32, lock: bool) -> Result<Arc<Staging>, String> {
        let bytes = slot_bytes
            .checked_mul(u64::from(slots))
            .filter(|&b| b > 0 && slots >= 2)
            .ok_or_else(|| format!("staging: {slots} slots of {slot_bytes} bytes (at least 2 slots)"))?;
        let recv_total = slots as usize / 2;
        let mapping = SharedMapping::create("kvmesh-staging", bytes, lock)
            .map_err(|e| format!("staging: cannot allocate {bytes} bytes: {e}"))?;
        Ok(Arc::new(Staging {
            mapping: Arc::new(mapping),
            slot_bytes,
            region,
            free: Mutex::new((0..slots).rev().collect()),
            recv: Side::new(recv_total),
            send: Side::new(slots as usize - recv_total),
            staged_reads: AtomicU64::new(0),
            staged_sends: AtomicU64::new(0),
            exhausted: AtomicU64::new(0),
        }))
    }

    /// The memory (to register with UCX).
    pub fn mapping(&self) -> &Arc<SharedMapping> {
        &self.mapping
    }

    /// Staging slots free now.
    #[cfg(test)]
    pub(crate) fn free_slots(&self) -> usize {
        self.free.lock().len()
    }

    /// Slots never reused (UCX may still touch them).
    #[cfg(test)]
    fn quarantined(&self) -> usize {
        self.recv.quarantined.load(Ordering::Relaxed) + self.send.quarantined.load(Ordering::Relaxed)
    }

    /// Most slots this daemon's reads hold at once (a getter's wave): the
    /// read slots not quarantined.
    pub fn recv_slots(&self) -> usize {
        self.recv.left()
    }

    /// Up to `n` slots to send from, waiting for them until `deadline`
    /// (a holder's sends end by themselves, so the wait is short unless
    /// peers ask for more than its send slots at once); fewer — none past
    /// the deadline — leave the rest of the order refused (counted).
    pub async fn take_send_wait(self: &Arc<Self>, n: usize, deadline: std::time::Instant) -> Vec<StagingSlot> {
        self.take(false, n, deadline).await
    }

    /// `n` slots to receive into (fewer when fewer read slots are left:
    /// [`Staging::recv_slots`]), waiting for them until `deadline`; `None`
    /// past it, or when no read slot is left (counted per read refused).
    pub async fn take_recv(self: &Arc<Self>, n: usize, deadline: std::time::Instant) -> Option<Vec<StagingSlot>> {
        Some(self.take(true, n, deadline).await).filter(|s| !s.is_empty())
    }

    /// Up to `n` slots of one side (at most the slots it has left, all at
    /// once or none), waiting until `deadline`; the reads or sends left
    /// without one are counted.
    async fn take(self: &Arc<Self>, recv: bool, n: usize, deadline: std::time::Instant) -> Vec<StagingSlot> {
        let side = if recv { &self.recv } else { &self.send };
        let mut slots = Vec::new();
        loop {
            let k = n.min(side.left());
            if k == 0 {
                break;
            }
            // A slot quarantined while this waits (its permit forgotten)
            // can leave fewer than `k` permits for ever: then wait again
            // for what is left, not until the deadline.
            let shrunk = side.shrunk.notified();
            tokio::pin!(shrunk);
            shrunk.as_mut().enable();
            if side.left() < k {
                continue;
            }
            let wait = Arc::clone(&side.permits).acquire_many_owned(k as u32);
            let got = tokio::select! {
                r = tokio::time::timeout_at(deadline.into(), wait) => r,
                _ = &mut shrunk => continue,
            };
            if let Ok(Ok(mut permits)) = got {
                while let Some(one) = if permits.num_permits() > 1 { permits.split(1) } else { None } {
                    slots.push(self.slot(one, recv));
                }
                slots.push(self.slot(permits, recv));
            }
            break;
        }
        self.exhausted.fetch_add((n - slots.len()) as u64, Ordering::Relaxed);
        slots
    }

    fn slot(self: &Arc<Self>, permit: OwnedSemaphorePermit, recv: bool) -> StagingSlot {
        // Every slot in use holds a permit, so a permit means a free slot.
        let index = self.free.lock().pop().expect("a permit for every free slot");
        StagingSlot { staging: Arc::clone(self), index, recv, permit: Some(permit) }
    }
}

/// One staging slot, taken for one transfer; back to the free list when
/// dropped (unless quarantined).
pub struct StagingSlot {
    staging: Arc<Staging>,
    index: u32,
    /// A read slot (else a send slot).
    recv: bool,
    /// `None` once quarantined (the permit forgotten).
    permit: Option<OwnedSemaphorePermit>,
}

impl std::fmt::Debug for StagingSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingSlot").field("index", &self.index).finish()
    }
}

impl StagingSlot {
    /// The data plane's region index of the staging memory.
    pub fn region(&self) -> u32 {
        self.staging.region
    }

    /// Offset of this slot in the staging memory.
    pub fn offset(&self) -> u64 {
        u64::from(self.index) * self.staging.slot_bytes
    }

    fn check(&self, len: u64) -> Result<(), String> {
        if len > self.staging.slot_bytes {
            return Err(format!("{len} bytes do not fit a staging slot of {}", self.staging.slot_bytes));
        }
        Ok(())
    }

    /// Copies `len` bytes at `offset` of `pool` into this slot (device →
    /// host for a GPU pool).
    pub fn fill_from(&self, pool: &PoolMemory, offset: u64, len: u64) -> Result<(), String> {
        self.check(len)?;
        let mut w = self.staging.mapping.write(self.offset(), len).map_err(|e| e.to_string())?;
        pool.copy_out(offset, &mut w)
    }

    /// The first `len` bytes of this slot (what a receive wrote).
    pub fn bytes(&self, len: u64) -> Result<ReadRegion, String> {
        self.check(len)?;
        self.staging.mapping.read(self.offset(), len).map_err(|e| e.to_string())
    }

    /// Copies the first `len` bytes of this slot to `offset` of `pool`
    /// (host → device for a GPU pool).
    pub fn copy_to(&self, pool: &PoolMemory, offset: u64, len: u64) -> Result<(), String> {
        let r = self.bytes(len)?;
        pool.copy_in(offset, &r)
    }

    /// Never reuse this slot: UCX may still write or read it.
    pub fn quarantine(mut self) {
        if let Some(p) = self.permit.take() {
            p.forget();
        }
        let side = if self.recv { &self.staging.recv } else { &self.staging.send };
        side.quarantined.fetch_add(1, Ordering::Relaxed);
        side.shrunk.notify_waiters();
    }
}

impl Drop for StagingSlot {
    fn drop(&mut self) {
        if let Some(p) = self.permit.take() {
            // The index first: the permit released after it finds it free.
            self.staging.free.lock().push(self.index);
            drop(p);
        }
    }
}

/// A granted slot of a staged pool to copy into a send staging slot
/// before it goes out (item `item` of its send order).
#[derive(Clone)]
pub struct StageJob {
    /// Index of the item in its order.
    pub item: usize,
    /// The pool's memory.
    pub memory: PoolMemory,
    /// Offset of the slot in it.
    pub offset: u64,
    /// Bytes (the slot's stride).
    pub len: u64,
}

impl std::fmt::Debug for StageJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageJob")
            .field("item", &self.item)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

/// Copies the staged slots of `o` (its `jobs`) into `slots` (device →
/// host for a GPU pool) and points their items there; an item that gets
/// no slot, or whose copy fails, is refused (an empty message from the
/// staging memory). Blocking: not on the data-plane thread.
pub fn stage(o: &mut crate::dataplane::SendOrder, staging: &Arc<Staging>, mut slots: Vec<StagingSlot>) {
    for j in std::mem::take(&mut o.jobs) {
        let item = &mut o.items[j.item];
        let slot = slots.pop();
        let copied = slot.as_ref().map(|s| s.fill_from(&j.memory, j.offset, j.len));
        match (slot, copied) {
            (Some(slot), Some(Ok(()))) => {
                (item.local_pool, item.local_offset) = (slot.region(), slot.offset());
                staging.staged_sends.fetch_add(1, Ordering::Relaxed);
                o.staged.push((j.item, slot));
            }
            (_, copied) => {
                if let Some(Err(e)) = copied {
                    tracing::warn!(offset = j.offset, "staging copy failed: {e}");
                }
                (item.local_pool, item.local_offset, item.len) = (staging.region, 0, 0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Half the slots serve reads (waiting for them), half sends (refused
    /// at once when busy, counted); slots come back when dropped, never
    /// when quarantined; bytes go in and out.
    #[tokio::test]
    async fn slots_are_lent_returned_and_quarantined() {
        let st = Staging::new(4, 4096, 7, false).unwrap();
        assert_eq!(st.recv_slots(), 2);
        let soon = || Instant::now() + Duration::from_millis(50);
        let reads = st.take_recv(5, soon()).await.unwrap();
        assert_eq!(reads.len(), 2, "at most the read slots");
        assert_eq!(st.exhausted.load(Ordering::Relaxed), 3, "three reads got no slot");
        assert!(st.take_recv(1, soon()).await.is_none(), "both read slots lent: waited, then refused");
        let mut sends = st.take_send_wait(2, soon()).await;
        let (s1, s2) = (sends.pop().unwrap(), sends.pop().unwrap());
        assert!(st.take_send_wait(1, soon()).await.is_empty(), "both send slots lent: waited, then refused");
        assert_eq!(st.exhausted.load(Ordering::Relaxed), 5);
        let mut offsets: Vec<u64> = reads.iter().chain([&s1, &s2]).map(|s| s.offset()).collect();
        offsets.sort();
        offsets.dedup();
        assert_eq!(offsets.len(), 4, "four distinct slots");
        assert_eq!(s1.region(), 7);
        let pool = PoolMemory::Host(Arc::new(SharedMapping::create("t", 8192, false).unwrap()));
        pool.copy_in(4096, &[9u8; 100]).unwrap();
        s1.fill_from(&pool, 4096, 100).unwrap();
        assert_eq!(&s1.bytes(100).unwrap()[..], &[9u8; 100][..]);
        s1.copy_to(&pool, 0, 100).unwrap();
        let mut back = [0u8; 100];
        pool.copy_out(0, &mut back).unwrap();
        assert_eq!(back, [9u8; 100]);
        assert!(s1.bytes(4097).is_err(), "bigger than a slot");
        // A waiting read gets a slot as soon as one comes back.
        let waiter = tokio::spawn({
            let st = Arc::clone(&st);
            async move { st.take_recv(1, Instant::now() + Duration::from_secs(5)).await.map(|v| v.len()) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut reads = reads.into_iter();
        drop(reads.next());
        assert_eq!(waiter.await.unwrap(), Some(1));
        // Quarantined: never back (neither the slot nor its permit), and
        // reads go in smaller waves.
        reads.next().unwrap().quarantine();
        assert_eq!(st.recv_slots(), 1);
        drop(s1);
        s2.quarantine();
        assert_eq!(st.quarantined(), 2);
        assert_eq!(st.free_slots(), 2, "the waiter's slot and s1 came back; two quarantined");
        assert_eq!(st.take_send_wait(2, soon()).await.len(), 1, "s1's permit is back; s2's is gone");
        let two = st.take_recv(2, soon()).await.unwrap();
        assert_eq!(two.len(), 1, "one read slot left: a wave of two gets one, at once");
        let last = two.into_iter().next().unwrap();
        last.quarantine();
        assert_eq!(st.recv_slots(), 0);
        let t0 = Instant::now();
        assert!(st.take_recv(1, Instant::now() + Duration::from_secs(5)).await.is_none());
        assert!(t0.elapsed() < Duration::from_secs(1), "no read slot left: refused at once, not at the deadline");
    }

    /// A wave waiting for both read slots, one of them quarantined by
    /// another batch meanwhile: it gets the one left as soon as that one is
    /// back, not nothing at its deadline.
    #[tokio::test]
    async fn a_wave_waiting_for_a_slot_that_is_quarantined_takes_what_is_left() {
        let st = Staging::new(4, 4096, 7, false).unwrap();
        let held = st.take_recv(2, Instant::now() + Duration::from_millis(50)).await.unwrap();
        let waiter = tokio::spawn({
            let st = Arc::clone(&st);
            async move { st.take_recv(2, Instant::now() + Duration::from_secs(10)).await.map(|v| v.len()) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let t0 = Instant::now();
        let mut held = held.into_iter();
        held.next().unwrap().quarantine();
        drop(held);
        assert_eq!(waiter.await.unwrap(), Some(1));
        assert!(t0.elapsed() < Duration::from_secs(2), "waited {:?}", t0.elapsed());
    }

    /// A staged order: its jobs are copied into send slots and its items
    /// point there; with no slot free an item becomes a refusal (an empty
    /// message from the staging memory).
    #[test]
    fn stage_points_items_at_staging_slots_or_refuses_them() {
        use crate::dataplane::{SendOrder, TransferItem};
        let st = Staging::new(2, 4096, 9, false).unwrap(); // one send slot
        let pool = PoolMemory::Host(Arc::new(SharedMapping::create("p", 16384, false).unwrap()));
        pool.copy_in(4096, &[7u8; 4096]).unwrap();
        pool.copy_in(8192, &[8u8; 4096]).unwrap();
        let item = |off| TransferItem {
            remote_pool: 0,
            remote_offset: 0,
            len: 4096,
            local_pool: 0,
            local_offset: off,
            tag: off,
        };
        let job = |item, offset| StageJob { item, memory: pool.clone(), offset, len: 4096 };
        let mut o = SendOrder {
            node: 2,
            incarnation: 1,
            items: vec![item(4096), item(8192)],
            staged: Vec::new(),
            jobs: vec![job(0, 4096), job(1, 8192)],
        };
        let slots = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
            .block_on(st.take_send_wait(2, std::time::Instant::now() + std::time::Duration::from_millis(20)));
        assert_eq!(slots.len(), 1, "one send slot");
        stage(&mut o, &st, slots);
        assert!(o.jobs.is_empty());
        assert_eq!(o.staged.len(), 1);
        let (i, slot) = &o.staged[0];
        assert_eq!(*i, 0);
        assert_eq!((o.items[0].local_pool, o.items[0].local_offset, o.items[0].len), (9, slot.offset(), 4096));
        assert_eq!(&slot.bytes(4096).unwrap()[..], &[7u8; 4096][..]);
        assert_eq!((o.items[1].local_pool, o.items[1].len), (9, 0), "no send slot: refused");
        assert_eq!(st.staged_sends.load(Ordering::Relaxed), 1);
        assert_eq!(st.exhausted.load(Ordering::Relaxed), 1);
    }
}
