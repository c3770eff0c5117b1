//! `pluglet handler` (placeholder written by helper B so the crate compiles; owned and replaced by
//! helper A, who keeps the `HandlerArgs` / `run` shape).

/// Arguments of `pluglet handler`.
#[derive(Debug, Clone, clap::Args)]
pub struct HandlerArgs {
    /// Arguments (placeholder).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<String>,
}

/// Runs `pluglet handler`.
pub fn run(_args: HandlerArgs) -> anyhow::Result<()> {
    anyhow::bail!("`pluglet handler` is not available in this build")
}
