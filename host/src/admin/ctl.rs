//! `pluglet ctl`: asks a running daemon over its admin socket and prints a table or JSON (wire
//! strings such as `CSIPlugin`, snake_case keys). Errors go to stderr with a non-zero exit (the
//! caller, `main.rs`, prints them).

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Context as _;
use pluglet_proto::admin::v1 as pb;
use pluglet_proto::admin::v1::admin_client::AdminClient;
use pluglet_uds::Channel;
use serde_json::{Value, json};

use crate::cli::{CtlArgs, CtlCommand, OutputFormat};
use crate::config::{ADMIN_SOCKET_NAME, DEFAULT_ADMIN_SOCKET};

/// The admin socket `ctl` talks to: `--admin-socket`, else `--root`/pluglet.sock, else the default.
pub fn admin_socket(args: &CtlArgs) -> PathBuf {
    match (&args.admin_socket, &args.root) {
        (Some(p), _) => p.clone(),
        (None, Some(root)) => root.join(ADMIN_SOCKET_NAME),
        (None, None) => PathBuf::from(DEFAULT_ADMIN_SOCKET),
    }
}

/// Runs one `pluglet ctl` command, printing to stdout.
pub async fn run(args: CtlArgs) -> anyhow::Result<()> {
    let socket = admin_socket(&args);
    if !socket.exists() {
        anyhow::bail!(
            "no admin socket at {} (is `pluglet run` running? pass --root or --admin-socket)",
            socket.display()
        );
    }
    let channel = pluglet_uds::connect(&socket, args.timeout)
        .await
        .with_context(|| {
            format!(
                "cannot reach the pluglet daemon at {} (is `pluglet run` running?)",
                socket.display()
            )
        })?;
    let mut client = AdminClient::new(channel);
    let out = render(&mut client, &args.command, args.output).await?;
    print!("{out}");
    Ok(())
}

async fn render(
    client: &mut AdminClient<Channel>,
    command: &CtlCommand,
    output: OutputFormat,
) -> anyhow::Result<String> {
    Ok(match command {
        CtlCommand::Plugins => {
            let plugins = client
                .list_plugins(pb::ListPluginsRequest {})
                .await
                .context("ListPlugins failed")?
                .into_inner()
                .plugins;
            match output {
                OutputFormat::Json => to_json(plugins.iter().map(plugin_json).collect()),
                OutputFormat::Table => plugins_table(&plugins),
            }
        }
        CtlCommand::Sockets => {
            let sockets = client
                .list_sockets(pb::ListSocketsRequest {})
                .await
                .context("ListSockets failed")?
                .into_inner()
                .sockets;
            match output {
                OutputFormat::Json => to_json(sockets.iter().map(socket_json).collect()),
                OutputFormat::Table => sockets_table(&sockets),
            }
        }
        CtlCommand::Handlers => {
            let handlers = client
                .list_handlers(pb::ListHandlersRequest {})
                .await
                .context("ListHandlers failed")?
                .into_inner()
                .handlers;
            match output {
                OutputFormat::Json => to_json(handlers.iter().map(handler_json).collect()),
                OutputFormat::Table => handlers_table(&handlers),
            }
        }
        CtlCommand::Resources
        | CtlCommand::Allocate { .. }
        | CtlCommand::Release { .. }
        | CtlCommand::Allocations => crate::admin::devices::render(client, command, output).await?,
    })
}

fn to_json(items: Vec<Value>) -> String {
    let mut s =
        serde_json::to_string_pretty(&Value::Array(items)).unwrap_or_else(|_| "[]".to_owned());
    s.push('\n');
    s
}

fn opt(s: &str) -> Value {
    if s.is_empty() {
        Value::Null
    } else {
        Value::String(s.to_owned())
    }
}

/// JSON object of a registered plugin (`ctl plugins -o json`); CSI facts are flat keys.
pub fn plugin_json(p: &pb::Plugin) -> Value {
    let mut v = json!({
        "name": p.name,
        "type": p.r#type,
        "endpoint": p.endpoint,
        "versions": p.versions,
        "version": opt(&p.version),
        "handler": p.handler,
        "registered_at": p.registered_at,
        "socket_path": p.socket_path,
    });
    if let (Some(csi), Value::Object(map)) = (&p.csi, &mut v) {
        let topology: serde_json::Map<String, Value> = csi
            .topology
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect::<std::collections::BTreeMap<_, _>>()
            .into_iter()
            .collect();
        map.insert("node_id".into(), json!(csi.node_id));
        map.insert(
            "max_volumes_per_node".into(),
            json!(csi.max_volumes_per_node),
        );
        map.insert("topology".into(), Value::Object(topology));
    }
    v
}

/// JSON object of a socket status (`ctl sockets -o json`).
pub fn socket_json(s: &pb::SocketStatus) -> Value {
    json!({
        "path": s.path,
        "state": s.state,
        "attempts": s.attempts,
        "last_error": opt(&s.last_error),
        "plugin_type": opt(&s.plugin_type),
        "plugin_name": opt(&s.plugin_name),
        "next_retry_ms": s.next_retry_ms,
    })
}

/// JSON object of a handler entry (`ctl handlers -o json`).
pub fn handler_json(h: &pb::HandlerInfo) -> Value {
    json!({
        "plugin_type": opt(&h.plugin_type),
        "resource": opt(&h.resource),
        "module": h.module,
        "sha256": h.sha256,
        "contract_version": h.contract_version,
        "families": h.families,
    })
}

/// Left-aligned columns separated by two spaces.
fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<&str>| {
        let last = cells.len() - 1;
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i == last {
                let _ = write!(out, "{cell}");
            } else {
                let _ = write!(out, "{cell:<w$}  ");
            }
        }
        out.push('\n');
    };
    line(header.to_vec());
    for row in &rows {
        line(row.iter().map(String::as_str).collect());
    }
    out
}

fn dash(s: &str) -> String {
    if s.is_empty() {
        "-".to_owned()
    } else {
        s.to_owned()
    }
}

fn plugins_table(plugins: &[pb::Plugin]) -> String {
    let rows = plugins
        .iter()
        .map(|p| {
            let node = p.csi.as_ref().map_or("-".to_owned(), |c| dash(&c.node_id));
            vec![
                p.name.clone(),
                p.r#type.clone(),
                dash(&p.version),
                node,
                p.endpoint.clone(),
                p.handler.clone(),
                p.registered_at.clone(),
            ]
        })
        .collect();
    table(
        &[
            "NAME",
            "TYPE",
            "VERSION",
            "NODE ID",
            "ENDPOINT",
            "HANDLER",
            "REGISTERED AT",
        ],
        rows,
    )
}

fn sockets_table(sockets: &[pb::SocketStatus]) -> String {
    let rows = sockets
        .iter()
        .map(|s| {
            vec![
                s.path.clone(),
                s.state.clone(),
                s.attempts.to_string(),
                dash(&s.plugin_type),
                dash(&s.plugin_name),
                dash(&s.last_error),
            ]
        })
        .collect();
    table(
        &["PATH", "STATE", "ATTEMPTS", "TYPE", "NAME", "LAST ERROR"],
        rows,
    )
}

fn handlers_table(handlers: &[pb::HandlerInfo]) -> String {
    let rows = handlers
        .iter()
        .map(|h| {
            let key = match (h.plugin_type.as_str(), h.resource.as_str()) {
                ("", "") => "(default policy)".to_owned(),
                ("", r) => format!("resource {r}"),
                (t, _) => t.to_owned(),
            };
            vec![
                key,
                h.module.clone(),
                h.contract_version.clone(),
                h.families.join(","),
                h.sha256.chars().take(12).collect(),
            ]
        })
        .collect();
    table(&["FOR", "MODULE", "CONTRACT", "FAMILIES", "SHA256"], rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn csi_plugin() -> pb::Plugin {
        pb::Plugin {
            name: "hostpath.csi.k8s.io".into(),
            r#type: "CSIPlugin".into(),
            endpoint: "/r/csi.sock".into(),
            versions: vec!["1.0.0".into()],
            version: "1.0.0".into(),
            handler: "builtin:csi".into(),
            registered_at: "2026-11-29T16:00:00.000Z".into(),
            socket_path: "/r/plugins_registry/reg.sock".into(),
            csi: Some(pb::CsiNodeInfo {
                node_id: "node-1".into(),
                max_volumes_per_node: 16,
                topology: [("topology.kubernetes.io/zone".to_owned(), "z1".to_owned())].into(),
            }),
        }
    }

    #[test]
    fn plugin_json_has_flat_csi_keys_and_wire_strings() {
        let v = plugin_json(&csi_plugin());
        assert_eq!(v["type"], "CSIPlugin");
        assert_eq!(v["node_id"], "node-1");
        assert_eq!(v["max_volumes_per_node"], 16);
        assert_eq!(v["topology"]["topology.kubernetes.io/zone"], "z1");
        assert_eq!(v["versions"], json!(["1.0.0"]));
        let mut dp = csi_plugin();
        dp.csi = None;
        dp.version = String::new();
        let v = plugin_json(&dp);
        assert!(v.get("node_id").is_none());
        assert_eq!(v["version"], Value::Null);
    }

    #[test]
    fn table_aligns_columns() {
        let t = table(&["A", "LONG"], vec![vec!["xyz".into(), "1".into()]]);
        assert_eq!(t, "A    LONG\nxyz  1\n");
    }

    #[test]
    fn admin_socket_follows_root() {
        use clap::Parser;
        let cli =
            crate::cli::Cli::try_parse_from(["pluglet", "ctl", "--root", "/r", "plugins"]).unwrap();
        let crate::cli::Command::Ctl(args) = cli.command else {
            panic!("not ctl")
        };
        assert_eq!(admin_socket(&args), PathBuf::from("/r/pluglet.sock"));
    }
}
