//! `zrt dequantize --from DIR --out DIR`: an MXFP4 checkpoint (GPT-OSS's
//! as published) written out with its experts in bf16
//! ([`zrt::mxfp4::dequantize`]).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

/// Options of `zrt dequantize`.
#[derive(Args, Debug)]
pub struct DequantizeArgs {
    /// The MXFP4 checkpoint: a `save_pretrained` directory whose
    /// `config.json` has a `quantization_config` of `quant_method` mxfp4.
    #[arg(long)]
    from: PathBuf,
    /// Where the bf16 checkpoint goes (the same files, names and config
    /// without `quantization_config`; zrt and `transformers` load it).
    #[arg(long)]
    out: PathBuf,
}

/// Runs `zrt dequantize`.
pub fn run(a: &DequantizeArgs) -> Result<()> {
    let d = zrt::mxfp4::dequantize(&a.from, &a.out)?;
    println!(
        "dequantized {} tensors into {} ({} files)",
        d.tensors.len(),
        a.out.display(),
        d.files
    );
    Ok(())
}
