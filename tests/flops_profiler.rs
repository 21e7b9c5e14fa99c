//! DeepSpeed's `flops_profiler`: at the step after `profile_step` steps,
//! the first rank reports the forward's multiply-accumulates, counted as
//! libtorch runs the matrix products, and each unit's. The test GPT's
//! are known exactly, so the report's numbers are checked against them,
//! whatever the stage, the accumulation or the recompute of checkpointed
//! blocks in backward (which must not count). In this binary because
//! checkpointed blocks set the process's RNG state.

use crate::common;

use common::{config_zero, on_ranks, serial, tokens, GPT, MICRO, SHARD_ALL, WORLD};
use zrt::gpt::Gpt;

/// The test GPT's forward multiply-accumulates for one micro-batch:
/// each block's four linears (12 d^2 a token) and its attention (q k^T
/// and weights x v over every pair of positions, causal or not), and the
/// head (d x vocab a token); the embeddings multiply nothing.
fn gpt_macs() -> (u64, u64, u64) {
    let (d, t, v) = (GPT.d_model as u64, GPT.seq as u64, GPT.vocab as u64);
    let tokens = MICRO as u64 * t;
    let block = 12 * d * d * tokens + MICRO as u64 * t * t * 2 * d;
    let head = tokens * d * v;
    (block, head, GPT.layers as u64 * block + head)
}

/// `n` as the report prints it (two decimals and a prefix).
fn si(n: u64) -> String {
    match n {
        n if n >= 1_000_000 => format!("{:.2} M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.2} K", n as f64 / 1e3),
        n => format!("{n}.00 "),
    }
}

/// The report of a 3-step run of the GPT (`checkpointed` blocks) at
/// `stage` with `gas`, the profile at `profile_step`, read from its
/// output file; and whether the file existed after each step.
fn profiled(stage: u8, gas: usize, checkpointed: bool, profile_step: u64) -> (String, Vec<bool>) {
    let dir = common::scratch(&format!("flops-{stage}-{gas}-{checkpointed}"));
    let file = dir.join("flops.txt");
    let block = format!(
        r#""flops_profiler": {{"enabled": true, "profile_step": {profile_step}, "top_modules": 2, "output_file": "{}"}},"#,
        file.display()
    );
    let cfg = config_zero(stage, gas, 1.0, &block, SHARD_ALL);
    let seen = on_ranks(WORLD, |r| {
        let new = match checkpointed {
            true => Gpt::new_checkpointed,
            false => Gpt::new,
        };
        let (vs, plan, gpt) = common::built(&GPT, new);
        let e = common::engine_of(&vs, &plan, &cfg, &r);
        let mut seen = Vec::new();
        for step in 0..3 {
            for k in 0..gas {
                e.backward(&gpt.loss(&tokens(step, k, r.rank(), gas)))
                    .unwrap();
                e.step().unwrap();
            }
            seen.push(file.exists());
        }
        seen
    });
    let text = std::fs::read_to_string(&file).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    (text, seen.into_iter().next().unwrap_or_default())
}

/// The report's line for `key`, its value.
fn value<'a>(text: &'a str, key: &str) -> &'a str {
    (text.lines().find(|l| l.starts_with(key)))
        .map(|l| l[key.len()..].trim())
        .unwrap_or_else(|| panic!("no `{key}` in:\n{text}"))
}

/// The detailed line of unit `name`.
fn unit_line<'a>(text: &'a str, name: &str) -> &'a str {
    (text
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{name} "))))
    .unwrap_or_else(|| panic!("no line for `{name}` in:\n{text}"))
}

#[test]
fn the_profiled_steps_forward_counts_every_matrix_product_once() {
    let _serial = serial();
    let (block, head, total) = gpt_macs();
    for (stage, gas, checkpointed) in [(0, 1, false), (3, 1, false), (3, 2, false), (2, 1, true)] {
        let what = format!("stage {stage}, gas {gas}, checkpointed {checkpointed}");
        let (text, seen) = profiled(stage, gas, checkpointed, 1);
        // Written at the end of step 2, the one after `profile_step` 1.
        assert_eq!(seen, [false, true, true], "{what}");
        assert!(
            value(&text, "flops profiler, step:").starts_with("2 "),
            "{what}:\n{text}"
        );
        let g = gas as u64;
        assert_eq!(
            value(&text, "fwd MACs per rank:"),
            format!("{}MACs", si(g * total)),
            "{what}:\n{text}"
        );
        assert_eq!(
            value(&text, "fwd flops per rank:"),
            si(2 * g * total).trim(),
            "{what}"
        );
        assert_eq!(
            value(&text, "micro-batch per rank x accumulation steps:"),
            format!("{MICRO} x {gas}")
        );
        assert_eq!(value(&text, "world size:"), WORLD.to_string());
        for (unit, macs) in [("h.0", block), ("h.1", block), ("head", head), ("wte", 0)] {
            let line = unit_line(&text, unit);
            assert!(
                line.contains(&format!("MACs {:>12}", format!("{}MACs", si(g * macs)))),
                "{what}: {line}"
            );
            assert!(
                line.ends_with(&format!("over {gas} forward(s)")),
                "{what}: {line}"
            );
        }
        // Nothing multiplied outside the units; the blocks lead.
        let none = format!("MACs {:>12}", "0.00 MACs");
        assert!(
            unit_line(&text, "(outside the units)").contains(&none),
            "{what}:\n{text}"
        );
        assert!(
            value(&text, "top units by MACs:").starts_with("`h.0`"),
            "{what}:\n{text}"
        );
        assert!(
            value(&text, "bwd FLOPS per rank = 2 x fwd flops / bwd latency:").ends_with("FLOPS")
        );
    }
}

#[test]
fn profile_step_0_profiles_the_first_step() {
    let _serial = serial();
    let (text, seen) = profiled(1, 1, false, 0);
    assert_eq!(seen, [true, true, true]);
    assert!(
        value(&text, "flops profiler, step:").starts_with("1 "),
        "{text}"
    );
}
