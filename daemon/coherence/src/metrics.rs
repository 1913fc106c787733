//! Counters the core keeps for the daemon to export.

/// A log2-bucketed histogram of microsecond latencies (bucket i counts
/// values in [2^i, 2^(i+1))).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Histogram {
    /// Counts per bucket.
    pub buckets: [u64; 40],
    /// Number of samples.
    pub count: u64,
    /// Largest sample.
    pub max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { buckets: [0; 40], count: 0, max: 0 }
    }
}

impl Histogram {
    /// Adds a sample.
    pub fn record(&mut self, v: u64) {
        let b = (64 - v.max(1).leading_zeros() - 1) as usize;
        self.buckets[b.min(39)] += 1;
        self.count += 1;
        self.max = self.max.max(v);
    }

    /// Upper bound of the bucket holding quantile `q` (0..=1).
    pub fn quantile_upper_bound(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let target = ((self.count as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, &c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= target {
                return (1u64 << (i + 1)).min(self.max.max(1));
            }
        }
        self.max
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
        assert!(h.quantile_upper_bound(0.5) >= 500 && h.quantile_upper_bound(0.5) <= 1024);
        assert_eq!(h.quantile_upper_bound(1.0), 1000);
    }
}
