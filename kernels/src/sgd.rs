//! Fused SGD (with momentum, dampening, Nesterov) over one rank's flat fp32
//! shard: `torch.optim.SGD`'s update, which DeepSpeed builds for
//! `"type": "SGD"` (it hands any type it has no kernel of its own for to
//! `torch.optim`).
//!
//! ```text
//! g = grad * grad_scale                  (1/loss_scale x clip coefficient)
//! g = -g                                 (maximize)
//! g = g + weight_decay * p               (L2: coupled, as torch's SGD)
//! b = g                                  (momentum, the buffer's first step)
//! b = momentum * b + (1 - dampening) * g (momentum, every later step)
//! g = g + momentum * b                   (nesterov)   else  g = b
//! p = p - lr * g
//! ```
//!
//! With `momentum == 0` SGD keeps no state at all: `m` is empty, and the
//! update is `p = p - lr * (g + weight_decay * p)`. Each `add(x, alpha)` of
//! torch's is one fused multiply-add here, as libtorch's vectorized CPU add
//! computes it; `mul_` then `add_` is a rounded product and a fused
//! multiply-add. Every dispatch level and thread count gives the same bits.

use crate::adam::{AdamShard, ComputeCopy};
use crate::error::{empty, non_negative, same_len};
use crate::simd::multiversion;
use crate::walk::{for_each_range, in_blocks, CopyBits};
use crate::{KernelError, Threads};

/// SGD's hyper-parameters for one step (`torch.optim.SGD`'s, same names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate of this step.
    pub lr: f64,
    /// Momentum factor; 0 keeps no momentum buffer.
    pub momentum: f64,
    /// Dampening of the gradient's share in the momentum buffer.
    pub dampening: f64,
    /// L2 penalty, added to the gradient (coupled, as torch's SGD does).
    pub weight_decay: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
    /// Ascend the objective instead of descending it.
    pub maximize: bool,
}

impl Default for SgdConfig {
    /// `torch.optim.SGD`'s defaults: lr 1e-3, no momentum, no decay.
    fn default() -> Self {
        Self {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
        }
    }
}

impl SgdConfig {
    /// Checks every setting is in its domain (torch's own checks, plus
    /// finiteness).
    pub fn validate(&self) -> Result<(), KernelError> {
        let bad = |name, value, why| Err(KernelError::BadSetting { name, value, why });
        non_negative(&[("lr", self.lr), ("momentum", self.momentum)])?;
        if !self.dampening.is_finite() {
            return bad("dampening", self.dampening, "must be finite");
        }
        non_negative(&[("weight_decay", self.weight_decay)])?;
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return bad(
                "nesterov",
                1.0,
                "Nesterov momentum needs momentum > 0 and dampening 0",
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
    momentum: f32,
    /// `1 - dampening`, or 1 on the buffer's first step (it is the
    /// gradient itself then).
    one_minus_dampening: f32,
    /// 0 on the buffer's first step: nothing of the zero buffer is kept.
    keep: f32,
    nesterov: bool,
    neg_lr: f32,
}

impl Coef {
    fn new(cfg: &SgdConfig, first: bool, grad_scale: f32) -> Result<Self, KernelError> {
        cfg.validate()?;
        Ok(Self {
            scale: if cfg.maximize {
                -grad_scale
            } else {
                grad_scale
            },
            weight_decay: cfg.weight_decay as f32,
            momentum: cfg.momentum as f32,
            one_minus_dampening: if first {
                1.0
            } else {
                (1.0 - cfg.dampening) as f32
            },
            keep: if first { 0.0 } else { cfg.momentum as f32 },
            nesterov: cfg.nesterov,
            neg_lr: -cfg.lr as f32,
        })
    }

    /// The gradient with its scale and decay.
    #[inline(always)]
    fn grad(&self, g: f32, p: f32) -> f32 {
        let g = g * self.scale;
        if self.weight_decay != 0.0 {
            p.mul_add(self.weight_decay, g)
        } else {
            g
        }
    }
}

/// The update over equal-length slices (`m` as long as `p`, or empty
/// without momentum), straight loops LLVM vectorizes.
#[inline(always)]
fn update(c: &Coef, p: &mut [f32], g: &[f32], m: &mut [f32]) {
    let n = p.len();
    let g = &g[..n];
    if m.is_empty() {
        for i in 0..n {
            p[i] = c.grad(g[i], p[i]).mul_add(c.neg_lr, p[i]);
        }
        return;
    }
    let m = &mut m[..n];
    for i in 0..n {
        let gi = c.grad(g[i], p[i]);
        // On the first step `keep` is 0 and the buffer is `gi` exactly
        // (0 x 0 + gi x 1); a NaN left in a buffer stays NaN, as torch's.
        let b = gi.mul_add(c.one_minus_dampening, m[i] * c.keep);
        let d = if c.nesterov {
            b.mul_add(c.momentum, gi)
        } else {
            b
        };
        p[i] = d.mul_add(c.neg_lr, p[i]);
        m[i] = b;
    }
}

/// One thread's contiguous range in cache blocks ([`in_blocks`]), each
/// block's compute copy written while it is in cache; software prefetch as
/// Adam's (SGD streams two or three arrays and is as memory-bound).
#[inline(always)]
fn range_body(c: &Coef, p: &mut [f32], g: &[f32], m: &mut [f32], copy: CopyBits<'_>) {
    if m.is_empty() {
        let streams = [p.as_ptr(), g.as_ptr()];
        in_blocks(
            p,
            streams,
            copy,
            #[inline(always)]
            |ps, r| update(c, ps, &g[r], &mut []),
        );
    } else {
        let streams = [p.as_ptr(), g.as_ptr(), m.as_ptr()];
        in_blocks(
            p,
            streams,
            copy,
            #[inline(always)]
            |ps, r| update(c, ps, &g[r.clone()], &mut m[r]),
        );
    }
}

multiversion!(fn sgd_range(c: &Coef, p: &mut [f32], g: &[f32], m: &mut [f32], copy: CopyBits<'_>) => range_body);

/// One SGD step over a shard, in one pass over memory.
///
/// `shard.m` is the momentum buffer: as long as `p` when `cfg.momentum > 0`,
/// empty when it is 0; `shard.v` must be empty. `first` says this step
/// starts the buffer (torch sets it to the gradient on a parameter's first
/// step rather than decaying a zero one, which matters under dampening);
/// it is ignored without momentum. `grad_scale` multiplies every gradient
/// first (`clip_coef / loss_scale`). With a [`ComputeCopy`] destination,
/// the updated parameters are also written there in bf16/f16.
pub fn sgd_step(
    threads: &Threads,
    cfg: &SgdConfig,
    first: bool,
    grad_scale: f32,
    shard: AdamShard<'_>,
    copy: ComputeCopy<'_>,
) -> Result<(), KernelError> {
    let c = Coef::new(cfg, first, grad_scale)?;
    let AdamShard { p, g, m, v } = shard;
    let n = p.len();
    same_len("g", g.len(), "p", n)?;
    match cfg.momentum > 0.0 {
        true => same_len("m", m.len(), "p", n)?,
        false => empty("m", m.len(), "SGD without momentum keeps no state")?,
    }
    empty("v", v.len(), "SGD keeps no second moment")?;
    let copy = CopyBits::of(copy, n)?;
    // Without momentum `m` is empty, and stays so in every thread's range.
    for_each_range(threads, p, g, [m], copy, |p, g, [m], copy| {
        sgd_range(&c, p, g, m, copy)
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::test_data::{bits, start};

    /// The module doc's formula in f64, step `t`'s gradient `g x (1 + t/10)`.
    fn reference(cfg: &SgdConfig, steps: u64, p: &mut [f64], g: &[f64], m: &mut [f64]) {
        for t in 1..=steps {
            for i in 0..p.len() {
                let mut gi = g[i] * (1.0 + 0.1 * t as f64);
                if cfg.maximize {
                    gi = -gi;
                }
                gi += cfg.weight_decay * p[i];
                if cfg.momentum > 0.0 {
                    m[i] = if t == 1 {
                        gi
                    } else {
                        cfg.momentum * m[i] + (1.0 - cfg.dampening) * gi
                    };
                    gi = if cfg.nesterov {
                        gi + cfg.momentum * m[i]
                    } else {
                        m[i]
                    };
                }
                p[i] -= cfg.lr * gi;
            }
        }
    }

    fn run(threads: usize, cfg: &SgdConfig, n: usize, steps: u64) -> (Vec<f32>, Vec<f32>) {
        let pool = Threads::new(threads).unwrap();
        let (mut p, g) = start(n);
        let mut m = vec![0.0; if cfg.momentum > 0.0 { n } else { 0 }];
        for t in 1..=steps {
            let shard = AdamShard {
                p: &mut p,
                g: &g,
                m: &mut m,
                v: &mut [],
            };
            let scale = 1.0 + 0.1 * t as f32;
            sgd_step(&pool, cfg, t == 1, scale, shard, ComputeCopy::None).unwrap();
        }
        (p, m)
    }

    fn configs() -> Vec<SgdConfig> {
        let base = SgdConfig {
            lr: 0.05,
            ..Default::default()
        };
        vec![
            base,
            SgdConfig {
                weight_decay: 0.01,
                maximize: true,
                ..base
            },
            SgdConfig {
                momentum: 0.9,
                dampening: 0.3,
                weight_decay: 0.01,
                ..base
            },
            SgdConfig {
                momentum: 0.9,
                nesterov: true,
                ..base
            },
        ]
    }

    #[test]
    fn matches_f64_reference_with_and_without_momentum() {
        let (n, steps) = (1000, 10);
        for cfg in configs() {
            let (p, m) = run(1, &cfg, n, steps);
            let (p0, g) = start(n);
            let mut rp: Vec<f64> = p0.iter().map(|&x| x as f64).collect();
            let rg: Vec<f64> = g.iter().map(|&x| x as f64).collect();
            let mut rm = vec![0.0; n];
            reference(&cfg, steps, &mut rp, &rg, &mut rm);
            assert_eq!(m.len(), if cfg.momentum > 0.0 { n } else { 0 });
            for i in 0..n {
                assert!(
                    (p[i] as f64 - rp[i]).abs() <= 1e-5 * rp[i].abs().max(1.0),
                    "{cfg:?} p[{i}]: {} vs {}",
                    p[i],
                    rp[i]
                );
                if let Some(&mi) = m.get(i) {
                    assert!(
                        (mi as f64 - rm[i]).abs() <= 1e-5 * rm[i].abs().max(1.0),
                        "{cfg:?} m[{i}]: {mi} vs {}",
                        rm[i]
                    );
                }
            }
        }
    }

    #[test]
    fn the_first_step_sets_the_buffer_to_the_gradient() {
        // Under dampening the first step must not damp: torch starts the
        // buffer as a copy of the gradient.
        let cfg = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.5,
            ..Default::default()
        };
        let (p, m) = run(1, &cfg, 8, 1);
        let (p0, g) = start(8);
        for i in 0..8 {
            let gi = g[i] * 1.1;
            assert_eq!(m[i], gi);
            assert_eq!(p[i], gi.mul_add(-0.1, p0[i]));
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
            // `sgd_range` runs the widest level this CPU has.
            let c = Coef::new(&cfg, false, 0.7).unwrap();
            let (p0, g) = start(4099);
            let m0: Vec<f32> = match cfg.momentum > 0.0 {
                true => g.iter().map(|x| -x * 0.3).collect(),
                false => Vec::new(),
            };
            let (mut p1, mut m1, mut b1) = (p0.clone(), m0.clone(), vec![0u16; p0.len()]);
            let (mut p2, mut m2, mut b2) = (p0.clone(), m0, vec![0u16; p0.len()]);
            range_body(&c, &mut p1, &g, &mut m1, CopyBits::Bf16(&mut b1));
            sgd_range(&c, &mut p2, &g, &mut m2, CopyBits::Bf16(&mut b2));
            assert_eq!(bits(&p1), bits(&p2));
            assert_eq!(bits(&m1), bits(&m2));
            assert_eq!(b1, b2);
        }
    }

    #[test]
    fn compute_copy_is_the_cast_of_the_updated_params_on_every_thread() {
        let pool = Threads::new(3).unwrap();
        let n = 70_001;
        let (mut p, g) = start(n);
        let mut b = vec![bf16::ZERO; n];
        let shard = AdamShard {
            p: &mut p,
            g: &g,
            m: &mut [],
            v: &mut [],
        };
        let copy = ComputeCopy::Bf16(&mut b);
        sgd_step(&pool, &SgdConfig::default(), true, 1.0, shard, copy).unwrap();
        for i in 0..n {
            assert_eq!(b[i].to_bits(), crate::cast::f32_to_bf16_bits(p[i]), "{i}");
        }
    }

    #[test]
    fn state_it_does_not_keep_or_a_bad_setting_is_refused() {
        let pool = Threads::new(1).unwrap();
        let (mut p, g, mut m) = (vec![0.0; 4], vec![0.0; 4], vec![0.0; 4]);
        let step = |cfg: &SgdConfig, p: &mut [f32], m: &mut [f32], v: &mut [f32]| {
            let shard = AdamShard { p, g: &g, m, v };
            sgd_step(&pool, cfg, false, 1.0, shard, ComputeCopy::None)
                .unwrap_err()
                .to_string()
        };
        let plain = SgdConfig::default();
        assert_eq!(
            step(&plain, &mut p, &mut m, &mut []),
            "slice `m` has 4 elements but must be empty: SGD without momentum keeps no state"
        );
        let momentum = SgdConfig {
            momentum: 0.9,
            ..plain
        };
        assert_eq!(
            step(&momentum, &mut p, &mut [], &mut []),
            "slice `m` has 0 elements but `p` has 4: every slice of one shard must have the same length"
        );
        assert_eq!(
            step(&momentum, &mut p, &mut m, &mut [0.0; 4]),
            "slice `v` has 4 elements but must be empty: SGD keeps no second moment"
        );
        let nesterov = SgdConfig {
            nesterov: true,
            dampening: 0.1,
            ..momentum
        };
        assert_eq!(
            step(&nesterov, &mut p, &mut m, &mut []),
            "invalid optimizer setting `nesterov` = 1: Nesterov momentum needs momentum > 0 and dampening 0"
        );
    }
}
