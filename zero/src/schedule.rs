//! Learning-rate schedules, with DeepSpeed's formulas
//! (`deepspeed/runtime/lr_schedules.py`).

use crate::config::SchedulerConfig;

/// The learning rate optimizer step `step` (0-based) uses, as under
/// DeepSpeed's engine. DeepSpeed steps the scheduler after the optimizer,
/// so step `k` runs at the schedule's value after `k - 1` scheduler steps
/// (iteration `k - 1`), and step 0 at the value the scheduler set before
/// it started: `warmup_min_lr` for WarmupLR and WarmupDecayLR, 0 for
/// WarmupCosineLR (DeepSpeed's first step with it does not move the
/// weights). Without a scheduler every step uses `base_lr`.
pub fn lr_at(s: Option<&SchedulerConfig>, base_lr: f64, step: u64) -> f64 {
    let Some(s) = s else { return base_lr };
    match step.checked_sub(1) {
        Some(iteration) => at_iteration(s, base_lr, iteration),
        None => match s {
            SchedulerConfig::WarmupLR { warmup_min_lr, .. }
            | SchedulerConfig::WarmupDecayLR { warmup_min_lr, .. } => *warmup_min_lr,
            SchedulerConfig::WarmupCosineLR { .. } => 0.0,
        },
    }
}

/// Warm-up progress in [0, 1] at iteration `it` of `n` warm-up iterations.
/// DeepSpeed uses at least 2 (a log over 1 would divide by 0).
fn warm_up(it: u64, n: u64, ty: &str) -> f64 {
    let n = n.max(2);
    if it >= n {
        1.0
    } else if ty == "linear" {
        it as f64 / n as f64
    } else {
        // DeepSpeed's log warm-up: log(it + 1) / log(n).
        ((it + 1) as f64).ln() / (n as f64).ln()
    }
}

/// The schedule's value after `it + 1` scheduler steps
/// (`deepspeed/runtime/lr_schedules.py`, `get_lr` at `last_batch_iteration = it`).
fn at_iteration(s: &SchedulerConfig, base_lr: f64, it: u64) -> f64 {
    match s {
        SchedulerConfig::WarmupLR {
            warmup_min_lr: min,
            warmup_max_lr: max,
            warmup_num_steps: n,
            warmup_type: ty,
        } => min + (max - min) * warm_up(it, *n, ty),
        SchedulerConfig::WarmupDecayLR {
            warmup_min_lr: min,
            warmup_max_lr: max,
            warmup_num_steps: n,
            warmup_type: ty,
            total_num_steps: total,
        } => {
            let n = (*n).max(2);
            let gamma = if it < n {
                warm_up(it, n, ty)
            } else {
                // Linear decay from max at the end of warm-up to min at
                // `total_num_steps`, and min after it.
                let left = total.saturating_sub(it) as f64;
                let span = total.saturating_sub(n).max(1) as f64;
                (left / span).max(0.0)
            };
            min + (max - min) * gamma
        }
        SchedulerConfig::WarmupCosineLR {
            total_num_steps: total,
            warmup_min_ratio: wmin,
            warmup_num_steps: n,
            cos_min_ratio: cmin,
            warmup_type: ty,
        } => {
            let n = (*n).max(2);
            let ratio = if it < n {
                wmin + (1.0 - wmin) * warm_up(it, n, ty)
            } else {
                // The cosine counts its first step as 1, and stays at the
                // floor from `total_num_steps` on.
                let span = total.saturating_sub(n).max(1) as f64;
                let progress = ((it - n + 1) as f64 / span).min(1.0);
                (cmin + (1.0 - cmin) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
                    .max(0.0)
            };
            base_lr * ratio
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What optimizer step k used under DeepSpeed 0.19.8's engine, for
    /// k = 0, 1, ...: produced with DeepSpeed's own scheduler classes on a
    /// torch SGD optimizer at lr 2.0, reading the lr before each
    /// `optimizer.step()` and calling `scheduler.step()` after it, as
    /// `DeepSpeedEngine._take_model_step` does.
    fn deepspeed(s: &SchedulerConfig, want: &[f64]) {
        let got: Vec<f64> = (0..want.len() as u64)
            .map(|k| lr_at(Some(s), 2.0, k))
            .collect();
        for (k, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() < 1e-12, "step {k}: {got:?} against {want:?}");
        }
    }

    fn warmup(min: f64, max: f64, n: u64, ty: &str) -> SchedulerConfig {
        SchedulerConfig::WarmupLR {
            warmup_min_lr: min,
            warmup_max_lr: max,
            warmup_num_steps: n,
            warmup_type: ty.into(),
        }
    }

    fn cosine(total: u64, wmin: f64, n: u64, cmin: f64, ty: &str) -> SchedulerConfig {
        SchedulerConfig::WarmupCosineLR {
            total_num_steps: total,
            warmup_min_ratio: wmin,
            warmup_num_steps: n,
            cos_min_ratio: cmin,
            warmup_type: ty.into(),
        }
    }

    #[test]
    fn every_step_uses_the_rate_deepspeeds_engine_gives_it() {
        deepspeed(
            &warmup(0.001, 0.011, 4, "linear"),
            &[0.001, 0.001, 0.0035, 0.006, 0.0085, 0.011],
        );
        deepspeed(
            &warmup(0.0, 1.0, 4, "log"),
            &[0.0, 0.0, 0.5, 0.7924812503605781, 1.0, 1.0],
        );
        // One warm-up step counts as two, as in DeepSpeed.
        deepspeed(&warmup(0.0, 1.0, 1, "linear"), &[0.0, 0.0, 0.5, 1.0]);
        let decay = |min: f64, ty: &str| SchedulerConfig::WarmupDecayLR {
            warmup_min_lr: min,
            warmup_max_lr: 1.0,
            warmup_num_steps: 3,
            warmup_type: ty.into(),
            total_num_steps: 8,
        };
        deepspeed(
            &decay(0.0, "linear"),
            &[0.0, 0.0, 1.0 / 3.0, 2.0 / 3.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.0],
        );
        // The decay runs down to warmup_min_lr, not to 0.
        deepspeed(
            &decay(0.1, "log"),
            &[
                0.1,
                0.1,
                0.6678367782143115,
                1.0,
                1.0,
                0.82,
                0.64,
                0.46,
                0.28,
                0.1,
            ],
        );
        let after_warm_up = [
            1.8472135954999582,
            1.4472135954999579,
            0.9527864045000422,
            0.5527864045000421,
            0.4,
            0.4,
        ];
        // WarmupCosineLR warms up by log unless told linear, and its first
        // step runs at 0.
        let log = [&[0.0, 0.2, 1.335673556428623, 2.0][..], &after_warm_up].concat();
        deepspeed(&cosine(8, 0.1, 3, 0.2, "log"), &log);
        let lin = [&[0.0, 0.2, 0.8, 1.4][..], &after_warm_up].concat();
        deepspeed(&cosine(8, 0.1, 3, 0.2, "linear"), &lin);
        // total_num_steps within the warm-up: straight to the floor after it.
        deepspeed(
            &cosine(2, 0.0, 3, 0.25, "linear"),
            &[0.0, 0.0, 2.0 / 3.0, 4.0 / 3.0, 0.5, 0.5],
        );
        assert_eq!(lr_at(None, 0.3, 0), 0.3);
        assert_eq!(lr_at(None, 0.3, 7), 0.3);
    }
}
