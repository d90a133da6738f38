//! `kmqd-bench`: the benchmark's command line (the benchmark itself is the library, `kmqd_bench`); exit codes
//! as kmqd's ([`kmqd::cli::Failure::exit_code`]).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kmqd::cli::{Failure, init_logging};

/// Measure kmqd against a private redis-server (needs no config): push rates, drain rates in both modes with 1, 2
/// and 4 daemons, idle wake-up latency, delayed-task lateness, memory. See docs/PERFORMANCE.md.
#[derive(Parser, Debug)]
#[command(name = "kmqd-bench", version)]
pub struct BenchArgs {
    /// Tasks per drain run of no-op tasks (the handlers scenario sizes its own runs: about 3 s each).
    #[arg(long, default_value_t = 200_000)]
    pub tasks: usize,
    /// Runs per figure; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Daemon process counts for the drain runs.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub daemons: Vec<usize>,
    /// Only these scenarios.
    #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(kmqd_bench::SCENARIOS))]
    pub only: Vec<String>,
    /// Handler threads per daemon.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Claim batch.
    #[arg(long, default_value_t = 1000)]
    pub batch: usize,
    /// Claimed tasks that may wait for a worker, per daemon (a deep prefetch keeps a no-op drain busy; see
    /// docs/PERFORMANCE.md).
    #[arg(long, default_value_t = 4000)]
    pub prefetch: usize,
    /// Where libkmq_testkit.so is (default: next to the kmqd binary).
    #[arg(long)]
    pub plugins_dir: Option<PathBuf>,
    /// The backlog whose drain the peak-RSS figure measures.
    #[arg(long, default_value_t = 1_000_000)]
    pub backlog: usize,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Compare with the peers: a results directory of ../shared/bench/peers/run.sh from this session (see
    /// scripts/bench-peers).
    #[arg(long, value_name = "RESULTS_DIR")]
    pub peers: Option<PathBuf>,
    /// Run this kmqd binary as the daemon (default: the kmqd next to kmqd-bench): two builds measured in one
    /// session.
    #[arg(long, value_name = "KMQD")]
    pub daemon: Option<PathBuf>,
}

fn main() -> ExitCode {
    match run_bench(BenchArgs::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            // Not eprintln!, which panics when standard error is closed: the exit code still tells.
            let _ = writeln!(std::io::stderr(), "kmqd-bench: {failure}");
            ExitCode::from(failure.exit_code())
        }
    }
}

fn run_bench(args: BenchArgs) -> Result<(), Failure> {
    init_logging("warn");
    let options = kmqd_bench::Options {
        tasks: args.tasks,
        runs: args.runs.max(1),
        daemons: args.daemons,
        only: args.only,
        workers: args.workers,
        batch: args.batch,
        prefetch: args.prefetch,
        plugins_dir: args.plugins_dir,
        backlog: args.backlog,
        peers: args.peers,
        daemon: args.daemon,
    };
    let report = kmqd_bench::run(options, &mut std::io::stderr()).map_err(Failure::Runtime)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("report serializes")
        );
    } else {
        print!("{}", kmqd_bench::render(&report));
    }
    Ok(())
}
