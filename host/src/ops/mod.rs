//! What an operator watches the daemon by: its health and readiness ([`health`]).
pub mod health;
