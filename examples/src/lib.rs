//! The README's Rust examples live in `examples/` as complete programs (`cargo run -p
//! idem-examples --example first_request`); `tests/` checks that the README quotes them as
//! they are and runs them, and that `scripts/test <backend>` picks each backend's servers and
//! tests. The README's shell walkthroughs run in `scripts/walkthrough`.
