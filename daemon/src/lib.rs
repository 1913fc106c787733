//! `kvmeshd`, the per-node daemon of kvmesh.
//!
//! It owns pools of shared memory cut into fixed-size slots, an index from
//! (namespace, key) to slot with S3-FIFO eviction, and serves co-located
//! engines over gRPC on a Unix socket. Engines map the pools' memfds and
//! read pinned blocks in place; the daemon's job is to decide which slot
//! holds what and to never let a slot be reused while anyone can still read
//! it (pins with leases, released when the engine's connection closes).
#![forbid(unsafe_code)]

pub mod cluster;
pub mod config;
pub mod dataplane;
pub mod error;
pub mod etcd;
pub mod fast;
pub mod inline;
pub mod memory;
pub mod metrics;
pub mod peers;
pub mod server;
pub mod service;
pub mod staging;
pub mod store;
pub mod tls;

pub use config::Config;
pub use error::Error;
