//! Extracts the Rust plugin from docs/PLUGINS.md (its one ```rust block) into `$OUT_DIR/guide_plugin.rs`, which
//! `src/lib.rs` includes: the guide's code is compiled, linted and tested as a real plugin crate.

use std::path::Path;

fn main() {
    let guide = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/PLUGINS.md");
    println!("cargo::rerun-if-changed={}", guide.display());
    let text = std::fs::read_to_string(&guide)
        .unwrap_or_else(|error| panic!("cannot read the guide {}: {error}", guide.display()));
    let blocks = rust_blocks(&text);
    let [plugin] = blocks.as_slice() else {
        panic!(
            "{} must hold exactly one ```rust block (the example plugin), not {}; label other code blocks with their language",
            guide.display(),
            blocks.len()
        );
    };
    let out =
        Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("guide_plugin.rs");
    std::fs::write(&out, plugin)
        .unwrap_or_else(|error| panic!("cannot write {}: {error}", out.display()));
}

/// The contents of every fenced block whose info string is `rust`.
fn rust_blocks(markdown: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in markdown.lines() {
        let fence = line.trim_start();
        match &mut current {
            None if fence.starts_with("```") && fence.trim_start_matches('`').trim() == "rust" => {
                current = Some(String::new());
            }
            Some(block) if fence.starts_with("```") => {
                blocks.push(std::mem::take(block));
                current = None;
            }
            Some(block) => {
                block.push_str(line);
                block.push('\n');
            }
            None => {}
        }
    }
    blocks
}
