//! Structure-aware `Config::parse`: a valid config (config/*.toml, or fuzz/src/every-key.toml) with some of its
//! `key = value` lines given other values (range edges, durations that overflow, names kmqd knows, other TOML
//! types), removed or written twice. Most inputs stay valid TOML, so the fuzzer spends its time in validation,
//! which arbitrary text rarely reaches. Same checks as the `config` target.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    base: u8,
    edits: Vec<Edit<'a>>,
}

#[derive(Arbitrary, Debug)]
struct Edit<'a> {
    /// Which `key = value` line of the base (modulo their number).
    line: u16,
    change: Change<'a>,
}

#[derive(Arbitrary, Debug)]
enum Change<'a> {
    /// One of `kmqd_fuzz::INTERESTING` (modulo their number).
    Interesting(u8),
    Integer(i64),
    /// A duration string: a number and a unit.
    Duration(u64, Unit),
    Float(f64),
    /// A TOML string holding this text.
    Text(&'a str),
    /// This text as it is, after `key = `.
    Raw(&'a str),
    Remove,
    Twice,
}

#[derive(Arbitrary, Debug)]
enum Unit {
    Ns,
    Ms,
    S,
    M,
    H,
    D,
    Y,
}

fuzz_target!(|input: Input<'_>| {
    let base = kmqd_fuzz::BASES[usize::from(input.base) % kmqd_fuzz::BASES.len()];
    let mut lines: Vec<String> = base.lines().map(str::to_string).collect();
    for edit in input.edits.iter().take(16) {
        let editable: Vec<usize> = (0..lines.len())
            .filter(|&i| {
                let line = lines[i].trim_start();
                !line.starts_with('#') && !line.starts_with('[') && line.contains('=')
            })
            .collect();
        if editable.is_empty() {
            break;
        }
        let index = editable[usize::from(edit.line) % editable.len()];
        let key = lines[index]
            .split('=')
            .next()
            .unwrap_or("")
            .trim_end()
            .to_string();
        let value = match &edit.change {
            Change::Interesting(n) => {
                kmqd_fuzz::INTERESTING[usize::from(*n) % kmqd_fuzz::INTERESTING.len()].to_string()
            }
            Change::Integer(n) => n.to_string(),
            Change::Duration(n, unit) => format!("\"{n}{}\"", unit.suffix()),
            Change::Float(f) => format!("{f:?}"),
            Change::Text(text) => toml_string(text),
            Change::Raw(text) => text.to_string(),
            Change::Remove => {
                lines.remove(index);
                continue;
            }
            Change::Twice => {
                let line = lines[index].clone();
                lines.insert(index, line);
                continue;
            }
        };
        lines[index] = format!("{key} = {value}");
    }
    kmqd_fuzz::check_config(&lines.join("\n"));
});

impl Unit {
    fn suffix(&self) -> &'static str {
        match self {
            Unit::Ns => "ns",
            Unit::Ms => "ms",
            Unit::S => "s",
            Unit::M => "m",
            Unit::H => "h",
            Unit::D => "d",
            Unit::Y => "y",
        }
    }
}

/// A TOML basic string holding `text`.
fn toml_string(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
