//! `zrt ckpt`: offline tools over a checkpoint directory (no ranks needed).

use std::path::PathBuf;

use anyhow::Result;
use clap::{Subcommand, ValueEnum};
use zrt::zero::checkpoint::{consolidate, inspect, ExportDtype};

/// `zrt ckpt` subcommands.
#[derive(Subcommand, Debug)]
pub enum CkptCmd {
    /// Print what a checkpoint holds and verify every file's checksum.
    Inspect {
        /// The checkpoint directory (the one holding `latest`).
        dir: PathBuf,
        /// The tag to inspect (default: the one `latest` names).
        #[arg(long)]
        tag: Option<String>,
    },
    /// Rebuild the model's full weights into one safetensors file, under
    /// the original parameter names (loadable by tch and Python torch).
    Consolidate {
        /// The checkpoint directory (the one holding `latest`).
        dir: PathBuf,
        /// The safetensors file to write.
        out: PathBuf,
        /// The tag to consolidate (default: the one `latest` names).
        #[arg(long)]
        tag: Option<String>,
        /// The dtype of the written weights.
        #[arg(long, value_enum, default_value_t = Dtype::Fp32)]
        dtype: Dtype,
    },
}

/// `--dtype` of `zrt ckpt consolidate`.
#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum Dtype {
    /// The fp32 master weights, exactly.
    Fp32,
    /// bf16, rounded to nearest even.
    Bf16,
}

/// Runs a `zrt ckpt` subcommand.
pub fn run(cmd: &CkptCmd) -> Result<()> {
    match cmd {
        CkptCmd::Inspect { dir, tag } => print!("{}", inspect(dir, tag.as_deref())?),
        CkptCmd::Consolidate {
            dir,
            out,
            tag,
            dtype,
        } => {
            let dtype = match dtype {
                Dtype::Fp32 => ExportDtype::F32,
                Dtype::Bf16 => ExportDtype::Bf16,
            };
            let n = consolidate(dir, tag.as_deref(), out, dtype)?;
            println!("wrote {n} tensors to {}", out.display());
        }
    }
    Ok(())
}
