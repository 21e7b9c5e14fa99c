//! The `zrt` command line: launch ranks, run benchmarks, inspect checkpoints
//! and configs, estimate memory, merge a LoRA adapter, dequantize an
//! MXFP4 checkpoint, tokenize text,
//! continue a prompt.

mod bench;
mod ckpt;
mod config_cmd;
mod dequantize_cmd;
mod estimate;
#[cfg(feature = "tokenize")]
mod generate_cmd;
mod launch;
mod lora_cmd;
#[cfg(feature = "tokenize")]
mod tokenize_cmd;

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
    /// Example: zrt launch --nproc-per-node 2 -- target/release/examples/train_gpt --steps 50
    Launch(launch::LaunchArgs),
    /// Run a benchmark and print numbers next to a peer and a limit measured in the same run.
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
    },
    /// Inspect or consolidate a sharded checkpoint (`inspect DIR`, `consolidate DIR OUT`).
    Ckpt {
        #[command(subcommand)]
        which: ckpt::CkptCmd,
    },
    /// Check a DeepSpeed JSON config and print it resolved (`check FILE [--world N]`).
    Config {
        #[command(subcommand)]
        which: config_cmd::ConfigCmd,
    },
    /// Estimate model-state memory per rank for each ZeRO stage.
    Estimate(estimate::EstimateArgs),
    /// Write an MXFP4 checkpoint (GPT-OSS's as published) out with its experts in bf16.
    ///
    /// Example: zrt dequantize --from gpt-oss-20b --out gpt-oss-20b-bf16
    Dequantize(dequantize_cmd::DequantizeArgs),
    /// Fold a LoRA adapter into its base checkpoint (`merge --base DIR --adapter DIR --out DIR`).
    Lora {
        #[command(subcommand)]
        which: lora_cmd::LoraCmd,
    },
    /// Tokenize text with a checkpoint's tokenizer into the id file the examples train on.
    ///
    /// Example: zrt tokenize --tokenizer llama --out train.bin --eos corpus.jsonl
    #[cfg(feature = "tokenize")]
    Tokenize(tokenize_cmd::TokenizeArgs),
    /// Continue a prompt with a Hugging Face checkpoint (a fine-tune's export), greedily or sampled.
    ///
    /// Example: zrt generate --model tuned --prompt "Once upon a time" --do-sample --top-p 0.9
    #[cfg(feature = "tokenize")]
    Generate(generate_cmd::GenerateArgs),
}

#[derive(Subcommand, Debug)]
enum BenchCmd {
    /// Fused AdamW on one shard vs PyTorch fused AdamW, DeepSpeed CPUAdam and copy bandwidth.
    Adam(bench::adam::AdamArgs),
    /// all_reduce / reduce_scatter / all_gather bandwidth vs gloo and memcpy.
    Collectives(bench::collectives::CollectivesArgs),
    /// One rank of `bench collectives` (started by it).
    #[command(hide = true)]
    CollectivesRank(bench::collectives::RankArgs),
    /// Training step time and memory per ZeRO stage and world size.
    Train(bench::train::TrainArgs),
    /// One rank of `bench train` (started by it).
    #[command(hide = true)]
    TrainRank(bench::train::TrainRankArgs),
    /// Optimizer step with NVMe offload vs in memory and raw disk speed.
    Offload(bench::offload::OffloadArgs),
    /// A Hugging Face config's training step in zrt vs transformers, same weights and tokens.
    Hf(bench::hf::HfArgs),
    /// A language model's head and loss fused (zrt's default) vs its logits taken whole.
    Loss(bench::loss::LossArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    zrt::init_logging();
    let result = match cli.command {
        Cmd::Bench {
            which: BenchCmd::Adam(a),
        } => bench::adam::run(&a),
        Cmd::Bench {
            which: BenchCmd::Collectives(a),
        } => bench::collectives::run(&a),
        Cmd::Bench {
            which: BenchCmd::CollectivesRank(a),
        } => bench::collectives::rank_main(&a),
        Cmd::Bench {
            which: BenchCmd::Train(a),
        } => bench::train::run(&a),
        Cmd::Bench {
            which: BenchCmd::TrainRank(a),
        } => bench::train::rank_main(&a),
        Cmd::Bench {
            which: BenchCmd::Offload(a),
        } => bench::offload::run(&a),
        Cmd::Bench {
            which: BenchCmd::Hf(a),
        } => bench::hf::run(&a),
        Cmd::Bench {
            which: BenchCmd::Loss(a),
        } => bench::loss::run(&a),
        Cmd::Launch(a) => match launch::run(&a) {
            Ok(code) => return code,
            Err(e) => Err(e),
        },
        Cmd::Ckpt { which } => ckpt::run(&which),
        Cmd::Config { which } => config_cmd::run(&which),
        Cmd::Estimate(a) => estimate::run(&a),
        Cmd::Lora { which } => lora_cmd::run(&which),
        Cmd::Dequantize(a) => dequantize_cmd::run(&a),
        #[cfg(feature = "tokenize")]
        Cmd::Tokenize(a) => tokenize_cmd::run(&a),
        #[cfg(feature = "tokenize")]
        Cmd::Generate(a) => generate_cmd::run(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("zrt: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
