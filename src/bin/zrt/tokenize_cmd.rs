//! `zrt tokenize`: text files to the flat token-id file
//! `examples/finetune_hf.rs` trains on, with a checkpoint's tokenizer
//! ([`zrt::tokenize`]).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use zrt::tokenize::{tokenize_files, TokenizeOptions};

/// Options of `zrt tokenize`.
#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// The tokenizer: a checkpoint's directory (its `tokenizer.json` and
    /// `tokenizer_config.json`) or a `tokenizer.json`.
    #[arg(long)]
    tokenizer: PathBuf,
    /// The file written: little-endian ids, one document's after
    /// another's.
    #[arg(long)]
    out: PathBuf,
    /// Write `u32` ids (a vocabulary past 65536), not `u16`.
    #[arg(long)]
    u32: bool,
    /// Append the tokenizer's end-of-text token (`eos_token`) to each
    /// document.
    #[arg(long)]
    eos: bool,
    /// The field of each `.jsonl` line holding its text.
    #[arg(long, default_value = "text", conflicts_with = "completion_only")]
    field: String,
    /// Each `.jsonl` line holds a `prompt` and its `completion` (TRL's
    /// format): the loss is to count the completion's tokens only, which
    /// `OUT.mask` (a byte a token, 1: counted) says; `finetune_hf
    /// --mask` reads it.
    #[arg(long)]
    completion_only: bool,
    /// The text: `.txt` files (a document each) and `.jsonl` files (a
    /// document a line), in order.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
}

/// Runs `zrt tokenize`.
pub fn run(a: &TokenizeArgs) -> Result<()> {
    let opts = TokenizeOptions {
        u32: a.u32,
        eos: a.eos,
        field: a.field.clone(),
        completion_only: a.completion_only,
    };
    let done = tokenize_files(&a.tokenizer, &a.inputs, &a.out, &opts)?;
    println!(
        "{}: {} tokens of {} documents, {} ids (the model's vocabulary must be at least {})",
        a.out.display(),
        done.tokens,
        done.documents,
        if a.u32 { "u32" } else { "u16" },
        done.vocab
    );
    if a.completion_only {
        println!(
            "{}: the loss counts {} of the {} tokens (the completions')",
            zrt::tokenize::mask_path(&a.out).display(),
            done.counted,
            done.tokens
        );
    }
    Ok(())
}
