//! A real Prometheus for the fleet-output tests: Debian trixie's `prometheus`
//! package (2.53, a Go binary that runs on Debian 12's libc; its OTLP receiver
//! is `--enable-feature=otlp-write-receiver`), downloaded with the lab's private
//! apt and extracted into the cache, never installed.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use super::apt::{deb_extract, Apt};
use super::{lock_file, run};

/// The package, from a suite whose build runs on this host's libraries.
const PACKAGE: &str = "prometheus/trixie";

/// The Prometheus binary in `<cache>/prometheus-trixie/`, fetched on first use.
pub fn ensure_prometheus(cache: &Path) -> Result<PathBuf> {
    let dir = cache.join("prometheus-trixie");
    let bin = dir.join("root/usr/bin/prometheus");
    let _lock = lock_file(&cache.join("prometheus.lock"))?;
    if !bin.is_file() {
        eprintln!(
            "viotrace-vm: fetching Prometheus ({PACKAGE}) into {}",
            dir.display()
        );
        let debs = dir.join("debs");
        let _ = fs::remove_dir_all(&debs);
        let apt = Apt::new(cache)?;
        let got = apt.download(&[PACKAGE.to_string()], &debs)?;
        let root = dir.join("root");
        for d in &got {
            deb_extract(d, &root)?;
        }
        anyhow::ensure!(bin.is_file(), "{} has no usr/bin/prometheus", PACKAGE);
    }
    let v = run(Command::new(&bin).arg("--version"))
        .with_context(|| format!("{} does not run", bin.display()))?;
    anyhow::ensure!(
        v.contains("prometheus, version"),
        "unexpected --version: {v}"
    );
    Ok(bin)
}

/// VictoriaMetrics from Debian trixie (1.112): the OTLP-capable backend of the
/// fleet-output tests (Debian's Prometheus builds leave the OTLP receiver out).
/// OTLP metrics in at `/opentelemetry/v1/metrics`, Prometheus query API out.
pub fn ensure_victoria_metrics(cache: &Path) -> Result<PathBuf> {
    let dir = cache.join("victoria-metrics-trixie");
    let bin = dir.join("root/usr/bin/victoria-metrics");
    let _lock = lock_file(&cache.join("victoria-metrics.lock"))?;
    if !bin.is_file() {
        eprintln!(
            "viotrace-vm: fetching VictoriaMetrics into {}",
            dir.display()
        );
        let debs = dir.join("debs");
        let _ = fs::remove_dir_all(&debs);
        let apt = Apt::new(cache)?;
        let got = apt.download(&["victoria-metrics/trixie".to_string()], &debs)?;
        for d in &got {
            deb_extract(d, &dir.join("root"))?;
        }
        anyhow::ensure!(
            bin.is_file(),
            "victoria-metrics/trixie has no usr/bin/victoria-metrics"
        );
    }
    // Debian's build prints an empty version: that it runs is what is checked.
    run(Command::new(&bin).arg("-version"))
        .with_context(|| format!("{} does not run", bin.display()))?;
    Ok(bin)
}
