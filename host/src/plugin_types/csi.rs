//! CSI node plugins: at registration the host calls only `Node.NodeGetInfo` on the driver's
//! endpoint (facts §3), natively over gRPC with `:authority` `localhost`. The node id must be
//! non-empty; node id, max volumes and topology go to the register hook and into the plugin record.

use std::path::{Path, PathBuf};
use std::time::Duration;

use pluglet_proto::csi::v1::NodeGetInfoRequest;
use pluglet_proto::csi::v1::node_client::NodeClient;
use pluglet_uds::Channel;

use crate::plugin_manager::plugin::CsiNodeInfo;

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
    /// NodeGetInfo did not answer in time.
    #[error("NodeGetInfo on {endpoint} did not answer within {deadline:?}")]
    Deadline {
        /// The endpoint.
        endpoint: PathBuf,
        /// The deadline.
        deadline: Duration,
    },
    /// NodeGetInfo failed.
    #[error("NodeGetInfo on {endpoint} failed: {message}")]
    Rpc {
        /// The endpoint.
        endpoint: PathBuf,
        /// gRPC code and message.
        message: String,
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
    let response = match tokio::time::timeout(deadline, client.node_get_info(request)).await {
        Err(_) => {
            return Err(CsiError::Deadline {
                endpoint: path,
                deadline,
            });
        }
        Ok(Err(status)) => {
            return Err(CsiError::Rpc {
                endpoint: path,
                message: format!("{:?}: {}", status.code(), status.message()),
            });
        }
        Ok(Ok(r)) => r.into_inner(),
    };
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
