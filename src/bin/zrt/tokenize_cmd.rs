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
    /// document (not to a conversation: its chat template ends it).
    #[arg(long)]
    eos: bool,
    /// The field of each `.jsonl` line holding its text (a line without
    /// it whose `messages` is a list of messages is a conversation,
    /// rendered with the tokenizer's chat template).
    #[arg(long, default_value = "text", conflicts_with_all = ["completion_only", "assistant_only"])]
    field: String,
    /// Each `.jsonl` line holds a `prompt` and its `completion` (TRL's
    /// format): the loss is to count the completion's tokens only, which
    /// `OUT.mask` (a byte a token, 1: counted) says; `finetune_hf
    /// --mask` reads it.
    /// Lines whose `prompt` and `completion` are lists of messages are
    /// rendered with the tokenizer's chat template.
    #[arg(long)]
    completion_only: bool,
    /// Each `.jsonl` line is a conversation (`messages`, TRL's
    /// conversational format): the loss is to count the assistant's
    /// turns only, what the chat template's `{% generation %}` blocks
    /// render (TRL's `assistant_only_loss`), which `OUT.mask` says.
    #[arg(long, conflicts_with = "completion_only")]
    assistant_only: bool,
    /// Also write `OUT.docs` (a byte a token, 1 at each document's first
    /// token), which `finetune_hf --documents` reads to pack documents:
    /// where no token id tells the ends (a chat template ends every turn
    /// with the token that ends the conversation).
    #[arg(long)]
    document_starts: bool,
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
        assistant_only: a.assistant_only,
        document_starts: a.document_starts,
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
    if a.completion_only || a.assistant_only {
        println!(
            "{}: the loss counts {} of the {} tokens (the {})",
            zrt::tokenize::mask_path(&a.out).display(),
            done.counted,
            done.tokens,
            if a.completion_only {
                "completions'"
            } else {
                "assistant's turns'"
            }
        );
    }
    if a.document_starts {
        println!(
            "{}: where each of the {} documents starts",
            zrt::tokenize::documents_path(&a.out).display(),
            done.documents
        );
    }
    Ok(())
}
