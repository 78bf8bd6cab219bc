//! The host agent's OTLP exporter set-up (`--otlp`).

use std::sync::Arc;

use anyhow::{anyhow, Result};
use viotrace_shared::metrics::otlp::{Otlp, OtlpConfig};
use viotrace_shared::metrics::Metrics;

use crate::Cli;

/// Starts pushing to `base` (and the per-signal URL overrides).
pub fn start_otlp(cli: &Cli, base: &str, m: Arc<Metrics>) -> Result<Otlp> {
    let mut cfg =
        OtlpConfig::from_base(base, "viotrace-host").map_err(|e| anyhow!("--otlp: {e}"))?;
    if let Some(u) = &cli.otlp_metrics_url {
        cfg.metrics_url = u.clone();
    }
    if let Some(u) = &cli.otlp_traces_url {
        cfg.traces_url = u.clone();
    }
    eprintln!(
        "viotrace-host: OTLP metrics to {} every {:?}, slow-I/O traces to {}",
        cfg.metrics_url, cfg.interval, cfg.traces_url
    );
    Otlp::start(cfg, m).map_err(|e| anyhow!("--otlp: {e}"))
}
