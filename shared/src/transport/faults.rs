//! A fault-injecting proxy for the guest → host byte stream (tests and the lab):
//! it sits between a guest (or a vsock backend's Unix socket) and the host
//! agent, applies one scripted fault per connection, and forwards the rest.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::proto::FRAME_HEADER;

/// What the proxy does to one connection (guest → host direction); `n`
/// counts record batch frames (wire tag 2) of that connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Drop the n-th batch frame entirely (a backend that lost a packet).
    DropFrame(usize),
    /// Forward half of the n-th batch frame, then cut both sides.
    CutFrame(usize),
    /// Remove a few bytes from the middle of the n-th batch frame.
    DropBytes(usize),
    /// Stop forwarding for a while before the n-th batch frame.
    Stall(usize, Duration),
    Clean,
}

/// A running proxy; dropping it stops accepting.
pub struct FaultProxy {
    stop: Arc<AtomicBool>,
    listen: PathBuf,
    thread: Option<JoinHandle<()>>,
    /// Faults applied so far, in order.
    pub applied: Arc<Mutex<Vec<Fault>>>,
}

impl FaultProxy {
    /// Listens on `listen` and forwards each connection to `upstream`,
    /// applying `faults` to the first connections in turn.
    pub fn start(listen: &Path, upstream: &Path, faults: Vec<Fault>) -> std::io::Result<Self> {
        let _ = std::fs::remove_file(listen);
        let lis = UnixListener::bind(listen)?;
        lis.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let applied = Arc::new(Mutex::new(Vec::new()));
        let (st, ap, up) = (stop.clone(), applied.clone(), upstream.to_path_buf());
        let thread = std::thread::spawn(move || {
            let mut faults = faults.into_iter();
            while !st.load(Ordering::Relaxed) {
                match lis.accept() {
                    Ok((guest, _)) => {
                        let _ = guest.set_nonblocking(false);
                        let fault = faults.next().unwrap_or(Fault::Clean);
                        if let Ok(host) = UnixStream::connect(&up) {
                            let ap = ap.clone();
                            std::thread::spawn(move || forward(guest, host, fault, &ap));
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok(FaultProxy {
            stop,
            listen: listen.to_path_buf(),
            thread: Some(thread),
            applied,
        })
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.listen);
    }
}

fn forward(mut guest: UnixStream, mut host: UnixStream, fault: Fault, applied: &Mutex<Vec<Fault>>) {
    let (Ok(mut hr), Ok(mut gw)) = (host.try_clone(), guest.try_clone()) else {
        return;
    };
    let back = std::thread::spawn(move || {
        let _ = std::io::copy(&mut hr, &mut gw);
    });
    let mut n = 0usize;
    let note = |f: Fault| applied.lock().unwrap_or_else(|e| e.into_inner()).push(f);
    loop {
        let mut hdr = [0u8; FRAME_HEADER];
        if guest.read_exact(&mut hdr).is_err() {
            break;
        }
        let mut body = vec![0u8; u32::from_le_bytes(hdr) as usize];
        if guest.read_exact(&mut body).is_err() {
            break;
        }
        // Wire tag 2: a record batch.
        n += usize::from(body.first() == Some(&2));
        let mut frame = hdr.to_vec();
        frame.extend_from_slice(&body);
        match fault {
            Fault::DropFrame(k) if k == n && body[0] == 2 => {
                note(fault);
                continue;
            }
            Fault::CutFrame(k) if k == n && body[0] == 2 => {
                note(fault);
                let _ = host.write_all(&frame[..frame.len() / 2]);
                break;
            }
            Fault::Stall(k, d) if k == n && body[0] == 2 => {
                note(fault);
                std::thread::sleep(d);
            }
            Fault::DropBytes(k) if k == n && body[0] == 2 && frame.len() > 40 => {
                note(fault);
                frame.drain(20..27);
            }
            _ => {}
        }
        if host.write_all(&frame).is_err() {
            break;
        }
    }
    let _ = host.shutdown(std::net::Shutdown::Both);
    let _ = guest.shutdown(std::net::Shutdown::Both);
    let _ = back.join();
}
