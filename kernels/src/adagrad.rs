//! Fused Adagrad over one rank's flat fp32 shard: `torch.optim.Adagrad`'s
//! update, which DeepSpeed builds for `"type": "Adagrad"` (its
//! `DeepSpeedCPUAdagrad` under CPU offload is the same update without
//! `lr_decay`).
//!
//! ```text
//! g   = grad * grad_scale                 (1/loss_scale x clip coefficient)
//! g   = -g                                (maximize)
//! g   = g + weight_decay * p              (L2: coupled, as torch's)
//! s   = s + g * g                         (the sum of squares, from its initial value)
//! clr = lr / (1 + (step - 1) * lr_decay)
//! p   = p - clr * g / (sqrt(s) + eps)
//! ```
//!
//! One moment, `s`, kept in the shard's `m`. The operations round as
//! libtorch's CPU kernels do in torch's single-tensor Adagrad: `add(p,
//! alpha)` and `addcmul_(g, g)` one fused multiply-add each,
//! `addcdiv_(value = -clr)` the product `-clr * g`, its quotient by the
//! denominator, then the sum. The square root is IEEE's, correctly
//! rounded; libtorch's CPU `sqrt` is one ulp off for about 0.5% of inputs
//! (measured here), so the sums equal libtorch's to the bit and the
//! parameters within rounding (`tests/kernels_vs_libtorch.rs`). Every
//! dispatch level and thread count gives the same bits.

use crate::adam::{AdamShard, ComputeCopy};
use crate::error::{empty, non_negative, same_len};
use crate::simd::multiversion;
use crate::walk::{for_each_range, in_blocks, CopyBits};
use crate::{KernelError, Threads};

/// Adagrad's hyper-parameters (`torch.optim.Adagrad`'s, same names; its
/// `initial_accumulator_value` is where the caller's sum starts, which the
/// kernel only adds to).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdagradConfig {
    /// Learning rate before `lr_decay`.
    pub lr: f64,
    /// The rate of step `t` is `lr / (1 + (t - 1) * lr_decay)`.
    pub lr_decay: f64,
    /// L2 penalty, added to the gradient (coupled, as torch's Adagrad).
    pub weight_decay: f64,
    /// Added to the square root of the sum.
    pub eps: f64,
    /// Ascend the objective instead of descending it.
    pub maximize: bool,
}

impl Default for AdagradConfig {
    /// `torch.optim.Adagrad`'s defaults: lr 1e-2, eps 1e-10, no decay.
    fn default() -> Self {
        Self {
            lr: 1e-2,
            lr_decay: 0.0,
            weight_decay: 0.0,
            eps: 1e-10,
            maximize: false,
        }
    }
}

impl AdagradConfig {
    /// Checks every setting is in its domain (torch's own checks, plus
    /// finiteness).
    pub fn validate(&self) -> Result<(), KernelError> {
        non_negative(&[
            ("lr", self.lr),
            ("lr_decay", self.lr_decay),
            ("weight_decay", self.weight_decay),
            ("eps", self.eps),
        ])
    }

    /// The learning rate of step `step` (1-based), `lr_decay` applied.
    pub fn step_lr(&self, step: u64) -> f64 {
        self.lr / (1.0 + step.saturating_sub(1) as f64 * self.lr_decay)
    }
}

/// Per-call scalars, rounded to f32 once.
#[derive(Debug, Clone, Copy)]
struct Coef {
    /// `grad_scale`, negated under `maximize`.
    scale: f32,
    weight_decay: f32,
    eps: f32,
    /// `-clr`: addcdiv's value.
    neg_lr: f32,
}

impl Coef {
    fn new(cfg: &AdagradConfig, step: u64, grad_scale: f32) -> Result<Self, KernelError> {
        cfg.validate()?;
        Ok(Self {
            scale: if cfg.maximize {
                -grad_scale
            } else {
                grad_scale
            },
            weight_decay: cfg.weight_decay as f32,
            eps: cfg.eps as f32,
            neg_lr: -cfg.step_lr(step) as f32,
        })
    }
}

/// The update over equal-length slices, a straight loop LLVM vectorizes.
#[inline(always)]
fn update(c: &Coef, p: &mut [f32], g: &[f32], s: &mut [f32]) {
    let n = p.len();
    let (g, s) = (&g[..n], &mut s[..n]);
    for i in 0..n {
        let mut gi = g[i] * c.scale;
        if c.weight_decay != 0.0 {
            gi = p[i].mul_add(c.weight_decay, gi);
        }
        let si = gi.mul_add(gi, s[i]);
        p[i] += (c.neg_lr * gi) / (si.sqrt() + c.eps);
        s[i] = si;
    }
}

/// One thread's contiguous range in cache blocks ([`in_blocks`]), each
/// block's compute copy written while it is in cache.
#[inline(always)]
fn range_body(c: &Coef, p: &mut [f32], g: &[f32], s: &mut [f32], copy: CopyBits<'_>) {
    let streams = [p.as_ptr(), g.as_ptr(), s.as_ptr()];
    in_blocks(
        p,
        streams,
        copy,
        #[inline(always)]
        |ps, r| update(c, ps, &g[r.clone()], &mut s[r]),
    );
}

multiversion!(fn adagrad_range(c: &Coef, p: &mut [f32], g: &[f32], s: &mut [f32], copy: CopyBits<'_>) => range_body);

/// One Adagrad step (`step`, 1-based, sets the rate under `lr_decay`)
/// over a shard, in one pass over memory.
///
/// `shard.m` is the sum of squares, as long as `p`; `shard.v` must be
/// empty. `grad_scale` multiplies every gradient first (`clip_coef /
/// loss_scale`). With a [`ComputeCopy`] destination, the updated
/// parameters are also written there in bf16/f16.
pub fn adagrad_step(
    threads: &Threads,
    cfg: &AdagradConfig,
    step: u64,
    grad_scale: f32,
    shard: AdamShard<'_>,
    copy: ComputeCopy<'_>,
) -> Result<(), KernelError> {
    let c = Coef::new(cfg, step, grad_scale)?;
    let AdamShard { p, g, m, v } = shard;
    let n = p.len();
    same_len("g", g.len(), "p", n)?;
    same_len("m", m.len(), "p", n)?;
    empty("v", v.len(), "Adagrad keeps one sum of squares, in `m`")?;
    let copy = CopyBits::of(copy, n)?;
    for_each_range(threads, p, g, [m], copy, |p, g, [s], copy| {
        adagrad_range(&c, p, g, s, copy)
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::test_data::{bits, start};

    /// The module doc's formula in f64, step `t`'s gradient `g x (1 + t/10)`.
    fn reference(cfg: &AdagradConfig, steps: u64, p: &mut [f64], g: &[f64], s: &mut [f64]) {
        for t in 1..=steps {
            let clr = cfg.lr / (1.0 + (t - 1) as f64 * cfg.lr_decay);
            for i in 0..p.len() {
                let mut gi = g[i] * (1.0 + 0.1 * t as f64);
                if cfg.maximize {
                    gi = -gi;
                }
                gi += cfg.weight_decay * p[i];
                s[i] += gi * gi;
                p[i] -= clr * gi / (s[i].sqrt() + cfg.eps);
            }
        }
    }

    fn run(threads: usize, cfg: &AdagradConfig, n: usize, steps: u64) -> (Vec<f32>, Vec<f32>) {
        let pool = Threads::new(threads).unwrap();
        let (mut p, g) = start(n);
        let mut s = vec![0.0; n];
        for t in 1..=steps {
            let shard = AdamShard {
                p: &mut p,
                g: &g,
                m: &mut s,
                v: &mut [],
            };
            let scale = 1.0 + 0.1 * t as f32;
            adagrad_step(&pool, cfg, t, scale, shard, ComputeCopy::None).unwrap();
        }
        (p, s)
    }

    fn configs() -> Vec<AdagradConfig> {
        let base = AdagradConfig {
            lr: 0.05,
            ..Default::default()
        };
        vec![
            base,
            AdagradConfig {
                weight_decay: 0.01,
                maximize: true,
                ..base
            },
            AdagradConfig {
                lr_decay: 0.3,
                eps: 1e-3,
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
            let mut rs = vec![0.0; n];
            reference(&cfg, steps, &mut rp, &rg, &mut rs);
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
    fn the_rate_decays_by_step_and_the_first_step_is_libtorchs_bits() {
        let cfg = AdagradConfig {
            lr: 0.1,
            lr_decay: 0.5,
            ..Default::default()
        };
        assert_eq!(cfg.step_lr(1), 0.1);
        assert_eq!(cfg.step_lr(3), 0.1 / 2.0);
        // Step 1 from a zero sum: s = g^2 and p - clr g / (|g| + eps), each
        // operation rounded as libtorch's kernels round it.
        let (p, s) = run(1, &cfg, 8, 1);
        let (p0, g) = start(8);
        for i in 0..8 {
            let gi = g[i] * 1.1;
            let si = gi.mul_add(gi, 0.0);
            assert_eq!(s[i], si);
            assert_eq!(p[i], p0[i] + (-0.1f32 * gi) / (si.sqrt() + 1e-10));
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
            // `adagrad_range` runs the widest level this CPU has.
            let c = Coef::new(&cfg, 2, 0.7).unwrap();
            let (p0, g) = start(4099);
            let s0: Vec<f32> = g.iter().map(|x| x * x * 0.3).collect();
            let (mut p1, mut s1, mut b1) = (p0.clone(), s0.clone(), vec![0u16; p0.len()]);
            let (mut p2, mut s2, mut b2) = (p0.clone(), s0, vec![0u16; p0.len()]);
            range_body(&c, &mut p1, &g, &mut s1, CopyBits::Bf16(&mut b1));
            adagrad_range(&c, &mut p2, &g, &mut s2, CopyBits::Bf16(&mut b2));
            assert_eq!(bits(&p1), bits(&p2));
            assert_eq!(bits(&s1), bits(&s2));
            assert_eq!(b1, b2);
        }
    }

    #[test]
    fn compute_copy_is_the_cast_of_the_updated_params_on_every_thread() {
        let pool = Threads::new(3).unwrap();
        let n = 70_001;
        let (mut p, g) = start(n);
        let (mut s, mut b) = (vec![0.0; n], vec![bf16::ZERO; n]);
        let shard = AdamShard {
            p: &mut p,
            g: &g,
            m: &mut s,
            v: &mut [],
        };
        let copy = ComputeCopy::Bf16(&mut b);
        adagrad_step(&pool, &AdagradConfig::default(), 1, 1.0, shard, copy).unwrap();
        for i in 0..n {
            assert_eq!(b[i].to_bits(), crate::cast::f32_to_bf16_bits(p[i]), "{i}");
        }
    }

    #[test]
    fn state_it_does_not_keep_or_a_bad_setting_is_refused() {
        let pool = Threads::new(1).unwrap();
        let (mut p, g, mut s) = (vec![0.0; 4], vec![0.0; 4], vec![0.0; 4]);
        let step = |cfg: &AdagradConfig, p: &mut [f32], m: &mut [f32], v: &mut [f32]| {
            let shard = AdamShard { p, g: &g, m, v };
            adagrad_step(&pool, cfg, 1, 1.0, shard, ComputeCopy::None)
                .unwrap_err()
                .to_string()
        };
        let plain = AdagradConfig::default();
        assert_eq!(
            step(&plain, &mut p, &mut [], &mut []),
            "slice `m` has 0 elements but `p` has 4: every slice of one shard must have the same length"
        );
        assert_eq!(
            step(&plain, &mut p, &mut s, &mut [0.0; 4]),
            "slice `v` has 4 elements but must be empty: Adagrad keeps one sum of squares, in `m`"
        );
        let decay = AdagradConfig {
            lr_decay: -0.1,
            ..plain
        };
        assert_eq!(
            step(&decay, &mut p, &mut s, &mut []),
            "invalid optimizer setting `lr_decay` = -0.1: must be finite and >= 0"
        );
    }
}
