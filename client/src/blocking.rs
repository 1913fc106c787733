//! A synchronous face of [`crate::Client`] for callers without an async
//! runtime: the C ABI, the Python package, plain threads.
//!
//! A [`Client`] owns a small tokio runtime (one worker thread, which runs
//! the connection and the background release of dropped pins) and runs
//! each call to completion on the calling thread with
//! [`Client::block_on`]. Any number of threads may call through one
//! `Client` at once (it is `Send + Sync`); each call blocks only its
//! caller. Calls on the fast path (lookups, pins, unpins, and the put's
//! allocate, commit and abort) are written and their
//! answers read by the calling thread itself (one reader at a time, which
//! hands other callers their answers), so a call wakes no runtime thread. Calling from inside an async runtime is refused (it would block
//! that runtime's thread): use the async [`crate::Client`] there.

use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use crate::{ClientError, Result};

/// A connection to the local kvmeshd with its own runtime. Cheap to clone:
/// clones share the connection and the runtime, which lives until the last
/// clone (and every guard made through it) is gone.
#[derive(Clone)]
pub struct Client {
    // (Fields drop in this order: the connection first — its end wakes a
    // background call blocked on the socket —, then the runtime, which
    // then has nothing to wait for.)
    inner: crate::Client,
    rt: Arc<Runtime>,
}

/// How long dropping the last clone waits for the runtime's work in flight
/// (a background unpin waiting for the daemon's answer) before leaving it.
const SHUTDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The client's runtime, shut down without waiting forever: a background
/// unpin blocked on an answer from a daemon that hangs must not hang the
/// engine's exit (a plain drop would wait for it), and a client dropped
/// inside some async runtime must not panic.
struct Runtime(Option<tokio::runtime::Runtime>);

impl std::ops::Deref for Runtime {
    type Target = tokio::runtime::Runtime;
    fn deref(&self) -> &tokio::runtime::Runtime {
        self.0.as_ref().expect("present until dropped")
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            if tokio::runtime::Handle::try_current().is_ok() {
                rt.shutdown_background();
            } else {
                rt.shutdown_timeout(SHUTDOWN_WAIT);
            }
        }
    }
}

impl Client {
    /// Connects to the daemon at `path`, or at the default socket path.
    pub fn connect(path: Option<&Path>) -> Result<Client> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(ClientError::InvalidArgument(
                "the blocking client cannot be used from inside an async runtime; use kvmesh_client::Client".into(),
            ));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvmesh-client")
            .enable_all()
            .build()
            .map_err(|e| ClientError::Protocol(format!("cannot start the client runtime: {e}")))?;
        // The fast path's answers are read by the calling threads
        // themselves (fast.rs, `CallerFast`): no runtime thread between a
        // caller and its answer.
        let mode = (!crate::fast::disabled()).then_some(crate::fast::Mode::Callers);
        let path = match path {
            Some(p) => p.to_path_buf(),
            None => crate::default_socket_path(),
        };
        let inner = rt.block_on(crate::Client::connect_mode(path, mode))?;
        let rt = Arc::new(Runtime(Some(rt)));
        // Guards keep the runtime (and so the connection and session) as
        // long as they live: a pin must not end while its block is read.
        inner.keep_with_guards(Arc::clone(&rt) as Arc<dyn std::any::Any + Send + Sync>);
        Ok(Client { rt, inner })
    }

    /// The async client (for futures passed to [`Client::block_on`]).
    pub fn inner(&self) -> &crate::Client {
        &self.inner
    }

    /// Runs `f` to completion on the calling thread. Fails (instead of
    /// panicking) when the caller is itself inside an async runtime.
    ///
    /// A call on the fast path (lookup, pin, unpin, allocate, commit, abort) runs to its end within one
    /// poll here (the thread blocks on the socket): a timeout or `select!`
    /// around it inside `f` cannot cut it short, and two of them joined run
    /// one after the other. (Calls over gRPC stay ordinary futures.)
    pub fn block_on<F: Future>(&self, f: F) -> Result<F::Output> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(ClientError::InvalidArgument(
                "blocking kvmesh call from inside an async runtime; use kvmesh_client::Client".into(),
            ));
        }
        Ok(crate::fast::as_blocking_caller(|| self.rt.block_on(f)))
    }

    /// Runs a fallible call: `block_on` with the two error layers joined.
    pub fn call<T, F: Future<Output = Result<T>>>(&self, f: F) -> Result<T> {
        self.block_on(f)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_a_missing_socket_with_the_path() {
        let e = Client::connect(Some(Path::new("/nonexistent/kvmesh.sock"))).err().expect("no daemon there");
        assert!(matches!(e, ClientError::Connect { .. }), "{e:?}");
        assert!(e.to_string().contains("/nonexistent/kvmesh.sock"), "{e}");
    }

    #[tokio::test]
    async fn refuses_to_run_inside_a_runtime() {
        let e = Client::connect(None).err().expect("refused");
        assert!(matches!(e, ClientError::InvalidArgument(_)), "{e:?}");
    }
}
