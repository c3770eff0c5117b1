//! The CSI plugin type's steps: at registration the host calls only `Node.NodeGetInfo` on the
//! driver's endpoint (see `docs/kubelet-compatibility.md`, "CSI node plugins"), natively over
//! gRPC with `:authority` `localhost`. The node id must be non-empty; node id, max volumes and
//! topology go to the register hook, and the answer stays with the registration as
//! [`CsiNodeInfo`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use pluglet_fleet::{CsiDriver, Publisher};
use pluglet_handler_runtime::RegistrationFacts;
use pluglet_proto::csi::v1::NodeGetInfoRequest;
use pluglet_proto::csi::v1::node_client::NodeClient;
use pluglet_registration::{Candidate, Door, Facts, KindError, PluginKind, Registration};
use pluglet_uds::{Channel, RpcError};

/// What a CSI driver's NodeGetInfo said, kept with its registration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CsiNodeInfo {
    /// Node id; never empty for a registered driver.
    pub node_id: String,
    /// Maximum volumes per node (0: not given).
    pub max_volumes_per_node: i64,
    /// Accessible topology segments.
    pub topology: BTreeMap<String, String>,
}

/// The CSI plugin type's native steps: NodeGetInfo before the register hook; once registered,
/// the driver is handed to the fleet publisher when there is one (CSINode entry, node id
/// annotation, topology labels), and taken back when its registration ends.
#[derive(Clone)]
pub struct CsiKind {
    /// Time allowed to dial the driver's endpoint.
    pub dial_timeout: Duration,
    /// Time allowed for NodeGetInfo to answer.
    pub node_get_info_timeout: Duration,
    /// Where registered drivers are published; `None`: not published.
    pub publisher: Option<Publisher>,
}

#[async_trait::async_trait]
impl PluginKind for CsiKind {
    async fn gather_facts(&self, candidate: &Candidate) -> Result<Facts, KindError> {
        let endpoint = &candidate.info.endpoint;
        // A driver serving its Node service on the registration socket itself is asked over
        // the connection already open.
        let same_socket = match &candidate.door {
            Door::Registry { socket, .. } if endpoint_path(endpoint) == socket.as_path() => {
                candidate.connection.clone()
            }
            _ => None,
        };
        let info = node_get_info(
            endpoint,
            same_socket,
            self.dial_timeout,
            self.node_get_info_timeout,
        )
        .await?;
        let hook = RegistrationFacts {
            node_id: Some(info.node_id.clone()),
            max_volumes_per_node: Some(info.max_volumes_per_node),
            topology: info.topology.clone(),
        };
        Ok(Facts::with_detail(hook, info))
    }

    /// NodeGetInfo needs nothing the validate hook decides: it is asked while the hook runs.
    fn facts_alongside_validate(&self) -> bool {
        true
    }

    /// Hands the driver to the publisher, which never waits for the API server.
    async fn activate(&self, registration: &Arc<Registration>) -> Result<(), KindError> {
        if let (Some(publisher), Some(info)) =
            (&self.publisher, registration.facts.detail::<CsiNodeInfo>())
        {
            publisher.install_csi_driver(
                &registration.key.name,
                registration.id,
                CsiDriver {
                    node_id: info.node_id.clone(),
                    topology: info.topology.clone(),
                    max_volumes_per_node: info.max_volumes_per_node,
                },
            );
        }
        Ok(())
    }

    async fn deactivate(&self, registration: &Registration) {
        if let Some(publisher) = &self.publisher {
            publisher.remove_csi_driver(&registration.key.name, registration.id);
        }
    }
}

/// NodeGetInfo failed or answered something unacceptable.
#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    /// The endpoint could not be connected to.
    #[error("failed to dial CSI endpoint {endpoint}")]
    Dial {
        /// The endpoint.
        endpoint: PathBuf,
        /// Why.
        #[source]
        source: pluglet_uds::UdsError,
    },
    /// NodeGetInfo failed or did not answer in time.
    #[error("NodeGetInfo on {endpoint} failed")]
    Rpc {
        /// The endpoint.
        endpoint: PathBuf,
        /// The driver's status, or the deadline.
        #[source]
        status: RpcError,
    },
    /// NodeGetInfo returned an empty node id.
    #[error("NodeGetInfo on {endpoint} returned an empty node id")]
    EmptyNodeId {
        /// The endpoint.
        endpoint: PathBuf,
    },
}

/// The socket path of an endpoint, accepting an optional `unix://` scheme.
pub fn endpoint_path(endpoint: &str) -> &Path {
    Path::new(
        endpoint
            .strip_prefix("unix://")
            .or_else(|| endpoint.strip_prefix("unix:"))
            .unwrap_or(endpoint),
    )
}

/// Calls NodeGetInfo on `endpoint`, over `channel` when given (an open connection to that very
/// socket), else over a new connection.
pub async fn node_get_info(
    endpoint: &str,
    channel: Option<Channel>,
    dial_timeout: Duration,
    deadline: Duration,
) -> Result<CsiNodeInfo, CsiError> {
    let path = endpoint_path(endpoint).to_owned();
    let channel = match channel {
        Some(c) => c,
        None => pluglet_uds::connect(&path, dial_timeout)
            .await
            .map_err(|source| CsiError::Dial {
                endpoint: path.clone(),
                source,
            })?,
    };
    let mut client = NodeClient::new(channel);
    let mut request = tonic::Request::new(NodeGetInfoRequest {});
    request.set_timeout(deadline);
    let response = pluglet_uds::with_deadline(deadline, client.node_get_info(request))
        .await
        .map_err(|status| CsiError::Rpc {
            endpoint: path.clone(),
            status,
        })?;
    if response.node_id.is_empty() {
        return Err(CsiError::EmptyNodeId { endpoint: path });
    }
    Ok(CsiNodeInfo {
        node_id: response.node_id,
        max_volumes_per_node: response.max_volumes_per_node,
        topology: response
            .accessible_topology
            .map(|t| t.segments.into_iter().collect())
            .unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_may_carry_a_unix_scheme() {
        assert_eq!(
            endpoint_path("unix:///run/csi.sock"),
            Path::new("/run/csi.sock")
        );
        assert_eq!(endpoint_path("/run/csi.sock"), Path::new("/run/csi.sock"));
    }
}
