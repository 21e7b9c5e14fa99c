//! Learning-rate schedules, with DeepSpeed's formulas
//! (`deepspeed/runtime/lr_schedules.py`).

use crate::config::SchedulerConfig;

/// The learning rate for optimizer step `step` (0-based: the rate used by
/// the first step is `lr(0)`), given the optimizer's base `lr`.
pub fn lr_at(s: Option<&SchedulerConfig>, base_lr: f64, step: u64) -> f64 {
    let warm = |min: f64, max: f64, n: u64, ty: &str, step: u64| -> f64 {
        if n == 0 {
            return max;
        }
        let frac = if ty == "linear" {
            (step as f64 / n as f64).min(1.0)
        } else {
            // DeepSpeed's log warm-up: log(step + 1) / log(n).
            ((step + 1) as f64).ln() / (n as f64).ln().max(f64::MIN_POSITIVE)
        };
        min + (max - min) * frac.min(1.0)
    };
    match s {
        None => base_lr,
        Some(SchedulerConfig::WarmupLR {
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
        }) => {
            if step < *warmup_num_steps {
                warm(
                    *warmup_min_lr,
                    *warmup_max_lr,
                    *warmup_num_steps,
                    warmup_type,
                    step,
                )
            } else {
                *warmup_max_lr
            }
        }
        Some(SchedulerConfig::WarmupDecayLR {
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            total_num_steps,
        }) => {
            if step < *warmup_num_steps {
                warm(
                    *warmup_min_lr,
                    *warmup_max_lr,
                    *warmup_num_steps,
                    warmup_type,
                    step,
                )
            } else {
                let left = total_num_steps.saturating_sub(step) as f64;
                let span = total_num_steps.saturating_sub(*warmup_num_steps).max(1) as f64;
                warmup_max_lr * (left / span).max(0.0)
            }
        }
        Some(SchedulerConfig::WarmupCosineLR {
            total_num_steps,
            warmup_min_ratio,
            warmup_num_steps,
            cos_min_ratio,
        }) => {
            let ratio = if step < *warmup_num_steps {
                warmup_min_ratio
                    + (1.0 - warmup_min_ratio) * step as f64 / (*warmup_num_steps).max(1) as f64
            } else {
                let span = total_num_steps.saturating_sub(*warmup_num_steps).max(1) as f64;
                let progress = ((step - warmup_num_steps) as f64 / span).min(1.0);
                cos_min_ratio
                    + (1.0 - cos_min_ratio) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            };
            base_lr * ratio
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_shapes_match_deepspeed() {
        let lin = SchedulerConfig::WarmupLR {
            warmup_min_lr: 0.0,
            warmup_max_lr: 1.0,
            warmup_num_steps: 10,
            warmup_type: "linear".into(),
        };
        assert_eq!(lr_at(Some(&lin), 0.5, 0), 0.0);
        assert_eq!(lr_at(Some(&lin), 0.5, 5), 0.5);
        assert_eq!(lr_at(Some(&lin), 0.5, 50), 1.0);
        let log = SchedulerConfig::WarmupLR {
            warmup_min_lr: 0.0,
            warmup_max_lr: 1.0,
            warmup_num_steps: 10,
            warmup_type: "log".into(),
        };
        assert!((lr_at(Some(&log), 0.5, 4) - (5f64).ln() / (10f64).ln()).abs() < 1e-12);
        let decay = SchedulerConfig::WarmupDecayLR {
            warmup_min_lr: 0.0,
            warmup_max_lr: 1.0,
            warmup_num_steps: 10,
            warmup_type: "linear".into(),
            total_num_steps: 110,
        };
        assert_eq!(lr_at(Some(&decay), 0.5, 60), 0.5);
        assert_eq!(lr_at(Some(&decay), 0.5, 200), 0.0);
        let cos = SchedulerConfig::WarmupCosineLR {
            total_num_steps: 110,
            warmup_min_ratio: 0.0,
            warmup_num_steps: 10,
            cos_min_ratio: 0.0,
        };
        assert_eq!(lr_at(Some(&cos), 2.0, 10), 2.0);
        assert!((lr_at(Some(&cos), 2.0, 60) - 1.0).abs() < 1e-12);
        assert!(lr_at(Some(&cos), 2.0, 110).abs() < 1e-12);
        assert_eq!(lr_at(None, 0.3, 7), 0.3);
    }
}
