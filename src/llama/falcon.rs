//! Falcon's layer layouts ([`Family::Falcon`]): which norms a layer
//! has, whether its attention and MLP run side by side and whether its
//! heads take ALiBi's biases (Falcon-RW), read from `FalconConfig`'s
//! flags; the config written back; and Falcon-RW's ALiBi mask.

use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

use crate::hf::{HfError, HfJson};
use crate::packing::Documents;

use super::config::LlamaConfig;
use super::family::Family;

/// How a Falcon layer is laid out (`parallel_attn`,
/// `new_decoder_architecture`, `num_ln_in_parallel_attn`). Its fused
/// query-key-value matrix holds, for each group of heads sharing keys
/// and values, the group's queries, then its key, then its value: with
/// `multi_query` one group (Falcon 7B), with the new architecture
/// `num_kv_heads` (Falcon 40B and 180B), otherwise one a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FalconLayout {
    /// `new_decoder_architecture`: `num_kv_heads` groups of heads.
    pub new_arch: bool,
    /// `parallel_attn`: the attention and the MLP read the layer's input
    /// side by side, their outputs summed, then dropped out together
    /// (`hidden_dropout`); otherwise one after the other, the
    /// attention's output dropped out at `attention_dropout`.
    pub parallel: bool,
    /// Two norms of the input side by side (`ln_attn`, `ln_mlp`: the new
    /// architecture's default) rather than one (`input_layernorm`).
    pub two_norms: bool,
    /// `alibi` (Falcon-RW): no rotary embeddings; each head's scores
    /// biased by its slope times the key's position, rounded to bf16
    /// (`falcon::alibi_mask`).
    pub alibi: bool,
}

/// Falcon's layout and its key-value heads from the config `j` of
/// `heads` attention heads. The flag combinations `FalconDecoderLayer`
/// cannot run are refused.
pub(super) fn layout(j: &HfJson, heads: i64) -> Result<(FalconLayout, i64), HfError> {
    let new_arch = j.flag_or("new_decoder_architecture", false)?;
    let parallel = j.flag_or("parallel_attn", true)?;
    let norms = match j.get("num_ln_in_parallel_attn") {
        None if new_arch => 2,
        None => 1,
        Some(v) => match v.as_i64() {
            Some(n @ (1 | 2)) => n,
            _ => {
                return Err(j.field(format!(
                    "num_ln_in_parallel_attn {v}: a Falcon layer normalises its input once or twice (1 or 2)"
                )))
            }
        },
    };
    if new_arch && !parallel {
        return Err(j.field(
            "new_decoder_architecture true with parallel_attn false: FalconDecoderLayer cannot run this pair (its sequential layers are the old architecture's); set parallel_attn true".into(),
        ));
    }
    if !new_arch && parallel && norms == 2 {
        return Err(j.field(
            "num_ln_in_parallel_attn 2 without new_decoder_architecture: FalconDecoderLayer builds the two norms but its old layers read one it lacks; set new_decoder_architecture true or num_ln_in_parallel_attn 1".into(),
        ));
    }
    let kv_heads = match new_arch {
        true => j.size_or_none("num_kv_heads")?.unwrap_or(heads),
        false if j.flag_or("multi_query", true)? => 1,
        false => {
            let given = j.size_or_none("num_kv_heads")?.unwrap_or(heads);
            if given != heads {
                return Err(j.field(format!(
                    "num_kv_heads {given} with multi_query false and the old architecture: every head has its keys and values there ({heads}); leave it out or set new_decoder_architecture true"
                )));
            }
            heads
        }
    };
    let layout = FalconLayout {
        new_arch,
        parallel,
        two_norms: parallel && norms == 2,
        alibi: j.flag_or("alibi", false)?,
    };
    Ok((layout, kv_heads))
}

/// `c`'s `config.json` as `FalconConfig` reads it (no field it lacks:
/// its `head_dim` is a property no config may set).
pub(super) fn to_json(c: &LlamaConfig, f: &FalconLayout) -> Value {
    debug_assert_eq!(c.family, Family::Falcon);
    json!({
        "model_type": "falcon",
        "architectures": [Family::Falcon.architecture()],
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "ffn_hidden_size": c.intermediate,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "new_decoder_architecture": f.new_arch,
        "parallel_attn": f.parallel,
        "num_ln_in_parallel_attn": match (f.new_arch, f.two_norms) {
            (false, _) => None,
            (true, two) => Some(if two { 2 } else { 1 }),
        },
        // The old architecture's groups: one (multi-query), or a head each.
        "multi_query": !f.new_arch && c.kv_heads == 1,
        "num_kv_heads": if f.new_arch { c.kv_heads } else { c.heads },
        "alibi": f.alibi,
        "bias": c.o_bias,
        "activation": c.activation.name(),
        "layer_norm_epsilon": c.eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling.to_json(false),
        "max_position_embeddings": c.positions,
        "hidden_dropout": c.resid_dropout,
        "attention_dropout": c.attention_dropout,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}

/// ALiBi's slope for each of `heads` heads as `transformers`' Falcon
/// (and BLOOM) computes them in fp32 (`build_alibi_tensor`): the powers
/// `1..=n` of `2^-(8 / n)`, `n` the largest power of two up to `heads`;
/// past it, the odd powers of `2^-(4 / n)`.
pub(super) fn alibi_slopes(heads: i64, device: Device) -> Tensor {
    let n = 1i64 << (63 - heads.max(1).leading_zeros());
    let powers = |base: f64, count: i64, step: i64| {
        let exponents = Tensor::arange_start_step(1, 1 + step * count, step, (Kind::Int, device));
        Tensor::from(base as f32).to_device(device).pow(&exponents)
    };
    let slopes = powers(2f64.powf(-(2f64.powf(-((n as f64).log2() - 3.0)))), n, 1);
    match n == heads {
        true => slopes,
        false => {
            let extra = 2f64.powf(-(2f64.powf(-((2.0 * n as f64).log2() - 3.0))));
            Tensor::cat(&[slopes, powers(extra, (heads - n).min(n), 2)], 0)
        }
    }
}

/// Falcon-RW's additive mask for `t` queries after `offset` over all
/// `offset + t` keys, `[batch or 1, heads, t, offset + t]` in `kind`, as
/// `transformers`' Falcon builds it: each head's slope rounded to bf16
/// times the key's position (its position in its document, when
/// `documents`: as the document alone would have it), the product in
/// bf16, cast to `kind` and divided there by the square root of
/// `head_dim` (the scores' own scale applies on top); minus infinity
/// where the query does not see the key. Unlike MPT's and BLOOM's, the
/// bias is not the same as one of `j - i`: the rounding grows with the
/// position.
pub(super) fn alibi_mask(
    slopes: &Tensor,
    (t, offset): (i64, i64),
    documents: Option<&Documents>,
    (kind, head_dim): (Kind, i64),
) -> Tensor {
    let device = slopes.device();
    let keys = match documents {
        Some(d) => d.positions.unsqueeze(1),
        None => Tensor::arange(offset + t, (Kind::Int64, device)).view([1, 1, -1]),
    };
    let bias = slopes.to_kind(Kind::BFloat16).view([1, -1, 1]) * keys;
    let bias = (bias.to_kind(kind) / (head_dim as f64).sqrt()).unsqueeze(2);
    let visible = match documents {
        Some(d) => d.visible_within(None),
        None => {
            let i = Tensor::arange_start(offset, offset + t, (Kind::Int64, device)).unsqueeze(1);
            let j = Tensor::arange(offset + t, (Kind::Int64, device)).unsqueeze(0);
            i.ge_tensor(&j).unsqueeze(0).unsqueeze(0)
        }
    };
    let hidden = Tensor::from(f64::NEG_INFINITY)
        .to_kind(kind)
        .to_device(device);
    bias.where_self(&visible, &hidden)
}
