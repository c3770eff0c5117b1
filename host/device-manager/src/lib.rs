//! Pluglet's device manager: what the kubelet's `pkg/kubelet/cm/devicemanager` does, with the
//! allocation decision made by a sandboxed WASM policy chosen per resource.
//!
//! Start at [`DeviceManager::start`]. Data flow:
//!
//! ```text
//!  kubelet.sock Register ──► registration_server ──┐ (DevicePlugin handler hooks, dial,
//!  plugin watcher (host) ──► connect_watcher ──────┤  GetDevicePluginOptions)
//!                                                  ▼
//!                               endpoint task per registration (ListAndWatch)
//!                                                  │ Event::Devices / StreamEnded (+ generation)
//!                                                  ▼
//!                 manager loop ──► State { resources: devices (health, NUMA), pods: pod_devices }
//!                                                  ▲                       │
//!  admin API allocate/release ──► allocator ───────┘                       ▼
//!     (candidates → GetPreferredAllocation → WASM policy → check → reserve    checkpoint writer
//!      → Allocate → PreStartContainer → commit)                 (kubelet_internal_checkpoint
//!                                                                 + side file, fsync, rename)
//! ```
//!
//! Modules: [`devices`] (health, capacity, allocatable), [`pod_devices`] (who holds what),
//! [`allocator`], [`endpoint`] (one task per registration), [`registration_server`]
//! (`kubelet.sock` and start-up), [`checkpoint`] (the files), [`error`].

pub mod allocator;
pub mod checkpoint;
pub mod devices;
pub mod endpoint;
pub mod error;
mod manager;
pub mod pod_devices;
pub mod registration_server;
pub mod stub;

pub use allocator::{Allocation, check_answer};
pub use checkpoint::{RestoreReport, SetAside};
pub use devices::{Device, Health};
pub use endpoint::Flow;
pub use error::{AllocateError, RegisterError, StartError, SyncPodsError, error_chain};
pub use manager::{
    AllocationInfo, Config, DEFAULT_DIAL_TIMEOUT, DEFAULT_GRACE_PERIOD, DeviceManager, ResourceInfo,
};
pub use pluglet_checkpoint::Durability;
