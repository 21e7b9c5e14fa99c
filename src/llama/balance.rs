//! The router's load-balancing loss (`output_router_logits`): the Switch
//! Transformer's auxiliary loss, as `transformers`'
//! `load_balancing_loss_func` computes it over every layer with experts
//! and its `ForCausalLM` classes add it, times `router_aux_loss_coef`, to
//! the language model's loss.
//!
//! With `n` the tokens of every such layer together (layers times the
//! batch's tokens), `C_e` how often expert `e` was among a token's top
//! `k`, and `S_e` the sum of its routing probabilities, the loss is
//! `E * sum_e C_e * S_e / n^2`. Its gradient reaches the probabilities
//! only (the choices are counts): `coef * E * C_e / n^2` for each token's
//! probability of `e` in every layer, a vector known only once the last
//! layer has chosen. Each layer therefore hands its summed probabilities
//! to [`zero::glue::deferred`](crate::zero::glue::deferred), which gives
//! them that vector in backward, scaled by the seed gradient
//! [`zero::glue::probe`](crate::zero::glue::probe) reads off the loss. The
//! layer keeps one input and one output, so activation checkpointing
//! recomputes it as any other (the recompute records nothing twice).

use std::sync::Arc;

use parking_lot::Mutex;
use tch::{Kind, Tensor};

use crate::kv_cache::Decoding;

/// One forward's balance: what its layers with experts recorded, and
/// the tensors its backward reads.
#[derive(Debug)]
pub(crate) struct Tally {
    experts: i64,
    coef: f64,
    seen: Mutex<Seen>,
    /// The loss's gradient in each layer's summed probabilities
    /// (`[experts]`, fp32), filled by [`Tally::finish`]. (Behind locks:
    /// a tensor is not `Sync`, and the checkpoints' replays that hold a
    /// tally must be.)
    w: Mutex<Tensor>,
    /// The seed gradient (`[1]`, f64): 0 while no loss holds the term
    /// (its layers' probabilities then get none), NaN once one does and
    /// until its backward starts, then the seed.
    scale: Mutex<Tensor>,
}

/// What the layers recorded: choices and summed probabilities per
/// expert (f64), and the tokens routed.
#[derive(Debug, Default)]
struct Seen {
    counts: Option<Tensor>,
    sums: Option<Tensor>,
    tokens: i64,
}

impl Tally {
    /// A forward's, of a model with `experts` experts a layer and the
    /// loss's coefficient `coef`.
    pub(crate) fn new(experts: i64, coef: f64) -> Arc<Self> {
        let cpu = tch::Device::Cpu;
        Arc::new(Self {
            experts,
            coef,
            seen: Mutex::new(Seen::default()),
            w: Mutex::new(Tensor::zeros([experts], (Kind::Float, cpu))),
            scale: Mutex::new(Tensor::zeros([1], (Kind::Double, cpu))),
        })
    }

    /// Records a layer's routing: `probs` (`[tokens, experts]`, the
    /// router's softmax) and the experts `chosen` (`[tokens, k]`).
    fn record(&self, probs: &Tensor, chosen: &Tensor) {
        tch::no_grad(|| {
            let counts = (chosen.reshape([-1]))
                .bincount::<Tensor>(None, self.experts)
                .to_kind(Kind::Double);
            let sums = probs.sum_dim_intlist(0, false, Kind::Double);
            let mut seen = self.seen.lock();
            let add = |held: &mut Option<Tensor>, more: Tensor| {
                *held = Some(match held.take() {
                    Some(h) => h + more,
                    None => more,
                });
            };
            add(&mut seen.counts, counts);
            add(&mut seen.sums, sums);
            seen.tokens += probs.size().first().copied().unwrap_or(0);
        });
    }

    /// The loss's term (the coefficient times the balance), its gradient
    /// in the probabilities written for backward; `None` when no layer
    /// routed a token.
    fn finish(&self) -> Option<f64> {
        let seen = self.seen.lock();
        let (Some(counts), Some(sums)) = (&seen.counts, &seen.sums) else {
            return None;
        };
        if seen.tokens == 0 {
            return None;
        }
        let n2 = (seen.tokens as f64).powi(2);
        let e = self.experts as f64;
        tch::no_grad(|| {
            let aux = (counts * sums).sum(Kind::Double).double_value(&[]) * e / n2;
            let w = counts.to_device(tch::Device::Cpu) * (self.coef * e / n2);
            self.w.lock().copy_(&w);
            Some(self.coef * aux)
        })
    }
}

/// Starts a forward's tally when the model's config has the router's
/// load-balancing loss (`balance`, its coefficient, with `experts`
/// experts a layer): its layers with experts record into it. Otherwise,
/// and while generating with a cache (no loss is taken then), the
/// forward keeps none.
pub(crate) fn start(decoding: &Decoding, balance: Option<(f64, i64)>, generating: bool) {
    let tally = match (balance, generating) {
        (Some((coef, experts)), false) => Some((Tally::new(experts, coef), true)),
        _ => None,
    };
    decoding.set_tally(tally);
}

/// `out`, a layer's experts' output for the routing `probs` (`[tokens,
/// experts]`) and the experts the balance counts, `chosen` (`[tokens,
/// k]`: the top `k` of `probs`, which the router may not have chosen), recorded in
/// the forward's tally when it records (not in a checkpointed layer's
/// recompute), and, when the probabilities need a gradient, carrying
/// the balance's gradient to them (see the module's doc). `out` itself
/// when the forward keeps no tally.
pub(crate) fn balanced(
    out: Tensor,
    probs: &Tensor,
    chosen: &Tensor,
    decoding: &Decoding,
) -> Tensor {
    let Some((tally, recording)) = decoding.tally() else {
        return out;
    };
    if recording {
        tally.record(probs, chosen);
    }
    if !probs.requires_grad() {
        return out;
    }
    let s = probs.sum_dim_intlist(0, false, Kind::Float);
    let (w, scale) = (
        tally.w.lock().shallow_clone(),
        tally.scale.lock().shallow_clone(),
    );
    match crate::zero::glue::deferred(&out, &s, &w, &scale) {
        Ok(y) => y,
        // libtorch failing to make a view: as tch's own modules do.
        Err(e) => panic!("the router's load-balancing gradient: {e}"),
    }
}

/// `loss` plus the last forward's balance term, which it takes (a
/// second call adds nothing): with its gradient, through
/// [`zero::glue::probe`](crate::zero::glue::probe), when `loss` needs
/// one. `loss` itself when the forward kept no tally or routed nothing.
pub(crate) fn plus(loss: Tensor, decoding: &Decoding) -> Tensor {
    let Some(tally) = decoding.take_tally() else {
        return loss;
    };
    let Some(term) = tally.finish() else {
        return loss;
    };
    let value = Tensor::from(term)
        .to_kind(loss.kind())
        .to_device(loss.device());
    if !loss.requires_grad() {
        return loss + value;
    }
    let scale = tally.scale.lock().shallow_clone();
    let _ = scale.shallow_clone().fill_(f64::NAN);
    match crate::zero::glue::probe(&value, &scale) {
        Ok(p) => loss + p,
        Err(e) => panic!("the router's load-balancing loss: {e}"),
    }
}
