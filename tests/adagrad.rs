//! `optimizer.type: "Adagrad"`: torch.optim.Adagrad, whose state is one
//! sum of squared gradients. (Its parity with libtorch's operations at
//! stages 0-3 is in `engine_parity`.) Asserted here: bf16 stages and the
//! NVMe swaps train to the bits of the in-memory run, the sums starting at
//! an `initial_accumulator_value`; a rank holds 4 bytes per element of its
//! optimizer range less than under AdamW, in memory and in the swap file;
//! checkpoints hold the sum, resume to the same bits (`lr_decay` goes on
//! from the saved step), a module-only load starts the sums at their
//! initial value again, and a full load of another optimizer's one-moment
//! state is refused by name; ranks given different `lr_decay` refuse to
//! build. Checkpoint loads restore the RNG, so these
//! run one at a time ([`common::serial`]).

use crate::common;

use common::{config_params, nvme, serial, BF16, SHARD_ALL};
use zrt::zero::Config;

/// A rate that decays by step, which a resumed run must go on with.
const DECAY: &str = r#", "lr_decay": 0.5"#;

/// [`DECAY`], and sums that start above 0 (in memory and in the swap).
const SETTINGS: &str = r#", "lr_decay": 0.5, "initial_accumulator_value": 0.1"#;

fn adagrad(stage: u8, extra: &str, zero: &str) -> Config {
    let zero = format!("{SHARD_ALL} {zero}");
    config_params("Adagrad", SETTINGS, stage, 1, 0.0, extra, &zero)
}

#[test]
fn bf16_stages_and_the_nvme_swaps_train_to_the_bits_of_memory() {
    let _serial = serial();
    let dir = common::scratch("adagrad-swap");
    common::stages_and_swaps_train_alike("Adagrad", SETTINGS, &dir);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_holds_one_sum_in_memory_and_in_the_swap_file() {
    let _serial = serial();
    let dir = common::scratch("adagrad-bytes");
    common::holds_moments("Adagrad", "", 1, &dir);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_holds_the_sum_resumes_to_the_same_bits_and_is_refused_by_others() {
    let _serial = serial();
    let dir = common::scratch("adagrad-ckpt");
    let swap = common::scratch("adagrad-ckpt-swap");
    let (aio, off) = nvme(&swap);
    let at3 = adagrad(3, BF16, "");
    // Saved from the swap file and loaded into it.
    let swapped = adagrad(3, &format!("{BF16} {aio}"), &off);
    let names = common::resumes_to_the_same_bits(&dir, "adagrad", &swapped, &[&at3, &swapped]);
    assert!(names.iter().any(|n| n.ends_with("/m")), "{names:?}");
    assert!(!names.iter().any(|n| n.ends_with("/v")), "{names:?}");
    let text = zrt::zero::checkpoint::inspect(&dir, Some("adagrad")).unwrap();
    assert!(text.contains("compute bf16, optimizer Adagrad\n"), "{text}");
    // Lion's m and SGD's buffer are one moment each too, but not a sum of
    // squares: refused, the parameters still load.
    for (optimizer, params) in [("Lion", ""), ("SGD", r#", "momentum": 0.9"#)] {
        let cfg = config_params(optimizer, params, 3, 1, 0.0, BF16, SHARD_ALL);
        let what = format!("its run trained with Adagrad, whose optimizer state (one moment, m) is not {optimizer}'s (one moment, m)");
        let mend = "set `optimizer.type` to \"Adagrad\"";
        let wants = [&what[..], "load_checkpoint_module_only", mend];
        common::full_load_refused(&dir, "adagrad", &cfg, &wants);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&swap);
}

#[test]
fn a_module_only_load_starts_the_sums_at_their_initial_value() {
    // Its parameters loaded into a fresh engine train as the same
    // parameters put into the model before the engine: both sums start at
    // 0.1, not at the saved sums nor at 0.
    let _serial = serial();
    let dir = common::scratch("adagrad-module-only");
    let cfg = adagrad(2, "", "");
    let saved = common::on_ranks(common::WORLD, |r| {
        let (vs, plan, gpt) = common::model();
        let e = common::engine_of(&vs, &plan, &cfg, &r);
        common::train_losses(&gpt, &e, r.rank(), 2);
        e.save_checkpoint(&dir, "pre").unwrap();
        e.gathered_params().unwrap()
    })
    .remove(0);
    let loaded = common::on_ranks(common::WORLD, |r| {
        let (vs, plan, gpt) = common::model();
        let e = common::engine_of(&vs, &plan, &cfg, &r);
        e.load_checkpoint_module_only(&dir, None).unwrap();
        common::next_step(&e, &gpt, r.rank())
    });
    let built = common::on_ranks(common::WORLD, |r| {
        let (vs, plan, gpt) = common::model();
        common::put_params(&vs, &saved);
        let e = common::engine_of(&vs, &plan, &cfg, &r);
        common::next_step(&e, &gpt, r.rank())
    });
    assert_eq!(loaded, built);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ranks_given_different_rate_decays_refuse_to_build_naming_it() {
    let cfg = |rank| {
        let params = if rank == 0 { DECAY } else { "" };
        config_params("Adagrad", params, 2, 1, 0.0, "", SHARD_ALL)
    };
    let want =
        "rank 1 differs from rank 0 in optimizer.params.lr_decay: rank 1 has 0.0, rank 0 has 0.5.";
    common::refused_on_every_rank(cfg, common::gpt_plan, want);
}
