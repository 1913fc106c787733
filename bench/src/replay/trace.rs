//! The request trace: Mooncake's FAST'25 format, one JSON object per line:
//! `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
//! "hash_ids": [int, ...]}`.
//!
//! Rules checked on read (an error names the line; `--skip-bad-lines`
//! counts and skips instead): valid JSON with those fields; `timestamp` not
//! below the previous line's; `len(hash_ids) == ceil(input_length /
//! block_tokens)` — `--block-tokens` must be the block size the trace's ids
//! were computed with (512 for Mooncake's traces); and the ids form a prefix
//! tree (an id always follows the same predecessor). Blank lines are
//! ignored.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::path::Path;

use anyhow::{Context, bail};

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Request {
    /// Arrival, ms since the start of the trace (non-decreasing).
    pub(crate) timestamp: u64,
    /// Prompt tokens.
    pub(crate) input_length: u64,
    /// Tokens generated.
    pub(crate) output_length: u64,
    /// Chained prefix-block ids, one per block of `block_tokens` tokens
    /// (the last may be partial).
    pub(crate) hash_ids: Vec<u64>,
}

/// A trace read from a file.
pub(crate) struct Trace {
    pub(crate) requests: Vec<Request>,
    /// Lines skipped with `--skip-bad-lines`, with the first reason.
    pub(crate) skipped: usize,
    pub(crate) first_skip: Option<String>,
}

/// Checks one request against the rules; `parents` accumulates the tree.
fn check(r: &Request, block_tokens: u64, last_ts: u64, parents: &mut HashMap<u64, Option<u64>>) -> Result<(), String> {
    if r.timestamp < last_ts {
        return Err(format!("timestamp {} is below the previous line's {last_ts}", r.timestamp));
    }
    let want = r.input_length.div_ceil(block_tokens);
    if r.hash_ids.len() as u64 != want {
        return Err(format!(
            "{} hash_ids for {} input tokens; expected {want} at --block-tokens {block_tokens} \
             (is the trace's block size {block_tokens}?)",
            r.hash_ids.len(),
            r.input_length
        ));
    }
    // Check the whole line before recording any of it.
    let mut fresh: Vec<(u64, Option<u64>)> = Vec::new();
    let mut prev = None;
    for &id in &r.hash_ids {
        let known = parents.get(&id).copied().or_else(|| fresh.iter().find(|(i, _)| *i == id).map(|&(_, p)| p));
        match known {
            Some(p) if p != prev => {
                return Err(format!(
                    "hash id {id} follows {} here but {} earlier: the ids are not a prefix tree",
                    prev.map_or("nothing".into(), |p| p.to_string()),
                    p.map_or("nothing".into(), |p| p.to_string())
                ));
            }
            Some(_) => {}
            None => fresh.push((id, prev)),
        }
        prev = Some(id);
    }
    parents.extend(fresh);
    Ok(())
}

/// Reads and checks a trace file.
pub(crate) fn read(path: &Path, block_tokens: u64, skip_bad_lines: bool) -> anyhow::Result<Trace> {
    let f = std::fs::File::open(path).with_context(|| format!("open trace {}", path.display()))?;
    read_from(std::io::BufReader::new(f), &path.display().to_string(), block_tokens, skip_bad_lines)
}

/// Reads and checks a trace from `input` (named `name` in errors).
pub(crate) fn read_from(
    input: impl BufRead,
    name: &str,
    block_tokens: u64,
    skip_bad_lines: bool,
) -> anyhow::Result<Trace> {
    if block_tokens == 0 {
        bail!("--block-tokens must be at least 1");
    }
    let mut requests = Vec::new();
    let mut parents = HashMap::new();
    let mut last_ts = 0;
    let mut skipped = 0;
    let mut first_skip = None;
    for (i, line) in input.lines().enumerate() {
        let n = i + 1;
        let line = line.with_context(|| format!("{name}:{n}: read"))?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed = serde_json::from_str::<Request>(&line)
            .map_err(|e| format!("not a trace record ({e})"))
            .and_then(|r| check(&r, block_tokens, last_ts, &mut parents).map(|()| r));
        match parsed {
            Ok(r) => {
                last_ts = r.timestamp;
                requests.push(r);
            }
            Err(why) if skip_bad_lines => {
                skipped += 1;
                first_skip.get_or_insert_with(|| format!("{name}:{n}: {why}"));
            }
            Err(why) => bail!("{name}:{n}: {why} (--skip-bad-lines skips such lines)"),
        }
    }
    if requests.is_empty() {
        bail!("{name}: no requests");
    }
    Ok(Trace { requests, skipped, first_skip })
}

/// Writes a trace (one JSON object per line).
pub(crate) fn write(path: &Path, requests: &[Request]) -> anyhow::Result<()> {
    let f = std::fs::File::create(path).with_context(|| format!("create {}", path.display()))?;
    let mut w = std::io::BufWriter::new(f);
    for r in requests {
        serde_json::to_writer(&mut w, r)?;
        w.write_all(b"\n")?;
    }
    w.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str, text: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("kvmesh-trace-{}-{name}.jsonl", std::process::id()));
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn reads_a_valid_trace_and_round_trips() {
        let text = "{\"timestamp\":0,\"input_length\":1000,\"output_length\":5,\"hash_ids\":[1,2]}\n\n\
                    {\"timestamp\":7,\"input_length\":1100,\"output_length\":5,\"hash_ids\":[1,2,3]}\n";
        let p = tmp("ok", text);
        let t = read(&p, 512, false).unwrap();
        assert_eq!(t.requests.len(), 2);
        assert_eq!(t.requests[1].hash_ids, vec![1, 2, 3]);
        write(&p, &t.requests).unwrap();
        assert_eq!(read(&p, 512, false).unwrap().requests, t.requests);
        let _ = std::fs::remove_file(p);
    }

    #[test]
    fn bad_lines_name_the_line_or_are_skipped_and_counted() {
        let good = "{\"timestamp\":5,\"input_length\":512,\"output_length\":1,\"hash_ids\":[1]}";
        for (bad, why) in [
            ("{\"timestamp\":1,\"input_len", "not a trace record"),
            ("{\"timestamp\":6,\"input_length\":600,\"output_length\":1,\"hash_ids\":[1]}", "expected 2"),
            ("{\"timestamp\":1,\"input_length\":512,\"output_length\":1,\"hash_ids\":[1]}", "below the previous"),
            ("{\"timestamp\":9,\"input_length\":1024,\"output_length\":1,\"hash_ids\":[7,1]}", "not a prefix tree"),
            ("[1,2,3]", "not a trace record"),
        ] {
            let p = tmp("bad", &format!("{good}\n{bad}\n"));
            let e = read(&p, 512, false).err().expect("refused").to_string();
            assert!(e.contains(":2:") && e.contains(why), "{bad}: {e}");
            let t = read(&p, 512, true).unwrap();
            assert_eq!((t.requests.len(), t.skipped), (1, 1), "{bad}");
            assert!(t.first_skip.unwrap().contains(why));
            let _ = std::fs::remove_file(p);
        }
    }
}
