//! The plugin registration wire client: GetInfo and NotifyRegistrationStatus on a plugin's
//! registration socket (facts §1). Wire only; what to do with the answers is in
//! [`super::operation`].

use std::time::Duration;

use pluglet_proto::pluginregistration::registration_client::RegistrationClient as GrpcClient;
use pluglet_proto::pluginregistration::{InfoRequest, PluginInfo, RegistrationStatus};
use pluglet_uds::Channel;

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
    /// An RPC did not answer within its deadline.
    #[error("{rpc} on socket {socket} did not answer within {deadline:?}")]
    Deadline {
        /// `GetInfo` or `NotifyRegistrationStatus`.
        rpc: &'static str,
        /// The socket.
        socket: SocketPath,
        /// The deadline.
        deadline: Duration,
    },
    /// An RPC failed.
    #[error("{rpc} on socket {socket} failed: {message}")]
    Rpc {
        /// `GetInfo` or `NotifyRegistrationStatus`.
        rpc: &'static str,
        /// The socket.
        socket: SocketPath,
        /// The gRPC status message (code included).
        message: String,
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
        const RPC: &str = "GetInfo";
        let mut request = tonic::Request::new(InfoRequest {});
        request.set_timeout(deadline);
        match tokio::time::timeout(deadline, self.client.get_info(request)).await {
            Err(_) => Err(self.deadline(RPC, deadline)),
            Ok(Err(status)) => Err(self.rpc_error(RPC, &status)),
            Ok(Ok(response)) => Ok(response.into_inner()),
        }
    }

    /// Tells the plugin the outcome of its registration.
    pub async fn notify(
        &mut self,
        registered: bool,
        error: &str,
        deadline: Duration,
    ) -> Result<(), RegistrationError> {
        const RPC: &str = "NotifyRegistrationStatus";
        let mut request = tonic::Request::new(RegistrationStatus {
            plugin_registered: registered,
            error: error.to_owned(),
        });
        request.set_timeout(deadline);
        match tokio::time::timeout(deadline, self.client.notify_registration_status(request)).await
        {
            Err(_) => Err(self.deadline(RPC, deadline)),
            Ok(Err(status)) => Err(self.rpc_error(RPC, &status)),
            Ok(Ok(_)) => Ok(()),
        }
    }

    fn deadline(&self, rpc: &'static str, deadline: Duration) -> RegistrationError {
        RegistrationError::Deadline {
            rpc,
            socket: self.socket.clone(),
            deadline,
        }
    }

    fn rpc_error(&self, rpc: &'static str, status: &tonic::Status) -> RegistrationError {
        let message = if status.message().is_empty() {
            format!("{:?}", status.code())
        } else {
            format!("{:?}: {}", status.code(), status.message())
        };
        RegistrationError::Rpc {
            rpc,
            socket: self.socket.clone(),
            message,
        }
    }
}
