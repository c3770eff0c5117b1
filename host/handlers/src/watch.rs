//! Watching the handlers directory: inotify events (through `notify`) are debounced until the
//! files settle, then the set reloads as one transaction (off the reactor: it compiles).
//!
//! An event that says a file is finished (closed after writing, renamed into place, removed)
//! settles after [`SETTLE`]; while a file has been created or written but not closed, or while
//! `handlers.toml` is gone (an editor saving by rename), the wait is [`WRITING_QUIET`] of
//! silence, so a `cp` or an editor's save is seen once, finished. `handlers.toml` itself is
//! applied only once its writer closed it (`IN_CLOSE_WRITE`) or it was renamed into place:
//! while it is open for writing the wait is [`HANDLERS_OPEN_QUIET`] of silence. A reload that
//! finds it empty, when it was not at the read before, decides nothing
//! ([`ReloadOutcome::Waiting`]): the writer's next events bring the next read, and a file that
//! stays empty for [`WRITING_QUIET`] is taken as written empty on purpose. A module file
//! caught half-written anyway is refused by the transaction and retried when it changes again.
//! Reads (our own included) are not changes and are ignored.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use notify::event::{AccessKind, AccessMode, CreateKind, EventKind, ModifyKind, RenameMode};
use notify::{RecursiveMode, Watcher};
use pluglet_core::inotify::{InotifyLimit, LimitReached};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::file::HANDLERS_FILE;
use crate::live::{Handlers, ReloadOutcome};

/// Quiet time after a finished write, rename or removal before the reload: enough to take a
/// module and `handlers.toml` installed one right after the other as one change.
pub const SETTLE: Duration = Duration::from_millis(3);
/// Quiet time while a file is open for writing.
pub const WRITING_QUIET: Duration = Duration::from_millis(250);
/// Quiet time while `handlers.toml` is open for writing and not yet closed: a writer that
/// holds it open this long without a sign is taken as done.
pub const HANDLERS_OPEN_QUIET: Duration = Duration::from_secs(5);

/// Why the directory cannot be watched.
#[derive(Debug, thiserror::Error)]
#[error("cannot watch the handlers directory {dir}")]
pub struct WatchError {
    dir: PathBuf,
    #[source]
    source: WatchFailure,
}

/// What the OS said: a per-user inotify limit (with the sysctl to raise), or another error.
#[derive(Debug, thiserror::Error)]
enum WatchFailure {
    #[error(transparent)]
    Limit(LimitReached),
    #[error(transparent)]
    Notify(notify::Error),
}

impl WatchError {
    fn new(dir: PathBuf, error: notify::Error) -> WatchError {
        let source = match InotifyLimit::of_notify(&error) {
            Some(limit) => WatchFailure::Limit(limit.reached()),
            None => WatchFailure::Notify(error),
        };
        WatchError { dir, source }
    }
}

enum Change {
    /// A file is being written.
    Writing(PathBuf),
    /// A file is finished.
    Done(PathBuf),
    /// A file is gone (removed or renamed away).
    Gone(PathBuf),
}

fn classify(event: notify::Event) -> Vec<Change> {
    let mut paths = event.paths.into_iter();
    match event.kind {
        EventKind::Create(CreateKind::File | CreateKind::Any)
        | EventKind::Modify(ModifyKind::Data(_) | ModifyKind::Any) => {
            paths.map(Change::Writing).collect()
        }
        EventKind::Access(AccessKind::Close(AccessMode::Write))
        | EventKind::Modify(ModifyKind::Name(RenameMode::To)) => paths.map(Change::Done).collect(),
        EventKind::Modify(ModifyKind::Name(RenameMode::Both)) => {
            let from = paths.next().map(Change::Gone);
            from.into_iter().chain(paths.map(Change::Done)).collect()
        }
        EventKind::Remove(_)
        | EventKind::Modify(ModifyKind::Name(RenameMode::From | RenameMode::Any | _)) => {
            paths.map(Change::Gone).collect()
        }
        _ => Vec::new(),
    }
}

impl Handlers {
    /// Starts watching the handlers directory (and the directories of modules named by absolute
    /// path); returns the task that reloads on changes until `cancel`.
    pub fn watch(
        &self,
        cancel: CancellationToken,
    ) -> Result<impl Future<Output = ()> + Send + 'static, WatchError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                if let Ok(event) = event {
                    let _ = tx.send(event);
                }
            })
            .map_err(|e| WatchError::new(self.dir().to_path_buf(), e))?;
        watcher
            .watch(self.dir(), RecursiveMode::NonRecursive)
            .map_err(|e| WatchError::new(self.dir().to_path_buf(), e))?;
        let handlers = self.clone();
        Ok(async move { run(handlers, watcher, rx, cancel).await })
    }
}

async fn run(
    handlers: Handlers,
    mut watcher: notify::RecommendedWatcher,
    mut rx: mpsc::UnboundedReceiver<notify::Event>,
    cancel: CancellationToken,
) {
    let mut extra: Vec<PathBuf> = Vec::new();
    watch_module_dirs(&handlers, &mut watcher, &mut extra);
    // Set while handlers.toml was found half-written: if no change comes before it, the file
    // is read again as written whole.
    let mut recheck: Option<tokio::time::Instant> = None;
    let toml = handlers.dir().join(HANDLERS_FILE);
    // The next retry of a change refused because a module could not be pulled.
    let mut pull_retry = PULL_RETRY_FIRST;
    loop {
        // Wait for a change (reads, ours included, are not changes).
        let mut writing = Writing::default();
        let mut written = false;
        loop {
            let event = tokio::select! {
                _ = cancel.cancelled() => return,
                event = rx.recv() => event,
                _ = sleep_until_some(recheck) => {
                    written = true;
                    break;
                }
            };
            let Some(event) = event else { return };
            if note(event, &mut writing) {
                break;
            }
        }
        recheck = None;
        if !written {
            // A change of the directory: a new entry gets a fresh backoff.
            pull_retry = PULL_RETRY_FIRST;
        }
        // Then for the files to settle.
        let quiet = |writing: &Writing| {
            tokio::time::Instant::now()
                + if writing.files.is_empty() {
                    SETTLE
                } else if writing.open.contains(&toml) {
                    HANDLERS_OPEN_QUIET
                } else {
                    WRITING_QUIET
                }
        };
        let mut deadline = quiet(&writing);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                event = rx.recv() => {
                    let Some(event) = event else { return };
                    if note(event, &mut writing) {
                        deadline = quiet(&writing);
                    }
                }
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        let reload = handlers.clone();
        let outcome = tokio::task::spawn_blocking(move || {
            if written {
                reload.reload_written()
            } else {
                reload.reload()
            }
        })
        .await;
        match outcome {
            Ok(ReloadOutcome::Applied(slots)) => {
                tracing::debug!(?slots, "handlers directory change applied");
                watch_module_dirs(&handlers, &mut watcher, &mut extra);
            }
            Ok(ReloadOutcome::Unchanged) => {
                tracing::debug!("handlers directory changed; nothing that serves calls did")
            }
            Ok(ReloadOutcome::Refused(_)) if handlers.awaiting_pull() => {
                tracing::info!(
                    retry_in = ?pull_retry,
                    "a module could not be pulled; the change is tried again"
                );
                recheck = Some(tokio::time::Instant::now() + pull_retry);
                pull_retry = (pull_retry * 2).min(PULL_RETRY_MAX);
            }
            Ok(ReloadOutcome::Refused(_)) => {}
            Ok(ReloadOutcome::Waiting(_)) => {
                recheck = Some(tokio::time::Instant::now() + WRITING_QUIET);
            }
            Err(e) => tracing::error!(error = %e, "handler reload panicked"),
        }
    }
}

/// The first retry of a change refused because a module could not be pulled; it doubles.
pub const PULL_RETRY_FIRST: Duration = Duration::from_millis(500);
/// The longest wait between two retries of a pull.
pub const PULL_RETRY_MAX: Duration = Duration::from_secs(300);

/// Sleeps until `at`; forever when `None`.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The files not finished yet.
#[derive(Default)]
struct Writing {
    /// Being written, or (`handlers.toml`) gone and maybe coming back.
    files: HashSet<PathBuf>,
    /// Open for writing (written, not closed yet).
    open: HashSet<PathBuf>,
}

/// Records an event; whether it is a change worth a reload.
fn note(event: notify::Event, writing: &mut Writing) -> bool {
    let mut any = false;
    for change in classify(event) {
        any = true;
        match change {
            Change::Writing(path) => {
                writing.open.insert(path.clone());
                writing.files.insert(path);
            }
            Change::Done(path) => {
                writing.open.remove(&path);
                writing.files.remove(&path);
            }
            // An editor that saves by renaming the old file away and writing a new one leaves
            // no handlers.toml for a moment: wait for the new one as for a file being written
            // (if none comes, the file was removed on purpose and the built-ins serve).
            Change::Gone(path) if path.file_name() == Some(HANDLERS_FILE.as_ref()) => {
                writing.open.remove(&path);
                writing.files.insert(path);
            }
            Change::Gone(path) => {
                writing.open.remove(&path);
                writing.files.remove(&path);
            }
        }
    }
    any
}

/// Watches the directories of modules outside the handlers directory (and no others).
fn watch_module_dirs(
    handlers: &Handlers,
    watcher: &mut notify::RecommendedWatcher,
    extra: &mut Vec<PathBuf>,
) {
    let wanted = handlers.module_dirs();
    for dir in extra.iter().filter(|d| !wanted.contains(d)) {
        let _ = watcher.unwatch(dir);
    }
    for dir in wanted.iter().filter(|d| !extra.contains(d)) {
        if let Err(e) = watcher.watch(dir, RecursiveMode::NonRecursive) {
            let error = match InotifyLimit::of_notify(&e) {
                Some(limit) => limit.reached().to_string(),
                None => e.to_string(),
            };
            tracing::warn!(dir = %dir.display(), %error, "cannot watch a module's directory; changes there need a change of handlers.toml to be seen");
        }
    }
    *extra = wanted;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_limit_names_the_sysctl_and_the_command_once() {
        let error = WatchError::new(
            PathBuf::from("/etc/pluglet/handlers"),
            notify::Error::new(notify::ErrorKind::MaxFilesWatch),
        );
        let text = pluglet_core::error_chain(&error);
        assert!(
            text.starts_with(
                "cannot watch the handlers directory /etc/pluglet/handlers: the per-user inotify \
                 watch limit is reached (fs.inotify.max_user_watches = "
            ),
            "{text}"
        );
        assert_eq!(text.matches("cannot watch").count(), 1, "{text}");
        assert_eq!(
            text.matches("sysctl -w fs.inotify.max_user_watches=")
                .count(),
            1,
            "{text}"
        );
    }

    #[test]
    fn other_failures_carry_no_sysctl_advice() {
        let other = WatchError::new(
            PathBuf::from("/h"),
            notify::Error::new(notify::ErrorKind::PathNotFound),
        );
        let text = pluglet_core::error_chain(&other);
        assert!(!text.contains("fs.inotify"), "{text}");
    }
}
