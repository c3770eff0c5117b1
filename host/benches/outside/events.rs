//! The observation points seen through inotify: a checkpoint rename, a socket created.

use std::path::Path;
use std::sync::mpsc;
use std::time::Instant;

use crate::{CHECKPOINT, TIMEOUT, now_ns};

/// inotify events (timestamp taken in the watcher's callback, ns) of the watched dirs.
pub struct Events {
    pub watcher: notify::RecommendedWatcher,
    pub rx: mpsc::Receiver<(u64, notify::Event)>,
}

impl Events {
    pub fn new() -> Events {
        let (tx, rx) = mpsc::channel();
        let watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            if let Ok(event) = res {
                let _ = tx.send((now_ns(), event));
            }
        })
        .expect("inotify watcher");
        Events { watcher, rx }
    }

    pub fn watch(&mut self, dir: &Path) {
        use notify::Watcher as _;
        self.watcher
            .watch(dir, notify::RecursiveMode::NonRecursive)
            .unwrap_or_else(|e| panic!("watch {}: {e}", dir.display()));
    }

    pub fn unwatch(&mut self, dir: &Path) {
        use notify::Watcher as _;
        let _ = self.watcher.unwatch(dir);
    }

    pub fn drain(&self) {
        while self.rx.try_recv().is_ok() {}
    }

    /// Waits for an event naming `path` (created, or renamed to it), not older than `since`
    /// (ns), for which `check` holds; returns its timestamp.
    pub fn wait_for(&self, path: &Path, since: u64, mut check: impl FnMut() -> bool) -> u64 {
        use notify::EventKind;
        use notify::event::ModifyKind;
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (at, event) = self
                .rx
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no awaited event on {}", path.display()));
            let kind_fits = matches!(
                event.kind,
                EventKind::Create(_) | EventKind::Modify(ModifyKind::Name(_))
            );
            if kind_fits && at >= since && event.paths.last().is_some_and(|p| p == path) && check()
            {
                return at;
            }
        }
    }

    /// Waits for a checkpoint rename in `dir`, not older than `since`, whose content
    /// satisfies `check`.
    pub fn checkpoint(&self, dir: &Path, since: u64, check: impl Fn(&str) -> bool) -> u64 {
        let path = dir.join(CHECKPOINT);
        self.wait_for(&path, since, || {
            std::fs::read_to_string(&path).is_ok_and(|text| check(&text))
        })
    }
}
