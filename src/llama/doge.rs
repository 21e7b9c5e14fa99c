//! Doge ([`Family::Doge`]): its attention's dynamic mask, what zrt
//! refuses of its `config.json`, and the fields it writes back.
//!
//! `DogeAttention` biases every query's score of a key by a value the
//! key's own value vector gives (`exp(A * softplus(dt_proj(v)))`, one a
//! key-value head), and, past `keep_window_size` keys, lets each query
//! see only the `keep_window_size` keys of highest bias. That is its
//! eager attention's; its `sdpa` path (the class's default) passes the
//! bias as the whole mask and so drops the causal one: a token there
//! sees the ones after it. zrt computes the eager, causal model.
//!
//! A fresh Doge's `A` is zero: every key's bias is 1, and past
//! `keep_window_size` keys the top-k chooses among ties (libtorch's
//! choice, which need not be `transformers`'); training moves `A` off
//! zero, and a trained checkpoint's biases differ key by key.

use serde_json::{json, Value};
use tch::nn::{self, Module};
use tch::Tensor;

use crate::hf::{HfError, HfJson};
use crate::lora::Adapted;

use super::config::LlamaConfig;
use super::layer::Lin;

/// `keep_window_size`'s default.
const KEEP_WINDOW: i64 = 2048;

/// `keep_window_size`: how many keys a query keeps once more are
/// visible (those its dynamic mask biases most), refused below 1 or
/// null. A config with experts (`is_moe`) is refused: zrt does not build
/// Doge's product-key experts (`DogeCDMoE`), which `transformers` 4.57
/// cannot run either (its layer drops out the tuple they return).
pub(super) fn keep_window(j: &HfJson) -> Result<i64, HfError> {
    if j.flag_or("is_moe", false)? {
        return Err(j.field(
            "is_moe true: zrt builds Doge's dense MLP only, not its product-key experts (DogeCDMoE); set it to false".into(),
        ));
    }
    // (`size_or_null` refuses one below 1.)
    match j.size_or_null("keep_window_size", Some(KEEP_WINDOW))? {
        Some(keep) => Ok(keep),
        None => Err(j.field(format!(
            "keep_window_size null: each query keeps at least one key; give 1 or more (its default is {KEEP_WINDOW})"
        ))),
    }
}

/// Doge's fields beyond the shared ones in its `config.json`, as
/// `DogeConfig` reads them.
pub(super) fn json(c: &LlamaConfig) -> Value {
    json!({
        "attention_bias": c.o_bias,
        "mlp_bias": c.mlp_bias,
        "sliding_window": c.sliding_window,
        "keep_window_size": c.keep_window,
        "hidden_dropout": c.resid_dropout,
        "is_moe": false,
    })
}

/// One layer's dynamic mask (`self_attn.A`, `self_attn.dt_proj`).
#[derive(Debug)]
pub(super) struct DynamicMask {
    /// `A`: a factor a key-value head (zeros, as its class starts it).
    a: Tensor,
    /// `dt_proj`: every key-value head's values to a logit a head.
    dt_proj: Adapted,
    /// `keep_window_size`.
    keep: i64,
}

impl DynamicMask {
    /// Under `a` (`self_attn`), for `c`'s heads, `keep` keys a query.
    pub(super) fn new(a: &nn::Path, c: &LlamaConfig, keep: i64, lin: &Lin<'_>) -> Self {
        let kv = c.kv_heads;
        Self {
            a: a.zeros("A", &[kv]),
            dt_proj: lin(&(a / "dt_proj"), kv * c.head_dim, kv, c.o_bias),
            keep,
        }
    }

    /// Each key's bias `[batch, heads, 1, keys]` (each key-value head's
    /// repeated for its `heads / kv_heads` query heads) from the values
    /// `v` `[batch, kv_heads, keys, hd]`, in their dtype.
    pub(super) fn bias(&self, v: &Tensor, heads: i64) -> Tensor {
        let s = v.size();
        let (b, kv, t) = (s[0], s[1], s[2]);
        let flat = v.transpose(1, 2).reshape([b, t, -1]);
        let dt = (self.dt_proj.forward(&flat).softplus() * &self.a).exp();
        dt.transpose(1, 2)
            .repeat_interleave_self_int(heads / kv, 1, None)
            .unsqueeze(2)
    }

    /// `keep_window_size`: how many keys a query keeps ([`kept`]).
    pub(super) fn keep(&self) -> i64 {
        self.keep
    }
}

/// `visible` (bool, broadcasting to `[batch, heads, queries, keys]`)
/// narrowed, when there are more than `keep` keys, to each query's
/// `keep` visible keys of highest `bias` (a row's choice its own, so a
/// block of queries chooses as the whole does).
pub(super) fn kept(bias: &Tensor, visible: &Tensor, keep: i64) -> Tensor {
    let keys = bias.size()[3];
    if keys <= keep {
        return visible.shallow_clone();
    }
    let ranked = bias.where_scalarother(visible, f64::NEG_INFINITY);
    let (_, top) = ranked.topk(keep, -1, true, false);
    let chosen = ranked.zeros_like().scatter_value(-1, &top, 1.0).gt(0.5);
    chosen.logical_and(visible)
}
