//! Files on disk: atomic write, load, and setting a corrupt file aside.
//!
//! A write never leaves a half-written file under the real name: the bytes go to a temporary
//! file `.<random>` in the same directory (mode 0600, as Go's `os.CreateTemp`), which is
//! fsynced, renamed over the target, and then the directory is fsynced so the rename itself
//! survives a power cut (the kubelet's `utilstore.FileStore` does the same except the last
//! step). [`Durability::NoFsync`] skips both fsyncs, for benchmarks and tests only.
//!
//! A file that exists but is corrupt is never deleted: [`load_or_set_aside`] renames it to
//! `<name>.corrupt-<unix seconds>` so the daemon can report it and start empty, and a person
//! can look at it later.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{CheckpointError, FormatError};
use crate::format::CheckpointData;

/// The kubelet's checkpoint file name, in the device plugins directory (beside `kubelet.sock`).
pub const CHECKPOINT_FILE_NAME: &str = "kubelet_internal_checkpoint";

/// What a set-aside file's name contains after the original name: `<name>.corrupt-<unix-ts>`.
///
/// Code that cleans the device plugins directory (the kubelet removes every file there but the
/// checkpoint) should keep files whose name contains this, so nothing corrupt is lost silently.
pub const SET_ASIDE_MARKER: &str = ".corrupt-";

/// Whether a write waits for the data to reach the disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// fsync the file before the rename and the directory after it (the default, and what the
    /// daemon must use).
    #[default]
    Fsync,
    /// Skip both fsyncs: the rename is still atomic for readers, but a power cut may lose the
    /// write. For benchmarks and tests.
    NoFsync,
}

/// The result of [`load_or_set_aside`] or [`crate::load_side_or_set_aside`].
#[derive(Debug)]
pub enum LoadOutcome<T> {
    /// The file was read and verified.
    Loaded(T),
    /// There is no file: start empty.
    Missing,
    /// The file was corrupt and has been renamed to `moved_to`: say so and start empty.
    SetAside {
        /// Why the file was refused (a [`CheckpointError::Corrupt`] naming the original path).
        reason: CheckpointError,
        /// Where the file is now.
        moved_to: PathBuf,
    },
}

/// The checkpoint path in a device plugins directory: `<dir>/kubelet_internal_checkpoint`.
pub fn checkpoint_path(device_plugins_dir: &Path) -> PathBuf {
    device_plugins_dir.join(CHECKPOINT_FILE_NAME)
}

/// Writes `data` to `path` in the kubelet's format, atomically and with fsync.
pub fn write(path: &Path, data: &CheckpointData) -> Result<(), CheckpointError> {
    write_with(path, data, Durability::Fsync)
}

/// Writes `data` to `path` in the kubelet's format, atomically, fsyncing as `durability` says.
pub fn write_with(
    path: &Path,
    data: &CheckpointData,
    durability: Durability,
) -> Result<(), CheckpointError> {
    write_atomic(path, &data.encode(), durability)
}

/// Reads and verifies the checkpoint at `path`: `Ok(None)` when there is no file,
/// [`CheckpointError::Corrupt`] when it does not parse or fails its checksum.
pub fn load(path: &Path) -> Result<Option<CheckpointData>, CheckpointError> {
    load_with(path, CheckpointData::decode)
}

/// Reads the checkpoint at `path`; a corrupt one is renamed aside (never deleted).
///
/// Errors only when the file cannot be read at all or cannot be renamed; the daemon should then
/// refuse to start rather than overwrite something it could not look at.
pub fn load_or_set_aside(path: &Path) -> Result<LoadOutcome<CheckpointData>, CheckpointError> {
    load_or_set_aside_with(path, CheckpointData::decode)
}

/// Writes `bytes` to `path` atomically: temporary file `.<random>` in the same directory,
/// write, fsync, rename over `path`, fsync the directory (fsyncs skipped with
/// [`Durability::NoFsync`]). Creates the directory (mode 0700) when missing. On error the
/// temporary file is removed and `path` keeps its previous content.
pub fn write_atomic(
    path: &Path,
    bytes: &[u8],
    durability: Durability,
) -> Result<(), CheckpointError> {
    write_atomic_in_pieces(path, bytes, durability, usize::MAX)
}

/// [`write_atomic`] for a file that then takes small writes in place (the journal): its bytes
/// are written `piece` bytes at a time. The kernel sizes the page cache's folios by the writes
/// that fill them (ext4 on Linux 6.x), and a small write into a large folio marks each of its
/// blocks dirty in turn: after one 16 MiB write, a 150-byte write into the file took 4.2 µs,
/// after 16 KiB writes 0.9 µs (docs/performance.md).
pub fn write_atomic_in_pieces(
    path: &Path,
    bytes: &[u8],
    durability: Durability,
    piece: usize,
) -> Result<(), CheckpointError> {
    replace_file_in_pieces(path, bytes, durability, piece)?;
    if durability == Durability::Fsync {
        sync_parent(path)?;
    }
    Ok(())
}

/// [`write_atomic`] without the directory fsync, as the kubelet writes its checkpoint: the
/// content is on disk, but after a power cut the name may still point to the previous file
/// until [`sync_parent`] has run. For writers that batch directory syncs and know which files
/// may be on disk meanwhile.
pub fn replace_file(
    path: &Path,
    bytes: &[u8],
    durability: Durability,
) -> Result<(), CheckpointError> {
    replace_file_in_pieces(path, bytes, durability, usize::MAX)
}

/// [`replace_file`], writing `bytes` `piece` bytes at a time (see [`write_atomic_in_pieces`]).
fn replace_file_in_pieces(
    path: &Path,
    bytes: &[u8],
    durability: Durability,
    piece: usize,
) -> Result<(), CheckpointError> {
    let fail = |step: &'static str| {
        move |source: io::Error| CheckpointError::Write {
            path: path.to_path_buf(),
            step,
            source,
        }
    };
    let dir = parent_dir(path);
    if !dir.is_dir() {
        create_dir(dir).map_err(fail("create the directory"))?;
    }
    let mut tmp = tempfile::Builder::new()
        .prefix(".")
        .rand_bytes(10)
        .tempfile_in(dir)
        .map_err(fail("create a temporary file"))?;
    for piece in bytes.chunks(piece.max(1)) {
        tmp.write_all(piece)
            .map_err(fail("write the temporary file"))?;
    }
    if durability == Durability::Fsync {
        tmp.as_file()
            .sync_all()
            .map_err(fail("fsync the temporary file"))?;
    }
    tmp.persist(path)
        .map_err(|e| fail("rename the temporary file over it")(e.error))?;
    Ok(())
}

/// Fsyncs the directory holding `path`, so that renames in it survive a power cut.
pub fn sync_parent(path: &Path) -> Result<(), CheckpointError> {
    sync_dir(parent_dir(path)).map_err(|source| CheckpointError::Write {
        path: path.to_path_buf(),
        step: "fsync the directory",
        source,
    })
}

/// Renames the file at `path` to `<name>.corrupt-<unix seconds>` (with `.1`, `.2`, … appended
/// if that exists) in the same directory, never replacing another file, and returns the new
/// path.
pub fn set_aside(path: &Path) -> Result<PathBuf, CheckpointError> {
    aside_with(path, move_no_replace)
}

/// Keeps the file at `path` as `<name>.corrupt-<unix seconds>` (named as [`set_aside`] does)
/// and leaves it in place too: a hard link (no bytes copied), or a copy where the filesystem
/// has no hard links. Returns the copy's path.
///
/// For a caller that will replace the corrupt file atomically: until it does, the name still
/// holds the corrupt file, never nothing, so a crash in between finds the same evidence again.
pub fn keep_copy(path: &Path) -> Result<PathBuf, CheckpointError> {
    aside_with(path, copy_no_replace)
}

/// Gives the file at `path` a free `<name>.corrupt-<unix seconds>[.n]` name with `place`.
fn aside_with(
    path: &Path,
    place: fn(&Path, &Path) -> io::Result<()>,
) -> Result<PathBuf, CheckpointError> {
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut base = path.file_name().map(OsString::from).unwrap_or_default();
    base.push(format!("{SET_ASIDE_MARKER}{seconds}"));
    let dir = parent_dir(path);
    let mut attempt = 0u32;
    loop {
        let mut name = base.clone();
        if attempt > 0 {
            name.push(format!(".{attempt}"));
        }
        let to = dir.join(name);
        match place(path, &to) {
            Ok(()) => {
                // Best effort: the data is safe either way, only the new name may not persist.
                let _ = sync_dir(dir);
                return Ok(to);
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempt < 1000 => attempt += 1,
            Err(source) => {
                return Err(CheckpointError::SetAside {
                    path: path.to_path_buf(),
                    to,
                    source,
                });
            }
        }
    }
}

/// Reads `path` and decodes it with `decode`; `Ok(None)` when the file does not exist.
pub(crate) fn load_with<T>(
    path: &Path,
    decode: impl FnOnce(&[u8]) -> Result<T, FormatError>,
) -> Result<Option<T>, CheckpointError> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(CheckpointError::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    decode(&bytes)
        .map(Some)
        .map_err(|source| CheckpointError::Corrupt {
            path: path.to_path_buf(),
            source,
        })
}

/// [`load_with`], renaming a corrupt file aside.
pub(crate) fn load_or_set_aside_with<T>(
    path: &Path,
    decode: impl FnOnce(&[u8]) -> Result<T, FormatError>,
) -> Result<LoadOutcome<T>, CheckpointError> {
    match load_with(path, decode) {
        Ok(Some(value)) => Ok(LoadOutcome::Loaded(value)),
        Ok(None) => Ok(LoadOutcome::Missing),
        Err(reason) if reason.is_corrupt() => {
            let moved_to = set_aside(path)?;
            tracing::warn!(
                path = %path.display(),
                moved_to = %moved_to.display(),
                error = %pluglet_core::error_chain(&reason),
                "corrupt checkpoint set aside; starting with an empty state"
            );
            Ok(LoadOutcome::SetAside { reason, moved_to })
        }
        Err(e) => Err(e),
    }
}

/// The directory holding `path` (`.` for a bare file name).
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

#[cfg(unix)]
fn create_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

#[cfg(not(unix))]
fn create_dir(dir: &Path) -> io::Result<()> {
    fs::create_dir_all(dir)
}

#[cfg(unix)]
fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> io::Result<()> {
    Ok(())
}

/// Links (or, without hard links, copies) `from` to `to` unless `to` exists (`AlreadyExists`
/// then).
fn copy_no_replace(from: &Path, to: &Path) -> io::Result<()> {
    match fs::hard_link(from, to) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(e),
        Err(_) => {
            let mut source = File::open(from)?;
            let mut copy = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(to)?;
            io::copy(&mut source, &mut copy)?;
            copy.sync_all()
        }
    }
}

/// Moves `from` to `to` unless `to` exists (`AlreadyExists` then): a hard link fails rather
/// than replace, then the old name is removed. Falls back to a checked rename where the
/// filesystem has no hard links.
fn move_no_replace(from: &Path, to: &Path) -> io::Result<()> {
    match fs::hard_link(from, to) {
        Ok(()) => fs::remove_file(from),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(e),
        Err(_) => {
            if to.exists() {
                return Err(io::Error::from(io::ErrorKind::AlreadyExists));
            }
            fs::rename(from, to)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::format::PodDevicesEntry;

    fn data() -> CheckpointData {
        CheckpointData {
            pod_device_entries: Some(vec![PodDevicesEntry {
                pod_uid: "pod-uid-1".into(),
                container_name: "ctr".into(),
                resource_name: "example.com/gpu".into(),
                device_ids: Some(BTreeMap::from([(0, Some(vec!["dev0".into()]))])),
                alloc_resp: Some(vec![1, 2, 3]),
            }]),
            registered_devices: BTreeMap::from([(
                "example.com/gpu".into(),
                Some(vec!["dev0".into(), "dev1".into()]),
            )]),
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn write_then_load_both_durabilities() {
        let dir = tempfile::tempdir().unwrap();
        let path = checkpoint_path(dir.path());
        for durability in [Durability::Fsync, Durability::NoFsync] {
            write_with(&path, &data(), durability).unwrap();
            assert_eq!(load(&path).unwrap(), Some(data()));
            assert_eq!(fs::read(&path).unwrap(), data().encode());
        }
        // Only the checkpoint: no temporary file left behind.
        assert_eq!(names(dir.path()), vec![CHECKPOINT_FILE_NAME.to_owned()]);
    }

    #[cfg(unix)]
    #[test]
    fn written_file_is_private() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("new-dir").join(CHECKPOINT_FILE_NAME);
        write(&path, &CheckpointData::default()).unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dir_mode = fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dir_mode & 0o077, 0, "directory mode {dir_mode:o}");
    }

    #[test]
    fn written_in_pieces_is_the_same_file() {
        let dir = tempfile::tempdir().unwrap();
        let bytes: Vec<u8> = (0..=255u8).cycle().take(40_000).collect();
        for piece in [0, 1, 3, 16 << 10, 40_000, usize::MAX] {
            let path = dir.path().join(format!("in-pieces-{piece}"));
            write_atomic_in_pieces(&path, &bytes, Durability::NoFsync, piece).unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), bytes, "pieces of {piece}");
        }
    }

    #[test]
    fn overwrite_replaces_content() {
        let dir = tempfile::tempdir().unwrap();
        let path = checkpoint_path(dir.path());
        write(&path, &data()).unwrap();
        write(&path, &CheckpointData::default()).unwrap();
        assert_eq!(load(&path).unwrap(), Some(CheckpointData::default()));
    }

    #[test]
    fn missing_file_is_none_and_missing() {
        let dir = tempfile::tempdir().unwrap();
        let path = checkpoint_path(dir.path());
        assert_eq!(load(&path).unwrap(), None);
        assert!(matches!(
            load_or_set_aside(&path).unwrap(),
            LoadOutcome::Missing
        ));
    }

    #[test]
    fn loaded_outcome_for_a_good_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = checkpoint_path(dir.path());
        write(&path, &data()).unwrap();
        match load_or_set_aside(&path).unwrap() {
            LoadOutcome::Loaded(loaded) => assert_eq!(loaded, data()),
            other => panic!("expected Loaded, got {other:?}"),
        }
        assert!(path.exists());
    }

    #[test]
    fn unparsable_file_is_a_typed_error_and_is_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let path = checkpoint_path(dir.path());
        fs::write(&path, b"{not json").unwrap();
        let err = load(&path).unwrap_err();
        assert!(matches!(
            &err,
            CheckpointError::Corrupt {
                source: FormatError::Json(_),
                ..
            }
        ));
        assert_eq!(err.path(), path);
        let message = err.to_string();
        assert!(message.contains(&path.display().to_string()), "{message}");

        match load_or_set_aside(&path).unwrap() {
            LoadOutcome::SetAside { reason, moved_to } => {
                assert!(reason.is_corrupt());
                assert!(!path.exists());
                assert_eq!(moved_to.parent(), Some(dir.path()));
                let name = moved_to.file_name().unwrap().to_string_lossy().into_owned();
                assert!(
                    name.starts_with(&format!("{CHECKPOINT_FILE_NAME}{SET_ASIDE_MARKER}")),
                    "{name}"
                );
                assert_eq!(fs::read(&moved_to).unwrap(), b"{not json");
            }
            other => panic!("expected SetAside, got {other:?}"),
        }
        // The next start finds nothing and starts empty.
        assert!(matches!(
            load_or_set_aside(&path).unwrap(),
            LoadOutcome::Missing
        ));
    }

    #[test]
    fn checksum_mismatch_is_set_aside_and_never_overwrites_an_earlier_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = checkpoint_path(dir.path());
        let tampered = |round: usize| {
            String::from_utf8(data().encode())
                .unwrap()
                .replace("dev1", &format!("devX{round}"))
        };
        let mut moved = Vec::new();
        for round in 0..3 {
            fs::write(&path, tampered(round)).unwrap();
            let err = load(&path).unwrap_err();
            assert!(matches!(
                &err,
                CheckpointError::Corrupt {
                    source: FormatError::ChecksumMismatch { .. },
                    ..
                }
            ));
            match load_or_set_aside(&path).unwrap() {
                LoadOutcome::SetAside { moved_to, .. } => moved.push(moved_to),
                other => panic!("expected SetAside, got {other:?}"),
            }
        }
        // Three distinct files, each with its own content (same second or not).
        for (round, file) in moved.iter().enumerate() {
            assert_eq!(fs::read_to_string(file).unwrap(), tampered(round));
        }
        assert_eq!(names(dir.path()).len(), 3);
    }

    #[test]
    fn checksum_mismatch_names_both_checksums() {
        let dir = tempfile::tempdir().unwrap();
        let path = checkpoint_path(dir.path());
        let tampered = String::from_utf8(data().encode())
            .unwrap()
            .replace("dev1", "dev7");
        fs::write(&path, tampered).unwrap();
        match load(&path) {
            Err(CheckpointError::Corrupt {
                source: FormatError::ChecksumMismatch { stored, computed },
                ..
            }) => {
                assert_eq!(stored, data().checksum().to_string());
                assert_ne!(stored, computed);
            }
            other => panic!("expected a checksum mismatch, got {other:?}"),
        }
    }

    #[cfg(unix)]
    #[test]
    fn unreadable_path_is_a_read_error_not_a_set_aside() {
        // A directory where the file should be: reading fails with something other than NotFound.
        let dir = tempfile::tempdir().unwrap();
        let path = checkpoint_path(dir.path());
        fs::create_dir(&path).unwrap();
        let err = load_or_set_aside(&path).unwrap_err();
        assert!(matches!(err, CheckpointError::Read { .. }), "{err:?}");
        assert!(path.is_dir());
    }

    #[test]
    fn failed_write_names_the_step_and_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = checkpoint_path(dir.path());
        write(&path, &data()).unwrap();
        // Renaming a file over a non-empty directory fails.
        let blocked = dir.path().join("blocked");
        fs::create_dir(&blocked).unwrap();
        fs::write(blocked.join("x"), b"x").unwrap();
        let err = write(&blocked, &data()).unwrap_err();
        match &err {
            CheckpointError::Write { step, .. } => assert!(step.contains("rename"), "{step}"),
            other => panic!("expected a write error, got {other:?}"),
        }
        assert!(err.to_string().contains("blocked"));
        assert_eq!(load(&path).unwrap(), Some(data()));
        let mut left = names(dir.path());
        left.retain(|n| n.starts_with('.'));
        assert!(left.is_empty(), "temporary files left: {left:?}");
    }

    #[test]
    fn relative_bare_file_name_uses_current_directory_parent() {
        assert_eq!(parent_dir(Path::new("file")), Path::new("."));
        assert_eq!(parent_dir(Path::new("/a/file")), Path::new("/a"));
    }

    #[test]
    fn error_chain_joins_causes() {
        let err = CheckpointError::Corrupt {
            path: PathBuf::from("/x/cp"),
            source: FormatError::ChecksumMismatch {
                stored: "1".into(),
                computed: "2".into(),
            },
        };
        let text = pluglet_core::error_chain(&err);
        assert!(text.starts_with("checkpoint /x/cp is corrupt"), "{text}");
        assert!(
            text.ends_with(": checksum mismatch: the file says 1, its data hashes to 2"),
            "{text}"
        );
    }
}
