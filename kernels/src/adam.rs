//! Fused Adam / AdamW over one rank's flat fp32 shard.
//!
//! Semantics are DeepSpeed's `FusedAdam`/`DeepSpeedCPUAdam` (and PyTorch's
//! `Adam`/`AdamW`, which agree with them):
//!
//! ```text
//! g  = grad * grad_scale                 (1/loss_scale x clip coefficient)
//! g += weight_decay * p                  (Adam, adam_w_mode = false: L2)
//! p *= 1 - lr * weight_decay             (AdamW, adam_w_mode = true: decoupled)
//! m  = beta1 * m + (1 - beta1) * g
//! v  = beta2 * v + (1 - beta2) * g * g
//! p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
//! ```
//!
//! with `bc1 = 1 - beta1^step`, `bc2 = 1 - beta2^step` (both 1 when
//! `bias_correction` is off). Scalar coefficients are computed in f64 and
//! rounded to f32 once per call, as libtorch does with its double scalars.
//!
//! Rounding follows libtorch's own CPU kernels operation by operation, so
//! zrt and `torch.optim.AdamW` agree to about an ulp, not merely in value:
//! `add_(x, alpha)` is a fused multiply-add in libtorch's vectorized code, so
//! the first moment and the L2 term use `mul_add`; `addcmul` and `addcdiv`
//! are computed as `(value * a) * b` and `(value * a) / b`. On a CPU without
//! FMA the `mul_add` calls fall back to libm (correct, much slower).

use half::{bf16, f16};

use crate::error::{non_negative, same_len};
use crate::simd::multiversion;
use crate::walk::{for_each_range, in_blocks, CopyBits};
use crate::{KernelError, Threads};

/// Adam hyper-parameters, named as in DeepSpeed's `optimizer.params`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    /// Learning rate of this step (schedulers change it between steps).
    pub lr: f64,
    /// `betas[0]`: decay of the first moment.
    pub beta1: f64,
    /// `betas[1]`: decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay; decoupled (AdamW) or L2 (Adam) per `adam_w_mode`.
    pub weight_decay: f64,
    /// `true`: AdamW's decoupled decay; `false`: Adam with L2 decay.
    pub adam_w_mode: bool,
    /// Divide the moments by `1 - beta^step`.
    pub bias_correction: bool,
}

impl Default for AdamConfig {
    /// DeepSpeed's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, no decay, AdamW mode.
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            adam_w_mode: true,
            bias_correction: true,
        }
    }
}

impl AdamConfig {
    /// Checks every setting's domain, naming the first bad one.
    pub fn validate(&self) -> Result<(), KernelError> {
        let bad = |name, value, why| Err(KernelError::BadSetting { name, value, why });
        non_negative(&[("lr", self.lr)])?;
        if !(0.0..1.0).contains(&self.beta1) {
            return bad("betas[0]", self.beta1, "must be in [0, 1)");
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return bad("betas[1]", self.beta2, "must be in [0, 1)");
        }
        non_negative(&[("eps", self.eps), ("weight_decay", self.weight_decay)])
    }
}

/// One rank's shard of the optimizer's inputs; all four slices have one length.
#[derive(Debug)]
pub struct AdamShard<'a> {
    /// fp32 master parameters, updated in place.
    pub p: &'a mut [f32],
    /// fp32 gradients (unscaled by this call: see `grad_scale`).
    pub g: &'a [f32],
    /// First moment, updated in place.
    pub m: &'a mut [f32],
    /// Second moment, updated in place.
    pub v: &'a mut [f32],
}

/// Where, if anywhere, to write the updated parameters in the compute dtype.
#[derive(Debug, Default)]
pub enum ComputeCopy<'a> {
    /// fp32 training: the master shard is the compute shard.
    #[default]
    None,
    /// Write bf16 (libtorch's rounding) into this slice.
    Bf16(&'a mut [bf16]),
    /// Write f16 (libtorch's rounding) into this slice.
    F16(&'a mut [f16]),
}

/// Per-call scalars, rounded to f32 once (shared with the CUDA kernel).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Coef {
    pub(crate) scale: f32,
    pub(crate) beta1: f32,
    pub(crate) one_minus_beta1: f32,
    pub(crate) beta2: f32,
    pub(crate) one_minus_beta2: f32,
    pub(crate) eps: f32,
    /// L2 decay added to the gradient (0 in AdamW mode).
    pub(crate) l2: f32,
    /// Decoupled decay factor `1 - lr * wd` (1 in Adam mode).
    pub(crate) decay: f32,
    /// `-lr / bc1`, as libtorch passes it to `addcdiv_`.
    pub(crate) neg_step_size: f32,
    pub(crate) bc2_sqrt: f32,
}

impl Coef {
    /// Validates the settings and the step, then rounds the scalars: the one
    /// entry point of every Adam kernel (CPU and CUDA).
    pub(crate) fn new(cfg: &AdamConfig, step: u64, grad_scale: f32) -> Result<Self, KernelError> {
        cfg.validate()?;
        if step == 0 {
            return Err(KernelError::BadSetting {
                name: "step",
                value: 0.0,
                why: "is 1-based: the first step is 1",
            });
        }
        let t = step as f64;
        let (bc1, bc2) = if cfg.bias_correction {
            (1.0 - cfg.beta1.powf(t), 1.0 - cfg.beta2.powf(t))
        } else {
            (1.0, 1.0)
        };
        let (l2, decay) = if cfg.adam_w_mode {
            (0.0, 1.0 - cfg.lr * cfg.weight_decay)
        } else {
            (cfg.weight_decay, 1.0)
        };
        Ok(Self {
            scale: grad_scale,
            beta1: cfg.beta1 as f32,
            one_minus_beta1: (1.0 - cfg.beta1) as f32,
            beta2: cfg.beta2 as f32,
            one_minus_beta2: (1.0 - cfg.beta2) as f32,
            eps: cfg.eps as f32,
            l2: l2 as f32,
            decay: decay as f32,
            neg_step_size: (-(cfg.lr / bc1)) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
        })
    }
}

/// The update over equal-length slices. `L2` is hoisted so each variant is a
/// straight loop LLVM vectorizes.
#[inline(always)]
fn update<const L2: bool>(c: &Coef, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let pi = p[i];
        let mut gi = g[i] * c.scale;
        if L2 {
            // grad.add(p, alpha = wd)
            gi = pi.mul_add(c.l2, gi);
        }
        // exp_avg.mul_(beta1).add_(grad, alpha = 1 - beta1)
        let mi = gi.mul_add(c.one_minus_beta1, m[i] * c.beta1);
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value = 1 - beta2)
        let vi = v[i] * c.beta2 + c.one_minus_beta2 * gi * gi;
        // (exp_avg_sq.sqrt() / sqrt(bc2)).add_(eps)
        let denom = vi.sqrt() / c.bc2_sqrt + c.eps;
        // p.mul_(1 - lr * wd); p.addcdiv_(exp_avg, denom, value = -lr / bc1)
        p[i] = pi * c.decay + c.neg_step_size * mi / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

/// One thread's contiguous range, in cache blocks with software prefetch
/// ([`in_blocks`]).
#[inline(always)]
fn range_body(
    c: &Coef,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    copy: CopyBits<'_>,
) {
    let streams = [p.as_ptr(), g.as_ptr(), m.as_ptr(), v.as_ptr()];
    in_blocks(
        p,
        streams,
        copy,
        #[inline(always)]
        |ps, r| {
            let (gs, ms, vs) = (&g[r.clone()], &mut m[r.clone()], &mut v[r]);
            if c.l2 != 0.0 {
                update::<true>(c, ps, gs, ms, vs);
            } else {
                update::<false>(c, ps, gs, ms, vs);
            }
        },
    );
}

multiversion!(fn adam_range(c: &Coef, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], copy: CopyBits<'_>) => range_body);

/// One Adam/AdamW step over a shard, in one pass over memory.
///
/// `step` is the 1-based step count *including* this step (as
/// `state["step"]` after its increment in PyTorch). `grad_scale` multiplies
/// every gradient first: pass `clip_coef / loss_scale` (1.0 for neither).
/// With a [`ComputeCopy`] destination, the updated parameters are also
/// written there in bf16/f16.
pub fn adam_step(
    threads: &Threads,
    cfg: &AdamConfig,
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
    same_len("v", v.len(), "p", n)?;
    let copy = CopyBits::of(copy, n)?;
    for_each_range(threads, p, g, [m, v], copy, |p, g, [m, v], copy| {
        adam_range(&c, p, g, m, v, copy)
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain f64 transcription of the formula in the module docs.
    fn reference(
        cfg: &AdamConfig,
        steps: u64,
        p: &mut [f64],
        g: &[f64],
        m: &mut [f64],
        v: &mut [f64],
    ) {
        for t in 1..=steps {
            let bc1 = 1.0 - cfg.beta1.powi(t as i32);
            let bc2 = 1.0 - cfg.beta2.powi(t as i32);
            for i in 0..p.len() {
                let mut gi = g[i] * (1.0 + 0.1 * t as f64);
                if !cfg.adam_w_mode {
                    gi += cfg.weight_decay * p[i];
                } else {
                    p[i] *= 1.0 - cfg.lr * cfg.weight_decay;
                }
                m[i] = cfg.beta1 * m[i] + (1.0 - cfg.beta1) * gi;
                v[i] = cfg.beta2 * v[i] + (1.0 - cfg.beta2) * gi * gi;
                p[i] -= cfg.lr / bc1 * m[i] / (v[i].sqrt() / bc2.sqrt() + cfg.eps);
            }
        }
    }

    fn run(threads: usize, cfg: &AdamConfig, n: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let pool = Threads::new(threads).unwrap();
        let mut p: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 30.0)
            .collect();
        let g: Vec<f32> = (0..n)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 40.0)
            .collect();
        let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
        for t in 1..=10u64 {
            let shard = AdamShard {
                p: &mut p,
                g: &g,
                m: &mut m,
                v: &mut v,
            };
            adam_step(
                &pool,
                cfg,
                t,
                1.0 + 0.1 * t as f32,
                shard,
                ComputeCopy::None,
            )
            .unwrap();
        }
        (p, m, v)
    }

    #[test]
    fn matches_f64_reference_in_both_modes() {
        // A large eps too: at 1e-8 its sign would not show.
        for (adam_w_mode, eps) in [(true, 1e-8), (false, 1e-8), (true, 0.1)] {
            let cfg = AdamConfig {
                lr: 1e-2,
                weight_decay: 0.05,
                adam_w_mode,
                eps,
                ..Default::default()
            };
            let n = 1000;
            let (p, _, _) = run(1, &cfg, n);
            let mut rp: Vec<f64> = (0..n)
                .map(|i| ((i * 37 % 101) as f64 - 50.0) / 30.0)
                .collect();
            let rg: Vec<f64> = (0..n)
                .map(|i| ((i * 53 % 97) as f64 - 48.0) / 40.0)
                .collect();
            let (mut rm, mut rv) = (vec![0.0; n], vec![0.0; n]);
            reference(&cfg, 10, &mut rp, &rg, &mut rm, &mut rv);
            for i in 0..n {
                let err = (p[i] as f64 - rp[i]).abs();
                assert!(
                    err <= 1e-5 * rp[i].abs().max(1e-2),
                    "mode w={adam_w_mode} i={i}: {} vs {}",
                    p[i],
                    rp[i]
                );
            }
        }
    }

    #[test]
    fn thread_count_does_not_change_a_bit() {
        let cfg = AdamConfig {
            lr: 3e-3,
            weight_decay: 0.01,
            ..Default::default()
        };
        // Not a multiple of the vector width, the block or the thread count.
        let n = 100_003;
        let one = run(1, &cfg, n);
        let three = run(3, &cfg, n);
        assert!(one
            .0
            .iter()
            .zip(&three.0)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(one
            .2
            .iter()
            .zip(&three.2)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn baseline_and_dispatched_simd_agree_to_the_bit() {
        // `range_body` called directly is compiled for baseline x86-64;
        // `adam_range` runs the widest level this CPU has.
        let c = Coef::new(
            &AdamConfig {
                weight_decay: 0.1,
                adam_w_mode: false,
                ..Default::default()
            },
            3,
            0.7,
        )
        .unwrap();
        let n = 4099;
        let p0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
        let m0: Vec<f32> = g.iter().map(|x| x * 0.1).collect();
        let v0: Vec<f32> = g.iter().map(|x| x * x * 0.01).collect();
        let (mut p1, mut m1, mut v1) = (p0.clone(), m0.clone(), v0.clone());
        let (mut p2, mut m2, mut v2) = (p0, m0, v0);
        let (mut b1, mut b2) = (vec![0u16; n], vec![0u16; n]);
        range_body(&c, &mut p1, &g, &mut m1, &mut v1, CopyBits::F16(&mut b1));
        adam_range(&c, &mut p2, &g, &mut m2, &mut v2, CopyBits::F16(&mut b2));
        assert!(p1.iter().zip(&p2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(v1.iter().zip(&v2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert_eq!(b1, b2);
    }

    #[test]
    fn compute_copy_is_the_cast_of_the_updated_params() {
        let pool = Threads::new(2).unwrap();
        let n = 70_001;
        let mut p: Vec<f32> = (0..n).map(|i| (i as f32).sin()).collect();
        let g: Vec<f32> = (0..n).map(|i| (i as f32).cos()).collect();
        let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
        let mut b = vec![bf16::ZERO; n];
        let shard = AdamShard {
            p: &mut p,
            g: &g,
            m: &mut m,
            v: &mut v,
        };
        adam_step(
            &pool,
            &AdamConfig::default(),
            1,
            1.0,
            shard,
            ComputeCopy::Bf16(&mut b),
        )
        .unwrap();
        for i in 0..n {
            assert_eq!(b[i].to_bits(), crate::cast::f32_to_bf16_bits(p[i]));
        }
        let mut h = vec![f16::ZERO; n];
        let shard = AdamShard {
            p: &mut p,
            g: &g,
            m: &mut m,
            v: &mut v,
        };
        adam_step(
            &pool,
            &AdamConfig::default(),
            2,
            1.0,
            shard,
            ComputeCopy::F16(&mut h),
        )
        .unwrap();
        for i in 0..n {
            assert_eq!(h[i].to_bits(), crate::cast::f32_to_f16_bits(p[i]));
        }
    }

    #[test]
    fn every_setting_out_of_its_domain_is_refused_by_name() {
        let (nan, inf) = (f64::NAN, f64::INFINITY);
        type Set = fn(&mut AdamConfig, f64);
        let settings: [(&str, Set, &[f64]); 5] = [
            ("lr", |c, x| c.lr = x, &[-1e-3, inf, nan]),
            ("betas[0]", |c, x| c.beta1 = x, &[-0.1, 1.0, nan]),
            ("betas[1]", |c, x| c.beta2 = x, &[-0.1, 1.5, nan]),
            ("eps", |c, x| c.eps = x, &[-1e-8, inf, nan]),
            (
                "weight_decay",
                |c, x| c.weight_decay = x,
                &[-0.01, inf, nan],
            ),
        ];
        for (name, set, bad) in settings {
            for &x in bad {
                let mut c = AdamConfig::default();
                set(&mut c, x);
                let e = c.validate().unwrap_err().to_string();
                assert!(e.contains(&format!("`{name}` = {x}")), "{name} = {x}: {e}");
            }
            // The domain's edge is allowed.
            let mut c = AdamConfig::default();
            set(&mut c, 0.0);
            c.validate().unwrap();
        }
    }

    #[test]
    fn bad_arguments_are_named() {
        let pool = Threads::new(1).unwrap();
        let (mut p, g, mut m, mut v) = (vec![0.0; 4], vec![0.0; 3], vec![0.0; 4], vec![0.0; 4]);
        let shard = AdamShard {
            p: &mut p,
            g: &g,
            m: &mut m,
            v: &mut v,
        };
        let e = adam_step(
            &pool,
            &AdamConfig::default(),
            1,
            1.0,
            shard,
            ComputeCopy::None,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("slice `g` has 3 elements but `p` has 4"),
            "{e}"
        );
        let g = vec![0.0; 4];
        let shard = AdamShard {
            p: &mut p,
            g: &g,
            m: &mut m,
            v: &mut v,
        };
        let cfg = AdamConfig {
            beta2: 1.0,
            ..Default::default()
        };
        let e = adam_step(&pool, &cfg, 1, 1.0, shard, ComputeCopy::None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid optimizer setting `betas[1]` = 1: must be in [0, 1)"
        );
        let shard = AdamShard {
            p: &mut p,
            g: &g,
            m: &mut m,
            v: &mut v,
        };
        let e = adam_step(
            &pool,
            &AdamConfig::default(),
            0,
            1.0,
            shard,
            ComputeCopy::None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("1-based"), "{e}");
    }
}
