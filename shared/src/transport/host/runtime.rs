//! The network thread: the tokio runtime that serves the guests, on a thread
//! of its own, apart from the agent's main loop.

use std::future::Future;
use std::io;

/// A tokio runtime with one worker thread named as given.
pub struct NetRuntime {
    rt: tokio::runtime::Runtime,
}

impl NetRuntime {
    /// Starts the runtime and its thread.
    pub fn start(name: &str) -> io::Result<NetRuntime> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(name)
            .enable_all()
            .build()?;
        Ok(NetRuntime { rt })
    }

    /// Runs `f` to completion from the calling thread (tasks it spawns run on
    /// the network thread).
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }
}
