//! # zrt
//!
//! ZeRO-sharded data-parallel training for models written with
//! [`tch`](https://docs.rs/tch) (libtorch), the FSDP / DeepSpeed-ZeRO idea in
//! Rust. This facade re-exports the workspace's crates:
//!
//! - [`collectives`]: process groups, device mesh, rendezvous, backends;
//! - [`kernels`]: fused Adam/AdamW and helpers on flat shards;
//! - [`offload`]: where optimizer state lives (device, host, NVMe);
//! - [`zero`]: flat buffers, stages 1-3, `ShardedModule`, engine, config.
//!
//! [`gpt`] is a small GPT whose blocks are `ShardedModule`s: the model of
//! the main job, the benchmarks and the parity tests; [`gpt2`] is GPT-2
//! as Hugging Face lays it out, which a pretrained checkpoint loads into
//! under any stage, as are [`gpt_neox`] (Pythia), [`phi`] (Phi-1 and 2) and [`llama`] (Llama,
//! Mistral, Qwen, Gemma, Phi-3 and the others of its family); [`tokenize`] turns text into the token files the
//! examples train on, with a checkpoint's own tokenizer, and
//! [`chat_template`] renders conversations with its chat template;
//! [`packing`] has the documents packed in one window attend only within
//! themselves;
//! [`generate`] continues a prompt. [`stop`] ends a
//! training loop after a step, with a checkpoint, when the job is asked to
//! stop (a scheduler's SIGTERM, Ctrl-C).
//!
//! # Training with ZeRO
//!
//! Wrap the model's blocks in `ShardedModule`s on a [`zero::ShardPlan`]
//! (the GPT here does), build the engine from a DeepSpeed config, and run
//! the program under `zrt launch --nproc-per-node N -- PROGRAM`, which
//! gives every rank the environment [`collectives::init_from_env`] reads.
//! Every rank runs the same loop; the engine shards the parameters,
//! gradients and optimizer state as the config's stage says, and
//! `backward` and `step` do the communication.
//!
//! ```no_run
//! use zrt::collectives::init_from_env;
//! use zrt::gpt::{Gpt, GptConfig};
//! use zrt::zero::{AutoHints, Config, Engine, ShardPlan};
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     zrt::init_logging(); // zrt's warnings to stderr (RUST_LOG filters)
//!     let cfg = Config::from_file("ds_config.json")?; // DeepSpeed JSON
//!     let mut dist = init_from_env()?; // the ranks `zrt launch` started
//!     let vs = tch::nn::VarStore::new(tch::Device::Cpu);
//!     let plan = ShardPlan::new();
//!     let shape = GptConfig { vocab: 256, d_model: 256, layers: 6, heads: 8, seq: 128 };
//!     let model = Gpt::new(&vs.root(), &plan, &shape); // blocks in ShardedModule::new(&plan, path, block)
//!     // Pretrained weights go into `vs` here: the engine takes rank 0's.
//!     let engine = Engine::from_config(&vs, &plan, &cfg, &mut dist, &AutoHints::default())?;
//!     for _ in 0..100 {
//!         let batch = tch::Tensor::randint(256, [8, 129], (tch::Kind::Int64, tch::Device::Cpu));
//!         let loss = model.loss(&batch);
//!         engine.backward(&loss)?; // or loss.backward(): the hooks reduce either way
//!         engine.step()?; // steps at the accumulation boundary only
//!     }
//!     engine.save_checkpoint("checkpoints", "step100")?;
//!     Ok(())
//! }
//! ```
//!
//! The README's "Using it" goes on from there: parameter groups, monitors,
//! activation checkpointing, reading stage 3's parameters, hybrid sharding
//! and checkpoints.

mod blocks;
#[cfg(feature = "tokenize")]
pub mod chat_template;
pub mod generate;
pub mod gpt;
pub mod gpt2;
pub mod gpt_neox;
pub mod hf;
mod kv_cache;
pub mod llama;
pub mod lora;
pub mod mxfp4;
pub mod packing;
pub mod phi;
pub mod stop;
#[cfg(feature = "tokenize")]
pub mod tokenize;

/// This process's peak resident set size in bytes (VmHWM), NaN where
/// /proc is not available: what the main job and `zrt bench train` report.
pub fn peak_rss_bytes() -> f64 {
    zrt_zero::resident_bytes().1.unwrap_or(f64::NAN)
}

/// What [`init_logging`] shows when `RUST_LOG` is not set: warnings and
/// errors from everywhere, and the engine's and offload's info lines
/// (`"auto"` values resolved, `wall_clock_breakdown`, checkpoints saved,
/// what went to NVMe).
pub const DEFAULT_LOG_FILTER: &str = "warn,zrt_zero=info,zrt_offload=info";

/// Sends the workspace's [`tracing`](https://docs.rs/tracing) events to
/// stderr, filtered by `RUST_LOG` (e.g. `RUST_LOG=zrt_collectives=debug`),
/// else by [`DEFAULT_LOG_FILTER`]. The libraries only emit events; a
/// program calls this once at the start of `main` (the main job and the
/// `zrt` CLI do), or installs a subscriber of its own. Without one, warnings
/// such as a config key zrt ignores are never seen. Later calls, or a
/// subscriber already installed, leave things as they are.
pub fn init_logging() {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let set = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty());
    let (filter, refused) = match set.as_deref().map(EnvFilter::try_new) {
        Some(Ok(f)) => (f, None),
        Some(Err(e)) => (EnvFilter::new(DEFAULT_LOG_FILTER), Some(e)),
        None => (EnvFilter::new(DEFAULT_LOG_FILTER), None),
    };
    let installed = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        // Under `zrt launch` stderr is a pipe: no colour codes in the lines.
        .with_ansi(std::io::stderr().is_terminal())
        .try_init()
        .is_ok();
    if let (true, Some(e), Some(v)) = (installed, refused, set) {
        tracing::warn!("RUST_LOG={v:?} is not a filter ({e}); logging with {DEFAULT_LOG_FILTER:?}");
    }
}

pub use zrt_collectives as collectives;
pub use zrt_kernels as kernels;
pub use zrt_offload as offload;
pub use zrt_zero as zero;

#[cfg(test)]
mod tests {
    /// The first fenced block after `start` in `text`, up to its closing fence.
    fn block<'a>(text: &'a str, start: &str, fence: &str) -> &'a str {
        let from = text.find(start).map_or(text.len(), |i| i + start.len());
        let body = &text[from..];
        let body = body.find(fence).map_or("", |i| &body[i + fence.len()..]);
        body.find("```").map_or(body, |i| &body[..i])
    }

    /// The README's "Using it" program is this crate's doc example, which
    /// `cargo test` compiles: a change to one that the other lacks would
    /// leave the README showing code that no longer builds.
    #[test]
    fn the_readmes_program_is_the_compiled_doc_example() {
        let readme = block(include_str!("../README.md"), "## Using it", "```rust\n");
        let doc: String = block(
            include_str!("lib.rs"),
            "# Training with ZeRO",
            "```no_run\n",
        )
        .lines()
        .map(|l| {
            let l = l.trim_start_matches("//!");
            format!("{}\n", l.strip_prefix(' ').unwrap_or(l))
        })
        .collect();
        assert!(readme.contains("Engine::from_config"), "{readme}");
        assert_eq!(readme.trim_end(), doc.trim_end());
    }
}
