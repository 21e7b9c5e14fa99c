//! Muon's element-wise halves over one rank's flat fp32 shard.
//!
//! Muon ("MomentUm Orthogonalized by Newton-Schulz", Keller Jordan 2024;
//! `torch.optim.Muon`) keeps one momentum buffer per 2-D weight, and
//! replaces each weight's update with the orthogonalized momentum: a
//! Newton-Schulz iteration over the *whole matrix*, which no shard of it
//! can run alone. So the step comes in three parts, and this module holds
//! the two that work element by element (the engine gathers each matrix
//! between them and runs the iteration through libtorch):
//!
//! ```text
//! g = grad * grad_scale                  (1/loss_scale x clip coefficient)
//! m = m.lerp(g, 1 - momentum)            muon_momentum
//! u = nesterov ? g.lerp(m, momentum) : m   (in g's place)
//!        ... O = NS(u of the whole matrix), in the engine ...
//! p = p * (1 - lr * weight_decay)        muon_apply
//! p = p - adjusted_lr * O
//! ```
//!
//! Rounding as libtorch's CPU kernels, which `torch.optim.Muon` calls:
//! `lerp` is one fused multiply-add whose form depends on the weight
//! (`w (end - start) + start` below 0.5, `(w - 1)(end - start) + end` at
//! or above, as in [`rmsprop`](crate::rmsprop)); the decay is a product,
//! the update (`add_(O, alpha)`) one fused multiply-add.

use crate::adam::ComputeCopy;
use crate::error::{non_negative, same_len};
use crate::walk::CopyBits;
use crate::KernelError;

/// Muon's momentum settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MuonConfig {
    /// The momentum (`torch.optim.Muon`'s 0.95).
    pub momentum: f64,
    /// Nesterov's variant: the update is the gradient moved toward the new
    /// buffer, not the buffer (torch's default).
    pub nesterov: bool,
}

/// `lerp`'s weight as libtorch computes with it: the weight below 0.5,
/// else the weight less 1 (the other formula).
fn lerp_weight(w: f64) -> f32 {
    let w = w as f32;
    match w.abs() < 0.5 {
        true => w,
        false => w - 1.0,
    }
}

/// `start.lerp(end, w)` as libtorch computes it, `w` from [`lerp_weight`].
#[inline(always)]
fn lerp(w: f32, start: f32, end: f32) -> f32 {
    let base = if w >= 0.0 { start } else { end };
    w.mul_add(end - start, base)
}

/// Muon's first half, in place: the momentum buffer `m` takes the scaled
/// gradient (`m.lerp_(g, 1 - momentum)`), and `g` is replaced by what the
/// orthogonalization is to run on: with Nesterov the gradient moved
/// toward the new buffer (`g.lerp(m, momentum)`), else the buffer. (The
/// engine's gradient is spent once read, and holds no second copy.) `g`
/// and `m` have one length.
pub fn muon_momentum(
    cfg: &MuonConfig,
    grad_scale: f32,
    g: &mut [f32],
    m: &mut [f32],
) -> Result<(), KernelError> {
    non_negative(&[("momentum", cfg.momentum)])?;
    let n = g.len();
    same_len("m", m.len(), "g", n)?;
    let (take, toward) = (lerp_weight(1.0 - cfg.momentum), lerp_weight(cfg.momentum));
    for i in 0..n {
        let gi = g[i] * grad_scale;
        let mi = lerp(take, m[i], gi);
        m[i] = mi;
        g[i] = match cfg.nesterov {
            true => lerp(toward, gi, mi),
            false => mi,
        };
    }
    Ok(())
}

/// Muon's second half: decoupled weight decay (`p *= 1 - lr *
/// weight_decay`), then `p -= adjusted_lr * o`, `o` being this shard's
/// part of the orthogonalized update; with a [`ComputeCopy`] destination
/// the new parameters are written there too. `adjusted_lr` is the rate
/// with Muon's shape adjustment (the engine's).
pub fn muon_apply(
    lr: f64,
    weight_decay: f64,
    adjusted_lr: f64,
    p: &mut [f32],
    o: &[f32],
    copy: ComputeCopy<'_>,
) -> Result<(), KernelError> {
    non_negative(&[
        ("lr", lr),
        ("weight_decay", weight_decay),
        ("adjusted_lr", adjusted_lr),
    ])?;
    let n = p.len();
    same_len("o", o.len(), "p", n)?;
    let mut copy = CopyBits::of(copy, n)?;
    let (decay, neg) = ((1.0 - lr * weight_decay) as f32, -adjusted_lr as f32);
    for i in 0..n {
        p[i] = neg.mul_add(o[i], p[i] * decay);
    }
    copy.write(0, p);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// `start.lerp(end, w)` in f64, rounded once: what either of
    /// libtorch's formulas approximates.
    fn lerp64(start: f32, end: f32, w: f64) -> f64 {
        start as f64 + w * (end as f64 - start as f64)
    }

    #[test]
    fn momentum_follows_torchs_lerps() {
        let g: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.013)
            .collect();
        let m0: Vec<f32> = (0..64)
            .map(|i| ((i * 11 % 17) as f32 - 8.0) * 0.007)
            .collect();
        for nesterov in [true, false] {
            let cfg = MuonConfig {
                momentum: 0.95,
                nesterov,
            };
            let (mut m, mut u) = (m0.clone(), g.clone());
            muon_momentum(&cfg, 0.5, &mut u, &mut m).unwrap();
            for i in 0..64 {
                let gi = g[i] * 0.5;
                // The buffer: 0.05 < 0.5, the first formula, one fma.
                let want = 0.05f32.mul_add(gi - m0[i], m0[i]);
                assert_eq!(m[i].to_bits(), want.to_bits(), "m[{i}]");
                assert!((m[i] as f64 - lerp64(m0[i], gi, 0.05)).abs() <= 1e-8);
                let want_u = match nesterov {
                    // 0.95 >= 0.5: the second formula, from the end.
                    true => (0.95f32 - 1.0).mul_add(m[i] - gi, m[i]),
                    false => m[i],
                };
                assert_eq!(u[i].to_bits(), want_u.to_bits(), "u[{i}]");
                if nesterov {
                    assert!((u[i] as f64 - lerp64(gi, m[i], 0.95)).abs() <= 1e-8);
                }
            }
        }
    }

    #[test]
    fn apply_decays_then_adds_the_update_and_writes_the_copy() {
        let p0: Vec<f32> = (0..40).map(|i| (i as f32 - 20.0) * 0.031).collect();
        let o: Vec<f32> = (0..40)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.05)
            .collect();
        let mut p = p0.clone();
        let mut c = vec![bf16::ZERO; 40];
        muon_apply(0.02, 0.1, 0.03, &mut p, &o, ComputeCopy::Bf16(&mut c)).unwrap();
        for i in 0..40 {
            let want = (-0.03f32).mul_add(o[i], p0[i] * (1.0 - 0.02 * 0.1) as f32);
            assert_eq!(p[i].to_bits(), want.to_bits(), "p[{i}]");
            assert_eq!(c[i], bf16::from_f32(p[i]));
        }
    }

    #[test]
    fn refuses_bad_lengths_and_settings() {
        let cfg = MuonConfig {
            momentum: 0.9,
            nesterov: true,
        };
        let (mut g, mut m) = (vec![0f32; 4], vec![0f32; 3]);
        let e = muon_momentum(&cfg, 1.0, &mut g, &mut m).unwrap_err();
        assert!(e.to_string().contains("`m`"), "{e}");
        let bad = MuonConfig {
            momentum: -0.5,
            ..cfg
        };
        let mut m = vec![0f32; 4];
        let e = muon_momentum(&bad, 1.0, &mut g, &mut m).unwrap_err();
        assert!(e.to_string().contains("momentum"), "{e}");
        let mut p = vec![0f32; 4];
        let e = muon_apply(0.1, 0.0, 0.1, &mut p, &[0.0; 5], ComputeCopy::None).unwrap_err();
        assert!(e.to_string().contains("`o`"), "{e}");
        let e = muon_apply(f64::NAN, 0.0, 0.1, &mut p, &[0.0; 4], ComputeCopy::None).unwrap_err();
        assert!(e.to_string().contains("lr"), "{e}");
    }
}
