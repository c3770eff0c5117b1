//! The `kubelet.sock` door: the kubelet's side of `v1beta1.Registration` (the kubelet's
//! `plugin/v1beta1/server.go`; see `docs/kubelet-compatibility.md`, "Device plugin
//! registration"), and the start-up steps around the device plugins directory.
//!
//! Register hands the plugin to the registration pipeline, the same one the plugin watcher's
//! registrations go through: the DevicePlugin handler's validate hook (the version and the
//! extended resource name), its register hook, then activation (dial `<dir>/<endpoint>` and
//! GetDevicePluginOptions) before answering, as the kubelet does. Any refusal reaches the
//! plugin as a gRPC error whose message says what was wrong.
//!
//! The socket is served through `pluglet_uds::incoming_any_authority`: Go plugins dial the
//! socket by its bare path, so their HTTP/2 `:authority` looks like a path, which tonic would
//! refuse (see `docs/kubelet-compatibility.md`, "HTTP/2 authority from Go plugins").

use std::io;
use std::os::unix::fs::FileTypeExt as _;
use std::path::{Path, PathBuf};

use pluglet_core::error_chain;
use pluglet_handler_runtime::PluginInfo;
use pluglet_proto::constants::{CHECKPOINT_FILE, DEVICE_PLUGIN};
use pluglet_proto::v1beta1;
use pluglet_proto::v1beta1::registration_server::{Registration, RegistrationServer};
use pluglet_registration::{Candidate, Door, Pipeline, RegisterError, Stage};
use tokio::net::UnixListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::error::{ConnectError, StartError};

/// Fails with [`StartError::DirectoryInUse`] when something answers on `socket`.
pub(crate) fn check_not_in_use(socket: &Path) -> Result<(), StartError> {
    if pluglet_uds::answers(socket) {
        return Err(StartError::DirectoryInUse {
            socket: socket.to_path_buf(),
        });
    }
    Ok(())
}

/// Creates the directory (0750, as the kubelet) and removes every socket in it: stale plugin
/// sockets tell nobody anything, and their removal tells plugins to register again. Other files
/// (the checkpoint, set-aside files) and sub-directories are kept.
pub(crate) fn prepare_directory(dir: &Path) -> Result<(), StartError> {
    let fail = |source: io::Error| StartError::Directory {
        dir: dir.to_path_buf(),
        source,
    };
    {
        use std::os::unix::fs::DirBuilderExt as _;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o750)
            .create(dir)
            .map_err(fail)?;
    }
    for entry in std::fs::read_dir(dir).map_err(fail)? {
        let entry = entry.map_err(fail)?;
        if entry.file_name() == CHECKPOINT_FILE {
            continue;
        }
        let is_socket = entry.file_type().map(|t| t.is_socket()).unwrap_or(false);
        if is_socket {
            let path = entry.path();
            match std::fs::remove_file(&path) {
                Ok(()) => tracing::info!(socket = %path.display(), "removed stale socket"),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(source) => return Err(StartError::RemoveStale { path, source }),
            }
        }
    }
    Ok(())
}

/// Watches `dir` for removed sockets and reports them to the manager loop (a `kubelet.sock`
/// plugin whose socket is removed is disconnected). The watch is the task of the returned
/// [`RemovalWatch`] and ends when it is dropped.
///
/// It asks inotify for deletions only (`IN_DELETE`), through the `inotify` crate rather than a
/// general file watcher: the checkpoint writer rewrites `kubelet_internal_checkpoint` in this
/// directory after allocations, and a watcher of every change would wake for each of those
/// rewrites only to ignore them.
pub(crate) fn watch_directory(
    dir: &Path,
    removed: mpsc::Sender<PathBuf>,
) -> Result<RemovalWatch, StartError> {
    use inotify::{Inotify, WatchMask};
    use tokio_stream::StreamExt as _;
    let fail = |source: io::Error| match pluglet_core::inotify::InotifyLimit::of_io(&source) {
        Some(limit) => StartError::WatchLimit {
            dir: dir.to_path_buf(),
            limit: limit.reached(),
        },
        None => StartError::Watch {
            dir: dir.to_path_buf(),
            source,
        },
    };
    let inotify = Inotify::init().map_err(fail)?;
    inotify
        .watches()
        .add(dir, WatchMask::DELETE | WatchMask::ONLYDIR)
        .map_err(fail)?;
    let mut events = inotify.into_event_stream([0u8; 4096]).map_err(fail)?;
    let dir = dir.to_path_buf();
    let task = tokio::spawn(async move {
        while let Some(event) = events.next().await {
            let event = match event {
                Ok(event) => event,
                Err(error) => {
                    tracing::error!(%error, dir = %dir.display(), "the watch for removed device plugin sockets failed");
                    return;
                }
            };
            let Some(name) = event.name else { continue };
            if removed.send(dir.join(name)).await.is_err() {
                return;
            }
        }
    });
    Ok(RemovalWatch(task))
}

/// The watch for removed plugin sockets started by [`watch_directory`]; dropping it ends it.
pub(crate) struct RemovalWatch(tokio::task::JoinHandle<()>);

impl Drop for RemovalWatch {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves Registration on the bound `kubelet.sock` until `cancel` fires, then removes the
/// socket.
pub(crate) async fn serve(
    pipeline: Pipeline,
    listener: UnixListener,
    socket: PathBuf,
    metrics: crate::Metrics,
    cancel: CancellationToken,
) {
    let service = RegistrationServer::new(RegistrationService { pipeline, metrics });
    pluglet_uds::serve(
        pluglet_uds::incoming_any_authority(listener),
        service,
        cancel.cancelled_owned(),
    )
    .await;
    if let Err(err) = std::fs::remove_file(&socket)
        && err.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(%err, socket = %socket.display(), "cannot remove kubelet.sock");
    }
}

/// `v1beta1.Registration`.
struct RegistrationService {
    pipeline: Pipeline,
    metrics: crate::Metrics,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(
        &self,
        request: tonic::Request<v1beta1::RegisterRequest>,
    ) -> Result<tonic::Response<v1beta1::Empty>, tonic::Status> {
        let request = request.into_inner();
        // One span per Register, with the fields of a registration through the plugin watcher;
        // the socket is the plugin's own (its endpoint in the device plugins directory).
        let span = tracing::info_span!(
            "registration",
            socket = %request.endpoint,
            plugin_name = %request.resource_name,
            plugin_type = DEVICE_PLUGIN,
        );
        self.register_in_pipeline(request).instrument(span).await
    }
}

impl RegistrationService {
    async fn register_in_pipeline(
        &self,
        request: v1beta1::RegisterRequest,
    ) -> Result<tonic::Response<v1beta1::Empty>, tonic::Status> {
        let resource = request.resource_name.clone();
        self.metrics.registration(&resource);
        let candidate = Candidate {
            info: PluginInfo {
                plugin_type: DEVICE_PLUGIN.to_owned(),
                name: request.resource_name,
                endpoint: request.endpoint,
                supported_versions: vec![request.version],
            },
            door: Door::KubeletSock,
            connection: None,
        };
        match self.pipeline.register(candidate).await {
            Ok(_) => Ok(tonic::Response::new(v1beta1::Empty {})),
            Err(err) => {
                let message = error_chain(&err);
                tracing::warn!(%resource, error = %message, "device plugin Register refused");
                Err(tonic::Status::new(status_code(&err), message))
            }
        }
    }
}

/// The one place Register refusals become gRPC status codes.
fn status_code(err: &RegisterError) -> tonic::Code {
    match err.stage() {
        Stage::Handler => tonic::Code::FailedPrecondition,
        Stage::Validate | Stage::Register if err.refusal().is_some() => {
            tonic::Code::InvalidArgument
        }
        Stage::Validate | Stage::Register => tonic::Code::Internal,
        Stage::Facts => tonic::Code::Internal,
        Stage::Activate => match err.native::<ConnectError>() {
            Some(_) => tonic::Code::Unavailable,
            None => tonic::Code::Internal,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prepare_removes_sockets_and_keeps_other_files() {
        let dir = tempfile::tempdir().unwrap();
        let stale = dir.path().join("old-plugin.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&stale).unwrap();
        std::fs::write(dir.path().join(CHECKPOINT_FILE), "{}").unwrap();
        std::fs::write(
            dir.path().join("kubelet_internal_checkpoint.corrupt-1"),
            "x",
        )
        .unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        prepare_directory(dir.path()).unwrap();
        assert!(!stale.exists());
        assert!(dir.path().join(CHECKPOINT_FILE).exists());
        assert!(
            dir.path()
                .join("kubelet_internal_checkpoint.corrupt-1")
                .exists()
        );
        assert!(dir.path().join("sub").is_dir());
    }

    #[test]
    fn a_live_socket_means_in_use_and_a_dead_one_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kubelet.sock");
        assert!(check_not_in_use(&socket).is_ok(), "missing socket");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let err = check_not_in_use(&socket).unwrap_err();
        assert!(matches!(err, StartError::DirectoryInUse { .. }), "{err}");
        drop(listener);
        assert!(check_not_in_use(&socket).is_ok(), "stale socket");
    }
}
