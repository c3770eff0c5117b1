//! Hooks the end-to-end tests steer the daemon by, read from the environment. Compiled in only
//! with the `test-hooks` feature (the test build's: `scripts/test.sh`), never in a shipped
//! binary; `pluglet --version` then ends in `+test-hooks`, so a test can tell.

use std::fs::File;
use std::future::Future;
use std::path::PathBuf;

use anyhow::Context as _;
use tracing::info;

use super::health::Health;

/// The path of a FIFO the daemon reads to its end before the registry's start-up scan, so a
/// test can see the daemon not yet ready.
pub const HOLD_SCAN_ENV: &str = "PLUGLET_TEST_HOLD_SCAN";

/// The name of a stage that ends with an error as soon as the daemon is ready (the way a
/// crashed stage looks to the supervisor).
pub const FAIL_STAGE_ENV: &str = "PLUGLET_TEST_FAIL_STAGE";

/// Waits, when [`HOLD_SCAN_ENV`] is set, until its FIFO is read to its end.
pub async fn hold_scan() -> anyhow::Result<()> {
    let Some(path) = std::env::var_os(HOLD_SCAN_ENV).map(PathBuf::from) else {
        return Ok(());
    };
    info!(fifo = %path.display(), "holding the start-up scan until the FIFO is closed");
    tokio::task::spawn_blocking(move || {
        let mut fifo = File::open(&path)
            .with_context(|| format!("cannot open {HOLD_SCAN_ENV} {}", path.display()))?;
        std::io::copy(&mut fifo, &mut std::io::sink())?;
        anyhow::Ok(())
    })
    .await
    .context("holding the scan panicked")?
}

/// `stage`, or, when [`FAIL_STAGE_ENV`] names `name`, `stage` until the daemon is ready and an
/// error from then on.
pub fn fail_stage<F>(
    name: &'static str,
    stage: F,
    health: &Health,
) -> impl Future<Output = Result<(), String>> + Send + 'static
where
    F: Future<Output = Result<(), String>> + Send + 'static,
{
    let injected = (std::env::var(FAIL_STAGE_ENV).as_deref() == Ok(name)).then(|| health.clone());
    async move {
        match injected {
            None => stage.await,
            Some(health) => {
                let mut ready = health.subscribe_ready();
                tokio::select! {
                    result = stage => result,
                    _ = ready.wait_for(|r| *r) => {
                        Err(format!("failed on purpose ({FAIL_STAGE_ENV})"))
                    }
                }
            }
        }
    }
}
