//! Mixture-of-experts layers whose experts some ranks' tokens never reach:
//! every rank runs the layer, an expert without tokens is skipped, so its
//! parameters get no gradient on that rank
//! (`ShardPlan::partly_unused_on_some_ranks`). Each run is compared with
//! the same run where idle experts run on zero tokens instead (their
//! gradient is then a defined zero on every rank, and no declaration is
//! needed): the two must train alike, bit for bit. Here, not in the
//! `integration` binary: a checkpointed layer's recompute restores
//! libtorch's RNG state (see `rng_state.rs`).

use crate::common;

use common::{engine_of, linear_unit, on_ranks, serial, small_input, WORLD};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use zrt::zero::activation::Checkpointed;
use zrt::zero::{glue, Config, Engine, EngineError, ShardPlan, ShardedModule};

/// Experts per layer.
const EXPERTS: usize = 4;

/// A mixture-of-experts layer with a residual: a router whose softmax
/// weighs each token's expert output, and `EXPERTS` linear experts. Rank 0
/// sends token `i` to expert `i % 4` (all four get tokens); every other
/// rank sends its tokens to experts 1 and 2 only, so experts 0 and 3 get
/// none there.
#[derive(Debug)]
struct Moe {
    router: nn::Linear,
    experts: Vec<nn::Linear>,
    rank: usize,
    /// How an expert without tokens is treated.
    idle: Idle,
    /// No token goes to any expert (all dropped, as a full capacity
    /// would drop them): the layer passes its input on, and none of its
    /// parameters gets a gradient.
    routes_nothing: bool,
    /// When no expert ran, the layer returns its input itself (which the
    /// declaration does not allow), not `x + 0`.
    identity_when_idle: bool,
}

/// What a layer does with an expert none of this rank's tokens reach.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Idle {
    /// Skipped: no gradient reaches its parameters on this rank (declared
    /// with `partly_unused_on_some_ranks`).
    Skipped,
    /// Run on zero tokens: its gradient is a zero tensor.
    RunOnNothing,
}

impl Moe {
    fn new(p: &nn::Path, d: i64, rank: usize, idle: Idle) -> Self {
        let experts = (0..EXPERTS)
            .map(|e| nn::linear(p / "experts" / e, d, d, Default::default()))
            .collect();
        let router = nn::linear(p / "router", d, EXPERTS as i64, Default::default());
        Self {
            router,
            experts,
            rank,
            idle,
            routes_nothing: false,
            identity_when_idle: false,
        }
    }

    /// The expert token `i` of this rank goes to, if any.
    fn route(&self, i: usize) -> Option<usize> {
        match self.rank {
            _ if self.routes_nothing => None,
            0 => Some(i % EXPERTS),
            _ => Some(1 + i % 2),
        }
    }
}

impl Module for Moe {
    fn forward(&self, x: &Tensor) -> Tensor {
        let gate = self.router.forward(x).softmax(-1, Kind::Float);
        // A new tensor even when no token is routed: the layer's output
        // must not be its input on some ranks (its backward would begin
        // at its input's gradient there, another point of backward).
        let mut y = x.zeros_like();
        let mut ran = false;
        for (e, expert) in self.experts.iter().enumerate() {
            let idx: Vec<i64> = (0..x.size()[0] as usize)
                .filter(|&i| self.route(i) == Some(e))
                .map(|i| i as i64)
                .collect();
            if idx.is_empty() && self.idle == Idle::Skipped {
                continue;
            }
            let idx = Tensor::from_slice(&idx);
            let w = gate.index_select(0, &idx).select(1, e as i64).unsqueeze(1);
            let out = expert.forward(&x.index_select(0, &idx)) * w;
            y = y.index_add(0, &idx, &out);
            ran = true;
        }
        match ran || !self.identity_when_idle {
            true => x + y,
            false => x.shallow_clone(),
        }
    }
}

/// A layer as the model runs it: plain, or checkpointed (its activations
/// recomputed in backward, which accumulates its gradients).
#[derive(Debug)]
enum Layer {
    Plain(Moe),
    Checkpointed(Checkpointed<Moe>),
}

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> Tensor {
        match self {
            Layer::Plain(m) => m.forward(x),
            Layer::Checkpointed(m) => m.forward(x),
        }
    }
}

/// How the model runs `m1`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Shape {
    /// Checkpointed.
    checkpointed: bool,
    /// Twice in each forward, before and after `b` (one layer's weights
    /// shared by two places).
    twice: bool,
    /// Left out of rank 1's forward (a misuse of the declaration).
    skipped_on_rank_1: bool,
    /// Rank 1 routes no token to any expert of `m1`, and `b` and `c` are
    /// frozen: on rank 1 a backward reaches no parameter before `m1`'s
    /// turn to be reduced comes.
    nothing_reached_on_rank_1: bool,
    /// Before each micro-step, the input's gradient by a backward that
    /// accumulates no parameter's (`torch.autograd.grad(loss, x)`).
    input_gradient_first: bool,
    /// With `nothing_reached_on_rank_1`, rank 1's `m1` returns its input
    /// itself.
    identity_on_rank_1: bool,
}

/// Units `m0` (a layer on the 3-wide input: the first unit, whose
/// backward no unit's follows), `a` (3 -> 8), `m1` (a layer 8 wide), `b`
/// (8 -> 8) and `c` (8 -> 1).
struct Model {
    vs: nn::VarStore,
    plan: ShardPlan,
    m0: ShardedModule<Moe>,
    a: ShardedModule<nn::Linear>,
    m1: ShardedModule<Layer>,
    b: ShardedModule<nn::Linear>,
    c: ShardedModule<nn::Linear>,
    shape: Shape,
}

impl Shape {
    /// Rank 1 reaches no parameter of `m1` or after it
    /// ([`Shape::nothing_reached_on_rank_1`]).
    fn nothing_on_rank_1() -> Self {
        Self {
            nothing_reached_on_rank_1: true,
            ..Self::default()
        }
    }
}

impl Model {
    /// Built with known values (index-based), the same on every rank.
    fn new(rank: usize, idle: Idle) -> Self {
        Self::shaped(rank, idle, Shape::default())
    }

    /// As [`Model::new`], `m1` run as `shape` says.
    fn shaped(rank: usize, idle: Idle, shape: Shape) -> Self {
        let _g = common::rng_lock();
        tch::set_num_threads(1);
        let vs = nn::VarStore::new(Device::Cpu);
        let plan = ShardPlan::new();
        let root = vs.root();
        let m0 = ShardedModule::new(
            &plan,
            &(&root / "m0"),
            Moe::new(&(&root / "m0"), 3, rank, idle),
        );
        let a = linear_unit(&vs, &plan, "a", 3, 8);
        let mut m1 = Moe::new(&(&root / "m1"), 8, rank, idle);
        m1.routes_nothing = shape.nothing_reached_on_rank_1 && rank == 1;
        m1.identity_when_idle = shape.identity_on_rank_1;
        let m1 = match shape.checkpointed {
            true => Layer::Checkpointed(Checkpointed::new(m1)),
            false => Layer::Plain(m1),
        };
        let m1 = ShardedModule::new(&plan, &(&root / "m1"), m1);
        let b = linear_unit(&vs, &plan, "b", 8, 8);
        let c = linear_unit(&vs, &plan, "c", 8, 1);
        common::known_values(&vs, 0.7, 0.4);
        Self {
            vs,
            plan,
            m0,
            a,
            m1,
            b,
            c,
            shape,
        }
    }

    fn loss(&self, x: &Tensor, rank: usize) -> Tensor {
        let h = self.a.forward(&self.m0.forward(x)).tanh();
        let h = match self.shape.skipped_on_rank_1 && rank == 1 {
            true => h,
            false => self.m1.forward(&h),
        };
        let h = self.b.forward(&h).tanh();
        let h = match self.shape.twice {
            true => self.m1.forward(&h),
            false => h,
        };
        self.c.forward(&h).square().mean(Kind::Float)
    }
}

/// Every parameter of every rank, as `Engine::gathered_params` gives them.
type Params = Vec<(String, Vec<f32>)>;

/// Stage `stage`, `gas` micro-steps per step, `zero` spliced into
/// `zero_optimization`; every parameter sharded (no persistence threshold).
fn config(stage: u8, gas: usize, zero: &str) -> Config {
    Config::from_json(&format!(
        r#"{{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": {gas},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}},
            "zero_optimization": {{{zero} "stage": {stage}, "stage3_param_persistence_threshold": 0}}}}"#
    ))
    .unwrap()
}

/// The experts' parameters.
fn experts(name: &str, _shape: &[i64]) -> bool {
    name.contains(".experts.")
}

/// How a run declares the experts.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Declared {
    Not,
    Partly,
    /// `unused_on_some_ranks`: the units stay gathered at stage 3.
    Unused,
}

/// What one rank's run gave: its parameters, the units reduced during
/// backward, and whether `m1`'s first expert weight was freed after the
/// last step (stage 3).
struct Run {
    params: Params,
    during_backward: u64,
    m1_freed: bool,
}

/// How a run's micro-steps go backward.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Backward {
    /// `engine.backward(&loss)`, then `engine.step()`.
    Engine,
    /// The program's own `loss.backward()`, then `engine.step()`.
    Bare,
    /// `loss.backward()`, `engine.step()` only after the last micro-step of
    /// each accumulation: the next backward ends the one before, and its
    /// hooks have begun when it does.
    BareStepAtBoundary,
}

/// Trains the model 4 micro-steps under `cfg` on every rank, idle experts
/// as `idle`, declared as `declared`, going backward as `backward` says.
fn train(
    cfg: &Config,
    idle: Idle,
    declared: Declared,
    backward: Backward,
) -> Vec<Result<Run, EngineError>> {
    train_shaped(cfg, idle, declared, backward, Shape::default())
}

/// [`train`] with `m1` run as `shape` says.
fn train_shaped(
    cfg: &Config,
    idle: Idle,
    declared: Declared,
    backward: Backward,
    shape: Shape,
) -> Vec<Result<Run, EngineError>> {
    on_ranks(WORLD, |r| {
        let m = Model::shaped(r.rank(), idle, shape);
        if shape.nothing_reached_on_rank_1 {
            common::freeze(&m.vs, &["b.", "c."]);
        }
        match declared {
            Declared::Not => {}
            Declared::Partly => {
                m.plan.partly_unused_on_some_ranks(experts).unwrap();
                assert!(m
                    .plan
                    .is_partly_unused_on_some_ranks("m1.experts.3.bias", &[8]));
                assert!(!m
                    .plan
                    .is_partly_unused_on_some_ranks("m1.router.bias", &[4]));
            }
            Declared::Unused => m.plan.unused_on_some_ranks(experts).unwrap(),
        }
        let e: Engine<_> = engine_of(&m.vs, &m.plan, cfg, &r);
        let steps = || -> Result<(), EngineError> {
            for k in 0..4 {
                if shape.input_gradient_first {
                    let x = small_input(r.rank(), 10 + k).set_requires_grad(true);
                    drop(Tensor::run_backward(
                        &[m.loss(&x, r.rank())],
                        &[&x],
                        false,
                        false,
                    ));
                }
                let loss = m.loss(&small_input(r.rank(), k), r.rank());
                match backward {
                    Backward::Engine => e.backward(&loss)?,
                    _ => loss.backward(),
                }
                let boundary = (k + 1) % e.config().batch.gas as usize == 0;
                if backward != Backward::BareStepAtBoundary || boundary {
                    e.step()?;
                }
            }
            Ok(())
        };
        steps()?;
        let w = &m.vs.variables()["m1.experts.0.weight"];
        let m1_freed = glue::storage_nbytes(w)? == 0;
        Ok(Run {
            params: e.gathered_params()?,
            during_backward: e.overlap_counts().during_backward,
            m1_freed,
        })
    })
}

/// Trains with idle experts skipped and declared, and with them run on
/// zero tokens undeclared, and asserts the two end alike: the first run.
fn trains_as_run_on_nothing(cfg: &Config, backward: Backward, shape: Shape) -> Vec<Run> {
    let run = |idle, declared| ok(train_shaped(cfg, idle, declared, backward, shape));
    let got = run(Idle::Skipped, Declared::Partly);
    let want = run(Idle::RunOnNothing, Declared::Not);
    assert_eq!(params(&got), params(&want), "{backward:?}, {shape:?}");
    got
}

/// What a run failed with ("" if it did not fail).
fn error_of<T>(r: &Result<T, EngineError>) -> String {
    r.as_ref()
        .err()
        .map(ToString::to_string)
        .unwrap_or_default()
}

fn ok(runs: Vec<Result<Run, EngineError>>) -> Vec<Run> {
    runs.into_iter().map(|r| r.unwrap()).collect()
}

fn params(runs: &[Run]) -> Vec<&Params> {
    runs.iter().map(|r| &r.params).collect()
}

#[test]
fn experts_some_ranks_never_reach_train_as_if_they_ran_on_no_tokens() {
    let _serial = serial();
    // Every stage, with and without overlap_comm, gas 1 and 2, and at
    // stage 3 with bare backwards too (their gradients are divided by the
    // accumulation steps after backward, so they are compared with bare
    // runs).
    use Backward::*;
    for stage in [0u8, 1, 2, 3] {
        for (gas, zero) in [(1, ""), (2, ""), (2, r#""overlap_comm": false,"#)] {
            let cfg = config(stage, gas, zero);
            for backward in [Engine, Bare, BareStepAtBoundary] {
                if backward != Engine && (stage != 3 || gas == 1) {
                    continue;
                }
                let got = trains_as_run_on_nothing(&cfg, backward, Shape::default());
                let what = format!("stage {stage}, gas {gas} {zero} {backward:?}");
                // Rank 0's tokens alone reach expert 0: it trained.
                let (_, start) = initial("m1.experts.0.weight");
                let moved = &got[0]
                    .params
                    .iter()
                    .find(|(n, _)| n == "m1.experts.0.weight");
                assert_ne!(moved.map(|(_, v)| v), Some(&start), "{what}");
                if stage == 3 {
                    // The experts went back to shards after the last step,
                    // as every unit's parameters do.
                    assert!(got.iter().all(|r| r.m1_freed), "{what}");
                }
            }
        }
    }
}

/// A parameter's value as the model is built.
fn initial(name: &str) -> (String, Vec<f32>) {
    let m = Model::new(0, Idle::Skipped);
    let t = m.vs.variables()[name].flatten(0, -1);
    (name.to_string(), Vec::<f32>::try_from(&t).unwrap())
}

#[test]
fn at_stage_3_declared_experts_are_sharded_and_reduced_during_backward_not_kept_gathered() {
    let _serial = serial();
    let cfg = config(3, 1, "");
    let partly = ok(train(
        &cfg,
        Idle::Skipped,
        Declared::Partly,
        Backward::Engine,
    ));
    let unused = ok(train(
        &cfg,
        Idle::Skipped,
        Declared::Unused,
        Backward::Engine,
    ));
    let plain = ok(train(
        &cfg,
        Idle::RunOnNothing,
        Declared::Not,
        Backward::Engine,
    ));
    // Both declarations train alike...
    assert_eq!(params(&partly), params(&unused));
    for r in 0..WORLD {
        // ...but `unused_on_some_ranks` keeps its units gathered (a rank
        // that skips one must not gather it), where this one frees them.
        assert!(partly[r].m1_freed && !unused[r].m1_freed && plain[r].m1_freed);
        // Four backwards of five units: `m1` is reduced when `a`'s backward
        // begins (the undeclared run reduces it from its last gradient's
        // hook); `m0`, the first unit, at the end of backward (not counted).
        assert_eq!(plain[r].during_backward, 4 * 5);
        assert_eq!(partly[r].during_backward, 4 * 4);
        // unused_on_some_ranks reduces m0 and m1 after backward.
        assert_eq!(unused[r].during_backward, 4 * 3);
    }
}

#[test]
fn experts_some_ranks_never_reach_undeclared_at_stage_3_are_named_with_the_declaration() {
    let _serial = serial();
    // Rank 0 finds m1 whole during backward and reduces it; rank 1 never
    // does. The error says which declaration mends it.
    let got = train(
        &config(3, 1, ""),
        Idle::Skipped,
        Declared::Not,
        Backward::Engine,
    );
    for (rank, r) in got.iter().enumerate() {
        let e = error_of(r);
        assert!(
            e.contains("ShardPlan::partly_unused_on_some_ranks"),
            "rank {rank}: {e}"
        );
    }
}

#[test]
fn a_rank_that_skips_a_partly_unused_unit_at_stage_3_is_told_to_declare_it_unused() {
    let _serial = serial();
    let got = on_ranks(WORLD, |r| {
        let skipped = Shape {
            skipped_on_rank_1: true,
            ..Shape::default()
        };
        let m = Model::shaped(r.rank(), Idle::Skipped, skipped);
        m.plan.partly_unused_on_some_ranks(experts).unwrap();
        let e = engine_of(&m.vs, &m.plan, &config(3, 1, ""), &r);
        let loss = m.loss(&small_input(r.rank(), 0), r.rank());
        e.backward(&loss).and_then(|()| e.step().map(|_| ()))
    });
    for (rank, r) in got.iter().enumerate() {
        let e = error_of(r);
        assert!(
            e.contains("ranks ran units in different orders")
                && e.contains("declares them with ShardPlan::unused_on_some_ranks"),
            "rank {rank}: {e}"
        );
    }
}

#[test]
fn checkpointed_experts_and_experts_run_twice_train_as_if_they_ran_on_no_tokens() {
    // A checkpointed layer's gradients are accumulated by its recompute,
    // inside its backward; a layer run twice is reduced after its first
    // run's backward, the last. Stage 3 (bare backwards too) and stage 2.
    let _serial = serial();
    let checkpointed = Shape {
        checkpointed: true,
        ..Shape::default()
    };
    let twice = Shape {
        twice: true,
        ..Shape::default()
    };
    let both = Shape {
        checkpointed: true,
        twice: true,
        ..Shape::default()
    };
    for shape in [checkpointed, twice, both] {
        let cases = [
            (3u8, 1, Backward::Engine),
            (3, 2, Backward::Bare),
            (3, 2, Backward::BareStepAtBoundary),
            (2, 2, Backward::Engine),
        ];
        for (stage, gas, backward) in cases {
            let got = trains_as_run_on_nothing(&config(stage, gas, ""), backward, shape);
            let what = format!("{shape:?}, stage {stage}, gas {gas}, {backward:?}");
            if stage == 3 {
                assert!(got.iter().all(|r| r.m1_freed), "{what}");
            }
        }
    }
}

#[test]
fn a_bare_backward_that_reaches_nothing_on_one_rank_before_a_layer_is_reduced_begins_there() {
    // On rank 1 the first gradient of a `loss.backward()` would come after
    // `m1`'s reduction (when `a`'s backward begins): the backward begins
    // at that reduction instead, as it began on rank 0 at m1's first
    // gradient, and the ranks reduce alike.
    let _serial = serial();
    let shape = Shape::nothing_on_rank_1();
    for (gas, backward) in [(1, Backward::Bare), (2, Backward::BareStepAtBoundary)] {
        trains_as_run_on_nothing(&config(3, gas, ""), backward, shape);
    }
}

#[test]
fn an_input_gradient_through_declared_layers_leaves_training_as_it_was() {
    // Its backward passes the layers' gradient hooks too, but accumulates
    // no parameter gradient: it must not begin a micro-step (reducing
    // zeros) where a reduction falls due on a rank.
    let _serial = serial();
    let plain = Shape::nothing_on_rank_1();
    let probed = Shape {
        input_gradient_first: true,
        ..plain
    };
    for backward in [Backward::Engine, Backward::Bare] {
        let cfg = config(3, 1, "");
        let run = |shape| {
            ok(train_shaped(
                &cfg,
                Idle::Skipped,
                Declared::Partly,
                backward,
                shape,
            ))
        };
        let (got, want) = (run(probed), run(plain));
        assert_eq!(params(&got), params(&want), "{backward:?}");
        assert!(got.iter().all(|r| r.m1_freed), "{backward:?}");
    }
}

#[test]
fn a_declared_layer_that_returns_its_input_itself_is_named() {
    // Rank 1 routes no token through `m1`, which then hands its input on
    // as its output: its backward would begin at another point there.
    let _serial = serial();
    let shape = Shape {
        identity_on_rank_1: true,
        ..Shape::nothing_on_rank_1()
    };
    let got = train_shaped(
        &config(3, 1, ""),
        Idle::Skipped,
        Declared::Partly,
        Backward::Engine,
        shape,
    );
    let e = error_of(&got[1]);
    assert!(
        e.contains("unit `m1` (declared with ShardPlan::partly_unused_on_some_ranks) returned its input itself"),
        "{e}"
    );
    // Rank 0 is stopped too, by whatever its next collective meets.
    assert!(got[0].is_err());
}
