//! Tasks that continue on the thread that wakes them.
//!
//! An engine call that has to wait (a remote fetch, a cluster-wide lookup)
//! is a future whose last step — the core's answer arriving — mostly
//! happens on the data-plane thread (a read validated there, a coherence
//! answer handled there as it arrives). A tokio task would then need a
//! runtime worker woken to write the engine's answer: one thread wake-up
//! more on the critical path (~30 µs on a small virtual machine). A task
//! made here is polled instead by the thread that wakes it, when that
//! thread *serves woken tasks* (the data-plane thread does, between its
//! turns, holding no lock); woken anywhere else it is polled on the
//! runtime, as a tokio task would be.
//!
//! Invariants:
//! - A task is polled by one thread at a time (`async-task` guarantees it)
//!   and always inside the runtime's context (timers, `spawn`).
//! - A serving thread polls woken tasks only in [`run_woken`], which its
//!   owner calls where it holds no lock: a wake under a lock (a oneshot
//!   sent under the core's lock) only queues the task.
//! - Tasks polled there must not block on the serving thread's own work
//!   (the engine calls' continuations write an answer without waiting:
//!   a client slow to read is flushed from a blocking-pool thread).
//! - A task is never lost: queued tasks left when a serving thread stops
//!   go to the runtime.
//! - A served task may take the store's lock (a pin's answer, a session
//!   released): while another thread holds it, the serving thread makes
//!   no UCX progress — as when it feeds the core a read or a coherence
//!   message. No holder of that lock waits for the data-plane thread.
//! - One batch of woken tasks per [`run_woken`] call: a task that wakes
//!   itself on every poll cannot keep the serving thread from its own
//!   work (its owner calls again before it sleeps, see [`has_woken`]).
//! - A panic in a task is a panic of the daemon: `kvmeshd` aborts on any
//!   panic (main.rs), wherever it happens.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use async_task::Runnable;
use tokio::runtime::Handle;

thread_local! {
    /// On a serving thread: the tasks woken on it, not yet polled.
    static WOKEN: RefCell<Option<Vec<Runnable>>> = const { RefCell::new(None) };
}

/// Marks the current thread as one that serves the tasks woken on it (at
/// its [`run_woken`] calls) until the returned guard drops.
pub fn serve_here() -> Serving {
    WOKEN.with(|w| {
        let mut w = w.borrow_mut();
        if w.is_none() {
            *w = Some(Vec::new());
        }
    });
    Serving(std::marker::PhantomData)
}

/// See [`serve_here`]. Dropping it hands the tasks still queued to the
/// runtime (through their schedule function, now that the thread no
/// longer serves).
/// (Not `Send`: it is the marked thread's own.)
pub struct Serving(std::marker::PhantomData<*const ()>);

impl Drop for Serving {
    fn drop(&mut self) {
        let left = WOKEN.with(|w| w.borrow_mut().take()).unwrap_or_default();
        for r in left {
            r.schedule();
        }
    }
}

/// Polls the tasks woken on this thread since the last call (those they
/// wake wait for the next call: see [`has_woken`]). Returns how many ran.
pub fn run_woken() -> usize {
    let batch = WOKEN.with(|w| w.borrow_mut().as_mut().map(std::mem::take).unwrap_or_default());
    let ran = batch.len();
    for r in batch {
        r.run();
    }
    ran
}

/// Whether this thread serves the tasks woken on it.
pub fn serving() -> bool {
    WOKEN.with(|w| w.borrow().is_some())
}

/// Whether tasks are waiting for this thread's next [`run_woken`].
pub fn has_woken() -> bool {
    WOKEN.with(|w| w.borrow().as_ref().is_some_and(|v| !v.is_empty()))
}

/// Starts `fut` as a task: polled first here and now, then by whichever
/// thread wakes it (see the module's doc). Runs detached: its output is
/// its own business.
pub fn spawn<F>(rt: &Handle, fut: F)
where
    F: Future<Output = ()> + Send + 'static,
{
    let fut = InRuntime { rt: rt.clone(), fut: Box::pin(fut) };
    let runtime = rt.clone();
    let schedule = move |r: Runnable| {
        // (A thread whose thread-locals are being torn down serves no
        // more: the runtime takes the task.)
        let mut left = Some(r);
        let _ = WOKEN.try_with(|w| {
            if let Some(v) = w.borrow_mut().as_mut() {
                v.extend(left.take());
            }
        });
        if let Some(r) = left {
            runtime.spawn(async move {
                r.run();
            });
        }
    };
    let (runnable, task) = async_task::spawn(fut, schedule);
    task.detach();
    runnable.run();
}

/// A future polled inside the runtime's context, whatever thread polls it.
struct InRuntime {
    rt: Handle,
    fut: Pin<Box<dyn Future<Output = ()> + Send>>,
}

impl Future for InRuntime {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        let _entered = this.rt.enter();
        this.fut.as_mut().poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A task woken on a serving thread is polled there, at its
    /// `run_woken`, not on the runtime; woken elsewhere, on the runtime.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_task_continues_on_the_serving_thread_that_wakes_it() {
        let rt = Handle::current();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        spawn(&rt, async move {
            let _ = rx.await;
            // Polled on the serving thread, outside the runtime: its
            // context is there (a timer needs it).
            let _ = tokio::time::timeout(std::time::Duration::from_secs(1), async {}).await;
            let _ = done_tx.send(std::thread::current().id());
        });
        let serving = std::thread::spawn(move || {
            let _s = serve_here();
            assert!(!has_woken());
            tx.send(()).unwrap();
            // Woken here: queued, not yet polled.
            assert!(has_woken());
            assert_eq!(run_woken(), 1);
            assert!(!has_woken());
            std::thread::current().id()
        })
        .join()
        .unwrap();
        assert_eq!(done_rx.recv().unwrap(), serving);

        // Woken from a thread that does not serve: polled on the runtime.
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        spawn(&rt, async move {
            let _ = rx.await;
            let _ = done_tx.send(std::thread::current().id());
        });
        let waker = std::thread::spawn(move || {
            tx.send(()).unwrap();
            std::thread::current().id()
        })
        .join()
        .unwrap();
        assert_ne!(done_rx.await.unwrap(), waker);
    }

    /// Tasks still queued when a serving thread stops serving are not
    /// lost: they run on the runtime.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn tasks_queued_when_a_thread_stops_serving_run_on_the_runtime() {
        let rt = Handle::current();
        let polls = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let p = Arc::clone(&polls);
        spawn(&rt, async move {
            let _ = rx.await;
            p.fetch_add(1, Ordering::SeqCst);
            // The runtime's context is there wherever it is polled.
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            let _ = done_tx.send(());
        });
        std::thread::spawn(move || {
            let s = serve_here();
            tx.send(()).unwrap();
            assert!(has_woken());
            drop(s);
        })
        .join()
        .unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(5), done_rx).await.unwrap().unwrap();
        assert_eq!(polls.load(Ordering::SeqCst), 1);
    }
}
