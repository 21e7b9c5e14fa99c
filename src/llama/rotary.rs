//! Rotary position embeddings: each scaling kind's inverse
//! frequencies, and turning queries and keys by them.

use tch::{Kind, Tensor};

use crate::packing::Documents;

use super::rope_scaling::RopeScaling;

/// A layer's rotary embedding: its inverse frequencies, and under
/// LongRoPE those for a sequence longer than the pretrained one and the
/// factor on the cosines and sines.
#[derive(Debug)]
pub(crate) struct Rotary {
    inv_freq: Tensor,
    /// LongRoPE's `long_factor` frequencies, and the longest sequence
    /// `inv_freq` is for.
    long: Option<(Tensor, i64)>,
    /// The cosines' and sines' factor (LongRoPE's and YaRN's
    /// `attention_factor`, PhiMoE's `short_mscale`), and past LongRoPE's
    /// pretrained length (PhiMoE's `long_mscale`).
    scale: (f64, f64),
    /// LongRoPE's frequencies and factor chosen by the row's length, as
    /// PhiMoE's rotary embedding chooses them, not by the longest packed
    /// document's (Phi-3's).
    by_row: bool,
    /// Under the `dynamic` scaling, the frequencies of the longest
    /// sequence seen.
    dynamic: Option<Dynamic>,
    /// Neighbouring dimensions turn together (`x[2i]`, `x[2i + 1]`)
    /// rather than the halves of the head; `Some(true)`: in fp32
    /// (Cohere's; DeepSeek-V2's, ERNIE 4.5's and Llama 4's, whose
    /// unrounded complex angles this rounds to the input's dtype first),
    /// `Some(false)`: in the input's dtype (GLM's, Helium's).
    interleaved: Option<bool>,
    /// OLMo's: the halves turned in fp32 by unrounded cosines and sines,
    /// then cast back (its rotary embedding hands them over in fp32).
    fp32: bool,
}

/// The `dynamic` scaling's state, `transformers`' own (its rotary
/// embedding's `max_seq_len_cached`): a sequence longer than the longest
/// seen past `positions` computes its frequencies, which the sequences
/// after it use until one shorter than `positions` comes. Each layer
/// keeps its own; every layer sees the same lengths, so they agree.
#[derive(Debug)]
struct Dynamic {
    factor: f64,
    positions: i64,
    hd: i64,
    theta: f64,
    /// The longest length seen since the last reset and its frequencies
    /// (`None`: the unscaled ones, for up to `positions` tokens).
    seen: parking_lot::Mutex<(i64, Option<Tensor>)>,
}

impl Dynamic {
    /// The inverse frequencies for a sequence of `t` tokens, the
    /// unscaled ones being `unscaled`.
    fn inv_freq(&self, t: i64, unscaled: &Tensor) -> Tensor {
        let mut seen = self.seen.lock();
        if t > seen.0 {
            *seen = (t, Some(self.grown(t, unscaled.device())));
        }
        if t < self.positions && seen.0 > self.positions {
            *seen = (self.positions, None);
        }
        seen.1.as_ref().unwrap_or(unscaled).shallow_clone()
    }

    /// The frequencies for `t` tokens past `positions`, operation for
    /// operation as `transformers` computes them from a length held in a
    /// tensor (the base in fp32, not in Python's doubles).
    fn grown(&self, t: i64, device: tch::Device) -> Tensor {
        let (f, d) = (self.factor, self.hd as f64);
        let n = Tensor::from_slice(&[t]).to_device(device).squeeze();
        let base = ((n * f) / self.positions as f64 - (f - 1.0)).pow_tensor_scalar(d / (d - 2.0))
            * self.theta;
        let exponents = Tensor::arange_start_step(0, self.hd, 2, (Kind::Int64, device))
            .to_kind(Kind::Float)
            / d;
        base.pow(&exponents).reciprocal()
    }
}

impl Rotary {
    /// Turning `hd` dimensions at base `theta`, scaled as `scaling` says
    /// (`positions`, `max_position_embeddings`, is what the `dynamic`
    /// scaling grows past).
    pub(crate) fn new(
        hd: i64,
        theta: f64,
        scaling: &RopeScaling,
        positions: i64,
        device: tch::Device,
    ) -> Self {
        let powers = base_powers(hd, theta, device);
        let long = match scaling {
            RopeScaling::LongRope {
                long,
                original_positions,
                ..
            } => Some((divided(&powers, long), *original_positions)),
            _ => None,
        };
        let scale = match scaling {
            RopeScaling::LongRope {
                mscales: Some(m), ..
            } => *m,
            RopeScaling::LongRope {
                attention_factor, ..
            }
            | RopeScaling::Yarn {
                attention_factor, ..
            } => (*attention_factor, *attention_factor),
            _ => (1.0, 1.0),
        };
        let dynamic = match scaling {
            RopeScaling::Dynamic { factor } | RopeScaling::DynamicAlpha { factor, .. } => {
                Some(Dynamic {
                    factor: *factor,
                    positions,
                    hd,
                    theta,
                    seen: parking_lot::Mutex::new((positions, None)),
                })
            }
            _ => None,
        };
        Self {
            inv_freq: inv_freq(&powers, hd, theta, scaling, positions),
            long,
            scale,
            dynamic,
            interleaved: None,
            fp32: false,
            by_row: matches!(
                scaling,
                RopeScaling::LongRope {
                    mscales: Some(_),
                    ..
                }
            ),
        }
    }

    /// As it is, turning the halves in fp32 (OLMo's).
    pub(super) fn in_fp32(self) -> Self {
        Self { fp32: true, ..self }
    }

    /// As it is, turning neighbouring pairs of dimensions: in fp32
    /// (Cohere's), or in the input's dtype (GLM's).
    pub(super) fn interleaved(self, fp32: bool) -> Self {
        Self {
            interleaved: Some(fp32),
            ..self
        }
    }

    /// Up to which sequence length its frequencies stay the same
    /// (`None`: at every length): LongRoPE's short factors serve up to
    /// `original_max_position_embeddings`, the `dynamic` scaling leaves
    /// the base as it is up to `max_position_embeddings` (a sequence
    /// shorter than it resets a base grown before).
    pub(crate) fn fixed_up_to(&self) -> Option<i64> {
        match (&self.long, &self.dynamic) {
            (Some((_, original)), _) => Some(*original),
            (_, Some(dynamic)) => Some(dynamic.positions),
            _ => None,
        }
    }

    /// The cosines' and sines' factor for a sequence of `t` tokens.
    fn scale(&self, t: i64) -> f64 {
        match &self.long {
            Some((_, original)) if t > *original => self.scale.1,
            _ => self.scale.0,
        }
    }

    /// The inverse frequencies for a sequence of `t` tokens.
    fn inv_freq(&self, t: i64) -> Tensor {
        match (&self.long, &self.dynamic) {
            (Some((long, original)), _) if t > *original => long.shallow_clone(),
            (_, Some(dynamic)) => dynamic.inv_freq(t, &self.inv_freq),
            _ => self.inv_freq.shallow_clone(),
        }
    }
}

/// `theta^(2i/hd)` for each pair `i` a head of `hd` rotated dimensions
/// turns, `[hd / 2]` in fp32, as `transformers` computes it (each
/// operation in its order, so that the angles are its to the bit).
fn base_powers(hd: i64, theta: f64, device: tch::Device) -> Tensor {
    let exponents =
        Tensor::arange_start_step(0, hd, 2, (Kind::Int64, device)).to_kind(Kind::Float) / hd as f64;
    Tensor::pow_scalar(theta, &exponents)
}

/// LongRoPE's inverse frequencies: `1 / (factors * powers)`.
fn divided(powers: &Tensor, factors: &[f64]) -> Tensor {
    let factors = Tensor::from_slice(factors)
        .to_kind(Kind::Float)
        .to_device(powers.device());
    (factors * powers).reciprocal()
}

/// The rotary embedding's inverse frequencies, `[hd / 2]` in fp32 (`hd`
/// the dimensions it turns, `powers` their [`base_powers`] at `theta`),
/// computed as `transformers` computes them: `theta^(-2i/hd)`, scaled as
/// `scaling` says (LongRoPE's for a sequence up to the pretrained
/// length).
fn inv_freq(powers: &Tensor, hd: i64, theta: f64, scaling: &RopeScaling, positions: i64) -> Tensor {
    match scaling {
        RopeScaling::None => powers.reciprocal(),
        RopeScaling::Linear { factor } => powers.reciprocal() / *factor,
        // Up to `max_position_embeddings` `m` tokens: the base grown by
        // `factor * m / m - (factor - 1)` in Python's doubles, as
        // `transformers` initialises it (1, or an ulp from it).
        RopeScaling::Dynamic { factor } => {
            let m = positions as f64;
            let grown = (factor * m / m - (factor - 1.0)).powf(hd as f64 / (hd as f64 - 2.0));
            base_powers(hd, theta * grown, powers.device()).reciprocal()
        }
        // Hunyuan's: the base raised by its alpha, in Python's doubles.
        RopeScaling::DynamicAlpha { alpha, .. } => {
            let d = hd as f64;
            base_powers(hd, theta * alpha.powf(d / (d - 2.0)), powers.device()).reciprocal()
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_positions: old,
        } => {
            let (factor, low, high, old) = (*factor, *low, *high, *old);
            let inv = powers.reciprocal();
            let wavelen = inv.reciprocal() * (2.0 * std::f64::consts::PI);
            let long = wavelen.gt(old / low);
            let scaled = (&inv / factor).where_self(&long, &inv);
            let smooth = (wavelen.reciprocal() * old - low) / (high - low);
            let smoothed = (smooth.neg() + 1.0) * &scaled / factor + &smooth * &scaled;
            let short = wavelen.lt(old / high);
            let medium = short.logical_not().logical_and(&long.logical_not());
            smoothed.where_self(&medium, &scaled)
        }
        RopeScaling::LongRope { short, .. } => divided(powers, short),
        RopeScaling::Yarn {
            factor,
            original_positions,
            beta_fast,
            beta_slow,
            truncate,
            ..
        } => yarn_inv_freq(
            powers,
            hd,
            theta,
            *factor,
            *original_positions,
            (*beta_fast, *beta_slow),
            *truncate,
        ),
    }
}

/// YaRN's inverse frequencies from `powers` ([`base_powers`] of `hd`
/// dimensions at base `theta`), operation for operation as
/// `transformers` computes them: the pairs that turn fewer than
/// `beta_slow` times over `original` positions interpolated (divided by
/// `factor`), those turning more than `beta_fast` times kept, a linear
/// ramp over the dimensions between.
fn yarn_inv_freq(
    powers: &Tensor,
    hd: i64,
    theta: f64,
    factor: f64,
    original: f64,
    (beta_fast, beta_slow): (f64, f64),
    truncate: bool,
) -> Tensor {
    let dim = hd as f64;
    // The dimension at which a frequency turns `rotations` times.
    let at = |rotations: f64| {
        (dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * theta.ln())
    };
    let (low, high) = match truncate {
        true => (at(beta_fast).floor(), at(beta_slow).ceil()),
        false => (at(beta_fast), at(beta_slow)),
    };
    let (low, high) = (low.max(0.0), high.min(dim - 1.0));
    let high = if low == high { high + 0.001 } else { high };
    let ramp = ((Tensor::arange(hd / 2, (Kind::Float, powers.device())) - low) / (high - low))
        .clamp(0.0, 1.0);
    let kept = ramp.neg() + 1.0;
    let interpolated = (powers * factor).reciprocal();
    let extrapolated = powers.reciprocal();
    interpolated * (kept.neg() + 1.0) + extrapolated * kept
}

/// Rotary position embedding of `x` `[batch, heads, seq, head_dim]`:
/// `x * cos + rotate_half(x) * sin`, `rotate_half` turning the second half
/// of each head's dimensions before the first (`transformers`'
/// convention), the angles computed in fp32 from the rotary's inverse
/// frequencies for the sequence's length (and its cosines and sines
/// scaled by its factor, in fp32). Only the first `2 * inv_freq.len()`
/// dimensions turn (all but under Phi-3's `partial_rotary_factor`); the
/// rest pass as they are. `x`'s positions start at `offset` (the tokens
/// a generation's cache holds before it; 0 without one).
pub(crate) fn rope_from(x: &Tensor, rotary: &Rotary, offset: i64) -> Tensor {
    let t = x.size()[2];
    let opts = (Kind::Float, x.device());
    let positions = match offset {
        0 => Tensor::arange(t, opts),
        o => Tensor::arange_start(o, o + t, opts),
    };
    rope(x, rotary, offset + t, &positions)
}

/// As [`rope_from`], each token of `x` `[batch, heads, seq, head_dim]`
/// turned at its position in its packed document (`documents`), the
/// frequencies those of the longest position's length, as `transformers`
/// turns at `position_ids`.
pub(crate) fn rope_at(x: &Tensor, rotary: &Rotary, documents: &Documents) -> Tensor {
    let positions = documents.positions.to_kind(Kind::Float).unsqueeze(1);
    let t = match rotary.by_row {
        true => x.size()[2],
        false => documents.longest,
    };
    rope(x, rotary, t, &positions)
}

/// The rotary embedding of `x` at `positions` (`[seq]`, or `[batch, 1,
/// seq]` for each row its own), fp32, with the inverse frequencies and
/// factor for a sequence of `t` tokens.
fn rope(x: &Tensor, rotary: &Rotary, t: i64, positions: &Tensor) -> Tensor {
    let (inv_freq, scale) = (&rotary.inv_freq(t), rotary.scale(t));
    let hd = x.size()[3];
    let rd = 2 * inv_freq.size()[0];
    let freqs = positions.unsqueeze(-1) * inv_freq;
    if let Some(fp32) = rotary.interleaved {
        return rope_interleaved(x, &freqs, scale, fp32);
    }
    let emb = Tensor::cat(&[&freqs, &freqs], -1);
    let (cos, sin) = match scale {
        1.0 => (emb.cos(), emb.sin()),
        s => (emb.cos() * s, emb.sin() * s),
    };
    let turned = match rd < hd {
        true => x.narrow(-1, 0, rd),
        false => x.shallow_clone(),
    };
    let (cos, sin, turned) = match rotary.fp32 {
        true => (cos, sin, turned.to_kind(Kind::Float)),
        false => (cos.to_kind(x.kind()), sin.to_kind(x.kind()), turned),
    };
    let (x1, x2) = (
        turned.narrow(-1, 0, rd / 2),
        turned.narrow(-1, rd / 2, rd / 2),
    );
    let rotated = Tensor::cat(&[&x2.neg(), &x1], -1);
    with_unturned((turned * cos + rotated * sin).to_kind(x.kind()), x)
}

/// The interleaved rotary embedding of `x` `[batch, heads, seq,
/// head_dim]` at angles `freqs` `[seq, rd / 2]`: each pair `(x[2i],
/// x[2i + 1])` of the first `rd` dimensions turned by angle `i` (the
/// rest pass), the cosines and sines rounded to `x`'s dtype; in fp32 then
/// cast back as `transformers`' Cohere does (`fp32`), or in `x`'s dtype
/// as its GLM does.
fn rope_interleaved(x: &Tensor, freqs: &Tensor, scale: f64, fp32: bool) -> Tensor {
    let emb = freqs.repeat_interleave_self_int(2, Some(-1), None);
    let (cos, sin) = match scale {
        1.0 => (emb.cos(), emb.sin()),
        s => (emb.cos() * s, emb.sin() * s),
    };
    let (hd, rd) = (x.size()[3], 2 * freqs.size()[freqs.dim() - 1]);
    let turned = match rd < hd {
        true => x.narrow(-1, 0, rd),
        false => x.shallow_clone(),
    };
    let (cos, sin, h) = match fp32 {
        true => {
            let rounded = |t: Tensor| t.to_kind(x.kind()).to_kind(Kind::Float);
            (rounded(cos), rounded(sin), turned.to_kind(Kind::Float))
        }
        false => (cos.to_kind(x.kind()), sin.to_kind(x.kind()), turned),
    };
    let (even, odd) = (h.slice(-1, 0, rd, 2), h.slice(-1, 1, rd, 2));
    let rotated = Tensor::stack(&[odd.neg(), even], -1).flatten(-2, -1);
    with_unturned((h * cos + rotated * sin).to_kind(x.kind()), x)
}

/// `turned`, the first dimensions of each head of `x` `[batch, heads,
/// seq, head_dim]` turned, followed by the rest of `x`'s as they are
/// (all of them turned: `turned` itself). Joined token by token
/// (`[batch, seq, heads, _]` transposed), as a projection's heads are
/// and a whole turn leaves them: the attention's output follows its
/// queries' layout, and laid out head by head it would be copied for the
/// output projection, the attention keeping one copy for backward and
/// the projection the other (Phi-4-mini's, GLM's, GPT-J's partial
/// turns).
fn with_unturned(turned: Tensor, x: &Tensor) -> Tensor {
    let (rd, hd) = (turned.size()[3], x.size()[3]);
    match rd < hd {
        true => {
            let rest = x.narrow(-1, rd, hd - rd);
            Tensor::cat(&[&turned.transpose(1, 2), &rest.transpose(1, 2)], -1).transpose(1, 2)
        }
        false => turned,
    }
}
