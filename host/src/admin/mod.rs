//! Pluglet's admin API: the gRPC server on the admin unix socket ([`server`], with the device
//! RPCs in [`devices`]) and the `pluglet ctl` client ([`ctl`]) that prints what it says through
//! one set of views ([`view`]). Messages are in `proto/admin.proto`.

pub mod ctl;
pub mod devices;
pub mod server;
pub mod view;

use tonic::Status;

/// Longest pod UID, container or resource name a request may carry, in bytes: room for any
/// Kubernetes name (an extended resource name is at most 317 bytes), small enough that a name
/// never swells the checkpoint, a log line or an error message.
pub const MAX_NAME_BYTES: usize = 512;

/// Refuses an empty name, one longer than [`MAX_NAME_BYTES`], or one with control characters
/// (they would break log lines and `ctl` tables), saying which field and what to send instead.
pub(crate) fn check_name(field: &str, value: &str) -> Result<(), Status> {
    if value.is_empty() {
        return Err(Status::invalid_argument(format!(
            "{field} must not be empty"
        )));
    }
    if value.len() > MAX_NAME_BYTES {
        return Err(Status::invalid_argument(format!(
            "{field} is {} bytes long; at most {MAX_NAME_BYTES} are accepted",
            value.len()
        )));
    }
    if let Some(c) = value.chars().find(|c| c.is_control()) {
        return Err(Status::invalid_argument(format!(
            "{field} holds the control character {c:?}; names are printable text"
        )));
    }
    Ok(())
}
