//! `handlers.toml`: any text is a configuration or an error naming the file, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|text: &str| {
    let dir = Path::new("/nonexistent-handlers-dir");
    if let Err(e) = pluglet_handlers::parse(dir, &dir.join("handlers.toml"), text) {
        assert!(e.to_string().contains("handlers.toml"), "error names the file: {e}");
    }
});
