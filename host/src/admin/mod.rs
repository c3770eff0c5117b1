//! Pluglet's admin API: the gRPC server on the admin unix socket ([`server`], with the device
//! RPCs in [`devices`]) and the `pluglet ctl` client ([`ctl`]) that prints what it says through
//! one set of views ([`view`]). Messages are in `proto/admin.proto`.

pub mod ctl;
pub mod devices;
pub mod server;
pub mod view;
