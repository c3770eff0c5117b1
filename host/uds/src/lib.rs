//! gRPC over unix domain sockets, for every socket Pluglet dials or serves.
//!
//! Start here:
//! - [`connect`] dials a plugin's socket and returns a [`Channel`] (one HTTP/2 connection,
//!   usable by any tonic-generated client) whose requests carry `:authority: localhost` (what
//!   the upstream kubelet sends to device plugins and CSI drivers since about Kubernetes 1.26).
//!   It retries the short window in which a socket file exists but its owner does not accept
//!   yet. [`Channel::unary`] makes a unary call on it without tonic's client, for calls on
//!   every allocation's path.
//! - [`bind`] creates a listening socket (parent directory, stale socket removal, file mode).
//! - [`incoming`] turns the listener into a stream of connections, and [`serve`] serves a
//!   tonic-generated server on them; [`Routes`] answers some of its unary methods without
//!   tonic's server, for calls on every allocation's path.
//! - [`incoming_any_authority`] does the same, but wraps every connection in an
//!   [`AuthorityRewrite`] layer so that clients sending a socket path as `:authority` (every Go
//!   device plugin built with grpc-go; see docs/kubelet-compatibility.md, "HTTP/2 authority
//!   from Go plugins") are served instead of being refused by the `h2` crate with
//!   `RST_STREAM(PROTOCOL_ERROR)`. Use it for `kubelet.sock`.
//!
//! Socket paths here are filesystem paths; no abstract sockets.

pub mod authority;
mod channel;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
mod hpack;
mod message;
mod routes;
mod serve;
mod unary;

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio_stream::{Stream, StreamExt, wrappers::UnixListenerStream};

pub use authority::{AuthorityRewrite, MAX_HEADER_BLOCK, MAX_HEADER_LIST};
pub use channel::{Channel, ResponseBody};
pub use message::MAX_UNARY_MESSAGE;
pub use routes::Routes;
pub use serve::{ACCEPT_PAUSE_FIRST, ACCEPT_PAUSE_MAX, GrpcServer, serve};

/// Longest socket path the kernel accepts (`sizeof(sun_path)` is 108 on Linux, including the NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// First pause between two connection attempts while a socket is not accepting yet.
const RETRY_START: Duration = Duration::from_millis(1);
/// Longest pause between two connection attempts; the pause doubles from [`RETRY_START`].
const RETRY_MAX: Duration = Duration::from_millis(50);

/// HTTP/2 stream and connection flow-control window of client connections (8 MiB).
const WINDOW: u32 = 8 << 20;

/// What can go wrong dialing, binding or serving a unix socket.
#[derive(Debug, thiserror::Error)]
pub enum UdsError {
    /// Nobody accepted a connection on the socket before the deadline; `source` is the last
    /// failure seen (usually "connection refused" or "no such file or directory").
    #[error(
        "could not connect to unix socket {path} within {timeout:?}: check that its owner is running and serving there"
    )]
    Connect {
        /// The socket dialed.
        path: PathBuf,
        /// The deadline given to [`connect`].
        timeout: Duration,
        /// The last connection failure.
        #[source]
        source: io::Error,
    },
    /// The socket accepted, but the HTTP/2 connection could not be set up on it.
    #[error("could not start an HTTP/2 connection on unix socket {path}")]
    Channel {
        /// The socket dialed.
        path: PathBuf,
        /// What the HTTP/2 layer reported.
        #[source]
        source: h2::Error,
    },
    /// The socket path does not fit in `sockaddr_un`.
    #[error(
        "unix socket path {path} is {len} bytes long, the limit is {MAX_SOCKET_PATH}: choose a shorter directory"
    )]
    PathTooLong {
        /// The offending path.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
    },
    /// The directory that should hold the socket could not be created.
    #[error("could not create directory {path} for a unix socket")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Something that is not a socket sits where the socket should go; it is left alone.
    #[error(
        "refusing to replace {path}: it exists and is not a unix socket; remove it or choose another socket path"
    )]
    NotASocket {
        /// The path that is occupied.
        path: PathBuf,
    },
    /// A stale socket file could not be inspected or removed before binding.
    #[error("could not remove stale unix socket {path}")]
    RemoveStale {
        /// The stale socket.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `bind(2)` or `listen(2)` failed.
    #[error("could not listen on unix socket {path}")]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The socket was bound but its file mode could not be set; the socket file is removed again.
    #[error("could not set mode {mode:#o} on unix socket {path}")]
    SetMode {
        /// The socket path.
        path: PathBuf,
        /// The requested mode.
        mode: u32,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// Dials the unix socket at `path` and returns a connected gRPC [`Channel`].
///
/// Requests on the channel carry `:authority: localhost` (what the upstream kubelet sends),
/// which every gRPC server accepts. The connection is made and the HTTP/2 preface sent here,
/// so a dead socket fails here rather than on the first RPC. A socket file appears at
/// `bind(2)`, before its owner calls `listen(2)`, so "connection refused", "no such file" and a
/// full listen backlog are retried quickly (pauses growing from 1 ms to 50 ms) until `timeout`
/// has passed; other errors (such as "permission denied") fail at once.
///
/// The channel is one HTTP/2 connection and does not redial: once it breaks every request
/// fails. That is what a plugin's peer wants: a device plugin whose connection broke must
/// register again, as with the kubelet.
///
/// The returned error names the path and carries the last cause.
pub async fn connect(path: &Path, timeout: Duration) -> Result<Channel, UdsError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let stream = connect_with_retry(path, timeout, deadline).await?;
    let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
    // Large flow-control windows: a 10,000-device ListAndWatch update (~300 KB) then arrives
    // in one go instead of stalling on HTTP/2's default 64 KiB window.
    let handshake = h2::client::Builder::new()
        .initial_window_size(WINDOW)
        .initial_connection_window_size(WINDOW)
        .enable_push(false)
        .handshake::<_, bytes::Bytes>(stream);
    let (sender, connection) =
        match tokio::time::timeout(remaining.max(Duration::from_millis(1)), handshake).await {
            Ok(Ok(parts)) => parts,
            Ok(Err(source)) => {
                return Err(UdsError::Channel {
                    path: path.to_path_buf(),
                    source,
                });
            }
            Err(_elapsed) => {
                return Err(UdsError::Connect {
                    path: path.to_path_buf(),
                    timeout,
                    source: io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the socket accepted but the HTTP/2 connection did not start in time",
                    ),
                });
            }
        };
    let socket = path.to_path_buf();
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(socket = %socket.display(), %error, "gRPC connection ended");
        }
    });
    Ok(Channel::new(sender))
}

/// Connects to `path`, retrying the errors of a socket that is not listening yet until `deadline`.
async fn connect_with_retry(
    path: &Path,
    timeout: Duration,
    deadline: tokio::time::Instant,
) -> Result<UnixStream, UdsError> {
    let mut pause = RETRY_START;
    loop {
        let last = match UnixStream::connect(path).await {
            Ok(stream) => return Ok(stream),
            Err(error) if is_not_listening_yet(&error) => error,
            Err(source) => {
                return Err(UdsError::Connect {
                    path: path.to_path_buf(),
                    timeout,
                    source,
                });
            }
        };
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(UdsError::Connect {
                path: path.to_path_buf(),
                timeout,
                source: last,
            });
        }
        tokio::time::sleep(pause.min(deadline - now)).await;
        pause = (pause * 2).min(RETRY_MAX);
    }
}

/// Errors of a socket whose owner has not bound or not started listening yet.
fn is_not_listening_yet(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound | io::ErrorKind::WouldBlock
    )
}

/// Whether a process accepts connections on the unix socket at `path`: a daemon about to serve
/// there checks this first, so that it never takes a live socket from another server.
pub fn answers(path: &Path) -> bool {
    std::os::unix::net::UnixStream::connect(path).is_ok()
}

/// Binds a listening unix socket at `path`.
///
/// Creates the parent directory if needed, removes a stale socket file left by an earlier process
/// (anything else at `path`, such as a regular file or a directory, is refused and left alone),
/// binds, and sets the file mode to `mode` if given (e.g. `0o600`); otherwise the process umask
/// applies. Between `bind(2)` and the mode change the socket briefly has the umask's mode.
///
/// Must be called from within a Tokio runtime.
pub fn bind(path: &Path, mode: Option<u32>) -> Result<UnixListener, UdsError> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(UdsError::PathTooLong {
            path: path.to_path_buf(),
            len,
        });
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|source| UdsError::CreateDir {
            path: parent.to_path_buf(),
            source,
        })?;
    }
    remove_stale_socket(path)?;

    let listener = UnixListener::bind(path).map_err(|source| UdsError::Bind {
        path: path.to_path_buf(),
        source,
    })?;
    if let Some(mode) = mode
        && let Err(source) = std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
    {
        drop(listener);
        let _ = std::fs::remove_file(path);
        return Err(UdsError::SetMode {
            path: path.to_path_buf(),
            mode,
            source,
        });
    }
    Ok(listener)
}

/// Removes a socket file at `path`; refuses to touch anything that is not a socket.
fn remove_stale_socket(path: &Path) -> Result<(), UdsError> {
    let metadata = match std::fs::symlink_metadata(path) {
        Ok(metadata) => metadata,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(UdsError::RemoveStale {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    if !metadata.file_type().is_socket() {
        return Err(UdsError::NotASocket {
            path: path.to_path_buf(),
        });
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(UdsError::RemoveStale {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The accepted connections of `listener`, for [`serve`] (or tonic's own server).
///
/// Connections are passed on as they are, so the `h2` crate's checks apply: a client that
/// sends a socket path as `:authority` is refused; use [`incoming_any_authority`] for sockets that
/// Go gRPC clients dial. Accept errors (e.g. too many open files) are yielded as items; [`serve`]
/// logs them and keeps accepting.
pub fn incoming(listener: UnixListener) -> impl Stream<Item = io::Result<UnixStream>> {
    UnixListenerStream::new(listener)
}

/// Like [`incoming`], but each connection is wrapped in an [`AuthorityRewrite`] so that requests
/// whose `:authority` is not a valid URI authority (a socket path, raw or percent-encoded, as sent
/// by grpc-go and grpc-python clients) are served with `:authority: localhost` instead of being
/// refused. See [`AuthorityRewrite`] for what the layer does and what it costs.
pub fn incoming_any_authority(
    listener: UnixListener,
) -> impl Stream<Item = io::Result<AuthorityRewrite<UnixStream>>> {
    incoming(listener).map(|accepted| accepted.map(AuthorityRewrite::new))
}

/// A plugin's gRPC error status, shown as `Code: message` (tonic's own `Display` adds details
/// and metadata that people reading a log or a refusal do not need).
#[derive(Clone, Debug)]
pub struct RpcError(pub tonic::Status);

impl RpcError {
    /// The status code.
    pub fn code(&self) -> tonic::Code {
        self.0.code()
    }
}

impl std::fmt::Display for RpcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.message().is_empty() {
            write!(f, "{:?}", self.0.code())
        } else {
            write!(f, "{:?}: {}", self.0.code(), self.0.message())
        }
    }
}

impl std::error::Error for RpcError {}

impl From<tonic::Status> for RpcError {
    fn from(status: tonic::Status) -> RpcError {
        RpcError(status)
    }
}

/// Awaits one unary gRPC call for at most `deadline`: its answer, the plugin's error status,
/// or a `DeadlineExceeded` status saying how long was waited. Every call Pluglet makes to a
/// plugin goes through this, so no call can hang a registration or an allocation.
///
/// Callers also send the deadline to the peer (`grpc-timeout`), and a gRPC server gives up at
/// the same moment the caller does, answering `Cancelled` (tonic) or `DeadlineExceeded`
/// (grpc-go). Such an answer arriving once the deadline has passed is the same event as the
/// caller's own timer, and is reported the same way, whichever of the two came first.
pub async fn with_deadline<T>(
    deadline: Duration,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, RpcError> {
    let start = tokio::time::Instant::now();
    let expired = || {
        RpcError(tonic::Status::deadline_exceeded(format!(
            "no answer within {deadline:?}"
        )))
    };
    match tokio::time::timeout(deadline, call).await {
        Ok(Ok(answer)) => Ok(answer.into_inner()),
        Ok(Err(status))
            if matches!(
                status.code(),
                tonic::Code::Cancelled | tonic::Code::DeadlineExceeded
            ) && start.elapsed() >= deadline =>
        {
            Err(expired())
        }
        Ok(Err(status)) => Err(RpcError(status)),
        Err(_) => Err(expired()),
    }
}
