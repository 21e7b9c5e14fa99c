//! DiffLlama's differential attention ([`Family::DiffLlama`]): each
//! layer's heads pair up, the first half's attention minus `lambda`
//! times the second half's, so that the noise both attend to cancels.
//!
//! As `transformers`' `DiffLlamaAttention` computes it: the values of
//! every head (the keys' groups repeated) are cut into two halves of
//! heads put side by side, `[batch, heads / 2, seq, 2 head_dim]`, and
//! repeated so that each head attends over values twice as wide; head
//! `i`'s output minus `lambda` times head `i + heads / 2`'s is
//! RMS-normalised (no weights) over those `2 head_dim` and scaled by `1 -
//! lambda_init`. `lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 .
//! lambda_k2) + lambda_init`, the four vectors the layer's, `lambda_init =
//! 0.8 - 0.6 exp(-0.3 l)` for layer `l`.

use tch::nn;
use tch::{Kind, Tensor};

use super::norm::rms_normalized;

/// A layer's differential attention: its four `lambda` vectors (each
/// `head_dim` wide) and `lambda_init`.
#[derive(Debug)]
pub(super) struct Differential {
    /// `lambda_q1`, `lambda_k1`, `lambda_q2`, `lambda_k2`.
    lambdas: [Tensor; 4],
    init: f64,
    eps: f64,
}

impl Differential {
    /// Layer `l`'s, under `a` (`self_attn`), for heads `head_dim` wide; its
    /// norm's epsilon `eps`. The vectors start as its class draws them
    /// (normal, deviation 0.1: `lambda_std_dev`'s default; a file's
    /// replace them).
    pub(super) fn new(a: &nn::Path, head_dim: i64, l: i64, eps: f64) -> Self {
        let normal = nn::Init::Randn {
            mean: 0.0,
            stdev: 0.1,
        };
        Self {
            lambdas: ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"]
                .map(|name| a.var(name, &[head_dim], normal)),
            init: 0.8 - 0.6 * (-0.3 * l as f64).exp(),
            eps,
        }
    }

    /// The values `v` `[batch, kv_heads, seq, head_dim]` as the heads
    /// attend over them: every head's (each of the `kv_heads` repeated
    /// for its group), the second half of the heads side by side with the
    /// first, the whole repeated for both halves: `[batch, heads, seq, 2
    /// head_dim]`.
    pub(super) fn values(v: &Tensor, heads: i64) -> Tensor {
        let every = Self::every_head(v, heads);
        let half = heads / 2;
        let wide = Tensor::cat(&[every.narrow(1, 0, half), every.narrow(1, half, half)], -1);
        wide.repeat([1, 2, 1, 1])
    }

    /// The keys (or values) `k` `[batch, kv_heads, seq, head_dim]`, each
    /// repeated for its group of heads: `[batch, heads, seq, head_dim]`.
    pub(super) fn every_head(k: &Tensor, heads: i64) -> Tensor {
        match heads / k.size()[1] {
            1 => k.shallow_clone(),
            g => k.repeat_interleave_self_int(g, 1, None),
        }
    }

    /// The heads' outputs `out` `[batch, heads, seq, 2 head_dim]`
    /// combined: `[batch, heads / 2, seq, 2 head_dim]`.
    pub(super) fn combine(&self, out: &Tensor) -> Tensor {
        let kind = out.kind();
        let half = out.size()[1] / 2;
        // Each product summed in fp32, as its class sums it.
        let exp = |q: &Tensor, k: &Tensor| {
            (q * k)
                .sum_dim_intlist(-1, false, Kind::Float)
                .exp()
                .to_kind(kind)
        };
        let [q1, k1, q2, k2] = &self.lambdas;
        let lambda = exp(q1, k1) - exp(q2, k2) + self.init;
        let diff = out.narrow(1, 0, half) - lambda * out.narrow(1, half, half);
        rms_normalized(&diff, self.eps).to_kind(kind) * (1.0 - self.init)
    }
}
