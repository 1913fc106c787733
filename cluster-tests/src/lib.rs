//! Multi-daemon tests of kvmesh. This crate will hold the tests that start
//! several `kvmeshd` processes (on loopback or in network namespaces the
//! test creates), inject faults (kill -9, partitions, restarts), and the
//! deterministic simulator of the coherence core.
//!
//! Nothing lives here yet: the single-daemon integration tests are in
//! `daemon/tests/`; multi-daemon tests arrive with the peer data plane.
#![forbid(unsafe_code)]
