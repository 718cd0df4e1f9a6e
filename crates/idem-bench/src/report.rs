//! Latency percentiles and the printed report of each phase.

use std::collections::BTreeMap;
use std::time::Duration;

/// Count of each outcome name.
pub type Outcomes = BTreeMap<&'static str, u64>;

/// The measured figures of one phase.
#[derive(Debug)]
pub struct PhaseReport {
    name: String,
    concurrency: usize,
    ops: usize,
    elapsed: Duration,
    p50: Duration,
    p99: Duration,
    p999: Duration,
    outcomes: Outcomes,
}

impl PhaseReport {
    /// Summarises a phase's latencies (one per operation).
    pub fn new(
        name: &str,
        concurrency: usize,
        elapsed: Duration,
        mut latencies: Vec<Duration>,
        outcomes: Outcomes,
    ) -> Self {
        latencies.sort_unstable();
        // Nearest-rank percentile, in per mille and integer arithmetic (no float rounding).
        let pct = |per_mille: usize| -> Duration {
            if latencies.is_empty() {
                return Duration::ZERO;
            }
            let rank = (per_mille * latencies.len()).div_ceil(1000);
            latencies[rank.clamp(1, latencies.len()) - 1]
        };
        Self {
            name: name.to_owned(),
            concurrency,
            ops: latencies.len(),
            elapsed,
            p50: pct(500),
            p99: pct(990),
            p999: pct(999),
            outcomes,
        }
    }

    /// Operations per second.
    pub fn throughput(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64().max(f64::EPSILON)
    }

    /// Operations completed.
    pub fn ops(&self) -> usize {
        self.ops
    }

    /// Counts `ops` operations instead of one per latency sample (for phases whose
    /// samples are not one per operation).
    pub fn set_ops(&mut self, ops: usize) {
        self.ops = ops;
    }

    /// Median latency.
    pub fn p50(&self) -> Duration {
        self.p50
    }

    /// 99th percentile latency.
    pub fn p99(&self) -> Duration {
        self.p99
    }

    /// Mean time of one operation as one caller sees it: concurrency / throughput.
    pub fn mean_latency(&self) -> Duration {
        Duration::from_secs_f64(self.concurrency as f64 / self.throughput().max(f64::EPSILON))
    }

    /// The phase as JSON.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "phase": self.name,
            "concurrency": self.concurrency,
            "ops": self.ops,
            "seconds": self.elapsed.as_secs_f64(),
            "ops_per_sec": self.throughput(),
            "p50_us": self.p50.as_secs_f64() * 1e6,
            "p99_us": self.p99.as_secs_f64() * 1e6,
            "p999_us": self.p999.as_secs_f64() * 1e6,
            "outcomes": self.outcomes,
        })
    }
}

/// Prints a run: one JSON document (`doc`, with the phases and the figures added), or
/// `header`, then the phases' table (when there are any) and the figures.
pub fn print(
    json: bool,
    mut doc: serde_json::Value,
    header: &str,
    reports: &[PhaseReport],
    figures: &[Figure],
) {
    if json {
        if !reports.is_empty() {
            doc["phases"] = reports.iter().map(PhaseReport::to_json).collect();
        }
        doc["figures"] = figures.iter().map(Figure::to_json).collect();
        println!("{doc:#}");
        return;
    }
    println!("{header}");
    if !reports.is_empty() {
        print_table(reports);
    }
    print_figures(figures);
}

/// The median of `values` (NaN when there are none).
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Prints the phases as an aligned table.
fn print_table(reports: &[PhaseReport]) {
    println!(
        "{:<22} {:>4} {:>8} {:>10} {:>9} {:>9} {:>9}  outcomes",
        "phase", "C", "ops", "ops/s", "p50 µs", "p99 µs", "p99.9 µs"
    );
    for r in reports {
        let outcomes: Vec<String> = r.outcomes.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!(
            "{:<22} {:>4} {:>8} {:>10.0} {:>9.1} {:>9.1} {:>9.1}  {}",
            r.name,
            r.concurrency,
            r.ops,
            r.throughput(),
            r.p50.as_secs_f64() * 1e6,
            r.p99.as_secs_f64() * 1e6,
            r.p999.as_secs_f64() * 1e6,
            outcomes.join(" ")
        );
    }
}

/// A bound a figure should meet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Target {
    /// The figure should be at least this.
    AtLeast(f64),
    /// The figure should be at most this.
    AtMost(f64),
}

impl Target {
    fn met(self, value: f64) -> bool {
        match self {
            Self::AtLeast(t) => value >= t,
            Self::AtMost(t) => value <= t,
        }
    }

    fn describe(self) -> String {
        match self {
            Self::AtLeast(t) => format!(">= {t}"),
            Self::AtMost(t) => format!("<= {t}"),
        }
    }
}

/// A derived figure: a ratio to a floor, server CPU per operation, bytes per record.
#[derive(Debug, Clone)]
pub struct Figure {
    /// What it is, e.g. `lifecycle C=1 / (2 x PING)`.
    pub name: String,
    /// The value.
    pub value: f64,
    /// Its unit (`""` for a ratio).
    pub unit: &'static str,
    /// The issue's target, if it sets one.
    pub target: Option<Target>,
    /// How it was computed, from which measured figures.
    pub basis: String,
}

impl Figure {
    /// A figure without a target.
    pub fn new(name: impl Into<String>, value: f64, unit: &'static str, basis: String) -> Self {
        Self {
            name: name.into(),
            value,
            unit,
            target: None,
            basis,
        }
    }

    /// The ratio of two throughputs in operations per second, `ours` over `theirs`, both
    /// named in its basis: `"<ours>/s vs <theirs>/s <what theirs is>"`.
    pub fn ratio(name: impl Into<String>, ours: f64, theirs: f64, theirs_is: &str) -> Self {
        let basis = format!("{ours:.0}/s vs {theirs:.0}/s {theirs_is}");
        Self::new(name, ours / theirs, "", basis)
    }

    /// Sets the target.
    pub fn target(mut self, target: Target) -> Self {
        self.target = Some(target);
        self
    }

    /// `Some(true)` when it meets its target, `None` without one.
    pub fn met(&self) -> Option<bool> {
        self.target.map(|t| t.met(self.value))
    }

    /// The figure as JSON.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "target": self.target.map(Target::describe),
            "met": self.met(),
            "basis": self.basis,
        })
    }
}

/// Prints the derived figures, one a line.
fn print_figures(figures: &[Figure]) {
    if figures.is_empty() {
        return;
    }
    println!();
    println!(
        "{:<44} {:>10} {:<6} {:>9} {:<6}  basis",
        "figure", "value", "unit", "target", ""
    );
    for f in figures {
        let (target, verdict) = match (f.target, f.met()) {
            (Some(t), Some(true)) => (t.describe(), "met"),
            (Some(t), _) => (t.describe(), "MISSED"),
            (None, _) => (String::new(), ""),
        };
        let value = if f.unit.is_empty() {
            format!("{:.3}", f.value)
        } else {
            format!("{:.1}", f.value)
        };
        println!(
            "{:<44} {:>10} {:<6} {:>9} {:<6}  {}",
            f.name, value, f.unit, target, verdict, f.basis
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let lat: Vec<Duration> = (1..=1000).map(Duration::from_micros).collect();
        let r = PhaseReport::new("x", 1, Duration::from_secs(1), lat, Outcomes::new());
        assert_eq!(r.p50, Duration::from_micros(500));
        assert_eq!(r.p99, Duration::from_micros(990));
        assert_eq!(r.p999, Duration::from_micros(999));
        assert_eq!(r.ops, 1000);
        let empty = PhaseReport::new("e", 1, Duration::from_secs(1), Vec::new(), Outcomes::new());
        assert_eq!(empty.p99, Duration::ZERO);
    }

    #[test]
    fn mean_latency_is_concurrency_over_throughput() {
        let lat = vec![Duration::from_micros(100); 1000];
        let r = PhaseReport::new("x", 4, Duration::from_millis(100), lat, Outcomes::new());
        // 1000 ops in 0.1 s = 10,000/s; with 4 in flight, each took 400 µs on average.
        assert_eq!(r.mean_latency().as_micros(), 400);
    }

    #[test]
    fn targets_judge_both_directions() {
        let f = Figure::new("r", 0.85, "", String::new());
        assert_eq!(f.met(), None);
        assert_eq!(f.clone().target(Target::AtLeast(0.8)).met(), Some(true));
        assert_eq!(f.clone().target(Target::AtLeast(0.9)).met(), Some(false));
        assert_eq!(f.target(Target::AtMost(0.8)).met(), Some(false));
    }
}
