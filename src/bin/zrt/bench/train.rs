//! `zrt bench train`: training step time and memory per ZeRO stage and
//! world size, on the GPT of the main job, measured in the same run as a
//! matmul peak (for MFU) and next to DESIGN.md's memory formula and the
//! ZeRO communication volumes.

use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use tch::{nn, Device, Kind, Tensor};

use super::median;
use crate::estimate::model_state_bytes;
use zrt::collectives::{init_from_env, ProcessGroup, ReduceOp};
use zrt::gpt::{Gpt, GptConfig};
use zrt::zero::{AutoHints, Config, Engine, ShardPlan};

/// Options of `zrt bench train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// ZeRO stages to measure.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,3")]
    stages: Vec<u8>,
    /// World sizes (ranks as processes on the shm backend).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    worlds: Vec<usize>,
    /// Model sizes: `base` (the issue's GPT: vocab 8192, d 512, 8 layers,
    /// 8 heads, seq 256) and `large` (about 3x the parameters: d 768, 12 layers).
    #[arg(long, value_delimiter = ',', default_value = "base,large")]
    sizes: Vec<String>,
    /// Micro-batch per rank.
    #[arg(long, default_value_t = 4)]
    micro: i64,
    /// Timed steps per configuration per round (after one warm-up step).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Interleaved rounds over all configurations.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// One JSON object per row on stdout instead of a table.
    #[arg(long)]
    json: bool,
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

fn peak_rss_bytes() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb * 1024.0)
}

/// FLOPs of one training step of `c` on `tokens` tokens: 6 per parameter
/// per token (forward + backward) plus attention's 12 x layers x d x seq per token.
fn step_flops(c: &GptConfig, params: f64, tokens: f64) -> f64 {
    6.0 * params * tokens + 12.0 * (c.layers * c.d_model * c.seq) as f64 * tokens
}

/// Runs inside each rank: times `steps` training steps, prints rank 0's row.
pub fn rank_main(a: &TrainRankArgs) -> Result<()> {
    tch::set_num_threads(1);
    let mut dist = init_from_env()?;
    let (rank, n) = (dist.env().rank, dist.env().world_size);
    let c = gpt(&a.size)?;
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let plan = ShardPlan::new();
    let model = Gpt::new(&vs.root(), &plan, &c);
    let cfg = Config::from_json(&format!(
        r#"{{"train_micro_batch_size_per_gpu": {}, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-4, "weight_decay": 0.01}}}},
            "gradient_clipping": 1.0, "zero_optimization": {{"stage": {}}}}}"#,
        a.micro, a.stage
    ))?;
    let group = dist.new_group(&(0..n).collect::<Vec<_>>())?;
    let engine = Engine::new(&vs, &plan, &cfg, group, &AutoHints::default())?;
    let batch = || Tensor::randint(c.vocab, [a.micro, c.seq + 1], (Kind::Int64, Device::Cpu));
    let stats = || engine.group().stats().snapshot();
    let mut times = Vec::new();
    let (mut comm_s, mut comm_elems) = (0.0, 0.0);
    for s in 0..=a.steps {
        let before = stats();
        let t = Instant::now();
        engine.backward(&model.loss(&batch()))?;
        engine.step()?;
        let dt = t.elapsed().as_secs_f64();
        if s > 0 {
            times.push(dt);
            for (x, y) in stats().iter().zip(&before) {
                comm_s += (x.time - y.time).as_secs_f64();
                comm_elems += (x.bytes_sent - y.bytes_sent) as f64 / 4.0;
            }
        }
    }
    let t = engine.group().all_reduce(times, ReduceOp::Max).wait()?;
    let rss = engine
        .group()
        .all_gather(vec![peak_rss_bytes()], Vec::new())
        .wait()?
        .1;
    let state = engine.model_state_bytes()? as f64;
    if rank == 0 {
        println!(
            "@@zrt {}",
            json!({
                "times": t, "rss": rss, "model_state_bytes": state, "params": engine.num_params(),
                "comm_seconds_per_step": comm_s / a.steps as f64, "comm_elements_per_step": comm_elems / a.steps as f64,
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

fn run_rank(
    me: &std::path::Path,
    world: usize,
    stage: u8,
    size: &str,
    a: &TrainArgs,
) -> Result<Value> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port()
        .to_string();
    let token = format!("bench-train-{}-{port}", std::process::id());
    let children: Vec<_> = (0..world)
        .map(|r| {
            Command::new(me)
                .args([
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
                ])
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("ZRT_TOKEN", &token)
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .context("starting a rank")
        })
        .collect::<Result<_>>()?;
    let mut row = None;
    for c in children {
        let o = c.wait_with_output()?;
        if !o.status.success() {
            bail!(
                "a rank of stage {stage} world {world} {size} failed ({})",
                o.status
            );
        }
        for l in String::from_utf8_lossy(&o.stdout).lines() {
            if let Some(j) = l.split_once("@@zrt ").map(|x| x.1) {
                row = Some(serde_json::from_str(j)?);
            }
        }
    }
    row.context("no rank printed results")
}

/// Runs the sweep and prints its rows.
pub fn run(a: &TrainArgs) -> Result<()> {
    let me = std::env::current_exe()?;
    let mut configs = Vec::new();
    for size in &a.sizes {
        gpt(size)?;
        for &world in &a.worlds {
            for &stage in &a.stages {
                configs.push((size.clone(), world, stage));
            }
        }
    }
    let mut samples: Vec<Vec<Value>> = configs.iter().map(|_| Vec::new()).collect();
    let mut peaks = Vec::new();
    for round in 0..a.rounds {
        peaks.push(matmul_peak());
        for (k, (size, world, stage)) in configs.iter().enumerate() {
            samples[k].push(run_rank(&me, *world, *stage, size, a)?);
        }
        eprintln!("zrt bench train: round {}/{} done", round + 1, a.rounds);
    }
    let peak = median(&peaks);
    if !a.json {
        println!("fp32 AdamW, micro-batch {} per rank, 1 thread per rank, shm backend; medians of {} rounds x {} steps; matmul peak {:.1} GFLOP/s per core", a.micro, a.rounds, a.steps, peak / 1e9);
        println!(
            "{:<6} {:>5} {:>5} {:>8} {:>9} {:>8} {:>6} {:>9} {:>10} {:>10} {:>10} {:>10} {:>8}",
            "model",
            "world",
            "stage",
            "params",
            "s/step",
            "tok/s",
            "MFU",
            "RSS MiB",
            "state MiB",
            "formula",
            "comm Mel",
            "ZeRO Mel",
            "comm s"
        );
    }
    for ((size, world, stage), rows) in configs.iter().zip(&samples) {
        let c = gpt(size)?;
        let get = |f: &str| -> Vec<f64> { rows.iter().filter_map(|r| r[f].as_f64()).collect() };
        let step: Vec<f64> = rows
            .iter()
            .flat_map(|r| r["times"].as_array().cloned().unwrap_or_default())
            .filter_map(|v| v.as_f64())
            .collect();
        let t = median(&step);
        let params = rows
            .first()
            .and_then(|r| r["params"].as_f64())
            .unwrap_or(f64::NAN);
        let tokens = (a.micro * c.seq) as f64 * *world as f64;
        let flops = step_flops(&c, params, tokens) / t;
        let mfu = flops / (peak * *world as f64);
        let rss = rows
            .iter()
            .flat_map(|r| r["rss"].as_array().cloned().unwrap_or_default())
            .filter_map(|v| v.as_f64())
            .fold(0.0, f64::max);
        let state = median(&get("model_state_bytes"));
        let formula = model_state_bytes(*stage, params, *world as f64, 4.0);
        let comm = median(&get("comm_elements_per_step"));
        // Elements each rank sends per step by ZeRO's accounting: 2 Psi
        // (stages 0-2) or 3 Psi (stage 3), times (n-1)/n; none alone.
        let n = *world as f64;
        let per_psi = if *stage == 3 { 3.0 } else { 2.0 };
        let zero = if *world == 1 {
            0.0
        } else {
            per_psi * params * (n - 1.0) / n
        };
        let wait = median(&get("comm_seconds_per_step"));
        if a.json {
            println!(
                "{}",
                json!({
                    "bench": "train", "model": size, "world": world, "stage": stage, "params": params,
                    "seconds_per_step": t, "tokens_per_s": tokens / t, "flops_per_s": flops, "mfu": mfu,
                    "matmul_peak_flops_per_s": peak, "peak_rss_bytes": rss, "model_state_bytes": state,
                    "formula_bytes": formula, "comm_elements_per_step": comm, "zero_volume_elements": zero,
                    "comm_seconds_per_step": wait,
                })
            );
        } else {
            println!(
                "{:<6} {:>5} {:>5} {:>7.1}M {:>9.3} {:>8.0} {:>5.1}% {:>9.0} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>8.3}",
                size, world, stage, params / 1e6, t, tokens / t, mfu * 100.0, rss / (1 << 20) as f64,
                state / (1 << 20) as f64, formula / (1 << 20) as f64, comm / 1e6, zero / 1e6, wait
            );
        }
    }
    Ok(())
}
