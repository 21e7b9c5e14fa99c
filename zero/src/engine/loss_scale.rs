//! fp16's dynamic loss scaler, following DeepSpeed's `DynamicLossScaler`.
//!
//! The scale multiplies the loss before backward so that small fp16
//! gradients do not flush to zero; the step divides it out again. An
//! overflow (inf/NaN in any rank's gradients) skips the step and, after
//! `hysteresis` of them, halves the scale; a run of `loss_scale_window`
//! steps without one doubles it.

use crate::checkpoint::meta::ScalerMeta;
use crate::config::LossScaleConfig;
use crate::EngineError;

/// The scaler's state; the engine keeps one under fp16.
pub(super) struct Scaler {
    cfg: LossScaleConfig,
    /// The scale the next backward multiplies the loss by.
    pub(super) scale: f64,
    /// Overflows left before the next halving.
    hysteresis: u32,
    /// Steps seen (overflowed ones included).
    iter: u64,
    /// The step of the last overflow, `None` before the first.
    last_overflow: Option<u64>,
}

impl Scaler {
    /// A scaler at its initial scale (`loss_scale` when static, else
    /// 2^`initial_scale_power`).
    pub(super) fn new(cfg: &LossScaleConfig) -> Self {
        let scale = if cfg.loss_scale > 0.0 {
            cfg.loss_scale
        } else {
            2f64.powi(cfg.initial_scale_power as i32)
        };
        Self {
            cfg: cfg.clone(),
            scale,
            hysteresis: cfg.hysteresis.max(1),
            iter: 0,
            last_overflow: None,
        }
    }

    /// Moves the scale after a step whose gradients did (`overflow`) or did
    /// not hold inf/NaN; a static scale never moves.
    ///
    /// DeepSpeed's rule: an overflow with no hysteresis left halves the
    /// scale, one with hysteresis left uses one up; the scale doubles on a
    /// good step that follows a multiple of `loss_scale_window` good steps
    /// since the last overflow (or since the start), and the doubling
    /// refills the hysteresis (`consecutive_hysteresis` refills it on every
    /// good step). An overflow when the scale is already at
    /// `min_loss_scale` is an error, as in DeepSpeed: no smaller scale is
    /// left to try, and skipping every step from then on would stall the
    /// run silently.
    pub(super) fn update(&mut self, overflow: bool) -> Result<(), EngineError> {
        let iter = self.iter;
        self.iter += 1;
        if self.cfg.loss_scale > 0.0 {
            return Ok(());
        }
        if overflow {
            self.last_overflow = Some(iter);
            if self.hysteresis > 1 {
                self.hysteresis -= 1;
            } else if self.scale <= self.cfg.min_loss_scale {
                return Err(EngineError::LossScaleAtMinimum(self.scale));
            } else {
                self.scale = (self.scale / 2.0).max(self.cfg.min_loss_scale);
            }
            return Ok(());
        }
        if self.cfg.consecutive_hysteresis {
            self.hysteresis = self.cfg.hysteresis.max(1);
        }
        // Good steps before this one since the last overflow (saturating:
        // a checkpoint's state is read from a file).
        let good = iter.saturating_sub(self.last_overflow.map_or(0, |k| k + 1));
        let window = self.cfg.loss_scale_window;
        if window > 0 && good > 0 && good % window == 0 {
            self.hysteresis = self.cfg.hysteresis.max(1);
            self.scale *= 2.0;
        }
        Ok(())
    }

    /// The state a checkpoint records.
    pub(super) fn meta(&self) -> ScalerMeta {
        ScalerMeta {
            scale: self.scale,
            hysteresis: self.hysteresis,
            iter: self.iter,
            last_overflow: self.last_overflow,
        }
    }

    /// Takes up the state a checkpoint recorded (the config stays this
    /// run's).
    pub(super) fn restore(&mut self, m: &ScalerMeta) {
        self.scale = m.scale;
        self.hysteresis = m.hysteresis;
        self.iter = m.iter;
        self.last_overflow = m.last_overflow;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(power: u32, window: u64, hysteresis: u32) -> LossScaleConfig {
        LossScaleConfig {
            loss_scale: 0.0,
            initial_scale_power: power,
            loss_scale_window: window,
            hysteresis,
            consecutive_hysteresis: false,
            min_loss_scale: 1.0,
        }
    }

    /// The scale after each of `steps` (true: overflow).
    fn scales(cfg: &LossScaleConfig, steps: &[bool]) -> Vec<f64> {
        let mut s = Scaler::new(cfg);
        steps
            .iter()
            .map(|&o| {
                s.update(o).unwrap();
                s.scale
            })
            .collect()
    }

    #[test]
    fn the_window_runs_alike_from_the_start_and_after_an_overflow() {
        // Window 2: two good steps, then the third doubles, whether they
        // count from the start or from an overflow (DeepSpeed's
        // `stable_interval`; the old rule doubled one step earlier after an
        // overflow than from the start).
        let (o, g) = (true, false);
        assert_eq!(
            scales(&cfg(4, 2, 1), &[g, g, g, g, g, o, g, g, g, g, g]),
            [16., 16., 32., 32., 64., 32., 32., 32., 64., 64., 128.]
        );
        // A window of 0 never doubles.
        assert_eq!(scales(&cfg(4, 0, 1), &[g, g, g]), [16.; 3]);
    }

    #[test]
    fn hysteresis_delays_the_halving_and_a_doubling_refills_it() {
        let (o, g) = (true, false);
        // Hysteresis 2: the first overflow uses it up, the second halves;
        // with it spent, the next overflow halves at once.
        assert_eq!(scales(&cfg(4, 2, 2), &[o, o, o]), [16., 8., 4.]);
        // A doubling refills it: one overflow after it keeps the scale.
        assert_eq!(
            scales(&cfg(4, 2, 2), &[o, o, g, g, g, o]),
            [16., 8., 8., 8., 16., 16.]
        );
        // Without a doubling a good step does not refill it...
        assert_eq!(scales(&cfg(4, 1000, 2), &[o, g, o]), [16., 16., 8.]);
        // ...unless consecutive_hysteresis says so.
        let consecutive = LossScaleConfig {
            consecutive_hysteresis: true,
            ..cfg(4, 1000, 2)
        };
        assert_eq!(scales(&consecutive, &[o, g, o]), [16., 16., 16.]);
    }

    #[test]
    fn an_overflow_at_the_minimum_scale_is_an_error() {
        let mut s = Scaler::new(&LossScaleConfig {
            min_loss_scale: 2.0,
            ..cfg(2, 1000, 1)
        });
        s.update(true).unwrap();
        assert_eq!(s.scale, 2.0, "halved to the minimum");
        let e = s.update(true).unwrap_err().to_string();
        assert!(
            e.contains("minimum loss scale (2, `fp16.min_loss_scale`)"),
            "{e}"
        );
        assert!(e.contains("bf16"), "names the way out: {e}");
        // Halving stops at the minimum rather than below it.
        let mut s = Scaler::new(&LossScaleConfig {
            min_loss_scale: 3.0,
            ..cfg(2, 1000, 1)
        });
        s.update(true).unwrap();
        assert_eq!(s.scale, 3.0);
    }

    #[test]
    fn a_static_scale_never_moves() {
        let fixed = LossScaleConfig {
            loss_scale: 128.0,
            ..cfg(16, 1, 1)
        };
        assert_eq!(scales(&fixed, &[true, false, false, true]), [128.0; 4]);
    }

    #[test]
    fn a_restored_scaler_continues_where_the_saved_one_was() {
        let c = cfg(4, 2, 2);
        let (o, g) = (true, false);
        let mut a = Scaler::new(&c);
        for step in [o, o, g] {
            a.update(step).unwrap();
        }
        let mut b = Scaler::new(&c);
        b.restore(&a.meta());
        for step in [g, g, o, g, g, g] {
            a.update(step).unwrap();
            b.update(step).unwrap();
            assert_eq!((a.scale, a.hysteresis), (b.scale, b.hysteresis));
        }
    }
}
