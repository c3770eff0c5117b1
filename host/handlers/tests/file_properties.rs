//! Property tests of `handlers.toml` parsing: any text is a configuration or an error that
//! names the file, never a panic. The `handlers_toml` fuzz target (`scripts/fuzz.sh`) runs the
//! same parser on coverage-guided input.

use std::path::Path;

use proptest::prelude::*;

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        "\"[a-z./0-9-]{0,12}\"",
        Just("\"../../etc/passwd\"".to_string()),
        Just("\"\"".to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        Just("18446744073709551616".to_string()),
        Just("true".to_string()),
        Just("{ min_version = \"1.2.0\", n = 3 }".to_string()),
        Just("[1, \"a\"]".to_string()),
        "\"[0-9a-f]{64}\"",
        Just("\"builtin\"".to_string()),
        Just("\"fail\"".to_string()),
    ]
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("module"),
        Just("sha256"),
        Just("deadline_ms"),
        Just("memory_mib"),
        Just("fuel"),
        Just("settings"),
        Just("rollback_after"),
        Just("on_failure"),
        Just("unknown_key"),
    ]
    .prop_map(str::to_string)
}

fn section() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("[plugin_types.CSIPlugin]".to_string()),
        Just("[plugin_types.DevicePlugin]".to_string()),
        Just("[resources.\"vendor.com/gpu\"]".to_string()),
        "\\[resources\\.\"[a-z./]{0,10}\"\\]",
        Just("[other]".to_string()),
    ]
}

fn file() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        (section(), proptest::collection::vec((key(), value()), 0..6)),
        0..4,
    )
    .prop_map(|sections| {
        let mut text = String::new();
        for (header, entries) in sections {
            text.push_str(&header);
            text.push('\n');
            for (key, value) in entries {
                text.push_str(&format!("{key} = {value}\n"));
            }
        }
        text
    })
}

fn parse(text: &str) -> Result<pluglet_handlers::HandlersFile, pluglet_handlers::FileError> {
    let dir = Path::new("/etc/pluglet/handlers");
    pluglet_handlers::parse(dir, &dir.join("handlers.toml"), text)
}

proptest! {
    #[test]
    fn any_text_is_a_configuration_or_an_error_naming_the_file(text in any::<String>()) {
        if let Err(e) = parse(&text) {
            prop_assert!(e.to_string().contains("handlers.toml"), "{}", e);
        }
    }

    #[test]
    fn files_of_known_shape_parse_or_say_what_is_wrong(text in file()) {
        if let Err(e) = parse(&text) {
            prop_assert!(e.to_string().contains("handlers.toml"), "{}", e);
        }
    }
}
