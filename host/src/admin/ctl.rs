//! `pluglet ctl`: asks a running daemon over its admin socket and prints what it answers as a
//! table or JSON, both rendered from the same views ([`crate::admin::view`]). Errors go to
//! stderr with a non-zero exit (the caller, `main.rs`, prints them; a [`UsageError`] exits 64).

use std::collections::BTreeSet;
use std::io::Read as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use pluglet_proto::admin::v1 as pb;
use pluglet_proto::admin::v1::admin_client::AdminClient;
use pluglet_uds::Channel;
use serde::Serialize;

use crate::admin::view::{
    self, AllocateResultView, AllocationView, EventView, HandlerRefreshView, HandlerRollbackView,
    HandlerView, HandlersView, Kind, Listed, PluginView, ReleaseResultView, ResourceView,
    SocketView, StatusView, SyncPodsView,
};
use crate::cli::{CtlArgs, CtlCommand, HandlersAction, OutputFormat, UsageError};
use crate::config::{ADMIN_SOCKET_NAME, DEFAULT_ADMIN_SOCKET};

/// The admin socket `ctl` talks to: `--admin-socket`, else `--root`/pluglet.sock, else the default.
pub fn admin_socket(args: &CtlArgs) -> PathBuf {
    match (&args.admin_socket, &args.root) {
        (Some(p), _) => p.clone(),
        (None, Some(root)) => root.join(ADMIN_SOCKET_NAME),
        (None, None) => PathBuf::from(DEFAULT_ADMIN_SOCKET),
    }
}

/// Runs one `pluglet ctl` command, printing to stdout. The command line is checked (and any
/// file it names read) before the daemon is asked anything.
pub async fn run(args: CtlArgs) -> anyhow::Result<()> {
    let request = Request::from_command(&args.command)?;
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
    if request == Request::WatchEvents {
        return watch_events(&mut client, args.output).await;
    }
    let out = request.send(&mut client, args.output).await?;
    print!("{out}");
    Ok(())
}

/// `ctl events --watch`: the recent events, then each new one as it happens, one line each
/// (with `-o json`, one JSON object per line), until interrupted or the daemon stops.
async fn watch_events(
    client: &mut AdminClient<Channel>,
    output: OutputFormat,
) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut stream = client
        .watch_events(pb::WatchEventsRequest {})
        .await
        .context("WatchEvents failed")?
        .into_inner();
    let mut stdout = std::io::stdout();
    if output == OutputFormat::Table {
        let header = view::columns(<EventView as view::Table>::HEADER, Vec::new());
        stdout.write_all(header.as_bytes())?;
        stdout.flush()?;
    }
    while let Some(event) = stream.message().await.context("the event stream failed")? {
        let event = EventView::from(&event);
        let line = match output {
            OutputFormat::Json => view::json_line_of(&event),
            OutputFormat::Table => event.line(),
        };
        stdout.write_all(line.as_bytes())?;
        stdout.flush()?;
    }
    anyhow::bail!("the daemon ended the event stream (it stopped)")
}

/// One admin call, built from the command line.
#[derive(Clone, Debug, PartialEq)]
enum Request {
    Status,
    Events,
    WatchEvents,
    Plugins,
    Sockets,
    Handlers,
    RollbackHandler(pb::RollbackHandlerRequest),
    RefreshHandlers(pb::RefreshHandlersRequest),
    Resources,
    Allocate(pb::AllocateRequest),
    Release(pb::ReleaseRequest),
    Allocations,
    SyncPods(pb::SyncPodsRequest),
}

impl Request {
    fn from_command(command: &CtlCommand) -> anyhow::Result<Request> {
        Ok(match command {
            CtlCommand::Status => Request::Status,
            CtlCommand::Events { watch: false } => Request::Events,
            CtlCommand::Events { watch: true } => Request::WatchEvents,
            CtlCommand::Plugins => Request::Plugins,
            CtlCommand::Sockets => Request::Sockets,
            CtlCommand::Handlers { action: None } => Request::Handlers,
            CtlCommand::Handlers {
                action:
                    Some(HandlersAction::Rollback {
                        plugin_type,
                        resource,
                    }),
            } => Request::RollbackHandler(pb::RollbackHandlerRequest {
                plugin_type: plugin_type.clone().unwrap_or_default(),
                resource: resource.clone().unwrap_or_default(),
            }),
            CtlCommand::Handlers {
                action:
                    Some(HandlersAction::Refresh {
                        plugin_type,
                        resource,
                    }),
            } => Request::RefreshHandlers(pb::RefreshHandlersRequest {
                plugin_type: plugin_type.clone().unwrap_or_default(),
                resource: resource.clone().unwrap_or_default(),
            }),
            CtlCommand::Resources => Request::Resources,
            CtlCommand::Allocate {
                pod,
                container,
                resource,
                count,
                pod_name,
                namespace,
            } => Request::Allocate(pb::AllocateRequest {
                pod_uid: pod.clone(),
                container: container.clone(),
                resource: resource.clone(),
                count: *count,
                pod_name: pod_name.clone().unwrap_or_default(),
                pod_namespace: namespace.clone().unwrap_or_default(),
            }),
            CtlCommand::Release { pod, container } => Request::Release(pb::ReleaseRequest {
                pod_uid: pod.clone(),
                container: container.clone().unwrap_or_default(),
            }),
            CtlCommand::Allocations => Request::Allocations,
            CtlCommand::SyncPods {
                keep,
                keep_file,
                dry_run,
                all,
            } => {
                let file = match keep_file {
                    Some(path) => Some((path.as_path(), read_keep_file(path)?)),
                    None => None,
                };
                let keep = keep_list(keep, file.as_ref().map(|(p, t)| (*p, t.as_str())), *all)?;
                Request::SyncPods(pb::SyncPodsRequest {
                    keep_pod_uids: keep.into_iter().collect(),
                    dry_run: *dry_run,
                    all: *all,
                })
            }
        })
    }

    async fn send(
        self,
        client: &mut AdminClient<Channel>,
        output: OutputFormat,
    ) -> anyhow::Result<String> {
        Ok(match self {
            Request::Status => {
                let answer = client
                    .get_status(pb::GetStatusRequest {})
                    .await
                    .context("GetStatus failed")?
                    .into_inner();
                let view = StatusView::from(&answer);
                one(output, &view, || view.text())
            }
            Request::Events | Request::WatchEvents => {
                let answer = client
                    .list_events(pb::ListEventsRequest {})
                    .await
                    .context("ListEvents failed")?
                    .into_inner();
                list(output, answer.events.iter().map(EventView::from))
            }
            Request::Plugins => {
                let answer = client
                    .list_plugins(pb::ListPluginsRequest {})
                    .await
                    .context("ListPlugins failed")?
                    .into_inner();
                list(output, answer.plugins.iter().map(PluginView::from))
            }
            Request::Sockets => {
                let answer = client
                    .list_sockets(pb::ListSocketsRequest {})
                    .await
                    .context("ListSockets failed")?
                    .into_inner();
                list(output, answer.sockets.iter().map(SocketView::from))
            }
            Request::Handlers => {
                let answer = client
                    .list_handlers(pb::ListHandlersRequest {})
                    .await
                    .context("ListHandlers failed")?
                    .into_inner();
                let view = HandlersView::from(&answer);
                one(output, &view, || view.table())
            }
            Request::RollbackHandler(request) => {
                let what = match request.plugin_type.is_empty() {
                    false => format!("rollback of plugin type {}", request.plugin_type),
                    true => format!("rollback of resource {}", request.resource),
                };
                let answer = client
                    .rollback_handler(request)
                    .await
                    .map_err(|s| refused(&what, &s))?
                    .into_inner();
                let rows: Vec<HandlerView> = answer.handler.iter().map(HandlerView::from).collect();
                match output {
                    OutputFormat::Json => view::json_of(&HandlerRollbackView {
                        handler: rows.into_iter().next(),
                    }),
                    OutputFormat::Table => format!("rolled back\n{}", view::table(&rows)),
                }
            }
            Request::RefreshHandlers(request) => {
                let answer = client
                    .refresh_handlers(request)
                    .await
                    .map_err(|s| refused("refresh of the oci:// handlers", &s))?
                    .into_inner();
                let view = HandlerRefreshView {
                    outcome: answer.outcome.clone(),
                    reason: (!answer.reason.is_empty()).then(|| answer.reason.clone()),
                    items: answer.handlers.iter().map(HandlerView::from).collect(),
                };
                let text = match output {
                    OutputFormat::Json => view::json_of(&view),
                    OutputFormat::Table => {
                        let mut text = format!("refresh: {}\n", view.outcome);
                        if let Some(reason) = &view.reason {
                            text.push_str(&format!("reason: {reason}\n"));
                        }
                        text.push_str(&view::table(&view.items));
                        text
                    }
                };
                if view.outcome == "refused" {
                    print!("{text}");
                    anyhow::bail!(
                        "refresh refused; the handlers in force keep serving: {}",
                        view.reason.as_deref().unwrap_or("")
                    );
                }
                text
            }
            Request::Resources => {
                let answer = client
                    .list_resources(pb::ListResourcesRequest {})
                    .await
                    .context("ListResources failed")?
                    .into_inner();
                list(output, answer.resources.iter().map(ResourceView::from))
            }
            Request::Allocations => {
                let answer = client
                    .list_allocations(pb::ListAllocationsRequest {})
                    .await
                    .context("ListAllocations failed")?
                    .into_inner();
                list(output, answer.allocations.iter().map(AllocationView::from))
            }
            Request::Allocate(request) => {
                let what = format!(
                    "allocation of {} {} to pod {} container {}",
                    request.count, request.resource, request.pod_uid, request.container
                );
                let answer = client
                    .allocate(request)
                    .await
                    .map_err(|s| refused(&what, &s))?
                    .into_inner();
                let view = AllocateResultView::try_from(&answer).with_context(|| {
                    format!("the daemon's answer to the {what} does not decode")
                })?;
                one(output, &view, || view.table())
            }
            Request::Release(request) => {
                let pod = request.pod_uid.clone();
                let container = request.container.clone();
                let answer = client
                    .release(request)
                    .await
                    .map_err(|s| failed(&format!("release of pod {pod}"), &s))?
                    .into_inner();
                let view = ReleaseResultView::from(&answer);
                let container = (!container.is_empty()).then_some(container.as_str());
                one(output, &view, || view.text(&pod, container))
            }
            Request::SyncPods(request) => {
                let answer = client
                    .sync_pods(request)
                    .await
                    .map_err(|s| failed("sync of pods", &s))?
                    .into_inner();
                let view = SyncPodsView::from(&answer);
                one(output, &view, || view.table())
            }
        })
    }
}

fn refused(what: &str, status: &tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{what} refused ({:?}): {}", status.code(), status.message())
}

fn failed(what: &str, status: &tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{what} failed ({:?}): {}", status.code(), status.message())
}

/// A list of views: a JSON list in its envelope, or a table with one row per item.
fn list<T: Serialize + view::Table + Listed>(
    output: OutputFormat,
    items: impl Iterator<Item = T>,
) -> String {
    let items: Vec<T> = items.collect();
    match output {
        OutputFormat::Json => view::json_list(items),
        OutputFormat::Table => view::table(&items),
    }
}

/// One view: a JSON object in its envelope, or the text `table` renders.
fn one<T: Serialize + Kind>(
    output: OutputFormat,
    item: &T,
    table: impl FnOnce() -> String,
) -> String {
    match output {
        OutputFormat::Json => view::json_of(item),
        OutputFormat::Table => table(),
    }
}

/// The text of `--keep-file` (`-`: standard input).
fn read_keep_file(path: &Path) -> anyhow::Result<String> {
    if path == Path::new("-") {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .context("cannot read the pods to keep from standard input")?;
        return Ok(text);
    }
    std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the keep file {}", path.display()))
}

/// The pods whose devices `sync-pods` keeps: every `--keep` and every UID of the keep file
/// (`(path, text)`: one UID a line, blank lines and `#` comments ignored). An empty list is a
/// usage error unless `all` says that freeing every pod's devices is meant.
pub fn keep_list(
    keep: &[String],
    file: Option<(&Path, &str)>,
    all: bool,
) -> Result<BTreeSet<String>, UsageError> {
    let mut uids = BTreeSet::new();
    for uid in keep {
        let uid = uid.trim();
        if uid.is_empty() || uid.contains(char::is_whitespace) {
            return Err(UsageError::KeepUid {
                uid: uid.to_owned(),
            });
        }
        uids.insert(uid.to_owned());
    }
    if let Some((path, text)) = file {
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if line.contains(char::is_whitespace) {
                return Err(UsageError::KeepFileLine {
                    path: path.to_owned(),
                    line: n + 1,
                    text: line.to_owned(),
                });
            }
            uids.insert(line.to_owned());
        }
    }
    if uids.is_empty() && !all {
        return Err(UsageError::NothingKept {
            file: file.map(|(path, _)| path.to_owned()),
        });
    }
    Ok(uids)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn uids(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn keep_list_combines_flags_and_file_and_skips_comments() {
        let text = "# active pods\n\npod-b\n  pod-c  \n#pod-x\npod-a\n";
        let got = keep_list(
            &["pod-a".into(), "pod-z".into()],
            Some((Path::new("keep.txt"), text)),
            false,
        )
        .unwrap();
        assert_eq!(got, uids(&["pod-a", "pod-b", "pod-c", "pod-z"]));
    }

    #[test]
    fn an_empty_keep_list_needs_all() {
        let err = keep_list(&[], None, false).unwrap_err().to_string();
        assert!(err.contains("--all"), "{err}");
        assert!(err.contains("every pod"), "{err}");
        let err = keep_list(&[], Some((Path::new("k.txt"), "# none\n\n")), false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("k.txt names no pod"), "{err}");
        assert_eq!(keep_list(&[], None, true).unwrap(), uids(&[]));
        assert_eq!(
            keep_list(&["p".into()], None, true).unwrap(),
            uids(&["p"]),
            "--all never drops a pod named to keep"
        );
    }

    #[test]
    fn bad_uids_are_usage_errors_naming_the_line() {
        let err = keep_list(
            &[],
            Some((Path::new("k.txt"), "pod-a\npod-b pod-c\n")),
            true,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("k.txt line 2"), "{err}");
        assert_eq!(
            keep_list(&[" ".into()], None, true),
            Err(UsageError::KeepUid { uid: "".into() })
        );
    }

    #[test]
    fn sync_pods_requests_carry_the_flags() {
        use clap::Parser;
        let cli = crate::cli::Cli::try_parse_from([
            "pluglet",
            "ctl",
            "sync-pods",
            "--keep",
            "b",
            "--keep",
            "a",
            "--dry-run",
        ])
        .unwrap();
        let crate::cli::Command::Ctl(args) = cli.command else {
            panic!("not ctl")
        };
        assert_eq!(
            Request::from_command(&args.command).unwrap(),
            Request::SyncPods(pb::SyncPodsRequest {
                keep_pod_uids: vec!["a".into(), "b".into()],
                dry_run: true,
                all: false,
            })
        );
    }
}
