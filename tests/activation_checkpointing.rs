//! Activation checkpointing (`zrt::zero::activation::Checkpointed`): the
//! same outputs and gradients as the plain module, to the bit, with dropout
//! drawing the same masks; the module runs twice; errors in either run come
//! back as errors; a frozen module after a frozen input runs once; and a
//! GPT with checkpointed blocks trains to the same bits as the plain one at
//! every stage, with the same gathers at stage 3, also with a frozen
//! prefix (which backward neither recomputes nor gathers); and units whose
//! checkpoints run more than once per backward (shared layers, checkpointed
//! whole or in part) train as the plain ones, reduced once per backward.
//!
//! The tests run one at a time ([`common::serial`]): a recompute puts
//! libtorch's process-global RNG state back, which can land between another
//! test's seeding and its model's first draws.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{
    built, config_with, config_zero, engine_of, on_ranks, seeded, serial, small_input,
    train_losses, GPT, WORLD,
};
use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, Tensor};
use zrt::collectives::local::{LocalGroup, LocalRank};
use zrt::gpt::Gpt;
use zrt::zero::activation::{Checkpointed, CheckpointedT};
use zrt::zero::{glue, Config, Engine, OverlapCounts, ShardPlan, ShardedModule};

/// Linear, GELU, dropout, linear; counts its forwards and panics on call
/// `fail_on`.
#[derive(Debug)]
struct Mlp {
    a: nn::Linear,
    b: nn::Linear,
    calls: Arc<AtomicUsize>,
    fail_on: usize,
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Tensor {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if n == self.fail_on {
            panic!("boom on call {n}");
        }
        let h = self.a.forward(x).gelu("none").dropout(0.3, true);
        self.b.forward(&h)
    }
}

/// A fresh VarStore and MLP from seed 0 (the same every time). Call it
/// under [`seeded`], which the whole test holds: the RNG is process-wide
/// and other tests draw from it too.
fn mlp(fail_on: usize) -> (nn::VarStore, Mlp, Arc<AtomicUsize>) {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let calls = Arc::new(AtomicUsize::new(0));
    let m = Mlp {
        a: nn::linear(vs.root() / "a", 8, 16, Default::default()),
        b: nn::linear(vs.root() / "b", 16, 8, Default::default()),
        calls: calls.clone(),
        fail_on,
    };
    (vs, m, calls)
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(&t.to_kind(Kind::Float).flatten(0, -1)).unwrap()
}

/// Output, parameter gradients (by name), input gradient and the next
/// random draw after backward.
type Outcome = (
    Vec<f32>,
    Vec<(String, Vec<f32>)>,
    Option<Vec<f32>>,
    Vec<f32>,
);

/// A 3 x 8 input for [`Mlp`].
fn mlp_input() -> Tensor {
    Tensor::from_slice(&(0..24).map(|i| i as f32 * 0.1 - 1.0).collect::<Vec<_>>()).view([3, 8])
}

/// Each variable's gradient, by name.
fn grads(vs: &nn::VarStore) -> Vec<(String, Vec<f32>)> {
    let mut grads: Vec<(String, Vec<f32>)> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, values(&t.grad())))
        .collect();
    grads.sort_by(|a, b| a.0.cmp(&b.0));
    grads
}

fn run(vs: &nn::VarStore, f: impl Fn(&Tensor) -> Tensor, input_grad: bool) -> Outcome {
    let x = mlp_input().set_requires_grad(input_grad);
    tch::manual_seed(7);
    let y = f(&x);
    (&y * &y).sum(Kind::Float).backward();
    let grads = grads(vs);
    let xg = input_grad.then(|| values(&x.grad()));
    (
        values(&y),
        grads,
        xg,
        values(&Tensor::rand([4], (Kind::Float, Device::Cpu))),
    )
}

#[test]
fn a_checkpointed_module_gives_the_plain_outputs_and_gradients_and_runs_twice() {
    let _serial = serial();
    seeded(plain_and_checkpointed_agree);
}

fn plain_and_checkpointed_agree() {
    // Without an input that requires grad too (a block after a frozen
    // embedding): its parameters must still get their gradients.
    for input_grad in [true, false] {
        let (vs, plain, calls) = mlp(0);
        let want = run(&vs, |x| plain.forward(x), input_grad);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        let (vs, m, calls) = mlp(0);
        let c = Checkpointed::new(m);
        let got = run(&vs, |x| c.forward(x), input_grad);
        assert_eq!(got, want, "input requires grad: {input_grad}");
        assert!(got.1.iter().all(|(_, g)| g.iter().any(|&v| v != 0.0)));
        // Forward, then the recompute in backward.
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
    // The forward recorded no graph of the module's own: the output's
    // history reaches no parameter (so it saved none of the activations).
    let (vs, m, _) = mlp(0);
    let x = Tensor::ones([2, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let weight = glue::tensor_impl(&vs.variables()["a.weight"]).unwrap();
    assert!(glue::graph_leaves(&m.forward(&x), Some(&x))
        .unwrap()
        .contains(&weight));
    let c = Checkpointed::new(m);
    assert!(!glue::graph_leaves(&c.forward(&x), Some(&x))
        .unwrap()
        .contains(&weight));
    // A frozen module after a frozen input (a frozen block after a frozen
    // embedding) has nothing to recompute: it runs once, and its output
    // needs no gradient, as the plain module's. With an input that needs
    // one it is recomputed, for the input's gradient.
    for input_grad in [false, true] {
        let outcome = |checkpointed: bool| {
            let (mut vs, m, calls) = mlp(0);
            vs.freeze();
            let x = Tensor::ones([2, 8], (Kind::Float, Device::Cpu)).set_requires_grad(input_grad);
            tch::manual_seed(7);
            let y = if checkpointed {
                Checkpointed::new(m).forward(&x)
            } else {
                m.forward(&x)
            };
            assert_eq!(y.requires_grad(), input_grad, "checkpointed {checkpointed}");
            let xg = input_grad.then(|| {
                (&y * &y).sum(Kind::Float).backward();
                values(&x.grad())
            });
            (values(&y), xg, calls.load(Ordering::SeqCst))
        };
        let (plain, ckpt) = (outcome(false), outcome(true));
        assert_eq!(
            (&ckpt.0, &ckpt.1),
            (&plain.0, &plain.1),
            "input grad {input_grad}"
        );
        assert_eq!(
            ckpt.2,
            1 + usize::from(input_grad),
            "input grad {input_grad}"
        );
    }
    // Under no_grad (evaluation) there is nothing to recompute.
    let (_vs, m, calls) = mlp(0);
    let c = Checkpointed::new(m);
    let y = tch::no_grad(|| c.forward(&Tensor::ones([2, 8], (Kind::Float, Device::Cpu))));
    assert!(!y.requires_grad());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// [`Mlp`] with dropout only when training: a `ModuleT`-only block.
#[derive(Debug)]
struct MlpT(Mlp);

impl nn::ModuleT for MlpT {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        self.0.calls.fetch_add(1, Ordering::SeqCst);
        let h = self.0.a.forward(x).gelu("none").dropout(0.3, train);
        self.0.b.forward(&h)
    }
}

#[test]
fn a_checkpointed_module_t_keeps_its_train_flag_for_the_recompute() {
    let _serial = serial();
    seeded(|| {
        for train in [true, false] {
            let (vs, m, _) = mlp(0);
            let plain = MlpT(m);
            let want = run(&vs, |x| plain.forward_t(x, train), true);
            let (vs, m, calls) = mlp(0);
            let c = CheckpointedT::new(MlpT(m));
            let got = run(&vs, |x| c.forward_t(x, train), true);
            assert_eq!(got, want, "train: {train}");
            assert_eq!(calls.load(Ordering::SeqCst), 2);
        }
    });
}

/// A linear layer whose output is scaled by state of its model (a shared
/// number the program may change between forward and backward).
#[derive(Debug)]
struct Scaled {
    a: nn::Linear,
    scale: Arc<std::sync::atomic::AtomicI64>,
}

impl Module for Scaled {
    fn forward(&self, x: &Tensor) -> Tensor {
        let s = self.scale.load(Ordering::SeqCst) as f64;
        self.a.forward(x).tanh() * s
    }
}

/// A checkpointed module's recompute runs under the state its forward
/// saw when a `Capture` takes it, though the program changed it between
/// forward and backward: the plain module's gradients, to the bit, and
/// the state the program set afterwards. Without one the recompute reads
/// the changed state, and the gradients differ.
#[test]
fn a_recompute_sees_the_model_state_its_forward_saw_when_captured() {
    use std::sync::atomic::AtomicI64;
    use zrt::zero::activation::{Capture, Replay, Restore};
    let _serial = serial();
    seeded(|| {
        // Seeded alike: the same weights every time.
        let make = || {
            tch::manual_seed(0);
            let vs = nn::VarStore::new(Device::Cpu);
            let a = nn::linear(vs.root() / "a", 8, 8, Default::default());
            let scale = Arc::new(AtomicI64::new(2));
            (
                vs,
                Scaled {
                    a,
                    scale: scale.clone(),
                },
                scale,
            )
        };
        // Forward at scale 2, backward after the program set it to 5.
        let step = |vs: &nn::VarStore, f: &dyn Fn(&Tensor) -> Tensor, scale: &AtomicI64| {
            scale.store(2, Ordering::SeqCst);
            let y = f(&mlp_input());
            scale.store(5, Ordering::SeqCst);
            (&y * &y).sum(Kind::Float).backward();
            grads(vs)
        };
        let (vs, m, scale) = make();
        let want = step(&vs, &|x| m.forward(x), &scale);
        let (vs, m, scale) = make();
        let shared = scale.clone();
        let capture: Capture = Arc::new(move || {
            let (seen, s) = (shared.load(Ordering::SeqCst), shared.clone());
            let replay: Replay = Box::new(move || {
                let was = s.swap(seen, Ordering::SeqCst);
                let s = s.clone();
                Restore::new(move || s.store(was, Ordering::SeqCst))
            });
            replay
        });
        let c = Checkpointed::with_context(m, capture);
        assert_eq!(step(&vs, &|x| c.forward(x), &scale), want);
        assert_eq!(scale.load(Ordering::SeqCst), 5, "the state put back");
        let (vs, m, scale) = make();
        let c = Checkpointed::new(m);
        assert_ne!(step(&vs, &|x| c.forward(x), &scale), want);
    });
}

#[test]
fn errors_in_the_forward_or_the_recompute_are_returned() {
    let _serial = serial();
    seeded(errors_come_back);
}

fn errors_come_back() {
    let x = Tensor::ones([2, 8], (Kind::Float, Device::Cpu));
    let (_vs, m, _) = mlp(1);
    let err = Checkpointed::new(m).f_forward(&x).unwrap_err();
    assert!(
        err.to_string()
            .contains("the checkpointed segment panicked: boom on call 1"),
        "{err}"
    );
    let (_vs, m, _) = mlp(2);
    let y = Checkpointed::new(m).f_forward(&x).unwrap();
    let err = y.sum(Kind::Float).f_backward().unwrap_err();
    assert!(
        err.to_string()
            .contains("the checkpointed segment panicked: boom on call 2"),
        "{err}"
    );
}

/// What a training run left on rank 0: parameters, losses, overlap counts.
type Trained = (Vec<(String, Vec<f32>)>, Vec<f64>, OverlapCounts);

/// Trains the test GPT (plain or checkpointed blocks) 3 steps on `WORLD`
/// ranks: rank 0's parameters, losses and gather counts.
fn train(cfg: &Config, new: fn(&nn::Path, &ShardPlan, &zrt::gpt::GptConfig) -> Gpt) -> Trained {
    train_frozen(cfg, new, &[])
}

/// [`train`] with the variables whose names start with one of `frozen`
/// frozen before the engine is built.
fn train_frozen(
    cfg: &Config,
    new: fn(&nn::Path, &ShardPlan, &zrt::gpt::GptConfig) -> Gpt,
    frozen: &[&str],
) -> Trained {
    let mut out = on_ranks(WORLD, |r| {
        let (vs, plan, gpt) = built(&GPT, new);
        common::freeze(&vs, frozen);
        let e = engine_of(&vs, &plan, cfg, &r);
        let losses = train_losses(&gpt, &e, r.rank(), 3);
        (e.gathered_params().unwrap(), losses, e.overlap_counts())
    });
    out.swap_remove(0)
}

#[test]
fn a_gpt_with_checkpointed_blocks_trains_to_the_same_bits_at_every_stage() {
    let _serial = serial();
    let bf16 = r#""bf16": {"enabled": true},"#;
    for (stage, extra) in [(0u8, ""), (1, ""), (2, ""), (3, ""), (3, bf16)] {
        let cfg = config_with(stage, 1, 0.5, extra);
        let plain = train(&cfg, Gpt::new);
        let ckpt = train(&cfg, Gpt::new_checkpointed);
        assert_eq!(ckpt.1, plain.1, "stage {stage} {extra}: losses");
        assert_eq!(ckpt.0, plain.0, "stage {stage} {extra}: parameters");
        // The gathers stay outside the checkpoint: the recompute gathers
        // nothing more, and the reductions still overlap backward.
        assert_eq!(ckpt.2, plain.2, "stage {stage} {extra}: overlap");
    }
}

#[test]
fn small_parameters_kept_gathered_in_the_root_wait_for_their_blocks_recomputes() {
    let _serial = serial();
    // Stage 3 keeps parameters under `stage3_param_persistence_threshold`
    // (the blocks' biases and norms here) gathered in the root unit. A
    // block run twice per micro-step (the loss of two forwards), its
    // checkpoint accumulates them once per run: the root was reduced once
    // each of its parameters had a gradient, before the other run's
    // recompute added to some, and again for that: a sum in another order
    // than stage 0's (until late on 2026-11-28: parameters 1 ulp apart
    // after two steps of two micro-steps).
    let persist = r#""stage3_param_persistence_threshold": 100,"#;
    let run = |stage: u8| {
        let cfg = config_zero(stage, 2, 0.0, "", persist);
        on_ranks(WORLD, |r| {
            let (vs, plan, gpt) = built(&GPT, Gpt::new_checkpointed);
            // The root's other parameter accumulates last, after every
            // recompute: frozen, so that the root's last parameter comes
            // from a block.
            common::freeze(&vs, &["wpe."]);
            let e = engine_of(&vs, &plan, &cfg, &r);
            for step in 0..2 {
                for k in 0..2 {
                    let t = common::tokens(step, k, r.rank(), 2);
                    e.backward(&((gpt.loss(&t) + gpt.loss(&t.flip([0]))) * 0.5))
                        .unwrap();
                    e.step().unwrap();
                }
            }
            e.gathered_params().unwrap()
        })
        .swap_remove(0)
    };
    let sorted = |mut p: Vec<(String, Vec<f32>)>| {
        p.sort_by(|a, b| a.0.cmp(&b.0));
        p
    };
    assert_eq!(sorted(run(3)), sorted(run(0)));
}

#[test]
fn a_frozen_prefix_is_not_recomputed_nor_gathered_again() {
    let _serial = serial();
    // The embeddings and the first block frozen (fine-tuning the top of a
    // model): the first block's input and output need no gradient, so
    // backward never reaches it, checkpointed or not. Its checkpoint must
    // not recompute it, which at stage 3 would gather it once more.
    let frozen = ["wte", "wpe", "h.0."];
    for stage in [0u8, 3] {
        // Every unit sharded, however small.
        let zero = r#""stage3_param_persistence_threshold": 0,"#;
        let cfg = config_zero(stage, 1, 0.5, "", zero);
        let plain = train_frozen(&cfg, Gpt::new, &frozen);
        let ckpt = train_frozen(&cfg, Gpt::new_checkpointed, &frozen);
        assert_eq!(ckpt.1, plain.1, "stage {stage}: losses");
        assert_eq!(ckpt.0, plain.0, "stage {stage}: parameters");
        assert_eq!(ckpt.2, plain.2, "stage {stage}: overlap");
        // Nor does backward prefetch the frozen units: only the first
        // forward's guess (by index, before any order was recorded) goes
        // unused. It used to gather the embedding and the first block in
        // every backward for nothing: 4 unused gathers in 3 steps.
        assert!(plain.2.unused <= 1, "stage {stage}: {:?}", plain.2);
    }
}

#[test]
fn input_gradients_through_a_checkpointed_module_add_no_parameter_gradient_and_keep_their_graph() {
    let _serial = serial();
    seeded(input_gradients_alike);
}

fn input_gradients_alike() {
    // torch.autograd.grad(loss, x) through the checkpoint accumulated the
    // module's parameter gradients (an engine's next step applied them),
    // and with create_graph returned a gradient without its graph (a
    // gradient penalty through it added nothing, silently), until
    // 2026-11-28: the recompute back-propagated as `loss.backward()` does.
    let outcome = |checkpointed: bool| {
        let (vs, m, _) = mlp(0);
        let c = Checkpointed::new(m);
        let x = mlp_input().set_requires_grad(true);
        tch::manual_seed(7);
        let y = match checkpointed {
            true => c.forward(&x),
            false => c.with_inner(|m| m.forward(&x)),
        };
        let l = (&y * &y).sum(Kind::Float);
        let once = Tensor::run_backward(&[&l], &[&x], true, false);
        let g = Tensor::run_backward(&[&l], &[&x], true, true);
        let accumulated: Vec<String> = vs
            .variables()
            .into_iter()
            .filter(|(_, t)| t.grad().defined())
            .map(|(n, _)| n)
            .collect();
        assert!(g[0].requires_grad(), "checkpointed {checkpointed}");
        // The penalty's backward reaches the parameters through `g`.
        g[0].square().sum(Kind::Float).backward();
        (values(&once[0]), values(&g[0]), accumulated, grads(&vs))
    };
    let (want, got) = (outcome(false), outcome(true));
    assert!(want.2.is_empty());
    // First order to the bit; the second sums its terms in another order.
    assert_eq!((&got.0, &got.1, &got.2), (&want.0, &want.1, &want.2));
    assert_eq!(names(&got.3), names(&want.3));
    for ((name, g), (_, w)) in got.3.iter().zip(&want.3) {
        assert_close(g, w, name);
    }
}

fn names(p: &[(String, Vec<f32>)]) -> Vec<&str> {
    p.iter().map(|(n, _)| n.as_str()).collect()
}

/// `got` equals `want` but for rounding: within 1e-5 of each value's
/// magnitude (at least 1).
fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "{what}: {got:?} against {want:?}"
        );
    }
}

/// Linear, then tanh: a block that draws nothing from the generator the
/// ranks (threads) share.
#[derive(Debug)]
struct Tanh(nn::Linear);

impl Module for Tanh {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.0.forward(x).tanh()
    }
}

/// A loss of the input, from the model's units.
type Loss = Box<dyn Fn(&Tensor) -> Tensor>;

/// A model of units `make` builds on a fresh VarStore and plan, from seed
/// 5 (under the model lock), and the loss it gives an input.
fn units(make: impl FnOnce(&nn::VarStore, &ShardPlan) -> Loss) -> (nn::VarStore, ShardPlan, Loss) {
    let _g = common::rng_lock();
    tch::manual_seed(5);
    let vs = nn::VarStore::new(Device::Cpu);
    let plan = ShardPlan::new();
    let loss = make(&vs, &plan);
    (vs, plan, loss)
}

/// A [`Tanh`] block `i -> o` named `name`, checkpointed or not, as a unit.
fn tanh_unit(
    vs: &nn::VarStore,
    plan: &ShardPlan,
    name: &str,
    i: i64,
    o: i64,
    checkpointed: bool,
) -> Box<dyn Module> {
    let p = vs.root() / name;
    let block = Tanh(nn::linear(&p, i, o, Default::default()));
    match checkpointed {
        true => Box::new(ShardedModule::new(plan, &p, Checkpointed::new(block))),
        false => Box::new(ShardedModule::new(plan, &p, block)),
    }
}

/// Units `a` (3 -> 8) and `b` (8 -> 1), [`tanh_unit`]s; the loss is the
/// mean square of the output.
fn two_units(checkpointed: bool) -> (nn::VarStore, ShardPlan, Loss) {
    units(|vs, plan| {
        let a = tanh_unit(vs, plan, "a", 3, 8, checkpointed);
        let b = tanh_unit(vs, plan, "b", 8, 1, checkpointed);
        Box::new(move |x| b.forward(&a.forward(x)).square().mean(Kind::Float))
    })
}

/// The engine at `stage` for `vs` and `plan` on `r`'s ranks, every unit
/// sharded however small.
fn engine_at(stage: u8, vs: &nn::VarStore, plan: &ShardPlan, r: &LocalRank) -> Engine<LocalGroup> {
    let zero = r#""stage3_param_persistence_threshold": 0,"#;
    engine_of(vs, plan, &config_zero(stage, 1, 0.0, "", zero), r)
}

/// Trains the model `make` builds (see [`units`]) 3 steps at `stage`, the
/// second with a plain `loss.backward()`: rank 0's parameters and what
/// its gathers and reductions overlapped.
fn train_units(
    stage: u8,
    make: impl Fn(&nn::VarStore, &ShardPlan) -> Loss + Sync,
) -> (Vec<(String, Vec<f32>)>, OverlapCounts) {
    on_ranks(WORLD, |r| {
        let (vs, plan, loss) = units(&make);
        let e = engine_at(stage, &vs, &plan, &r);
        for k in 0..3 {
            let loss = loss(&small_input(r.rank(), k));
            match k {
                1 => loss.backward(),
                _ => e.backward(&loss).unwrap(),
            }
            e.step().unwrap();
        }
        // Each micro-step counted once, whatever backward drove it.
        assert_eq!(e.micro_steps(), 3, "stage {stage}");
        (e.gathered_params().unwrap(), e.overlap_counts())
    })
    .swap_remove(0)
}

/// Saliency maps and rank 0's parameters after training (see
/// [`train_with_saliency`]).
type WithSaliency = (Vec<Vec<f32>>, common::Params);

/// Trains the model `build` makes 3 steps at `stage`, each step after a
/// saliency map (the input's gradient only) and with a gradient penalty
/// (WGAN-GP: the input's gradient with create_graph, and the engine's
/// backward of the loss plus a function of it): the saliency maps and rank
/// 0's parameters. Each saliency map's backward leaves the model state as
/// it found it (stage 3 frees each unit it gathered).
fn train_with_saliency(
    stage: u8,
    build: impl Fn() -> (nn::VarStore, ShardPlan, Loss) + Sync,
) -> WithSaliency {
    let input = |rank: usize, k: usize| small_input(rank, k).set_requires_grad(true);
    on_ranks(WORLD, |r| {
        let (vs, plan, loss) = build();
        let e = engine_at(stage, &vs, &plan, &r);
        let mut saliency = Vec::new();
        for k in 0..3 {
            let held = e.model_state_bytes().unwrap();
            let x = input(r.rank(), 10 + k);
            let g = Tensor::run_backward(&[loss(&x)], &[&x], false, false);
            saliency.push(values(&g[0]));
            assert_eq!(e.model_state_bytes().unwrap(), held, "stage {stage}");
            let x = input(r.rank(), k);
            e.backward(&common::with_gradient_penalty(&loss(&x), &x))
                .unwrap();
            e.step().unwrap();
        }
        (saliency, e.gathered_params().unwrap())
    })
    .swap_remove(0)
}

/// Asserts that two [`train_with_saliency`] runs agree but for rounding:
/// through checkpoints the second-order terms sum in another order.
fn assert_alike(got: &WithSaliency, want: &WithSaliency, what: &str) {
    for (k, (g, w)) in got.0.iter().zip(&want.0).enumerate() {
        assert_close(g, w, &format!("{what}: saliency {k}"));
    }
    assert_eq!(names(&got.1), names(&want.1), "{what}");
    for ((name, g), (_, w)) in got.1.iter().zip(&want.1) {
        assert_close(g, w, &format!("{what}: {name}"));
    }
}

/// Unit `a` (3 -> 3, checkpointed or not) run twice, then unit `b`
/// (3 -> 1): shared layers. The loss is the mean square.
fn shared_unit(checkpointed: bool) -> impl Fn(&nn::VarStore, &ShardPlan) -> Loss + Sync {
    move |vs: &nn::VarStore, plan: &ShardPlan| -> Loss {
        let a = tanh_unit(vs, plan, "a", 3, 3, checkpointed);
        let b = tanh_unit(vs, plan, "b", 3, 1, false);
        Box::new(move |x| {
            b.forward(&a.forward(&a.forward(x)))
                .square()
                .mean(Kind::Float)
        })
    }
}

#[test]
fn input_gradients_and_a_gradient_penalty_through_checkpointed_units_train_alike_at_every_stage() {
    let _serial = serial();
    // Before each step a saliency map (the input's gradient only), then a
    // gradient penalty (WGAN-GP): the input's gradient with create_graph,
    // and the engine's backward of the loss plus a function of it. Stage
    // 3 frees each unit after the saliency map's backward.
    let want = train_with_saliency(0, || two_units(false));
    for stage in [0u8, 1, 2, 3] {
        let got = train_with_saliency(stage, || two_units(true));
        assert_alike(&got, &want, &format!("stage {stage}"));
    }
}

#[test]
fn a_checkpointed_unit_run_twice_in_one_forward_trains_like_the_plain_one() {
    let _serial = serial();
    // ALBERT-style shared layers: each run's recompute accumulates the
    // unit's gradients in a backward of its own. At stage 3 the second
    // recompute read the unit freed (SIGSEGV) until 2026-11-28, and the
    // second run's gradients were taken for another backward's (after a
    // plain loss.backward(), a micro-step more). The unit is reduced once
    // per backward, as the plain one (until late on 2026-11-28 once per
    // run, and at stage 3 gathered again for the second run's backward).
    for stage in [0u8, 1, 2, 3] {
        assert_eq!(
            train_units(stage, shared_unit(true)),
            train_units(stage, shared_unit(false)),
            "stage {stage}"
        );
    }
}

#[test]
fn checkpointed_forwards_whose_graphs_are_dropped_hold_back_no_reduction() {
    let _serial = serial();
    // Each checkpointed segment holds its units' reductions until a
    // backward recomputes it. One whose graph is dropped instead (an
    // evaluation with autograd on, a saliency map's backward, which
    // accumulates nothing) lets go when the graph goes: the next
    // backward's units are reduced as their gradients come in, not all at
    // its end, and at stage 3 freed as they go.
    let run = |stage: u8, detours: bool| {
        on_ranks(WORLD, |r| {
            let (vs, plan, loss) = two_units(true);
            let e = engine_at(stage, &vs, &plan, &r);
            for k in 0..3 {
                if detours {
                    drop(loss(&small_input(r.rank(), 10 + k)));
                    let x = small_input(r.rank(), 20 + k).set_requires_grad(true);
                    drop(Tensor::run_backward(&[loss(&x)], &[&x], false, false));
                }
                e.backward(&loss(&small_input(r.rank(), k))).unwrap();
                e.step().unwrap();
            }
            (
                e.gathered_params().unwrap(),
                e.overlap_counts().during_backward,
            )
        })
        .swap_remove(0)
    };
    for stage in [0u8, 3] {
        let (params, during) = run(stage, true);
        assert_eq!(
            during, 6,
            "stage {stage}: two units reduced in each backward"
        );
        assert_eq!((params, during), run(stage, false), "stage {stage}");
    }
}

/// A unit of two [`Tanh`] blocks `inner` (3 -> 3) and `outer` (3 -> 3),
/// `inner` checkpointed: a checkpoint covering part of a unit.
#[derive(Debug)]
struct Partly(Box<dyn Module>, Tanh);

impl Module for Partly {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.1.forward(&self.0.forward(x))
    }
}

/// Unit `a`, a [`Partly`] unit (its `inner` block checkpointed or not),
/// run once or twice, then unit `b` (3 -> 1); the loss is the mean square.
fn partly(checkpointed: bool, twice: bool) -> impl Fn(&nn::VarStore, &ShardPlan) -> Loss + Sync {
    move |vs: &nn::VarStore, plan: &ShardPlan| -> Loss {
        let p = vs.root() / "a";
        let inner = Tanh(nn::linear(&p / "inner", 3, 3, Default::default()));
        let inner: Box<dyn Module> = match checkpointed {
            true => Box::new(Checkpointed::new(inner)),
            false => Box::new(inner),
        };
        let outer = Tanh(nn::linear(&p / "outer", 3, 3, Default::default()));
        let a = ShardedModule::new(plan, &p, Partly(inner, outer));
        let b = tanh_unit(vs, plan, "b", 3, 1, false);
        Box::new(move |x| {
            let h = match twice {
                true => a.forward(&a.forward(x)),
                false => a.forward(x),
            };
            b.forward(&h).square().mean(Kind::Float)
        })
    }
}

#[test]
fn a_unit_checkpointed_in_part_and_run_twice_trains_like_the_plain_one() {
    let _serial = serial();
    // Shared layers whose checkpoint covers part of the unit (the
    // attention of a block, say). The plain part's gradients accumulate
    // once, summed over both runs; the checkpointed part's once per run,
    // each in its recompute. After the second run's recompute and the
    // plain part every parameter had a gradient: the unit was reduced
    // then and, at stage 3, freed, and the first run's recompute read it
    // freed (SIGSEGV); at stages 0-2 the first run's part was reduced on
    // its own, a sum in another order than the plain unit's (until
    // late on 2026-11-28). Now the unit waits for every recompute it holds.
    for twice in [false, true] {
        for stage in [0u8, 1, 2, 3] {
            // The same bits, gathers and reductions as the plain unit.
            assert_eq!(
                train_units(stage, partly(true, twice)),
                train_units(stage, partly(false, twice)),
                "stage {stage}, run twice: {twice}"
            );
        }
    }
}

/// Units in a row: a module of units, which a checkpoint can wrap whole.
#[derive(Debug)]
struct Row(Vec<Box<dyn Module>>);

impl Module for Row {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.0.iter().fold(x.shallow_clone(), |h, m| m.forward(&h))
    }
}

#[test]
fn a_checkpoint_around_several_units_trains_like_the_plain_units_at_every_stage() {
    let _serial = serial();
    // The checkpoint outside the units (README: inside them), so the
    // recompute runs the units' forwards again in backward: stage 3
    // gathers and frees them for it as for a forward, and their hooks
    // fire in the recompute's own backward.
    let row = |checkpointed: bool| {
        move |vs: &nn::VarStore, plan: &ShardPlan| -> Loss {
            let row = Row(vec![
                tanh_unit(vs, plan, "a", 3, 8, false),
                tanh_unit(vs, plan, "b", 8, 1, false),
            ]);
            let model: Box<dyn Module> = match checkpointed {
                true => Box::new(Checkpointed::new(row)),
                false => Box::new(row),
            };
            Box::new(move |x| model.forward(x).square().mean(Kind::Float))
        }
    };
    let want = train_units(0, row(false)).0;
    for stage in [0u8, 1, 2, 3] {
        assert_eq!(train_units(stage, row(true)).0, want, "stage {stage}");
    }
}

#[test]
fn saliency_maps_and_a_gradient_penalty_through_shared_checkpointed_units_train_alike() {
    let _serial = serial();
    // Shared units (run twice), checkpointed whole or in part, under a
    // saliency map (whose recomputes accumulate nothing, and whose
    // backward frees a stage-3 unit at its input's gradient) and a
    // gradient penalty: stage 3 must gather the unit again for the first
    // run's recompute, and the saliency maps and the training equal the
    // plain units' (to rounding: the second order sums in another order).
    for partial in [false, true] {
        let build = |checkpointed: bool| match partial {
            true => units(partly(checkpointed, true)),
            false => units(shared_unit(checkpointed)),
        };
        let want = train_with_saliency(0, || build(false));
        for stage in [0u8, 3] {
            let got = train_with_saliency(stage, || build(true));
            assert_alike(&got, &want, &format!("in part: {partial}, stage {stage}"));
        }
    }
}
