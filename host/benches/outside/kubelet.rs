//! The kubelet's figures for the same rows (kubelet v1.24 code, Python peers, 2-core VM), which
//! the table prints Pluglet's against.

/// The kubelet's figures, ms (p50, p99; one figure given as both).
pub const KUBELET_REGISTER: (f64, f64) = (7.77, 11.3);
pub const KUBELET_UPDATE_10K: (f64, f64) = (11.4, 16.8);
pub const KUBELET_FIRST_10K: (f64, f64) = (60.5, 60.5);
pub const KUBELET_ALLOC_1_OF_8: (f64, f64) = (1.30, 1.88);
pub const KUBELET_ALLOC_1_OF_1024: (f64, f64) = (1.46, 4.97);
pub const KUBELET_ALLOC_1024_OF_1024: (f64, f64) = (11.0, 15.6);
pub const KUBELET_RELEASE: (f64, f64) = (0.05, 0.07);
pub const KUBELET_ADMIN_RT: (f64, f64) = (0.09, 0.17);
pub const KUBELET_GETINFO_NOTIFY: (f64, f64) = (1.44, 5.03);
pub const KUBELET_SOCKET_NOTIFY: (f64, f64) = (522.0, 993.0);
/// The kubelet's resident memory, MB (device manager alone, one plugin of 8 devices).
pub const KUBELET_IDLE_RSS_MB: f64 = 31.9;
