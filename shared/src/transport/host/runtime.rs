//! The network thread: the tokio runtime that serves the guests, on a thread
//! of its own, apart from the agent's main loop.
//!
//! A current-thread runtime driven by one dedicated thread: the same one
//! thread as a multi-thread runtime with one worker, without the work-stealing
//! scheduler's bookkeeping at every park (its idle/notify state and the
//! per-batch poll-time average, a `pow` each time).

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::runtime::{Builder, Runtime};
use tokio::sync::oneshot;

/// A tokio runtime served by one thread named as given. Dropping it stops
/// the thread (tasks still running are dropped).
pub struct NetRuntime {
    rt: Arc<Runtime>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl NetRuntime {
    /// Starts the runtime and its thread.
    pub fn start(name: &str) -> io::Result<NetRuntime> {
        // (I/O and timers only: no signal driver, whose SIGCHLD orphan
        // reaping ran at every park, for processes this runtime never starts)
        let rt = Arc::new(
            Builder::new_current_thread()
                .enable_io()
                .enable_time()
                .build()?,
        );
        let (stop, stopped) = oneshot::channel::<()>();
        let driver = rt.clone();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                // Drives every task (and the I/O and timer drivers) until stopped.
                let _ = driver.block_on(stopped);
            })?;
        Ok(NetRuntime {
            rt,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Runs `f` to completion from the calling thread (the network thread
    /// drives I/O and timers, and runs the tasks `f` spawns).
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }
}

impl Drop for NetRuntime {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn tasks_run_on_the_named_thread_and_drop_stops_it() {
        let net = NetRuntime::start("viotrace-test-net").unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        net.block_on(async {
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                let name = std::thread::current().name().map(str::to_string);
                tx.send(name).unwrap();
            });
        });
        // The spawned task runs although nobody else is in `block_on`.
        let got = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(got.as_deref(), Some("viotrace-test-net"));
        // A timer from another thread's block_on is driven by the network thread.
        let t = std::time::Instant::now();
        net.block_on(async { tokio::time::sleep(Duration::from_millis(20)).await });
        assert!(t.elapsed() >= Duration::from_millis(20));
        drop(net);
    }
}
