//! A home's lookup table as words in shared memory, read one-sided by
//! other daemons (docs/COHERENCE.md, "Lookups read one-sided").
//!
//! The home writes it (one writer, under its core lock); peers read it
//! through their mapping of the same registered memory while it changes.
//! Every word is an `AtomicU64`, so concurrent access across processes is
//! defined; each entry and the header sit behind a seqlock (the sequence
//! word is odd while the writer changes them), and a reader that sees it
//! change retries a few times, then gives up: the key is *unknown* and
//! the caller asks the home instead. A reader trusts nothing it reads for
//! its own safety: the table's shape comes from the length the reader
//! mapped, and every index is bounded by it.
//!
//! Layout (words): a header of 8 (`magic`, `seq`, node, incarnation,
//! epoch, ready, 2 unused), one meta word per group, then `groups` groups
//! of [`GROUP_ENTRIES`] entries of 8 words (`seq`, used, namespace, key
//! low, key high, three value words). A key lives only in its group (a
//! hash of the key picks it). A key that finds its group full waits in
//! the writer's overflow list and the group's meta word counts it: a
//! reader that does not find a key in a group with overflow says
//! *unknown*, never *absent*. The meta word also counts every move of an
//! overflowed key into the group; a reader reads it before and after its
//! scan and retries when it changed.

use std::collections::HashMap;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicU64, fence};

/// First word of every table.
pub const TABLE_MAGIC: u64 = u64::from_le_bytes(*b"kvmtbl01");
/// Entries per group.
pub const GROUP_ENTRIES: usize = 8;
/// Value words per entry.
pub const VALUE_WORDS: usize = 3;
const HEADER_WORDS: usize = 8;
const ENTRY_WORDS: usize = 8;
/// Tries of a seqlocked read before a reader gives up.
const READ_TRIES: usize = 16;

/// Words a table of `groups` groups takes.
pub fn table_words(groups: usize) -> usize {
    HEADER_WORDS + meta_words(groups) + groups * GROUP_ENTRIES * ENTRY_WORDS
}

/// Groups for about `entries` keys at half load (at least one).
pub fn groups_for(entries: usize) -> usize {
    (entries.saturating_mul(2) / GROUP_ENTRIES).max(1)
}

/// The meta words, rounded up to whole 64-byte lines.
fn meta_words(groups: usize) -> usize {
    groups.div_ceil(8) * 8
}

/// The most groups `len` words hold.
fn groups_in(len: usize) -> usize {
    let avail = len.saturating_sub(HEADER_WORDS);
    // meta (<= groups + 7) + groups * 64 <= avail
    let mut g = avail / (1 + GROUP_ENTRIES * ENTRY_WORDS);
    while g > 0 && table_words(g) > len {
        g -= 1;
    }
    g
}

/// The group of a key (the same function on every node).
fn group_of(ns: u64, key: u128, groups: usize) -> usize {
    let mut h = ns ^ (key as u64).rotate_left(17) ^ ((key >> 64) as u64).rotate_left(41);
    // splitmix64's finaliser
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^= h >> 31;
    (h % groups as u64) as usize
}

/// What a table's header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The home that writes it.
    pub node: u32,
    /// Its incarnation.
    pub incarnation: u64,
    /// The epoch of its view.
    pub epoch: u64,
    /// Its directory is rebuilt for that view.
    pub ready: bool,
}

/// What a reader found for a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// The key's value words, read whole.
    Found([u64; VALUE_WORDS]),
    /// Not in the table at the moment of the read.
    Absent,
    /// Cannot tell (the table changed under every try, or the key's group
    /// overflowed): ask the home.
    Unknown,
}

/// Why a region cannot hold a table.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TableError {
    /// Too short for a header and one group.
    #[error("lookup table region of {0} words is too small (at least {min} needed)", min = table_words(1))]
    TooSmall(usize),
}

/// A key (namespace, key) waiting for room in its group, with its value.
type Queued = ((u64, u128), [u64; VALUE_WORDS]);

/// The writer of a table: the home, one thread at a time (`&mut self`).
pub struct TableWriter<W: std::ops::Deref<Target = [AtomicU64]>> {
    words: W,
    groups: usize,
    /// Where each placed key is (entry index).
    placed: HashMap<(u64, u128), usize>,
    /// Entries in use, per entry index.
    used: Vec<bool>,
    /// Keys whose group was full, with their values, per group.
    overflow: HashMap<usize, Vec<Queued>>,
    /// Moves of overflowed keys into their group, per group.
    moves: Vec<u32>,
}

impl<W: std::ops::Deref<Target = [AtomicU64]>> TableWriter<W> {
    /// A writer over `words`, which it clears: an empty table whose header
    /// says not ready.
    pub fn new(words: W) -> Result<Self, TableError> {
        let groups = groups_in(words.len());
        if groups == 0 {
            return Err(TableError::TooSmall(words.len()));
        }
        for w in words.iter() {
            w.store(0, Relaxed);
        }
        fence(Release);
        words[0].store(TABLE_MAGIC, Release);
        let entries = groups * GROUP_ENTRIES;
        Ok(TableWriter {
            words,
            groups,
            placed: HashMap::new(),
            used: vec![false; entries],
            overflow: HashMap::new(),
            moves: vec![0; groups],
        })
    }

    /// The words written.
    pub fn words(&self) -> &[AtomicU64] {
        &self.words
    }

    /// Groups of the table.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// Keys placed in the table.
    pub fn placed(&self) -> usize {
        self.placed.len()
    }

    /// Keys waiting for room in their group.
    pub fn overflowed(&self) -> usize {
        self.overflow.values().map(Vec::len).sum()
    }

    /// Writes the header.
    pub fn set_header(&mut self, h: Header) {
        let w = &self.words;
        let seq = w[1].load(Relaxed);
        w[1].store(seq | 1, Relaxed);
        fence(Release);
        w[2].store(u64::from(h.node), Relaxed);
        w[3].store(h.incarnation, Relaxed);
        w[4].store(h.epoch, Relaxed);
        w[5].store(u64::from(h.ready), Relaxed);
        w[1].store((seq | 1) + 1, Release);
    }

    fn entry_base(&self, index: usize) -> usize {
        HEADER_WORDS + meta_words(self.groups) + index * ENTRY_WORDS
    }

    fn write_entry(&self, index: usize, used: bool, ns: u64, key: u128, value: [u64; VALUE_WORDS]) {
        let b = self.entry_base(index);
        let w = &self.words;
        let seq = w[b].load(Relaxed);
        w[b].store(seq | 1, Relaxed);
        fence(Release);
        w[b + 1].store(u64::from(used), Relaxed);
        w[b + 2].store(ns, Relaxed);
        w[b + 3].store(key as u64, Relaxed);
        w[b + 4].store((key >> 64) as u64, Relaxed);
        for (i, v) in value.iter().enumerate() {
            w[b + 5 + i].store(*v, Relaxed);
        }
        w[b].store((seq | 1) + 1, Release);
    }

    fn write_meta(&self, group: usize) {
        let over = self.overflow.get(&group).map_or(0, Vec::len) as u64;
        let m = (over.min(u64::from(u32::MAX)) << 32) | u64::from(self.moves[group]);
        self.words[HEADER_WORDS + group].store(m, Release);
    }

    /// Sets `key`'s value (places it, or queues it when its group is full).
    pub fn set(&mut self, ns: u64, key: u128, value: [u64; VALUE_WORDS]) {
        if let Some(&i) = self.placed.get(&(ns, key)) {
            return self.write_entry(i, true, ns, key, value);
        }
        let g = group_of(ns, key, self.groups);
        if let Some(list) = self.overflow.get_mut(&g)
            && let Some(slot) = list.iter_mut().find(|(k, _)| *k == (ns, key))
        {
            slot.1 = value;
            return;
        }
        match (g * GROUP_ENTRIES..(g + 1) * GROUP_ENTRIES).find(|&i| !self.used[i]) {
            Some(i) => {
                self.used[i] = true;
                self.placed.insert((ns, key), i);
                self.write_entry(i, true, ns, key, value);
            }
            None => {
                self.overflow.entry(g).or_default().push(((ns, key), value));
                self.write_meta(g);
            }
        }
    }

    /// Removes `key` (a key waiting in its group's overflow takes its place).
    pub fn remove(&mut self, ns: u64, key: u128) {
        let g = group_of(ns, key, self.groups);
        if let Some(i) = self.placed.remove(&(ns, key)) {
            match self.overflow.get_mut(&g).and_then(Vec::pop) {
                Some(((ons, okey), v)) => {
                    // The moved key is written before the group's meta says
                    // so: a reader that scanned before the move retries.
                    self.placed.insert((ons, okey), i);
                    self.write_entry(i, true, ons, okey, v);
                    self.moves[g] = self.moves[g].wrapping_add(1);
                    if self.overflow.get(&g).is_some_and(Vec::is_empty) {
                        self.overflow.remove(&g);
                    }
                    self.write_meta(g);
                }
                None => {
                    self.used[i] = false;
                    self.write_entry(i, false, 0, 0, [0; VALUE_WORDS]);
                }
            }
            return;
        }
        if let Some(list) = self.overflow.get_mut(&g) {
            list.retain(|(k, _)| *k != (ns, key));
            if list.is_empty() {
                self.overflow.remove(&g);
            }
            self.write_meta(g);
        }
    }

    /// Removes every key.
    pub fn clear(&mut self) {
        let keys: Vec<(u64, u128)> = self.placed.keys().copied().collect();
        self.overflow.clear();
        for (ns, key) in keys {
            self.remove(ns, key);
        }
        for g in 0..self.groups {
            self.moves[g] = self.moves[g].wrapping_add(1);
            self.write_meta(g);
        }
    }
}

/// A reader of a table another process writes.
pub struct TableReader<'a> {
    words: &'a [AtomicU64],
    groups: usize,
}

impl<'a> TableReader<'a> {
    /// A reader of `words`; `None` when they hold no table (too short, or
    /// no magic word).
    pub fn new(words: &'a [AtomicU64]) -> Option<TableReader<'a>> {
        let groups = groups_in(words.len());
        (groups > 0 && words[0].load(Acquire) == TABLE_MAGIC).then_some(TableReader { words, groups })
    }

    /// The header, read whole; `None` when it changed under every try.
    pub fn header(&self) -> Option<Header> {
        let w = self.words;
        for _ in 0..READ_TRIES {
            let s1 = w[1].load(Acquire);
            if s1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let node = w[2].load(Relaxed);
            let incarnation = w[3].load(Relaxed);
            let epoch = w[4].load(Relaxed);
            let ready = w[5].load(Relaxed);
            fence(Acquire);
            if w[1].load(Relaxed) == s1 {
                let node = u32::try_from(node).ok()?;
                return Some(Header { node, incarnation, epoch, ready: ready == 1 });
            }
        }
        None
    }

    /// What the table says of `key` now.
    pub fn get(&self, ns: u64, key: u128) -> Probe {
        let g = group_of(ns, key, self.groups);
        let meta = &self.words[HEADER_WORDS + g];
        'tries: for _ in 0..READ_TRIES {
            let m1 = meta.load(Acquire);
            for i in g * GROUP_ENTRIES..(g + 1) * GROUP_ENTRIES {
                let b = HEADER_WORDS + meta_words(self.groups) + i * ENTRY_WORDS;
                let w = &self.words[b..b + ENTRY_WORDS];
                let s1 = w[0].load(Acquire);
                if s1 & 1 == 1 {
                    std::hint::spin_loop();
                    continue 'tries;
                }
                let used = w[1].load(Relaxed);
                let e_ns = w[2].load(Relaxed);
                let lo = w[3].load(Relaxed);
                let hi = w[4].load(Relaxed);
                let value = [w[5].load(Relaxed), w[6].load(Relaxed), w[7].load(Relaxed)];
                fence(Acquire);
                if w[0].load(Relaxed) != s1 {
                    continue 'tries;
                }
                if used == 1 && e_ns == ns && (u128::from(hi) << 64 | u128::from(lo)) == key {
                    return Probe::Found(value);
                }
            }
            fence(Acquire);
            let m2 = meta.load(Relaxed);
            if m1 != m2 {
                continue;
            }
            return if m1 >> 32 == 0 { Probe::Absent } else { Probe::Unknown };
        }
        Probe::Unknown
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn region(groups: usize) -> Vec<AtomicU64> {
        (0..table_words(groups)).map(|_| AtomicU64::new(0)).collect()
    }

    /// Words a writer and readers share (as two processes share a mapping).
    struct Shared(Arc<Vec<AtomicU64>>);
    impl std::ops::Deref for Shared {
        type Target = [AtomicU64];
        fn deref(&self) -> &[AtomicU64] {
            &self.0
        }
    }

    fn shared(groups: usize) -> (Arc<Vec<AtomicU64>>, TableWriter<Shared>) {
        let words = Arc::new(region(groups));
        let w = TableWriter::new(Shared(Arc::clone(&words))).unwrap();
        (words, w)
    }

    #[test]
    fn the_shape_comes_from_the_length() {
        for g in [1, 2, 7, 8, 9, 100, 1000] {
            assert_eq!(groups_in(table_words(g)), g);
            assert_eq!(groups_in(table_words(g) + 5), g);
        }
        assert!(TableWriter::new(region(0)).is_err());
        let short: Vec<AtomicU64> = (0..10).map(|_| AtomicU64::new(0)).collect();
        assert!(TableReader::new(&short).is_none());
        let blank = region(4);
        assert!(TableReader::new(&blank).is_none(), "no magic, no table");
    }

    #[test]
    fn set_get_remove_header() {
        let (words, mut w) = shared(16);
        let r = TableReader::new(&words).unwrap();
        assert_eq!(r.groups, 16);
        assert_eq!(r.header(), Some(Header { node: 0, incarnation: 0, epoch: 0, ready: false }));
        w.set_header(Header { node: 3, incarnation: 9, epoch: 12, ready: true });
        for k in 0..50u128 {
            w.set(7, k << 70 | k, [k as u64, 1, 2]);
        }
        w.set(7, 3 << 70 | 3, [333, 1, 2]);
        w.remove(7, 5 << 70 | 5);
        assert_eq!(r.header(), Some(Header { node: 3, incarnation: 9, epoch: 12, ready: true }));
        for k in 0..50u128 {
            let want = match k {
                3 => Probe::Found([333, 1, 2]),
                5 => Probe::Absent,
                _ => Probe::Found([k as u64, 1, 2]),
            };
            assert_eq!(r.get(7, k << 70 | k), want, "key {k}");
        }
        assert_eq!(r.get(8, 1 << 70 | 1), Probe::Absent, "another namespace");
        w.clear();
        assert!((0..50u128).all(|k| r.get(7, k << 70 | k) == Probe::Absent));
    }

    /// A full group sends later keys to the overflow: they read as
    /// unknown (never absent) until a removal makes room, then as found.
    #[test]
    fn a_full_group_says_unknown_not_absent() {
        let (words, mut w) = shared(1);
        let r = TableReader::new(&words).unwrap();
        let n = GROUP_ENTRIES as u128 + 3;
        for k in 0..n {
            w.set(1, k, [k as u64, 0, 0]);
        }
        assert_eq!((w.placed(), w.overflowed()), (GROUP_ENTRIES, 3));
        let unknown: Vec<u128> = (0..n).filter(|&k| r.get(1, k) == Probe::Unknown).collect();
        assert_eq!(unknown.len(), 3);
        assert_eq!(r.get(1, 1000), Probe::Unknown, "a missing key of an overflowed group");
        // Updating a queued key keeps it queued, with its new value.
        w.set(1, unknown[0], [77, 0, 0]);
        assert_eq!(r.get(1, unknown[0]), Probe::Unknown);
        // Removing a queued key takes it off the queue.
        w.remove(1, unknown[2]);
        assert_eq!(w.overflowed(), 2);
        for _ in 0..2 {
            let placed = (0..n).find(|&k| matches!(r.get(1, k), Probe::Found(_))).unwrap();
            w.remove(1, placed);
        }
        assert_eq!(w.overflowed(), 0);
        assert_eq!(r.get(1, unknown[0]), Probe::Found([77, 0, 0]));
        assert_eq!(r.get(1, unknown[1]), Probe::Found([unknown[1] as u64, 0, 0]));
        assert_eq!(r.get(1, unknown[2]), Probe::Absent);
        assert_eq!(r.get(1, 1000), Probe::Absent);
    }

    /// A reader racing the writer never sees a torn entry (each value it
    /// finds was written whole: its three words equal), and never calls
    /// absent a key the writer never removes, though keys move in and out
    /// of the overflow all the time (20 keys, 16 entries).
    #[test]
    fn readers_racing_the_writer_see_whole_entries() {
        let (words, mut w) = shared(2);
        for k in 0..20u128 {
            w.set(1, k, [0, 0, 0]);
        }
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (words, stop) = (Arc::clone(&words), Arc::clone(&stop));
            std::thread::spawn(move || {
                let r = TableReader::new(&words).unwrap();
                let (mut found, mut unknown) = (0u64, 0u64);
                while !stop.load(Relaxed) {
                    for k in 0..20u128 {
                        match r.get(1, k) {
                            Probe::Found([a, b, c]) => {
                                assert!(a == b && b == c, "torn entry of key {k}: {a} {b} {c}");
                                found += 1;
                            }
                            Probe::Absent => assert!(k >= 10, "key {k} is never removed"),
                            Probe::Unknown => unknown += 1,
                        }
                    }
                }
                (found, unknown)
            })
        };
        for round in 1..300_000u64 {
            let k = u128::from(round % 20);
            if k >= 10 && round % 3 == 0 {
                w.remove(1, k);
            } else {
                w.set(1, k, [round, round, round]);
            }
        }
        stop.store(true, Relaxed);
        let (found, unknown) = reader.join().unwrap();
        assert!(found > 1000, "the reader read ({found} found, {unknown} unknown)");
    }
}
