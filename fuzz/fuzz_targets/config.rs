//! `Config::parse` on arbitrary text: it never panics, and every error names the file (most also the line and
//! column), as the README promises.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    kmqd_fuzz::check_config(text);
});
