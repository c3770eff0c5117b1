//! The per-user inotify limits, and the one piece of advice every watcher gives when a watch
//! runs into one: which sysctl, its value now, and the command to raise it.
//!
//! The kernel says "limit" with two errors: `inotify_init` fails with `EMFILE` when the user
//! holds `fs.inotify.max_user_instances` instances, `inotify_add_watch` with `ENOSPC` when the
//! user holds `fs.inotify.max_user_watches` watches. [`InotifyLimit::from_os_error`] maps them;
//! [`LimitReached`] is the message.

use std::fmt;
use std::io;

/// A per-user inotify limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InotifyLimit {
    /// Inotify instances per user (`fs.inotify.max_user_instances`).
    Instances,
    /// Watches per user (`fs.inotify.max_user_watches`).
    Watches,
}

impl InotifyLimit {
    /// The limit an OS error says was reached: `EMFILE` (from `inotify_init`) is the instances
    /// limit, `ENOSPC` (from `inotify_add_watch`) the watches limit; any other error is none.
    pub fn from_os_error(errno: i32) -> Option<InotifyLimit> {
        match errno {
            libc::EMFILE => Some(InotifyLimit::Instances),
            libc::ENOSPC => Some(InotifyLimit::Watches),
            _ => None,
        }
    }

    /// The limit a file watcher's error says was reached, if any: `notify` reports the watch
    /// limit as its own kind and the instance limit as the OS error.
    pub fn of_notify(error: &notify::Error) -> Option<InotifyLimit> {
        match &error.kind {
            notify::ErrorKind::MaxFilesWatch => Some(InotifyLimit::Watches),
            notify::ErrorKind::Io(io) => InotifyLimit::of_io(io),
            _ => None,
        }
    }

    /// The limit `error` says was reached, if it is one (see [`InotifyLimit::from_os_error`]).
    pub fn of_io(error: &io::Error) -> Option<InotifyLimit> {
        error.raw_os_error().and_then(InotifyLimit::from_os_error)
    }

    /// The sysctl that sets it.
    pub fn sysctl(self) -> &'static str {
        match self {
            InotifyLimit::Instances => "fs.inotify.max_user_instances",
            InotifyLimit::Watches => "fs.inotify.max_user_watches",
        }
    }

    /// The sysctl's value now, if it can be read.
    pub fn current(self) -> Option<u64> {
        let path = format!("/proc/sys/{}", self.sysctl().replace('.', "/"));
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    }

    /// That this limit is reached, with its value read now.
    pub fn reached(self) -> LimitReached {
        LimitReached::new(self, self.current())
    }

    /// The value to suggest: twice the current one, and never under the kernel's default.
    fn suggested(self, current: u64) -> u64 {
        let default = match self {
            InotifyLimit::Instances => 128,
            InotifyLimit::Watches => 8192,
        };
        current.saturating_mul(2).max(default)
    }
}

/// A watch failed because a per-user inotify limit is reached. Its text names the sysctl, its
/// value and the `sysctl -w` command that raises it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitReached {
    /// Which limit.
    pub limit: InotifyLimit,
    /// The sysctl's value when the watch failed, if it could be read.
    pub value: Option<u64>,
}

impl LimitReached {
    /// `limit` reached at `value`.
    pub fn new(limit: InotifyLimit, value: Option<u64>) -> LimitReached {
        LimitReached { limit, value }
    }
}

impl fmt::Display for LimitReached {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sysctl = self.limit.sysctl();
        let what = match self.limit {
            InotifyLimit::Instances => "inotify instance",
            InotifyLimit::Watches => "inotify watch",
        };
        write!(f, "the per-user {what} limit is reached ({sysctl} = ")?;
        match self.value {
            Some(value) => write!(
                f,
                "{value}); raise it with `sysctl -w {sysctl}={}`",
                self.limit.suggested(value)
            )?,
            None => write!(f, "unknown); raise it with `sysctl -w {sysctl}=<more>`")?,
        }
        f.write_str(" and a file in /etc/sysctl.d to keep it")?;
        if self.limit == InotifyLimit::Instances {
            f.write_str(", or stop processes holding inotify instances")?;
        }
        Ok(())
    }
}

impl std::error::Error for LimitReached {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_limit_errors_map_to_their_sysctls() {
        assert_eq!(
            InotifyLimit::from_os_error(libc::EMFILE),
            Some(InotifyLimit::Instances)
        );
        assert_eq!(
            InotifyLimit::from_os_error(libc::ENOSPC),
            Some(InotifyLimit::Watches)
        );
        assert_eq!(InotifyLimit::from_os_error(libc::ENOENT), None);
        assert_eq!(
            InotifyLimit::of_io(&io::Error::from_raw_os_error(libc::EMFILE)),
            Some(InotifyLimit::Instances)
        );
        assert_eq!(InotifyLimit::of_io(&io::Error::other("no errno")), None);
    }

    #[test]
    fn the_message_names_the_sysctl_its_value_and_the_command_once() {
        let text = LimitReached::new(InotifyLimit::Watches, Some(8192)).to_string();
        assert_eq!(
            text,
            "the per-user inotify watch limit is reached (fs.inotify.max_user_watches = 8192); \
             raise it with `sysctl -w fs.inotify.max_user_watches=16384` and a file in \
             /etc/sysctl.d to keep it"
        );
        let text = LimitReached::new(InotifyLimit::Instances, Some(0)).to_string();
        assert!(
            text.contains("(fs.inotify.max_user_instances = 0)"),
            "{text}"
        );
        assert!(
            text.contains("`sysctl -w fs.inotify.max_user_instances=128`"),
            "{text}"
        );
        assert_eq!(text.matches("fs.inotify.max_user_instances").count(), 2);
        let text = LimitReached::new(InotifyLimit::Watches, None).to_string();
        assert!(
            text.contains("`sysctl -w fs.inotify.max_user_watches=<more>`"),
            "{text}"
        );
    }
}
