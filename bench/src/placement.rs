//! Where a bench's processes run (`--split-cpus SERVER:CLIENT`): the
//! serving side of a system on some CPUs, its reading side on others, as
//! on two nodes.

use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};

/// `--split-cpus SERVER:CLIENT`: where each side of every system runs.
#[derive(Clone, Debug)]
pub(crate) struct Split {
    pub(crate) server: String,
    pub(crate) client: String,
}

impl Split {
    pub(crate) fn parse(s: &str) -> anyhow::Result<Split> {
        let (server, client) = s
            .split_once(':')
            .with_context(|| format!("--split-cpus {s:?}: expected SERVER:CLIENT CPU lists, e.g. 1:0"))?;
        for l in [server, client] {
            if l.is_empty() || !l.chars().all(|c| c.is_ascii_digit() || c == ',' || c == '-') {
                bail!("--split-cpus {s:?}: {l:?} is not a CPU list (taskset syntax: 0,2-3)");
            }
        }
        Ok(Split { server: server.to_string(), client: client.to_string() })
    }
}

/// Binds every thread of process `pid` (and the threads it makes later)
/// to `cpus` with util-linux's `taskset`.
pub(crate) fn pin(pid: u32, cpus: &str, what: &str) -> anyhow::Result<()> {
    let out = Command::new("taskset")
        .args(["--all-tasks", "--cpu-list", "--pid", cpus, &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .context("run taskset (util-linux) for --split-cpus")?;
    if !out.status.success() {
        bail!("taskset -a -c {cpus} -p {pid} ({what}): {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Split;

    #[test]
    fn split_cpus_take_two_cpu_lists() {
        let s = Split::parse("1:0").unwrap();
        assert_eq!((s.server.as_str(), s.client.as_str()), ("1", "0"));
        let s = Split::parse("2-3,6:0,1").unwrap();
        assert_eq!((s.server.as_str(), s.client.as_str()), ("2-3,6", "0,1"));
        for bad in ["", "1", "1:", ":0", "a:0", "1:0:2", "1;0", "0 :1"] {
            assert!(Split::parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
