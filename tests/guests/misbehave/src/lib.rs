//! Test guest that misbehaves on request: the `mode` setting chooses what `validate` does.
//!
//! | mode | behaviour |
//! |---|---|
//! | `by-name` | the mode named by the plugin's name (so one slot can be called well and badly) |
//! | `ok` (default) | accepts, logs the node name, `accepted.version` = setting `version` |
//! | `loop` | spins forever (hits the deadline or the fuel budget) |
//! | `spin` | spins for setting `ms` milliseconds (default 5), then accepts |
//! | `sleep` | sleeps setting `ms` milliseconds (default 100; wall time without CPU), then accepts |
//! | `naps` | sleeps 1 ms at a time until setting `ms` milliseconds (default 100) have passed |
//! | `burn` | runs setting `iterations` loop iterations (default 1000), then accepts |
//! | `alloc` | allocates 1 MiB blocks forever (hits the memory cap) |
//! | `alloc-some` | allocates and touches setting `mib` MiB (default 4), then accepts |
//! | `panic` | panics with "misbehave: asked to panic" |
//! | `log` | logs setting `lines` lines (default 10), then accepts |
//! | `refuse` | refuses with kind `other` |
//! | `count` | logs `call N of this instance`, N counting the calls this instance has run, then accepts |
//! | `recurse` | recurses without end (overflows the call stack) |
//! | `huge-message[:MIB]` | refuses with a message of MIB MiB (default 100) |
//! | `huge-version[:MIB]` | accepts with a version of MIB MiB (default 100) |
//! | `huge-log[:MIB]` | logs a line of MIB MiB (default 100), then accepts |
//!
//! It also exports `allocation-policy`; the `allocate` setting chooses what that hook answers:
//! `ok` (default, the SDK's first fit), `unknown-id` (the last id replaced by `no-such-device`),
//! `too-few` (one id short), `duplicate` (the first id twice), `huge-ids[:N]` (N empty ids, default
//! 2,000,000), `by-request` (the mode named by the request's first preferred id, `ok`
//! without one), or any `mode` above (run first).

use pluglet_guest::{
    Accepted, AllocationPolicy, AllocationRequest, PluginInfo, Refusal, RefusalKind,
    RegisteredPlugin, Registration,
};

/// The misbehaving handler.
pub struct Misbehave;

fn number(key: &str, default: u64) -> u64 {
    pluglet_guest::setting(key)
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs the behaviour `mode` asks for.
pub fn run(mode: &str) -> Result<Accepted, Refusal> {
    let (mode, size) = mode.split_once(':').unwrap_or((mode, ""));
    let huge = || "x".repeat(size.parse::<usize>().unwrap_or(100) << 20);
    match mode {
        "huge-message" => return Err(Refusal::new(RefusalKind::Other, huge())),
        "huge-version" => {
            return Ok(Accepted {
                version: Some(huge()),
            });
        }
        "huge-log" => pluglet_guest::info(&huge()),
        "loop" => {
            let mut x = 0u64;
            loop {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        }
        "spin" => {
            let until =
                std::time::Instant::now() + std::time::Duration::from_millis(number("ms", 5));
            let mut x = 0u64;
            while std::time::Instant::now() < until {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        }
        "sleep" => std::thread::sleep(std::time::Duration::from_millis(number("ms", 100))),
        "naps" => {
            let until =
                std::time::Instant::now() + std::time::Duration::from_millis(number("ms", 100));
            while std::time::Instant::now() < until {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        "burn" => {
            let mut x = 0u64;
            for i in 0..number("iterations", 1000) {
                x = std::hint::black_box(x.wrapping_add(i));
            }
        }
        "alloc" => {
            let mut blocks: Vec<Vec<u8>> = Vec::new();
            loop {
                let block = vec![1u8; 1 << 20];
                blocks.push(std::hint::black_box(block));
            }
        }
        "alloc-some" => {
            let block = vec![1u8; (number("mib", 4) as usize) << 20];
            std::hint::black_box(&block);
        }
        "panic" => panic!("misbehave: asked to panic"),
        "recurse" => {
            std::hint::black_box(recurse(0));
        }
        "log" => {
            for i in 0..number("lines", 10) {
                pluglet_guest::info(&format!("line {i}"));
            }
        }
        "count" => {
            static CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            pluglet_guest::info(&format!("call {n} of this instance"));
        }
        "refuse" => {
            return Err(Refusal::new(
                RefusalKind::Other,
                "misbehave: asked to refuse",
            ));
        }
        _ => pluglet_guest::info(&format!("ok on node {}", pluglet_guest::node_name())),
    }
    Ok(Accepted {
        version: pluglet_guest::setting("version"),
    })
}

/// Calls itself until the stack overflows (the end it names is never reached); `black_box`
/// keeps the compiler from turning it into a loop.
fn recurse(depth: u64) -> u64 {
    if depth == u64::MAX {
        return 0;
    }
    std::hint::black_box(recurse(std::hint::black_box(depth + 1))) + 1
}

impl Registration for Misbehave {
    fn validate(
        plugin: PluginInfo,
        _existing: Option<RegisteredPlugin>,
    ) -> Result<Accepted, Refusal> {
        match pluglet_guest::setting("mode").as_deref() {
            Some("by-name") => run(&plugin.name),
            Some(mode) => run(mode),
            None => run("ok"),
        }
    }
}

impl AllocationPolicy for Misbehave {
    fn allocate(request: AllocationRequest) -> Result<Vec<String>, Refusal> {
        let mode = match pluglet_guest::setting("allocate").as_deref() {
            Some("by-request") => request
                .preferred
                .as_ref()
                .and_then(|p| p.first().cloned())
                .unwrap_or_else(|| "ok".into()),
            Some(mode) => mode.to_owned(),
            None => "ok".into(),
        };
        answer(&mode, &request)
    }
}

/// What the `allocate` hook answers in `mode` (see the crate doc).
pub fn answer(mode: &str, request: &AllocationRequest) -> Result<Vec<String>, Refusal> {
    match mode {
        "ok" | "unknown-id" | "too-few" | "duplicate" => {}
        huge if huge.starts_with("huge-ids") => {
            let count = huge
                .strip_prefix("huge-ids:")
                .and_then(|n| n.parse().ok())
                .unwrap_or(2_000_000);
            return Ok(vec![String::new(); count]);
        }
        other => {
            run(other)?;
        }
    }
    let mut ids = pluglet_guest::first_fit(request)?;
    match mode {
        "unknown-id" => {
            ids.pop();
            ids.push("no-such-device".into());
        }
        "too-few" => {
            ids.pop();
        }
        "duplicate" => {
            if let Some(first) = ids.first().cloned() {
                ids.pop();
                ids.push(first);
            }
        }
        _ => {}
    }
    Ok(ids)
}

pluglet_guest::export_handler!(Misbehave: registration, allocation_policy);
