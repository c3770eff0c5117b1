//! Kubernetes name rules, as the API server checks them (`k8s.io/apimachinery` validation):
//! DNS-1123 subdomains, label values and qualified names. Plugin names, resource names and the
//! labels a plugin's facts turn into must pass them, so handlers share one implementation.
//!
//! ```
//! use pluglet_guest::names;
//!
//! assert!(names::is_dns1123_subdomain("hostpath.csi.k8s.io"));
//! assert!(names::is_qualified_name("topology.example.com/zone"));
//! assert!(names::check_qualified_name("Vendor.com/gpu").is_err());
//! ```

/// Longest DNS-1123 subdomain.
pub const DNS1123_SUBDOMAIN_MAX_LEN: usize = 253;

/// Longest label value, and longest name part of a qualified name.
pub const LABEL_VALUE_MAX_LEN: usize = 63;

/// Whether `name` is a DNS-1123 subdomain: at most 253 characters of lowercase letters, digits,
/// `-` and `.`, each dot-separated part starting and ending with a letter or digit.
pub fn is_dns1123_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= DNS1123_SUBDOMAIN_MAX_LEN
        && name.split('.').all(is_subdomain_part)
}

/// One dot-separated part of a subdomain: lowercase letters, digits and `-`, starting and ending
/// with a letter or digit. (The subdomain rule bounds only the whole name's length.)
fn is_subdomain_part(part: &str) -> bool {
    let bytes = part.as_bytes();
    let lower_alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    match (bytes.first(), bytes.last()) {
        (Some(first), Some(last)) => {
            lower_alnum(first)
                && lower_alnum(last)
                && bytes.iter().all(|b| lower_alnum(b) || *b == b'-')
        }
        _ => false,
    }
}

/// Whether `value` is a valid label value: empty, or at most 63 characters of letters, digits,
/// `-`, `_` and `.`, starting and ending with a letter or digit.
pub fn is_label_value(value: &str) -> bool {
    value.is_empty() || is_label_name(value)
}

/// A non-empty label value: the name part of a qualified name.
fn is_label_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    match (bytes.first(), bytes.last()) {
        (Some(first), Some(last)) => {
            bytes.len() <= LABEL_VALUE_MAX_LEN
                && first.is_ascii_alphanumeric()
                && last.is_ascii_alphanumeric()
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

/// Checks that `value` is a qualified name, as label keys and resource names must be:
/// `[prefix/]name`, the prefix a DNS-1123 subdomain, the name 1–63 characters of letters, digits,
/// `-`, `_` and `.` starting and ending with a letter or digit. `Err` says which rule it breaks.
pub fn check_qualified_name(value: &str) -> Result<(), String> {
    let parts: Vec<&str> = value.split('/').collect();
    let name = match parts.as_slice() {
        [name] => *name,
        [prefix, name] => {
            if prefix.is_empty() {
                return Err("prefix part must not be empty".into());
            }
            if !is_dns1123_subdomain(prefix) {
                return Err(format!(
                    "prefix {prefix:?} must be a lowercase DNS-1123 subdomain of at most \
                     {DNS1123_SUBDOMAIN_MAX_LEN} characters"
                ));
            }
            name
        }
        _ => return Err("a qualified name has at most one '/'".into()),
    };
    if name.is_empty() {
        return Err("name part must not be empty".into());
    }
    if name.len() > LABEL_VALUE_MAX_LEN {
        return Err(format!(
            "name part {name:?} is longer than {LABEL_VALUE_MAX_LEN} characters"
        ));
    }
    if !is_label_name(name) {
        return Err(format!(
            "name part {name:?} must consist of alphanumerics, '-', '_' or '.', starting and \
             ending with an alphanumeric"
        ));
    }
    Ok(())
}

/// Whether `value` is a qualified name (see [`check_qualified_name`]).
pub fn is_qualified_name(value: &str) -> bool {
    check_qualified_name(value).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subdomains() {
        for good in [
            "a",
            "hostpath.csi.k8s.io",
            "a-b.c0",
            "0.1",
            &"a".repeat(253),
        ] {
            assert!(is_dns1123_subdomain(good), "{good:?}");
        }
        // Parts are not bounded to 63 characters, only the whole name to 253.
        assert!(is_dns1123_subdomain(&format!("{}.com", "a".repeat(100))));
        for bad in [
            "",
            "Csi.Example.com",
            "csi_example",
            "-csi.example.com",
            "csi-.example.com",
            "csi..example",
            ".csi",
            "csi.",
            &"a".repeat(254),
        ] {
            assert!(!is_dns1123_subdomain(bad), "{bad:?}");
        }
    }

    #[test]
    fn label_values() {
        for good in ["", "zone-a", "Zone_A.1", "a", &"a".repeat(63)] {
            assert!(is_label_value(good), "{good:?}");
        }
        for bad in ["not a label!", "-a", "a-", "_a", "a/b", &"a".repeat(64)] {
            assert!(!is_label_value(bad), "{bad:?}");
        }
    }

    #[test]
    fn qualified_names() {
        for good in [
            "zone",
            "topology.example.com/zone",
            "requests.nvidia.com/gpu",
            "example.com/Foo_bar.1",
        ] {
            assert_eq!(check_qualified_name(good), Ok(()), "{good:?}");
            assert!(is_qualified_name(good));
        }
        let cases = [
            ("/gpu", "prefix part must not be empty"),
            ("Vendor.com/gpu", "must be a lowercase DNS-1123 subdomain"),
            ("a/b/c", "at most one '/'"),
            ("vendor.com/", "name part must not be empty"),
            ("", "name part must not be empty"),
            ("vendor.com/-gpu", "must consist of alphanumerics"),
        ];
        for (bad, expected) in cases {
            let err = check_qualified_name(bad).unwrap_err();
            assert!(err.contains(expected), "{bad:?}: {err}");
            assert!(!is_qualified_name(bad));
        }
        let long = format!("vendor.com/{}", "g".repeat(64));
        assert!(
            check_qualified_name(&long)
                .unwrap_err()
                .contains("longer than 63")
        );
    }
}
