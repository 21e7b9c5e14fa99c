//! `optimizer.type: "Lion"`: one moment per trained element where Adam
//! keeps two. (Its parity with an unsharded reference at stages 0-3 is in
//! `engine_parity`.) Asserted here: bf16 stages and the NVMe swaps (the
//! optimizer's, holding the master and m or m alone, and the parameters')
//! train to the bits of the in-memory run; a rank holds 4 bytes per
//! element of its optimizer range less than under AdamW, in memory and in
//! the swap file; checkpoints hold no `v`, resume to the same bits, and
//! a full load of the other optimizer's state is refused by name while a
//! module-only load takes the parameters. Checkpoint loads restore the
//! RNG, so these run one at a time ([`common::serial`]).

use crate::common;

use common::{config_of, nvme, on_ranks, serial, train_losses, BF16, SHARD_ALL};
use zrt::zero::Config;

fn lion(stage: u8, extra: &str, zero: &str) -> Config {
    config_of("Lion", stage, 1, 0.0, extra, &format!("{SHARD_ALL} {zero}"))
}

/// A fresh folder under the temp dir for one of this file's tests.
fn scratch(name: &str) -> std::path::PathBuf {
    common::scratch(&format!("lion-{name}"))
}

#[test]
fn bf16_stages_and_the_nvme_swaps_train_to_the_bits_of_memory() {
    let _serial = serial();
    let dir = scratch("swap");
    common::stages_and_swaps_train_alike("Lion", "", &dir);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_holds_one_moment_in_memory_and_in_the_swap_file() {
    let _serial = serial();
    let dir = scratch("bytes");
    let (aio, off) = nvme(&dir);
    for stage in [0u8, 2, 3] {
        let held = |optimizer, extra: &str, zero: &str| {
            common::state_held(optimizer, "", stage, extra, zero)
        };
        let (adam, range, ..) = held("AdamW", "", "");
        let (lion, ..) = held("Lion", "", "");
        assert_eq!(adam - lion, 4 * range, "stage {stage}");
        if stage == 3 {
            // fp32: the swap holds m and v, or m alone.
            let adam = held("AdamW", &aio, &off).2.unwrap();
            let lion = held("Lion", &aio, &off).2.unwrap();
            assert!(lion > 0 && adam == 2 * lion, "{adam} vs {lion}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_holds_one_moment_resumes_to_the_same_bits_and_is_not_adams() {
    let _serial = serial();
    let dir = scratch("ckpt");
    let swap = scratch("ckpt-swap");
    let (aio, off) = nvme(&swap);
    let (at3, adam) = (
        lion(3, BF16, ""),
        config_of("AdamW", 3, 1, 0.0, BF16, SHARD_ALL),
    );
    // The master and m in the swap file: saved from it and loaded into it.
    let swapped = lion(3, &format!("{BF16} {aio}"), &off);
    let straight = on_ranks(common::WORLD, |r| {
        let (vs, plan, gpt) = common::model();
        let e = common::engine_of(&vs, &plan, &swapped, &r);
        train_losses(&gpt, &e, r.rank(), 1);
        e.save_checkpoint(&dir, "lion").unwrap();
        common::next_step(&e, &gpt, r.rank())
    });
    let names = common::saved_names(&dir, "lion");
    assert!(names.iter().any(|n| n.ends_with("/m")), "{names:?}");
    assert!(!names.iter().any(|n| n.ends_with("/v")), "{names:?}");
    let text = zrt::zero::checkpoint::inspect(&dir, Some("lion")).unwrap();
    assert!(
        text.contains("ZeRO stage 3, compute bf16, optimizer Lion"),
        "{text}"
    );
    for cfg in [&at3, &swapped] {
        let resumed = on_ranks(common::WORLD, |r| {
            let (vs, plan, gpt) = common::model();
            let e = common::engine_of(&vs, &plan, cfg, &r);
            e.load_checkpoint(&dir, Some("lion")).unwrap();
            common::next_step(&e, &gpt, r.rank())
        });
        assert_eq!(resumed, straight);
    }
    // An AdamW run refuses Lion's state, and loads its parameters alone.
    on_ranks(common::WORLD, |r| {
        let (vs, plan, _) = common::model();
        let e = common::engine_of(&vs, &plan, &adam, &r);
        let err = e
            .load_checkpoint(&dir, Some("lion"))
            .unwrap_err()
            .to_string();
        for want in [
            "its run trained with Lion, whose optimizer state (one moment, m) is not AdamW's (two moments, m and v)",
            "load_checkpoint_module_only",
            "set `optimizer.type` to \"Lion\"",
        ] {
            assert!(err.contains(want), "{want:?} in {err}");
        }
        e.load_checkpoint_module_only(&dir, Some("lion")).unwrap();
        e.save_checkpoint(&dir, "adam").unwrap();
    });
    // ... and a Lion run refuses AdamW's.
    on_ranks(common::WORLD, |r| {
        let (vs, plan, _) = common::model();
        let e = common::engine_of(&vs, &plan, &at3, &r);
        let err = e
            .load_checkpoint(&dir, Some("adam"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("its run trained with AdamW, whose optimizer state (two moments, m and v) is not Lion's (one moment, m)"), "{err}");
    });
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&swap);
}
