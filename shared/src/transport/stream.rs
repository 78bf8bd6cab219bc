//! The guest's stream to the host (AF_VSOCK or Unix), with writes cut to a
//! size every vsock backend carries in one descriptor.

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::Endpoint;

/// Largest single `write(2)`: vsock backends that assume one descriptor per
/// packet break on guest packets above 32 KiB (Linux ≥ 6.12 splits those into
/// non-linear skbs), so no write is ever larger than this.
pub const WRITE_CHUNK: usize = 16 * 1024;

pub(super) enum Conn {
    Unix(UnixStream),
    Vsock(vsock::VsockStream),
}

impl Conn {
    pub fn connect(ep: &Endpoint) -> io::Result<Conn> {
        match ep {
            Endpoint::Unix(p) => UnixStream::connect(p).map(Conn::Unix),
            Endpoint::Vsock { cid, port } => {
                vsock::VsockStream::connect_with_cid_port(*cid, *port).map(Conn::Vsock)
            }
        }
    }
    pub fn try_clone(&self) -> io::Result<Conn> {
        match self {
            Conn::Unix(s) => s.try_clone().map(Conn::Unix),
            Conn::Vsock(s) => s.try_clone().map(Conn::Vsock),
        }
    }
    pub fn set_read_timeout(&self, d: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Unix(s) => s.set_read_timeout(d),
            Conn::Vsock(s) => s.set_read_timeout(d),
        }
    }
    pub fn set_write_timeout(&self, d: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Unix(s) => s.set_write_timeout(d),
            Conn::Vsock(s) => s.set_write_timeout(d),
        }
    }
    pub fn shutdown(&self) {
        let _ = match self {
            Conn::Unix(s) => s.shutdown(Shutdown::Both),
            Conn::Vsock(s) => s.shutdown(Shutdown::Both),
        };
    }
    /// Writes everything, never more than [`WRITE_CHUNK`] bytes per call.
    pub fn write_chunked(&mut self, mut b: &[u8]) -> io::Result<()> {
        while !b.is_empty() {
            let n = b.len().min(WRITE_CHUNK);
            let w = match self {
                Conn::Unix(s) => s.write(&b[..n]),
                Conn::Vsock(s) => s.write(&b[..n]),
            };
            match w {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(k) => b = &b[k..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl Read for Conn {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Unix(s) => s.read(b),
            Conn::Vsock(s) => s.read(b),
        }
    }
}
