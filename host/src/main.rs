//! The `pluglet` binary (placeholder).
fn main() {}
