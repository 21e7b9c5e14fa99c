//! The smallest real thing zrt runs today (until the engine and the GPT job
//! land): ZeRO-3's data flow, by hand, across ranks.
//!
//! Under `zrt launch` each rank is a process and the ranks talk through
//! shared memory (the shm backend); run directly, the ranks are threads
//! (the local backend). Each rank holds only its shard of the fp32
//! parameters and of Adam's m and v. Every step it all-gathers the flat
//! parameters into a tch MLP, runs forward and backward on its own
//! micro-batch, reduce-scatters (averages) the flat gradients, and updates its
//! shard with zrt's fused AdamW. Rank 0 prints the training loss and a
//! held-out validation loss, which fall.
//!
//! `cargo xtask demo` runs `zrt launch --nproc-per-node 2 -- demo`;
//! `demo [--world N] [--steps N]` runs N threads instead.

use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use tch::{nn, nn::Module, Device, Reduction, Tensor};
use zrt::collectives::local;
use zrt::collectives::{chunk_range, init_from_env, ProcessGroup, ReduceOp};
use zrt::kernels::{adam_step, AdamConfig, AdamShard, ComputeCopy, Threads};

const IN: i64 = 16;
const HIDDEN: i64 = 64;
const BATCH: usize = 64;
/// Flat-buffer alignment (elements), as DESIGN.md's layout.
const ALIGN: usize = 16;

/// Deterministic data: x uniform in [-1, 1), y = sin(3 x.a) + 0.5 x0 x1.
fn batch(seed: u64, n: usize) -> (Tensor, Tensor) {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let xs: Vec<f32> = (0..n * IN as usize).map(|_| next()).collect();
    let ys: Vec<f32> = xs
        .chunks(IN as usize)
        .map(|x| {
            let dot: f32 = x
                .iter()
                .enumerate()
                .map(|(i, v)| v * (i as f32 * 0.1 - 0.7))
                .sum();
            (3.0 * dot).sin() + 0.5 * x[0] * x[1]
        })
        .collect();
    (
        Tensor::from_slice(&xs).view([n as i64, IN]),
        Tensor::from_slice(&ys).view([n as i64, 1]),
    )
}

struct Flat {
    /// (tensor, offset, numel), sorted by VarStore name.
    vars: Vec<(Tensor, usize, usize)>,
    padded: usize,
}

impl Flat {
    fn new(vs: &nn::VarStore, world: usize) -> Self {
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let mut off = 0;
        let vars = named
            .into_iter()
            .map(|(_, t)| {
                let n = t.numel();
                let at = off;
                off = (off + n).div_ceil(ALIGN) * ALIGN;
                (t, at, n)
            })
            .collect();
        let unit = world * ALIGN;
        Self {
            vars,
            padded: off.div_ceil(unit) * unit,
        }
    }

    fn params(&self) -> Result<Vec<f32>> {
        let mut flat = vec![0f32; self.padded];
        for (t, off, n) in &self.vars {
            let v = Vec::<f32>::try_from(&t.detach().flatten(0, -1))?;
            flat[*off..off + n].copy_from_slice(&v);
        }
        Ok(flat)
    }

    fn load(&self, flat: &[f32]) {
        tch::no_grad(|| {
            for (t, off, n) in &self.vars {
                let src = Tensor::from_slice(&flat[*off..off + n]).view(t.size().as_slice());
                t.shallow_clone().copy_(&src);
            }
        });
    }

    fn grads(&self) -> Result<Vec<f32>> {
        let mut flat = vec![0f32; self.padded];
        for (t, off, n) in &self.vars {
            let v = Vec::<f32>::try_from(&t.grad().flatten(0, -1))?;
            flat[*off..off + n].copy_from_slice(&v);
        }
        Ok(flat)
    }

    fn zero_grads(&self) {
        for (t, _, _) in &self.vars {
            let mut g = t.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    }
}

/// tch's RNG is global to the process: seed-and-build under a lock so every
/// rank's thread gets the same, reproducible initialization.
static INIT: Mutex<()> = Mutex::new(());

/// One rank's training; `log` receives rank 0's progress lines.
fn run<G: ProcessGroup>(g: &G, steps: usize, log: &(dyn Fn(String) + Sync)) -> Result<(f64, f64)> {
    let (me, world) = (g.rank(), g.size());
    let init = INIT
        .lock()
        .map_err(|_| anyhow::anyhow!("init lock poisoned"))?;
    tch::manual_seed(42);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let model = nn::seq()
        .add(nn::linear(&root / "l1", IN, HIDDEN, Default::default()))
        .add_fn(|x| x.gelu("none"))
        .add(nn::linear(&root / "l2", HIDDEN, HIDDEN, Default::default()))
        .add_fn(|x| x.gelu("none"))
        .add(nn::linear(&root / "l3", HIDDEN, 1, Default::default()));
    drop(init);
    let flat = Flat::new(&vs, world);

    // Rank 0's initialization is everyone's, as DDP/FSDP do at wrap time.
    let full = g.broadcast(flat.params()?, 0).wait()?;
    let mine = chunk_range(flat.padded, world, me);
    let mut p = full[mine.clone()].to_vec();
    let (mut m, mut v) = (vec![0f32; p.len()], vec![0f32; p.len()]);
    drop(full);
    let pool = Threads::new(1)?;
    let cfg = AdamConfig {
        lr: 1e-2,
        weight_decay: 0.01,
        ..AdamConfig::default()
    };
    let (vx, vy) = batch(999_999, 512);
    let mut val = (f64::NAN, f64::NAN);

    for step in 1..=steps {
        let (shard, full) = g.all_gather(p, Vec::with_capacity(flat.padded)).wait()?;
        p = shard;
        flat.load(&full);
        if me == 0 && (step == 1 || step % 200 == 0 || step == steps) {
            let vl = tch::no_grad(|| {
                model
                    .forward(&vx)
                    .mse_loss(&vy, Reduction::Mean)
                    .double_value(&[])
            });
            if step == 1 {
                val.0 = vl;
            }
            val.1 = vl;
            log(format!("step {step:4}  validation loss {vl:.4}"));
        }
        flat.zero_grads();
        let (x, y) = batch((step * world + me) as u64, BATCH);
        let loss = model.forward(&x).mse_loss(&y, Reduction::Mean);
        loss.backward();
        let (_, grad) = g
            .reduce_scatter(flat.grads()?, Vec::with_capacity(p.len()), ReduceOp::Avg)
            .wait()?;
        let shard = AdamShard {
            p: &mut p,
            g: &grad,
            m: &mut m,
            v: &mut v,
        };
        adam_step(&pool, &cfg, step as u64, 1.0, shard, ComputeCopy::None)?;
        let avg = g
            .all_reduce(vec![loss.double_value(&[])], ReduceOp::Avg)
            .wait()?[0];
        if me == 0 && (step == 1 || step % 200 == 0) {
            log(format!("step {step:4}  train loss {avg:.4}"));
        }
    }
    Ok(val)
}

fn report(first: f64, last: f64) -> Result<()> {
    println!(
        "validation loss {first:.4} -> {last:.4} ({:.1}x lower)",
        first / last
    );
    // NaN counts as not falling.
    if last.is_nan() || last >= first {
        bail!("validation loss did not fall");
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |name: &str, default: usize| -> Result<usize> {
        match args.iter().position(|a| a == name) {
            Some(i) => args
                .get(i + 1)
                .context(format!("{name} needs a value"))?
                .parse()
                .context(format!("{name} takes a number")),
            None => Ok(default),
        }
    };
    let steps = opt("--steps", 1000)?;
    if steps == 0 {
        bail!("--steps must be at least 1");
    }
    tch::set_num_threads(1);
    let banner = |world: usize, how: &str| {
        println!("zrt demo: ZeRO-3 data flow by hand, {world} ranks ({how}), {steps} steps");
        println!("each rank holds 1/{world} of the fp32 params and Adam state; all_gather -> forward/backward -> reduce_scatter -> fused AdamW");
    };

    if std::env::var_os("RANK").is_some() {
        // Started by `zrt launch`: one process per rank.
        let dist = init_from_env().context("joining the job")?;
        let g = dist.world();
        if g.rank() == 0 {
            banner(g.size(), "processes, shared-memory backend");
        }
        let (first, last) = run(g, steps, &|line| println!("{line}"))?;
        return if g.rank() == 0 {
            report(first, last)
        } else {
            Ok(())
        };
    }

    let world = opt("--world", 2)?;
    if world == 0 {
        bail!("--world must be at least 1");
    }
    banner(world, "threads, local backend");
    let log = Mutex::new(Vec::new());
    let push = |line: String| {
        if let Ok(mut l) = log.lock() {
            l.push(line);
        }
    };
    let results: Vec<Result<(f64, f64)>> = std::thread::scope(|s| {
        let hs: Vec<_> = local::world(world)
            .into_iter()
            .map(|r| {
                let push = &push;
                s.spawn(move || run(r.world(), steps, push))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a rank panicked")))
            })
            .collect()
    });
    for line in log
        .lock()
        .map_err(|_| anyhow::anyhow!("log poisoned"))?
        .iter()
    {
        println!("{line}");
    }
    let mut vals = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        vals.push(res.with_context(|| format!("rank {r} failed"))?);
    }
    report(vals[0].0, vals[0].1)
}
