//! Where an allocation's or a release's time went inside the daemon, read from its `/metrics`
//! (`pluglet_device_stage_duration_seconds`).

use std::io::Write as _;

use crate::report::Row;

/// Every step of the daemon's allocations and releases so far (`/metrics`,
/// `pluglet_device_stage_duration_seconds`): (operation, stage) → seconds in total.
pub type StageSums = std::collections::BTreeMap<(String, String), f64>;

/// The daemon's `/metrics` at `addr` (one HTTP/1.1 GET), headers included.
pub fn scrape(addr: &str) -> String {
    use std::io::Read as _;
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to /metrics");
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send the GET");
    let mut text = String::new();
    stream.read_to_string(&mut text).expect("read /metrics");
    text
}

/// The sum over every label set of the counter `name` in `text` (a [`scrape`]).
pub fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let value = match rest.strip_prefix('{') {
                Some(labelled) => labelled.split_once("} ")?.1,
                None => rest.strip_prefix(' ')?,
            };
            value.trim().parse::<f64>().ok()
        })
        .sum()
}

/// Reads [`StageSums`] from the daemon's `/metrics` at `addr`.
pub fn stage_sums(addr: &str) -> StageSums {
    let text = scrape(addr);
    let mut sums = StageSums::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("pluglet_device_stage_duration_seconds_sum{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels.split(',').find_map(|kv| {
                kv.strip_prefix(name)
                    .and_then(|v| v.strip_prefix("=\""))
                    .and_then(|v| v.strip_suffix('"'))
                    .map(str::to_owned)
            })
        };
        if let (Some(operation), Some(stage), Ok(value)) =
            (label("operation"), label("stage"), value.trim().parse())
        {
            sums.insert((operation, stage), value);
        }
    }
    sums
}

/// The steps of the daemon's allocations and releases, in their order (the `stage` values
/// of `pluglet_device_stage_duration_seconds`).
pub const STAGES: [&str; 9] = [
    "queue",
    "candidates",
    "preferred",
    "policy",
    "reserve",
    "plugin",
    "cdi",
    "commit",
    "cdi_remove",
];

/// Where the rows' time went inside the daemon: p50 of each step, µs.
pub fn print_stages(rows: &mut [Row]) {
    let shown: Vec<&str> = STAGES
        .into_iter()
        .filter(|stage| rows.iter().any(|r| r.stages.contains_key(*stage)))
        .collect();
    if shown.is_empty() {
        return;
    }
    println!(
        "\ninside the daemon, p50 per step in µs (/metrics pluglet_device_stage_duration_seconds; the p50s do not add up to the row's p50)"
    );
    let mut header = format!("{:<42}", "row");
    for stage in &shown {
        header += &format!(" {stage:>10}");
    }
    println!("{header}");
    for row in rows.iter_mut() {
        if row.stages.is_empty() {
            continue;
        }
        let mut line = format!("{:<42}", row.name);
        for stage in &shown {
            match row.stages.get_mut(*stage) {
                Some(samples) if !samples.is_empty() => {
                    samples.sort_by(f64::total_cmp);
                    let p50 = samples[(samples.len() - 1) / 2] * 1e6;
                    line += &format!(" {p50:>10.0}");
                }
                _ => line += &format!(" {:>10}", "—"),
            }
        }
        println!("{line}");
    }
}

/// What each step took between `before` and `now` (two [`stage_sums`]).
pub fn stages_since(now: &StageSums, before: &StageSums) -> StageSums {
    now.iter()
        .map(|(key, total)| (key.clone(), total - before.get(key).copied().unwrap_or(0.0)))
        .collect()
}

/// Adds what each step took since `before` to `allocate` (operation `allocate`) and
/// `release` (operation `release`); returns the sums now.
pub fn take_stages(
    addr: &str,
    before: &StageSums,
    allocate: &mut Row,
    release: &mut Row,
) -> StageSums {
    let now = stage_sums(addr);
    for ((operation, stage), spent) in stages_since(&now, before) {
        let row = match operation.as_str() {
            "allocate" => &mut *allocate,
            "release" => &mut *release,
            _ => continue,
        };
        if spent > 0.0 {
            row.stages.entry(stage).or_default().push(spent);
        }
    }
    now
}
