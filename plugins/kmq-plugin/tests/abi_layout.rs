//! The C header is the ABI's source of truth; this test proves the Rust mirror in `kmq_plugin::abi` agrees with
//! it. It writes a C program that prints `sizeof` and `offsetof` of every struct and field of
//! `plugins/include/kmq_plugin.h` (and the values of its constants), compiles it with the system C compiler, runs
//! it, and compares each line with `size_of` / `offset_of!` on the Rust side.

use std::mem::{offset_of, size_of};
use std::path::Path;
use std::process::Command;

use kmq_plugin::abi::{
    self, CompleteFn, EntryFn, HandleFn, HostFn, InitFn, KmqBuf, KmqHost, KmqPlugin, KmqStatus,
    KmqStr, KmqTask, OnDeadFn, ResultFn, ShutdownFn, StartFn,
};

/// One fact about the layout: the C expression that computes it, and what Rust says it is.
struct Fact {
    c_expression: String,
    rust: usize,
}

fn size(c_type: &str, rust: usize) -> Fact {
    Fact {
        c_expression: format!("sizeof({c_type})"),
        rust,
    }
}

fn offset(c_type: &str, c_field: &str, rust: usize) -> Fact {
    Fact {
        c_expression: format!("offsetof({c_type}, {c_field})"),
        rust,
    }
}

fn constant(c_name: &str, rust: i64) -> Fact {
    Fact {
        c_expression: format!("(size_t)({c_name})"),
        rust: usize::try_from(rust).expect("the ABI's constants are small and non-negative"),
    }
}

/// Every struct, every field (in header order) and every constant of the header.
fn facts() -> Vec<Fact> {
    vec![
        size("kmq_str", size_of::<KmqStr>()),
        offset("kmq_str", "ptr", offset_of!(KmqStr, ptr)),
        offset("kmq_str", "len", offset_of!(KmqStr, len)),
        size("kmq_task", size_of::<KmqTask>()),
        offset("kmq_task", "id", offset_of!(KmqTask, id)),
        offset("kmq_task", "queue", offset_of!(KmqTask, queue)),
        offset("kmq_task", "type", offset_of!(KmqTask, type_)),
        offset("kmq_task", "data", offset_of!(KmqTask, data)),
        offset("kmq_task", "attempt", offset_of!(KmqTask, attempt)),
        offset(
            "kmq_task",
            "created_at_ms",
            offset_of!(KmqTask, created_at_ms),
        ),
        offset("kmq_task", "deadline_ms", offset_of!(KmqTask, deadline_ms)),
        offset("kmq_task", "cancel", offset_of!(KmqTask, cancel)),
        offset(
            "kmq_task",
            "retry_after_ms",
            offset_of!(KmqTask, retry_after_ms),
        ),
        offset("kmq_task", "run", offset_of!(KmqTask, run)),
        size("kmq_host", size_of::<KmqHost>()),
        offset("kmq_host", "struct_size", offset_of!(KmqHost, struct_size)),
        offset("kmq_host", "result", offset_of!(KmqHost, result)),
        offset("kmq_host", "progress", offset_of!(KmqHost, progress)),
        size("kmq_status", size_of::<KmqStatus>()),
        constant("KMQ_DONE", abi::KMQ_DONE.into()),
        constant("KMQ_RETRY", abi::KMQ_RETRY.into()),
        constant("KMQ_FAIL", abi::KMQ_FAIL.into()),
        size("kmq_buf", size_of::<KmqBuf>()),
        offset("kmq_buf", "ptr", offset_of!(KmqBuf, ptr)),
        offset("kmq_buf", "cap", offset_of!(KmqBuf, cap)),
        offset("kmq_buf", "len", offset_of!(KmqBuf, len)),
        size("kmq_plugin", size_of::<KmqPlugin>()),
        offset(
            "kmq_plugin",
            "abi_version",
            offset_of!(KmqPlugin, abi_version),
        ),
        offset(
            "kmq_plugin",
            "struct_size",
            offset_of!(KmqPlugin, struct_size),
        ),
        offset("kmq_plugin", "name", offset_of!(KmqPlugin, name)),
        offset("kmq_plugin", "types", offset_of!(KmqPlugin, types)),
        offset("kmq_plugin", "init", offset_of!(KmqPlugin, init)),
        offset("kmq_plugin", "handle", offset_of!(KmqPlugin, handle)),
        offset("kmq_plugin", "on_dead", offset_of!(KmqPlugin, on_dead)),
        offset("kmq_plugin", "shutdown", offset_of!(KmqPlugin, shutdown)),
        offset("kmq_plugin", "start", offset_of!(KmqPlugin, start)),
        offset("kmq_plugin", "host", offset_of!(KmqPlugin, host)),
        // The function pointers are nullable in C, so the Rust side wraps them in Option: same size, NULL is None.
        size("((kmq_plugin *)0)->init", size_of::<Option<InitFn>>()),
        size("((kmq_plugin *)0)->handle", size_of::<Option<HandleFn>>()),
        size("((kmq_plugin *)0)->on_dead", size_of::<Option<OnDeadFn>>()),
        size(
            "((kmq_plugin *)0)->shutdown",
            size_of::<Option<ShutdownFn>>(),
        ),
        size("((kmq_plugin *)0)->start", size_of::<Option<StartFn>>()),
        size("((kmq_plugin *)0)->host", size_of::<Option<HostFn>>()),
        size("((kmq_host *)0)->result", size_of::<Option<ResultFn>>()),
        size("kmq_complete_fn", size_of::<CompleteFn>()),
        size("&kmq_plugin_v1", size_of::<EntryFn>()),
        constant("KMQ_ABI_VERSION", abi::KMQ_ABI_VERSION.into()),
    ]
}

fn include_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../include"))
}

#[test]
fn header_and_rust_abi_types_agree_on_every_size_offset_and_constant() {
    let facts = facts();
    let dir = tempfile::tempdir().expect("temp dir");
    let mut program = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include \"kmq_plugin.h\"\n\nint main(void) {\n",
    );
    for fact in &facts {
        program.push_str(&format!(
            "    printf(\"%zu\\n\", (size_t){});\n",
            fact.c_expression
        ));
    }
    program.push_str("    return 0;\n}\n");
    let source = dir.path().join("layout.c");
    let binary = dir.path().join("layout");
    std::fs::write(&source, &program).expect("write layout.c");

    let compiled = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Werror", "-I"])
        .arg(include_dir())
        .arg("-o")
        .arg(&binary)
        .arg(&source)
        .output()
        .unwrap_or_else(|error| {
            panic!("cannot run the C compiler `cc` ({error}); install one (apt-get install gcc): this test needs it")
        });
    assert!(
        compiled.status.success(),
        "cc could not compile the layout program against kmq_plugin.h:\n{}\n{program}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    let output = Command::new(&binary)
        .output()
        .expect("run the layout program");
    assert!(output.status.success(), "the layout program failed");
    let printed = String::from_utf8(output.stdout).expect("ASCII digits");
    let c_values: Vec<usize> = printed
        .lines()
        .map(|line| line.parse().expect("one number per line"))
        .collect();
    assert_eq!(c_values.len(), facts.len(), "one line per fact:\n{printed}");

    let disagreements: Vec<String> = facts
        .iter()
        .zip(&c_values)
        .filter(|(fact, c_value)| fact.rust != **c_value)
        .map(|(fact, c_value)| {
            format!(
                "{}: C says {c_value}, Rust says {}",
                fact.c_expression, fact.rust
            )
        })
        .collect();
    assert!(
        disagreements.is_empty(),
        "kmq_plugin.h and kmq_plugin::abi disagree; fix abi.rs to match the header:\n{}",
        disagreements.join("\n")
    );
}

#[test]
fn the_exported_symbol_is_the_one_the_header_declares() {
    let header = std::fs::read_to_string(include_dir().join("kmq_plugin.h")).expect("read header");
    let symbol = std::str::from_utf8(abi::PLUGIN_SYMBOL)
        .expect("ASCII")
        .trim_end_matches('\0');
    assert!(
        header.contains(&format!("const kmq_plugin *{symbol}(void);")),
        "kmq_plugin.h does not declare `const kmq_plugin *{symbol}(void);`"
    );
    assert_eq!(
        symbol,
        format!("kmq_plugin_v{}", abi::KMQ_ABI_VERSION),
        "the symbol carries the ABI version"
    );
}
