//! Test guest that opens a TCP connection with `std::net` in a hook: it imports `wasi:sockets`,
//! so the host must refuse it at load.

use std::io::Write;

use pluglet_guest::{Accepted, PluginInfo, Refusal, RefusalKind, RegisteredPlugin, Registration};

/// The handler dialling out.
pub struct UsesTcp;

impl Registration for UsesTcp {
    fn validate(
        plugin: PluginInfo,
        _existing: Option<RegisteredPlugin>,
    ) -> Result<Accepted, Refusal> {
        let sent = std::net::TcpStream::connect(plugin.endpoint.as_str())
            .and_then(|mut stream| stream.write_all(plugin.name.as_bytes()));
        match sent {
            Ok(()) => Ok(Accepted { version: None }),
            Err(e) => Err(Refusal::new(RefusalKind::Other, e.to_string())),
        }
    }
}

pluglet_guest::export_handler!(UsesTcp: registration);
