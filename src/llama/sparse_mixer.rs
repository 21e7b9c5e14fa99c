//! PhiMoE's router, sparsemixer (Liu et al., "GRIN: GRadient-INformed
//! MoE"): each token's two experts chosen one after the other among
//! the router's logits near the best still in play, by a Gumbel draw in
//! training, with a gradient to the logits of its own.
//!
//! `transformers` computes it with a custom autograd function
//! (`MultiplierProcessor`) whose backward is not the forward's
//! derivative; tch has none, so [`heun_weight`] builds a graph whose
//! ordinary backward computes the same numbers, in the same order.

use tch::{Kind, Tensor};

/// Each token's two experts `[tokens, 2]` (`i64`) and their weights
/// `[tokens, 2]` in the logits' dtype, from the router's `logits`
/// `[tokens, experts]`: `transformers`' `sparsemixer` at
/// `router_jitter_noise` `eps`, drawing from libtorch's generator in
/// `training` as it draws (two exponential draws of the logits' shape
/// and three uniform ones a token, in its order).
pub(super) fn route(logits: &Tensor, eps: f64, training: bool) -> (Tensor, Tensor) {
    let (first, w1) = pick(logits, logits, eps, training, Draws::Once);
    // The first expert out of play for the second.
    let rest = logits.scatter_value(-1, &first, f64::NEG_INFINITY);
    let (second, w2) = pick(logits, &rest, eps, training, Draws::Twice);
    (
        Tensor::cat(&[w1, w2], -1),
        Tensor::cat(&[first, second], -1),
    )
}

/// How many uniform draws `transformers` makes for Heun's mask: its
/// second expert's `rand_like(...).uniform_()` draws twice, the second
/// overwriting the first.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Draws {
    Once,
    Twice,
}

/// One expert `[tokens, 1]` and its weight among the logits of `play`
/// (`logits` with the experts already taken at minus infinity): those
/// further below `play`'s best than `2 eps` relative to the larger of
/// the best and each logit's magnitude are masked out; of the rest the
/// best (in training, the best after Gumbel noise) is taken, weighted by
/// its softmax over them (in training, times Heun's 1 or 1/3, with
/// sparsemixer's gradient: [`heun_weight`]).
fn pick(
    logits: &Tensor,
    play: &Tensor,
    eps: f64,
    training: bool,
    draws: Draws,
) -> (Tensor, Tensor) {
    let (out, best) = tch::no_grad(|| {
        let (threshold, best) = play.max_dim(-1, true);
        let factor = logits.abs().clamp_min_tensor(&threshold);
        (((threshold - logits) / factor).gt(2.0 * eps), best)
    });
    let masked = play.masked_fill(&out, f64::NEG_INFINITY);
    let chosen = match training {
        // Gumbel sampling: the best of the logits minus the log of
        // exponential draws.
        true => tch::no_grad(|| {
            let mut e = masked.empty_like();
            let _ = e.exponential_(1.0);
            (&masked - e.log()).max_dim(-1, true).1
        }),
        false => best,
    };
    let gates = masked.softmax(-1, masked.kind());
    let weight = gates.gather(-1, &chosen, false);
    if !training {
        return (chosen, weight);
    }
    // Heun's third-order method: the weight kept whole when the chosen
    // expert is the best or a draw exceeds 0.75, else a third of it.
    let whole = tch::no_grad(|| {
        let (top, top_index) = gates.max_dim(-1, true);
        let mut u = top.rand_like();
        if draws == Draws::Twice {
            let _ = u.uniform_(0.0, 1.0);
        }
        let keep = chosen.eq_tensor(&top_index).logical_or(&u.gt(0.75));
        // `torch.add(0.3333, keep, alpha=0.6667)`: in fp32, then cast.
        (keep.to_kind(Kind::Float) * 0.6667 + 0.3333).to_kind(gates.kind())
    });
    (
        chosen.shallow_clone(),
        heun_weight(logits, &weight, &chosen, &gates, &whole),
    )
}

/// `weight * whole` whose gradient reaches `logits` as sparsemixer's
/// `MultiplierProcessor` sends it: for an output gradient `g`, `G = g *
/// weight`, then `-G * gates` on every logit plus `G` on the chosen one,
/// and nothing through the softmax.
///
/// The value is computed apart and detached; `t - t.detach()` (exactly
/// 0) carries the gradient: `t = weight.detach() * s` gives `s` the
/// gradient `g * weight`, and `s = logits[chosen] - sum(logits *
/// gates.detach())` gives `logits` `G` on the chosen and `-G * gates`
/// everywhere, summed at a view of the logits of its own so that the two
/// meet before this pick's gradient joins the other pick's, as the
/// custom backward's single tensor does.
fn heun_weight(
    logits: &Tensor,
    weight: &Tensor,
    chosen: &Tensor,
    gates: &Tensor,
    whole: &Tensor,
) -> Tensor {
    let value = (weight * whole).detach();
    let own = logits.view_as(logits);
    let s = own.gather(-1, chosen, false)
        - (&own * gates.detach()).sum_dim_intlist(-1, true, None::<Kind>);
    let t = weight.detach() * s;
    value + (&t - t.detach())
}
