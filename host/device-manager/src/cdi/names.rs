//! CDI names for Pluglet's allocations: the kind (`vendor/class`) of a resource and the device
//! name of one container's allocation, and the CDI syntax rules they must satisfy.
//!
//! The rules (CDI's parser): a vendor or class starts with a letter, ends with a letter or
//! digit, and holds only letters, digits, `-`, `_` and `.`; before cdiVersion 0.6.0 a class
//! may hold no `.`, and runtimes of that age (podman 4.3) refuse one. A device name starts and
//! ends with a letter or digit (before 0.5.0: starts with a letter) and holds only letters,
//! digits, `-`, `_`, `.` and `:`. The naming and why it is so are in `docs/cdi.md`.

use sha2::{Digest as _, Sha256};

/// Prefix of every device name Pluglet generates, so none can be taken for a vendor's own.
pub const DEVICE_PREFIX: &str = "pluglet-";

/// A CDI kind: `vendor/class`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kind {
    /// The vendor part: the resource's domain.
    pub vendor: String,
    /// The class part: the resource's name part.
    pub class: String,
}

impl Kind {
    /// The fully qualified name of `device` of this kind: `vendor/class=device`.
    pub fn qualified(&self, device: &str) -> String {
        [self.vendor.as_str(), "/", &self.class, "=", device].concat()
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.vendor, self.class)
    }
}

/// The kind of `resource` (`domain/name`, as device plugins register): `domain` as the
/// vendor and `name` as the class when both are valid as they are for cdiVersion 0.5.0
/// (`vendor.com/gpu` → `vendor.com/gpu`). Otherwise (a class with a `.` or starting with a
/// digit, a domain starting with a digit) each part is mended (`.` in the class → `-`, a
/// leading digit gets an `r`/`v` before it) and the class ends in `-` and 8 hex digits of the
/// resource name's SHA-256, so two resources never share a kind (`vendor.com/gpu.small` →
/// `vendor.com/gpu-small-1a2b3c4d`).
pub fn kind_of(resource: &str) -> Kind {
    let (domain, name) = resource.split_once('/').unwrap_or(("", resource));
    if valid_vendor(domain) && valid_class(name, false) {
        return Kind {
            vendor: domain.to_owned(),
            class: name.to_owned(),
        };
    }
    let vendor = mend(domain, 'v', true);
    let class = format!(
        "{}-{}",
        mend(name, 'r', false),
        &hex::encode(Sha256::digest(resource.as_bytes()))[..8]
    );
    Kind { vendor, class }
}

/// Makes `part` a valid vendor (`dots` allowed) or pre-0.6.0 class: characters outside the
/// allowed set become `-`, a first character that is not a letter gets `lead` before it, and
/// trailing characters that are not letters or digits are dropped.
fn mend(part: &str, lead: char, dots: bool) -> String {
    let mut out: String = part
        .chars()
        .map(|c| match c {
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => c,
            '.' if dots => '.',
            _ => '-',
        })
        .collect();
    if !out.starts_with(|c: char| c.is_ascii_alphabetic()) {
        out.insert(0, lead);
    }
    while out.ends_with(|c: char| !c.is_ascii_alphanumeric()) {
        out.pop();
    }
    out
}

/// The device name of the allocation of `container` of `pod_uid`:
/// `pluglet-<pod uid>_<container>` when both are plain Kubernetes names (letters, digits,
/// `-` and `.`, starting and ending with a letter or digit; every pod UID and container name
/// Kubernetes makes is one), else `pluglet-h` and 32 hex digits of a SHA-256 of both. The `_`
/// appears only as the separator, so no two (pod, container) pairs share a name.
pub fn device_name(pod_uid: &str, container: &str) -> String {
    if plain(pod_uid) && plain(container) {
        return [DEVICE_PREFIX, pod_uid, "_", container].concat();
    }
    let mut hash = Sha256::new();
    hash.update(pod_uid.as_bytes());
    hash.update([0]);
    hash.update(container.as_bytes());
    format!("{DEVICE_PREFIX}h{}", &hex::encode(hash.finalize())[..32])
}

fn plain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
}

/// Whether `vendor` is a valid CDI vendor.
pub fn valid_vendor(vendor: &str) -> bool {
    valid_kind_part(vendor, true)
}

/// Whether `class` is a valid CDI class (`dots`: as cdiVersion 0.6.0 allows).
pub fn valid_class(class: &str, dots: bool) -> bool {
    valid_kind_part(class, dots)
}

fn valid_kind_part(part: &str, dots: bool) -> bool {
    part.starts_with(|c: char| c.is_ascii_alphabetic())
        && part.ends_with(|c: char| c.is_ascii_alphanumeric())
        && part
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || (dots && c == '.'))
}

/// Whether `name` is a valid CDI device name (cdiVersion 0.5.0 and later).
pub fn valid_device_name(name: &str) -> bool {
    name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))
}

/// Whether `name` is a valid fully qualified CDI device name, `vendor/class=device`.
pub fn valid_qualified(name: &str) -> bool {
    let Some((kind, device)) = name.split_once('=') else {
        return false;
    };
    let Some((vendor, class)) = kind.split_once('/') else {
        return false;
    };
    valid_vendor(vendor) && valid_class(class, true) && valid_device_name(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_resources_keep_their_name() {
        let kind = kind_of("vendor.com/gpu");
        assert_eq!(kind.to_string(), "vendor.com/gpu");
        assert_eq!(
            kind_of("example.com/fpga_x-2").to_string(),
            "example.com/fpga_x-2"
        );
    }

    #[test]
    fn resources_that_need_mending_get_a_distinct_valid_kind() {
        let dotted = kind_of("vendor.com/gpu.small");
        let dashed = kind_of("vendor.com/gpu-small");
        assert!(dotted.class.starts_with("gpu-small-"), "{dotted}");
        assert_eq!(dashed.class, "gpu-small");
        assert_ne!(dotted, dashed);
        for resource in [
            "vendor.com/gpu.small",
            "vendor.com/3d",
            "1vendor.com/x",
            "vendor.com/a.b.",
            "no-slash",
            "weird domain/na me",
        ] {
            let kind = kind_of(resource);
            assert!(valid_vendor(&kind.vendor), "{resource}: vendor {kind}");
            assert!(valid_class(&kind.class, false), "{resource}: class {kind}");
            assert_eq!(kind, kind_of(resource), "stable");
        }
    }

    #[test]
    fn kubernetes_names_read_as_they_are() {
        assert_eq!(device_name("0f3e-41aa", "main"), "pluglet-0f3e-41aa_main");
        assert_eq!(device_name("pod.a", "c1"), "pluglet-pod.a_c1");
    }

    #[test]
    fn names_that_need_escaping_are_hashed_valid_and_distinct() {
        let names = [
            device_name("my pod", "c"),
            device_name("my", "pod c"),
            device_name("a_b", "c"),
            device_name("a", "b_c"),
            device_name("-lead", "c"),
            device_name("ü", "c"),
            device_name(&"x".repeat(512), "c"),
        ];
        for (i, name) in names.iter().enumerate() {
            assert!(valid_device_name(name), "{name}");
            assert!(name.starts_with(DEVICE_PREFIX));
            for other in &names[i + 1..] {
                assert_ne!(name, other);
            }
        }
        assert_eq!(device_name("my pod", "c"), names[0], "stable");
    }

    #[test]
    fn qualified_names_follow_the_cdi_rules() {
        for good in [
            "vendor.com/gpu=0",
            "a/b=c:d",
            "nvidia.com/gpu=GPU-1a.2",
            "v/c.d=x",
        ] {
            assert!(valid_qualified(good), "{good}");
        }
        for bad in [
            "vendor.com/gpu",
            "gpu=0",
            "vendor.com/gpu=",
            "vendor.com/gpu=-0",
            "vendor.com/gpu=0-",
            "1vendor/gpu=0",
            "vendor/gpu=a b",
            "vendor/-gpu=a",
        ] {
            assert!(!valid_qualified(bad), "{bad}");
        }
    }
}
