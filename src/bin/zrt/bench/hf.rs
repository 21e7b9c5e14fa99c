//! `zrt bench hf`: a training step of the model a Hugging Face
//! `config.json` describes (any layout zrt builds), in zrt and in
//! `transformers`, on one rank, the same weights and tokens, against the
//! matmul peak measured in the same run (MFU).
//!
//! The peer (`bench/peers/hf_peer.py`, in the libtorch venv) builds the
//! model from the config with seed 0 and writes it with
//! `save_pretrained`; zrt loads that checkpoint, so both start from the
//! same weights. Both step on the same tokens with AdamW (zrt's engine at
//! stage 0, PyTorch's fused AdamW), and the table shows each side's
//! first and last loss: equal to about 1e-4 when they did the same work.
//! This is where a layout's own compute shows: Mamba-1's token-by-token
//! scan, the DeltaNet's and lightning attention's chunked forms.
//!
//! With `--lora-r` both sides train LoRA adapters on the frozen base:
//! the peer wraps its model with PEFT's `get_peft_model` and writes the
//! adapters as drawn, and zrt loads them (`lora::load_adapter`), so both
//! start from the same adapters too.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use tch::{nn::VarStore, Device, Kind, Tensor};

use super::peer::Peer;
use super::{cell, matmul_peak, median, time_each};
use zrt::collectives::local;
use zrt::hf::{HfModel, HfOptions};
use zrt::lora::LoraConfig;
use zrt::zero::{AutoHints, Config, Engine, ShardPlan};

/// Options of `zrt bench hf`.
#[derive(Args, Debug)]
pub struct HfArgs {
    /// The model's `config.json` (or the directory holding it): any
    /// layout `zrt estimate --hf-config` reads. Keep it small: the model
    /// is built twice, in zrt and in the peer, in fp32.
    #[arg(long)]
    config: PathBuf,
    /// Sequences a step.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i64).range(1..))]
    batch: i64,
    /// Tokens a sequence.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(i64).range(2..))]
    seq: i64,
    /// Intra-op threads, zrt's libtorch and the peer's alike.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i32).range(1..))]
    threads: i32,
    /// Interleaved rounds (zrt, peer, matmul peak, zrt, ...).
    #[arg(long, default_value_t = 3, value_parser = super::at_least_one())]
    rounds: usize,
    /// Timed steps per side per round (with more than one, the first
    /// round's first step is a warm-up, not timed).
    #[arg(long, default_value_t = 3, value_parser = super::at_least_one())]
    steps: usize,
    /// zrt's loss takes the head's logits whole (`finetune_hf
    /// --unfused-loss`), as the peer's does, rather than fusing the head
    /// with the loss (the default, which computes the head's product
    /// once more in backward where the logits take more than one of its
    /// blocks, 8M logits each, and the head trains: not under LoRA).
    #[arg(long)]
    unfused_loss: bool,
    /// Train LoRA adapters of this rank on the frozen base instead of
    /// the whole model: PEFT's on the peer's side, from the same draw.
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    lora_r: Option<i64>,
    /// The adapters' alpha.
    #[arg(long, default_value_t = 16.0, requires = "lora_r")]
    lora_alpha: f64,
    /// The modules the adapters go on, comma-separated (PEFT's
    /// `target_modules`; `all-linear` too); PEFT's default for the
    /// layout when not given.
    #[arg(long, requires = "lora_r")]
    lora_targets: Option<String>,
    /// One JSON object per row on stdout instead of a table.
    #[arg(long)]
    json: bool,
}

/// A scratch directory removed when dropped, even when the benchmark
/// fails half-way: the peer's checkpoint can be large.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The tokens `[batch, seq]` a step trains on, the peer's formula: every
/// step the same, every id below `vocab`.
fn tokens(batch: i64, seq: i64, vocab: i64) -> Tensor {
    ((Tensor::arange(batch * seq, (Kind::Int64, Device::Cpu)) * 7919 + 13).remainder(vocab))
        .view([batch, seq])
}

/// The config file `config` names (a directory's `config.json`).
fn config_file(config: &Path) -> PathBuf {
    if config.is_dir() {
        config.join("config.json")
    } else {
        config.to_path_buf()
    }
}

/// Runs the benchmark and prints its row pair.
pub fn run(args: &HfArgs) -> Result<()> {
    let file = config_file(&args.config);
    // Read here first: a layout zrt does not build is refused before the
    // peer spends a minute importing transformers and building it.
    let units = zrt::hf::unit_params(&file)
        .with_context(|| format!("--config {}", args.config.display()))?;
    let params: u64 = units.iter().map(|u| u.1).sum();
    // Both sides' weights, gradients and Adam moments (16 bytes each), the
    // checkpoint zrt reads, and zrt's flat copies; activations come on top.
    super::check_fits(
        params.checked_mul(2 * 16 + 4 + 8),
        &format!("--config {}", args.config.display()),
    )?;
    let scratch =
        Scratch(std::env::temp_dir().join(format!("zrt-bench-hf-{}", std::process::id())));
    let mut peer_args = vec![
        file.display().to_string(),
        scratch.0.display().to_string(),
        args.batch.to_string(),
        args.seq.to_string(),
        args.threads.to_string(),
    ];
    if let Some(r) = args.lora_r {
        let targets = (args.lora_targets.as_deref())
            .map(|t| match t {
                "all-linear" => json!(t),
                _ => json!(t.split(',').map(str::trim).collect::<Vec<_>>()),
            })
            .unwrap_or(Value::Null);
        let lora = json!({"r": r, "alpha": args.lora_alpha, "targets": targets});
        peer_args.push(lora.to_string());
    }
    let mut peer = Peer::start(
        include_str!("../../../../bench/peers/hf_peer.py"),
        &peer_args,
    )?;
    tch::set_num_threads(args.threads);
    let vs = VarStore::new(Device::Cpu);
    let plan = ShardPlan::new();
    // With LoRA, the adapters as PEFT drew them, and its settings as it
    // resolved them (its default targets for the layout among them).
    let adapter = scratch.0.join("adapter");
    let options = HfOptions {
        lora: match args.lora_r {
            Some(_) => Some(LoraConfig::from_adapter_dir(&adapter)?),
            None => None,
        },
        ..HfOptions::default()
    };
    let (model, _) = HfModel::from_pretrained_with(&vs, &plan, &scratch.0, &options)?;
    let cfg = Config::from_json(&format!(
        r#"{{"train_micro_batch_size_per_gpu": {}, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-4, "weight_decay": 0.0}}}}, "zero_optimization": {{"stage": 0}}}}"#,
        args.batch
    ))?;
    let group = local::world(1)
        .pop()
        .context("a world of one rank")?
        .new_group(&[0])?;
    let engine = Engine::new(&vs, &plan, &cfg, group, &AutoHints::default())?;
    if options.lora.is_some() {
        zrt::lora::load_adapter(&engine, &adapter)?;
    }
    let theirs = peer.hello["params"].as_u64().unwrap_or(0);
    if engine.num_params() as u64 != theirs {
        bail!(
            "zrt trains {} parameters and transformers {theirs} from {}: not the same model, so the timings would not compare",
            engine.num_params(),
            file.display()
        );
    }
    let tokens = tokens(args.batch, args.seq, model.vocab());
    model.set_training(true);
    model.set_fused_loss(!args.unfused_loss);
    let (mut zrt_losses, mut zrt_parts) = (Vec::new(), Vec::new());
    // Each part timed here, as the peer times its own: the engine's
    // `last_step_breakdown` counts into the forward everything since its
    // previous call, which after a round is the peer's whole round.
    let mut zrt_step = || -> Result<()> {
        let t0 = Instant::now();
        let loss = model.loss(&tokens);
        zrt_losses.push(loss.double_value(&[]));
        let t1 = Instant::now();
        engine.backward(&loss)?;
        let t2 = Instant::now();
        engine.step()?;
        zrt_parts.push([t1 - t0, t2 - t1, t2.elapsed()].map(|d| d.as_secs_f64()));
        Ok(())
    };

    let (mut zrt_times, mut peer_times, mut peer_losses, mut peaks) =
        (vec![], vec![], vec![], vec![]);
    let mut peer_parts: Vec<[f64; 3]> = Vec::new();
    let mut peer_peak = f64::NAN;
    for round in 0..args.rounds {
        let mut failed = None;
        let mut times = time_each(args.steps, || {
            if let Err(e) = zrt_step() {
                failed.get_or_insert(e);
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        let reply = peer.call(&json!({"steps": args.steps}))?;
        let mut theirs: Vec<f64> = (reply["times"].as_array())
            .with_context(|| format!("peer reply without times: {reply}"))?
            .iter()
            .filter_map(Value::as_f64)
            .collect();
        peer_losses
            .extend((reply["losses"].as_array().into_iter().flatten()).filter_map(Value::as_f64));
        peer_peak = reply["peak_rss_bytes"].as_f64().unwrap_or(f64::NAN);
        peer_parts.extend(
            reply["parts"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| [0, 1, 2].map(|i| p[i].as_f64().unwrap_or(f64::NAN))),
        );
        if round == 0 && args.steps > 1 {
            // The warm-up: allocations, libtorch's first kernels.
            for t in [&mut times, &mut theirs] {
                if !t.is_empty() {
                    t.remove(0);
                }
            }
        }
        zrt_times.extend(times);
        peer_times.extend(theirs);
        peaks.push(matmul_peak(args.threads));
        eprintln!("zrt bench hf: round {}/{} done", round + 1, args.rounds);
    }

    let json = config_json(&file);
    let model_type = json["model_type"].as_str().unwrap_or("?");
    let experts = has_experts(&json);
    let tokens_per_step = (args.batch * args.seq) as f64;
    let peak = median(&peaks);
    let (ours, peers) = (median(&zrt_times), median(&peer_times));
    // Each side's parts, the warm-up (round 0's first step) left out as
    // from the times.
    let warm = usize::from(args.steps > 1);
    // Each process's peak resident memory over the whole run (zrt's
    // includes reading the checkpoint; each holds one model).
    let rows = [
        (
            "zrt",
            ours,
            &zrt_losses,
            parts(zrt_parts.get(warm..)),
            zrt::peak_rss_bytes(),
        ),
        (
            "transformers",
            peers,
            &peer_losses,
            parts(peer_parts.get(warm..)),
            peer_peak,
        ),
    ];
    // A step's products: forward 2 a parameter a token, backward 2 for
    // the inputs' gradients and 2 for the weights'; under LoRA the base's
    // weights take none (the adapters' are left out, as small).
    let flops = match args.lora_r {
        Some(_) => 4.0,
        None => 6.0,
    };
    let trains = match args.lora_r {
        Some(r) => format!(
            ", LoRA r {r} on {} ({} adapter params; PEFT's on the peer's side)",
            (options.lora.as_ref()).map_or(String::new(), |l| l.target_modules.join(",")),
            engine.num_params()
        ),
        None => String::new(),
    };
    if !args.json {
        println!(
            "{model_type} ({:.2}M params{trains}), batch {} x seq {}, {} thread(s), {} rounds x {} steps, medians, zrt's head {} the loss; \
             MFU counts {flops} x params x tokens (attention left out; none with experts) against a {:.1} GFLOP/s matmul; \
             transformers {} with attention {}",
            params as f64 / 1e6,
            args.batch,
            args.seq,
            args.threads,
            args.rounds,
            args.steps,
            if args.unfused_loss { "apart from" } else { "fused with" },
            peak / 1e9,
            peer.hello["transformers"].as_str().unwrap_or("?"),
            peer.hello["attn_implementation"].as_str().unwrap_or("?"),
        );
        println!(
            "{:<14} {:>9} {:>9} {:>7} {:>11} {:>11} {:>8}   {:>7} {:>7} {:>7} {:>9}",
            "impl",
            "ms/step",
            "tok/s",
            "MFU",
            "first loss",
            "last loss",
            "vs peer",
            "fwd ms",
            "bwd ms",
            "opt ms",
            "peak MiB"
        );
    }
    for (name, secs, losses, [fwd, bwd, opt], peak_rss) in rows {
        let mfu = match experts {
            true => f64::NAN,
            false => flops * params as f64 * tokens_per_step / secs / peak,
        };
        let (first, last) = (
            losses.first().copied().unwrap_or(f64::NAN),
            losses.last().copied().unwrap_or(f64::NAN),
        );
        if args.json {
            println!(
                "{}",
                json!({
                    "bench": "hf", "impl": name, "model_type": model_type, "params": params,
                    "batch": args.batch, "seq": args.seq, "threads": args.threads,
                    "seconds_per_step": secs, "tokens_per_s": tokens_per_step / secs,
                    "first_loss": first, "last_loss": last,
                    "ratio_vs_peer": peers / secs,
                    "forward_s": fwd, "backward_s": bwd, "optimizer_s": opt,
                    "peak_rss_bytes": peak_rss,
                    "ratio_vs_limit": if mfu.is_finite() { json!(mfu) } else { Value::Null },
                    // The peer's loss takes the logits whole.
                    "fused_loss": name == "zrt" && !args.unfused_loss,
                    "lora_r": args.lora_r,
                })
            );
        } else {
            println!(
                "{:<14} {:>9.1} {:>9.0} {:>7} {:>11.6} {:>11.6} {:>8}   {:>7} {:>7} {:>7} {:>9}",
                name,
                secs * 1e3,
                tokens_per_step / secs,
                cell(100.0 * mfu, 1, "%"),
                first,
                last,
                cell(peers / secs, 2, "x"),
                cell(fwd * 1e3, 1, ""),
                cell(bwd * 1e3, 1, ""),
                cell(opt * 1e3, 1, ""),
                cell(peak_rss / f64::from(1 << 20), 0, ""),
            );
        }
    }
    Ok(())
}

/// The medians of each part of the steps `timed` (forward, backward,
/// optimizer seconds), NaN when there are none.
fn parts(timed: Option<&[[f64; 3]]>) -> [f64; 3] {
    let timed = timed.unwrap_or_default();
    [0, 1, 2].map(|i| median(&timed.iter().map(|p| p[i]).collect::<Vec<_>>()))
}

/// The config `file` as JSON (`Null` when it cannot be read: it was read
/// once already, by [`zrt::hf::unit_params`]).
fn config_json(file: &Path) -> Value {
    std::fs::read_to_string(file)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(Value::Null)
}

/// The keys under which the layouts zrt builds count their routed
/// experts (DBRX's under `ffn_config`).
const EXPERT_KEYS: [&str; 5] = [
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "moe_num_experts",
    "ffn_config",
];

/// Whether the config `j` routes tokens to some of several experts: then
/// 6 x params x tokens counts experts no token ran, and MFU is left out.
fn has_experts(j: &Value) -> bool {
    EXPERT_KEYS.iter().any(|k| {
        let v = match *k {
            "ffn_config" => &j[k]["moe_num_experts"],
            _ => &j[k],
        };
        v.as_u64().is_some_and(|n| n > 1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mfu_is_left_out_where_a_config_routes_to_experts_only() {
        for (config, routed) in [
            (json!({"model_type": "llama"}), false),
            (
                json!({"model_type": "mixtral", "num_local_experts": 8}),
                true,
            ),
            (json!({"model_type": "olmoe", "num_experts": 64}), true),
            (
                json!({"model_type": "deepseek_v3", "n_routed_experts": 256}),
                true,
            ),
            (
                json!({"model_type": "ernie4_5_moe", "moe_num_experts": 64}),
                true,
            ),
            (
                json!({"model_type": "dbrx", "ffn_config": {"moe_num_experts": 16}}),
                true,
            ),
            // Qwen3-Next with no experts is dense; one expert is a dense MLP.
            (json!({"model_type": "qwen3_next", "num_experts": 0}), false),
            (json!({"model_type": "jamba", "num_experts": 1}), false),
        ] {
            assert_eq!(has_experts(&config), routed, "{config}");
        }
    }

    #[test]
    fn every_config_the_repo_keeps_for_the_bench_is_one_zrt_builds() {
        // All of them Llama families but Phi's: read whole, the
        // quantization_config too (which `unit_params` leaves out to
        // count a dequantized model).
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/hf-configs");
        let mut read = vec![];
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let what = path.display();
            let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
            if stem != "phi" {
                let config = zrt::llama::LlamaConfig::from_hf_dir(&path);
                config.unwrap_or_else(|e| panic!("{what}: {e}"));
            }
            let units = zrt::hf::unit_params(&path).unwrap_or_else(|e| panic!("{what}: {e}"));
            let total: u64 = units.iter().map(|u| u.1).sum();
            assert!(total > 1_000_000, "{what}: {total} parameters");
            read.push(stem);
        }
        read.sort();
        let kept = [
            "bitnet",
            "doge",
            "llama",
            "longcat_flash",
            "mamba",
            "mamba2",
            "minimax",
            "phi",
            "qwen3_next",
            "recurrent_gemma",
            "rwkv",
            "xlstm",
            "zamba",
            "zamba2",
        ];
        assert_eq!(read, kept);
    }

    #[test]
    fn the_tokens_are_the_peers_formula_below_the_vocabulary() {
        let t = tokens(2, 3, 100);
        assert_eq!(t.size(), [2, 3]);
        let ids: Vec<i64> = t.view([-1]).try_into().unwrap();
        assert_eq!(ids, [13, 32, 51, 70, 89, 8]);
    }
}
