//! Fused Lion over one rank's flat fp32 shard.
//!
//! Lion ("EvoLved Sign Momentum", Chen et al. 2023) keeps one moment where
//! Adam keeps two, so its optimizer state is half of Adam's. The update is
//! DeepSpeed's `FusedLion`/`DeepSpeedCPULion` (decay always decoupled):
//!
//! ```text
//! g  = grad * grad_scale                 (1/loss_scale x clip coefficient)
//! c  = beta1 * m + (1 - beta1) * g
//! p  = p * (1 - lr * weight_decay) - lr * sign(c)
//! m  = beta2 * m + (1 - beta2) * g
//! ```
//!
//! with one difference where DeepSpeed's two kernels disagree with each
//! other: `sign(0)` is 0 here, as in the paper, so an element whose gradient
//! and momentum are both zero (an embedding row no batch has used yet)
//! does not move. DeepSpeed's CUDA kernel moves it by `+lr`, its CPU kernel
//! by `-lr` or `+lr` with the zero's sign bit. A NaN in `c` stays NaN.
//!
//! The moment's two products are a fused multiply-add, as the first moment
//! of [`adam`](crate::adam) is (libtorch's `add_(x, alpha)`); the
//! parameter's update is a multiply and an add, rounded apart. Every
//! dispatch level and thread count gives the same bits.

use crate::adam::{AdamConfig, AdamShard, ComputeCopy};
use crate::error::{empty, same_len};
use crate::simd::multiversion;
use crate::walk::{for_each_range, in_blocks, CopyBits};
use crate::{KernelError, Threads};

/// Per-call scalars, rounded to f32 once.
#[derive(Debug, Clone, Copy)]
struct Coef {
    scale: f32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    /// Decoupled decay factor `1 - lr * wd`.
    decay: f32,
    lr: f32,
}

impl Coef {
    fn new(cfg: &AdamConfig, grad_scale: f32) -> Result<Self, KernelError> {
        cfg.validate()?;
        Ok(Self {
            scale: grad_scale,
            beta1: cfg.beta1 as f32,
            one_minus_beta1: (1.0 - cfg.beta1) as f32,
            beta2: cfg.beta2 as f32,
            one_minus_beta2: (1.0 - cfg.beta2) as f32,
            decay: (1.0 - cfg.lr * cfg.weight_decay) as f32,
            lr: cfg.lr as f32,
        })
    }
}

/// The update over equal-length slices, a straight loop LLVM vectorizes.
#[inline(always)]
fn update(c: &Coef, p: &mut [f32], g: &[f32], m: &mut [f32]) {
    let n = p.len();
    let (g, m) = (&g[..n], &mut m[..n]);
    for i in 0..n {
        let gi = g[i] * c.scale;
        let ci = gi.mul_add(c.one_minus_beta1, m[i] * c.beta1);
        // `signum` alone would give +0.0 a sign of 1; NaN stays NaN.
        let sign = if ci == 0.0 { 0.0 } else { ci.signum() };
        p[i] = p[i] * c.decay - c.lr * sign;
        m[i] = gi.mul_add(c.one_minus_beta2, m[i] * c.beta2);
    }
}

/// One thread's contiguous range in cache blocks ([`in_blocks`]), each
/// block's compute copy written while it is in cache; within a block in
/// steps, with software prefetch ahead as Adam's, memory-bound as it is
/// (`zrt bench adam`, 1 thread, 50M params: a Lion step took 0.83-0.85 of
/// zrt's AdamW step's time without it, 0.77-0.79 with it).
#[inline(always)]
fn range_body(c: &Coef, p: &mut [f32], g: &[f32], m: &mut [f32], copy: CopyBits<'_>) {
    let streams = [p.as_ptr(), g.as_ptr(), m.as_ptr()];
    in_blocks(
        p,
        streams,
        copy,
        #[inline(always)]
        |ps, r| update(c, ps, &g[r.clone()], &mut m[r]),
    );
}

multiversion!(fn lion_range(c: &Coef, p: &mut [f32], g: &[f32], m: &mut [f32], copy: CopyBits<'_>) => range_body);

/// One Lion step over a shard, in one pass over memory.
///
/// Reads `lr`, `beta1`, `beta2` and `weight_decay` from `cfg` (all checked
/// as [`AdamConfig::validate`] checks them; `eps`, `adam_w_mode` and
/// `bias_correction` mean nothing to Lion). `shard.v` must be empty: Lion
/// keeps no second moment. `grad_scale` multiplies every gradient first
/// (`clip_coef / loss_scale`); it matters, since `c` mixes the gradient
/// with the momentum before its sign is taken. With a [`ComputeCopy`]
/// destination, the updated parameters are also written there in
/// bf16/f16.
pub fn lion_step(
    threads: &Threads,
    cfg: &AdamConfig,
    grad_scale: f32,
    shard: AdamShard<'_>,
    copy: ComputeCopy<'_>,
) -> Result<(), KernelError> {
    let c = Coef::new(cfg, grad_scale)?;
    let AdamShard { p, g, m, v } = shard;
    let n = p.len();
    same_len("g", g.len(), "p", n)?;
    same_len("m", m.len(), "p", n)?;
    empty("v", v.len(), "Lion keeps no second moment")?;
    let copy = CopyBits::of(copy, n)?;
    for_each_range(threads, p, g, [m], copy, |p, g, [m], copy| {
        lion_range(&c, p, g, m, copy)
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::test_data::bits;

    /// The module doc's formula in f64, sign(0) = 0.
    fn reference(cfg: &AdamConfig, steps: u64, p: &mut [f64], g: &[f64], m: &mut [f64]) {
        for t in 1..=steps {
            for i in 0..p.len() {
                let gi = g[i] * (1.0 + 0.1 * t as f64);
                let c = cfg.beta1 * m[i] + (1.0 - cfg.beta1) * gi;
                let sign = if c == 0.0 { 0.0 } else { c.signum() };
                p[i] = p[i] * (1.0 - cfg.lr * cfg.weight_decay) - cfg.lr * sign;
                m[i] = cfg.beta2 * m[i] + (1.0 - cfg.beta2) * gi;
            }
        }
    }

    fn start(n: usize) -> (Vec<f32>, Vec<f32>) {
        let p = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 30.0)
            .collect();
        // Every 7th gradient is zero: with a zero momentum, those elements
        // must not move but for decay.
        let g = (0..n)
            .map(|i| {
                if i % 7 == 0 {
                    0.0
                } else {
                    ((i * 53 % 97) as f32 - 48.5) / 40.0
                }
            })
            .collect();
        (p, g)
    }

    fn run(threads: usize, cfg: &AdamConfig, n: usize, steps: u64) -> (Vec<f32>, Vec<f32>) {
        let pool = Threads::new(threads).unwrap();
        let (mut p, g) = start(n);
        let mut m = vec![0.0; n];
        for t in 1..=steps {
            let shard = AdamShard {
                p: &mut p,
                g: &g,
                m: &mut m,
                v: &mut [],
            };
            lion_step(&pool, cfg, 1.0 + 0.1 * t as f32, shard, ComputeCopy::None).unwrap();
        }
        (p, m)
    }

    #[test]
    fn matches_f64_reference_and_leaves_zero_gradients_alone() {
        let cfg = AdamConfig {
            lr: 1e-2,
            beta2: 0.99,
            weight_decay: 0.1,
            ..Default::default()
        };
        let (n, steps) = (1000, 10);
        let (p, m) = run(1, &cfg, n, steps);
        let (p0, g) = start(n);
        let mut rp: Vec<f64> = p0.iter().map(|&x| x as f64).collect();
        let rg: Vec<f64> = g.iter().map(|&x| x as f64).collect();
        let mut rm = vec![0.0; n];
        reference(&cfg, steps, &mut rp, &rg, &mut rm);
        for i in 0..n {
            // Each step moves an element by exactly lr or 0 (no sign is
            // near its flip here): only the decay's rounding differs.
            assert!(
                (p[i] as f64 - rp[i]).abs() <= 1e-6,
                "p[{i}]: {} vs {}",
                p[i],
                rp[i]
            );
            assert!(
                (m[i] as f64 - rm[i]).abs() <= 1e-6 * rm[i].abs().max(1e-3),
                "m[{i}]"
            );
        }
        // The zero-gradient elements only decayed.
        let decayed = (p0[7] as f64) * (1.0 - cfg.lr * cfg.weight_decay).powi(steps as i32);
        assert!(
            (p[7] as f64 - decayed).abs() <= 1e-6,
            "{} vs {decayed}",
            p[7]
        );
        assert_eq!(m[7], 0.0);
        // And without decay they do not move at all.
        let still = AdamConfig {
            weight_decay: 0.0,
            ..cfg
        };
        assert_eq!(run(1, &still, n, steps).0[7], p0[7]);
    }

    #[test]
    fn threads_and_dispatch_levels_do_not_change_a_bit() {
        let cfg = AdamConfig {
            lr: 3e-3,
            weight_decay: 0.01,
            ..Default::default()
        };
        let n = 100_003;
        let one = run(1, &cfg, n, 3);
        let three = run(3, &cfg, n, 3);
        assert_eq!(bits(&one.0), bits(&three.0));
        assert_eq!(bits(&one.1), bits(&three.1));
        // `range_body` called directly is compiled for baseline x86-64;
        // `lion_range` runs the widest level this CPU has.
        let c = Coef::new(&cfg, 0.7).unwrap();
        let (p0, g) = start(4099);
        let m0: Vec<f32> = g.iter().map(|x| -x * 0.3).collect();
        let (mut p1, mut m1, mut b1) = (p0.clone(), m0.clone(), vec![0u16; p0.len()]);
        let (mut p2, mut m2, mut b2) = (p0.clone(), m0, vec![0u16; p0.len()]);
        range_body(&c, &mut p1, &g, &mut m1, CopyBits::Bf16(&mut b1));
        lion_range(&c, &mut p2, &g, &mut m2, CopyBits::Bf16(&mut b2));
        assert_eq!(bits(&p1), bits(&p2));
        assert_eq!(bits(&m1), bits(&m2));
        assert_eq!(b1, b2);
    }

    #[test]
    fn compute_copy_is_the_cast_of_the_updated_params() {
        let pool = Threads::new(2).unwrap();
        let n = 70_001;
        let (mut p, g) = start(n);
        let mut m = vec![0.0; n];
        let mut b = vec![bf16::ZERO; n];
        let shard = AdamShard {
            p: &mut p,
            g: &g,
            m: &mut m,
            v: &mut [],
        };
        lion_step(
            &pool,
            &AdamConfig::default(),
            1.0,
            shard,
            ComputeCopy::Bf16(&mut b),
        )
        .unwrap();
        for i in 0..n {
            assert_eq!(b[i].to_bits(), crate::cast::f32_to_bf16_bits(p[i]));
        }
    }

    #[test]
    fn a_second_moment_or_a_bad_setting_is_refused() {
        let pool = Threads::new(1).unwrap();
        let (mut p, g, mut m, mut v) = (vec![0.0; 4], vec![0.0; 4], vec![0.0; 4], vec![0.0; 4]);
        let shard = AdamShard {
            p: &mut p,
            g: &g,
            m: &mut m,
            v: &mut v,
        };
        let e = lion_step(&pool, &AdamConfig::default(), 1.0, shard, ComputeCopy::None)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "slice `v` has 4 elements but must be empty: Lion keeps no second moment"
        );
        let shard = AdamShard {
            p: &mut p,
            g: &g,
            m: &mut m,
            v: &mut [],
        };
        let cfg = AdamConfig {
            beta1: 1.0,
            ..Default::default()
        };
        let e = lion_step(&pool, &cfg, 1.0, shard, ComputeCopy::None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid optimizer setting `betas[0]` = 1: must be in [0, 1)"
        );
    }
}
