//! `kvmesh-bench replay` and `kvmesh-bench load`: request traces replayed
//! open-loop against a real cluster (see docs/REPLAY.md).

pub(crate) mod model;
pub(crate) mod plot;
pub(crate) mod router;
pub(crate) mod run;
pub(crate) mod synth;
pub(crate) mod trace;
