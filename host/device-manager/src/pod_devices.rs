//! What each pod's containers hold (the kubelet's `pod_devices.go`).
//!
//! One entry per (pod, container, resource). An entry is first *reserved* (the allocator chose
//! its devices and no one else may take them, but the plugin's Allocate has not answered yet),
//! then *allocated* (the plugin answered) or dropped again. Only allocated entries are
//! checkpointed. Written by the allocator, by releases and by the restore at start; read by the
//! allocator (what is free) and the admin API.

use std::collections::{BTreeMap, HashMap};

use imbl::OrdMap;
use std::sync::{Arc, OnceLock};

use pluglet_core::{ContainerName, PodUid, ResourceName};
use pluglet_handler_runtime::ColumnRun;

use crate::answer::PluginAnswer;
use crate::device_id::DeviceId;
use crate::devices::{DeviceSet, Health, IdHasher, NameHasher, Positions};
use crate::keep_list::KeepList;

/// Who holds devices: one container of one pod, for one resource.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HolderKey {
    /// The pod's UID.
    pub pod_uid: PodUid,
    /// The container's name.
    pub container: ContainerName,
    /// The extended resource name.
    pub resource: ResourceName,
}

impl HolderKey {
    /// The key of `container` of `pod_uid` for `resource`.
    pub fn new(
        pod_uid: impl Into<PodUid>,
        container: impl Into<ContainerName>,
        resource: impl Into<ResourceName>,
    ) -> HolderKey {
        HolderKey {
            pod_uid: pod_uid.into(),
            container: container.into(),
            resource: resource.into(),
        }
    }
}

/// A pod UID of up to [`InlineUid::CAPACITY`] bytes, kept in place.
#[derive(Clone, Copy, Debug)]
struct InlineUid {
    len: u8,
    bytes: [u8; InlineUid::CAPACITY],
}

impl InlineUid {
    /// A kubelet's pod UIDs (36-byte UUIDs) and a little more.
    const CAPACITY: usize = 39;

    /// `uid` in place; `None` when it is longer than [`InlineUid::CAPACITY`].
    fn new(uid: &str) -> Option<InlineUid> {
        let mut bytes = [0; InlineUid::CAPACITY];
        bytes.get_mut(..uid.len())?.copy_from_slice(uid.as_bytes());
        Some(InlineUid {
            len: uid.len() as u8,
            bytes,
        })
    }

    fn bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

/// The pods holding entries, each with its number of entries: the index a sync of pods walks
/// beside its keep list, kept by the state (a copy has none) through every change.
///
/// The index is a two-level B-tree of large sorted runs (`indexset`), not the standard
/// library's: a walk reads one run after the other, where the standard tree's small nodes are
/// each a dependent read. Walking 10,000 pods beside a keep list took 130 µs with the index out
/// of the cache against 430 µs (docs/performance.md); an insert and a removal cost 0.5 µs
/// against 0.3 µs.
#[derive(Clone, Debug)]
struct HeldPods {
    by_uid: indexset::BTreeMap<PodKey, u32>,
}

impl HeldPods {
    /// Pods per sorted run: an insert moves at most this many keys (12 KiB) along.
    const RUN: usize = 256;

    /// One more entry of `pod`. A pod's first entry (the commonest case: a pod allocating one
    /// resource for one container) is one search of the index; a search costs a comparison of
    /// UIDs per step, about 550 instructions among 10,000 pods.
    fn count(&mut self, pod: &str) {
        if let Some(before) = self.by_uid.insert(PodKey::new(pod), 1)
            && let Some(count) = self.by_uid.get_mut(&PodKey::new(pod))
        {
            *count = before + 1;
        }
    }

    /// One entry of `pod` fewer: one search, then the entry found by its place.
    fn uncount(&mut self, pod: &str) {
        let pod = PodKey::new(pod);
        let at = self.by_uid.rank(&pod);
        match self.by_uid.get_index(at) {
            Some((found, 1)) if *found == pod => {
                self.by_uid.pop_index(at);
            }
            Some((found, _)) if *found == pod => {
                if let Some(count) = self.by_uid.get_mut_index(at) {
                    *count -= 1;
                }
            }
            _ => {}
        }
    }
}

impl Default for HeldPods {
    fn default() -> HeldPods {
        HeldPods {
            by_uid: indexset::BTreeMap::with_maximum_node_size(HeldPods::RUN),
        }
    }
}

/// A pod UID as the index of held pods keeps it: in place when it fits, so that a walk over
/// the index reads the index's own runs and nothing else.
#[derive(Clone, Debug)]
enum PodKey {
    Inline(InlineUid),
    Long(PodUid),
}

impl PodKey {
    fn new(uid: &str) -> PodKey {
        InlineUid::new(uid).map_or_else(|| PodKey::Long(PodUid::from(uid)), PodKey::Inline)
    }

    fn bytes(&self) -> &[u8] {
        match self {
            PodKey::Inline(uid) => uid.bytes(),
            PodKey::Long(uid) => uid.as_str().as_bytes(),
        }
    }

    /// The UID (copied from a `str`, so its bytes are UTF-8).
    fn uid(&self) -> PodUid {
        PodUid::from(String::from_utf8_lossy(self.bytes()).into_owned())
    }
}

/// By the UID's bytes, as `str` orders them (and so as [`HolderKey`] orders its pods).
impl Ord for PodKey {
    fn cmp(&self, other: &PodKey) -> std::cmp::Ordering {
        self.bytes().cmp(other.bytes())
    }
}

impl PartialOrd for PodKey {
    fn partial_cmp(&self, other: &PodKey) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for PodKey {
    fn eq(&self, other: &PodKey) -> bool {
        self.bytes() == other.bytes()
    }
}

impl Eq for PodKey {}

/// Where an entry stands.
#[derive(Clone, Debug, PartialEq)]
pub enum HoldingState {
    /// Devices chosen and held; the plugin's Allocate (and PreStartContainer) not yet done.
    /// `token` identifies the one request that may commit or cancel it.
    Reserved {
        /// The reserving request.
        token: u64,
    },
    /// The plugin answered Allocate.
    Allocated {
        /// The plugin's answer for this container.
        answer: PluginAnswer,
    },
}

/// A pod's name and namespace, as the pod-resources API shows them (Pluglet's pods are
/// identified by UID; the name is what the client gave with its first allocation).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PodName {
    /// The pod's name.
    pub name: String,
    /// Its namespace.
    pub namespace: String,
}

impl PodName {
    /// The namespace of a pod allocated without one, as the pod-resources API shows it.
    pub const DEFAULT_NAMESPACE: &'static str = "default";

    /// The name `pod` is shown with: `given`, else its UID in the default namespace.
    pub fn shown(given: Option<&PodName>, pod_uid: &str) -> PodName {
        given.cloned().unwrap_or_else(|| PodName {
            name: pod_uid.to_owned(),
            namespace: PodName::DEFAULT_NAMESPACE.to_owned(),
        })
    }
}

/// What one holder holds: the devices one container holds (or has reserved) of one resource.
/// The device lists are shared, not copied, when a holding is cloned: a reservation turned
/// into an allocation on a copy of the state changes only its state.
#[derive(Clone, Debug, PartialEq)]
pub struct Holding {
    /// Device ids in the order they were chosen.
    pub devices: Arc<[DeviceId]>,
    /// The same ids by NUMA node (`-1`: no topology), as the kubelet checkpoints them.
    pub numa: Arc<BTreeMap<i64, Vec<DeviceId>>>,
    /// Reserved or allocated.
    pub state: HoldingState,
    /// The pod's name and namespace, when the allocation gave them (recorded in the journal
    /// with the allocation; see `persistence::files`).
    pub pod: Option<PodName>,
}

/// The ids of one resource that some container holds or has reserved.
#[derive(Clone, Copy, Debug)]
pub struct HeldIds<'a>(Option<&'a HashMap<DeviceId, u32, IdHasher>>);

impl HeldIds<'_> {
    /// Whether `id` is held.
    pub fn is_held(&self, id: &str) -> bool {
        self.0.is_some_and(|held| held.contains_key(id))
    }
}

/// An entry as kept: shared by copies of the state until one of them changes it, with its
/// encoded form once a writer has asked for it (see [`PodDevices::encoded`]).
#[derive(Clone, Debug)]
struct Kept {
    entry: Holding,
    encoded: OnceLock<Box<[u8]>>,
}

impl Kept {
    fn new(entry: Holding) -> Arc<Kept> {
        Arc::new(Kept {
            entry,
            encoded: OnceLock::new(),
        })
    }

    /// The entry's bytes as `encode` makes them, encoded the first time they are asked for.
    fn bytes(&self, key: &HolderKey, encode: impl Fn(&HolderKey, &Holding) -> Vec<u8>) -> &[u8] {
        self.encoded
            .get_or_init(|| encode(key, &self.entry).into_boxed_slice())
    }
}

/// What a change made on a copy did to one key (see [`PodDevices::take_changes`]).
#[derive(Clone, Debug)]
pub struct Change {
    key: Arc<HolderKey>,
    /// The key's entry before the change, in the state the copy was made from; `None`: none.
    old: Option<Arc<Kept>>,
    /// The key's entry after the change; `None`: removed.
    kept: Option<Arc<Kept>>,
}

impl Change {
    /// The key changed.
    pub fn key(&self) -> &HolderKey {
        &self.key
    }

    /// The bytes `encode` gives the key's entry if it is allocated (kept with the entry like
    /// those of [`PodDevices::encoded`]); `None` when it was removed or is only reserved.
    pub fn encoded(&self, encode: impl Fn(&HolderKey, &Holding) -> Vec<u8>) -> Option<&[u8]> {
        let kept = self.kept.as_ref()?;
        match kept.entry.state {
            HoldingState::Allocated { .. } => Some(kept.bytes(&self.key, encode)),
            HoldingState::Reserved { .. } => None,
        }
    }
}

/// Every holder's devices, with a per-resource index of what is held.
///
/// Entries are shared between copies ([`PodDevices::without_index`] shares the map's tree, not
/// only devices and answers), and each keeps its encoded form for the journal: a change encodes
/// only what it changes, however many containers hold devices on the node.
#[derive(Clone, Debug)]
pub struct PodDevices {
    /// A persistent map: a copy shares its tree and copies only the nodes a change touches, so
    /// the copy every durable change is made from costs the same on an empty node and on one
    /// holding 10,000 allocations.
    entries: OrdMap<Arc<HolderKey>, Arc<Kept>>,
    /// resource → device id → number of entries holding it (more than 1 only after restoring a
    /// checkpoint that says so).
    held: HashMap<ResourceName, HashMap<DeviceId, u32, IdHasher>, NameHasher>,
    /// resource → its healthy devices no one holds, as of the device set it was built from
    /// (see [`PodDevices::for_each_free`]); kept up to date by every change of what is held.
    free: HashMap<ResourceName, FreeDevices, NameHasher>,
    /// The pods holding entries: what a sync walks (see [`PodDevices::pods_not_kept`]).
    /// `None` in a copy made to be encoded ([`PodDevices::without_index`]), which keeps no
    /// index at all (not even an empty one: making one allocates a run).
    pods: Option<HeldPods>,
    /// Bumped by every change (see [`PodDevices::version`]).
    version: u64,
    /// In a copy without index: the keys its changes touched, in order, each with its entry
    /// before that change and after it (see [`PodDevices::take_changes`]).
    touched: Vec<Change>,
}

impl Default for PodDevices {
    fn default() -> PodDevices {
        PodDevices {
            entries: OrdMap::default(),
            held: HashMap::default(),
            free: HashMap::default(),
            pods: Some(HeldPods::default()),
            version: 0,
            touched: Vec::new(),
        }
    }
}

impl PodDevices {
    /// A number that grows with every change, so a writer can tell whether a snapshot it took
    /// covers the current state.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The entry of `key`, if any.
    pub fn get(&self, key: &HolderKey) -> Option<&Holding> {
        self.entries.get(key).map(|kept| &kept.entry)
    }

    /// A copy of the entries without the per-resource index: enough to encode the state after
    /// a change before the change is made, at a fraction of a full clone's cost for an
    /// allocation of many devices. The copy's [`PodDevices::is_held`] and
    /// [`PodDevices::held_count`] say nothing is held.
    pub fn without_index(&self) -> PodDevices {
        PodDevices {
            entries: self.entries.clone(),
            held: HashMap::default(),
            free: HashMap::default(),
            pods: None,
            version: self.version,
            touched: Vec::new(),
        }
    }

    /// What the changes since the copy was made ([`PodDevices::without_index`]) did: each key
    /// they touched, once, sorted, with its entry before them and now; empty for the state
    /// itself, which does not keep them. A journal change record is made of these (what the
    /// change touched, not the whole state), and [`PodDevices::adopt`] makes them again on the
    /// state, neither looking the keys up again.
    pub fn take_changes(&mut self) -> Vec<Change> {
        let mut touched = std::mem::take(&mut self.touched);
        // Stable: of each key's changes, the first holds its entry before them all and the
        // last its entry now, so no key is looked up again.
        touched.sort_by(|a, b| a.key.cmp(&b.key));
        touched.dedup_by(|later, first| {
            let same = later.key == first.key;
            if same {
                first.kept = later.kept.take();
            }
            same
        });
        touched
    }

    /// Forgets the changes made since the copy was made ([`PodDevices::take_changes`] then
    /// says nothing changed).
    pub fn forget_changes(&mut self) {
        self.touched.clear();
    }

    /// A copy without index ([`PodDevices::without_index`]).
    fn unindexed(&self) -> bool {
        self.pods.is_none()
    }

    /// Notes, in a copy, that `key`'s entry changed from `old` to `kept` (`None`: none).
    fn touch(&mut self, key: &Arc<HolderKey>, old: Option<&Arc<Kept>>, kept: Option<&Arc<Kept>>) {
        if self.unindexed() {
            self.touched.push(Change {
                key: Arc::clone(key),
                old: old.cloned(),
                kept: kept.cloned(),
            });
        }
    }

    /// Whether some container holds (or has reserved) device `id` of `resource`.
    pub fn is_held(&self, resource: &str, id: &str) -> bool {
        self.held_of(resource).is_held(id)
    }

    /// What is held of `resource`, looked up once for many ids.
    pub fn held_of(&self, resource: &str) -> HeldIds<'_> {
        HeldIds(self.held.get(resource))
    }

    /// The healthy devices of `devices` (the resource's devices now) that no one holds, in
    /// plugin order, and how many they are. The view of what is free is kept between calls and
    /// changed by each change of what is held, so a call costs the free devices (and a word per
    /// 64 devices), not every device of the resource; it is built again, once, after the
    /// devices or their health change.
    pub fn free_devices(
        &mut self,
        resource: &ResourceName,
        devices: &DeviceSet,
    ) -> (usize, impl Iterator<Item = ColumnRun<'_>>) {
        let current = self
            .free
            .get(resource)
            .is_some_and(|f| f.devices.generation() == devices.generation());
        if !current {
            let held = HeldIds(self.held.get(resource.as_str()));
            let free = FreeDevices::new(devices.clone(), |id| held.is_held(id));
            self.free.insert(resource.clone(), free);
        }
        let free = &self.free[resource];
        let mut runs = free_runs(&free.bits, &free.words).peekable();
        let merged = std::iter::from_fn(move || {
            let mut run = runs.next()?;
            while let Some(next) = runs.next_if(|next| next.start == run.end) {
                run.end = next.end;
            }
            Some(run)
        });
        (free.count, merged.map(|run| free.devices.run(run)))
    }

    /// Number of devices of `resource` held or reserved.
    pub fn held_count(&self, resource: &str) -> usize {
        self.held.get(resource).map_or(0, HashMap::len)
    }

    /// Adds an entry; the caller has checked that `key` has none and its devices are free.
    pub fn insert(&mut self, key: HolderKey, entry: Holding) {
        self.insert_found(Arc::new(key), entry, &Positions::default());
    }

    /// [`PodDevices::insert`], with where the entry's devices are in the resource's devices
    /// (see [`Positions`]): the view of what is free takes them by position while it is of that
    /// generation, and by id otherwise.
    pub fn insert_found(&mut self, key: Arc<HolderKey>, entry: Holding, found: &Positions) {
        self.version += 1;
        self.hold(&key.resource, &entry.devices, found);
        let kept = Kept::new(entry);
        let now = self.unindexed().then(|| Arc::clone(&kept));
        let old = self.entries.insert(Arc::clone(&key), kept);
        self.touch(&key, old.as_ref(), now.as_ref());
        match old {
            Some(old) => self.unhold(key.resource.as_str(), &old.entry.devices),
            None => self.count_pod(&key.pod_uid),
        }
    }

    /// Makes `changes`, taken from a copy ([`PodDevices::take_changes`]), on this state as one
    /// change: each key's entry becomes the copy's (shared with it, encoded bytes included),
    /// or is removed where the copy has none; the change is not run again.
    pub fn adopt(&mut self, changes: &[Change]) {
        if changes.is_empty() {
            return;
        }
        self.version += 1;
        for Change { key, kept, .. } in changes {
            let old = match kept {
                Some(kept) => self.entries.insert(Arc::clone(key), Arc::clone(kept)),
                None => self.entries.remove(&**key),
            };
            self.touch(key, old.as_ref(), kept.as_ref());
            self.follow(key, old.as_ref(), kept.as_ref());
        }
    }

    /// [`PodDevices::adopt`] of the changes made on `from`, a copy made from this state when
    /// it was at version `base`. While this state is still at `base` (nothing changed it since,
    /// as when changes come one at a time), `from`'s map is taken whole, its tree shared, and
    /// only the index follows `changes`: no key is looked up, and no path of this state's tree
    /// is copied to change it. Otherwise as [`PodDevices::adopt`].
    pub fn adopt_copy(&mut self, from: &PodDevices, base: Option<u64>, changes: &[Change]) {
        if base != Some(self.version) || self.unindexed() {
            self.adopt(changes);
            return;
        }
        if changes.is_empty() {
            return;
        }
        self.version += 1;
        self.entries = from.entries.clone();
        for Change { key, old, kept } in changes {
            self.follow(key, old.as_ref(), kept.as_ref());
        }
    }

    /// Makes the index follow `key`'s entry going from `old` to `kept`.
    fn follow(&mut self, key: &HolderKey, old: Option<&Arc<Kept>>, kept: Option<&Arc<Kept>>) {
        if let (Some(old), Some(kept)) = (old, kept)
            && old.entry.devices == kept.entry.devices
        {
            // The same devices (a reservation that became an allocation, the commonest
            // change): what is held stays as it is.
            return;
        }
        if let Some(kept) = kept {
            self.hold(&key.resource, &kept.entry.devices, &Positions::default());
        }
        match (old.is_some(), kept.is_some()) {
            (false, true) => self.count_pod(&key.pod_uid),
            (true, false) => self.uncount_pod(&key.pod_uid),
            _ => {}
        }
        if let Some(old) = old {
            self.unhold(key.resource.as_str(), &old.entry.devices);
        }
    }

    fn hold(&mut self, resource: &ResourceName, devices: &[DeviceId], found: &Positions) {
        if self.unindexed() {
            return;
        }
        // Looked up by the name lent: a copy of it is made only at the resource's first holding.
        if !self.held.contains_key(resource.as_str()) {
            self.held.insert(resource.clone(), HashMap::default());
        }
        let held = self
            .held
            .get_mut(resource.as_str())
            .expect("inserted above if missing");
        // Room for all of them at once, not grown (and rehashed) step by step.
        held.reserve(devices.len());
        let mut free = self.free.get_mut(resource);
        let at = free.as_ref().and_then(|free| found.in_set(&free.devices));
        for (i, id) in devices.iter().enumerate() {
            *held.entry(id.clone()).or_default() += 1;
            if let Some(free) = &mut free {
                match at {
                    Some(at) => free.take_at(at[i] as usize),
                    None => free.take(id.as_str()),
                }
            }
        }
    }

    /// Turns the reservation `token` of `key` into an allocation. False when the reservation is
    /// gone (released meanwhile).
    pub fn commit(&mut self, key: &HolderKey, token: u64, answer: PluginAnswer) -> bool {
        let unindexed = self.unindexed();
        match self.entries.get_key_value_mut(key) {
            Some((shared, kept)) if kept.entry.state == (HoldingState::Reserved { token }) => {
                let shared = Arc::clone(shared);
                // Kept for the copy's change; the state does not keep it (its entry is then
                // changed in place unless a copy shares it).
                let old = unindexed.then(|| Arc::clone(kept));
                let changed = Arc::make_mut(kept);
                changed.entry.state = HoldingState::Allocated { answer };
                changed.encoded = OnceLock::new();
                let now = unindexed.then(|| Arc::clone(kept));
                self.version += 1;
                self.touch(&shared, old.as_ref(), now.as_ref());
                true
            }
            _ => false,
        }
    }

    /// Drops the reservation `token` of `key` (its allocation failed). False when it is gone.
    pub fn cancel(&mut self, key: &HolderKey, token: u64) -> bool {
        match self.entries.get(key) {
            Some(kept) if kept.entry.state == (HoldingState::Reserved { token }) => {
                self.release_key(key);
                true
            }
            _ => false,
        }
    }

    /// Removes every entry of `pod_uid` (only `container`'s when given), reserved ones included;
    /// returns the keys removed.
    pub fn release(&mut self, pod_uid: &str, container: Option<&str>) -> Vec<HolderKey> {
        let keys = self.pod_keys_where(pod_uid, |k| container.is_none_or(|c| k.container == c));
        self.release_keys(keys)
            .into_iter()
            .map(|(key, _)| key)
            .collect()
    }

    /// The keys of the entries of pods not in `keep`, sorted by pod, container and resource.
    pub fn not_kept(&self, keep: &KeepList) -> Vec<HolderKey> {
        let pods = self.pods_not_kept(keep);
        self.keys_of_pods(&pods)
    }

    /// [`PodDevices::not_kept`] of this copy, made from `state` with the changes that touched
    /// `waiting` made on it: its pods are the state's (found by the state's index of held
    /// pods, not by a walk of the copy's entries) and those of `waiting`.
    pub fn not_kept_beside(
        &self,
        state: &PodDevices,
        waiting: &[Change],
        keep: &KeepList,
    ) -> Vec<HolderKey> {
        let mut pods = state.pods_not_kept(keep);
        pods.extend(
            waiting
                .iter()
                .map(|change| &change.key.pod_uid)
                .filter(|pod| !keep.contains(pod.as_str()))
                .cloned(),
        );
        pods.sort_unstable();
        pods.dedup();
        self.keys_of_pods(&pods)
    }

    /// The pods holding entries that are not in `keep`, sorted. The pods and `keep` are both
    /// sorted by UID, so they are walked side by side: a comparison per pod and per kept pod
    /// passed, not a lookup in `keep` per pod; where the kept pods run far ahead (a node
    /// holding little), the walk jumps instead of stepping. The state walks its index of held
    /// pods; a copy, which has none, walks its entries. Plain loops: as a `filter` closure,
    /// the cursor's question was not made in line, and the walk cost about a third more.
    fn pods_not_kept(&self, keep: &KeepList) -> Vec<PodUid> {
        let mut kept = keep.ascending();
        let mut gone = Vec::new();
        if let Some(index) = &self.pods {
            for pod in index.by_uid.keys() {
                if !kept.contains(pod.bytes()) {
                    gone.push(pod.uid());
                }
            }
            return gone;
        }
        let mut last: Option<&PodUid> = None;
        for key in self.entries.keys() {
            let pod = &key.pod_uid;
            if last != Some(pod) && !kept.contains(pod.as_str().as_bytes()) {
                gone.push(pod.clone());
            }
            last = Some(pod);
        }
        gone
    }

    /// The keys of the entries of `pods` (sorted, each once), sorted: a range of the map per
    /// pod.
    fn keys_of_pods(&self, pods: &[PodUid]) -> Vec<HolderKey> {
        pods.iter()
            .flat_map(|pod| {
                self.entries_of_pod(pod.as_str())
                    .map(|(key, _)| key.clone())
            })
            .collect()
    }

    /// The keys of the entries of `pod_uid` that `gone` selects, sorted: found by a range of
    /// the map (sorted by pod first), not a walk over every holder on the node.
    pub fn pod_keys_where(
        &self,
        pod_uid: &str,
        mut gone: impl FnMut(&HolderKey) -> bool,
    ) -> Vec<HolderKey> {
        self.entries_of_pod(pod_uid)
            .map(|(key, _)| key)
            .filter(|key| gone(key))
            .cloned()
            .collect()
    }

    /// The entries of `pod_uid`, sorted: a range of the map, which is sorted by pod first.
    fn entries_of_pod<'a>(
        &'a self,
        pod_uid: &str,
    ) -> impl Iterator<Item = (&'a HolderKey, &'a Kept)> {
        self.entries
            .range(HolderKey::new(pod_uid, "", "")..)
            .map(|(key, kept)| (&**key, &**kept))
            .take_while(move |(key, _)| key.pod_uid == pod_uid)
    }

    /// Removes the entries of `keys` as one change, reserved ones included (their allocation
    /// then cannot commit; keys without an entry are skipped); returns the entries removed.
    pub fn release_keys(&mut self, keys: Vec<HolderKey>) -> Vec<(HolderKey, Holding)> {
        if keys.is_empty() {
            return Vec::new();
        }
        self.version += 1;
        let mut removed = Vec::with_capacity(keys.len());
        for key in keys {
            if let Some((shared, kept)) = self.entries.remove_with_key(&key) {
                self.touch(&shared, Some(&kept), None);
                self.unhold(key.resource.as_str(), &kept.entry.devices);
                self.uncount_pod(&key.pod_uid);
                let entry =
                    Arc::try_unwrap(kept).map_or_else(|kept| kept.entry.clone(), |k| k.entry);
                removed.push((key, entry));
            }
        }
        removed
    }

    /// The name of `key`'s pod recorded with any of its entries (if one was given) and `key`'s
    /// entry, found by one range of the map (the pod's entries) instead of a lookup each.
    pub fn pod_name_and_entry(&self, key: &HolderKey) -> (Option<&PodName>, Option<&Holding>) {
        let mut name = None;
        let mut entry = None;
        for (k, kept) in self.entries_of_pod(key.pod_uid.as_str()) {
            name = name.or(kept.entry.pod.as_ref());
            if k.container == key.container && k.resource == key.resource {
                entry = Some(&kept.entry);
            }
        }
        (name, entry)
    }

    /// The name of `pod_uid` recorded with any of its entries, if one was given.
    pub fn pod_name(&self, pod_uid: &str) -> Option<&PodName> {
        self.entries_of_pod(pod_uid)
            .find_map(|(_, kept)| kept.entry.pod.as_ref())
    }

    /// Every entry, sorted by pod, container and resource.
    pub fn iter(&self) -> impl Iterator<Item = (&HolderKey, &Holding)> {
        self.entries.iter().map(|(key, kept)| (&**key, &kept.entry))
    }

    /// The allocated entries (reserved ones are left out), each as `encode` turns it into
    /// bytes, sorted by pod, container and resource. An entry is encoded once: its bytes are
    /// kept with it (and shared by copies) until it changes, so `encode` must depend on the key
    /// and the entry only.
    pub fn encoded<'a>(
        &'a self,
        encode: impl Fn(&HolderKey, &Holding) -> Vec<u8> + 'a,
    ) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.allocated()
            .map(move |(key, kept)| kept.bytes(key, &encode))
    }

    /// The allocated entries (reserved ones are left out), sorted by pod, container and
    /// resource, each with the bytes [`PodDevices::encoded`] keeps for it if it has been
    /// encoded (nothing is encoded or kept here).
    pub fn allocated_with_bytes(
        &self,
    ) -> impl Iterator<Item = (&HolderKey, &Holding, Option<&[u8]>)> {
        self.allocated()
            .map(|(key, kept)| (key, &kept.entry, kept.encoded.get().map(|b| &**b)))
    }

    /// The allocated entries, sorted by pod, container and resource.
    fn allocated(&self) -> impl Iterator<Item = (&HolderKey, &Kept)> {
        self.entries
            .iter()
            .filter_map(|(key, kept)| match kept.entry.state {
                HoldingState::Allocated { .. } => Some((&**key, &**kept)),
                HoldingState::Reserved { .. } => None,
            })
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no one holds anything.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Removes the entry of `key`, whatever its state.
    pub fn release_key(&mut self, key: &HolderKey) {
        if let Some((shared, kept)) = self.entries.remove_with_key(key) {
            self.version += 1;
            self.touch(&shared, Some(&kept), None);
            self.unhold(key.resource.as_str(), &kept.entry.devices);
            self.uncount_pod(&key.pod_uid);
        }
    }

    /// One more entry of `pod` (in the index of held pods, which a copy does not keep).
    fn count_pod(&mut self, pod: &PodUid) {
        if let Some(index) = &mut self.pods {
            index.count(pod.as_str());
        }
    }

    /// One entry of `pod` fewer.
    fn uncount_pod(&mut self, pod: &PodUid) {
        if let Some(index) = &mut self.pods {
            index.uncount(pod.as_str());
        }
    }

    fn unhold(&mut self, resource: &str, devices: &[DeviceId]) {
        if let Some(held) = self.held.get_mut(resource) {
            let mut free = self.free.get_mut(resource);
            for id in devices {
                if let Some(count) = held.get_mut(id.as_str()) {
                    *count -= 1;
                    if *count == 0 {
                        held.remove(id.as_str());
                        if let Some(free) = &mut free {
                            free.give_back(id.as_str());
                        }
                    }
                }
            }
            if held.is_empty() {
                self.held.remove(resource);
            }
        }
    }
}

/// The healthy devices of one resource that no one holds: a bit per device of `devices`, by
/// position in plugin order, and a bit per word of those saying whether it has a free device,
/// so that listing them reads the words that do and not one per 64 devices of the resource (on
/// a full node of 10,064 devices with 64 free, 3 summary words instead of 158 words).
#[derive(Clone, Debug)]
struct FreeDevices {
    devices: DeviceSet,
    bits: Vec<u64>,
    /// Bit `w % 64` of word `w / 64`: word `w` of `bits` is not zero.
    words: Vec<u64>,
    count: usize,
}

/// The positions of the set bits of `bits` (bit `i % 64` of word `i / 64` is position `i`), in
/// order.
fn set_bits(bits: &[u64]) -> impl Iterator<Item = usize> + '_ {
    bits.iter().enumerate().flat_map(|(w, &word)| {
        let mut word = word;
        std::iter::from_fn(move || {
            (word != 0).then(|| {
                let bit = word.trailing_zeros() as usize;
                word &= word - 1;
                w * 64 + bit
            })
        })
    })
}

/// The runs of consecutive set bits of `bits` (bit `i % 64` of word `i / 64` is position `i`), as
/// ranges of positions in order; a run that crosses a word boundary comes as two. `words` says
/// which words of `bits` are not zero (as [`FreeDevices`] keeps it): only those are read.
fn free_runs<'a>(
    bits: &'a [u64],
    words: &'a [u64],
) -> impl Iterator<Item = std::ops::Range<usize>> + 'a {
    set_bits(words).flat_map(move |w| {
        let mut word = bits[w];
        std::iter::from_fn(move || {
            (word != 0).then(|| {
                let start = word.trailing_zeros() as usize;
                let len = (!(word >> start)).trailing_zeros() as usize;
                let ones = if len == 64 { u64::MAX } else { (1 << len) - 1 };
                word &= !(ones << start);
                w * 64 + start..w * 64 + start + len
            })
        })
    })
}

impl FreeDevices {
    /// The healthy devices of `devices` that `held` does not say are held.
    fn new(devices: DeviceSet, held: impl Fn(&str) -> bool) -> FreeDevices {
        let words = devices.capacity().div_ceil(64);
        let mut free = FreeDevices {
            bits: vec![0; words],
            words: vec![0; words.div_ceil(64)],
            devices,
            count: 0,
        };
        for (at, device) in free.devices.devices().enumerate() {
            if device.health == Health::Healthy && !held(device.id) {
                let w = at / 64;
                free.bits[w] |= 1 << (at % 64);
                free.words[w / 64] |= 1 << (w % 64);
                free.count += 1;
            }
        }
        free
    }

    fn is_set(&self, at: usize) -> bool {
        self.bits[at / 64] & (1 << (at % 64)) != 0
    }

    fn set(&mut self, at: usize) {
        let w = at / 64;
        self.bits[w] |= 1 << (at % 64);
        self.words[w / 64] |= 1 << (w % 64);
        self.count += 1;
    }

    fn clear(&mut self, at: usize) {
        let w = at / 64;
        self.bits[w] &= !(1 << (at % 64));
        if self.bits[w] == 0 {
            self.words[w / 64] &= !(1 << (w % 64));
        }
        self.count -= 1;
    }

    /// `id` is held now.
    fn take(&mut self, id: &str) {
        if let Some(at) = self.devices.position(id) {
            self.take_at(at);
        }
    }

    /// The device at `at` (a position in `devices`) is held now.
    fn take_at(&mut self, at: usize) {
        if self.is_set(at) {
            self.clear(at);
        }
    }

    /// No one holds `id` any more: free again if it is healthy.
    fn give_back(&mut self, id: &str) {
        if let Some(at) = self.devices.position(id)
            && !self.is_set(at)
            && self
                .devices
                .at(at)
                .is_some_and(|d| d.health == Health::Healthy)
        {
            self.set(at);
        }
    }
}

/// Groups `devices` by NUMA node as the kubelet checkpoints them: a device on several nodes is
/// listed under each, a device without topology under `-1`.
pub fn group_by_numa<'a>(
    devices: impl IntoIterator<Item = (&'a str, &'a [i64])>,
) -> BTreeMap<i64, Vec<DeviceId>> {
    let mut out: BTreeMap<i64, Vec<DeviceId>> = BTreeMap::new();
    for (id, numa) in devices {
        if numa.is_empty() {
            out.entry(-1).or_default().push(DeviceId::from(id));
        }
        for node in numa {
            out.entry(*node).or_default().push(DeviceId::from(id));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::ListedDevice;

    fn key(pod: &str, container: &str) -> HolderKey {
        HolderKey {
            pod_uid: pod.into(),
            container: container.into(),
            resource: "vendor.com/gpu".into(),
        }
    }

    fn reserved(ids: &[&str], token: u64) -> Holding {
        Holding {
            devices: ids
                .iter()
                .map(|&s| DeviceId::from(s))
                .collect::<Vec<_>>()
                .into(),
            numa: Default::default(),
            state: HoldingState::Reserved { token },
            pod: None,
        }
    }

    /// `n` healthy devices without topology, `d0` to `d<n - 1>`.
    fn healthy(n: usize) -> DeviceSet {
        DeviceSet::new(
            (0..n)
                .map(|i| ListedDevice {
                    id: DeviceId::from(format!("d{i}").as_str()),
                    health: Health::Healthy,
                    numa: Vec::new(),
                })
                .collect(),
        )
    }

    /// The free devices of `vendor.com/gpu` among `set` as the allocator lists them, and how
    /// many the view says they are.
    fn free_listed(pods: &mut PodDevices, set: &DeviceSet) -> (usize, Vec<String>) {
        let gpu = ResourceName::from("vendor.com/gpu");
        let (count, runs) = pods.free_devices(&gpu, set);
        let mut candidates = pluglet_handler_runtime::Candidates::with_capacity(0, 0);
        for run in runs {
            candidates.extend_from_columns(run);
        }
        let ids = candidates.iter().map(|(id, _)| id.to_owned()).collect();
        (count, ids)
    }

    /// The free devices of `vendor.com/gpu` among `set`, checked against their count.
    fn free_ids(pods: &mut PodDevices, set: &DeviceSet) -> Vec<String> {
        let (count, ids) = free_listed(pods, set);
        assert_eq!(count, ids.len());
        ids
    }

    #[test]
    fn adopting_a_copy_s_changes_keeps_what_is_held_and_free_right() {
        let set = healthy(4);
        let free = |pods: &mut PodDevices| free_ids(pods, &set);
        let mut pods = PodDevices::default();
        pods.insert(key("p", "c"), reserved(&["d0", "d1"], 7));
        assert_eq!(free(&mut pods), ["d2", "d3"]);

        // A reservation committed on a copy: the same devices, now allocated.
        let mut copy = pods.without_index();
        assert!(copy.commit(&key("p", "c"), 7, PluginAnswer::default()));
        pods.adopt(&copy.take_changes());
        assert!(matches!(
            pods.get(&key("p", "c")).unwrap().state,
            HoldingState::Allocated { .. }
        ));
        assert_eq!(pods.held_count("vendor.com/gpu"), 2);
        assert_eq!(free(&mut pods), ["d2", "d3"]);

        // Other devices for the same key: the old ones are free again, the new ones held.
        let mut copy = pods.without_index();
        copy.insert(key("p", "c"), reserved(&["d1", "d3"], 8));
        pods.adopt(&copy.take_changes());
        assert!(!pods.is_held("vendor.com/gpu", "d0"));
        assert!(pods.is_held("vendor.com/gpu", "d1"));
        assert!(pods.is_held("vendor.com/gpu", "d3"));
        assert_eq!(free(&mut pods), ["d0", "d2"]);

        // Released on a copy: nothing held.
        let mut copy = pods.without_index();
        copy.release("p", None);
        pods.adopt(&copy.take_changes());
        assert_eq!(pods.held_count("vendor.com/gpu"), 0);
        assert_eq!(free(&mut pods), ["d0", "d1", "d2", "d3"]);
    }

    #[test]
    fn a_copy_s_changes_name_each_key_once_with_its_entry_before_them_and_after() {
        let mut pods = PodDevices::default();
        pods.insert(key("p", "c"), reserved(&["d0"], 1));
        let mut copy = pods.without_index();
        assert!(copy.commit(&key("p", "c"), 1, PluginAnswer::default()));
        copy.insert(key("q", "c"), reserved(&["d1"], 2));
        assert!(copy.commit(&key("q", "c"), 2, PluginAnswer::default()));
        copy.insert(key("r", "c"), reserved(&["d2"], 3));
        copy.release_keys(vec![key("p", "c"), key("r", "c")]);

        let changes = copy.take_changes();
        let shown: Vec<_> = changes
            .iter()
            .map(|c| {
                let state = |kept: &Option<Arc<Kept>>| {
                    kept.as_ref().map(|k| match k.entry.state {
                        HoldingState::Reserved { token } => format!("reserved {token}"),
                        HoldingState::Allocated { .. } => "allocated".to_owned(),
                    })
                };
                (c.key().pod_uid.to_string(), state(&c.old), state(&c.kept))
            })
            .collect();
        assert_eq!(
            shown,
            [
                ("p".into(), Some("reserved 1".into()), None),
                ("q".into(), None, Some("allocated".into())),
                ("r".into(), None, None),
            ]
        );
        // What the copy holds now, as the changes say.
        for change in &changes {
            assert_eq!(
                copy.get(change.key()),
                change.kept.as_ref().map(|k| &k.entry)
            );
        }
        assert!(copy.take_changes().is_empty(), "taken once");
    }

    #[test]
    fn the_free_view_takes_devices_by_position_in_its_generation_and_by_id_otherwise() {
        let device = |id: &str| ListedDevice {
            id: id.into(),
            health: Health::Healthy,
            numa: Vec::new(),
        };
        let set = healthy(4);
        let mut pods = PodDevices::default();
        assert_eq!(free_ids(&mut pods, &set).len(), 4);
        pods.insert_found(
            Arc::new(key("p", "c")),
            reserved(&["d2", "d0"], 1),
            &Positions::new(&set, vec![2, 0]),
        );
        assert_eq!(free_ids(&mut pods, &set), ["d1", "d3"]);

        // Positions of another set (the devices listed again, in another order): by id.
        let other = DeviceSet::new(["d3", "d1"].map(device).into());
        pods.insert_found(
            Arc::new(key("q", "c")),
            reserved(&["d1"], 2),
            &Positions::new(&other, vec![1]),
        );
        assert!(pods.is_held("vendor.com/gpu", "d1"));
        assert_eq!(free_ids(&mut pods, &set), ["d3"]);
    }

    #[test]
    fn free_runs_are_the_set_bits_in_order() {
        let bits = [0b1011_0110, u64::MAX, 1 << 63, 0, 1];
        let runs: Vec<_> = free_runs(&bits, &[0b10111]).collect();
        assert_eq!(
            runs,
            [1..3, 4..6, 7..8, 64..128, 191..192, 256..257],
            "a run that crosses a word boundary comes as two"
        );
        let runs: Vec<_> = free_runs(&bits, &[0b10001]).collect();
        assert_eq!(
            runs,
            [1..3, 4..6, 7..8, 256..257],
            "only the words said to be set"
        );
    }

    #[test]
    fn a_full_resource_lists_its_few_free_devices_across_summary_words() {
        let set = healthy(10_000);
        let listed = |pods: &mut PodDevices| free_ids(pods, &set);
        let mut pods = PodDevices::default();
        assert_eq!(listed(&mut pods).len(), 10_000);
        let free = [0, 4095, 4096, 4160, 9999];
        let held: Vec<String> = (0..10_000)
            .filter(|i| !free.contains(i))
            .map(|i| format!("d{i}"))
            .collect();
        let held: Vec<&str> = held.iter().map(String::as_str).collect();
        pods.insert(key("p", "c"), reserved(&held, 1));
        assert_eq!(
            listed(&mut pods),
            ["d0", "d4095", "d4096", "d4160", "d9999"]
        );
        // Given back: listed again, in plugin order.
        pods.release("p", None);
        pods.insert(key("q", "c"), reserved(&["d1", "d5000"], 2));
        let listed = listed(&mut pods);
        assert_eq!(listed.len(), 9_998);
        assert!(!listed.iter().any(|id| id == "d1" || id == "d5000"));
    }

    #[test]
    fn free_devices_are_the_healthy_devices_not_held_in_plugin_order() {
        let devices: Vec<ListedDevice> = (0..150)
            .map(|i| ListedDevice {
                id: DeviceId::from(format!("d{i}").as_str()),
                health: if i % 7 == 3 {
                    Health::Unhealthy
                } else {
                    Health::Healthy
                },
                numa: (0..i % 3).map(|n| n as i64).collect(),
            })
            .collect();
        let set = DeviceSet::new(devices.clone());
        let mut pods = PodDevices::default();
        pods.insert(
            key("p", "c"),
            reserved(&["d0", "d63", "d64", "d100", "d149"], 1),
        );
        let gpu = ResourceName::from("vendor.com/gpu");
        let (count, runs) = pods.free_devices(&gpu, &set);
        let mut candidates = pluglet_handler_runtime::Candidates::with_capacity(0, 0);
        for run in runs {
            candidates.extend_from_columns(run);
        }
        let expected: Vec<(&str, &[i64])> = devices
            .iter()
            .filter(|d| d.health == Health::Healthy)
            .filter(|d| !["d0", "d63", "d64", "d100", "d149"].contains(&d.id.as_str()))
            .map(|d| (d.id.as_str(), d.numa.as_slice()))
            .collect();
        assert_eq!(count, expected.len());
        assert_eq!(candidates.iter().collect::<Vec<_>>(), expected);
    }

    #[test]
    fn reserve_commit_release_returns_devices() {
        let mut pods = PodDevices::default();
        pods.insert(key("p", "c"), reserved(&["d0", "d1"], 7));
        assert!(pods.is_held("vendor.com/gpu", "d0"));
        assert!(!pods.commit(&key("p", "c"), 8, Default::default()));
        assert!(pods.commit(&key("p", "c"), 7, Default::default()));
        assert!(
            !pods.cancel(&key("p", "c"), 7),
            "allocated entries are not cancelled"
        );
        assert_eq!(pods.held_count("vendor.com/gpu"), 2);
        assert_eq!(pods.release("p", None), [key("p", "c")]);
        assert!(!pods.is_held("vendor.com/gpu", "d0"));
        assert!(pods.is_empty());
    }

    #[test]
    fn release_of_one_container_keeps_the_others() {
        let mut pods = PodDevices::default();
        pods.insert(key("p", "a"), reserved(&["d0"], 1));
        pods.insert(key("p", "b"), reserved(&["d1"], 2));
        pods.insert(key("q", "a"), reserved(&["d2"], 3));
        assert_eq!(pods.release("p", Some("b")), [key("p", "b")]);
        assert_eq!(pods.len(), 2);
        assert!(pods.is_held("vendor.com/gpu", "d0"));
        assert!(!pods.is_held("vendor.com/gpu", "d1"));
    }

    fn allocated(ids: &[&str]) -> Holding {
        Holding {
            state: HoldingState::Allocated {
                answer: PluginAnswer::default(),
            },
            ..reserved(ids, 0)
        }
    }

    /// Releases, as one change, every entry `gone` selects: the reference a walk is held to.
    fn release_where(
        pods: &mut PodDevices,
        gone: impl Fn(&HolderKey) -> bool,
    ) -> Vec<(HolderKey, Holding)> {
        let keys = pods
            .iter()
            .map(|(k, _)| k.clone())
            .filter(|k| gone(k))
            .collect();
        pods.release_keys(keys)
    }

    /// Releases, as one change, every entry of a pod not in `keep`, as a sync of pods does.
    fn release_not_kept(pods: &mut PodDevices, keep: &KeepList) -> Vec<(HolderKey, Holding)> {
        let keys = pods.not_kept(keep);
        pods.release_keys(keys)
    }

    #[test]
    fn release_where_frees_every_pod_not_kept_in_one_change() {
        let mut pods = PodDevices::default();
        pods.insert(key("keep", "a"), allocated(&["d0"]));
        pods.insert(key("gone", "a"), allocated(&["d1"]));
        pods.insert(key("gone", "b"), allocated(&["d2"]));
        pods.insert(key("starting", "a"), reserved(&["d3"], 9));
        let nic = HolderKey {
            resource: "vendor.com/nic".into(),
            ..key("gone", "a")
        };
        pods.insert(nic.clone(), allocated(&["n0"]));
        let keep = KeepList::from_iter(["keep", "not-holding-anything"]);

        let mut walked = pods.clone();
        let before = pods.version();
        let removed = release_where(&mut pods, |k| !keep.contains(k.pod_uid.as_str()));
        assert_eq!(
            release_not_kept(&mut walked, &keep),
            removed,
            "walking side by side frees the same"
        );
        assert_eq!(pods.version(), before + 1, "one change");
        let keys: Vec<HolderKey> = removed.iter().map(|(k, _)| k.clone()).collect();
        assert_eq!(
            keys,
            [
                key("gone", "a"),
                nic,
                key("gone", "b"),
                key("starting", "a")
            ]
        );
        assert_eq!(removed[3].1.state, HoldingState::Reserved { token: 9 });
        assert!(
            !pods.commit(&key("starting", "a"), 9, Default::default()),
            "a released reservation cannot commit"
        );
        for id in ["d1", "d2", "d3"] {
            assert!(!pods.is_held("vendor.com/gpu", id), "{id} still held");
        }
        assert_eq!(pods.held_count("vendor.com/nic"), 0);
        assert!(pods.is_held("vendor.com/gpu", "d0"));
        assert_eq!(pods.len(), 1);

        let version = pods.version();
        assert!(release_where(&mut pods, |k| !keep.contains(k.pod_uid.as_str())).is_empty());
        assert_eq!(pods.version(), version, "nothing to free changes nothing");
        assert_eq!(release_where(&mut pods, |_| true).len(), 1);
        assert!(pods.is_empty());
    }

    #[test]
    fn release_not_kept_jumps_over_long_runs_of_kept_pods() {
        let keep: KeepList = (0..100).map(|i| format!("k{i:03}")).collect();
        let mut pods = PodDevices::default();
        for (i, pod) in ["a", "k005", "k050", "k050x", "k099", "z"]
            .iter()
            .enumerate()
        {
            pods.insert(key(pod, "c"), allocated(&[&format!("d{i}")]));
        }
        let freed: Vec<String> = release_not_kept(&mut pods, &keep)
            .into_iter()
            .map(|(k, _)| k.pod_uid.to_string())
            .collect();
        assert_eq!(freed, ["a", "k050x", "z"]);
        assert_eq!(pods.len(), 3);
    }

    proptest::proptest! {
        /// The side-by-side walk finds exactly the entries whose pod is not kept: pods with
        /// several entries, runs of kept pods longer than the steps before a jump, kept pods
        /// holding nothing.
        #[test]
        fn not_kept_is_every_entry_of_a_pod_not_kept(
            held in proptest::collection::vec((0u8..60, 0u8..3), 0..80),
            keep in proptest::collection::btree_set(0u8..70, 0..70),
        ) {
            // Every third pod's UID too long to be kept in place in the index of held pods.
            let uid = |pod: u8| match pod % 3 {
                0 => format!("p{pod:02}-{}", "long".repeat(10)),
                _ => format!("p{pod:02}"),
            };
            let mut pods = PodDevices::default();
            for (i, (pod, container)) in held.iter().enumerate() {
                pods.insert(
                    key(&uid(*pod), &format!("c{container}")),
                    allocated(&[&format!("d{i}")]),
                );
            }
            let keep: KeepList = keep.iter().map(|p| uid(*p)).collect();
            let expected: Vec<HolderKey> = pods
                .iter()
                .map(|(k, _)| k.clone())
                .filter(|k| !keep.contains(k.pod_uid.as_str()))
                .collect();
            proptest::prop_assert_eq!(pods.not_kept(&keep), expected.clone());
            // A copy has no index of held pods: it walks its entries, and finds the same.
            proptest::prop_assert_eq!(pods.without_index().not_kept(&keep), expected);
        }

        /// Whatever changes a copy makes (the changes waiting for the disk), the pods it holds
        /// that are not kept are found by the state's index and the keys the changes touched
        /// as a walk of the copy's own entries finds them; and the state's index counts its
        /// entries per pod through every change, made on it or adopted from a copy.
        #[test]
        fn the_index_of_held_pods_follows_every_change(
            changes in proptest::collection::vec((0u8..4, 0u8..40, 0u8..3), 0..60),
            waiting in proptest::collection::vec((0u8..4, 0u8..40, 0u8..3), 0..20),
            keep in proptest::collection::btree_set(0u8..45, 0..45),
        ) {
            let uid = |pod: u8| match pod % 3 {
                0 => format!("p{pod:02}-{}", "long".repeat(10)),
                _ => format!("p{pod:02}"),
            };
            // 0: insert, 1: release the pod, 2: release one container, 3: insert on a copy
            // adopted by the state (as the journal writer applies a change).
            let change = |pods: &mut PodDevices, (op, pod, container): (u8, u8, u8), i: usize| {
                let k = key(&uid(pod), &format!("c{container}"));
                match op {
                    0 => pods.insert(k, allocated(&[&format!("d{i}")])),
                    1 => {
                        pods.release(&uid(pod), None);
                    }
                    2 => pods.release_key(&k),
                    _ => {
                        let mut copy = pods.without_index();
                        copy.insert(k, allocated(&[&format!("e{i}")]));
                        pods.adopt(&copy.take_changes());
                    }
                }
            };
            let mut pods = PodDevices::default();
            for (i, c) in changes.iter().enumerate() {
                change(&mut pods, *c, i);
                let mut counted: BTreeMap<String, u32> = BTreeMap::new();
                for (k, _) in pods.iter() {
                    *counted.entry(k.pod_uid.to_string()).or_default() += 1;
                }
                let index = held_pods(&pods);
                proptest::prop_assert_eq!(index, counted);
            }
            let mut copy = pods.without_index();
            for (i, c) in waiting.iter().enumerate() {
                change(&mut copy, *c, 1000 + i);
            }
            let waiting = copy.take_changes();
            let keep: KeepList = keep.iter().map(|p| uid(*p)).collect();
            proptest::prop_assert_eq!(
                copy.not_kept_beside(&pods, &waiting, &keep),
                copy.not_kept(&keep)
            );
        }
    }

    /// The state's index of held pods: each pod's UID and its number of entries.
    fn held_pods(pods: &PodDevices) -> BTreeMap<String, u32> {
        pods.pods
            .as_ref()
            .expect("the state keeps the index")
            .by_uid
            .iter()
            .map(|(pod, n)| (pod.uid().to_string(), *n))
            .collect()
    }

    /// What the state shows: every entry, what is held of the resource (and how often), the
    /// free view and the index of held pods.
    fn shown(pods: &mut PodDevices, set: &DeviceSet) -> impl std::fmt::Debug + PartialEq {
        let entries: Vec<(HolderKey, Holding)> =
            pods.iter().map(|(k, h)| (k.clone(), h.clone())).collect();
        let held: BTreeMap<String, u32> = pods
            .held
            .get("vendor.com/gpu")
            .map(|h| h.iter().map(|(id, n)| (id.to_string(), *n)).collect())
            .unwrap_or_default();
        let index = held_pods(pods);
        let (count, free) = free_listed(pods, set);
        (entries, held, index, count, free)
    }

    proptest::proptest! {
        /// A change made on a copy of the state, adopted with the copy's map taken whole (the
        /// state unchanged since the copy), leaves the state as adopting it key by key does:
        /// the same entries, devices held, free view and index of held pods.
        #[test]
        fn adopting_a_copy_whole_is_adopting_it_key_by_key(
            before in proptest::collection::vec((0u8..6, 0u8..3, 0u8..16), 0..12),
            change in proptest::collection::vec((0u8..4, 0u8..6, 0u8..3, 0u8..16), 1..6),
        ) {
            let device = |i: u8| ListedDevice {
                id: format!("d{i}").as_str().into(),
                health: Health::Healthy,
                numa: Vec::new(),
            };
            let set = DeviceSet::new((0..16).map(device).collect::<Vec<_>>());
            let mut state = PodDevices::default();
            for (pod, container, d) in &before {
                let k = key(&format!("p{pod}"), &format!("c{container}"));
                if state.get(&k).is_none() {
                    state.insert(k, reserved(&[&format!("d{d}")], u64::from(*d)));
                }
            }
            shown(&mut state, &set);
            let base = state.version();
            let mut copy = state.without_index();
            // 0: insert (or replace), 1: commit a reservation, 2: release a container,
            // 3: release a pod.
            for (op, pod, container, d) in &change {
                let k = key(&format!("p{pod}"), &format!("c{container}"));
                match op {
                    0 => copy.insert(k, reserved(&[&format!("d{d}")], 100)),
                    1 => {
                        let token = match copy.get(&k).map(|h| &h.state) {
                            Some(HoldingState::Reserved { token }) => *token,
                            _ => u64::from(*d),
                        };
                        copy.commit(&k, token, PluginAnswer::default());
                    }
                    2 => copy.release_key(&k),
                    _ => {
                        copy.release(&format!("p{pod}"), None);
                    }
                }
            }
            let changes = copy.take_changes();
            let mut by_key = state.clone();
            by_key.adopt(&changes);
            let mut whole = state.clone();
            whole.adopt_copy(&copy, Some(base), &changes);
            proptest::prop_assert_eq!(shown(&mut whole, &set), shown(&mut by_key, &set));
            proptest::prop_assert_eq!(whole.version(), by_key.version());
            // A state changed since the copy was made adopts key by key.
            let mut moved = state.clone();
            moved.insert(key("other", "c"), reserved(&["d15"], 7));
            let mut expected = moved.clone();
            expected.adopt(&changes);
            moved.adopt_copy(&copy, Some(base), &changes);
            proptest::prop_assert_eq!(shown(&mut moved, &set), shown(&mut expected, &set));
        }
    }

    #[test]
    fn a_pod_s_name_and_an_entry_are_found_together() {
        let named = |ids: &[&str]| Holding {
            pod: Some(PodName {
                name: "web-0".into(),
                namespace: "default".into(),
            }),
            ..reserved(ids, 1)
        };
        let mut pods = PodDevices::default();
        pods.insert(key("a", "c"), reserved(&["d0"], 1));
        pods.insert(key("p", "b"), reserved(&["d1"], 2));
        pods.insert(key("p", "c"), named(&["d2"]));
        pods.insert(key("q", "c"), named(&["d3"]));
        let (name, entry) = pods.pod_name_and_entry(&key("p", "b"));
        assert_eq!(name.map(|n| n.name.as_str()), Some("web-0"));
        assert_eq!(entry.map(|e| &*e.devices), Some(&["d1".into()][..]));
        let (name, entry) = pods.pod_name_and_entry(&key("p", "x"));
        assert_eq!(name.map(|n| n.name.as_str()), Some("web-0"));
        assert!(entry.is_none());
        let (name, entry) = pods.pod_name_and_entry(&key("a", "c"));
        assert!(name.is_none());
        assert!(entry.is_some());
        assert_eq!(pods.pod_name_and_entry(&key("new", "c")), (None, None));
    }

    #[test]
    fn an_index_key_keeps_a_pod_uid_in_place_up_to_its_capacity() {
        let fits = "u".repeat(InlineUid::CAPACITY);
        let long = "u".repeat(InlineUid::CAPACITY + 1);
        assert_eq!(
            InlineUid::new(&fits).as_ref().map(InlineUid::bytes),
            Some(fits.as_bytes())
        );
        assert_eq!(
            InlineUid::new("").as_ref().map(InlineUid::bytes),
            Some(&b""[..])
        );
        assert!(InlineUid::new(&long).is_none());
        assert_eq!(PodKey::new(&fits).bytes(), fits.as_bytes());
        assert_eq!(PodKey::new(&long).bytes(), long.as_bytes());
        assert_eq!(PodKey::new(&long).uid(), PodUid::from(long.as_str()));
    }

    #[test]
    fn a_copy_without_index_changes_its_entries_as_the_state_does() {
        let mut pods = PodDevices::default();
        pods.insert(key("p", "c"), reserved(&["d0", "d1"], 7));
        pods.insert(key("q", "c"), allocated(&["d2"]));
        let mut copy = pods.without_index();
        assert!(!copy.is_held("vendor.com/gpu", "d0"));
        for p in [&mut pods, &mut copy] {
            assert!(p.commit(&key("p", "c"), 7, Default::default()));
            p.insert(key("r", "c"), reserved(&["d3"], 8));
            assert_eq!(p.release("q", None), vec![key("q", "c")]);
        }
        assert_eq!(copy.version(), pods.version());
        assert!(copy.iter().eq(pods.iter()));
        assert_eq!(copy.held_count("vendor.com/gpu"), 0);
        assert_eq!(pods.held_count("vendor.com/gpu"), 3);
    }

    #[test]
    fn cancel_frees_a_reservation() {
        let mut pods = PodDevices::default();
        pods.insert(key("p", "c"), reserved(&["d0"], 1));
        assert!(pods.cancel(&key("p", "c"), 1));
        assert_eq!(pods.held_count("vendor.com/gpu"), 0);
    }

    #[test]
    fn numa_grouping_follows_the_kubelet() {
        let grouped = group_by_numa([("a", &[0][..]), ("b", &[0, 1][..]), ("c", &[][..])]);
        assert_eq!(
            grouped,
            BTreeMap::from([
                (-1, vec![DeviceId::from("c")]),
                (0, vec![DeviceId::from("a"), DeviceId::from("b")]),
                (1, vec![DeviceId::from("b")]),
            ])
        );
    }
}
