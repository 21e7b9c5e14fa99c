//! `zrt ckpt`: offline tools over a checkpoint directory (no ranks needed).

use std::path::PathBuf;

use anyhow::Result;
use clap::{Subcommand, ValueEnum};
use zrt::zero::checkpoint::{
    consolidate, consolidate_as, consolidate_sharded, inspect, ExportDtype,
};

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
        /// Write OUT as a directory of files of at most this many bytes
        /// of tensors each and their index (Hugging Face's sharded
        /// checkpoint, DeepSpeed's `zero_to_fp32.py --max_shard_size`):
        /// `5GB` (1e9 bytes each), `500MB`, `2GiB`, or a number of bytes.
        #[arg(long, value_parser = parse_size)]
        max_shard_size: Option<u64>,
        /// Write OUT as a directory `transformers`' `from_pretrained`
        /// reads: in the Hugging Face layout of the model this
        /// `config.json` describes (GPT-2: names under `transformer.`,
        /// its Conv1D matrices transposed; the Llama family's, from
        /// Llama to Qwen3-MoE: their own), the config beside the tensors.
        #[arg(long)]
        hf_config: Option<PathBuf>,
    },
}

/// A size as Hugging Face writes one: a number of bytes, or one with a
/// unit (`KB`, `MB`, `GB`, `TB`: powers of 1000; `KiB`, `MiB`, `GiB`,
/// `TiB`: of 1024), decimals allowed (`1.5GB`).
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        other => {
            return Err(format!(
                "`{other}` is not a unit of size: use KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (of 1024)"
            ))
        }
    };
    let n: f64 = number.parse().map_err(|_| {
        format!("`{s}` is not a size: write a number of bytes, or one with a unit, as 5GB")
    })?;
    let bytes = (n * scale as f64).round();
    if !(bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(format!(
            "`{s}` is no size a file can have: give at least 1 byte"
        ));
    }
    Ok(bytes as u64)
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
            max_shard_size,
            hf_config,
        } => {
            let dtype = match dtype {
                Dtype::Fp32 => ExportDtype::F32,
                Dtype::Bf16 => ExportDtype::Bf16,
            };
            let tag = tag.as_deref();
            let (n, files) = match (max_shard_size, hf_config) {
                (None, None) => (consolidate(dir, tag, out, dtype)?, String::new()),
                (Some(max), None) => {
                    let (n, files) = consolidate_sharded(dir, tag, out, dtype, *max)?;
                    (n, format!(" ({files} files)"))
                }
                (max, Some(config)) => {
                    // A directory, as from_pretrained reads one: one
                    // `model.safetensors` unless a file size is given.
                    let max = max.unwrap_or(u64::MAX);
                    let layout = zrt::hf::export_layout(config)?;
                    let (n, files) = consolidate_as(dir, tag, out, dtype, Some(max), &layout)?;
                    (
                        n,
                        format!(" ({files} files and config.json, Hugging Face's layout)"),
                    )
                }
            };
            println!("wrote {n} tensors to {}{files}", out.display());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_read_as_hugging_face_writes_them() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("1.5 MB"), Ok(1_500_000));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("5GG")
            .unwrap_err()
            .contains("`gg` is not a unit of size"));
        assert!(parse_size("GB").unwrap_err().contains("is not a size"));
        assert!(parse_size("0").unwrap_err().contains("at least 1 byte"));
    }
}
