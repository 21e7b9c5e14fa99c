//! Learning-rate schedules, with DeepSpeed's formulas
//! (`deepspeed/runtime/lr_schedules.py`).

use crate::config::SchedulerConfig;

/// The learning rate optimizer step `step` (0-based) uses, as under
/// DeepSpeed's engine. DeepSpeed steps the scheduler after the optimizer,
/// so step `k` runs at the schedule's value after `k - 1` scheduler steps
/// (iteration `k - 1`), and step 0 at the value the scheduler set before
/// it started: `warmup_min_lr` for WarmupLR and WarmupDecayLR, 0 for
/// WarmupCosineLR (DeepSpeed's first step with it does not move the
/// weights), `cycle_min_lr` for OneCycle and `lr_range_test_min_lr` for
/// LRRangeTest. Without a scheduler every step uses `base_lr`.
pub fn lr_at(s: Option<&SchedulerConfig>, base_lr: f64, step: u64) -> f64 {
    let Some(s) = s else { return base_lr };
    match step.checked_sub(1) {
        Some(iteration) => at_iteration(s, base_lr, iteration),
        None => match s {
            SchedulerConfig::WarmupLR { warmup_min_lr, .. }
            | SchedulerConfig::WarmupDecayLR { warmup_min_lr, .. } => *warmup_min_lr,
            SchedulerConfig::WarmupCosineLR { .. } => 0.0,
            SchedulerConfig::OneCycle { cycle_min_lr, .. } => *cycle_min_lr,
            SchedulerConfig::LRRangeTest {
                lr_range_test_min_lr,
                ..
            } => *lr_range_test_min_lr,
        },
    }
}

/// Adam's (beta1, beta2) for optimizer step `step`: `betas` as configured,
/// except under OneCycle with `cycle_momentum`, which (as DeepSpeed's
/// does) sets beta1 to its cycled momentum and beta2 to 0.99, from before
/// the first step on (step 0 uses `cycle_min_mom`, the value DeepSpeed's
/// scheduler sets when it is made).
pub fn betas_at(s: Option<&SchedulerConfig>, betas: (f64, f64), step: u64) -> (f64, f64) {
    let Some(SchedulerConfig::OneCycle {
        cycle_momentum: true,
        cycle_min_mom: min,
        cycle_max_mom: max,
        decay_mom_rate: rate,
        decay_step_size,
        cycle_first_step_size: first,
        cycle_second_step_size: second,
        cycle_first_stair_count: first_stairs,
        cycle_second_stair_count: second_stairs,
        ..
    }) = s
    else {
        return betas;
    };
    // DeepSpeed keeps beta2 at 0.99 whatever the optimizer had.
    const BETA2: f64 = 0.99;
    let Some(it) = step.checked_sub(1) else {
        return (*min, BETA2);
    };
    let c = Cycle::new(*first, *second, *first_stairs, *second_stairs);
    let beta1 = match c.past(it) {
        None => max - (max - min) * c.scale(it),
        // A zero rate or interval means no decay: the cycle's end value.
        Some(_) if *rate == 0.0 || *decay_step_size == 0 => *max,
        Some(k) => max * (1.0 + rate * (k / *decay_step_size as f64)),
    };
    (beta1, BETA2)
}

/// OneCycle's shape, in DeepSpeed's float arithmetic (so that the rates
/// match its to the last bit).
struct Cycle {
    first: f64,
    second: f64,
    first_stairs: u64,
    second_stairs: u64,
}

impl Cycle {
    /// From OneCycle's `cycle_*_step_size` and `cycle_*_stair_count`.
    fn new(first: u64, second: u64, first_stairs: u64, second_stairs: u64) -> Cycle {
        Cycle {
            first: first as f64,
            second: second as f64,
            first_stairs,
            second_stairs,
        }
    }

    fn total(&self) -> f64 {
        self.first + self.second
    }

    /// Iterations past the cycle's end (1 at the first), or `None` within it.
    fn past(&self, it: u64) -> Option<f64> {
        let it = it as f64;
        (it >= self.total()).then(|| it - self.total() + 1.0)
    }

    /// How far up the cycle iteration `it` is, in [0, 1]: rising over the
    /// first half, falling over the second, in stairs when they are given
    /// (DeepSpeed's `_get_scale_factor`).
    fn scale(&self, it: u64) -> f64 {
        let total = self.total();
        let ratio = self.first / total;
        let b = (it + 1) as f64;
        let x = 1.0 + b / total - (1.0 + b / total).floor();
        let (scale, stairs) = if x <= ratio {
            (x / ratio, self.first_stairs)
        } else {
            ((x - 1.0) / (ratio - 1.0), self.second_stairs)
        };
        if stairs == 0 {
            return scale;
        }
        // Stairs count from the iteration, not from `scale`, which can sit
        // an ulp under a stair's edge (as DeepSpeed explains).
        let at = b % total;
        let position = if at <= self.first {
            at * stairs as f64 / self.first
        } else {
            (total - at) * stairs as f64 / self.second
        };
        position.floor() / stairs as f64
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
        SchedulerConfig::OneCycle {
            cycle_min_lr: min,
            cycle_max_lr: max,
            decay_lr_rate: rate,
            decay_step_size,
            cycle_first_step_size: first,
            cycle_second_step_size: second,
            cycle_first_stair_count: first_stairs,
            cycle_second_stair_count: second_stairs,
            ..
        } => {
            let c = Cycle::new(*first, *second, *first_stairs, *second_stairs);
            match c.past(it) {
                None => min + (max - min) * c.scale(it),
                Some(_) if *rate == 0.0 || *decay_step_size == 0 => *min,
                Some(k) => min / (1.0 + rate * (k / *decay_step_size as f64)),
            }
        }
        SchedulerConfig::LRRangeTest {
            lr_range_test_min_lr: min,
            lr_range_test_step_size: size,
            lr_range_test_step_rate: rate,
            lr_range_test_staircase: staircase,
        } => {
            let interval = (it + 1) as f64 / *size as f64;
            let interval = if *staircase {
                interval.floor()
            } else {
                interval
            };
            min * (1.0 + rate * interval)
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

    /// OneCycle with DeepSpeed's defaults but for what is given.
    fn one_cycle(
        lr: (f64, f64),
        steps: (u64, u64),
        stairs: (u64, u64),
        decay: (u64, f64, f64),
        momentum: Option<(f64, f64)>,
    ) -> SchedulerConfig {
        SchedulerConfig::OneCycle {
            cycle_min_lr: lr.0,
            cycle_max_lr: lr.1,
            decay_lr_rate: decay.1,
            cycle_first_step_size: steps.0,
            cycle_second_step_size: steps.1,
            cycle_first_stair_count: stairs.0,
            cycle_second_stair_count: stairs.1,
            decay_step_size: decay.0,
            cycle_momentum: momentum.is_some(),
            cycle_min_mom: momentum.map_or(0.8, |m| m.0),
            cycle_max_mom: momentum.map_or(0.9, |m| m.1),
            decay_mom_rate: decay.2,
        }
    }

    /// What optimizer step k used under DeepSpeed 0.19.8's OneCycle (made
    /// as [`deepspeed`]'s values were, on torch's AdamW with betas (0.9,
    /// 0.999)): its learning rate and beta1 (beta2 is 0.99 throughout).
    fn deepspeed_cycle(s: &SchedulerConfig, lrs: &[f64], beta1s: &[f64]) {
        deepspeed(s, lrs);
        let got: Vec<(f64, f64)> = (0..beta1s.len() as u64)
            .map(|k| betas_at(Some(s), (0.9, 0.999), k))
            .collect();
        for (k, ((b1, b2), w)) in got.iter().zip(beta1s).enumerate() {
            assert!(
                (b1 - w).abs() < 1e-12 && *b2 == 0.99,
                "step {k}: {got:?} against {beta1s:?}"
            );
        }
    }

    #[test]
    fn one_cycle_gives_every_step_deepspeeds_rate_and_momentum() {
        // Rising over 3, falling over 4, then at the floor (no decay).
        deepspeed_cycle(
            &one_cycle((0.1, 1.0), (3, 4), (0, 0), (0, 0.0, 0.0), Some((0.8, 0.9))),
            &[0.1, 0.4, 0.7, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1, 0.1, 0.1],
            &[
                0.8,
                0.8666666666666667,
                0.8333333333333334,
                0.8,
                0.825,
                0.85,
                0.875,
                0.9,
                0.9,
                0.9,
                0.9,
            ],
        );
        // With decay: the rate divides, beta1 multiplies (past 1: the
        // engine stops there).
        deepspeed_cycle(
            &one_cycle((0.1, 1.0), (2, 2), (0, 0), (2, 0.5, 0.1), Some((0.8, 0.9))),
            &[
                0.1,
                0.55,
                1.0,
                0.55,
                0.1,
                0.08,
                0.06666666666666667,
                0.05714285714285715,
                0.05,
                0.044444444444444446,
            ],
            &[0.8, 0.85, 0.8, 0.85, 0.9, 0.945, 0.99, 1.035, 1.08, 1.125],
        );
        // In stairs: 2 up over 4 iterations, 3 down over 6.
        deepspeed_cycle(
            &one_cycle(
                (0.2, 1.4),
                (4, 6),
                (2, 3),
                (0, 0.0, 0.0),
                Some((0.85, 0.95)),
            ),
            &[
                0.2, 0.2, 0.8, 0.8, 1.4, 1.0, 1.0, 0.6, 0.6, 0.2, 0.2, 0.2, 0.2,
            ],
            &[
                0.85,
                0.95,
                0.9,
                0.9,
                0.85,
                0.8833333333333333,
                0.8833333333333333,
                0.9166666666666666,
                0.9166666666666666,
                0.95,
                0.95,
                0.95,
                0.95,
            ],
        );
        // A decay rate with no decay interval decays nothing (DeepSpeed
        // skips it), and the other way round.
        for decay in [(0, 0.5, 0.1), (2, 0.0, 0.0)] {
            deepspeed_cycle(
                &one_cycle((0.2, 1.4), (2, 2), (0, 0), decay, Some((0.8, 0.9))),
                &[0.2, 0.8, 1.4, 0.8, 0.2, 0.2, 0.2],
                &[0.8, 0.85, 0.8, 0.85, 0.9, 0.9, 0.9],
            );
        }
        // Without cycle_momentum the optimizer's betas stay.
        let plain = one_cycle((0.2, 1.4), (2, 2), (0, 0), (0, 0.0, 0.0), None);
        deepspeed(&plain, &[0.2, 0.8, 1.4, 0.8, 0.2]);
        for k in 0..5 {
            assert_eq!(betas_at(Some(&plain), (0.9, 0.999), k), (0.9, 0.999));
        }
        assert_eq!(betas_at(None, (0.5, 0.6), 3), (0.5, 0.6));
        // A falling half of 0 steps: the rate drops straight back.
        deepspeed(
            &one_cycle((0.2, 1.4), (2, 0), (0, 0), (0, 0.0, 0.0), None),
            &[0.2, 0.8, 0.2, 0.2],
        );
    }

    #[test]
    fn the_range_test_gives_every_step_deepspeeds_rate() {
        let range = |staircase| SchedulerConfig::LRRangeTest {
            lr_range_test_min_lr: 0.1,
            lr_range_test_step_size: 3,
            lr_range_test_step_rate: 2.0,
            lr_range_test_staircase: staircase,
        };
        deepspeed(
            &range(false),
            &[
                0.1,
                0.16666666666666666,
                0.2333333333333333,
                0.30000000000000004,
                0.3666666666666667,
                0.4333333333333334,
                0.5,
                0.5666666666666668,
            ],
        );
        deepspeed(&range(true), &[0.1, 0.1, 0.1, 0.3, 0.3, 0.3, 0.5, 0.5]);
        assert_eq!(betas_at(Some(&range(true)), (0.9, 0.999), 4), (0.9, 0.999));
    }
}
