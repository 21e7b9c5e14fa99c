//! `optimizer.type: "Lamb"`: Adam's moments, each parameter's step scaled
//! by its trust ratio, whose norms the engine sums over the shards that
//! cut the parameter. (Its parity with an unsharded reference at stages
//! 0-3 is in `engine_parity`.) Asserted here: a run repeats itself to the
//! bit; stages agree within rounding (a parameter a shard cuts has its
//! squares added in another order, in f64, which the step's rounding to
//! f32 hides nearly always: this model's stages agree to the bit, which
//! is not promised); checkpoints resume to the bits of the straight run and load
//! AdamW's state (the same moments) but not Lion's; the NVMe swaps train as
//! memory does, within rounding (their chunks cut the parameters' sums). Checkpoint loads restore the RNG, so these run one at
//! a time ([`common::serial`]).

use crate::common;

use common::{
    config_of, nvme, nvme_params, on_ranks, serial, train_losses, train_world, BF16, SHARD_ALL,
};
use zrt::zero::Config;

fn lamb(stage: u8, extra: &str, zero: &str) -> Config {
    config_of("Lamb", stage, 1, 0.0, extra, &format!("{SHARD_ALL} {zero}"))
}

#[test]
fn a_run_repeats_to_the_bit_and_stages_agree_within_rounding() {
    let _serial = serial();
    let steps = 4;
    let zero = train_world(&lamb(0, BF16, ""), &[], steps);
    for stage in 1..=3u8 {
        let run = train_world(&lamb(stage, BF16, ""), &[], steps);
        assert_eq!(
            run,
            train_world(&lamb(stage, BF16, ""), &[], steps),
            "stage {stage}"
        );
        for ((name, a), (_, b)) in run.1.iter().zip(&zero.1) {
            let mut closest = common::Closest::default();
            for (x, y) in a.iter().zip(b) {
                // bf16 parameters: a rounding apart at most.
                assert!(
                    closest.see((x - y).abs() as f64, 1e-2 * y.abs().max(0.1) as f64),
                    "stage {stage} {name}: {x} vs {y}"
                );
            }
            closest.record(&format!("LAMB bf16 stage {stage} against stage 0: {name}"));
        }
    }
}

#[test]
fn hybrid_sharding_sums_the_norms_over_the_shard_group() {
    // Four ranks in MiCS pairs, replicas on the same data: the two-rank
    // run's training, the norms summed inside each pair only.
    let _serial = serial();
    let pairs = lamb(3, BF16, r#""mics_shard_size": 2,"#);
    let hybrid = common::train_grouped(4, &pairs, 3);
    let two = train_world(&lamb(3, BF16, ""), &[], 3);
    assert_eq!(hybrid.0, two.0);
    assert_eq!(hybrid.1, two.1);
}

#[test]
fn a_checkpoint_resumes_to_the_same_bits_and_takes_adamws_moments_not_lions() {
    let _serial = serial();
    let dir = common::scratch("lamb-ckpt");
    let at3 = lamb(3, BF16, "");
    // Saved from the swaps (read out of them) and loaded into them.
    let swap = common::scratch("lamb-ckpt-swap");
    let (aio, off) = nvme(&swap);
    let both = format!("{off} {}", nvme_params(&swap));
    let swapped = lamb(3, &format!("{BF16} {aio}"), &both);
    for cfg in [&at3, &swapped] {
        let straight = on_ranks(common::WORLD, |r| {
            let (vs, plan, gpt) = common::model();
            let e = common::engine_of(&vs, &plan, cfg, &r);
            train_losses(&gpt, &e, r.rank(), 2);
            e.save_checkpoint(&dir, "lamb").unwrap();
            common::next_step(&e, &gpt, r.rank())
        });
        let names = common::saved_names(&dir, "lamb");
        assert!(names.iter().any(|n| n.ends_with("/v")), "{names:?}");
        let resumed = on_ranks(common::WORLD, |r| {
            let (vs, plan, gpt) = common::model();
            let e = common::engine_of(&vs, &plan, cfg, &r);
            e.load_checkpoint(&dir, Some("lamb")).unwrap();
            common::next_step(&e, &gpt, r.rank())
        });
        assert_eq!(resumed, straight);
    }
    let _ = std::fs::remove_dir_all(&swap);
    // AdamW's m and v are LAMB's: a full load; Lion's m is not.
    for (optimizer, loads) in [("AdamW", true), ("Lion", false)] {
        on_ranks(common::WORLD, |r| {
            let (vs, plan, gpt) = common::model();
            let cfg = config_of(optimizer, 3, 1, 0.0, BF16, SHARD_ALL);
            let e = common::engine_of(&vs, &plan, &cfg, &r);
            train_losses(&gpt, &e, r.rank(), 1);
            e.save_checkpoint(&dir, optimizer).unwrap();
        });
        on_ranks(common::WORLD, |r| {
            let (vs, plan, _) = common::model();
            let e = common::engine_of(&vs, &plan, &at3, &r);
            match e.load_checkpoint(&dir, Some(optimizer)) {
                Ok(_) => assert!(loads, "{optimizer}"),
                Err(err) => {
                    let err = err.to_string();
                    let want = "its run trained with Lion, whose optimizer state (one moment, m) is not Lamb's (two moments, m and v)";
                    assert!(!loads && err.contains(want), "{err}");
                }
            }
        });
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_nvme_swaps_train_as_memory_does_within_rounding() {
    // The swaps stream each pass through 1024-element chunks, which cut
    // the parameters: their sums add chunk by chunk. fp32 shows a pass
    // that drops or repeats a chunk's part; bf16 puts the master in the
    // swap too.
    let _serial = serial();
    let steps = 4;
    let dir = common::scratch("lamb-swap");
    let (aio, off) = nvme(&dir);
    let params = nvme_params(&dir);
    let both = format!("{off} {params}");
    for (extra, stage, zero, close) in [
        ("", 2, &off, 1e-5),
        ("", 3, &both, 1e-5),
        ("", 3, &params, 1e-5),
        (BF16, 1, &off, 1e-2),
        (BF16, 3, &both, 1e-2),
    ] {
        let memory = train_world(&lamb(stage, extra, ""), &[], steps);
        let run = train_world(&lamb(stage, &format!("{extra} {aio}"), zero), &[], steps);
        let what = format!("{extra} stage {stage} {zero}");
        // The swap files' folder left out of the margins' names.
        let offloaded = match (
            zero.contains("offload_optimizer"),
            zero.contains("offload_param"),
        ) {
            (true, true) => "optimizer and parameters",
            (true, false) => "optimizer",
            _ => "parameters",
        };
        for (x, y) in run.0.iter().zip(&memory.0) {
            assert!((x - y).abs() <= 1e-5 * y.abs(), "{what}: loss {x} vs {y}");
        }
        for ((name, a), (_, b)) in run.1.iter().zip(&memory.1) {
            let mut closest = common::Closest::default();
            for (x, y) in a.iter().zip(b) {
                assert!(
                    closest.see((x - y).abs() as f64, (close * y.abs().max(0.1)) as f64),
                    "{what} {name}: {x} vs {y}"
                );
            }
            closest.record(&format!(
                "LAMB's {offloaded} offloaded against in memory: {extra} stage {stage} {name}"
            ));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
