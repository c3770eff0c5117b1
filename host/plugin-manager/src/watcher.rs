//! Plugin watcher: inotify on the registry directory → the desired state (the kubelet's
//! `pluginwatcher/`).
//!
//! Order at start (as the kubelet's watcher does it; see `docs/kubelet-compatibility.md`, "Plugin
//! watcher"): create the inotify instance, watch the root, *then* walk the
//! tree, so a socket created in between is seen by the walk or by an event (the same file seen twice
//! keeps its generation, see [`super::desired_state::FileId`]). Every directory gets its own watch;
//! a directory created later is watched first and walked second, so sockets created in it right
//! after `mkdir` are not missed. Dot-files (and dot-directories) and anything that is not a socket
//! (`stat`, following symlinks, `S_IFSOCK`) are ignored. A symlink to a socket counts as a
//! socket (under the link's path), as in the kubelet; a symlink to a directory is not followed
//! (the kubelet's walk does not follow it either), so a link back up the tree cannot make the
//! walk loop, and a link that cannot be resolved (a loop, a dangling target) is skipped with a
//! log line. A path named `*.sock` that is skipped (a regular file, a FIFO, such a link) is
//! recorded beside the desired state with the reason, so `pluglet ctl sockets` shows it as
//! `ignored` instead of leaving an operator to guess. Create → add (a new file at a known path
//! is a new generation), Remove → forget (a removed directory forgets everything below it). Renames
//! count as remove + create. Event-driven; the only timer is a slow resync that rescans the tree as
//! a safety net (and after an inotify queue overflow).
//!
//! Without inotify (the per-user instance limit, or no watch left for the registry itself) the
//! watcher does not start and neither does the daemon; a sub-directory that cannot be watched is
//! logged and left to the resync.

use std::collections::HashSet;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::event::{ModifyKind, RenameMode};
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher as _};
use pluglet_core::inotify::{InotifyLimit, LimitReached};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, trace, warn};

use super::desired_state::{DesiredStateWriter, FileId};
use super::plugin::SocketPath;

/// Why the watcher could not start.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// The registry directory could not be created.
    #[error("cannot create registry directory {path}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// No inotify instance could be created because of the per-user limit.
    #[error("cannot create an inotify instance")]
    InstanceLimit(#[source] LimitReached),
    /// The inotify instance could not be created for another reason.
    #[error("cannot create an inotify instance")]
    Create(#[source] notify::Error),
    /// A directory could not be watched because of the per-user watch limit.
    #[error("cannot watch {path}")]
    WatchLimit {
        /// The directory.
        path: PathBuf,
        /// The limit, its value and how to raise it.
        #[source]
        limit: LimitReached,
    },
    /// A directory could not be watched.
    #[error("cannot watch {path}")]
    Watch {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: notify::Error,
    },
    /// The registry directory could not be read.
    #[error("cannot read registry directory {path}")]
    Scan {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// The watcher stage: owns the inotify watcher and the desired state writer.
pub struct Watcher {
    root: PathBuf,
    watcher: RecommendedWatcher,
    events: mpsc::UnboundedReceiver<notify::Result<Event>>,
    desired: DesiredStateWriter,
    resync: Duration,
}

impl Watcher {
    /// Creates `root` if missing, watches it and scans it (in that order). Fails if the root cannot
    /// be watched or read.
    pub fn start(
        root: &Path,
        desired: DesiredStateWriter,
        resync: Duration,
    ) -> Result<Watcher, WatchError> {
        std::fs::create_dir_all(root).map_err(|source| WatchError::CreateDir {
            path: root.to_owned(),
            source,
        })?;
        let (tx, events) = mpsc::unbounded_channel();
        let watcher = notify::recommended_watcher(move |ev: notify::Result<Event>| {
            let _ = tx.send(ev);
        })
        .map_err(|e| match InotifyLimit::of_notify(&e) {
            Some(limit) => WatchError::InstanceLimit(limit.reached()),
            None => WatchError::Create(e),
        })?;
        let mut w = Watcher {
            root: root.to_owned(),
            watcher,
            events,
            desired,
            resync,
        };
        w.watch_dir(root)?;
        std::fs::read_dir(root).map_err(|source| WatchError::Scan {
            path: root.to_owned(),
            source,
        })?;
        let mut found = HashSet::new();
        w.walk(root, &mut found);
        Ok(w)
    }

    /// Handles events until cancelled.
    pub async fn run(mut self, cancel: CancellationToken) {
        let mut resync = tokio::time::interval(self.resync);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        resync.tick().await;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => break,
                ev = self.events.recv() => match ev {
                    Some(ev) => self.handle(ev),
                    None => {
                        error!("inotify event stream ended; registry directory no longer watched");
                        break;
                    }
                },
                _ = resync.tick() => self.rescan(),
            }
        }
    }

    fn handle(&mut self, ev: notify::Result<Event>) {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                if let Some(limit) = InotifyLimit::of_notify(&e) {
                    error!(
                        error = %limit.reached(),
                        "a sub-directory is not watched: until the limit is raised, sockets \
                         created in new sub-directories are found by the periodic rescan \
                         (--resync-period) only"
                    );
                } else {
                    warn!(error = %e, "inotify error");
                }
                return;
            }
        };
        trace!(?ev, "inotify event");
        if ev.need_rescan() {
            warn!("inotify queue overflowed; rescanning the registry directory");
            self.rescan();
            return;
        }
        match ev.kind {
            EventKind::Create(_) | EventKind::Modify(ModifyKind::Name(RenameMode::To)) => {
                for p in &ev.paths {
                    self.on_created(p, &mut HashSet::new());
                }
            }
            EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(RenameMode::From)) => {
                for p in &ev.paths {
                    self.on_removed(p);
                }
            }
            _ => {}
        }
    }

    /// A path appeared: a socket is added, a directory watched then walked. A path named
    /// `*.sock` that is not a socket is recorded as ignored, with why, for `ctl sockets`.
    fn on_created(&mut self, path: &Path, found: &mut HashSet<SocketPath>) {
        if is_hidden(path) {
            trace!(path = %path.display(), "ignoring dot-file");
            return;
        }
        let is_link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
        let meta = match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) if is_link => {
                self.not_a_socket(
                    path,
                    format!(
                        "a symlink that cannot be resolved ({e}): not registered; point it at \
                         the plugin's socket or remove it"
                    ),
                    found,
                );
                return;
            }
            Err(e) => {
                debug!(path = %path.display(), error = %e, "cannot stat; ignoring");
                return;
            }
        };
        let ft = meta.file_type();
        if ft.is_dir() && is_link {
            warn!(path = %path.display(), "symlink to a directory in the registry; not followed");
            if looks_like_socket(path) {
                self.not_a_socket(
                    path,
                    "a symlink to a directory: not followed, not registered".to_owned(),
                    found,
                );
            }
            return;
        }
        if ft.is_dir() {
            if let Err(e) = self.watch_dir(path) {
                error!(
                    error = %pluglet_core::error_chain(&e),
                    "sub-directory not watched: sockets created in it are found by the periodic \
                     rescan (--resync-period) only"
                );
            }
            self.walk(path, found);
        } else if ft.is_socket() {
            let socket = SocketPath::new(path);
            found.insert(socket.clone());
            let file_id = FileId {
                dev: meta.dev(),
                ino: meta.ino(),
            };
            if let Some(generation) = self.desired.add_or_update(socket, file_id) {
                debug!(path = %path.display(), %generation, "socket added to desired state");
            }
        } else if looks_like_socket(path) {
            let what = if ft.is_file() {
                "a regular file"
            } else if ft.is_fifo() {
                "a FIFO"
            } else if ft.is_char_device() || ft.is_block_device() {
                "a device node"
            } else {
                "not a socket"
            };
            let link = if is_link { " (through a symlink)" } else { "" };
            self.not_a_socket(
                path,
                format!(
                    "{what}{link}, not a unix socket: nothing can be dialed here; a plugin \
                     creates its registration socket by listening on it (remove the file)"
                ),
                found,
            );
        } else {
            trace!(path = %path.display(), "ignoring non-socket");
        }
    }

    /// Records `path` (named like a socket) as ignored for `reason`; logged once per reason.
    fn not_a_socket(&mut self, path: &Path, reason: String, found: &mut HashSet<SocketPath>) {
        let socket = SocketPath::new(path);
        found.insert(socket.clone());
        if !looks_like_socket(path) {
            warn!(path = %path.display(), %reason, "not registered");
            return;
        }
        if self.desired.ignore(socket, reason.clone()) {
            warn!(path = %path.display(), %reason, "not registered");
        }
    }

    fn on_removed(&mut self, path: &Path) {
        let socket = SocketPath::new(path);
        if self.desired.remove(&socket) {
            debug!(path = %path.display(), "socket removed from desired state");
        }
        let n = self.desired.remove_under(path);
        if n > 0 {
            debug!(path = %path.display(), sockets = n, "directory removed from desired state");
        }
    }

    fn walk(&mut self, dir: &Path, found: &mut HashSet<SocketPath>) {
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) => {
                warn!(path = %dir.display(), error = %e, "cannot read directory; skipping");
                return;
            }
        };
        for entry in entries.flatten() {
            self.on_created(&entry.path(), found);
        }
    }

    /// Walks the whole tree again: adds what is new (or re-created), forgets what vanished.
    fn rescan(&mut self) {
        let mut found = HashSet::new();
        let root = self.root.clone();
        self.walk(&root, &mut found);
        for (socket, _) in self.desired.entries() {
            if !found.contains(&socket) {
                debug!(%socket, "socket vanished without an event");
                self.desired.remove(&socket);
            }
        }
        for path in self.desired.ignored_paths() {
            if !found.contains(&path) {
                self.desired.unignore(&path);
            }
        }
    }

    fn watch_dir(&mut self, dir: &Path) -> Result<(), WatchError> {
        self.watcher
            .watch(dir, RecursiveMode::NonRecursive)
            .map_err(|source| match InotifyLimit::of_notify(&source) {
                Some(limit) => WatchError::WatchLimit {
                    path: dir.to_owned(),
                    limit: limit.reached(),
                },
                None => WatchError::Watch {
                    path: dir.to_owned(),
                    source,
                },
            })
    }
}

fn is_hidden(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with('.'))
}

/// Whether the name says "registration socket" (`*.sock`): such a path that is not a socket is
/// shown as ignored rather than passed over in silence.
fn looks_like_socket(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "sock")
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;
    use std::time::Duration;

    use super::super::desired_state;
    use super::*;

    #[test]
    fn a_limit_reached_names_the_sysctl_and_the_command_once() {
        let watches = notify::Error::new(notify::ErrorKind::MaxFilesWatch);
        assert_eq!(
            InotifyLimit::of_notify(&watches),
            Some(InotifyLimit::Watches)
        );
        let instances = notify::Error::io(io::Error::from_raw_os_error(libc::EMFILE));
        assert_eq!(
            InotifyLimit::of_notify(&instances),
            Some(InotifyLimit::Instances)
        );
        let other = notify::Error::io(io::Error::from_raw_os_error(libc::EACCES));
        assert_eq!(InotifyLimit::of_notify(&other), None);

        let error = WatchError::WatchLimit {
            path: PathBuf::from("/r/plugins_registry"),
            limit: LimitReached::new(InotifyLimit::Watches, Some(100)),
        };
        assert_eq!(
            pluglet_core::error_chain(&error),
            "cannot watch /r/plugins_registry: the per-user inotify watch limit is reached \
             (fs.inotify.max_user_watches = 100); raise it with `sysctl -w \
             fs.inotify.max_user_watches=8192` and a file in /etc/sysctl.d to keep it"
        );
        let error = WatchError::InstanceLimit(LimitReached::new(InotifyLimit::Instances, Some(0)));
        let text = pluglet_core::error_chain(&error);
        assert!(
            text.starts_with("cannot create an inotify instance: the per-user inotify instance"),
            "{text}"
        );
        assert_eq!(text.matches("sysctl -w").count(), 1, "{text}");
    }

    async fn wait_for(
        reader: &mut desired_state::DesiredStateReader,
        what: impl Fn(&desired_state::DesiredMap) -> bool,
    ) {
        tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if what(&reader.snapshot()) {
                    return;
                }
                reader.changed().await;
            }
        })
        .await
        .expect("condition not reached within 5 s");
    }

    #[tokio::test]
    async fn finds_sockets_ignores_dot_files_and_plain_files() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let _before = UnixListener::bind(root.join("before.sock")).unwrap();
        std::fs::write(root.join("plain.sock"), b"x").unwrap();
        let (w, mut r) = desired_state::channel();
        let watcher = Watcher::start(root, w, Duration::from_secs(30)).unwrap();
        let cancel = CancellationToken::new();
        let task = tokio::spawn(watcher.run(cancel.clone()));
        assert!(
            r.snapshot()
                .contains_key(&SocketPath::new(root.join("before.sock")))
        );

        let _hidden = UnixListener::bind(root.join(".hidden.sock")).unwrap();
        std::fs::create_dir(root.join("sub")).unwrap();
        let _nested = UnixListener::bind(root.join("sub/nested.sock")).unwrap();
        let nested = SocketPath::new(root.join("sub/nested.sock"));
        wait_for(&mut r, |m| m.contains_key(&nested)).await;
        let snap = r.snapshot();
        assert_eq!(snap.len(), 2, "{snap:?}");
        let plain = SocketPath::new(root.join("plain.sock"));
        assert!(
            r.ignored()[&plain].contains("a regular file"),
            "shown, not dialed"
        );

        std::fs::remove_file(root.join("sub/nested.sock")).unwrap();
        wait_for(&mut r, |m| !m.contains_key(&nested)).await;
        cancel.cancel();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn symlinks_to_directories_are_not_followed_and_loops_do_not_stop_the_watch() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("registry");
        std::fs::create_dir(&root).unwrap();
        let outside = tempfile::tempdir().unwrap();
        let _target = UnixListener::bind(outside.path().join("target.sock")).unwrap();
        std::os::unix::fs::symlink(&root, root.join("self")).unwrap();
        std::os::unix::fs::symlink(root.join("loop-b"), root.join("loop-a")).unwrap();
        std::os::unix::fs::symlink(root.join("loop-a"), root.join("loop-b")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("target.sock"), root.join("link.sock"))
            .unwrap();
        let (w, mut r) = desired_state::channel();
        let watcher = Watcher::start(&root, w, Duration::from_secs(30)).unwrap();
        let cancel = CancellationToken::new();
        let task = tokio::spawn(watcher.run(cancel.clone()));
        let link = SocketPath::new(root.join("link.sock"));
        let snap = r.snapshot();
        assert_eq!(snap.keys().collect::<Vec<_>>(), [&link], "{snap:?}");

        // A link made while watching is handled the same way; new sockets are still seen.
        std::os::unix::fs::symlink(&root, root.join("self-again")).unwrap();
        let _late = UnixListener::bind(root.join("late.sock")).unwrap();
        let late = SocketPath::new(root.join("late.sock"));
        wait_for(&mut r, |m| m.contains_key(&late)).await;
        let snap = r.snapshot();
        assert_eq!(snap.len(), 2, "{snap:?}");
        cancel.cancel();
        task.await.unwrap();
    }

    #[test]
    fn hidden_means_basename_starts_with_a_dot() {
        assert!(is_hidden(Path::new("/r/.x.sock")));
        assert!(!is_hidden(Path::new("/r/.d/x.sock")));
    }
}
