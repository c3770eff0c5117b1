//! Supervision of the daemon's stages: each long-running stage is watched, and one that ends
//! while the daemon runs (returns, fails or panics) is reported to [`Health`] and ends the
//! daemon with the stage named, so that systemd (or whatever started it) restarts it. The
//! daemon never runs half-alive.

use std::future::Future;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::health::Health;

/// A stage that ended while the daemon ran.
#[derive(Debug, thiserror::Error)]
#[error("stage {stage} stopped unexpectedly: {cause}")]
pub struct StageEnded {
    /// The stage.
    pub stage: &'static str,
    /// Why.
    pub cause: String,
}

/// The watched stages.
pub struct Supervisor {
    health: Health,
    cancel: CancellationToken,
    stages: JoinSet<(&'static str, Result<(), String>)>,
}

impl Supervisor {
    /// A supervisor reporting to `health`; stages that end after `cancel` fired are not
    /// failures.
    pub fn new(health: Health, cancel: CancellationToken) -> Supervisor {
        Supervisor {
            health,
            cancel,
            stages: JoinSet::new(),
        }
    }

    /// Runs `stage` as the stage `name`: its end (an `Err` carries why) is watched.
    pub fn spawn<F>(&mut self, name: &'static str, stage: F)
    where
        F: Future<Output = Result<(), String>> + Send + 'static,
    {
        self.health.stage_started(name);
        #[cfg(feature = "test-hooks")]
        let stage = super::test_hooks::fail_stage(name, stage, &self.health);
        let task = tokio::spawn(stage);
        self.stages.spawn(async move {
            let result = match task.await {
                Ok(result) => result,
                Err(err) if err.is_panic() => Err(panic_text(err.into_panic())),
                Err(err) => Err(err.to_string()),
            };
            (name, result)
        });
    }

    /// Waits for the first stage to end while the daemon runs; reports it to health.
    /// Pending forever if none does.
    pub async fn first_failure(&mut self) -> StageEnded {
        loop {
            let Some(joined) = self.stages.join_next().await else {
                return std::future::pending().await;
            };
            let Ok((stage, result)) = joined else {
                continue;
            };
            if self.cancel.is_cancelled() {
                continue;
            }
            let cause = match result {
                Ok(()) => "it returned".to_owned(),
                Err(cause) => cause,
            };
            self.health.stage_ended(stage, cause.clone());
            return StageEnded { stage, cause };
        }
    }

    /// Waits for every stage to end (after cancellation).
    pub async fn wait(&mut self) {
        while self.stages.join_next().await.is_some() {}
    }
}

fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".to_owned());
    format!("panicked: {text}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stage_that_ends_while_running_is_named_and_reported() {
        let health = Health::new();
        let cancel = CancellationToken::new();
        let mut supervisor = Supervisor::new(health.clone(), cancel.clone());
        let stop_quiet = cancel.clone();
        supervisor.spawn("quiet", async move {
            stop_quiet.cancelled().await;
            Ok(())
        });
        supervisor.spawn("crashing", async { panic!("out of luck") });
        let ended = supervisor.first_failure().await;
        assert_eq!(ended.stage, "crashing");
        assert!(ended.cause.contains("out of luck"), "{}", ended.cause);
        assert!(!health.is_live());
        cancel.cancel();
        supervisor.wait().await;
    }

    /// Paused time: the timeout fires only once every task is idle.
    #[tokio::test(start_paused = true)]
    async fn stages_ending_after_cancellation_are_not_failures() {
        let cancel = CancellationToken::new();
        let mut supervisor = Supervisor::new(Health::new(), cancel.clone());
        let token = cancel.clone();
        supervisor.spawn("stage", async move {
            token.cancelled().await;
            Err("stopped".into())
        });
        cancel.cancel();
        let failure = tokio::time::timeout(
            std::time::Duration::from_secs(3600),
            supervisor.first_failure(),
        );
        assert!(failure.await.is_err(), "no failure after cancellation");
    }
}
