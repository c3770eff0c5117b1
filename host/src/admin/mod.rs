//! Pluglet's admin API: the gRPC server on the admin unix socket ([`server`]) and the
//! `pluglet ctl` client that prints what it says ([`ctl`]). Messages are in `proto/admin.proto`.

pub mod ctl;
pub mod devices;
pub mod server;
