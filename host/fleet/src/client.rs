//! Connecting to the API server: a kubeconfig file, or the service account of the pod Pluglet
//! runs in. Requests time out (a hung API server is a failed round, retried with backoff) and
//! are not retried inside the client: the publisher owns retries.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::config::{InClusterError, KubeConfigOptions, Kubeconfig, KubeconfigError};

/// Where the API server's address and credentials come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// A kubeconfig file (its current context).
    Kubeconfig(PathBuf),
    /// The pod's service account (`KUBERNETES_SERVICE_HOST` and the mounted token).
    InCluster,
}

/// The client could not be set up; nothing was sent.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The kubeconfig file cannot be read or used.
    #[error("cannot use kubeconfig {path}")]
    Kubeconfig {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: KubeconfigError,
    },
    /// Not in a pod, or its service account cannot be read.
    #[error(
        "cannot use the in-cluster service account (is Pluglet running in a pod with a service account?)"
    )]
    InCluster(#[source] InClusterError),
    /// The HTTP client could not be built (TLS settings).
    #[error("cannot build the Kubernetes client")]
    Client(#[source] kube::Error),
}

/// Time allowed to connect to the API server.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Time allowed for one request's answer.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// Time allowed between two reads of a watch's answer: longer than the watch's own timeout
/// ([`WATCH_TIMEOUT`]), so a quiet watch ends by the API server, not by the client.
pub const WATCH_READ_TIMEOUT: Duration = Duration::from_secs(330);
/// How long the API server keeps one watch open before it is made again.
pub const WATCH_TIMEOUT: u32 = 290;

/// A client of one API server.
#[derive(Clone)]
pub struct Connection {
    pub(crate) client: kube::Client,
    /// The same server, for watches (a longer read timeout).
    pub(crate) watch_client: kube::Client,
    server: String,
}

impl Connection {
    /// The API server's URL.
    pub fn server(&self) -> &str {
        &self.server
    }
}

/// A client for `source` (nothing is sent yet).
pub async fn connect(source: &Source) -> Result<Connection, ClientError> {
    let mut config = match source {
        Source::Kubeconfig(path) => from_file(path).await?,
        Source::InCluster => kube::Config::incluster().map_err(ClientError::InCluster)?,
    };
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    config.read_timeout = Some(REQUEST_TIMEOUT);
    config.write_timeout = Some(REQUEST_TIMEOUT);
    config.default_retry = false;
    let server = config.cluster_url.to_string();
    let mut watching = config.clone();
    watching.read_timeout = Some(WATCH_READ_TIMEOUT);
    let client = kube::Client::try_from(config).map_err(ClientError::Client)?;
    let watch_client = kube::Client::try_from(watching).map_err(ClientError::Client)?;
    Ok(Connection {
        client,
        watch_client,
        server,
    })
}

async fn from_file(path: &Path) -> Result<kube::Config, ClientError> {
    let error = |source| ClientError::Kubeconfig {
        path: path.to_owned(),
        source,
    };
    let kubeconfig = Kubeconfig::read_from(path).map_err(error)?;
    kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(error)
}
