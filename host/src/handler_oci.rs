//! `pluglet handler push` and `pluglet handler pull`: a module to and from an OCI registry, and
//! the registry options they share with `pluglet run`.
//!
//! - `pluglet handler push oci://REGISTRY/REPO:TAG MODULE [--signature FILE.minisig]
//!   [--vectors FILE.vectors.json]`: pushes the component in the CNCF wasm artifact layout and
//!   attaches the signature and the vectors as referrers of its manifest; prints the digests
//!   (`-o json` kind `HandlerPush`).
//! - `pluglet handler pull oci://REF --dest DIR`: writes `NAME.wasm`, and `NAME.wasm.minisig` and
//!   `NAME.vectors.json` when the registry holds them (NAME is the repository's last element), so
//!   that `handler verify` and `handler test --vectors` run offline on the same bytes (`-o json`
//!   kind `HandlerPull`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use pluglet_oci::options::{DEFAULT_MAX_MODULE_SIZE, DEFAULT_TIMEOUT, parse_insecure_registry};
use pluglet_oci::{OciRef, Registry, RegistryCa, RegistryOptions};
use serde::Serialize;

use crate::admin::view::{self, Kind};
use crate::cli::OutputFormat;

/// How registries are reached: the options `pluglet run`, `handler push` and `handler pull`
/// share.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RegistryArgs {
    /// A Docker-style config.json holding credentials per registry (`auths`), read at each
    /// pull [config: registry_auth].
    #[arg(long, value_name = "FILE")]
    pub registry_auth: Option<PathBuf>,
    /// The CA (PEM) that signs a registry's certificate, as HOST[:PORT]=FILE; repeatable
    /// [config: registry_ca = ["…"]].
    #[arg(long, value_name = "HOST[:PORT]=FILE")]
    pub registry_ca: Vec<RegistryCa>,
    /// A registry reached over plain HTTP, as HOST:PORT; repeatable [config:
    /// insecure_registries = ["…"]].
    #[arg(long = "insecure-registry", value_name = "HOST:PORT", value_parser = parse_insecure_registry)]
    pub insecure_registries: Vec<String>,
    /// The largest module a pull accepts, such as 64MiB [default: 64MiB].
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub registry_max_module_size: Option<u64>,
    /// The timeout of each request to a registry [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub registry_timeout: Option<Duration>,
}

impl RegistryArgs {
    /// The client options these arguments give.
    pub fn options(&self) -> RegistryOptions {
        RegistryOptions {
            auth_file: self.registry_auth.clone(),
            cas: self.registry_ca.clone(),
            insecure: self.insecure_registries.clone(),
            max_module_size: self
                .registry_max_module_size
                .unwrap_or(DEFAULT_MAX_MODULE_SIZE),
            timeout: self.registry_timeout.unwrap_or(DEFAULT_TIMEOUT),
        }
    }
}

/// Parses a size: bytes, or with a unit (`64MiB`, `150 KB`).
pub fn parse_size(text: &str) -> Result<u64, String> {
    text.trim()
        .parse::<bytesize::ByteSize>()
        .map(|size| size.as_u64())
        .map_err(|e| format!("{text:?} is not a size such as 64MiB or 1048576: {e}"))
}

/// Arguments of `pluglet handler push`.
#[derive(Debug, Clone, clap::Args)]
pub struct PushArgs {
    /// Where to push: oci://REGISTRY/REPO:TAG.
    pub reference: OciRef,
    /// The component (`.wasm`).
    pub module: PathBuf,
    /// A minisign signature of the module, attached as a referrer.
    #[arg(long, value_name = "FILE.minisig")]
    pub signature: Option<PathBuf>,
    /// Conformance vectors of the module, attached as a referrer.
    #[arg(long, value_name = "FILE.vectors.json")]
    pub vectors: Option<PathBuf>,
    /// How the registry is reached.
    #[command(flatten)]
    pub registry: RegistryArgs,
}

/// Arguments of `pluglet handler pull`.
#[derive(Debug, Clone, clap::Args)]
pub struct PullArgs {
    /// What to pull: oci://REGISTRY/REPO:TAG or oci://REGISTRY/REPO@sha256:HEX.
    pub reference: OciRef,
    /// The directory the files are written to (created if missing).
    #[arg(long, value_name = "DIR")]
    pub dest: PathBuf,
    /// How the registry is reached.
    #[command(flatten)]
    pub registry: RegistryArgs,
}

#[derive(Serialize)]
struct PushReport {
    #[serde(flatten)]
    pushed: pluglet_oci::Pushed,
}

impl Kind for PushReport {
    const KIND: &'static str = "HandlerPush";
}

#[derive(Serialize)]
struct PullReport {
    reference: String,
    digest: String,
    pinned: String,
    sha256: String,
    size: u64,
    module: String,
    signature: Option<String>,
    vectors: Option<String>,
}

impl Kind for PullReport {
    const KIND: &'static str = "HandlerPull";
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

fn read(path: &Path, what: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read the {what} {}", path.display()))
}

/// Runs `pluglet handler push`.
pub fn push(args: PushArgs, output: OutputFormat) -> anyhow::Result<()> {
    let module = read(&args.module, "module")?;
    if !(module.starts_with(b"\0asm") && module.get(4..8) == Some(&[0x0d, 0, 1, 0][..])) {
        bail!(
            "{} is not a WebAssembly component (a handler is built for wasm32-wasip2); \
             `pluglet handler check` says more",
            args.module.display()
        );
    }
    let signature = args
        .signature
        .as_deref()
        .map(|p| read(p, "signature"))
        .transpose()?;
    if let (Some(sig), Some(path)) = (&signature, &args.signature)
        && (std::str::from_utf8(sig).is_err() || !sig.starts_with(b"untrusted comment:"))
    {
        bail!(
            "{} is not a minisign signature (`minisign -Sm MODULE` writes MODULE.minisig)",
            path.display()
        );
    }
    if let Some(path) = &args.vectors {
        pluglet_handlers::Vectors::read(path)?;
    }
    let vectors = args
        .vectors
        .as_deref()
        .map(|p| read(p, "vectors file"))
        .transpose()?;
    let registry = Registry::new(args.registry.options());
    let pushed = runtime()?
        .block_on(registry.push(
            &args.reference,
            &module,
            signature.as_deref(),
            vectors.as_deref(),
        ))
        .with_context(|| {
            format!(
                "cannot push {} to {}",
                args.module.display(),
                args.reference
            )
        })?;
    match output {
        OutputFormat::Json => print!("{}", view::json_of(&PushReport { pushed })),
        OutputFormat::Table => {
            println!("pushed:     {}", pushed.reference);
            println!("digest:     {}", pushed.digest);
            println!("pinned:     {}", pushed.pinned);
            println!("sha256:     {}", pushed.module_digest);
            println!("size:       {} bytes", pushed.size);
            println!("signature:  {}", pushed.signature.as_deref().unwrap_or("-"));
            println!("vectors:    {}", pushed.vectors.as_deref().unwrap_or("-"));
        }
    }
    Ok(())
}

/// Runs `pluglet handler pull`.
pub fn pull(args: PullArgs, output: OutputFormat) -> anyhow::Result<()> {
    let registry = Registry::new(args.registry.options());
    let pulled = runtime()?
        .block_on(registry.pull(&args.reference))
        .with_context(|| format!("cannot pull {}", args.reference))?;
    std::fs::create_dir_all(&args.dest)
        .with_context(|| format!("cannot create {}", args.dest.display()))?;
    let name = args.reference.name();
    let module_path = args.dest.join(format!("{name}.wasm"));
    let write = |path: &Path, bytes: &[u8]| {
        std::fs::write(path, bytes).with_context(|| format!("cannot write {}", path.display()))
    };
    write(&module_path, &pulled.module)?;
    let mut report = PullReport {
        reference: args.reference.to_string(),
        pinned: args.reference.with_digest(&pulled.digest).to_string(),
        digest: pulled.digest,
        sha256: pulled
            .module_digest
            .trim_start_matches("sha256:")
            .to_owned(),
        size: pulled.module.len() as u64,
        module: module_path.display().to_string(),
        signature: None,
        vectors: None,
    };
    if let Some(signature) = pulled.signatures.last() {
        let path = pluglet_handlers::signature_path(&module_path);
        write(&path, signature.as_bytes())?;
        report.signature = Some(path.display().to_string());
    }
    if let Some(vectors) = &pulled.vectors {
        let path = pluglet_handlers::vectors_path(&module_path);
        write(&path, vectors)?;
        report.vectors = Some(path.display().to_string());
    }
    match output {
        OutputFormat::Json => print!("{}", view::json_of(&report)),
        OutputFormat::Table => {
            println!("pulled:     {}", report.reference);
            println!("digest:     {}", report.digest);
            println!("sha256:     {}", report.sha256);
            println!("module:     {}", report.module);
            println!("signature:  {}", report.signature.as_deref().unwrap_or("-"));
            println!("vectors:    {}", report.vectors.as_deref().unwrap_or("-"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_units() {
        assert_eq!(parse_size("64MiB").unwrap(), 64 * 1024 * 1024);
        assert_eq!(parse_size("1048576").unwrap(), 1048576);
        assert_eq!(parse_size("150 KB").unwrap(), 150_000);
        assert!(parse_size("lots").is_err());
    }
}
