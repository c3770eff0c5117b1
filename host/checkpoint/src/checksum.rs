//! The kubelet's checkpoint checksum: `uint64(FNV-1a-32(S))`, where `S` is go-spew's `%#v`
//! rendering of the `checkpointData` struct (docs/kubelet-compatibility.md, "Checkpoint
//! checksum" and "Checkpoint test vectors").
//!
//! The kubelet computes it with `hashutil.DeepHashObject`, i.e. a `spew.ConfigState` with
//! `Indent: " "`, `SortKeys`, `DisableMethods`, `SpewKeys`, `DisablePointerAddresses` and
//! `DisableCapacities`, printing `%#v` into an FNV-1a 32-bit hasher. With `%#v` spew's
//! *formatter* is used (not its dumper), so the indent never shows. What the formatter prints
//! for our types:
//!
//! - every value that is not an element of a slice or a map, or a map key, is preceded by its Go
//!   type in parentheses: `(checkpoint.checkpointData)`, `([]checkpoint.PodDevicesEntry)`,
//!   `(string)`, `(checkpoint.DevicesPerNUMA)`, `([]uint8)`, `(map[string][]string)`;
//! - a struct is `{Field:value Field:value}`; a slice `[a b]`; a map `map[k:v k:v]` with keys
//!   sorted (int64 numerically, strings byte-wise); a nil slice or map is `<nil>`, an empty one
//!   `[]` / `map[]`;
//! - strings are written raw (no quotes, no escaping); bytes as decimal numbers.
//!
//! The renderer writes into a [`Sink`], so the checksum is computed without building `S`.

use std::collections::BTreeMap;

use crate::format::{EntryParts, PodDevicesEntry};

/// FNV-1a 32-bit offset basis.
const FNV32_OFFSET: u32 = 0x811c_9dc5;
/// FNV-1a 32-bit prime.
const FNV32_PRIME: u32 = 0x0100_0193;

/// FNV-1a, 32 bits (Go's `hash/fnv.New32a`), of `bytes`.
pub fn fnv1a_32(bytes: &[u8]) -> u32 {
    let mut hasher = Fnv1a32::default();
    hasher.put(bytes);
    hasher.0
}

/// Where the renderer writes: a byte buffer or a running hash.
pub(crate) trait Sink {
    /// Appends `bytes`.
    fn put(&mut self, bytes: &[u8]);

    /// Appends `bytes` as spew prints the elements of a `[]uint8`: each in decimal, separated
    /// by spaces (no brackets).
    fn put_byte_decimals(&mut self, bytes: &[u8]) {
        for (i, b) in bytes.iter().enumerate() {
            if i > 0 {
                self.put(b" ");
            }
            self.put(byte_decimal(*b));
        }
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// A running FNV-1a 32-bit hash.
struct Fnv1a32(u32);

impl Default for Fnv1a32 {
    fn default() -> Self {
        Fnv1a32(FNV32_OFFSET)
    }
}

impl Fnv1a32 {
    /// One byte into the hash.
    #[inline(always)]
    fn step(hash: u32, byte: u8) -> u32 {
        (hash ^ u32::from(byte)).wrapping_mul(FNV32_PRIME)
    }

    /// One byte's decimal digits into the hash, without leading zeros.
    #[inline(always)]
    fn step_decimal(mut hash: u32, byte: u8) -> u32 {
        let [hundreds, tens, ones] = BYTE_DECIMAL[usize::from(byte)];
        if byte >= 100 {
            hash = Self::step(hash, hundreds);
        }
        if byte >= 10 {
            hash = Self::step(hash, tens);
        }
        Self::step(hash, ones)
    }
}

impl Sink for Fnv1a32 {
    fn put(&mut self, bytes: &[u8]) {
        self.0 = bytes.iter().fold(self.0, |hash, &b| Self::step(hash, b));
    }

    /// The hash of the decimal text, taken digit by digit from the table: no text is built and
    /// no slice is made per byte. An allocation response is most of what the checksum covers.
    fn put_byte_decimals(&mut self, bytes: &[u8]) {
        let Some((&first, rest)) = bytes.split_first() else {
            return;
        };
        let mut hash = Self::step_decimal(self.0, first);
        for &b in rest {
            hash = Self::step_decimal(Self::step(hash, b' '), b);
        }
        self.0 = hash;
    }
}

/// The checksum of the data part of a checkpoint: `uint64(FNV-1a-32(S))`.
///
/// `entries` and `registered` are `None` where the Go value is nil.
pub(crate) fn checksum(
    entries: Option<&[PodDevicesEntry]>,
    registered: Option<&BTreeMap<String, Option<Vec<String>>>>,
) -> u64 {
    checksum_of_parts(
        entries.map(|e| e.iter().map(PodDevicesEntry::parts)),
        registered.map(registered_parts),
    )
}

/// [`checksum`] of entries given as borrowed parts and registered devices given as (resource,
/// ids) in resource order: for a caller that keeps the data in its own types.
pub(crate) fn checksum_of_parts<'a, S, R>(
    entries: Option<impl Iterator<Item = EntryParts<'a, S>>>,
    registered: Option<impl Iterator<Item = (&'a str, Option<&'a [R]>)>>,
) -> u64
where
    S: AsRef<str> + 'a,
    R: AsRef<str> + 'a,
{
    let mut hasher = Fnv1a32::default();
    render(&mut hasher, entries, registered);
    u64::from(hasher.0)
}

/// go-spew's `%#v` rendering of `checkpoint.checkpointData` (see the module doc).
pub(crate) fn spew(
    entries: Option<&[PodDevicesEntry]>,
    registered: Option<&BTreeMap<String, Option<Vec<String>>>>,
) -> String {
    let mut out = Vec::new();
    render(
        &mut out,
        entries.map(|e| e.iter().map(PodDevicesEntry::parts)),
        registered.map(registered_parts),
    );
    // Every piece written is either ASCII or a whole Rust string, so this is valid UTF-8.
    String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// A `RegisteredDevices` map as (resource, ids) in key order.
fn registered_parts(
    map: &BTreeMap<String, Option<Vec<String>>>,
) -> impl Iterator<Item = (&str, Option<&[String]>)> {
    map.iter().map(|(k, v)| (k.as_str(), v.as_deref()))
}

fn render<'a, S, R>(
    out: &mut impl Sink,
    entries: Option<impl Iterator<Item = EntryParts<'a, S>>>,
    registered: Option<impl Iterator<Item = (&'a str, Option<&'a [R]>)>>,
) where
    S: AsRef<str> + 'a,
    R: AsRef<str> + 'a,
{
    out.put(b"(checkpoint.checkpointData){PodDeviceEntries:([]checkpoint.PodDevicesEntry)");
    match entries {
        None => out.put(b"<nil>"),
        Some(entries) => {
            out.put(b"[");
            for (i, entry) in entries.enumerate() {
                if i > 0 {
                    out.put(b" ");
                }
                render_entry(out, &entry);
            }
            out.put(b"]");
        }
    }
    out.put(b" RegisteredDevices:(map[string][]string)");
    match registered {
        None => out.put(b"<nil>"),
        Some(map) => {
            out.put(b"map[");
            for (i, (resource, ids)) in map.enumerate() {
                if i > 0 {
                    out.put(b" ");
                }
                out.put(resource.as_bytes());
                out.put(b":");
                render_strings(out, ids);
            }
            out.put(b"]");
        }
    }
    out.put(b"}");
}

/// One `PodDevicesEntry` as a slice element: no type prefix for the struct itself.
fn render_entry<S: AsRef<str>>(out: &mut impl Sink, entry: &EntryParts<'_, S>) {
    out.put(b"{PodUID:(string)");
    out.put(entry.pod_uid.as_bytes());
    out.put(b" ContainerName:(string)");
    out.put(entry.container_name.as_bytes());
    out.put(b" ResourceName:(string)");
    out.put(entry.resource_name.as_bytes());
    out.put(b" DeviceIDs:(checkpoint.DevicesPerNUMA)");
    match &entry.device_ids {
        None => out.put(b"<nil>"),
        Some(nodes) => {
            out.put(b"map[");
            // spew sorts int keys numerically; the parts may list the nodes in any order (a
            // sorted copy is made only then).
            let sorted;
            let nodes = if nodes.is_sorted_by_key(|(node, _)| *node) {
                nodes.as_slice()
            } else {
                let mut copy = nodes.clone();
                copy.sort_unstable_by_key(|(node, _)| *node);
                sorted = copy;
                sorted.as_slice()
            };
            for (i, &(numa, ids)) in nodes.iter().enumerate() {
                if i > 0 {
                    out.put(b" ");
                }
                put_decimal(out, numa);
                out.put(b":");
                render_strings(out, ids);
            }
            out.put(b"]");
        }
    }
    out.put(b" AllocResp:([]uint8)");
    match entry.alloc_resp {
        None => out.put(b"<nil>"),
        Some(bytes) => {
            out.put(b"[");
            out.put_byte_decimals(bytes);
            out.put(b"]");
        }
    }
    out.put(b"}");
}

/// A `[]string` in element position (no type prefix): `<nil>` or `[a b]`.
fn render_strings<S: AsRef<str>>(out: &mut impl Sink, ids: Option<&[S]>) {
    match ids {
        None => out.put(b"<nil>"),
        Some(ids) => {
            out.put(b"[");
            for (i, id) in ids.iter().enumerate() {
                if i > 0 {
                    out.put(b" ");
                }
                out.put(id.as_ref().as_bytes());
            }
            out.put(b"]");
        }
    }
}

/// Every byte value in decimal, as spew prints a `[]uint8` element: an allocation response of
/// some kilobytes is rendered byte by byte for every checksum, so this is a table lookup rather
/// than a formatter call.
static BYTE_DECIMAL: [[u8; 3]; 256] = {
    let mut table = [[0u8; 3]; 256];
    let mut n = 0;
    while n < 256 {
        // `n` < 256, so each digit fits in a u8.
        table[n] = [
            (n / 100) as u8 + b'0',
            (n / 10 % 10) as u8 + b'0',
            (n % 10) as u8 + b'0',
        ];
        n += 1;
    }
    table
};

/// `b` in decimal, no leading zeros.
fn byte_decimal(b: u8) -> &'static [u8] {
    let digits = &BYTE_DECIMAL[usize::from(b)];
    let skip = match b {
        0..=9 => 2,
        10..=99 => 1,
        _ => 0,
    };
    &digits[skip..]
}

/// Writes `n` in decimal without allocating.
fn put_decimal(out: &mut impl Sink, n: i64) {
    out.put(itoa::Buffer::new().format(n).as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_prints_as_its_decimal() {
        for b in 0..=u8::MAX {
            assert_eq!(byte_decimal(b), b.to_string().as_bytes());
        }
    }

    #[test]
    fn the_hash_of_byte_decimals_is_the_hash_of_their_text() {
        let every: Vec<u8> = (0..=u8::MAX).chain([7, 0, 255, 10, 99, 100]).collect();
        for bytes in [&[][..], &[0], &[255], &[9, 10], &every] {
            let mut text = Vec::new();
            text.put_byte_decimals(bytes);
            let mut hasher = Fnv1a32::default();
            hasher.put(b"[");
            hasher.put_byte_decimals(bytes);
            assert_eq!(
                hasher.0,
                fnv1a_32(&[&b"["[..], &text].concat()),
                "{bytes:?}"
            );
        }
    }

    #[test]
    fn numa_nodes_in_any_order_hash_as_spew_sorts_them() {
        fn entry<'a>(nodes: Vec<(i64, Option<&'a [String]>)>) -> EntryParts<'a, String> {
            EntryParts {
                pod_uid: "p",
                container_name: "c",
                resource_name: "r",
                device_ids: Some(nodes),
                alloc_resp: None,
            }
        }
        fn hash(entry: EntryParts<'_, String>) -> u64 {
            checksum_of_parts(
                Some(std::iter::once(entry)),
                None::<std::iter::Empty<(&str, Option<&[String]>)>>,
            )
        }
        let ids = ["a".to_owned()];
        let sorted = vec![(-1, Some(&ids[..])), (2, None), (10, Some(&ids[..]))];
        let shuffled = vec![(10, Some(&ids[..])), (-1, Some(&ids[..])), (2, None)];
        let mut text = Vec::new();
        render_entry(&mut text, &entry(shuffled.clone()));
        assert!(
            String::from_utf8(text)
                .unwrap()
                .contains("map[-1:[a] 2:<nil> 10:[a]]")
        );
        assert_eq!(hash(entry(sorted)), hash(entry(shuffled)));
    }

    #[test]
    fn fnv1a_32_known_values() {
        // Reference values of FNV-1a 32 (draft-eastlake-fnv test vectors).
        assert_eq!(fnv1a_32(b""), 0x811c_9dc5);
        assert_eq!(fnv1a_32(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a_32(b"foobar"), 0xbf9c_f968);
    }

    #[test]
    fn decimal_extremes() {
        let mut out = Vec::new();
        put_decimal(&mut out, i64::MIN);
        out.put(b" ");
        put_decimal(&mut out, i64::MAX);
        out.put(b" ");
        put_decimal(&mut out, -1);
        assert_eq!(out, b"-9223372036854775808 9223372036854775807 -1");
    }

    #[test]
    fn checksum_hashes_the_spew_text() {
        let text = spew(None, Some(&BTreeMap::new()));
        assert_eq!(
            checksum(None, Some(&BTreeMap::new())),
            u64::from(fnv1a_32(text.as_bytes()))
        );
    }
}
