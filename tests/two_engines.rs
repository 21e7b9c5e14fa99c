//! Two engines in one program, as DeepSpeed users run them: a frozen
//! teacher under ZeRO-3, only ever run forward, whose logits a student
//! learns from (distillation); two models trained in turn; a GAN, whose
//! generator's backward runs through the discriminator's parameters. Each
//! engine makes its own groups, so neither's collectives meet the
//! other's; each must train exactly as it does alone, and
//! `engine.backward` trains its own engine only (docs/choices.md), while
//! the program's own `loss.backward()` trains every engine it reaches.

use crate::common;

use common::{config_zero, engine_of, linear_unit, model_of, on_ranks, tokens, Params, GPT, WORLD};
use tch::Kind;
use zrt::collectives::local::LocalGroup;
use zrt::gpt::{Gpt, GptConfig};
use zrt::zero::{glue, AutoHints, Config, Engine, ShardPlan};

/// The student: one block where the teacher ([`GPT`]) has two.
const STUDENT: GptConfig = GptConfig { layers: 1, ..GPT };

/// AdamW at `stage`, no accumulation or clipping; at stage 3 every
/// parameter is sharded (DeepSpeed's default threshold would keep all of
/// these tiny models' parameters whole).
fn config(stage: u8) -> Config {
    config_zero(
        stage,
        1,
        0.0,
        "",
        r#""stage3_param_persistence_threshold": 0,"#,
    )
}

/// Next-token cross-entropy of `logits` for `batch`, plus their mean
/// squared distance from the teacher's.
fn distill_loss(batch: &tch::Tensor, logits: &tch::Tensor, teacher: &tch::Tensor) -> tch::Tensor {
    let y = batch.narrow(1, 1, GPT.seq);
    let ce = logits
        .view([-1, GPT.vocab])
        .cross_entropy_for_logits(&y.reshape([-1]));
    ce + (logits - teacher).square().mean(Kind::Float)
}

/// Trains the student at ZeRO-3 for three steps against the teacher's
/// logits; the teacher is a plain tch model (`teacher_stage` `None`) or
/// frozen whole in an engine of that stage. Rank 0's student losses and
/// parameters.
fn distill(teacher_stage: Option<u8>) -> (Vec<f64>, Params) {
    let out = on_ranks(WORLD, |r| {
        let (tvs, tplan, teacher) = model_of(&GPT);
        for (_, t) in tvs.variables() {
            let _ = t.set_requires_grad(false);
        }
        let (svs, splan, student) = model_of(&STUDENT);
        let _teacher_engine = teacher_stage.map(|s| engine_of(&tvs, &tplan, &config(s), &r));
        let se = engine_of(&svs, &splan, &config(3), &r);
        let losses: Vec<f64> = (0..3)
            .map(|step| {
                let batch = tokens(step, 0, r.rank(), 1);
                let x = batch.narrow(1, 0, GPT.seq);
                let t = tch::no_grad(|| teacher.forward(&x));
                if teacher_stage == Some(3) && step > 0 {
                    // Sharded for real: a block the forward is done with
                    // holds no memory (the first forward frees units to
                    // zeros it maps instead, for its check of tied weights).
                    let w = &tvs.variables()["h.0.fc.weight"];
                    assert_eq!(glue::storage_nbytes(w).unwrap(), 0);
                }
                let loss = distill_loss(&batch, &student.forward(&x), &t);
                se.backward(&loss).unwrap();
                se.step().unwrap();
                loss.double_value(&[])
            })
            .collect();
        (losses, se.gathered_params().unwrap())
    });
    out.into_iter().next().unwrap()
}

#[test]
fn a_frozen_zero_3_teacher_teaches_as_the_plain_model_does() {
    let plain = distill(None);
    assert!(plain.0.iter().all(|l| l.is_finite()), "{:?}", plain.0);
    assert_ne!(plain.0[0], plain.0[2], "the student did not learn");
    let sharded = distill(Some(3));
    assert_eq!(sharded.0, plain.0, "losses");
    assert_eq!(sharded.1, plain.1, "the student's parameters");
}

/// A model, its plan and its engine, kept together: the engine works on
/// the VarStore's tensors and the plan's units.
type Trained = (tch::nn::VarStore, ShardPlan, Gpt, Engine<LocalGroup>);

/// Trains `a` (the [`GPT`]) and `b` (the [`STUDENT`] shape) for three
/// steps each on rank `r`'s micro-batches, in turn when both are given:
/// rank 0's losses and parameters of each.
fn train(a: Option<u8>, b: Option<u8>) -> [Option<(Vec<f64>, Params)>; 2] {
    let out = on_ranks(WORLD, |r| {
        let models: Vec<Option<Trained>> = [(a, GPT), (b, STUDENT)]
            .into_iter()
            .map(|(stage, shape)| {
                stage.map(|s| {
                    let (vs, plan, gpt) = model_of(&shape);
                    let e = engine_of(&vs, &plan, &config(s), &r);
                    (vs, plan, gpt, e)
                })
            })
            .collect();
        let mut losses = [Vec::new(), Vec::new()];
        for step in 0..3 {
            for (m, l) in models.iter().zip(&mut losses) {
                if let Some((_, _, gpt, e)) = m {
                    let loss = gpt.loss(&tokens(step, 0, r.rank(), 1));
                    e.backward(&loss).unwrap();
                    e.step().unwrap();
                    l.push(loss.double_value(&[]));
                }
            }
        }
        let mut got = [None, None];
        for ((m, l), g) in models.iter().zip(losses).zip(&mut got) {
            if let Some((_, _, _, e)) = m {
                *g = Some((l, e.gathered_params().unwrap()));
            }
        }
        got
    });
    out.into_iter().next().unwrap()
}

#[test]
fn two_engines_trained_in_turn_each_train_as_alone() {
    for (sa, sb) in [(3, 3), (3, 2), (1, 3)] {
        let [a, b] = train(Some(sa), Some(sb));
        let [alone_a, _] = train(Some(sa), None);
        let [_, alone_b] = train(None, Some(sb));
        assert_eq!(a, alone_a, "stages {sa} and {sb}: the first model");
        assert_eq!(b, alone_b, "stages {sa} and {sb}: the second model");
    }
}

/// A GAN's discriminator and generator: two linear units each.
struct Gan {
    gvs: tch::nn::VarStore,
    gplan: ShardPlan,
    dvs: tch::nn::VarStore,
    dplan: ShardPlan,
    g: [zrt::zero::ShardedModule<tch::nn::Linear>; 2],
    d: [zrt::zero::ShardedModule<tch::nn::Linear>; 2],
}

impl Gan {
    fn new() -> Self {
        let _g = common::rng_lock();
        tch::manual_seed(3);
        let (gvs, gplan) = (tch::nn::VarStore::new(tch::Device::Cpu), ShardPlan::new());
        let (dvs, dplan) = (tch::nn::VarStore::new(tch::Device::Cpu), ShardPlan::new());
        let g = [
            linear_unit(&gvs, &gplan, "g1", 4, 8),
            linear_unit(&gvs, &gplan, "g2", 8, 4),
        ];
        let d = [
            linear_unit(&dvs, &dplan, "d1", 4, 8),
            linear_unit(&dvs, &dplan, "d2", 8, 1),
        ];
        Self {
            gvs,
            gplan,
            dvs,
            dplan,
            g,
            d,
        }
    }

    fn generate(&self, z: &tch::Tensor) -> tch::Tensor {
        use tch::nn::Module;
        self.g[1].forward(&self.g[0].forward(z).tanh())
    }

    /// The discriminator's mean score of `x`.
    fn score(&self, x: &tch::Tensor) -> tch::Tensor {
        use tch::nn::Module;
        self.d[1]
            .forward(&self.d[0].forward(x).tanh())
            .mean(Kind::Float)
    }
}

/// Data of `step` on `rank`, in `kind`.
fn data(step: usize, rank: usize, kind: Kind) -> tch::Tensor {
    (tch::Tensor::arange(16, (Kind::Float, tch::Device::Cpu)).view([4, 4])
        * (0.1 + 0.1 * (step * WORLD + rank) as f64))
        .cos()
        .to_kind(kind)
}

/// Two discriminator steps, with a generator step between them when
/// `generator_step` (its loss runs through the discriminator), in fp32 or
/// fp16 (`fp16`, with DeepSpeed's loss scaling): the discriminator's
/// parameters at the end, the generator's, and what was logged on rank 0.
fn gan(stage: u8, generator_step: bool, fp16: bool) -> (Params, Params, String) {
    let (top, kind) = match fp16 {
        // A scale these gradients do not overflow: no step is skipped.
        true => (
            r#""fp16": {"enabled": true, "initial_scale_power": 4},"#,
            Kind::Half,
        ),
        false => ("", Kind::Float),
    };
    let cfg = config_zero(
        stage,
        1,
        0.0,
        top,
        r#""stage3_param_persistence_threshold": 0,"#,
    );
    let out = on_ranks(WORLD, |r| {
        common::with_logs(|| {
            let m = Gan::new();
            let eg = engine_of(&m.gvs, &m.gplan, &cfg, &r);
            let ed = engine_of(&m.dvs, &m.dplan, &cfg, &r);
            let d_before = ed.gathered_params().unwrap();
            let fake = m.generate(&data(0, r.rank(), kind));
            let ld = m.score(&data(1, r.rank(), kind)) - m.score(&fake.detach());
            ed.backward(&ld).unwrap();
            ed.step().unwrap();
            if generator_step {
                eg.backward(&m.score(&fake)).unwrap();
                eg.step().unwrap();
                if stage == 3 {
                    // Re-gathered for that backward, freed again after it.
                    let w = &m.dvs.variables()["d1.weight"];
                    assert_eq!(glue::storage_nbytes(w).unwrap(), 0);
                }
            }
            // The discriminator's second step reads real data only.
            ed.backward(&m.score(&data(2, r.rank(), kind))).unwrap();
            ed.step().unwrap();
            let d = ed.gathered_params().unwrap();
            assert_ne!(d, d_before, "the discriminator did not train");
            (d, eg.gathered_params().unwrap())
        })
    });
    let ((d, g), logs) = out.into_iter().next().unwrap();
    (d, g, logs)
}

#[test]
fn another_engines_backward_through_this_ones_parameters_trains_neither_them_nor_it_twice() {
    // In fp16 the generator's scaled loss reached the discriminator's
    // hooks, which used to fail it: "call engine.backward(&loss)".
    for (stage, fp16) in [(0u8, false), (1, false), (2, false), (3, false), (3, true)] {
        let (d, g, logs) = gan(stage, true, fp16);
        let (d_alone, g_untrained, quiet) = gan(stage, false, fp16);
        // The generator's loss reached the discriminator's parameters, and
        // its step dropped their gradients, as zero_grad() would have.
        assert_eq!(d, d_alone, "stage {stage}: the discriminator");
        assert_ne!(g, g_untrained, "stage {stage}: the generator did not train");
        assert_eq!(
            logs.matches("another engine's backward sent gradients")
                .count(),
            1,
            "stage {stage}: {logs}"
        );
        assert!(logs.contains("unit `d"), "{logs}");
        assert!(!quiet.contains("another engine"), "{quiet}");
    }
}

/// Three steps of the generator's loss through the discriminator, which
/// trains both: by the program's own `loss.backward()` and a step of each
/// engine, or (`one_engine`) in one engine over the same four units.
/// Rank 0's parameters by name.
fn joint(stage: u8, one_engine: bool) -> Params {
    use tch::nn::Module;
    let out = on_ranks(WORLD, |r| {
        let loss = |u: &[&zrt::zero::ShardedModule<tch::nn::Linear>; 4], step: usize| {
            let fake = u[1].forward(&u[0].forward(&data(step, r.rank(), Kind::Float)).tanh());
            u[3].forward(&u[2].forward(&fake).tanh()).mean(Kind::Float)
        };
        let mut p = if one_engine {
            // The same units from the same draws as `Gan::new`, in one VarStore.
            let (vs, plan, u) = {
                let _g = common::rng_lock();
                tch::manual_seed(3);
                let (vs, plan) = (tch::nn::VarStore::new(tch::Device::Cpu), ShardPlan::new());
                let u = [("g1", 4, 8), ("g2", 8, 4), ("d1", 4, 8), ("d2", 8, 1)]
                    .map(|(n, i, o)| linear_unit(&vs, &plan, n, i, o));
                (vs, plan, u)
            };
            let e = engine_of(&vs, &plan, &config(stage), &r);
            for step in 0..3 {
                loss(&[&u[0], &u[1], &u[2], &u[3]], step).backward();
                e.step().unwrap();
            }
            e.gathered_params().unwrap()
        } else {
            let m = Gan::new();
            let eg = engine_of(&m.gvs, &m.gplan, &config(stage), &r);
            let ed = engine_of(&m.dvs, &m.dplan, &config(stage), &r);
            for step in 0..3 {
                loss(&[&m.g[0], &m.g[1], &m.d[0], &m.d[1]], step).backward();
                eg.step().unwrap();
                ed.step().unwrap();
            }
            let mut p = eg.gathered_params().unwrap();
            p.extend(ed.gathered_params().unwrap());
            p
        };
        p.sort_by(|a, b| a.0.cmp(&b.0));
        p
    });
    out.into_iter().next().unwrap()
}

#[test]
fn one_loss_backward_through_two_engines_trains_both_as_one_engine_would() {
    for stage in [0u8, 1, 2, 3] {
        assert_eq!(joint(stage, false), joint(stage, true), "stage {stage}");
    }
}

#[test]
fn an_engine_built_again_on_the_same_model_goes_on_from_the_dropped_ones_values() {
    // A new config, a next phase of training: unshard, drop the engine,
    // build another on the same model and plan. After bf16 the model holds
    // the trained values in bf16 (the fp32 masters go with the engine, as
    // they do with DeepSpeed's; a checkpoint keeps them): the next engine
    // starts from those, widened.
    let bf16 = |stage: u8| {
        config_zero(
            stage,
            1,
            0.0,
            r#""bf16": {"enabled": true},"#,
            r#""stage3_param_persistence_threshold": 0,"#,
        )
    };
    let cases = [
        ("stages 3 then 3", config(3), config(3)),
        ("stages 3 then 0", config(3), config(0)),
        ("stages 2 then 3", config(2), config(3)),
        ("bf16 stages 3 then 3", bf16(3), bf16(3)),
        ("bf16 stage 1 then stage 3", bf16(1), bf16(3)),
    ];
    for (what, first, second) in cases {
        let out = on_ranks(WORLD, |r| {
            let (vs, plan, gpt) = model_of(&GPT);
            let train = |e: &Engine<LocalGroup>, from: usize| {
                for step in from..from + 2 {
                    e.backward(&gpt.loss(&tokens(step, 0, r.rank(), 1)))
                        .unwrap();
                    e.step().unwrap();
                }
                e.gathered_params().unwrap()
            };
            let e = engine_of(&vs, &plan, &first, &r);
            let trained = train(&e, 0);
            // While it lives, the plan is its own.
            let group = r.new_group(&(0..WORLD).collect::<Vec<_>>()).unwrap();
            let refused = Engine::new(&vs, &plan, &second, group, &AutoHints::default());
            let refused = refused.err().expect("a second engine on a claimed plan");
            assert!(
                refused
                    .to_string()
                    .contains("this plan already drives another engine"),
                "{refused}"
            );
            e.unshard().unwrap();
            drop(e);
            let e = engine_of(&vs, &plan, &second, &r);
            let start = e.gathered_params().unwrap();
            let again = train(&e, 2);
            (trained, start, again)
        });
        let (mut trained, start, again) = out.into_iter().next().unwrap();
        if what.starts_with("bf16") {
            for (_, v) in &mut trained {
                let t = tch::Tensor::from_slice(v).to_kind(Kind::BFloat16);
                *v = Vec::<f32>::try_from(&t.to_kind(Kind::Float)).unwrap();
            }
        }
        assert_eq!(
            start, trained,
            "{what}: the second engine starts from the trained values"
        );
        assert_ne!(again, start, "{what}: the second engine did not train");
    }
}
