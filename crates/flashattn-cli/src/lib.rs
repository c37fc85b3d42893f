//! The command-line tool: argument parsing, the three subcommands and their shared pieces.
//!
//! Exit status: 0 on success, 1 when `check` finds a configuration out of bounds, 2 for bad
//! usage or bad input (unknown option, unreadable or inconsistent tensor file, a device that is
//! not there, ...).

mod accuracy;
mod args;
mod bench;
mod bench_table;
mod check;
mod device;
mod inputs;
mod json;
mod layer_bench;
mod layer_run;
mod linear_bench;
mod linear_run;
mod memory;
mod output;
mod plot;
mod run;
mod table;
mod tensor_files;
mod timing;

use std::process::ExitCode;

use clap::Parser;

use args::{Cli, Command};

/// A failure of the command, shown as `error: ...` with exit status 2.
#[derive(Debug)]
pub enum CliError {
    /// The library refused the call (an invalid argument, a missing backend, ...).
    Lib(flashattn::Error),
    /// Anything else, with its message.
    Msg(String),
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CliError::Lib(e) => write!(f, "{e}"),
            CliError::Msg(m) => f.write_str(m),
        }
    }
}

impl From<flashattn::Error> for CliError {
    fn from(e: flashattn::Error) -> Self {
        CliError::Lib(e)
    }
}

/// Shorthand for building a [`CliError`].
pub fn fail(msg: impl Into<String>) -> CliError {
    CliError::Msg(msg.into())
}

/// What a subcommand returns: whether every check passed, or an error.
pub type CliResult<T> = Result<T, CliError>;

/// Exit status of a check that found a configuration out of bounds.
const EXIT_CHECK_FAILED: u8 = 1;
/// Exit status of bad usage or bad input.
const EXIT_USAGE: u8 = 2;

/// Parses the command line, runs the subcommand and maps the outcome to the exit status.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.command {
        Command::Check(a) => check::run(&a),
        Command::Bench(a) => bench::run(&a).map(|()| true),
        Command::Run(a) => run::run(&a).map(|()| true),
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(EXIT_CHECK_FAILED),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_USAGE)
        }
    }
}
