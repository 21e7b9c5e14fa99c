//! Attention the fused kernel cannot compute, as `transformers`' eager
//! attention computes it: Gemma 2's soft-capped scores (and
//! VaultGemma's), GPT-OSS's sinks beside them, Doge's dynamic mask
//! ([`weights`]); and, in training without dropout, a block of queries
//! at a time, each block computed again in backward ([`in_blocks`]).
//!
//! Computed whole, autograd keeps the scores, their tanh and the weights
//! for backward, eight bytes a score and head in bf16 (104 of Gemma 2
//! 2B's 148 GiB at 8192 tokens; about 32 GiB a layer of GPT-OSS's 64
//! heads). In blocks, each block of queries runs under
//! [`glue::checkpoint`]: its forward keeps only its inputs (the queries,
//! and the keys, values, sinks and Doge's bias every block shares), and backward
//! computes its scores again, one block at a time. Each block runs the
//! eager operations on its rows, so the values are the eager
//! attention's; the keys' and values' gradients are summed over the
//! blocks, in another order than one product's.
//!
//! This is FlashAttention's memory (the scores of one block at a time)
//! without its kernel: the scores are computed twice.

use tch::{Kind, Tensor};

use crate::packing::in_window_from;
use crate::zero::glue::{self, GlueError};

/// About this many scores (32 MiB in fp32) a block of queries computes.
const BLOCK_SCORES: i64 = 8 << 20;

/// How many queries a block of `rows` rows of `heads` heads over `t`
/// keys takes.
pub(super) fn block_rows(rows: i64, heads: i64, t: i64) -> i64 {
    (BLOCK_SCORES / (rows * heads * t).max(1)).clamp(1, t.max(1))
}

/// The eager attention's weights of queries `q` `[batch, heads, n, hd]`
/// over keys `k` `[batch, heads, t, hd]` (each head's own: repeated for
/// grouped heads), where `visible` `[n, t]` (or broadcast to the
/// scores) says, in `q`'s dtype. `transformers`' operations in its
/// order: the scores times `scale`, plus Doge's `bias`, capped when
/// `cap` is given (`cap * tanh(s / cap)`), masked, their softmax in fp32
/// (beside each head's sink in `sinks` `[heads]`, whose weight is then
/// dropped) cast back.
pub(super) fn weights(
    (q, k): (&Tensor, &Tensor),
    visible: &Tensor,
    (bias, sinks): (Option<&Tensor>, Option<&Tensor>),
    (scale, cap): (f64, Option<f64>),
) -> Tensor {
    let scores = q.matmul(&k.transpose(2, 3)) * scale;
    let scores = match bias {
        Some(bias) => scores + bias,
        None => scores,
    };
    let scores = match cap {
        Some(cap) => (scores / cap).tanh() * cap,
        None => scores,
    };
    let scores = scores.masked_fill(&visible.logical_not(), f64::NEG_INFINITY);
    let weights = match sinks {
        // Each head's sink a last column of every query's scores.
        Some(sinks) => {
            let sinks = (sinks.to_kind(scores.kind()).view([1, -1, 1, 1]))
                .expand_as(&scores.narrow(-1, 0, 1));
            (Tensor::cat(&[scores, sinks], -1).softmax(-1, Kind::Float)).slice(-1, 0, -1, 1)
        }
        None => scores.softmax(-1, Kind::Float),
    };
    weights.to_kind(q.kind())
}

/// Doge's dynamic mask: each key's bias `[batch, heads, 1, keys]`, and
/// how many visible keys of highest bias each query keeps.
pub(super) type Dynamic<'a> = (&'a Tensor, i64);

/// The eager attention of queries `q` at positions `first..first + n`
/// over keys and values `k`, `v` `[batch, heads, t, hd]`, each query
/// seeing itself and the `window - 1` keys before it (of those, the
/// ones Doge's `dynamic` mask keeps): [`weights`] times the values.
pub(super) fn eager(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    (dynamic, sinks): (Option<Dynamic<'_>>, Option<&Tensor>),
    first: i64,
    (scale, cap, window): (f64, Option<f64>, i64),
) -> Tensor {
    let seen = in_window_from((first, q.size()[2]), k.size()[2], window, q.device());
    let seen = match dynamic {
        Some((bias, keep)) => super::doge::kept(bias, &seen, keep),
        None => seen,
    };
    let bias = dynamic.map(|(bias, _)| bias);
    weights((q, k), &seen, (bias, sinks), (scale, cap)).matmul(v)
}

/// [`eager`] over every query of `q` (positions from 0), a block of
/// queries at a time, each under [`glue::checkpoint`]: what backward
/// needs is `q`, `k`, `v`, the sinks and Doge's bias, not the scores.
pub(super) fn in_blocks(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    (dynamic, sinks): (Option<Dynamic<'_>>, Option<&Tensor>),
    settings: (f64, Option<f64>, i64),
) -> Result<Tensor, GlueError> {
    let size = q.size();
    let (rows, heads, t) = (size[0], size[1], size[2]);
    let block = block_rows(rows, heads, t);
    let keep = dynamic.map(|(_, keep)| keep);
    let mut parts = Vec::new();
    for first in (0..t).step_by(block as usize) {
        let n = block.min(t - first);
        let qi = q.narrow(2, first, n);
        // The sinks, then the bias, after the queries, keys and values.
        let shared = sinks.into_iter().chain(dynamic.map(|(bias, _)| bias));
        let inputs: Vec<&Tensor> = [&qi, k, v].into_iter().chain(shared).collect();
        let with_sinks = sinks.is_some();
        let part = glue::checkpoint(&inputs, move |x| {
            let sinks = x.get(3).filter(|_| with_sinks);
            let dynamic = keep.and_then(|keep| Some((x.last()?, keep)));
            Ok(eager(
                (&x[0], &x[1], &x[2]),
                (dynamic, sinks),
                first,
                settings,
            ))
        })?;
        parts.push(part);
    }
    Ok(match parts.len() {
        1 => parts.swap_remove(0),
        _ => Tensor::cat(&parts, 2),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// `q`, `k`, `v` `[2, 3, t, 8]` that need gradients, from seed 3.
    fn qkv(t: i64) -> [Tensor; 3] {
        tch::manual_seed(3);
        let x = || Tensor::randn([2, 3, t, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        [x(), x(), x()]
    }

    /// How a case's scores are shaped besides the window.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Extra {
        /// Soft-capped (Gemma 2).
        Cap,
        /// Beside sinks (GPT-OSS).
        Sinks,
        /// Doge's bias on each key, keeping each query's 50 keys of
        /// highest bias (all of them at 7 keys).
        Dynamic,
    }

    #[test]
    fn blocks_give_the_eager_attention_and_its_gradients() {
        let opts = (Kind::Float, Device::Cpu);
        let sinks = (Tensor::arange(3, opts) - 1.0).set_requires_grad(true);
        // 3000 keys: blocks of 466 queries, the last one short.
        let cases = [(7, 100), (7, 3), (3000, 3000), (3000, 700)];
        let extras = [Extra::Cap, Extra::Sinks, Extra::Dynamic];
        for ((t, window), extra) in cases.into_iter().flat_map(|c| extras.map(|e| (c, e))) {
            let [q, k, v] = qkv(t);
            let bias = Tensor::randn([2, 3, 1, t], opts).set_requires_grad(true);
            let seed = Tensor::randn([2, 3, t, 8], opts);
            let s = (extra == Extra::Sinks).then_some(&sinks);
            let b = (extra == Extra::Dynamic).then_some(&bias);
            let dynamic = b.map(|b| (b, 50));
            let run = |out: Tensor| {
                let wrt: Vec<&Tensor> = [&q, &k, &v].into_iter().chain(s).chain(b).collect();
                let loss = (out.shallow_clone() * &seed).sum(Kind::Float);
                (
                    out.detach(),
                    Tensor::run_backward(&[loss], &wrt, false, false),
                )
            };
            let settings = match extra {
                Extra::Cap => (0.35, Some(5.0), window),
                _ => (0.35, None, window),
            };
            let (want, wg) = run(eager((&q, &k, &v), (dynamic, s), 0, settings));
            let (got, gg) = run(in_blocks((&q, &k, &v), (dynamic, s), settings).unwrap());
            // Inside a checkpointed layer: its blocks' checkpoints are
            // made, and run, in the layer's recompute.
            let inputs: Vec<&Tensor> = [&q, &k, &v].into_iter().chain(s).chain(b).collect();
            let (nested, ng) = run(glue::checkpoint(&inputs, move |x| {
                let sinks = (extra == Extra::Sinks).then(|| &x[3]);
                let dynamic = (extra == Extra::Dynamic).then(|| (&x[3], 50));
                in_blocks((&x[0], &x[1], &x[2]), (dynamic, sinks), settings)
                    .map_err(|e| e.to_string())
            })
            .unwrap());
            let case = format!("t {t} window {window} {extra:?}");
            // Row by row the same operations.
            assert!(got.equal(&want), "{case}");
            assert!(nested.equal(&want), "{case}");
            assert_eq!(wg.len(), 3 + (extra != Extra::Cap) as usize);
            for (a, (b, c)) in wg.iter().zip(gg.iter().zip(&ng)) {
                let bound = 1e-5 * a.abs().max().double_value(&[]);
                for (how, b) in [("blocks", b), ("nested", c)] {
                    let d = (a - b).abs().max().double_value(&[]);
                    assert!(d <= bound, "{how}, {case}: {d}");
                }
            }
        }
    }
}
