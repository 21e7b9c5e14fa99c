//! Resolving a parsed config for a world and a program
//! ([`Config::resolve`]): DeepSpeed's batch rule, and every `"auto"`
//! filled as Hugging Face's Trainer fills it.

use super::{AutoHints, Batch, Config, ConfigError, Precision, Resolved, SchedulerConfig, Setting};

/// The batch rule, DeepSpeed's: any two of (train, micro, gas) determine the
/// third; one alone is completed with gas = 1.
fn batch(
    train: Option<u64>,
    micro: Option<u64>,
    gas: Option<u64>,
    world: u64,
    problems: &mut Vec<String>,
) -> Option<Batch> {
    let div = |a: u64, b: u64, what: &str, problems: &mut Vec<String>| {
        if b == 0 || a % b != 0 {
            problems.push(what.to_string());
            None
        } else {
            Some(a / b)
        }
    };
    let b = match (train, micro, gas) {
        (Some(t), Some(m), Some(g)) => Batch {
            train: t,
            micro: m,
            gas: g,
        },
        (Some(t), Some(m), None) => {
            let g = div(t, m * world, &format!("train_batch_size {t} is not divisible by train_micro_batch_size_per_gpu {m} x world {world}"), problems)?;
            Batch {
                train: t,
                micro: m,
                gas: g,
            }
        }
        (Some(t), None, Some(g)) => {
            let m = div(t, g * world, &format!("train_batch_size {t} is not divisible by gradient_accumulation_steps {g} x world {world}"), problems)?;
            Batch {
                train: t,
                micro: m,
                gas: g,
            }
        }
        (None, Some(m), Some(g)) => Batch {
            train: m * g * world,
            micro: m,
            gas: g,
        },
        (Some(t), None, None) => {
            let m = div(
                t,
                world,
                &format!("train_batch_size {t} is not divisible by the world size {world}"),
                problems,
            )?;
            Batch {
                train: t,
                micro: m,
                gas: 1,
            }
        }
        (None, Some(m), None) => Batch {
            train: m * world,
            micro: m,
            gas: 1,
        },
        (None, None, _) => {
            problems.push("set `train_batch_size` or `train_micro_batch_size_per_gpu` (with `gradient_accumulation_steps` if not 1), or have the program pass its micro-batch in `AutoHints::micro_batch`, as Hugging Face's Trainer fills them".into());
            return None;
        }
    };
    // The config's own keys are refused at 0 when parsed; a 0 here came
    // from the program's AutoHints, and the product rule below would
    // blame train_batch_size for it.
    if b.micro == 0 || b.gas == 0 {
        problems.push(format!(
            "train_micro_batch_size_per_gpu {} and gradient_accumulation_steps {} must both be at least 1: check the values the program passes in AutoHints",
            b.micro, b.gas
        ));
        return None;
    }
    if b.train != b.micro * b.gas * world {
        problems.push(format!(
            "train_batch_size {} != train_micro_batch_size_per_gpu {} x gradient_accumulation_steps {} x world {world} (= {})",
            b.train,
            b.micro,
            b.gas,
            b.micro * b.gas * world
        ));
        return None;
    }
    Some(b)
}

/// The batch `elasticity` chooses for `world`. Batch keys given beside
/// it are refused, as DeepSpeed refuses them (it would ignore them), unless
/// `ignore_non_elastic_batch_info` says to ignore them.
fn elastic_batch(
    e: &super::ElasticityConfig,
    c: &Config,
    world: u64,
    problems: &mut Vec<String>,
) -> Option<Batch> {
    let given: Vec<&str> = [
        ("train_batch_size", c.train_batch_size),
        ("train_micro_batch_size_per_gpu", c.micro_batch),
        ("gradient_accumulation_steps", c.gradient_accumulation_steps),
    ]
    .into_iter()
    .filter(|(_, s)| *s != Setting::Value(None))
    .map(|(k, _)| k)
    .collect();
    if !given.is_empty() && !e.ignore_non_elastic_batch_info {
        let keys: Vec<String> = given.iter().map(|k| format!("`{k}`")).collect();
        problems.push(format!(
            "`elasticity` is enabled, which chooses the batch, and the config gives {} too: remove them, or set `elasticity.ignore_non_elastic_batch_info` to true to have them ignored",
            keys.join(", ")
        ));
        return None;
    }
    match e.batch_for(world) {
        Ok(b) => {
            tracing::info!(
                "elasticity: global batch {} on {world} rank(s): micro-batch {} x {} accumulation steps",
                b.train,
                b.micro,
                b.gas
            );
            Some(b)
        }
        Err(why) => {
            problems.push(why);
            None
        }
    }
}

/// The batch from the config's batch keys (`"auto"` ones from the
/// program's [`AutoHints`]) by DeepSpeed's rule.
fn batch_keys(
    c: &Config,
    hints: &AutoHints,
    world: u64,
    problems: &mut Vec<String>,
) -> Option<Batch> {
    // A batch key's hint comes from the program's micro-batch (the
    // train batch is micro x gas x world).
    let b = |s: Setting<Option<u64>>, name: &str, hint: Option<u64>, problems: &mut Vec<String>| {
        match s {
            Setting::Value(v) => v,
            Setting::Auto => {
                let rule = ("value for it", "micro_batch");
                auto(name, hint.map(|h| h as f64), rule, problems).map(|v| v as u64)
            }
        }
    };
    let mut micro = b(
        c.micro_batch,
        "train_micro_batch_size_per_gpu",
        hints.micro_batch,
        problems,
    );
    if micro.is_none() && c.train_batch_size == Setting::Value(None) {
        // No batch keys at all (a template): the program's micro-batch, as
        // Hugging Face's integration fills them.
        if let Some(m) = hints.micro_batch {
            tracing::info!(
                "config: no batch keys; train_micro_batch_size_per_gpu {m} from the program"
            );
            micro = Some(m);
        }
    }
    let gas = b(
        c.gradient_accumulation_steps,
        "gradient_accumulation_steps",
        hints.gradient_accumulation_steps.or(Some(1)),
        problems,
    );
    let train_hint = micro.zip(gas).map(|(m, g)| m * g * world);
    let train = b(c.train_batch_size, "train_batch_size", train_hint, problems);
    batch(train, micro, gas, world, problems)
}

/// The program's value for `"auto"` key `name`, logged; or a problem
/// naming what the program did not give (`rule`) and the [`AutoHints`]
/// field that gives it (`field`; `zrt config check` maps it to its flag).
fn auto<T: std::fmt::Debug>(
    name: &str,
    hint: Option<T>,
    (rule, field): (&str, &str),
    problems: &mut Vec<String>,
) -> Option<T> {
    match hint {
        Some(v) => {
            tracing::info!("config: `{name}` \"auto\" resolved to {v:?} ({rule})");
            Some(v)
        }
        None => {
            problems.push(format!("`{name}` is \"auto\" but the program gave no {rule}: set it in the config, or pass it in `AutoHints::{field}`"));
            None
        }
    }
}

/// Fills the keys parsing left to the program ([`Config::unresolved`],
/// [`Config::precision_auto`]) as Hugging Face's integration fills them:
/// betas, eps, the clip, warm-up and total steps and the 16-bit switches
/// from the program; `warmup_min_lr` 0; `warmup_max_lr` the optimizer's lr
/// (also DeepSpeed's WarmupLR's default when the key is left out). Runs
/// after the optimizer's lr is resolved.
fn fill_from_program(c: &mut Config, hints: &AutoHints, problems: &mut Vec<String>) {
    for key in std::mem::take(&mut c.unresolved) {
        let param = key.strip_prefix("scheduler.params.");
        match (key.as_str(), param) {
            ("optimizer.params.betas", _) => {
                if let Some(b) = auto(&key, hints.betas, ("betas", "betas"), problems) {
                    c.optimizer.betas = b;
                }
            }
            ("optimizer.params.eps", _) => {
                if let Some(e) = auto(&key, hints.eps, ("epsilon", "eps"), problems) {
                    c.optimizer.eps = e;
                }
            }
            ("gradient_clipping", _) => {
                if let Some(g) = auto(
                    &key,
                    hints.gradient_clipping,
                    ("gradient clip", "gradient_clipping"),
                    problems,
                ) {
                    c.gradient_clipping = g;
                }
            }
            (_, Some("warmup_max_lr")) => {
                // Unresolved only when the optimizer's lr is "auto" with no
                // hint, which is a problem of its own already.
                if let (Some(lr), Some(s)) = (c.optimizer.lr.value(), &mut c.scheduler) {
                    tracing::info!(
                        "config: `{key}` (\"auto\" or left out) is the optimizer's lr, {lr}"
                    );
                    set_param(s, "warmup_max_lr", lr);
                }
            }
            (_, Some("warmup_min_lr")) => {
                // Parsing left DeepSpeed's default there, 0: what Hugging
                // Face fills.
                tracing::info!("config: `{key}` \"auto\" resolved to 0 (as Hugging Face fills it)");
            }
            (_, Some(param)) => {
                let (value, rule) = match param {
                    "warmup_num_steps" => (
                        hints.warmup_steps.map(|n| n as f64),
                        ("warm-up steps", "warmup_steps"),
                    ),
                    _ => (
                        hints.total_steps.map(|n| n as f64),
                        ("total steps", "total_steps"),
                    ),
                };
                if let (Some(v), Some(s)) = (auto(&key, value, rule, problems), &mut c.scheduler) {
                    set_param(s, param, v);
                }
            }
            _ => {}
        }
    }
    if c.gradient_clipping < 0.0 {
        problems.push(format!(
            "`gradient_clipping` must be >= 0 (0 turns it off), got {} from the program",
            c.gradient_clipping
        ));
    }
    if let Some(
        SchedulerConfig::WarmupLR {
            warmup_num_steps: 0,
            ..
        }
        | SchedulerConfig::WarmupDecayLR {
            warmup_num_steps: 0,
            ..
        }
        | SchedulerConfig::WarmupCosineLR {
            warmup_num_steps: 0,
            ..
        },
    ) = c.scheduler
    {
        problems.push("`scheduler.params.warmup_num_steps` must be at least 1 (DeepSpeed refuses 0 too), got 0 from the program".into());
    }
    let wants = |p: &Precision| match p {
        Precision::Bf16 { .. } => ("bf16.enabled", hints.bf16),
        _ => ("fp16.enabled", hints.fp16),
    };
    for p in std::mem::take(&mut c.precision_auto) {
        let (key, hint) = wants(&p);
        let on = hint.unwrap_or(false);
        tracing::info!("config: `{key}` \"auto\" resolved to {on} (the program's choice; false when it gives none)");
        if !on {
            continue;
        }
        if c.precision != Precision::Fp32 {
            problems.push("`fp16.enabled` and `bf16.enabled` both resolved to true: the program asks for both bf16 and fp16 (AutoHints); choose one".into());
        } else {
            c.precision = p;
        }
    }
}

/// Sets warm-up schedule parameter `param` (`warmup_max_lr`,
/// `warmup_num_steps` or `total_num_steps`: one [`fill_from_program`]
/// fills).
fn set_param(s: &mut SchedulerConfig, param: &str, v: f64) {
    match (s, param) {
        (
            SchedulerConfig::WarmupLR { warmup_max_lr, .. }
            | SchedulerConfig::WarmupDecayLR { warmup_max_lr, .. },
            "warmup_max_lr",
        ) => *warmup_max_lr = v,
        (
            SchedulerConfig::WarmupLR {
                warmup_num_steps, ..
            }
            | SchedulerConfig::WarmupDecayLR {
                warmup_num_steps, ..
            }
            | SchedulerConfig::WarmupCosineLR {
                warmup_num_steps, ..
            },
            "warmup_num_steps",
        ) => *warmup_num_steps = v as u64,
        (
            SchedulerConfig::WarmupDecayLR {
                total_num_steps, ..
            }
            | SchedulerConfig::WarmupCosineLR {
                total_num_steps, ..
            },
            "total_num_steps",
        ) => *total_num_steps = v as u64,
        _ => {}
    }
}

/// Resolves `"auto"` and the batch rule (see [`Config::resolve`]).
pub(super) fn resolve(
    cfg: &Config,
    world: u64,
    hints: &AutoHints,
) -> Result<Resolved, ConfigError> {
    let mut problems = Vec::new();
    let mut c = cfg.clone();
    let hidden = hints.hidden_size.map(|h| h as f64);
    let fill_u64 = |s: &mut Setting<u64>, v: Option<f64>| {
        if let Some(v) = v {
            *s = Setting::Value(v as u64);
        }
    };
    if c.zero.reduce_bucket_size == Setting::Auto {
        let v = auto(
            "zero_optimization.reduce_bucket_size",
            hidden.map(|h| h * h),
            ("hidden size (hidden^2)", "hidden_size"),
            &mut problems,
        );
        fill_u64(&mut c.zero.reduce_bucket_size, v);
    }
    if c.zero.stage3_prefetch_bucket_size == Setting::Auto {
        let v = auto(
            "zero_optimization.stage3_prefetch_bucket_size",
            hidden.map(|h| (0.9 * h * h).floor()),
            ("hidden size (0.9 hidden^2)", "hidden_size"),
            &mut problems,
        );
        fill_u64(&mut c.zero.stage3_prefetch_bucket_size, v);
    }
    if c.zero.stage3_param_persistence_threshold == Setting::Auto {
        let v = auto(
            "zero_optimization.stage3_param_persistence_threshold",
            hidden.map(|h| 10.0 * h),
            ("hidden size (10 hidden)", "hidden_size"),
            &mut problems,
        );
        fill_u64(&mut c.zero.stage3_param_persistence_threshold, v);
    }
    if c.optimizer.lr == Setting::Auto {
        if let Some(v) = auto(
            "optimizer.params.lr",
            hints.lr,
            ("learning rate", "lr"),
            &mut problems,
        ) {
            c.optimizer.lr = Setting::Value(v);
        }
    }
    if c.optimizer.weight_decay == Setting::Auto {
        if let Some(v) = auto(
            "optimizer.params.weight_decay",
            hints.weight_decay,
            ("weight decay", "weight_decay"),
            &mut problems,
        ) {
            c.optimizer.weight_decay = Setting::Value(v);
        }
    }
    fill_from_program(&mut c, hints, &mut problems);
    let resolved = match &c.elasticity {
        Some(e) => elastic_batch(e, &c, world, &mut problems),
        None => batch_keys(&c, hints, world, &mut problems),
    };
    if let Some(s) = c.zero.mics_shard_size {
        if world % s != 0 {
            problems.push(format!(
                "`zero_optimization.mics_shard_size` {s} must divide the world size {world}"
            ));
        }
    }
    if world % c.zero.zero_hpz_partition_size != 0 {
        problems.push(format!(
            "`zero_optimization.zero_hpz_partition_size` {} must divide the world size {world}",
            c.zero.zero_hpz_partition_size
        ));
    }
    match resolved {
        Some(batch) if problems.is_empty() => {
            c.train_batch_size = Setting::Value(Some(batch.train));
            c.micro_batch = Setting::Value(Some(batch.micro));
            c.gradient_accumulation_steps = Setting::Value(Some(batch.gas));
            Ok(Resolved {
                config: c,
                batch,
                world,
            })
        }
        _ => Err(ConfigError {
            problems,
            ..Default::default()
        }),
    }
}
