//! The host agent's reports: the periodic tables, the clean stop's totals,
//! counters and stats line, and the metrics publication.

use anyhow::{Context, Result};
use libbpf_rs::RingBuffer;
use viotrace_shared::record::Stats;
use viotrace_shared::selfcost::CostReport;

use super::App;

impl App<'_> {
    /// The periodic tables: end to end, why-slow, and this agent's own.
    pub(super) fn tables(&mut self) {
        let every = humantime::format_duration(self.cli.interval);
        let s = &mut self.sink;
        if let Some(j) = s.joined.as_mut() {
            let mut t = String::new();
            if !j.out.interval.is_empty() {
                t = j.out.interval.render_table(&format!(
                    "== viotrace end-to-end (guest + host, host clock): last {every}"
                ));
                j.out.interval.drain_into(&mut j.total);
            }
            let title =
                format!("== viotrace why-slow: causes of the slow I/Os of the last {every}");
            if let Some(c) = j
                .out
                .verdicts
                .as_mut()
                .and_then(|v| v.take_interval(&title))
            {
                t += &c;
            }
            if !t.is_empty() {
                s.human(&t);
            }
        }
        if !s.interval.is_empty() {
            let t = s.interval.render_table(&format!(
                "== viotrace-host: last {every} (at +{:.1}s)",
                self.start.elapsed().as_secs_f64()
            ));
            s.human(&t);
            s.interval.drain_into(&mut s.total);
        }
        let _ = s.out.flush();
    }

    /// Clean stop: drain, detach everything, emit what was still waiting, and the
    /// totals, counters and final stats line.
    pub fn finish(mut self, rb: &RingBuffer, why: &str) -> Result<()> {
        self.drain(rb);
        let detaching = self.tracer.detach_all();
        self.drain(rb);
        let pids: Vec<u32> = self.tracer.targets.keys().copied().collect();
        for pid in pids {
            self.detach(pid, "agent stopping");
        }
        self.drain(rb);
        let mut transport = Vec::new();
        if let Some(mut j) = self.sink.joined.take() {
            let notes = j.finish()?;
            transport = j
                .vm_accounts()
                .iter()
                .map(|r| serde_json::to_value(r).unwrap_or_default())
                .collect();
            for n in notes {
                self.sink.human(&n);
            }
            j.out.interval.drain_into(&mut j.total);
            let t = j.total.render_table(&format!(
                "== viotrace end-to-end totals ({} records)",
                j.out.records
            ));
            self.sink.human(&t);
            // The final metrics publication below still reports the join's counters;
            // its slow-I/O trace sender is closed first, or the OTLP exporter's
            // finish would wait for it.
            j.out.otlp = None;
            self.sink.joined = Some(j);
        }
        let cost = self
            .cost
            .report(Some(self.tracer.bpf_runs()), self.sink.records);
        self.final_cost = Some(cost);
        if self.otlp.is_some() {
            // The last push carries the final counters.
            self.publish_metrics();
            if let Some(o) = self.otlp.as_mut() {
                o.finish();
            }
        }
        let stats = self.counters(&cost);
        self.final_lines(&stats, transport, why)?;
        self.sink
            .human(&format!("viotrace-host: {}\n", cost.line("request")));
        let _ = self.sink.out.flush();
        let _ = detaching.join();
        Ok(())
    }

    /// The totals table, the counters line and (with `--json`) the stats line.
    pub(super) fn final_lines(
        &mut self,
        stats: &[(String, u64)],
        transport: Vec<serde_json::Value>,
        why: &str,
    ) -> Result<()> {
        let unattributed = self.unattributed();
        let s = &mut self.sink;
        s.interval.drain_into(&mut s.total);
        let t = s.total.render_table(&format!(
            "== viotrace-host: totals over {:.1}s ({why})",
            self.start.elapsed().as_secs_f64()
        ));
        s.human(&t);
        let mut line = format!(
            "drops/counters: records={} unattributed={unattributed}",
            s.records
        );
        for (k, v) in stats {
            line += &format!(" {k}={v}");
        }
        line.push('\n');
        s.human(&line);
        if s.json {
            let mut line = Stats {
                stages: s.total.summaries(),
                transport: Some(transport),
                ..Stats::default()
            };
            line.values.insert("records".into(), s.records);
            line.values.insert("unattributed".into(), unattributed);
            line.values.extend(stats.iter().cloned());
            let _ = s.out.write(&line);
        }
        s.out.flush().context("writing stdout")
    }

    /// The counters of the final stats line and of the metrics endpoint besides
    /// `records` and `unattributed`: one list for both, so neither lacks one.
    fn counters(&self, cost: &CostReport) -> Vec<(String, u64)> {
        let mut c: Vec<(String, u64)> = self
            .tracer
            .stats()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        if self.explicit.is_empty() {
            c.push(("discovery_scans".into(), self.discoveries));
        }
        // The verifier's work at load (Linux 5.16+): all programs', the largest one's.
        if let Some((sum, top)) = self.verified {
            c.push(("startup_verified_insns".into(), sum));
            c.push(("startup_verified_insns_max".into(), u64::from(top)));
        }
        if let Some(j) = self.sink.joined.as_ref() {
            c.extend(j.counters());
        }
        c.extend(cost.counters().into_iter().map(|(k, v)| (k.to_string(), v)));
        if let Some(o) = &self.otlp {
            c.extend(o.stats.counters());
        }
        c
    }

    /// Publishes the counters of the final stats line (and each VM's clock
    /// uncertainty) to the metrics endpoint: once a second, not per record.
    pub(super) fn publish_metrics(&self) {
        let Some(m) = &self.metrics else { return };
        let unattributed = self.unattributed();
        let s = &self.sink;
        let mut c: Vec<(String, u64)> = vec![
            ("records".into(), s.records),
            ("unattributed".into(), unattributed),
        ];
        let mut g = Vec::new();
        if let Some(j) = s.joined.as_ref() {
            for (vm, u) in &j.out.clock_uncertainty {
                g.push((
                    "viotrace_clock_uncertainty_seconds".to_string(),
                    vm.clone(),
                    *u as f64 / 1e9,
                ));
            }
        }
        // The agent's own cost: live without the BPF run time, final with it.
        let cost = self
            .final_cost
            .unwrap_or_else(|| self.cost.report(None, s.records));
        c.extend(self.counters(&cost));
        m.set_counters(c);
        m.set_gauges(g);
    }
}
