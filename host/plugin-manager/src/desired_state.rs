//! Desired state of world: the registration sockets that exist right now.
//!
//! Single writer: the watcher ([`DesiredStateWriter`], not `Clone`). Readers
//! ([`DesiredStateReader`]): the reconciler, which wakes on [`DesiredStateReader::changed`] and plans
//! against [`DesiredStateReader::borrow`]. Mirrors the kubelet's `desired_state_of_world.go`, where a
//! fresh UUID per Create forces re-registration; here that is the [`Generation`].

use std::collections::BTreeMap;
use std::path::Path;

use tokio::sync::{mpsc, watch};

use super::plugin::{Generation, SocketPath};

/// Identity of the file behind a path (device, inode), so a second Create for the very same socket
/// (start-up scan racing its own inotify event) is not mistaken for a re-creation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileId {
    /// `st_dev`.
    pub dev: u64,
    /// `st_ino`.
    pub ino: u64,
}

/// One socket in the desired state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DesiredEntry {
    /// Incarnation: changes whenever the socket is created again.
    pub generation: Generation,
    /// File identity when it was seen.
    pub file_id: FileId,
    /// When this incarnation was first seen (start of the registration latency).
    pub seen: std::time::Instant,
}

/// The whole desired state, keyed by socket path.
pub type DesiredMap = BTreeMap<SocketPath, DesiredEntry>;

/// Paths in the registry that look like registration sockets (`*.sock`) but are not (a
/// regular file, a symlink that does not resolve, ...), with why each is not registered. Kept
/// beside the desired state so `pluglet ctl sockets` can show them; the reconciler never acts
/// on them.
pub type IgnoredMap = BTreeMap<SocketPath, String>;

/// Creates the cache: the writer goes to the watcher, readers to the reconciler.
pub fn channel() -> (DesiredStateWriter, DesiredStateReader) {
    let (tx, rx) = watch::channel(DesiredMap::new());
    let (ignored_tx, ignored) = watch::channel(IgnoredMap::new());
    (
        DesiredStateWriter {
            tx,
            ignored: ignored_tx,
            next_generation: 1,
            changes: None,
        },
        DesiredStateReader { rx, ignored },
    )
}

/// The only writer of the desired state.
#[derive(Debug)]
pub struct DesiredStateWriter {
    tx: watch::Sender<DesiredMap>,
    ignored: watch::Sender<IgnoredMap>,
    next_generation: u64,
    changes: Option<mpsc::UnboundedSender<SocketPath>>,
}

/// The paths whose desired state changed, in order, for a reader that reconciles incrementally
/// (see [`DesiredStateWriter::subscribe_changes`]).
#[derive(Debug)]
pub struct ChangedPaths {
    rx: mpsc::UnboundedReceiver<SocketPath>,
}

impl ChangedPaths {
    /// The next changed path; `None` once the writer is gone.
    pub async fn next(&mut self) -> Option<SocketPath> {
        self.rx.recv().await
    }

    /// A changed path that is already queued, if any.
    pub fn try_next(&mut self) -> Option<SocketPath> {
        self.rx.try_recv().ok()
    }
}

impl DesiredStateWriter {
    /// From now on, also reports every changed path to the returned receiver (one subscriber;
    /// a second call replaces the first).
    pub fn subscribe_changes(&mut self) -> ChangedPaths {
        let (tx, rx) = mpsc::unbounded_channel();
        self.changes = Some(tx);
        ChangedPaths { rx }
    }

    fn report(&self, path: &SocketPath) {
        if let Some(tx) = &self.changes {
            let _ = tx.send(path.clone());
        }
    }

    /// Records a socket seen at `path`. Returns the new generation when this is a new socket (new
    /// path, or a different file at a known path), `None` when it is the same file again.
    pub fn add_or_update(&mut self, path: SocketPath, file_id: FileId) -> Option<Generation> {
        self.unignore(&path);
        let generation = Generation(self.next_generation);
        let changed = self.tx.send_if_modified(|map| match map.get(&path) {
            Some(e) if e.file_id == file_id => false,
            _ => {
                map.insert(
                    path.clone(),
                    DesiredEntry {
                        generation,
                        file_id,
                        seen: std::time::Instant::now(),
                    },
                );
                true
            }
        });
        if !changed {
            return None;
        }
        self.next_generation += 1;
        self.report(&path);
        Some(generation)
    }

    /// Forgets the socket at `path`. Returns whether it was known.
    pub fn remove(&mut self, path: &SocketPath) -> bool {
        self.unignore(path);
        let removed = self.tx.send_if_modified(|map| map.remove(path).is_some());
        if removed {
            self.report(path);
        }
        removed
    }

    /// Forgets every socket at or below `dir` (a removed or renamed directory). Returns how many.
    pub fn remove_under(&mut self, dir: &Path) -> usize {
        self.ignored.send_if_modified(|map| {
            let before = map.len();
            map.retain(|p, _| !p.as_path().starts_with(dir));
            map.len() != before
        });
        let mut removed = Vec::new();
        self.tx.send_if_modified(|map| {
            map.retain(|p, _| {
                let keep = !p.as_path().starts_with(dir);
                if !keep {
                    removed.push(p.clone());
                }
                keep
            });
            !removed.is_empty()
        });
        for p in &removed {
            self.report(p);
        }
        removed.len()
    }

    /// Records that `path` looks like a socket but is not one, and why. Returns whether this is
    /// news (a new path or a new reason). A socket at `path` is forgotten first.
    pub fn ignore(&mut self, path: SocketPath, reason: String) -> bool {
        if self.tx.borrow().contains_key(&path) {
            self.remove(&path);
        }
        self.ignored.send_if_modified(|map| {
            if map.get(&path) == Some(&reason) {
                return false;
            }
            map.insert(path, reason);
            true
        })
    }

    /// Forgets an ignored path (it is gone, or is a socket now). Returns whether it was known.
    pub fn unignore(&mut self, path: &SocketPath) -> bool {
        self.ignored
            .send_if_modified(|map| map.remove(path).is_some())
    }

    /// The ignored paths now.
    pub fn ignored_paths(&self) -> Vec<SocketPath> {
        self.ignored.borrow().keys().cloned().collect()
    }

    /// Socket paths currently desired, with their file identity.
    pub fn entries(&self) -> Vec<(SocketPath, FileId)> {
        self.tx
            .borrow()
            .iter()
            .map(|(p, e)| (p.clone(), e.file_id))
            .collect()
    }

    /// A reader of this cache.
    pub fn reader(&self) -> DesiredStateReader {
        DesiredStateReader {
            rx: self.tx.subscribe(),
            ignored: self.ignored.subscribe(),
        }
    }
}

/// A read handle on the desired state.
#[derive(Clone, Debug)]
pub struct DesiredStateReader {
    rx: watch::Receiver<DesiredMap>,
    ignored: watch::Receiver<IgnoredMap>,
}

impl DesiredStateReader {
    /// Waits until the desired state changed since the last [`DesiredStateReader::borrow`].
    /// Returns `false` once the writer is gone.
    pub async fn changed(&mut self) -> bool {
        self.rx.changed().await.is_ok()
    }

    /// Borrows the current state and marks it seen. Hold the guard only briefly: the watcher
    /// waits for it.
    pub fn borrow(&mut self) -> watch::Ref<'_, DesiredMap> {
        self.rx.borrow_and_update()
    }

    /// The generation of `socket` right now, without marking the state seen (a pending change
    /// still wakes [`DesiredStateReader::changed`]).
    pub fn peek_generation(&self, socket: &SocketPath) -> Option<Generation> {
        self.rx.borrow().get(socket).map(|e| e.generation)
    }

    /// When the current incarnation of `socket` was first seen, if it still has `generation`.
    pub fn seen(&self, socket: &SocketPath, generation: Generation) -> Option<std::time::Instant> {
        self.rx
            .borrow()
            .get(socket)
            .filter(|e| e.generation == generation)
            .map(|e| e.seen)
    }

    /// Whether `socket` is desired right now.
    pub fn snapshot_contains(&self, socket: &SocketPath) -> bool {
        self.rx.borrow().contains_key(socket)
    }

    /// A copy of the current state.
    pub fn snapshot(&self) -> DesiredMap {
        self.rx.borrow().clone()
    }

    /// A copy of the paths that look like sockets but are not, with why.
    pub fn ignored(&self) -> IgnoredMap {
        self.ignored.borrow().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(ino: u64) -> FileId {
        FileId { dev: 1, ino }
    }

    #[test]
    fn same_file_keeps_its_generation_and_a_new_file_gets_a_new_one() {
        let (mut w, r) = channel();
        let p = SocketPath::new("/r/a.sock");
        let g1 = w.add_or_update(p.clone(), id(7)).unwrap();
        assert_eq!(w.add_or_update(p.clone(), id(7)), None);
        let g2 = w.add_or_update(p.clone(), id(8)).unwrap();
        assert!(g2 > g1);
        assert_eq!(r.snapshot()[&p].generation, g2);
        assert!(w.remove(&p));
        assert!(!w.remove(&p));
        let g3 = w.add_or_update(p.clone(), id(8)).unwrap();
        assert!(g3 > g2, "re-created after removal is a new generation");
    }

    #[test]
    fn changed_paths_are_reported_in_order() {
        let (mut w, _r) = channel();
        let mut changes = w.subscribe_changes();
        let a = SocketPath::new("/r/a.sock");
        let b = SocketPath::new("/r/d/b.sock");
        w.add_or_update(a.clone(), id(1));
        w.add_or_update(a.clone(), id(1));
        w.add_or_update(b.clone(), id(2));
        w.remove(&a);
        w.remove_under(Path::new("/r/d"));
        let mut seen = Vec::new();
        while let Some(p) = changes.try_next() {
            seen.push(p);
        }
        assert_eq!(seen, vec![a.clone(), b.clone(), a, b]);
    }

    #[test]
    fn remove_under_drops_a_whole_directory() {
        let (mut w, r) = channel();
        w.add_or_update(SocketPath::new("/r/d/a.sock"), id(1));
        w.add_or_update(SocketPath::new("/r/d/e/b.sock"), id(2));
        w.add_or_update(SocketPath::new("/r/dd.sock"), id(3));
        assert_eq!(w.remove_under(Path::new("/r/d")), 2);
        assert_eq!(r.snapshot().len(), 1);
    }

    #[test]
    fn ignored_paths_are_kept_apart_and_forgotten_when_they_go() {
        let (mut w, r) = channel();
        let mut changes = w.subscribe_changes();
        let p = SocketPath::new("/r/d/plain.sock");
        assert!(w.ignore(p.clone(), "a regular file".into()));
        assert!(!w.ignore(p.clone(), "a regular file".into()), "no news");
        assert!(r.snapshot().is_empty(), "never desired");
        assert!(changes.try_next().is_none(), "the reconciler is not woken");
        assert_eq!(r.ignored()[&p], "a regular file");
        // Replaced by a real socket: desired, no longer ignored.
        w.add_or_update(p.clone(), id(1));
        assert!(r.ignored().is_empty());
        // A socket replaced by a plain file: no longer desired.
        w.ignore(p.clone(), "a regular file".into());
        assert!(r.snapshot().is_empty());
        assert_eq!(w.remove_under(Path::new("/r/d")), 0);
        assert!(r.ignored().is_empty(), "a removed directory forgets them");
    }

    #[tokio::test]
    async fn readers_wake_on_change_only() {
        let (mut w, mut r) = channel();
        w.add_or_update(SocketPath::new("/r/a.sock"), id(1));
        assert!(r.changed().await);
        let _ = r.borrow();
        w.add_or_update(SocketPath::new("/r/a.sock"), id(1));
        assert!(
            !r.rx.has_changed().unwrap(),
            "no-op update does not wake the reconciler"
        );
    }
}
