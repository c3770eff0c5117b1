//! systemd's service notifications (`Type=notify`), through the `sd-notify` crate: `READY=1`
//! once the daemon is ready, `WATCHDOG=1` every half `WATCHDOG_USEC` while every stage runs,
//! `STOPPING=1` when it stops. Without `NOTIFY_SOCKET` (not started by systemd) nothing is sent.

use std::time::Duration;

use sd_notify::NotifyState;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::health::Health;

/// Sends `READY=1` when `health` turns ready, then keeps the watchdog fed while the daemon is
/// live, until `cancel` fires.
pub async fn run(health: Health, cancel: CancellationToken) {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return;
    }
    let mut ready = health.subscribe_ready();
    tokio::select! {
        _ = cancel.cancelled() => return,
        result = ready.wait_for(|ready| *ready) => if result.is_err() { return },
    }
    send(&[NotifyState::Ready, NotifyState::Status("ready")]);
    info!("told systemd the daemon is ready");
    let Some(timeout) = sd_notify::watchdog_enabled() else {
        return;
    };
    let period = (timeout / 2).max(Duration::from_millis(10));
    info!(period = ?period, "feeding the systemd watchdog");
    let mut ticks = tokio::time::interval(period);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = ticks.tick() => {}
        }
        if health.is_live() {
            send(&[NotifyState::Watchdog]);
        }
    }
}

/// Sends `STOPPING=1`.
pub fn stopping() {
    if std::env::var_os("NOTIFY_SOCKET").is_some() {
        send(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
    }
}

fn send(states: &[NotifyState]) {
    if let Err(err) = sd_notify::notify(states) {
        warn!(%err, "cannot notify systemd (NOTIFY_SOCKET)");
    }
}
