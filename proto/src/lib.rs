//! Wire protocol of kvmesh: the `.proto` files of this folder compiled into
//! tonic/prost types. This crate holds generated code only; all behaviour
//! lives in the daemon and the client library.
#![forbid(unsafe_code)]
#![allow(missing_docs, unreachable_pub, clippy::all)]

/// Engine-facing API, served by `kvmeshd` on its Unix socket.
pub mod engine {
    /// Version 1 of the engine API.
    pub mod v1 {
        tonic::include_proto!("kvmesh.engine.v1");
    }
}

/// Daemon-to-daemon control channel (handshake, grants).
pub mod peer {
    /// Version 1 of the peer API.
    pub mod v1 {
        tonic::include_proto!("kvmesh.peer.v1");
    }
}
