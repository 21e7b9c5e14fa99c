//! `optimizer.type: "RMSprop"`: torch.optim.RMSprop, whose state is the
//! square average of the gradient and, with momentum, a momentum buffer,
//! or, centered, the gradient's average. (Its parity with libtorch's
//! operations at stages 0-3 is in `engine_parity`.) Asserted here: bf16
//! stages and the NVMe swaps train to the bits of the in-memory run, plain,
//! with momentum and centered; a rank holds AdamW's bytes with either
//! and 4 bytes per element of its optimizer range less with neither, in
//! memory and in the swap file; checkpoints hold the square average (m)
//! and the second array (v), resume to the same bits, and a full load by
//! another optimizer or by RMSprop with another momentum or centering is
//! refused by name; ranks given different `alpha` refuse to build. Checkpoint loads restore the RNG, so these run one at
//! a time ([`common::serial`]).

use crate::common;

use common::{config_params, nvme, serial, BF16, SHARD_ALL};
use zrt::zero::Config;

/// RMSprop with a momentum buffer and another alpha (without: torch's
/// defaults past lr and weight decay, alpha 0.99, no momentum).
const MOMENTUM: &str = r#", "alpha": 0.9, "momentum": 0.9"#;

/// Centered RMSprop: its `v` is the gradient's average.
const CENTERED: &str = r#", "centered": true"#;

fn rmsprop(params: &str, stage: u8, extra: &str, zero: &str) -> Config {
    let zero = format!("{SHARD_ALL} {zero}");
    config_params("RMSprop", params, stage, 1, 0.0, extra, &zero)
}

#[test]
fn bf16_stages_and_the_nvme_swaps_train_to_the_bits_of_memory() {
    let _serial = serial();
    let dir = common::scratch("rmsprop-swap");
    for params in ["", MOMENTUM, CENTERED] {
        common::stages_and_swaps_train_alike("RMSprop", params, &dir);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_holds_one_or_two_moments_in_memory_and_in_the_swap_file() {
    let _serial = serial();
    let dir = common::scratch("rmsprop-bytes");
    for (params, moments) in [("", 1), (MOMENTUM, 2), (CENTERED, 2)] {
        common::holds_moments("RMSprop", params, moments, &dir);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_holds_its_state_resumes_to_the_same_bits_and_is_refused_by_others() {
    let _serial = serial();
    let dir = common::scratch("rmsprop-ckpt");
    let swap = common::scratch("rmsprop-ckpt-swap");
    let (aio, off) = nvme(&swap);
    for (tag, params) in [
        ("plain", ""),
        ("momentum", MOMENTUM),
        ("centered", CENTERED),
    ] {
        let at3 = rmsprop(params, 3, BF16, "");
        // Saved from the swap file and loaded into it.
        let swapped = rmsprop(params, 3, &format!("{BF16} {aio}"), &off);
        let names = common::resumes_to_the_same_bits(&dir, tag, &swapped, &[&at3, &swapped]);
        assert!(names.iter().any(|n| n.ends_with("/m")), "{names:?}");
        let has_v = names.iter().any(|n| n.ends_with("/v"));
        assert_eq!(has_v, !params.is_empty(), "{names:?}");
        let text = zrt::zero::checkpoint::inspect(&dir, Some(tag)).unwrap();
        let said = match tag {
            "plain" => "(momentum 0)",
            "momentum" => "(momentum 0.9)",
            _ => "(momentum 0, centered)",
        };
        let said = format!("compute bf16, optimizer RMSprop {said}\n");
        assert!(text.contains(&said), "{text}");
    }
    // Refused: another optimizer's state (AdamW's m and v are not the
    // square average and the buffer; Adagrad's one moment is a sum), or
    // RMSprop's with another momentum; the parameters still load.
    let other = "set `optimizer.type` to \"RMSprop\"";
    let refused = [
        ("AdamW", "", "momentum", "its run trained with RMSprop, whose optimizer state (two moments, m and v) is not AdamW's (two moments, m and v)", other),
        ("Adagrad", "", "plain", "its run trained with RMSprop, whose optimizer state (one moment, m) is not Adagrad's (one moment, m)", other),
        ("RMSprop", MOMENTUM, "plain", "its run trained with RMSprop, whose optimizer state (one moment, m) is not RMSprop's (two moments, m and v: the square average and the momentum buffer)", "set `optimizer.params.momentum` to the saved run's 0"),
        ("RMSprop", "", "momentum", "its run trained with RMSprop, whose optimizer state (two moments, m and v: the square average and the momentum buffer) is not RMSprop's (one moment, m)", "set `optimizer.params.momentum` to the saved run's 0.9"),
        // As many moments, not the same: the buffer is not the average.
        ("RMSprop", MOMENTUM, "centered", "its run trained with RMSprop, whose optimizer state (two moments, m and v: the square average and the gradient's average) is not RMSprop's (two moments, m and v: the square average and the momentum buffer)", "set `optimizer.params.centered` to the saved run's true"),
        ("RMSprop", CENTERED, "momentum", "its run trained with RMSprop, whose optimizer state (two moments, m and v: the square average and the momentum buffer) is not RMSprop's (two moments, m and v: the square average and the gradient's average)", "set `optimizer.params.centered` to the saved run's false"),
        ("RMSprop", "", "centered", "its run trained with RMSprop, whose optimizer state (two moments, m and v: the square average and the gradient's average) is not RMSprop's (one moment, m)", "set `optimizer.params.centered` to the saved run's true"),
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
fn ranks_given_different_alphas_refuse_to_build_naming_it() {
    // Their square averages would drift apart with no error anywhere.
    let cfg = |rank| {
        let params = if rank == 0 { r#", "alpha": 0.9"# } else { "" };
        rmsprop(params, 2, "", "")
    };
    let want =
        "rank 1 differs from rank 0 in optimizer.params.alpha: rank 1 has 0.99, rank 0 has 0.9.";
    common::refused_on_every_rank(cfg, common::gpt_plan, want);
}
