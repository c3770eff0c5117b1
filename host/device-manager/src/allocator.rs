//! Allocation: candidates → plugin preference → WASM policy → host check → reserve → Allocate
//! → PreStartContainer → record (facts §7.4, §7.5).
//!
//! Promises:
//! - a container that already holds devices of a resource gets the same ones again with no
//!   RPC; a different count is a "changed request" error, as in the kubelet;
//! - the policy's answer must be exactly `count` distinct available ids including every
//!   must-include id, else the request is refused naming the policy module;
//! - devices are chosen under a per-resource decision lock and reserved in the state before
//!   the first RPC to the plugin, so concurrent requests never get the same device;
//! - any failure leaves nothing held; success returns only once it is durable (journal
//!   first, the kubelet checkpoint follows: see [`crate::checkpoint`]).

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use pluglet_handler_runtime::{AllocationRequest, CallContext, Device as PolicyDevice};
use pluglet_proto::v1beta1;

use crate::error::{AllocateError, SyncPodsError};
use crate::manager::{AllocationInfo, DeviceManager};
use crate::pod_devices::{Entry, EntryState, HolderKey, group_by_numa};

/// The kubelet's `KubeletPreStartContainerRPCTimeoutInSecs`.
pub const PRE_START_TIMEOUT: Duration = Duration::from_secs(30);

/// Time allowed for the plugin's Allocate and GetPreferredAllocation (the kubelet sets none;
/// a plugin that never answers would otherwise hold its reservation forever).
pub const ALLOCATE_TIMEOUT: Duration = Duration::from_secs(30);

/// A successful allocation.
#[derive(Clone, Debug, PartialEq)]
pub struct Allocation {
    /// The devices the container holds, in the order chosen.
    pub device_ids: Vec<String>,
    /// The plugin's Allocate answer for the container.
    pub response: v1beta1::ContainerAllocateResponse,
    /// True when the container already held these devices and no RPC was made.
    pub reused: bool,
}

/// Checks a policy answer: exactly `count` distinct ids, all in `available`, including every
/// `must_include` id. Returns what is wrong.
pub fn check_answer(
    answer: &[String],
    count: u32,
    available: &HashSet<&str>,
    must_include: &[String],
) -> Result<(), String> {
    if answer.len() != count as usize {
        return Err(format!("{} ids instead of exactly {count}", answer.len()));
    }
    let mut seen = HashSet::with_capacity(answer.len());
    for id in answer {
        if !seen.insert(id.as_str()) {
            return Err(format!("{id} is chosen twice"));
        }
        if !available.contains(id.as_str()) {
            return Err(format!(
                "{id} is not an available device (unknown, unhealthy or held by another container)"
            ));
        }
    }
    if let Some(missing) = must_include.iter().find(|id| !seen.contains(id.as_str())) {
        return Err(format!("must-include device {missing} is missing"));
    }
    Ok(())
}

/// What the state says before the policy runs.
enum Plan {
    /// The container already holds these devices.
    Reuse(Allocation),
    /// Choose among these.
    Choose {
        available: Vec<PolicyDevice>,
        preferred_available: bool,
        client: v1beta1::device_plugin_client::DevicePluginClient<pluglet_uds::Channel>,
    },
}

impl DeviceManager {
    /// Allocates `count` devices of `resource` to one container (see the module doc).
    pub async fn allocate(
        &self,
        pod_uid: &str,
        container: &str,
        resource: &str,
        count: u32,
    ) -> Result<Allocation, AllocateError> {
        let key = HolderKey {
            pod_uid: pod_uid.to_owned(),
            container: container.to_owned(),
            resource: resource.to_owned(),
        };
        if count == 0 {
            return Err(AllocateError::ZeroCount {
                resource: key.resource,
            });
        }
        if self.inner.cancel.is_cancelled() {
            return Err(AllocateError::Stopped);
        }
        let decision = {
            let mut locks = self
                .inner
                .decisions
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            locks.entry(resource.to_owned()).or_default().clone()
        };
        let decision = decision.lock_owned().await;

        let (available, preferred_available, mut client) = match self.plan(&key, count)? {
            Plan::Reuse(allocation) => return Ok(allocation),
            Plan::Choose {
                available,
                preferred_available,
                client,
            } => (available, preferred_available, client),
        };

        let preferred = if preferred_available {
            let request = v1beta1::PreferredAllocationRequest {
                container_requests: vec![v1beta1::ContainerPreferredAllocationRequest {
                    available_device_i_ds: available.iter().map(|d| d.id.clone()).collect(),
                    must_include_device_i_ds: Vec::new(),
                    allocation_size: i32::try_from(count).unwrap_or(i32::MAX),
                }],
            };
            let answer =
                tokio::time::timeout(ALLOCATE_TIMEOUT, client.get_preferred_allocation(request))
                    .await
                    .unwrap_or_else(|_| {
                        Err(tonic::Status::deadline_exceeded(format!(
                            "no answer within {ALLOCATE_TIMEOUT:?}"
                        )))
                    })
                    .map_err(|status| AllocateError::Preferred {
                        resource: resource.to_owned(),
                        status,
                    })?;
            // Only the first container response counts, as in the kubelet.
            Some(
                answer
                    .into_inner()
                    .container_responses
                    .into_iter()
                    .next()
                    .map(|r| r.device_i_ds)
                    .unwrap_or_default(),
            )
        } else {
            None
        };

        let policy = self.inner.handlers.for_resource(resource);
        let module = policy.module().to_owned();
        let request = AllocationRequest {
            resource: resource.to_owned(),
            available,
            must_include: Vec::new(),
            count,
            preferred,
        };
        let cx = CallContext {
            node_name: self.inner.config.node_name.clone(),
        };
        let call = pluglet_handler_runtime::run_in_place(|| policy.allocate(&cx, &request));
        let call = call.map_err(|source| AllocateError::PolicyFailed {
            resource: resource.to_owned(),
            source,
        })?;
        let chosen = call.value.map_err(|refusal| AllocateError::PolicyRefused {
            resource: resource.to_owned(),
            module: module.clone(),
            refusal,
        })?;
        let available_ids: HashSet<&str> =
            request.available.iter().map(|d| d.id.as_str()).collect();
        check_answer(&chosen, count, &available_ids, &request.must_include).map_err(|problem| {
            AllocateError::BadPolicyAnswer {
                resource: resource.to_owned(),
                module: module.clone(),
                answer: chosen.clone(),
                count,
                problem,
            }
        })?;
        tracing::debug!(%resource, %module, ?chosen, elapsed = ?call.elapsed, "allocation policy chose");

        let token = self.inner.next_token.fetch_add(1, Ordering::SeqCst);
        let (client, pre_start) = self.reserve(&key, &chosen, token)?;
        drop(decision);

        match self.call_plugin(client, pre_start, &key, &chosen).await {
            Ok(response) => self.commit(key, token, chosen, response).await,
            Err(err) => {
                self.lock().pods.cancel(&key, token);
                Err(err)
            }
        }
    }

    /// Releases what `pod_uid` holds (only `container`'s when given); returns the number of
    /// (container, resource) entries released, once the checkpoint no longer holds them.
    pub async fn release(&self, pod_uid: &str, container: Option<&str>) -> usize {
        let released = self.lock().pods.release(pod_uid, container);
        if released.is_empty() {
            return 0;
        }
        tracing::info!(
            pod_uid,
            ?container,
            entries = released.len(),
            "devices released"
        );
        if let Err(err) = self.persist_allocations().await {
            tracing::error!(error = %crate::error::error_chain(&*err), "cannot record a release on disk");
        }
        released.len()
    }

    /// Frees, in one state change and one journal record, everything held by pods whose UID
    /// is not in `keep` (the kubelet's `UpdateAllocatedDevices`), entries still being
    /// allocated included: their allocation then fails as [`AllocateError::Released`].
    /// Returns what was freed, once it is durable; with `dry_run`, what would be freed, and
    /// nothing changes. An empty `keep` frees everything.
    pub async fn sync_pods(
        &self,
        keep: &BTreeSet<String>,
        dry_run: bool,
    ) -> Result<Vec<AllocationInfo>, SyncPodsError> {
        let freed: Vec<AllocationInfo> = {
            let mut state = self.lock();
            if dry_run {
                state
                    .pods
                    .not_kept(keep)
                    .map(|(key, entry)| AllocationInfo::of(key, entry))
                    .collect()
            } else {
                state
                    .pods
                    .release_pods_except(keep)
                    .iter()
                    .map(|(key, entry)| AllocationInfo::of(key, entry))
                    .collect()
            }
        };
        if dry_run {
            return Ok(freed);
        }
        if !freed.is_empty() {
            let pods: BTreeSet<&str> = freed.iter().map(|a| a.pod_uid.as_str()).collect();
            tracing::info!(
                pods = ?pods,
                entries = freed.len(),
                kept = keep.len(),
                "devices of pods no longer active released"
            );
        }
        // Writes no record when nothing is pending; after a failed write, this one retries it.
        match self.persist_allocations().await {
            Ok(()) => Ok(freed),
            Err(source) => Err(SyncPodsError::Journal { freed, source }),
        }
    }

    /// Under the state lock: reuse, or the candidates.
    fn plan(&self, key: &HolderKey, count: u32) -> Result<Plan, AllocateError> {
        let state = self.lock();
        if let Some(entry) = state.pods.get(key) {
            return match &entry.state {
                EntryState::Reserved { .. } => Err(AllocateError::InProgress {
                    pod_uid: key.pod_uid.clone(),
                    container: key.container.clone(),
                    resource: key.resource.clone(),
                }),
                EntryState::Allocated { response } if entry.devices.len() == count as usize => {
                    Ok(Plan::Reuse(Allocation {
                        device_ids: entry.devices.clone(),
                        response: response.clone(),
                        reused: true,
                    }))
                }
                EntryState::Allocated { .. } => Err(AllocateError::ChangedRequest {
                    pod_uid: key.pod_uid.clone(),
                    container: key.container.clone(),
                    resource: key.resource.clone(),
                    held: entry.devices.len(),
                    requested: count,
                }),
            };
        }
        let Some(resource) = state.resources.get(&key.resource) else {
            return Err(AllocateError::UnknownResource {
                resource: key.resource.clone(),
            });
        };
        let Some(endpoint) = &resource.endpoint else {
            return Err(AllocateError::NotConnected {
                resource: key.resource.clone(),
            });
        };
        let available: Vec<PolicyDevice> = resource
            .devices
            .iter()
            .filter(|d| {
                d.health == crate::devices::Health::Healthy
                    && !state.pods.is_held(&key.resource, &d.id)
            })
            .map(|d| PolicyDevice {
                id: d.id.clone(),
                numa_nodes: d.numa.clone(),
            })
            .collect();
        if available.len() < count as usize {
            return Err(AllocateError::Unavailable {
                resource: key.resource.clone(),
                requested: count,
                available: available.len(),
            });
        }
        Ok(Plan::Choose {
            available,
            preferred_available: endpoint.options.get_preferred_allocation_available,
            client: endpoint.client.clone(),
        })
    }

    /// Under the state lock: checks the chosen devices are still free and healthy and holds
    /// them for this request. Returns the client to call and whether PreStartContainer is due.
    fn reserve(
        &self,
        key: &HolderKey,
        chosen: &[String],
        token: u64,
    ) -> Result<
        (
            v1beta1::device_plugin_client::DevicePluginClient<pluglet_uds::Channel>,
            bool,
        ),
        AllocateError,
    > {
        let mut state = self.lock();
        if state.pods.get(key).is_some() {
            return Err(AllocateError::InProgress {
                pod_uid: key.pod_uid.clone(),
                container: key.container.clone(),
                resource: key.resource.clone(),
            });
        }
        let Some(resource) = state.resources.get(&key.resource) else {
            return Err(AllocateError::UnknownResource {
                resource: key.resource.clone(),
            });
        };
        let Some(endpoint) = &resource.endpoint else {
            return Err(AllocateError::NotConnected {
                resource: key.resource.clone(),
            });
        };
        let mut numa_of = Vec::with_capacity(chosen.len());
        for id in chosen {
            match resource.devices.get(id) {
                Some(device)
                    if device.health == crate::devices::Health::Healthy
                        && !state.pods.is_held(&key.resource, id) =>
                {
                    numa_of.push((id.as_str(), device.numa.as_slice()));
                }
                _ => {
                    return Err(AllocateError::Raced {
                        resource: key.resource.clone(),
                        device: id.clone(),
                    });
                }
            }
        }
        let numa = group_by_numa(numa_of);
        let client = endpoint.client.clone();
        let pre_start = endpoint.options.pre_start_required;
        state.pods.insert(
            key.clone(),
            Entry {
                devices: chosen.to_vec(),
                numa,
                state: EntryState::Reserved { token },
            },
        );
        Ok((client, pre_start))
    }

    /// Allocate, then PreStartContainer when the plugin asked for it.
    async fn call_plugin(
        &self,
        mut client: v1beta1::device_plugin_client::DevicePluginClient<pluglet_uds::Channel>,
        pre_start: bool,
        key: &HolderKey,
        chosen: &[String],
    ) -> Result<v1beta1::ContainerAllocateResponse, AllocateError> {
        let request = v1beta1::AllocateRequest {
            container_requests: vec![v1beta1::ContainerAllocateRequest {
                devices_ids: chosen.to_vec(),
            }],
        };
        let answer = tokio::time::timeout(ALLOCATE_TIMEOUT, client.allocate(request))
            .await
            .unwrap_or_else(|_| {
                Err(tonic::Status::deadline_exceeded(format!(
                    "no answer within {ALLOCATE_TIMEOUT:?}"
                )))
            })
            .map_err(|status| AllocateError::Allocate {
                resource: key.resource.clone(),
                devices: chosen.to_vec(),
                status,
            })?;
        let response = answer
            .into_inner()
            .container_responses
            .into_iter()
            .next()
            .ok_or_else(|| AllocateError::EmptyAllocateResponse {
                resource: key.resource.clone(),
                devices: chosen.to_vec(),
            })?;
        if pre_start {
            let request = v1beta1::PreStartContainerRequest {
                devices_ids: chosen.to_vec(),
            };
            tokio::time::timeout(PRE_START_TIMEOUT, client.pre_start_container(request))
                .await
                .unwrap_or_else(|_| {
                    Err(tonic::Status::deadline_exceeded(format!(
                        "no answer within {PRE_START_TIMEOUT:?}"
                    )))
                })
                .map_err(|status| AllocateError::PreStart {
                    resource: key.resource.clone(),
                    devices: chosen.to_vec(),
                    status,
                })?;
        }
        Ok(response)
    }

    /// Records the allocation and waits until it is durable; undoes it if the write fails.
    async fn commit(
        &self,
        key: HolderKey,
        token: u64,
        chosen: Vec<String>,
        response: v1beta1::ContainerAllocateResponse,
    ) -> Result<Allocation, AllocateError> {
        if !self.lock().pods.commit(&key, token, response.clone()) {
            return Err(AllocateError::Released {
                pod_uid: key.pod_uid,
                container: key.container,
                resource: key.resource,
            });
        }
        if let Err(source) = self.persist_allocations().await {
            {
                let mut state = self.lock();
                let ours = state.pods.get(&key).is_some_and(|e| {
                    matches!(&e.state, EntryState::Allocated { response: r } if *r == response)
                        && e.devices == chosen
                });
                if ours {
                    state.pods.release_key(&key);
                }
            }
            let _ = self.persist_allocations().await;
            return Err(AllocateError::Checkpoint {
                resource: key.resource,
                source: Arc::clone(&source),
            });
        }
        tracing::info!(
            pod_uid = %key.pod_uid,
            container = %key.container,
            resource = %key.resource,
            devices = ?chosen,
            "devices allocated"
        );
        Ok(Allocation {
            device_ids: chosen,
            response,
            reused: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_good_answer_passes() {
        let available = HashSet::from(["a", "b", "c"]);
        assert_eq!(
            check_answer(&ids(&["c", "a"]), 2, &available, &ids(&["a"])),
            Ok(())
        );
    }

    #[test]
    fn bad_answers_are_named() {
        let available = HashSet::from(["a", "b", "c"]);
        let cases: [(&[&str], &[&str], &str); 4] = [
            (&["a"], &[], "1 ids instead of exactly 2"),
            (&["a", "a"], &[], "a is chosen twice"),
            (&["a", "x"], &[], "x is not an available device"),
            (&["a", "b"], &["c"], "must-include device c is missing"),
        ];
        for (answer, must, expected) in cases {
            let err = check_answer(&ids(answer), 2, &available, &ids(must)).unwrap_err();
            assert!(err.contains(expected), "{answer:?}: {err}");
        }
    }
}
