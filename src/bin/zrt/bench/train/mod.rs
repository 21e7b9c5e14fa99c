//! `zrt bench train`: training step time and memory per ZeRO stage and
//! world size, on the GPT of the main job, measured in the same run as a
//! matmul peak (for MFU) and next to DESIGN.md's memory formula and the
//! ZeRO communication volumes.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use serde_json::{json, Value};
use tch::{nn, Device, Kind, Tensor};

use super::{peer, run_ranks};
use zrt::collectives::{init_from_env, ProcessGroup, ReduceOp};
use zrt::gpt::{is_mlp_param, layerdrop, Gpt, GptConfig};
use zrt::zero::{AutoHints, Config, Engine, ShardPlan};

mod report;

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

/// `zrt bench train`: measures every configuration and peer the options
/// ask for, interleaved over the rounds, and reports them.
pub fn run(a: &TrainArgs) -> Result<()> {
    let me = std::env::current_exe()?;
    check_args(a)?;
    let configs = configurations(a)?;
    // The runs whose only peer is DDP (it alone trains a module some ranks
    // skip, or use in part, or runs Muon over whole matrices).
    let ddp_only = a.layerdrop > 0.0 || a.mlp_drop > 0.0 || a.optimizer == "muon";
    let peers = peers_to_run(a, ddp_only);
    let measured = measure(&me, a, &configs, &peers)?;
    let r = report::Report::new(a, &configs, &peers, &measured);
    if !a.json {
        r.header();
    }
    let mut plotted = Vec::new();
    for k in 0..configs.len() {
        plotted.push(r.zrt_row(k)?);
    }
    for (size, mode) in &peers {
        r.peer_row(size, mode)?;
    }
    if let Some(dir) = &a.plot {
        report::plots(dir, &plotted, &peers, &|s, m| r.peer_rows(s, m))?;
        if !a.json {
            println!(
                "plots: {}/step_time.png, {}/memory.png",
                dir.display(),
                dir.display()
            );
        }
    }
    if !a.json && a.peer && ddp_only {
        r.ddp_ratios();
    }
    if !a.json && a.peer {
        r.fsdp_ratios();
    }
    Ok(())
}

/// Refuses options that cannot be measured, naming the fix.
fn check_args(a: &TrainArgs) -> Result<()> {
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
    Ok(())
}

/// Every zrt configuration the options ask for, in the order the rows
/// print.
fn configurations(a: &TrainArgs) -> Result<Vec<Measured>> {
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
    Ok(configs)
}

/// The peers `--peer` runs, per model size: DDP alone when `ddp_only`,
/// and without DeepSpeed's when the venv cannot import it.
fn peers_to_run(a: &TrainArgs, ddp_only: bool) -> Vec<(String, &'static str)> {
    if !a.peer {
        return Vec::new();
    }
    // DeepSpeed is optional in the venv: without it its peers are left out
    // with one line, not a traceback per peer and round and rows of NaN.
    // (Under --layerdrop, --mlp-drop or Muon there are no DeepSpeed rows
    // to leave out.)
    let deepspeed_missing = match ddp_only {
        false => peer::import_fails(&peer::venv_python(), "deepspeed"),
        true => None,
    };
    if let Some(why) = &deepspeed_missing {
        eprintln!(
            "zrt bench train: DeepSpeed's rows are left out, the venv cannot import it \
             ({why}); `$(cargo xtask python) -m pip install deepspeed ninja` adds them"
        );
    }
    a.sizes
        .iter()
        .flat_map(|s| PEERS.iter().map(move |p| (s.clone(), *p)))
        .filter(|(_, p)| deepspeed_missing.is_none() || !p.starts_with("deepspeed"))
        .filter(|(_, p)| !ddp_only || *p == "ddp")
        .collect()
}

/// What the rounds measured: each configuration's and each peer's rank-0
/// rows (one per round; a peer's failed rounds left out), and the matmul
/// peak of each round.
struct Measurements {
    samples: Vec<Vec<Value>>,
    peer_samples: Vec<Vec<Value>>,
    peaks: Vec<f64>,
}

/// Runs every configuration and every peer once per round, interleaved,
/// so that the host's drift touches them alike.
fn measure(
    me: &std::path::Path,
    a: &TrainArgs,
    configs: &[Measured],
    peers: &[(String, &str)],
) -> Result<Measurements> {
    let script = std::env::temp_dir().join(format!("zrt-train-peer-{}.py", std::process::id()));
    if a.peer {
        std::fs::write(
            &script,
            include_str!("../../../../../bench/peers/train_peer.py"),
        )?;
    }
    let mut m = Measurements {
        samples: configs.iter().map(|_| Vec::new()).collect(),
        peer_samples: peers.iter().map(|_| Vec::new()).collect(),
        peaks: Vec::new(),
    };
    for round in 0..a.rounds {
        m.peaks.push(super::matmul_peak(1));
        for (k, c) in configs.iter().enumerate() {
            m.samples[k].push(run_rank(me, c, a)?);
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
                Ok(v) => m.peer_samples[k].push(v),
                Err(e) => eprintln!("zrt bench train: peer {mode} on {size} failed: {e:#}"),
            }
        }
        eprintln!("zrt bench train: round {}/{} done", round + 1, a.rounds);
    }
    let _ = std::fs::remove_file(&script);
    Ok(m)
}
