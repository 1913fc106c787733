//! Offline references for a replay, computed from the trace alone: the
//! prefix hits of a cache of infinite capacity (the ideal reuse) and of an
//! LRU cache holding as many blocks as the cluster's pools.
//!
//! A request hits the longest prefix of its blocks that is cached, then
//! every block of it is cached (the replay puts the missing ones). Requests
//! are taken in arrival order; the replay starts them in that order too, so
//! with one request at a time a block it finds was put by an earlier
//! request: per request, the replay can never hit more than the ideal
//! (counted as `above_ideal`, a bug then). Overlapping requests can: a
//! later one's put may land before an earlier one's pin.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::trace::Request;

/// Prefix hits per request of the ideal cache.
pub(crate) fn ideal(requests: &[Request]) -> Vec<u32> {
    let mut seen: HashSet<u64> = HashSet::new();
    requests
        .iter()
        .map(|r| {
            let hits = r.hash_ids.iter().take_while(|id| seen.contains(id)).count();
            seen.extend(r.hash_ids.iter().copied());
            hits as u32
        })
        .collect()
}

/// Prefix hits per request of an LRU cache of `capacity` blocks.
pub(crate) fn lru(requests: &[Request], capacity: usize) -> Vec<u32> {
    let mut stamp_of: HashMap<u64, u64> = HashMap::new();
    let mut by_stamp: BTreeMap<u64, u64> = BTreeMap::new();
    let mut clock = 0u64;
    requests
        .iter()
        .map(|r| {
            let hits = r.hash_ids.iter().take_while(|id| stamp_of.contains_key(id)).count();
            for &id in &r.hash_ids {
                clock += 1;
                if let Some(old) = stamp_of.insert(id, clock) {
                    by_stamp.remove(&old);
                }
                by_stamp.insert(clock, id);
            }
            while stamp_of.len() > capacity {
                let Some((_, victim)) = by_stamp.pop_first() else { break };
                stamp_of.remove(&victim);
            }
            hits as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ids: &[u64]) -> Request {
        Request { timestamp: 0, input_length: ids.len() as u64 * 512, output_length: 1, hash_ids: ids.to_vec() }
    }

    #[test]
    fn ideal_counts_cached_prefixes() {
        let t = [req(&[1, 2, 3]), req(&[1, 2, 4]), req(&[5, 2]), req(&[1, 2, 3, 6])];
        assert_eq!(ideal(&t), vec![0, 2, 0, 3]);
    }

    #[test]
    fn lru_forgets_the_least_recent_and_never_beats_the_ideal() {
        let t = [req(&[1, 2]), req(&[3, 4]), req(&[1, 2]), req(&[5, 6]), req(&[3, 4]), req(&[1, 2])];
        assert_eq!(lru(&t, 4), vec![0, 0, 2, 0, 0, 0]);
        assert_eq!(lru(&t, 6), vec![0, 0, 2, 0, 2, 2]);
        assert_eq!(lru(&t, 1000), ideal(&t));
        for cap in 0..8 {
            let l = lru(&t, cap);
            assert!(l.iter().zip(ideal(&t)).all(|(a, b)| *a <= b), "capacity {cap}");
        }
    }
}
