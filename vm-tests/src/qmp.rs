//! A minimal QMP client: enough to resume a VM started with `-S` and to ask it to quit.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    /// Connects (retrying until `timeout`) and negotiates capabilities.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Qmp> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(e).with_context(|| format!("connect QMP {}", path.display())),
            }
        };
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let writer = stream.try_clone()?;
        let mut q = Qmp {
            reader: BufReader::new(stream),
            writer,
        };
        let greeting = q.read_msg()?;
        if greeting.get("QMP").is_none() {
            bail!("unexpected QMP greeting: {greeting}");
        }
        q.execute("qmp_capabilities")?;
        Ok(q)
    }

    fn read_msg(&mut self) -> Result<Value> {
        let mut line = String::new();
        let n = self.reader.read_line(&mut line).context("read from QMP")?;
        if n == 0 {
            bail!("QMP connection closed");
        }
        serde_json::from_str(&line).with_context(|| format!("bad QMP message {line:?}"))
    }

    /// Runs a command and returns its `return` value (events in between are skipped).
    pub fn execute(&mut self, cmd: &str) -> Result<Value> {
        let msg = serde_json::json!({ "execute": cmd });
        writeln!(self.writer, "{msg}").context("write to QMP")?;
        loop {
            let v = self.read_msg()?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                bail!("QMP {cmd} failed: {e}");
            }
        }
    }
}
