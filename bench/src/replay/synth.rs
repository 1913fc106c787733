//! Seeded synthetic request traces for `kvmesh-bench load`.
//!
//! Arrivals follow a Poisson process, Gamma-distributed bursts, or a
//! staircase of Poisson rates. Each request either opens a new session (an
//! optional shared system prompt plus Zipf-sized user tokens) or continues an
//! open session (the previous context plus its output plus new user tokens).
//! Block ids (`hash_ids`) form a prefix tree: requests share ids exactly for
//! the full blocks of a shared token prefix. The output depends only on the
//! config, seed included.

use anyhow::{Context, bail};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp, Gamma, Zipf};

use super::trace::Request;

/// Most sessions kept open at once; past this the oldest is closed.
const MAX_OPEN_SESSIONS: usize = 1024;

/// How requests arrive.
#[derive(Clone, Debug)]
pub(crate) enum Arrival {
    /// Poisson arrivals at `rate` requests per second.
    Poisson {
        /// Requests per second.
        rate: f64,
    },
    /// Bursts: gaps between arrivals Gamma-distributed (shape, scale in ms).
    Bursts {
        /// Gamma shape (small values give bursty traffic).
        shape: f64,
        /// Gamma scale, in ms.
        scale_ms: f64,
    },
    /// A staircase: Poisson arrivals at each rate (req/s) for `stair_secs`
    /// seconds, one stair after another.
    Stairs {
        /// Requests per second of each stair, in order.
        rates: Vec<f64>,
        /// Length of each stair, in seconds.
        stair_secs: f64,
    },
}

/// Parameters of a synthetic trace.
#[derive(Clone, Debug)]
pub(crate) struct SynthConfig {
    /// Seed of the random generator.
    pub(crate) seed: u64,
    /// Arrival process.
    pub(crate) arrival: Arrival,
    /// Stop after this many requests (None: only the duration bounds it).
    pub(crate) requests: Option<usize>,
    /// Stop at this many seconds of arrivals (ignored for Stairs, whose
    /// length is rates.len() * stair_secs).
    pub(crate) duration_s: f64,
    /// Tokens per block (hash_ids granularity), e.g. 512.
    pub(crate) block_tokens: u64,
    /// Zipf exponent of the new user tokens of a request, over
    /// [min_tokens, max_tokens].
    pub(crate) zipf_alpha: f64,
    /// Fewest new user tokens in a request.
    pub(crate) min_tokens: u64,
    /// Most new user tokens in a request.
    pub(crate) max_tokens: u64,
    /// Population of shared system prompts, each `system_prompt_tokens` long;
    /// a new session picks one (Zipf with the same alpha over the
    /// population, so a few are popular). 0: no system prompts.
    pub(crate) system_prompts: usize,
    /// Length of each system prompt, in tokens.
    pub(crate) system_prompt_tokens: u64,
    /// Probability that a request is the next turn of an existing open
    /// session rather than a new session.
    pub(crate) followup_prob: f64,
    /// Most turns per session (a session with this many turns is closed).
    pub(crate) max_turns: u32,
    /// Fewest output tokens per request (uniform in [output_min, output_max]).
    pub(crate) output_min: u64,
    /// Most output tokens per request.
    pub(crate) output_max: u64,
}

fn check_positive(name: &str, value: f64) -> anyhow::Result<()> {
    if !(value.is_finite() && value > 0.0) {
        bail!("{name} must be a finite number > 0 (got {value})");
    }
    Ok(())
}

impl SynthConfig {
    /// Checks that every parameter is in range, naming the offending option.
    pub(crate) fn validate(&self) -> anyhow::Result<()> {
        match &self.arrival {
            Arrival::Poisson { rate } => {
                check_positive("--rate", *rate)?;
                check_positive("--duration", self.duration_s)?;
            }
            Arrival::Bursts { shape, scale_ms } => {
                check_positive("--burst-shape", *shape)?;
                check_positive("--burst-scale-ms", *scale_ms)?;
                check_positive("--duration", self.duration_s)?;
            }
            Arrival::Stairs { rates, stair_secs } => {
                if rates.is_empty() {
                    bail!("--stairs needs at least one rate");
                }
                for rate in rates {
                    check_positive("--stairs (each rate)", *rate)?;
                }
                check_positive("--stair-secs", *stair_secs)?;
            }
        }
        if self.block_tokens == 0 {
            bail!("--block-tokens must be > 0");
        }
        check_positive("--zipf-alpha", self.zipf_alpha)?;
        if self.min_tokens == 0 {
            bail!("--min-tokens must be >= 1");
        }
        if self.min_tokens > self.max_tokens {
            bail!("--min-tokens ({}) must be <= --max-tokens ({})", self.min_tokens, self.max_tokens);
        }
        if self.system_prompts > 0 && self.system_prompt_tokens == 0 {
            bail!("--system-prompt-tokens must be > 0 when --system-prompts > 0");
        }
        if !(0.0..=1.0).contains(&self.followup_prob) {
            bail!("--followup-prob must be in [0, 1] (got {})", self.followup_prob);
        }
        if self.max_turns == 0 {
            bail!("--max-turns must be >= 1");
        }
        if self.output_min > self.output_max {
            bail!("--output-min ({}) must be <= --output-max ({})", self.output_min, self.output_max);
        }
        Ok(())
    }
}

/// Source of arrival times, in ms since the start of the trace.
enum Clock {
    Poisson { gap: Exp<f64>, end_ms: f64 },
    Bursts { gap: Gamma<f64>, end_ms: f64 },
    Stairs { gaps: Vec<Exp<f64>>, stair_ms: f64 },
}

struct Arrivals {
    clock: Clock,
    t_ms: f64,
    stair: usize,
}

impl Arrivals {
    fn new(cfg: &SynthConfig) -> anyhow::Result<Self> {
        let end_ms = cfg.duration_s * 1000.0;
        let clock = match &cfg.arrival {
            Arrival::Poisson { rate } => Clock::Poisson { gap: poisson_gap(*rate)?, end_ms },
            Arrival::Bursts { shape, scale_ms } => Clock::Bursts {
                gap: Gamma::new(*shape, *scale_ms).map_err(|e| anyhow::anyhow!("bad burst parameters: {e}"))?,
                end_ms,
            },
            Arrival::Stairs { rates, stair_secs } => Clock::Stairs {
                gaps: rates.iter().map(|rate| poisson_gap(*rate)).collect::<anyhow::Result<_>>()?,
                stair_ms: stair_secs * 1000.0,
            },
        };
        Ok(Self { clock, t_ms: 0.0, stair: 0 })
    }

    /// The next arrival time, or None once the trace's time is up.
    fn next_ms(&mut self, rng: &mut SmallRng) -> Option<f64> {
        match &self.clock {
            Clock::Poisson { gap, end_ms } => {
                self.t_ms += gap.sample(rng);
                (self.t_ms < *end_ms).then_some(self.t_ms)
            }
            Clock::Bursts { gap, end_ms } => {
                self.t_ms += gap.sample(rng);
                (self.t_ms < *end_ms).then_some(self.t_ms)
            }
            Clock::Stairs { gaps, stair_ms } => loop {
                let gap = gaps.get(self.stair)?;
                let end = (self.stair + 1) as f64 * stair_ms;
                self.t_ms += gap.sample(rng);
                if self.t_ms < end {
                    return Some(self.t_ms);
                }
                // Exponential gaps are memoryless: restart at the next stair.
                self.stair += 1;
                self.t_ms = end;
            },
        }
    }
}

/// Exponential inter-arrival gaps, in ms, for `rate` requests per second.
fn poisson_gap(rate: f64) -> anyhow::Result<Exp<f64>> {
    Exp::new(rate / 1000.0).map_err(|e| anyhow::anyhow!("bad arrival rate {rate}: {e}"))
}

/// A Zipf rank in [1, n].
fn zipf_rank(dist: &Zipf<f64>, n: u64, rng: &mut SmallRng) -> u64 {
    (dist.sample(rng) as u64).clamp(1, n)
}

/// An open session: its last request and how many turns it has had.
struct Session {
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
    turns: u32,
}

/// Appends fresh ids to `ids` until it has `blocks` entries.
fn fill_fresh(ids: &mut Vec<u64>, blocks: usize, next_id: &mut u64) {
    while ids.len() < blocks {
        ids.push(*next_id);
        *next_id += 1;
    }
}

/// Number of blocks (the last possibly partial) covering `tokens` tokens.
fn blocks_for(tokens: u64, block_tokens: u64) -> anyhow::Result<usize> {
    usize::try_from(tokens.div_ceil(block_tokens)).context("request too long: block count does not fit in usize")
}

/// Number of full blocks in `tokens` tokens.
fn full_blocks(tokens: u64, block_tokens: u64) -> anyhow::Result<usize> {
    usize::try_from(tokens / block_tokens).context("request too long: block count does not fit in usize")
}

/// Generates the trace. Same config (incl. seed) => identical output.
pub(crate) fn generate(cfg: &SynthConfig) -> anyhow::Result<Vec<Request>> {
    cfg.validate()?;
    let mut rng = SmallRng::seed_from_u64(cfg.seed);
    let mut arrivals = Arrivals::new(cfg)?;

    let user_span = cfg.max_tokens - cfg.min_tokens + 1;
    let user_zipf = Zipf::new(user_span as f64, cfg.zipf_alpha)
        .map_err(|e| anyhow::anyhow!("bad --zipf-alpha / token range: {e}"))?;
    let prompt_zipf = if cfg.system_prompts > 0 {
        Some(
            Zipf::new(cfg.system_prompts as f64, cfg.zipf_alpha)
                .map_err(|e| anyhow::anyhow!("bad --zipf-alpha / --system-prompts: {e}"))?,
        )
    } else {
        None
    };

    // Fixed ids for the full blocks of each system prompt, from 1 up.
    let prompt_blocks = full_blocks(cfg.system_prompt_tokens, cfg.block_tokens)?;
    let mut next_id: u64 = 1;
    let prompt_ids: Vec<Vec<u64>> = (0..cfg.system_prompts)
        .map(|_| {
            let mut ids = Vec::with_capacity(prompt_blocks);
            fill_fresh(&mut ids, prompt_blocks, &mut next_id);
            ids
        })
        .collect();

    let mut sessions: Vec<Session> = Vec::new();
    let mut out = Vec::with_capacity(cfg.requests.unwrap_or(0).min(1 << 20));

    while cfg.requests.is_none_or(|n| out.len() < n) {
        let Some(t_ms) = arrivals.next_ms(&mut rng) else {
            break;
        };
        let timestamp = t_ms as u64;
        let user_tokens = cfg.min_tokens + zipf_rank(&user_zipf, user_span, &mut rng) - 1;
        let output_length = rng.random_range(cfg.output_min..=cfg.output_max);

        let followup = !sessions.is_empty() && rng.random_bool(cfg.followup_prob);
        let (input_length, hash_ids) = if followup {
            let idx = rng.random_range(0..sessions.len());
            let session = &mut sessions[idx];
            let input_length = session.input_length.saturating_add(session.output_length).saturating_add(user_tokens);
            let kept = full_blocks(session.input_length, cfg.block_tokens)?;
            let blocks = blocks_for(input_length, cfg.block_tokens)?;
            let mut ids = Vec::with_capacity(blocks);
            ids.extend_from_slice(&session.hash_ids[..kept.min(session.hash_ids.len())]);
            fill_fresh(&mut ids, blocks, &mut next_id);
            session.turns += 1;
            if session.turns >= cfg.max_turns {
                sessions.remove(idx);
            } else {
                session.input_length = input_length;
                session.output_length = output_length;
                session.hash_ids.clone_from(&ids);
            }
            (input_length, ids)
        } else {
            let (prefix_tokens, prefix_ids): (u64, &[u64]) = match &prompt_zipf {
                Some(dist) => {
                    let rank = zipf_rank(dist, cfg.system_prompts as u64, &mut rng);
                    let idx = usize::try_from(rank - 1).unwrap_or(0);
                    (cfg.system_prompt_tokens, &prompt_ids[idx])
                }
                None => (0, &[]),
            };
            let input_length = prefix_tokens.saturating_add(user_tokens);
            let blocks = blocks_for(input_length, cfg.block_tokens)?;
            let mut ids = Vec::with_capacity(blocks);
            ids.extend_from_slice(prefix_ids);
            fill_fresh(&mut ids, blocks, &mut next_id);
            if cfg.max_turns > 1 {
                if sessions.len() >= MAX_OPEN_SESSIONS {
                    sessions.remove(0);
                }
                sessions.push(Session { input_length, output_length, hash_ids: ids.clone(), turns: 1 });
            }
            (input_length, ids)
        };

        out.push(Request { timestamp, input_length, output_length, hash_ids });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn base() -> SynthConfig {
        SynthConfig {
            seed: 7,
            arrival: Arrival::Poisson { rate: 100.0 },
            requests: None,
            duration_s: 60.0,
            block_tokens: 512,
            zipf_alpha: 1.1,
            min_tokens: 16,
            max_tokens: 4096,
            system_prompts: 8,
            system_prompt_tokens: 1200,
            followup_prob: 0.6,
            max_turns: 6,
            output_min: 16,
            output_max: 512,
        }
    }

    #[test]
    fn same_seed_same_trace_different_seed_different() {
        let cfg = SynthConfig { requests: Some(500), ..base() };
        let a = generate(&cfg).unwrap();
        let b = generate(&cfg).unwrap();
        assert_eq!(a, b);
        let c = generate(&SynthConfig { seed: 8, ..cfg }).unwrap();
        assert_ne!(a, c);
    }

    #[test]
    fn request_limit_is_honoured() {
        let cfg = SynthConfig { requests: Some(123), ..base() };
        assert_eq!(generate(&cfg).unwrap().len(), 123);
    }

    #[test]
    fn timestamps_non_decreasing_and_block_counts() {
        for arrival in [
            Arrival::Poisson { rate: 100.0 },
            Arrival::Bursts { shape: 0.3, scale_ms: 20.0 },
            Arrival::Stairs { rates: vec![20.0, 80.0], stair_secs: 10.0 },
        ] {
            let cfg = SynthConfig { arrival, duration_s: 20.0, ..base() };
            let trace = generate(&cfg).unwrap();
            assert!(!trace.is_empty());
            assert!(trace.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
            assert!(trace.iter().all(|r| r.timestamp < 20_000));
            for r in &trace {
                assert_eq!(r.hash_ids.len() as u64, r.input_length.div_ceil(cfg.block_tokens));
                assert!((cfg.output_min..=cfg.output_max).contains(&r.output_length));
            }
        }
    }

    #[test]
    fn hash_ids_form_a_prefix_tree() {
        for system_prompt_tokens in [1200, 1024] {
            let cfg = SynthConfig { system_prompt_tokens, followup_prob: 0.7, duration_s: 30.0, ..base() };
            let trace = generate(&cfg).unwrap();
            let mut pred: BTreeMap<u64, Option<u64>> = BTreeMap::new();
            for r in &trace {
                for (i, id) in r.hash_ids.iter().enumerate() {
                    let p = i.checked_sub(1).map(|j| r.hash_ids[j]);
                    let seen = *pred.entry(*id).or_insert(p);
                    assert_eq!(seen, p, "id {id} has two predecessors");
                }
            }
        }
    }

    #[test]
    fn poisson_rate_roughly_right() {
        let trace = generate(&base()).unwrap();
        let n = trace.len() as f64;
        assert!((n - 6000.0).abs() < 300.0, "got {n} requests");
    }

    #[test]
    fn stairs_grow() {
        let cfg =
            SynthConfig { arrival: Arrival::Stairs { rates: vec![10.0, 50.0, 200.0], stair_secs: 10.0 }, ..base() };
        let trace = generate(&cfg).unwrap();
        let mut counts = [0usize; 3];
        for r in &trace {
            let stair = (r.timestamp / 10_000) as usize;
            assert!(stair < 3);
            counts[stair] += 1;
        }
        assert!(counts[0] < counts[1] && counts[1] < counts[2], "{counts:?}");
    }

    #[test]
    fn followups_share_prefixes() {
        let cfg = SynthConfig { system_prompts: 0, followup_prob: 0.8, requests: Some(1000), ..base() };
        let trace = generate(&cfg).unwrap();
        let mut uses: BTreeMap<u64, usize> = BTreeMap::new();
        for r in &trace {
            for id in &r.hash_ids {
                *uses.entry(*id).or_default() += 1;
            }
        }
        assert!(uses.values().any(|&n| n > 1));
    }

    #[test]
    fn validate_rejects_bad_ranges() {
        let bad = [
            SynthConfig { min_tokens: 10, max_tokens: 5, ..base() },
            SynthConfig { block_tokens: 0, ..base() },
            SynthConfig { followup_prob: 1.5, ..base() },
            SynthConfig { zipf_alpha: 0.0, ..base() },
            SynthConfig { arrival: Arrival::Poisson { rate: 0.0 }, ..base() },
            SynthConfig { arrival: Arrival::Stairs { rates: vec![], stair_secs: 1.0 }, ..base() },
            SynthConfig { min_tokens: 0, ..base() },
            SynthConfig { max_turns: 0, ..base() },
        ];
        for cfg in &bad {
            assert!(cfg.validate().is_err(), "{cfg:?}");
            assert!(generate(cfg).is_err());
        }
        assert!(base().validate().is_ok());
    }
}
