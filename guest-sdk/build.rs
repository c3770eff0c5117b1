//! Embeds the WIT contract into the SDK's export macro, so a guest crate generates its export
//! glue from the same `wit/handler.wit` wherever it lives (wit-bindgen resolves `path` relative to
//! the crate invoking the macro, so the text is passed inline).

use std::path::Path;

fn main() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let wit_path = Path::new(&manifest).join("wit").join("handler.wit");
    println!("cargo:rerun-if-changed={}", wit_path.display());
    let wit = std::fs::read_to_string(&wit_path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", wit_path.display()));
    let version = wit
        .lines()
        .find_map(|l| l.trim().strip_prefix("package pluglet:handler@"))
        .and_then(|rest| rest.strip_suffix(';'))
        .unwrap_or_else(|| {
            panic!(
                "{} has no `package pluglet:handler@x.y.z;` line",
                wit_path.display()
            )
        })
        .to_string();
    let mut hashes = String::from("#");
    while wit.contains(&format!("\"{hashes}")) {
        hashes.push('#');
    }
    let out = format!(
        r#"/// Generates the export glue of one world of the contract in the invoking crate.
#[doc(hidden)]
#[macro_export]
macro_rules! __pluglet_generate_world {{
    ($world:tt) => {{
        ::pluglet_guest::__private::wit_bindgen::generate!({{
            inline: r{hashes}"{wit}"{hashes},
            world: $world,
            runtime_path: "::pluglet_guest::__private::wit_bindgen::rt",
            with: {{
                "pluglet:handler/types@{version}": ::pluglet_guest::__private::bindings::pluglet::handler::types,
                "pluglet:handler/host@{version}": ::pluglet_guest::__private::bindings::pluglet::handler::host,
            }},
        }});
    }};
}}

/// The contract version (WIT package version) this SDK builds handlers for.
pub const CONTRACT_VERSION: &str = "{version}";
"#
    );
    let out_dir = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    std::fs::write(Path::new(&out_dir).join("generate_world.rs"), out)
        .expect("cannot write generate_world.rs");
}
