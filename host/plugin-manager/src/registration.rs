//! The plugin registration wire client: GetInfo and NotifyRegistrationStatus on a plugin's
//! registration socket (see `docs/kubelet-compatibility.md`, "Registration order"). Wire
//! only; what to do with the answers is in [`super::operation`].

use std::time::Duration;

use pluglet_proto::pluginregistration::registration_client::RegistrationClient as GrpcClient;
use pluglet_proto::pluginregistration::{InfoRequest, PluginInfo, RegistrationStatus};
use pluglet_uds::{Channel, RpcError};

use super::plugin::SocketPath;

/// A registration RPC that failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistrationError {
    /// The socket could not be connected to within the dial timeout.
    #[error("failed to dial socket {socket}")]
    Dial {
        /// The socket.
        socket: SocketPath,
        /// Why.
        #[source]
        source: pluglet_uds::UdsError,
    },
    /// An RPC failed or did not answer within its deadline.
    #[error("{rpc} on socket {socket} failed{hint}")]
    Rpc {
        /// `GetInfo` or `NotifyRegistrationStatus`.
        rpc: &'static str,
        /// The socket.
        socket: SocketPath,
        /// What the failure suggests about the peer, when it suggests something (a peer that
        /// speaks no gRPC, or another service); empty otherwise.
        hint: &'static str,
        /// The plugin's status, or the deadline.
        #[source]
        status: RpcError,
    },
}

/// A connection to one plugin's registration socket.
#[derive(Debug, Clone)]
pub struct RegistrationClient {
    socket: SocketPath,
    channel: Channel,
    client: GrpcClient<Channel>,
}

impl RegistrationClient {
    /// Connects, retrying quickly while the socket is not listening yet (it is visible from
    /// `bind()` on, before `listen()`), for at most `timeout`. Sends `:authority` `localhost`.
    pub async fn connect(
        socket: &SocketPath,
        timeout: Duration,
    ) -> Result<RegistrationClient, RegistrationError> {
        let channel = pluglet_uds::connect(socket.as_path(), timeout)
            .await
            .map_err(|source| RegistrationError::Dial {
                socket: socket.clone(),
                source,
            })?;
        Ok(RegistrationClient {
            socket: socket.clone(),
            client: GrpcClient::new(channel.clone()),
            channel,
        })
    }

    /// The connection, for other services served on the same socket.
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// Asks the plugin who it is.
    pub async fn get_info(&mut self, deadline: Duration) -> Result<PluginInfo, RegistrationError> {
        let mut request = tonic::Request::new(InfoRequest {});
        request.set_timeout(deadline);
        pluglet_uds::with_deadline(deadline, self.client.get_info(request))
            .await
            .map_err(|status| self.rpc_error("GetInfo", status))
    }

    /// Tells the plugin the outcome of its registration.
    pub async fn notify(
        &mut self,
        registered: bool,
        error: &str,
        deadline: Duration,
    ) -> Result<(), RegistrationError> {
        let mut request = tonic::Request::new(RegistrationStatus {
            plugin_registered: registered,
            error: error.to_owned(),
        });
        request.set_timeout(deadline);
        pluglet_uds::with_deadline(deadline, self.client.notify_registration_status(request))
            .await
            .map(|_| ())
            .map_err(|status| self.rpc_error("NotifyRegistrationStatus", status))
    }

    fn rpc_error(&self, rpc: &'static str, status: RpcError) -> RegistrationError {
        // A transport or decoding failure (or an unknown method) comes back as one of these
        // codes: the peer is not a plugin registration server, whatever listens there.
        let hint = match status.code() {
            tonic::Code::Internal | tonic::Code::Unknown | tonic::Code::Unimplemented => {
                " (the peer does not answer as a plugin serving pluginregistration.Registration \
                 over gRPC would; check what listens on this socket)"
            }
            _ => "",
        };
        RegistrationError::Rpc {
            rpc,
            socket: self.socket.clone(),
            hint,
            status,
        }
    }
}
