//! The Rust plugin of docs/PLUGINS.md, compiled from the guide itself: `build.rs` copies the guide's ```rust
//! block into `OUT_DIR`, and it is included here. So `cargo build` proves the guide's code compiles, clippy lints
//! it, and `cargo test` runs the tests written in the guide. The integration tests also run tasks through it.
//!
//! Edit the example in docs/PLUGINS.md, not here.

include!(concat!(env!("OUT_DIR"), "/guide_plugin.rs"));
