//! A client of the admin API that keeps one connection, as an orchestrator does, and runs the
//! commands it reads on stdin over it, one per line:
//!
//! ```text
//! allocate POD CONTAINER RESOURCE COUNT
//! release POD
//! allocations
//! ```
//!
//! It answers each line with one line, `ok` or `error: WHY`, once the daemon has answered, so
//! a script can wait for each operation. `scripts/instructions.sh` uses it to count the daemon's
//! instructions per operation without a connection set up for each (which `pluglet ctl` pays,
//! and the script counts as a row of its own).

use std::path::PathBuf;

use anyhow::{Context as _, bail};
use clap::Parser;
use pluglet_proto::admin::v1 as pb;
use pluglet_proto::admin::v1::admin_client::AdminClient;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};

/// Command-line arguments.
#[derive(Parser)]
#[command(about = "Runs admin API commands read from stdin over one connection")]
struct Args {
    /// The daemon's admin socket.
    #[arg(long)]
    socket: PathBuf,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let channel = pluglet_uds::connect(&args.socket, std::time::Duration::from_secs(30))
        .await
        .with_context(|| format!("cannot connect to {}", args.socket.display()))?;
    let mut client = AdminClient::new(channel);
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut out = tokio::io::stdout();
    while let Some(line) = lines.next_line().await? {
        let answer = match run(&mut client, &line).await {
            Ok(()) => "ok\n".to_owned(),
            Err(e) => format!("error: {e:#}\n"),
        };
        out.write_all(answer.as_bytes()).await?;
        out.flush().await?;
    }
    Ok(())
}

/// Runs one command line.
async fn run(client: &mut AdminClient<pluglet_uds::Channel>, line: &str) -> anyhow::Result<()> {
    let words: Vec<&str> = line.split_whitespace().collect();
    match words.as_slice() {
        ["allocate", pod, container, resource, count] => {
            client
                .allocate(pb::AllocateRequest {
                    pod_uid: (*pod).to_owned(),
                    container: (*container).to_owned(),
                    resource: (*resource).to_owned(),
                    count: count.parse().context("COUNT is not a number")?,
                    ..Default::default()
                })
                .await?;
        }
        ["release", pod] => {
            client
                .release(pb::ReleaseRequest {
                    pod_uid: (*pod).to_owned(),
                    container: String::new(),
                })
                .await?;
        }
        ["allocations"] => {
            client
                .list_allocations(pb::ListAllocationsRequest::default())
                .await?;
        }
        _ => bail!(
            "unknown command {line:?}: allocate POD CONTAINER RESOURCE COUNT, release POD or allocations"
        ),
    }
    Ok(())
}
