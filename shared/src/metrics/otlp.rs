//! OpenTelemetry (OTLP/HTTP, protobuf) push: the metrics of [`Metrics`] every
//! interval (cumulative temporality, explicit-bucket histograms with the same
//! bounds as the Prometheus exposition), and one trace per slow I/O — a root
//! span for the request and one child span per stage, in path order.
//!
//! Messages are the official OTLP protobuf definitions (`opentelemetry-proto`,
//! prost); they are posted with a small blocking HTTP/1.1 client from a
//! background thread, so the agent needs no async runtime or TLS stack for it
//! (plain `http://` endpoints only). The record path only hands a slow record to
//! a bounded channel; a full channel drops the trace and counts it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::metrics::v1::{
    metric, number_data_point, AggregationTemporality, Histogram, HistogramDataPoint, Metric,
    NumberDataPoint, ResourceMetrics, ScopeMetrics, Sum,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{span, ResourceSpans, ScopeSpans, Span};
use prost::Message;

use super::{bound_ns, Metrics, Snapshot, BUCKETS};

use crate::record::JoinedIo;
/// The official OTLP protobuf types and prost, for readers of what is exported.
pub use opentelemetry_proto as proto;
pub use prost;

/// Most slow I/Os waiting to be exported; more are dropped and counted.
const QUEUE: usize = 4096;
/// Most spans of slow I/Os per request.
const BATCH: usize = 512;

/// Where to push and how often.
#[derive(Clone, Debug)]
pub struct OtlpConfig {
    /// `http://host:port/v1/metrics`.
    pub metrics_url: String,
    /// `http://host:port/v1/traces`.
    pub traces_url: String,
    pub interval: Duration,
    /// `service.name` of the resource.
    pub service: String,
}

impl OtlpConfig {
    /// From an OTLP/HTTP base endpoint (`http://collector:4318`): the signals go to
    /// `<base>/v1/metrics` and `<base>/v1/traces` (the OTLP exporter convention).
    pub fn from_base(base: &str, service: &str) -> Result<OtlpConfig, String> {
        let base = base.trim_end_matches('/');
        parse_url(&format!("{base}/v1/metrics"))?;
        Ok(OtlpConfig {
            metrics_url: format!("{base}/v1/metrics"),
            traces_url: format!("{base}/v1/traces"),
            interval: Duration::from_secs(5),
            service: service.to_string(),
        })
    }
}

/// Export accounting (also published as the agent's counters).
#[derive(Debug, Default)]
pub struct OtlpStats {
    pub metric_pushes: AtomicU64,
    pub span_traces: AtomicU64,
    pub traces_dropped_queue_full: AtomicU64,
    pub export_errors: AtomicU64,
}

impl OtlpStats {
    pub fn counters(&self) -> Vec<(String, u64)> {
        vec![
            (
                "otlp_metric_pushes".into(),
                self.metric_pushes.load(Ordering::Relaxed),
            ),
            (
                "otlp_traces_exported".into(),
                self.span_traces.load(Ordering::Relaxed),
            ),
            (
                "otlp_traces_dropped_queue_full".into(),
                self.traces_dropped_queue_full.load(Ordering::Relaxed),
            ),
            (
                "otlp_export_errors".into(),
                self.export_errors.load(Ordering::Relaxed),
            ),
        ]
    }
}

/// What the exporter thread is sent: a slow I/O, or the order to push what it
/// has and stop (whatever [`SlowTraces`] handles are still alive).
enum Msg {
    Io(Box<JoinedIo>),
    Stop,
}

/// Queues slow I/Os for the exporter thread.
#[derive(Clone)]
pub struct SlowTraces {
    tx: Option<SyncSender<Msg>>,
    stats: Arc<OtlpStats>,
}

impl SlowTraces {
    /// Queues one slow I/O for a trace (never blocks; a full queue drops and counts it).
    pub fn slow(&self, j: &JoinedIo) {
        let Some(tx) = &self.tx else { return };
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) =
            tx.try_send(Msg::Io(Box::new(j.clone())))
        {
            self.stats
                .traces_dropped_queue_full
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The agent's side of the exporter.
pub struct Otlp {
    tx: Option<SyncSender<Msg>>,
    pub stats: Arc<OtlpStats>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Otlp {
    /// Starts the exporter thread.
    pub fn start(cfg: OtlpConfig, metrics: Arc<Metrics>) -> Result<Otlp, String> {
        parse_url(&cfg.metrics_url)?;
        parse_url(&cfg.traces_url)?;
        let (tx, rx) = sync_channel(QUEUE);
        let stats = Arc::new(OtlpStats::default());
        let st = stats.clone();
        let thread = std::thread::Builder::new()
            .name("otlp".into())
            .spawn(move || exporter(cfg, metrics, rx, st))
            .map_err(|e| e.to_string())?;
        Ok(Otlp {
            tx: Some(tx),
            stats,
            thread: Some(thread),
        })
    }

    /// A handle that queues slow I/Os (for the joined output).
    pub fn traces(&self) -> SlowTraces {
        SlowTraces {
            tx: self.tx.clone(),
            stats: self.stats.clone(),
        }
    }

    /// Exports what is queued and the final metrics, then stops (live
    /// [`SlowTraces`] handles do not hold it up; what they queue later is dropped
    /// and counted).
    pub fn finish(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(Msg::Stop);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Otlp {
    fn drop(&mut self) {
        self.finish();
    }
}

fn exporter(cfg: OtlpConfig, m: Arc<Metrics>, rx: Receiver<Msg>, st: Arc<OtlpStats>) {
    let start_ns = crate::walltime::realtime_ns().max(0) as u64;
    let mut next = Instant::now() + cfg.interval;
    let mut spans: Vec<JoinedIo> = Vec::new();
    let mut seq = 0u64;
    loop {
        let wait = next.saturating_duration_since(Instant::now());
        let done = match rx.recv_timeout(wait) {
            Ok(Msg::Io(j)) => {
                spans.push(*j);
                if spans.len() < BATCH && Instant::now() < next {
                    continue;
                }
                false
            }
            Ok(Msg::Stop) | Err(RecvTimeoutError::Disconnected) => true,
            Err(RecvTimeoutError::Timeout) => false,
        };
        if !spans.is_empty() {
            let n = spans.len() as u64;
            let req = traces_request(&cfg.service, &std::mem::take(&mut spans), &mut seq);
            match post(&cfg.traces_url, &req.encode_to_vec()) {
                Ok(()) => st.span_traces.fetch_add(n, Ordering::Relaxed),
                Err(e) => {
                    log::warn!("OTLP traces to {}: {e}", cfg.traces_url);
                    st.export_errors.fetch_add(1, Ordering::Relaxed)
                }
            };
        }
        if done || Instant::now() >= next {
            next = Instant::now() + cfg.interval;
            let now = crate::walltime::realtime_ns().max(0) as u64;
            let req = metrics_request(&cfg.service, &m.snapshot(), start_ns, now);
            match post(&cfg.metrics_url, &req.encode_to_vec()) {
                Ok(()) => st.metric_pushes.fetch_add(1, Ordering::Relaxed),
                Err(e) => {
                    log::warn!("OTLP metrics to {}: {e}", cfg.metrics_url);
                    st.export_errors.fetch_add(1, Ordering::Relaxed)
                }
            };
        }
        if done {
            return;
        }
    }
}

fn kv(k: &str, v: impl Into<AnyV>) -> KeyValue {
    let value = match v.into() {
        AnyV::S(s) => any_value::Value::StringValue(s),
        AnyV::I(i) => any_value::Value::IntValue(i),
    };
    KeyValue {
        key: k.to_string(),
        value: Some(AnyValue { value: Some(value) }),
        ..Default::default()
    }
}

enum AnyV {
    S(String),
    I(i64),
}
impl From<&str> for AnyV {
    fn from(s: &str) -> Self {
        AnyV::S(s.to_string())
    }
}
impl From<String> for AnyV {
    fn from(s: String) -> Self {
        AnyV::S(s)
    }
}
impl From<i64> for AnyV {
    fn from(i: i64) -> Self {
        AnyV::I(i)
    }
}

fn resource(service: &str) -> Resource {
    Resource {
        attributes: vec![kv("service.name", service)],
        ..Default::default()
    }
}

fn scope() -> InstrumentationScope {
    InstrumentationScope {
        name: "viotrace".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        ..Default::default()
    }
}

fn sum_metric(name: &str, desc: &str, points: Vec<NumberDataPoint>) -> Metric {
    Metric {
        name: name.into(),
        description: desc.into(),
        data: Some(metric::Data::Sum(Sum {
            data_points: points,
            aggregation_temporality: AggregationTemporality::Cumulative as i32,
            is_monotonic: true,
        })),
        ..Default::default()
    }
}

fn point(attrs: Vec<KeyValue>, v: u64, start: u64, now: u64) -> NumberDataPoint {
    NumberDataPoint {
        attributes: attrs,
        start_time_unix_nano: start,
        time_unix_nano: now,
        value: Some(number_data_point::Value::AsInt(v as i64)),
        ..Default::default()
    }
}

/// The OTLP metrics of a snapshot (names as in the Prometheus exposition;
/// counters without the `_total` suffix, which OTLP→Prometheus adds).
pub fn metrics_request(
    service: &str,
    s: &Snapshot,
    start: u64,
    now: u64,
) -> ExportMetricsServiceRequest {
    let bounds: Vec<f64> = (0..BUCKETS).map(|k| bound_ns(k) as f64 / 1e9).collect();
    let attrs = |k: &super::SeriesKey| {
        vec![
            kv("source", k.source),
            kv("vm", k.vm.as_str()),
            kv("disk", k.disk.as_str()),
            kv("queue", k.queue.map_or(String::new(), |q| q.to_string())),
        ]
    };
    let mut hist = Vec::new();
    let (mut reqs, mut bytes) = (Vec::new(), Vec::new());
    for sr in &s.series {
        for (stage, h) in &sr.stages {
            let mut a = attrs(&sr.key);
            a.push(kv("stage", stage.as_str()));
            hist.push(HistogramDataPoint {
                attributes: a,
                start_time_unix_nano: start,
                time_unix_nano: now,
                count: h.count(),
                sum: Some(h.sum_ns as f64 / 1e9),
                bucket_counts: h.counts.clone(),
                explicit_bounds: bounds.clone(),
                ..Default::default()
            });
        }
        for (op, n, b) in &sr.ops {
            let mut a = attrs(&sr.key);
            a.push(kv("op", op.name()));
            reqs.push(point(a.clone(), *n, start, now));
            bytes.push(point(a, *b, start, now));
        }
    }
    let mut all = s.counters.clone();
    all.push(("metrics_series_dropped".into(), s.series_dropped));
    all.push(("metrics_stages_dropped".into(), s.stages_dropped));
    let events = all
        .iter()
        .map(|(n, v)| {
            point(
                vec![kv("agent", s.agent), kv("name", n.as_str())],
                *v,
                start,
                now,
            )
        })
        .collect();
    let metrics = vec![
        Metric {
            name: "viotrace_stage_duration_seconds".into(),
            description: "Duration of one stage of a request; stage=total is the whole request"
                .into(),
            data: Some(metric::Data::Histogram(Histogram {
                data_points: hist,
                aggregation_temporality: AggregationTemporality::Cumulative as i32,
            })),
            ..Default::default()
        },
        sum_metric("viotrace_requests", "Finished requests by op", reqs),
        sum_metric("viotrace_bytes", "Bytes of finished requests by op", bytes),
        sum_metric(
            "viotrace_agent_events",
            "The agent's counters (drops, losses, accounts)",
            events,
        ),
    ];
    ExportMetricsServiceRequest {
        resource_metrics: vec![ResourceMetrics {
            resource: Some(resource(service)),
            scope_metrics: vec![ScopeMetrics {
                scope: Some(scope()),
                metrics,
                ..Default::default()
            }],
            ..Default::default()
        }],
    }
}

/// Span id from a sequence number (unique per agent run with the trace id).
fn ids(seq: u64, start: i64) -> [u8; 16] {
    let mut t = [0u8; 16];
    t[..8].copy_from_slice(&(start as u64).to_be_bytes());
    t[8..].copy_from_slice(
        &(seq ^ 0x5654_5241_4345_0000 ^ u64::from(std::process::id())).to_be_bytes(),
    );
    t
}

/// One trace per slow I/O: a root span and a child per stage.
pub fn traces_request(service: &str, ios: &[JoinedIo], seq: &mut u64) -> ExportTraceServiceRequest {
    let mut spans = Vec::new();
    for j in ios {
        let Some(t0) = j.time.map(|t| t.unix_ns()) else {
            continue;
        };
        *seq += 1;
        let trace_id = ids(*seq, t0).to_vec();
        let root_id = (*seq << 8).to_be_bytes().to_vec();
        let total = j.total_ns.unwrap_or(0).max(0);
        let mut a = vec![
            kv("vm", j.vm.as_str()),
            kv("op", j.op.name()),
            kv("sector", j.sector as i64),
            kv("bytes", i64::from(j.bytes)),
        ];
        let opt = [
            ("disk", j.disk.as_ref().map(|x| x.to_string())),
            ("device", j.device.as_ref().map(|x| x.to_string())),
            ("queue", j.queue.map(|x| x.to_string())),
            ("head", j.head.map(|x| x.to_string())),
            ("pid", j.pid.map(|x| x.to_string())),
            ("comm", j.comm.as_ref().map(|x| x.to_string())),
            ("cgroup_id", j.cgroup_id.map(|x| x.to_string())),
            ("inode", j.inode.map(|x| x.to_string())),
            (
                "backend",
                j.backend.map(|b| format!("{b:?}").to_lowercase()),
            ),
            (
                "clock_uncertainty_ns",
                j.clock_uncertainty_ns.map(|x| x.to_string()),
            ),
        ];
        for (k, v) in opt {
            if let Some(v) = v {
                a.push(kv(k, v));
            }
        }
        spans.push(Span {
            trace_id: trace_id.clone(),
            span_id: root_id.clone(),
            name: format!("io {}", j.op.name()),
            kind: span::SpanKind::Internal as i32,
            start_time_unix_nano: t0 as u64,
            end_time_unix_nano: (t0 + total) as u64,
            attributes: a,
            ..Default::default()
        });
        let mut at = t0;
        for (i, (stage, ns)) in j.stages.iter().enumerate() {
            let d = ns.max(0);
            spans.push(Span {
                trace_id: trace_id.clone(),
                span_id: ((*seq << 8) | (i as u64 + 1)).to_be_bytes().to_vec(),
                parent_span_id: root_id.clone(),
                name: stage.to_string(),
                kind: span::SpanKind::Internal as i32,
                start_time_unix_nano: at as u64,
                end_time_unix_nano: (at + d) as u64,
                attributes: vec![kv("stage", stage), kv("duration_ns", ns)],
                ..Default::default()
            });
            at += d;
        }
    }
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(resource(service)),
            scope_spans: vec![ScopeSpans {
                scope: Some(scope()),
                spans,
                ..Default::default()
            }],
            ..Default::default()
        }],
    }
}

/// `http://host:port/path` → (host:port, path).
fn parse_url(url: &str) -> Result<(String, String), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("OTLP endpoint {url:?}: only http:// is supported"))?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if hostport.is_empty() {
        return Err(format!("OTLP endpoint {url:?} has no host"));
    }
    let hp = if hostport.contains(':') {
        hostport.to_string()
    } else {
        format!("{hostport}:80")
    };
    Ok((hp, path.to_string()))
}

/// POSTs a protobuf body; any 2xx is success.
pub fn post(url: &str, body: &[u8]) -> Result<(), String> {
    let (hp, path) = parse_url(url)?;
    let io = |e: std::io::Error| format!("{hp}: {e}");
    let mut c = TcpStream::connect(&hp).map_err(io)?;
    c.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(io)?;
    c.set_write_timeout(Some(Duration::from_secs(10)))
        .map_err(io)?;
    write!(
        c,
        "POST {path} HTTP/1.1\r\nHost: {hp}\r\nContent-Type: application/x-protobuf\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .map_err(io)?;
    c.write_all(body).map_err(io)?;
    let mut r = BufReader::new(c);
    let mut status = String::new();
    r.read_line(&mut status).map_err(io)?;
    let code = status.split_whitespace().nth(1).unwrap_or("");
    if !code.starts_with('2') {
        let mut rest = String::new();
        let _ = r.take(2000).read_to_string(&mut rest);
        return Err(format!("{url}: {} {}", status.trim(), rest.trim()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A live slow-I/O handle (the joined output still holds one at exit) must not
    /// keep the exporter from stopping.
    #[test]
    fn finish_does_not_wait_for_live_trace_handles() {
        // Nothing listens on port 1: the final push fails at once and is counted.
        let cfg = OtlpConfig {
            metrics_url: "http://127.0.0.1:1/v1/metrics".into(),
            traces_url: "http://127.0.0.1:1/v1/traces".into(),
            interval: Duration::from_secs(3600),
            service: "test".into(),
        };
        let mut o = Otlp::start(cfg, Metrics::new("test")).unwrap();
        let handle = o.traces();
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            o.finish();
            let _ = tx.send(o.stats.export_errors.load(Ordering::Relaxed));
        });
        let errors = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("finish returned while a SlowTraces handle lives");
        assert!(errors >= 1, "the failed final push is counted");
        t.join().unwrap();
        drop(handle);
    }

    #[test]
    fn urls() {
        assert_eq!(
            parse_url("http://h:4318/v1/metrics").unwrap(),
            ("h:4318".into(), "/v1/metrics".into())
        );
        assert_eq!(parse_url("http://h").unwrap(), ("h:80".into(), "/".into()));
        assert!(parse_url("https://h/x").is_err());
        let c = OtlpConfig::from_base("http://c:4318/", "s").unwrap();
        assert_eq!(c.traces_url, "http://c:4318/v1/traces");
    }

    fn io() -> JoinedIo {
        use crate::record::{ClockDomain, Points};
        use std::borrow::Cow;
        JoinedIo {
            vm: "vm1".into(),
            time: Some(crate::walltime::WallTime(1_000_000_000)),
            disk: Some("vdb".into()),
            device: Some("virtio-disk1".into()),
            queue: Some(0),
            head: Some(7),
            op: crate::record::Op::Write,
            sector: 64,
            bytes: 4096,
            pid: Some(42),
            tid: Some(42),
            comm: Some("fio".into()),
            cgroup_id: Some(1),
            inode: Some(12),
            file_offset: None,
            kicked: Some(true),
            error: Some(0),
            qemu_pid: Some(9),
            backend: Some(crate::record::Backend::Threads),
            merge_id: Some(1),
            status: Some(0),
            ts: Points::new(),
            ts_domain: ClockDomain::Host,
            stages: crate::stages::Stages(smallvec::smallvec![
                (Cow::Borrowed("kick_to_pop"), 300),
                (Cow::Borrowed("host_io"), 5000),
                (Cow::Borrowed("push_to_irq"), -20),
            ]),
            substages: Default::default(),
            total_ns: Some(5280),
            clock_uncertainty_ns: Some(100),
            joined: true,
            reason: None,
            cause: None,
            interference: None,
        }
    }

    #[test]
    fn one_trace_per_io_with_a_child_per_stage_and_metrics_decode() {
        let mut seq = 0;
        let req = traces_request("svc", &[io(), io()], &mut seq);
        let back = ExportTraceServiceRequest::decode(&req.encode_to_vec()[..]).unwrap();
        let spans = &back.resource_spans[0].scope_spans[0].spans;
        assert_eq!(spans.len(), 8);
        let root = &spans[0];
        assert!(root.parent_span_id.is_empty());
        assert_eq!(root.start_time_unix_nano, 1_000_000_000);
        assert_eq!(root.end_time_unix_nano, 1_000_005_280);
        let kids: Vec<&Span> = spans[1..4].iter().collect();
        assert!(kids
            .iter()
            .all(|k| k.parent_span_id == root.span_id && k.trace_id == root.trace_id));
        assert_eq!(kids[1].name, "host_io");
        assert_eq!(kids[1].start_time_unix_nano, 1_000_000_300);
        assert_eq!(
            kids[2].end_time_unix_nano, kids[2].start_time_unix_nano,
            "negative stage: empty span"
        );
        assert_ne!(spans[4].trace_id, root.trace_id, "a trace per I/O");
        assert!(root.attributes.iter().any(|a| a.key == "comm"));

        let m = Metrics::new("t");
        let mut r = super::super::Recorder::new(m.clone());
        let j = io();
        r.record(
            "joined",
            "vm1",
            "vdb",
            Some(0),
            j.op,
            j.bytes,
            &j.stages,
            j.total_ns,
            true,
        );
        m.set_counters(vec![("lost_in_transit".into(), 3)]);
        let req = metrics_request("svc", &m.snapshot(), 1, 2);
        let back = ExportMetricsServiceRequest::decode(&req.encode_to_vec()[..]).unwrap();
        let ms = &back.resource_metrics[0].scope_metrics[0].metrics;
        let Some(metric::Data::Histogram(h)) = &ms[0].data else {
            panic!("{ms:?}")
        };
        assert_eq!(h.data_points.len(), 4, "3 stages + total");
        let p = &h.data_points[1];
        assert_eq!(p.count, 1);
        assert_eq!(p.bucket_counts.len(), p.explicit_bounds.len() + 1);
        let Some(metric::Data::Sum(ev)) = &ms[3].data else {
            panic!()
        };
        assert!(ev.is_monotonic);
        assert_eq!(
            ev.data_points[0].value,
            Some(number_data_point::Value::AsInt(3))
        );
    }
}
