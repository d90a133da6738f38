//! Tidy tests, in rust-analyzer's manner: tests that read the repository's own files and fail when the code, the
//! docs and the rules they state drift apart. They need no Redis and build nothing else, so they run with the
//! library's unit tests (`cargo test --lib tidy`).
//!
//! - [`layering`]: no module imports one above it (ARCHITECTURE.md, "Layout", states the rules);
//! - [`docs_in_sync`]: the docs' cross-references resolve, the codemap names every source file, and
//!   docs/CONFIG.md's defaults are the config's.

mod docs_in_sync;
mod layering;

use std::path::{Path, PathBuf};

/// The repository's root: the kmqd crate's manifest directory.
fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every file under `dir` (relative to the root) whose name ends in one of `extensions`, sorted, as paths relative
/// to the root; directories named in `skip` are not entered.
fn files(dir: &str, extensions: &[&str], skip: &[&str]) -> Vec<PathBuf> {
    fn walk(dir: &Path, extensions: &[&str], skip: &[&str], out: &mut Vec<PathBuf>) {
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                if !skip.contains(&name.as_str()) {
                    walk(&path, extensions, skip, out);
                }
            } else if extensions.iter().any(|ext| name.ends_with(ext)) {
                out.push(path.strip_prefix(root()).unwrap().to_path_buf());
            }
        }
    }
    let mut out = Vec::new();
    walk(&root().join(dir), extensions, skip, &mut out);
    out.sort();
    out
}

/// The text of `path` (relative to the root).
fn read(path: &Path) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}
