//! Reading the guest agent's human output (tables and counters).

/// The rows of `label` in the guest log's totals table: stage → count.
pub fn totals_rows(log: &str, label: &str) -> std::collections::BTreeMap<String, u64> {
    let totals = log
        .split("=== viotrace-guest totals")
        .nth(1)
        .unwrap_or_else(|| panic!("no totals table: {log}"));
    let mut rows = std::collections::BTreeMap::new();
    let mut inside = false;
    for l in totals.lines().skip(1) {
        if l.starts_with("  ") && !l.starts_with("    ") {
            inside = l.trim() == label;
        } else if let (true, [stage, count, ..]) =
            (inside, &l.split_whitespace().collect::<Vec<_>>()[..])
        {
            if let Ok(n) = count.parse() {
                rows.insert(stage.to_string(), n);
            }
        }
    }
    rows
}

/// A counter of the totals' `counters:` line.
pub fn counter(log: &str, name: &str) -> u64 {
    let line = log
        .lines()
        .find(|l| l.trim_start().starts_with("counters:"));
    line.and_then(|l| {
        l.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
    })
    .and_then(|v| v.parse().ok())
    .unwrap_or_else(|| panic!("no counter {name}: {log}"))
}
