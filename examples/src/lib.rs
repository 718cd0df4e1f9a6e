//! The README's Rust examples live in `examples/` as complete programs (`cargo run -p
//! idem-examples --example quickstart`); `tests/` checks that the README quotes them as they
//! are, runs them, and runs the README's shell walkthroughs as written.
