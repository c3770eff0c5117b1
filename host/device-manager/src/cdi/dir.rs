//! The CDI spec directory: Pluglet's `pluglet-*.json` files in it, each written whole or not at
//! all (a temporary file renamed over the old one, mode 0644) so that a runtime reading the
//! directory at any moment sees either the old spec or the new one. Nothing else in the
//! directory is read, changed or removed.
//!
//! The temporary files live in a subdirectory, [`TEMP_DIR`], never beside the specs: a runtime
//! lists the directory and then looks at each name, and some CDI libraries (the one in podman
//! 4.3) abandon the whole scan, seeing no device at all, when a listed name is gone by then, as
//! a temporary file is once renamed. Runtimes skip subdirectories. A spec removed at a release
//! can still vanish under such a scan; see docs/cdi.md.

use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use super::names::{DEVICE_PREFIX, Kind};

/// Start of every file name Pluglet writes in the directory.
pub const FILE_PREFIX: &str = "pluglet-";
/// End of every spec file name (runtimes read `*.json` and `*.yaml`).
pub const FILE_SUFFIX: &str = ".json";
/// The subdirectory holding a spec while it is written (runtimes read no subdirectory).
pub const TEMP_DIR: &str = ".pluglet-tmp";
/// Start of a temporary file left beside the specs by an older Pluglet (removed at start).
const OLD_TEMP_PREFIX: &str = ".pluglet-";

/// The file name of the spec of `device` of `kind`: `pluglet-<vendor>=<class>=<device>.json`
/// with the device name's own `pluglet-` left out (`=` appears in no vendor, class or device
/// name, so no two specs share a file), or `pluglet-h<hash>.json` when that would be longer
/// than a file name may be.
pub fn file_name(kind: &Kind, device: &str) -> String {
    let tail = device.strip_prefix(DEVICE_PREFIX).unwrap_or(device);
    let name = [
        FILE_PREFIX,
        &kind.vendor,
        "=",
        &kind.class,
        "=",
        tail,
        FILE_SUFFIX,
    ]
    .concat();
    if name.len() <= 250 {
        return name;
    }
    let hash = Sha256::digest(kind.qualified(device).as_bytes());
    format!("{FILE_PREFIX}h{}{FILE_SUFFIX}", &hex::encode(hash)[..40])
}

/// Pluglet's files in one CDI spec directory.
#[derive(Clone, Debug)]
pub struct SpecDir {
    path: PathBuf,
}

impl SpecDir {
    /// The directory at `path` (created, mode 0755, at the first write).
    pub fn new(path: PathBuf) -> SpecDir {
        SpecDir { path }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Creates the directory (mode 0755) and its temporary subdirectory (mode 0700) unless
    /// they exist.
    pub fn create(&self) -> std::io::Result<()> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&self.path)?;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(self.path.join(TEMP_DIR))
    }

    /// Writes `content` as `file`, replacing what was there in one step. No fsync: after a
    /// crash the start-up reconciliation rewrites every spec from the checkpoint.
    /// The directory is made only when it is missing (start-up makes it; this covers its
    /// removal while the daemon runs), so an allocation pays no extra system call.
    pub fn write(&self, file: &str, content: &[u8]) -> std::io::Result<()> {
        // Both paths made at their final size: one allocation each (this runs per allocation).
        let dir = self.path.as_os_str().len();
        let mut temp = PathBuf::with_capacity(dir + TEMP_DIR.len() + file.len() + 6);
        temp.push(&self.path);
        temp.push(TEMP_DIR);
        temp.push(file);
        temp.as_mut_os_string().push(".tmp");
        let mut target = PathBuf::with_capacity(dir + file.len() + 1);
        target.push(&self.path);
        target.push(file);
        let open = || {
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o644)
                .open(&temp)
        };
        let result = (|| {
            let mut out = match open() {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    self.create()?;
                    open()?
                }
                opened => opened?,
            };
            // The mode given to open is narrowed by the umask; runtimes of other users read it.
            out.set_permissions(std::fs::Permissions::from_mode(0o644))?;
            out.write_all(content)?;
            std::fs::rename(&temp, &target)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&temp);
        }
        result
    }

    /// Removes `file`; one already gone is no error.
    pub fn remove(&self, file: &str) -> std::io::Result<()> {
        match std::fs::remove_file(self.path.join(file)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// What `file` holds now, if it exists.
    pub fn read(&self, file: &str) -> std::io::Result<Option<Vec<u8>>> {
        match std::fs::read(self.path.join(file)) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Pluglet's spec files (`pluglet-*.json`) now in the directory, and its temporary files
    /// left by a crash (paths relative to the directory); none when the directory does not
    /// exist.
    pub fn own_files(&self) -> std::io::Result<(Vec<String>, Vec<String>)> {
        let entries = match std::fs::read_dir(&self.path) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Default::default()),
            Err(e) => return Err(e),
        };
        let (mut specs, mut temps) = (Vec::new(), Vec::new());
        for entry in entries {
            let entry = entry?;
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            if name.starts_with(FILE_PREFIX) && name.ends_with(FILE_SUFFIX) {
                specs.push(name);
            } else if name.starts_with(OLD_TEMP_PREFIX) && name.ends_with(".tmp") {
                temps.push(name);
            }
        }
        match std::fs::read_dir(self.path.join(TEMP_DIR)) {
            Ok(entries) => {
                for entry in entries {
                    if let Ok(name) = entry?.file_name().into_string() {
                        temps.push(format!("{TEMP_DIR}/{name}"));
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        specs.sort();
        temps.sort();
        Ok((specs, temps))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cdi::names::kind_of;

    #[test]
    fn file_names_are_readable_distinct_and_bounded() {
        let kind = kind_of("vendor.com/gpu");
        assert_eq!(
            file_name(&kind, "pluglet-0f3e_main"),
            "pluglet-vendor.com=gpu=0f3e_main.json"
        );
        let long = "pluglet-".to_owned() + &"a".repeat(253) + "_c";
        let name = file_name(&kind, &long);
        assert!(name.len() <= 255 && name.starts_with("pluglet-h"), "{name}");
        assert_ne!(name, file_name(&kind, &(long.clone() + "d")));
        let a = Kind {
            vendor: "a_b".into(),
            class: "c".into(),
        };
        let b = Kind {
            vendor: "a".into(),
            class: "b_c".into(),
        };
        assert_ne!(file_name(&a, "pluglet-x"), file_name(&b, "pluglet-x"));
    }

    #[test]
    fn writes_whole_files_readable_by_all_and_touches_nothing_else() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = SpecDir::new(tmp.path().join("cdi"));
        assert_eq!(
            dir.own_files().unwrap(),
            (vec![], vec![]),
            "no directory yet"
        );
        dir.write("pluglet-a.json", b"{}").unwrap();
        dir.write("pluglet-a.json", b"{\"x\":1}").unwrap();
        std::fs::write(tmp.path().join("cdi/vendor.json"), b"{}").unwrap();
        std::fs::write(tmp.path().join("cdi/.pluglet-b.json.tmp"), b"").unwrap();
        std::fs::write(tmp.path().join("cdi/.pluglet-tmp/pluglet-c.json.tmp"), b"").unwrap();
        let listed: Vec<String> = std::fs::read_dir(tmp.path().join("cdi"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|name| name.ends_with(".tmp"))
            .collect();
        assert_eq!(
            listed,
            [".pluglet-b.json.tmp"],
            "no temporary file beside the specs"
        );
        let meta = std::fs::metadata(tmp.path().join("cdi/pluglet-a.json")).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o644);
        assert_eq!(
            dir.read("pluglet-a.json").unwrap().as_deref(),
            Some(&b"{\"x\":1}"[..])
        );
        assert_eq!(
            dir.own_files().unwrap(),
            (
                vec!["pluglet-a.json".to_owned()],
                vec![
                    ".pluglet-b.json.tmp".to_owned(),
                    ".pluglet-tmp/pluglet-c.json.tmp".to_owned()
                ]
            )
        );
        dir.remove("pluglet-a.json").unwrap();
        dir.remove("pluglet-a.json").unwrap();
        assert!(tmp.path().join("cdi/vendor.json").exists());
    }
}
