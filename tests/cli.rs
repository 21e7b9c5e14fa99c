//! The `zrt` CLI end to end: its config and estimate commands, its log
//! output, and `bench train`'s bucket-size axis.

use std::process::Command;

use crate::common;

fn zrt(args: &[&str]) -> (bool, String) {
    common::zrt_cli(args)
}

/// A DeepSpeed config holding `json`, in a file of the test's own
/// (`zrt-cli-NAME-PID.json` in the temp directory); the test removes it.
fn config_file(name: &str, json: &str) -> String {
    let f = std::env::temp_dir().join(format!("zrt-cli-{name}-{}.json", std::process::id()));
    std::fs::write(&f, json).unwrap();
    f.to_string_lossy().into_owned()
}

/// A Hugging Face `config.json` holding `json`, as `dir/NAME.json`.
fn hf_config(dir: &std::path::Path, name: &str, json: &str) -> String {
    let f = dir.join(format!("{name}.json"));
    std::fs::write(&f, json).unwrap();
    f.to_string_lossy().into_owned()
}

/// Runs `zrt estimate --hf-config CONFIG ARGS...` and checks that it
/// succeeds and prints each of `said`.
fn estimate_says(config: &str, args: &[&str], said: &[&str]) {
    let (ok, out) = zrt(&[&["estimate", "--hf-config", config][..], args].concat());
    assert!(ok, "{out}");
    for s in said {
        assert!(out.contains(s), "{s}: {out}");
    }
}

#[test]
fn the_fine_tuning_examples_config_resolves_its_auto_values_from_the_hidden_size() {
    // Hugging Face's "auto": the example passes the model's width, as
    // `--hidden` does here; without it each "auto" is named.
    let f = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/ds_finetune.json");
    let (ok, out) = zrt(&["config", "check", f, "--hidden", "896", "--world", "4"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("buckets          reduce 802816 (elements)")
            && out.contains("prefetch 722534 persistence < 8960"),
        "{out}"
    );
    let (ok, out) = zrt(&["config", "check", f, "--world", "4"]);
    assert!(
        !ok && out.contains("\"auto\" but the program gave no hidden size"),
        "{out}"
    );
}

#[test]
fn config_check_prints_a_shared_fixture_resolved() {
    let f = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../shared/ds-configs/tests_model_BingBertSquad_deepspeed_bsz24_fp16_zero2_config.json"
    );
    let (ok, out) = zrt(&["config", "check", f, "--world", "2"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("batch            train 24 = micro 3 x gas 4 x world 2"),
        "{out}"
    );
    assert!(out.contains("zero stage       2"), "{out}");
    assert!(
        out.contains("fp16 compute, fp32 master, loss scale dynamic (initial 2^16"),
        "{out}"
    );
    assert!(
        out.contains("reductions       reduce-scatter of every micro-step's gradients during backward, 4 a step"),
        "{out}"
    );
}

#[test]
fn config_check_resolves_an_elastic_batch_for_the_world_and_lists_the_worlds() {
    let f = config_file(
        "elastic",
        r#"{"elasticity": {"enabled": true, "max_train_batch_size": 100, "micro_batch_sizes": [4], "max_gpus": 8}}"#,
    );
    let (ok, out) = zrt(&["config", "check", &f, "--world", "3"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("batch            train 96 = micro 4 x gas 8 x world 3"),
        "{out}"
    );
    assert!(
        out.contains("elasticity       the same global batch on worlds [1, 2, 3, 4, 6, 8]"),
        "{out}"
    );
    let (ok, out) = zrt(&["config", "check", &f, "--world", "5"]);
    let _ = std::fs::remove_file(&f);
    assert!(
        !ok && out.contains("which a world of 5 rank(s) cannot split"),
        "{out}"
    );
}

#[test]
fn config_check_says_when_each_stage_reduces_under_accumulation() {
    // Stage 0 all-reduces every micro-step, where DeepSpeed's waits for
    // the boundary: said, with the stage that does as DeepSpeed's.
    let cases = [
        (0, 4, "all-reduce of every micro-step's gradients during backward, 4 a step (DeepSpeed's stage 0 reduces once, at the boundary, as zrt's stage 1 does)"),
        (0, 1, "all-reduce of the gradients during backward, once a step"),
        (1, 4, "reduce-scatter of the 4 micro-steps' local sums during the last one's backward, once a step"),
        (1, 1, "reduce-scatter of the gradients during backward, once a step"),
        (3, 2, "reduce-scatter of every micro-step's gradients during backward, 2 a step"),
    ];
    for (stage, gas, want) in cases {
        let json = format!(
            r#"{{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": {gas}, "zero_optimization": {{"stage": {stage}}}}}"#
        );
        let f = config_file(&format!("reductions-{stage}-{gas}"), &json);
        let (ok, out) = zrt(&["config", "check", &f, "--world", "2"]);
        std::fs::remove_file(&f).unwrap();
        assert!(ok, "{out}");
        assert!(
            out.contains(&format!("reductions       {want}\n")),
            "stage {stage} gas {gas}: {out}"
        );
    }
}

#[test]
fn config_check_shows_each_warning_once_with_the_report_or_the_problems() {
    // A fixture with six warnings (the bf16 loss-scale keys, and
    // contiguous_gradients false), as the report's own lines, not also
    // as log lines.
    let f = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../shared/ds-configs/tests_torch_compile_ds_config_z3.json"
    );
    let (ok, out) = zrt(&["config", "check", f, "--world", "2"]);
    assert!(ok, "{out}");
    assert_eq!(
        out.matches("`bf16.hysteresis` has no effect").count(),
        1,
        "{out}"
    );
    assert_eq!(out.matches("  warning: ").count(), 6, "{out}");
    assert!(!out.contains("WARN"), "{out}");
    // A config that fails still shows what it would have warned about.
    let bad = config_file(
        "warned",
        r#"{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": true, "loss_scale": 0}}"#,
    );
    let (ok, out) = zrt(&["config", "check", &bad, "--world", "2"]);
    assert!(!ok);
    assert!(
        out.contains("1 problem(s) in the DeepSpeed config"),
        "{out}"
    );
    assert!(
        out.contains("\n  warning: `bf16.loss_scale` has no effect: bf16 needs no loss scaling"),
        "{out}"
    );
    assert!(!out.contains("WARN"), "{out}");
    let _ = std::fs::remove_file(&bad);
}

#[test]
fn config_check_lists_every_problem_and_fails() {
    let f = config_file(
        "bad",
        r#"{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stag": 3}}"#,
    );
    let (ok, out) = zrt(&["config", "check", &f, "--world", "2"]);
    assert!(!ok);
    assert!(
        out.contains("2 problem(s) in the DeepSpeed config"),
        "{out}"
    );
    assert!(
        out.contains(
            "unknown key `zero_optimization.stag`; did you mean `zero_optimization.stage`?"
        ),
        "{out}"
    );
    assert!(
        out.contains(
            "train_batch_size 10 is not divisible by train_micro_batch_size_per_gpu 4 x world 2"
        ),
        "{out}"
    );
    // No "auto" is owed, so no flag for one is suggested.
    assert!(!out.contains("as flags"), "{out}");
    let _ = std::fs::remove_file(f);
}

#[test]
fn config_check_fills_a_hugging_face_config_from_its_flags() {
    let f = config_file(
        "hf",
        r#"{"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
            "zero_optimization": {"stage": 3}, "gradient_clipping": "auto",
            "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}"#,
    );
    let f = f.as_str();
    let (ok, out) = zrt(&[
        "config",
        "check",
        f,
        "--world",
        "2",
        "--micro",
        "4",
        "--lr",
        "3e-4",
        "--weight-decay",
        "0.1",
        "--betas",
        "0.9,0.95",
        "--eps",
        "1e-6",
        "--clip",
        "1",
        "--warmup-steps",
        "20",
        "--bf16",
    ]);
    assert!(ok, "{out}");
    for want in [
        "AdamW lr 0.0003 betas (0.9, 0.95) eps 0.000001 weight_decay 0.1",
        "WarmupLR { warmup_min_lr: 0.0, warmup_max_lr: 0.0003, warmup_num_steps: 20,",
        "precision        bf16 compute",
        "clipping         global norm 1",
    ] {
        assert!(out.contains(want), "{want}: {out}");
    }
    // Without the flags each value owed is named.
    let (ok, out) = zrt(&["config", "check", f, "--micro", "4", "--lr", "3e-4"]);
    assert!(!ok);
    for key in [
        "weight_decay",
        "betas",
        "eps",
        "warmup_num_steps",
        "gradient_clipping",
    ] {
        assert!(
            out.contains(&format!("{key}` is \"auto\" but the program gave no")),
            "{key}: {out}"
        );
    }
    assert!(
        out.contains("takes the program's values as flags: --weight-decay WD, --betas B1,B2, --eps EPS, --clip C, --warmup-steps N (see"),
        "{out}"
    );
    let (ok, out) = zrt(&["config", "check", f, "--betas", "0.9"]);
    assert!(!ok);
    assert!(
        out.contains("expected BETA1,BETA2 (e.g. 0.9,0.999), got `0.9`"),
        "{out}"
    );
    let _ = std::fs::remove_file(f);
}

#[test]
fn config_check_takes_the_micro_batch_of_a_config_with_no_batch_keys_from_its_flag() {
    let f = config_file("nobatch", r#"{"zero_optimization": {"stage": 3}}"#);
    let (ok, out) = zrt(&["config", "check", &f, "--world", "2"]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("or have the program pass its micro-batch in `AutoHints::micro_batch`")
            && out.contains("takes the program's values as flags: --micro M (see"),
        "{out}"
    );
    let (ok, out) = zrt(&["config", "check", &f, "--world", "2", "--micro", "3"]);
    assert!(ok, "{out}");
    assert!(out.contains("train 6 = micro 3 x gas 1 x world 2"), "{out}");
    let _ = std::fs::remove_file(f);
}

#[test]
fn config_check_names_the_folders_the_monitors_write_into_and_what_the_comms_logger_logs() {
    let f = config_file(
        "monitors",
        r#"{"train_batch_size": 8, "csv_monitor": {"enabled": true, "output_path": "out", "job_name": "a"},
            "tensorboard": {"enabled": true},
            "comms_logger": {"enabled": true, "verbose": true, "prof_all": false, "prof_ops": ["all_gather_into_tensor"]}}"#,
    );
    let (ok, out) = zrt(&["config", "check", &f, "--world", "2"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("\n  comms logger     all_gather, each as it completes\n"),
        "{out}"
    );
    assert!(
        out.contains(
            "\n  monitors         csv_monitor into out/a, tensorboard into DeepSpeedJobName\n"
        ),
        "{out}"
    );
    let _ = std::fs::remove_file(f);
    let f = config_file("no-monitors", r#"{"train_batch_size": 8}"#);
    let (ok, out) = zrt(&["config", "check", &f, "--world", "2"]);
    assert!(
        ok && out.contains("\n  monitors         none\n  comms logger     none\n"),
        "{out}"
    );
    let _ = std::fs::remove_file(f);
}

#[test]
fn config_check_fills_stage_3_sizes_steps_and_fp16_from_its_flags() {
    let f = config_file(
        "z3",
        r#"{"fp16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": "auto"}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}}"#,
    );
    let f = f.as_str();
    let (ok, out) = zrt(&[
        "config",
        "check",
        f,
        "--world",
        "2",
        "--hidden",
        "512",
        "--total-steps",
        "1000",
        "--fp16",
    ]);
    assert!(ok, "{out}");
    // DeepSpeed's "auto": hidden^2, 0.9 hidden^2 and 10 hidden.
    for want in [
        "buckets          reduce 262144 (elements); overlap_comm true",
        "stage 3          prefetch 235929 persistence < 5120 max_live 1000000000",
        "warmup_num_steps: 10, warmup_type: \"log\", total_num_steps: 1000 }",
        "precision        fp16 compute",
    ] {
        assert!(out.contains(want), "{want}: {out}");
    }
    // Without them, each is owed, and the flag that gives it is named.
    let (ok, out) = zrt(&["config", "check", f, "--world", "2"]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("4 problem(s)")
            && out.contains("`zero_optimization.reduce_bucket_size` is \"auto\" but the program gave no hidden size")
            && out.contains("`scheduler.params.total_num_steps` is \"auto\" but the program gave no total steps")
            && out.contains("\n`zrt config check` takes the program's values as flags: --hidden H, --total-steps N (see `zrt config check --help`)"),
        "{out}"
    );
    let _ = std::fs::remove_file(f);
}

#[test]
fn estimate_prints_the_design_formula() {
    let (ok, out) = zrt(&["estimate", "--params", "1073741824", "--world", "4"]);
    assert!(ok, "{out}");
    // 2^30 params, bf16 on 4 ranks: zrt holds fp32 gradients, 18 GiB at
    // stage 0, 6 + 12/4 at stage 1, 2 + 16/4 at stage 2 and 18/4 at stage
    // 3; DESIGN.md's table (16-bit gradients) says 16, 4 + 12/4, 2 + 14/4
    // and 16/4.
    assert!(
        out.contains("stage 0:      18.00 GiB       16.00 GiB")
            && out.contains("stage 1:       9.00 GiB        7.00 GiB")
            && out.contains("stage 2:       6.00 GiB        5.50 GiB")
            && out.contains("stage 3:       4.50 GiB        4.00 GiB")
            && out.contains("accumulates gradients in fp32"),
        "{out}"
    );
    // Building: every weight in fp32, 4 GiB, less than stage 3's 4.5 on
    // 4 ranks: no remark.
    assert!(
        out.contains("building the model: 4.00 GiB on every rank (its weights in fp32")
            && !out.contains("more than stage 3 holds"),
        "{out}"
    );
    // On 8 ranks stage 3 holds 2.25 GiB: building is the peak.
    let (ok, out) = zrt(&["estimate", "--params", "1073741824", "--world", "8"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("building the model: 4.00 GiB on every rank")
            && out.contains("ShardPlan::weights_on_first_rank_only (the other ranks hold one block), or on no rank under ShardPlan::weights_from_file (each loads its shard of a file) or weights_on_disk_while_built (rank 0 writes it to disk as it is made); more than stage 3 holds"),
        "{out}"
    );
    // The main job's 4.9M-parameter GPT on 2 ranks in fp32: the stages
    // differ (they all printed 0.04 GiB before).
    let (ok, out) = zrt(&[
        "estimate", "--params", "4.9e6", "--world", "2", "--dtype", "fp32",
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("stage 0:      74.77 MiB") && out.contains("stage 3:      37.38 MiB"),
        "{out}"
    );
    // A LoRA model: 1 GiB-worth of bf16 frozen base (2^29 parameters)
    // beside 2^20 trainable ones on 2 ranks; at stage 3 the base's shard
    // is 512 MiB in bf16, 256.5 MiB packed, beside 9 MiB of trainable
    // state.
    for (packed, stage3) in [(false, "521.00 MiB"), (true, "265.50 MiB")] {
        let mut args = vec![
            "estimate",
            "--params",
            "1048576",
            "--world",
            "2",
            "--frozen",
            "536870912",
        ];
        if packed {
            args.push("--quantize-frozen");
        }
        let (ok, out) = zrt(&args);
        assert!(ok, "{out}");
        assert!(
            out.contains(&format!("stage 3: {stage3:>14}")) && out.contains("stage 2:"),
            "{out}"
        );
        // Below stage 3 the base is whole on every rank: 1 GiB more.
        assert!(out.contains("stage 0:       1.02 GiB"), "{out}");
    }
    let (ok, out) = zrt(&["estimate", "--params", "1e9", "--world", "2", "--frozen=-1"]);
    assert!(!ok && out.contains("--frozen must be a count"), "{out}");
    // 2^30 parameters on 4 ranks, as `how` ([flag, value]) says.
    let on_1gib = |how: [&str; 2]| {
        zrt(&[
            "estimate",
            "--params",
            "1073741824",
            "--world",
            "4",
            how[0],
            how[1],
        ])
    };
    // Lion keeps one moment: 4 bytes per parameter less, 14 GiB at stage
    // 0 (12 in the table), 5 at stage 2 and 14/4 at stage 3; asked for,
    // or from a DeepSpeed config (bf16, Lion, stage 2: its row marked).
    let f = config_file(
        "estimate",
        r#"{"train_batch_size": 8, "bf16": {"enabled": true}, "optimizer": {"type": "Lion"}, "zero_optimization": {"stage": 2}}"#,
    );
    for (how, mark) in [
        (["--optimizer", "Lion"], ""),
        (["--config", f.as_str()], "  <- the config's stage"),
    ] {
        let (ok, out) = on_1gib(how);
        assert!(
            ok && out.contains("bf16 compute, Lion:")
                && out.contains("stage 0:      14.00 GiB       12.00 GiB\n")
                && out.contains(&format!("stage 2:       5.00 GiB        4.50 GiB{mark}\n"))
                && out.contains("stage 3:       3.50 GiB        3.00 GiB\n"),
            "{how:?}: {out}"
        );
    }
    let (ok, out) = zrt(&[
        "estimate",
        "--params=1e9",
        "--world=2",
        "--config",
        &f,
        "--dtype=fp32",
    ]);
    let _ = std::fs::remove_file(&f);
    assert!(!ok && out.contains("cannot be used with"), "{out}");
    // SGD without momentum keeps no moment: 8 bytes per parameter less
    // than Adam (the master, the parameters and the gradients are left);
    // with momentum, Lion's.
    let f = config_file(
        "estimate-sgd",
        r#"{"train_batch_size": 8, "bf16": {"enabled": true}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}"#,
    );
    for how in [["--optimizer", "sgd"], ["--config", f.as_str()]] {
        let (ok, out) = on_1gib(how);
        assert!(
            ok && out.contains("bf16 compute, SGD without momentum:")
                && out.contains("stage 0:      10.00 GiB        8.00 GiB")
                && out.contains("stage 3:       2.50 GiB        2.00 GiB\n"),
            "{how:?}: {out}"
        );
    }
    let _ = std::fs::remove_file(&f);
    // SGD's momentum buffer, Adagrad's sum and RMSprop's square average:
    // one moment, as Lion's; RMSprop with momentum two, as Adam.
    for (optimizer, said) in [
        ("sgd-momentum", "SGD with momentum"),
        ("adagrad", "Adagrad"),
        ("rmsprop", "RMSprop without momentum"),
    ] {
        let (ok, out) = on_1gib(["--optimizer", optimizer]);
        assert!(
            ok && out.contains(&format!("bf16 compute, {said}:"))
                && out.contains("stage 0:      14.00 GiB"),
            "{out}"
        );
    }
    let f = config_file(
        "estimate-rmsprop",
        r#"{"train_batch_size": 8, "bf16": {"enabled": true}, "optimizer": {"type": "RMSprop", "params": {"momentum": 0.9}}}"#,
    );
    for (how, said) in [
        (["--optimizer", "rmsprop-momentum"], "RMSprop with momentum"),
        (["--optimizer", "rmsprop-centered"], "RMSprop centered"),
        (["--config", f.as_str()], "RMSprop with momentum"),
    ] {
        let (ok, out) = on_1gib(how);
        assert!(
            ok && out.contains(&format!("bf16 compute, {said}:"))
                && out.contains("stage 0:      18.00 GiB"),
            "{how:?}: {out}"
        );
    }
    let _ = std::fs::remove_file(&f);
    // Muon keeps one moment for its matrices (90% of the parameters
    // unless told), AdamW's two for the rest: 18 GiB less 4 bytes for
    // each matrix element at stage 0.
    let f = config_file(
        "estimate-muon",
        r#"{"train_batch_size": 8, "bf16": {"enabled": true}, "optimizer": {"type": "Muon"}}"#,
    );
    let muon = |how: &[&str]| {
        let mut args = vec!["estimate", "--params", "1073741824", "--world", "4"];
        args.extend(how);
        zrt(&args)
    };
    for (how, share, stage0) in [
        (&["--optimizer", "muon"][..], "90", "14.40 GiB"),
        (&["--config", f.as_str()], "90", "14.40 GiB"),
        (&["--config", &f, "--muon-share", "0.5"], "50", "16.00 GiB"),
        (
            &["--optimizer", "muon", "--muon-share=1"],
            "100",
            "14.00 GiB",
        ),
    ] {
        let (ok, out) = muon(how);
        let said = format!("bf16 compute, Muon over {share}% of the parameters (one moment for those, AdamW's two for the rest):");
        assert!(
            ok && out.contains(&said) && out.contains(&format!("stage 0:      {stage0}")),
            "{how:?}: {out}"
        );
    }
    let (ok, out) = muon(&["--optimizer", "muon", "--muon-share", "1.5"]);
    assert!(!ok && out.contains("--muon-share is a share"), "{out}");
    let (ok, out) = muon(&["--optimizer", "lion", "--muon-share", "0.5"]);
    assert!(
        !ok && out.contains("--muon-share is for Muon, and the optimizer is lion"),
        "{out}"
    );
    let _ = std::fs::remove_file(&f);
    let (ok, out) = zrt(&[
        "estimate",
        "--params=1e9",
        "--world=2",
        "--optimizer=adadelta",
    ]);
    assert!(
        !ok && out.contains(
            "--optimizer must be adam, adamw, lamb, muon, rmsprop-momentum, rmsprop-centered, lion, adagrad, rmsprop, sgd-momentum or sgd, got adadelta"
        ),
        "{out}"
    );
    for (params, world) in [
        ("0", "2"),
        ("-1e9", "2"),
        ("NaN", "2"),
        ("inf", "2"),
        ("1e9", "0"),
    ] {
        let (params, world) = (format!("--params={params}"), format!("--world={world}"));
        let (ok, out) = zrt(&["estimate", &params, &world]);
        assert!(
            !ok && out.contains("--params and --world must be positive numbers"),
            "{params} {world}: {out}"
        );
    }
}

#[test]
fn a_benchmark_given_a_count_of_zero_refuses_it() {
    // A zero here printed NaN rows, ran a benchmark of nothing, or (adam's
    // --params) panicked.
    for args in [
        &["adam", "--params", "0"][..],
        &["adam", "--threads", "1,0"],
        &["adam", "--rounds", "0"],
        &["adam", "--steps", "0"],
        &["collectives", "--sizes", "0"],
        &["collectives", "--rounds", "0"],
        &["collectives", "--iters", "0"],
        &["offload", "--params", "0"],
        &["offload", "--block-size", "0"],
        &["offload", "--buffers", "0"],
        &["offload", "--threads", "0"],
        &["offload", "--rounds", "0"],
        &["offload", "--steps", "0"],
        &["train", "--worlds", "0"],
        &["train", "--micro", "0"],
        &["train", "--steps", "0"],
        &["train", "--rounds", "0"],
        &["loss", "--tokens", "0"],
        &["loss", "--width", "0"],
        &["loss", "--vocab", "0"],
        &["loss", "--threads", "0"],
        &["loss", "--rounds", "0"],
    ] {
        let (ok, out) = zrt(&[&["bench"][..], args].concat());
        let flag = args[1];
        assert!(
            !ok && out.contains(&format!("invalid value '0' for '{flag} "))
                && out.contains("0 is not in 1.."),
            "{args:?}: {out}"
        );
    }
}

#[test]
fn a_benchmark_larger_than_the_host_refuses_it_before_allocating() {
    // These aborted in the allocator ("memory allocation failed") or
    // overflowed computing the size, after a rank or two had started.
    for (args, flags) in [
        (
            &["collectives", "--sizes", "1,100000000"][..],
            "--sizes 100000000",
        ),
        (
            &["collectives", "--sizes", "18446744073709551615"],
            "--sizes 18446744073709551615",
        ),
        (
            &["adam", "--params", "100000000000000"],
            "--params 100000000000000",
        ),
        (
            &["adam", "--params", "2000000000000", "--peer"],
            "--params 2000000000000 with --peer",
        ),
        (
            &["offload", "--params", "100000000000000"],
            "--params 100000000000000 --block-size",
        ),
        (
            &["offload", "--buffers", "1000000000000"],
            "--buffers 1000000000000",
        ),
        (
            &["loss", "--tokens", "100000", "--vocab", "10000000"],
            "--tokens 100000 --width 1152 --vocab 10000000",
        ),
        (
            &["loss", "--vocab", "9223372036854775807"],
            "--tokens 512 --width 1152 --vocab 9223372036854775807",
        ),
    ] {
        let (ok, out) = zrt(&[&["bench"][..], args].concat());
        assert!(
            !ok && out.contains(flags)
                && (out.contains("GiB available; give a smaller value")
                    || out.contains("more memory than any host has")),
            "{args:?}: {out}"
        );
        assert!(!out.contains("round 1/"), "{args:?} ran: {out}");
    }
}

#[test]
fn the_loss_bench_prints_the_three_ways_with_their_peaks() {
    // 1024 tokens of a 50000-word vocabulary: seven blocks of 8192
    // columns. The fused way holds no logits, only a block's: a small
    // part of the peer's peak.
    let (ok, out) = zrt(&[
        "bench", "loss", "--tokens", "1024", "--width", "8", "--vocab", "50000", "--rounds", "1",
        "--json",
    ]);
    assert!(ok, "{out}");
    let rows: Vec<serde_json::Value> = (out.lines())
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let ways: Vec<&str> = rows.iter().filter_map(|r| r["way"].as_str()).collect();
    assert_eq!(ways, ["fused", "kept", "fp32"], "{out}");
    let field = |i: usize, k: &str| rows[i][k].as_f64().unwrap_or(f64::NAN);
    // The peer's logits, their gradient and log-softmax: 3 x 205 MB.
    assert!(field(2, "peak_bytes") > 4e8, "{out}");
    assert!(field(0, "memory_vs_peer") < 0.3, "{out}");
    assert_eq!(field(2, "ratio_vs_peer"), 1.0, "{out}");
    for i in 0..3 {
        assert!((field(i, "loss") - field(2, "loss")).abs() < 1e-4, "{out}");
        assert!(field(i, "step_s") > 0.0, "{out}");
    }
}

#[test]
fn the_collectives_bench_prints_every_row_with_its_limits() {
    // Two real ranks on shm, 1 MiB, once: every op's row as JSON, with the
    // memcpy it is compared with and both cores' memcpy at once.
    let o = Command::new(env!("CARGO_BIN_EXE_zrt"))
        .args(["bench", "collectives", "--sizes", "1", "--rounds", "1"])
        .args(["--iters", "1", "--json"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", common::printed(&o));
    let rows: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let ops: Vec<&str> = rows.iter().map(|r| r["op"].as_str().unwrap()).collect();
    assert_eq!(
        ops,
        [
            "all_reduce",
            "reduce_scatter",
            "all_gather",
            "reduce_scatter_in_place",
            "all_gather_in_place",
            "reduce_scatter_symmetric",
            "all_gather_symmetric",
            "all_to_all"
        ]
    );
    let two_cpus = std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2);
    for r in &rows {
        let positive = |k: &str| r[k].as_f64().is_some_and(|x| x > 0.0 && x.is_finite());
        for k in [
            "seconds",
            "busbw_gb_per_s",
            "memcpy_gb_per_s",
            "ratio_vs_limit",
        ] {
            assert!(positive(k), "{k} in {r}");
        }
        // Null (not NaN, which is no JSON) where one CPU cannot copy twice.
        assert_eq!(positive("memcpy_two_cores_gb_per_s"), two_cpus, "{r}");
        let ratio = r["busbw_gb_per_s"].as_f64().unwrap() / r["memcpy_gb_per_s"].as_f64().unwrap();
        assert!(
            (r["ratio_vs_limit"].as_f64().unwrap() - ratio).abs() < 1e-9,
            "{r}"
        );
    }
}

/// stderr of a tiny `zrt bench adam` run with `ZRT_SIMD=avx3` (which the
/// kernels crate warns about through `tracing`) and `RUST_LOG` as given.
fn adam_with_unknown_simd(rust_log: Option<&str>) -> String {
    let mut c = Command::new(env!("CARGO_BIN_EXE_zrt"));
    c.args([
        "bench",
        "adam",
        "--params",
        "100000",
        "--threads",
        "1",
        "--rounds",
        "1",
    ])
    .env("ZRT_SIMD", "avx3");
    match rust_log {
        Some(v) => c.env("RUST_LOG", v),
        None => c.env_remove("RUST_LOG"),
    };
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{err}");
    err
}

#[test]
fn the_cli_shows_the_libraries_warnings() {
    // Only a subscriber the CLI installed can print the kernels' warning.
    let err = adam_with_unknown_simd(None);
    assert!(
        err.contains(
            "WARN ZRT_SIMD=\"avx3\" is not base, avx2 or avx512: using the CPU's widest level"
        ),
        "{err}"
    );
    assert!(!err.contains('\x1b'), "no colour codes into a pipe: {err}");
    // A filter that does not parse is said, and the default one used.
    let err = adam_with_unknown_simd(Some("zrt_zero=loud"));
    assert!(
        err.contains("WARN RUST_LOG=\"zrt_zero=loud\" is not a filter (")
            && err.contains("WARN ZRT_SIMD=\"avx3\""),
        "{err}"
    );
}

#[test]
fn the_main_job_refuses_an_option_it_does_not_know_and_lists_them_on_help() {
    let run = |args: &[&str]| {
        let o = Command::new(common::example("train_gpt"))
            .args(args)
            .output()
            .unwrap();
        (o.status.success(), common::printed(&o))
    };
    // Refused before joining a job: no `zrt launch` needed to see these.
    let (ok, out) = run(&["--step", "10"]);
    assert!(!ok && out.contains("unknown option `--step`"), "{out}");
    assert!(out.contains("--steps"), "the options are listed: {out}");
    let (ok, out) = run(&["--steps", "-3"]);
    assert!(
        !ok && out.contains("--steps must be at least 1, got -3"),
        "{out}"
    );
    let (ok, out) = run(&["--save-dir"]);
    assert!(!ok && out.contains("--save-dir needs a value"), "{out}");
    for chance in ["--layerdrop", "--mlp-drop"] {
        let (ok, out) = run(&[chance, "1"]);
        let want = format!("{chance} takes a chance from 0 up to (not including) 1, got `1`");
        assert!(!ok && out.contains(&want), "{out}");
    }
    let (ok, out) = run(&["--help"]);
    assert!(
        ok && out.contains("--eval-every N") && out.contains("--resume"),
        "{out}"
    );
}

/// The main job's options for a one-step run of a tiny model, saving
/// nothing: for tests of what happens before or at its first step.
const TINY_MAIN_JOB: [&str; 9] = [
    "--d-model",
    "16",
    "--layers",
    "1",
    "--heads",
    "1",
    "--steps",
    "1",
    "--no-save",
];

/// [`TINY_MAIN_JOB`] and `args` on one rank: its exit code and output.
fn run_tiny_main_job(args: &[&str]) -> (Option<i32>, String) {
    let o = common::output_elsewhere(
        Command::new(env!("CARGO_BIN_EXE_zrt"))
            .args(["launch", "--nproc-per-node", "1", "--"])
            .arg(common::example("train_gpt"))
            .args(TINY_MAIN_JOB)
            .args(args)
            .env_remove("ZRT_TOKEN"),
    );
    (o.status.code(), common::printed(&o))
}

#[test]
fn the_main_job_refuses_a_window_or_batch_it_cannot_hold() {
    // One rank, a tiny model: each case fails before or at its first step.
    // Longer than the held-out tenth: a panic slicing the text before.
    let (code, out) = run_tiny_main_job(&["--seq", "100000"]);
    assert!(
        code == Some(1)
            && out.contains(
                "--seq 100000 needs windows of 100001 bytes, longer than the validation text"
            )
            && !out.contains("panicked"),
        "{out}"
    );
    // A micro-batch no host holds: an abort in the allocator before.
    let cfg = config_file(
        "huge-micro",
        r#"{"train_micro_batch_size_per_gpu": 1e12, "optimizer": {"type": "AdamW", "params": {}},
            "zero_optimization": {"stage": 3}}"#,
    );
    let (code, out) = run_tiny_main_job(&["--seq", "16", "--config", &cfg]);
    let _ = std::fs::remove_file(&cfg);
    assert!(
        code == Some(1)
            && out.contains(
                "a micro-batch of 1000000000000 sequences of 17 tokens does not fit in memory: \
                 lower train_micro_batch_size_per_gpu"
            ),
        "{out}"
    );
}

#[test]
fn a_main_job_too_short_to_learn_says_what_it_measured_and_why() {
    // One step: its learning rate is the warm-up's first, 0, so the
    // validation loss cannot fall, and the job's check says that.
    let (code, out) = run_tiny_main_job(&[]);
    let said = out
        .lines()
        .find_map(|l| l.split_once("Error: validation loss did not fall: "))
        .map(|(_, rest)| rest)
        .unwrap_or_else(|| panic!("{out}"));
    let (losses, why) = said
        .split_once(" after ")
        .unwrap_or_else(|| panic!("{out}"));
    let (v0, last) = losses.split_once(" -> ").unwrap_or_else(|| panic!("{out}"));
    assert_eq!(v0, last, "{out}");
    assert_eq!(
        why,
        "1 optimizer step(s) at a last learning rate of 0.00e0 (a run of a few steps may \
         still be in the warm-up; the default is --steps 400)",
        "{out}"
    );
    assert_eq!(code, Some(1), "{out}");
}

#[test]
fn a_dev_shm_too_small_for_the_group_is_named_with_the_fix() {
    // The job in a mount namespace of its own whose /dev/shm holds 64 KiB
    // (needs root, as the tmpfs tests do). Before, the group's segment was
    // a sparse file that joined fine: a job whose collectives touched more
    // of it than /dev/shm held died of SIGBUS (the demo's model did, at
    // its first step), and this tiny one, touching less, ran.
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", "sh", "-c"])
        .arg("mount -t tmpfs -o size=64k tmpfs /dev/shm || exit 99; exec \"$@\"")
        .arg("sh")
        .arg(env!("CARGO_BIN_EXE_zrt"))
        .args(["launch", "--nproc-per-node", "2", "--"])
        .arg(common::example("train_gpt"))
        .args(TINY_MAIN_JOB)
        .env_remove("ZRT_TOKEN")
        .env("ZRT_BACKEND", "shm");
    let o = common::output_elsewhere(&mut cmd);
    let out = common::printed(&o);
    assert_ne!(
        o.status.code(),
        Some(99),
        "cannot mount a tmpfs (not root?): {out}"
    );
    assert!(
        o.status.code() == Some(1)
            && out.contains("[rank 0]     rendezvous failed: reserving ")
            && out.contains(
                "No space left on device (os error 28); /dev/shm is full or smaller than the job \
                 needs (see `df -h /dev/shm`; Docker gives a container 64 MiB unless run with \
                 --shm-size): free space there, or use ZRT_BACKEND=tcp"
            )
            && !out.contains("signal"),
        "{out}"
    );
}

#[test]
fn bench_train_leaves_out_peers_it_cannot_run_and_says_so_once() {
    // A "Python" that fails everything: DeepSpeed cannot be imported, and
    // every other peer fails in its round.
    let o = Command::new(env!("CARGO_BIN_EXE_zrt"))
        .args(["bench", "train", "--sizes", "tiny", "--worlds", "2"])
        .args(["--stages", "3", "--rounds", "1", "--steps", "1", "--peer"])
        .env("ZRT_BACKEND", "shm")
        .env("ZRT_PYTHON", "/bin/false")
        .output()
        .unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{}", common::printed(&o));
    assert_eq!(
        err.matches("DeepSpeed's rows are left out, the venv cannot import it")
            .count(),
        1,
        "{err}"
    );
    assert!(!err.contains("deepspeed_zero"), "{err}");
    assert!(!out.contains("deepspeed") && !out.contains("NaN"), "{out}");
    for peer in ["ddp", "fsdp2_zero3", "fsdp2_zero2"] {
        let row = format!("{peer:<16} failed in every round (its errors are above)");
        assert!(out.contains(&row), "{peer}: {out}");
        assert!(
            err.contains(&format!("peer {peer} on tiny failed")),
            "{err}"
        );
    }
    assert!(out.contains("tiny       2 zrt zero3"), "{out}");
}

#[test]
fn bench_train_with_muon_measures_ddp_with_torchs_muon_alone() {
    // FSDP2's shards would each orthogonalize a piece of a matrix:
    // DDP with torch.optim.Muon is the peer that runs Muon.
    let o = Command::new(env!("CARGO_BIN_EXE_zrt"))
        .args(["bench", "train", "--sizes", "tiny", "--worlds", "2"])
        .args(["--stages", "3", "--rounds", "1", "--steps", "1", "--peer"])
        .args(["--optimizer", "muon"])
        .env("ZRT_BACKEND", "shm")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", common::printed(&o));
    assert!(
        out.starts_with("fp32 Muon (the blocks' matrices) and AdamW"),
        "{out}"
    );
    assert!(
        out.contains("tiny       2 zrt zero3") && out.contains("tiny       2 ddp"),
        "{out}"
    );
    assert!(!out.contains("fsdp2") && !out.contains("failed"), "{out}");
    assert!(
        out.contains(
            "tiny ZeRO-3, 2 ranks, Muon: DDP (torch.optim.Muon and AdamW) / zrt step time"
        ),
        "{out}"
    );
}

#[test]
fn bench_train_runs_its_ranks_on_each_backend_it_is_given() {
    // ZRT_BACKEND says shm: the flag decides, and each row says what its
    // ranks ran on.
    let o = Command::new(env!("CARGO_BIN_EXE_zrt"))
        .args(["bench", "train", "--sizes", "tiny", "--worlds", "2"])
        .args(["--stages", "3", "--rounds", "1", "--steps", "1", "--json"])
        .args(["--backends", "tcp,shm"])
        .env("ZRT_BACKEND", "shm")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", common::printed(&o));
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let backends: Vec<&str> = rows
        .iter()
        .map(|r| r["backend"].as_str().unwrap())
        .collect();
    assert_eq!(backends, ["tcp", "shm"], "{rows:?}");
    // The same work on either backend.
    for field in ["params", "comm_elements_per_step", "model_state_bytes"] {
        assert_eq!(rows[0][field], rows[1][field], "{field}: {rows:?}");
    }
    let o = Command::new(env!("CARGO_BIN_EXE_zrt"))
        .args(["bench", "train", "--backends", "shm,nccl"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("invalid value 'nccl'"),
        "{err}"
    );
}

#[test]
fn bench_train_measures_each_bucket_size_and_refuses_a_fraction() {
    let bench = |buckets: &str| {
        Command::new(env!("CARGO_BIN_EXE_zrt"))
            .args(["bench", "train", "--sizes", "tiny", "--worlds", "2"])
            .args(["--stages", "3", "--rounds", "1", "--steps", "1", "--json"])
            .args(["--reduce-bucket-sizes", buckets])
            .env("ZRT_BACKEND", "shm")
            .output()
            .unwrap()
    };
    let o = bench("5e8,100");
    assert!(o.status.success(), "{}", common::printed(&o));
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let buckets: Vec<f64> = rows
        .iter()
        .map(|r| r["reduce_bucket_size"].as_f64().unwrap())
        .collect();
    assert_eq!(buckets, [5e8, 100.0], "{rows:?}");
    // Buckets change the number of calls, not what crosses ranks.
    for field in ["params", "comm_elements_per_step", "model_state_bytes"] {
        assert_eq!(rows[0][field], rows[1][field], "{field}: {rows:?}");
    }
    assert!(rows[0]["comm_elements_per_step"].as_f64().unwrap() > 0.0);
    assert_eq!(rows[0]["backend"], "shm", "{rows:?}");
    let o = bench("5e8,0.5");
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--reduce-bucket-sizes entry 0.5: a bucket is a whole number of elements"),
        "{err}"
    );
}

/// `zrt bench train` of the tiny model, ZeRO-3 on 2 ranks, one round of
/// two steps, with `extra`; a peer's "Python" fails.
fn bench_tiny_stage_3(extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_zrt"))
        .args(["bench", "train", "--sizes", "tiny", "--worlds", "2"])
        .args(["--stages", "3", "--rounds", "1", "--steps", "2"])
        .args(extra)
        .env("ZRT_BACKEND", "shm")
        .env("ZRT_PYTHON", "/bin/false")
        .output()
        .unwrap()
}

/// The first `--json` row of a bench that succeeded.
fn first_row(o: &std::process::Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", common::printed(o));
    let out = String::from_utf8_lossy(&o.stdout);
    serde_json::from_str(out.lines().next().unwrap()).unwrap()
}

/// [`bench_tiny_stage_3`] with `--peer` and `extra`: the peers are DDP
/// alone (which this "Python" fails), DeepSpeed's not even looked for.
/// Its stdout.
fn with_ddp_peer_alone(extra: &[&str]) -> String {
    let o = bench_tiny_stage_3(&[&["--peer"], extra].concat());
    assert!(o.status.success(), "{}", common::printed(&o));
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(err.contains("peer ddp on tiny failed"), "{err}");
    assert!(
        !err.contains("fsdp2") && !out.contains("fsdp2"),
        "{out}{err}"
    );
    assert!(!err.contains("DeepSpeed's rows are left out"), "{err}");
    out.into_owned()
}

#[test]
fn bench_train_with_mlps_left_out_declares_them_and_runs_only_the_ddp_peer() {
    // At the second step rank 0 leaves out both blocks' MLPs and rank 1
    // none (`layerdrop` at 0.5 of seeds 2 and 3 with bit 63 set), the
    // blocks running: undeclared, their reductions would go out of step.
    let dropped = first_row(&bench_tiny_stage_3(&["--json", "--mlp-drop", "0.5"]));
    assert_eq!(dropped["mlp_drop"], 0.5, "{dropped}");
    assert_eq!(first_row(&bench_tiny_stage_3(&["--json"]))["mlp_drop"], 0.0);
    let out = with_ddp_peer_alone(&["--mlp-drop", "0.5"]);
    assert!(
        out.contains("MLP drop 0.5: each block's MLP left out"),
        "{out}"
    );
}

#[test]
fn bench_train_with_layerdrop_declares_the_blocks_and_runs_only_the_ddp_peer() {
    let (bench, row) = (bench_tiny_stage_3, first_row);
    // At the warm-up step rank 0 leaves block 0 out and rank 1 runs both
    // (`layerdrop` of seeds 0 and 1): undeclared, their reductions would
    // go out of step and the ranks fail.
    let dropped = row(&bench(&["--json", "--layerdrop", "0.5"]));
    assert_eq!(dropped["layerdrop"], 0.5, "{dropped}");
    assert_eq!(row(&bench(&["--json"]))["layerdrop"], 0.0);
    assert_eq!(dropped["layerdrop_same"], false, "{dropped}");
    // Every rank leaving out rank 0's blocks (equal work) trains as well.
    let same = row(&bench(&[
        "--json",
        "--layerdrop",
        "0.5",
        "--layerdrop-same",
    ]));
    assert_eq!(same["layerdrop_same"], true, "{same}");
    let o = bench(&["--layerdrop-same"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && err.contains(
                "--layerdrop-same makes the ranks leave out the same blocks: give the chance too"
            ),
        "{err}"
    );
    // The peers: DDP alone (FSDP2 and DeepSpeed cannot skip a module on
    // some ranks).
    let out = with_ddp_peer_alone(&["--layerdrop", "0.5"]);
    assert!(out.contains("LayerDrop 0.5: each block left out"), "{out}");
    let o = bench(&["--layerdrop", "1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("`1` is not a chance from 0 up to (not including) 1"),
        "{err}"
    );
}

#[test]
fn config_check_says_when_stage_3_gathers_reduces_or_holds_int8() {
    let qwz = "qwZ              forward and backward gathers packed as int8";
    let qgz = "qgZ              gradient reduce-scatters packed as int8";
    let frozen = "frozen weights   sharded frozen parameters held and gathered as int8";
    for (w, g, n) in [
        (true, false, false),
        (false, true, false),
        (false, false, true),
        (false, false, false),
    ] {
        let name = format!("qwz-{w}-qgz-{g}-frozen-{n}");
        let f = config_file(
            &name,
            &format!(
                r#"{{"train_batch_size": 8, "zero_optimization": {{"stage": 3, "zero_quantized_weights": {w}, "zero_quantized_gradients": {g}, "zero_quantized_nontrainable_weights": {n}}}}}"#
            ),
        );
        let (ok, out) = zrt(&["config", "check", &f, "--world", "2"]);
        let _ = std::fs::remove_file(&f);
        assert!(ok, "{out}");
        let said = (out.contains(qwz), out.contains(qgz), out.contains(frozen));
        assert_eq!(said, (w, g, n), "{out}");
        // Implemented: no warning that it is ignored.
        assert!(!out.contains("does not implement"), "{out}");
    }
}

#[test]
fn config_check_shows_each_optimizers_settings_and_refuses_adams() {
    // (name, params, the optimizer's line; a block with an Adam setting,
    // what is said of it)
    let cases = [
        (
            "Lion",
            r#""lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.1"#,
            "optimizer        Lion lr 0.0001 betas (0.9, 0.99) weight_decay 0.1 (decoupled decay; one moment, no second)",
            r#""eps": 1e-8"#,
            "`optimizer.params.eps` is an Adam setting that Lion does not take",
        ),
        (
            "SGD",
            r#""lr": 0.1, "momentum": 0.9, "nesterov": true, "weight_decay": 1e-4"#,
            "optimizer        SGD lr 0.1 momentum 0.9 dampening 0 nesterov true maximize false weight_decay 0.0001 (L2 decay; one momentum buffer)",
            r#""betas": [0.9, 0.99]"#,
            "`optimizer.params.betas` is an Adam setting that SGD does not take",
        ),
        (
            "Adagrad",
            r#""lr": 0.1, "lr_decay": 0.01, "weight_decay": 1e-4"#,
            "optimizer        Adagrad lr 0.1 lr_decay 0.01 eps 0.0000000001 initial_accumulator_value 0 maximize false weight_decay 0.0001 (L2 decay; one sum of squares)",
            r#""betas": [0.9, 0.99]"#,
            "`optimizer.params.betas` is an Adam setting that Adagrad does not take",
        ),
        (
            "RMSprop",
            r#""lr": 0.01, "alpha": 0.9, "momentum": 0.5, "weight_decay": 1e-4"#,
            "optimizer        RMSprop lr 0.01 alpha 0.9 eps 0.00000001 momentum 0.5 centered false maximize false weight_decay 0.0001 (L2 decay; a square average and a momentum buffer)",
            r#""amsgrad": false"#,
            "`optimizer.params.amsgrad` is an Adam setting that RMSprop does not take",
        ),
    ];
    let muon = (
        "Muon",
        r#""muon_lr": 0.02, "adam_lr": 3e-3, "weight_decay": 0.01"#,
        "optimizer        Muon lr 0.02 momentum 0.95 nesterov true ns_steps 5 ns_coefficients (3.4445, -4.775, 2.0315) adjust_lr_fn original weight_decay 0.01 (decoupled); AdamW lr 0.003 betas (0.9, 0.95) eps 0.0000000001 for what Muon does not take",
        r#""fused": true"#,
        "`optimizer.params.fused` is an Adam setting that Muon does not take",
    );
    let lamb = (
        "Lamb",
        r#""lr": 1e-3, "weight_decay": 0.01, "max_coeff": 0.3"#,
        "optimizer        Lamb lr 0.001 betas (0.9, 0.999) eps 0.00000001 weight_decay 0.01 (in the update) bias_correction true trust ratio in [0.01, 0.3]",
        r#""adam_w_mode": true"#,
        "`optimizer.params.adam_w_mode` is an Adam setting that Lamb does not take",
    );
    for (name, params, line, adams, refused) in cases.into_iter().chain([lamb, muon]) {
        for (params, ok_and_said) in [(params, (true, line)), (adams, (false, refused))] {
            let f = config_file(
                name,
                &format!(
                    r#"{{"train_batch_size": 8, "optimizer": {{"type": "{name}", "params": {{{params}}}}}}}"#
                ),
            );
            let (ok, out) = zrt(&["config", "check", &f, "--world", "2"]);
            let _ = std::fs::remove_file(&f);
            assert!(ok == ok_and_said.0 && out.contains(ok_and_said.1), "{out}");
        }
    }
}

#[test]
fn estimate_counts_the_activations_of_the_layers_it_knows() {
    // TinyLlama 1.1B's shape, one row of 256 tokens a rank: fp32 each
    // layer's saved tensors (the formula `tests/activation_memory.rs`
    // holds to libtorch's allocations), bf16 each layer's input. Their
    // 256 x 32000 logits fit one block of the fused loss, which keeps
    // their fp32 log-probabilities (31.25 MiB); two rows' do not.
    let dir = common::scratch("cli-estimate-activations");
    let tiny = dir.join("tinyllama.json");
    std::fs::write(
        &tiny,
        r#"{"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 22, "vocab_size": 32000, "rms_norm_eps": 1e-05, "max_position_embeddings": 2048, "tie_word_embeddings": false}"#,
    )
    .unwrap();
    let tiny = tiny.to_str().unwrap();
    let base = [
        "estimate",
        "--hf-config",
        tiny,
        "--world",
        "2",
        "--seq",
        "256",
    ];
    let (ok, out) = zrt(&[&base[..], &["--dtype", "fp32"]].concat());
    assert!(
        ok && out
            .contains("activations: a forward of 1 x 256 tokens in fp32 holds 769.48 MiB a rank"),
        "{out}"
    );
    assert!(
        out.contains("which keeps the logits' log-probabilities in fp32 as one of its blocks"),
        "{out}"
    );
    // The three terms summed: 8.20 GiB, 750 MiB and 769 MiB.
    assert!(
        out.contains("stage 3 in all: 9.68 GiB a rank while it trains"),
        "{out}"
    );
    // A config's stage below 3: its model state, the largest unit's
    // gradient and the fp32 buffer it is reduced from (500 MiB), the
    // activations; at stage 1 the reduced shards too, held to the step
    // beside the whole sum (2.05 GiB).
    for (stage, said) in [
        (2, "stage 2 in all: 11.48 GiB a rank while it trains"),
        (1, "stage 1 in all: 15.58 GiB a rank while it trains"),
    ] {
        let ds = dir.join(format!("ds{stage}.json"));
        let json =
            format!(r#"{{"train_batch_size": 2, "zero_optimization": {{"stage": {stage}}}}}"#);
        std::fs::write(&ds, json).unwrap();
        let (ok, out) = zrt(&[&base[..], &["--config", ds.to_str().unwrap()]].concat());
        assert!(ok && out.contains(said), "{out}");
        let gradients = format!("stage {stage} reduces a unit at a time: the largest, `lm_head` (65536000 params), adds up to 500.00 MiB");
        assert!(
            out.contains(&gradients) && !out.contains("stage 3 in all"),
            "{out}"
        );
    }
    let (ok, out) = zrt(&[
        &base[..],
        &["--checkpoint-activations", "--micro-batch", "2"],
    ]
    .concat());
    assert!(
        ok && out.contains("a forward of 2 x 256 tokens in bf16, each layer recomputed in backward holds 52.11 MiB a rank")
            && out.contains("the head fused with the loss, no logits kept"),
        "{out}"
    );
    // A window shorter than the row: twice the tokens keep twice the
    // bytes (the fused loss each logit's fp32 log-probability: one of
    // its blocks holds them all), and the layers one mask of 256 x 256
    // scores in bf16. The attention's dropout takes the plain attention,
    // which keeps fp32 weights for every pair of tokens (1.5 MiB of them
    // here); Gemma 2's attention's dropout, whose soft-capped scores
    // are computed in blocks, is not counted, and said so.
    let mistral = r#"{"model_type": "mistral", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "sliding_window": 128"#;
    let dropout = hf_config(
        &dir,
        "mistral-dropout",
        &format!(r#"{mistral}, "attention_dropout": 0.1}}"#),
    );
    let capped = hf_config(
        &dir,
        "gemma2-dropout",
        r#"{"model_type": "gemma2", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 1000, "attention_dropout": 0.1}"#,
    );
    let mistral = hf_config(&dir, "mistral", &format!("{mistral}}}"));
    for (config, seq, said) in [
        (
            &mistral,
            "128",
            "a forward of 1 x 128 tokens in bf16 holds 3.00 MiB",
        ),
        (
            &mistral,
            "256",
            "a forward of 1 x 256 tokens in bf16 holds 6.12 MiB",
        ),
        (
            &dropout,
            "128",
            "a forward of 1 x 128 tokens in bf16 holds 4.99 MiB",
        ),
        (&capped, "128", "activations: not counted for this model"),
    ] {
        estimate_says(config, &["--world", "2", "--seq", seq], &[said]);
    }
    // Gemma 3 1B's config, in bf16: its 26 layers each keep 98356
    // bytes a token (four norms keeping their normalized values in fp32,
    // each head's query and key normalised; 112180 when the MLP kept its
    // activation's output), 624.3 MiB at 256 tokens, besides the rotary
    // tables' 13 MiB and the head's input the fused loss keeps. At 1024
    // tokens, four times that and the mask its 22 layers in a window of
    // 512 share (2 MB). Unfused, the loss keeps the logits too: 128 MiB
    // at 256 tokens over its 262144 words in bf16, 512 MiB at 1024 (255
    // MiB and 1 GiB when it kept them in fp32).
    let gemma3 = hf_config(
        &dir,
        "gemma3",
        r#"{"architectures": ["Gemma3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "attn_logit_softcapping": null, "final_logit_softcapping": null, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144}"#,
    );
    for (seq, said) in [
        (
            "256",
            "a forward of 1 x 256 tokens in bf16 holds 640.66 MiB a rank",
        ),
        (
            "1024",
            "a forward of 1 x 1024 tokens in bf16 holds 2.50 GiB a rank",
        ),
    ] {
        estimate_says(
            &gemma3,
            &["--world", "2", "--seq", seq, "--dtype", "bf16"],
            &[said, "the head fused with the loss, no logits kept"],
        );
    }
    estimate_says(
        &gemma3,
        &["--world", "2", "--seq", "1024", "--dtype", "bf16", "--unfused-loss"],
        &["holds 3.00 GiB a rank for its backward (the tensors autograd saves, the logits the loss keeps among them)"],
    );
    // Phi-3 mini's, LoRA r 8 on PEFT's default for it, the fused
    // `qkv_proj` (8 x (3072 + 9216) a layer, 32 layers). Its values keep
    // the whole fused output, so a layer keeps about 101 kB a token:
    // 3.10 GiB at 1024 tokens.
    let phi3 = hf_config(
        &dir,
        "phi3",
        r#"{"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 32, "vocab_size": 32064, "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_scaling": null, "sliding_window": 2047, "pad_token_id": 32000, "tie_word_embeddings": false}"#,
    );
    estimate_says(
        &phi3,
        &["--world", "2", "--seq", "1024", "--dtype", "bf16", "--lora-r", "8"],
        &[
            "LoRA r 8 on qkv_proj: 3145728 adapter params train",
            "a forward of 1 x 1024 tokens in bf16, LoRA r 8 adapters training holds 3.10 GiB a rank",
        ],
    );
    // Mixtral 8x7B's, LoRA r 16 on PEFT's default for it (q_proj and
    // v_proj: 16 x (8192 + 5120) a layer): its experts, frozen, keep
    // what their backward to the adapters below needs, two of eight a
    // token, about 132 kB a token and layer of the 196 kB. Adapters on
    // the experts are not counted.
    let mixtral = hf_config(
        &dir,
        "mixtral",
        r#"{"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": null, "output_router_logits": false, "tie_word_embeddings": false}"#,
    );
    let mixtral_lora = [
        "--world", "8", "--seq", "2048", "--dtype", "bf16", "--lora-r", "16",
    ];
    estimate_says(
        &mixtral,
        &mixtral_lora,
        &[
            "LoRA r 16 on q_proj,v_proj: 6815744 adapter params train",
            "a forward of 1 x 2048 tokens in bf16, LoRA r 16 adapters training holds 11.86 GiB a rank",
            // Its frozen head's input's gradient in fp32, 32 MiB.
            "no logits kept but the gradient of the frozen head's input in fp32",
        ],
    );
    let all_linear = [&mixtral_lora[..], &["--lora-targets", "all-linear"]].concat();
    let (ok, out) = zrt(&[&["estimate", "--hf-config", &mixtral][..], &all_linear].concat());
    assert!(
        !ok && out.contains("(not on a mixture's router or experts); for this model give"),
        "{out}"
    );
    // DeepSeek-V2-Lite's: latent attention, its values padded to the
    // queries' and keys' width for the fused kernel (without, the
    // kernel keeping every score ran, 272 MiB more a layer at 2048
    // tokens); LoRA on the queries', the latent's expansion and the
    // output projections: 16 x (2048 + 3072 + 512 + 4096 + 2048 + 2048)
    // a layer.
    let lite = hf_config(
        &dir,
        "deepseek-v2-lite",
        r#"{"architectures": ["DeepseekV2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": false, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": null, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"}, "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": true, "tie_word_embeddings": false, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16", "use_cache": true, "v_head_dim": 128, "vocab_size": 102400}"#,
    );
    let two_ranks = ["--world", "2", "--seq", "2048", "--dtype", "bf16"];
    estimate_says(
        &lite,
        &two_ranks,
        &["a forward of 1 x 2048 tokens in bf16 holds 9.82 GiB a rank"],
    );
    estimate_says(
        &lite,
        &[
            &two_ranks[..],
            &[
                "--lora-r",
                "16",
                "--lora-targets",
                "q_proj,kv_b_proj,o_proj",
            ],
        ]
        .concat(),
        &[
            "LoRA r 16 on q_proj,kv_b_proj,o_proj: 5971968 adapter params train",
            "stage 3 in all: 22.10 GiB a rank",
        ],
    );
    // Each at its widths, in bf16: its config, ranks, tokens and what
    // the estimate says.
    let widths: [(&str, &str, &str, &str, &[&str]); 20] = [
        // Llama 4 Scout's language model (its published text config,
        // its temperature tuning given as 4; 16 experts a layer, top 1,
        // beside a shared expert): at 16384 tokens its 36 chunked layers
        // attend within chunks of 8192 through one mask of scores (each
        // layer's own kept 17.5 GiB more, until 2026-12-07); the other
        // 12 grow their queries with the position.
        (
            "llama4-scout",
            r#"{"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "attention_bias": false, "attention_chunk_size": 8192, "attention_dropout": 0.0, "attn_scale": 0.1, "attn_temperature_tuning": 4, "floor_scale": 8192, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "interleave_moe_layer_step": 1, "intermediate_size": 8192, "intermediate_size_mlp": 16384, "max_position_embeddings": 262144, "no_rope_layers": [], "num_attention_heads": 40, "num_experts_per_tok": 1, "num_hidden_layers": 48, "num_key_value_heads": 8, "num_local_experts": 16, "output_router_logits": false, "pad_token_id": 200018, "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "rope_theta": 500000.0, "router_jitter_noise": 0.0, "tie_word_embeddings": false, "use_qk_norm": true, "vocab_size": 202048}"#,
            "8",
            "16384",
            &["a forward of 1 x 16384 tokens in bf16 holds 181.00 GiB a rank"],
        ),
        // Apertus's class defaults (8B's width, an MLP 14336 wide): its
        // xIELU keeps its input alone, computed again in backward (its
        // intermediate values kept 34.79 GiB in all, until 2026-12-07).
        (
            "apertus",
            r#"{"model_type": "apertus", "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}"#,
            "2",
            "4096",
            &["a forward of 1 x 4096 tokens in bf16 holds 21.54 GiB a rank"],
        ),
        // LFM2-1.2B's shape: ten short convolutions, each keeping its
        // projection's three widths, their product, the convolution's
        // output and the output projection's copy (6 b h a token),
        // around six layers that attend.
        (
            "lfm2",
            r#"{"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "hidden_size": 2048, "intermediate_size": 12288, "block_ff_dim": 12288, "block_auto_adjust_ff_dim": true, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 65536, "conv_L_cache": 3, "conv_bias": false, "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "full_attention", "conv", "full_attention", "conv", "full_attention", "conv"], "max_position_embeddings": 128000, "norm_eps": 1e-05, "rope_theta": 1000000.0, "tie_embedding": true, "pad_token_id": 0}"#,
            "2",
            "4096",
            &[
                "1170340608 params",
                "a forward of 1 x 4096 tokens in bf16 holds 6.60 GiB a rank",
            ],
        ),
        // DBRX's (132B): its fused query-key-value projection clipped
        // at 8 (each clamp keeping the projection's output), four of 16
        // experts a token.
        (
            "dbrx",
            r#"{"architectures": ["DbrxForCausalLM"], "model_type": "dbrx", "d_model": 6144, "n_heads": 48, "n_layers": 40, "max_seq_len": 32768, "vocab_size": 100352, "attn_config": {"kv_n_heads": 8, "clip_qkv": 8, "rope_theta": 500000}, "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4}, "tie_word_embeddings": false}"#,
            "8",
            "4096",
            &[
                "131596523520 params",
                "a forward of 1 x 4096 tokens in bf16 holds 69.06 GiB a rank",
            ],
        ),
        // Falcon-7B's: one key and value (a view of the fused
        // projection, which it keeps whole) beside the MLP after one
        // LayerNorm.
        (
            "falcon-7b",
            r#"{"architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71, "num_hidden_layers": 32, "multi_query": true, "parallel_attn": true, "bias": false, "alibi": false, "new_decoder_architecture": false, "vocab_size": 65024, "hidden_dropout": 0.0, "attention_dropout": 0.0}"#,
            "2",
            "2048",
            &[
                "6921720704 params",
                "a forward of 1 x 2048 tokens in bf16 holds 7.32 GiB a rank",
            ],
        ),
        // Pythia-1.4B's (GPT-NeoX): each head's query, key and value
        // one projection (the values, views of it, keep it whole), a
        // quarter of each head turned, the MLP beside the attention
        // after a LayerNorm of its own.
        (
            "pythia-1.4b",
            r#"{"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_act": "gelu", "hidden_size": 2048, "intermediate_size": 8192, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "num_attention_heads": 16, "num_hidden_layers": 24, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": false, "use_parallel_residual": true, "vocab_size": 50304}"#,
            "2",
            "2048",
            &[
                "1414647808 params",
                "a forward of 1 x 2048 tokens in bf16 holds 3.22 GiB a rank",
            ],
        ),
        // phi-1.5's: one LayerNorm both sublayers read, half of each
        // head turned, its `gelu_new` keeping its input alone (its five
        // operations kept 2.25 GiB more, until 2026-12-07).
        (
            "phi-1_5",
            r#"{"architectures": ["PhiForCausalLM"], "model_type": "phi", "attention_dropout": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "hidden_act": "gelu_new", "hidden_size": 2048, "intermediate_size": 8192, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "num_attention_heads": 32, "num_hidden_layers": 24, "partial_rotary_factor": 0.5, "qk_layernorm": false, "rope_theta": 10000.0, "tie_word_embeddings": false, "vocab_size": 51200}"#,
            "2",
            "2048",
            &[
                "1418270720 params",
                "a forward of 1 x 2048 tokens in bf16 holds 2.66 GiB a rank",
            ],
        ),
        // phi-2's: its `resid_pdrop` 0.1 keeps a mask of each
        // sublayer's output.
        (
            "phi-2",
            r#"{"architectures": ["PhiForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 50256, "embd_pdrop": 0.0, "eos_token_id": 50256, "hidden_act": "gelu_new", "hidden_size": 2560, "initializer_range": 0.02, "intermediate_size": 10240, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "model_type": "phi", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "partial_rotary_factor": 0.4, "qk_layernorm": false, "resid_pdrop": 0.1, "rope_scaling": null, "rope_theta": 10000.0, "tie_word_embeddings": false, "torch_dtype": "float16", "use_cache": true, "vocab_size": 51200}"#,
            "2",
            "2048",
            &[
                "2779683840 params",
                "a forward of 1 x 2048 tokens in bf16 holds 5.04 GiB a rank",
            ],
        ),
        // GPT-2's (124M) with its dropouts, 0.1 each: the attention's
        // takes libtorch's plain path on a CPU, whose fp32 softmax, mask
        // and dropped weights for every pair of tokens are 1.69 GiB of
        // the 2.06 (without its dropouts it holds 292 MiB).
        (
            "gpt2",
            r#"{"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": null, "summary_first_dropout": 0.1, "summary_proj_to_labels": true, "summary_type": "cls_index", "summary_use_proj": true, "vocab_size": 50257}"#,
            "2",
            "1024",
            &[
                "124439808 params",
                "a forward of 1 x 1024 tokens in bf16 holds 2.06 GiB a rank",
            ],
        ),
        // StarCoder2-3B's shape with dropouts of 0.1 (the attention's
        // weights, each sublayer's output, the embeddings): at 4096
        // tokens the plain attention's fp32 weights, mask and dropped
        // weights are 144 GiB of the 149.95 (without the dropouts it
        // holds 10.14 GiB).
        (
            "starcoder2",
            r#"{"architectures": ["Starcoder2ForCausalLM"], "attention_dropout": 0.1, "residual_dropout": 0.1, "embedding_dropout": 0.1, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 3072, "intermediate_size": 12288, "max_position_embeddings": 16384, "model_type": "starcoder2", "num_attention_heads": 24, "num_hidden_layers": 30, "num_key_value_heads": 2, "rope_theta": 999999.4420358813, "sliding_window": 4096, "use_bias": true, "vocab_size": 49152}"#,
            "2",
            "4096",
            &[
                "3030371328 params",
                "a forward of 1 x 4096 tokens in bf16 holds 149.95 GiB a rank",
            ],
        ),
        // OPT-350m's: norms of each residual sum, its embeddings 512 wide
        // projected in and out of the layers' 1024, its dropout of 0.1.
        (
            "opt-350m",
            r#"{"architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_function": "relu", "attention_dropout": 0.0, "do_layer_norm_before": false, "dropout": 0.1, "ffn_dim": 4096, "hidden_size": 1024, "max_position_embeddings": 2048, "num_attention_heads": 16, "num_hidden_layers": 24, "pad_token_id": 1, "vocab_size": 50272, "word_embed_proj_dim": 512}"#,
            "2",
            "2048",
            &[
                "331196416 params",
                "a forward of 1 x 2048 tokens in bf16 holds 1.32 GiB a rank",
            ],
        ),
        // MPT-7B's: ALiBi's biases one mask of 32 heads' scores, 256 MiB
        // at 2048 tokens, that its layers share.
        (
            "mpt-7b",
            r#"{"architectures": ["MptForCausalLM"], "model_type": "mpt", "d_model": 4096, "n_heads": 32, "n_layers": 32, "max_seq_len": 2048, "vocab_size": 50432, "no_bias": true, "attn_config": {"alibi": true, "attn_pdrop": 0.0, "clip_qkv": null}}"#,
            "8",
            "2048",
            &[
                "6649286656 params",
                "a forward of 1 x 2048 tokens in bf16 holds 8.29 GiB a rank",
            ],
        ),
        // ModernBERT-decoder's 150M shape: its first layer attending
        // without a norm, windows of 64 in two layers of three, the
        // dense layer, activation and norm before its head.
        (
            "modernbert-decoder-150m",
            r#"{"model_type": "modernbert-decoder", "vocab_size": 50368, "hidden_size": 768, "intermediate_size": 1152, "num_hidden_layers": 22, "num_attention_heads": 12}"#,
            "2",
            "1024",
            &[
                "149655232 params",
                "a forward of 1 x 1024 tokens in bf16 holds 434.22 MiB a rank",
            ],
        ),
        // Doge's 320M shape: its attention in blocks of queries beside
        // its dynamic mask, its residuals weighted.
        (
            "doge-320m",
            r#"{"model_type": "doge", "vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 32, "num_attention_heads": 8}"#,
            "2",
            "2048",
            &[
                "403055872 params",
                "a forward of 1 x 2048 tokens in bf16 holds 3.46 GiB a rank",
            ],
        ),
        // Mamba-130m's shape: the slow path's fp32 discretised `A`, `B x`
        // and every token's state, 14 bytes a channel, a state and a token
        // in 16 bits.
        (
            "mamba-130m",
            r#"{"model_type": "mamba", "architectures": ["MambaForCausalLM"], "hidden_size": 768, "num_hidden_layers": 24, "vocab_size": 50280, "state_size": 16, "expand": 2, "conv_kernel": 4, "time_step_rank": 48, "intermediate_size": 1536, "use_bias": false, "use_conv_bias": true, "layer_norm_epsilon": 1e-05, "tie_word_embeddings": true}"#,
            "2",
            "2048",
            &[
                "129135360 params",
                "a forward of 1 x 2048 tokens in bf16 holds 17.74 GiB a rank",
            ],
        ),
        // Jamba-v0.1's 52B shape: 28 of its 32 layers that scan, beside
        // attention and experts.
        (
            "jamba-v0.1",
            r#"{"model_type": "jamba", "architectures": ["JambaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 65536, "num_experts": 16, "num_experts_per_tok": 2, "expert_layer_period": 2, "expert_layer_offset": 1, "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 256, "mamba_conv_bias": true, "mamba_proj_bias": false, "rms_norm_eps": 1e-06, "tie_word_embeddings": false, "use_mamba_kernels": true, "max_position_embeddings": 262144}"#,
            "8",
            "2048",
            &[
                "51570323328 params",
                "a forward of 1 x 2048 tokens in bf16 holds 121.75 GiB a rank",
            ],
        ),
        // Mamba2-130m's shape: each chunk of 256 tokens' decays and
        // products in fp32, 12 bytes a head for each token of its chunk.
        (
            "mamba2-130m",
            r#"{"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "hidden_size": 768, "num_hidden_layers": 24, "vocab_size": 50288, "num_heads": 24, "head_dim": 64, "expand": 2, "state_size": 128, "n_groups": 1, "chunk_size": 256, "conv_kernel": 4, "use_bias": false, "use_conv_bias": true, "layer_norm_epsilon": 1e-05, "tie_word_embeddings": true}"#,
            "2",
            "2048",
            &[
                "128989632 params",
                "a forward of 1 x 2048 tokens in bf16 holds 10.22 GiB a rank",
            ],
        ),
        // Bamba-9B's shape: that scan in 29 of its 32 layers.
        (
            "bamba-9b",
            r#"{"model_type": "bamba", "architectures": ["BambaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "attn_layer_indices": [9, 18, 27], "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_chunk_size": 256, "mamba_expand": 2, "mamba_d_conv": 4, "rms_norm_eps": 1e-05, "tie_word_embeddings": false}"#,
            "8",
            "4096",
            &[
                "9780235392 params",
                "a forward of 1 x 4096 tokens in bf16 holds 146.21 GiB a rank",
            ],
        ),
        // Phi-3.5-MoE's shape: sparsemixer's two picks each keeping its
        // softmax over the experts still in play, its input jittered.
        (
            "phi-3.5-moe",
            r#"{"model_type": "phimoe", "architectures": ["PhimoeForCausalLM"], "hidden_size": 4096, "intermediate_size": 6400, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 16, "num_experts_per_tok": 2, "vocab_size": 32064, "max_position_embeddings": 131072, "sliding_window": 131072, "attention_bias": true, "lm_head_bias": true, "rms_norm_eps": 1e-05, "router_jitter_noise": 0.01, "input_jitter_noise": 0.01, "tie_word_embeddings": false}"#,
            "8",
            "4096",
            &[
                "41873153344 params",
                "a forward of 1 x 4096 tokens in bf16 holds 21.10 GiB a rank",
            ],
        ),
        // A Falcon-H1 0.5B-like shape: attention beside a Mamba-2 scan
        // of 24 heads in every layer, its gate without a norm.
        (
            "falcon-h1-0.5b",
            r#"{"model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"], "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 32784, "mamba_d_ssm": 1536, "mamba_n_heads": 24, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_chunk_size": 128, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_rms_norm": false, "max_position_embeddings": 16384, "tie_word_embeddings": false}"#,
            "2",
            "4096",
            &[
                "521411104 params",
                "a forward of 1 x 4096 tokens in bf16 holds 27.82 GiB a rank",
            ],
        ),
    ];
    for (name, json, world, seq, said) in widths {
        let config = hf_config(&dir, name, json);
        let args = ["--world", world, "--seq", seq, "--dtype", "bf16"];
        estimate_says(&config, &args, said);
    }
    // Gemma 2 2B's: its soft-capped scores computed a block of queries
    // at a time and again in backward (one by one they kept 1.63 GiB
    // more); its capped logits computed in blocks by the fused loss
    // (unfused, their tanh and the logits the loss keeps were 0.49 GiB
    // each).
    let gemma2 = hf_config(
        &dir,
        "gemma2",
        r#"{"architectures": ["Gemma2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 256000}"#,
    );
    estimate_says(
        &gemma2,
        &["--world", "2", "--seq", "1024", "--dtype", "bf16"],
        &["a forward of 1 x 1024 tokens in bf16 holds 3.91 GiB a rank"],
    );
    // OLMo 2 1B's: norms after each sublayer only, the whole queries'
    // and keys' too, their normalized values and the turned heads in
    // fp32 (~171 kB a layer and token in bf16, 2.18 GiB at 1024 tokens;
    // the logits the unfused loss keeps would add 0.19).
    let olmo2 = hf_config(
        &dir,
        "olmo2",
        r#"{"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 16, "vocab_size": 100352, "max_position_embeddings": 4096, "rms_norm_eps": 1e-06, "rope_theta": 500000, "pad_token_id": 100277, "tie_word_embeddings": false}"#,
    );
    estimate_says(
        &olmo2,
        &["--world", "2", "--seq", "1024", "--dtype", "bf16"],
        &["a forward of 1 x 1024 tokens in bf16 holds 2.18 GiB a rank"],
    );
    // Widths come from a config, not from a count.
    let (ok, out) = zrt(&[
        "estimate", "--params", "1e9", "--world", "2", "--seq", "256",
    ]);
    assert!(
        !ok && out.contains(
            "--seq counts activations from the layers' widths, which --params does not give"
        ),
        "{out}"
    );
    // LoRA r 16 on every linear layer of the frozen model: the
    // adapters train, the model is frozen (12.62M and 1.1B, the README's
    // real-size run), and the activations are LoRA's.
    let lora = [
        "--dtype",
        "fp32",
        "--lora-r",
        "16",
        "--lora-targets",
        "all-linear",
    ];
    let (ok, out) = zrt(&[&base[..], &lora[..]].concat());
    assert!(ok, "{out}");
    for said in [
        "LoRA r 16 on all-linear: 12615680 adapter params train, the 1100048384 of the model frozen",
        "with 1.100e9 frozen params",
        "stage 3:       2.14 GiB",
        "the largest, `lm_head` (65536000 params, frozen), adds 250.00 MiB",
        "a forward of 1 x 256 tokens in fp32, LoRA r 16 adapters training holds 679.89 MiB a rank",
        "stage 3 in all: 3.05 GiB a rank while it trains",
    ] {
        assert!(out.contains(said), "{said}: {out}");
    }
    // LoRA's dropout: each of the seven adapters of a layer keeps its
    // own dropped input and its mask, where one input was kept for all.
    let (ok, out) = zrt(&[&base[..], &lora[..], &["--lora-dropout", "0.05"]].concat());
    assert!(
        ok && out.contains("LoRA r 16 adapters training holds 1.21 GiB a rank"),
        "{out}"
    );
    // At stage 2 the frozen model is every rank's, whole (4.10 GiB),
    // and no unit is gathered.
    let ds2 = dir.join("ds2.json");
    let (ok, out) = zrt(&[&base[..], &lora[2..], &["--config", ds2.to_str().unwrap()]].concat());
    assert!(
        ok && out.contains("stage 2 in all: 4.88 GiB a rank while it trains")
            && !out.contains("gathers"),
        "{out}"
    );
    // PEFT's default targets for the model's type: Llama's q_proj and
    // v_proj.
    let (ok, out) = zrt(&[
        "estimate",
        "--hf-config",
        tiny,
        "--world",
        "2",
        "--lora-r",
        "8",
    ]);
    assert!(
        ok && out.contains("LoRA r 8 on q_proj,v_proj: 1126400 adapter params"),
        "{out}"
    );
    let (ok, out) = zrt(&[
        "estimate", "--params", "1e6", "--world", "2", "--lora-r", "8",
    ]);
    assert!(
        !ok && out.contains("--lora-r counts the adapters from the layers' widths"),
        "{out}"
    );
    let (ok, out) = zrt(&[&base[..], &["--micro-batch", "0"]].concat());
    assert!(
        !ok && out.contains("--seq and --micro-batch must be at least 1"),
        "{out}"
    );
}

#[test]
fn estimate_counts_a_hugging_face_configs_parameters() {
    let dir = common::scratch("cli-estimate-hf");
    // Llama 3.2 1B (tied) and Qwen2.5 0.5B (tied, q/k/v biases), as
    // their config.json files spell them; the counts are their
    // safetensors files' (Qwen's checked here against a model
    // transformers wrote from that config).
    for (name, json, params, largest) in [
        (
            "llama",
            r#"{"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": true}"#,
            "1235814400 params in 17 units",
            "the largest, `model.embed_tokens` (262668288 params), adds up to 1.96 GiB",
        ),
        (
            "qwen",
            r#"{"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": true, "use_sliding_window": false}"#,
            "494032768 params in 25 units",
            "the largest, `model.embed_tokens` (136134656 params), adds up to 1.01 GiB",
        ),
        // Gemma 3 1B (tied, four norms a layer, query and key norms): its
        // count is transformers' for this config.
        (
            "gemma3",
            r#"{"model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "attn_logit_softcapping": null, "final_logit_softcapping": null, "pad_token_id": 0, "max_position_embeddings": 32768}"#,
            "999885952 params in 27 units",
            "the largest, `model.embed_tokens` (301989888 params), adds up to 2.25 GiB",
        ),
        // Pythia-70M (GPT-NeoX, the head apart) and Phi-2 (the head's
        // bias), as their repositories' config.json files spell them:
        // transformers' counts.
        (
            "pythia",
            r#"{"architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu", "hidden_size": 512, "initializer_range": 0.02, "intermediate_size": 2048, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 8, "num_hidden_layers": 6, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": false, "torch_dtype": "float16", "transformers_version": "4.24.0", "use_cache": true, "use_parallel_residual": true, "vocab_size": 50304}"#,
            "70426624 params in 8 units",
            "the largest, `embed_out` (25755648 params), adds up to 196.50 MiB",
        ),
        (
            "phi2",
            r#"{"_name_or_path": "microsoft/phi-2", "architectures": ["PhiForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 50256, "embd_pdrop": 0.0, "eos_token_id": 50256, "hidden_act": "gelu_new", "hidden_size": 2560, "initializer_range": 0.02, "intermediate_size": 10240, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "model_type": "phi", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "partial_rotary_factor": 0.4, "qk_layernorm": false, "resid_pdrop": 0.1, "rope_scaling": null, "rope_theta": 10000.0, "tie_word_embeddings": false, "torch_dtype": "float16", "transformers_version": "4.37.0", "use_cache": true, "vocab_size": 51200}"#,
            "2779683840 params in 34 units",
            "the largest, `lm_head` (131123200 params), adds up to 1000.39 MiB",
        ),
        // gpt-oss-20b's config as published (its layer_types left out),
        // MXFP4: counted as the bf16 model zrt trains, transformers'.
        (
            "gpt-oss",
            r#"{"architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": false, "pad_token_id": 199999, "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false}, "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.55.0.dev0", "use_cache": true, "vocab_size": 201088, "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}}"#,
            "20914757184 params in 26 units",
            "the largest, `model.layers.23` (823186976 params), adds up to 6.13 GiB",
        ),
    ] {
        let config = dir.join(format!("{name}.json"));
        std::fs::write(&config, json).unwrap();
        let config = config.to_str().unwrap();
        let (ok, out) = zrt(&["estimate", "--hf-config", config, "--world", "8"]);
        assert!(ok && out.contains(params) && out.contains(largest), "{out}");
        assert!(!out.contains("frozen"), "{out}");
        assert!(!out.contains("the language model of"), "{out}");
    }
    // LLaVA 1.5 7B's published config: its language model (every size
    // but the vocabulary `LlamaConfig`'s defaults), counted as
    // transformers counts it, the CLIP tower said to be left out.
    let llava = dir.join("llava.json");
    std::fs::write(
        &llava,
        r#"{"architectures": ["LlavaForConditionalGeneration"], "image_token_index": 32000, "model_type": "llava", "pad_token_id": 32001, "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064}, "tie_word_embeddings": false, "torch_dtype": "float16", "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096, "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768, "vocab_size": 32000}, "vocab_size": 32064}"#,
    )
    .unwrap();
    let (ok, out) = zrt(&[
        "estimate",
        "--hf-config",
        llava.to_str().unwrap(),
        "--world",
        "8",
    ]);
    assert!(
        ok && out.contains("6738939904 params in 34 units")
            && out
                .contains(r#"the language model of a "llava" checkpoint, which zrt trains alone"#),
        "{out}"
    );
    // MiniMax's decay buffers, held as frozen parameters, are counted as
    // frozen: its second layer's (4 heads, blocks of 256), 4 x (1 + 2 x
    // 256 + 256^2).
    let minimax = dir.join("minimax.json");
    std::fs::write(
        &minimax,
        r#"{"model_type": "minimax", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#,
    )
    .unwrap();
    let minimax = minimax.to_str().unwrap();
    let (ok, out) = zrt(&["estimate", "--hf-config", minimax, "--world", "8"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("and 264196 values of buffers its class writes into its files")
            && out.contains("with 2.642e5 frozen params"),
        "{out}"
    );
    // Either the count or the config, not both; a config zrt does not
    // build is refused naming its model_type.
    let llama = dir.join("llama.json");
    let llama = llama.to_str().unwrap();
    let (ok, out) = zrt(&[
        "estimate",
        "--hf-config",
        llama,
        "--params",
        "5",
        "--world",
        "2",
    ]);
    assert!(!ok && out.contains("cannot be used with"), "{out}");
    // A Mamba's class defaults count as transformers counts them.
    let mamba = dir.join("mamba.json");
    std::fs::write(&mamba, r#"{"model_type": "mamba"}"#).unwrap();
    let (ok, out) = zrt(&[
        "estimate",
        "--hf-config",
        mamba.to_str().unwrap(),
        "--world",
        "2",
    ]);
    assert!(ok && out.contains("159308544 params"), "{out}");
    // So do RWKV's (RWKV-4 at 4096 wide, 32 blocks).
    let rwkv = dir.join("rwkv.json");
    std::fs::write(&rwkv, r#"{"model_type": "rwkv"}"#).unwrap();
    let (ok, out) = zrt(&[
        "estimate",
        "--hf-config",
        rwkv.to_str().unwrap(),
        "--world",
        "2",
    ]);
    assert!(ok && out.contains("7392649216 params"), "{out}");
    // Zamba2's class defaults (2.7B's sizes) count as transformers
    // counts them, each shared block once.
    let zamba2 = dir.join("zamba2.json");
    std::fs::write(&zamba2, r#"{"model_type": "zamba2"}"#).unwrap();
    let (ok, out) = zrt(&[
        "estimate",
        "--hf-config",
        zamba2.to_str().unwrap(),
        "--world",
        "2",
    ]);
    assert!(ok && out.contains("2481848336 params"), "{out}");
    // So do the first Zamba's (Zamba 7B's sizes), its shared block once.
    let zamba = dir.join("zamba.json");
    std::fs::write(&zamba, r#"{"model_type": "zamba"}"#).unwrap();
    let (ok, out) = zrt(&[
        "estimate",
        "--hf-config",
        zamba.to_str().unwrap(),
        "--world",
        "2",
    ]);
    assert!(ok && out.contains("7232490496 params"), "{out}");
    // And xLSTM's (xLSTM 7B's sizes).
    let xlstm = dir.join("xlstm.json");
    std::fs::write(&xlstm, r#"{"model_type": "xlstm"}"#).unwrap();
    let (ok, out) = zrt(&[
        "estimate",
        "--hf-config",
        xlstm.to_str().unwrap(),
        "--world",
        "2",
    ]);
    assert!(ok && out.contains("6865424896 params"), "{out}");
    // A model_type zrt does not build is named, and why.
    let gemma3n = dir.join("gemma3n.json");
    std::fs::write(&gemma3n, r#"{"model_type": "gemma3n_text"}"#).unwrap();
    let (ok, out) = zrt(&[
        "estimate",
        "--hf-config",
        gemma3n.to_str().unwrap(),
        "--world",
        "2",
    ]);
    assert!(
        !ok && out.contains("model_type \"gemma3n_text\": zrt builds")
            && out.contains("(not this one: Gemma 3n is not built: transformers 4.57 computes"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `zrt dequantize` writes an MXFP4 checkpoint's experts out in bf16
/// (`zrt::mxfp4`; `tests/from_hf.rs` checks the values against
/// `transformers`), and refuses, naming why, a checkpoint that is not
/// MXFP4 and an `--out` that is its `--from`.
#[test]
fn dequantize_writes_an_mxfp4_checkpoint_in_bf16_and_refuses_what_it_cannot() {
    use tch::{Kind, Tensor};
    let dir = common::scratch("cli-dequantize");
    let (from, out) = (dir.join("q"), dir.join("out"));
    std::fs::create_dir_all(&from).unwrap();
    std::fs::write(
        from.join("config.json"),
        r#"{"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}"#,
    )
    .unwrap();
    // Two experts of a 64-wide matrix's 3 rows (two blocks a row): every
    // code 0x22 (1.0 twice), scale 2^1; a norm copied as it is.
    let blocks = Tensor::full([2, 3, 2, 16], 0x22, (Kind::Uint8, tch::Device::Cpu));
    let scales = Tensor::full([2, 3, 2], 128, (Kind::Uint8, tch::Device::Cpu));
    let norm = Tensor::ones([4], (Kind::Float, tch::Device::Cpu));
    Tensor::write_safetensors(
        &[
            ("e.down_proj_blocks", blocks),
            ("e.down_proj_scales", scales),
            ("norm.weight", norm.shallow_clone()),
        ],
        from.join("model.safetensors"),
    )
    .unwrap();
    let (f, o) = (from.to_str().unwrap(), out.to_str().unwrap());
    let (ok, said) = zrt(&["dequantize", "--from", f, "--out", o]);
    assert!(ok && said.contains("dequantized 1 tensors"), "{said}");
    let written: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(out.join("model.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    let w = &written["e.down_proj"];
    assert_eq!((w.kind(), w.size()), (Kind::BFloat16, vec![2, 64, 3]));
    assert!(w.to_kind(Kind::Float).eq(2.0).all().int64_value(&[]) == 1);
    assert!(written["norm.weight"].equal(&norm) && written.len() == 2);
    let config = std::fs::read_to_string(out.join("config.json")).unwrap();
    assert!(!config.contains("quantization_config"), "{config}");
    let (ok, said) = zrt(&["dequantize", "--from", f, "--out", f]);
    assert!(
        !ok && said.contains("would overwrite the quantized one"),
        "{said}"
    );
    let (ok, said) = zrt(&["dequantize", "--from", o, "--out", f]);
    assert!(!ok && said.contains("no quantization_config"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tiny Llama's `config.json` for `zrt bench hf`, under `name`.
fn tiny_hf_config(name: &str, model_type: &str) -> String {
    config_file(
        name,
        &format!(
            r#"{{"model_type": "{model_type}", "architectures": ["LlamaForCausalLM"], "vocab_size": 300,
                "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2}}"#
        ),
    )
}

/// `zrt bench hf --config CONFIG` of one round of three steps at 16
/// tokens, JSON rows, with `more` arguments.
fn bench_hf(config: &str, more: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_zrt"))
        .args(["bench", "hf", "--config", config, "--seq", "16", "--json"])
        .args(["--rounds", "1", "--steps", "3"])
        .args(more)
        .output()
        .unwrap()
}

/// The JSON rows a `--json` bench printed.
fn json_rows(o: &std::process::Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn bench_hf_trains_zrt_and_transformers_from_the_same_weights_to_the_same_losses() {
    // The peer writes the checkpoint zrt loads; both take three AdamW
    // steps on the same tokens, so their losses must agree, first and
    // last; zrt's head fused with its loss, and with `--unfused-loss`
    // not.
    let f = tiny_hf_config("bench-hf", "llama");
    let (o, apart) = (bench_hf(&f, &[]), bench_hf(&f, &["--unfused-loss"]));
    std::fs::remove_file(&f).unwrap();
    for (o, fused) in [(&apart, false), (&o, true)] {
        assert!(o.status.success(), "{}", common::printed(o));
        let rows = json_rows(o);
        let fusing: Vec<_> = rows.iter().map(|r| r["fused_loss"].as_bool()).collect();
        assert_eq!(fusing, [Some(fused), Some(false)], "{rows:?}");
    }
    assert!(o.status.success(), "{}", common::printed(&o));
    let rows = json_rows(&o);
    assert_eq!(rows.len(), 2, "{rows:?}");
    let (ours, theirs) = (&rows[0], &rows[1]);
    assert_eq!(
        (ours["impl"].as_str(), theirs["impl"].as_str()),
        (Some("zrt"), Some("transformers"))
    );
    assert_eq!(ours["model_type"], "llama");
    for key in ["first_loss", "last_loss"] {
        let (a, b) = (ours[key].as_f64().unwrap(), theirs[key].as_f64().unwrap());
        assert!((a - b).abs() < 1e-4, "{key}: zrt {a}, transformers {b}");
    }
    // Three steps of AdamW moved the weights: the last loss is another.
    let (first, last) = (
        ours["first_loss"].as_f64().unwrap(),
        ours["last_loss"].as_f64().unwrap(),
    );
    assert!(last < first - 1e-3, "{first} -> {last}");
    // The peer's ratio to itself is 1; zrt's is its time over the peer's.
    assert_eq!(theirs["ratio_vs_peer"].as_f64(), Some(1.0));
    let ratio = ours["ratio_vs_peer"].as_f64().unwrap();
    let expected =
        theirs["seconds_per_step"].as_f64().unwrap() / ours["seconds_per_step"].as_f64().unwrap();
    assert!(
        (ratio - expected).abs() < 1e-9 && ratio > 0.0,
        "{ratio} {expected}"
    );
    // Each side's step in its parts, every one timed.
    for row in &rows {
        for part in ["forward_s", "backward_s", "optimizer_s"] {
            let secs = row[part].as_f64().unwrap_or(f64::NAN);
            assert!(secs > 0.0 && secs < 60.0, "{part} {row}");
        }
        // Each process holds libtorch and a model: more than 50 MiB,
        // well under the host.
        let peak = row["peak_rss_bytes"].as_f64().unwrap_or(f64::NAN);
        assert!(peak > 50e6 && peak < 8e9, "{row}");
    }
    let mfu = ours["ratio_vs_limit"].as_f64().unwrap();
    assert!(mfu > 0.0 && mfu < 1.5, "{mfu}");
}

#[test]
fn bench_hf_trains_lora_adapters_from_peft_s_draw_to_peft_s_losses() {
    // The peer draws PEFT's adapters and writes them; zrt starts from
    // them, so both train the same parameters (the bench refuses
    // counts that differ) to the same losses, on PEFT's default targets
    // for the layout and on every linear layer; the fused loss's head
    // is frozen.
    let f = tiny_hf_config("bench-hf-lora", "llama");
    let lora = ["--lora-r", "4"];
    let all = [&lora[..], &["--lora-targets", "all-linear"]].concat();
    let outs = [bench_hf(&f, &lora), bench_hf(&f, &all)];
    std::fs::remove_file(&f).unwrap();
    let mut moved = 0.0f64;
    for o in &outs {
        assert!(o.status.success(), "{}", common::printed(o));
        let rows = json_rows(o);
        assert_eq!(rows.len(), 2, "{rows:?}");
        let (ours, theirs) = (&rows[0], &rows[1]);
        assert_eq!(
            (ours["lora_r"].as_i64(), theirs["lora_r"].as_i64()),
            (Some(4), Some(4))
        );
        for key in ["first_loss", "last_loss"] {
            let (a, b) = (ours[key].as_f64().unwrap(), theirs[key].as_f64().unwrap());
            assert!((a - b).abs() < 1e-5, "{key}: zrt {a}, PEFT {b}");
        }
        moved =
            moved.max(ours["first_loss"].as_f64().unwrap() - ours["last_loss"].as_f64().unwrap());
    }
    assert!(moved > 1e-6, "the adapters did not train: {moved}");
}

#[test]
fn bench_hf_refuses_a_layout_zrt_does_not_build_before_starting_the_peer() {
    let f = tiny_hf_config("bench-hf-unknown", "no_such_model");
    // A "Python" that fails: the refusal must come before it would run.
    let o = Command::new(env!("CARGO_BIN_EXE_zrt"))
        .args(["bench", "hf", "--config", &f])
        .env("ZRT_PYTHON", "/bin/false")
        .output()
        .unwrap();
    std::fs::remove_file(&f).unwrap();
    let out = common::printed(&o);
    assert!(!o.status.success(), "{out}");
    assert!(
        out.contains(&format!("--config {f}")) && out.contains("no_such_model"),
        "{out}"
    );
    assert!(!out.contains("peer"), "{out}");
}
