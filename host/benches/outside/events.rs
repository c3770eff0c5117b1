//! The observation points seen through inotify: a checkpoint rename, a socket created.

use std::fs::File;
use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use pluglet_proto::admin::v1 as admin;
use pluglet_proto::admin::v1::admin_client::AdminClient;
use pluglet_proto::v1beta1;
use pluglet_proto::v1beta1::device_plugin_client::DevicePluginClient;
use pluglet_uds::Channel;

use crate::events::Events;
use crate::floors::{SyncFloor, bare_watch, ns_between, peer_allocate, peer_rt};
use crate::kubelet::*;
use crate::node::{Daemon, Node, cdi_dir, fresh_root, mb, memory};
use crate::peer_handle::Peer;
use crate::report::{Row, print_rows};
use crate::stages::{StageSums, print_stages, stage_sums, take_stages};
use crate::timed_rows::timed_rows;
use crate::{CHECKPOINT, PEER_ENV, PYTHON_PEER, SETTLE, TIMEOUT, daemon_args, daemon_binary, env_count, now_ns};

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
            if kind_fits
                && at >= since
                && event.paths.last().is_some_and(|p| p == path)
                && check()
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
