//! The keys DeepSpeed documents, which of them zrt honours, and the closest
//! known key for a typo.

/// Top-level keys zrt reads.
pub(crate) const TOP: &[&str] = &[
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "gradient_clipping",
    "steps_per_print",
    "wall_clock_breakdown",
    "memory_breakdown",
    "dump_state",
    "zero_optimization",
    "communication_data_type",
    "data_types",
    "aio",
    "csv_monitor",
    "tensorboard",
    "comms_logger",
    "flops_profiler",
    "checkpoint",
    "elasticity",
];

/// Keys of `elasticity` (DeepSpeed's, version 0.1 and 0.2's two more).
pub(crate) const ELASTICITY: &[&str] = &[
    "enabled",
    "max_train_batch_size",
    "micro_batch_sizes",
    "min_gpus",
    "max_gpus",
    "min_time",
    "prefer_larger_batch",
    "ignore_non_elastic_batch_info",
    "version",
    "model_parallel_size",
    "num_gpus_per_node",
];

/// Keys of `checkpoint` (DeepSpeed's checkpoint options).
pub(crate) const CHECKPOINT: &[&str] = &[
    "tag_validation",
    "load_universal",
    "use_node_local_storage",
    "parallel_write",
];

/// Keys of the monitor blocks zrt writes (`csv_monitor`, `tensorboard`).
pub(crate) const MONITOR: &[&str] = &["enabled", "output_path", "job_name"];

/// Keys of `flops_profiler`.
pub(crate) const FLOPS_PROFILER: &[&str] = &[
    "enabled",
    "recompute_fwd_factor",
    "profile_step",
    "module_depth",
    "top_modules",
    "detailed",
    "output_file",
];

/// Keys of `comms_logger`.
pub(crate) const COMMS_LOGGER: &[&str] = &["enabled", "verbose", "prof_all", "prof_ops", "debug"];

/// Names `comms_logger.prof_ops` may hold: DeepSpeed's names of its
/// communication calls, and the operation of zrt's they count as (`None`:
/// one zrt never issues).
pub(crate) const COMM_OPS: &[(&str, Option<&str>)] = &[
    ("all_reduce", Some("all_reduce")),
    ("inference_all_reduce", Some("all_reduce")),
    ("all_reduce_coalesced", Some("all_reduce")),
    ("reduce_scatter", Some("reduce_scatter")),
    ("reduce_scatter_tensor", Some("reduce_scatter")),
    ("reduce_scatter_base", Some("reduce_scatter")),
    ("reduce_scatter_fn", Some("reduce_scatter")),
    ("all_gather", Some("all_gather")),
    ("all_gather_into_tensor", Some("all_gather")),
    ("all_gather_base", Some("all_gather")),
    ("allgather_fn", Some("all_gather")),
    ("all_gather_coalesced", Some("all_gather")),
    ("broadcast", Some("broadcast")),
    ("barrier", Some("barrier")),
    ("send", Some("send")),
    ("isend", Some("send")),
    ("recv", Some("recv")),
    ("irecv", Some("recv")),
    ("all_to_all_single", Some("all_to_all")),
    ("all_to_all", Some("all_to_all")),
    ("reduce", None),
    ("gather", None),
    ("scatter", None),
];

/// Top-level keys DeepSpeed knows that zrt does not implement (warnings).
pub(crate) const TOP_KNOWN_UNIMPLEMENTED: &[&str] = &[
    "activation_checkpointing",
    "amp",
    "autotuning",
    "comet",
    "compression_training",
    "data_efficiency",
    "gradient_predivide_factor",
    "pipeline",
    "prescale_gradients",
    "seq_parallel_communication_data_type",
    "sparse_attention",
    "sparse_gradients",
    "wandb",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
];

/// `zero_optimization` keys zrt honours (aliases included).
pub(crate) const ZERO: &[&str] = &[
    "stage",
    "reduce_bucket_size",
    "overlap_comm",
    "stage3_prefetch_bucket_size",
    "prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "param_persistence_threshold",
    "stage3_max_live_parameters",
    "max_live_parameters",
    "mics_shard_size",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights",
    "offload_optimizer",
    "offload_param",
];

/// `zero_optimization` keys DeepSpeed knows that zrt does not implement yet (warnings).
pub(crate) const ZERO_KNOWN_UNIMPLEMENTED: &[&str] = &[
    "contiguous_gradients",
    "reduce_scatter",
    "allgather_partitions",
    "allgather_bucket_size",
    "stage3_max_reuse_distance",
    "max_reuse_distance",
    "sub_group_size",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "round_robin_gradients",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "ignore_unused_parameters",
    "legacy_stage1",
    "use_multi_rank_bucket_allreduce",
    "stage3_model_persistence_threshold",
    "model_persistence_threshold",
    "stage3_module_granularity_threshold",
    "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "use_all_reduce_for_fetch_params",
    "zeropp_loco_param",
    "mics_hierarchical_params_gather",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
];

/// Known-unimplemented keys one value of which asks for what zrt does
/// anyway: given that value they pass silently (configs written for
/// DeepSpeed spell out its defaults); any other value warns, saying what
/// zrt does instead. Top-level blocks with `"enabled": false` pass too.
pub(crate) const SAME_AS_ZRT: &[(&str, AsZrt, &str)] = &[
    // Settings of DeepSpeed's own implementation: zrt does one thing,
    // with the same results, and says so when a config asks for another.
    (
        "contiguous_gradients",
        AsZrt::Bool(true),
        "zrt's gradients always go into contiguous flat buffers",
    ),
    (
        "reduce_scatter",
        AsZrt::Bool(true),
        "zrt always reduce-scatters gradients (DeepSpeed's all-reduce instead gives the same sums)",
    ),
    (
        "allgather_partitions",
        AsZrt::Bool(true),
        "zrt always all-gathers the updated shards (DeepSpeed's broadcasts instead give the same values)",
    ),
    (
        "allgather_bucket_size",
        AsZrt::Number(5e8),
        "zrt gathers each unit's updated shards in one call: the unit is the bucket",
    ),
    (
        "stage3_max_reuse_distance",
        AsZrt::Number(1e9),
        REUSE,
    ),
    ("max_reuse_distance", AsZrt::Number(1e9), REUSE),
    (
        "activation_checkpointing",
        AsZrt::Never,
        "it tunes DeepSpeed's own checkpointing (partitioned or CPU-held inputs); in zrt a model checkpoints a block by wrapping it in `zrt::zero::activation::Checkpointed`, as DeepSpeed's model code calls `deepspeed.checkpointing.checkpoint`",
    ),
    (
        "prescale_gradients",
        AsZrt::Bool(false),
        "zrt reduces gradients in fp32 and averages after the reduction",
    ),
    (
        "gradient_predivide_factor",
        AsZrt::Number(1.0),
        "zrt reduces gradients in fp32 and averages after the reduction",
    ),
    (
        "stage3_gather_16bit_weights_on_model_save",
        AsZrt::Bool(true),
        GATHERS_ON_SAVE,
    ),
    (
        "stage3_gather_fp16_weights_on_model_save",
        AsZrt::Bool(true),
        GATHERS_ON_SAVE,
    ),
    (
        "gather_16bit_weights_on_model_save",
        AsZrt::Bool(true),
        GATHERS_ON_SAVE,
    ),
    (
        "ignore_unused_parameters",
        AsZrt::Bool(true),
        "zrt trains a model some of whose parameters no loss uses (their gradient is zero)",
    ),
    (
        "load_from_fp32_weights",
        AsZrt::Bool(true),
        "zrt's checkpoints restore the fp32 master weights",
    ),
    (
        "round_robin_gradients",
        AsZrt::Bool(false),
        "it only orders DeepSpeed's gradient copies; zrt's results do not depend on it",
    ),
    (
        "elastic_checkpoint",
        AsZrt::Bool(false),
        "zrt's checkpoints load on any world size anyway",
    ),
    (
        "stage3_use_all_reduce_for_fetch_params",
        AsZrt::Bool(false),
        "zrt fetches parameters with all-gathers",
    ),
    (
        "use_all_reduce_for_fetch_params",
        AsZrt::Bool(false),
        "zrt fetches parameters with all-gathers",
    ),
    (
        "mics_hierarchical_params_gather",
        AsZrt::Bool(false),
        "zrt gathers inside the shard group in one step",
    ),
    (
        "pipeline_loading_checkpoint",
        AsZrt::Bool(false),
        "zrt loads checkpoints whole-model",
    ),
    (
        "legacy_stage1",
        AsZrt::Bool(false),
        "zrt's stage 1 is the current one",
    ),
    (
        "sub_group_size",
        AsZrt::Number(1e9),
        "zrt's optimizer step, and its NVMe swap, go one unit at a time (`aio.block_size` sets the swap's pieces)",
    ),
    (
        "memory_efficient_linear",
        AsZrt::Bool(true),
        "zrt's stage 3 frees gathered weights in place, so what autograd saves of them holds no memory whatever this says",
    ),
    (
        "log_trace_cache_warnings",
        AsZrt::Bool(false),
        "zrt records the units' order at every forward and logs nothing about it",
    ),
    (
        "stage3_module_granularity_threshold",
        AsZrt::Number(0.0),
        UNITS,
    ),
    ("module_granularity_threshold", AsZrt::Number(0.0), UNITS),
    (
        "use_multi_rank_bucket_allreduce",
        AsZrt::Bool(true),
        "zrt reduces each bucket in one collective",
    ),
    // Top-level keys.
    (
        "sparse_gradients",
        AsZrt::Bool(false),
        "zrt takes sparse gradients (embedding(.., sparse = true)), adds their rows into its flat buffers and reduces every gradient dense",
    ),
    (
        "zero_force_ds_cpu_optimizer",
        AsZrt::Bool(true),
        "zrt always runs its own Adam kernel, offloaded or not",
    ),
    (
        "seq_parallel_communication_data_type",
        AsZrt::Str("fp32"),
        "zrt has no sequence parallelism",
    ),
    // Permission to give DeepSpeed an optimizer of the program's own: zrt
    // takes none, so neither value changes anything.
    ("zero_allow_untested_optimizer", AsZrt::Any, ""),
    // Monitors that need their own clients; zrt writes the other two.
    ("wandb", AsZrt::Never, NO_CLIENT),
    ("comet", AsZrt::Never, NO_CLIENT),
];

/// What zrt does instead of the monitors that need a service's client.
const NO_CLIENT: &str = "zrt has no client for that service; the monitors it writes are `csv_monitor` and `tensorboard` (files TensorBoard and any CSV reader open)";

/// What zrt's units are, for the keys that set DeepSpeed's granularity.
const UNITS: &str = "zrt's units are the modules the program wraps in ShardedModule";

/// What zrt does instead of `stage3_max_reuse_distance`.
const REUSE: &str = "stage 3 keeps the unit forward ran last gathered for the backward that begins with it and re-gathers the others, whatever the distance";

const GATHERS_ON_SAVE: &str = "zrt's save_16bit_model gathers the weights whatever this says (one unit at a time, never the whole model on a rank)";

/// The value of a [`SAME_AS_ZRT`] key that means what zrt does.
#[derive(Debug, Clone, Copy)]
pub(crate) enum AsZrt {
    Bool(bool),
    Number(f64),
    Str(&'static str),
    /// Every value does: the key never warns.
    Any,
    /// No value does (a block): it always warns, with the text alone.
    Never,
}

impl AsZrt {
    /// Whether `v` is this value.
    pub(crate) fn is(self, v: &serde_json::Value) -> bool {
        match self {
            AsZrt::Bool(b) => v.as_bool() == Some(b),
            AsZrt::Number(x) => v.as_f64() == Some(x),
            AsZrt::Str(x) => v.as_str() == Some(x),
            AsZrt::Any => true,
            AsZrt::Never => false,
        }
    }
}

/// Deprecated `zero_optimization` keys and what they map to.
pub(crate) const ZERO_DEPRECATED: &[(&str, &str)] = &[
    ("cpu_offload", "offload_optimizer: {\"device\": \"cpu\"}"),
    ("cpu_offload_params", "offload_param: {\"device\": \"cpu\"}"),
    ("cpu_offload_param", "offload_param: {\"device\": \"cpu\"}"),
    ("cpu_offload_use_pin_memory", "offload_*.pin_memory"),
];

/// `offload_optimizer` keys.
pub(crate) const OFFLOAD_OPTIMIZER: &[&str] = &[
    "device",
    "nvme_path",
    "pin_memory",
    "buffer_count",
    "pipeline_read",
    "pipeline_write",
    "fast_init",
    "ratio",
    "pipeline",
];

/// `aio` keys (DeepSpeed's async I/O for NVMe offload).
pub(crate) const AIO: &[&str] = &[
    "block_size",
    "queue_depth",
    "thread_count",
    "intra_op_parallelism",
    "single_submit",
    "overlap_events",
    "use_gds",
];

/// `offload_param` keys.
pub(crate) const OFFLOAD_PARAM: &[&str] = &[
    "device",
    "nvme_path",
    "buffer_count",
    "buffer_size",
    "max_in_cpu",
    "pin_memory",
];

/// `fp16` keys.
pub(crate) const FP16: &[&str] = &[
    "enabled",
    "auto_cast",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "fp16_master_weights_and_grads",
];

/// `bf16` keys (DeepSpeed's bf16 has no loss scaling; fp16's keys are
/// tolerated there with a warning, as DeepSpeed ignores them).
pub(crate) const BF16: &[&str] = &["enabled", "immediate_grad_update", "check_grad_overflow"];

/// Edit distance (Levenshtein) between two keys.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The known key closest to `key`, if one is close enough to be a typo.
pub(crate) fn closest<'a>(key: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    known
        .into_iter()
        .map(|k| (distance(key, k), k))
        .filter(|(d, k)| *d <= (k.len() / 3).max(2))
        .min()
        .map(|(_, k)| k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typos_find_their_key() {
        assert_eq!(
            closest("stage3_prefetch_bucket_sze", ZERO.iter().copied()),
            Some("stage3_prefetch_bucket_size")
        );
        assert_eq!(closest("stag", ZERO.iter().copied()), Some("stage"));
        assert_eq!(closest("completely_else", ZERO.iter().copied()), None);
        assert_eq!(distance("kitten", "sitting"), 3);
        assert_eq!(distance("abc", ""), 3);
        assert_eq!(distance("xab", "ab"), 1);
        assert_eq!(distance("ab", "a"), 1);
        // A third of a long key's length may differ: five edits away from
        // its 27 characters is still a typo of it.
        assert_eq!(
            closest("stage3_prefetch_bucket", ZERO.iter().copied()),
            Some("stage3_prefetch_bucket_size")
        );
    }
}
