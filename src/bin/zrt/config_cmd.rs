//! `zrt config check FILE [--world N]`: the resolved config, or every problem.

use anyhow::Result;
use clap::{Args, Subcommand};
use zrt::zero::config::{
    OffloadDevice, OptimizerConfig, OptimizerKind, Precision, Setting, ZeroConfig,
};
use zrt::zero::{AutoHints, Config, ConfigError, Resolved};

/// `zrt config` subcommands.
#[derive(Subcommand, Debug)]
pub enum ConfigCmd {
    /// Parse and resolve a DeepSpeed JSON config; print it, or every problem at once.
    Check(CheckArgs),
}

/// Options of `zrt config check`.
#[derive(Args, Debug)]
pub struct CheckArgs {
    /// The DeepSpeed JSON file.
    file: std::path::PathBuf,
    /// Data-parallel world size to resolve the batch rule for.
    #[arg(long, default_value_t = 1)]
    world: u64,
    /// Hidden size, for "auto" bucket sizes and thresholds.
    #[arg(long)]
    hidden: Option<u64>,
    /// Micro-batch per rank, for "auto" (or absent) batch sizes.
    #[arg(long)]
    micro: Option<u64>,
    /// Learning rate, for an "auto" lr (and an "auto" warmup_max_lr).
    #[arg(long)]
    lr: Option<f64>,
    /// Weight decay, for an "auto" weight_decay.
    #[arg(long)]
    weight_decay: Option<f64>,
    /// Adam's betas as BETA1,BETA2, for "auto" betas.
    #[arg(long, value_parser = parse_betas)]
    betas: Option<(f64, f64)>,
    /// Adam's epsilon, for an "auto" eps.
    #[arg(long)]
    eps: Option<f64>,
    /// Gradient-norm clip, for an "auto" gradient_clipping.
    #[arg(long)]
    clip: Option<f64>,
    /// Warm-up steps, for an "auto" warmup_num_steps.
    #[arg(long)]
    warmup_steps: Option<u64>,
    /// Optimizer steps in the run, for an "auto" total_num_steps.
    #[arg(long)]
    total_steps: Option<u64>,
    /// Compute in bf16, for "auto" bf16.enabled (otherwise false).
    #[arg(long)]
    bf16: bool,
    /// Compute in fp16, for "auto" fp16.enabled (otherwise false).
    #[arg(long)]
    fp16: bool,
}

/// `0.9,0.95` as Adam's betas.
fn parse_betas(s: &str) -> std::result::Result<(f64, f64), String> {
    let bad = || format!("expected BETA1,BETA2 (e.g. 0.9,0.999), got `{s}`");
    let (a, b) = s.split_once(',').ok_or_else(bad)?;
    let num = |x: &str| x.trim().parse::<f64>().map_err(|_| bad());
    Ok((num(a)?, num(b)?))
}

/// A setting as the config gives it: its value, or `auto`.
fn show<T: std::fmt::Debug + Copy>(s: Setting<T>) -> String {
    match s {
        Setting::Value(v) => format!("{v:?}"),
        Setting::Auto => "auto".into(),
    }
}

/// Each [`AutoHints`] field a config can owe (bf16 and fp16 default to
/// false) and the flag of `zrt config check` that gives it.
const HINT_FLAGS: [(&str, &str); 9] = [
    ("hidden_size", "--hidden H"),
    ("micro_batch", "--micro M"),
    ("lr", "--lr LR"),
    ("weight_decay", "--weight-decay WD"),
    ("betas", "--betas B1,B2"),
    ("eps", "--eps EPS"),
    ("gradient_clipping", "--clip C"),
    ("warmup_steps", "--warmup-steps N"),
    ("total_steps", "--total-steps N"),
];

/// The flags that give what `e` says the program owes: the library names
/// the [`AutoHints`] field (`AutoHints::lr`) that fills an `"auto"` it
/// could not; here the user gives those on the command line. Empty when
/// nothing is owed.
fn owed_flags(e: &ConfigError) -> String {
    let text = e.to_string();
    let flags: Vec<&str> = (HINT_FLAGS.iter())
        // The library quotes the field whole, so one cannot match
        // inside a longer one's name.
        .filter(|(field, _)| text.contains(&format!("`AutoHints::{field}`")))
        .map(|(_, flag)| *flag)
        .collect();
    if flags.is_empty() {
        return String::new();
    }
    format!(
        "\n`zrt config check` takes the program's values as flags: {} (see `zrt config check --help`)",
        flags.join(", ")
    )
}

/// Runs `zrt config ...`.
pub fn run(cmd: &ConfigCmd) -> Result<()> {
    let ConfigCmd::Check(a) = cmd;
    let r = checked(a)?;
    let c = &r.config;
    println!("{}: OK for a world of {}", a.file.display(), r.world);
    println!(
        "  batch            train {} = micro {} x gas {} x world {}",
        r.batch.train, r.batch.micro, r.batch.gas, r.world
    );
    if let Some(e) = &c.elasticity {
        // Which worlds an elastic job (`zrt launch --nnodes MIN:MAX`) may
        // run on with this same global batch.
        println!(
            "  elasticity       the same global batch on worlds {:?}",
            e.global_batch().1
        );
    }
    print_optimizer(&c.optimizer);
    match &c.scheduler {
        Some(sched) => println!("  scheduler        {sched:?}"),
        None => println!("  scheduler        none (the learning rate stays at lr)"),
    }
    print_precision(c);
    print_zero(&c.zero, r.batch.gas);
    print_observers(c);
    for w in &c.warnings {
        println!("  warning: {w}");
    }
    Ok(())
}

/// The config of `a.file`, resolved with the flags' values for its
/// `"auto"`s, or every problem at once (with the flags that would give
/// what it owes).
fn checked(a: &CheckArgs) -> Result<Resolved> {
    let hints = AutoHints {
        hidden_size: a.hidden,
        micro_batch: a.micro,
        lr: a.lr,
        weight_decay: a.weight_decay,
        betas: a.betas,
        eps: a.eps,
        gradient_clipping: a.clip,
        warmup_steps: a.warmup_steps,
        total_steps: a.total_steps,
        bf16: Some(a.bf16),
        fp16: Some(a.fp16),
        ..Default::default()
    };
    let text = std::fs::read_to_string(&a.file)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", a.file.display()))?;
    // The report lists the config's warnings itself, once: the library's
    // log of the same lines would print each twice.
    let checked =
        tracing::subscriber::with_default(tracing::subscriber::NoSubscriber::new(), || {
            Config::check(&text, a.world, &hints)
        });
    checked.map_err(|e| {
        let warned: String = e
            .warnings
            .iter()
            .map(|w| format!("\n  warning: {w}"))
            .collect();
        anyhow::anyhow!("{}: {e}{}{warned}", a.file.display(), owed_flags(&e))
    })
}

/// The optimizer line: its settings, and what state it keeps.
fn print_optimizer(o: &OptimizerConfig) {
    match o.kind {
        OptimizerKind::Lion => println!(
            "  optimizer        Lion lr {} betas ({}, {}) weight_decay {} (decoupled decay; one moment, no second)",
            show(o.lr),
            o.betas.0,
            o.betas.1,
            show(o.weight_decay),
        ),
        OptimizerKind::Sgd => println!(
            "  optimizer        SGD lr {} momentum {} dampening {} nesterov {} maximize {} weight_decay {} (L2 decay; {})",
            show(o.lr),
            o.momentum,
            o.dampening,
            o.nesterov,
            o.maximize,
            show(o.weight_decay),
            match o.moments() {
                0 => "no optimizer state",
                _ => "one momentum buffer",
            }
        ),
        OptimizerKind::Lamb => println!(
            "  optimizer        Lamb lr {} betas ({}, {}) eps {}{} weight_decay {} (in the update) bias_correction {} trust ratio in [{}, {}]",
            show(o.lr),
            o.betas.0,
            o.betas.1,
            o.eps,
            if o.eps_inside_sqrt { " (inside the square root)" } else { "" },
            show(o.weight_decay),
            o.bias_correction,
            o.min_coeff,
            o.max_coeff,
        ),
        OptimizerKind::Adagrad => println!(
            "  optimizer        Adagrad lr {} lr_decay {} eps {} initial_accumulator_value {} maximize {} weight_decay {} (L2 decay; one sum of squares)",
            show(o.lr),
            o.lr_decay,
            o.eps,
            o.initial_accumulator_value,
            o.maximize,
            show(o.weight_decay),
        ),
        OptimizerKind::Rmsprop => println!(
            "  optimizer        RMSprop lr {} alpha {} eps {} momentum {} centered {} maximize {} weight_decay {} (L2 decay; {})",
            show(o.lr),
            o.alpha,
            o.eps,
            o.momentum,
            o.centered,
            o.maximize,
            show(o.weight_decay),
            match (o.moments(), o.centered) {
                (1, _) => "a square average",
                (_, true) => "a square average and the gradient's average",
                (_, false) => "a square average and a momentum buffer",
            }
        ),
        OptimizerKind::Muon => println!(
            "  optimizer        Muon lr {} momentum {} nesterov {} ns_steps {} ns_coefficients {:?} adjust_lr_fn {} weight_decay {} (decoupled); AdamW lr {} betas ({}, {}) eps {} for what Muon does not take",
            show(o.lr),
            o.momentum,
            o.nesterov,
            o.ns_steps,
            o.ns_coefficients,
            if o.match_rms_adamw { "match_rms_adamw" } else { "original" },
            show(o.weight_decay),
            o.adam_lr.map_or_else(|| show(o.lr), |r| r.to_string()),
            o.betas.0,
            o.betas.1,
            o.eps,
        ),
        OptimizerKind::Adam | OptimizerKind::AdamW => println!(
            "  optimizer        {:?} lr {} betas ({}, {}) eps {} weight_decay {} ({} decay) bias_correction {}",
            o.kind,
            show(o.lr),
            o.betas.0,
            o.betas.1,
            o.eps,
            show(o.weight_decay),
            if o.adam_w_mode { "decoupled" } else { "L2" },
            o.bias_correction
        ),
    }
}

/// The precision and clipping lines.
fn print_precision(c: &Config) {
    let prec = match &c.precision {
        Precision::Fp32 => "fp32".to_string(),
        Precision::Bf16 {
            check_grad_overflow,
        } => format!(
            "bf16 compute, fp32 master{}",
            if *check_grad_overflow { ", steps with inf/NaN gradients skipped" } else { "" }
        ),
        Precision::Fp16(l) => format!(
            "fp16 compute, fp32 master, loss scale {} (initial 2^{}, window {}, hysteresis {}{}, min {})",
            if l.loss_scale == 0.0 { "dynamic".to_string() } else { l.loss_scale.to_string() },
            l.initial_scale_power,
            l.loss_scale_window,
            l.hysteresis,
            if l.consecutive_hysteresis { " consecutive" } else { "" },
            l.min_loss_scale
        ),
    };
    println!(
        "  precision        {prec}; gradients reduced in {}",
        if c.fp32_grad_reduce {
            "fp32"
        } else {
            "the compute dtype"
        }
    );
    println!(
        "  clipping         {}",
        if c.gradient_clipping > 0.0 {
            format!("global norm {}", c.gradient_clipping)
        } else {
            "off".into()
        }
    );
}

/// The ZeRO lines: stage, reductions, buckets, stage 3's settings,
/// sharding and offload.
fn print_zero(z: &ZeroConfig, gas: u64) {
    println!("  zero stage       {}", z.stage);
    println!("  reductions       {}", reductions(z.stage, gas));
    // Only what zrt acts on: allgather_bucket_size, contiguous_gradients
    // and stage3_max_reuse_distance change nothing here (the config warns
    // when they ask for something else).
    println!(
        "  buckets          reduce {} (elements); overlap_comm {}",
        show(z.reduce_bucket_size),
        z.overlap_comm
    );
    if z.stage == 3 {
        println!(
            "  stage 3          prefetch {} persistence < {} max_live {}",
            show(z.stage3_prefetch_bucket_size),
            show(z.stage3_param_persistence_threshold),
            z.stage3_max_live_parameters,
        );
        if z.zero_quantized_weights {
            println!("  qwZ              forward and backward gathers packed as int8 (a scale per 2048 elements or fewer, of one parameter)");
        }
        if z.zero_quantized_gradients {
            println!("  qgZ              gradient reduce-scatters packed as int8 (a scale per 2048 elements or fewer, of one parameter), one all_to_all each");
        }
        if z.zero_quantized_nontrainable_weights {
            println!("  frozen weights   sharded frozen parameters held and gathered as int8 (a scale per 2048 elements or fewer, of one parameter)");
        }
    }
    println!(
        "  sharding         {}; hpZ partition {}",
        z.mics_shard_size
            .map_or("over the whole world".to_string(), |s| format!(
                "MiCS groups of {s}"
            )),
        z.zero_hpz_partition_size
    );
    // As the config spells the devices, with the swap's folder.
    let off = |o: &Option<zrt::zero::config::OffloadConfig>| match o {
        Some(o) if o.device == OffloadDevice::Cpu => "cpu".to_string(),
        Some(o) if o.device == OffloadDevice::Nvme => format!(
            "nvme ({})",
            o.nvme_path.as_deref().unwrap_or("no nvme_path")
        ),
        _ => "none".to_string(),
    };
    println!(
        "  offload          optimizer {}, params {}",
        off(&z.offload_optimizer),
        off(&z.offload_param)
    );
}

/// The monitors and the comms logger.
fn print_observers(c: &Config) {
    let monitors: Vec<String> = [
        ("csv_monitor", &c.monitor.csv),
        ("tensorboard", &c.monitor.tensorboard),
    ]
    .into_iter()
    .filter_map(|(key, dir)| dir.as_ref().map(|d| format!("{key} into {}", d.display())))
    .collect();
    println!(
        "  monitors         {}",
        if monitors.is_empty() {
            "none".to_string()
        } else {
            monitors.join(", ")
        }
    );
    let l = &c.comms_logger;
    let logged = match &l.ops {
        _ if !l.enabled => "none".to_string(),
        None => "every op".to_string(),
        Some(ops) => ops.join(", "),
    };
    let each = if l.enabled && l.verbose {
        ", each as it completes"
    } else {
        ""
    };
    println!("  comms logger     {logged}{each}");
}

/// When a stage reduces the gradients, under `gas` accumulation steps:
/// stage 1 once, the sums during the last micro-step's backward; stage 0
/// every micro-step, as stages 2 and 3 do, which DeepSpeed's stage 0 does
/// not (docs/choices.md, "Stage 0 reduces every micro-step").
fn reductions(stage: u8, gas: u64) -> String {
    let op = if stage == 0 {
        "all-reduce"
    } else {
        "reduce-scatter"
    };
    match (stage, gas) {
        (1, n) if n > 1 => format!("reduce-scatter of the {n} micro-steps' local sums during the last one's backward, once a step"),
        (_, 1) => format!("{op} of the gradients during backward, once a step"),
        (0, n) => format!("all-reduce of every micro-step's gradients during backward, {n} a step (DeepSpeed's stage 0 reduces once, at the boundary, as zrt's stage 1 does)"),
        (_, n) => format!("{op} of every micro-step's gradients during backward, {n} a step"),
    }
}
