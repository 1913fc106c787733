//! Multi-node tests of kvmesh.
//!
//! The deterministic simulator of the coherence core ([`sim`], run by the
//! `kvmesh-sim` binary and by `tests/sim.rs`), and `kvmesh-nemesis`: real
//! `kvmeshd` processes and etcd in network namespaces it creates, faults
//! (partitions, pauses, kills, drains, pool pressure), its recorded
//! [`history`] and the checker that no engine ever read a wrong or stale
//! block (docs/RELIABILITY.md).
#![forbid(unsafe_code)]

pub mod blocks;
pub mod history;
pub mod sim;
