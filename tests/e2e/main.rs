//! End-to-end tests: the real `pluglet run` binary on a temporary root, the example plugins as
//! separate processes, and `pluglet ctl` to observe. One module per user story; the shared
//! harness is the `pluglet-test-support` crate's `e2e`, named `support` here. Run them with
//! `bash scripts/test.sh`: it builds the binaries first (with the daemon's test hooks, the
//! `pluglet/test-hooks` feature, which the tests are run with too) and installs the programs the
//! tests run (`minisign` for the signature tests, `systemd-analyze` for the
//! unit file, `mount` for the state tests, which run as root, podman, runc and
//! busybox-static for the container runtime test, `curl` for the pages of `docs/` whose commands
//! `docs_pages` runs, and etcd with a kube-apiserver built by
//! `scripts/kube-apiserver.sh` for publishing to a Kubernetes API server).

use pluglet_test_support::e2e as support;
use pluglet_test_support::e2e::devices as device_support;

mod daemon_lifecycle;
mod isolation;
mod misbehaving_device_plugins;
mod misbehaving_plugins;
mod ops;
mod refusal;
mod registration;

mod admin_access;
mod cdi_runtime;
mod cli_grammar;
mod compile_cache;
mod crash_consistency;
mod device_authority;
mod device_property;
mod device_restart;
mod devices;
mod docs_pages;
mod fleet;
mod handler_integrity;
mod handler_registry;
mod handler_restart;
mod handler_rewrites;
mod handler_rollout;
mod handler_swap;
mod handler_vectors;
mod kube_harness;
mod kubelet_sock_plugins;
mod node_operations;
mod pod_resources;
mod state_disk;
mod status_events;
mod sync_pods;
