//! `zrt lora merge --base DIR --adapter DIR --out DIR`: a PEFT adapter
//! folded into its base checkpoint ([`zrt::lora::merge`]).

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Subcommand};

/// `zrt lora` subcommands.
#[derive(Subcommand, Debug)]
pub enum LoraCmd {
    /// Fold a LoRA adapter into its base checkpoint (PEFT's merge_and_unload), file by file.
    Merge(MergeArgs),
}

/// Options of `zrt lora merge`.
#[derive(Args, Debug)]
pub struct MergeArgs {
    /// The base checkpoint: a `save_pretrained` directory.
    #[arg(long)]
    base: PathBuf,
    /// The adapter: PEFT's directory (`adapter_config.json`,
    /// `adapter_model.safetensors`), `finetune_hf --lora-r`'s `--out`.
    #[arg(long)]
    adapter: PathBuf,
    /// Where the merged checkpoint goes (the base's files, names and
    /// config; `transformers` and `zrt generate` load it).
    #[arg(long)]
    out: PathBuf,
}

/// Runs a `zrt lora` subcommand.
pub fn run(cmd: &LoraCmd) -> Result<()> {
    match cmd {
        LoraCmd::Merge(a) => {
            let m = zrt::lora::merge(&a.base, &a.adapter, &a.out)?;
            let saved = match m.replaced.len() {
                0 => String::new(),
                n => format!(" and replaced {n} tensors (modules_to_save, trainable tokens)"),
            };
            let biases = match m.biases.len() {
                0 => String::new(),
                n => format!(", {n} biases (lora_bias)"),
            };
            println!(
                "merged {} matrices{biases}{saved} into {} ({} files)",
                m.matrices.len(),
                a.out.display(),
                m.files
            );
            Ok(())
        }
    }
}
