//! The `scheduler` block: DeepSpeed's learning-rate schedules, each
//! with its keys, defaults and DeepSpeed's refusals (and a few of zrt's
//! own where DeepSpeed would change the schedule without a word).

use serde_json::{Map, Value};

use super::{join, P};
use crate::config::{OptimizerKind, SchedulerConfig};

impl P {
    /// The `scheduler` block, if any (`optimizer` decides whether
    /// OneCycle can cycle momentum).
    pub(super) fn scheduler(
        &mut self,
        top: &Map<String, Value>,
        optimizer: OptimizerKind,
    ) -> Option<SchedulerConfig> {
        let o = self.object(top, "scheduler")?;
        self.keys(o, "scheduler", &["type", "params"], &[], false);
        let empty = Map::new();
        let p = match o.get("params") {
            Some(Value::Object(m)) => m,
            _ => &empty,
        };
        let path = "scheduler.params";
        let ty = self.string(o, "scheduler", "type").unwrap_or_default();
        let warmup_type = || {
            p.get("warmup_type")
                .and_then(Value::as_str)
                .unwrap_or("log")
                .to_string()
        };
        let s = match ty.as_str() {
            "WarmupLR" => {
                self.keys(
                    p,
                    path,
                    &[
                        "warmup_min_lr",
                        "warmup_max_lr",
                        "warmup_num_steps",
                        "warmup_type",
                        "last_batch_iteration",
                    ],
                    &[],
                    false,
                );
                SchedulerConfig::WarmupLR {
                    warmup_min_lr: self.f64_auto(p, path, "warmup_min_lr", 0.0),
                    warmup_max_lr: self.warmup_max_lr(p, path, true),
                    warmup_num_steps: self.u64_auto(p, path, "warmup_num_steps", 1000),
                    warmup_type: warmup_type(),
                }
            }
            "WarmupDecayLR" => {
                self.keys(
                    p,
                    path,
                    &[
                        "warmup_min_lr",
                        "warmup_max_lr",
                        "warmup_num_steps",
                        "warmup_type",
                        "total_num_steps",
                        "last_batch_iteration",
                    ],
                    &[],
                    false,
                );
                if !p.contains_key("total_num_steps") {
                    self.problems.push(
                        "`scheduler.params.total_num_steps` is required by WarmupDecayLR".into(),
                    );
                }
                SchedulerConfig::WarmupDecayLR {
                    warmup_min_lr: self.f64_auto(p, path, "warmup_min_lr", 0.0),
                    warmup_max_lr: self.warmup_max_lr(p, path, false),
                    warmup_num_steps: self.u64_auto(p, path, "warmup_num_steps", 1000),
                    warmup_type: warmup_type(),
                    total_num_steps: self.u64_auto(p, path, "total_num_steps", 1),
                }
            }
            "WarmupCosineLR" => {
                self.keys(
                    p,
                    path,
                    &[
                        "total_num_steps",
                        "warmup_min_ratio",
                        "warmup_num_steps",
                        "cos_min_ratio",
                        "warmup_type",
                        "last_batch_iteration",
                    ],
                    &[],
                    false,
                );
                if !p.contains_key("total_num_steps") {
                    self.problems.push(
                        "`scheduler.params.total_num_steps` is required by WarmupCosineLR".into(),
                    );
                }
                SchedulerConfig::WarmupCosineLR {
                    total_num_steps: self.u64_auto(p, path, "total_num_steps", 1),
                    warmup_min_ratio: self.f64_or(p, path, "warmup_min_ratio", 0.0),
                    warmup_num_steps: self.u64_auto(p, path, "warmup_num_steps", 1000),
                    cos_min_ratio: self.f64_or(p, path, "cos_min_ratio", 1e-4),
                    warmup_type: warmup_type(),
                }
            }
            "OneCycle" => self.one_cycle(p, path, optimizer),
            "LRRangeTest" => self.lr_range_test(p, path),
            other => {
                self.problems.push(format!(
                    "`scheduler.type` \"{other}\" is not supported by zrt: use WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest"
                ));
                return None;
            }
        };
        // DeepSpeed starts a schedule at `last_batch_iteration` + 1 without
        // setting its first rate; zrt resumes a schedule from the
        // checkpoint's step instead, and ignoring the key would run another
        // schedule than the one asked for without a word.
        if let Some(v) = p.get("last_batch_iteration") {
            let at = "scheduler.params.last_batch_iteration";
            if self.number(v, at).is_some_and(|n| n != -1.0) {
                self.problems.push(format!("`{at}` is {v}: zrt starts every schedule at its beginning and resumes it from a checkpoint's step; remove the key (or set it to -1) and load the checkpoint to go on"));
            }
        }
        if let SchedulerConfig::WarmupLR {
            warmup_type,
            warmup_num_steps,
            ..
        }
        | SchedulerConfig::WarmupDecayLR {
            warmup_type,
            warmup_num_steps,
            ..
        }
        | SchedulerConfig::WarmupCosineLR {
            warmup_type,
            warmup_num_steps,
            ..
        } = &s
        {
            // DeepSpeed falls back to "log" with a warning; a typo here would
            // change the schedule without a word, so it is refused instead.
            if warmup_type != "log" && warmup_type != "linear" {
                self.problems.push(format!("`scheduler.params.warmup_type` must be \"log\" or \"linear\", got \"{warmup_type}\""));
            }
            if *warmup_num_steps == 0 {
                self.problems.push(format!("`scheduler.params.warmup_num_steps` must be at least 1 for {ty} (DeepSpeed refuses 0 too)"));
            }
        }
        Some(s)
    }

    /// WarmupLR's and WarmupDecayLR's `warmup_max_lr`: a number, or the
    /// optimizer's lr (filled at resolve once that is known) when given
    /// `"auto"` (Hugging Face fills it so) or when left out of a WarmupLR
    /// (`absent_is_lr`: DeepSpeed 0.19's WarmupLR defaults to the
    /// optimizer's lr, its WarmupDecayLR to 1e-3).
    fn warmup_max_lr(&mut self, p: &Map<String, Value>, path: &str, absent_is_lr: bool) -> f64 {
        let from_optimizer = match p.get("warmup_max_lr") {
            None => absent_is_lr,
            Some(v) => v == "auto",
        };
        if from_optimizer {
            self.autos.push(join(path, "warmup_max_lr"));
            1e-3
        } else {
            self.f64_or(p, path, "warmup_max_lr", 1e-3)
        }
    }

    /// DeepSpeed's `OneCycle`, with its defaults; `cycle_min_lr` and
    /// `cycle_max_lr` have none there and are required here.
    fn one_cycle(
        &mut self,
        p: &Map<String, Value>,
        path: &str,
        optimizer: OptimizerKind,
    ) -> SchedulerConfig {
        self.keys(
            p,
            path,
            &[
                "cycle_min_lr",
                "cycle_max_lr",
                "decay_lr_rate",
                "cycle_first_step_size",
                "cycle_second_step_size",
                "cycle_first_stair_count",
                "cycle_second_stair_count",
                "decay_step_size",
                "cycle_momentum",
                "cycle_min_mom",
                "cycle_max_mom",
                "decay_mom_rate",
                "last_batch_iteration",
            ],
            &[],
            false,
        );
        for key in ["cycle_min_lr", "cycle_max_lr"] {
            if !p.contains_key(key) {
                self.problems.push(format!(
                    "`{path}.{key}` is required by OneCycle (DeepSpeed has no default either)"
                ));
            }
        }
        let first = self.u64_or(p, path, "cycle_first_step_size", 2000);
        if first == 0 {
            // DeepSpeed refuses it too: the rising half's slope divides by it.
            self.problems.push(format!(
                "`{path}.cycle_first_step_size` must be at least 1 for OneCycle"
            ));
        }
        let second = self.u64_or(p, path, "cycle_second_step_size", first);
        let first_stairs = self.u64_or(p, path, "cycle_first_stair_count", 0);
        let decay_step_size = self.u64_or(p, path, "decay_step_size", 0);
        let mut cycle_momentum = self.bool_or(p, path, "cycle_momentum", true);
        if cycle_momentum
            && matches!(
                optimizer,
                OptimizerKind::Sgd | OptimizerKind::Adagrad | OptimizerKind::Rmsprop
            )
        {
            // DeepSpeed's OneCycle turns its momentum off, with a warning,
            // for an optimizer without betas.
            let kept = match optimizer {
                OptimizerKind::Sgd => ", SGD's `momentum` stays as set",
                _ => "",
            };
            self.warnings.push(format!(
                "OneCycle cycles momentum as the optimizer's betas, which {} has not: `{path}.cycle_momentum` is off (as DeepSpeed turns it off){kept}; set cycle_momentum to false to silence this",
                optimizer.name()
            ));
            cycle_momentum = false;
        }
        let cycle_min_mom = self.f64_or(p, path, "cycle_min_mom", 0.8);
        let cycle_max_mom = self.f64_or(p, path, "cycle_max_mom", 0.9);
        let decay_mom_rate = self.f64_or(p, path, "decay_mom_rate", 0.0);
        if cycle_momentum {
            // They become Adam's beta1, which the optimizer holds to [0, 1).
            for (key, m) in [
                ("cycle_min_mom", cycle_min_mom),
                ("cycle_max_mom", cycle_max_mom),
            ] {
                if !(0.0..1.0).contains(&m) {
                    self.problems.push(format!(
                        "`{path}.{key}` must be in [0, 1) (it becomes the optimizer's beta1), got {m}"
                    ));
                }
            }
            let (rate, d, max) = (decay_mom_rate, decay_step_size, cycle_max_mom);
            if rate > 0.0 && d > 0 && (0.0..1.0).contains(&max) && max > 0.0 {
                // DeepSpeed's momentum decay multiplies: beta1 grows past the
                // cycle until it reaches 1, where Adam stops (the engine
                // refuses that step rather than diverge).
                let past = (d as f64 * (1.0 / max - 1.0) / rate).ceil();
                self.warnings.push(format!(
                    "`{path}.decay_mom_rate` {rate} raises beta1 after the cycle (OneCycle multiplies `cycle_max_mom` by 1 + rate x iterations / `decay_step_size`, as DeepSpeed does): it reaches 1 about {past} steps after the cycle's {} steps, and the engine stops there; Adam and Lion need beta1 < 1",
                    first + second
                ));
            }
        }
        SchedulerConfig::OneCycle {
            cycle_min_lr: self.f64_or(p, path, "cycle_min_lr", 0.0),
            cycle_max_lr: self.f64_or(p, path, "cycle_max_lr", 0.0),
            decay_lr_rate: self.f64_or(p, path, "decay_lr_rate", 0.0),
            cycle_first_step_size: first,
            cycle_second_step_size: second,
            cycle_first_stair_count: first_stairs,
            cycle_second_stair_count: self.u64_or(
                p,
                path,
                "cycle_second_stair_count",
                first_stairs,
            ),
            decay_step_size,
            cycle_momentum,
            cycle_min_mom,
            cycle_max_mom,
            decay_mom_rate,
        }
    }

    /// DeepSpeed's `LRRangeTest`, with its defaults.
    fn lr_range_test(&mut self, p: &Map<String, Value>, path: &str) -> SchedulerConfig {
        self.keys(
            p,
            path,
            &[
                "lr_range_test_min_lr",
                "lr_range_test_step_size",
                "lr_range_test_step_rate",
                "lr_range_test_staircase",
                "last_batch_iteration",
            ],
            &[],
            false,
        );
        let step_size = self.u64_or(p, path, "lr_range_test_step_size", 2000);
        if step_size == 0 {
            self.problems.push(format!(
                "`{path}.lr_range_test_step_size` must be at least 1 (DeepSpeed refuses 0 too)"
            ));
        }
        SchedulerConfig::LRRangeTest {
            lr_range_test_min_lr: self.f64_or(p, path, "lr_range_test_min_lr", 1e-3),
            lr_range_test_step_size: step_size,
            lr_range_test_step_rate: self.f64_or(p, path, "lr_range_test_step_rate", 1.0),
            lr_range_test_staircase: self.bool_or(p, path, "lr_range_test_staircase", false),
        }
    }
}
