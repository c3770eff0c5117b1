//! A plugin's Allocate calls: one at a time, with the allocations that became ready while a
//! call ran asked together in the next one (as the journal's group commit makes the changes
//! that became ready during a sync durable with the next one).
//!
//! The kubelet admits one pod at a time, so a plugin never has two of its Allocate calls at
//! once. Pluglet allocates concurrently, and keeps that for each plugin: while a call runs, the
//! allocations that reach the plugin wait in a queue, and the next call asks for all of them
//! (at most [`AllocateCalls::new`]'s `batch`), one `ContainerAllocateRequest` each. The API's
//! request is a list of containers, answered in the same order, so a plugin that loops over
//! `container_requests` (as the kubelet's sample device plugin does) needs nothing new, and
//! `--device-allocate-batch 1` asks one container per call for one that does not. A busy
//! plugin then pays its per-call cost (the gRPC round trip, for a Python plugin about a quarter
//! of a millisecond of CPU) once per call, not once per allocation. An allocation that finds no
//! call running is asked at once, by its own task: a lone allocation waits for nothing.
//!
//! A plugin that answers a call of several containers with another number of answers is asked
//! one container per call from then on (that call's allocations are asked again, one by one).
//! A call of several that the plugin refuses is asked again one container at a time, so one
//! container's refusal fails only its own allocation. A call that timed out or whose connection
//! failed fails every allocation in it: asking again would only wait again. Each allocation
//! has the call's timeout from the moment it reaches the plugin, its wait for the calls before
//! its own included: a call's deadline is that of the oldest allocation in it, and one whose
//! time ran out while it waited is answered so without being asked for.
//!
//! The queue is a short mutex; no task runs while the plugin is idle. When the call that an
//! allocation made itself ends (or its caller stops waiting) with allocations queued, a task is
//! started that calls for the queue until it is empty. Allocations whose callers stopped
//! waiting before their call was sent are left out of it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pluglet_core::ResourceName;
use pluglet_uds::{Channel, RpcError};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::answer::{AllocateIds, AllocateRequestIds, ContainerAnswers, ReadAnswer};

/// What an allocation hears from its plugin.
#[derive(Debug)]
pub(crate) struct Called {
    /// The answer for its container (`None`: the plugin answered no container).
    pub answer: Result<Option<ReadAnswer>, RpcError>,
    /// How many Allocate calls to count for it: the call it was first in, and the call it
    /// was asked again in alone.
    pub calls: u32,
}

/// One plugin's Allocate calls (see the module doc). Shared by the allocations of its
/// endpoint.
#[derive(Debug)]
pub(crate) struct AllocateCalls {
    resource: ResourceName,
    channel: Channel,
    batch: usize,
    timeout: Duration,
    /// Set when the plugin answered a call of several containers wrongly.
    one_per_call: AtomicBool,
    queue: Mutex<Queue>,
}

#[derive(Debug, Default)]
struct Queue {
    /// Whether a call runs (or a task is about to make the next one).
    busy: bool,
    waiting: VecDeque<Waiting>,
}

/// An allocation waiting for the plugin's next call.
#[derive(Debug)]
struct Waiting {
    ids: AllocateIds,
    /// When it reached the plugin plus the call's timeout.
    deadline: Instant,
    answer: oneshot::Sender<Called>,
}

impl AllocateCalls {
    /// The Allocate calls of `resource`'s plugin on `channel`: at most `batch` containers in a
    /// call (1: one per call, as the kubelet asks). Each allocation hears an answer within
    /// `timeout` of reaching the plugin, its wait for the calls before its own included.
    pub fn new(
        resource: ResourceName,
        channel: Channel,
        batch: usize,
        timeout: Duration,
    ) -> AllocateCalls {
        AllocateCalls {
            resource,
            channel,
            batch: batch.max(1),
            timeout,
            one_per_call: AtomicBool::new(false),
            queue: Mutex::new(Queue::default()),
        }
    }

    /// Asks the plugin to allocate `ids` to one container: at once when no call runs,
    /// otherwise in the next call.
    pub async fn allocate(self: &Arc<Self>, ids: AllocateIds) -> Called {
        let deadline = Instant::now() + self.timeout;
        let queued = {
            let mut queue = self.lock();
            if queue.busy {
                let (answer, answered) = oneshot::channel();
                queue.waiting.push_back(Waiting {
                    ids,
                    deadline,
                    answer,
                });
                Err(answered)
            } else {
                queue.busy = true;
                Ok(ids)
            }
        };
        match queued {
            Ok(ids) => {
                let turn = Turn(self);
                let called = self.call_one(ids, deadline).await;
                drop(turn);
                called
            }
            Err(answered) => answered.await.unwrap_or_else(|_| Called {
                answer: Err(RpcError(tonic::Status::cancelled(
                    "the Allocate call was abandoned: the daemon is stopping",
                ))),
                calls: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// After a call an allocation made itself: the queue's next calls go to a task of their
    /// own, or the plugin is idle again.
    fn hand_on(self: &Arc<Self>) {
        let mut queue = self.lock();
        if queue.waiting.is_empty() {
            queue.busy = false;
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime to call from (it is gone): the queued allocations hear that when
            // their answers are dropped with the queue.
            queue.waiting.clear();
            queue.busy = false;
            return;
        };
        drop(queue);
        let calls = Arc::clone(self);
        runtime.spawn(async move { calls.drain().await });
    }

    /// Calls for the queue until it is empty.
    async fn drain(self: Arc<Self>) {
        loop {
            let (next, expired) = {
                let mut queue = self.lock();
                queue.waiting.retain(|w| !w.answer.is_closed());
                if queue.waiting.is_empty() {
                    queue.busy = false;
                    return;
                }
                // Those whose time ran out while they waited are answered so, not asked for.
                let now = Instant::now();
                let expired = queue
                    .waiting
                    .iter()
                    .take_while(|w| w.deadline <= now)
                    .count();
                let expired: Vec<Waiting> = queue.waiting.drain(..expired).collect();
                let size = if self.one_per_call.load(Ordering::Relaxed) {
                    1
                } else {
                    self.batch
                };
                let size = size.min(queue.waiting.len());
                let next: Vec<Waiting> = queue.waiting.drain(..size).collect();
                (next, expired)
            };
            for w in expired {
                let _ = w.answer.send(Called {
                    answer: Err(self.expired()),
                    calls: 0,
                });
            }
            if !next.is_empty() {
                self.call(next).await;
            }
        }
    }

    /// One call for `waiting` (at least one, oldest first), and each answer sent.
    async fn call(&self, mut waiting: Vec<Waiting>) {
        if waiting.len() == 1 {
            let one = waiting.pop().expect("one waiting");
            let called = self.call_one(one.ids, one.deadline).await;
            let _ = one.answer.send(called);
            return;
        }
        let asked = waiting.len();
        // The oldest's deadline is the soonest.
        let deadline = waiting[0].deadline;
        let request = AllocateRequestIds::Several(waiting.iter().map(|w| w.ids.clone()).collect());
        let answered = self.send(request, deadline).await;
        match answered {
            Ok(answers) if answers.len() == asked => {
                for (k, (w, answer)) in waiting.into_iter().zip(answers).enumerate() {
                    let _ = w.answer.send(Called {
                        answer: Ok(Some(answer)),
                        calls: u32::from(k == 0),
                    });
                }
            }
            Ok(answers) => {
                tracing::warn!(
                    resource = %self.resource,
                    asked,
                    answered = answers.len(),
                    "the device plugin answered an Allocate call of several containers with \
                     another number of answers; it is asked one container per call from now on"
                );
                self.one_per_call.store(true, Ordering::Relaxed);
                self.one_by_one(waiting).await;
            }
            Err(err) if failed_for_all(&err) => {
                for (k, w) in waiting.into_iter().enumerate() {
                    let _ = w.answer.send(Called {
                        answer: Err(err.clone()),
                        calls: u32::from(k == 0),
                    });
                }
            }
            Err(err) => {
                tracing::debug!(
                    resource = %self.resource,
                    asked,
                    error = %err,
                    "the device plugin refused an Allocate call of several containers; asking \
                     for each alone"
                );
                self.one_by_one(waiting).await;
            }
        }
    }

    /// Each of `waiting` asked alone, in order, after a call of them all that counts for the
    /// first.
    async fn one_by_one(&self, waiting: Vec<Waiting>) {
        for (k, w) in waiting.into_iter().enumerate() {
            // The calls before this one may have used up its time.
            let mut called = if w.deadline <= Instant::now() {
                Called {
                    answer: Err(self.expired()),
                    calls: 0,
                }
            } else {
                self.call_one(w.ids, w.deadline).await
            };
            called.calls += u32::from(k == 0);
            let _ = w.answer.send(called);
        }
    }

    /// A call for one container, answered by `deadline`.
    async fn call_one(&self, ids: AllocateIds, deadline: Instant) -> Called {
        let answer = self
            .send(AllocateRequestIds::One(ids), deadline)
            .await
            .map(ContainerAnswers::first);
        Called { answer, calls: 1 }
    }

    async fn send(
        &self,
        request: AllocateRequestIds,
        deadline: Instant,
    ) -> Result<ContainerAnswers, RpcError> {
        let call = super::allocate(self.channel.clone(), request);
        match tokio::time::timeout_at(deadline, call).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(status)) => Err(RpcError(status)),
            Err(_) => Err(self.expired()),
        }
    }

    /// The error of an allocation the plugin did not answer in time.
    fn expired(&self) -> RpcError {
        RpcError(tonic::Status::deadline_exceeded(format!(
            "no answer within {:?} (the plugin's calls before this allocation's included)",
            self.timeout
        )))
    }
}

/// Whether a failed call would fail again for each container alone: no answer in time, or
/// no connection.
fn failed_for_all(err: &RpcError) -> bool {
    matches!(
        err.code(),
        tonic::Code::DeadlineExceeded | tonic::Code::Unavailable | tonic::Code::Cancelled
    )
}

/// The turn of an allocation that calls the plugin itself: when it ends (or its caller stops
/// waiting), the queue is handed on.
struct Turn<'a>(&'a Arc<AllocateCalls>);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.0.hand_on();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use pluglet_proto::v1beta1::DevicePluginOptions;
    use pluglet_test_support::stub::{Stub, devices};
    use tokio::sync::Semaphore;
    use tokio::task::JoinHandle;

    use super::*;
    use crate::device_id::DeviceId;

    /// A stub plugin of 8 devices (kept while its directory is) and calls of at most `batch`.
    struct Plugin {
        _dir: tempfile::TempDir,
        stub: Stub,
        calls: Arc<AllocateCalls>,
    }

    impl Plugin {
        async fn start(batch: usize) -> Plugin {
            let dir = tempfile::tempdir().unwrap();
            let stub = Stub::start(
                &dir.path().join("dp.sock"),
                devices(8, 0),
                DevicePluginOptions::default(),
            );
            let calls = calls(&stub, batch).await;
            Plugin {
                _dir: dir,
                stub,
                calls,
            }
        }

        /// The containers each call asked for since the last look.
        fn sizes(&self) -> Vec<usize> {
            std::mem::take(&mut *self.stub.state.allocate_sizes.lock().unwrap())
        }

        /// Holds the stub's Allocate calls until the gate's permits are added.
        fn gate(&self) -> Arc<Semaphore> {
            let gate = Arc::new(Semaphore::new(0));
            *self.stub.state.allocate_gate.lock().unwrap() = Some(gate.clone());
            gate
        }

        /// Starts an allocation of `device` in a task of its own.
        fn start_one(&self, device: &str) -> JoinHandle<Called> {
            let calls = self.calls.clone();
            let ids = AllocateIds(DeviceId::from_wire(vec![device.to_owned()]).into());
            tokio::spawn(async move { calls.allocate(ids).await })
        }

        /// Starts `d0`, held in its call, and waits until `then` are queued behind it.
        async fn behind_a_held_call(
            &self,
            then: &[&str],
        ) -> (Arc<Semaphore>, JoinHandle<Called>, Vec<JoinHandle<Called>>) {
            let gate = self.gate();
            let first = self.start_one("d0");
            self.stub.state.allocating.notified().await;
            let rest = then.iter().map(|d| self.start_one(d)).collect();
            tokio::time::timeout(Duration::from_secs(10), async {
                while self.calls.lock().waiting.len() < then.len() {
                    tokio::task::yield_now().await;
                }
            })
            .await
            .expect("the allocations were queued");
            (gate, first, rest)
        }

        /// `d0`'s call is held while `then` queue; then the gate opens. Returns what each of
        /// the queued heard, in order.
        async fn behind_one_call(&self, then: &[&str]) -> Vec<Called> {
            let (gate, first, rest) = self.behind_a_held_call(then).await;
            gate.add_permits(100);
            assert_eq!(answered(&first.await.unwrap()), Ok("d0".to_owned()));
            let mut heard = Vec::new();
            for task in rest {
                heard.push(task.await.unwrap());
            }
            heard
        }

        /// Whether no call runs.
        fn idle(&self) -> bool {
            !self.calls.lock().busy
        }
    }

    async fn calls(stub: &Stub, batch: usize) -> Arc<AllocateCalls> {
        let channel = pluglet_uds::connect(&stub.socket, Duration::from_secs(10))
            .await
            .unwrap();
        Arc::new(AllocateCalls::new(
            ResourceName::new("vendor.com/gpu"),
            channel,
            batch,
            Duration::from_secs(10),
        ))
    }

    /// The devices the stub's answer names (its `STUB_DEVICES` env), or the call's error code.
    fn answered(called: &Called) -> Result<String, tonic::Code> {
        match &called.answer {
            Ok(Some(answer)) => Ok(answer
                .view()
                .unwrap()
                .envs
                .iter()
                .find(|(k, _)| *k == "STUB_DEVICES")
                .map(|(_, v)| (*v).to_owned())
                .unwrap()),
            Ok(None) => panic!("no container answered"),
            Err(err) => Err(err.code()),
        }
    }

    /// What each of `heard` was answered, and the calls counted for each.
    fn answers(heard: &[Called]) -> (Vec<Result<String, tonic::Code>>, Vec<u32>) {
        (
            heard.iter().map(answered).collect(),
            heard.iter().map(|c| c.calls).collect(),
        )
    }

    /// Each device answered to its own allocation.
    fn own(devices: &[&str]) -> Vec<Result<String, tonic::Code>> {
        devices.iter().map(|d| Ok((*d).to_owned())).collect()
    }

    #[tokio::test]
    async fn a_lone_allocation_is_asked_at_once_in_a_call_of_its_own() {
        let plugin = Plugin::start(16).await;
        for device in ["d0", "d1"] {
            let called = plugin.start_one(device).await.unwrap();
            assert_eq!(answers(&[called]), (own(&[device]), vec![1]));
        }
        assert_eq!(plugin.sizes(), [1, 1]);
        assert!(plugin.idle());
    }

    #[tokio::test]
    async fn allocations_that_wait_for_a_call_are_asked_together_in_the_next() {
        let plugin = Plugin::start(16).await;
        let heard = plugin.behind_one_call(&["d1", "d2", "d3"]).await;
        assert_eq!(
            answers(&heard),
            (own(&["d1", "d2", "d3"]), vec![1, 0, 0]),
            "each hears the answer for its own container; the call counts once"
        );
        assert_eq!(plugin.sizes(), [1, 3]);
        assert!(plugin.idle());
    }

    #[tokio::test]
    async fn a_call_asks_for_at_most_the_batch() {
        let plugin = Plugin::start(2).await;
        let heard = plugin.behind_one_call(&["d1", "d2", "d3"]).await;
        assert_eq!(answers(&heard).0, own(&["d1", "d2", "d3"]));
        assert_eq!(plugin.sizes(), [1, 2, 1]);

        // 1: one container per call, and still one call at a time.
        let one = Plugin::start(1).await;
        let heard = one.behind_one_call(&["d1", "d2"]).await;
        assert_eq!(answers(&heard).0, own(&["d1", "d2"]));
        assert_eq!(one.sizes(), [1, 1, 1]);
    }

    #[tokio::test]
    async fn a_plugin_that_answers_only_the_first_container_is_asked_one_per_call() {
        let plugin = Plugin::start(16).await;
        plugin
            .stub
            .state
            .answer_first_only
            .store(true, Ordering::SeqCst);
        let heard = plugin.behind_one_call(&["d1", "d2", "d3"]).await;
        assert_eq!(answers(&heard), (own(&["d1", "d2", "d3"]), vec![2, 1, 1]));
        assert_eq!(plugin.sizes(), [1, 3, 1, 1, 1], "asked again one by one");

        let heard = plugin.behind_one_call(&["d4", "d5"]).await;
        assert_eq!(answers(&heard).0, own(&["d4", "d5"]));
        assert_eq!(plugin.sizes(), [1, 1, 1], "one per call from then on");
    }

    #[tokio::test]
    async fn a_refused_call_of_several_fails_only_the_container_refused() {
        let plugin = Plugin::start(16).await;
        *plugin.stub.state.refuse_device.lock().unwrap() = Some("d2".to_owned());
        let heard = plugin.behind_one_call(&["d1", "d2", "d3"]).await;
        let mut expected = own(&["d1", "d2", "d3"]);
        expected[1] = Err(tonic::Code::InvalidArgument);
        assert_eq!(answers(&heard).0, expected);
        assert_eq!(plugin.sizes(), [1, 3, 1, 1, 1]);

        let heard = plugin.behind_one_call(&["d4", "d5"]).await;
        assert_eq!(answers(&heard).0, own(&["d4", "d5"]));
        assert_eq!(plugin.sizes(), [1, 2], "still asked together");
    }

    #[tokio::test]
    async fn an_allocation_whose_caller_stopped_waiting_is_not_asked_for() {
        let plugin = Plugin::start(16).await;
        let (gate, first, rest) = plugin.behind_a_held_call(&["d1", "d2"]).await;
        let [gone, kept] = <[_; 2]>::try_from(rest).unwrap();
        gone.abort();
        let _ = gone.await;
        gate.add_permits(100);
        assert!(first.await.unwrap().answer.is_ok());
        assert_eq!(answered(&kept.await.unwrap()), Ok("d2".to_owned()));
        assert_eq!(plugin.sizes(), [1, 1]);
    }

    #[tokio::test]
    async fn when_the_caller_of_a_running_call_stops_waiting_the_queue_goes_on() {
        let plugin = Plugin::start(16).await;
        let (gate, first, rest) = plugin.behind_a_held_call(&["d1"]).await;
        first.abort();
        let _ = first.await;
        gate.add_permits(100);
        for next in rest {
            assert_eq!(answered(&next.await.unwrap()), Ok("d1".to_owned()));
        }
        assert!(plugin.idle());
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_allocation_has_the_timeout_from_reaching_the_plugin() {
        let plugin = Plugin::start(16).await;
        let (_gate, first, rest) = plugin.behind_a_held_call(&["d1"]).await;
        // Nothing answers: the clock runs to the first deadline, the running call's, which is
        // also the waiting one's (both reached the plugin at the same paused instant).
        let first = first.await.unwrap();
        assert_eq!(answered(&first), Err(tonic::Code::DeadlineExceeded));
        for waiting in rest {
            let waiting = waiting.await.unwrap();
            let Err(err) = &waiting.answer else {
                panic!("answered: {waiting:?}");
            };
            assert_eq!(err.code(), tonic::Code::DeadlineExceeded);
            assert!(err.0.message().contains("calls before"), "{err:?}");
            assert_eq!(waiting.calls, 0, "not asked for");
        }
        assert_eq!(plugin.sizes(), [1]);
        assert!(plugin.idle());
    }
}
