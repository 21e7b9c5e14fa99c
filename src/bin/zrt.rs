//! The `zrt` command line: launch ranks, run benchmarks, inspect checkpoints
//! and configs, estimate memory.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// zrt: ZeRO-sharded data-parallel training for tch (libtorch) models.
#[derive(Parser, Debug)]
#[command(name = "zrt", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Start N ranks of a program with the torchrun environment contract.
    ///
    /// Example: zrt launch --nproc-per-node 2 -- target/release/examples/train_gpt
    Launch {
        /// Arguments: launcher options, then `--`, then the program and its arguments.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Run a benchmark (collectives, adam, train, offload) and print numbers
    /// next to a peer and a limit measured in the same run.
    Bench {
        /// Which benchmark, then its options.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Inspect or consolidate a sharded checkpoint.
    Ckpt {
        /// `inspect DIR` or `consolidate DIR OUT.safetensors`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Check a DeepSpeed JSON config and print it resolved.
    Config {
        /// `check FILE [--world N]`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Estimate model-state memory per rank for each ZeRO stage.
    Estimate {
        /// `--params N --world N`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let name = match cli.command {
        Cmd::Launch { .. } => "launch",
        Cmd::Bench { .. } => "bench",
        Cmd::Ckpt { .. } => "ckpt",
        Cmd::Config { .. } => "config",
        Cmd::Estimate { .. } => "estimate",
    };
    eprintln!("zrt {name}: not implemented in this build yet");
    ExitCode::from(2)
}
