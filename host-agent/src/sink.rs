//! Where the host agent's own records go: JSON lines, per-stage tables,
//! slow-element waterfalls, metrics, and the joined mode's input.

use std::io::Write;

use viotrace_shared::jsonl::JsonLines;
use viotrace_shared::record::HostElem;
use viotrace_shared::stats::{render_waterfall, Aggregator, PairLabel};

use crate::joined;

/// Where the records go, and the aggregates built from them.
pub struct Sink {
    pub json: bool,
    pub threshold_ns: Option<u64>,
    pub interval: Aggregator,
    pub total: Aggregator,
    pub out: JsonLines<std::io::BufWriter<std::io::Stdout>>,
    pub records: u64,
    pub joined: Option<joined::Joined>,
    pub metrics: Option<viotrace_shared::metrics::Recorder>,
    pub label: PairLabel,
}

impl Sink {
    pub fn human(&mut self, s: &str) {
        if self.json {
            eprint!("{s}");
        } else {
            let _ = self.out.get_mut().write_all(s.as_bytes());
        }
    }

    /// One host element: statistics, outputs, then the join (which keeps a
    /// compact copy of what it reads).
    pub fn elem(&mut self, e: HostElem) {
        self.records += 1;
        let label = self.label.get(&e.vm, &e.device);
        // In joined mode the end-to-end records carry these stages (source="joined"):
        // recording them per element too would double the exporter's cost.
        // Into the interval only: the totals take whole intervals (drain_into).
        let total_ns = match self.metrics.as_mut().filter(|_| self.joined.is_none()) {
            Some(m) => {
                let b = viotrace_shared::join::host_breakdown(&e);
                let (q, op) = (Some(e.queue), e.op);
                m.record(
                    "host", &e.vm, &e.device, q, op, e.bytes, &b.stages, b.total_ns, true,
                );
                self.interval.record_breakdown(label, &b);
                b.total_ns
            }
            None => self.interval.record_points(label, &e.ts),
        };
        if self.json {
            let _ = self.out.write(&e);
        }
        if let Some(th) = self.threshold_ns {
            if total_ns.is_some_and(|t| t >= 0 && t as u64 >= th) {
                let header = format!(
                    "slow element: vm={} disk={} q{} head={} {} sector={} bytes={} backend={:?} merge_id={} status={} at {}",
                    e.vm,
                    e.device,
                    e.queue,
                    e.head,
                    e.op,
                    e.sector,
                    e.bytes,
                    e.backend,
                    e.merge_id,
                    e.status.map_or("-".to_string(), |s| s.to_string()),
                    e.time.map_or("?".to_string(), |t| t.to_string())
                );
                let w = render_waterfall(&header, &e.ts);
                self.human(&w);
            }
        }
        if let Some(j) = self.joined.as_mut() {
            j.host_elem(&e);
        }
    }
}
