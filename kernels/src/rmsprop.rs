//! Fused RMSprop over one rank's flat fp32 shard: `torch.optim.RMSprop`'s
//! update, which DeepSpeed builds for `"type": "RMSprop"` (a type it has no
//! kernel of its own for goes to `torch.optim`).
//!
//! ```text
//! g = grad * grad_scale                   (1/loss_scale x clip coefficient)
//! g = -g                                  (maximize)
//! g = g + weight_decay * p                (L2: coupled, as torch's)
//! s = alpha * s + (1 - alpha) * g * g     (the square average, from 0)
//! a = sqrt(s) + eps
//! c = c + (1 - alpha) * (g - c);  a = sqrt(s - c * c) + eps   (centered)
//! b = momentum * b + g / a;  p = p - lr * b      (momentum > 0)
//! p = p - lr * g / a                             (momentum == 0)
//! ```
//!
//! The square average is kept in the shard's `m`; `v` holds the momentum
//! buffer (when `momentum > 0`) or, `centered`, the gradient's average
//! `c`, and is empty otherwise. torch's centered variant with momentum
//! keeps both, a third array zrt's flat state does not have: refused.
//!
//! The operations round as libtorch's CPU kernels do in torch's
//! single-tensor RMSprop (measured here, operation by operation):
//! `mul_(alpha)` a rounded product, then `addcmul_(g, g, 1 - alpha)` one
//! fused multiply-add of `(1 - alpha) * g` by `g`; `add(p, wd)` and
//! `add_(b, -lr)` one fused multiply-add each; `addcdiv_` the product by its
//! value, the quotient, then the sum; `lerp_(g, w)` one fused multiply-add,
//! `w * (g - c) + c` for `w < 0.5` and `(w - 1) * (g - c) + g` above, and
//! `addcmul(c, c, -1)` the fused `-c * c + s`. The square root is IEEE's, correctly
//! rounded; libtorch's CPU `sqrt` is one ulp off for about 0.5% of inputs,
//! so the square averages equal libtorch's to the bit and the parameters
//! within rounding (`tests/kernels_vs_libtorch.rs`). Every dispatch level
//! and thread count gives the same bits.

use crate::adam::{AdamShard, ComputeCopy};
use crate::error::{empty, non_negative, same_len};
use crate::simd::multiversion;
use crate::walk::{for_each_range, in_blocks, CopyBits};
use crate::{KernelError, Threads};

/// RMSprop's hyper-parameters (`torch.optim.RMSprop`'s, same names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmspropConfig {
    /// Learning rate of this step.
    pub lr: f64,
    /// Smoothing of the square average: the share of the old average kept.
    pub alpha: f64,
    /// Added to the square average's root.
    pub eps: f64,
    /// L2 penalty, added to the gradient (coupled, as torch's RMSprop).
    pub weight_decay: f64,
    /// Momentum factor; 0 keeps no momentum buffer.
    pub momentum: f64,
    /// Divide by the root of the gradient's variance (the square average
    /// less the squared average gradient) instead of its mean square;
    /// needs `momentum == 0` here (see the module doc).
    pub centered: bool,
    /// Ascend the objective instead of descending it.
    pub maximize: bool,
}

impl Default for RmspropConfig {
    /// `torch.optim.RMSprop`'s defaults: lr 1e-2, alpha 0.99, eps 1e-8, no
    /// momentum, no decay.
    fn default() -> Self {
        Self {
            lr: 1e-2,
            alpha: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
            momentum: 0.0,
            centered: false,
            maximize: false,
        }
    }
}

impl RmspropConfig {
    /// Checks every setting is in its domain: torch's own checks, plus
    /// finiteness, and `alpha <= 1` (above it the average's new share is
    /// negative and the root of a negative average NaN).
    pub fn validate(&self) -> Result<(), KernelError> {
        let bad = |name, value, why| Err(KernelError::BadSetting { name, value, why });
        non_negative(&[
            ("lr", self.lr),
            ("eps", self.eps),
            ("weight_decay", self.weight_decay),
            ("momentum", self.momentum),
        ])?;
        if !(0.0..=1.0).contains(&self.alpha) {
            return bad("alpha", self.alpha, "must be in [0, 1]");
        }
        if self.centered && self.momentum > 0.0 {
            return bad(
                "momentum",
                self.momentum,
                "must be 0 when centered: centered RMSprop with momentum keeps three arrays per parameter",
            );
        }
        Ok(())
    }
}

/// Per-call scalars, rounded to f32 once.
#[derive(Debug, Clone, Copy)]
struct Coef {
    /// `grad_scale`, negated under `maximize`.
    scale: f32,
    weight_decay: f32,
    alpha: f32,
    /// `1 - alpha`, taken in f64 first as torch does.
    one_minus_alpha: f32,
    eps: f32,
    momentum: f32,
    neg_lr: f32,
    centered: bool,
    /// `lerp_`'s weight (`1 - alpha`) as it computes with it: the weight
    /// below 0.5, else the weight less 1 (see the module doc).
    lerp: f32,
}

impl Coef {
    fn new(cfg: &RmspropConfig, grad_scale: f32) -> Result<Self, KernelError> {
        cfg.validate()?;
        Ok(Self {
            scale: if cfg.maximize {
                -grad_scale
            } else {
                grad_scale
            },
            weight_decay: cfg.weight_decay as f32,
            alpha: cfg.alpha as f32,
            one_minus_alpha: (1.0 - cfg.alpha) as f32,
            eps: cfg.eps as f32,
            momentum: cfg.momentum as f32,
            neg_lr: -cfg.lr as f32,
            centered: cfg.centered,
            lerp: match ((1.0 - cfg.alpha) as f32).abs() < 0.5 {
                true => (1.0 - cfg.alpha) as f32,
                false => (1.0 - cfg.alpha) as f32 - 1.0,
            },
        })
    }

    /// `c.lerp_(g, 1 - alpha)` as libtorch computes it.
    #[inline(always)]
    fn lerp(&self, c: f32, g: f32) -> f32 {
        let base = if self.lerp >= 0.0 { c } else { g };
        self.lerp.mul_add(g - c, base)
    }
}

/// The update over equal-length slices (`b`, the momentum buffer or the
/// centered average, as long as `p`, or empty), straight loops LLVM
/// vectorizes.
#[inline(always)]
fn update(c: &Coef, p: &mut [f32], g: &[f32], s: &mut [f32], b: &mut [f32]) {
    let n = p.len();
    let (g, s) = (&g[..n], &mut s[..n]);
    // The gradient with its scale and decay, and the new square average.
    let step = |p: f32, g: f32, s: f32| {
        let mut g = g * c.scale;
        if c.weight_decay != 0.0 {
            g = p.mul_add(c.weight_decay, g);
        }
        (g, (c.one_minus_alpha * g).mul_add(g, s * c.alpha))
    };
    if b.is_empty() {
        for i in 0..n {
            let (gi, si) = step(p[i], g[i], s[i]);
            p[i] += (c.neg_lr * gi) / (si.sqrt() + c.eps);
            s[i] = si;
        }
        return;
    }
    let b = &mut b[..n];
    if c.centered {
        for i in 0..n {
            let (gi, si) = step(p[i], g[i], s[i]);
            let ci = c.lerp(b[i], gi);
            p[i] += (c.neg_lr * gi) / ((-ci).mul_add(ci, si).sqrt() + c.eps);
            s[i] = si;
            b[i] = ci;
        }
        return;
    }
    for i in 0..n {
        let (gi, si) = step(p[i], g[i], s[i]);
        let bi = b[i] * c.momentum + gi / (si.sqrt() + c.eps);
        p[i] = bi.mul_add(c.neg_lr, p[i]);
        s[i] = si;
        b[i] = bi;
    }
}

/// One thread's contiguous range in cache blocks ([`in_blocks`]), each
/// block's compute copy written while it is in cache.
#[inline(always)]
fn range_body(
    c: &Coef,
    p: &mut [f32],
    g: &[f32],
    s: &mut [f32],
    b: &mut [f32],
    copy: CopyBits<'_>,
) {
    if b.is_empty() {
        let streams = [p.as_ptr(), g.as_ptr(), s.as_ptr()];
        in_blocks(
            p,
            streams,
            copy,
            #[inline(always)]
            |ps, r| update(c, ps, &g[r.clone()], &mut s[r], &mut []),
        );
    } else {
        let streams = [p.as_ptr(), g.as_ptr(), s.as_ptr(), b.as_ptr()];
        in_blocks(
            p,
            streams,
            copy,
            #[inline(always)]
            |ps, r| update(c, ps, &g[r.clone()], &mut s[r.clone()], &mut b[r]),
        );
    }
}

multiversion!(fn rmsprop_range(c: &Coef, p: &mut [f32], g: &[f32], s: &mut [f32], b: &mut [f32], copy: CopyBits<'_>) => range_body);

/// One RMSprop step over a shard, in one pass over memory.
///
/// `shard.m` is the square average, as long as `p`; `shard.v` the momentum
/// buffer (`cfg.momentum > 0`) or the gradient's average (`cfg.centered`),
/// as long as `p`, and empty when there is neither.
/// `grad_scale` multiplies every gradient first (`clip_coef /
/// loss_scale`). With a [`ComputeCopy`] destination, the updated
/// parameters are also written there in bf16/f16.
pub fn rmsprop_step(
    threads: &Threads,
    cfg: &RmspropConfig,
    grad_scale: f32,
    shard: AdamShard<'_>,
    copy: ComputeCopy<'_>,
) -> Result<(), KernelError> {
    let c = Coef::new(cfg, grad_scale)?;
    let AdamShard { p, g, m, v } = shard;
    let n = p.len();
    same_len("g", g.len(), "p", n)?;
    same_len("m", m.len(), "p", n)?;
    match cfg.momentum > 0.0 || cfg.centered {
        true => same_len("v", v.len(), "p", n)?,
        false => empty(
            "v",
            v.len(),
            "RMSprop without momentum, not centered, keeps no second array",
        )?,
    }
    let copy = CopyBits::of(copy, n)?;
    // Without momentum or centering `v` is empty, and stays so in every
    // thread's range.
    for_each_range(threads, p, g, [m, v], copy, |p, g, [s, b], copy| {
        rmsprop_range(&c, p, g, s, b, copy)
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::test_data::{bits, start};

    /// The module doc's formula in f64, step `t`'s gradient `g x (1 + t/10)`.
    fn reference(cfg: &RmspropConfig, steps: u64, p: &mut [f64], g: &[f64]) -> Vec<f64> {
        let n = p.len();
        let (mut s, mut b, mut c) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        for t in 1..=steps {
            for i in 0..n {
                let mut gi = g[i] * (1.0 + 0.1 * t as f64);
                if cfg.maximize {
                    gi = -gi;
                }
                gi += cfg.weight_decay * p[i];
                s[i] = cfg.alpha * s[i] + (1.0 - cfg.alpha) * gi * gi;
                c[i] += (1.0 - cfg.alpha) * (gi - c[i]);
                let mean_square = match cfg.centered {
                    true => s[i] - c[i] * c[i],
                    false => s[i],
                };
                let d = gi / (mean_square.sqrt() + cfg.eps);
                b[i] = cfg.momentum * b[i] + d;
                p[i] -= cfg.lr * if cfg.momentum > 0.0 { b[i] } else { d };
            }
        }
        s
    }

    /// `steps` steps from [`start`]: the parameters and the square average.
    fn run(threads: usize, cfg: &RmspropConfig, n: usize, steps: u64) -> (Vec<f32>, Vec<f32>) {
        let pool = Threads::new(threads).unwrap();
        let (mut p, g) = start(n);
        let mut s = vec![0.0; n];
        let second = cfg.momentum > 0.0 || cfg.centered;
        let mut b = vec![0.0; if second { n } else { 0 }];
        for t in 1..=steps {
            let shard = AdamShard {
                p: &mut p,
                g: &g,
                m: &mut s,
                v: &mut b,
            };
            let scale = 1.0 + 0.1 * t as f32;
            rmsprop_step(&pool, cfg, scale, shard, ComputeCopy::None).unwrap();
        }
        (p, s)
    }

    fn configs() -> Vec<RmspropConfig> {
        let base = RmspropConfig {
            lr: 0.01,
            ..Default::default()
        };
        vec![
            base,
            RmspropConfig {
                weight_decay: 0.01,
                maximize: true,
                alpha: 0.9,
                ..base
            },
            RmspropConfig {
                momentum: 0.9,
                eps: 1e-3,
                ..base
            },
            // (A fast alpha would make `s - c c` cancel to its rounding
            // over these slowly changing gradients, in f32 as against f64;
            // its first step is checked to the bit below.)
            RmspropConfig {
                centered: true,
                weight_decay: 0.01,
                ..base
            },
        ]
    }

    #[test]
    fn matches_f64_reference() {
        let (n, steps) = (1000, 10);
        for cfg in configs() {
            let (p, s) = run(1, &cfg, n, steps);
            let (p0, g) = start(n);
            let mut rp: Vec<f64> = p0.iter().map(|&x| x as f64).collect();
            let rg: Vec<f64> = g.iter().map(|&x| x as f64).collect();
            let rs = reference(&cfg, steps, &mut rp, &rg);
            for i in 0..n {
                assert!(
                    (p[i] as f64 - rp[i]).abs() <= 1e-5 * rp[i].abs().max(1.0),
                    "{cfg:?} p[{i}]: {} vs {}",
                    p[i],
                    rp[i]
                );
                assert!(
                    (s[i] as f64 - rs[i]).abs() <= 1e-5 * rs[i].abs().max(1.0),
                    "{cfg:?} s[{i}]: {} vs {}",
                    s[i],
                    rs[i]
                );
            }
        }
    }

    #[test]
    fn the_first_step_rounds_as_libtorchs_operations() {
        // From a zero average and buffer: s = (1 - alpha) g x g, and the
        // buffer is g / a, each operation rounded as libtorch's kernels
        // round it (alpha 0.9: 1 - alpha is not 0.1f32 exactly).
        for momentum in [0.0, 0.5] {
            let cfg = RmspropConfig {
                lr: 0.1,
                alpha: 0.9,
                momentum,
                ..Default::default()
            };
            let (p, s) = run(1, &cfg, 8, 1);
            let (p0, g) = start(8);
            let one_minus_alpha = (1.0f64 - 0.9) as f32;
            for i in 0..8 {
                let gi = g[i] * 1.1;
                let si = (one_minus_alpha * gi).mul_add(gi, 0.0);
                assert_eq!(s[i], si);
                let a = si.sqrt() + 1e-8;
                let want = match momentum > 0.0 {
                    true => (gi / a).mul_add(-0.1, p0[i]),
                    false => p0[i] + (-0.1f32 * gi) / a,
                };
                assert_eq!(p[i], want, "momentum {momentum}, {i}");
            }
        }
    }

    #[test]
    fn the_centered_first_step_rounds_as_libtorchs_operations() {
        // From zero averages: c = lerp(0, g, w), whose two formulas meet
        // at w = 0.5, and a = sqrt(s - c c) + eps.
        for alpha in [0.9, 0.3] {
            let cfg = RmspropConfig {
                lr: 0.1,
                alpha,
                centered: true,
                ..Default::default()
            };
            let pool = Threads::new(1).unwrap();
            let (mut p, g) = start(8);
            let p0 = p.clone();
            let (mut s, mut c) = (vec![0.0; 8], vec![0.0; 8]);
            let shard = AdamShard {
                p: &mut p,
                g: &g,
                m: &mut s,
                v: &mut c,
            };
            rmsprop_step(&pool, &cfg, 1.0, shard, ComputeCopy::None).unwrap();
            let w = (1.0 - alpha) as f32;
            for i in 0..8 {
                let si = (w * g[i]).mul_add(g[i], 0.0);
                let ci = match w < 0.5 {
                    true => w.mul_add(g[i], 0.0),
                    false => (w - 1.0).mul_add(g[i], g[i]),
                };
                assert_eq!((s[i], c[i]), (si, ci), "alpha {alpha}, {i}");
                let a = (-ci).mul_add(ci, si).sqrt() + 1e-8;
                assert_eq!(p[i], p0[i] + (-0.1f32 * g[i]) / a, "alpha {alpha}, {i}");
            }
        }
    }

    #[test]
    fn threads_and_dispatch_levels_do_not_change_a_bit() {
        for cfg in configs() {
            let n = 100_003;
            let one = run(1, &cfg, n, 3);
            let three = run(3, &cfg, n, 3);
            assert_eq!(bits(&one.0), bits(&three.0), "{cfg:?}");
            assert_eq!(bits(&one.1), bits(&three.1), "{cfg:?}");
            // `range_body` called directly is compiled for baseline x86-64;
            // `rmsprop_range` runs the widest level this CPU has.
            let c = Coef::new(&cfg, 0.7).unwrap();
            let (p0, g) = start(4099);
            let s0: Vec<f32> = g.iter().map(|x| x * x * 0.3).collect();
            let b0 = match cfg.momentum > 0.0 || cfg.centered {
                true => g.iter().map(|x| x * 0.2).collect(),
                false => Vec::new(),
            };
            let mut one = (p0.clone(), s0.clone(), b0.clone(), vec![0u16; p0.len()]);
            let mut two = (p0, s0, b0, vec![0u16; 4099]);
            range_body(
                &c,
                &mut one.0,
                &g,
                &mut one.1,
                &mut one.2,
                CopyBits::Bf16(&mut one.3),
            );
            rmsprop_range(
                &c,
                &mut two.0,
                &g,
                &mut two.1,
                &mut two.2,
                CopyBits::Bf16(&mut two.3),
            );
            assert_eq!(bits(&one.0), bits(&two.0));
            assert_eq!(bits(&one.1), bits(&two.1));
            assert_eq!(bits(&one.2), bits(&two.2));
            assert_eq!(one.3, two.3);
        }
    }

    #[test]
    fn compute_copy_is_the_cast_of_the_updated_params_on_every_thread() {
        let pool = Threads::new(3).unwrap();
        let n = 70_001;
        let (mut p, g) = start(n);
        let (mut s, mut b, mut copy) = (vec![0.0; n], vec![0.0; n], vec![bf16::ZERO; n]);
        let cfg = RmspropConfig {
            momentum: 0.9,
            ..Default::default()
        };
        let shard = AdamShard {
            p: &mut p,
            g: &g,
            m: &mut s,
            v: &mut b,
        };
        rmsprop_step(&pool, &cfg, 1.0, shard, ComputeCopy::Bf16(&mut copy)).unwrap();
        for i in 0..n {
            assert_eq!(
                copy[i].to_bits(),
                crate::cast::f32_to_bf16_bits(p[i]),
                "{i}"
            );
        }
    }

    #[test]
    fn state_it_does_not_keep_or_a_bad_setting_is_refused() {
        let pool = Threads::new(1).unwrap();
        let (mut p, g, mut s) = (vec![0.0; 4], vec![0.0; 4], vec![0.0; 4]);
        let step = |cfg: &RmspropConfig, p: &mut [f32], m: &mut [f32], v: &mut [f32]| {
            let shard = AdamShard { p, g: &g, m, v };
            rmsprop_step(&pool, cfg, 1.0, shard, ComputeCopy::None)
                .unwrap_err()
                .to_string()
        };
        let plain = RmspropConfig::default();
        assert_eq!(
            step(&plain, &mut p, &mut s, &mut [0.0; 4]),
            "slice `v` has 4 elements but must be empty: RMSprop without momentum, not centered, keeps no second array"
        );
        let momentum = RmspropConfig {
            momentum: 0.9,
            ..plain
        };
        assert_eq!(
            step(&momentum, &mut p, &mut s, &mut []),
            "slice `v` has 0 elements but `p` has 4: every slice of one shard must have the same length"
        );
        let alpha = RmspropConfig {
            alpha: 1.5,
            ..plain
        };
        assert_eq!(
            step(&alpha, &mut p, &mut s, &mut []),
            "invalid optimizer setting `alpha` = 1.5: must be in [0, 1]"
        );
        let both = RmspropConfig {
            centered: true,
            ..momentum
        };
        assert_eq!(
            step(&both, &mut p, &mut s, &mut [0.0; 4]),
            "invalid optimizer setting `momentum` = 0.9: must be 0 when centered: centered RMSprop with momentum keeps three arrays per parameter"
        );
    }
}
