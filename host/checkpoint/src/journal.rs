//! A two-slot journal: the cheapest durable write this crate has.
//!
//! The kubelet's way to make a change durable (temporary file, fsync, rename) allocates blocks
//! and commits filesystem metadata on every write: about 0.6–0.9 ms on a virtual disk. The
//! journal is one file made once with its blocks written out (zeros), holding two fixed-size
//! slots. A record overwrites the older slot in place and is made durable with `fdatasync`,
//! which then only has data to flush (no block allocation, no size change): about a quarter of
//! the cost.
//!
//! Each slot starts with a header (magic, sequence number, length, CRC-32 of sequence, length
//! and payload). A write torn by a crash breaks only the slot being written; the other still
//! holds the previous record, so [`Journal::open`] always finds the newest complete record.
//! A record larger than half a slot grows the file: a new file with larger slots is written and
//! renamed over the old one (temporary file, fsync, rename, directory fsync), once.
//!
//! Changes: a record ([`Journal::append`]) holds a whole state, so its cost grows with the
//! state. A change to it ([`Journal::append_change`]) is written instead right after the newest
//! record and the changes before it, in the same slot (its own header: another magic, the next
//! sequence number, its own CRC), with the same `fdatasync`: its cost is the change's, however
//! large the state. When the slot has no room left, the caller writes a whole record again,
//! into the other slot. Several records and changes may be written before one `fdatasync`
//! ([`Journal::write`], [`Journal::write_change`], then [`Journal::sync`]): a group commit, one
//! sync for all. A change torn by a crash ends the chain there: the record and the
//! changes before it still stand (the torn one was never acknowledged). Reading a slot follows
//! the chain while each change carries the next sequence number and an intact CRC, so what is
//! left of older chains in a reused slot (smaller sequence numbers) is never taken for part of
//! it. A reader that knows only whole records (before changes existed) reads the record alone.
//!
//! What a record means is the caller's business (the device manager keeps its allocations
//! here, ahead of the kubelet-format checkpoint).

use std::fs::{File, OpenOptions};
use std::io::{self, Read as _};
use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use crate::error::CheckpointError;
use crate::store::{Durability, set_aside};

/// The first bytes of every slot.
const MAGIC: &[u8; 8] = b"PLGJRNL1";

/// The first bytes of every change written after a slot's record.
const CHANGE_MAGIC: &[u8; 8] = b"PLGJCHG1";

/// Header: magic (8), sequence (8), payload length (4), CRC-32 (4), reserved (8).
const HEADER: usize = 32;

/// Slot size of a new journal (two slots: 128 KiB on disk).
pub const INITIAL_SLOT_SIZE: usize = 64 << 10;

/// The writes a new journal file is made with: the page cache's folios for its slots stay this
/// small, so a change's write into them costs the same in a journal of 64 KiB slots and in one
/// of 8 MiB.
const WRITE_PIECE: usize = 16 << 10;

/// The newest complete record of a journal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JournalRecord {
    /// The sequence number of its newest change, or its own when it has none (1 for the first
    /// record ever written).
    pub seq: u64,
    /// What the caller wrote with [`Journal::append`].
    pub payload: Vec<u8>,
    /// What the caller wrote after it with [`Journal::append_change`], oldest first.
    pub changes: Vec<Vec<u8>>,
}

/// What [`Journal::open`] found.
#[derive(Debug)]
pub struct Opened {
    /// The journal, ready to append.
    pub journal: Journal,
    /// The newest complete record, if any.
    pub record: Option<JournalRecord>,
    /// Set when the file was not a whole journal and was set aside (renamed): where it went.
    pub set_aside: Option<PathBuf>,
    /// True when `record` was recovered from the file set aside (a journal cut short, or with
    /// a damaged header, still holding an intact record); the new journal starts from it.
    pub salvaged: bool,
}

/// An open journal (see the module doc). Not shared: the caller serialises appends.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: File,
    slot_size: usize,
    seq: u64,
    durability: Durability,
    /// The slot holding the newest record, and where its chain of changes ends in it (`0`:
    /// no record yet, so no change can be written).
    slot: usize,
    tail: usize,
    /// Something was written since the last `fdatasync`.
    unsynced: bool,
    /// A whole record was written since the last `fdatasync` (the slot of the durable one is
    /// the only one left to fall back on).
    unsynced_record: bool,
}

impl Journal {
    /// Opens the journal at `path`, creating it (two zeroed slots, fsynced) when missing.
    ///
    /// A file that is not a whole journal (not a journal at all, cut short, or with both slots
    /// damaged) is renamed to `<name>.corrupt-<unix seconds>`, never deleted, and a fresh
    /// journal is made, starting from the newest intact record still found in the old file
    /// (see [`salvage`]), if any.
    pub fn open(path: &Path, durability: Durability) -> Result<Opened, CheckpointError> {
        let read_error = |source| CheckpointError::Read {
            path: path.to_path_buf(),
            source,
        };
        match File::open(path) {
            Ok(mut file) => {
                let mut bytes = Vec::new();
                file.read_to_end(&mut bytes).map_err(read_error)?;
                if let Some((slot_size, newest)) = parse_file(&bytes) {
                    let seq = newest.as_ref().map_or(0, |(_, r, _)| r.seq);
                    let (slot, tail) = newest
                        .as_ref()
                        .map_or((0, 0), |(slot, _, tail)| (*slot, *tail));
                    let record = newest.map(|(_, r, _)| r);
                    let file = OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open(path)
                        .map_err(|source| CheckpointError::Write {
                            path: path.to_path_buf(),
                            step: "open the journal for writing",
                            source,
                        })?;
                    return Ok(Opened {
                        journal: Journal {
                            path: path.to_path_buf(),
                            file,
                            slot_size,
                            seq,
                            durability,
                            slot,
                            tail,
                            unsynced: false,
                            unsynced_record: false,
                        },
                        record,
                        set_aside: None,
                        salvaged: false,
                    });
                }
                let salvaged = salvage(&bytes);
                let moved_to = set_aside(path)?;
                // The new journal starts from the salvaged record and its changes, as one chain.
                let journal = match &salvaged {
                    None => Journal::create(path, INITIAL_SLOT_SIZE, None, durability)?,
                    Some(r) => {
                        let chain = chain_bytes(r);
                        Journal::create(
                            path,
                            slot_size_for(INITIAL_SLOT_SIZE, chain.len()),
                            Some((r.seq, &chain)),
                            durability,
                        )?
                    }
                };
                return Ok(Opened {
                    journal,
                    salvaged: salvaged.is_some(),
                    record: salvaged,
                    set_aside: Some(moved_to),
                });
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(read_error(e)),
        }
        let journal = Journal::create(path, INITIAL_SLOT_SIZE, None, durability)?;
        Ok(Opened {
            journal,
            record: None,
            set_aside: None,
            salvaged: false,
        })
    }

    /// Reads the newest complete record of the journal at `path` without opening it for
    /// writing: `Ok(None)` when there is no file or no record yet, or when the file is not a
    /// journal (which [`Journal::open`] would set aside). For a state directory that cannot be
    /// written to: what the journal holds can still be restored.
    pub fn read(path: &Path) -> Result<Option<JournalRecord>, CheckpointError> {
        match std::fs::read(path) {
            Ok(bytes) => Ok(match parse_file(&bytes) {
                Some((_, newest)) => newest.map(|(_, r, _)| r),
                None => salvage(&bytes),
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(CheckpointError::Read {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The sequence number of the last record written (0: none yet).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Writes `payload` as the newest record (a whole state: the changes before it no longer
    /// count) and waits until it is on disk (`fdatasync`, skipped with [`Durability::NoFsync`]).
    /// On error the previous record and its changes stay the newest.
    pub fn append(&mut self, payload: &[u8]) -> Result<(), CheckpointError> {
        self.write(payload)?;
        self.sync()
    }

    /// Writes `change` after the newest record and its changes, in the same slot, and waits
    /// until it is on disk. `Ok(false)` (nothing written) when there is no record yet or no room
    /// left in the slot: write a whole record with [`Journal::append`] instead. On error the
    /// change does not count (a reader stops before it).
    pub fn append_change(&mut self, change: &[u8]) -> Result<bool, CheckpointError> {
        if !self.write_change(change)? {
            return Ok(false);
        }
        self.sync()?;
        Ok(true)
    }

    /// [`Journal::append`] without waiting for the disk: the record counts once
    /// [`Journal::sync`] has returned. Records and changes written before one `sync` are made
    /// durable together (a group commit); a crash before it leaves the newest durable record
    /// and a prefix of what followed it (a reader stops at the first torn one). A second whole
    /// record before a `sync` would overwrite the slot holding the durable one, so this syncs
    /// first when one is pending.
    pub fn write(&mut self, payload: &[u8]) -> Result<(), CheckpointError> {
        if self.unsynced_record {
            self.sync()?;
        }
        let seq = self.seq + 1;
        let record = encode_record(MAGIC, seq, payload);
        if 2 * record.len() > self.slot_size {
            // Room for changes after it: at least as much as the record takes. The new file
            // is written, synced and renamed in place: durable at once, with what came before.
            let slot_size = slot_size_for(self.slot_size, record.len());
            *self = Journal::create(&self.path, slot_size, Some((seq, &record)), self.durability)?;
            return Ok(());
        }
        let slot = if self.tail == 0 {
            (seq % 2) as usize
        } else {
            1 - self.slot
        };
        self.write_at(&record, slot * self.slot_size)?;
        self.seq = seq;
        self.slot = slot;
        self.tail = record.len();
        self.unsynced_record = true;
        Ok(())
    }

    /// [`Journal::append_change`] without waiting for the disk (see [`Journal::write`]).
    pub fn write_change(&mut self, change: &[u8]) -> Result<bool, CheckpointError> {
        if self.tail == 0 || self.tail + HEADER + change.len() > self.slot_size {
            return Ok(false);
        }
        let seq = self.seq + 1;
        let record = encode_record(CHANGE_MAGIC, seq, change);
        self.write_at(&record, self.slot * self.slot_size + self.tail)?;
        self.seq = seq;
        self.tail += record.len();
        Ok(true)
    }

    /// Waits until everything written so far is on disk (one `fdatasync`, skipped with
    /// [`Durability::NoFsync`], and when nothing was written since the last one).
    pub fn sync(&mut self) -> Result<(), CheckpointError> {
        if !self.unsynced {
            return Ok(());
        }
        if self.durability == Durability::Fsync {
            self.file
                .sync_data()
                .map_err(|source| CheckpointError::Write {
                    path: self.path.clone(),
                    step: "fdatasync the journal",
                    source,
                })?;
        }
        self.unsynced = false;
        self.unsynced_record = false;
        Ok(())
    }

    /// Writes `bytes` at `offset` (durable at the next [`Journal::sync`]).
    fn write_at(&mut self, bytes: &[u8], offset: usize) -> Result<(), CheckpointError> {
        self.unsynced = true;
        self.file
            .write_all_at(bytes, offset as u64)
            .map_err(|source| CheckpointError::Write {
                path: self.path.clone(),
                step: "write a journal slot",
                source,
            })
    }

    /// Writes a new journal file with two slots of `slot_size` bytes (slot 0 holding `first`,
    /// already encoded records ending with sequence number `seq`, when given) beside `path` and
    /// renames it over `path`.
    fn create(
        path: &Path,
        slot_size: usize,
        first: Option<(u64, &[u8])>,
        durability: Durability,
    ) -> Result<Journal, CheckpointError> {
        let mut bytes = vec![0u8; 2 * slot_size];
        if let Some((_, records)) = first {
            bytes[..records.len()].copy_from_slice(records);
        }
        // In pieces: the changes then written into the slots are small (see
        // `write_atomic_in_pieces`).
        crate::store::write_atomic_in_pieces(path, &bytes, durability, WRITE_PIECE)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o600)
            .open(path)
            .map_err(|source| CheckpointError::Write {
                path: path.to_path_buf(),
                step: "open the new journal",
                source,
            })?;
        Ok(Journal {
            path: path.to_path_buf(),
            file,
            slot_size,
            seq: first.map_or(0, |(seq, _)| seq),
            durability,
            slot: 0,
            tail: first.map_or(0, |(_, records)| records.len()),
            unsynced: false,
            unsynced_record: false,
        })
    }
}

/// The slot size, from `at_least` up by doubling, that leaves room for changes after
/// `records` bytes of records: at least as much again.
fn slot_size_for(at_least: usize, records: usize) -> usize {
    let mut slot_size = at_least;
    while 2 * records > slot_size {
        slot_size *= 2;
    }
    slot_size
}

/// A record and its changes encoded again as one chain (to start a new journal from it).
fn chain_bytes(record: &JournalRecord) -> Vec<u8> {
    let first = record.seq - record.changes.len() as u64;
    let mut out = encode_record(MAGIC, first, &record.payload);
    for (seq, change) in (first + 1..).zip(&record.changes) {
        out.extend_from_slice(&encode_record(CHANGE_MAGIC, seq, change));
    }
    out
}

/// Header and payload of one record (`MAGIC`) or change (`CHANGE_MAGIC`).
fn encode_record(magic: &[u8; 8], seq: u64, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).expect("journal records are far below 4 GiB");
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(magic);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc(seq, len, payload).to_le_bytes());
    out.extend_from_slice(&[0; 8]);
    out.extend_from_slice(payload);
    out
}

/// The slot size and newest record of a whole journal file, with the slot it is in and where
/// its chain of changes ends; `None` when it is not a journal (wrong size, or no valid slot
/// while not all zeros).
#[allow(clippy::type_complexity)]
fn parse_file(bytes: &[u8]) -> Option<(usize, Option<(usize, JournalRecord, usize)>)> {
    let slot_size = slot_size_of(bytes)?;
    let newest = [0, 1]
        .into_iter()
        .filter_map(|slot| {
            parse_chain(&bytes[slot * slot_size..][..slot_size]).map(|(r, tail)| (slot, r, tail))
        })
        .max_by_key(|(_, r, _)| r.seq);
    (newest.is_some() || bytes.iter().all(|&b| b == 0)).then_some((slot_size, newest))
}

/// The newest intact record in a file that is not a whole journal (cut short by a copy or a
/// full disk, or grown by something else): slot 0 starts at offset 0 whatever the slot size,
/// slot 1 at one of the sizes a journal can have; a record counts only if its CRC holds, and
/// brings the intact changes that follow it.
pub fn salvage(bytes: &[u8]) -> Option<JournalRecord> {
    let mut found = parse_chain(bytes).map(|(r, _)| r);
    let mut slot_size = INITIAL_SLOT_SIZE;
    while slot_size < bytes.len() {
        if let Some((record, _)) = parse_chain(&bytes[slot_size..])
            && found.as_ref().is_none_or(|f| record.seq > f.seq)
        {
            found = Some(record);
        }
        slot_size = slot_size.saturating_mul(2);
    }
    found
}

/// The record at the start of `slot` and the changes after it, if the record is complete and
/// intact, with the offset where the chain ends.
fn parse_chain(slot: &[u8]) -> Option<(JournalRecord, usize)> {
    let (seq, payload) = parse_one(slot, MAGIC)?;
    let mut record = JournalRecord {
        seq,
        payload: payload.to_vec(),
        changes: Vec::new(),
    };
    let mut at = HEADER + payload.len();
    while let Some((seq, change)) = parse_one(&slot[at..], CHANGE_MAGIC) {
        if seq != record.seq + 1 {
            break;
        }
        record.seq = seq;
        record.changes.push(change.to_vec());
        at += HEADER + change.len();
    }
    Some((record, at))
}

/// The sequence number and payload of the record or change (by `magic`) at the start of
/// `bytes`, if it is complete and intact.
fn parse_one<'a>(bytes: &'a [u8], magic: &[u8; 8]) -> Option<(u64, &'a [u8])> {
    if bytes.len() < HEADER || &bytes[..8] != magic {
        return None;
    }
    let seq = u64::from_le_bytes(bytes[8..16].try_into().ok()?);
    let len = u32::from_le_bytes(bytes[16..20].try_into().ok()?);
    let stored = u32::from_le_bytes(bytes[20..24].try_into().ok()?);
    let payload = bytes.get(HEADER..HEADER + len as usize)?;
    (seq > 0 && crc(seq, len, payload) == stored).then_some((seq, payload))
}

/// The slot size of a journal file: half its length, if that is a power of two of at least
/// [`INITIAL_SLOT_SIZE`].
fn slot_size_of(bytes: &[u8]) -> Option<usize> {
    let slot = bytes.len() / 2;
    (bytes.len().is_multiple_of(2) && slot >= INITIAL_SLOT_SIZE && slot.is_power_of_two())
        .then_some(slot)
}

/// CRC-32 (IEEE) over sequence, length and payload.
fn crc(seq: u64, len: u32, payload: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&seq.to_le_bytes());
    hasher.update(&len.to_le_bytes());
    hasher.update(payload);
    hasher.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(path: &Path) -> Opened {
        Journal::open(path, Durability::Fsync).unwrap()
    }

    #[test]
    fn a_new_journal_is_empty_and_keeps_the_newest_record() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let opened = open(&path);
        assert!(opened.record.is_none());
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            2 * INITIAL_SLOT_SIZE as u64
        );
        let mut journal = opened.journal;
        for i in 1..=5u8 {
            journal.append(&[i; 10]).unwrap();
        }
        let record = open(&path).record.unwrap();
        assert_eq!((record.seq, record.payload), (5, vec![5; 10]));
    }

    #[test]
    fn a_torn_slot_leaves_the_previous_record() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let mut journal = open(&path).journal;
        journal.append(b"first").unwrap();
        journal.append(b"second").unwrap();
        // Record 2 lives in slot 0: damage its payload as a crash mid-write would.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[HEADER + 2] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let opened = open(&path);
        assert_eq!(
            opened.record,
            Some(JournalRecord {
                seq: 1,
                payload: b"first".to_vec(),
                changes: Vec::new(),
            })
        );
        // Appending goes on from there and overwrites the torn slot.
        let mut journal = opened.journal;
        journal.append(b"third").unwrap();
        assert_eq!(open(&path).record.unwrap().payload, b"third");
    }

    #[test]
    fn a_record_larger_than_a_slot_grows_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let mut journal = open(&path).journal;
        journal.append(b"small").unwrap();
        let big = vec![7u8; 3 * INITIAL_SLOT_SIZE];
        journal.append(&big).unwrap();
        assert!(std::fs::metadata(&path).unwrap().len() >= 2 * big.len() as u64);
        let record = open(&path).record.unwrap();
        assert_eq!((record.seq, record.payload.len()), (2, big.len()));
        journal.append(b"after").unwrap();
        assert_eq!(open(&path).record.unwrap().payload, b"after");
    }

    #[test]
    fn a_journal_cut_short_keeps_its_newest_intact_record() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let mut journal = open(&path).journal;
        journal.append(b"one").unwrap();
        journal.append(b"two").unwrap();
        journal.append(b"three").unwrap();
        let whole = std::fs::read(&path).unwrap();
        // Record 3 is in slot 1, record 2 in slot 0. Every cut: the newest record still whole
        // in what is left, or none when even record 2 is cut.
        let record_3_end = INITIAL_SLOT_SIZE + HEADER + b"three".len();
        let record_2_end = HEADER + b"two".len();
        for cut in [
            0,
            10,
            record_2_end - 1,
            record_2_end,
            4096,
            INITIAL_SLOT_SIZE,
            INITIAL_SLOT_SIZE + 5,
            record_3_end - 1,
            record_3_end,
            whole.len() - 1,
        ] {
            let expected = if cut >= record_3_end {
                Some((3, b"three".to_vec()))
            } else if cut >= record_2_end {
                Some((2, b"two".to_vec()))
            } else {
                None
            };
            let got = salvage(&whole[..cut]).map(|r| (r.seq, r.payload));
            assert_eq!(got, expected, "cut at {cut}");

            std::fs::write(&path, &whole[..cut]).unwrap();
            assert_eq!(
                Journal::read(&path).unwrap().map(|r| r.seq),
                expected.as_ref().map(|e| e.0),
                "read, cut at {cut}"
            );
            let opened = open(&path);
            let moved = opened.set_aside.expect("a journal cut short is set aside");
            assert_eq!(
                std::fs::read(&moved).unwrap(),
                &whole[..cut],
                "kept as it was"
            );
            assert_eq!(opened.salvaged, expected.is_some(), "cut at {cut}");
            assert_eq!(
                opened.record.map(|r| (r.seq, r.payload)),
                expected,
                "cut at {cut}"
            );
            // The new journal is whole, starts from the record kept, and goes on from it.
            let mut journal = opened.journal;
            journal.append(b"next").unwrap();
            let reopened = open(&path);
            assert!(reopened.set_aside.is_none());
            let next = reopened.record.unwrap();
            assert_eq!(next.payload, b"next");
            assert_eq!(next.seq, expected.map_or(1, |e| e.0 + 1));
            std::fs::remove_file(&moved).unwrap();
        }
    }

    #[test]
    fn a_file_that_is_not_a_journal_is_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        std::fs::write(&path, b"not a journal").unwrap();
        let opened = open(&path);
        assert!(opened.record.is_none());
        let moved = opened.set_aside.expect("set aside");
        assert_eq!(std::fs::read(&moved).unwrap(), b"not a journal");
        assert!(open(&path).set_aside.is_none(), "the new journal is valid");
    }

    #[test]
    fn changes_follow_their_record_and_a_torn_one_ends_the_chain() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let mut journal = open(&path).journal;
        assert!(!journal.append_change(b"early").unwrap(), "no record yet");
        journal.append(b"whole-1").unwrap();
        assert!(journal.append_change(b"c2").unwrap());
        assert!(journal.append_change(b"c3").unwrap());
        let record = open(&path).record.unwrap();
        assert_eq!(record.seq, 3);
        assert_eq!(record.payload, b"whole-1");
        assert_eq!(record.changes, [b"c2".to_vec(), b"c3".to_vec()]);

        // A new whole record goes to the other slot; its changes follow it there.
        journal.append(b"whole-4").unwrap();
        assert!(journal.append_change(b"c5").unwrap());
        let record = open(&path).record.unwrap();
        assert_eq!(
            (record.seq, record.payload.as_slice()),
            (5, &b"whole-4"[..])
        );
        assert_eq!(record.changes, [b"c5".to_vec()]);

        // Change 5 torn by a crash: the chain ends before it, and the next change takes its place.
        let mut bytes = std::fs::read(&path).unwrap();
        let at = HEADER + b"whole-4".len() + HEADER;
        bytes[at] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let opened = open(&path);
        let record = opened.record.unwrap();
        assert_eq!((record.seq, record.changes.len()), (4, 0));
        let mut journal = opened.journal;
        assert!(journal.append_change(b"c5-again").unwrap());
        let record = open(&path).record.unwrap();
        assert_eq!(record.seq, 5);
        assert_eq!(record.changes, [b"c5-again".to_vec()]);

        // A torn whole record leaves the other slot's record and all its changes.
        journal.append(b"whole-6").unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        // Whole records alternate slots: 1 (seq 1), 0 (seq 4), 1 (seq 6).
        let at = INITIAL_SLOT_SIZE + HEADER + 1;
        bytes[at] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let record = open(&path).record.unwrap();
        assert_eq!(
            (record.seq, record.payload.as_slice()),
            (5, &b"whole-4"[..])
        );
        assert_eq!(record.changes, [b"c5-again".to_vec()]);
    }

    /// A group: records written one after the other and synced once. A crash before the sync
    /// may keep any part of what was written; a reader takes the durable record and the intact
    /// prefix of what followed, never a record after a torn one, and a second whole record in
    /// a group never overwrites the slot holding the durable one.
    #[test]
    fn a_group_written_before_one_sync_is_read_as_a_prefix() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let mut journal = open(&path).journal;
        journal.append(b"whole-1").unwrap();
        assert!(journal.write_change(b"c2").unwrap());
        assert!(journal.write_change(b"c3").unwrap());
        assert!(journal.write_change(b"c4").unwrap());
        journal.sync().unwrap();
        let base = journal.slot * INITIAL_SLOT_SIZE;
        let record = open(&path).record.unwrap();
        assert_eq!(record.seq, 4);
        assert_eq!(record.changes.len(), 3);

        // c3 never reached the disk: c4, written after it, does not count either.
        let mut bytes = std::fs::read(&path).unwrap();
        let at = base + HEADER + b"whole-1".len() + HEADER + b"c2".len() + HEADER;
        bytes[at] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let record = open(&path).record.unwrap();
        assert_eq!(record.seq, 2, "the chain ends before the torn change");
        assert_eq!(record.changes, [b"c2".to_vec()]);

        // Two whole records in one group: the first is synced before the second overwrites the
        // other slot, so tearing the second leaves the first.
        let mut journal = open(&path).journal;
        journal.write(b"whole-3").unwrap();
        let slot_of_3 = journal.slot;
        journal.write(b"whole-4").unwrap();
        assert_ne!(journal.slot, slot_of_3);
        journal.sync().unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[journal.slot * INITIAL_SLOT_SIZE + HEADER] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let record = open(&path).record.unwrap();
        assert_eq!(
            (record.seq, record.payload.as_slice()),
            (3, &b"whole-3"[..])
        );
    }

    #[test]
    fn a_full_slot_asks_for_a_whole_record_and_a_salvaged_chain_is_kept_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let mut journal = open(&path).journal;
        journal.append(b"whole").unwrap();
        let change = vec![9u8; 1000];
        let mut written = 0;
        while journal.append_change(&change).unwrap() {
            written += 1;
        }
        assert!(
            written > 10 && written < INITIAL_SLOT_SIZE / 1000,
            "{written}"
        );
        let record = open(&path).record.unwrap();
        assert_eq!(record.changes.len(), written);

        // Cut short: set aside, and the new journal starts from the whole chain.
        let whole = std::fs::read(&path).unwrap();
        std::fs::write(&path, &whole[..whole.len() - 1]).unwrap();
        let opened = open(&path);
        assert!(opened.salvaged);
        let mut journal = opened.journal;
        assert_eq!(open(&path).record.unwrap().changes.len(), written);
        assert!(journal.append_change(b"next").unwrap());
        let record = open(&path).record.unwrap();
        assert_eq!(record.changes.len(), written + 1);
        assert_eq!(record.seq, 1 + written as u64 + 1);
    }
}
