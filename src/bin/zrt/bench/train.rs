//! `zrt bench train`: training step time and memory per ZeRO stage and
//! world size, on the GPT of the main job, measured in the same run as a
//! matmul peak (for MFU) and next to DESIGN.md's memory formula and the
//! ZeRO communication volumes.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use serde_json::{json, Value};
use tch::{nn, Device, Kind, Tensor};

use super::{median, peer, run_ranks};
use crate::estimate::model_state_bytes;
use zrt::collectives::{init_from_env, ProcessGroup, ReduceOp};
use zrt::gpt::{is_mlp_param, layerdrop, Gpt, GptConfig};
use zrt::zero::{AutoHints, Config, Engine, ShardPlan};

/// Options of `zrt bench train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// ZeRO stages to measure.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,3")]
    stages: Vec<u8>,
    /// World sizes (ranks as processes on each of `--backends`).
    #[arg(long, value_delimiter = ',', default_value = "1,2", value_parser = super::at_least_one())]
    worlds: Vec<usize>,
    /// Model sizes: `base` (the issue's GPT: vocab 8192, d 512, 8 layers,
    /// 8 heads, seq 256) and `large` (about 3x the parameters: d 768, 12 layers).
    #[arg(long, value_delimiter = ',', default_value = "base,large")]
    sizes: Vec<String>,
    /// Micro-batch per rank.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(i64).range(1..))]
    micro: i64,
    /// Timed steps per configuration per round (after one warm-up step).
    #[arg(long, default_value_t = 3, value_parser = super::at_least_one())]
    steps: usize,
    /// Interleaved rounds over all configurations.
    #[arg(long, default_value_t = 2, value_parser = super::at_least_one())]
    rounds: usize,
    /// Also run the peers (PyTorch DDP, FSDP2 ZeRO-3/ZeRO-2, DeepSpeed ZeRO
    /// 1-3) on 2 ranks, gloo, in the libtorch venv (DeepSpeed rows need
    /// `deepspeed`).
    #[arg(long)]
    peer: bool,
    /// Freeze every block's MLP weights (`fc`, `out`: two thirds of a
    /// block), in zrt and in the peers, as a LoRA fine-tune freezes its
    /// base: params, formula and ZeRO volume then count the trainable ones.
    #[arg(long)]
    freeze_mlp: bool,
    /// Recompute every block's activations in backward, in zrt
    /// (`Gpt::new_checkpointed`) and in the peers (each block in
    /// `checkpoint_wrapper`, non-reentrant, inside `fully_shard` as
    /// torchtitan applies it). MFU still counts model FLOPs, not the
    /// recompute.
    #[arg(long)]
    checkpoint_activations: bool,
    /// Leave each block out of a step's forward with this chance, drawn on
    /// each rank apart (`zrt::gpt::layerdrop`, the same draws in zrt and
    /// the peer): zrt declares the blocks with
    /// `ShardPlan::unused_on_some_ranks`, the peer is DDP with
    /// `find_unused_parameters=True`, PyTorch's option for it (FSDP2 and
    /// DeepSpeed have none, and are left out). MFU counts every block.
    #[arg(long, default_value_t = 0.0, value_parser = chance)]
    layerdrop: f64,
    /// With `--layerdrop`: every rank leaves out the same blocks (rank 0's
    /// draws), in zrt and the peer, so the ranks' work is equal. zrt still
    /// declares the blocks; the time waited is then what is left with
    /// equal work, and its difference from a run without this flag what
    /// the ranks' unequal work costs.
    #[arg(long)]
    layerdrop_same: bool,
    /// Leave each block's MLP out of a step's forward with this chance,
    /// the block running, drawn on each rank apart (the same draws in zrt
    /// and the peer): experts no token reached, as it were. zrt declares
    /// the MLPs with `ShardPlan::partly_unused_on_some_ranks` (stage 3
    /// keeps them sharded); the peer is DDP with
    /// `find_unused_parameters=True` (FSDP2 aborts on such a model:
    /// `bench/peers/fsdp2_partly_unused.py`; DeepSpeed is left out too).
    /// MFU counts every MLP.
    #[arg(long, default_value_t = 0.0, value_parser = chance)]
    mlp_drop: f64,
    /// The optimizer: adamw (lr 1e-4), or muon: Muon for the blocks'
    /// matrices (0.02, momentum 0.95, Nesterov's), AdamW for the rest
    /// (1e-4, betas (0.9, 0.95), eps 1e-10), weight decay 0.01 both. With
    /// muon the peer is DDP with `torch.optim.Muon` and `AdamW` over the
    /// same split (FSDP2's shards would each orthogonalize a piece of a
    /// matrix, which is not Muon; DeepSpeed is left out). MFU counts the
    /// model's FLOPs, not the Newton-Schulz iterations; the memory
    /// formula counts one moment for Muon's matrices.
    #[arg(long, default_value = "adamw", value_parser = ["adamw", "muon"])]
    optimizer: String,
    /// `zero_optimization.reduce_bucket_size`s to measure every stage with,
    /// in elements (DeepSpeed's default: 5e8). Several are interleaved like
    /// the stages: `5e8,5e5` shows what small buckets (which also bound the
    /// gradients in flight during backward to two of them) cost in step
    /// time and save in peak RSS. The peers keep their defaults; the
    /// summary's ratios use the first size listed.
    #[arg(long, value_delimiter = ',', default_value = "5e8")]
    reduce_bucket_sizes: Vec<f64>,
    /// zrt backends the ranks use, interleaved like the stages: shm, and
    /// tcp (on loopback: what a job across hosts runs on). The peers use
    /// gloo, over TCP, either way.
    #[arg(long, value_delimiter = ',', default_value = "shm", value_parser = ["shm", "tcp"])]
    backends: Vec<String>,
    /// One JSON object per row on stdout instead of a table.
    #[arg(long)]
    json: bool,
    /// Also write PNG plots of step time and memory per stage into this
    /// directory (`step_time.png`, `memory.png`).
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
}

/// Options of the hidden per-rank half.
#[derive(Args, Debug)]
pub struct TrainRankArgs {
    #[arg(long)]
    stage: u8,
    #[arg(long)]
    size: String,
    #[arg(long)]
    micro: i64,
    #[arg(long)]
    steps: usize,
    #[arg(long)]
    freeze_mlp: bool,
    #[arg(long)]
    checkpoint_activations: bool,
    #[arg(long, default_value_t = 5e8)]
    reduce_bucket_size: f64,
    #[arg(long, default_value_t = 0.0)]
    layerdrop: f64,
    #[arg(long)]
    layerdrop_same: bool,
    #[arg(long, default_value_t = 0.0)]
    mlp_drop: f64,
    #[arg(long, default_value = "adamw")]
    optimizer: String,
}

/// A chance from 0 up to (not including) 1 (`--layerdrop`).
fn chance(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if (0.0..1.0).contains(&p) => Ok(p),
        _ => Err(format!(
            "`{s}` is not a chance from 0 up to (not including) 1"
        )),
    }
}

fn gpt(size: &str) -> Result<GptConfig> {
    Ok(match size {
        "base" => GptConfig {
            vocab: 8192,
            d_model: 512,
            layers: 8,
            heads: 8,
            seq: 256,
        },
        "large" => GptConfig {
            vocab: 8192,
            d_model: 768,
            layers: 12,
            heads: 12,
            seq: 256,
        },
        "tiny" => GptConfig {
            vocab: 256,
            d_model: 64,
            layers: 2,
            heads: 2,
            seq: 32,
        },
        other => bail!("unknown --sizes entry `{other}`: use base, large or tiny"),
    })
}

/// FLOPs of one training step of `c` on `tokens` tokens: 6 per trained
/// parameter per token (forward + backward), 4 per frozen one (no weight
/// gradient), plus attention's 12 x layers x d x seq per token.
fn step_flops(c: &GptConfig, params: f64, frozen: f64, tokens: f64) -> f64 {
    (6.0 * params + 4.0 * frozen) * tokens + 12.0 * (c.layers * c.d_model * c.seq) as f64 * tokens
}

/// Freezes every block's MLP weights (`--freeze-mlp`); their elements.
fn freeze_mlp(vs: &nn::VarStore) -> usize {
    let mut n = 0;
    for (name, t) in vs.variables() {
        if name.starts_with("h.") && (name.ends_with(".fc.weight") || name.ends_with(".out.weight"))
        {
            let _ = t.set_requires_grad(false);
            n += t.numel();
        }
    }
    n
}

/// Runs inside each rank: times `steps` training steps, prints rank 0's row.
pub fn rank_main(a: &TrainRankArgs) -> Result<()> {
    tch::set_num_threads(1);
    let mut dist = init_from_env()?;
    let (rank, n) = (dist.env().rank, dist.env().world_size);
    let backend = format!("{:?}", dist.backend()).to_lowercase();
    let c = gpt(&a.size)?;
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let plan = ShardPlan::new();
    let model = if a.checkpoint_activations {
        Gpt::new_checkpointed(&vs.root(), &plan, &c)
    } else {
        Gpt::new(&vs.root(), &plan, &c)
    };
    let frozen = if a.freeze_mlp { freeze_mlp(&vs) } else { 0 };
    if a.layerdrop > 0.0 {
        plan.unused_on_some_ranks(|name, _| name.starts_with("h."))?;
    }
    if a.mlp_drop > 0.0 {
        plan.partly_unused_on_some_ranks(|name, _| is_mlp_param(name))?;
    }
    let optimizer = match a.optimizer.as_str() {
        "muon" => {
            r#"{"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 1e-4, "weight_decay": 0.01}}"#
        }
        _ => r#"{"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}"#,
    };
    let cfg = Config::from_json(&format!(
        r#"{{"train_micro_batch_size_per_gpu": {}, "optimizer": {optimizer},
            "gradient_clipping": 1.0, "zero_optimization": {{"stage": {}, "reduce_bucket_size": {}}}}}"#,
        a.micro, a.stage, a.reduce_bucket_size
    ))?;
    let group = dist.new_group(&(0..n).collect::<Vec<_>>())?;
    let engine = Engine::new(&vs, &plan, &cfg, group, &AutoHints::default())?;
    let batch = || Tensor::randint(c.vocab, [a.micro, c.seq + 1], (Kind::Int64, Device::Cpu));
    let stats = || engine.group().stats().snapshot();
    let mut times = Vec::new();
    let (mut comm_s, mut comm_elems, mut wait_s) = (0.0, 0.0, 0.0);
    for s in 0..=a.steps {
        let before = stats();
        let t = Instant::now();
        // Each rank its own draws (or rank 0's), as the peer makes them.
        let drawer = if a.layerdrop_same { 0 } else { rank };
        let seed = (s * n + drawer) as u64;
        let skipped = layerdrop(a.layerdrop, c.layers, seed);
        // The MLPs' draws: another stream (the seed's high bit).
        model.leave_out_mlps(&layerdrop(a.mlp_drop, c.layers, seed | 1 << 63));
        engine.backward(&model.loss_skipping(&batch(), &skipped))?;
        engine.step()?;
        let dt = t.elapsed().as_secs_f64();
        if s > 0 {
            times.push(dt);
            wait_s += engine
                .last_step_breakdown()
                .map_or(0.0, |b| b.comm_wait.as_secs_f64());
            for (x, y) in stats().iter().zip(&before) {
                comm_s += (x.time - y.time).as_secs_f64();
                comm_elems += (x.bytes_sent - y.bytes_sent) as f64 / 4.0;
            }
        }
    }
    let t = engine.group().all_reduce(times, ReduceOp::Max).wait()?;
    let rss = engine
        .group()
        .all_gather(vec![zrt::peak_rss_bytes()], Vec::new())
        .wait()?
        .1;
    let state = engine.model_state_bytes()? as f64;
    if rank == 0 {
        println!(
            "@@zrt {}",
            json!({
                "times": t, "rss": rss, "model_state_bytes": state, "params": engine.num_params(), "frozen": frozen,
                "muon_params": engine.num_muon_params(),
                "backend": backend,
                "comm_seconds_per_step": comm_s / a.steps as f64, "comm_elements_per_step": comm_elems / a.steps as f64,
                "comm_wait_seconds_per_step": wait_s / a.steps as f64,
            })
        );
    }
    Ok(())
}

/// Single-thread fp32 matmul GFLOP/s (the peak MFU is measured against).
fn matmul_peak() -> f64 {
    tch::set_num_threads(1);
    let a = Tensor::randn([1024, 1024], (Kind::Float, Device::Cpu));
    let _ = a.matmul(&a);
    let t = Instant::now();
    for _ in 0..5 {
        let _ = a.matmul(&a);
    }
    2.0 * 1024f64.powi(3) * 5.0 / t.elapsed().as_secs_f64()
}

/// `zrt bench train`'s label of a bucket size: `500k`, `500M`, `262144`.
fn bucket_label(b: f64) -> String {
    match b {
        b if b >= 1e6 && b % 1e6 == 0.0 => format!("{}M", b / 1e6),
        b if b >= 1e3 && b % 1e3 == 0.0 => format!("{}k", b / 1e3),
        b => b.to_string(),
    }
}

fn run_rank(
    me: &std::path::Path,
    (size, world, stage, bucket, backend): &Measured,
    a: &TrainArgs,
) -> Result<Value> {
    let args: Vec<String> = [
        "bench",
        "train-rank",
        "--stage",
        &stage.to_string(),
        "--size",
        size,
        "--micro",
        &a.micro.to_string(),
        "--steps",
        &a.steps.to_string(),
        "--reduce-bucket-size",
        &bucket.to_string(),
        "--layerdrop",
        &a.layerdrop.to_string(),
        "--mlp-drop",
        &a.mlp_drop.to_string(),
        "--optimizer",
        &a.optimizer,
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(a.freeze_mlp.then(|| "--freeze-mlp".to_string()))
    .chain(a.layerdrop_same.then(|| "--layerdrop-same".to_string()))
    .chain(
        a.checkpoint_activations
            .then(|| "--checkpoint-activations".to_string()),
    )
    .collect();
    run_ranks(me, &args, *world, &[("ZRT_BACKEND", backend.clone())])
}

/// One zrt configuration: model size, world, stage, `reduce_bucket_size`,
/// backend.
type Measured = (String, usize, u8, f64, String);

/// The PyTorch peers `--peer` runs (bench/peers/train_peer.py modes).
const PEERS: [&str; 6] = [
    "ddp",
    "fsdp2_zero3",
    "fsdp2_zero2",
    "deepspeed_zero1",
    "deepspeed_zero2",
    "deepspeed_zero3",
];

/// Median step time of a set of rank-0 rows.
fn median_time(rows: &[Value]) -> f64 {
    median(
        &rows
            .iter()
            .flat_map(|r| r["times"].as_array().cloned().unwrap_or_default())
            .filter_map(|v| v.as_f64())
            .collect::<Vec<_>>(),
    )
}

/// Largest peak RSS over the ranks of a set of rows.
fn max_rss(rows: &[Value]) -> f64 {
    rows.iter()
        .flat_map(|r| r["rss"].as_array().cloned().unwrap_or_default())
        .filter_map(|v| v.as_f64())
        .fold(f64::NAN, f64::max)
}

pub fn run(a: &TrainArgs) -> Result<()> {
    let me = std::env::current_exe()?;
    if a.reduce_bucket_sizes.is_empty() {
        bail!("--reduce-bucket-sizes is empty: give at least one size, e.g. 5e8");
    }
    if a.layerdrop_same && a.layerdrop == 0.0 {
        bail!("--layerdrop-same makes the ranks leave out the same blocks: give the chance too, e.g. --layerdrop 0.2");
    }
    if let Some(b) = a
        .reduce_bucket_sizes
        .iter()
        .find(|b| !(b.is_finite() && **b >= 1.0 && b.fract() == 0.0))
    {
        bail!(
            "--reduce-bucket-sizes entry {b}: a bucket is a whole number of elements, at least 1"
        );
    }
    // Bucket sizes are named in the rows only when they are not DeepSpeed's
    // default alone.
    let name_buckets = a.reduce_bucket_sizes != [5e8];
    let mut configs: Vec<Measured> = Vec::new();
    for size in &a.sizes {
        gpt(size)?;
        for &world in &a.worlds {
            for &stage in &a.stages {
                for &bucket in &a.reduce_bucket_sizes {
                    for backend in &a.backends {
                        configs.push((size.clone(), world, stage, bucket, backend.clone()));
                    }
                }
            }
        }
    }
    // DeepSpeed is optional in the venv: without it its peers are left out
    // with one line, not a traceback per peer and round and rows of NaN.
    // (Under --layerdrop or --mlp-drop there are no DeepSpeed rows to
    // leave out.)
    let uneven = a.layerdrop > 0.0 || a.mlp_drop > 0.0;
    let muon = a.optimizer == "muon";
    // The runs whose only peer is DDP.
    let ddp_only = uneven || muon;
    let deepspeed_missing = match a.peer && !ddp_only {
        true => peer::import_fails(&peer::venv_python(), "deepspeed"),
        false => None,
    };
    if let Some(why) = &deepspeed_missing {
        eprintln!(
            "zrt bench train: DeepSpeed's rows are left out, the venv cannot import it \
             ({why}); `$(cargo xtask python) -m pip install deepspeed ninja` adds them"
        );
    }
    let peers: Vec<(String, &str)> = if a.peer {
        a.sizes
            .iter()
            .flat_map(|s| PEERS.iter().map(move |p| (s.clone(), *p)))
            .filter(|(_, p)| deepspeed_missing.is_none() || !p.starts_with("deepspeed"))
            // Only DDP trains a module some ranks skip, or use in part,
            // or runs Muon over whole matrices.
            .filter(|(_, p)| !ddp_only || *p == "ddp")
            .collect()
    } else {
        Vec::new()
    };
    let script = std::env::temp_dir().join(format!("zrt-train-peer-{}.py", std::process::id()));
    if a.peer {
        std::fs::write(
            &script,
            include_str!("../../../../bench/peers/train_peer.py"),
        )?;
    }
    let mut samples: Vec<Vec<Value>> = configs.iter().map(|_| Vec::new()).collect();
    let mut peer_samples: Vec<Vec<Value>> = peers.iter().map(|_| Vec::new()).collect();
    let mut peaks = Vec::new();
    // Interleaved: every configuration and every peer once per round.
    for round in 0..a.rounds {
        peaks.push(matmul_peak());
        for (k, c) in configs.iter().enumerate() {
            samples[k].push(run_rank(&me, c, a)?);
        }
        for (k, (size, mode)) in peers.iter().enumerate() {
            let args = vec![
                script.display().to_string(),
                mode.to_string(),
                size.clone(),
                a.micro.to_string(),
                a.steps.to_string(),
                (a.freeze_mlp as u8).to_string(),
                (a.checkpoint_activations as u8).to_string(),
                a.layerdrop.to_string(),
                (a.layerdrop_same as u8).to_string(),
                a.mlp_drop.to_string(),
                a.optimizer.clone(),
            ];
            match run_ranks(&peer::venv_python(), &args, 2, &[]) {
                Ok(v) => peer_samples[k].push(v),
                Err(e) => eprintln!("zrt bench train: peer {mode} on {size} failed: {e:#}"),
            }
        }
        eprintln!("zrt bench train: round {}/{} done", round + 1, a.rounds);
    }
    let _ = std::fs::remove_file(&script);
    let peak = median(&peaks);
    let peer_rows = |size: &str, mode: &str| -> &[Value] {
        peers
            .iter()
            .zip(&peer_samples)
            .find(|((s, m), _)| s == size && *m == mode)
            .map_or(&[], |(_, r)| r.as_slice())
    };
    // Backends are named in the rows only when there are several.
    let several_backends = a.backends.len() > 1;
    if !a.json {
        println!(
            "fp32 {}, micro-batch {} per rank, 1 thread per rank, {} backend{}; medians of {} rounds x {} steps; matmul peak {:.1} GFLOP/s per core{}{}{}{}",
            match muon {
                true => "Muon (the blocks' matrices) and AdamW (the rest; MFU leaves out the Newton-Schulz FLOPs)",
                false => "AdamW",
            },
            a.micro,
            a.backends.join(" and "),
            if several_backends { "s" } else { "" },
            a.rounds,
            a.steps,
            peak / 1e9,
            match a.freeze_mlp {
                true => "; every block's MLP weights frozen (params, formula and ZeRO volume count the trained ones)",
                false => "",
            },
            match a.checkpoint_activations {
                true => "; every block's activations recomputed in backward (MFU counts model FLOPs, not the recompute)",
                false => "",
            },
            match a.layerdrop > 0.0 {
                true => format!(
                    "; LayerDrop {}: each block left out with that chance, {} (zrt: ShardPlan::unused_on_some_ranks; DDP: find_unused_parameters; MFU counts every block)",
                    a.layerdrop,
                    match a.layerdrop_same {
                        true => "the same blocks on every rank",
                        false => "drawn on each rank apart",
                    }
                ),
                false => String::new(),
            },
            match a.mlp_drop > 0.0 {
                true => format!(
                    "; MLP drop {}: each block's MLP left out with that chance, the block running, drawn on each rank apart (zrt: ShardPlan::partly_unused_on_some_ranks; DDP: find_unused_parameters; MFU counts every MLP)",
                    a.mlp_drop
                ),
                false => String::new(),
            }
        );
        println!(
            "{:<6} {:>5} {:<16} {:>8} {:>9} {:>8} {:>6} {:>9} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8}",
            "model",
            "world",
            "impl",
            "params",
            "s/step",
            "tok/s",
            "MFU",
            "RSS MiB",
            "state MiB",
            "formula",
            "comm Mel",
            "ZeRO Mel",
            "comm s",
            "wait s"
        );
    }
    let mib = |b: f64| b / (1u64 << 20) as f64;
    // (size, world, stage, s/step, peak RSS, model state, formula) for --plot.
    let mut plotted = Vec::new();
    let tag = |backend: &str| match several_backends {
        true => format!(" {backend}"),
        false => String::new(),
    };
    for ((size, world, stage, bucket, backend), rows) in configs.iter().zip(&samples) {
        let c = gpt(size)?;
        let name = match name_buckets {
            true => format!("zrt zero{stage} b{}", bucket_label(*bucket)),
            false => format!("zrt zero{stage}"),
        } + &tag(backend);
        let get = |f: &str| -> Vec<f64> { rows.iter().filter_map(|r| r[f].as_f64()).collect() };
        let t = median_time(rows);
        let params = rows
            .first()
            .and_then(|r| r["params"].as_f64())
            .unwrap_or(f64::NAN);
        let frozen = rows
            .first()
            .and_then(|r| r["frozen"].as_f64())
            .unwrap_or(0.0);
        let n = *world as f64;
        let tokens = (a.micro * c.seq) as f64 * n;
        let flops = step_flops(&c, params, frozen, tokens) / t;
        let mfu = flops / (peak * n);
        let rss = max_rss(rows);
        let state = median(&get("model_state_bytes"));
        // Muon's matrices keep one moment, the rest AdamW's two.
        let muon = (rows.first())
            .and_then(|r| r["muon_params"].as_f64())
            .unwrap_or(0.0);
        let formula = model_state_bytes(*stage, params, n, 4.0, 2.0 - muon / params);
        let comm = median(&get("comm_elements_per_step"));
        // Elements that must cross ranks per step by ZeRO's accounting: 2 Psi
        // (stages 0-2) or 3 Psi (stage 3), times (n-1)/n; none alone.
        let per_psi = if *stage == 3 { 3.0 } else { 2.0 };
        let zero = if *world == 1 {
            0.0
        } else {
            per_psi * params * (n - 1.0) / n
        };
        // Time the collectives took on their worker, and the part of it the
        // step was blocked on (the rest overlapped compute).
        let comm_time = median(&get("comm_seconds_per_step"));
        let wait = median(&get("comm_wait_seconds_per_step"));
        // The FSDP2 peer of a stage: reshard after forward for ZeRO-3, not otherwise.
        let fsdp = if *stage == 3 {
            "fsdp2_zero3"
        } else {
            "fsdp2_zero2"
        };
        let vs = |mode: &str| {
            if a.peer && *world == 2 {
                median_time(peer_rows(size, mode)) / t
            } else {
                f64::NAN
            }
        };
        let rss_vs = if a.peer && *world == 2 {
            max_rss(peer_rows(size, fsdp)) / rss
        } else {
            f64::NAN
        };
        let opt = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
        let line = match name_buckets {
            true => format!("{size} bucket {}", bucket_label(*bucket)),
            false => size.clone(),
        } + &tag(backend);
        plotted.push((line, *world, *stage, t, rss, state, formula));
        if a.json {
            println!(
                "{}",
                json!({
                    "bench": "train", "model": size, "world": world, "impl": format!("zrt_zero{stage}"), "stage": stage,
                    // The backend the ranks said they ran on.
                    "backend": rows.first().map_or(Value::Null, |r| r["backend"].clone()),
                    "reduce_bucket_size": bucket,
                    "params": params, "seconds_per_step": t, "tokens_per_s": tokens / t, "flops_per_s": flops, "mfu": mfu,
                    "matmul_peak_flops_per_s": peak, "peak_rss_bytes": rss, "model_state_bytes": state,
                    "formula_bytes": formula, "comm_elements_per_step": comm, "zero_volume_elements": zero,
                    "comm_seconds_per_step": comm_time, "comm_wait_seconds_per_step": wait,
                    "ratio_step_time_vs_fsdp2": opt(vs(fsdp)),
                    "ratio_step_time_vs_ddp": opt(vs("ddp")), "ratio_rss_vs_fsdp2": opt(rss_vs),
                    "freeze_mlp": a.freeze_mlp, "checkpoint_activations": a.checkpoint_activations,
                    "layerdrop": a.layerdrop, "layerdrop_same": a.layerdrop_same, "mlp_drop": a.mlp_drop,
                })
            );
        } else {
            println!(
                "{:<6} {:>5} {:<16} {:>7.1}M {:>9.3} {:>8.0} {:>5.1}% {:>9.0} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>8.3} {:>8.3}",
                size,
                world,
                name,
                params / 1e6,
                t,
                tokens / t,
                mfu * 100.0,
                mib(rss),
                mib(state),
                mib(formula),
                comm / 1e6,
                zero / 1e6,
                comm_time,
                wait
            );
        }
    }
    for (size, mode) in &peers {
        let c = gpt(size)?;
        let rows = peer_rows(size, mode);
        let (t, rss) = (median_time(rows), max_rss(rows));
        let tokens = (a.micro * c.seq * 2) as f64;
        if rows.is_empty() {
            // Its errors went to stderr as each round failed.
            match a.json {
                true => println!(
                    "{}",
                    json!({"bench": "train", "model": size, "world": 2, "impl": mode, "failed": true})
                ),
                false => println!(
                    "{:<6} {:>5} {:<16} failed in every round (its errors are above)",
                    size, 2, mode
                ),
            }
        } else if a.json {
            println!(
                "{}",
                json!({"bench": "train", "model": size, "world": 2, "impl": mode, "seconds_per_step": t, "tokens_per_s": tokens / t, "peak_rss_bytes": rss,
                    "freeze_mlp": a.freeze_mlp, "checkpoint_activations": a.checkpoint_activations,
                    "layerdrop": a.layerdrop, "layerdrop_same": a.layerdrop_same, "mlp_drop": a.mlp_drop})
            );
        } else {
            println!(
                "{:<6} {:>5} {:<16} {:>8} {:>9.3} {:>8.0} {:>6} {:>9.0}",
                size,
                2,
                mode,
                "",
                t,
                tokens / t,
                "",
                mib(rss)
            );
        }
    }
    if let Some(dir) = &a.plot {
        plots(dir, &plotted, &peers, &peer_rows)?;
        if !a.json {
            println!(
                "plots: {}/step_time.png, {}/memory.png",
                dir.display(),
                dir.display()
            );
        }
    }
    if !a.json && a.peer && ddp_only {
        // FSDP2 has no rows to compare with: DDP, per stage.
        for ((size, world, stage, bucket, backend), rows) in configs.iter().zip(&samples) {
            let ddp = peer_rows(size, "ddp");
            if *world != 2 || *bucket != a.reduce_bucket_sizes[0] || ddp.is_empty() {
                continue;
            }
            let mut what = Vec::new();
            if a.layerdrop > 0.0 {
                let same = if a.layerdrop_same {
                    " (same blocks)"
                } else {
                    ""
                };
                what.push(format!("LayerDrop {}{same}", a.layerdrop));
            }
            if a.mlp_drop > 0.0 {
                what.push(format!("MLP drop {}", a.mlp_drop));
            }
            if muon {
                what.push("Muon".to_string());
            }
            let peer = match (uneven, muon) {
                (true, true) => "DDP (find_unused_parameters, torch.optim.Muon)",
                (true, false) => "DDP (find_unused_parameters)",
                _ => "DDP (torch.optim.Muon and AdamW)",
            };
            println!(
                "{size} ZeRO-{stage}, 2 ranks{}, {}: {peer} / zrt step time {:.2}x, peak RSS {:.2}x (higher is better for zrt)",
                tag(backend),
                what.join(", "),
                median_time(ddp) / median_time(rows),
                max_rss(ddp) / max_rss(rows)
            );
        }
    }
    if !a.json && a.peer {
        for size in &a.sizes {
            for ((stage, fsdp), backend) in [(3u8, "fsdp2_zero3"), (2, "fsdp2_zero2")]
                .into_iter()
                .flat_map(|s| a.backends.iter().map(move |b| (s, b)))
            {
                let Some(rows) = configs
                    .iter()
                    .zip(&samples)
                    .find(|((s, w, st, b, be), _)| {
                        s == size
                            && *w == 2
                            && *st == stage
                            && *b == a.reduce_bucket_sizes[0]
                            && be == backend
                    })
                    .map(|(_, r)| r)
                else {
                    continue;
                };
                if peer_rows(size, fsdp).is_empty() {
                    // It failed in every round: its row says so.
                    continue;
                }
                let t = median_time(rows);
                println!(
                    "{size} ZeRO-{stage}, 2 ranks{}: FSDP2 / zrt step time {:.2}x, DDP / zrt {:.2}x, FSDP2 / zrt peak RSS {:.2}x (higher is better for zrt)",
                    match several_backends {
                        true => format!(", zrt on {backend}"),
                        false => String::new(),
                    },
                    median_time(peer_rows(size, fsdp)) / t,
                    median_time(peer_rows(size, "ddp")) / t,
                    max_rss(peer_rows(size, fsdp)) / max_rss(rows)
                );
            }
        }
    }
    Ok(())
}

/// One zrt configuration's figures, as `--plot` draws them.
type Plotted = (String, usize, u8, f64, f64, f64, f64);

/// The stage a peer's row sits at on the plots' x axis.
fn peer_stage(mode: &str) -> Option<f64> {
    Some(match mode {
        "ddp" => 0.0,
        "deepspeed_zero1" => 1.0,
        "fsdp2_zero2" | "deepspeed_zero2" => 2.0,
        "fsdp2_zero3" | "deepspeed_zero3" => 3.0,
        _ => return None,
    })
}

/// Writes `step_time.png` and `memory.png` into `dir`.
fn plots<'a>(
    dir: &std::path::Path,
    rows: &[Plotted],
    peers: &[(String, &str)],
    peer_rows: &dyn Fn(&str, &str) -> &'a [Value],
) -> Result<()> {
    use super::plot::{by_stage, Series};
    std::fs::create_dir_all(dir)?;
    let mib = |b: f64| b / (1u64 << 20) as f64;
    let mut keys: Vec<(String, usize)> = rows.iter().map(|r| (r.0.clone(), r.1)).collect();
    keys.dedup();
    let line = |label: String, f: &dyn Fn(&Plotted) -> f64, key: &(String, usize)| Series {
        label,
        points: rows
            .iter()
            .filter(|r| r.0 == key.0 && r.1 == key.1)
            .map(|r| (r.2 as f64, f(r)))
            .collect(),
        points_only: false,
    };
    let mut time: Vec<Series> = keys
        .iter()
        .map(|k| line(format!("zrt {} world {}", k.0, k.1), &|r| r.3, k))
        .collect();
    let mut memory: Vec<Series> = Vec::new();
    for k in &keys {
        memory.push(line(
            format!("zrt {} world {}: peak RSS", k.0, k.1),
            &|r| mib(r.4),
            k,
        ));
        memory.push(line(
            format!("zrt {} world {}: model state", k.0, k.1),
            &|r| mib(r.5),
            k,
        ));
        memory.push(Series {
            points_only: true,
            ..line(
                format!("{} world {}: DESIGN.md formula", k.0, k.1),
                &|r| mib(r.6),
                k,
            )
        });
    }
    // Peers (2 ranks) as markers at the stage they correspond to.
    let mut sizes: Vec<&String> = peers.iter().map(|p| &p.0).collect();
    sizes.dedup();
    for size in sizes {
        for (family, label) in [
            ("ddp", "DDP"),
            ("fsdp2", "FSDP2"),
            ("deepspeed", "DeepSpeed"),
        ] {
            let pts: Vec<(f64, f64, f64)> = peers
                .iter()
                .filter(|(s, m)| s == size && m.starts_with(family))
                .filter_map(|(s, m)| {
                    let r = peer_rows(s, m);
                    peer_stage(m).map(|x| (x, median_time(r), mib(max_rss(r))))
                })
                .collect();
            if pts.is_empty() {
                continue;
            }
            let name = format!("{label} {size} world 2");
            time.push(Series {
                label: name.clone(),
                points: pts.iter().map(|p| (p.0, p.1)).collect(),
                points_only: true,
            });
            memory.push(Series {
                label: format!("{name}: peak RSS"),
                points: pts.iter().map(|p| (p.0, p.2)).collect(),
                points_only: true,
            });
        }
    }
    by_stage(
        &dir.join("step_time.png"),
        "Training step time per ZeRO stage",
        "seconds per step",
        &time,
    )?;
    by_stage(
        &dir.join("memory.png"),
        "Memory per rank per ZeRO stage",
        "MiB",
        &memory,
    )
}
