//! `kmqd`: parses the command line and hands over to the library; exit codes are mapped in one place
//! ([`kmqd::cli::Failure::exit_code`]).

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = kmqd::cli::Args::parse();
    match kmqd::cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("kmqd: {failure}");
            ExitCode::from(failure.exit_code())
        }
    }
}
