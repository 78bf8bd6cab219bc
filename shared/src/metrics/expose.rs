//! Prometheus exposition of [`Metrics`] (text format, encoded by the
//! `prometheus-client` crate from a snapshot taken at scrape time) and the
//! small HTTP endpoint `--metrics-listen ADDR:PORT` serves it on (`GET /metrics`).
//!
//! Nothing here runs unless someone scrapes: the endpoint is a thread blocked
//! in `accept`.

use std::borrow::Cow;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::{Metrics, Snapshot};

type Labels = Vec<(Cow<'static, str>, String)>;

#[derive(Debug)]
struct MetricsCollector(Arc<Metrics>);

fn series_labels(k: &super::SeriesKey) -> Labels {
    vec![
        ("source".into(), k.source.to_string()),
        ("vm".into(), k.vm.clone()),
        ("disk".into(), k.disk.clone()),
        (
            "queue".into(),
            k.queue.map_or(String::new(), |q| q.to_string()),
        ),
    ]
}

/// Encodes one counter value under `labels`.
fn counter(
    enc: &mut prometheus_client::encoding::MetricEncoder,
    labels: &Labels,
    v: u64,
) -> Result<(), std::fmt::Error> {
    let mut f = enc.encode_family(labels)?;
    f.encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(&v, None)
}

fn encode_series(s: &Snapshot, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    let mut e = enc.encode_descriptor(
        "viotrace_stage_duration_seconds",
        "Duration of one stage of a request (stage names: docs/SCHEMA.md); stage=\"total\" is the whole request",
        None,
        MetricType::Histogram,
    )?;
    for sr in &s.series {
        for (stage, h) in &sr.stages {
            let mut l = series_labels(&sr.key);
            l.push(("stage".into(), stage.clone()));
            let mut f = e.encode_family(&l)?;
            f.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                h.sum_ns as f64 / 1e9,
                h.count(),
                &h.buckets_seconds(),
                None,
            )?;
        }
    }
    let mut e = enc.encode_descriptor(
        "viotrace_requests",
        "Finished requests by op",
        None,
        MetricType::Counter,
    )?;
    for sr in &s.series {
        for (op, n, _) in &sr.ops {
            let mut l = series_labels(&sr.key);
            l.push(("op".into(), op.name().to_string()));
            counter(&mut e, &l, *n)?;
        }
    }
    let mut e = enc.encode_descriptor(
        "viotrace_bytes",
        "Bytes of finished requests by op",
        None,
        MetricType::Counter,
    )?;
    for sr in &s.series {
        for (op, _, b) in &sr.ops {
            let mut l = series_labels(&sr.key);
            l.push(("op".into(), op.name().to_string()));
            counter(&mut e, &l, *b)?;
        }
    }
    let mut e = enc.encode_descriptor(
        "viotrace_unjoined_records",
        "End-to-end records without a partner on the other side (\"joined\":false)",
        None,
        MetricType::Counter,
    )?;
    for sr in s.series.iter().filter(|s| s.key.source == "joined") {
        counter(&mut e, &series_labels(&sr.key), sr.unjoined)?;
    }
    Ok(())
}

fn encode_agent(s: &Snapshot, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    let agent: Labels = vec![("agent".into(), s.agent.to_string())];
    let mut e = enc.encode_descriptor(
        "viotrace_agent_events",
        "The agent's counters: every drop, loss and transport account of its final stats line (name=the stats key)",
        None,
        MetricType::Counter,
    )?;
    let mut all = s.counters.clone();
    all.push(("metrics_series_dropped".into(), s.series_dropped));
    all.push(("metrics_stages_dropped".into(), s.stages_dropped));
    for (name, v) in &all {
        let mut l = agent.clone();
        l.push(("name".into(), name.clone()));
        counter(&mut e, &l, *v)?;
    }
    let mut names: Vec<&str> = s.gauges.iter().map(|g| g.0.as_str()).collect();
    names.sort();
    names.dedup();
    for name in names {
        let mut e = enc.encode_descriptor(name, "per-VM gauge", None, MetricType::Gauge)?;
        for (_, vm, v) in s.gauges.iter().filter(|g| g.0 == name) {
            let l: Labels = vec![("vm".into(), vm.clone())];
            e.encode_family(&l)?.encode_gauge(v)?;
        }
    }
    let me = crate::metrics::expose::self_usage();
    for (name, help, v, t) in [
        (
            "viotrace_process_cpu_seconds",
            "CPU time (user + system) of the agent",
            me.0,
            MetricType::Counter,
        ),
        (
            "viotrace_process_resident_memory_bytes",
            "Resident set size of the agent",
            me.1,
            MetricType::Gauge,
        ),
    ] {
        let mut e = enc.encode_descriptor(name, help, None, t)?;
        let mut f = e.encode_family(&agent)?;
        if matches!(t, MetricType::Counter) {
            f.encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(&v, None)?;
        } else {
            f.encode_gauge(&v)?;
        }
    }
    Ok(())
}

impl Collector for MetricsCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.0.snapshot();
        encode_series(&s, &mut enc)?;
        encode_agent(&s, &mut enc)
    }
}

/// (CPU seconds, RSS bytes) of this process: its exact CPU time
/// ([`selfcost::cpu_time`](crate::selfcost::cpu_time)) and its RSS now (`/proc/self/statm`).
pub fn self_usage() -> (f64, f64) {
    let cpu = crate::selfcost::cpu_time().map_or(0.0, |d| d.as_secs_f64());
    let rss = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(0.0, |p| p * 4096.0);
    (cpu, rss)
}

/// The text exposition of `m` now.
pub fn render(m: &Arc<Metrics>) -> String {
    let mut reg = Registry::default();
    reg.register_collector(Box::new(MetricsCollector(m.clone())));
    let mut out = String::new();
    // Encoding into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &reg);
    out
}

/// Serves `GET /metrics` on `addr` from a background thread. Returns the bound
/// address (port 0 picks one).
pub fn serve(addr: &str, m: Arc<Metrics>) -> std::io::Result<SocketAddr> {
    let l = TcpListener::bind(addr)?;
    let local = l.local_addr()?;
    std::thread::Builder::new()
        .name("metrics-http".into())
        .spawn(move || {
            for c in l.incoming().flatten() {
                let _ = handle(c, &m);
            }
        })?;
    Ok(local)
}

fn handle(mut c: TcpStream, m: &Arc<Metrics>) -> std::io::Result<()> {
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    c.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut r = BufReader::new(c.try_clone()?);
    let mut line = String::new();
    r.read_line(&mut line)?;
    // Headers up to the blank line (bounded).
    let mut h = String::new();
    for _ in 0..100 {
        h.clear();
        if r.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, ctype, body) = if method != "GET" {
        (
            "405 Method Not Allowed",
            "text/plain",
            "GET only\n".to_string(),
        )
    } else if path == "/metrics" || path.starts_with("/metrics?") {
        (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            render(m),
        )
    } else {
        ("404 Not Found", "text/plain", "try /metrics\n".to_string())
    };
    write!(
        c,
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    c.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Op;
    use crate::stages::Stages;
    use std::io::Read;

    #[test]
    fn scrape_over_http_has_histograms_and_counters() {
        let m = Metrics::new("viotrace-test");
        let mut r = super::super::Recorder::new(m.clone());
        let s = Stages(smallvec::smallvec![(Cow::Borrowed("host_io"), 1500)]);
        r.record(
            "joined",
            "vm1",
            "vdb",
            Some(0),
            Op::Read,
            4096,
            &s,
            Some(9000),
            true,
        );
        m.set_counters(vec![("lost_in_transit".into(), 0)]);
        m.set_gauges(vec![(
            "viotrace_clock_uncertainty_seconds".into(),
            "vm1".into(),
            2e-6,
        )]);
        let addr = serve("127.0.0.1:0", m).unwrap();
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut body = String::new();
        c.read_to_string(&mut body).unwrap();
        assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
        for want in [
            r#"viotrace_stage_duration_seconds_bucket{le="0.000001",source="joined",vm="vm1",disk="vdb",queue="0",stage="host_io"} 0"#,
            r#"viotrace_stage_duration_seconds_bucket{le="0.000002",source="joined",vm="vm1",disk="vdb",queue="0",stage="host_io"} 1"#,
            r#"viotrace_stage_duration_seconds_bucket{le="16.777216",source="joined",vm="vm1",disk="vdb",queue="0",stage="host_io"} 1"#,
            r#"viotrace_stage_duration_seconds_bucket{le="+Inf",source="joined",vm="vm1",disk="vdb",queue="0",stage="host_io"} 1"#,
            r#"viotrace_stage_duration_seconds_count{source="joined",vm="vm1",disk="vdb",queue="0",stage="total"} 1"#,
            r#"viotrace_requests_total{source="joined",vm="vm1",disk="vdb",queue="0",op="read"} 1"#,
            r#"viotrace_bytes_total{source="joined",vm="vm1",disk="vdb",queue="0",op="read"} 4096"#,
            r#"viotrace_agent_events_total{agent="viotrace-test",name="lost_in_transit"} 0"#,
            r#"viotrace_clock_uncertainty_seconds{vm="vm1"} 0.000002"#,
            "# EOF",
        ] {
            assert!(body.contains(want), "missing {want} in\n{body}");
        }
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let mut b = String::new();
        c.read_to_string(&mut b).unwrap();
        assert!(b.starts_with("HTTP/1.1 404"), "{b}");
    }
}
