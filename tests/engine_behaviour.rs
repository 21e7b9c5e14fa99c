//! The engine on three tiny linears, 2 ranks (threads): exact gradient
//! shards and padding, exact accumulation, stage-3 gathering and freeing,
//! memory against DESIGN.md's formula, timing independence, and units run in
//! different orders.

use crate::common;

use std::sync::Mutex;

use common::{engine_of, linear_unit, on_ranks, small_input as input, solo_engine, Params};

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use zrt::collectives::local::{self, LocalGroup};
use zrt::collectives::ProcessGroup;
use zrt::zero::{glue, AutoHints, Config, Engine, EngineError, ShardPlan, ShardedModule};

const WORLD: usize = 2;

struct Tiny {
    vs: nn::VarStore,
    plan: ShardPlan,
    a: ShardedModule<nn::Linear>,
    b: ShardedModule<nn::Linear>,
    c: ShardedModule<nn::Linear>,
}

/// Three linears 3 -> 5 -> 4 -> 1 with known values (index-based).
fn tiny() -> Tiny {
    let _g = common::rng_lock();
    tch::set_num_threads(1);
    let vs = nn::VarStore::new(Device::Cpu);
    let plan = ShardPlan::new();
    let mk = |name: &str, i: i64, o: i64| linear_unit(&vs, &plan, name, i, o);
    let (a, b, c) = (mk("a", 3, 5), mk("b", 5, 4), mk("c", 4, 1));
    common::known_values(&vs, 1.0, 0.5);
    Tiny { vs, plan, a, b, c }
}

impl Tiny {
    fn loss(&self, x: &Tensor) -> Tensor {
        self.loss_after_a(&self.a.forward(x))
    }

    /// The loss from `a`'s output `h` (for tests that look between units).
    fn loss_after_a(&self, h: &Tensor) -> Tensor {
        self.c
            .forward(&self.b.forward(h).tanh())
            .square()
            .mean(Kind::Float)
    }
}

fn config(stage: u8, gas: usize) -> Config {
    config_plus(stage, gas, "", "")
}

/// [`config`] with `top` spliced into the top level and `zero` into
/// `zero_optimization` (each ending with a comma).
fn config_plus(stage: u8, gas: usize, top: &str, zero: &str) -> Config {
    Config::from_json(&format!(
        r#"{{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": {gas}, {top}
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}},
            "zero_optimization": {{{zero} "stage": {stage}, "stage3_param_persistence_threshold": 0}}}}"#
    ))
    .unwrap()
}

fn group(r: &local::LocalRank) -> LocalGroup {
    r.new_group(&(0..WORLD).collect::<Vec<_>>()).unwrap()
}

/// The tiny model and its engine under `cfg` on rank `r`'s world group.
fn tiny_engine(cfg: &Config, r: &local::LocalRank) -> (Tiny, Engine<LocalGroup>) {
    let t = tiny();
    let e = engine_for(&t, cfg, r);
    (t, e)
}

/// The engine for `t` (built as it is now) under `cfg` on rank `r`.
fn engine_for(t: &Tiny, cfg: &Config, r: &local::LocalRank) -> Engine<LocalGroup> {
    engine_of(&t.vs, &t.plan, cfg, r)
}

/// A 3-element parameter `extra` (all ones) added to unit `unit` of `t`.
fn extra_param(t: &Tiny, unit: &str) -> Tensor {
    let _g = common::rng_lock();
    (t.vs.root() / unit).ones("extra", &[3])
}

/// Each rank's gradient of unit `u` for micro-step k, flattened in the flat
/// layout (sorted names, 16-aligned, padded), divided by gas, as f32.
fn reference_grad(unit: &str, k: usize, rank: usize, gas: usize, padded: usize) -> Vec<f32> {
    let t = tiny();
    (t.loss(&input(rank, k)) / gas as f64).backward();
    let mut names: Vec<_> =
        t.vs.variables()
            .into_iter()
            .filter(|(n, _)| n.starts_with(&format!("{unit}.")))
            .collect();
    names.sort_by(|x, y| x.0.cmp(&y.0));
    let mut flat = vec![0f32; padded];
    let mut off = 0;
    for (_, p) in names {
        let g = Vec::<f32>::try_from(&p.grad().flatten(0, -1)).unwrap();
        flat[off..off + g.len()].copy_from_slice(&g);
        off = (off + g.len()).div_ceil(16) * 16;
    }
    flat
}

#[test]
fn gradient_shards_padding_and_accumulation_are_exact() {
    for stage in [2u8, 3] {
        let got: Vec<_> = on_ranks(WORLD, |r| {
            let (t, e) = tiny_engine(&config(stage, 2), &r);
            assert_eq!(e.unit_names(), ["a", "b", "c"]);
            let mut after = Vec::new();
            for k in 0..2 {
                e.backward(&t.loss(&input(r.rank(), k))).unwrap();
                after.push(
                    (0..3)
                        .map(|u| e.grad_buffer(u).unwrap())
                        .collect::<Vec<_>>(),
                );
                e.step().unwrap();
            }
            (r.rank(), after)
        });
        // a: weight 15 at 0, bias 5 at 16 -> 21 -> padded to 2 x 16 = 32;
        // b: weight 20 at 0, bias 4 at 32 -> 36 -> 64; c: 4 at 0, 1 at 16 -> 32.
        for (rank, after) in got {
            for (u, name) in ["a", "b", "c"].iter().enumerate() {
                let padded = [32, 64, 32][u];
                let half = padded / 2;
                let mut want = vec![0f32; padded];
                for (k, grads) in after.iter().enumerate() {
                    // Average over ranks in f64, round once, accumulate in f32.
                    let r0 = reference_grad(name, k, 0, 2, padded);
                    let r1 = reference_grad(name, k, 1, 2, padded);
                    for i in 0..padded {
                        want[i] += ((r0[i] as f64 + r1[i] as f64) / 2.0) as f32;
                    }
                    let shard = &want[rank * half..(rank + 1) * half];
                    assert_eq!(
                        &grads[u][..],
                        shard,
                        "stage {stage} unit {name} rank {rank} after micro-step {k}"
                    );
                }
                // `a` sorts bias (5 elements at 0) before weight (15 at 16):
                // its padding is 5..16 (rank 0's shard) and 31 (rank 1's).
                if *name == "a" {
                    let pad: &[f32] = if rank == 0 {
                        &after[1][0][5..16]
                    } else {
                        &after[1][0][15..]
                    };
                    assert!(
                        !pad.is_empty() && pad.iter().all(|&x| x == 0.0),
                        "padding must stay zero: {pad:?}"
                    );
                    assert!(
                        after[1][0].iter().any(|&x| x != 0.0),
                        "the real gradients are not all zero"
                    );
                }
            }
        }
    }
}

#[test]
fn stage_3_frees_units_after_forward_and_between_steps() {
    on_ranks(WORLD, |r| {
        let t = tiny();
        let vars = t.vs.variables();
        let (w0, b0) = (vars["a.weight"].copy(), vars["a.bias"].copy());
        let e = Engine::new(
            &t.vs,
            &t.plan,
            &config(3, 1),
            group(&r),
            &AutoHints::default(),
        )
        .unwrap();
        let w = t.vs.variables()["a.weight"].shallow_clone();
        assert_eq!(
            glue::storage_nbytes(&w).unwrap(),
            0,
            "freed before the first forward"
        );
        for pass in 0..2 {
            let x = input(r.rank(), pass);
            let h = t.a.forward(&x);
            if pass == 0 {
                // Forward ran on the gathered values (rank 0's).
                assert!(
                    h.allclose(&(x.matmul(&w0.tr()) + &b0), 1e-6, 1e-6, false),
                    "forward used the gathered values"
                );
                // The first forward keeps units gathered while it
                // checks which parameters each one used.
                assert!(
                    glue::storage_nbytes(&w).unwrap() > 0,
                    "kept through the first forward"
                );
            } else {
                assert_eq!(
                    glue::storage_nbytes(&w).unwrap(),
                    0,
                    "resharded after forward"
                );
            }
            let loss = t.loss_after_a(&h);
            // When backward reaches `a`'s output, `c` (whose backward
            // is long done) is already reduced and freed: reductions
            // and frees happen during backward, not after it.
            let c_w = t.vs.variables()["c.weight"].shallow_clone();
            let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
            let seen2 = seen.clone();
            glue::on_grad(&h, move || {
                *seen2.lock().unwrap() = Some(glue::storage_nbytes(&c_w).unwrap());
            })
            .unwrap();
            e.backward(&loss).unwrap();
            assert_eq!(*seen.lock().unwrap(), Some(0), "c freed during backward");
            let counts = e.overlap_counts();
            assert_eq!(
                counts.during_backward,
                3 * (pass as u64 + 1),
                "every unit reduced from its hook: {counts:?}"
            );
            if pass == 1 {
                // Forward prefetched b and c; backward re-gathered c,
                // then b and a (prefetched while the one before ran).
                assert!(counts.prefetched >= 4, "{counts:?}");
            }
            assert_eq!(
                glue::storage_nbytes(&w).unwrap(),
                0,
                "resharded after backward"
            );
            assert!(!w.grad().defined(), "no full gradient is kept");
            assert!(
                e.grad_buffer(0).unwrap().iter().any(|&g| g != 0.0),
                "backward produced gradients"
            );
            assert!(e.step().unwrap());
            assert_eq!(
                glue::storage_nbytes(&w).unwrap(),
                0,
                "resharded after step()"
            );
            // Freed units gave their gathered buffers back for the
            // next gathers, keeping at most two (b, 64 padded f32
            // elements, and a or c, 32).
            let pooled = e.pooled_bytes();
            assert!(
                pooled > 0 && pooled <= (64 + 32) * 4,
                "pooled {pooled} bytes"
            );
        }
    });
}

#[test]
fn overlap_comm_false_waits_for_each_units_reduction_in_its_hook() {
    // When backward reaches `a`'s output, `c`'s hook issued its reduction
    // long before. With `overlap_comm` it may still be in flight (two
    // buckets are allowed) and nothing is in c's gradient buffer yet;
    // without, the hook waited for it and the buffer holds it. On by
    // default at every stage.
    for (stage, zero, waited) in [
        (2u8, r#""overlap_comm": true,"#, false),
        (2, r#""overlap_comm": false,"#, true),
        (2, "", false),
        (3, "", false),
        (3, r#""overlap_comm": false,"#, true),
        (0, r#""overlap_comm": false,"#, true),
    ] {
        let cfg = config_plus(stage, 1, "", zero);
        let buffers = on_ranks(WORLD, |r| {
            let (t, e) = tiny_engine(&cfg, &r);
            let e = std::sync::Arc::new(e);
            let c = e.unit_names().iter().position(|n| n == "c").unwrap();
            let h = t.a.forward(&input(r.rank(), 0));
            let seen = std::sync::Arc::new(Mutex::new(None));
            let (seen2, e2) = (seen.clone(), e.clone());
            glue::on_grad(&h, move || *seen2.lock().unwrap() = e2.grad_buffer(c)).unwrap();
            e.backward(&t.loss_after_a(&h)).unwrap();
            let at_a = seen.lock().unwrap().take().expect("the hook ran");
            (at_a, e.grad_buffer(c).unwrap())
        });
        for (rank, (at_a, after)) in buffers.into_iter().enumerate() {
            let what = format!("stage {stage}, {zero:?}, rank {rank}");
            assert!(after.iter().any(|&g| g != 0.0), "{what}: {after:?}");
            if waited {
                assert_eq!(at_a, after, "{what}: reduced in c's hook");
            } else {
                assert!(at_a.iter().all(|&g| g == 0.0), "{what}: in flight {at_a:?}");
            }
        }
    }
}

#[test]
fn a_units_gradient_buffer_goes_back_to_the_pool_for_the_next_backward() {
    // Backward stages each unit's gradients in a whole padded f32 buffer
    // (c: 32 elements, b: 64, a: 32, in backward order: 16-element slots,
    // padded to a multiple of 16 per rank); once reduced it is kept for
    // the next backward's, the newest two of them.
    for stage in [0u8, 1, 2] {
        on_ranks(WORLD, |r| {
            let (t, e) = tiny_engine(&config(stage, 1), &r);
            assert_eq!(e.pooled_bytes(), 0, "stage {stage}");
            e.backward(&t.loss(&input(r.rank(), 0))).unwrap();
            assert_eq!(e.pooled_bytes(), (64 + 32) * 4, "stage {stage}");
        });
    }
}

#[test]
fn stage_3_prefetches_in_the_order_forward_ran_not_the_wrapping_order() {
    on_ranks(WORLD, |r| {
        // Wrapped c, a, b (units 0, 1, 2) but run a, b, c: as a GPT
        // wraps its token embedding and head after the blocks.
        // Built under the RNG lock: `nn::linear` draws its values.
        let rng = common::rng_lock();
        let (vs, plan) = (nn::VarStore::new(Device::Cpu), ShardPlan::new());
        let mk = |name: &str, i: i64, o: i64| linear_unit(&vs, &plan, name, i, o);
        let c = mk("c", 4, 1);
        let a = mk("a", 3, 5);
        let b = mk("b", 5, 4);
        drop(rng);
        let e = Engine::new(&vs, &plan, &config(3, 1), group(&r), &AutoHints::default()).unwrap();
        assert_eq!(e.unit_names(), ["c", "a", "b"]);
        let c_w = vs.variables()["c.weight"].shallow_clone();
        let a_w = vs.variables()["a.weight"].shallow_clone();
        for pass in 0..3 {
            let before = e.overlap_counts();
            let y = c.forward(&b.forward(&a.forward(&input(r.rank(), pass))).tanh());
            if pass > 0 {
                assert_eq!(glue::storage_nbytes(&a_w).unwrap(), 0, "a resharded");
                // Backward starts with c: it stays gathered.
                assert!(
                    glue::storage_nbytes(&c_w).unwrap() > 0,
                    "the unit forward ran last stays gathered for backward"
                );
            }
            e.backward(&y.square().mean(Kind::Float)).unwrap();
            assert!(e.step().unwrap());
            let now = e.overlap_counts();
            let on_demand = now.on_demand - before.on_demand;
            let unused = now.unused - before.unused;
            if pass == 0 {
                // No order known yet, so by index: a prefetched b
                // (unit 2), b nothing (no unit 3), c waited.
                // Backward found every unit kept by the first forward.
                assert_eq!((on_demand, unused), (2, 0), "{now:?}");
            } else {
                // By the recorded order only a, which starts the
                // forward, waited for its whole gather; b and c
                // (forward), b and a (backward) were prefetched, and
                // nothing was gathered for nobody.
                assert_eq!((on_demand, unused), (1, 0), "pass {pass}: {now:?}");
                assert_eq!(now.prefetched - before.prefetched, 4, "{now:?}");
            }
        }
    });
}

#[test]
fn model_state_bytes_match_the_design_formula() {
    for stage in 0..=3u8 {
        let got: Vec<usize> = on_ranks(WORLD, |r| {
            let (t, e) = tiny_engine(&config(stage, 1), &r);
            e.backward(&t.loss(&input(r.rank(), 0))).unwrap();
            e.step().unwrap();
            e.model_state_bytes().unwrap()
        });
        // Psi (padded) = 32 + 64 + 32; N = 2; fp32: params 4, grads 4, m + v 8 bytes.
        let (p, n) = (128usize, WORLD);
        let want = match stage {
            0 => 16 * p,
            1 => 4 * p + 4 * p + 8 * p / n,
            2 => 4 * p + 12 * p / n,
            _ => 16 * p / n,
        };
        assert_eq!(got, vec![want; WORLD], "stage {stage}");
    }
}

/// `steps` optimizer steps of `t` under `e` (a config with 2 accumulation
/// steps), rank `rank`'s micro-batches.
fn train_steps(t: &Tiny, e: &Engine<LocalGroup>, rank: usize, steps: usize) {
    for step in 0..steps {
        for k in 0..2 {
            e.backward(&t.loss(&input(rank, k + step))).unwrap();
            e.step().unwrap();
        }
    }
}

fn train(stage: u8, delays: bool) -> Vec<(String, Vec<f32>)> {
    let out: Vec<_> = on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&config(stage, 2), &r);
        if delays {
            e.inject_delays(0x5eed + r.rank() as u64);
        }
        train_steps(&t, &e, r.rank(), 3);
        e.gathered_params().unwrap()
    });
    out.into_iter().next().unwrap()
}

#[test]
fn random_delays_before_collectives_change_no_bit() {
    for stage in [1u8, 2, 3] {
        assert_eq!(train(stage, false), train(stage, true), "stage {stage}");
    }
}

#[test]
fn units_run_in_different_orders_are_an_error_naming_them() {
    let errs: Vec<String> = on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&config(3, 1), &r);
        let x = input(r.rank(), 0);
        // Rank 1 runs unit b before unit a: shapes differ, so
        // feed b a 5-wide input directly.
        let y = if r.rank() == 0 {
            t.c.forward(&t.b.forward(&t.a.forward(&x)))
        } else {
            let h =
                t.b.forward(&Tensor::ones([4, 5], (Kind::Float, Device::Cpu)));
            let _ = t.a.forward(&x);
            t.c.forward(&h)
        };
        match e.backward(&y.mean(Kind::Float)) {
            Err(err @ EngineError::UnitOrder(_)) => err.to_string(),
            other => panic!("expected a unit-order error, got {other:?}"),
        }
    });
    for e in errs {
        assert!(e.contains("rank 0 runs `a`, rank 1 runs `b`"), "{e}");
    }
}

#[test]
fn a_unit_skipped_on_some_ranks_trains_when_declared_and_is_named_when_not() {
    // Rank 1 leaves unit b out of its forward (its input to c is a's
    // output cut to b's width) in the first micro-step of each step; with
    // `Extra::TimesZero` it runs b there too, its output times zero added
    // (in the same place, so its gradients, zero, complete b at the same
    // point of backward as on rank 0; adding 0 x b's parameters to the
    // loss instead completes b first, which puts the reductions out of
    // step as surely as leaving b out).
    // `bare`: the program's own `loss.backward()`.
    let run = |stage: u8, declared: Option<Extra>, bare: bool| {
        on_ranks(WORLD, |r| {
            let t = tiny();
            if declared == Some(Extra::Declared) {
                t.plan
                    .unused_on_some_ranks(|name, _| name.starts_with("b."))
                    .unwrap();
            }
            let e = engine_for(&t, &config(stage, 2), &r);
            for k in 0..4 {
                let x = input(r.rank(), k);
                let h = t.a.forward(&x);
                let skip = r.rank() == 1 && k % 2 == 0;
                let h = match (skip, declared) {
                    (true, Some(Extra::TimesZero)) => h.narrow(1, 0, 4) + t.b.forward(&h) * 0.0,
                    (true, _) => h.narrow(1, 0, 4),
                    (false, _) => t.b.forward(&h),
                };
                let loss = t.c.forward(&h).square().mean(Kind::Float);
                match bare {
                    true => loss.f_backward().map_err(|e| e.to_string())?,
                    false => e.backward(&loss).map_err(|e| e.to_string())?,
                }
                e.step().map_err(|e| e.to_string())?;
            }
            let during = e.overlap_counts().during_backward;
            Ok::<_, String>((e.gathered_params().unwrap(), during))
        })
    };
    let params = |got: Vec<Result<(_, u64), String>>| -> Vec<_> {
        got.into_iter().map(|g| g.map(|(p, _)| p)).collect()
    };
    // Each rank's reductions issued from backward's hooks.
    let during = |got: &[Result<(Params, u64), String>]| -> Vec<u64> {
        got.iter().map(|g| g.as_ref().unwrap().1).collect()
    };
    // Declared, stage 0 trains as if rank 1 used b times zero, to the bit.
    let reference = params(run(0, Some(Extra::TimesZero), false));
    assert_eq!(params(run(0, Some(Extra::Declared), false)), reference);
    let reference = reference[0].as_ref().unwrap();
    // `what` trained as the reference did, on every rank.
    let assert_close = |what: &str, got: Vec<Result<(Params, u64), String>>| {
        for (rank, g) in params(got).iter().enumerate() {
            assert_params_close(
                &format!("{what} rank {rank}"),
                g.as_ref().unwrap(),
                reference,
            );
        }
    };
    for stage in [0u8, 1, 2, 3] {
        let got = run(stage, Some(Extra::Declared), false);
        // Units reduced from backward's hooks on each rank, of 3 x 4: the
        // first backward leaves b to its end (no launch order agreed
        // yet); from the second on, stages 0 and 2 reduce b in its turn,
        // at once where the walk from the loss finds it unreached (rank 1,
        // micro-step 2); stage 3 leaves it to the end throughout; stage 1,
        // whose first backward only adds to local sums, takes each unit as
        // it completes there (rank 1's b at its end), then as stages 0
        // and 2 do.
        let want = match stage {
            0 | 2 => [2 + 3 * 3; 2],
            1 => [3 * 4, 2 + 3 * 3],
            _ => [2 * 4; 2],
        };
        assert_eq!(during(&got), want, "stage {stage}");
        assert_close(&format!("stage {stage}"), got);
    }
    // A bare `loss.backward()` gives no loss to walk from: rank 1's b,
    // left out of micro-steps 0 and 2, is never whole there and holds
    // back a, after it in the order, to the end of micro-step 2 (the
    // first backward defers b on both ranks anyway). Slower, not out of
    // step: the same training.
    let got = run(2, Some(Extra::Declared), true);
    assert_eq!(during(&got), [2 + 3 * 3, 2 + 3 + 1 + 3], "bare");
    assert_close("bare", got);
    // Undeclared, stage 2 names the parameters rank 1 lacks, and how to
    // declare them.
    for (rank, e) in params(run(2, None, false)).into_iter().enumerate() {
        let e = e.unwrap_err();
        assert!(
            e.starts_with("gradient reductions out of step across ranks"),
            "{e}"
        );
        assert!(e.contains("ShardPlan::unused_on_some_ranks"), "{e}");
        let lacks = "no gradient reached `b.bias` (unit `b`), `b.weight` (unit `b`) (to declare them: `plan.unused_on_some_ranks(|name, _| name.starts_with(\"b.\"))?`)";
        assert_eq!(e.contains(lacks), rank == 1, "rank {rank}: {e}");
    }
    // Undeclared, stage 3 gathers b for its backward on rank 0 where
    // rank 1 gathers a (declared, b stays gathered).
    for e in params(run(3, None, false)) {
        let e = e.unwrap_err();
        assert!(
            e.starts_with("ranks ran units in different orders: rank 0 runs the backward of `b`, rank 1 runs the backward of `a`")
                && e.contains("declares them with ShardPlan::unused_on_some_ranks, and stage 3 then keeps them gathered"),
            "{e}"
        );
    }
}

#[test]
fn stage_1_reduces_in_the_boundary_backward_in_the_order_the_ranks_agreed() {
    // Stage 1 reduce-scatters a step's accumulated gradients from the
    // hooks of the backward that ends the accumulation, as DeepSpeed's
    // does, once the first backward has agreed the order of the units
    // (before that, and at gas 1 in the first step, `step()` reduces
    // them). Rank 1 leaves b out of the boundary micro-steps after the
    // first step, undeclared (stage 1 never needed the declaration): b is
    // then whole only at the end of its backward, and holds a back there,
    // so both ranks still reduce c, b, a. `zero`: how b takes part in
    // rank 1's skipped micro-steps (in the same place, its output times
    // zero, or not at all).
    let run = |gas: usize, times_zero: bool| {
        on_ranks(WORLD, |r| {
            let (t, e) = tiny_engine(&config(1, gas), &r);
            let scatters = || -> u64 {
                let all = e.group().stats().by_size();
                (all.iter().filter(|s| s.op == "reduce_scatter"))
                    .map(|s| s.calls)
                    .sum()
            };
            let mut seen = Vec::new();
            for k in 0..6 {
                let h = t.a.forward(&input(r.rank(), k));
                let skip = r.rank() == 1 && k >= gas && (k + 1) % gas == 0;
                let h = match (skip, times_zero) {
                    (true, true) => h.narrow(1, 0, 4) + t.b.forward(&h) * 0.0,
                    (true, false) => h.narrow(1, 0, 4),
                    (false, _) => t.b.forward(&h),
                };
                let loss = t.c.forward(&h).square().mean(Kind::Float);
                let before = scatters();
                e.backward(&loss).unwrap();
                let backward = scatters();
                e.step().unwrap();
                seen.push((backward - before, scatters() - backward));
            }
            (e.gathered_params().unwrap(), seen)
        })
    };
    for gas in [1, 2] {
        let got = run(gas, false);
        // Reduce-scatters (one per unit) in backward and in step().
        let want: Vec<(u64, u64)> = (0..6)
            .map(|k| match (k + 1) % gas == 0 {
                false => (0, 0),
                true if k == 0 => (0, 3),
                true => (3, 0),
            })
            .collect();
        for (rank, (_, seen)) in got.iter().enumerate() {
            assert_eq!(seen, &want, "gas {gas} rank {rank}");
        }
        // Leaving b out trains as running it times zero, to the bit.
        let zero = run(gas, true);
        for (rank, ((p, _), (q, _))) in got.iter().zip(&zero).enumerate() {
            assert_eq!(p, q, "gas {gas} rank {rank}");
        }
        assert_eq!(got[0].0, got[1].0, "gas {gas}");
    }
}

#[test]
fn a_stage_1_checkpoint_between_the_boundary_backward_and_its_step_resumes_exactly() {
    // The boundary's backward has reduced the step's gradients when a
    // save comes before its `step()`: the checkpoint still holds the
    // accumulated sums (the reduction ran on a copy), and an engine that
    // loads it there, fresh or in its own window with other sums reduced
    // already, steps with the loaded ones.
    let dir = common::scratch("stage1-window");
    let cfg = config(1, 2);
    // Two steps of micro-batches `from..`, saving in the second step's
    // window (`save`), or loading there (`load`).
    let run = |r: &local::LocalRank, from: usize, save: bool, load: bool| {
        let (t, e) = tiny_engine(&cfg, r);
        for k in 0..4 {
            e.backward(&t.loss(&input(r.rank(), from + k))).unwrap();
            if k == 3 && save {
                e.save_checkpoint(&dir, "window").unwrap();
            }
            if k == 3 && load {
                e.load_checkpoint(&dir, Some("window")).unwrap();
            }
            assert_eq!(e.step().unwrap(), k % 2 == 1, "micro-step {k}");
        }
        e.gathered_params().unwrap()
    };
    let got = on_ranks(WORLD, |r| {
        let saved = run(&r, 10, true, false);
        let other = run(&r, 0, false, false);
        let loaded = run(&r, 0, false, true);
        let (_, e) = tiny_engine(&cfg, &r);
        e.load_checkpoint(&dir, Some("window")).unwrap();
        assert!(e.step().unwrap());
        (saved, other, loaded, e.gathered_params().unwrap())
    });
    for (rank, (saved, other, loaded, resumed)) in got.iter().enumerate() {
        assert_eq!(loaded, saved, "rank {rank}: loaded in the window");
        assert_eq!(resumed, saved, "rank {rank}: resumed");
        // The check can fail: the two runs' batches step apart.
        assert_ne!(other, saved, "rank {rank}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_declared_unit_a_foreign_checkpoint_hides_from_the_walk_is_refused_not_lost() {
    // Stages 0 and 2 count a declared unit whole at once when the walk
    // from the loss does not reach it. A checkpoint the engine does not
    // track (glue::checkpoint straight, not Checkpointed) hides b's
    // parameters from that walk, then its recompute accumulates them
    // after b was reduced with zeros: a rank that does so stops, naming
    // it (here both ranks do).
    for stage in [0u8, 2] {
        let got = on_ranks(WORLD, |r| {
            let t = tiny();
            t.plan
                .unused_on_some_ranks(|name, _| name.starts_with("b."))
                .unwrap();
            let e = engine_for(&t, &config(stage, 1), &r);
            let v = t.vs.variables();
            let (w, bias) = (v["b.weight"].shallow_clone(), v["b.bias"].shallow_clone());
            for k in 0..2 {
                let h = t.a.forward(&input(r.rank(), k));
                // The first backward agrees the order; the second walks.
                let h = match k {
                    0 => t.b.forward(&h),
                    _ => {
                        let (w, bias) = (w.shallow_clone(), bias.shallow_clone());
                        glue::checkpoint(&[&h], move |x| Ok(x[0].linear(&w, Some(&bias)))).unwrap()
                    }
                };
                let loss = t.c.forward(&h).square().mean(Kind::Float);
                e.backward(&loss).map_err(|e| (k, e.to_string()))?;
                e.step().map_err(|e| (k, e.to_string()))?;
            }
            Ok::<_, (usize, String)>(())
        });
        for g in got {
            let (k, e) = g.unwrap_err();
            assert_eq!(k, 1, "stage {stage}: {e}");
            assert!(
                e.starts_with("accumulated gradients unusable: parameter `b.")
                    && e.contains("did not find")
                    && e.contains("Checkpointed"),
                "stage {stage}: {e}"
            );
        }
    }
}

/// The error of building `t`'s engine under `cfg` on `group`, which must
/// be [`EngineError::RanksDiffer`].
fn differs(t: &Tiny, cfg: &Config, group: LocalGroup) -> String {
    match Engine::new(&t.vs, &t.plan, cfg, group, &AutoHints::default()) {
        Err(e @ EngineError::RanksDiffer(_)) => e.to_string(),
        Err(e) => panic!("expected the ranks' difference, got {e}"),
        Ok(_) => panic!("an engine was built from different models or configs"),
    }
}

#[test]
fn ranks_built_from_different_models_or_configs_are_refused_naming_each_difference() {
    // Rank 1's unit `b` has one more parameter and its config clips
    // gradients. The model alone used to fail the build's broadcast with
    // no cause named; the clipping alone trained the ranks apart with no
    // error at all (every collective still lines up).
    let errs = on_ranks(WORLD, |r| {
        let t = tiny();
        let top = match r.rank() {
            0 => "",
            _ => {
                let _ = extra_param(&t, "b");
                r#""gradient_clipping": 1.0,"#
            }
        };
        differs(&t, &config_plus(3, 1, top, ""), group(&r))
    });
    assert_eq!(errs[0], errs[1], "every rank says the same");
    assert!(
        errs[0].starts_with(
            "ranks built their engines from different models or configs: rank 1 differs from rank 0 in \
             gradient_clipping: rank 1 has 1.0, rank 0 has 0.0; \
             variable `b.extra`: rank 1 has [3] Float (trained), rank 0 has none. \
             Every rank must build the same model"
        ),
        "{}",
        errs[0]
    );
}

/// Builds the tiny model's engine on every rank after `rules(plan, rank)`
/// set the plan's rules: every rank must be refused alike, the error
/// starting with the ranks' difference and then `differences`.
fn assert_rules_refused(rules: impl Fn(&ShardPlan, usize) + Sync, differences: &str) {
    let errs = on_ranks(WORLD, |r| {
        let t = tiny();
        rules(&t.plan, r.rank());
        differs(&t, &config(2, 1), group(&r))
    });
    assert_eq!(errs[0], errs[1], "every rank says the same");
    let want = format!(
        "ranks built their engines from different models or configs: rank 1 differs from rank 0 in {differences}"
    );
    assert!(errs[0].starts_with(&want), "{}", errs[0]);
}

#[test]
fn ranks_leaving_different_parameters_out_of_weight_decay_are_refused_naming_them() {
    // Trained apart with no collective out of line, had they not compared.
    assert_rules_refused(
        |plan, rank| {
            if rank == 1 {
                plan.exclude_from_weight_decay(|name, _| name.ends_with(".bias"))
                    .unwrap();
            }
        },
        "variable `a.bias`: rank 1 has [5] Float (trained, no weight decay), rank 0 has [5] Float (trained); \
         variable `b.bias`",
    );
}

#[test]
fn ranks_scaling_learning_rates_differently_are_refused_naming_them() {
    assert_rules_refused(
        |plan, rank| {
            let scale = if rank == 1 { 0.5 } else { 0.25 };
            plan.scale_learning_rate(move |name, _| if name.starts_with("b.") { scale } else { 1.0 })
                .unwrap();
        },
        "variable `b.bias`: rank 1 has [4] Float (trained, learning rate x0.5), rank 0 has [4] Float (trained, learning rate x0.25); \
         variable `b.weight`",
    );
}

#[test]
fn ranks_declaring_different_parameters_unused_on_some_ranks_are_refused_naming_them() {
    // Rank 0 would reduce c during backward and rank 1 at its end.
    assert_rules_refused(
        |plan, rank| {
            if rank == 1 {
                plan.unused_on_some_ranks(|name, _| name == "c.bias").unwrap();
            }
        },
        "variable `c.bias`: rank 1 has [1] Float (trained, unused on some ranks), rank 0 has [1] Float (trained). ",
    );
    // The same for the declaration of units every rank runs.
    assert_rules_refused(
        |plan, rank| {
            if rank == 0 {
                plan.partly_unused_on_some_ranks(|name, _| name == "c.bias")
                    .unwrap();
            }
        },
        "variable `c.bias`: rank 1 has [1] Float (trained), rank 0 has [1] Float (trained, unused on some ranks in a unit every rank runs). ",
    );
}

#[test]
fn a_learning_rate_scale_that_is_not_a_finite_number_of_at_least_zero_is_refused() {
    for (scale, shown) in [(-1.0, "-1"), (f64::INFINITY, "inf")] {
        let t = tiny();
        t.plan
            .scale_learning_rate(move |name, _| if name == "a.bias" { scale } else { 1.0 })
            .unwrap();
        let e = solo_engine(&t.vs, &t.plan, &config(3, 1)).err().unwrap();
        assert_eq!(
            e.to_string(),
            format!(
                "sharding plan: ShardPlan::scale_learning_rate gave `a.bias` the scale {shown}: a scale \
                 multiplies the schedule's learning rate and must be a finite number of at least 0 \
                 (1 leaves the parameter at the schedule's rate)"
            )
        );
        // Refused before the plan was claimed: a mended rule builds.
        t.plan.scale_learning_rate(|_, _| 0.0).unwrap();
        assert!(solo_engine(&t.vs, &t.plan, &config(3, 1)).is_ok());
        assert_eq!(t.plan.learning_rate_scale("a.bias", &[5]), 0.0);
    }
}

#[test]
fn a_setting_one_rank_alone_refuses_is_named_as_the_difference() {
    // Rank 1 alone would refuse hpZ without an hpZ group, and rank 0 would
    // only learn that rank 1 left: the ranks compare before either refuses.
    let errs = on_ranks(WORLD, |r| {
        let zero = match r.rank() {
            0 => "",
            _ => r#""zero_hpz_partition_size": 2,"#,
        };
        differs(&tiny(), &config_plus(3, 1, "", zero), group(&r))
    });
    for e in errs {
        assert!(
            e.contains(
                "rank 1 differs from rank 0 in zero_optimization.zero_hpz_partition_size: rank 1 has 2, rank 0 has 1."
            ),
            "{e}"
        );
    }
}

#[test]
fn a_rank_differing_outside_both_groups_of_a_peer_fails_that_peer_too_and_the_plan_is_left() {
    // A 2x2 mesh: shard groups {0, 1} and {2, 3}, replicate groups {0, 2}
    // and {1, 3}. Only rank 3's config differs, so rank 0 agrees with
    // both its groups: it must still refuse, or it would go on alone.
    let out = on_ranks(4, |r| {
        let t = tiny();
        let zero = match r.rank() {
            3 => r#""reduce_bucket_size": 1000,"#,
            _ => "",
        };
        let mesh = r.mesh(2).unwrap();
        let err = match Engine::new_hybrid(
            &t.vs,
            &t.plan,
            &config_plus(2, 1, "", zero),
            mesh,
            &AutoHints::default(),
        ) {
            Err(e @ EngineError::RanksDiffer(_)) => e.to_string(),
            Err(e) => panic!("rank {}: expected the ranks' difference, got {e}", r.rank()),
            Ok(_) => panic!("rank {}: built from different configs", r.rank()),
        };
        // The refusal claimed nothing: the same plan builds once the
        // configs agree, and trains.
        let e = Engine::new_hybrid(
            &t.vs,
            &t.plan,
            &config(2, 1),
            r.mesh(2).unwrap(),
            &AutoHints::default(),
        )
        .unwrap();
        e.backward(&t.loss(&input(r.rank(), 0))).unwrap();
        assert!(e.step().unwrap());
        (err, e.gathered_params().unwrap())
    });
    for (err, params) in &out {
        assert!(
            err.starts_with(
                "ranks built their engines from different models or configs: rank 3 differs from rank 0 in \
                 zero_optimization.reduce_bucket_size: rank 3 has 1000, rank 0 has 500000000. Every"
            ),
            "{err}"
        );
        assert_eq!(params, &out[0].1, "ranks disagree after the step");
    }
}

#[test]
fn ranks_may_keep_their_own_optimizer_state_differently() {
    // Where a rank keeps its Adam state is its own affair: rank 1 swaps it
    // to NVMe, rank 0 keeps it in memory, and they train as ranks that
    // both keep it in memory.
    let dir = std::env::temp_dir().join(format!("zrt-behaviour-{}-own", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let offload = format!(
        r#""offload_optimizer": {{"device": "nvme", "nvme_path": "{}"}},"#,
        dir.display()
    );
    let out = on_ranks(WORLD, |r| {
        let zero = if r.rank() == 1 { offload.as_str() } else { "" };
        let (t, e) = tiny_engine(&config_plus(2, 2, "", zero), &r);
        train_steps(&t, &e, r.rank(), 3);
        e.gathered_params().unwrap()
    });
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(out[0], train(2, false));
    assert_eq!(out[1], out[0]);
}

#[test]
fn plans_and_settings_the_engine_cannot_use_are_refused() {
    let t = tiny();
    let low = Config::from_json(
        r#"{"train_batch_size": 1, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}"#,
    )
    .unwrap();
    let e = solo_engine(&t.vs, &t.plan, &low).err().unwrap();
    assert!(e.to_string().contains("zero_hpz_partition_size"), "{e}");
    // A refused config claims nothing: the plan still builds an engine.
    let ok = solo_engine(&t.vs, &t.plan, &config(3, 1));
    assert!(ok.is_ok());
    let again = solo_engine(&t.vs, &t.plan, &config(3, 1)).err().unwrap();
    assert!(
        again
            .to_string()
            .contains("this plan already drives another engine"),
        "{again}"
    );
    // The weight-decay rule is read when the engine is built: a later one
    // would be ignored, so it is refused.
    let late = t.plan.exclude_from_weight_decay(|_, _| true).unwrap_err();
    assert_eq!(
        late.to_string(),
        "sharding plan: exclude_from_weight_decay was called after the engine was built from \
         this plan: call it before Engine::from_config (or new, new_hybrid, new_hpz)"
    );
    assert!(!t.plan.excluded_from_weight_decay("a.bias", &[5]));
    let late = t.plan.scale_learning_rate(|_, _| 2.0).unwrap_err();
    assert!(
        late.to_string().starts_with(
            "sharding plan: scale_learning_rate was called after the engine was built"
        ),
        "{late}"
    );
    assert_eq!(t.plan.learning_rate_scale("a.bias", &[5]), 1.0);
    // A unit wrapped under a path where nothing was created is another mistake.
    let rng = common::rng_lock();
    let (vs, plan) = (nn::VarStore::new(Device::Cpu), ShardPlan::new());
    let _a = linear_unit(&vs, &plan, "a", 3, 5);
    drop(rng);
    let _stray = ShardedModule::new(
        &plan,
        &(vs.root() / "nowhere"),
        nn::func(|x| x.shallow_clone()),
    );
    let e = solo_engine(&vs, &plan, &config(3, 1)).err().unwrap();
    assert!(
        e.to_string()
            .contains("unit `nowhere` has no parameters under its VarStore path"),
        "{e}"
    );
}

#[test]
fn each_step_reports_where_its_time_went() {
    on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&config(3, 2), &r);
        // Delays before every collective: waiting must show.
        e.inject_delays(0x7 + r.rank() as u64);
        assert_eq!(e.last_step_breakdown(), None);
        for k in 0..2 {
            std::thread::sleep(std::time::Duration::from_millis(20)); // "forward"
            e.backward(&t.loss(&input(r.rank(), k))).unwrap();
            e.step().unwrap();
        }
        let b = e.last_step_breakdown().expect("a step was taken");
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        assert!(
            ms(b.forward) >= 40.0,
            "two micro-steps of 20 ms each: {b:?}"
        );
        assert!(
            b.backward > std::time::Duration::ZERO && b.optimizer > std::time::Duration::ZERO,
            "{b:?}"
        );
        assert!(b.comm_wait > std::time::Duration::ZERO, "{b:?}");
        assert!(b.comm_wait <= b.forward + b.backward + b.optimizer, "{b:?}");
    });
}

#[test]
fn units_under_the_persistence_threshold_stay_gathered_with_the_same_results() {
    let persistent = Config::from_json(
        r#"{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000}}"#,
    )
    .unwrap();
    let kept: Vec<_> = on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&persistent, &r);
        let w = t.vs.variables()["a.weight"].shallow_clone();
        assert!(
            glue::storage_nbytes(&w).unwrap() > 0,
            "kept gathered from the start"
        );
        for step in 0..3 {
            for k in 0..2 {
                e.backward(&t.loss(&input(r.rank(), k + step))).unwrap();
                assert!(
                    glue::storage_nbytes(&w).unwrap() > 0,
                    "kept through backward"
                );
                e.step().unwrap();
            }
        }
        assert!(glue::storage_nbytes(&w).unwrap() > 0, "kept after step()");
        assert_eq!(e.overlap_counts().prefetched, 0, "nothing to gather");
        e.gathered_params().unwrap()
    });
    // The same training as with every unit freed and re-gathered.
    assert_eq!(kept[0], train(3, false));
}

/// A module using a weight another unit owns (a tied weight), plus its own bias.
#[derive(Debug)]
struct TiedB {
    w: Tensor,
    bias: Tensor,
}

impl nn::Module for TiedB {
    fn forward(&self, x: &Tensor) -> Tensor {
        x.matmul(&self.w.tr()) + &self.bias
    }
}

#[test]
fn a_weight_tied_across_units_is_refused_in_stage_3_and_works_below() {
    // `stage3_max_live_parameters` 1 frees `a` as soon as its forward ends,
    // so `b` reads its weight as zeros; by default `a` is still held then.
    for (stage, live) in [
        (2u8, ""),
        (3, ""),
        (3, r#""stage3_max_live_parameters": 1,"#),
    ] {
        let _g = common::rng_lock();
        let vs = nn::VarStore::new(Device::Cpu);
        let plan = ShardPlan::new();
        let root = vs.root();
        let a = ShardedModule::new(
            &plan,
            &(&root / "a"),
            nn::linear(&root / "a", 4, 4, Default::default()),
        );
        let tied = TiedB {
            w: a.inner().ws.shallow_clone(),
            bias: (&root / "b").zeros("bias", &[4]),
        };
        let b = ShardedModule::new(&plan, &(&root / "b"), tied);
        let cfg = Config::from_json(&format!(
            r#"{{"train_batch_size": 4, "zero_optimization": {{"stage": {stage}, {live} "stage3_param_persistence_threshold": 0}}}}"#
        ))
        .unwrap();
        let e = solo_engine(&vs, &plan, &cfg).unwrap();
        let x = Tensor::ones([4, 4], (Kind::Float, Device::Cpu));
        let loss = b.forward(&a.forward(&x).tanh()).square().mean(Kind::Float);
        if stage == 3 && !live.is_empty() {
            // A bare backward runs (b's on the zeros a's weight reads as)
            // and step() names the tie.
            loss.backward();
            let text = e.step().unwrap_err().to_string();
            assert!(
                text.contains("parameter `a.weight` belongs to unit `a` but unit `b` uses it too"),
                "{text}"
            );
            continue;
        }
        let got = e.backward(&loss);
        if stage == 3 {
            let text = got.unwrap_err().to_string();
            assert!(
                text.contains("parameter `a.weight` belongs to unit `a` but unit `b` uses it too"),
                "{text}"
            );
        } else {
            got.unwrap();
            assert!(e.step().unwrap(), "a tied weight trains below stage 3");
        }
    }
}

/// Per step after the first (order known), the stage-3 gathers of the tiny
/// model that were (prefetched, on demand, unused) under `zero` (spliced
/// into `zero_optimization`).
fn gathers_per_step(zero: &str) -> (u64, u64, u64) {
    let cfg = Config::from_json(&format!(
        r#"{{"train_batch_size": 8, "zero_optimization": {{"stage": 3, {zero}
            "stage3_param_persistence_threshold": 0}}}}"#
    ))
    .unwrap();
    on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&cfg, &r);
        e.backward(&t.loss(&input(r.rank(), 0))).unwrap();
        e.step().unwrap();
        let before = e.overlap_counts();
        for k in 1..3 {
            e.backward(&t.loss(&input(r.rank(), k))).unwrap();
            e.step().unwrap();
        }
        let now = e.overlap_counts();
        (
            (now.prefetched - before.prefetched) / 2,
            (now.on_demand - before.on_demand) / 2,
            (now.unused - before.unused) / 2,
        )
    })[0]
}

#[test]
fn prefetch_stays_within_the_bucket_and_live_parameter_bounds() {
    // Units a, b, c: 20, 24 and 5 elements (32, 64, 32 padded). Unbounded:
    // b and c prefetched in forward, b and a in backward (c, run last,
    // stays gathered); only a waits.
    let all = (4, 1, 0);
    assert_eq!(gathers_per_step(""), all);
    // A unit over `stage3_prefetch_bucket_size` elements is not prefetched
    // (b, twice); one of exactly that size is.
    let no_b = (2, 3, 0);
    assert_eq!(
        gathers_per_step(r#""stage3_prefetch_bucket_size": 24,"#),
        all
    );
    assert_eq!(
        gathers_per_step(r#""stage3_prefetch_bucket_size": 23,"#),
        no_b
    );
    // Nor is one that would take the gathered and in-flight elements over
    // `stage3_max_live_parameters`: each prefetch joins one gathered unit,
    // and b's with a or c makes 64 + 32 elements.
    assert_eq!(
        gathers_per_step(r#""stage3_max_live_parameters": 96,"#),
        all
    );
    assert_eq!(
        gathers_per_step(r#""stage3_max_live_parameters": 95,"#),
        (0, 5, 0)
    );
}

#[test]
fn a_prefetch_nothing_used_is_counted_unused() {
    on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&config(3, 1), &r);
        e.backward(&t.loss(&input(r.rank(), 0))).unwrap();
        e.step().unwrap();
        // a's forward prefetches b; nothing runs b before the unshard
        // completes the gather for nobody.
        let _ = tch::no_grad(|| t.a.forward(&input(r.rank(), 1)));
        let before = e.overlap_counts();
        e.with_full_params(|| ()).unwrap();
        let now = e.overlap_counts();
        assert_eq!(now.unused - before.unused, 1, "{now:?}");
    });
}

#[test]
fn the_first_forward_holds_only_the_latest_unit_as_later_forwards_do() {
    on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&config(3, 1), &r);
        let vars = t.vs.variables();
        let (a, b, c) = (&vars["a.weight"], &vars["b.weight"], &vars["c.weight"]);
        let held = |x: &Tensor| glue::storage_nbytes(x).unwrap() > 0;
        let zeros = |x: &Tensor| glue::reads_zeros(x).unwrap();
        let all_held = || -> usize {
            vars.values()
                .map(|v| glue::storage_nbytes(v).unwrap())
                .sum()
        };
        let mut after_forward = Vec::new();
        for step in 0..2 {
            let h = t.a.forward(&input(r.rank(), step));
            if step == 0 {
                // Which unit runs last is not known yet: the latest stays.
                assert!(held(a), "a, the latest so far");
            }
            let hb = t.b.forward(&h).tanh();
            if step == 0 {
                // a is freed once b's forward ends, to memory that reads as
                // zeros (a unit still to run might use a's weight).
                assert!(!held(a) && zeros(a), "a freed to zeros");
                assert!(held(b), "b, the latest so far");
            }
            let y = t.c.forward(&hb);
            // Every unit has been checked: no zeros left, and only c (run
            // last, first in backward) holds memory, on every step alike.
            assert!(!held(a) && !held(b) && held(c), "step {step}");
            assert!(!zeros(a) && !zeros(b), "step {step}: back to the guard");
            after_forward.push(all_held());
            e.backward(&y.square().mean(Kind::Float)).unwrap();
            assert!(e.step().unwrap());
        }
        assert_eq!(
            after_forward[0], after_forward[1],
            "the first step holds as much as the second"
        );
    });
}

#[test]
fn the_first_forward_keeps_units_only_within_max_live_parameters() {
    let tight = Config::from_json(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3,
            "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 1}}"#,
    )
    .unwrap();
    on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&tight, &r);
        let w = t.vs.variables()["a.weight"].shallow_clone();
        let h = t.a.forward(&input(r.rank(), 0));
        assert_eq!(
            glue::storage_nbytes(&w).unwrap(),
            0,
            "over the bound: freed at once"
        );
        assert!(
            glue::reads_zeros(&w).unwrap(),
            "to zeros: b and c are still to run"
        );
        let loss = t.loss_after_a(&h);
        e.backward(&loss).unwrap();
        assert!(e.step().unwrap());
    });
}

#[test]
fn a_unit_that_stays_gathered_is_not_freed_by_the_first_forward() {
    // Threshold 19: every parameter of `a` (15, 5) and of `c` (4, 1) is
    // under it, so those units stay gathered; `b` (20) is freed. The first
    // forward frees each unit once the next one's forward ends, but never
    // one that stays.
    let cfg = Config::from_json(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3,
            "stage3_param_persistence_threshold": 19}}"#,
    )
    .unwrap();
    on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&cfg, &r);
        let vars = t.vs.variables();
        let held = |n: &str| glue::storage_nbytes(&vars[n]).unwrap() > 0;
        for step in 0..2 {
            let h = t.a.forward(&input(r.rank(), step));
            let hb = t.b.forward(&h).tanh();
            assert!(held("a.weight"), "step {step}: a stays");
            let loss = t.c.forward(&hb).square().mean(Kind::Float);
            assert!(
                held("a.weight") && held("c.weight"),
                "step {step}: they stay"
            );
            // b is the last unit that does not stay: kept for backward in
            // the first step (as the unit run last is later), freed after
            // it once the order is known.
            assert_eq!(held("b.weight"), step == 0, "step {step}");
            e.backward(&loss).unwrap();
            assert!(e.step().unwrap());
            assert!(held("a.weight") && held("c.weight") && !held("b.weight"));
        }
    });
}

#[test]
fn parameters_under_the_persistence_threshold_stay_gathered_one_by_one() {
    // Threshold 10: a.weight (15) and b.weight (20) are freed after their
    // forward; the biases (5, 4) stay gathered in the root; c (4 + 1) is all
    // small and stays gathered whole.
    let cfg = Config::from_json(
        r#"{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10}}"#,
    )
    .unwrap();
    let got: Vec<_> = on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&cfg, &r);
        let vars = t.vs.variables();
        let bytes = |n: &str| glue::storage_nbytes(&vars[n]).unwrap();
        assert!(
            e.unit_names().last().is_some_and(|n| n == "<root>"),
            "{:?}",
            e.unit_names()
        );
        for step in 0..3 {
            for k in 0..2 {
                let h = t.a.forward(&input(r.rank(), k + step));
                if step > 0 {
                    assert_eq!(bytes("a.weight"), 0, "a.weight is freed after forward");
                    assert!(
                        bytes("a.bias") > 0 && bytes("c.weight") > 0,
                        "small ones stay"
                    );
                }
                let loss = t.loss_after_a(&h);
                e.backward(&loss).unwrap();
                e.step().unwrap();
            }
        }
        assert!(bytes("b.bias") > 0 && bytes("c.bias") > 0 && bytes("b.weight") == 0);
        let mut p = e.gathered_params().unwrap();
        p.sort_by(|x, y| x.0.cmp(&y.0));
        p
    });
    // The same training as with every parameter freed and re-gathered.
    let mut want = train(3, false);
    want.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(got[0], want);
}

#[test]
fn a_parameter_of_exactly_the_persistence_threshold_stays_gathered() {
    // DeepSpeed persists `ds_numel <= threshold`. a.weight has 15
    // elements, a.bias 5, b.weight 20: at 15 unit `a` is all small and
    // stays gathered whole; at 5 a.bias moves to the root and stays
    // gathered while a.weight is freed; at 4 both are freed. b.weight is
    // freed at every one.
    for (threshold, weight_kept, bias_kept) in
        [(15, true, true), (5, false, true), (4, false, false)]
    {
        let cfg = Config::from_json(&format!(
            r#"{{"train_micro_batch_size_per_gpu": 4,
                "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}},
                "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": {threshold}}}}}"#
        ))
        .unwrap();
        on_ranks(WORLD, |r| {
            let (t, e) = tiny_engine(&cfg, &r);
            let vars = t.vs.variables();
            let kept = |n: &str| glue::storage_nbytes(&vars[n]).unwrap() > 0;
            for k in 0..2 {
                e.backward(&t.loss(&input(r.rank(), k))).unwrap();
                e.step().unwrap();
                let _ = t.a.forward(&input(r.rank(), k));
                let what = format!("threshold {threshold}, step {k}");
                assert_eq!(kept("a.weight"), weight_kept, "{what}");
                assert_eq!(kept("a.bias"), bias_kept, "{what}");
                assert!(!kept("b.weight"), "{what}");
            }
        });
    }
}

#[test]
fn stage_3_leaves_a_units_buffers_and_odd_dtype_frozen_parameters_whole() {
    // Stage 3 shards a unit's frozen *parameters* of fp32 or the compute
    // dtype; a buffer (a running statistic) and an f64 frozen parameter
    // stay whole on every rank, in their dtype, with their values.
    on_ranks(WORLD, |r| {
        let t = tiny();
        let b = t.vs.root() / "b";
        let stat = b.zeros_no_train("stat", &[8]);
        let _ = stat.shallow_clone().fill_(0.25);
        let mut scale = b.ones("scale", &[8]);
        let _ = scale.set_requires_grad(false);
        scale.set_data(&scale.to_kind(Kind::Double));
        let e = engine_for(&t, &config(3, 1), &r);
        for k in 0..2 {
            e.backward(&t.loss(&input(r.rank(), k))).unwrap();
            e.step().unwrap();
        }
        let vars = t.vs.variables();
        assert_eq!(
            glue::storage_nbytes(&vars["b.weight"]).unwrap(),
            0,
            "b's weights are sharded"
        );
        for (name, bytes, want) in [("b.stat", 4 * 8, 0.25), ("b.scale", 8 * 8, 1.0)] {
            let v = &vars[name];
            assert_eq!(glue::storage_nbytes(v).unwrap(), bytes, "{name} whole");
            let got = Vec::<f64>::try_from(&v.to_kind(Kind::Double)).unwrap();
            assert_eq!(got, vec![want; 8], "{name}");
        }
        assert_eq!(vars["b.scale"].kind(), Kind::Double);
    });
}

/// Trains the tiny model with `b.weight` frozen — rank 1's set to other
/// values before the engine is built, which must give it rank 0's — and
/// returns rank 0's gathered (trainable) parameters and every rank's
/// `b.weight` afterwards.
fn train_frozen(stage: u8) -> (Params, Vec<Vec<f32>>) {
    let out = on_ranks(WORLD, |r| {
        let t = tiny();
        let frozen = t.vs.variables()["b.weight"].shallow_clone();
        let _ = frozen.set_requires_grad(false);
        if r.rank() == 1 {
            let _ = tch::no_grad(|| frozen.shallow_clone().fill_(7.0));
        }
        let e = engine_for(&t, &config(stage, 2), &r);
        train_steps(&t, &e, r.rank(), 3);
        let p = e.gathered_params().unwrap();
        // Stage 3 holds it as shards between steps: read it gathered.
        let f = e.with_full_params(|| Vec::<f32>::try_from(&frozen.flatten(0, -1)).unwrap());
        (p, f.unwrap())
    });
    let frozen = out.iter().map(|o| o.1.clone()).collect();
    (out.into_iter().next().unwrap().0, frozen)
}

#[test]
fn a_frozen_unit_backward_passes_through_is_freed_once_its_backward_is_done() {
    // `b` has only frozen parameters; `a` before it and `c` after it train,
    // so backward runs through `b`: stage 3 re-gathers it for that and
    // must free it again before `a`'s backward, not at the end.
    let seen: Vec<Vec<(usize, usize)>> = on_ranks(WORLD, |r| {
        let t = tiny();
        let vars = t.vs.variables();
        let _ = vars["b.weight"].set_requires_grad(false);
        let _ = vars["b.bias"].set_requires_grad(false);
        let e = engine_for(&t, &config(3, 1), &r);
        let seen = std::sync::Arc::new(Mutex::new(Vec::new()));
        for step in 0..3 {
            // The gradient of the model's input is computed after `a`'s
            // backward, the last of all: what does `b` hold then?
            let x = input(r.rank(), step).set_requires_grad(true);
            let (w, s) = (vars["b.weight"].shallow_clone(), seen.clone());
            glue::on_grad(&x, move || {
                let b = glue::storage_nbytes(&w).unwrap();
                s.lock().unwrap().push((step, b));
            })
            .unwrap();
            e.backward(&t.loss(&x)).unwrap();
            e.step().unwrap();
        }
        let v = seen.lock().unwrap().clone();
        v
    });
    for s in seen {
        assert_eq!(s, [(0, 0), (1, 0), (2, 0)]);
    }
}

#[test]
fn a_frozen_unit_run_twice_in_a_row_keeps_its_parameters_for_both_backwards() {
    // f(f(a(x))): the second run's input is the first run's output, so
    // the gradient that ends the second run's backward is the one the
    // first run's re-gather waits for.
    let run = |stage: u8| {
        let out = on_ranks(WORLD, |r| {
            // Built under the lock: the ranks share libtorch's global RNG.
            let (vs, plan, a, f, c) = {
                let _g = common::rng_lock();
                tch::manual_seed(7);
                let (vs, plan) = (nn::VarStore::new(Device::Cpu), ShardPlan::new());
                let a = linear_unit(&vs, &plan, "a", 3, 3);
                let f = linear_unit(&vs, &plan, "f", 3, 3);
                let c = linear_unit(&vs, &plan, "c", 3, 1);
                (vs, plan, a, f, c)
            };
            common::freeze(&vs, &["f."]);
            let e = engine_of(&vs, &plan, &config(stage, 1), &r);
            for k in 0..3 {
                let y = c.forward(&f.forward(&f.forward(&a.forward(&input(r.rank(), k)))));
                e.backward(&y.square().mean(Kind::Float)).unwrap();
                e.step().unwrap();
            }
            e.gathered_params().unwrap()
        });
        out.into_iter().next().unwrap()
    };
    assert_eq!(run(3), run(0));
}

#[test]
fn frozen_parameters_are_rank_0s_and_stay_while_the_rest_trains_alike_in_every_stage() {
    let before = Vec::<f32>::try_from(&tiny().vs.variables()["b.weight"].flatten(0, -1)).unwrap();
    let (reference, _) = train_frozen(0);
    assert!(
        !reference.iter().any(|(n, _)| n == "b.weight"),
        "a frozen parameter has no master copy"
    );
    for stage in [0u8, 1, 2, 3] {
        let (got, frozen) = train_frozen(stage);
        for f in &frozen {
            assert_eq!(
                f, &before,
                "stage {stage}: rank 0's frozen weight, untouched"
            );
        }
        assert_params_close(&format!("stage {stage}"), &got, &reference);
        // It did train.
        let a0 = &got.iter().find(|(n, _)| n == "a.weight").unwrap().1;
        let init = Vec::<f32>::try_from(&tiny().vs.variables()["a.weight"].flatten(0, -1)).unwrap();
        assert_ne!(a0, &init, "stage {stage}");
    }
}

#[test]
fn a_parameter_no_loss_uses_trains_like_the_reference_in_every_stage() {
    // `a.extra` gets no gradient (as a head not used in this phase of
    // training): its unit's reduction must still happen, and with zero
    // gradient AdamW only decays it.
    let run = |stage: u8| -> Params {
        let out = on_ranks(WORLD, |r| {
            let t = tiny();
            let _unused = extra_param(&t, "a");
            let e = engine_for(&t, &config(stage, 2), &r);
            train_steps(&t, &e, r.rank(), 2);
            e.gathered_params().unwrap()
        });
        out.into_iter().next().unwrap()
    };
    let reference = run(0);
    assert!(reference.iter().any(|(n, _)| n == "a.extra"));
    for stage in [1u8, 2, 3] {
        assert_params_close(&format!("stage {stage}"), &run(stage), &reference);
    }
}

/// Asserts that `got` holds `want`'s parameters, by name, each element
/// within 1e-6 (`what` says whose).
fn assert_params_close(what: &str, got: &Params, want: &Params) {
    assert_eq!(got.len(), want.len(), "{what}");
    for ((n, a), (m, b)) in got.iter().zip(want) {
        assert_eq!(n, m, "{what}");
        let worst = (a.iter().zip(b))
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-6, "{what} {n}: off by {worst}");
    }
}

/// Trains the tiny model under `config(stage, gas)` for `micro_steps`,
/// with `c.extra` in rank 0's loss from micro-step `from` on; each rank's
/// first error, with the micro-step it came at.
fn train_with_extra_on_rank_0(
    stage: u8,
    gas: usize,
    micro_steps: usize,
    from: usize,
) -> Vec<Result<(), (usize, String)>> {
    train_with_extra_on_rank_0_under(config(stage, gas), micro_steps, from)
}

/// [`train_with_extra_on_rank_0`] under `cfg`.
fn train_with_extra_on_rank_0_under(
    cfg: Config,
    micro_steps: usize,
    from: usize,
) -> Vec<Result<(), (usize, String)>> {
    on_ranks(WORLD, |r| {
        let t = tiny();
        let extra = extra_param(&t, "c");
        let e = engine_for(&t, &cfg, &r);
        for k in 0..micro_steps {
            let loss = t.loss(&input(r.rank(), k));
            let loss = match r.rank() == 0 && k >= from {
                true => loss + extra.sum(Kind::Float) * 0.1,
                false => loss,
            };
            e.backward(&loss).map_err(|e| (k, e.to_string()))?;
            e.step().map_err(|e| (k, e.to_string()))?;
        }
        Ok(())
    })
}

/// Both ranks were told their reductions went out of step because of
/// `c.extra` (`what`: what each rank did), rank 1 that it lacks that
/// gradient and rank 0 that it lacks none; each error came at micro-step
/// `at` when given.
fn assert_named_uneven(got: &[Result<(), (usize, String)>], what: &str, at: Option<usize>) {
    let error = |rank: usize| match &got[rank] {
        Err((k, e)) => {
            assert!(
                at.is_none_or(|at| at == *k),
                "rank {rank} failed at micro-step {k}: {e}"
            );
            e.clone()
        }
        Ok(()) => panic!("rank {rank} trained on: {got:?}"),
    };
    for rank in 0..WORLD {
        let e = error(rank);
        assert!(
            e.starts_with(&format!(
                "gradient reductions out of step across ranks: {what}"
            )) && e.contains("Declare such parameters with ShardPlan::unused_on_some_ranks"),
            "rank {rank}: {e}"
        );
    }
    let e1 = error(1);
    assert!(
        e1.contains(
            "on this rank no gradient reached `c.extra` (unit `c`) (to declare them: `plan.unused_on_some_ranks(|name, _| name.starts_with(\"c.\"))?`)"
        ),
        "{e1}"
    );
    let e0 = error(0);
    assert!(
        e0.contains("every parameter got a gradient on this rank"),
        "{e0}"
    );
}

#[test]
fn a_parameter_only_some_ranks_use_is_named_when_it_puts_reductions_out_of_step() {
    // `c.extra` is in rank 0's loss only. Stage 1 reduces every unit at the
    // accumulation boundary, in one order, and trains; stages 0, 2 and 3
    // reduce unit c during backward on rank 0 but only at its end on rank 1.
    let run = |stage: u8| train_with_extra_on_rank_0(stage, 2, 4, 0);
    assert!(run(1).iter().all(Result::is_ok), "{:?}", run(1));
    for stage in [0u8, 2, 3] {
        // Named before any reduction is used: b and the grown c have the
        // same size, and would have been summed together. At stage 3 rank
        // 1's backward gathers `a` (the first forward freed every unit)
        // where rank 0 reduces `c`.
        let what = match stage {
            3 => "rank 0 reduces `c`, rank 1 runs the backward of `a`. ",
            _ => "rank 0 reduces `c`, rank 1 reduces `b`. ",
        };
        assert_named_uneven(&run(stage), what, None);
        // Without `overlap_comm` rank 0 waits in c's hook; its error is
        // made when backward has run on, so it does not blame its own
        // units not reached yet.
        let waiting = config_plus(stage, 2, "", r#""overlap_comm": false,"#);
        let got = train_with_extra_on_rank_0_under(waiting, 4, 0);
        assert_named_uneven(&got, what, None);
    }
}

/// How rank 1 leaves `c.extra` out of its loss, where rank 0 uses it.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Extra {
    /// Declared with `ShardPlan::unused_on_some_ranks`, absent from rank
    /// 1's loss.
    Declared,
    /// In rank 1's loss times zero: the gradient it gets is zero, and the
    /// unit completes at the same point on both ranks.
    TimesZero,
}

/// Trains the tiny model with `c.extra` in rank 0's loss (rank 1's as
/// `extra` says) for 4 micro-steps under `cfg`: every rank's parameters.
fn train_with_extra_on_rank_0_only(cfg: &Config, extra: Extra) -> Vec<Params> {
    on_ranks(WORLD, |r| {
        let t = tiny();
        let p = extra_param(&t, "c");
        if extra == Extra::Declared {
            t.plan
                .unused_on_some_ranks(|name, _| name == "c.extra")
                .unwrap();
        }
        let e = engine_for(&t, cfg, &r);
        for k in 0..4 {
            let loss = t.loss(&input(r.rank(), k));
            let loss = match (r.rank(), extra) {
                (0, _) => loss + p.sum(Kind::Float) * 0.1,
                (_, Extra::TimesZero) => loss + p.sum(Kind::Float) * 0.0,
                (_, Extra::Declared) => loss,
            };
            e.backward(&loss).unwrap();
            e.step().unwrap();
        }
        e.gathered_params().unwrap()
    })
}

#[test]
fn a_parameter_declared_unused_on_some_ranks_trains_as_if_they_used_it_times_zero() {
    // Rank 1's loss leaves `c.extra` out; declared, its unit is reduced at
    // the end of backward on both ranks, with zeros for rank 1's part:
    // the run equals one where rank 1 adds 0 x extra (every stage, with
    // and without overlap_comm, gas 1 and 2).
    for stage in [0u8, 1, 2, 3] {
        for (gas, plus) in [(1, ""), (2, ""), (2, r#""overlap_comm": false,"#)] {
            let cfg = config_plus(stage, gas, "", plus);
            let got = train_with_extra_on_rank_0_only(&cfg, Extra::Declared);
            let want = train_with_extra_on_rank_0_only(&cfg, Extra::TimesZero);
            assert_eq!(got, want, "stage {stage}, gas {gas} {plus}");
            // Rank 0's gradient reached the parameter: it moved off its
            // ones further than weight decay alone would take it.
            let extra = &got[0].iter().find(|(n, _)| n == "c.extra").unwrap().1;
            assert!(extra.iter().all(|&x| x < 0.99), "{extra:?}");
        }
    }
}

#[test]
fn a_parameter_only_some_ranks_use_is_named_when_backward_gathers_too() {
    // From step 2 stage 3 gathers units during backward, so rank 0's early
    // reduction of `c` meets rank 1's gather of the next unit for its
    // backward, and the data collectives behind the announcements differ
    // (a reduce-scatter against an all-gather). Both ranks must still be
    // told it is the parameter, not different engine calls or a bare
    // collective mismatch, at step 2 (micro-step 1).
    let got = train_with_extra_on_rank_0(3, 1, 3, 1);
    assert_named_uneven(
        &got,
        "rank 0 reduces `c`, rank 1 runs the backward of `a`. ",
        Some(1),
    );
}

#[test]
fn forward_t_gathers_and_trains_like_forward() {
    // At stage 3 a unit is freed between uses: forward_t must gather it
    // first and re-gather it for backward, as forward does.
    let run = |use_t: bool| {
        on_ranks(WORLD, |r| {
            let (t, e) = tiny_engine(&config(3, 1), &r);
            for k in 0..2 {
                let x = input(r.rank(), k);
                let h = match use_t {
                    true => t.a.forward_t(&x, true),
                    false => t.a.forward(&x),
                };
                e.backward(&t.loss_after_a(&h)).unwrap();
                e.step().unwrap();
            }
            e.gathered_params().unwrap()
        })
    };
    let (with_t, plain) = (run(true), run(false));
    assert_eq!(with_t, plain);
    // ...and the steps moved the weights.
    let t = tiny();
    let start = t.vs.variables()["a.weight"].flatten(0, -1);
    let start = Vec::<f32>::try_from(&start).unwrap();
    let moved = &with_t[0].iter().find(|(n, _)| n == "a.weight").unwrap().1;
    assert_ne!(moved, &start);
}

#[test]
fn the_learning_rate_reported_follows_the_warm_up_from_before_the_first_step() {
    let cfg = Config::from_json(
        r#"{"train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001,
                "warmup_max_lr": 0.011, "warmup_num_steps": 10, "warmup_type": "linear"}},
            "zero_optimization": {"stage": 2}}"#,
    )
    .unwrap();
    on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&cfg, &r);
        // Not the optimizer's 0.5: the first step will use the warm-up's start.
        assert_eq!(e.lr(), 0.001);
        let mut seen = Vec::new();
        for k in 0..3 {
            e.backward(&t.loss(&input(r.rank(), k))).unwrap();
            e.step().unwrap();
            seen.push(e.lr());
        }
        // DeepSpeed's engine steps the scheduler after the optimizer: the
        // first two steps both run at the warm-up's start.
        let want = [0.001, 0.001, 0.002];
        for (s, w) in seen.iter().zip(want) {
            assert!((s - w).abs() < 1e-12, "{seen:?} against {want:?}");
        }
    });
}

#[test]
fn one_cycles_momentum_decay_stops_every_rank_where_beta1_reaches_1() {
    // Cycle over steps 1-2; past it beta1 is 0.9 x (1 + 0.5 k): 1.35 at k 1.
    let cfg = config_plus(
        2,
        1,
        r#""scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.001,
            "cycle_max_lr": 0.01, "cycle_first_step_size": 1, "decay_step_size": 1,
            "decay_mom_rate": 0.5}},"#,
        "",
    );
    on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&cfg, &r);
        // What the first step will use: DeepSpeed's scheduler sets it when made.
        assert_eq!((e.lr(), e.betas()), (0.001, (0.8, 0.99)));
        let mut seen = Vec::new();
        for k in 0..3 {
            e.backward(&t.loss(&input(r.rank(), k))).unwrap();
            assert!(e.step().unwrap());
            seen.push((e.lr(), e.betas()));
        }
        assert_eq!(
            seen,
            [
                (0.001, (0.8, 0.99)),
                // 0.001 + 0.009 x 1, as DeepSpeed computes it.
                (0.010000000000000002, (0.8, 0.99)),
                (0.001, (0.9, 0.99))
            ]
        );
        let before = e.gathered_params().unwrap();
        e.backward(&t.loss(&input(r.rank(), 3))).unwrap();
        let err = e.step().unwrap_err().to_string();
        assert!(
            err.contains("OneCycle's `scheduler.params.decay_mom_rate` has moved beta1 to 1.35 at step 4: AdamW needs beta1 in [0, 1)"),
            "{err}"
        );
        // Refused before anything moved.
        assert_eq!(e.gathered_params().unwrap(), before);
        assert_eq!(e.global_step(), 3);
    });
}

#[test]
fn the_range_test_raises_the_rate_as_deepspeed_does() {
    let cfg = config_plus(
        3,
        1,
        r#""scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.001,
            "lr_range_test_step_size": 2, "lr_range_test_step_rate": 3, "lr_range_test_staircase": true}},"#,
        "",
    );
    on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&cfg, &r);
        let mut seen = vec![e.lr()];
        for k in 0..4 {
            e.backward(&t.loss(&input(r.rank(), k))).unwrap();
            e.step().unwrap();
            seen.push(e.lr());
        }
        // Before the first step, then what each step used: the rate goes
        // up by 3 x 0.001 every 2 scheduler steps.
        assert_eq!(seen, [0.001, 0.001, 0.001, 0.004, 0.004]);
        assert_eq!(e.betas(), (0.9, 0.999));
    });
}

#[test]
fn a_backward_past_a_boundary_no_step_handled_is_refused() {
    for stage in [2, 3] {
        past_a_boundary(stage);
    }
}

fn past_a_boundary(stage: u8) {
    on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&config(stage, 2), &r);
        // Two micro-steps make the boundary; then step() must come.
        for k in 0..2 {
            e.backward(&t.loss(&input(r.rank(), k))).unwrap();
        }
        let err = e
            .backward(&t.loss(&input(r.rank(), 2)))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("backward after micro-step 2 reached an accumulation boundary")
                && err.contains("call engine.step() after every backward"),
            "{err}"
        );
        // After the step the program goes on as usual.
        assert!(e.step().unwrap());
        e.backward(&t.loss(&input(r.rank(), 2))).unwrap();
        assert!(!e.step().unwrap(), "off the boundary");
        e.backward(&t.loss(&input(r.rank(), 3))).unwrap();
        assert!(e.step().unwrap(), "stage {stage}: the next boundary");
    });
}

/// Unit `a` (3 -> 3) run twice in each forward, then `c` (3 -> 1): the
/// final parameters of `a` after two steps of stage `stage` (None: plain
/// libtorch on one rank seeing both ranks' inputs, averaged).
fn reused_unit(stage: Option<u8>) -> Vec<f32> {
    let build = || {
        let _g = common::rng_lock();
        tch::manual_seed(5);
        let vs = nn::VarStore::new(Device::Cpu);
        let plan = ShardPlan::new();
        let a = linear_unit(&vs, &plan, "a", 3, 3);
        let c = linear_unit(&vs, &plan, "c", 3, 1);
        (vs, plan, a, c)
    };
    let loss = |a: &ShardedModule<nn::Linear>, c: &ShardedModule<nn::Linear>, x: &Tensor| {
        c.forward(&a.forward(&a.forward(x).tanh()))
            .square()
            .mean(Kind::Float)
    };
    let weights = |vs: &nn::VarStore| {
        let w = &vs.variables()["a.weight"];
        Vec::<f32>::try_from(&w.flatten(0, -1)).unwrap()
    };
    match stage {
        Some(stage) => {
            let out = on_ranks(WORLD, |r| {
                let (vs, plan, a, c) = build();
                let e = engine_of(&vs, &plan, &config(stage, 1), &r);
                for k in 0..2 {
                    e.backward(&loss(&a, &c, &input(r.rank(), k))).unwrap();
                    e.step().unwrap();
                }
                e.gathered_params()
                    .unwrap()
                    .into_iter()
                    .find(|(n, _)| n == "a.weight")
                    .unwrap()
                    .1
            });
            out[0].clone()
        }
        None => {
            let (vs, _plan, a, c) = build();
            let mut opt = nn::OptimizerConfig::build(
                nn::AdamW {
                    wd: 0.0,
                    ..Default::default()
                },
                &vs,
                0.01,
            )
            .unwrap();
            for k in 0..2 {
                opt.zero_grad();
                let l = (loss(&a, &c, &input(0, k)) + loss(&a, &c, &input(1, k))) / 2.0;
                l.backward();
                opt.step();
            }
            weights(&vs)
        }
    }
}

#[test]
fn a_unit_run_twice_in_one_forward_trains_like_the_reference() {
    let want = reused_unit(None);
    for stage in [0u8, 1, 2, 3] {
        let got = reused_unit(Some(stage));
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-5,
                "stage {stage}: {got:?} against {want:?}"
            );
        }
    }
}

#[test]
fn a_forward_whose_loss_is_dropped_changes_no_result_in_stage_3() {
    let run = |dangling: bool| {
        on_ranks(WORLD, |r| {
            let (t, e) = tiny_engine(&config(3, 1), &r);
            for k in 0..3 {
                if dangling {
                    // A validation loss computed with gradients on, dropped.
                    let _ = t.loss(&input(r.rank(), 7)).double_value(&[]);
                }
                e.backward(&t.loss(&input(r.rank(), k))).unwrap();
                e.step().unwrap();
            }
            e.gathered_params().unwrap()
        })[0]
            .clone()
    };
    assert_eq!(run(true), run(false));
}

#[test]
fn a_backward_libtorch_refuses_leaves_the_engine_as_it_was() {
    // A loss with no graph: libtorch refuses it before any hook fires. The
    // engine must disarm what it armed for that backward; otherwise a
    // later bare `loss.backward()` is taken for the refused one's (its
    // reductions are never waited for: the step runs without them) and
    // stage 3 thinks a backward is still under way.
    for stage in 0..=3u8 {
        let run = |refused: bool| {
            on_ranks(WORLD, |r| {
                let (t, e) = tiny_engine(&config(stage, 1), &r);
                for k in 0..3 {
                    if refused && k == 1 {
                        let err = e.backward(&Tensor::from(1.0f32)).unwrap_err();
                        assert!(
                            err.to_string().contains("does not require grad"),
                            "stage {stage}: {err}"
                        );
                        e.with_full_params(|| ()).unwrap();
                    }
                    t.loss(&input(r.rank(), k)).backward();
                    e.step().unwrap();
                }
                e.gathered_params().unwrap()
            })[0]
                .clone()
        };
        assert_eq!(run(true), run(false), "stage {stage}");
    }
}

#[test]
fn ranks_making_different_engine_calls_are_each_told_not_left_with_garbage() {
    // Rank 0 trains while rank 1 calls with_full_params: the forward's
    // gathers line up with the unshard's, then rank 0's next gather
    // announcement meets rank 1's fingerprint exchange. Both are
    // all_gathers of i64; when all_gather parts could differ in length
    // they matched, and rank 1 compared rank 0's announcement as
    // fingerprints and returned Ok.
    let errs: Vec<String> = on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&config(3, 1), &r);
        e.backward(&t.loss(&input(r.rank(), 0))).unwrap();
        e.step().unwrap();
        let got = match r.rank() {
            0 => e.backward(&t.loss(&input(r.rank(), 1))),
            _ => e.with_full_params(|| ()),
        };
        match got {
            Err(err @ EngineError::OutOfStep(_)) => err.to_string(),
            other => panic!(
                "rank {}: expected ranks out of step, got {other:?}",
                r.rank()
            ),
        }
    });
    let here = ", and another rank made a different collective call here";
    assert!(
        errs[0].starts_with(&format!(
            "ranks out of step: this rank announced the gather of unit `b` to its 2 ranks{here}"
        )),
        "{}",
        errs[0]
    );
    assert!(
        errs[1].starts_with(&format!(
            "ranks out of step: with_full_params exchanged its fingerprints of the units{here}"
        )),
        "{}",
        errs[1]
    );
    for e in &errs {
        assert!(
            e.contains("rank 0 called all_gather(i64 x 2) but rank 1 called all_gather(i64 x 6)")
                && e.ends_with("every rank must make the same engine calls in the same order"),
            "{e}"
        );
    }
}

#[test]
fn a_step_with_a_non_finite_gradient_norm_is_warned_about() {
    on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&config(2, 1), &r);
        let (norm, logs) = common::with_logs(|| {
            e.backward(&(t.loss(&input(r.rank(), 0)) * f64::INFINITY))
                .unwrap();
            e.step().unwrap();
            e.global_grad_norm()
        });
        assert!(norm.is_some_and(|n| !n.is_finite()), "{norm:?}");
        assert!(
            logs.contains("WARN")
                && logs.contains("this step writes inf or NaN into the parameters"),
            "{logs}"
        );
    });
}

#[test]
fn bf16_check_grad_overflow_skips_a_step_with_inf_gradients_on_every_rank() {
    // Rank 1 alone makes an infinite gradient; with the key on, neither
    // rank steps and the parameters stay as they were, and the next step
    // trains. With it off the step is applied (and warned about, above).
    for check in [true, false] {
        let cfg = Config::from_json(&format!(
            r#"{{"train_micro_batch_size_per_gpu": 4, "bf16": {{"enabled": true, "check_grad_overflow": {check}}},
                "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}},
                "zero_optimization": {{"stage": 2}}}}"#
        ))
        .unwrap();
        on_ranks(WORLD, |r| {
            let (t, e) = tiny_engine(&cfg, &r);
            let before = e.gathered_params().unwrap();
            let x = input(r.rank(), 0).to_kind(Kind::BFloat16);
            let blow_up = if r.rank() == 1 { f64::INFINITY } else { 1.0 };
            e.backward(&(t.loss(&x) * blow_up)).unwrap();
            let (stepped, logs) = common::with_logs(|| e.step().unwrap());
            let after = e.gathered_params().unwrap();
            if check {
                assert!(!stepped, "rank {}: skipped", r.rank());
                assert_eq!(e.skipped_steps(), 1);
                assert_eq!(after, before, "rank {}: nothing applied", r.rank());
                assert!(logs.contains("step skipped on every rank"), "{logs}");
                e.backward(&t.loss(&x)).unwrap();
                assert!(e.step().unwrap(), "the next step trains");
                assert_ne!(e.gathered_params().unwrap(), before);
            } else {
                assert!(stepped && e.skipped_steps() == 0);
                assert_ne!(after, before, "rank {}: applied", r.rank());
            }
        });
    }
}

#[test]
fn stage_0_under_accumulation_says_it_reduces_every_micro_step_where_deepspeeds_waits() {
    // DeepSpeed's stage 0 all-reduces at the accumulation boundary only,
    // zrt's every micro-step (docs/choices.md): the first rank says so
    // when the engine is built, and only then.
    let line = "stage 0 all-reduces each micro-step's gradients during backward (2 a step)";
    for (stage, gas, said) in [(0, 2, true), (0, 1, false), (1, 2, false)] {
        let cfg = config_plus(stage, gas, "", "");
        let logs = on_ranks(WORLD, |r| {
            common::with_logs_at(tracing::Level::INFO, || drop(tiny_engine(&cfg, &r))).1
        });
        assert_eq!(
            logs[0].contains(line),
            said,
            "stage {stage} gas {gas}: {}",
            logs[0]
        );
        assert!(!logs[1].contains("stage 0 all-reduces"), "{}", logs[1]);
    }
}

#[test]
fn steps_per_print_logs_progress_on_the_first_rank_counting_skipped_steps() {
    // Five boundaries, the second skipped (rank 1's gradient is infinite):
    // with `steps_per_print` 2 rank 0 logs boundaries 2 (the skipped one)
    // and 4, as DeepSpeed counts them; rank 1 logs none; 0 logs nothing.
    for every in [2, 0] {
        let top = format!(
            r#""steps_per_print": {every}, "bf16": {{"enabled": true, "check_grad_overflow": true}},"#
        );
        let cfg = config_plus(2, 1, &top, "");
        on_ranks(WORLD, |r| {
            let (t, e) = tiny_engine(&cfg, &r);
            let mut at_4 = None;
            let ((), logs) = common::with_logs_at(tracing::Level::INFO, || {
                for k in 0..5 {
                    let x = input(r.rank(), k).to_kind(Kind::BFloat16);
                    let blow_up = if k == 1 && r.rank() == 1 {
                        f64::INFINITY
                    } else {
                        1.0
                    };
                    e.backward(&(t.loss(&x) * blow_up)).unwrap();
                    assert_eq!(
                        e.step().unwrap(),
                        k != 1,
                        "rank {} boundary {}",
                        r.rank(),
                        k + 1
                    );
                    if k == 3 {
                        at_4 = Some((e.lr(), e.betas(), e.global_grad_norm().unwrap()));
                    }
                }
            });
            let lines: Vec<&str> = logs
                .lines()
                .filter(|l| l.contains(", skipped="))
                .filter_map(|l| l.split_once("step=").map(|(_, rest)| rest))
                .collect();
            if every == 0 || r.rank() != 0 {
                assert!(lines.is_empty(), "rank {}, every {every}: {logs}", r.rank());
                return;
            }
            let (lr, betas, norm) = at_4.unwrap();
            assert_eq!(
                (lr, betas),
                (0.01, (0.9, 0.999)),
                "the config's, no schedule"
            );
            let applied = "4, skipped=1, lr=0.01, mom=(0.9, 0.999), grad_norm=";
            assert!(
                lines.len() == 2
                    && lines[0]
                        == "2, skipped=1, lr=0.01, mom=(0.9, 0.999), grad_norm=none (step skipped)"
                    && lines[1].starts_with(applied),
                "{logs}"
            );
            // Six significant digits of the step's norm.
            let printed: f64 = lines[1][applied.len()..].parse().unwrap();
            assert!(
                (printed - norm).abs() <= 1e-5 * norm,
                "{printed} against {norm}"
            );
        });
    }
}

#[test]
fn memory_breakdown_logs_what_the_first_rank_holds_with_each_progress_line() {
    // DeepSpeed's `memory_breakdown`: once the engine is built and with
    // every progress line (here boundaries 2 and 4 of 4), on rank 0 only;
    // the model state it names is `model_state_bytes`'.
    for on in [true, false] {
        let top = format!(r#""steps_per_print": 2, "memory_breakdown": {on},"#);
        let cfg = config_plus(3, 1, &top, "");
        on_ranks(WORLD, |r| {
            let ((t, e), logs) =
                common::with_logs_at(tracing::Level::INFO, || tiny_engine(&cfg, &r));
            let ((), more) = common::with_logs_at(tracing::Level::INFO, || {
                for k in 0..4 {
                    e.backward(&t.loss(&input(r.rank(), k))).unwrap();
                    e.step().unwrap();
                }
            });
            let said: Vec<&str> = (logs.lines().chain(more.lines()))
                .filter_map(|l| l.split_once("memory ").map(|(_, rest)| rest))
                .collect();
            if !on || r.rank() != 0 {
                assert!(said.is_empty(), "rank {}, {on}: {logs}{more}", r.rank());
                return;
            }
            let state = format!(
                "; model state {:.1} MiB, reuse pools ",
                e.model_state_bytes().unwrap() as f64 / (1u64 << 20) as f64
            );
            let whens: Vec<&str> = said.iter().map(|l| l.split(':').next().unwrap()).collect();
            assert_eq!(
                whens,
                ["after building the engine", "at step 2", "at step 4"],
                "{logs}{more}"
            );
            for l in &said {
                assert!(
                    l.contains(": resident ") && l.contains(" MiB (peak "),
                    "{l}"
                );
                assert!(l.contains("; libtorch ") && l.ends_with(" MiB)"), "{l}");
            }
            assert!(said[2].contains(&state), "{} lacks {state}", said[2]);
        });
    }
}

#[test]
fn dump_state_logs_the_engine_and_each_units_layout_on_the_first_rank() {
    // DeepSpeed's `dump_state`: once, when the engine is built, on rank 0
    // only; each unit's line names its parameters, elements and this
    // rank's shard, which `master_shard` reports too.
    for on in [true, false] {
        let cfg = common::config_zero(
            3,
            1,
            0.0,
            &format!(r#""dump_state": {on},"#),
            common::SHARD_ALL,
        );
        on_ranks(WORLD, |r| {
            let (vs, plan, _) = common::model();
            common::freeze(&vs, &["h.1.fc"]);
            let (e, logs) = common::with_logs_at(tracing::Level::INFO, || {
                common::engine_of(&vs, &plan, &cfg, &r)
            });
            let said: Vec<&str> = (logs.lines())
                .filter(|l| l.contains("engine state: ") || l.contains(" unit `"))
                .collect();
            if !on || r.rank() != 0 {
                assert!(said.is_empty(), "rank {}, {on}: {logs}", r.rank());
                return;
            }
            let names = e.unit_names();
            assert_eq!(said.len(), 1 + names.len(), "{logs}");
            let batch = e.config().batch;
            assert!(
                said[0].contains(&format!(
                    "engine state: ZeRO stage 3, 1 replica(s) x shard groups of 2, fp32 compute; batch {} = {} per rank x 1 accumulation x 2 ranks; optimizer AdamW at lr 0.01; {} unit(s)",
                    batch.train, batch.micro, names.len()
                )),
                "{}",
                said[0]
            );
            for (k, (name, line)) in names.iter().zip(&said[1..]).enumerate() {
                let (master, range) = e.master_shard(k).unwrap().unwrap();
                assert_eq!(master.len(), range.len());
                let want = format!(
                    "unit `{name}`: {} parameter(s), ",
                    (vs.variables().keys())
                        .filter(|n| {
                            n.strip_prefix(name.as_str())
                                .is_some_and(|r| r.starts_with('.'))
                                && !n.starts_with("h.1.fc")
                        })
                        .count()
                );
                let shard = format!("this rank's shard {}..{}", range.start, range.end);
                if name != "<root>" {
                    assert!(line.contains(&want), "{line} lacks {want}");
                }
                assert!(line.contains(&shard), "{line} lacks {shard}");
                let frozen = line.contains("; frozen part 2 parameter(s), ");
                assert_eq!(frozen, name == "h.1", "{line}");
            }
        });
    }
}

#[test]
fn under_hybrid_sharding_only_the_jobs_first_rank_logs_progress_and_the_comms_table() {
    // Shard groups {0, 1} and {2, 3}: rank 2 is rank 0 of its shard group
    // but not of its replicate group {0, 2}; only world rank 0 logs (the
    // progress line and the comms table), and only it writes the monitors.
    let dir = std::env::temp_dir().join(format!("zrt-hybrid-monitor-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let top = format!(
        r#""steps_per_print": 1, "csv_monitor": {{"enabled": true, "output_path": "{}"}},
            "comms_logger": {{"enabled": true}},"#,
        dir.display()
    );
    let cfg = config_plus(2, 1, &top, r#""mics_shard_size": 2,"#);
    let lines = on_ranks(4, |mut r| {
        let t = tiny();
        let e = Engine::from_config(&t.vs, &t.plan, &cfg, &mut r, &AutoHints::default()).unwrap();
        let ((), logs) = common::with_logs_at(tracing::Level::INFO, || {
            e.backward(&t.loss(&input(r.rank(), 0))).unwrap();
            assert!(e.step().unwrap());
            e.log_comms_summary();
        });
        e.write_monitor_events(&[("rank", r.rank() as f64, 1)]);
        // Every rank counts its two groups, by role: the gradient shards
        // are averaged across the replicate group.
        let rows = e.comms_summary().rows;
        for (role, op) in [("shard", "reduce_scatter"), ("replicate", "all_reduce")] {
            assert!(
                rows.iter()
                    .any(|x| (x.role, x.ranks, x.op) == (role, 2, op)),
                "{role} {op}: {rows:?}"
            );
        }
        let count = |text: &str| logs.lines().filter(|l| l.contains(text)).count();
        [
            count("step=1, skipped=0, lr=0.01"),
            count("comms_logger: this rank's collectives so far"),
        ]
    });
    assert_eq!(lines, [[1, 1], [0, 0], [0, 0], [0, 0]]);
    let rows = std::fs::read_to_string(dir.join("DeepSpeedJobName/rank.csv")).unwrap();
    assert_eq!(rows, "step,rank\n1,0\n");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn with_full_params_a_stage_3_model_saves_through_its_var_store() {
    let swap = std::env::temp_dir().join(format!("zrt-full-swap-{}", std::process::id()));
    std::fs::create_dir_all(&swap).unwrap();
    let offload = common::nvme_params(&swap);
    let bf16 = r#""bf16": {"enabled": true},"#;
    for (stage, extra, zero) in [
        (3u8, "", ""),
        (3, bf16, ""),
        // The gather sources paged in from the swap.
        (3, bf16, offload.as_str()),
        (2, "", ""),
    ] {
        let cfg = Config::from_json(&format!(
            r#"{{"train_micro_batch_size_per_gpu": 4, {extra}
                "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}},
                "zero_optimization": {{{zero} "stage": {stage}, "stage3_param_persistence_threshold": 0}}}}"#
        ))
        .unwrap();
        // The model runs in the compute dtype.
        let x = |rank: usize, k: usize| match extra.is_empty() {
            true => input(rank, k),
            false => input(rank, k).to_kind(Kind::BFloat16),
        };
        on_ranks(WORLD, |r| {
            let (t, e) = tiny_engine(&cfg, &r);
            e.backward(&t.loss(&x(r.rank(), 0))).unwrap();
            e.step().unwrap();
            let w = t.vs.variables()["a.weight"].shallow_clone();
            if stage == 3 {
                // Between steps a stage-3 weight has no memory: `vs.save`
                // here would crash the process.
                assert_eq!(glue::storage_nbytes(&w).unwrap(), 0);
            }
            let path = std::env::temp_dir().join(format!(
                "zrt-full-{}-{stage}-{}-{}-{}.safetensors",
                std::process::id(),
                extra.len(),
                zero.len(),
                r.rank()
            ));
            e.with_full_params(|| t.vs.save(&path)).unwrap().unwrap();
            let saved = Tensor::read_safetensors(&path).unwrap();
            let _ = std::fs::remove_file(&path);
            let (_, aw) = saved.iter().find(|(n, _)| n == "a.weight").unwrap();
            let master = e.gathered_params().unwrap();
            let want = &master.iter().find(|(n, _)| n == "a.weight").unwrap().1;
            let want = Tensor::from_slice(want).to_kind(aw.kind());
            assert!(
                aw.flatten(0, -1).equal(&want),
                "stage {stage} {extra}: the saved weight is the trained one"
            );
            if stage == 3 {
                assert_eq!(glue::storage_nbytes(&w).unwrap(), 0, "freed again after");
            }
            // Training goes on as before.
            e.backward(&t.loss(&x(r.rank(), 1))).unwrap();
            assert!(e.step().unwrap());
        });
    }
    let _ = std::fs::remove_dir_all(&swap);
}

#[test]
fn an_unsharded_stage_3_model_outlives_its_engine() {
    on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&config(3, 1), &r);
        e.backward(&t.loss(&input(r.rank(), 0))).unwrap();
        e.step().unwrap();
        let trained = e.gathered_params().unwrap();
        e.unshard().unwrap();
        drop(e);
        // Inference and the VarStore work on the trained values, whole.
        let vars = t.vs.variables();
        for (name, want) in &trained {
            let got = Vec::<f32>::try_from(&vars[name].flatten(0, -1)).unwrap();
            assert_eq!(&got, want, "{name}");
        }
        assert!(t.loss(&input(r.rank(), 1)).double_value(&[]).is_finite());
    });
}

#[test]
fn a_model_neither_fp32_nor_in_the_compute_dtype_is_refused_before_it_is_laid_out() {
    // f64 would lose bits in the fp32 master; fp32 and the compute dtype
    // widen to it exactly. Refused before the plan is claimed: the mended
    // model builds on the same plan.
    let mut t = tiny();
    t.vs.double();
    let e = solo_engine(&t.vs, &t.plan, &config(3, 1)).err().unwrap();
    assert!(
        e.to_string().contains(
            "is Double and the config computes in Float: make the model fp32 (`vs.float()`"
        ),
        "{e}"
    );
    // A bf16 model is a config without its bf16 block, or a model to
    // cast back.
    t.vs.bfloat16();
    let e = solo_engine(&t.vs, &t.plan, &config(3, 1)).err().unwrap();
    assert!(
        e.to_string().contains("is BFloat16 and the config computes in Float: enable `\"bf16\": {\"enabled\": true}` in the config, or make the model fp32 (`vs.float()`"),
        "{e}"
    );
    t.vs.float();
    let e = solo_engine(&t.vs, &t.plan, &config(3, 1)).unwrap();
    e.backward(&t.loss(&input(0, 0))).unwrap();
    assert!(e.step().unwrap());
}

#[test]
fn bf16_model_state_holds_fp32_gradients() {
    // DESIGN.md's table counts 2-byte gradients (DeepSpeed's); zrt reduces
    // and accumulates gradients in fp32 (DESIGN.md "Numerics"), 2 bytes per
    // parameter more, sharded from stage 2. `zrt estimate` prints this.
    let (p, n) = (128usize, WORLD);
    for stage in 0..=3u8 {
        let got: Vec<usize> = on_ranks(WORLD, |r| {
            let cfg = Config::from_json(&format!(
                r#"{{"train_micro_batch_size_per_gpu": 4, "bf16": {{"enabled": true}},
                    "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}},
                    "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0}}}}"#
            ))
            .unwrap();
            let (t, e) = tiny_engine(&cfg, &r);
            let x = input(r.rank(), 0).to_kind(Kind::BFloat16);
            e.backward(&t.loss(&x)).unwrap();
            e.step().unwrap();
            e.model_state_bytes().unwrap()
        });
        // bf16 params, fp32 gradients, fp32 master + m + v.
        let want = match stage {
            0 => (2 + 4 + 12) * p,
            1 => (2 + 4) * p + 12 * p / n,
            2 => 2 * p + (4 + 12) * p / n,
            _ => (2 + 4 + 12) * p / n,
        };
        assert_eq!(got, vec![want; WORLD], "stage {stage}");
    }
}

#[test]
fn a_backward_that_fails_after_reducing_part_of_its_gradient_stops_the_engine_until_a_load() {
    // The input changes in place after the forward: libtorch's backward
    // fails at unit `a` (its saved input is stale), after `c` and `b` ran.
    // Stage 1 has then added both to its accumulated gradients, and so has
    // stage 2 without `overlap_comm` (each hook waits for its reduction);
    // with it, stages 2-3 with 1-element buckets `c` (retired when `b`
    // launched), and with the default buckets nothing was added yet and
    // training goes on.
    let cases: [(u8, &str, Option<&str>); 5] = [
        (1, "", Some("units `b`, `c`")),
        (2, r#""overlap_comm": false,"#, Some("units `b`, `c`")),
        (2, r#""reduce_bucket_size": 1,"#, Some("unit `c`")),
        (3, r#""reduce_bucket_size": 1,"#, Some("unit `c`")),
        (2, "", None),
    ];
    for (stage, zero, added) in cases {
        let what = format!("stage {stage} {zero}");
        let cfg = config_plus(stage, 1, "", zero);
        let dir = std::env::temp_dir().join(format!(
            "zrt-failed-backward-{}-{stage}-{}",
            std::process::id(),
            zero.len()
        ));
        let out = on_ranks(WORLD, |r| {
            let (t, e) = tiny_engine(&cfg, &r);
            e.save_checkpoint(&dir, "start").unwrap();
            let x = input(r.rank(), 0);
            let loss = t.loss(&x);
            let _ = x.shallow_clone().g_add_scalar_(1.0);
            let failed = e.backward(&loss).unwrap_err().to_string();
            assert!(failed.starts_with("libtorch: "), "{what}: {failed}");
            let y = input(r.rank(), 1);
            let mut refused = Vec::new();
            if added.is_some() {
                refused.push(e.backward(&t.loss(&y)).unwrap_err().to_string());
                refused.push(e.step().unwrap_err().to_string());
                refused.push(e.save_checkpoint(&dir, "later").unwrap_err().to_string());
                // The weights were not touched: they still save.
                e.save_16bit_model(dir.join("weights.safetensors")).unwrap();
                e.load_checkpoint(&dir, Some("start")).unwrap();
            }
            e.backward(&t.loss(&y)).unwrap();
            e.step().unwrap();
            let trained = (e.global_grad_norm(), e.gathered_params().unwrap());
            (refused, trained)
        });
        let clean = on_ranks(WORLD, |r| {
            let (t, e) = tiny_engine(&cfg, &r);
            e.backward(&t.loss(&input(r.rank(), 1))).unwrap();
            e.step().unwrap();
            (e.global_grad_norm(), e.gathered_params().unwrap())
        });
        for (rank, (refused, trained)) in out.iter().enumerate() {
            // The norm too: Adam's first update hides a gradient that is
            // off by a part (it moves each weight by about lr x its sign).
            assert_eq!(trained, &clean[rank], "{what}: rank {rank} trains on");
            assert_eq!(refused.len(), if added.is_some() { 3 } else { 0 }, "{what}");
            for e in refused {
                let units = added.unwrap_or_default();
                assert!(
                    e.starts_with("accumulated gradients unusable: the backward of micro-step 0 failed (libtorch: ")
                        && e.contains(&format!("after the gradients of {units} had been reduced"))
                        && e.contains("load a checkpoint (`load_checkpoint`"),
                    "{what}: {e}"
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_plain_backward_whose_hook_failed_after_part_was_reduced_stops_the_engine() {
    // Stage 3, 1-element buckets: `c` is added to the step's gradients
    // when `b` launches. Rank 1's loss skips `a` (its output detached):
    // its backward ends before `a`'s and its next forward gathers, where
    // rank 0 reduces `a`. Rank 0's error is recorded while the program's
    // own `loss.backward()` is open (not ended until the next engine
    // call). The next engine call returns it; whichever it is
    // (`backward`, as here, or `step`), part of the gradient is in and the
    // engine must refuse to go on (`backward` returned the error and left
    // the open backward to `step`, which ended it and stepped, or failed
    // on a group the error had left).
    let cfg = config_plus(3, 1, "", r#""reduce_bucket_size": 1,"#);
    let out = on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&cfg, &r);
        let h = t.a.forward(&input(r.rank(), 0));
        let h = if r.rank() == 1 { h.detach() } else { h };
        t.loss_after_a(&h).backward();
        let y = t.loss(&input(r.rank(), 1));
        let failed = e.backward(&y).unwrap_err().to_string();
        let refused = e.step().unwrap_err().to_string();
        (failed, refused)
    });
    for (rank, (failed, refused)) in out.iter().enumerate() {
        assert!(
            refused.starts_with(&format!(
                "accumulated gradients unusable: the backward of micro-step 0 failed ({failed}) after the gradients of "
            )) && refused.contains("`c`"),
            "rank {rank}: {refused}"
        );
    }
    // Both are told the cause: rank 0's next forward met the failure
    // after its plain backward, which stays open until the next engine
    // call (it was told only of the collective that failed).
    for (rank, (failed, _)) in out.iter().enumerate() {
        assert!(
            failed.starts_with("gradient reductions out of step across ranks: rank 0 reduces `a`"),
            "rank {rank}: {failed}"
        );
    }
}

#[test]
fn monitors_write_deepspeeds_scalars_from_the_first_rank_only() {
    // Three boundaries of two micro-steps (train batch 4 x 2 x 2 = 16
    // samples), fp16, the second boundary skipped (rank 1's second
    // gradient is infinite): both monitors, in one folder, get one row or
    // event per boundary from rank 0 alone, at x = samples so far.
    let dir = std::env::temp_dir().join(format!("zrt-monitor-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let block = |key: &str| {
        format!(
            r#""{key}": {{"enabled": true, "output_path": "{}", "job_name": "run"}},"#,
            dir.display()
        )
    };
    let top = format!(
        r#"{} {} "wall_clock_breakdown": true, "fp16": {{"enabled": true, "initial_scale_power": 4, "hysteresis": 1}},"#,
        block("csv_monitor"),
        block("tensorboard")
    );
    let cfg = config_plus(2, 2, &top, "");
    let seen = on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&cfg, &r);
        let mut seen = Vec::new();
        for b in 0..3 {
            let mut losses = Vec::new();
            for m in 0..2 {
                let loss = t.loss(&input(r.rank(), 2 * b + m).to_kind(Kind::Half));
                losses.push(loss.double_value(&[]));
                let blow_up = if (b, m, r.rank()) == (1, 1, 1) {
                    f64::INFINITY
                } else {
                    1.0
                };
                e.backward(&(loss * blow_up)).unwrap();
                assert_eq!(e.step().unwrap(), m == 1 && b != 1);
            }
            let mean = (losses[0] + losses[1]) / 2.0;
            let b = e.last_step_breakdown().unwrap();
            let ms = [b.forward, b.backward, b.optimizer].map(|d| d.as_secs_f64() * 1e3);
            seen.push((mean, e.lr(), e.loss_scale().unwrap(), ms));
        }
        // A scalar of the program's own, from every rank.
        assert_eq!(e.global_samples(), 48);
        e.write_monitor_events(&[("Eval/Samples/eval_loss", r.rank() as f64 + 0.5, 48)]);
        seen
    });
    let rank0 = &seen[0];
    let run = dir.join("run");
    let rows = |tag: &str| -> Vec<(u64, f64)> {
        let text = std::fs::read_to_string(run.join(format!("Train_Samples_{tag}.csv"))).unwrap();
        let mut lines = text.lines();
        assert_eq!(lines.next(), Some(format!("step,{tag}").as_str()), "{text}");
        lines
            .map(|l| {
                let (x, v) = l.split_once(',').unwrap();
                (x.parse().unwrap(), v.parse().unwrap())
            })
            .collect()
    };
    let xs = [16, 32, 48];
    let loss = rows("train_loss");
    assert_eq!(loss.len(), 3, "{loss:?}");
    for ((x, v), (want_x, (want, _, _, _))) in loss.iter().zip(xs.iter().zip(rank0)) {
        assert_eq!(x, want_x);
        assert!(
            (v - want).abs() <= 1e-9 * want.abs(),
            "{v} against rank 0's {want}"
        );
    }
    // Rank 1's losses are not rank 0's: the rows are rank 0's alone.
    assert!(seen[1].iter().zip(rank0).all(|(a, b)| a.0 != b.0));
    let expect = |tag: &str, want: Vec<f64>| {
        let got = rows(tag);
        assert_eq!(
            got,
            xs.iter().copied().zip(want).collect::<Vec<_>>(),
            "{tag}"
        );
    };
    expect("lr", rank0.iter().map(|s| s.1).collect());
    // The overflow halved the scale (hysteresis 1).
    assert_eq!(
        rank0.iter().map(|s| s.2).collect::<Vec<_>>(),
        [16.0, 8.0, 8.0]
    );
    expect("loss_scale", rank0.iter().map(|s| s.2).collect());
    // The step's breakdown (`last_step_breakdown`), in milliseconds.
    for (i, tag) in ["forward", "backward", "step"].into_iter().enumerate() {
        let got = rows(&format!("elapsed_time_ms_{tag}"));
        assert_eq!(got.iter().map(|r| r.0).collect::<Vec<_>>(), xs, "{tag}");
        for (g, s) in got.iter().zip(rank0) {
            assert!((g.1 - s.3[i]).abs() <= 1e-9 * s.3[i], "{tag}: {got:?}");
        }
    }
    let eval = std::fs::read_to_string(run.join("Eval_Samples_eval_loss.csv")).unwrap();
    assert_eq!(eval, "step,eval_loss\n48,0.5\n", "rank 0's alone");
    // One event file, holding the same scalars (TensorBoard's are f32).
    let files: Vec<_> = std::fs::read_dir(&run)
        .unwrap()
        .map(|f| f.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("tfevents"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let events = zrt::zero::monitor::tfevents::read_scalars(&files[0]).unwrap();
    assert_eq!(events.len(), 3 * 6 + 1, "{events:?}");
    let of = |tag: &str| -> Vec<(i64, f32)> {
        (events.iter())
            .filter(|e| e.0 == tag)
            .map(|e| (e.1, e.2))
            .collect()
    };
    assert_eq!(of("Train/Samples/lr"), [(16, 0.01), (32, 0.01), (48, 0.01)]);
    let scales: Vec<(i64, f32)> = xs
        .iter()
        .zip(rank0)
        .map(|(x, s)| (*x as i64, s.2 as f32))
        .collect();
    assert_eq!(of("Train/Samples/loss_scale"), scales);
    let losses: Vec<(i64, f32)> = loss.iter().map(|(x, v)| (*x as i64, *v as f32)).collect();
    assert_eq!(of("Train/Samples/train_loss"), losses);
    assert_eq!(of("Eval/Samples/eval_loss"), [(48, 0.5)]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_monitor_folder_that_cannot_be_made_is_refused_naming_it() {
    let cfg = config_plus(
        0,
        1,
        r#""tensorboard": {"enabled": true, "output_path": "/proc/zrt-no", "job_name": "run"},"#,
        "",
    );
    on_ranks(1, |r| {
        let t = tiny();
        let e = Engine::new(
            &t.vs,
            &t.plan,
            &cfg,
            r.new_group(&[0]).unwrap(),
            &AutoHints::default(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.starts_with("monitor: cannot write `tensorboard` into /proc/zrt-no/run: ")
                && e.ends_with(
                    "set `tensorboard.output_path` to a writable folder, or turn the monitor off"
                ),
            "{e}"
        );
    });
}

#[test]
fn comms_logger_logs_the_selected_ops_each_and_in_a_summary_on_the_first_rank() {
    // Stage 3 gathers and reduce-scatters; the engine's build also
    // broadcasts rank 0's values and exchanges its agreement. The logger
    // keeps the gathers and reductions, named as DeepSpeed names them.
    let cfg = config_plus(
        3,
        2,
        r#""comms_logger": {"enabled": true, "verbose": true, "prof_all": false,
            "prof_ops": ["all_gather_into_tensor", "reduce_scatter_tensor"]},"#,
        "",
    );
    let kept = ["all_gather", "reduce_scatter"];
    let got = on_ranks(WORLD, |r| {
        common::with_logs_at(tracing::Level::INFO, || {
            let (t, e) = tiny_engine(&cfg, &r);
            let calls = |op: &str| -> u64 {
                let all = e.group().stats().by_size();
                all.iter().filter(|s| s.op == op).map(|s| s.calls).sum()
            };
            let at_build = kept.map(calls);
            for m in 0..2 {
                e.backward(&t.loss(&input(r.rank(), m))).unwrap();
                e.step().unwrap();
            }
            // Ops run in order on the group's thread: after this barrier
            // nothing the engine issued (a prefetch) is still to complete.
            e.group().barrier().wait().unwrap();
            let now = kept.map(calls);
            let since = [now[0] - at_build[0], now[1] - at_build[1]];
            e.log_comms_summary();
            (e.comms_summary(), e.group().stats().by_size(), since)
        })
    });
    for (rank, ((summary, all, since), logs)) in got.into_iter().enumerate() {
        // The summary holds the group's counts of the kept ops, exactly.
        let want: Vec<_> = all.iter().filter(|s| kept.contains(&s.op)).collect();
        assert_eq!(summary.rows.len(), want.len(), "{summary}");
        for (row, s) in summary.rows.iter().zip(&want) {
            assert_eq!(
                (row.role, row.ranks, row.op, row.bytes, row.calls, row.time),
                ("shard", WORLD, s.op, s.bytes, s.calls, s.time)
            );
        }
        for op in kept {
            assert!(summary.rows.iter().any(|r| r.op == op), "{op}: {summary}");
        }
        // What was left out ran: the filter, not an idle group, keeps it out.
        assert!(all.iter().any(|s| !kept.contains(&s.op)), "{all:?}");
        let lines = |op: &str| {
            logs.lines()
                .filter(|l| l.contains(&format!("comm op: {op} | group: shard")))
                .count() as u64
        };
        if rank == 0 {
            // A line per kept op since the build, with its size and rates.
            assert_eq!(
                [lines("all_gather"), lines("reduce_scatter")],
                since,
                "{logs}"
            );
            assert!(since.iter().all(|&n| n > 0), "{since:?}");
            let line = logs
                .lines()
                .find(|l| l.contains("comm op: all_gather"))
                .unwrap();
            assert!(
                line.contains("msg size: ") && line.contains("busbw (GB/s): "),
                "{line}"
            );
            assert!(
                !logs.contains("comm op: broadcast") && !logs.contains("comm op: all_reduce"),
                "{logs}"
            );
            // And the table, as `comms_summary` displays it.
            let table = summary.to_string();
            assert!(logs.contains(table.trim_end()), "{logs}\n{table}");
        } else {
            assert!(
                !logs.contains("comm op:") && !logs.contains("busbw GB/s"),
                "{logs}"
            );
        }
    }
}

#[test]
fn without_comms_logger_the_summary_holds_every_op_and_logging_it_says_why_not() {
    let got = on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&config(3, 1), &r);
        e.backward(&t.loss(&input(r.rank(), 0))).unwrap();
        e.step().unwrap();
        let ((), logs) = common::with_logs_at(tracing::Level::INFO, || e.log_comms_summary());
        let ops: Vec<_> = e
            .comms_summary()
            .rows
            .iter()
            .map(|r| (r.op, r.calls))
            .collect();
        let all: Vec<_> = e
            .group()
            .stats()
            .by_size()
            .iter()
            .map(|s| (s.op, s.calls))
            .collect();
        (logs, ops, all)
    });
    for (rank, (logs, ops, all)) in got.into_iter().enumerate() {
        let said =
            logs.contains("no communication summary: `comms_logger` is not enabled in the config");
        assert_eq!(said, rank == 0, "{logs}");
        assert_eq!(ops, all);
        for op in ["all_gather", "reduce_scatter", "broadcast"] {
            assert!(ops.iter().any(|o| o.0 == op), "{op}: {ops:?}");
        }
    }
}

#[test]
fn a_model_run_twice_before_one_backward_trains_alike_in_every_stage() {
    // A siamese or contrastive step: two forwards of the whole model, one
    // loss. Stage 3 frees every unit after each forward and re-gathers it
    // for each use's backward; each parameter's gradient sums both uses
    // before its hook fires, once.
    let zero = r#""stage3_param_persistence_threshold": 0,"#;
    let run = |stage: u8| {
        on_ranks(WORLD, |r| {
            let (vs, plan, gpt) = common::model();
            let cfg = common::config_zero(stage, 1, 0.0, "", zero);
            let e = engine_of(&vs, &plan, &cfg, &r);
            for step in 0..3 {
                let a = gpt.loss(&common::tokens(step, 0, r.rank(), 2));
                let b = gpt.loss(&common::tokens(step, 1, r.rank(), 2));
                e.backward(&(a + b)).unwrap();
                e.step().unwrap();
            }
            e.gathered_params().unwrap()
        })
        .remove(0)
    };
    let unsharded = run(0);
    for stage in [1u8, 2, 3] {
        assert_eq!(run(stage), unsharded, "stage {stage}");
    }
}

#[test]
fn a_loss_backward_cannot_run_is_named_and_the_engine_trains_on() {
    // libtorch's errors: "element 0 of tensors does not require grad and
    // does not have a grad_fn" with 2 KB of C++ stack, and "grad can be
    // implicitly created only for scalar outputs".
    let got = on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&config(3, 1), &r);
        let x = input(r.rank(), 0);
        let evaluated = tch::no_grad(|| t.loss(&x));
        let per_sample = t.c.forward(&t.b.forward(&t.a.forward(&x)).tanh());
        let errs = [
            e.backward(&evaluated).unwrap_err().to_string(),
            e.backward(&per_sample).unwrap_err().to_string(),
        ];
        e.backward(&t.loss(&x)).unwrap();
        assert!(e.step().unwrap());
        (errs, e.gathered_params().unwrap())
    });
    let clean = on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&config(3, 1), &r);
        e.backward(&t.loss(&input(r.rank(), 0))).unwrap();
        e.step().unwrap();
        e.gathered_params().unwrap()
    });
    for (rank, ([no_grad, shaped], trained)) in got.iter().enumerate() {
        assert!(
            no_grad.starts_with(
                "bad argument: backward of a loss that does not require grad: it was computed under tch::no_grad"
            ),
            "{no_grad}"
        );
        assert!(
            shaped.starts_with(
                "bad argument: backward of a loss of shape [4, 1]: it needs one number"
            ),
            "{shaped}"
        );
        assert_eq!(
            trained, &clean[rank],
            "rank {rank} trains on as if nothing failed"
        );
    }
}

#[test]
fn a_unit_no_rank_uses_trains_alike_at_every_stage() {
    // Unit `c` is in no rank's loss (a head another phase trains): its
    // gradient is zero on every rank, reduced at the end of backward (at
    // stage 3 without ever being gathered for it), and Adam steps it with
    // that zero, as DeepSpeed's flat buffers do.
    let run = |stage: u8| {
        on_ranks(WORLD, |r| {
            let (t, e) = tiny_engine(&config(stage, 1), &r);
            for k in 0..3 {
                let h = t.b.forward(&t.a.forward(&input(r.rank(), k)));
                e.backward(&h.tanh().square().mean(Kind::Float)).unwrap();
                e.step().unwrap();
            }
            e.gathered_params().unwrap()
        })
        .remove(0)
    };
    let reference = run(0);
    // No weight decay in this config: a zero gradient moves nothing.
    let t = tiny();
    for (name, v) in reference.iter().filter(|(n, _)| n.starts_with("c.")) {
        let start = Vec::<f32>::try_from(&t.vs.variables()[name].flatten(0, -1)).unwrap();
        assert_eq!(v, &start, "{name}");
    }
    assert_ne!(reference[0].1, {
        let a = &t.vs.variables()[&reference[0].0];
        Vec::<f32>::try_from(&a.flatten(0, -1)).unwrap()
    });
    for stage in [1u8, 2, 3] {
        assert_eq!(run(stage), reference, "stage {stage}");
    }
}

#[test]
fn an_evaluation_between_a_plain_backward_and_the_step_changes_nothing() {
    // `loss.backward(); if it % 100 == 0 { evaluate() }; engine.step()`:
    // the plain backward stays open (its reductions in flight, stage 3's
    // units gathered for it) while the evaluation's forward gathers and
    // frees units, until step() ends it.
    let zero = r#""stage3_param_persistence_threshold": 0,"#;
    let run = |stage: u8, bare: bool| {
        on_ranks(WORLD, |r| {
            let (vs, plan, gpt) = common::model();
            let cfg = common::config_zero(stage, 1, 0.0, "", zero);
            let e = engine_of(&vs, &plan, &cfg, &r);
            let mut evals = Vec::new();
            for step in 0..3 {
                let loss = gpt.loss(&common::tokens(step, 0, r.rank(), 1));
                match bare {
                    true => loss.backward(),
                    false => e.backward(&loss).unwrap(),
                }
                let val = |k| gpt.loss(&common::tokens(100 + step, k, r.rank(), 1));
                // Under no_grad, and with autograd on (a forward whose
                // backward never runs).
                evals.push(tch::no_grad(|| val(0)).double_value(&[]));
                evals.push(val(1).double_value(&[]));
                assert!(e.step().unwrap());
            }
            (evals, e.gathered_params().unwrap())
        })
        .remove(0)
    };
    for stage in [0u8, 1, 2, 3] {
        assert_eq!(run(stage, true), run(stage, false), "stage {stage}");
    }
}

#[test]
fn input_gradients_by_autograd_grad_leave_training_as_it_was() {
    // Saliency maps, adversarial examples: a backward for the input's
    // gradient only (torch.autograd.grad(loss, x)) runs through the units
    // (stage 3 gathers them for it) but accumulates no parameter gradient.
    // Between steps, at every stage: training equals training without it,
    // the input gradients equal stage 0's, and stage 3 frees each unit
    // after it (until 2026-11-28 they stayed gathered until their next
    // forward: the whole model, at the end of such a backward).
    let run = |stage: u8, probe: bool| {
        on_ranks(WORLD, |r| {
            let (t, e) = tiny_engine(&config(stage, 1), &r);
            let mut saliency = Vec::new();
            for k in 0..3 {
                if probe {
                    let held = e.model_state_bytes().unwrap();
                    // `a`'s input too: its backward needs `a`'s weights.
                    let x = input(r.rank(), 10 + k).set_requires_grad(true);
                    let g = Tensor::run_backward(&[t.loss(&x)], &[&x], false, false);
                    saliency.push(Vec::<f32>::try_from(&g[0].flatten(0, -1)).unwrap());
                    // Each unit freed once backward is through it: no
                    // parameter gradient hook fires to free it.
                    assert_eq!(e.model_state_bytes().unwrap(), held, "stage {stage}");
                }
                e.backward(&t.loss(&input(r.rank(), k))).unwrap();
                e.step().unwrap();
            }
            (saliency, e.gathered_params().unwrap())
        })
        .remove(0)
    };
    let reference = run(0, true);
    assert_eq!(reference.0.len(), 3);
    for stage in [0u8, 1, 2, 3] {
        let (saliency, trained) = run(stage, true);
        assert_eq!(trained, run(stage, false).1, "stage {stage}");
        assert_eq!(saliency, reference.0, "stage {stage}");
    }
}

#[test]
fn a_gradient_penalty_through_the_units_trains_alike_at_every_stage() {
    // WGAN-GP, R1: the input gradient taken with create_graph (and so
    // keep_graph), then a backward through it, which needs the units'
    // parameters again after the first pass; with unit `b` frozen too (a
    // unit of frozen parameters only, freed when its input's gradient is
    // ready unless the graph is kept: it was freed, and the second
    // backward read freed memory).
    let run = |stage: u8, frozen: bool| {
        on_ranks(WORLD, |r| {
            let t = tiny();
            if frozen {
                common::freeze(&t.vs, &["b."]);
            }
            let e = engine_for(&t, &config(stage, 1), &r);
            for k in 0..3 {
                let x = input(r.rank(), k).set_requires_grad(true);
                e.backward(&common::with_gradient_penalty(&t.loss(&x), &x))
                    .unwrap();
                e.step().unwrap();
            }
            e.gathered_params().unwrap()
        })
        .remove(0)
    };
    for frozen in [false, true] {
        let reference = run(0, frozen);
        for stage in [1u8, 2, 3] {
            assert_eq!(
                run(stage, frozen),
                reference,
                "stage {stage}, frozen b {frozen}"
            );
        }
    }
}

#[test]
fn a_backward_that_reaches_none_of_the_engines_parameters_is_warned_of_once() {
    // The loss of another model (the wrong engine's backward): its
    // micro-step's gradient is zero, silently. Units declared unused on
    // some ranks, which the walk from such a loss finds unreached and
    // reduces (with zeros) at once, count as not reached either.
    for declared in [false, true] {
        let t = tiny();
        if declared {
            t.plan.unused_on_some_ranks(|_, _| true).unwrap();
        }
        let other = tiny_other();
        let e = solo_engine(&t.vs, &t.plan, &config(2, 1)).unwrap();
        let ((), logs) = common::with_logs(|| {
            // The first backward agrees the order the walk needs.
            e.backward(&t.loss(&input(0, 0))).unwrap();
            e.step().unwrap();
            for k in 0..2 {
                e.backward(&(other.square().mean(Kind::Float) * (k + 1) as f64))
                    .unwrap();
                e.step().unwrap();
            }
            e.backward(&t.loss(&input(0, 1))).unwrap();
            e.step().unwrap();
        });
        let warned = "the loss reached none of this engine's trained parameters";
        assert_eq!(
            logs.matches(warned).count(),
            1,
            "declared {declared}: {logs}"
        );
    }
}

/// A parameter of no engine's, for a loss that reaches none.
fn tiny_other() -> Tensor {
    Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true)
}

#[test]
fn the_accumulation_boundary_is_the_micro_step_whose_step_updates() {
    // DeepSpeed's `is_gradient_accumulation_boundary`: true for the last
    // micro-step of each accumulation, asked before its backward or after
    // it (engine.backward or a plain loss.backward()), and on after a
    // checkpoint load.
    let dir = std::env::temp_dir().join(format!("zrt-boundary-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = config(2, 3);
    on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&cfg, &r);
        for k in 1..=7 {
            let last = k % 3 == 0;
            assert_eq!(e.is_gradient_accumulation_boundary(), last, "before {k}");
            let loss = t.loss(&input(r.rank(), k));
            match k % 2 {
                0 => loss.backward(),
                _ => e.backward(&loss).unwrap(),
            }
            assert_eq!(e.is_gradient_accumulation_boundary(), last, "after {k}");
            assert_eq!(e.step().unwrap(), last, "step {k}");
            if k == 3 {
                e.save_checkpoint(&dir, "three").unwrap();
            }
        }
        // Without the step() calls between micro-steps that do not update
        // (then, until its backward, the micro-step in progress is the one
        // before).
        let (t, e) = tiny_engine(&cfg, &r);
        e.load_checkpoint(&dir, Some("three")).unwrap();
        assert!(!e.is_gradient_accumulation_boundary());
        for k in 4..=5 {
            e.backward(&t.loss(&input(r.rank(), k))).unwrap();
            assert!(!e.is_gradient_accumulation_boundary(), "{k}");
        }
        t.loss(&input(r.rank(), 6)).backward();
        assert!(e.is_gradient_accumulation_boundary());
        assert!(e.step().unwrap());
        assert!(!e.is_gradient_accumulation_boundary());
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn input_gradients_taken_with_retain_graph_hold_the_units_until_one_without() {
    // Stage 3: a backward that keeps its graph frees no unit at its
    // input's gradient (a gradient penalty's backward may follow); the
    // last input gradient taken without retain_graph frees them (choices.md).
    on_ranks(WORLD, |r| {
        let (t, e) = tiny_engine(&config(3, 1), &r);
        for k in 0..2 {
            let held = e.model_state_bytes().unwrap();
            let x = input(r.rank(), 10 + k).set_requires_grad(true);
            let y = t.loss(&x);
            let kept = Tensor::run_backward(&[&y], &[&x], true, false);
            assert!(e.model_state_bytes().unwrap() > held, "step {k}");
            let last = Tensor::run_backward(&[&y], &[&x], false, false);
            assert_eq!(e.model_state_bytes().unwrap(), held, "step {k}");
            assert_eq!(kept[0], last[0]);
            e.backward(&t.loss(&input(r.rank(), k))).unwrap();
            e.step().unwrap();
        }
    });
}
