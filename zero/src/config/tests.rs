use std::path::PathBuf;

use super::*;

/// `../shared/ds-configs` beside the checkout (CI lays shared/ there), or
/// `$ZRT_DS_CONFIGS`.
fn fixtures() -> PathBuf {
    std::env::var_os("ZRT_DS_CONFIGS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/ds-configs")
        })
}

fn hints() -> AutoHints {
    AutoHints {
        hidden_size: Some(64),
        micro_batch: Some(2),
        gradient_accumulation_steps: None,
        lr: Some(1e-4),
        weight_decay: Some(0.0),
        ..Default::default()
    }
}

#[test]
fn every_shared_deepspeed_config_loads_and_resolves() {
    let dir = fixtures();
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| {
            panic!(
                "the DeepSpeed fixtures must be at {} ({e}); set ZRT_DS_CONFIGS",
                dir.display()
            )
        })
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    assert!(
        files.len() >= 8,
        "expected the shared fixtures, found {files:?}"
    );
    for f in files {
        let c = Config::from_file(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        // A world that divides every fixture's batch.
        let r = c
            .resolve(1, &hints())
            .unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        assert_eq!(r.batch.train, r.batch.micro * r.batch.gas);
    }
}

#[test]
fn fixtures_read_as_deepspeed_means_them() {
    let c = Config::from_file(
        fixtures().join("deepspeed_autotuning_config_templates_template_zero3.json"),
    )
    .unwrap();
    assert_eq!(c.zero.stage, 3);
    assert_eq!(c.zero.reduce_bucket_size, Setting::Value(500_000_000));
    assert_eq!(
        c.zero.stage3_param_persistence_threshold,
        Setting::Value(1_000_000)
    );
    assert!(!c.zero.overlap_comm);
    assert!(
        c.warnings
            .iter()
            .any(|w| w.contains("`zero_optimization.sub_group_size`")),
        "{:?}",
        c.warnings
    );

    let c = Config::from_file(
        fixtures().join("tests_model_BingBertSquad_deepspeed_bsz24_fp16_zero2_config.json"),
    )
    .unwrap();
    assert_eq!(c.optimizer.lr, Setting::Value(3e-5));
    assert!(!c.optimizer.bias_correction);
    assert!(
        matches!(c.precision, Precision::Fp16(LossScaleConfig { loss_scale, initial_scale_power: 16, .. }) if loss_scale == 0.0)
    );
    let r = c.resolve(2, &hints()).unwrap();
    assert_eq!(
        r.batch,
        Batch {
            train: 24,
            micro: 3,
            gas: 4
        }
    );

    let c = Config::from_file(
        fixtures().join("tests_model_Megatron_GPT2_ds_config_func_bs8_zero2_offload.json"),
    )
    .unwrap();
    assert_eq!(
        c.zero.offload_optimizer.as_ref().map(|o| o.device),
        Some(OffloadDevice::Cpu)
    );
    assert!(
        c.warnings
            .iter()
            .any(|w| w.contains("`zero_optimization.cpu_offload` is deprecated")),
        "{:?}",
        c.warnings
    );

    let c = Config::from_file(fixtures().join("tests_torch_compile_ds_config_z3.json")).unwrap();
    assert_eq!(
        c.precision,
        Precision::Bf16 {
            check_grad_overflow: false
        }
    );
    assert_eq!(c.optimizer.betas, (0.8, 0.999));
    assert!(
        c.warnings
            .iter()
            .any(|w| w.contains("`bf16.loss_scale` has no effect")),
        "{:?}",
        c.warnings
    );
    assert!(
        !c.warnings.iter().any(|w| w.contains("unknown key `bf16.")),
        "{:?}",
        c.warnings
    );
    assert!(matches!(
        c.scheduler,
        Some(SchedulerConfig::WarmupLR {
            warmup_num_steps: 1000,
            ..
        })
    ));
}

fn problems(json: &str) -> Vec<String> {
    Config::from_json(json)
        .err()
        .map(|e| e.problems)
        .unwrap_or_default()
}

#[test]
fn an_unknown_zero_key_is_an_error_naming_the_closest_key() {
    let p = problems(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sze": 5e8}}"#,
    );
    assert_eq!(
        p,
        ["unknown key `zero_optimization.stage3_prefetch_bucket_sze`; did you mean `zero_optimization.stage3_prefetch_bucket_size`?"]
    );
    let p = problems(
        r#"{"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memroy": true}}}"#,
    );
    assert_eq!(
        p,
        ["unknown key `zero_optimization.offload_optimizer.pin_memroy`; did you mean `zero_optimization.offload_optimizer.pin_memory`?"]
    );
}

#[test]
fn a_key_given_twice_is_an_error_naming_it() {
    let p = problems(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3, "overlap_comm": true, "stage": 1}}"#,
    );
    assert_eq!(
        p,
        ["`zero_optimization.stage` is given twice: JSON keeps only the last value, which is rarely what was meant; keep one"]
    );
}

#[test]
fn every_problem_is_reported_at_once() {
    let e = Config::from_json(
        r#"{"fp16": {"enabled": true}, "bf16": {"enabled": true}, "optimizer": {"type": "Adadelta"},
            "zero_optimization": {"stage": 4, "bogus": 1}, "gradient_clipping": -1}"#,
    )
    .unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("5 problem(s) in the DeepSpeed config:"),
        "{text}"
    );
    for want in [
        "`fp16.enabled` and `bf16.enabled` are both true",
        "`optimizer.type` \"adadelta\" is not supported by zrt: use \"Adam\", \"AdamW\", \"Lion\", \"SGD\", \"Lamb\", \"Adagrad\", \"RMSprop\" or \"Muon\"",
        "`zero_optimization.stage` must be 0, 1, 2 or 3, got 4",
        "unknown key `zero_optimization.bogus`",
        "`gradient_clipping` must be >= 0",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
}

#[test]
fn the_batch_rule_completes_or_names_the_numbers() {
    let r = |json: &str, world| {
        Config::from_json(json)
            .unwrap()
            .resolve(world, &AutoHints::default())
    };
    assert_eq!(
        r(
            r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}"#,
            2
        )
        .unwrap()
        .batch,
        Batch {
            train: 32,
            micro: 4,
            gas: 4
        }
    );
    assert_eq!(
        r(
            r#"{"train_batch_size": 32, "gradient_accumulation_steps": 2}"#,
            4
        )
        .unwrap()
        .batch,
        Batch {
            train: 32,
            micro: 4,
            gas: 2
        }
    );
    assert_eq!(
        r(
            r#"{"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 3}"#,
            2
        )
        .unwrap()
        .batch,
        Batch {
            train: 48,
            micro: 8,
            gas: 3
        }
    );
    assert_eq!(
        r(r#"{"train_batch_size": 8}"#, 2).unwrap().batch,
        Batch {
            train: 8,
            micro: 4,
            gas: 1
        }
    );
    assert_eq!(
        r(r#"{"train_micro_batch_size_per_gpu": 4}"#, 3)
            .unwrap()
            .batch,
        Batch {
            train: 12,
            micro: 4,
            gas: 1
        }
    );
    // A batch size written as a string other than "auto" is not a number.
    let e = Config::from_json(r#"{"train_batch_size": "32"}"#).unwrap_err();
    assert_eq!(
        e.problems,
        ["`train_batch_size` must be a number, got \"32\""]
    );
    let e = r(r#"{"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}"#, 2).unwrap_err();
    assert_eq!(e.problems, ["train_batch_size 24 != train_micro_batch_size_per_gpu 3 x gradient_accumulation_steps 2 x world 2 (= 12)"]);
    let e = r(
        r#"{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}"#,
        2,
    )
    .unwrap_err();
    assert_eq!(
        e.problems,
        ["train_batch_size 10 is not divisible by train_micro_batch_size_per_gpu 4 x world 2"]
    );
    let e = r(r#"{"zero_optimization": {"stage": 1}}"#, 2).unwrap_err();
    assert!(
        e.problems[0].starts_with("set `train_batch_size` or `train_micro_batch_size_per_gpu`"),
        "{e}"
    );
}

#[test]
fn auto_values_resolve_as_hugging_face_does_or_say_what_is_missing() {
    let json = r#"{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"}}"#;
    let c = Config::from_json(json).unwrap();
    let r = c.resolve(2, &hints()).unwrap();
    assert_eq!(
        r.batch,
        Batch {
            train: 4,
            micro: 2,
            gas: 1
        }
    );
    assert_eq!(r.config.zero.reduce_bucket_size, Setting::Value(4096));
    assert_eq!(
        r.config.zero.stage3_prefetch_bucket_size,
        Setting::Value(3686)
    );
    assert_eq!(
        r.config.zero.stage3_param_persistence_threshold,
        Setting::Value(640)
    );
    assert_eq!(r.config.optimizer.lr, Setting::Value(1e-4));
    // train_batch_size "auto" is the product of the other two and the world.
    let with_gas = AutoHints {
        gradient_accumulation_steps: Some(3),
        ..hints()
    };
    assert_eq!(
        c.resolve(4, &with_gas).unwrap().batch,
        Batch {
            train: 24,
            micro: 2,
            gas: 3
        }
    );
    // A zero from the program is named as the program's, not blamed on
    // train_batch_size.
    let zero_micro = AutoHints {
        micro_batch: Some(0),
        ..hints()
    };
    let e = c.resolve(2, &zero_micro).unwrap_err();
    assert_eq!(
        e.problems,
        ["train_micro_batch_size_per_gpu 0 and gradient_accumulation_steps 1 must both be at least 1: check the values the program passes in AutoHints"]
    );
    let e = c.resolve(2, &AutoHints::default()).unwrap_err();
    assert!(e.problems.iter().any(|p| p.starts_with("`zero_optimization.reduce_bucket_size` is \"auto\" but the program gave no hidden size")), "{e}");
    assert!(
        e.problems
            .iter()
            .any(|p| p.starts_with("`train_micro_batch_size_per_gpu` is \"auto\"")),
        "{e}"
    );
}

#[test]
fn hybrid_sizes_must_divide_the_world() {
    let c = Config::from_json(
        r#"{"train_batch_size": 12, "zero_optimization": {"stage": 3, "mics_shard_size": 4}}"#,
    )
    .unwrap();
    assert_eq!(c.zero.mics_shard_size, Some(4));
    let e = c.resolve(6, &AutoHints::default()).unwrap_err();
    assert_eq!(
        e.problems,
        ["`zero_optimization.mics_shard_size` 4 must divide the world size 6"]
    );
    // A size that divides the world resolves.
    let c = Config::from_json(
        r#"{"train_batch_size": 12, "zero_optimization": {"stage": 3, "mics_shard_size": 2}}"#,
    )
    .unwrap();
    assert!(c.resolve(6, &AutoHints::default()).is_ok());
    let c = Config::from_json(
        r#"{"train_batch_size": 8, "zero_optimization": {"mics_shard_size": -1}}"#,
    )
    .unwrap();
    assert_eq!(c.zero.mics_shard_size, None);
}

#[test]
fn known_but_unimplemented_keys_warn_and_nvme_needs_a_path() {
    let c = Config::from_json(r#"{"train_batch_size": 8, "activation_checkpointing": {}, "sparse_attention": {"mode": "fixed"}}"#).unwrap();
    assert!(c.warnings.iter().any(|w| w.starts_with("`activation_checkpointing` is a DeepSpeed setting zrt does not implement; it is ignored: it tunes DeepSpeed's own checkpointing") && w.contains("zrt::zero::activation::Checkpointed")), "{:?}", c.warnings);
    assert!(
        c.warnings.iter().any(|w| {
            w
            == "`sparse_attention` is a DeepSpeed setting zrt does not implement yet; it is ignored"
        }),
        "{:?}",
        c.warnings
    );
    let p =
        problems(r#"{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}"#);
    assert_eq!(p, ["`zero_optimization.offload_optimizer.device` is \"nvme\" but `zero_optimization.offload_optimizer.nvme_path` is missing: name a directory on the NVMe drive"]);
    let p = problems(
        r#"{"zero_optimization": {"reduce_bucket_size": 0.5, "stage3_max_live_parameters": "many"}}"#,
    );
    assert_eq!(p.len(), 2, "{p:?}");
    assert!(
        p[0].contains("`zero_optimization.reduce_bucket_size` must be a whole number"),
        "{p:?}"
    );
}

#[test]
fn settings_of_deepspeeds_own_implementation_warn_unless_they_ask_for_what_zrt_does() {
    // DeepSpeed's defaults, as configs spell them out: quiet.
    let quiet = Config::from_json(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2, "contiguous_gradients": true,
            "reduce_scatter": true, "allgather_partitions": true, "allgather_bucket_size": 5e8,
            "stage3_max_reuse_distance": 1e9}}"#,
    )
    .unwrap();
    assert!(quiet.warnings.is_empty(), "{:?}", quiet.warnings);
    assert_eq!(quiet.zero.allgather_bucket_size, 500_000_000);
    // Anything else: each named, with what zrt does, and the value kept
    // (the ranks still agree on it).
    let loud = Config::from_json(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2, "contiguous_gradients": false,
            "reduce_scatter": false, "allgather_partitions": false, "allgather_bucket_size": 2e8,
            "max_reuse_distance": 5}}"#,
    )
    .unwrap();
    assert_eq!(loud.zero.allgather_bucket_size, 200_000_000);
    assert_eq!(loud.zero.stage3_max_reuse_distance, 5);
    for (key, does) in [
        ("contiguous_gradients` = false", "contiguous flat buffers"),
        (
            "reduce_scatter` = false",
            "always reduce-scatters gradients",
        ),
        (
            "allgather_partitions` = false",
            "always all-gathers the updated shards",
        ),
        (
            "allgather_bucket_size` = 200000000.0",
            "the unit is the bucket",
        ),
        ("max_reuse_distance` = 5", "re-gathers the others"),
    ] {
        assert!(
            loud.warnings.iter().any(|w| w
                .starts_with(&format!("`zero_optimization.{key} is a DeepSpeed setting zrt does not implement; it is ignored: "))
                && w.contains(does)),
            "{key}: {:?}",
            loud.warnings
        );
    }
    assert_eq!(loud.warnings.len(), 5, "{:?}", loud.warnings);
}

#[test]
fn bf16_immediate_grad_update_false_warns_that_zrt_accumulates_in_fp32_anyway() {
    let cfg = |v: &str| {
        Config::from_json(&format!(
            r#"{{"train_batch_size": 8, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
                "bf16": {{"enabled": true, "immediate_grad_update": {v}}}}}"#
        ))
    };
    assert!(cfg("true").unwrap().warnings.is_empty());
    let w = cfg("false").unwrap().warnings;
    assert!(
        w.len() == 1 && w[0].starts_with("`bf16.immediate_grad_update` = false is ignored: zrt adds each micro-step's gradients into fp32 buffers"),
        "{w:?}"
    );
    let e = cfg("1").unwrap_err().to_string();
    assert!(e.contains("bf16.immediate_grad_update"), "{e}");
}

#[test]
fn unimplemented_keys_set_to_what_zrt_does_anyway_pass_silently() {
    let quiet = Config::from_json(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "prescale_gradients": false, "gradient_predivide_factor": 1.0,
            "flops_profiler": {"enabled": false}, "wandb": {"enabled": false},
            "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": true,
                "ignore_unused_parameters": true, "round_robin_gradients": false}}"#,
    )
    .unwrap();
    assert!(quiet.warnings.is_empty(), "{:?}", quiet.warnings);
    let loud = Config::from_json(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "prescale_gradients": true, "wandb": {"enabled": true},
            "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": false}}"#,
    )
    .unwrap();
    assert_eq!(loud.warnings.len(), 3, "{:?}", loud.warnings);
    assert!(loud.warnings.iter().any(|w| w.starts_with("`prescale_gradients` = true is a DeepSpeed setting zrt does not implement; it is ignored: zrt reduces gradients in fp32")), "{:?}", loud.warnings);
    assert!(
        loud.warnings.iter().any(|w| w
            .starts_with("`zero_optimization.stage3_gather_16bit_weights_on_model_save` = false")
            && w.contains("save_16bit_model gathers the weights whatever this says")),
        "{:?}",
        loud.warnings
    );
    assert!(
        loud.warnings.iter().any(|w| w
            == "`wandb` is a DeepSpeed setting zrt does not implement; it is ignored: zrt has no client for that service; the monitors it writes are `csv_monitor` and `tensorboard` (files TensorBoard and any CSV reader open)"),
        "{:?}",
        loud.warnings
    );
}

#[test]
fn more_of_deepspeeds_defaults_spelled_out_pass_silently_and_other_values_warn() {
    // What a full DeepSpeed config spells out at its defaults: quiet, the
    // offload blocks' own keys too (pinned memory means nothing without
    // an offload).
    let quiet = Config::from_json(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "dump_state": false, "memory_breakdown": false, "sparse_gradients": false,
            "zero_force_ds_cpu_optimizer": true, "zero_allow_untested_optimizer": true,
            "seq_parallel_communication_data_type": "fp32",
            "zero_optimization": {"stage": 3, "sub_group_size": 1e9, "memory_efficient_linear": true,
                "log_trace_cache_warnings": false, "stage3_module_granularity_threshold": 0,
                "use_multi_rank_bucket_allreduce": true,
                "offload_optimizer": {"device": "none", "pin_memory": true, "ratio": 1, "fast_init": false},
                "offload_param": {"device": "none", "pin_memory": true, "max_in_cpu": 1e9}}}"#,
    )
    .unwrap();
    assert!(quiet.warnings.is_empty(), "{:?}", quiet.warnings);
    let loud = Config::from_json(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "dump_state": true, "memory_breakdown": true, "sparse_gradients": true,
            "zero_force_ds_cpu_optimizer": false, "zero_allow_untested_optimizer": false,
            "seq_parallel_communication_data_type": "bf16", "checkpoint": {"tag_validation": "Warn"},
            "zero_optimization": {"stage": 3, "sub_group_size": 1e12, "memory_efficient_linear": false,
                "log_trace_cache_warnings": true, "module_granularity_threshold": 100,
                "use_multi_rank_bucket_allreduce": false,
                "offload_optimizer": {"device": "cpu", "pin_memory": true, "ratio": 0.5, "fast_init": true},
                "offload_param": {"device": "nvme", "nvme_path": "/tmp", "pin_memory": true, "max_in_cpu": 1e6}}}"#,
    )
    .unwrap();
    for (key, does) in [
        ("sparse_gradients` = true", "every gradient dense"),
        (
            "zero_force_ds_cpu_optimizer` = false",
            "its own Adam kernel",
        ),
        (
            "seq_parallel_communication_data_type` = \"bf16\"",
            "no sequence parallelism",
        ),
        (
            "zero_optimization.sub_group_size` = 1000000000000.0",
            "one unit at a time",
        ),
        (
            "zero_optimization.memory_efficient_linear` = false",
            "frees gathered weights in place",
        ),
        (
            "zero_optimization.log_trace_cache_warnings` = true",
            "logs nothing about it",
        ),
        (
            "zero_optimization.module_granularity_threshold` = 100",
            "wraps in ShardedModule",
        ),
        (
            "zero_optimization.use_multi_rank_bucket_allreduce` = false",
            "one collective",
        ),
    ] {
        assert!(
            loud.warnings.iter().any(|w| w.starts_with(&format!(
                "`{key} is a DeepSpeed setting zrt does not implement; it is ignored: "
            )) && w.contains(does)),
            "{key}: {:?}",
            loud.warnings
        );
    }
    for w in [
        "`checkpoint.tag_validation` = \"Warn\" is not what zrt does: it fails a save whose ranks give different tags, as \"Fail\" does",

        "`zero_optimization.offload_optimizer.ratio` = 0.5 is not honoured by zrt",
        "`zero_optimization.offload_optimizer.fast_init` = true is not honoured by zrt",
        "`zero_optimization.offload_param.max_in_cpu` = 1000000.0 is not honoured by zrt",
        "`zero_optimization.offload_param.pin_memory` has no effect on a CPU-only run",
    ] {
        assert!(
            loud.warnings.iter().any(|x| x.starts_with(w)),
            "{w}: {:?}",
            loud.warnings
        );
    }
    // The eight above, those five, and "cpu" offload's own; no pin_memory
    // warning for "cpu" (its device warning says it), none for the
    // permission to bring an optimizer (zrt takes none), none for
    // `memory_breakdown` and `dump_state` (zrt logs both since
    // 2026-12-01).
    assert_eq!(loud.warnings.len(), 14, "{:?}", loud.warnings);
    assert!(loud.dump_state && !quiet.dump_state);
}

#[test]
fn the_checkpoint_block_is_checked_and_says_what_zrt_does_instead() {
    let with = |block: &str| {
        Config::from_json(&format!(
            r#"{{"train_batch_size": 8, "optimizer": {{"type": "AdamW"}}, "checkpoint": {block}}}"#
        ))
    };
    // What zrt does anyway: silent (DeepSpeed upper-cases the mode).
    let quiet = with(r#"{"tag_validation": "fail", "load_universal": false, "use_node_local_storage": false, "parallel_write": {"pipeline_stage": false}}"#).unwrap();
    assert!(quiet.warnings.is_empty(), "{:?}", quiet.warnings);
    let loud = with(r#"{"tag_validation": "Ignore", "load_universal": true, "use_node_local_storage": true, "parallel_write": {"pipeline_stage": true}}"#).unwrap();
    assert_eq!(
        loud.warnings,
        [
            "`checkpoint.tag_validation` = \"Ignore\" is not what zrt does: it fails a save whose ranks give different tags, as \"Fail\" does (their files would go to different directories, none of them a whole checkpoint)",
            "`checkpoint.load_universal` = true is not needed: zrt's checkpoints load on any world size and stage as saved (DeepSpeed's universal checkpoint folders are not a format zrt reads)",
            "`checkpoint.use_node_local_storage` = true is not implemented by zrt; it is ignored: rank 0 commits one checkpoint directory, which on several nodes must be storage every rank shares (a rank that cannot write into it fails the save, naming itself)",
            "`checkpoint.parallel_write.pipeline_stage` = true has no effect: zrt has no pipeline stages, and every rank writes its own file already",
        ]
    );
    assert_eq!(
        with(r#"{"tag_validation": "Strict", "tag_validaton": 1, "parallel_write": true}"#)
            .unwrap_err()
            .problems,
        [
            "unknown key `checkpoint.tag_validaton`; did you mean `checkpoint.tag_validation`?",
            "`checkpoint.tag_validation` must be \"Ignore\", \"Warn\" or \"Fail\", got \"Strict\"",
            "`checkpoint.parallel_write` must be an object, got true",
        ]
    );
}

#[test]
fn a_scheduler_value_per_parameter_group_is_refused_pointing_at_the_plans_scales() {
    let e = Config::from_json(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0,
                "warmup_max_lr": [1e-3, 1e-4], "warmup_num_steps": 10}}}"#,
    )
    .unwrap_err();
    assert_eq!(
        e.problems,
        ["`scheduler.params.warmup_max_lr` is a list, DeepSpeed's form for one value per optimizer parameter group, got [0.001,0.0001]: zrt's config has no parameter groups; give one number and scale the groups' rates against it with ShardPlan::scale_learning_rate"]
    );
}

#[test]
fn check_reports_parse_and_resolve_problems_together() {
    let e = Config::check(
        r#"{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sze": 1}}"#,
        2,
        &AutoHints::default(),
    )
    .unwrap_err();
    assert_eq!(e.problems.len(), 2, "{e}");
    assert!(e.problems[0].contains("stage3_prefetch_bucket_sze"));
    assert_eq!(
        e.problems[1],
        "train_batch_size 10 is not divisible by train_micro_batch_size_per_gpu 4 x world 2"
    );
}

#[test]
fn numbers_are_whole_where_counts_are_meant_and_strings_are_auto_only() {
    assert_eq!(Setting::<u64>::Auto.value(), None);
    assert_eq!(Setting::Value(3u64).value(), Some(3));
    let c = Config::from_json(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 0, "allgather_bucket_size": 9e15}}"#,
    )
    .unwrap();
    assert_eq!(
        (c.zero.stage, c.zero.allgather_bucket_size),
        (0, 9_000_000_000_000_000)
    );
    for (json, want) in [
        (
            r#"{"train_batch_size": 8, "zero_optimization": {"stage": -1}}"#,
            "`zero_optimization.stage` must be a whole number from 0 to 9e15 (5e8 is fine), got -1",
        ),
        (
            r#"{"train_batch_size": 8, "zero_optimization": {"allgather_bucket_size": 1e16}}"#,
            "`zero_optimization.allgather_bucket_size` must be a whole number from 0 to 9e15 (5e8 is fine), got 1e+16",
        ),
        (
            r#"{"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": "big"}}"#,
            "`zero_optimization.reduce_bucket_size` must be a number, got \"big\"",
        ),
        (
            r#"{"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": "fast"}}}"#,
            "`optimizer.params.lr` must be a number, got \"fast\"",
        ),
        (
            r#"{"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}"#,
            "`optimizer.params.betas` must be [beta1, beta2], got [0.9]",
        ),
    ] {
        assert_eq!(problems(json), [want], "{json}");
    }
}

#[test]
fn lion_reads_lr_betas_and_weight_decay_and_refuses_adams_settings() {
    let c = Config::from_json(
        r#"{"train_batch_size": 8, "optimizer": {"type": "Lion", "params": {"lr": 1e-4, "betas": [0.95, 0.98], "weight_decay": 0.1}}}"#,
    )
    .unwrap();
    let o = &c.optimizer;
    assert_eq!(o.kind, crate::config::OptimizerKind::Lion);
    assert_eq!(
        (o.lr.value(), o.betas, o.weight_decay.value()),
        (Some(1e-4), (0.95, 0.98), Some(0.1))
    );
    assert!(o.adam_w_mode, "Lion's decay is decoupled");
    assert_eq!(o.moments(), 1);
    // DeepSpeed's FusedLion takes no eps, adam_w_mode, ...: it fails on
    // them; zrt names each.
    let p = problems(
        r#"{"train_batch_size": 8, "optimizer": {"type": "lion", "params": {"lr": 1e-4, "eps": 1e-8, "amsgrad": true}}}"#,
    );
    assert_eq!(p.len(), 2, "{p:?}");
    for key in ["eps", "amsgrad"] {
        assert!(
            p.iter().any(|x| x.starts_with(&format!(
                "`optimizer.params.{key}` is an Adam setting that Lion does not take"
            )) && x.ends_with("remove it, or use \"AdamW\"")),
            "{key}: {p:?}"
        );
    }
}

#[test]
fn sgd_reads_torchs_settings_and_refuses_adams() {
    let sgd = |params: &str| {
        Config::from_json(&format!(
            r#"{{"train_batch_size": 8, "optimizer": {{"type": "SGD", "params": {{"lr": 0.1{params}}}}}}}"#
        ))
    };
    let c = sgd(r#", "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-4, "maximize": true, "foreach": false"#).unwrap();
    let o = &c.optimizer;
    assert_eq!(o.kind, crate::config::OptimizerKind::Sgd);
    assert_eq!(
        (
            o.lr.value(),
            o.momentum,
            o.dampening,
            o.weight_decay.value()
        ),
        (Some(0.1), 0.9, 0.1, Some(1e-4))
    );
    assert!(o.maximize && !o.nesterov);
    assert!(!o.adam_w_mode, "SGD's decay is coupled, as torch's");
    assert_eq!(o.moments(), 1);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    // torch's default momentum is 0: no state at all.
    assert_eq!(sgd("").unwrap().optimizer.moments(), 0);
    // torch.optim.SGD takes no betas or eps, and needs momentum and no
    // dampening for Nesterov; Adam takes no momentum.
    for (params, want) in [
        (
            r#", "betas": [0.9, 1.5], "eps": 1e-8"#,
            vec![
                "`optimizer.params.eps` is an Adam setting that SGD does not take (torch.optim.SGD has momentum, dampening, nesterov and weight_decay): remove it, or use \"AdamW\"",
                "`optimizer.params.betas` is an Adam setting that SGD does not take (torch.optim.SGD has momentum, dampening, nesterov and weight_decay): remove it, or use \"AdamW\"",
            ],
        ),
        (
            r#", "nesterov": true, "momentum": 0.9, "dampening": 0.1"#,
            vec!["`optimizer.params.nesterov` needs momentum > 0 and dampening 0 (got momentum 0.9, dampening 0.1): set momentum, drop dampening, or set nesterov to false"],
        ),
        (
            r#", "momentum": -0.5"#,
            vec!["`optimizer.params.momentum` must be finite and >= 0, got -0.5"],
        ),
    ] {
        assert_eq!(sgd(params).unwrap_err().problems, want, "{params}");
    }
    assert_eq!(
        problems(
            r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}}"#
        ),
        ["`optimizer.params.momentum` is an SGD setting that AdamW does not take (its moments decay by `betas`): remove it, or use \"SGD\""]
    );
    // OneCycle cycles betas, which SGD has not: DeepSpeed turns the
    // momentum cycle off, and so does zrt, saying so (and not that the
    // betas are unused).
    let c = Config::from_json(
        r#"{"train_batch_size": 8, "optimizer": {"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9}},
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_min_mom": 1.5}}}"#,
    )
    .unwrap();
    assert!(matches!(
        c.scheduler,
        Some(SchedulerConfig::OneCycle {
            cycle_momentum: false,
            ..
        })
    ));
    assert_eq!(
        c.warnings,
        ["OneCycle cycles momentum as the optimizer's betas, which SGD has not: `scheduler.params.cycle_momentum` is off (as DeepSpeed turns it off), SGD's `momentum` stays as set; set cycle_momentum to false to silence this"]
    );
}

#[test]
fn adagrad_reads_torchs_settings_and_refuses_adams() {
    let adagrad = |params: &str| {
        Config::from_json(&format!(
            r#"{{"train_batch_size": 8, "optimizer": {{"type": "Adagrad", "params": {{"weight_decay": 1e-4{params}}}}}}}"#
        ))
    };
    // torch's defaults: lr 1e-2, eps 1e-10 (FusedAdam's are 1e-3, 1e-8).
    let o = adagrad("").unwrap().optimizer;
    assert_eq!(o.kind, crate::config::OptimizerKind::Adagrad);
    assert_eq!(
        (o.lr.value(), o.eps, o.lr_decay, o.weight_decay.value()),
        (Some(1e-2), 1e-10, 0.0, Some(1e-4))
    );
    assert!(!o.adam_w_mode, "Adagrad's decay is coupled, as torch's");
    assert!(!o.maximize);
    assert_eq!(o.moments(), 1);
    assert_eq!((o.initial_accumulator_value, o.initial_m()), (0.0, 0.0));
    let c = adagrad(r#", "lr": 0.1, "lr_decay": 0.01, "eps": 1e-8, "initial_accumulator_value": 0.25, "maximize": true, "foreach": null, "amsgrad": false"#).unwrap();
    let o = &c.optimizer;
    assert_eq!((o.lr.value(), o.lr_decay, o.eps), (Some(0.1), 0.01, 1e-8));
    assert_eq!((o.initial_accumulator_value, o.initial_m()), (0.25, 0.25));
    assert!(o.maximize);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    for (params, want) in [
        (
            r#", "betas": [0.9, 0.999], "bias_correction": true"#,
            vec![
                "`optimizer.params.bias_correction` is an Adam setting that Adagrad does not take (torch.optim.Adagrad has lr_decay, weight_decay, eps and initial_accumulator_value): remove it, or use \"AdamW\"",
                "`optimizer.params.betas` is an Adam setting that Adagrad does not take (torch.optim.Adagrad has lr_decay, weight_decay, eps and initial_accumulator_value): remove it, or use \"AdamW\"",
            ],
        ),
        (
            r#", "initial_accumulator_value": -0.1"#,
            vec!["`optimizer.params.initial_accumulator_value` must be finite and >= 0, got -0.1"],
        ),
        (
            r#", "lr_decay": -1"#,
            vec!["`optimizer.params.lr_decay` must be finite and >= 0, got -1"],
        ),
        (
            r#", "amsgrad": true"#,
            vec!["`optimizer.params.amsgrad` is not implemented by zrt: remove it or set it to false"],
        ),
        (
            r#", "momentum": 0.9"#,
            vec!["`optimizer.params.momentum` is an SGD setting that Adagrad does not take (it keeps a sum of squares, no momentum): remove it, or use \"SGD\""],
        ),
    ] {
        assert_eq!(adagrad(params).unwrap_err().problems, want, "{params}");
    }
    assert_eq!(
        problems(
            r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr_decay": 0.1}}}"#
        ),
        ["`optimizer.params.lr_decay` is an Adagrad setting that AdamW does not take: remove it, or use \"Adagrad\""]
    );
    // OneCycle's momentum cycle: off, as for SGD.
    let c = Config::from_json(
        r#"{"train_batch_size": 8, "optimizer": {"type": "Adagrad"},
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}}}"#,
    )
    .unwrap();
    assert_eq!(
        c.warnings,
        ["OneCycle cycles momentum as the optimizer's betas, which Adagrad has not: `scheduler.params.cycle_momentum` is off (as DeepSpeed turns it off); set cycle_momentum to false to silence this"]
    );
}

#[test]
fn rmsprop_reads_torchs_settings_and_refuses_the_rest() {
    let rmsprop = |params: &str| {
        Config::from_json(&format!(
            r#"{{"train_batch_size": 8, "optimizer": {{"type": "RMSprop", "params": {{"weight_decay": 1e-4{params}}}}}}}"#
        ))
    };
    // torch's defaults: lr 1e-2, alpha 0.99, eps 1e-8, no momentum.
    let o = rmsprop("").unwrap().optimizer;
    assert_eq!(o.kind, crate::config::OptimizerKind::Rmsprop);
    assert_eq!(
        (
            o.lr.value(),
            o.alpha,
            o.eps,
            o.momentum,
            o.weight_decay.value()
        ),
        (Some(1e-2), 0.99, 1e-8, 0.0, Some(1e-4))
    );
    assert!(!o.adam_w_mode, "RMSprop's decay is coupled, as torch's");
    assert!(!o.maximize);
    assert_eq!(o.moments(), 1, "the square average alone");
    let c = rmsprop(r#", "lr": 0.1, "alpha": 0.9, "eps": 1e-6, "momentum": 0.5, "centered": false, "maximize": true, "foreach": null, "capturable": false, "differentiable": false"#).unwrap();
    let o = &c.optimizer;
    assert_eq!(
        (o.lr.value(), o.alpha, o.eps, o.momentum),
        (Some(0.1), 0.9, 1e-6, 0.5)
    );
    assert!(o.maximize);
    assert_eq!(o.moments(), 2, "the square average and the momentum buffer");
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let o = rmsprop(r#", "centered": true"#).unwrap().optimizer;
    assert!(o.centered);
    assert_eq!(
        o.moments(),
        2,
        "the square average and the gradient's average"
    );
    for (params, want) in [
        (
            r#", "betas": [0.9, 0.999], "amsgrad": false"#,
            vec![
                "`optimizer.params.amsgrad` is an Adam setting that RMSprop does not take (torch.optim.RMSprop has alpha, eps, momentum and weight_decay): remove it, or use \"AdamW\"",
                "`optimizer.params.betas` is an Adam setting that RMSprop does not take (torch.optim.RMSprop has alpha, eps, momentum and weight_decay): remove it, or use \"AdamW\"",
            ],
        ),
        (
            r#", "centered": true, "momentum": 0.9"#,
            vec!["`optimizer.params.centered` with `momentum` above 0 is not implemented by zrt: it keeps a third array per parameter (the gradient's average and the momentum buffer, beside the square average), which zrt's flat state does not have; set centered to false or momentum to 0"],
        ),
        (
            r#", "alpha": 1.5"#,
            vec!["`optimizer.params.alpha` must be in [0, 1], got 1.5"],
        ),
        (
            r#", "momentum": -0.1"#,
            vec!["`optimizer.params.momentum` must be finite and >= 0, got -0.1"],
        ),
        (
            r#", "nesterov": true"#,
            vec!["`optimizer.params.nesterov` is an SGD setting that RMSprop does not take (its momentum buffer is neither damped nor Nesterov's): remove it, or use \"SGD\""],
        ),
    ] {
        assert_eq!(rmsprop(params).unwrap_err().problems, want, "{params}");
    }
    assert_eq!(
        problems(
            r#"{"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"alpha": 0.9, "momentum": 0.9}}}"#
        ),
        ["`optimizer.params.alpha` is an RMSprop setting that SGD does not take: remove it, or use \"RMSprop\""]
    );
    // OneCycle's momentum cycle: off, as for SGD.
    let c = Config::from_json(
        r#"{"train_batch_size": 8, "optimizer": {"type": "rmsprop"},
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}}}"#,
    )
    .unwrap();
    assert_eq!(
        c.warnings,
        ["OneCycle cycles momentum as the optimizer's betas, which RMSprop has not: `scheduler.params.cycle_momentum` is off (as DeepSpeed turns it off); set cycle_momentum to false to silence this"]
    );
}

#[test]
fn lamb_reads_fused_lambs_settings_and_refuses_the_rest() {
    let c = Config::from_json(
        r#"{"train_batch_size": 8, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "betas": [0.9, 0.98], "weight_decay": 0.01, "bias_correction": false, "max_coeff": 0.3, "min_coeff": 0.01, "eps_inside_sqrt": true, "max_grad_norm": 0}}}"#,
    )
    .unwrap();
    let o = &c.optimizer;
    assert_eq!(o.kind, crate::config::OptimizerKind::Lamb);
    assert_eq!((o.max_coeff, o.min_coeff), (0.3, 0.01));
    assert!(o.eps_inside_sqrt && !o.bias_correction);
    assert_eq!(o.moments(), 2);
    // Adam's and AdamW's moments are LAMB's; Lion's and SGD's are not.
    use crate::config::OptimizerKind::*;
    assert!(Lamb.same_state(AdamW) && Lamb.same_state(Adam));
    assert!(!Lamb.same_state(Lion) && !Lamb.same_state(Sgd));
    for (json, want) in [
        (
            r#"{"type": "Lamb", "params": {"adam_w_mode": true}}"#,
            "`optimizer.params.adam_w_mode` is an Adam setting that Lamb does not take (DeepSpeed's FusedLamb adds its weight decay to the update, inside the trust ratio): remove it, or use \"AdamW\"",
        ),
        (
            r#"{"type": "Lamb", "params": {"max_grad_norm": 1.0}}"#,
            "`optimizer.params.max_grad_norm` is FusedLamb's old clipping, which zrt does not implement: set `gradient_clipping` instead",
        ),
        (
            r#"{"type": "Lamb", "params": {"min_coeff": 2, "max_coeff": 1}}"#,
            "`optimizer.params.min_coeff` and `max_coeff` must be 0 <= min_coeff <= max_coeff, finite, got 2 and 1",
        ),
        (
            r#"{"type": "AdamW", "params": {"max_coeff": 10}}"#,
            "`optimizer.params.max_coeff` is a Lamb setting that AdamW does not take: remove it, or use \"Lamb\"",
        ),
    ] {
        let json = format!(r#"{{"train_batch_size": 8, "optimizer": {json}}}"#);
        assert_eq!(problems(&json), [want], "{json}");
    }
}

#[test]
fn adam_w_mode_is_deepspeeds_adam_default_and_always_on_for_adamw() {
    let mode = |json: &str| Config::from_json(json).unwrap().optimizer.adam_w_mode;
    assert!(mode(
        r#"{"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {}}}"#
    ));
    assert!(!mode(
        r#"{"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}}"#
    ));
    assert!(mode(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}}"#
    ));
}

#[test]
fn scheduler_params_are_read_and_checked() {
    let c = Config::from_json(
        r#"{"train_batch_size": 8, "scheduler": {"type": "WarmupLR",
            "params": {"warmup_num_steps": 50, "warmup_max_lr": 0.01, "warmup_type": "linear"}}}"#,
    )
    .unwrap();
    match c.scheduler {
        Some(SchedulerConfig::WarmupLR {
            warmup_num_steps,
            warmup_max_lr,
            ref warmup_type,
            ..
        }) => assert_eq!(
            (warmup_num_steps, warmup_max_lr, warmup_type.as_str()),
            (50, 0.01, "linear")
        ),
        ref s => panic!("{s:?}"),
    }
    for ty in ["WarmupDecayLR", "WarmupCosineLR"] {
        let with = format!(
            r#"{{"train_batch_size": 8, "scheduler": {{"type": "{ty}", "params": {{"total_num_steps": 100}}}}}}"#
        );
        assert!(Config::from_json(&with).is_ok(), "{ty}");
        let without = format!(
            r#"{{"train_batch_size": 8, "scheduler": {{"type": "{ty}", "params": {{}}}}}}"#
        );
        assert_eq!(
            problems(&without),
            [format!(
                "`scheduler.params.total_num_steps` is required by {ty}"
            )]
        );
    }
    for ty in ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"] {
        let p = problems(&format!(
            r#"{{"train_batch_size": 8, "scheduler": {{"type": "{ty}", "params": {{"total_num_steps": 9, "warmup_type": "cos", "warmup_num_steps": 0}}}}}}"#
        ));
        assert_eq!(
            p,
            [
                "`scheduler.params.warmup_type` must be \"log\" or \"linear\", got \"cos\"".to_string(),
                format!("`scheduler.params.warmup_num_steps` must be at least 1 for {ty} (DeepSpeed refuses 0 too)")
            ]
        );
    }
    // WarmupCosineLR warms up by log unless told otherwise, as in DeepSpeed.
    let c = Config::from_json(
        r#"{"train_batch_size": 8, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9}}}"#,
    )
    .unwrap();
    assert!(
        matches!(c.scheduler, Some(SchedulerConfig::WarmupCosineLR { ref warmup_type, .. }) if warmup_type == "log"),
        "{:?}",
        c.scheduler
    );
}

fn scheduler(ty: &str, params: &str) -> String {
    format!(
        r#"{{"train_batch_size": 8, "optimizer": {{"type": "AdamW", "params": {{}}}},
            "scheduler": {{"type": "{ty}", "params": {{{params}}}}}}}"#
    )
}

#[test]
fn one_cycle_takes_deepspeeds_defaults_and_says_what_it_does_to_the_betas() {
    let c = Config::from_json(&scheduler(
        "OneCycle",
        r#""cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 100, "cycle_first_stair_count": 4"#,
    ))
    .unwrap();
    assert_eq!(
        c.scheduler,
        Some(SchedulerConfig::OneCycle {
            cycle_min_lr: 0.001,
            cycle_max_lr: 0.01,
            decay_lr_rate: 0.0,
            cycle_first_step_size: 100,
            // The falling half and its stairs default to the rising half's.
            cycle_second_step_size: 100,
            cycle_first_stair_count: 4,
            cycle_second_stair_count: 4,
            decay_step_size: 0,
            cycle_momentum: true,
            cycle_min_mom: 0.8,
            cycle_max_mom: 0.9,
            decay_mom_rate: 0.0,
        })
    );
    // The optimizer's betas give way to the cycled momentum: said once.
    assert_eq!(
        c.warnings,
        ["OneCycle cycles Adam's beta1 between `cycle_max_mom` and `cycle_min_mom` and sets beta2 to 0.99, as DeepSpeed does: `optimizer.params.betas` (0.9, 0.999) is not used; set `scheduler.params.cycle_momentum` to false to keep it"]
    );
    let kept = Config::from_json(&scheduler(
        "OneCycle",
        r#""cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_momentum": false, "cycle_second_step_size": 0"#,
    ))
    .unwrap();
    assert!(kept.warnings.is_empty(), "{:?}", kept.warnings);
    assert!(matches!(
        kept.scheduler,
        Some(SchedulerConfig::OneCycle {
            cycle_first_step_size: 2000,
            cycle_second_step_size: 0,
            ..
        })
    ));
    assert_eq!(
        problems(&scheduler(
            "OneCycle",
            r#""cycle_first_step_size": 0, "cycle_min_mom": 1.0, "cycle_max_mom": -0.1"#
        )),
        [
            "`scheduler.params.cycle_min_lr` is required by OneCycle (DeepSpeed has no default either)",
            "`scheduler.params.cycle_max_lr` is required by OneCycle (DeepSpeed has no default either)",
            "`scheduler.params.cycle_first_step_size` must be at least 1 for OneCycle",
            "`scheduler.params.cycle_min_mom` must be in [0, 1) (it becomes the optimizer's beta1), got 1",
            "`scheduler.params.cycle_max_mom` must be in [0, 1) (it becomes the optimizer's beta1), got -0.1",
        ]
    );
    // Momenta are not Adam's while they do not cycle.
    assert!(Config::from_json(&scheduler(
        "OneCycle",
        r#""cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_momentum": false, "cycle_min_mom": 1.0"#
    ))
    .is_ok());
    // A momentum decay that will take beta1 to 1 is announced with when.
    let decays = Config::from_json(&scheduler(
        "OneCycle",
        r#""cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_step_size": 5, "cycle_second_step_size": 5, "decay_step_size": 10, "decay_mom_rate": 0.01, "cycle_max_mom": 0.8"#,
    ))
    .unwrap();
    assert_eq!(
        decays.warnings[0],
        "`scheduler.params.decay_mom_rate` 0.01 raises beta1 after the cycle (OneCycle multiplies `cycle_max_mom` by 1 + rate x iterations / `decay_step_size`, as DeepSpeed does): it reaches 1 about 250 steps after the cycle's 10 steps, and the engine stops there; Adam and Lion need beta1 < 1"
    );
}

#[test]
fn the_range_test_takes_deepspeeds_defaults() {
    let c = Config::from_json(&scheduler("LRRangeTest", "")).unwrap();
    assert_eq!(
        c.scheduler,
        Some(SchedulerConfig::LRRangeTest {
            lr_range_test_min_lr: 1e-3,
            lr_range_test_step_size: 2000,
            lr_range_test_step_rate: 1.0,
            lr_range_test_staircase: false,
        })
    );
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    assert_eq!(
        problems(&scheduler(
            "LRRangeTest",
            r#""lr_range_test_step_size": 0, "lr_range_test_staircase": 1"#
        )),
        [
            "`scheduler.params.lr_range_test_step_size` must be at least 1 (DeepSpeed refuses 0 too)",
            "`scheduler.params.lr_range_test_staircase` must be true or false, got 1",
        ]
    );
}

#[test]
fn a_schedule_started_part_way_is_refused_and_other_types_are_named() {
    for ty in ["WarmupLR", "OneCycle", "LRRangeTest"] {
        let p = problems(&scheduler(
            ty,
            r#""cycle_min_lr": 0.1, "cycle_max_lr": 1, "last_batch_iteration": 40"#,
        ));
        assert!(
            p.contains(&"`scheduler.params.last_batch_iteration` is 40: zrt starts every schedule at its beginning and resumes it from a checkpoint's step; remove the key (or set it to -1) and load the checkpoint to go on".to_string()),
            "{ty}: {p:?}"
        );
    }
    assert!(Config::from_json(&scheduler("LRRangeTest", r#""last_batch_iteration": -1"#)).is_ok());
    assert_eq!(
        problems(&scheduler("CyclicLR", "")),
        ["`scheduler.type` \"CyclicLR\" is not supported by zrt: use WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest"]
    );
}

/// A Hugging Face style ZeRO-3 config (FlagAlpha/Llama2-Chinese's
/// `train/pretrain/ds_config_zero3.json`): every value the Trainer fills is
/// `"auto"`.
const HF_ZERO3: &str = r#"{
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"last_batch_iteration": -1, "total_num_steps": "auto",
                             "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": true, "contiguous_gradients": true,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "gather_16bit_weights_on_model_save": true},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": false
}"#;

/// What a Hugging Face Trainer would hand over for [`HF_ZERO3`].
fn trainer_hints() -> AutoHints {
    AutoHints {
        hidden_size: Some(64),
        micro_batch: Some(2),
        gradient_accumulation_steps: Some(4),
        lr: Some(3e-4),
        weight_decay: Some(0.1),
        betas: Some((0.9, 0.95)),
        eps: Some(1e-6),
        gradient_clipping: Some(1.0),
        warmup_steps: Some(20),
        total_steps: Some(500),
        bf16: Some(true),
        fp16: None,
    }
}

#[test]
fn hugging_faces_auto_values_are_filled_from_the_program_as_its_trainer_fills_them() {
    let cfg = Config::from_json(HF_ZERO3).unwrap();
    assert_eq!(
        cfg.unresolved,
        [
            "optimizer.params.betas",
            "optimizer.params.eps",
            "scheduler.params.warmup_min_lr",
            "scheduler.params.warmup_max_lr",
            "scheduler.params.warmup_num_steps",
            "scheduler.params.total_num_steps",
            "gradient_clipping",
        ]
    );
    let r = cfg.resolve(8, &trainer_hints()).unwrap();
    let c = &r.config;
    assert_eq!(
        (c.optimizer.betas, c.optimizer.eps, c.gradient_clipping),
        ((0.9, 0.95), 1e-6, 1.0)
    );
    assert_eq!(
        c.scheduler,
        Some(SchedulerConfig::WarmupDecayLR {
            warmup_min_lr: 0.0,
            warmup_max_lr: 3e-4,
            warmup_num_steps: 20,
            warmup_type: "log".into(),
            total_num_steps: 500,
        })
    );
    assert_eq!(
        c.precision,
        Precision::Bf16 {
            check_grad_overflow: false
        }
    );
    assert!(c.unresolved.is_empty() && c.precision_auto.is_empty());
    assert_eq!(r.batch.train, 2 * 4 * 8);
    // fp16 from the program takes the block's loss-scaling settings.
    let fp16 = AutoHints {
        bf16: None,
        fp16: Some(true),
        ..trainer_hints()
    };
    match Config::from_json(HF_ZERO3)
        .unwrap()
        .resolve(8, &fp16)
        .unwrap()
        .config
        .precision
    {
        Precision::Fp16(l) => assert_eq!(
            (
                l.loss_scale,
                l.initial_scale_power,
                l.loss_scale_window,
                l.hysteresis
            ),
            (0.0, 16, 1000, 2)
        ),
        p => panic!("{p:?}"),
    }
    // Neither: fp32, as the Trainer leaves both off by default.
    let neither = AutoHints {
        bf16: None,
        ..trainer_hints()
    };
    let r = Config::from_json(HF_ZERO3)
        .unwrap()
        .resolve(8, &neither)
        .unwrap();
    assert_eq!(r.config.precision, Precision::Fp32);
    let both = AutoHints {
        fp16: Some(true),
        ..trainer_hints()
    };
    assert_eq!(
        Config::from_json(HF_ZERO3).unwrap().resolve(8, &both).unwrap_err().problems,
        ["`fp16.enabled` and `bf16.enabled` both resolved to true: the program asks for both bf16 and fp16 (AutoHints); choose one"]
    );
    // A program that gives nothing is told each value it owes.
    let bare = AutoHints {
        hidden_size: Some(64),
        micro_batch: Some(2),
        lr: Some(3e-4),
        weight_decay: Some(0.0),
        ..Default::default()
    };
    let owed = |what: &str, rule: &str, field: &str| {
        format!("`{what}` is \"auto\" but the program gave no {rule}: set it in the config, or pass it in `AutoHints::{field}`")
    };
    assert_eq!(
        Config::from_json(HF_ZERO3)
            .unwrap()
            .resolve(8, &bare)
            .unwrap_err()
            .problems,
        [
            owed("optimizer.params.betas", "betas", "betas"),
            owed("optimizer.params.eps", "epsilon", "eps"),
            owed(
                "scheduler.params.warmup_num_steps",
                "warm-up steps",
                "warmup_steps"
            ),
            owed(
                "scheduler.params.total_num_steps",
                "total steps",
                "total_steps"
            ),
            owed("gradient_clipping", "gradient clip", "gradient_clipping"),
        ]
    );
    let zero_warm_up = AutoHints {
        warmup_steps: Some(0),
        gradient_clipping: Some(-1.0),
        ..trainer_hints()
    };
    assert_eq!(
        Config::from_json(HF_ZERO3).unwrap().resolve(8, &zero_warm_up).unwrap_err().problems,
        [
            "`gradient_clipping` must be >= 0 (0 turns it off), got -1 from the program",
            "`scheduler.params.warmup_num_steps` must be at least 1 (DeepSpeed refuses 0 too), got 0 from the program",
        ]
    );
}

#[test]
fn only_the_string_auto_is_left_to_the_program() {
    // Any other string is the type error it always was, not an "auto".
    assert_eq!(
        problems(
            r#"{"train_batch_size": 8, "gradient_clipping": "1.0",
                "optimizer": {"type": "AdamW", "params": {"eps": "1e-8", "betas": "auto-ish"}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "ten"}},
                "bf16": {"enabled": "yes"}}"#
        ),
        [
            "`optimizer.params.betas` must be [beta1, beta2], got \"auto-ish\"",
            "`optimizer.params.eps` must be a number, got \"1e-8\"",
            "`scheduler.params.warmup_num_steps` must be a number, got \"ten\"",
            "`bf16.enabled` must be true or false, got \"yes\"",
            "`gradient_clipping` must be a number, got \"1.0\"",
        ]
    );
    // A 16-bit block off, or without `enabled`, is off (DeepSpeed's default).
    for blocks in [
        r#""fp16": {"enabled": false}, "bf16": {"enabled": false}"#,
        r#""fp16": {"loss_scale": 0}, "bf16": {}"#,
    ] {
        let c = Config::from_json(&format!(r#"{{"train_batch_size": 8, {blocks}}}"#)).unwrap();
        assert_eq!(
            (c.precision, c.precision_auto.len()),
            (Precision::Fp32, 0),
            "{blocks}"
        );
    }
}

#[test]
fn a_momentum_decay_is_announced_only_when_it_will_reach_1() {
    let warned = |params: &str| {
        Config::from_json(&scheduler(
            "OneCycle",
            &format!(r#""cycle_min_lr": 0.1, "cycle_max_lr": 1, {params}"#),
        ))
        .unwrap()
        .warnings
        .iter()
        .any(|w| w.contains("decay_mom_rate"))
    };
    assert!(warned(r#""decay_step_size": 10, "decay_mom_rate": 0.01"#));
    // No rate, no interval, or a beta1 of 0 (which stays 0): no decay to 1.
    assert!(!warned(r#""decay_step_size": 10, "decay_mom_rate": 0"#));
    assert!(!warned(r#""decay_step_size": 0, "decay_mom_rate": 0.01"#));
    assert!(!warned(
        r#""decay_step_size": 10, "decay_mom_rate": 0.01, "cycle_min_mom": 0, "cycle_max_mom": 0"#
    ));
    // A rate that lowers beta1 never reaches 1 either.
    assert!(!warned(r#""decay_step_size": 10, "decay_mom_rate": -0.01"#));
}

#[test]
fn a_warm_up_with_no_peak_rises_to_what_deepspeed_gives_it() {
    // DeepSpeed 0.19's WarmupLR rises to the optimizer's lr; its
    // WarmupDecayLR to 1e-3.
    let peak = |ty: &str, lr: &str| {
        let json = format!(
            r#"{{"train_batch_size": 8, "optimizer": {{"type": "AdamW", "params": {{"lr": {lr}}}}},
                "scheduler": {{"type": "{ty}", "params": {{"total_num_steps": 100}}}}}}"#
        );
        let hints = AutoHints {
            lr: Some(5e-4),
            ..Default::default()
        };
        match Config::from_json(&json)
            .unwrap()
            .resolve(1, &hints)
            .unwrap()
            .config
            .scheduler
        {
            Some(SchedulerConfig::WarmupLR { warmup_max_lr, .. })
            | Some(SchedulerConfig::WarmupDecayLR { warmup_max_lr, .. }) => warmup_max_lr,
            s => panic!("{s:?}"),
        }
    };
    assert_eq!(peak("WarmupLR", "3e-4"), 3e-4);
    assert_eq!(peak("WarmupLR", "\"auto\""), 5e-4);
    assert_eq!(peak("WarmupDecayLR", "3e-4"), 1e-3);
}

#[test]
fn precision_offload_and_aio_warn_only_about_what_has_no_effect() {
    let quiet = Config::from_json(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {}}, "bf16": {"enabled": true}, "aio": {"block_size": 4096},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}}"#,
    )
    .unwrap();
    assert!(quiet.warnings.is_empty(), "{:?}", quiet.warnings);
    assert_eq!(
        quiet.precision,
        Precision::Bf16 {
            check_grad_overflow: false
        }
    );
    assert_eq!(
        quiet.aio,
        AioConfig {
            block_size: 4096,
            ..AioConfig::default()
        }
    );
    let loud = Config::from_json(
        r#"{"train_batch_size": 8, "bf16": {"enabled": true, "loss_scale": 0}, "aio": {"queue_depth": 16},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pipeline_read": false}}}"#,
    )
    .unwrap();
    for want in [
        "`bf16.loss_scale` has no effect",
        "`aio.queue_depth` is not honoured",
        "`zero_optimization.offload_optimizer.device` = \"cpu\"",
        "`zero_optimization.offload_optimizer.pipeline_read` = false has no effect",
    ] {
        assert!(
            loud.warnings.iter().any(|w| w.starts_with(want)),
            "{want}: {:?}",
            loud.warnings
        );
    }
    assert_eq!(loud.aio.queue_depth, 16);
}

#[test]
fn fp16_reads_consecutive_hysteresis_and_says_auto_cast_does_nothing() {
    let c = Config::from_json(
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {}}, "fp16": {"enabled": true, "consecutive_hysteresis": true, "auto_cast": false}}"#,
    )
    .unwrap();
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    assert!(
        matches!(&c.precision, Precision::Fp16(l) if l.consecutive_hysteresis),
        "{:?}",
        c.precision
    );
    let c = Config::from_json(
        r#"{"train_batch_size": 8, "fp16": {"enabled": true, "auto_cast": true}}"#,
    )
    .unwrap();
    assert!(
        matches!(&c.precision, Precision::Fp16(l) if !l.consecutive_hysteresis),
        "off by default"
    );
    assert!(
        c.warnings
            .iter()
            .any(|w| w.starts_with("`fp16.auto_cast` = true has no effect")),
        "{:?}",
        c.warnings
    );
}

#[test]
fn deprecated_offload_keys_map_to_their_successors_without_overriding_them() {
    let c = Config::from_json(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3, "cpu_offload": true,
            "cpu_offload_params": true, "cpu_offload_use_pin_memory": true}}"#,
    )
    .unwrap();
    for o in [&c.zero.offload_optimizer, &c.zero.offload_param] {
        let o = o.as_ref().unwrap();
        assert_eq!((o.device, o.pin_memory), (OffloadDevice::Cpu, true));
    }
    // An explicit successor wins over the deprecated switch.
    let c = Config::from_json(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3, "cpu_offload": true, "cpu_offload_param": true,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}, "offload_param": {"device": "none"}}}"#,
    )
    .unwrap();
    assert_eq!(
        c.zero.offload_optimizer.as_ref().map(|o| o.device),
        Some(OffloadDevice::Nvme)
    );
    assert_eq!(
        c.zero.offload_param.as_ref().map(|o| o.device),
        Some(OffloadDevice::None)
    );
    // Switched off, they add nothing.
    let c = Config::from_json(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3, "cpu_offload": false, "cpu_offload_params": false}}"#,
    )
    .unwrap();
    assert!(c.zero.offload_optimizer.is_none() && c.zero.offload_param.is_none());
}

#[test]
fn overlap_comm_defaults_on_at_every_stage() {
    let overlap = |stage: u8| {
        Config::from_json(&format!(
            r#"{{"train_batch_size": 8, "zero_optimization": {{"stage": {stage}}}}}"#
        ))
        .unwrap()
        .zero
        .overlap_comm
    };
    assert!((0..=3).all(overlap));
}

#[test]
fn check_fails_on_parse_problems_even_when_resolving_succeeds() {
    let e = Config::check(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 7}}"#,
        2,
        &AutoHints::default(),
    )
    .unwrap_err();
    assert_eq!(
        e.problems,
        ["`zero_optimization.stage` must be 0, 1, 2 or 3, got 7"]
    );
    assert!(Config::check(r#"{"train_batch_size": 8}"#, 2, &AutoHints::default()).is_ok());
}

#[test]
fn monitor_blocks_name_their_folders_as_deepspeed_joins_them() {
    let cfg = |blocks: &str| {
        Config::from_json(&format!(
            r#"{{"train_batch_size": 8, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}, {blocks}}}"#
        ))
    };
    let c = cfg(
        r#""csv_monitor": {"enabled": true, "output_path": "logs/", "job_name": "gpt"},
        "tensorboard": {"enabled": true}"#,
    )
    .unwrap();
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    // DeepSpeed's defaults: output_path "" and job_name "DeepSpeedJobName".
    assert_eq!(
        c.monitor,
        MonitorConfig {
            csv: Some("logs/gpt".into()),
            tensorboard: Some("DeepSpeedJobName".into()),
        }
    );
    // Off unless enabled, as DeepSpeed's are; a disabled block is quiet.
    let c =
        cfg(r#""csv_monitor": {"output_path": "x"}, "tensorboard": {"enabled": false}"#).unwrap();
    assert_eq!(c.monitor, MonitorConfig::default());
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let e = cfg(r#""tensorboard": {"enabled": "yes", "job_nam": "a"}, "csv_monitor": {"enabled": true, "job_name": "a/b"}"#)
        .unwrap_err()
        .to_string();
    for want in [
        "`tensorboard.enabled` must be true or false, got \"yes\"",
        "unknown key `tensorboard.job_nam`; did you mean `tensorboard.job_name`?",
        "`csv_monitor.job_name` must name one folder (inside `output_path`), got \"a/b\"",
    ] {
        assert!(e.contains(want), "{want}: {e}");
    }
}

#[test]
fn comms_logger_takes_deepspeeds_op_names_and_says_what_it_cannot_log() {
    let cfg = |block: &str| {
        Config::from_json(&format!(
            r#"{{"train_batch_size": 8, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}, "comms_logger": {block}}}"#
        ))
    };
    // DeepSpeed's tutorial block: every op.
    let c =
        cfg(r#"{"enabled": true, "verbose": false, "prof_all": true, "debug": false}"#).unwrap();
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let all = CommsLoggerConfig {
        enabled: true,
        verbose: false,
        ops: None,
    };
    assert_eq!(c.comms_logger, all);
    assert!(c.comms_logger.logs("barrier") && c.comms_logger.logs("all_gather"));
    // Off unless enabled; a disabled block is quiet and logs nothing.
    let c = cfg(r#"{"enabled": false, "prof_ops": ["all_reduce"]}"#).unwrap();
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    assert!(!c.comms_logger.enabled && !c.comms_logger.logs("all_reduce"));
    // prof_ops by DeepSpeed's names, mapped to zrt's; one zrt never issues.
    let c = cfg(r#"{"enabled": true, "verbose": true, "prof_all": false,
        "prof_ops": ["all_gather_into_tensor", "reduce_scatter_tensor", "isend", "all_to_all_single", "gather"]}"#)
    .unwrap();
    let ops = ["all_gather", "reduce_scatter", "send", "all_to_all"]
        .map(String::from)
        .to_vec();
    assert_eq!(c.comms_logger.ops, Some(ops));
    assert!(
        c.comms_logger.verbose && c.comms_logger.logs("send") && !c.comms_logger.logs("all_reduce")
    );
    assert_eq!(
        c.warnings,
        ["`comms_logger.prof_ops` names `gather`, which zrt never issues: nothing of it to log"]
    );
    // prof_ops beside prof_all true, nothing selected, debug: said.
    for (block, want) in [
        (r#"{"enabled": true, "prof_ops": ["all_reduce"]}"#, "`comms_logger.prof_ops` is used only when `prof_all` is false, as in DeepSpeed: every operation is logged"),
        (r#"{"enabled": true, "prof_all": false}"#, "`comms_logger` has `prof_all` false and no `prof_ops`: it logs no operation"),
        (r#"{"enabled": true, "debug": true}"#, "`comms_logger.debug` has no effect: zrt names an operation's group, not the function that called it"),
    ] {
        assert_eq!(cfg(block).unwrap().warnings, [want], "{block}");
    }
    let e = cfg(r#"{"enabled": true, "prof_ops": ["allreduce", 3], "verbos": true}"#)
        .unwrap_err()
        .to_string();
    for want in [
        "`comms_logger.prof_ops` names \"allreduce\", not a communication operation: zrt's are all_reduce, reduce_scatter, all_gather, all_to_all, broadcast, barrier, send and recv",
        "`comms_logger.prof_ops` names 3, not a communication operation",
        "unknown key `comms_logger.verbos`; did you mean `comms_logger.verbose`?",
    ] {
        assert!(e.contains(want), "{want}: {e}");
    }
    let e = cfg(r#"{"enabled": true, "prof_ops": "all_reduce"}"#)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`comms_logger.prof_ops` must be a list of operation names, got \"all_reduce\""),
        "{e}"
    );
}

#[test]
fn muon_reads_deepspeeds_and_torchs_settings_and_refuses_the_rest() {
    let muon = |params: &str| {
        Config::from_json(&format!(
            r#"{{"train_batch_size": 8, "optimizer": {{"type": "Muon", "params": {{"weight_decay": 0.1{params}}}}}}}"#
        ))
    };
    // DeepSpeed's defaults: Muon at 0.02 with momentum 0.95 (Nesterov's),
    // its AdamW at 3e-4 with betas (0.9, 0.95) and eps 1e-10.
    let o = muon("").unwrap().optimizer;
    assert_eq!(o.kind, crate::config::OptimizerKind::Muon);
    assert_eq!(
        (
            o.lr.value(),
            o.adam_lr,
            o.momentum,
            o.betas,
            o.eps,
            o.ns_steps
        ),
        (Some(0.02), Some(3e-4), 0.95, (0.9, 0.95), 1e-10, 5)
    );
    assert_eq!(o.ns_coefficients, (3.4445, -4.775, 2.0315));
    assert!(o.nesterov && o.adam_w_mode && !o.match_rms_adamw);
    assert_eq!(o.moments(), 2, "AdamW's m and v; Muon's buffer in m");
    // `lr` alone sets both halves; `muon_lr` and `adam_lr` each their own
    // (with `muon_lr`, `lr` is the AdamW half's, as DeepSpeed hands it).
    for (params, lr, adam) in [
        (r#", "lr": 0.01"#, 0.01, None),
        (r#", "lr": 0.01, "adam_lr": 0.001"#, 0.01, Some(0.001)),
        (r#", "lr": 0.01, "muon_lr": 0.05"#, 0.05, Some(0.01)),
        (r#", "muon_lr": 0.05"#, 0.05, Some(3e-4)),
        (r#", "muon_lr": 0.05, "adam_lr": 0.002"#, 0.05, Some(0.002)),
    ] {
        let o = muon(params).unwrap().optimizer;
        assert_eq!((o.lr.value(), o.adam_lr), (Some(lr), adam), "{params}");
    }
    let c = muon(
        r#", "momentum": 0.9, "nesterov": false, "ns_steps": 3, "adjust_lr_fn": "match_rms_adamw", "ns_method": "standard", "betas": [0.8, 0.9], "eps": 1e-8, "ns_coefficients": [2, -1.5, 0.5]"#,
    )
    .unwrap();
    let o = &c.optimizer;
    assert_eq!(
        (o.momentum, o.ns_steps, o.betas, o.eps, o.ns_coefficients),
        (0.9, 3, (0.8, 0.9), 1e-8, (2.0, -1.5, 0.5))
    );
    assert!(!o.nesterov && o.match_rms_adamw);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    // DeepSpeed's newer default iteration: the same result, said once.
    let c = muon(r#", "ns_method": "gram""#).unwrap();
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert!(c.warnings[0].contains("zrt runs the standard Newton-Schulz iteration"));
    for (params, want) in [
        (
            r#", "adam_w_mode": true, "dampening": 0.1"#,
            vec![
                "`optimizer.params.adam_w_mode` is an Adam setting that Muon does not take (its AdamW half has betas, eps, weight_decay and adam_lr): remove it, or use \"AdamW\"",
                "`optimizer.params.dampening` is an SGD setting that Muon does not take (its momentum buffer is not damped): remove it, or use \"SGD\"",
            ],
        ),
        (
            r#", "momentum": 1.0"#,
            vec!["`optimizer.params.momentum` must be in [0, 1) for Muon (the share of the old buffer kept each step; 0.95 is usual), got 1"],
        ),
        (
            r#", "ns_steps": 0"#,
            vec!["`optimizer.params.ns_steps` must be from 1 to 99 (Newton-Schulz iterations; 5 is usual), got 0"],
        ),
        (
            r#", "adjust_lr_fn": "spectral""#,
            vec!["`optimizer.params.adjust_lr_fn` must be \"original\" (each matrix's rate times sqrt(max(1, rows / cols))) or \"match_rms_adamw\" (times 0.2 sqrt(max(rows, cols))), got \"spectral\""],
        ),
        (
            r#", "ns_method": "svd""#,
            vec!["`optimizer.params.ns_method` must be \"standard\" or \"gram\", got \"svd\""],
        ),
        (
            r#", "adam_lr": -1"#,
            vec!["`optimizer.params.adam_lr` must be finite and >= 0, got -1"],
        ),
        (
            r#", "ns_coefficients": [3.4, -4.7]"#,
            vec!["`optimizer.params.ns_coefficients` must be three finite numbers [a, b, c], the iteration's a x + b x^3 + c x^5 (torch's default [3.4445, -4.775, 2.0315]), got [3.4,-4.7]"],
        ),
        (
            r#", "ns_coefficients": [3.4, "b", 2]"#,
            vec!["`optimizer.params.ns_coefficients` must be three finite numbers [a, b, c], the iteration's a x + b x^3 + c x^5 (torch's default [3.4445, -4.775, 2.0315]), got [3.4,\"b\",2]"],
        ),
    ] {
        assert_eq!(muon(params).unwrap_err().problems, want, "{params}");
    }
    assert_eq!(
        problems(
            r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"muon_lr": 0.02}}}"#
        ),
        ["`optimizer.params.muon_lr` is a Muon setting that AdamW does not take: remove it, or use \"Muon\""]
    );
    assert_eq!(
        problems(
            r#"{"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"ns_coefficients": [1, 2, 3]}}}"#
        ),
        ["`optimizer.params.ns_coefficients` is a Muon setting that SGD does not take: remove it, or use \"Muon\""]
    );
}

#[test]
fn elasticity_keeps_one_global_batch_on_every_world_it_suits() {
    let c = Config::from_json(
        r#"{"elasticity": {"enabled": true, "max_train_batch_size": 2000,
            "micro_batch_sizes": [2, 4, 6], "min_gpus": 1, "max_gpus": 10000,
            "min_time": 20, "version": 0.1}}"#,
    )
    .unwrap();
    // Each rank's share of 1680 by the largest of 6, 4, 2 dividing it:
    // 560 on 3 ranks is no multiple of 6.
    for (world, micro, gas) in [(1, 6, 280), (2, 6, 140), (3, 4, 140), (8, 6, 35)] {
        let b = c.resolve(world, &AutoHints::default()).unwrap().batch;
        assert_eq!(
            (b.train, b.micro, b.gas),
            (1680, micro, gas),
            "world {world}"
        );
    }
    let e = c
        .resolve(16, &AutoHints::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            "`elasticity` gives a global batch of 1680, which a world of 16 rank(s) cannot split"
        ),
        "{e}"
    );
    // A disabled block changes nothing, and is no unknown key.
    let off =
        Config::from_json(r#"{"train_batch_size": 8, "elasticity": {"enabled": false}}"#).unwrap();
    assert!(
        off.elasticity.is_none() && !off.warnings.iter().any(|w| w.contains("elasticity")),
        "{:?}",
        off.warnings
    );
    assert_eq!(
        off.resolve(2, &AutoHints::default()).unwrap().batch.micro,
        4
    );
}

#[test]
fn elasticity_refuses_batch_keys_beside_it_unless_told_to_ignore_them() {
    let block =
        r#""elasticity": {"enabled": true, "max_train_batch_size": 100, "micro_batch_sizes": [4]}"#;
    let c = Config::from_json(&format!(
        r#"{{"train_batch_size": 32, "gradient_accumulation_steps": "auto", {block}}}"#
    ))
    .unwrap();
    let e = c.resolve(2, &AutoHints::default()).unwrap_err().to_string();
    assert!(
        e.contains("`elasticity` is enabled, which chooses the batch, and the config gives `train_batch_size`, `gradient_accumulation_steps` too: remove them, or set `elasticity.ignore_non_elastic_batch_info` to true"),
        "{e}"
    );
    let ignored = block.replace("[4]}", "[4], \"ignore_non_elastic_batch_info\": true}");
    let c = Config::from_json(&format!(r#"{{"train_batch_size": 32, {ignored}}}"#)).unwrap();
    let b = c.resolve(2, &AutoHints::default()).unwrap().batch;
    assert_eq!((b.train, b.micro, b.gas), (96, 4, 12));
}

#[test]
fn elasticity_mistakes_name_the_key() {
    for (block, want) in [
        (
            r#"{"enabled": true, "version": 0.2}"#,
            "`elasticity.version` 0.2 is not implemented",
        ),
        (
            r#"{"enabled": true, "micro_batch_sizes": []}"#,
            "`elasticity.micro_batch_sizes` must list micro-batch sizes of at least 1",
        ),
        (
            r#"{"enabled": true, "micro_batch_sizes": 4}"#,
            "`elasticity.micro_batch_sizes` must be a list",
        ),
        (
            r#"{"enabled": true, "max_train_batch_size": 4, "micro_batch_sizes": [2, 8]}"#,
            "holds 8, above `max_train_batch_size` 4",
        ),
        (
            r#"{"enabled": true, "min_gpus": 4, "max_gpus": 2}"#,
            "must hold 1 <= min_gpus <= max_gpus",
        ),
        (r#"{"enabled": true, "max_gpu": 2}"#, "max_gpus"),
    ] {
        let e = Config::from_json(&format!(r#"{{"elasticity": {block}}}"#))
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{block}: {e}");
    }
}

#[test]
fn flops_profiler_reads_deepspeeds_block_and_refuses_what_it_cannot_mean() {
    let base = r#""train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}"#;
    let of = |block: &str| Config::from_json(&format!(r#"{{{base}, "flops_profiler": {block}}}"#));
    // DeepSpeed's documented block, its defaults spelled out.
    let c = of(r#"{"enabled": true, "recompute_fwd_factor": 0.0, "profile_step": 1, "module_depth": -1, "top_modules": 1, "detailed": true, "output_file": null}"#).unwrap();
    assert_eq!(
        c.flops_profiler,
        FlopsProfilerConfig {
            enabled: true,
            ..Default::default()
        }
    );
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let c = of(r#"{"enabled": true, "profile_step": 5, "top_modules": 3, "detailed": false, "output_file": "flops.txt", "recompute_fwd_factor": 1.0, "module_depth": 2}"#).unwrap();
    let want = FlopsProfilerConfig {
        enabled: true,
        profile_step: 5,
        recompute_fwd_factor: 1.0,
        top_modules: 3,
        detailed: false,
        output_file: Some("flops.txt".into()),
    };
    assert_eq!(c.flops_profiler, want);
    assert!(
        c.warnings
            .iter()
            .any(|w| w
                .starts_with("`flops_profiler.module_depth` = 2: zrt profiles the model's units")),
        "{:?}",
        c.warnings
    );
    assert_eq!(
        Config::from_json(&format!("{{{base}}}"))
            .unwrap()
            .flops_profiler,
        FlopsProfilerConfig::default()
    );
    for (block, says) in [
        (r#"{"enabled": true, "recompute_fwd_factor": -1}"#, "`flops_profiler.recompute_fwd_factor` is the share of the forward that backward computes again, at least 0, got -1"),
        (r#"{"enabled": true, "module_depth": "all"}"#, "`flops_profiler.module_depth` must be a whole number (-1: every depth), got \"all\""),
        (r#"{"enabled": true, "profile_steps": 2}"#, "profile_step"),
    ] {
        let err = of(block).unwrap_err().to_string();
        assert!(err.contains(says), "{block}: {err}");
    }
}
