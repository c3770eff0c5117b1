//! Crash consistency: the real daemon SIGKILLed at random moments while several clients
//! allocate and release through the admin API. After every restart, every allocation that was
//! answered is held with the same devices, nothing answered as released is held, no device is
//! held twice, and a call whose answer was lost to the kill went one way or the other, never
//! half (an allocation is held with all the devices it asked for, or not at all).
//!
//! The random moments come from a seeded generator; the seed is printed, and
//! `PLUGLET_CRASH_SEED=<seed>` runs the same schedule again.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pluglet_proto::admin::v1 as pb;
use pluglet_proto::admin::v1::admin_client::AdminClient;
use pluglet_uds::Channel;

use crate::device_support::{DevicePluginProcess, Flow};
use crate::support::{DEADLINE, Daemon, TestRoot};

const GPU: &str = "vendor.com/gpu";
const DEVICES: usize = 16;
const ROUNDS: usize = 100;
const CLIENTS: usize = 3;
/// The kill comes at a random moment this long at most after the storm starts.
const STORM_MAX: Duration = Duration::from_millis(120);

/// SplitMix64: small, seedable, good enough to pick moments and operations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What the clients were told, and what they were not.
#[derive(Default)]
struct Model {
    /// Pods whose allocation was answered and not released since: their devices.
    held: BTreeMap<String, Vec<String>>,
    /// Pods whose release was answered.
    released: BTreeSet<String>,
    /// Allocations whose answer was lost: the count asked for.
    maybe_allocated: BTreeMap<String, u32>,
    /// Releases whose answer was lost: the devices the pod held.
    maybe_released: BTreeMap<String, Vec<String>>,
    /// Pods a client is releasing right now (not offered to another release).
    releasing: BTreeSet<String>,
    acked_allocations: usize,
    acked_releases: usize,
    unknown_allocations: usize,
    unknown_releases: usize,
    /// Unknown calls found done / not done after the restart.
    unknown_done: usize,
    unknown_not_done: usize,
}

async fn admin(socket: &Path) -> Option<AdminClient<Channel>> {
    pluglet_uds::connect(socket, Duration::from_secs(2))
        .await
        .ok()
        .map(AdminClient::new)
}

/// A refusal the daemon itself answered: nothing was allocated.
fn refused(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::ResourceExhausted
            | tonic::Code::Aborted
            | tonic::Code::FailedPrecondition
            | tonic::Code::NotFound
            | tonic::Code::InvalidArgument
    )
}

/// One client: allocations of 1 or 2 devices to new pods and releases of its own pods, until a
/// call fails for a reason other than a refusal (the daemon is gone).
async fn client(socket: &Path, id: usize, round: usize, seed: u64, model: Arc<Mutex<Model>>) {
    let Some(mut admin) = admin(socket).await else {
        return;
    };
    let mut rng = Rng(seed);
    let mut n = 0;
    loop {
        n += 1;
        let mine: Vec<String> = {
            let model = model.lock().unwrap();
            model
                .held
                .keys()
                .filter(|p| p.starts_with(&format!("c{id}-")) && !model.releasing.contains(*p))
                .cloned()
                .collect()
        };
        let release = !mine.is_empty() && (mine.len() >= 3 || rng.below(3) == 0);
        if release {
            let pod = mine[rng.below(mine.len() as u64) as usize].clone();
            model.lock().unwrap().releasing.insert(pod.clone());
            let answer = admin
                .release(pb::ReleaseRequest {
                    pod_uid: pod.clone(),
                    container: String::new(),
                })
                .await;
            let mut model = model.lock().unwrap();
            model.releasing.remove(&pod);
            let devices = model.held.remove(&pod).expect("a held pod");
            match answer {
                Ok(_) => {
                    model.released.insert(pod);
                    model.acked_releases += 1;
                }
                Err(_) => {
                    model.maybe_released.insert(pod, devices);
                    model.unknown_releases += 1;
                    return;
                }
            }
        } else {
            let pod = format!("c{id}-r{round}-{n}");
            let count = 1 + rng.below(2) as u32;
            let answer = admin
                .allocate(pb::AllocateRequest {
                    pod_uid: pod.clone(),
                    container: "ctr".into(),
                    resource: GPU.into(),
                    count,
                    ..Default::default()
                })
                .await;
            let mut model = model.lock().unwrap();
            match answer {
                Ok(answer) => {
                    let ids = answer.into_inner().device_ids;
                    assert_eq!(ids.len(), count as usize, "{pod} answered {ids:?}");
                    model.held.insert(pod, ids);
                    model.acked_allocations += 1;
                }
                Err(status) if refused(&status) => {}
                Err(_) => {
                    model.maybe_allocated.insert(pod, count);
                    model.unknown_allocations += 1;
                    return;
                }
            }
        }
    }
}

/// Waits until the restarted daemon answers and the plugin is connected again; returns who
/// holds what, or `None` after [`DEADLINE`].
async fn wait_serving(socket: &Path) -> Option<BTreeMap<String, Vec<String>>> {
    let started = Instant::now();
    loop {
        if let Some(mut admin) = admin(socket).await {
            let connected = admin
                .list_resources(pb::ListResourcesRequest {})
                .await
                .map(|r| {
                    r.into_inner()
                        .resources
                        .iter()
                        .any(|r| r.resource == GPU && r.connected)
                })
                .unwrap_or(false);
            if connected
                && let Ok(list) = admin.list_allocations(pb::ListAllocationsRequest {}).await
            {
                return Some(
                    list.into_inner()
                        .allocations
                        .into_iter()
                        .map(|a| {
                            assert_eq!(a.container, "ctr");
                            assert_eq!(a.resource, GPU);
                            (a.pod_uid, a.device_ids)
                        })
                        .collect(),
                );
            }
        }
        if started.elapsed() > DEADLINE {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Checks what the restarted daemon holds against what the clients were told, then settles
/// the unknown calls by what it holds.
fn check(model: &mut Model, listed: &BTreeMap<String, Vec<String>>, round: usize, seed: u64) {
    let context = format!("round {round} (seed {seed})");
    for (pod, ids) in &model.held {
        assert_eq!(
            listed.get(pod),
            Some(ids),
            "{context}: acknowledged allocation of {pod} lost or changed"
        );
    }
    for pod in &model.released {
        assert!(
            !listed.contains_key(pod),
            "{context}: {pod} was released (acknowledged) but holds {:?}",
            listed[pod]
        );
    }
    let mut holders: BTreeMap<&String, &String> = BTreeMap::new();
    for (pod, ids) in listed {
        for id in ids {
            if let Some(other) = holders.insert(id, pod) {
                panic!("{context}: device {id} held by {other} and {pod}");
            }
        }
        if let Some(&count) = model.maybe_allocated.get(pod) {
            assert_eq!(ids.len(), count as usize, "{context}: {pod} half allocated");
        } else if let Some(before) = model.maybe_released.get(pod) {
            assert_eq!(ids, before, "{context}: {pod} half released");
        } else {
            assert!(
                model.held.contains_key(pod),
                "{context}: {pod} holds {ids:?} but no allocation of it was answered or in flight"
            );
        }
    }
    for (pod, _) in std::mem::take(&mut model.maybe_allocated) {
        match listed.get(&pod) {
            Some(ids) => {
                model.held.insert(pod, ids.clone());
                model.unknown_done += 1;
            }
            None => model.unknown_not_done += 1,
        }
    }
    for (pod, ids) in std::mem::take(&mut model.maybe_released) {
        if listed.contains_key(&pod) {
            model.held.insert(pod, ids);
            model.unknown_not_done += 1;
        } else {
            model.released.insert(pod);
            model.unknown_done += 1;
        }
    }
}

#[test]
fn sigkill_during_an_allocation_storm_loses_nothing_acknowledged() {
    let seed = std::env::var("PLUGLET_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("crash consistency seed {seed} (PLUGLET_CRASH_SEED={seed} repeats it)");
    let started = Instant::now();
    let mut rng = Rng(seed);
    let root = TestRoot::new();
    let socket = root.admin_socket();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let model = Arc::new(Mutex::new(Model::default()));
    let mut daemon = Daemon::start(&root.path(), &[]);
    let devices = DEVICES.to_string();
    // --reregister: the plugin binds and registers again when a restart removes its socket.
    let _plugin = DevicePluginProcess::start(
        &root,
        Flow::Classic,
        GPU,
        &["--devices", &devices, "--reregister"],
    );
    for round in 0..ROUNDS {
        let serving = |daemon: &Daemon| {
            runtime.block_on(wait_serving(&socket)).unwrap_or_else(|| {
                panic!(
                    "round {round} (seed {seed}): the daemon did not serve with its plugin \
                     connected within {DEADLINE:?}; log:\n{}",
                    daemon.log_text()
                )
            })
        };
        serving(&daemon);
        let clients: Vec<_> = (0..CLIENTS)
            .map(|id| {
                let (socket, model) = (socket.clone(), model.clone());
                let seed = rng.next();
                runtime.spawn(async move { client(&socket, id, round, seed, model).await })
            })
            .collect();
        let moment = Duration::from_micros(rng.below(STORM_MAX.as_micros() as u64));
        std::thread::sleep(moment);
        daemon.kill();
        for task in clients {
            if let Err(err) = runtime.block_on(task) {
                std::panic::resume_unwind(err.into_panic());
            }
        }
        daemon = Daemon::spawn(&root.path(), &[]);
        let listed = serving(&daemon);
        check(&mut model.lock().unwrap(), &listed, round, seed);
    }
    let model = model.lock().unwrap();
    eprintln!(
        "crash consistency: {ROUNDS} rounds, {} acknowledged allocations, {} acknowledged releases, \
         {} in-flight unknowns ({} allocations, {} releases; {} found done, {} not done), \
         {} pods held at the end, {:.1} s",
        model.acked_allocations,
        model.acked_releases,
        model.unknown_allocations + model.unknown_releases,
        model.unknown_allocations,
        model.unknown_releases,
        model.unknown_done,
        model.unknown_not_done,
        model.held.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        model.acked_allocations >= ROUNDS,
        "too few allocations answered for the test to mean anything"
    );
    drop(daemon);
}
