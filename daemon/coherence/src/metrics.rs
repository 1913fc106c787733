//! Counters the core keeps for the daemon to export.

/// Sub-buckets per power of two in [`Histogram`].
pub const HISTOGRAM_SUB_BUCKETS: usize = 16;
/// Buckets of a [`Histogram`] (values up to 2^40 us).
pub const HISTOGRAM_BUCKETS: usize = 40 * HISTOGRAM_SUB_BUCKETS;

/// A histogram of microsecond latencies with buckets of 1/16 of a power of
/// two (HDR-style: about 6% resolution at every scale). Bucket
/// `e * 16 + s` holds values in `[2^e * (16 + s) / 16, 2^e * (17 + s) / 16)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Histogram {
    /// Counts per bucket.
    pub buckets: Vec<u64>,
    /// Number of samples.
    pub count: u64,
    /// Largest sample.
    pub max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { buckets: vec![0; HISTOGRAM_BUCKETS], count: 0, max: 0 }
    }
}

/// The bucket holding `v`.
pub fn histogram_bucket(v: u64) -> usize {
    let v = v.max(1);
    let e = 63 - v.leading_zeros() as usize;
    let sub = if e >= 4 { (v >> (e - 4)) as usize & 15 } else { (v << (4 - e)) as usize & 15 };
    (e * HISTOGRAM_SUB_BUCKETS + sub).min(HISTOGRAM_BUCKETS - 1)
}

/// Smallest value above bucket `i` (its exclusive upper bound).
pub fn histogram_bucket_end(i: usize) -> u64 {
    let (e, s) = (i / HISTOGRAM_SUB_BUCKETS, i % HISTOGRAM_SUB_BUCKETS);
    let end = ((1u128 << e) * (17 + s as u128)).div_ceil(16);
    end.min(u64::MAX as u128) as u64
}

/// Upper bound of quantile `q` (0..=1) of bucket counts laid out like
/// [`Histogram::buckets`] (for histograms merged from several nodes).
pub fn quantile_of_buckets(buckets: &[u64], q: f64) -> u64 {
    let total: u64 = buckets.iter().sum();
    if total == 0 {
        return 0;
    }
    let target = ((total as f64) * q).ceil().max(1.0) as u64;
    let mut seen = 0;
    for (i, &c) in buckets.iter().enumerate() {
        seen += c;
        if seen >= target {
            return histogram_bucket_end(i);
        }
    }
    u64::MAX
}

impl Histogram {
    /// Adds a sample.
    pub fn record(&mut self, v: u64) {
        self.buckets[histogram_bucket(v)] += 1;
        self.count += 1;
        self.max = self.max.max(v);
    }

    /// Upper bound of the bucket holding quantile `q` (0..=1), at most the
    /// largest sample.
    pub fn quantile_upper_bound(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        quantile_of_buckets(&self.buckets, q).min(self.max.max(1))
    }
}

/// What the core counts.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    /// Batches sent.
    pub batches_sent: u64,
    /// Messages sent (entries in batches).
    pub msgs_sent: u64,
    /// Invalidate messages sent (including retransmissions).
    pub invalidates_sent: u64,
    /// Acks sent.
    pub acks_sent: u64,
    /// Batches that carried at least one ack.
    pub ack_batches_sent: u64,
    /// Batches dropped for a stale or unknown epoch or incarnation.
    pub stale_epoch_drops: u64,
    /// Transfers whose slot image did not match the grant.
    pub validation_failures: u64,
    /// Transfers that finished after the grant could no longer be trusted.
    pub late_transfers: u64,
    /// Acks that did not count (duplicate or stale).
    pub ignored_acks: u64,
    /// Grants given and not yet released or expired.
    pub grants_outstanding: u64,
    /// Home: invalidate -> ack latency (home clock).
    pub inval_to_ack_us: Histogram,
    /// Overwrites and invalidations completed at this home.
    pub changes_completed: u64,
    /// Reads this home granted of its own copy in answer to a locate (one
    /// round trip saved each).
    pub locate_grants: u64,
    /// Home: readers registered as pending holders when it answered their
    /// locate (`Config::register_at_locate`).
    pub pending_registrations: u64,
    /// Reader: fetched copies made Valid on their locate-time registration,
    /// without waiting for the home (one round trip saved each).
    pub early_registrations: u64,
    /// Keepalive acknowledgements dropped because this node never sent a
    /// keepalive at the echoed time (forged, or from a previous life).
    pub unsolicited_keepalive_acks: u64,
    /// Peer message values refused as impossible for an honest node (a
    /// version of a later epoch, an announce part beyond its count...).
    pub peer_refusals: u64,
    /// Changes refused because the epoch had no version left.
    pub versions_exhausted: u64,
    /// Times this node's membership lease lapsed while it held copies (it
    /// dropped them all: cache misses, never stale data).
    pub lease_lapses: u64,
    /// Copies dropped that way.
    pub copies_dropped_lapsed: u64,
    /// Cluster-wide lookups started here.
    pub lookups: u64,
    /// Lookups that ended before every home answered (deadline, view
    /// change, leave): the keys not answered were reported absent.
    pub lookups_incomplete: u64,
    /// Home: lookup questions answered (one per asker per lookup).
    pub lookup_questions_answered: u64,
    /// Of `lookups`, those answered from the homes' lookup tables, read
    /// one-sided ([`crate::Node::lookup_tables`]).
    pub lookups_one_sided: u64,
    /// Lookups from the homes' tables that could not answer every key (a
    /// table unreadable, of another view, or changing under every try).
    pub lookup_table_fallbacks: u64,
}

impl Metrics {
    /// Average messages per batch.
    pub fn batching_factor(&self) -> f64 {
        if self.batches_sent == 0 { 0.0 } else { self.msgs_sent as f64 / self.batches_sent as f64 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_bound_samples() {
        let mut h = Histogram::default();
        for v in 1..=1000u64 {
            h.record(v);
        }
        assert_eq!(h.count, 1000);
        let p50 = h.quantile_upper_bound(0.5);
        assert!((500..=532).contains(&p50), "p50 bound {p50}");
        assert_eq!(h.quantile_upper_bound(1.0), 1000);
    }

    #[test]
    fn buckets_cover_every_value_in_order() {
        let mut last = 0;
        for v in (1..5000u64).chain([1 << 20, (1 << 20) + 1, 5_000_000, u64::MAX >> 30]) {
            let b = histogram_bucket(v);
            assert!(b >= last || v > 5000, "bucket order broke at {v}");
            last = b;
            assert!(histogram_bucket_end(b) > v, "value {v} not below the end of its bucket {b}");
            if b > 0 {
                assert!(histogram_bucket_end(b - 1) <= v, "value {v} belongs to an earlier bucket");
            }
            // About 6% resolution.
            assert!(histogram_bucket_end(b) as f64 <= v as f64 * 1.0625 + 1.0, "bucket of {v} too wide");
        }
    }
}
