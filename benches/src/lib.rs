//! Shared helpers for the side-by-side benchmarks.
