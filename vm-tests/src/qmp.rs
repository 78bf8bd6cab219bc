//! A minimal QMP client: enough to resume a VM started with `-S`, to ask it to quit and to
//! read its virtqueues' state when a run hangs.

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
        self.execute_with(cmd, Value::Null)
    }

    /// [`Self::execute`] with arguments (`Value::Null`: none).
    pub fn execute_with(&mut self, cmd: &str, args: Value) -> Result<Value> {
        let msg = match args {
            Value::Null => serde_json::json!({ "execute": cmd }),
            a => serde_json::json!({ "execute": cmd, "arguments": a }),
        };
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

/// Every queue of each virtio device named `device` (e.g. `virtio-blk`) as QEMU sees it
/// (`x-query-virtio-queue-status`, QEMU 7.0 and later): one line per queue, and the raw
/// answers. A request the guest waits for shows as `inuse` (popped, not pushed), or as a
/// used index past `signalled_used` (pushed, the guest not notified).
pub fn virtio_queues(q: &mut Qmp, device: &str) -> Result<(Vec<String>, Value)> {
    let devs = q.execute("x-query-virtio")?;
    let (mut lines, mut raw) = (Vec::new(), Vec::new());
    for d in devs.as_array().into_iter().flatten() {
        let (Some(path), Some(name)) = (d["path"].as_str(), d["name"].as_str()) else {
            continue;
        };
        if name != device {
            continue;
        }
        let st = q.execute_with("x-query-virtio-status", serde_json::json!({ "path": path }))?;
        let n = st["num-vqs"].as_u64().unwrap_or(0);
        for queue in 0..n {
            let args = serde_json::json!({ "path": path, "queue": queue });
            let v = q.execute_with("x-query-virtio-queue-status", args)?;
            let f = |k: &str| v.get(k).map_or("?".to_string(), |x| x.to_string());
            lines.push(format!(
                "{name} {path} queue {queue}: last_avail_idx={} shadow_avail_idx={} \
                 inuse={} used_idx={} signalled_used={} (valid {})",
                f("last-avail-idx"),
                f("shadow-avail-idx"),
                f("inuse"),
                f("used-idx"),
                f("signalled-used"),
                f("signalled-used-valid"),
            ));
            raw.push(serde_json::json!({ "path": path, "queue": queue, "status": v }));
        }
        raw.push(serde_json::json!({ "path": path, "device": st }));
    }
    Ok((lines, Value::Array(raw)))
}
