//! Generated gRPC code for every protocol Pluglet speaks, one module per proto package.
//!
//! - [`pluginregistration`]: the kubelet plugin registration API (plugin watcher flow).
//! - [`v1beta1`] (alias [`deviceplugin::v1beta1`]): the kubelet device plugin API.
//! - [`csi::v1`]: the CSI subset a node agent calls at registration.
//! - [`admin::v1`]: Pluglet's own admin API.
//! - [`podresources::v1`]: the kubelet's pod-resources API (package `v1`).
#![allow(missing_docs)]

mod encoded_answer;

pub use encoded_answer::EncodedAnswer;

/// `package pluginregistration;`
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// `package v1beta1;` (the device plugin API). Also reachable as [`deviceplugin::v1beta1`].
pub mod v1beta1 {
    tonic::include_proto!("v1beta1");
}

/// The kubelet's pod-resources API.
pub mod podresources {
    /// `package v1;` (`k8s.io/kubelet/pkg/apis/podresources/v1`).
    pub mod v1 {
        tonic::include_proto!("v1");
    }
}

/// Device plugin API.
pub mod deviceplugin {
    pub use crate::v1beta1;
}

/// CSI API subset.
pub mod csi {
    /// `package csi.v1;`
    pub mod v1 {
        tonic::include_proto!("csi.v1");
    }
}

/// `package pluglet.admin.v1;` (module tree mirrors the proto package). Also reachable as [`admin::v1`].
pub mod pluglet {
    /// Pluglet admin API.
    pub mod admin {
        /// `package pluglet.admin.v1;`
        pub mod v1 {
            // Generated apart (see build.rs): `AllocateResponse.response` is an
            // [`EncodedAnswer`](crate::EncodedAnswer).
            include!(concat!(env!("OUT_DIR"), "/admin/pluglet.admin.v1.rs"));
        }
    }
}

/// Pluglet admin API.
pub mod admin {
    pub use crate::pluglet::admin::v1;
}

/// Wire constants of the kubelet protocols.
pub mod constants {
    /// Plugin types in `PluginInfo.type` (defined with [`pluglet_core::PluginType`]).
    pub use pluglet_core::names::{CSI_PLUGIN, DEVICE_PLUGIN, DRA_PLUGIN};
    /// Device health: healthy.
    pub const HEALTHY: &str = "Healthy";
    /// Device health: unhealthy.
    pub const UNHEALTHY: &str = "Unhealthy";
    /// The device plugin API version.
    pub const DEVICE_PLUGIN_VERSION: &str = "v1beta1";
    /// File name of the kubelet's registration socket in the device plugins directory.
    pub const KUBELET_SOCKET: &str = "kubelet.sock";
    /// File name of the device manager checkpoint in the device plugins directory.
    pub const CHECKPOINT_FILE: &str = "kubelet_internal_checkpoint";
}
