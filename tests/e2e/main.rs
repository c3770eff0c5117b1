//! End-to-end tests: the real `pluglet run` binary on a temporary root, the example plugins as
//! separate processes, and `pluglet ctl` to observe. One module per user story; shared harness in
//! `support/`. Build the binaries first: `cargo build --workspace --bins && cargo test --workspace`.

mod support;

mod daemon_lifecycle;
mod isolation;
mod refusal;
mod registration;

mod compile_cache;
mod device_authority;
mod device_property;
mod device_restart;
mod device_support;
mod devices;
mod handler_swap;
mod sync_pods;
