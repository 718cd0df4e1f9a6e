//! Latency percentiles and the printed report of each phase.

use std::collections::BTreeMap;
use std::time::Duration;

/// Count of each outcome name.
pub type Outcomes = BTreeMap<&'static str, u64>;

/// The measured figures of one phase.
#[derive(Debug)]
pub struct PhaseReport {
    name: String,
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

    /// The phase as JSON.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "phase": self.name,
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

/// Prints the phases as an aligned table.
pub fn print_table(reports: &[PhaseReport]) {
    println!(
        "{:<10} {:>9} {:>12} {:>10} {:>10} {:>10}  outcomes",
        "phase", "ops", "ops/s", "p50 µs", "p99 µs", "p99.9 µs"
    );
    for r in reports {
        let outcomes: Vec<String> = r.outcomes.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!(
            "{:<10} {:>9} {:>12.0} {:>10.1} {:>10.1} {:>10.1}  {}",
            r.name,
            r.ops,
            r.throughput(),
            r.p50.as_secs_f64() * 1e6,
            r.p99.as_secs_f64() * 1e6,
            r.p999.as_secs_f64() * 1e6,
            outcomes.join(" ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let lat: Vec<Duration> = (1..=1000).map(Duration::from_micros).collect();
        let r = PhaseReport::new("x", Duration::from_secs(1), lat, Outcomes::new());
        assert_eq!(r.p50, Duration::from_micros(500));
        assert_eq!(r.p99, Duration::from_micros(990));
        assert_eq!(r.p999, Duration::from_micros(999));
        assert_eq!(r.ops, 1000);
        let empty = PhaseReport::new("e", Duration::from_secs(1), Vec::new(), Outcomes::new());
        assert_eq!(empty.p99, Duration::ZERO);
    }
}
