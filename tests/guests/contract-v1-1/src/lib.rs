//! Test guest built against the 1.1.0 snapshot of the contract (guest-sdk/wit-history/1.1.0)
//! with plain wit-bindgen, allocation policy only: it has no `allocate-packed`, so a newer host
//! must call its `allocate` with the request of records.

#[cfg(target_arch = "wasm32")]
#[allow(missing_docs, unsafe_code, clippy::all)]
mod bindings {
    wit_bindgen::generate!({
        path: "../../../guest-sdk/wit-history/1.1.0",
        world: "allocation-handler",
    });

    use exports::pluglet::handler::allocation_policy::Guest;
    use pluglet::handler::types::{AllocationRequest, Refusal, RefusalKind};

    struct OldGuest;

    impl Guest for OldGuest {
        /// Last fit: the last `count` available devices, newest first.
        fn allocate(request: AllocationRequest) -> Result<Vec<String>, Refusal> {
            let count = request.count as usize;
            if request.available.len() < count {
                return Err(Refusal {
                    kind: RefusalKind::Unsatisfiable,
                    message: "too few devices".into(),
                });
            }
            Ok(request
                .available
                .iter()
                .rev()
                .take(count)
                .map(|d| format!("{}@{:?}", d.id, d.numa_nodes))
                .collect())
        }
    }

    export!(OldGuest);
}
