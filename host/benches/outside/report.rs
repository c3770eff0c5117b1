//! The rows and the printed table.

use std::time::Duration;

/// One printed row.
pub struct Row {
    pub name: &'static str,
    pub samples: Vec<Duration>,
    pub floor: Vec<Duration>,
    pub kubelet: Option<(f64, f64)>,
    /// Per step inside the daemon (stage label → seconds, one per operation).
    pub stages: std::collections::BTreeMap<String, Vec<f64>>,
}

impl Row {
    pub fn new(name: &'static str, kubelet: Option<(f64, f64)>) -> Row {
        Row {
            name,
            samples: Vec::new(),
            floor: Vec::new(),
            kubelet,
            stages: Default::default(),
        }
    }
}

pub fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e3
}

pub fn print_rows(rows: &mut [Row]) {
    println!(
        "\n{:<42} {:>5} {:>9} {:>9} {:>9} {:>7}   {:>17} {:>13}",
        "row (ms)", "n", "p50", "p99", "floor p50", "p50/fl", "kubelet p50/p99", "ratio p50/p99"
    );
    for row in rows.iter_mut() {
        if row.samples.is_empty() {
            continue;
        }
        row.samples.sort();
        row.floor.sort();
        let (p50, p99) = (pct(&row.samples, 0.5), pct(&row.samples, 0.99));
        let floor = if row.floor.is_empty() {
            f64::NAN
        } else {
            pct(&row.floor, 0.5)
        };
        let (kubelet, ratio) = match row.kubelet {
            Some((k50, k99)) => (
                format!("{k50:.2} / {k99:.2}"),
                format!("{:.2} / {:.2}", p50 / k50, p99 / k99),
            ),
            None => ("—".into(), "—".into()),
        };
        println!(
            "{:<42} {:>5} {:>9.3} {:>9.3} {:>9} {:>7}   {:>17} {:>13}",
            row.name,
            row.samples.len(),
            p50,
            p99,
            if floor.is_nan() {
                "—".to_string()
            } else {
                format!("{floor:.3}")
            },
            if floor.is_nan() {
                "—".to_string()
            } else {
                format!("{:.2}", p50 / floor)
            },
            kubelet,
            ratio
        );
    }
}
