//! Test-only package: see `tests/`.
