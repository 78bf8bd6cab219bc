//! Fleet outputs (issue 13) against the real servers: a Prometheus from Debian's
//! packages scrapes the host agent's `--metrics-listen` during a joined lab run;
//! its HTTP API must give the joined records' per-stage counts and every counter
//! of the host agent's stats line; every record carries a wall-clock `time` that
//! agrees with this host's clocks. OTLP: the host agent pushes its metrics into
//! that Prometheus's OTLP receiver (read back equal) and its slow-I/O traces to a
//! receiver here that decodes them with the official protobuf definitions.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use viotrace_shared::metrics::otlp::prost::Message;
use viotrace_shared::metrics::otlp::proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use viotrace_shared::metrics::otlp::proto::tonic::trace::v1::Span;
use viotrace_shared::record::{ClockDomain, JoinedIo, Points};
use viotrace_shared::walltime::{self, WallTime};
use viotrace_vm_tests::{assets, Agents, VmConfig};

mod common;
use common::checks::{check_run_joined, check_transport};
use common::http::{free_port, http_get};
use common::{lab, out_dir, run_agents, KNOWN_IO};

/// How many joined records have each stage (and a total): what the per-stage
/// histogram counts must be.
fn stage_counts(ios: &[&JoinedIo]) -> BTreeMap<String, f64> {
    let mut want: BTreeMap<String, f64> = BTreeMap::new();
    for j in ios.iter().filter(|j| j.joined) {
        for (stage, _) in j.stages.iter() {
            *want.entry(stage.to_string()).or_default() += 1.0;
        }
        if j.total_ns.is_some() {
            *want.entry("total".into()).or_default() += 1.0;
        }
    }
    want
}

/// A record's descriptor head as the span attribute shows it.
fn head(j: &JoinedIo) -> String {
    j.head.map_or_else(String::new, |h| h.to_string())
}

/// A Prometheus child process, killed on drop.
struct Prometheus {
    child: Child,
    port: u16,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    fn start(dir: &Path, target: &str) -> Prometheus {
        let bin = assets::prometheus::ensure_prometheus(&lab().assets.cache)
            .expect("Prometheus from Debian's packages");
        std::fs::create_dir_all(dir).unwrap();
        let cfg = dir.join("prometheus.yml");
        std::fs::write(
            &cfg,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\nscrape_configs:\n  - job_name: viotrace\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let port = free_port();
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new(bin)
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        let p = Prometheus { child, port };
        let deadline = Instant::now() + Duration::from_secs(60);
        while http_get(port, "/-/ready").is_none_or(|b| !b.contains("Ready")) {
            assert!(Instant::now() < deadline, "Prometheus not ready in 60 s");
            std::thread::sleep(Duration::from_millis(200));
        }
        p
    }

    /// VictoriaMetrics (OTLP receiver at /opentelemetry/v1/metrics, Prometheus
    /// query API); newest samples visible at once.
    fn start_victoria(dir: &Path) -> Prometheus {
        let bin = assets::prometheus::ensure_victoria_metrics(&lab().assets.cache)
            .expect("VictoriaMetrics from Debian's packages");
        std::fs::create_dir_all(dir).unwrap();
        let port = free_port();
        let log = std::fs::File::create(dir.join("victoria-metrics.log")).unwrap();
        let child = Command::new(bin)
            .arg(format!("-storageDataPath={}", dir.join("data").display()))
            .arg(format!("-httpListenAddr=127.0.0.1:{port}"))
            .arg("-search.latencyOffset=0s")
            .arg("-search.disableCache")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start victoria-metrics");
        let p = Prometheus { child, port };
        let deadline = Instant::now() + Duration::from_secs(60);
        while http_get(port, "/health").is_none_or(|b| !b.contains("OK")) {
            assert!(
                Instant::now() < deadline,
                "VictoriaMetrics not ready in 60 s"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        p
    }

    /// An instant query through the HTTP API: `(labels, value)` per result.
    fn query(&self, q: &str) -> Vec<(BTreeMap<String, String>, f64)> {
        let enc: String = q
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'.' | b'-' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        let body = http_get(self.port, &format!("/api/v1/query?query={enc}")).expect("query");
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        assert_eq!(v["status"], "success", "{body}");
        v["data"]["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let labels = r["metric"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
                    .collect();
                let val = r["value"][1].as_str().unwrap().parse().unwrap();
                (labels, val)
            })
            .collect()
    }
}

#[test]
fn prometheus_scrapes_the_host_agent_and_records_carry_wall_clock_time() {
    let mport = free_port();
    let target = format!("127.0.0.1:{mport}");
    let prom = Prometheus::start(&out_dir("fleet-prometheus-server"), &target);
    let before = walltime::realtime_ns();
    // The trailing sleep lets the last records be joined and scraped (1 s interval).
    let workload = format!("{KNOWN_IO}sleep 4\n");
    let r = run_agents(
        "fleet-prometheus",
        Agents::Both,
        VmConfig {
            host_args: vec!["--metrics-listen".into(), target.clone()],
            ..VmConfig::default()
        },
        &workload,
    );
    let after = walltime::realtime_ns();
    let hlog = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    assert_eq!(r.host_agent_rc, Some(0), "host agent:\n{hlog}");
    assert!(hlog.contains("Prometheus metrics on http://"), "{hlog}");

    // Per-stage counts of the joined records, as Prometheus stored them.
    let joined = r.records("joined.jsonl").unwrap();
    check_run_joined(&r, 0.999);
    check_transport(&r, "vt-fleet-prometheus");
    let want = stage_counts(&joined.ios());
    assert!(
        want.get("host_io").copied().unwrap_or(0.0) >= 650.0,
        "{want:?}"
    );
    let got: BTreeMap<String, f64> = prom
        .query(r#"sum by (stage) (last_over_time(viotrace_stage_duration_seconds_count{source="joined"}[10m]))"#)
        .into_iter()
        .map(|(l, v)| (l["stage"].clone(), v))
        .collect();
    assert_eq!(got, want, "per-stage counts: Prometheus vs joined.jsonl");
    // The +Inf bucket holds every observation.
    let inf: f64 = prom
        .query(r#"sum(last_over_time(viotrace_stage_duration_seconds_bucket{source="joined",le="+Inf"}[10m]))"#)
        .iter()
        .map(|x| x.1)
        .sum();
    assert_eq!(inf, want.values().sum::<f64>());

    // Every counter of the host agent's final stats line is exposed.
    let host = r.records("host.jsonl").unwrap();
    let stats = host.stats().expect("stats line");
    let exposed: Vec<String> = prom
        .query(r#"last_over_time(viotrace_agent_events_total{agent="viotrace-host"}[10m])"#)
        .into_iter()
        .map(|(l, _)| l["name"].clone())
        .collect();
    let counters: Vec<&String> = stats.values.keys().collect();
    assert!(counters.len() >= 20, "{stats:?}");
    let missing: Vec<&&String> = counters.iter().filter(|k| !exposed.contains(k)).collect();
    assert!(
        missing.is_empty(),
        "not exposed: {missing:?} (exposed {exposed:?})"
    );
    let lost =
        prom.query(r#"last_over_time(viotrace_agent_events_total{name="lost_in_transit"}[10m])"#);
    assert_eq!(lost.len(), 1);
    assert_eq!(lost[0].1, stats.values["lost_in_transit"] as f64);

    // Wall-clock time: every joined and host record has one, inside the run, and
    // equal to its first point mapped with this host's own clock offset.
    let (offset, unc) = walltime::measure_offset();
    let mut checked = 0;
    let mut check = |time: Option<WallTime>, ts: &Points, rec: &dyn std::fmt::Debug| {
        let t = time.unwrap_or_else(|| panic!("no time: {rec:?}"));
        assert!(
            t.unix_ns() >= before - 1_000_000_000 && t.unix_ns() <= after,
            "{t} outside the run ({rec:?})"
        );
        let first = ts.iter().map(|(_, t)| t).min().unwrap();
        let mine = first as i64 + offset;
        // Both mappings are sub-µs reads of the same two clocks; 1 ms covers a clock step.
        let slack = unc as i64 + 1_000_000;
        assert!(
            (t.unix_ns() - mine).abs() <= slack,
            "time {t} vs this host's mapping {} (±{slack} ns): {rec:?}",
            WallTime(mine)
        );
        checked += 1;
    };
    for j in joined.ios() {
        if j.ts_domain != ClockDomain::Guest {
            check(j.time, &j.ts, j);
        }
    }
    for e in host.host_elems() {
        check(e.time, &e.ts, e);
    }
    assert!(checked >= 1300, "{checked} records with time");
}

/// An OTLP/HTTP traces receiver: every POSTed body decoded as an
/// `ExportTraceServiceRequest` (opentelemetry-proto); its spans collected.
fn trace_receiver() -> (u16, Arc<Mutex<Vec<Span>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let spans = Arc::new(Mutex::new(Vec::new()));
    let out = spans.clone();
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            let mut r = std::io::BufReader::new(c.try_clone().unwrap());
            let mut len = 0usize;
            let mut line = String::new();
            loop {
                line.clear();
                if std::io::BufRead::read_line(&mut r, &mut line).unwrap_or(0) == 0
                    || line == "\r\n"
                {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0u8; len];
            let ok = r.read_exact(&mut body).is_ok();
            let req = ExportTraceServiceRequest::decode(&body[..]).expect("OTLP traces decode");
            for rs in req.resource_spans {
                for ss in rs.scope_spans {
                    out.lock().unwrap().extend(ss.spans);
                }
            }
            let mut c = c;
            let _ = write!(
                c,
                "HTTP/1.1 {} OK\r\nContent-Length: 0\r\n\r\n",
                if ok { 200 } else { 400 }
            );
        }
    });
    (port, spans)
}

fn attr(s: &Span, k: &str) -> Option<String> {
    use viotrace_shared::metrics::otlp::proto::tonic::common::v1::any_value::Value;
    s.attributes.iter().find(|a| a.key == k).and_then(|a| {
        match a.value.as_ref()?.value.as_ref()? {
            Value::StringValue(v) => Some(v.clone()),
            Value::IntValue(i) => Some(i.to_string()),
            _ => None,
        }
    })
}

#[test]
fn otlp_metrics_read_back_from_prometheus_and_traces_decode() {
    let prom = Prometheus::start_victoria(&out_dir("fleet-otlp-server"));
    let (tport, spans) = trace_receiver();
    let r = run_agents(
        "fleet-otlp",
        Agents::Both,
        VmConfig {
            host_args: vec![
                "--otlp".into(),
                format!("http://127.0.0.1:{}/opentelemetry", prom.port),
                "--otlp-traces-url".into(),
                format!("http://127.0.0.1:{tport}/v1/traces"),
                "-t".into(),
                "2ms".into(),
            ],
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    let hlog = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    assert_eq!(r.host_agent_rc, Some(0), "host agent:\n{hlog}");
    let joined = r.records("joined.jsonl").unwrap();
    let host = r.records("host.jsonl").unwrap();
    let stats = host.stats().expect("stats line");
    assert_eq!(
        stats.values.get("otlp_export_errors"),
        Some(&0),
        "{stats:?}"
    );
    assert_eq!(
        stats.values.get("otlp_traces_dropped_queue_full"),
        Some(&0),
        "{stats:?}"
    );

    // Metrics: the final push equals the joined records' per-stage counts.
    let want = stage_counts(&joined.ios());
    assert!(
        want.get("host_io").copied().unwrap_or(0.0) >= 650.0,
        "{want:?}"
    );
    // Ingested samples become searchable within a few seconds: wait for the final push.
    let q = r#"sum by (stage) (last_over_time(viotrace_stage_duration_seconds_count{source="joined"}[10m]))"#;
    let deadline = Instant::now() + Duration::from_secs(30);
    let got = loop {
        let got: BTreeMap<String, f64> = prom
            .query(q)
            .into_iter()
            .map(|(l, v)| (l["stage"].clone(), v))
            .collect();
        if got == want || Instant::now() > deadline {
            break got;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let names = http_get(prom.port, "/api/v1/label/__name__/values");
    assert_eq!(
        got, want,
        "per-stage counts: OTLP in VictoriaMetrics vs joined.jsonl (metric names: {names:?})"
    );
    // VictoriaMetrics keeps OTLP sum names as sent; translations that add `_total` match too.
    let lost = prom.query(
        r#"last_over_time({__name__=~"viotrace_agent_events(_total)?",name="lost_in_transit"}[10m])"#,
    );
    assert_eq!(lost.len(), 1, "{lost:?} (metric names: {names:?})");
    assert_eq!(lost[0].1, stats.values["lost_in_transit"] as f64);

    // Traces: one root span per slow joined I/O, a child per stage in path order.
    let ios = joined.ios();
    let slow: Vec<&&JoinedIo> = ios
        .iter()
        .filter(|j| j.joined && j.total_ns.is_some_and(|t| t >= 2_000_000))
        .collect();
    assert!(!slow.is_empty(), "no I/O above 2 ms under TCG?");
    let spans = spans.lock().unwrap().clone();
    let roots: Vec<&Span> = spans
        .iter()
        .filter(|s| s.parent_span_id.is_empty())
        .collect();
    assert_eq!(roots.len(), slow.len(), "one trace per slow I/O");
    let mut want_keys: Vec<(String, String)> = slow
        .iter()
        .map(|j| (j.sector.to_string(), head(j)))
        .collect();
    let mut got_keys: Vec<(String, String)> = roots
        .iter()
        .map(|s| (attr(s, "sector").unwrap(), attr(s, "head").unwrap()))
        .collect();
    want_keys.sort();
    got_keys.sort();
    assert_eq!(got_keys, want_keys);
    for root in &roots {
        let kids: Vec<&Span> = spans
            .iter()
            .filter(|s| s.parent_span_id == root.span_id && s.trace_id == root.trace_id)
            .collect();
        let j = slow
            .iter()
            .find(|j| {
                Some(j.sector.to_string()) == attr(root, "sector")
                    && Some(head(j)) == attr(root, "head")
            })
            .unwrap();
        // Compared as sets (path order is unit-tested).
        let mut names: Vec<&str> = kids.iter().map(|s| s.name.as_str()).collect();
        names.sort();
        let mut stages: Vec<&str> = j.stages.iter().map(|(n, _)| n).collect();
        stages.sort();
        assert_eq!(names, stages, "children of {root:?}");
        assert_eq!(
            root.end_time_unix_nano - root.start_time_unix_nano,
            j.total_ns.unwrap() as u64
        );
        assert_eq!(root.start_time_unix_nano as i64, j.time.unwrap().unix_ns());
        for k in [
            "vm", "disk", "queue", "pid", "comm", "inode", "backend", "op", "bytes",
        ] {
            assert!(attr(root, k).is_some(), "no {k} on {root:?}");
        }
    }
}
