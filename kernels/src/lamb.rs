//! LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning") as
//! DeepSpeed's `FusedLamb` computes it, in the three passes its trust ratio
//! needs:
//!
//! ```text
//! g  = grad * grad_scale                       (1/loss_scale x clip coefficient)
//! m  = beta1 * m + (1 - beta1) * g             [lamb_moments]
//! v  = beta2 * v + (1 - beta2) * g * g
//! u  = m / (sqrt(v) + eps) + weight_decay * p  (eps_inside_sqrt: m / sqrt(v + eps))
//! w2 = sum p^2, u2 = sum u^2 over one whole parameter tensor
//! r  = clamp(sqrt(w2) / sqrt(u2), min_coeff, max_coeff), 1 if either is 0   [LambConfig::trust]
//! p  = p - step_size * r * u                   [lamb_update]
//! ```
//!
//! with `step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)` under bias
//! correction, else `lr`: DeepSpeed corrects the step, not the moments, so
//! the trust ratio sees the uncorrected update (and the decay term is
//! scaled with it). Its defaults: `max_coeff` 10, `min_coeff` 0.01.
//!
//! The norms are of whole parameters, which a ZeRO shard cuts: the caller
//! sums each parameter's squares over the pieces a rank holds (with
//! [`reduce::sum_of_squares`](crate::reduce::sum_of_squares), deterministic),
//! adds the ranks' partial sums, and only then applies. Between the
//! passes `u` need not be kept: [`lamb_update`] computes it again from `p`
//! and the updated moments, to the same bits, and applies it in the same
//! pass, so a caller's scratch is pass one's, one parameter long, rather
//! than the whole shard.
//! Every dispatch level and thread count gives the same bits.

use crate::adam::{AdamConfig, ComputeCopy};
use crate::error::{non_negative, same_len};
use crate::simd::multiversion;
use crate::walk::{for_each_range, in_blocks, CopyBits};
use crate::{KernelError, Threads};

/// LAMB's hyper-parameters (DeepSpeed's `FusedLamb` names): Adam's, and
/// the trust ratio's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LambConfig {
    /// `lr`, `betas`, `eps`, `weight_decay` (added to the update as
    /// `weight_decay * p`, inside the trust ratio) and `bias_correction`
    /// (of the step size), as Adam's are named and checked; its
    /// `adam_w_mode` means nothing to LAMB.
    pub adam: AdamConfig,
    /// The trust ratio's upper clamp.
    pub max_coeff: f64,
    /// The trust ratio's lower clamp.
    pub min_coeff: f64,
    /// `eps` inside the square root (`m / sqrt(v + eps)`).
    pub eps_inside_sqrt: bool,
}

impl Default for LambConfig {
    /// DeepSpeed's `FusedLamb` defaults (Adam's are FusedAdam's, the same).
    fn default() -> Self {
        Self {
            adam: AdamConfig::default(),
            max_coeff: 10.0,
            min_coeff: 0.01,
            eps_inside_sqrt: false,
        }
    }
}

impl LambConfig {
    /// Checks every setting is in its domain.
    pub fn validate(&self) -> Result<(), KernelError> {
        self.adam.validate()?;
        let bad = |name, value, why| Err(KernelError::BadSetting { name, value, why });
        non_negative(&[("min_coeff", self.min_coeff)])?;
        if !(self.max_coeff >= self.min_coeff && self.max_coeff.is_finite()) {
            return bad(
                "max_coeff",
                self.max_coeff,
                "must be finite and >= min_coeff",
            );
        }
        Ok(())
    }

    /// The step size of step `step` (1-based): bias correction applied to
    /// the step, as DeepSpeed does.
    pub fn step_size(&self, step: u64) -> f64 {
        let a = &self.adam;
        if !a.bias_correction {
            return a.lr;
        }
        let t = step.min(i32::MAX as u64) as i32;
        a.lr * (1.0 - a.beta2.powi(t)).sqrt() / (1.0 - a.beta1.powi(t))
    }

    /// The trust ratio of a parameter whose squares sum to `w2` and whose
    /// update's squares sum to `u2` (over the whole parameter).
    pub fn trust(&self, w2: f64, u2: f64) -> f64 {
        let (w, u) = (w2.sqrt(), u2.sqrt());
        if w == 0.0 || u == 0.0 {
            return 1.0;
        }
        // A NaN ratio stays NaN (clamp would keep it too, but say so).
        (w / u).clamp(self.min_coeff, self.max_coeff)
    }
}

/// Pass one's scalars, rounded to f32 once.
#[derive(Debug, Clone, Copy)]
struct Coef {
    scale: f32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    eps: f32,
    eps_inside_sqrt: bool,
    weight_decay: f32,
}

impl Coef {
    fn new(cfg: &LambConfig, grad_scale: f32) -> Result<Self, KernelError> {
        cfg.validate()?;
        let a = &cfg.adam;
        Ok(Coef {
            scale: grad_scale,
            beta1: a.beta1 as f32,
            one_minus_beta1: (1.0 - a.beta1) as f32,
            beta2: a.beta2 as f32,
            one_minus_beta2: (1.0 - a.beta2) as f32,
            eps: a.eps as f32,
            eps_inside_sqrt: cfg.eps_inside_sqrt,
            weight_decay: a.weight_decay as f32,
        })
    }

    /// The update direction of an element from its parameter and its
    /// updated moments: pass one computes it, and [`lamb_update`] again
    /// before pass three, to the same bits.
    #[inline(always)]
    fn direction(&self, p: f32, m: f32, v: f32) -> f32 {
        let denom = if self.eps_inside_sqrt {
            (v + self.eps).sqrt()
        } else {
            v.sqrt() + self.eps
        };
        p.mul_add(self.weight_decay, m / denom)
    }
}

#[inline(always)]
fn moments(c: &Coef, p: &[f32], g: &[f32], m: &mut [f32], v: &mut [f32], u: &mut [f32]) {
    let n = u.len();
    let (p, g, m, v) = (&p[..n], &g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let gi = g[i] * c.scale;
        let mi = gi.mul_add(c.one_minus_beta1, m[i] * c.beta1);
        let vi = (gi * gi).mul_add(c.one_minus_beta2, v[i] * c.beta2);
        u[i] = c.direction(p[i], mi, vi);
        m[i] = mi;
        v[i] = vi;
    }
}

/// `p -= step * u` with `u` computed again from `p` and the moments.
#[inline(always)]
fn update(c: &Coef, neg_step: f32, p: &mut [f32], m: &[f32], v: &[f32]) {
    let n = p.len();
    let (m, v) = (&m[..n], &v[..n]);
    for i in 0..n {
        p[i] = c.direction(p[i], m[i], v[i]).mul_add(neg_step, p[i]);
    }
}

/// Pass one over one thread's range: `p` is read only (it is the walk's
/// first stream); `u` is written.
#[inline(always)]
fn moments_body(c: &Coef, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], u: &mut [f32]) {
    let streams = [p.as_ptr(), g.as_ptr(), m.as_ptr(), v.as_ptr()];
    in_blocks(
        p,
        streams,
        CopyBits::None,
        #[inline(always)]
        |ps, r| {
            let (gs, ms, vs) = (&g[r.clone()], &mut m[r.clone()], &mut v[r.clone()]);
            moments(c, ps, gs, ms, vs, &mut u[r])
        },
    );
}

multiversion!(fn moments_range(c: &Coef, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], u: &mut [f32]) => moments_body);

/// Pass one: updates `m` and `v` from the gradients `g` (times
/// `grad_scale`) and writes LAMB's update direction into `u`. `p` is not
/// changed (it is `&mut` only to walk with the others). All five slices
/// have one length.
#[allow(clippy::too_many_arguments)]
pub fn lamb_moments(
    threads: &Threads,
    cfg: &LambConfig,
    grad_scale: f32,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    u: &mut [f32],
) -> Result<(), KernelError> {
    let c = Coef::new(cfg, grad_scale)?;
    let n = p.len();
    for (name, len) in [
        ("g", g.len()),
        ("m", m.len()),
        ("v", v.len()),
        ("u", u.len()),
    ] {
        same_len(name, len, "p", n)?;
    }
    for_each_range(
        threads,
        p,
        g,
        [m, v, u],
        CopyBits::None,
        |p, g, [m, v, u], _| moments_range(&c, p, g, m, v, u),
    );
    Ok(())
}

/// Passes two and three over one thread's range (`m` in the walk's
/// second place), the compute copy written from each block.
#[inline(always)]
fn update_body(
    c: &Coef,
    neg_step: f32,
    p: &mut [f32],
    m: &[f32],
    v: &mut [f32],
    copy: CopyBits<'_>,
) {
    let streams = [p.as_ptr(), m.as_ptr(), v.as_ptr()];
    in_blocks(
        p,
        streams,
        copy,
        #[inline(always)]
        |ps, r| update(c, neg_step, ps, &m[r.clone()], &v[r]),
    );
}

multiversion!(fn update_range(c: &Coef, neg_step: f32, p: &mut [f32], m: &[f32], v: &mut [f32], copy: CopyBits<'_>) => update_body);

/// Passes two and three in one: `p -= step * u` (`step`: the step size
/// times this parameter's trust ratio, [`LambConfig::trust`]), with `u`
/// computed again from `p` and the moments [`lamb_moments`] left (the
/// bits it wrote, while `p` has not changed), and the compute copy of the
/// updated `p`. The engine keeps no update between the passes, and reads
/// `p`, `m`, `v` once for both. `v` is not changed (`&mut` only to walk
/// with the others).
pub fn lamb_update(
    threads: &Threads,
    cfg: &LambConfig,
    step: f64,
    p: &mut [f32],
    m: &[f32],
    v: &mut [f32],
    copy: ComputeCopy<'_>,
) -> Result<(), KernelError> {
    let c = Coef::new(cfg, 1.0)?;
    let n = p.len();
    for (name, len) in [("m", m.len()), ("v", v.len())] {
        same_len(name, len, "p", n)?;
    }
    let copy = CopyBits::of(copy, n)?;
    let neg_step = -step as f32;
    for_each_range(threads, p, m, [v], copy, |p, m, [v], copy| {
        update_range(&c, neg_step, p, m, v, copy)
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::reduce::sum_of_squares;
    use crate::test_data::bits;

    /// The module doc's formula in f64 over one parameter, `steps` steps,
    /// step `t`'s gradient `g x (1 + t/10)`.
    fn reference(cfg: &LambConfig, steps: u64, p: &mut [f64], g: &[f64]) -> Vec<f64> {
        let n = p.len();
        let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
        let mut ratios = Vec::new();
        for t in 1..=steps {
            let mut u = vec![0.0; n];
            for i in 0..n {
                let gi = g[i] * (1.0 + 0.1 * t as f64);
                let a = &cfg.adam;
                m[i] = a.beta1 * m[i] + (1.0 - a.beta1) * gi;
                v[i] = a.beta2 * v[i] + (1.0 - a.beta2) * gi * gi;
                let denom = match cfg.eps_inside_sqrt {
                    true => (v[i] + a.eps).sqrt(),
                    false => v[i].sqrt() + a.eps,
                };
                u[i] = m[i] / denom + a.weight_decay * p[i];
            }
            let w2: f64 = p.iter().map(|x| x * x).sum();
            let u2: f64 = u.iter().map(|x| x * x).sum();
            let r = cfg.trust(w2, u2);
            ratios.push(r);
            for i in 0..n {
                p[i] -= cfg.step_size(t) * r * u[i];
            }
        }
        ratios
    }

    fn start(n: usize, scale: f32) -> (Vec<f32>, Vec<f32>) {
        let p = (0..n)
            .map(|i| scale * ((i * 37 % 101) as f32 - 50.0) / 30.0)
            .collect();
        let g = (0..n)
            .map(|i| ((i * 53 % 97) as f32 - 48.5) / 40.0)
            .collect();
        (p, g)
    }

    /// `steps` steps of the three passes over one parameter on `threads`
    /// threads: (p, m, v, the trust ratios).
    fn run(threads: usize, cfg: &LambConfig, n: usize, scale: f32, steps: u64) -> [Vec<f32>; 3] {
        let pool = Threads::new(threads).unwrap();
        let (mut p, g) = start(n, scale);
        let (mut m, mut v, mut u) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        for t in 1..=steps {
            let gs = 1.0 + 0.1 * t as f32;
            lamb_moments(&pool, cfg, gs, &mut p, &g, &mut m, &mut v, &mut u).unwrap();
            let w2 = sum_of_squares(&pool, &p);
            let u2 = sum_of_squares(&pool, &u);
            let step = cfg.step_size(t) * cfg.trust(w2, u2);
            let copy = ComputeCopy::None;
            lamb_update(&pool, cfg, step, &mut p, &m, &mut v, copy).unwrap();
        }
        [p, m, v]
    }

    #[test]
    fn matches_f64_reference_and_clamps_the_trust_ratio() {
        let cfg = LambConfig {
            adam: AdamConfig {
                lr: 1e-2,
                weight_decay: 0.01,
                ..Default::default()
            },
            ..Default::default()
        };
        // Parameters of size ~1 (ratio inside the clamps), ~1000 (clamped
        // to max_coeff) and ~1e-4 (clamped to min_coeff).
        for (scale, clamped) in [(1.0f32, None), (1000.0, Some(10.0)), (1e-4, Some(0.01))] {
            let n = 1000;
            let [p, ..] = run(1, &cfg, n, scale, 5);
            let (p0, g) = start(n, scale);
            let mut rp: Vec<f64> = p0.iter().map(|&x| x as f64).collect();
            let rg: Vec<f64> = g.iter().map(|&x| x as f64).collect();
            let ratios = reference(&cfg, 5, &mut rp, &rg);
            if let Some(c) = clamped {
                assert!(ratios.iter().all(|&r| r == c), "{scale}: {ratios:?}");
            } else {
                assert!(ratios.iter().all(|&r| r > 0.01 && r < 10.0), "{ratios:?}");
            }
            for i in 0..n {
                let tol = 1e-5 * rp[i].abs().max(scale as f64);
                assert!(
                    (p[i] as f64 - rp[i]).abs() <= tol,
                    "{scale} p[{i}]: {} vs {}",
                    p[i],
                    rp[i]
                );
            }
        }
        // eps inside the square root, no bias correction.
        let inside = LambConfig {
            adam: AdamConfig {
                eps: 1e-4,
                bias_correction: false,
                ..cfg.adam
            },
            eps_inside_sqrt: true,
            ..cfg
        };
        let [p, ..] = run(1, &inside, 500, 1.0, 3);
        let (p0, g) = start(500, 1.0);
        let mut rp: Vec<f64> = p0.iter().map(|&x| x as f64).collect();
        let rg: Vec<f64> = g.iter().map(|&x| x as f64).collect();
        reference(&inside, 3, &mut rp, &rg);
        for i in 0..500 {
            assert!(
                (p[i] as f64 - rp[i]).abs() <= 1e-5 * rp[i].abs().max(1.0),
                "p[{i}]"
            );
        }
    }

    #[test]
    fn the_update_pass_applies_pass_ones_direction_to_the_bit() {
        // Computed again from p and the moments, the direction is pass
        // one's, so the fused pass equals applying the kept `u`.
        let pool = Threads::new(2).unwrap();
        for cfg in [
            LambConfig {
                adam: AdamConfig {
                    weight_decay: 0.01,
                    ..Default::default()
                },
                ..Default::default()
            },
            LambConfig {
                adam: AdamConfig {
                    eps: 1e-3,
                    ..Default::default()
                },
                eps_inside_sqrt: true,
                ..Default::default()
            },
        ] {
            let (mut p, g) = start(70_001, 1.0);
            let n = p.len();
            let (mut m, mut v, mut u) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            for t in 0..3 {
                let gs = 1.0 + t as f32;
                lamb_moments(&pool, &cfg, gs, &mut p, &g, &mut m, &mut v, &mut u).unwrap();
            }
            // `p -= step * u` with the kept `u`, one fused multiply-add.
            let kept: Vec<f32> = (p.iter().zip(&u))
                .map(|(p, u)| u.mul_add(-0.003f64 as f32, *p))
                .collect();
            let v0 = v.clone();
            let mut b2 = vec![bf16::ZERO; n];
            lamb_update(
                &pool,
                &cfg,
                0.003,
                &mut p,
                &m,
                &mut v,
                ComputeCopy::Bf16(&mut b2),
            )
            .unwrap();
            assert_eq!(bits(&p), bits(&kept), "{cfg:?}");
            // The compute copy is the cast of the updated parameters, on
            // every thread's range.
            for i in 0..n {
                let cast = crate::cast::f32_to_bf16_bits(p[i]);
                assert_eq!(b2[i].to_bits(), cast, "{cfg:?} {i}");
            }
            assert_eq!(bits(&v), bits(&v0), "v is read only");
        }
    }

    #[test]
    fn a_zero_norm_gives_a_ratio_of_one() {
        let cfg = LambConfig::default();
        assert_eq!(cfg.trust(0.0, 4.0), 1.0);
        assert_eq!(cfg.trust(4.0, 0.0), 1.0);
        assert_eq!(cfg.trust(4.0, 1.0), 2.0);
        assert_eq!(cfg.trust(1e6, 1.0), 10.0);
        assert_eq!(cfg.trust(1.0, 1e6), 0.01);
        assert!(cfg.trust(f64::NAN, 1.0).is_nan());
    }

    #[test]
    fn threads_and_dispatch_levels_do_not_change_a_bit() {
        let cfg = LambConfig {
            adam: AdamConfig {
                lr: 3e-3,
                weight_decay: 0.01,
                ..Default::default()
            },
            ..Default::default()
        };
        let n = 100_003;
        let one = run(1, &cfg, n, 1.0, 3);
        let three = run(3, &cfg, n, 1.0, 3);
        for k in 0..3 {
            assert_eq!(bits(&one[k]), bits(&three[k]), "array {k}");
        }
        let c = Coef {
            scale: 0.7,
            beta1: 0.9,
            one_minus_beta1: 0.1,
            beta2: 0.999,
            one_minus_beta2: 0.001,
            eps: 1e-8,
            eps_inside_sqrt: false,
            weight_decay: 0.01,
        };
        let (p0, g) = start(4099, 1.0);
        let m0: Vec<f32> = g.iter().map(|x| -x * 0.3).collect();
        let v0: Vec<f32> = g.iter().map(|x| x * x * 0.5).collect();
        let (mut p1, mut m1, mut v1, mut u1) =
            (p0.clone(), m0.clone(), v0.clone(), vec![0.0; 4099]);
        let (mut p2, mut m2, mut v2, mut u2) = (p0, m0, v0, vec![0.0; 4099]);
        // `*_body` is compiled for baseline x86-64; `*_range` runs the
        // widest level this CPU has.
        moments_body(&c, &mut p1, &g, &mut m1, &mut v1, &mut u1);
        moments_range(&c, &mut p2, &g, &mut m2, &mut v2, &mut u2);
        assert_eq!(
            (bits(&m1), bits(&v1), bits(&u1)),
            (bits(&m2), bits(&v2), bits(&u2))
        );
        let (mut b1, mut b2) = (vec![0u16; 4099], vec![0u16; 4099]);
        update_body(&c, -0.01, &mut p1, &m1, &mut v1, CopyBits::Bf16(&mut b1));
        update_range(&c, -0.01, &mut p2, &m2, &mut v2, CopyBits::Bf16(&mut b2));
        assert_eq!(bits(&p1), bits(&p2));
        assert_eq!(b1, b2);
    }

    #[test]
    fn bad_settings_and_shapes_are_refused() {
        // (The compute copy's cast is checked with the update pass above.)
        let pool = Threads::new(2).unwrap();
        let cfg = LambConfig {
            max_coeff: 0.001,
            ..Default::default()
        };
        let (mut p, g) = start(4, 1.0);
        let (mut m, mut v, mut u) = (vec![0.0; 4], vec![0.0; 4], vec![0.0; 4]);
        let e = lamb_moments(&pool, &cfg, 1.0, &mut p, &g, &mut m, &mut v, &mut u).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid optimizer setting `max_coeff` = 0.001: must be finite and >= min_coeff"
        );
        let e = lamb_moments(
            &pool,
            &LambConfig::default(),
            1.0,
            &mut p,
            &g,
            &mut m,
            &mut v,
            &mut [],
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "slice `u` has 0 elements but `p` has 4: every slice of one shard must have the same length"
        );
    }
}
