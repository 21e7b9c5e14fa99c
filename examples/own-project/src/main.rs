//! A tch model of your own, trained with ZeRO by zrt.
//!
//! ```sh
//! cargo build --release
//! zrt launch --nproc-per-node 2 -- target/release/own-project [ds_config.json] [steps]
//! ```
//!
//! The model is any tch code; the only change for zrt is that each block
//! is built inside a `ShardedModule` (the unit stage 3 gathers, runs and
//! frees), and that `backward` and `step` go through the engine the
//! DeepSpeed config describes. zrt's `tests/own_project.rs` builds this
//! folder as a project outside zrt's workspace and trains it on two ranks.

use anyhow::Context;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use zrt::collectives::init_from_env;
use zrt::zero::{AutoHints, Config, Engine, ShardPlan, ShardedModule};

/// Width of the model.
const D: i64 = 64;

/// One residual MLP block: what a `ShardedModule` wraps.
#[derive(Debug)]
struct Block {
    norm: nn::LayerNorm,
    up: nn::Linear,
    down: nn::Linear,
}

impl Block {
    fn new(p: &nn::Path) -> Self {
        Self {
            norm: nn::layer_norm(p / "norm", vec![D], Default::default()),
            up: nn::linear(p / "up", D, 4 * D, Default::default()),
            down: nn::linear(p / "down", 4 * D, D, Default::default()),
        }
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Tensor {
        x + self
            .down
            .forward(&self.up.forward(&self.norm.forward(x)).gelu("none"))
    }
}

fn main() -> anyhow::Result<()> {
    zrt::init_logging();
    let mut args = std::env::args().skip(1);
    let config = args.next().unwrap_or_else(|| "ds_config.json".into());
    let steps: i64 = match args.next() {
        Some(s) => s
            .parse()
            .with_context(|| format!("steps: {s:?} is not a number"))?,
        None => 200,
    };
    let cfg = Config::from_file(&config)?;
    let mut dist = init_from_env()?;
    let (rank, world) = (dist.env().rank, dist.env().world_size);

    // The model, built as plain tch code with each block in a ShardedModule.
    // The engine takes rank 0's initial values, so ranks need not agree on a
    // seed; the seed makes a run repeatable (an unlucky draw of the initial
    // weights trains several times slower).
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let plan = ShardPlan::new();
    // Ranks but the first hold no weights while the model is built (the
    // engine gives them rank 0's): load pretrained weights on rank 0 only.
    plan.weights_on_first_rank_only(&vs, rank)?;
    let root = vs.root();
    let blocks: Vec<ShardedModule<Block>> = (0..4)
        .map(|i| {
            let p = &root / format!("block{i}");
            ShardedModule::new(&plan, &p, Block::new(&p))
        })
        .collect();
    let head = ShardedModule::new(
        &plan,
        &(&root / "head"),
        nn::linear(&root / "head", D, 1, Default::default()),
    );
    // Biases and norm weights take no weight decay, as in Hugging Face's
    // Trainer and nanoGPT (DeepSpeed's parameter groups).
    plan.exclude_from_weight_decay(|_name, shape| shape.len() < 2)?;
    let engine = Engine::from_config(&vs, &plan, &cfg, &mut dist, &AutoHints::default())?;
    let batch = engine.config().batch;

    // The task: a fixed function of the input, the same on every rank.
    let weights: Vec<f32> = (0..D).map(|i| ((i % 7) as f32 - 3.0) / 8.0).collect();
    let teacher = Tensor::from_slice(&weights).view([D, 1]);
    let mut losses = Vec::new();
    for step in 0..steps {
        for micro in 0..batch.gas as i64 {
            // Each rank draws its own samples: data parallelism.
            tch::manual_seed((step * batch.gas as i64 + micro) * world as i64 + rank as i64);
            let x = Tensor::randn([batch.micro as i64, D], (Kind::Float, Device::Cpu));
            let y = x.matmul(&teacher).tanh();
            let out = blocks.iter().fold(x, |h, b| b.forward(&h));
            let loss = (head.forward(&out) - y).square().mean(Kind::Float);
            engine.backward(&loss)?;
            engine.step()?;
            losses.push(f64::try_from(&loss)?);
        }
        if rank == 0 && step % 50 == 0 {
            println!("step {step:4}  loss {:.4}", losses[losses.len() - 1]);
        }
    }
    // Every rank holds the same model after a step: a sum over all of it,
    // gathered whole, shows it.
    let sum = engine.with_full_params(|| {
        vs.trainable_variables()
            .iter()
            .map(|t| t.sum(Kind::Double).double_value(&[]))
            .sum::<f64>()
    })?;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let k = losses.len().min(20);
    println!(
        "rank {rank} of {world}: loss {:.4} -> {:.4}; parameter sum {sum:.9e}",
        mean(&losses[..k]),
        mean(&losses[losses.len() - k..])
    );
    Ok(())
}
