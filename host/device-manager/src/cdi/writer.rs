//! The spec files of new allocations, written on one thread of the hand-off's own.
//!
//! An allocation's spec file is written while its journal record is (the allocator waits for
//! both). On tokio's blocking pool, a node that allocates less often than the pool keeps an idle
//! thread (2 s in the daemon) started a thread for each spec and ended it after: a thread's
//! creation and exit per allocation, several times the instructions of the write itself. This
//! thread waits for the next spec instead. It starts at the first write, hands what a large spec
//! freed back to the allocator before it waits ([`pluglet_core::idle`]), and ends once the
//! [`Handoff`](super::Handoff) and its clones are gone. A thread that died (a panic in a write)
//! is replaced at the next write.

use std::future::Future;
use std::sync::mpsc::{self, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::oneshot;

use super::{CdiError, PendingSpec};

/// A spec to write and where its outcome goes.
type Job = (PendingSpec, oneshot::Sender<Result<(), CdiError>>);

/// The writer thread's queue (no thread until the first write). Cheap to clone: clones share
/// the thread.
#[derive(Clone, Debug, Default)]
pub(super) struct SpecWriter {
    jobs: Arc<Mutex<Option<mpsc::Sender<Job>>>>,
}

impl SpecWriter {
    /// Queues `spec` for the writer thread; the future is the write's outcome.
    pub(super) fn write(
        &self,
        spec: PendingSpec,
    ) -> impl Future<Output = Result<(), CdiError>> + Send + 'static {
        let path = spec.path();
        let queued = self.queue(spec);
        async move {
            let stopped = |source| CdiError::Write {
                path: path.clone(),
                source,
            };
            match queued {
                Ok(answer) => answer.await.unwrap_or_else(|_| {
                    Err(stopped(std::io::Error::other(
                        "the CDI spec writer thread stopped during the write",
                    )))
                }),
                Err(err) => Err(stopped(err)),
            }
        }
    }

    fn queue(&self, spec: PendingSpec) -> std::io::Result<oneshot::Receiver<Result<(), CdiError>>> {
        let (answer, answered) = oneshot::channel();
        let mut job = (spec, answer);
        let mut jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        // The second round runs only when the thread had died: a new one takes the job.
        for _ in 0..2 {
            let sender = match jobs.as_ref() {
                Some(sender) => sender,
                None => jobs.insert(start()?),
            };
            match sender.send(job) {
                Ok(()) => return Ok(answered),
                Err(mpsc::SendError(back)) => {
                    job = back;
                    *jobs = None;
                }
            }
        }
        Err(std::io::Error::other(
            "the CDI spec writer thread stopped as it started",
        ))
    }
}

fn start() -> std::io::Result<mpsc::Sender<Job>> {
    let (jobs, queued) = mpsc::channel();
    std::thread::Builder::new()
        .name("cdi-spec-writer".into())
        .spawn(move || run(&queued))?;
    Ok(jobs)
}

fn run(queued: &mpsc::Receiver<Job>) {
    loop {
        let (spec, answer) = match queued.try_recv() {
            Ok(job) => job,
            Err(TryRecvError::Disconnected) => return,
            Err(TryRecvError::Empty) => {
                pluglet_core::idle::going_idle();
                match queued.recv() {
                    Ok(job) => job,
                    Err(mpsc::RecvError) => return,
                }
            }
        };
        // An allocation that stopped waiting still has its file written: it is removed with
        // the allocation, as a file written on any other thread would be.
        let _ = answer.send(spec.write());
    }
}

#[cfg(test)]
mod tests {
    use super::super::Handoff;
    use super::*;
    use crate::answer::AnswerView;
    use crate::pod_devices::HolderKey;
    use pluglet_proto::v1beta1::ContainerAllocateResponse;

    fn response(env: &str) -> ContainerAllocateResponse {
        ContainerAllocateResponse {
            envs: [("E".to_owned(), env.to_owned())].into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn specs_queued_together_are_each_written_before_their_answer() {
        let tmp = tempfile::tempdir().unwrap();
        let handoff = Handoff::new(tmp.path().to_owned());
        let writes: Vec<_> = ["a", "b", "c"]
            .into_iter()
            .map(|pod| {
                let key = HolderKey::new(pod, "c", "vendor.com/gpu");
                let (_, spec) = handoff
                    .prepare(&key, &AnswerView::of(&response(pod)))
                    .unwrap();
                handoff.write_later(spec.expect("an answer with an env has a spec"))
            })
            .collect();
        for (pod, write) in ["a", "b", "c"].into_iter().zip(writes) {
            write.await.unwrap();
            let file = tmp
                .path()
                .join(format!("pluglet-vendor.com=gpu={pod}_c.json"));
            let text = std::fs::read_to_string(&file).unwrap();
            assert!(text.contains(&format!("E={pod}")), "{text}");
        }
    }

    #[tokio::test]
    async fn a_spec_that_cannot_be_written_names_its_file_and_the_next_one_is_written() {
        let tmp = tempfile::tempdir().unwrap();
        let blocked = tmp.path().join("not-a-directory");
        std::fs::write(&blocked, "").unwrap();
        let handoff = Handoff::new(blocked.join("cdi"));
        let key = HolderKey::new("p", "c", "vendor.com/gpu");
        let (_, spec) = handoff
            .prepare(&key, &AnswerView::of(&response("1")))
            .unwrap();
        let err = handoff.write_later(spec.unwrap()).await.unwrap_err();
        let CdiError::Write { path, .. } = &err else {
            panic!("{err:?}");
        };
        assert_eq!(path, &blocked.join("cdi/pluglet-vendor.com=gpu=p_c.json"));

        std::fs::remove_file(&blocked).unwrap();
        let (_, spec) = handoff
            .prepare(&key, &AnswerView::of(&response("2")))
            .unwrap();
        handoff.write_later(spec.unwrap()).await.unwrap();
        let text =
            std::fs::read_to_string(blocked.join("cdi/pluglet-vendor.com=gpu=p_c.json")).unwrap();
        assert!(text.contains("E=2"), "{text}");
    }
}
