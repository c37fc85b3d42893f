//! The `flashattn` command: `check` (against the f64 oracle), `bench` (flashattn next to the
//! standard attention) and `run` (attention on tensors read from a file). `flashattn --help`
//! lists the options and examples.

fn main() -> std::process::ExitCode {
    flashattn_cli::main()
}
