//! The history of a `kvmesh-nemesis` run and the checker that judges it
//! afterwards (issue 17).
//!
//! Every operation is recorded with its start and end, in microseconds
//! since the start of the run, taken from one monotonic clock in the
//! process that issued it: a start is read before the call is sent, an end
//! after its answer arrived, so `a.end < b.start` means `a` was answered
//! before `b` was asked. The checker trusts nothing else: no order of
//! events inside the daemons, no clock of theirs.
//!
//! What it reports:
//! - **wrong bytes**: a block that is not exactly the content of its key at
//!   some sequence (the reader records it), or a version of a key that no
//!   put had started writing before the read ended (a version change no
//!   client call caused, S7);
//! - **stale reads**: a read that returned a version superseded before the
//!   read started — a later put of the key acknowledged (S7: an
//!   acknowledged put stays readable until a later call changes the key; a
//!   writer's puts of a key are sequential, so a higher sequence is a later
//!   call; an earlier put that was never answered does not excuse the read:
//!   a daemon refuses a second write of a key while one is in flight, and
//!   a write it gave up on frees its slot, so an abandoned put cannot
//!   become readable after a later one was acknowledged), or an
//!   acknowledged invalidation of the namespace that began after every put
//!   of that version had been answered (S2);
//! - **lost puts**: acknowledged puts that a read started after their
//!   acknowledgement found replaced by an older version (each put counted
//!   once: the stale reads that come from overwrites, by the put they lost);
//! - **availability**: the share of reads that got data, per kind of fault
//!   in effect when they started, and in quiet periods.
//!
//! Misses and errors are never violations: a cache may miss, and a daemon
//! that is cut off or lost its lease refuses.

use std::collections::{BTreeMap, HashMap, HashSet};

/// Microseconds since the start of a run (a run lasts at most 71 minutes).
pub type Us = u32;

/// What a read of one key returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The block, exactly the content of its key at this sequence.
    Hit(u32),
    /// Not cached (anywhere the daemon could see).
    Miss,
    /// The call failed or timed out.
    Error,
    /// Bytes that are not the content of the key at any sequence; the
    /// detail is in [`History::wrong`].
    Wrong,
}

const MISS: u32 = u32::MAX;
const ERROR: u32 = u32::MAX - 1;
const WRONG: u32 = u32::MAX - 2;

/// One key of one read (20 bytes: a ten-minute run records ten million).
#[derive(Clone, Copy, Debug)]
pub struct Read {
    /// The daemon asked.
    pub node: u16,
    /// Index of the key in the run's key list.
    pub key: u32,
    /// When the call was sent.
    pub start: Us,
    /// When its answer arrived.
    pub end: Us,
    outcome: u32,
}

impl Read {
    /// A read of `key` on `node`.
    pub fn new(node: u16, key: u32, start: Us, end: Us, outcome: Outcome) -> Read {
        let outcome = match outcome {
            Outcome::Hit(s) => {
                assert!(s < WRONG, "sequence {s} out of range");
                s
            }
            Outcome::Miss => MISS,
            Outcome::Error => ERROR,
            Outcome::Wrong => WRONG,
        };
        Read { node, key, start, end, outcome }
    }

    /// What it returned.
    pub fn outcome(&self) -> Outcome {
        match self.outcome {
            MISS => Outcome::Miss,
            ERROR => Outcome::Error,
            WRONG => Outcome::Wrong,
            s => Outcome::Hit(s),
        }
    }
}

/// How a put was answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Committed, acknowledged at this time.
    Acked(Us),
    /// Refused or lost (the daemon says: not stored), answered at this time:
    /// whatever it did, it did before then.
    Refused(Us),
    /// No answer (failed, timed out): it may land at any time after it began.
    Unknown,
}

/// One put of one key at one sequence.
#[derive(Clone, Copy, Debug)]
pub struct Put {
    /// The daemon it was sent to.
    pub node: u16,
    /// Index of the key.
    pub key: u32,
    /// The sequence its content was derived from.
    pub seq: u32,
    /// When its allocation was asked.
    pub start: Us,
    /// Its answer.
    pub answer: Answer,
}

impl Put {
    /// When its commit was acknowledged.
    pub fn acked(&self) -> Option<Us> {
        match self.answer {
            Answer::Acked(t) => Some(t),
            _ => None,
        }
    }
    /// When it was answered either way (nothing of it happens later).
    pub fn settled(&self) -> Option<Us> {
        match self.answer {
            Answer::Acked(t) | Answer::Refused(t) => Some(t),
            Answer::Unknown => None,
        }
    }
}

/// An invalidation of the whole namespace.
#[derive(Clone, Copy, Debug)]
pub struct Invalidation {
    /// The daemon it was sent to.
    pub node: u16,
    /// When it was sent.
    pub start: Us,
    /// When it was answered with every key invalidated; `None` when it
    /// failed (some keys may have been invalidated, some not).
    pub acked: Option<Us>,
}

/// A fault in effect from `start` to `end`.
#[derive(Clone, Debug)]
pub struct Fault {
    /// Its kind (`cut-off`, `split`, `pause`, ...).
    pub kind: String,
    /// When it began.
    pub start: Us,
    /// When it was healed.
    pub end: Us,
}

/// Everything a run did.
#[derive(Clone, Debug, Default)]
pub struct History {
    /// Names of the keys, by index (for the report).
    pub key_names: Vec<String>,
    /// Every key of every read.
    pub reads: Vec<Read>,
    /// Every put.
    pub puts: Vec<Put>,
    /// Every namespace invalidation.
    pub invalidations: Vec<Invalidation>,
    /// Every fault.
    pub faults: Vec<Fault>,
    /// Why each `Outcome::Wrong` read was wrong, by its index in `reads`.
    pub wrong: HashMap<usize, String>,
}

/// One offending read, for the report.
#[derive(Clone, Debug)]
pub struct Offence {
    /// What is wrong, in words.
    pub what: String,
    /// When the read started.
    pub start: Us,
    /// When it ended.
    pub end: Us,
    /// The key read (index).
    pub key: u32,
    /// The daemon asked.
    pub node: u16,
}

/// Reads and reads that got data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Served {
    /// Keys read.
    pub reads: u64,
    /// Keys that came back with data.
    pub hits: u64,
}

impl Served {
    /// Share of reads that got data (`None` without reads).
    pub fn share(&self) -> Option<f64> {
        (self.reads > 0).then(|| self.hits as f64 / self.reads as f64)
    }
}

/// What the checker found.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Keys read.
    pub reads: u64,
    /// Keys read with data, every byte checked.
    pub hits: u64,
    /// Keys not found.
    pub misses: u64,
    /// Keys whose call failed.
    pub errors: u64,
    /// Wrong content, or a version no put wrote.
    pub wrong_bytes: u64,
    /// Reads of a version superseded before they started.
    pub stale_reads: u64,
    /// Acknowledged puts a later read found replaced by an older version.
    pub lost_puts: u64,
    /// The earliest offences (at most 20), by start.
    pub offences: Vec<Offence>,
    /// Availability per kind of fault in effect when a read started, and
    /// `quiet` for reads outside every fault.
    pub availability: BTreeMap<String, Served>,
}

impl Report {
    /// No wrong bytes, no stale reads, no lost puts.
    pub fn clean(&self) -> bool {
        self.wrong_bytes == 0 && self.stale_reads == 0 && self.lost_puts == 0
    }

    fn offend(&mut self, what: String, r: &Read) {
        // Reads come reader by reader: keep more than shown, then the
        // earliest (bounded: a planted bug makes tens of thousands).
        if self.offences.len() < 10_000 {
            self.offences.push(Offence { what, start: r.start, end: r.end, key: r.key, node: r.node });
        }
    }
}

/// Acknowledged puts of one key: (acknowledged at, sequence), sorted by
/// the time, with the highest sequence acknowledged up to each entry.
struct AckedPuts {
    at: Vec<Us>,
    max_seq: Vec<u32>,
}

impl AckedPuts {
    /// Highest sequence acknowledged strictly before `t`.
    fn before(&self, t: Us) -> Option<u32> {
        let n = self.at.partition_point(|&a| a < t);
        (n > 0).then(|| self.max_seq[n - 1])
    }
}

/// Everything the history holds about `key` from `from` to `to`: its puts
/// and invalidations, and its reads on every daemon, one per line (for
/// diagnosing an offence).
pub fn story(h: &History, key: u32, from: Us, to: Us) -> String {
    use std::fmt::Write;
    let mut lines: Vec<(Us, String)> = Vec::new();
    let s = |t: Us| format!("{:.6}", t as f64 / 1e6);
    for p in h.puts.iter().filter(|p| p.key == key && p.start <= to && p.settled().is_none_or(|e| e >= from)) {
        lines.push((p.start, format!("{} put seq {} on node {} -> {:?}", s(p.start), p.seq, p.node, p.answer)));
    }
    for i in h.invalidations.iter().filter(|i| i.start <= to && i.acked.is_none_or(|e| e >= from)) {
        lines.push((i.start, format!("{} namespace invalidation on node {} -> {:?}", s(i.start), i.node, i.acked)));
    }
    for r in h.reads.iter().filter(|r| r.key == key && r.start <= to && r.end >= from) {
        lines.push((
            r.start,
            format!("{} read on node {} -> {:?} (ended {})", s(r.start), r.node, r.outcome(), s(r.end)),
        ));
    }
    lines.sort_by_key(|l| l.0);
    let mut out = String::new();
    for (_, l) in lines {
        let _ = writeln!(out, "{l}");
    }
    out
}

/// Judges a history. Pure: the same history, the same report.
pub fn check(h: &History) -> Report {
    let mut rep = Report::default();
    let name = |k: u32| h.key_names.get(k as usize).cloned().unwrap_or_else(|| format!("key #{k}"));

    // Per key: the acknowledged puts by time, and every put by sequence.
    let mut acked: HashMap<u32, Vec<(Us, u32)>> = HashMap::new();
    let mut by_version: HashMap<(u32, u32), Vec<&Put>> = HashMap::new();
    for p in &h.puts {
        if let Some(a) = p.acked() {
            acked.entry(p.key).or_default().push((a, p.seq));
        }
        by_version.entry((p.key, p.seq)).or_default().push(p);
    }
    let acked: HashMap<u32, AckedPuts> = acked
        .into_iter()
        .map(|(k, mut v)| {
            v.sort_unstable();
            let mut m = 0;
            let max_seq = v
                .iter()
                .map(|&(_, s)| {
                    m = m.max(s);
                    m
                })
                .collect();
            (k, AckedPuts { at: v.iter().map(|&(a, _)| a).collect(), max_seq })
        })
        .collect();

    // Acknowledged invalidations by the time of their acknowledgement,
    // with the latest start among them up to each entry: a version whose
    // put was acknowledged before that start was invalidated.
    let mut inv: Vec<(Us, Us)> = h.invalidations.iter().filter_map(|i| Some((i.acked?, i.start))).collect();
    inv.sort_unstable();
    let mut latest = 0;
    let inv_latest_start: Vec<Us> = inv
        .iter()
        .map(|&(_, s)| {
            latest = latest.max(s);
            latest
        })
        .collect();
    let invalidated_before = |t: Us| -> Option<Us> {
        let n = inv.partition_point(|&(a, _)| a < t);
        (n > 0).then(|| inv_latest_start[n - 1])
    };

    let mut faults: Vec<&Fault> = h.faults.iter().collect();
    faults.sort_by_key(|f| f.start);

    let mut lost: HashSet<(u32, u32)> = HashSet::new();
    for (i, r) in h.reads.iter().enumerate() {
        rep.reads += 1;
        // Availability: the fault in effect when the read started.
        let n = faults.partition_point(|f| f.start <= r.start);
        let kind = faults[..n].iter().rev().find(|f| f.end >= r.start).map(|f| f.kind.as_str()).unwrap_or("quiet");
        let served = rep.availability.entry(kind.to_string()).or_default();
        served.reads += 1;
        let seq = match r.outcome() {
            Outcome::Miss => {
                rep.misses += 1;
                continue;
            }
            Outcome::Error => {
                rep.errors += 1;
                continue;
            }
            Outcome::Wrong => {
                served.hits += 1;
                rep.hits += 1;
                rep.wrong_bytes += 1;
                let why = h.wrong.get(&i).cloned().unwrap_or_else(|| "bytes of no version".into());
                rep.offend(format!("wrong bytes from node {}: {why}", r.node), r);
                continue;
            }
            Outcome::Hit(s) => s,
        };
        served.hits += 1;
        rep.hits += 1;
        // Some put of this version must have started before the read ended.
        let versions: &[&Put] = by_version.get(&(r.key, seq)).map(Vec::as_slice).unwrap_or(&[]);
        let writers = versions.iter().filter(|p| p.start <= r.end);
        if writers.clone().next().is_none() {
            rep.wrong_bytes += 1;
            rep.offend(
                format!("node {} returned {} at sequence {seq}, which no put had started writing", r.node, name(r.key)),
                r,
            );
            continue;
        }
        // Overwritten before the read started?
        if let Some(floor) = acked.get(&r.key).and_then(|a| a.before(r.start))
            && seq < floor
        {
            rep.stale_reads += 1;
            if lost.insert((r.key, floor)) {
                rep.lost_puts += 1;
            }
            let what = format!(
                "stale read from node {}: {} at sequence {seq}, the put of sequence {floor} was acknowledged \
                 before it started",
                r.node,
                name(r.key)
            );
            rep.offend(what, r);
            continue;
        }
        // Invalidated before the read started? Only if every put of this
        // version was answered before an invalidation began that was itself
        // acknowledged before the read started (a put never answered may
        // have landed after it).
        if let Some(inv_start) = invalidated_before(r.start)
            && writers.clone().all(|p| p.settled().is_some_and(|a| a < inv_start))
        {
            rep.stale_reads += 1;
            let what = format!(
                "stale read from node {}: {} at sequence {seq}, invalidated by the namespace invalidation sent \
                 at {:.3} s and acknowledged before the read",
                r.node,
                name(r.key),
                inv_start as f64 / 1e6
            );
            rep.offend(what, r);
        }
    }
    rep.offences.sort_by_key(|o| (o.start, o.end));
    rep.offences.truncate(20);
    rep
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A clean history: key 0 overwritten 1 → 2 → 3, reads in between,
    /// key 1 an immutable block put twice, an invalidation with a put
    /// racing it, a fault, misses and errors.
    fn clean() -> History {
        let put = |key, seq, start, acked: Option<Us>| Put {
            node: 1,
            key,
            seq,
            start,
            answer: acked.map_or(Answer::Unknown, Answer::Acked),
        };
        let read = |key, start, end, o| Read::new(2, key, start, end, o);
        History {
            key_names: vec!["k0".into(), "k1".into()],
            puts: vec![
                put(0, 1, 10, Some(20)),
                put(0, 2, 30, Some(40)),
                put(1, 0, 5, Some(8)),
                put(1, 0, 90, Some(95)),
                // Acknowledged after the invalidation below began: survives it.
                put(0, 3, 60, Some(75)),
                // Never acknowledged: it may show up at any time after it began.
                put(0, 4, 200, None),
            ],
            invalidations: vec![Invalidation { node: 3, start: 70, acked: Some(80) }],
            faults: vec![Fault { kind: "pause".into(), start: 100, end: 150 }],
            reads: vec![
                read(0, 0, 9, Outcome::Miss),
                // Concurrent with the put of 1: either is fine.
                read(0, 15, 25, Outcome::Hit(1)),
                read(0, 21, 29, Outcome::Hit(1)),
                // Concurrent with the put of 2, still 1.
                read(0, 35, 45, Outcome::Hit(1)),
                read(0, 41, 50, Outcome::Hit(2)),
                // After the invalidation: 3 was acknowledged after it began.
                read(0, 85, 90, Outcome::Hit(3)),
                // Key 1's first version, read while the invalidation was
                // still going on.
                read(1, 75, 84, Outcome::Hit(0)),
                // Key 1 re-put after the invalidation.
                read(1, 96, 99, Outcome::Hit(0)),
                read(1, 110, 120, Outcome::Error),
                read(1, 130, 140, Outcome::Hit(0)),
                // The unacknowledged put of 4 landed.
                read(0, 250, 260, Outcome::Hit(4)),
            ],
            wrong: HashMap::new(),
        }
    }

    #[test]
    fn a_clean_history_is_clean() {
        let r = check(&clean());
        assert!(r.clean(), "{:?}", r.offences);
        assert_eq!((r.reads, r.hits, r.misses, r.errors), (11, 9, 1, 1));
        assert_eq!(r.availability["pause"], Served { reads: 2, hits: 1 });
        assert_eq!(r.availability["quiet"], Served { reads: 9, hits: 8 });
    }

    #[test]
    fn a_stale_read_after_an_overwrite_is_a_lost_put() {
        let mut h = clean();
        h.reads.push(Read::new(4, 0, 41, 50, Outcome::Hit(1)));
        h.reads.push(Read::new(5, 0, 42, 50, Outcome::Hit(1)));
        let r = check(&h);
        assert_eq!((r.stale_reads, r.lost_puts, r.wrong_bytes), (2, 1, 0), "two reads, one lost put");
        assert!(r.offences[0].what.contains("sequence 2 was acknowledged"), "{}", r.offences[0].what);
        assert_eq!((r.offences[0].start, r.offences[0].end), (41, 50));
    }

    #[test]
    fn a_read_of_an_invalidated_version_is_stale() {
        let mut h = clean();
        // Key 1's first put was acknowledged at 8, before the invalidation
        // began (70); a read that started after the invalidation was
        // acknowledged (80), and ended before the second put began, got it.
        h.reads.push(Read::new(4, 1, 81, 84, Outcome::Hit(0)));
        // Once the second put began, the same content may be its.
        h.reads.push(Read::new(4, 1, 100, 104, Outcome::Hit(0)));
        let r = check(&h);
        assert_eq!((r.stale_reads, r.lost_puts), (1, 0));
        assert!(r.offences[0].what.contains("invalidation"), "{}", r.offences[0].what);
        // A failed invalidation proves nothing.
        h.invalidations[0].acked = None;
        assert!(check(&h).clean());
    }

    #[test]
    fn a_refused_put_answered_before_an_invalidation_is_covered_by_it() {
        let mut h = clean();
        // Another put of key 1 refused at 60 (the daemon says: not stored;
        // if it was, it was before 60), the first acknowledged at 8: both
        // before the invalidation began at 70.
        h.puts.push(Put { node: 1, key: 1, seq: 0, start: 50, answer: Answer::Refused(60) });
        let last = h.puts.len() - 1;
        h.reads.push(Read::new(4, 1, 81, 84, Outcome::Hit(0)));
        assert_eq!(check(&h).stale_reads, 1);
        // Unanswered, it may have landed after the invalidation: no offence.
        h.puts[last].answer = Answer::Unknown;
        assert!(check(&h).clean());
        // Refused after the invalidation began: may have landed after it.
        h.puts[last].answer = Answer::Refused(72);
        assert!(check(&h).clean());
    }

    #[test]
    fn the_story_of_a_key_tells_its_puts_and_reads_in_order() {
        let t = story(&clean(), 1, 0, 100);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 5, "{t}");
        assert!(lines[0].contains("put seq 0 on node 1 -> Acked(8)"), "{t}");
        assert!(lines[1].contains("namespace invalidation on node 3"), "{t}");
        assert!(lines[2].contains("read on node 2 -> Hit(0)"), "{t}");
        assert!(!t.contains("seq 1 "), "only key 1: {t}");
    }

    #[test]
    fn overlapping_faults_count_a_read_once() {
        let mut h = clean();
        h.faults.push(Fault { kind: "cut-off".into(), start: 120, end: 200 });
        let r = check(&h);
        let total: u64 = r.availability.values().map(|s| s.reads).sum();
        assert_eq!(total, r.reads);
        // The read at 130 falls in both: counted under the later one.
        assert_eq!(r.availability["cut-off"], Served { reads: 1, hits: 1 });
        assert_eq!(r.availability["pause"], Served { reads: 1, hits: 0 });
    }

    #[test]
    fn wrong_bytes_and_versions_no_put_wrote_are_reported() {
        let mut h = clean();
        h.reads.push(Read::new(4, 0, 300, 310, Outcome::Wrong));
        h.wrong.insert(h.reads.len() - 1, "bytes differ from sequence 4".into());
        // Sequence 9 was never written; sequence 4 not before 200.
        h.reads.push(Read::new(4, 0, 300, 310, Outcome::Hit(9)));
        h.reads.push(Read::new(4, 0, 100, 150, Outcome::Hit(4)));
        let r = check(&h);
        assert_eq!((r.wrong_bytes, r.stale_reads), (3, 0));
        // Earliest first.
        assert!(r.offences[0].what.contains("no put had started"), "{}", r.offences[0].what);
        assert!(r.offences[1].what.contains("bytes differ"), "{}", r.offences[1].what);
        assert!(r.offences[2].what.contains("sequence 9"), "{}", r.offences[2].what);
    }

    #[test]
    fn a_read_that_starts_in_the_microsecond_of_an_acknowledgement_is_not_stale() {
        // Same microsecond: not strictly before, so not known to the reader.
        let mut h = clean();
        h.reads.push(Read::new(4, 0, 40, 41, Outcome::Hit(1)));
        assert!(check(&h).clean());
        h.reads.push(Read::new(4, 0, 41, 42, Outcome::Hit(1)));
        assert_eq!(check(&h).stale_reads, 1);
    }
}
