//! The engine against an unsharded single-process reference: stages 0-3 x
//! accumulation 1, 2 x clipping off, on, world 2 (ranks as threads).
//!
//! The reference is plain tch with libtorch's own `clip_grad_norm` and
//! `AdamW` (Lion, which libtorch lacks, is stepped by [`lion_update`]:
//! the formula in f32, element by element). It computes each rank's micro-batch gradient in one process and
//! averages them in the order the collectives do (f64, rank order, one
//! rounding), accumulating micro-steps as each stage does (stage 1 sums
//! locally first). That isolates what the engine does (sharding, gathering,
//! reducing, updating) from the order of libtorch's batch reductions, which
//! Adam would otherwise amplify for parameters with tiny gradients (its step
//! is about m / sqrt(v), so an ulp in a tiny gradient moves the update).

use crate::common;

use common::{freeze, model, on_ranks, tokens, train_losses, Params, LR, WD, WORLD};
use tch::nn::{self, OptimizerConfig};
use tch::{Kind, Tensor};
use zrt::collectives::{local, ProcessGroup};
use zrt::zero::{AutoHints, Config, Engine};

const STEPS: usize = 5;

fn config(stage: u8, gas: usize, clip: f64) -> Config {
    config_with(stage, gas, clip, "")
}

/// As [`common::config_with`], stage 3 sharding every unit.
fn config_with(stage: u8, gas: usize, clip: f64, extra: &str) -> Config {
    config_zero(stage, gas, clip, extra, "")
}

/// As [`common::config_zero`], with `stage3_param_persistence_threshold`
/// 0: every unit of this GPT is under the default (1e5 elements), and a
/// stage 3 that keeps them all gathered would leave its free, re-gather
/// and prefetch paths out of every comparison here.
fn config_zero(stage: u8, gas: usize, clip: f64, extra: &str, zero: &str) -> Config {
    let zero = format!(r#"{zero} "stage3_param_persistence_threshold": 0,"#);
    common::config_zero(stage, gas, clip, extra, &zero)
}

/// The test GPT and its engine under `cfg` on rank `r`'s world group (the
/// VarStore is returned to outlive the engine).
fn world_engine(
    r: &local::LocalRank,
    cfg: &Config,
) -> (nn::VarStore, zrt::gpt::Gpt, Engine<local::LocalGroup>) {
    world_engine_with(r, cfg, Rules::Plain)
}

/// The optimizer rules a run's plan is given, and the parameter groups the
/// reference puts the same parameters in.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Rules {
    /// Every parameter decays, at the schedule's rate.
    Plain,
    /// Weight decay leaves out the parameters of fewer than two dimensions
    /// (biases, norm weights), as Hugging Face's Trainer does.
    NoDecayVectors,
    /// Those left out, and the learning rate scaled by where a parameter
    /// is: layer-wise decay over the two blocks (x0.25, x0.5), a faster
    /// token embedding (x2) and the final norm's weight held (x0).
    Scaled,
}

impl Rules {
    fn decays(self, shape: &[i64]) -> bool {
        self == Rules::Plain || shape.len() >= 2
    }

    fn lr_scale(self, name: &str) -> f64 {
        if self != Rules::Scaled {
            return 1.0;
        }
        match name {
            n if n.starts_with("h.0.") => 0.25,
            n if n.starts_with("h.1.") => 0.5,
            "wte.weight" => 2.0,
            "ln_f.weight" => 0.0,
            _ => 1.0,
        }
    }

    /// Gives `plan` these rules.
    fn apply(self, plan: &zrt::zero::ShardPlan) {
        if self != Rules::Plain {
            plan.exclude_from_weight_decay(move |_, shape| !self.decays(shape))
                .unwrap();
        }
        if self == Rules::Scaled {
            plan.scale_learning_rate(move |name, _| self.lr_scale(name))
                .unwrap();
        }
    }
}

/// As [`world_engine`], the plan given `rules`.
fn world_engine_with(
    r: &local::LocalRank,
    cfg: &Config,
    rules: Rules,
) -> (nn::VarStore, zrt::gpt::Gpt, Engine<local::LocalGroup>) {
    let (vs, plan, gpt) = model();
    rules.apply(&plan);
    let g = r.new_group(&(0..WORLD).collect::<Vec<_>>()).unwrap();
    let engine = Engine::new(&vs, &plan, cfg, g, &AutoHints::default()).unwrap();
    (vs, gpt, engine)
}

/// Per-step losses (mean over the global batch) and the final parameters.
fn run_engine(stage: u8, gas: usize, clip: f64) -> (Vec<f64>, Params, Vec<Option<f64>>) {
    let r = run_engine_with(config(stage, gas, clip), gas);
    (r.losses, r.params, r.norms)
}

/// What an engine run ends with.
struct Run {
    losses: Vec<f64>,
    params: Params,
    norms: Vec<Option<f64>>,
    skipped: u64,
    scale: Option<f64>,
    /// Bytes rank 0 handed to reduce-scatter and all-reduce.
    reduced_bytes: u64,
    /// Reduce-scatter and all-reduce calls rank 0 made.
    reduce_calls: u64,
    /// Each unit's gradient buffer length on rank 0 (the whole padded
    /// unit in stages 0-1, its shard in 2-3).
    grad_lens: Vec<usize>,
}

/// As `run_engine`, for any config.
fn run_engine_with(cfg: Config, gas: usize) -> Run {
    run_engine_mode(cfg, gas, Bare::None)
}

/// Which micro-steps run backward as the program's own `loss.backward()`
/// (the hooks alone drive the reductions) instead of
/// `engine.backward(&loss)`.
#[derive(Clone, Copy, PartialEq)]
enum Bare {
    None,
    All,
    /// The first of each step's; `engine.backward` the others.
    First,
}

/// As `run_engine_with`, with `bare` micro-steps.
fn run_engine_mode(cfg: Config, gas: usize, bare: Bare) -> Run {
    run_engine_full(cfg, gas, bare, Rules::Plain)
}

/// As `run_engine_mode`, the plan given `rules`.
fn run_engine_full(cfg: Config, gas: usize, bare: Bare, rules: Rules) -> Run {
    let out: Vec<_> = on_ranks(WORLD, |r| {
        let (_vs, gpt, engine) = world_engine_with(&r, &cfg, rules);
        let mut losses = Vec::new();
        let mut norms = Vec::new();
        for step in 0..STEPS {
            let mut sum = 0.0;
            for k in 0..gas {
                let loss = gpt.loss(&tokens(step, k, r.rank(), gas));
                sum += loss.double_value(&[]);
                if bare == Bare::All || (bare == Bare::First && k == 0) {
                    loss.backward();
                    if k + 1 < gas {
                        // As with FSDP: backward gas times,
                        // then one step.
                        continue;
                    }
                } else {
                    engine.backward(&loss).unwrap();
                }
                let skipped = engine.skipped_steps();
                let stepped = engine.step().unwrap();
                // Steps only at the boundary, unless fp16 skipped it.
                assert_eq!(
                    stepped || engine.skipped_steps() > skipped,
                    k + 1 == gas,
                    "steps only at the boundary"
                );
            }
            let all = r
                .world()
                .all_reduce(vec![sum / gas as f64], zrt::collectives::ReduceOp::Avg)
                .wait()
                .unwrap();
            losses.push(all[0]);
            norms.push(engine.global_grad_norm());
        }
        let reductions: Vec<_> = engine
            .group()
            .stats()
            .snapshot()
            .into_iter()
            .filter(|o| o.op == "reduce_scatter" || o.op == "all_reduce")
            .collect();
        Run {
            grad_lens: (0..)
                .map_while(|u| engine.grad_buffer(u))
                .map(|g| g.len())
                .collect(),
            reduced_bytes: reductions.iter().map(|o| o.bytes_sent).sum(),
            reduce_calls: reductions.iter().map(|o| o.calls).sum(),
            losses,
            params: engine.gathered_params().unwrap(),
            norms,
            skipped: engine.skipped_steps(),
            scale: engine.loss_scale(),
        }
    });
    // Every rank ends with the same parameters.
    assert_eq!(
        out[0].params, out[1].params,
        "ranks disagree after training"
    );
    out.into_iter().next().unwrap()
}

fn grads(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut g: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, t.grad().to_kind(Kind::Double)))
        .collect();
    g.sort_by(|a, b| a.0.cmp(&b.0));
    g
}

/// libtorch's AdamW with the engine's settings.
fn adamw(vs: &nn::VarStore) -> nn::Optimizer {
    adamw_settings().build(vs, LR).unwrap()
}

/// The engine's AdamW settings, for libtorch.
fn adamw_settings() -> nn::AdamW {
    nn::AdamW {
        beta1: 0.9,
        beta2: 0.999,
        wd: WD,
        eps: 1e-8,
        amsgrad: false,
    }
}

fn run_reference(stage: u8, gas: usize, clip: f64) -> (Vec<f64>, Params) {
    run_reference_with(stage, gas, clip, None)
}

/// A learning rate and beta1 for every step, and one beta2 (what a
/// DeepSpeed scheduler set on its optimizer).
struct Schedule {
    lrs: [f64; STEPS],
    beta1s: [f64; STEPS],
    beta2: f64,
}

/// As `run_reference`, with libtorch's AdamW set to `schedule`'s values
/// before each step.
fn run_reference_with(
    stage: u8,
    gas: usize,
    clip: f64,
    schedule: Option<&Schedule>,
) -> (Vec<f64>, Params) {
    run_reference_full(stage, gas, clip, schedule, Rules::Plain)
}

/// As `run_reference_with`, with a parameter group for each (decays,
/// learning-rate scale) that `rules` gives a parameter: weight decay 0 in
/// the groups left out of it, the schedule's rate times the scale.
fn run_reference_full(
    stage: u8,
    gas: usize,
    clip: f64,
    schedule: Option<&Schedule>,
    rules: Rules,
) -> (Vec<f64>, Params) {
    run_reference_opt(stage, gas, clip, schedule, rules, RefOpt::AdamW)
}

/// The reference's optimizer: libtorch's AdamW, [`lion_update`],
/// libtorch's SGD with these settings (its `wd` replaced by [`WD`]),
/// [`lamb_update`], [`adagrad_update`] with this `lr_decay` and sums
/// starting at `init`, or
/// [`rmsprop_update`] with these settings (`wd` ignored: [`WD`]).
#[derive(Clone, Copy)]
enum RefOpt {
    AdamW,
    Lion,
    Sgd(nn::Sgd),
    RmsProp(nn::RmsProp),
    Lamb,
    Adagrad { lr_decay: f64, init: f64 },
}

/// torch.optim's coupled-decay loop, without grad: `step(k, p, g, lr)` on
/// every variable `k`, with its parameter, its gradient with the L2 decay
/// [`WD`] added (where `rules` decay it) as torch's `grad.add(p, alpha =
/// wd)` adds it, one fused multiply-add (tch's `add` takes no alpha:
/// `addcmul` by a one-element tensor is the same operation), and its rate
/// ([`LR`] scaled as `rules` say).
fn coupled_steps(
    vars: &[(String, Tensor)],
    rules: Rules,
    mut step: impl FnMut(usize, Tensor, Tensor, f64),
) {
    tch::no_grad(|| {
        for (k, (name, var)) in vars.iter().enumerate() {
            let p = var.detach();
            let mut g = var.grad();
            if rules.decays(&var.size()) {
                g = g.addcmul(&p, &Tensor::from(WD as f32));
            }
            step(k, p, g, LR * rules.lr_scale(name));
        }
    });
}

/// torch.optim.Adagrad's step `t` (1-based, its single-tensor path, the
/// one it takes on CPU) at [`LR`], [`WD`], `lr_decay`, eps 1e-10, the sums
/// starting at `init` (its `initial_accumulator_value`), on every
/// variable from its `.grad()`, its decay and rate as `rules` give them
/// ([`coupled_steps`]), through libtorch's own operations:
/// `sum.addcmul_(g, g)`, `sum.sqrt() + eps`, `p.addcdiv_(-clr * g, std)`
/// (tch's addcdiv_ takes no value; libtorch's kernel multiplies by it
/// first too).
fn adagrad_update(
    vars: &[(String, Tensor)],
    sums: &mut Vec<Tensor>,
    rules: Rules,
    (lr_decay, init): (f64, f64),
    t: u64,
) {
    coupled_steps(vars, rules, |k, mut p, g, lr| {
        if sums.len() <= k {
            sums.push(p.full_like(init));
        }
        let clr = lr / (1.0 + (t - 1) as f64 * lr_decay);
        let _ = sums[k].addcmul_(&g, &g);
        let std = sums[k].sqrt() + 1e-10;
        let _ = p.addcdiv_(&(&g * -clr), &std);
    });
}

/// torch.optim.RMSprop's step (its single-tensor path, the one it takes on
/// CPU) with `rms`'s alpha, eps and momentum at [`LR`], [`WD`], on every
/// variable from its `.grad()`, its decay and rate as `rules` give them
/// ([`coupled_steps`]), through libtorch's operations as torch orders
/// them: `s.mul_(alpha).addcmul_(g, g, 1 - alpha)` (centered:
/// `b.lerp_(g, 1 - alpha)`, `s.addcmul(b, b, -1)`), the root of that plus
/// eps, then `b.mul_(momentum).addcdiv_(g, avg)` and `p.add_(b, -lr)`, or
/// `p.addcdiv_(g, avg, -lr)`. tch's `add`, `addcmul_` and `addcdiv_`
/// take no scalar: `addcmul` by a one-element tensor is the same fused
/// multiply-add, and the products are formed first, as libtorch's kernels
/// form them. The root is the f64 root rounded once (correctly rounded,
/// as zrt's): libtorch's f32 `sqrt` is one ulp off for some inputs, which
/// RMSprop's first steps (rates 1/sqrt(1 - alpha) times the learning
/// rate) amplify through the model past the comparison's 1e-5 (measured
/// against libtorch's own RMSprop: 8e-5 after five steps).
fn rmsprop_update(
    vars: &[(String, Tensor)],
    state: &mut Vec<[Tensor; 2]>,
    rms: nn::RmsProp,
    rules: Rules,
) {
    coupled_steps(vars, rules, |k, mut p, g, lr| {
        if state.len() <= k {
            state.push([p.zeros_like(), p.zeros_like()]);
        }
        let [s, b] = &mut state[k];
        let _ = s
            .g_mul_scalar_(rms.alpha)
            .addcmul_(&(&g * (1.0 - rms.alpha)), &g);
        // Centered: `b` is the gradient's average, and the root is of
        // `s.addcmul(b, b, value = -1)`.
        let mean_square = match rms.centered {
            true => s.addcmul(&-b.lerp_(&g, 1.0 - rms.alpha), b),
            false => s.shallow_clone(),
        };
        let root = mean_square
            .to_kind(Kind::Double)
            .sqrt()
            .to_kind(Kind::Float);
        let avg = root + rms.eps;
        if rms.momentum > 0.0 {
            let _ = b.g_mul_scalar_(rms.momentum).addcdiv_(&g, &avg);
            let _ = p.addcmul_(b, &Tensor::from(-lr as f32));
        } else {
            let _ = p.addcdiv_(&(&g * -lr), &avg);
        }
    });
}

/// Lion's step (DeepSpeed's, sign(0) = 0) at [`LR`], [`WD`], betas (0.9,
/// 0.999), on every variable from its `.grad()`, its decay and rate as
/// `rules` give them, in f32 with the kernel's fused multiply-adds: the
/// reference's part that libtorch has no optimizer for.
fn lion_update(vars: &[(String, Tensor)], moments: &mut Vec<Vec<f32>>, rules: Rules) {
    let (b1, b2) = (0.9f64, 0.999f64);
    moments.resize_with(vars.len(), Vec::new);
    tch::no_grad(|| {
        for ((name, v), m) in vars.iter().zip(moments.iter_mut()) {
            let lr = LR * rules.lr_scale(name);
            let wd = if rules.decays(&v.size()) { WD } else { 0.0 };
            let (lr, decay) = (lr as f32, (1.0 - lr * wd) as f32);
            let flat = |t: &Tensor| Vec::<f32>::try_from(&t.flatten(0, -1)).unwrap();
            let (mut p, g) = (flat(&v.detach()), flat(&v.grad()));
            m.resize(p.len(), 0.0);
            for i in 0..p.len() {
                let c = g[i].mul_add((1.0 - b1) as f32, m[i] * b1 as f32);
                let sign = if c == 0.0 { 0.0 } else { c.signum() };
                p[i] = p[i] * decay - lr * sign;
                m[i] = g[i].mul_add((1.0 - b2) as f32, m[i] * b2 as f32);
            }
            v.detach()
                .copy_(&Tensor::from_slice(&p).view(v.size().as_slice()));
        }
    });
}

/// DeepSpeed's FusedLamb step `t` (1-based) at [`LR`], [`WD`], betas
/// (0.9, 0.999), eps 1e-8, trust ratio clamped to [0.01, 10], on every
/// variable whole, its decay and rate as `rules` give them: the kernel's
/// f32 operations, the norms in f64 over the whole tensor (what the engine
/// must assemble from the shards).
fn lamb_update(
    vars: &[(String, Tensor)],
    state: &mut Vec<(Vec<f32>, Vec<f32>)>,
    rules: Rules,
    t: u64,
) {
    let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8f64);
    state.resize_with(vars.len(), Default::default);
    tch::no_grad(|| {
        for ((name, var), (m, v)) in vars.iter().zip(state.iter_mut()) {
            let lr = LR * rules.lr_scale(name);
            let wd = if rules.decays(&var.size()) { WD } else { 0.0 } as f32;
            let flat = |t: &Tensor| Vec::<f32>::try_from(&t.flatten(0, -1)).unwrap();
            let (mut p, g) = (flat(&var.detach()), flat(&var.grad()));
            m.resize(p.len(), 0.0);
            v.resize(p.len(), 0.0);
            let mut u = vec![0f32; p.len()];
            for i in 0..p.len() {
                m[i] = g[i].mul_add((1.0 - b1) as f32, m[i] * b1 as f32);
                v[i] = (g[i] * g[i]).mul_add((1.0 - b2) as f32, v[i] * b2 as f32);
                u[i] = p[i].mul_add(wd, m[i] / (v[i].sqrt() + eps as f32));
            }
            let sq = |x: &[f32]| x.iter().map(|&a| a as f64 * a as f64).sum::<f64>().sqrt();
            let (wn, un) = (sq(&p), sq(&u));
            let trust = if wn == 0.0 || un == 0.0 {
                1.0
            } else {
                (wn / un).clamp(0.01, 10.0)
            };
            let ti = t as i32;
            let step = lr * (1.0 - b2.powi(ti)).sqrt() / (1.0 - b1.powi(ti)) * trust;
            for i in 0..p.len() {
                p[i] = u[i].mul_add(-step as f32, p[i]);
            }
            var.detach()
                .copy_(&Tensor::from_slice(&p).view(var.size().as_slice()));
        }
    });
}

/// As `run_reference_full`, stepping with `ref_opt` (a schedule with
/// AdamW only).
fn run_reference_opt(
    stage: u8,
    gas: usize,
    clip: f64,
    schedule: Option<&Schedule>,
    rules: Rules,
    ref_opt: RefOpt,
) -> (Vec<f64>, Params) {
    assert!(matches!(ref_opt, RefOpt::AdamW) || schedule.is_none());
    let mut moments = Vec::new();
    let mut lamb_state = Vec::new();
    let mut sums = Vec::new();
    let mut rms_state = Vec::new();
    let (vs, _plan, gpt) = model();
    // Group 0 is the plain one.
    let mut groups = vec![(true, 1.0)];
    {
        let mut vars = vs.variables_.lock().unwrap();
        let names: std::collections::HashMap<usize, String> = vars
            .named_variables
            .iter()
            .filter_map(|(n, t)| {
                let i = vars
                    .trainable_variables
                    .iter()
                    .position(|v| v.tensor.data_ptr() == t.data_ptr())?;
                Some((i, n.clone()))
            })
            .collect();
        for (i, v) in vars.trainable_variables.iter_mut().enumerate() {
            let g = (rules.decays(&v.tensor.size()), rules.lr_scale(&names[&i]));
            v.group = match groups.iter().position(|x| *x == g) {
                Some(k) => k,
                None => {
                    groups.push(g);
                    groups.len() - 1
                }
            };
        }
    }
    let mut opt = match (schedule, ref_opt) {
        (_, RefOpt::Sgd(sgd)) => nn::Sgd { wd: WD, ..sgd }.build(&vs, LR).unwrap(),
        (None, _) => adamw(&vs),
        (Some(s), _) => nn::AdamW {
            beta2: s.beta2,
            ..adamw_settings()
        }
        .build(&vs, LR)
        .unwrap(),
    };
    let set_lr = |opt: &mut nn::Optimizer, lr: f64| {
        for (k, (_, scale)) in groups.iter().enumerate() {
            opt.set_lr_group(k, lr * scale);
        }
    };
    for (k, (decays, _)) in groups.iter().enumerate() {
        if !decays {
            opt.set_weight_decay_group(k, 0.0);
        }
    }
    set_lr(&mut opt, LR);
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut losses = Vec::new();
    for step in 0..STEPS {
        // acc[r] (stage 1: per rank, summed locally) or acc[0] (averaged each micro-step).
        let mut acc: Vec<Vec<Tensor>> = Vec::new();
        let mut loss_sum = 0.0;
        for k in 0..gas {
            let mut per_rank = Vec::new();
            for r in 0..WORLD {
                opt.zero_grad();
                let loss = gpt.loss(&tokens(step, k, r, gas));
                loss_sum += loss.double_value(&[]);
                (loss / gas as f64).backward();
                // Rounded to f32 as the engine's buffers hold them.
                per_rank.push(
                    grads(&vs)
                        .into_iter()
                        .map(|(_, g)| g.to_kind(Kind::Float))
                        .collect::<Vec<_>>(),
                );
            }
            let avg = |parts: &[Vec<Tensor>]| -> Vec<Tensor> {
                (0..parts[0].len())
                    .map(|i| {
                        let mut a = parts[0][i].to_kind(Kind::Double);
                        for p in &parts[1..] {
                            a += p[i].to_kind(Kind::Double);
                        }
                        (a / parts.len() as f64).to_kind(Kind::Float)
                    })
                    .collect()
            };
            if stage == 1 {
                if acc.is_empty() {
                    acc = per_rank;
                } else {
                    for (a, p) in acc.iter_mut().zip(per_rank) {
                        for (x, y) in a.iter_mut().zip(p) {
                            *x = &*x + y;
                        }
                    }
                }
            } else {
                let a = avg(&per_rank);
                if acc.is_empty() {
                    acc = vec![a];
                } else {
                    for (x, y) in acc[0].iter_mut().zip(a) {
                        *x = &*x + y;
                    }
                }
            }
        }
        let total = if stage == 1 {
            // Stage 1 reduces the locally accumulated gradients at the boundary.
            (0..acc[0].len())
                .map(|i| {
                    let mut a = acc[0][i].to_kind(Kind::Double);
                    for p in &acc[1..] {
                        a += p[i].to_kind(Kind::Double);
                    }
                    (a / WORLD as f64).to_kind(Kind::Float)
                })
                .collect::<Vec<_>>()
        } else {
            acc.remove(0)
        };
        tch::no_grad(|| {
            for ((_, v), g) in vars.iter().zip(&total) {
                v.grad().copy_(g);
            }
        });
        if clip > 0.0 {
            opt.clip_grad_norm(clip);
        }
        if let Some(s) = schedule {
            set_lr(&mut opt, s.lrs[step]);
            opt.set_momentum(s.beta1s[step]);
        }
        match ref_opt {
            RefOpt::Lion => lion_update(&vars, &mut moments, rules),
            RefOpt::Lamb => lamb_update(&vars, &mut lamb_state, rules, step as u64 + 1),
            RefOpt::Adagrad { lr_decay, init } => {
                adagrad_update(&vars, &mut sums, rules, (lr_decay, init), step as u64 + 1)
            }
            RefOpt::RmsProp(rms) => rmsprop_update(&vars, &mut rms_state, rms, rules),
            RefOpt::AdamW | RefOpt::Sgd(_) => opt.step(),
        }
        losses.push(loss_sum / (gas * WORLD) as f64);
    }
    let mut params: Params = vs
        .variables()
        .into_iter()
        .map(|(n, t)| {
            (
                n,
                Vec::<f32>::try_from(&t.detach().to_kind(Kind::Float).flatten(0, -1)).unwrap(),
            )
        })
        .collect();
    params.sort_by(|a, b| a.0.cmp(&b.0));
    (losses, params)
}

fn compare(what: &str, engine: (Vec<f64>, Params), reference: (Vec<f64>, Params)) {
    for (s, (a, b)) in engine.0.iter().zip(&reference.0).enumerate() {
        common::margin(
            &format!("{what}: loss of step {s}"),
            (a - b).abs(),
            1e-5 * b.abs(),
        );
        assert!(
            (a - b).abs() <= 1e-5 * b.abs(),
            "{what}: loss of step {s}: engine {a} reference {b}"
        );
    }
    let mut e = engine.1;
    e.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(e.len(), reference.1.len(), "{what}: parameter count");
    for ((na, a), (nb, b)) in e.iter().zip(&reference.1) {
        assert_eq!(na, nb, "{what}");
        assert_eq!(a.len(), b.len(), "{what}: {na}");
        // The element closest to its bound, recorded once a parameter.
        let mut closest = common::Closest::default();
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            let (x, y) = (*x as f64, *y as f64);
            // 1e-5 relative; parameters that cancel to near zero are held
            // to 1e-5 of the parameters' scale (0.1) instead.
            let within = closest.see((x - y).abs(), 1e-5 * y.abs().max(0.1));
            assert!(within, "{what}: {na}[{i}] engine {x} reference {y}");
        }
        closest.record(&format!("{what}: {na}"));
    }
}

#[test]
fn stages_0_to_3_match_the_unsharded_reference() {
    for gas in [1, 2] {
        for clip in [0.0, 0.5] {
            for stage in 0..=3u8 {
                let reference = run_reference(stage, gas, clip);
                let (losses, params, norms) = run_engine(stage, gas, clip);
                if clip > 0.0 {
                    assert!(
                        norms[0].unwrap() > clip,
                        "clipping must be active in this test: norm {:?}",
                        norms[0]
                    );
                }
                compare(
                    &format!("stage {stage} gas {gas} clip {clip}"),
                    (losses, params),
                    (reference.0.clone(), reference.1.clone()),
                );
            }
        }
    }
}

/// `optimizer` (with `params` past lr and weight decay) at stages 0-3,
/// every unit sharded, against the unsharded reference stepping with
/// `ref_opt`; with `clip` above 0 the clipping must be active.
fn stages_match_the_reference(
    optimizer: &str,
    params: &str,
    gas: usize,
    clip: f64,
    rules: Rules,
    ref_opt: RefOpt,
) {
    for stage in 0..=3u8 {
        let reference = run_reference_opt(stage, gas, clip, None, rules, ref_opt);
        let zero = r#""stage3_param_persistence_threshold": 0,"#;
        let cfg = common::config_params(optimizer, params, stage, gas, clip, "", zero);
        let run = run_engine_full(cfg, gas, Bare::None, rules);
        if clip > 0.0 {
            assert!(run.norms[0].unwrap() > clip, "clipping must be active");
        }
        compare(
            &format!("{optimizer}{params} stage {stage} gas {gas} clip {clip} {rules:?}"),
            (run.losses, run.params),
            reference,
        );
    }
}

#[test]
fn lion_at_stages_0_to_3_matches_the_unsharded_reference() {
    // The parameter rules' runs of elements treated alike too.
    for (gas, clip, rules) in [(1, 0.0, Rules::Plain), (2, 0.5, Rules::Scaled)] {
        stages_match_the_reference("Lion", "", gas, clip, rules, RefOpt::Lion);
    }
}

#[test]
fn lamb_at_stages_0_to_3_matches_the_unsharded_reference() {
    // The engine sums each parameter's norms over the shards that cut it;
    // the reference takes them over the whole tensor. With the parameter
    // rules (decay left out, scaled rates), clipping and gas 2 too.
    for (gas, clip, rules) in [(1, 0.0, Rules::Plain), (2, 0.5, Rules::Scaled)] {
        stages_match_the_reference("Lamb", "", gas, clip, rules, RefOpt::Lamb);
    }
}

#[test]
fn sgd_at_stages_0_to_3_matches_libtorchs_sgd() {
    // torch.optim.SGD's settings, each case a different path of the
    // kernel: no state, momentum with dampening (whose first step must not
    // damp), Nesterov; the parameter rules' runs and clipping with gas 2.
    let plain = nn::Sgd::default();
    let damped = nn::Sgd {
        momentum: 0.9,
        dampening: 0.5,
        ..plain
    };
    let nesterov = nn::Sgd {
        momentum: 0.9,
        nesterov: true,
        ..plain
    };
    for (sgd, params, gas, clip, rules) in [
        (plain, "", 1, 0.0, Rules::Plain),
        (
            damped,
            r#", "momentum": 0.9, "dampening": 0.5"#,
            2,
            0.5,
            Rules::Scaled,
        ),
        (
            nesterov,
            r#", "momentum": 0.9, "nesterov": true"#,
            1,
            0.0,
            Rules::NoDecayVectors,
        ),
    ] {
        stages_match_the_reference("SGD", params, gas, clip, rules, RefOpt::Sgd(sgd));
    }
}

#[test]
fn adagrad_at_stages_0_to_3_matches_libtorchs_operations() {
    // Plain; a decaying rate with the parameter rules' runs, clipping and
    // gas 2; sums starting above 0.
    let init = r#", "initial_accumulator_value": 0.1"#;
    for (params, lr_decay, init, gas, clip, rules) in [
        ("", 0.0, 0.0, 1, 0.0, Rules::Plain),
        (r#", "lr_decay": 0.5"#, 0.5, 0.0, 2, 0.5, Rules::Scaled),
        (init, 0.0, 0.1, 1, 0.0, Rules::NoDecayVectors),
    ] {
        let opt = RefOpt::Adagrad { lr_decay, init };
        stages_match_the_reference("Adagrad", params, gas, clip, rules, opt);
    }
}

#[test]
fn rmsprop_at_stages_0_to_3_matches_libtorchs_operations() {
    // torch.optim.RMSprop's settings, each case a path of the kernel: the
    // square average alone; with a momentum buffer, another alpha and
    // eps, the parameter rules' runs and clipping with gas 2; centered.
    let plain = nn::RmsProp::default();
    let momentum = nn::RmsProp {
        alpha: 0.9,
        eps: 1e-6,
        momentum: 0.9,
        ..plain
    };
    let centered = nn::RmsProp {
        centered: true,
        ..plain
    };
    for (rms, params, gas, clip, rules) in [
        (plain, "", 1, 0.0, Rules::Plain),
        (
            momentum,
            r#", "alpha": 0.9, "eps": 1e-6, "momentum": 0.9"#,
            2,
            0.5,
            Rules::Scaled,
        ),
        (
            centered,
            r#", "centered": true"#,
            1,
            0.0,
            Rules::NoDecayVectors,
        ),
    ] {
        stages_match_the_reference("RMSprop", params, gas, clip, rules, RefOpt::RmsProp(rms));
    }
}

#[test]
fn parameters_left_out_of_weight_decay_train_like_a_parameter_group_without_it() {
    // The swap streams the optimizer state in blocks of 1024 elements,
    // which cut the runs of decaying and non-decaying elements again.
    let swap = std::env::temp_dir().join(format!("zrt-parity-no-decay-{}", std::process::id()));
    std::fs::create_dir_all(&swap).unwrap();
    let (aio, offload) = common::nvme(&swap);
    for (what, stage, gas, clip, extra) in [
        ("stage 0", 0, 1, 0.0, String::new()),
        ("stage 1, gas 2, clip", 1, 2, 0.5, String::new()),
        ("stage 2, clip", 2, 1, 0.5, String::new()),
        ("stage 3, gas 2", 3, 2, 0.0, String::new()),
        (
            "stage 3, optimizer on NVMe",
            3,
            1,
            0.5,
            format!("{aio} {offload}"),
        ),
    ] {
        let reference = run_reference_full(stage, gas, clip, None, Rules::NoDecayVectors);
        let r = run_engine_full(
            config_with(stage, gas, clip, &extra),
            gas,
            Bare::None,
            Rules::NoDecayVectors,
        );
        compare(what, (r.losses, r.params.clone()), reference);
        // Leaving them out changed the outcome (so an engine that decayed
        // them would fail the comparison): the norm weights, ones, which
        // decay moves most, end elsewhere.
        let decayed = run_reference_full(stage, gas, clip, None, Rules::Plain).1;
        let params = sorted(r.params);
        let moved = |name: &str| ends_apart(&params, &decayed, name);
        assert!(moved("h.0.ln1.weight") && moved("ln_f.weight"), "{what}");
    }
    let _ = std::fs::remove_dir_all(&swap);
}

#[test]
fn scaled_learning_rates_train_like_parameter_groups_with_their_own_rates() {
    // The blocks at a quarter and half the rate, the embedding at twice it,
    // the final norm's weight held, the vectors out of weight decay: eight
    // parameter groups in the reference, runs of them inside every flat
    // buffer here. With WarmupLR each step's rate is the schedule's times
    // the scale (PyTorch's LambdaLR over groups with their own rates).
    let swap = std::env::temp_dir().join(format!("zrt-parity-lr-scale-{}", std::process::id()));
    std::fs::create_dir_all(&swap).unwrap();
    let (aio, offload) = common::nvme(&swap);
    let warmup = r#""scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0,
        "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"}},"#;
    // DeepSpeed's engine steps the scheduler once when it is built: the
    // first two steps run at the minimum.
    let schedule = Schedule {
        lrs: [0.0, 0.0, 0.0025, 0.005, 0.0075],
        beta1s: [0.9; STEPS],
        beta2: 0.999,
    };
    for (what, stage, gas, clip, extra, warm) in [
        ("stage 0", 0, 1, 0.0, String::new(), false),
        ("stage 1, gas 2, clip", 1, 2, 0.5, String::new(), false),
        ("stage 2, WarmupLR", 2, 1, 0.5, warmup.to_string(), true),
        (
            "stage 3, gas 2, WarmupLR",
            3,
            2,
            0.0,
            warmup.to_string(),
            true,
        ),
        (
            "stage 3, optimizer on NVMe",
            3,
            1,
            0.5,
            format!("{aio} {offload}"),
            false,
        ),
    ] {
        let schedule = warm.then_some(&schedule);
        let reference = run_reference_full(stage, gas, clip, schedule, Rules::Scaled);
        let r = run_engine_full(
            config_with(stage, gas, clip, &extra),
            gas,
            Bare::None,
            Rules::Scaled,
        );
        let params = sorted(r.params.clone());
        compare(what, (r.losses, r.params), reference);
        // The scales changed the outcome (an engine that ignored them
        // would fail the comparison): against the same run with the
        // vectors left out of decay but every rate the schedule's, the
        // scaled parameters end elsewhere, and the held one where it began.
        let unscaled = run_reference_full(stage, gas, clip, schedule, Rules::NoDecayVectors).1;
        let initial = sorted(
            common::model()
                .0
                .variables()
                .into_iter()
                .map(|(n, t)| (n, Vec::<f32>::try_from(&t.flatten(0, -1)).unwrap()))
                .collect(),
        );
        let at = |name: &str| params.iter().position(|p| p.0 == name).unwrap();
        for name in [
            "h.0.qkv.weight",
            "h.1.fc.weight",
            "wte.weight",
            "ln_f.weight",
        ] {
            assert!(ends_apart(&params, &unscaled, name), "{what}: {name}");
        }
        assert_eq!(
            params[at("ln_f.weight")].1,
            initial[at("ln_f.weight")].1,
            "{what}"
        );
    }
    let _ = std::fs::remove_dir_all(&swap);
}

/// Whether parameter `name` ends further apart in `a` and `b` (both
/// sorted by name) than [`compare`] allows.
fn ends_apart(a: &Params, b: &Params, name: &str) -> bool {
    let i = a.iter().position(|p| p.0 == name).unwrap();
    assert_eq!(b[i].0, name);
    (a[i].1.iter())
        .zip(&b[i].1)
        .any(|(x, y)| (x - y).abs() > 1e-5 * y.abs().max(0.1))
}

fn sorted(mut p: Params) -> Params {
    p.sort_by(|a, b| a.0.cmp(&b.0));
    p
}

#[test]
fn a_second_step_at_the_same_boundary_does_nothing() {
    let cfg = config(2, 1, 0.0);
    on_ranks(WORLD, |r| {
        let (_vs, gpt, engine) = world_engine(&r, &cfg);
        engine
            .backward(&gpt.loss(&tokens(0, 0, r.rank(), 1)))
            .unwrap();
        assert!(engine.step().unwrap());
        let after = engine.gathered_params().unwrap();
        assert!(!engine.step().unwrap(), "no new micro-step, no new step");
        assert_eq!(engine.global_step(), 1);
        assert_eq!(engine.gathered_params().unwrap(), after);
    });
}

#[test]
fn bf16_stages_agree_to_the_bit_and_track_the_fp32_reference() {
    let bf16 = r#""bf16": {"enabled": true},"#;
    let runs: Vec<_> = (0..=3u8)
        .map(|stage| run_engine_with(config_with(stage, 1, 0.5, bf16), 1))
        .collect();
    for (stage, r) in runs.iter().enumerate().skip(1) {
        // Same f64 reductions, element-wise updates: sharding changes no bit.
        assert_eq!(
            r.losses, runs[0].losses,
            "bf16 stage {stage} losses differ from stage 0"
        );
        assert_eq!(
            r.params, runs[0].params,
            "bf16 stage {stage} parameters differ from stage 0"
        );
    }
    // bf16 keeps 8 significand bits (0.4% per rounding): a forward pass in
    // bf16 moves the loss by well under 2% from the fp32 reference's.
    let reference = run_reference(0, 1, 0.5);
    for (s, (a, b)) in runs[0].losses.iter().zip(&reference.0).enumerate() {
        assert!(
            (a - b).abs() <= 2e-2 * b.abs(),
            "bf16 loss of step {s}: {a} vs fp32 {b}"
        );
    }
    assert!(
        runs[0].losses[STEPS - 1] < runs[0].losses[0],
        "bf16 training must lower the loss: {:?}",
        runs[0].losses
    );
}

#[test]
fn fp16_overflows_skip_the_step_on_every_rank_and_lower_the_scale() {
    // 2^20 is too large a scale for this model's fp16 gradients: the first
    // steps overflow, are skipped everywhere, and the scale comes down.
    let fp16 = r#""fp16": {"enabled": true, "initial_scale_power": 20, "hysteresis": 1, "loss_scale_window": 1000},"#;
    for stage in [0u8, 2, 3] {
        let Run {
            losses,
            params,
            skipped,
            scale,
            ..
        } = run_engine_with(config_with(stage, 1, 0.0, fp16), 1);
        let scale = scale.unwrap();
        assert!(
            skipped > 0 && skipped < STEPS as u64,
            "stage {stage}: {skipped} skipped"
        );
        assert_eq!(
            scale,
            2f64.powi(20 - skipped as i32),
            "stage {stage}: each overflow halves the scale"
        );
        assert!(
            params.iter().all(|(_, v)| v.iter().all(|x| x.is_finite())),
            "stage {stage}: parameters stay finite"
        );
        assert!(losses.iter().all(|l| l.is_finite()));
    }
}

#[test]
fn an_overflow_at_the_minimum_loss_scale_stops_every_rank() {
    // With the minimum at the initial 2^20 no smaller scale is left: the
    // first overflow is an error on every rank (DeepSpeed raises too),
    // not a run that skips every step from then on.
    let fp16 = r#""fp16": {"enabled": true, "initial_scale_power": 20, "hysteresis": 1, "min_loss_scale": 1048576},"#;
    let cfg = config_with(3, 1, 0.0, fp16);
    let errors = on_ranks(WORLD, |r| {
        let (_vs, gpt, engine) = world_engine(&r, &cfg);
        engine
            .backward(&gpt.loss(&tokens(0, 0, r.rank(), 1)))
            .unwrap();
        let e = engine.step().unwrap_err();
        (e.to_string(), engine.skipped_steps(), engine.loss_scale())
    });
    for (rank, (e, skipped, scale)) in errors.iter().enumerate() {
        assert!(
            e.contains("overflowed at the minimum loss scale (1048576, `fp16.min_loss_scale`)"),
            "rank {rank}: {e}"
        );
        assert_eq!(
            (*skipped, *scale),
            (1, Some(1048576.0)),
            "rank {rank}: the step is skipped"
        );
    }
}

/// `STEPS` steps of one micro-step each on this rank's batches; the mean
/// loss over `world` per step.
fn train_steps<G: ProcessGroup + 'static>(
    engine: &Engine<G>,
    gpt: &zrt::gpt::Gpt,
    rank: usize,
    world: &impl ProcessGroup,
) -> Vec<f64> {
    train_losses(gpt, engine, rank, STEPS)
        .into_iter()
        .map(|loss| {
            world
                .all_reduce(vec![loss], zrt::collectives::ReduceOp::Avg)
                .wait()
                .unwrap()[0]
        })
        .collect()
}

/// The reference of a 4-rank job with 2-rank shard groups: per-rank
/// gradients averaged as the hybrid engine does (inside each pair, then
/// across the pairs; f64 sums, one rounding per level), then libtorch's clip
/// and AdamW.
fn run_reference_hybrid(clip: f64) -> (Vec<f64>, Params) {
    let (vs, _plan, gpt) = model();
    let mut opt = adamw(&vs);
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let avg = |a: &Tensor, b: &Tensor| {
        ((a.to_kind(Kind::Double) + b.to_kind(Kind::Double)) / 2.0).to_kind(Kind::Float)
    };
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let mut per_rank = Vec::new();
        let mut sum = 0.0;
        for r in 0..4 {
            opt.zero_grad();
            let loss = gpt.loss(&tokens(step, 0, r, 1));
            sum += loss.double_value(&[]);
            loss.backward();
            per_rank.push(
                grads(&vs)
                    .into_iter()
                    .map(|(_, g)| g.to_kind(Kind::Float))
                    .collect::<Vec<_>>(),
            );
        }
        tch::no_grad(|| {
            for (i, (_, v)) in vars.iter().enumerate() {
                let pair0 = avg(&per_rank[0][i], &per_rank[1][i]);
                let pair1 = avg(&per_rank[2][i], &per_rank[3][i]);
                v.grad().copy_(&avg(&pair0, &pair1));
            }
        });
        if clip > 0.0 {
            opt.clip_grad_norm(clip);
        }
        opt.step();
        losses.push(sum / 4.0);
    }
    let mut params: Params = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(&t.detach().flatten(0, -1)).unwrap()))
        .collect();
    params.sort_by(|a, b| a.0.cmp(&b.0));
    (losses, params)
}

/// Each rank's losses, final parameters and reduce-scatter calls from
/// training the test GPT on 4 ranks under `cfg`, whose mics_shard_size
/// makes the mesh.
fn run_hybrid(cfg: &Config) -> Vec<(Vec<f64>, Params, u64)> {
    on_ranks(4, |mut r| {
        let (vs, plan, gpt) = model();
        let engine = Engine::from_config(&vs, &plan, cfg, &mut r, &AutoHints::default()).unwrap();
        assert_eq!(engine.group().size(), 2, "sharded in pairs");
        let losses = train_steps(&engine, &gpt, r.rank(), r.world());
        let scatters = engine
            .group()
            .stats()
            .snapshot()
            .into_iter()
            .filter(|o| o.op == "reduce_scatter")
            .map(|o| o.calls)
            .sum();
        (losses, engine.gathered_params().unwrap(), scatters)
    })
}

#[test]
fn hybrid_sharding_matches_the_unsharded_reference() {
    // World 4, mics_shard_size 2: shards inside {0, 1} and {2, 3}, gradient
    // shards averaged across {0, 2} and {1, 3}.
    let reference = run_reference_hybrid(0.5);
    for stage in 1..=3u8 {
        let out = run_hybrid(&config_zero(stage, 1, 0.5, "", r#""mics_shard_size": 2,"#));
        for o in &out[1..] {
            assert_eq!(
                o.1, out[0].1,
                "stage {stage}: every rank ends with the same parameters"
            );
        }
        compare(
            &format!("hybrid stage {stage}"),
            (out[0].0.clone(), out[0].1.clone()),
            reference.clone(),
        );
        // Buckets of 100 elements: every unit's reduction is split, and from
        // stage 2 on each unit retires the one before it mid-backward (two
        // buckets in flight at most), running its replicate-group average
        // then rather than at the end of backward. Same sums in the same
        // order: the same bits on every rank.
        let small = config_zero(
            stage,
            1,
            0.5,
            "",
            r#""mics_shard_size": 2, "reduce_bucket_size": 100,"#,
        );
        // Without `overlap_comm` each hook waits for its unit's
        // reduce-scatter and replicate-group average. The same bits.
        let waiting = r#""mics_shard_size": 2, "overlap_comm": false,"#;
        for (rank, b) in run_hybrid(&config_zero(stage, 1, 0.5, "", waiting))
            .iter()
            .enumerate()
        {
            let what = format!("hybrid stage {stage}, overlap_comm false, rank {rank}");
            assert_eq!(b.0, out[0].0, "{what}");
            assert_eq!(b.1, out[0].1, "{what}");
        }
        for (rank, b) in run_hybrid(&small).iter().enumerate() {
            let what = format!("hybrid stage {stage}, small buckets, rank {rank}");
            assert_eq!(b.0, out[0].0, "{what}");
            assert_eq!(b.1, out[0].1, "{what}");
            if stage >= 2 {
                // Split indeed.
                assert!(
                    b.2 > 4 * out[rank].2,
                    "{what}: {} calls, {} whole",
                    b.2,
                    out[rank].2
                );
            }
        }
    }
    // Without the mesh, mics_shard_size is refused with the fix (on every
    // rank: building an engine is a collective).
    let cfg = config_zero(2, 1, 0.0, "", r#""mics_shard_size": 2,"#);
    for e in on_ranks(4, |r| {
        let (vs, plan, _) = model();
        let g = r.new_group(&[0, 1, 2, 3]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg, g, &AutoHints::default());
        e.err().unwrap().to_string()
    }) {
        assert!(e.contains("Engine::new_hybrid"), "{e}");
    }
}

/// Which job `rank_main` runs when re-executed by `zrt launch`.
const CASE: &str = "ZRT_PARITY_CASE";

/// Runs as one rank of a real multi-process job when this test binary is
/// re-executed by the test below (a no-op otherwise): stage 3 on 2 ranks,
/// or stage 3 on 4 ranks in shard groups of 2, over the shm backend. Rank 0
/// prints the losses and writes the final parameters.
#[test]
fn rank_main() {
    let Ok(case) = std::env::var(CASE) else {
        return;
    };
    let out = std::env::var("ZRT_PARITY_OUT").unwrap();
    let mut dist = zrt::collectives::init_from_env().unwrap();
    let rank = dist.env().rank;
    let (vs, plan, gpt) = model();
    let engine = match case.as_str() {
        "hybrid" => {
            let cfg = config_zero(3, 1, 0.5, "", r#""mics_shard_size": 2,"#);
            let mesh = dist.mesh(2).unwrap();
            Engine::new_hybrid(&vs, &plan, &cfg, mesh, &AutoHints::default()).unwrap()
        }
        "zeropp" => {
            freeze(&vs, ZEROPP_FROZEN);
            let g = dist.new_group(&[0, 1]).unwrap();
            Engine::new(&vs, &plan, &zeropp(), g, &AutoHints::default()).unwrap()
        }
        _ => {
            let g = dist.new_group(&[0, 1]).unwrap();
            Engine::new(&vs, &plan, &config(3, 1, 0.5), g, &AutoHints::default()).unwrap()
        }
    };
    let losses: Vec<String> = train_steps(&engine, &gpt, rank, dist.world())
        .iter()
        .map(f64::to_string)
        .collect();
    engine.save_16bit_model(&out).unwrap();
    if rank == 0 {
        println!("@@ {}", losses.join(" "));
    }
}

/// `zrt launch`es `n` ranks of `rank_main` for `case` on `backend`; rank
/// 0's losses and the final parameters.
fn launch(n: usize, case: &str, backend: &str) -> (Vec<f64>, Params) {
    let out = std::env::temp_dir().join(format!(
        "zrt-parity-{}-{case}-{backend}.safetensors",
        std::process::id()
    ));
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_zrt"))
        .args(["launch", "--nproc-per-node", &n.to_string(), "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "engine_parity::rank_main",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CASE, case)
        .env("ZRT_PARITY_OUT", &out)
        .env("ZRT_BACKEND", backend)
        .output()
        .unwrap();
    let text = common::printed(&o);
    assert!(o.status.success(), "{text}");
    let losses = text
        .lines()
        .find_map(|l| l.split_once("@@ ").map(|(_, s)| s))
        .unwrap_or_else(|| panic!("no losses:\n{text}"))
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    (losses, read_export(&out))
}

/// The parameters (frozen ones too) of an export `save_16bit_model`
/// wrote, sorted by name; removes the file.
fn read_export(out: &std::path::Path) -> Params {
    let mut params: Params = Tensor::read_safetensors(out)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(&t.flatten(0, -1)).unwrap()))
        .collect();
    params.sort_by(|a, b| a.0.cmp(&b.0));
    let _ = std::fs::remove_file(out);
    params
}

#[test]
fn stage_3_and_hybrid_sharding_as_processes_on_shm_match_the_reference() {
    compare(
        "stage 3, 2 processes",
        launch(2, "stage3", "shm"),
        run_reference(3, 1, 0.5),
    );
    compare(
        "hybrid stage 3, 4 processes",
        launch(4, "hybrid", "shm"),
        run_reference_hybrid(0.5),
    );
}

/// The tcp backend (what a job across hosts uses; here on loopback)
/// trains as shm does, to the bit: every backend reduces with the same
/// rank-ordered kernels, however it moves the bytes (tcp in windows,
/// shm through staging slots). And its hybrid run matches the reference.
#[test]
fn stage_3_and_hybrid_sharding_as_processes_on_tcp_match_shm_and_the_reference() {
    let tcp = launch(2, "stage3", "tcp");
    let shm = launch(2, "stage3", "shm");
    assert_eq!(tcp.0, shm.0, "stage 3, 2 processes: losses on tcp and shm");
    assert!(
        tcp.1 == shm.1,
        "stage 3, 2 processes: parameters on tcp and shm differ"
    );
    compare("stage 3, 2 processes on tcp", tcp, run_reference(3, 1, 0.5));
    compare(
        "hybrid stage 3, 4 processes on tcp",
        launch(4, "hybrid", "tcp"),
        run_reference_hybrid(0.5),
    );
}

/// Stage 3 with ZeRO++'s packed gathers and packed reductions (qwZ,
/// qgZ), every unit packed, and frozen shards held packed.
fn zeropp() -> Config {
    config_zero(
        3,
        1,
        0.5,
        "",
        r#""zero_quantized_weights": true, "zero_quantized_gradients": true,
            "zero_quantized_nontrainable_weights": true,"#,
    )
}

/// What [`zeropp`] trains with frozen (its shards held packed).
const ZEROPP_FROZEN: &[&str] = &["h.1."];

/// Packed gathers, reductions and frozen shards as processes: on shm and
/// on tcp the same bits as on threads (the all_to_all and all_gather of
/// the packed bytes move them; every rank unpacks and sums alike).
#[test]
fn zeropp_as_processes_on_shm_and_tcp_trains_as_on_threads() {
    let out = std::env::temp_dir().join(format!(
        "zrt-parity-{}-zeropp.safetensors",
        std::process::id()
    ));
    let threads = on_ranks(WORLD, |r| {
        let (vs, plan, gpt) = model();
        freeze(&vs, ZEROPP_FROZEN);
        let g = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &zeropp(), g, &AutoHints::default()).unwrap();
        let losses = train_steps(&e, &gpt, r.rank(), r.world());
        // The export holds the frozen parameters (unpacked) too.
        e.save_16bit_model(&out).unwrap();
        (losses, e.overlap_counts().quantized_reductions)
    });
    let (losses, packed) = threads.into_iter().next().unwrap();
    assert!(packed > 0, "the packed reductions must run");
    let params = read_export(&out);
    assert!(params.iter().any(|(n, _)| n.starts_with(ZEROPP_FROZEN[0])));
    for backend in ["shm", "tcp"] {
        let (l, p) = launch(2, "zeropp", backend);
        assert_eq!(l, losses, "{backend}: losses");
        assert!(
            p == params,
            "{backend}: parameters differ from the threads' run"
        );
    }
}

#[test]
fn one_cycle_moves_the_rate_and_beta1_every_step_as_deepspeed_does() {
    // Up over 1 step, down over 2, then decaying: each step's rate and
    // beta1 as DeepSpeed 0.19.8's OneCycle set them on torch's AdamW
    // (beta2 0.99 throughout), handed to libtorch's AdamW by hand. (A beta1
    // that jumps close to 1 divides an old, rounded m by a small bias
    // correction: 0.9975 at the last step put a parameter 3.5e-5 off, past
    // this comparison's 1e-5, where 0.9595 holds to it.)
    let schedule = Schedule {
        lrs: [
            0.0025,
            0.019999999999999997,
            0.011250000000000003,
            0.0025,
            0.0016666666666666668,
        ],
        beta1s: [0.85, 0.85, 0.8999999999999999, 0.95, 0.9594999999999999],
        beta2: 0.99,
    };
    let one_cycle = r#""scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": 0.0025, "cycle_max_lr": 0.02, "cycle_first_step_size": 1,
        "cycle_second_step_size": 2, "decay_step_size": 1, "decay_lr_rate": 0.5,
        "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.01}},"#;
    for stage in [1, 3] {
        let reference = run_reference_with(stage, 1, 0.5, Some(&schedule));
        let r = run_engine_with(config_with(stage, 1, 0.5, one_cycle), 1);
        compare(
            &format!("OneCycle, stage {stage}"),
            (r.losses, r.params),
            reference,
        );
    }
    // The check can fail: the configured betas throughout are another run.
    let plain = run_reference(1, 1, 0.5);
    let r = run_engine_with(config_with(1, 1, 0.5, one_cycle), 1);
    let moved = r
        .params
        .iter()
        .zip(&plain.1)
        .any(|((_, a), (_, b))| a.iter().zip(b).any(|(x, y)| (x - y).abs() > 1e-4));
    assert!(moved, "OneCycle trained like constant settings");
}

#[test]
fn a_plain_loss_backward_is_reduced_by_the_hooks_as_engine_backward_is() {
    for stage in 0..=3u8 {
        for gas in [1usize, 2] {
            let via_engine = run_engine_mode(config(stage, gas, 0.5), gas, Bare::None);
            let bare = run_engine_mode(config(stage, gas, 0.5), gas, Bare::All);
            let what = format!("stage {stage} gas {gas}");
            if gas == 1 {
                // The same gradients, reduced the same way: the same bits.
                assert_eq!(bare.losses, via_engine.losses, "{what}");
                assert_eq!(bare.params, via_engine.params, "{what}");
            } else {
                // 1/gas applied after backward instead of to the loss. Adam
                // (and clipping) hide a gradient off by a constant factor
                // from the parameters; the norm does not.
                for (s, (a, b)) in bare.norms.iter().zip(&via_engine.norms).enumerate() {
                    let (a, b) = (a.unwrap(), b.unwrap());
                    assert!(
                        (a - b).abs() <= 1e-5 * b,
                        "{what}: gradient norm of step {s}: bare {a} via engine {b}"
                    );
                }
                let mut reference = via_engine.params;
                reference.sort_by(|a, b| a.0.cmp(&b.0));
                compare(
                    &what,
                    (bare.losses, bare.params),
                    (via_engine.losses.clone(), reference.clone()),
                );
                // One micro-step bare, the next through the engine: the
                // engine ends the bare one when the next begins (until
                // 2026-11-28 it took that backward for a bare one too,
                // dividing its gradients by gas again, and counted one
                // micro-step for the two).
                let mixed = run_engine_mode(config(stage, gas, 0.5), gas, Bare::First);
                for (s, (a, b)) in mixed.norms.iter().zip(&via_engine.norms).enumerate() {
                    let (a, b) = (a.unwrap(), b.unwrap());
                    assert!(
                        (a - b).abs() <= 1e-5 * b,
                        "{what}: gradient norm of step {s}: mixed {a} via engine {b}"
                    );
                }
                compare(
                    &format!("{what}, mixed"),
                    (mixed.losses, mixed.params),
                    (via_engine.losses, reference),
                );
            }
        }
    }
}

#[test]
fn communication_data_type_16_bit_reduces_in_half_the_bytes_and_tracks_fp32() {
    let reference = run_reference(0, 1, 0.5);
    for dtype in ["bf16", "fp16"] {
        let on = match dtype {
            "bf16" => r#""bf16": {"enabled": true},"#,
            _ => r#""fp16": {"enabled": true, "initial_scale_power": 8},"#,
        };
        let reduced16 = format!(r#"{on} "communication_data_type": "{dtype}","#);
        for stage in [0u8, 1, 2, 3] {
            let wide = run_engine_with(config_with(stage, 1, 0.5, on), 1);
            let narrow = run_engine_with(config_with(stage, 1, 0.5, &reduced16), 1);
            let what = format!("{dtype} stage {stage}");
            // The gradient collectives carry 2-byte elements instead of 4
            // (the loss-norm and fp16 checks are a few bytes).
            assert!(
                narrow.reduced_bytes * 2 <= wide.reduced_bytes + 64,
                "{what}: {} vs {} bytes",
                narrow.reduced_bytes,
                wide.reduced_bytes
            );
            assert_ne!(
                narrow.params, wide.params,
                "{what}: the 16-bit path must be taken"
            );
            for (s, (a, b)) in narrow.losses.iter().zip(&reference.0).enumerate() {
                assert!(
                    (a - b).abs() <= 2e-2 * b.abs(),
                    "{what} step {s}: {a} vs fp32 {b}"
                );
            }
        }
    }
}

#[test]
fn a_16_bit_communication_data_type_with_fp32_compute_is_warned_about() {
    // zrt reduces in the compute dtype, so the key alone changes nothing:
    // the engine says so at build, and only then.
    let said = |extra: &str| {
        let (vs, plan, _) = model();
        let cfg = config_with(2, 1, 0.0, extra);
        common::with_logs(|| common::solo_engine(&vs, &plan, &cfg).map(|_| ()))
    };
    let warning = "a 16-bit communication_data_type with fp32 compute";
    let (built, logs) = said(r#""communication_data_type": "bf16","#);
    assert!(built.is_ok() && logs.contains(warning), "{logs}");
    for quiet in [
        r#""communication_data_type": "fp32","#,
        r#""bf16": {"enabled": true}, "communication_data_type": "bf16","#,
        "",
    ] {
        let (built, logs) = said(quiet);
        assert!(built.is_ok() && !logs.contains(warning), "{quiet}: {logs}");
    }
}

#[test]
fn fp16_hands_adam_the_unscaled_gradients() {
    // Adam's update does not depend on the gradient's scale but through
    // eps, so a loss scale left in the gradients (or applied twice) hid
    // behind it. With eps 1 the update follows the gradient's size: fp16
    // must move the parameters as fp32 does, not 2^16 times the gradient.
    let eps = |mut cfg: Config| {
        cfg.optimizer.eps = 1.0;
        cfg
    };
    // A window of 2 doubles the scale during the run (at the third and
    // fifth steps): those steps' gradients were made with the scale before.
    let fp16 = r#""fp16": {"enabled": true, "initial_scale_power": 8, "loss_scale_window": 2},"#;
    let mut start: Params = model()
        .0
        .variables()
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()))
        .collect();
    start.sort_by(|a, b| a.0.cmp(&b.0));
    let moved = |r: &Run| -> f64 {
        let mut p = r.params.clone();
        p.sort_by(|a, b| a.0.cmp(&b.0));
        p.iter()
            .zip(&start)
            .flat_map(|((_, a), (_, b))| a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64))
            .fold(0.0, f64::max)
    };
    for stage in [0u8, 3] {
        let wide = run_engine_with(eps(config_with(stage, 1, 0.0, "")), 1);
        let half = run_engine_with(eps(config_with(stage, 1, 0.0, fp16)), 1);
        // The gradient norm it reports is unscaled too.
        for (s, (a, b)) in half.norms.iter().zip(&wide.norms).enumerate() {
            let (a, b) = (a.unwrap(), b.unwrap());
            assert!(
                (a - b).abs() <= 0.05 * b,
                "stage {stage} step {s}: fp16 gradient norm {a}, fp32 {b}"
            );
        }
        let (wide, half) = (moved(&wide), moved(&half));
        assert!(
            (half - wide).abs() <= 0.1 * wide,
            "stage {stage}: fp16 moved a parameter up to {half:e}, fp32 {wide:e}"
        );
    }
}

#[test]
fn bf16_tracks_the_fp32_reference_across_accumulation_and_clipping() {
    // The rest of the bf16 matrix (stages x gas x clipping): within the 2%
    // a bf16 forward allows (8 significand bits, 0.4% per rounding), and
    // stages 0, 2 and 3 (one reduction order) agree to the bit.
    let bf16 = r#""bf16": {"enabled": true},"#;
    for gas in [1usize, 2] {
        for clip in [0.0, 0.5] {
            let reference = run_reference(0, gas, clip);
            let runs: Vec<Run> = (0..=3u8)
                .map(|stage| run_engine_with(config_with(stage, gas, clip, bf16), gas))
                .collect();
            for (stage, r) in runs.iter().enumerate() {
                for (s, (a, b)) in r.losses.iter().zip(&reference.0).enumerate() {
                    assert!(
                        (a - b).abs() <= 2e-2 * b.abs(),
                        "bf16 stage {stage} gas {gas} clip {clip} step {s}: {a} vs fp32 {b}"
                    );
                }
            }
            for stage in [2usize, 3] {
                assert_eq!(
                    runs[stage].params, runs[0].params,
                    "bf16 stage {stage} gas {gas} clip {clip}"
                );
            }
        }
    }
}

/// Stage 3 on 4 ranks, plain or with hpZ over pairs: the final parameters
/// and how many gathers the hpZ group served.
fn run_hpz(hpz: bool, extra: &str) -> (Params, u64) {
    let zero = if hpz {
        r#""zero_hpz_partition_size": 2,"#
    } else {
        ""
    };
    let cfg = config_zero(3, 1, 0.5, extra, zero);
    let out: Vec<(Params, u64)> = on_ranks(4, |mut r| {
        let (vs, plan, gpt) = model();
        // With the key, the hpZ pairs are made from it.
        let engine = Engine::from_config(&vs, &plan, &cfg, &mut r, &AutoHints::default()).unwrap();
        assert_eq!(engine.group().size(), 4, "stage 3 shards over the world");
        train_steps(&engine, &gpt, r.rank(), r.world());
        (
            engine.gathered_params().unwrap(),
            engine.overlap_counts().hpz_gathers,
        )
    });
    out.into_iter().next().unwrap()
}

#[test]
fn hpz_regathers_inside_its_group_with_the_same_results() {
    for extra in ["", r#""bf16": {"enabled": true},"#] {
        let (plain, none) = run_hpz(false, extra);
        let (hpz, served) = run_hpz(true, extra);
        assert_eq!(none, 0);
        // wte and 2 blocks re-gathered from the pair in every backward
        // (the first forward, too, frees each unit once the next one's
        // forward ends); the head ran last in forward and stays gathered
        // for backward.
        assert_eq!(served, 3 * STEPS as u64, "{extra}");
        assert_eq!(hpz, plain, "hpZ gathers the same values: {extra}");
    }
    // Without its group the key is refused with the fix (on every rank:
    // building an engine is a collective).
    let cfg = config_zero(3, 1, 0.0, "", r#""zero_hpz_partition_size": 2,"#);
    for e in on_ranks(2, |r| {
        let (vs, plan, _) = model();
        let g = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg, g, &AutoHints::default());
        e.err().unwrap().to_string()
    }) {
        assert!(e.contains("Engine::new_hpz"), "{e}");
    }
    // With a group, it must be stage 3 and hold as many ranks as the key.
    for (stage, size) in [(3u8, 4), (2, 2)] {
        let cfg = config_zero(stage, 1, 0.0, "", r#""zero_hpz_partition_size": 2,"#);
        for e in on_ranks(4, |r| {
            let (vs, plan, _) = model();
            let world = r.new_group(&[0, 1, 2, 3]).unwrap();
            let first = r.rank() / size * size;
            let hpz = r.new_group(&(first..first + size).collect::<Vec<_>>());
            let e = Engine::new_hpz(&vs, &plan, &cfg, world, hpz.unwrap(), &AutoHints::default());
            e.err().unwrap().to_string()
        }) {
            let want = format!("hpZ needs ZeRO stage 3, zero_hpz_partition_size equal to the hpZ group's size ({size}, config says 2)");
            assert!(e.contains(&want), "stage {stage}, groups of {size}: {e}");
        }
    }
}

#[test]
fn a_config_the_world_cannot_be_split_by_is_refused_naming_the_key() {
    for (zero, want) in [
        (
            r#""mics_shard_size": 3,"#,
            "mics_shard_size 3 on a world of 4 ranks: it must divide the world",
        ),
        (
            r#""zero_hpz_partition_size": 3,"#,
            "zero_hpz_partition_size 3 on a world of 4 ranks: it must divide the world",
        ),
        (
            r#""mics_shard_size": 2, "zero_hpz_partition_size": 2,"#,
            "mics_shard_size and zero_hpz_partition_size together",
        ),
    ] {
        let cfg = config_zero(3, 1, 0.0, "", zero);
        let errors = on_ranks(4, |mut r| {
            let (vs, plan, _) = model();
            Engine::from_config(&vs, &plan, &cfg, &mut r, &AutoHints::default())
                .err()
                .map(|e| e.to_string())
        });
        for e in errors {
            let e = e.unwrap_or_default();
            assert!(e.contains(want), "{zero}: {e}");
        }
    }
}

#[test]
fn gradients_reduced_in_small_buckets_give_the_same_bits() {
    // 100 elements per bucket: every unit's reduction is split (the GPT's
    // smallest unit has thousands of elements); sums stay element-wise in
    // rank order, so nothing changes but the number of calls.
    for stage in 0..=3u8 {
        for gas in [1usize, 2] {
            let whole = run_engine_with(config(stage, gas, 0.5), gas);
            let bucketed = run_engine_with(
                config_zero(stage, gas, 0.5, "", r#""reduce_bucket_size": 100,"#),
                gas,
            );
            let what = format!("stage {stage} gas {gas}");
            assert_eq!(bucketed.losses, whole.losses, "{what}");
            assert_eq!(bucketed.params, whole.params, "{what}");
            // Without `overlap_comm` each hook waits for its unit's
            // reductions: that changes when they are added, not what.
            let waiting = r#""overlap_comm": false,"#;
            let other = run_engine_with(config_zero(stage, gas, 0.5, "", waiting), gas);
            assert_eq!(other.losses, whole.losses, "{what}, {waiting}");
            assert_eq!(other.params, whole.params, "{what}, {waiting}");
            // Each unit's reduction becomes ceil(padded / 100) calls (a
            // reduce-scatter's bucket takes 50 elements of each rank's
            // shard), once a micro-step (stages 0, 2, 3) or once a step
            // (stage 1, at the boundary); the other calls (the norm) stay.
            let padded = |len: usize| if stage >= 2 { len * WORLD } else { len };
            let extra: u64 = whole
                .grad_lens
                .iter()
                .map(|&len| padded(len).div_ceil(100) as u64 - 1)
                .sum();
            let times = (STEPS * if stage == 1 { 1 } else { gas }) as u64;
            assert_eq!(
                bucketed.reduce_calls,
                whole.reduce_calls + times * extra,
                "{what}: {} calls bucketed, {} whole, unit buffers {:?}",
                bucketed.reduce_calls,
                whole.reduce_calls,
                whole.grad_lens
            );
        }
    }
}
