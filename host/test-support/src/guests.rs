//! What the benchmarks of handler swaps and calls share: a guest's bytes under a new sha256,
//! and the allocation request they call policies with.

use pluglet_handler_runtime::{AllocationRequest, CandidateDevice};

fn leb128(mut n: usize, out: &mut Vec<u8>) {
    loop {
        let byte = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// `bytes` with a custom section (id 0, allowed at the top level of a component) carrying
/// `tag`: the same component under a new sha256, so that the compile cache has never seen it.
pub fn tagged(bytes: &[u8], tag: u64) -> Vec<u8> {
    let name = b"pluglet-bench";
    let mut body = Vec::new();
    leb128(name.len(), &mut body);
    body.extend_from_slice(name);
    body.extend_from_slice(&tag.to_le_bytes());
    let mut out = bytes.to_vec();
    out.push(0);
    leb128(body.len(), &mut out);
    out.extend_from_slice(&body);
    out
}

/// Allocate 1 of eight devices `d0`..`d7` of `resource`, alternating NUMA nodes 0 and 1.
pub fn one_of_eight(resource: &str) -> AllocationRequest {
    AllocationRequest {
        resource: resource.into(),
        available: (0..8)
            .map(|i| CandidateDevice {
                id: format!("d{i}"),
                numa_nodes: vec![i % 2],
            })
            .collect(),
        must_include: Vec::new(),
        count: 1,
        preferred: None,
    }
}
