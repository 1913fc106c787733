//! Multi-node tests of kvmesh.
//!
//! Today: the deterministic simulator of the coherence core ([`sim`], run
//! by the `kvmesh-sim` binary and by `tests/sim.rs`). Later: tests that start
//! several `kvmeshd` processes (on loopback or in network namespaces the
//! test creates), inject faults (kill -9, partitions, restarts) and check
//! that no engine ever reads a wrong or stale block.
#![forbid(unsafe_code)]

pub mod sim;
