//! The guest's stream to the host (AF_VSOCK or Unix), with writes cut to a
//! size every vsock backend carries in one descriptor.

use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::Endpoint;

/// Largest single `write(2)`: vsock backends that assume one descriptor per
/// packet break on guest packets above 32 KiB (Linux ≥ 6.12 splits those into
/// non-linear skbs), so no write is ever larger than this.
///
/// Half a KiB under 16 KiB: virtio-vsock makes one linear skb of a write,
/// `alloc_skb(44 + len)`, whose buffer also holds `struct skb_shared_info`
/// (320 bytes); 16 KiB of data came to 16 768 bytes, a 32 KiB allocation
/// that the kernel zeroes whole where `init_on_alloc` is on (Debian's
/// default): two bytes zeroed per byte sent. 15 872 bytes fit 16 KiB.
pub const WRITE_CHUNK: usize = 16 * 1024 - 512;

/// Most pieces one vectored write takes.
const MAX_IOV: usize = 16;

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
    pub fn write_chunked(&mut self, b: &[u8]) -> io::Result<()> {
        self.write_all_chunked(&[b])
    }

    /// Writes the pieces in order as one stream (vectored writes, so pieces
    /// are not gathered into one buffer first), never more than
    /// [`WRITE_CHUNK`] bytes per call.
    pub fn write_all_chunked(&mut self, bufs: &[&[u8]]) -> io::Result<()> {
        // Position: bufs[i][off..] is next.
        let (mut i, mut off) = (0, 0);
        let mut iov = [IoSlice::new(&[]); MAX_IOV];
        loop {
            while i < bufs.len() && off == bufs[i].len() {
                (i, off) = (i + 1, 0);
            }
            if i == bufs.len() {
                return Ok(());
            }
            let (mut n, mut total) = (0, 0);
            for (j, b) in bufs[i..].iter().enumerate() {
                if n == MAX_IOV || total == WRITE_CHUNK {
                    break;
                }
                let b = if j == 0 { &b[off..] } else { b };
                let take = b.len().min(WRITE_CHUNK - total);
                if take > 0 {
                    iov[n] = IoSlice::new(&b[..take]);
                    n += 1;
                    total += take;
                }
            }
            let w = match self {
                Conn::Unix(s) => s.write_vectored(&iov[..n]),
                Conn::Vsock(s) => nix::sys::uio::writev(&*s, &iov[..n]).map_err(io::Error::from),
            };
            let mut k = match w {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(k) => k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            while k > 0 {
                let left = bufs[i].len() - off;
                if k < left {
                    off += k;
                    break;
                }
                k -= left;
                (i, off) = (i + 1, 0);
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces of every size around the chunk and the vector limits arrive
    /// whole and in order, however the kernel splits the writes.
    #[test]
    fn chunked_pieces_arrive_as_one_stream() {
        let sizes = [
            0,
            1,
            7,
            WRITE_CHUNK - 1,
            WRITE_CHUNK,
            WRITE_CHUNK + 1,
            3 * WRITE_CHUNK,
        ];
        let mut pieces: Vec<Vec<u8>> = Vec::new();
        for (i, &n) in sizes.iter().cycle().take(60).enumerate() {
            pieces.push((0..n).map(|k| (k * 31 + i * 7) as u8).collect());
        }
        // Many small pieces too (more than one vectored write takes).
        for i in 0..3 * MAX_IOV {
            pieces.push(vec![i as u8; 3]);
        }
        let want: Vec<u8> = pieces.concat();
        let (a, mut b) = UnixStream::pair().expect("socketpair");
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            b.read_to_end(&mut got).map(|_| got)
        });
        let mut conn = Conn::Unix(a);
        let refs: Vec<&[u8]> = pieces.iter().map(Vec::as_slice).collect();
        conn.write_all_chunked(&refs).expect("write");
        conn.write_chunked(b"tail").expect("write");
        drop(conn);
        let got = reader.join().expect("reader").expect("read");
        assert_eq!(got.len(), want.len() + 4);
        assert!(got[..want.len()] == want[..] && got.ends_with(b"tail"));
    }
}
