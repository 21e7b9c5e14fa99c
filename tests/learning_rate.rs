//! `Engine::set_lr`: the program's own learning-rate schedule (nanoGPT's
//! `get_lr(it)`, written into DeepSpeed's optimizer `param_groups`). It
//! trains as a config of that rate would, alike at every stage, survives
//! a checkpoint, and is refused where it would be overwritten (a config
//! `scheduler`) or would let replicas drift apart (ranks setting
//! different rates).

use crate::common;

use common::{engine_of, model, on_ranks, serial, tokens, Params, WORLD};
use zrt::collectives::local::{LocalGroup, LocalRank};
use zrt::zero::{Config, Engine, EngineError};

/// AdamW at `stage` with learning rate `lr`, `extra` spliced into the top
/// level (ending with a comma); every stage-3 parameter sharded.
fn config(stage: u8, lr: f64, extra: &str) -> Config {
    Config::from_json(&format!(
        r#"{{"train_micro_batch_size_per_gpu": 2, {extra}
            "optimizer": {{"type": "AdamW", "params": {{"lr": {lr}, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0}}}}"#
    ))
    .unwrap()
}

fn engine(cfg: &Config, r: &LocalRank) -> (zrt::gpt::Gpt, Engine<LocalGroup>) {
    let (vs, plan, gpt) = model();
    (gpt, engine_of(&vs, &plan, cfg, r))
}

/// A learning rate by step.
type Rates<'a> = Option<&'a (dyn Fn(usize) -> f64 + Sync)>;

/// Trains `steps`, each after `set_lr(lrs(step))` when given.
fn train(
    gpt: &zrt::gpt::Gpt,
    e: &Engine<LocalGroup>,
    rank: usize,
    steps: std::ops::Range<usize>,
    lrs: Rates,
) {
    for step in steps {
        if let Some(lr) = lrs {
            e.set_lr(lr(step)).unwrap();
            assert_eq!(e.lr(), lr(step));
        }
        e.backward(&gpt.loss(&tokens(step, 0, rank, 1))).unwrap();
        e.step().unwrap();
    }
}

/// Rank 0's parameters after three steps at `stage` under config rate
/// `lr`, with `set_lr(lrs(step))` before each when given.
fn run(stage: u8, lr: f64, lrs: Rates) -> Params {
    on_ranks(WORLD, |r| {
        let (gpt, e) = engine(&config(stage, lr, ""), &r);
        train(&gpt, &e, r.rank(), 0..3, lrs);
        e.gathered_params().unwrap()
    })
    .remove(0)
}

#[test]
fn a_set_learning_rate_trains_as_a_config_of_that_rate_at_every_stage() {
    let fixed = |_: usize| 0.003;
    let decaying = |step: usize| 0.01 / (1 + step) as f64;
    let reference = run(0, 0.01, Some(&decaying));
    assert_ne!(
        reference,
        run(0, 0.01, None),
        "the rates made no difference"
    );
    for stage in [0u8, 1, 2, 3] {
        assert_eq!(
            run(stage, 0.01, Some(&fixed)),
            run(stage, 0.003, None),
            "stage {stage}: set_lr(0.003) under a config of 0.01"
        );
        assert_eq!(
            run(stage, 0.01, Some(&decaying)),
            reference,
            "stage {stage}"
        );
    }
}

#[test]
fn a_set_learning_rate_is_kept_by_checkpoints() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("zrt-set-lr-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (on, resumed) = {
        let lr = |_: usize| 0.003;
        let on = on_ranks(WORLD, |r| {
            let (gpt, e) = engine(&config(3, 0.01, ""), &r);
            train(&gpt, &e, r.rank(), 0..1, Some(&lr));
            e.save_checkpoint(&dir, "one").unwrap();
            train(&gpt, &e, r.rank(), 1..3, None);
            e.gathered_params().unwrap()
        });
        let resumed = on_ranks(WORLD, |r| {
            let (gpt, e) = engine(&config(3, 0.01, ""), &r);
            e.load_checkpoint(&dir, Some("one")).unwrap();
            assert_eq!(e.lr(), 0.003);
            train(&gpt, &e, r.rank(), 1..3, None);
            e.gathered_params().unwrap()
        });
        (on, resumed)
    };
    // Resumed under a config scheduler, that schedule sets the rate.
    let warmup = r#""scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},"#;
    let scheduled = on_ranks(WORLD, |r| {
        let (gpt, e) = engine(&config(3, 0.01, warmup), &r);
        e.load_checkpoint(&dir, Some("one")).unwrap();
        train(&gpt, &e, r.rank(), 1..3, None);
        e.lr()
    });
    let _ = std::fs::remove_dir_all(&dir);
    assert!(scheduled[0] != 0.003 && scheduled[0] > 0.0, "{scheduled:?}");
    assert_eq!(resumed[0], on[0], "the resumed run steps at the set rate");
    assert_ne!(on[0], run(3, 0.01, None));
}

#[test]
fn set_lr_is_refused_under_a_scheduler_for_a_bad_rate_and_for_ranks_that_differ() {
    let warmup = r#""scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},"#;
    let errs = on_ranks(WORLD, |r| {
        let (_, e) = engine(&config(2, 0.01, warmup), &r);
        e.set_lr(0.001).unwrap_err().to_string()
    });
    for e in errs {
        assert!(
            e.contains("set_lr(0.001) under the config's `scheduler`"),
            "{e}"
        );
        assert!(e.contains("remove the `scheduler` block"), "{e}");
    }
    let errs = on_ranks(WORLD, |r| {
        let (_, e) = engine(&config(2, 0.01, ""), &r);
        let nan = e.set_lr(f64::NAN).unwrap_err().to_string();
        assert!(
            nan.starts_with("bad argument: set_lr(NaN): a learning rate is a finite number >= 0"),
            "{nan}"
        );
        match e.set_lr(0.001 * (1 + r.rank()) as f64) {
            Err(err @ EngineError::ValuesDiffer(_)) => err.to_string(),
            other => panic!("rank {}: {other:?}", r.rank()),
        }
    });
    for e in errs {
        assert!(
            e.starts_with("ranks passed different values: set_lr got rank 0 0.001, rank 1 0.002: every rank must set the same learning rate"),
            "{e}"
        );
    }
}

#[test]
fn set_lr_on_one_rank_only_is_an_error_on_both_not_a_hang() {
    // `if rank == 0 { engine.set_lr(..) }`: rank 0's exchange meets rank
    // 1's next collective, the first gather of the next forward.
    let errs = on_ranks(WORLD, |r| {
        let (gpt, e) = engine(&config(3, 0.01, ""), &r);
        let x = tokens(0, 0, r.rank(), 1);
        let got = match r.rank() {
            0 => e.set_lr(0.001),
            _ => e.backward(&gpt.loss(&x)),
        };
        got.unwrap_err().to_string()
    });
    assert!(
        errs[0].starts_with("ranks out of step: set_lr(0.001) exchanged the learning rate, and another rank made a different collective call here"),
        "{}",
        errs[0]
    );
    assert!(
        errs[1].starts_with("ranks out of step: this rank announced the gather of unit `wte`"),
        "{}",
        errs[1]
    );
    for e in &errs {
        assert!(
            e.contains("(with_full_params, a checkpoint, set_lr, a forward only some ranks ran): collective mismatch on group `world`")
                && e.contains("rank 0 called all_gather(f64 x 1) but rank 1 called all_gather(i64 x 2)"),
            "{e}"
        );
    }
}
