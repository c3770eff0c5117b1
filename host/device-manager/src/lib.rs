//! Pluglet's device manager: what the kubelet's `pkg/kubelet/cm/devicemanager` does, with the
//! allocation decision made by a sandboxed WASM policy chosen per resource.
//!
//! Start at [`DeviceManager::start`]. Data flow, one module per stage:
//!
//! ```text
//!  kubelet.sock Register ──► registration_server ──┐
//!  plugin watcher (daemon) ─────────────────────────┤  registration pipeline (validate hook,
//!                                                   ▼  register hook, then activation:)
//!                                  kind ──► registry::connect ──► endpoint task per plugin
//!                                                   ▲                 │ ListAndWatch updates,
//!                                                   └─────────────────┘ stream end (own task)
//!  admin API allocate / release / sync-pods ──► allocator (pod devices; candidates from the
//!     registry → GetPreferredAllocation → WASM policy → check → reserve → Allocate
//!     → PreStartContainer → commit)
//!                                │ commit: journal record (durable)      │ write requests
//!                                ▼                                       ▼
//!                   persistence (journal, kubelet_internal_checkpoint + side file, restore)
//!                                │ the state of the newest durable change (shared copy)
//!                                ▼
//!  agents ──► pod_resources (v1.PodResourcesLister on pod-resources/kubelet.sock, with the
//!             registry's device sets; never the allocator's lock)
//! ```
//!
//! Modules: [`registry`] (resources, devices, endpoints, grace period), [`endpoint`] (one task per
//! connected plugin; `device_list` reads its ListAndWatch updates; `allocate_calls` makes its
//! Allocate calls, one at a time, the allocations that wait asked for together), [`devices`]
//! (health, capacity, allocatable; ids are [`DeviceId`]s), [`allocator`] and [`pod_devices`] (who
//! holds what; `answer` reads the plugin's Allocate answer and keeps it as a [`PluginAnswer`];
//! [`KeepList`] is the pods a sync of pods keeps), `cdi::writer` (the spec files' thread),
//! [`persistence`] (the files), [`pod_resources`] (the kubelet's pod-resources API, read from the
//! acknowledged allocations), [`registration_server`] (`kubelet.sock` and start-up), `kind` (the
//! device plugin type's pipeline steps), [`error`].

pub mod allocator;
mod answer;
pub mod cdi;
mod device_id;
mod device_list;
pub mod devices;
pub mod endpoint;
pub mod error;
mod keep_list;
mod kind;
mod manager;
pub mod metrics;
pub mod persistence;
pub mod pod_devices;
pub mod pod_resources;
pub mod registration_server;
pub mod registry;

pub use allocator::{Allocation, AllocationInfo, check_answer};
pub use answer::{AnswerDevice, AnswerMount, AnswerView, PluginAnswer, ViewError};
pub use device_id::DeviceId;
pub use devices::{Health, ListedDevice};
pub use endpoint::Flow;
pub use error::{AllocateError, AnswerError, ConnectError, ReleaseError, StartError, WriterError};
pub use keep_list::{KeepList, KeptCursor};
pub use manager::{
    Config, DEFAULT_ALLOCATE_BATCH, DEFAULT_DIAL_TIMEOUT, DEFAULT_GRACE_PERIOD, DeviceManager,
};
pub use metrics::Metrics;
pub use persistence::restore::{Recovery, RestoreReport, SetAside};
pub use pluglet_checkpoint::Durability;
pub use pod_devices::PodName;
pub use registry::{RegistryEvent, ResourceInfo};
