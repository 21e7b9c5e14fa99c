//! `optimizer.type: "SGD"`: torch.optim.SGD, whose state is a momentum
//! buffer with momentum and nothing at all without. (Its parity with
//! libtorch's SGD at stages 0-3 is in `engine_parity`.) Asserted here:
//! bf16 stages and the NVMe swaps (the optimizer's holding master and
//! buffer, the master alone, or nothing to hold) train to the bits of the
//! in-memory run; a rank holds 4 or 8 bytes per element of its optimizer
//! range less than under AdamW, in memory and in the swap file;
//! checkpoints hold the buffer or no moment, resume to the same bits, and
//! a full load of another optimizer's state, or of SGD's with another
//! momentum, is refused by name. Checkpoint loads restore the RNG, so
//! these run one at a time ([`common::serial`]).

use crate::common;

use common::{config_params, nvme, serial, BF16, SHARD_ALL};
use zrt::zero::Config;

/// The optimizer params of SGD with momentum (without: none past lr and
/// weight decay, torch's default momentum 0).
const MOMENTUM: &str = r#", "momentum": 0.9, "dampening": 0.1"#;

fn sgd(params: &str, stage: u8, extra: &str, zero: &str) -> Config {
    let zero = format!("{SHARD_ALL} {zero}");
    config_params("SGD", params, stage, 1, 0.0, extra, &zero)
}

#[test]
fn bf16_stages_and_the_nvme_swaps_train_to_the_bits_of_memory() {
    let _serial = serial();
    let dir = common::scratch("sgd-swap");
    // Without momentum the bf16 swap holds the master alone, and fp32
    // has nothing to offload.
    for params in ["", MOMENTUM] {
        common::stages_and_swaps_train_alike("SGD", params, &dir);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_holds_one_moment_or_none_in_memory_and_in_the_swap_file() {
    let _serial = serial();
    let dir = common::scratch("sgd-bytes");
    for (params, moments) in [(MOMENTUM, 1), ("", 0)] {
        common::holds_moments("SGD", params, moments, &dir);
    }
    // fp32 without momentum: no swap file at all, and a warning.
    let (aio, off) = nvme(&dir);
    let (.., file, logs) = common::state_held("SGD", "", 3, &aio, &off);
    assert_eq!(file, None);
    assert!(logs.contains("`zero_optimization.offload_optimizer` has nothing to offload: SGD without momentum keeps no optimizer state"), "{logs}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_holds_its_state_resumes_to_the_same_bits_and_is_refused_by_others() {
    let _serial = serial();
    let dir = common::scratch("sgd-ckpt");
    let swap = common::scratch("sgd-ckpt-swap");
    let (aio, off) = nvme(&swap);
    for (tag, params) in [("plain", ""), ("momentum", MOMENTUM)] {
        let at3 = sgd(params, 3, BF16, "");
        // Saved from the swap file and loaded into it.
        let swapped = sgd(params, 3, &format!("{BF16} {aio}"), &off);
        let names = common::resumes_to_the_same_bits(&dir, tag, &swapped, &[&at3, &swapped]);
        assert!(names.iter().any(|n| n.ends_with("/master")), "{names:?}");
        let has_m = names.iter().any(|n| n.ends_with("/m"));
        assert_eq!(has_m, !params.is_empty(), "{names:?}");
        assert!(!names.iter().any(|n| n.ends_with("/v")), "{names:?}");
        let text = zrt::zero::checkpoint::inspect(&dir, Some(tag)).unwrap();
        let momentum = if params.is_empty() { 0.0 } else { 0.9 };
        let said = format!("compute bf16, optimizer SGD (momentum {momentum})\n");
        assert!(text.contains(&said), "{text}");
    }
    // Refused: another optimizer's state (Lion's one moment is not SGD's
    // buffer), or SGD's with another momentum; the parameters still load.
    let refused = [
        ("AdamW", "", "momentum", "its run trained with SGD, whose optimizer state (one moment, m) is not AdamW's (two moments, m and v)", "set `optimizer.type` to \"SGD\""),
        ("Lion", "", "momentum", "its run trained with SGD, whose optimizer state (one moment, m) is not Lion's (one moment, m)", "set `optimizer.type` to \"SGD\""),
        ("SGD", MOMENTUM, "plain", "its run trained with SGD, whose optimizer state (no moment) is not SGD's (one moment, m)", "set `optimizer.params.momentum` to the saved run's 0"),
        ("SGD", "", "momentum", "its run trained with SGD, whose optimizer state (one moment, m) is not SGD's (no moment)", "set `optimizer.params.momentum` to the saved run's 0.9"),
    ];
    for (optimizer, params, tag, what, mend) in refused {
        let cfg = config_params(optimizer, params, 3, 1, 0.0, BF16, SHARD_ALL);
        let wants = [what, "load_checkpoint_module_only", mend];
        common::full_load_refused(&dir, tag, &cfg, &wants);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&swap);
}

#[test]
fn ranks_given_different_momenta_refuse_to_build_naming_it() {
    // One rank would keep a buffer and step with it, the other not: their
    // shards would drift apart with no error anywhere.
    let cfg = |rank| sgd(if rank == 0 { MOMENTUM } else { "" }, 2, "", "");
    let want = "rank 1 differs from rank 0 in optimizer.params.momentum: rank 1 has 0.0, rank 0 has 0.9; optimizer.params.dampening: rank 1 has 0.0, rank 0 has 0.1.";
    common::refused_on_every_rank(cfg, common::gpt_plan, want);
}
