//! Plain HTTP/1.0 from the tests: a free port, one GET, and a scraper that polls
//! an endpoint while a lab run goes on.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// The body of `GET path` (HTTP/1.0), if the server answered 200.
pub fn http_get(port: u16, path: &str) -> Option<String> {
    let mut c = TcpStream::connect(("127.0.0.1", port)).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(c, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut s = String::new();
    c.read_to_string(&mut s).ok()?;
    let (head, body) = s.split_once("\r\n\r\n")?;
    // Go's server answers in the request's version (HTTP/1.0 here).
    (head.split_whitespace().nth(1) == Some("200")).then(|| body.to_string())
}

/// GETs `path` every 200 ms until stopped; keeps the last body answered with 200.
pub struct Scraper {
    stop: Arc<AtomicBool>,
    last: Arc<Mutex<Option<String>>>,
    thread: Option<JoinHandle<()>>,
}

impl Scraper {
    pub fn start(port: u16, path: &'static str) -> Scraper {
        let (stop, last) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(None)));
        let (s, l) = (stop.clone(), last.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                if let Some(body) = http_get(port, path) {
                    *l.lock().unwrap() = Some(body);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        Scraper {
            stop,
            last,
            thread: Some(thread),
        }
    }

    /// Stops polling; the last body, if any GET was answered.
    pub fn finish(mut self) -> Option<String> {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.last.lock().unwrap().take()
    }
}
