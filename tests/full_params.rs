//! `with_full_params` keeps what its closure changes (FSDP's
//! `writeback=True`): a change made inside it trains exactly as the same
//! change made to the VarStore before the engine was built, on every stage,
//! in fp32 and bf16, with the optimizer state and the parameters on NVMe,
//! and for a sharded frozen weight. Ranks that change the model
//! differently get an error and rank 0's values; a change to a unit a
//! forward inside the closure freed on another rank is refused on every
//! rank. 2 ranks (threads).

use crate::common;

use common::{config_zero, model, nvme, nvme_params, on_ranks, tokens, WORLD};
use tch::{nn, Kind, Tensor};
use zrt::zero::{AutoHints, Config, Engine};

fn var(vs: &nn::VarStore, name: &str) -> Tensor {
    vs.variables()
        .remove(name)
        .unwrap_or_else(|| panic!("no variable {name}"))
}

/// The change, in values every precision holds exactly: a trained weight
/// and bias set, one row of the root's embedding set, the last row of a
/// frozen weight doubled (the only change in its unit, at the end of the
/// unit's frozen buffer: the fingerprint must cover all of it). The values
/// set in `h.1.proj` lie outside a linear layer's initial range
/// (1/sqrt(32)): an element whose 16-bit value already was the new one
/// keeps its fp32 master, as documented, and would differ here.
fn change(vs: &nn::VarStore) {
    tch::no_grad(|| {
        let _ = var(vs, "h.1.proj.weight").fill_(0.375);
        let _ = var(vs, "h.1.proj.bias").fill_(-0.5);
        let _ = var(vs, "wte.weight").narrow(0, 0, 1).fill_(0.0625);
        let fc = var(vs, "h.0.fc.weight");
        let _ = fc.narrow(0, fc.size()[0] - 1, 1).g_mul_scalar_(2.0);
    });
}

/// What training left: every master, and the frozen weight as the engine
/// holds it (gathered).
type Outcome = (Vec<(String, Vec<f32>)>, Vec<f32>);

/// Trains two steps of the test GPT with `h.0.fc.weight` frozen, making
/// [`change`] before building the engine (`inside` false) or inside
/// `with_full_params` after it.
fn train(cfg: &Config, inside: bool) -> Vec<Outcome> {
    on_ranks(WORLD, |r| {
        let (vs, plan, gpt) = model();
        let _ = var(&vs, "h.0.fc.weight").set_requires_grad(false);
        if !inside {
            change(&vs);
        }
        let g = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, cfg, g, &AutoHints::default()).unwrap();
        if inside {
            e.with_full_params(|| change(&vs)).unwrap();
        }
        for step in 0..2 {
            let loss = gpt.loss(&tokens(step, 0, r.rank(), 1));
            e.backward(&loss).unwrap();
            e.step().unwrap();
        }
        let frozen = e
            .with_full_params(|| {
                let t = var(&vs, "h.0.fc.weight").to_kind(Kind::Float);
                Vec::<f32>::try_from(&t.flatten(0, -1)).unwrap()
            })
            .unwrap();
        (e.gathered_params().unwrap(), frozen)
    })
}

/// Asserts `a` and `b` hold the same bits, naming the first parameter
/// that differs (the values themselves would fill a screen).
fn same(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb, "{what}");
        assert!(va == vb, "{what}: `{na}` differs");
    }
}

fn cfg(stage: u8, extra: &str, zero: &str) -> Config {
    let zero = format!(r#"{zero} "stage3_param_persistence_threshold": 0,"#);
    config_zero(stage, 1, 0.5, extra, &zero)
}

#[test]
fn a_change_inside_with_full_params_trains_as_one_made_before_the_engine() {
    let dir = std::env::temp_dir().join(format!("zrt-full-params-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (aio, opt) = nvme(&dir);
    let bf16 = r#""bf16": {"enabled": true},"#;
    let mut cases: Vec<(String, Config)> = Vec::new();
    for stage in 0..=3u8 {
        cases.push((format!("stage {stage} fp32"), cfg(stage, "", "")));
        cases.push((format!("stage {stage} bf16"), cfg(stage, bf16, "")));
    }
    let offloaded = format!("{opt}{}", nvme_params(&dir));
    cases.push((
        "stage 3 bf16, optimizer and parameters on NVMe".into(),
        cfg(3, &format!("{aio}{bf16}"), &offloaded),
    ));
    cases.push((
        "stage 3 fp32, optimizer and parameters on NVMe".into(),
        cfg(3, &aio, &offloaded),
    ));
    for (what, c) in &cases {
        let before = train(c, false);
        let inside = train(c, true);
        for (rank, (b, i)) in before.iter().zip(&inside).enumerate() {
            same(&b.0, &i.0, &format!("{what}, rank {rank}"));
            assert!(b.1 == i.1, "{what}, rank {rank}: the frozen weight differs");
        }
        // The change took: the frozen weight's last row is doubled, the
        // rest is the model's.
        let (vs, _, _) = model();
        let (_, frozen) = &inside[0];
        let init = var(&vs, "h.0.fc.weight")
            .to_kind(Kind::Float)
            .flatten(0, -1);
        let init = Vec::<f32>::try_from(&init).unwrap();
        let times = |x: f32, k: f32| match what.contains("bf16") {
            true => half::bf16::from_f32(x).to_f32() * k,
            false => x * k,
        };
        let of = |r: std::ops::Range<usize>, k: f32| -> Vec<f32> {
            init[r].iter().map(|&x| times(x, k)).collect()
        };
        let n = init.len();
        assert_eq!(frozen[n - 8..], of(n - 8..n, 2.0)[..], "{what}");
        assert_eq!(frozen[..8], of(0..8, 1.0)[..], "{what}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ranks_that_change_the_model_differently_get_an_error_and_rank_0s_values() {
    for (stage, extra) in [(3u8, ""), (2, r#""bf16": {"enabled": true},"#)] {
        let out = on_ranks(WORLD, |r| {
            let (vs, plan, gpt) = model();
            let g = r.new_group(&[0, 1]).unwrap();
            let e =
                Engine::new(&vs, &plan, &cfg(stage, extra, ""), g, &AutoHints::default()).unwrap();
            let w = var(&vs, "h.1.proj.weight");
            let err = e
                .with_full_params(|| {
                    if r.rank() == 1 {
                        let _ = tch::no_grad(|| w.shallow_clone().fill_(0.25));
                    }
                })
                .unwrap_err()
                .to_string();
            // Training goes on from one model.
            let loss = gpt.loss(&tokens(0, 0, r.rank(), 1));
            e.backward(&loss).unwrap();
            e.step().unwrap();
            (err, e.gathered_params().unwrap())
        });
        let reference = on_ranks(WORLD, |r| {
            let (vs, plan, gpt) = model();
            let g = r.new_group(&[0, 1]).unwrap();
            let e =
                Engine::new(&vs, &plan, &cfg(stage, extra, ""), g, &AutoHints::default()).unwrap();
            let loss = gpt.loss(&tokens(0, 0, r.rank(), 1));
            e.backward(&loss).unwrap();
            e.step().unwrap();
            e.gathered_params().unwrap()
        });
        for (rank, (err, params)) in out.iter().enumerate() {
            assert!(
                err.contains("the ranks changed units `h.1` (world ranks [1]) differently from world rank 0; rank 0's values were kept on every rank"),
                "stage {stage}, rank {rank}: {err}"
            );
            same(
                params,
                &reference[rank],
                &format!("stage {stage}, rank {rank}"),
            );
        }
    }
}

/// Variable `name`'s values as the engine holds them (a collective).
fn held(
    e: &Engine<impl zrt::collectives::ProcessGroup + 'static>,
    vs: &nn::VarStore,
    name: &str,
) -> Vec<f32> {
    e.with_full_params(|| {
        let t = var(vs, name).to_kind(Kind::Float);
        Vec::<f32>::try_from(&t.flatten(0, -1)).unwrap()
    })
    .unwrap()
}

#[test]
fn ranks_that_both_change_a_unit_but_differently_are_told_and_keep_rank_0s() {
    for stage in [3u8, 1] {
        let out = on_ranks(WORLD, |r| {
            let (vs, plan, _) = model();
            let g = r.new_group(&[0, 1]).unwrap();
            let e = Engine::new(&vs, &plan, &cfg(stage, "", ""), g, &AutoHints::default()).unwrap();
            let w = var(&vs, "h.1.proj.weight");
            let to = [0.5, 0.25][r.rank()];
            let err = e
                .with_full_params(|| tch::no_grad(|| drop(w.shallow_clone().fill_(to))))
                .unwrap_err()
                .to_string();
            (err, held(&e, &vs, "h.1.proj.weight"))
        });
        for (rank, (err, values)) in out.iter().enumerate() {
            assert!(
                err.contains("the ranks changed units `h.1` (world ranks [1]) differently"),
                "stage {stage}, rank {rank}: {err}"
            );
            assert!(
                values.iter().all(|&x| x == 0.5),
                "stage {stage}, rank {rank}"
            );
        }
    }
}

#[test]
fn a_change_a_forward_inside_the_closure_freed_on_another_rank_is_refused_on_both() {
    let out = on_ranks(WORLD, |r| {
        let (vs, plan, gpt) = model();
        let g = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg(3, "", ""), g, &AutoHints::default()).unwrap();
        // A step first: the first forward keeps every unit gathered.
        e.backward(&gpt.loss(&tokens(0, 0, r.rank(), 1))).unwrap();
        e.step().unwrap();
        let before = held(&e, &vs, "h.0.proj.weight");
        let w = var(&vs, "h.0.proj.weight");
        // Rank 0 changes h.0; rank 1 runs a forward, which frees h.0 again
        // at stage 3 once h.1 has run (the last unit stays for backward).
        let err = e
            .with_full_params(|| match r.rank() {
                0 => tch::no_grad(|| drop(w.shallow_clone().fill_(0.5))),
                _ => drop(gpt.loss(&tokens(1, 0, 1, 1))),
            })
            .unwrap_err()
            .to_string();
        // Without a change, a forward inside the closure is no error.
        e.with_full_params(|| {
            if r.rank() == 1 {
                drop(gpt.loss(&tokens(2, 0, 1, 1)));
            }
        })
        .unwrap();
        (err, before, held(&e, &vs, "h.0.proj.weight"))
    });
    for (rank, (err, before, after)) in out.iter().enumerate() {
        assert!(
            err.contains(
                "unit `h.0` changed inside with_full_params but world rank 1 no longer held it"
            ),
            "rank {rank}: {err}"
        );
        // Nothing was written back: every rank has the model as it was.
        assert_eq!(after, before, "rank {rank}");
    }
}

#[test]
fn hybrid_sharding_writes_back_in_every_replica_and_names_world_ranks() {
    // World 4, mics_shard_size 2: shards inside {0, 1} and {2, 3}, replicas
    // {0, 2} and {1, 3}. `who` changes the model: every rank, or rank 3
    // alone (the second replica's second shard rank).
    let cfg = config_zero(
        3,
        1,
        0.5,
        "",
        r#""mics_shard_size": 2, "stage3_param_persistence_threshold": 0,"#,
    );
    let run = |before: bool, who: fn(usize) -> bool| {
        on_ranks(4, |mut r| {
            let (vs, plan, gpt) = model();
            if before {
                change(&vs);
            }
            let e = Engine::from_config(&vs, &plan, &cfg, &mut r, &AutoHints::default()).unwrap();
            let kept = e.with_full_params(|| {
                if who(r.rank()) {
                    change(&vs);
                }
            });
            let loss = gpt.loss(&tokens(0, 0, r.rank(), 1));
            e.backward(&loss).unwrap();
            e.step().unwrap();
            (
                kept.err().map(|e| e.to_string()),
                e.gathered_params().unwrap(),
            )
        })
    };
    let reference = run(true, |_| false);
    let inside = run(false, |_| true);
    let rank3 = run(false, |r| r == 3);
    let untouched = run(false, |_| false);
    for rank in 0..4 {
        assert_eq!(reference[rank].0, None);
        same(
            &reference[rank].1,
            &reference[0].1,
            &format!("reference rank {rank}"),
        );
        same(
            &inside[rank].1,
            &reference[rank].1,
            &format!("changed inside, rank {rank}"),
        );
        same(
            &rank3[rank].1,
            &untouched[rank].1,
            &format!("rank 3 alone, rank {rank}"),
        );
        let err = rank3[rank].0.as_deref().unwrap_or_default();
        assert!(err.contains("(world ranks [3])"), "rank {rank}: {err}");
    }
}
