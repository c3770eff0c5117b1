//! [`Disk`]: what a journal record names (the checkpoint files that may be in place if the
//! process dies now) and the journal it is written to, behind the lock that orders journal
//! records, the checkpoint writer's snapshots and the naming of their files.

use std::path::Path;

use pluglet_checkpoint::{CheckpointError, Durability, Journal};

/// The checkpoint writer fsyncs the directory (making its renames survive a power cut) after
/// this many renames.
const DIR_SYNC_AFTER: usize = 4;

/// How many checkpoint files a journal record names at most (more only while writes keep
/// failing).
const MAX_ON_DISK: usize = 16;

/// The durable side of the state, behind one async mutex so that journal records and the
/// checkpoint writer's snapshots are ordered: a snapshot never sees a change whose record is
/// not on disk yet, and before a snapshot's file is written the journal's newest record names
/// it (every record written once its checksum is known does; see `Persistence::name`).
#[derive(Debug)]
pub(crate) struct Disk {
    /// The allocation journal; `None` while it cannot be opened for writing (a read-only state
    /// directory, say): every change tries again, and is refused until it can be.
    pub journal: Option<Journal>,
    /// Kubelet checksums of the checkpoint files that may be in place if the process dies now:
    /// the one found at start or last written, and any being written (or that failed to be)
    /// since. [`NO_CHECKPOINT`] stands for "no file".
    pub on_disk: Vec<u64>,
    /// Renames since the last directory fsync.
    pub unsynced: usize,
    /// Whether the journal's newest record and its changes hold the state as it is now, so a
    /// change can be written as what it changed. At start, whether they hold the state
    /// restored (it may come from a checkpoint newer than the journal: then a whole record is
    /// written first); false after any failed write (what reached the disk is then unknown).
    pub based: bool,
    /// Journal records this process has written to the file (or tried to): a checkpoint
    /// snapshot taken when this was `n` may lack the changes of any record after the `n`th.
    pub records: u64,
}

/// What a journal record names for "no checkpoint file in place" (a kubelet checksum is a
/// 32-bit FNV value, so it never equals this).
pub const NO_CHECKPOINT: u64 = u64::MAX;

impl Disk {
    /// A snapshot with this checksum is about to be written.
    pub fn writing(&mut self, checksum: u64) {
        self.on_disk.push(checksum);
        if self.on_disk.len() > MAX_ON_DISK {
            self.on_disk.remove(0);
        }
    }

    /// The file with this checksum is in place: earlier ones are gone.
    pub fn written(&mut self, checksum: u64) {
        self.on_disk.clear();
        self.on_disk.push(checksum);
        self.unsynced += 1;
    }

    /// Whether the writer should fsync the directory now.
    pub fn needs_dir_sync(&self) -> bool {
        self.unsynced >= DIR_SYNC_AFTER
    }

    /// Writes `payload` as the journal's newest record (a whole state), opening the journal
    /// first if it is not open (it could not be at start, or a previous attempt failed); it
    /// counts once [`Disk::sync`] has returned.
    pub(super) fn write(
        &mut self,
        path: &Path,
        durability: Durability,
        payload: &[u8],
    ) -> Result<(), CheckpointError> {
        let written = self.journal(path, durability)?.write(payload);
        self.records += 1;
        self.based = written.is_ok();
        written
    }

    /// Writes `change` after the journal's newest record (see [`Journal::write_change`]);
    /// `Ok(false)` when a whole record must be written instead.
    pub(super) fn write_change(
        &mut self,
        path: &Path,
        durability: Durability,
        change: &[u8],
    ) -> Result<bool, CheckpointError> {
        if !self.based {
            return Ok(false);
        }
        let written = self.journal(path, durability)?.write_change(change);
        self.records += 1;
        self.based = written.is_ok();
        written
    }

    /// Makes everything written since the last sync durable with one `fdatasync`. After a
    /// failure what reached the disk is unknown, so the next record is a whole one.
    pub(super) fn sync(&mut self) -> Result<(), CheckpointError> {
        let Some(journal) = self.journal.as_mut() else {
            return Ok(());
        };
        let synced = journal.sync();
        self.based &= synced.is_ok();
        synced
    }

    /// The journal, opened first if it is not open.
    fn journal(
        &mut self,
        path: &Path,
        durability: Durability,
    ) -> Result<&mut Journal, CheckpointError> {
        if self.journal.is_none() {
            self.based = false;
            let opened = Journal::open(path, durability)?;
            if let Some(moved_to) = &opened.set_aside {
                tracing::warn!(
                    path = %path.display(),
                    moved_to = %moved_to.display(),
                    "the allocation journal was not a journal any more; kept aside, starting a new one"
                );
            }
            tracing::info!(path = %path.display(), "allocation journal open for writing again");
            self.journal = Some(opened.journal);
        }
        Ok(self.journal.as_mut().expect("opened above"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_names_the_file_in_place_and_the_one_being_written() {
        let dir = tempfile::tempdir().unwrap();
        let mut disk = Disk {
            journal: Some(
                Journal::open(&dir.path().join("j"), Durability::NoFsync)
                    .unwrap()
                    .journal,
            ),
            on_disk: Vec::new(),
            unsynced: 0,
            based: false,
            records: 0,
        };
        disk.writing(1);
        disk.written(1);
        disk.writing(2);
        assert_eq!(disk.on_disk, [1, 2], "a crash now leaves either in place");
        disk.written(2);
        assert_eq!(
            disk.on_disk,
            [2],
            "file 1 is gone for good once 2 is in place"
        );
        disk.writing(3);
        disk.writing(4);
        assert_eq!(disk.on_disk, [2, 3, 4], "a failed write stays named");
        assert!(!disk.needs_dir_sync());
        disk.written(4);
        disk.written(4);
        disk.written(4);
        assert!(disk.needs_dir_sync(), "every fourth rename");
    }
}
