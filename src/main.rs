//! `kmqd`: parses the command line and hands over to the library; exit codes are mapped in one place
//! ([`kmqd::cli::Failure::exit_code`]).

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = kmqd::cli::Args::parse();
    match kmqd::cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            // Not eprintln!, which panics when standard error is closed: the exit code still tells.
            let _ = writeln!(std::io::stderr(), "kmqd: {failure}");
            ExitCode::from(failure.exit_code())
        }
    }
}
