//! Pluglet host library (placeholder, replaced by its owner).
