//! Bamba's z-loss (`z_loss_coefficient`): `BambaForCausalLM` adds, given
//! labels, the coefficient times the mean over every position of the
//! square of the logits' log-sum-exp, which keeps the logits from
//! drifting large (PaLM's auxiliary loss). Unlike the router's balance
//! ([`super::balance`]), it is a function of the logits alone, so its
//! gradient flows through the graph as any loss's: the forward keeps the
//! term, and the loss methods add it.

use tch::{Kind, Tensor};

use crate::kv_cache::Decoding;

/// Keeps the term of a forward's `logits` (`[.., vocab]`) for the next
/// loss when `coef` is above 0 and no generation is running (no loss is
/// taken then); keeps none otherwise.
pub(crate) fn record(decoding: &Decoding, logits: &Tensor, coef: f64) {
    let term = (coef > 0.0 && !decoding.generating()).then(|| {
        // As `transformers` does: the log-sum-exp in the logits' dtype,
        // then fp32 (the loss's) before the square and the mean.
        let lse = logits.logsumexp([-1], false).to_kind(Kind::Float);
        lse.square().mean(Kind::Float) * coef
    });
    decoding.set_z_loss(term);
}

/// `loss` plus the last forward's term, which it takes (a second call
/// adds nothing); `loss` itself when that forward kept none.
pub(crate) fn plus(loss: Tensor, decoding: &Decoding) -> Tensor {
    match decoding.take_z_loss() {
        Some(term) => {
            let term = term.to_kind(loss.kind()).to_device(loss.device());
            loss + term
        }
        None => loss,
    }
}
