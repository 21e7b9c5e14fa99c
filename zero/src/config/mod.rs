//! The DeepSpeed JSON config, as DeepSpeed documents it.
//!
//! [`Config::from_file`] / [`Config::from_json`] parse a document and
//! collect *every* problem at once: unknown keys inside `zero_optimization`
//! and the offload blocks are errors naming the closest known key; keys
//! DeepSpeed knows but zrt does not implement yet are warnings, never
//! silently ignored; deprecated keys (`cpu_offload`, ...) are mapped with a
//! warning; numbers may be written as `5e8`; fp16 and bf16 both enabled is
//! an error. [`Config::resolve`] then applies what needs the world size and
//! the model: the batch rule (any two of train / micro / accumulation
//! determine the third; all three must satisfy train = micro x gas x world)
//! and `"auto"` values, resolved as Hugging Face's integration does
//! (`reduce_bucket_size` = hidden^2, `stage3_prefetch_bucket_size` =
//! 0.9 hidden^2, `stage3_param_persistence_threshold` = 10 hidden; batch and
//! optimizer values from the program), each resolved value logged.

mod duplicates;
mod elasticity;
mod keys;
mod parse;
mod resolve;

use std::path::Path;

pub use elasticity::ElasticityConfig;
pub use parse::Setting;

/// Every problem found in a config; the message lists them all.
#[derive(Debug, Clone, Default, PartialEq, thiserror::Error)]
#[error("{} problem(s) in the DeepSpeed config:\n{}", .problems.len(), .problems.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
pub struct ConfigError {
    /// One line per problem, each naming the key and the fix.
    pub problems: Vec<String>,
    /// What [`Config::check`] would also have warned about (keys zrt reads
    /// differently or ignores), so that a report of the problems can show
    /// them too; empty from every other call, which logs its warnings.
    pub warnings: Vec<String>,
}

/// Which optimizer (`optimizer.type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerKind {
    /// Adam; decoupled decay only if `adam_w_mode` is set.
    Adam,
    /// AdamW (decoupled weight decay).
    AdamW,
    /// Lion: one moment (half of Adam's state), the sign of an
    /// interpolation of it and the gradient as the update, decoupled decay
    /// (`zrt_kernels::lion`). Reads `lr`, `betas` and `weight_decay` only.
    Lion,
    /// `torch.optim.SGD` (which DeepSpeed builds for a type it has no
    /// kernel of its own for): a momentum buffer when `momentum > 0`, no
    /// state at all otherwise; coupled (L2) weight decay
    /// (`zrt_kernels::sgd`).
    Sgd,
    /// LAMB, DeepSpeed's `FusedLamb`: Adam's m and v, and each
    /// parameter's step scaled by its trust ratio (the norm of the whole
    /// parameter over that of its update), which the engine sums across
    /// the shards that cut it (`zrt_kernels::lamb`).
    Lamb,
    /// `torch.optim.Adagrad` (DeepSpeed's `"Adagrad"`; its
    /// `DeepSpeedCPUAdagrad` is the same update without `lr_decay`): one
    /// moment, the sum of the squared gradients, each element's rate the
    /// learning rate over its root; coupled (L2) weight decay
    /// (`zrt_kernels::adagrad`).
    Adagrad,
    /// `torch.optim.RMSprop` (DeepSpeed's `"RMSprop"`, which it hands to
    /// `torch.optim`): the square average of the gradient, and a momentum
    /// buffer when `momentum > 0` or the gradient's average when
    /// `centered` (not both); coupled (L2) weight decay
    /// (`zrt_kernels::rmsprop`).
    Rmsprop,
    /// Muon with an auxiliary AdamW (DeepSpeed's `"Muon"`, its
    /// `MuonWithAuxAdam`; `torch.optim.Muon`'s update): the 2-D weights of
    /// wrapped blocks (or those [`ShardPlan::use_muon`] names) keep a
    /// momentum buffer and step by its orthogonalization over the whole
    /// matrix (a Newton-Schulz iteration the engine runs on gathered
    /// matrices); every other parameter steps by AdamW. Decoupled decay
    /// for both.
    ///
    /// [`ShardPlan::use_muon`]: crate::ShardPlan::use_muon
    Muon,
}

impl OptimizerKind {
    /// How many fp32 moments per trained element the optimizer keeps:
    /// Adam's, LAMB's and Muon's m and v (a Muon matrix's momentum in m,
    /// its v unused), Lion's m, Adagrad's sum of squares, RMSprop's square
    /// average, and the `buffer` SGD keeps with momentum and RMSprop with
    /// momentum or centered (its gradient's average).
    pub fn moments(self, buffer: bool) -> usize {
        match self {
            OptimizerKind::Adam | OptimizerKind::AdamW | OptimizerKind::Lamb => 2,
            // The AdamW half's m and v; the Muon half's buffer is in m (its
            // v stays zero: the flat state has one layout for every element).
            OptimizerKind::Muon => 2,
            OptimizerKind::Lion | OptimizerKind::Adagrad => 1,
            OptimizerKind::Sgd => usize::from(buffer),
            OptimizerKind::Rmsprop => 1 + usize::from(buffer),
        }
    }

    /// Whether a checkpoint of `other`'s state is this optimizer's state
    /// too: Adam's, AdamW's and LAMB's m and v are the same averages of
    /// the gradient and its square; every other pair's are not (Lion's m,
    /// SGD's buffer and Adagrad's sum are each one moment, but not the
    /// same one; RMSprop's square average is Adam's v without its bias
    /// correction, kept in another array; Muon's m is a momentum where its
    /// matrices are, AdamW's elsewhere).
    pub fn same_state(self, other: Self) -> bool {
        let family = |k| match k {
            OptimizerKind::Adam | OptimizerKind::AdamW | OptimizerKind::Lamb => 0,
            OptimizerKind::Lion => 1,
            OptimizerKind::Sgd => 2,
            OptimizerKind::Adagrad => 3,
            OptimizerKind::Rmsprop => 4,
            OptimizerKind::Muon => 5,
        };
        family(self) == family(other)
    }

    /// The optimizer `optimizer.type` names (any case: DeepSpeed compares
    /// lower-cased names); `None` for one zrt does not implement.
    pub fn from_name(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "adam" => Some(OptimizerKind::Adam),
            "adamw" => Some(OptimizerKind::AdamW),
            "lion" => Some(OptimizerKind::Lion),
            "sgd" => Some(OptimizerKind::Sgd),
            "lamb" => Some(OptimizerKind::Lamb),
            "adagrad" => Some(OptimizerKind::Adagrad),
            "rmsprop" => Some(OptimizerKind::Rmsprop),
            "muon" => Some(OptimizerKind::Muon),
            _ => None,
        }
    }

    /// The name DeepSpeed's `optimizer.type` gives it.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::Adam => "Adam",
            OptimizerKind::AdamW => "AdamW",
            OptimizerKind::Lion => "Lion",
            OptimizerKind::Sgd => "SGD",
            OptimizerKind::Lamb => "Lamb",
            OptimizerKind::Adagrad => "Adagrad",
            OptimizerKind::Rmsprop => "RMSprop",
            OptimizerKind::Muon => "Muon",
        }
    }
}

/// `torch.optim.Muon`'s Newton-Schulz coefficients (a, b, c), the
/// default of `ns_coefficients`: a quintic tuned for the slope at zero
/// (Keller Jordan's).
pub const NS_COEFFICIENTS: (f64, f64, f64) = (3.4445, -4.7750, 2.0315);

/// `optimizer`.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerConfig {
    /// `type`.
    pub kind: OptimizerKind,
    /// `params.lr`.
    pub lr: Setting<f64>,
    /// `params.betas`.
    pub betas: (f64, f64),
    /// `params.eps`.
    pub eps: f64,
    /// `params.weight_decay`.
    pub weight_decay: Setting<f64>,
    /// Decoupled decay (AdamW, Lion, or Adam with `adam_w_mode: true`;
    /// DeepSpeed's Adam defaults to true).
    pub adam_w_mode: bool,
    /// `params.bias_correction`.
    pub bias_correction: bool,
    /// SGD's, RMSprop's and Muon's `params.momentum` (SGD's and RMSprop's
    /// 0: no momentum buffer; Muon's 0.95; 0 for the others).
    pub momentum: f64,
    /// SGD's `params.dampening`.
    pub dampening: f64,
    /// SGD's and Muon's `params.nesterov` (Muon's default: true).
    pub nesterov: bool,
    /// SGD's, Adagrad's and RMSprop's `params.maximize`.
    pub maximize: bool,
    /// Adagrad's `params.lr_decay` (0 for the others).
    pub lr_decay: f64,
    /// Adagrad's `params.initial_accumulator_value`: where its sum of
    /// squares starts (0 for the others).
    pub initial_accumulator_value: f64,
    /// RMSprop's `params.alpha`: the share of the old square average kept
    /// each step (torch's default 0.99; unused by the others).
    pub alpha: f64,
    /// RMSprop's `params.centered`: divide by the root of the gradient's
    /// variance, which keeps the gradient's average.
    pub centered: bool,
    /// LAMB's `params.max_coeff`: the trust ratio's upper clamp.
    pub max_coeff: f64,
    /// LAMB's `params.min_coeff`: the trust ratio's lower clamp.
    pub min_coeff: f64,
    /// LAMB's `params.eps_inside_sqrt`.
    pub eps_inside_sqrt: bool,
    /// Muon's `params.adam_lr`: the auxiliary AdamW's rate, when it is not
    /// `lr` (the Muon half's, which `muon_lr` sets too). A scheduler moves
    /// both rates alike, keeping their ratio. `None` for the others.
    pub adam_lr: Option<f64>,
    /// Muon's `params.ns_steps`: Newton-Schulz iterations (5).
    pub ns_steps: u32,
    /// Muon's `params.ns_coefficients` (torch.optim.Muon's): the
    /// iteration's quintic `a x + b x^3 + c x^5`, as (a, b, c); Keller
    /// Jordan's (3.4445, -4.775, 2.0315) by default.
    pub ns_coefficients: (f64, f64, f64),
    /// Muon's `params.adjust_lr_fn` = `"match_rms_adamw"`: each matrix's
    /// rate times `0.2 sqrt(max(rows, cols))` (Moonshot's), instead of
    /// `sqrt(max(1, rows / cols))` (Keller Jordan's, the default).
    pub match_rms_adamw: bool,
}

impl OptimizerConfig {
    /// How many fp32 moments per trained element it keeps (2 for Adam,
    /// LAMB and Muon, 1 for Lion and Adagrad, 1 or 0 for SGD with or
    /// without momentum, 2 or 1 for RMSprop with or without momentum or
    /// centered).
    pub fn moments(&self) -> usize {
        self.kind.moments(self.momentum > 0.0 || self.centered)
    }

    /// The value every element of the first moment (`m`) starts at, in a
    /// new engine and after a module-only load: Adagrad's
    /// `initial_accumulator_value`, 0 for every other optimizer.
    pub fn initial_m(&self) -> f32 {
        match self.kind {
            OptimizerKind::Adagrad => self.initial_accumulator_value as f32,
            _ => 0.0,
        }
    }
}

/// `scheduler`.
#[derive(Debug, Clone, PartialEq)]
pub enum SchedulerConfig {
    /// Warm up from `warmup_min_lr` to `warmup_max_lr`, then stay.
    WarmupLR {
        /// Start.
        warmup_min_lr: f64,
        /// End of warm-up (left out: the optimizer's lr, as in DeepSpeed).
        warmup_max_lr: f64,
        /// Steps of warm-up.
        warmup_num_steps: u64,
        /// `log` (DeepSpeed's default) or `linear`.
        warmup_type: String,
    },
    /// WarmupLR, then linear decay to 0 at `total_num_steps`.
    WarmupDecayLR {
        /// Start.
        warmup_min_lr: f64,
        /// End of warm-up (left out: 1e-3, as in DeepSpeed).
        warmup_max_lr: f64,
        /// Steps of warm-up.
        warmup_num_steps: u64,
        /// `log` or `linear`.
        warmup_type: String,
        /// Step at which the rate reaches 0.
        total_num_steps: u64,
    },
    /// Warm-up from `warmup_min_ratio` x lr to lr, then cosine to `cos_min_ratio` x lr.
    WarmupCosineLR {
        /// Steps in all.
        total_num_steps: u64,
        /// Warm-up starts at this fraction of lr.
        warmup_min_ratio: f64,
        /// Steps of warm-up.
        warmup_num_steps: u64,
        /// The cosine ends at this fraction of lr.
        cos_min_ratio: f64,
        /// `log` (DeepSpeed's default) or `linear`.
        warmup_type: String,
    },
    /// One triangular cycle of the learning rate (and, inversely, of
    /// Adam's beta1), then a decay: DeepSpeed's `OneCycle`.
    OneCycle {
        /// The rate at the cycle's ends.
        cycle_min_lr: f64,
        /// The rate at the cycle's peak.
        cycle_max_lr: f64,
        /// After the cycle the rate is `cycle_min_lr / (1 + rate x k /
        /// decay_step_size)` at `k` iterations past it (0: it stays at
        /// `cycle_min_lr`).
        decay_lr_rate: f64,
        /// Iterations of the rising half.
        cycle_first_step_size: u64,
        /// Iterations of the falling half (DeepSpeed's default: the first's).
        cycle_second_step_size: u64,
        /// Stairs of the rising half (0: continuous).
        cycle_first_stair_count: u64,
        /// Stairs of the falling half (DeepSpeed's default: the first's).
        cycle_second_stair_count: u64,
        /// Iterations per decay interval (0: no decay).
        decay_step_size: u64,
        /// Whether beta1 cycles between `cycle_max_mom` and `cycle_min_mom`;
        /// while it does, beta2 is 0.99, as DeepSpeed sets it.
        cycle_momentum: bool,
        /// beta1 at the peak of the rate.
        cycle_min_mom: f64,
        /// beta1 at the cycle's ends.
        cycle_max_mom: f64,
        /// After the cycle beta1 is `cycle_max_mom x (1 + rate x k /
        /// decay_step_size)` (DeepSpeed's formula; 0: it stays).
        decay_mom_rate: f64,
    },
    /// The learning-rate range test: the rate grows from
    /// `lr_range_test_min_lr` by `lr_range_test_step_rate` x its start every
    /// `lr_range_test_step_size` iterations: DeepSpeed's `LRRangeTest`.
    LRRangeTest {
        /// The starting rate.
        lr_range_test_min_lr: f64,
        /// Iterations per increase.
        lr_range_test_step_size: u64,
        /// Increase per interval, in multiples of the start.
        lr_range_test_step_rate: f64,
        /// Whether the rate moves in stairs rather than every iteration.
        lr_range_test_staircase: bool,
    },
}

/// fp16 dynamic loss scaling (DeepSpeed's knobs).
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaleConfig {
    /// `loss_scale`: 0 for dynamic, else a static scale.
    pub loss_scale: f64,
    /// `initial_scale_power`: dynamic scaling starts at 2^this.
    pub initial_scale_power: u32,
    /// `loss_scale_window`: steps without overflow before the scale doubles
    /// (on the step after them, as DeepSpeed does); 0: it never doubles
    /// (DeepSpeed divides by it).
    pub loss_scale_window: u64,
    /// `hysteresis`: overflows tolerated before the scale halves.
    pub hysteresis: u32,
    /// `consecutive_hysteresis`: refill the hysteresis on every step
    /// without an overflow, not only when the scale doubles.
    pub consecutive_hysteresis: bool,
    /// `min_loss_scale`.
    pub min_loss_scale: f64,
}

/// Compute precision.
#[derive(Debug, Clone, PartialEq)]
pub enum Precision {
    /// fp32 compute.
    Fp32,
    /// bf16 compute, fp32 master.
    Bf16 {
        /// `bf16.check_grad_overflow`: skip, on every rank, a step whose
        /// gradients hold inf/NaN on any rank (off by default, as in
        /// DeepSpeed; with it off such a step is applied and warned about).
        check_grad_overflow: bool,
    },
    /// fp16 compute, fp32 master, loss scaling.
    Fp16(LossScaleConfig),
}

/// Where optimizer state or parameters live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffloadDevice {
    /// Not offloaded.
    None,
    /// Host memory.
    Cpu,
    /// NVMe swap files.
    Nvme,
}

/// `offload_optimizer` / `offload_param`.
#[derive(Debug, Clone, PartialEq)]
pub struct OffloadConfig {
    /// `device`.
    pub device: OffloadDevice,
    /// `nvme_path`.
    pub nvme_path: Option<String>,
    /// `pin_memory`.
    pub pin_memory: bool,
    /// `buffer_count`.
    pub buffer_count: u64,
    /// `buffer_size` (offload_param).
    pub buffer_size: u64,
}

/// `aio`: how the NVMe swap does its I/O. zrt honours `block_size` (bytes
/// per array per request); the other knobs are read and warned about.
#[derive(Debug, Clone, PartialEq)]
pub struct AioConfig {
    /// `block_size` in bytes (DeepSpeed's default 1 MiB).
    pub block_size: u64,
    /// `queue_depth`.
    pub queue_depth: u64,
    /// `thread_count` / `intra_op_parallelism`.
    pub thread_count: u64,
    /// `single_submit`.
    pub single_submit: bool,
    /// `overlap_events`.
    pub overlap_events: bool,
}

impl Default for AioConfig {
    fn default() -> Self {
        Self {
            block_size: 1 << 20,
            queue_depth: 8,
            thread_count: 1,
            single_submit: false,
            overlap_events: true,
        }
    }
}

/// DeepSpeed's monitor blocks zrt writes: `csv_monitor` and `tensorboard`,
/// each `{"enabled", "output_path", "job_name"}`. What the job's first
/// rank writes at each accumulation boundary is in [`crate::monitor`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MonitorConfig {
    /// `csv_monitor`'s folder (`output_path/job_name`) when enabled.
    pub csv: Option<std::path::PathBuf>,
    /// `tensorboard`'s folder (`output_path/job_name`) when enabled.
    pub tensorboard: Option<std::path::PathBuf>,
}

/// DeepSpeed's `comms_logger`: `{"enabled", "verbose", "prof_all",
/// "prof_ops"}`. The collectives count every operation whatever this says;
/// it chooses what the engine logs: each operation as it completes
/// (`verbose`) and the table [`crate::Engine::log_comms_summary`] prints.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CommsLoggerConfig {
    /// `enabled`.
    pub enabled: bool,
    /// `verbose`: a line per operation as it completes.
    pub verbose: bool,
    /// The operations logged, by zrt's names (`all_reduce`,
    /// `reduce_scatter`, `all_gather`, `broadcast`, `barrier`, `send`,
    /// `recv`): `None` for every one (`prof_all`, the default), else those
    /// `prof_ops` names.
    pub ops: Option<Vec<String>>,
}

impl CommsLoggerConfig {
    /// Whether operation `op` (zrt's name) is logged.
    pub fn logs(&self, op: &str) -> bool {
        self.enabled && self.ops.as_ref().is_none_or(|o| o.iter().any(|x| x == op))
    }
}

/// DeepSpeed's `flops_profiler`: at one step, the first rank reports
/// the forward's multiply-accumulates (matrix products, counted as
/// libtorch runs them), the step's forward, backward and optimizer
/// latencies and the FLOPS they make, per rank, and each unit's share.
#[derive(Debug, Clone, PartialEq)]
pub struct FlopsProfilerConfig {
    /// `enabled`.
    pub enabled: bool,
    /// `profile_step` (default 1): the step profiled is the one that runs
    /// once this many have ended (DeepSpeed's `global_steps ==
    /// profile_step`).
    pub profile_step: u64,
    /// `recompute_fwd_factor` (default 0): the share of the forward that
    /// backward computes again (activation checkpointing), counted in the
    /// backward's flops.
    pub recompute_fwd_factor: f64,
    /// `top_modules` (default 1): how many units the summary names, by
    /// multiply-accumulates and by forward latency.
    pub top_modules: u64,
    /// `detailed` (default true): a line for every unit.
    pub detailed: bool,
    /// `output_file`: where the report goes instead of the log.
    pub output_file: Option<std::path::PathBuf>,
}

impl Default for FlopsProfilerConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            profile_step: 1,
            recompute_fwd_factor: 0.0,
            top_modules: 1,
            detailed: true,
            output_file: None,
        }
    }
}

/// `zero_optimization`.
#[derive(Debug, Clone, PartialEq)]
pub struct ZeroConfig {
    /// 0 (plain data parallel), 1, 2 or 3.
    pub stage: u8,
    /// Elements per gradient bucket.
    pub reduce_bucket_size: Setting<u64>,
    /// Elements per gather bucket (stages 1-2). Read and agreed on across
    /// ranks, nothing more (a value other than DeepSpeed's 5e8 warns): zrt
    /// gathers each unit's updated shards in one call (the unit is the
    /// bucket).
    pub allgather_bucket_size: u64,
    /// Overlap gradient reductions with backward (default on at every
    /// stage; DeepSpeed's is on at stage 3 only). Off, each unit's gradient
    /// hook waits for the reductions it issued, so none is in flight while
    /// backward computes.
    pub overlap_comm: bool,
    /// Copy gradients into contiguous buffers as they are produced. Read
    /// and agreed on (false warns); zrt's gradients always go into flat
    /// buffers.
    pub contiguous_gradients: bool,
    /// Elements gathered ahead (stage 3).
    pub stage3_prefetch_bucket_size: Setting<u64>,
    /// Parameters below this many elements stay gathered (stage 3).
    pub stage3_param_persistence_threshold: Setting<u64>,
    /// Gathered elements in flight at most (stage 3).
    pub stage3_max_live_parameters: u64,
    /// Keep a gathered parameter if it is reused within this many elements
    /// (stage 3). Read and agreed on (a value other than DeepSpeed's 1e9
    /// warns); zrt keeps the unit forward ran last gathered for the
    /// backward that begins with it and re-gathers the others, whatever
    /// this says.
    pub stage3_max_reuse_distance: u64,
    /// MiCS: shard inside groups of this many ranks (-1 or absent: whole world).
    pub mics_shard_size: Option<u64>,
    /// ZeRO++ hpZ: secondary parameter shard inside groups of this many ranks.
    pub zero_hpz_partition_size: u64,
    /// ZeRO++ qwZ: stage 3 gathers trainable parameters for forward and
    /// backward as int8 codes with a scale per 2048 elements or fewer, of
    /// one parameter ([`zrt_kernels::quant`]) instead of in the compute dtype. The fp32
    /// master, the optimizer, checkpoints and `with_full_params` stay
    /// exact; what forward and backward compute with is rounded.
    pub zero_quantized_weights: bool,
    /// ZeRO++ qgZ: stage 3 reduce-scatters gradients as int8 codes with a
    /// scale per 2048 elements or fewer, of one parameter: each rank packs every rank's piece of its
    /// gradient bucket, one all_to_all delivers each rank the pieces of
    /// its shard, and the rank unpacks and averages them in fp32. A
    /// quarter of an fp32 reduce-scatter's bytes; the gradients are
    /// rounded once, before the sum.
    pub zero_quantized_gradients: bool,
    /// Stage 3 holds each rank's shard of the frozen parameters it shards
    /// (those `requires_grad` false inside a unit: a LoRA model's base) as
    /// int8 codes with a scale per 2048 elements or fewer, of one
    /// parameter, and gathers them so: a quarter of an fp32 shard's
    /// memory, half of a 16-bit one's. Lossy by design: forward, backward,
    /// `with_full_params`, checkpoints and exports all see the unpacked
    /// values (the true ones are dropped when the engine is built).
    pub zero_quantized_nontrainable_weights: bool,
    /// `offload_optimizer`.
    pub offload_optimizer: Option<OffloadConfig>,
    /// `offload_param`.
    pub offload_param: Option<OffloadConfig>,
}

/// Values `"auto"` resolves from, supplied by the program.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AutoHints {
    /// The model's hidden size (for bucket sizes and thresholds).
    pub hidden_size: Option<u64>,
    /// Micro-batch per rank the program uses.
    pub micro_batch: Option<u64>,
    /// Accumulation steps the program uses.
    pub gradient_accumulation_steps: Option<u64>,
    /// Learning rate the program uses.
    pub lr: Option<f64>,
    /// Weight decay the program uses.
    pub weight_decay: Option<f64>,
    /// Adam's (beta1, beta2) the program uses (`optimizer.params.betas`).
    pub betas: Option<(f64, f64)>,
    /// Adam's epsilon the program uses (`optimizer.params.eps`).
    pub eps: Option<f64>,
    /// The gradient-norm clip the program uses (`gradient_clipping`;
    /// Hugging Face's `max_grad_norm`).
    pub gradient_clipping: Option<f64>,
    /// Warm-up steps (`scheduler.params.warmup_num_steps`).
    pub warmup_steps: Option<u64>,
    /// Optimizer steps in the whole run (`scheduler.params.total_num_steps`).
    pub total_steps: Option<u64>,
    /// Whether the program computes in bf16 (`bf16.enabled`; none: false).
    pub bf16: Option<bool>,
    /// Whether the program computes in fp16 (`fp16.enabled`; none: false).
    pub fp16: Option<bool>,
}

/// A parsed DeepSpeed config (before [`Config::resolve`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `train_batch_size`.
    pub train_batch_size: Setting<Option<u64>>,
    /// `train_micro_batch_size_per_gpu`.
    pub micro_batch: Setting<Option<u64>>,
    /// `gradient_accumulation_steps`.
    pub gradient_accumulation_steps: Setting<Option<u64>>,
    /// `optimizer` (DeepSpeed's default: Adam, lr 1e-3, when absent).
    pub optimizer: OptimizerConfig,
    /// `scheduler`.
    pub scheduler: Option<SchedulerConfig>,
    /// `fp16` / `bf16`.
    pub precision: Precision,
    /// `gradient_clipping` (0: off).
    pub gradient_clipping: f64,
    /// `steps_per_print` (default 10, DeepSpeed's): every that many
    /// accumulation boundaries, skipped ones included, the job's first rank
    /// logs a progress line at info (step, skipped steps, lr, betas,
    /// gradient norm, fp16 loss scale). 0: never.
    pub steps_per_print: u64,
    /// `wall_clock_breakdown`.
    pub wall_clock_breakdown: bool,
    /// `memory_breakdown`: the first rank logs its resident set, model
    /// state, reuse pools and what libtorch holds (its allocations are
    /// counted from the engine's build on: `glue::allocated`) once the
    /// engine is built and with each progress line.
    pub memory_breakdown: bool,
    /// `dump_state`: the first rank logs the engine's state (its world,
    /// batch, optimizer and each unit's layout) once it is built.
    pub dump_state: bool,
    /// Reduce and accumulate gradients in fp32 (the default; `communication_data_type`
    /// or `data_types.grad_accum_dtype` can ask for the compute dtype).
    pub fp32_grad_reduce: bool,
    /// `zero_optimization`.
    pub zero: ZeroConfig,
    /// `aio`.
    pub aio: AioConfig,
    /// `csv_monitor` and `tensorboard`.
    pub monitor: MonitorConfig,
    /// `comms_logger`.
    pub comms_logger: CommsLoggerConfig,
    /// `flops_profiler`.
    pub flops_profiler: FlopsProfilerConfig,
    /// `elasticity`, when enabled: the batch keys then come from it, the
    /// same global batch on every world size it suits.
    pub elasticity: Option<ElasticityConfig>,
    /// Everything zrt read but will not honour, or mapped from a deprecated key.
    pub warnings: Vec<String>,
    /// Keys whose values [`Config::resolve`] fills: those given as `"auto"`
    /// among `optimizer.params.betas`, `optimizer.params.eps`,
    /// `gradient_clipping` and `scheduler.params.{warmup_min_lr,
    /// warmup_max_lr, warmup_num_steps, total_num_steps}`, and
    /// `scheduler.params.warmup_max_lr` when WarmupLR leaves it out
    /// (DeepSpeed then uses the optimizer's lr). Until then
    /// their fields hold DeepSpeed's defaults as placeholders.
    pub unresolved: Vec<String>,
    /// The 16-bit precisions whose `enabled` is `"auto"`: resolving
    /// enables the one the program asks for ([`AutoHints::bf16`],
    /// [`AutoHints::fp16`]), or neither.
    pub precision_auto: Vec<Precision>,
}

/// The batch sizes after the batch rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batch {
    /// Samples per optimizer step across the world.
    pub train: u64,
    /// Samples per rank per micro-step.
    pub micro: u64,
    /// Micro-steps per optimizer step.
    pub gas: u64,
}

/// A config with every value known: what the engine runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    /// The parsed config (its `"auto"` settings replaced).
    pub config: Config,
    /// The batch sizes.
    pub batch: Batch,
    /// The data-parallel world they were resolved for.
    pub world: u64,
}

impl Config {
    /// Reads and parses a DeepSpeed JSON file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            problems: vec![format!("cannot read {}: {e}", path.display())],
            ..Default::default()
        })?;
        Self::from_json(&text)
    }

    /// Parses a DeepSpeed JSON document.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        parse::parse(text)
    }

    /// Parses and resolves in one go, reporting the problems of both steps
    /// at once (what `zrt config check` prints), with the warnings in the
    /// config the result or the error holds (and logs them, as parsing
    /// does).
    pub fn check(text: &str, world: u64, hints: &AutoHints) -> Result<Resolved, ConfigError> {
        let (cfg, mut problems) = parse::parse_all(text)?;
        let warnings = cfg.warnings.clone();
        match cfg.resolve(world, hints) {
            Ok(r) if problems.is_empty() => Ok(r),
            Ok(_) => Err(ConfigError { problems, warnings }),
            Err(e) => {
                problems.extend(e.problems);
                Err(ConfigError { problems, warnings })
            }
        }
    }

    /// Applies the batch rule for a data-parallel world of `world` ranks and
    /// resolves every `"auto"` from `hints`; lists every problem at once.
    pub fn resolve(&self, world: u64, hints: &AutoHints) -> Result<Resolved, ConfigError> {
        resolve::resolve(self, world, hints)
    }
}

#[cfg(test)]
mod tests;
