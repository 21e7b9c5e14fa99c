//! MPT's `config.json` ([`Family::Mpt`]): its sizes under names of its
//! own, its attention's in a nested `attn_config`, read as the flat
//! config the other families share ([`own_names`]) and written back
//! nested; and its ALiBi slopes.

use serde_json::{json, Map, Value};
use tch::{Device, Kind, Tensor};

use crate::packing::Documents;

use crate::hf::{HfError, HfJson};

use super::config::LlamaConfig;
use super::family::Family;
use super::own_names::{self, field, Default, Field};

/// Each flat field and where MPT keeps it, with `MptConfig`'s default;
/// the top level's first four as its `attribute_map` lets a config
/// spell them too. `transformers`' MPT drops out at `attn_pdrop`
/// everywhere (attention weights, both sublayers' outputs).
const FIELDS: [Field; 8] = [
    field("hidden_size", "d_model", Default::Int(2048), true),
    field("num_attention_heads", "n_heads", Default::Int(16), true),
    field("num_hidden_layers", "n_layers", Default::Int(24), true),
    field(
        "max_position_embeddings",
        "max_seq_len",
        Default::Int(2048),
        false,
    ),
    field("vocab_size", "vocab_size", Default::Int(50368), false),
    own_names::EPSILON,
    field(
        "attention_dropout",
        "attn_config.attn_pdrop",
        Default::Float(0.0),
        false,
    ),
    field("clip_qkv", "attn_config.clip_qkv", Default::Null, false),
];

/// The flat fields read beside [`FIELDS`] that need more than a copy.
const OTHERS: [(&str, &str); 1] = [("softmax_scale", "attn_config.softmax_scale")];

/// The fields `transformers`' MPT reads as if they held their defaults,
/// with those defaults (the flat name, the value).
fn as_if() -> [(&'static str, Value); 9] {
    [
        ("expansion_ratio", json!(4)),
        ("logit_scale", Value::Null),
        ("embedding_fraction", json!(1.0)),
        ("attn_config.alibi", json!(true)),
        ("attn_config.alibi_bias_max", json!(8)),
        ("attn_config.qk_ln", json!(false)),
        ("attn_config.prefix_lm", json!(false)),
        ("attn_config.attn_uses_sequence_id", json!(false)),
        ("attn_config.attn_type", json!("multihead_attention")),
    ]
}

/// The MPT config `j` as the flat config the shared reader reads (the
/// file's text kept: an export writes it back verbatim).
pub(super) fn flat(j: &HfJson) -> Result<HfJson, HfError> {
    let attn = match j.get("attn_config") {
        None => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(v) => return Err(j.field(format!("`attn_config` is {v}, not an object"))),
    };
    for (at, default) in as_if() {
        let given = match at.split_once('.') {
            Some((_, key)) => attn.get(key),
            None => j.get(at),
        };
        let same = match (given, &default) {
            (None, _) => true,
            (Some(g), Value::Number(d)) => g.as_f64() == d.as_f64(),
            (Some(g), d) => g == d,
        };
        if !same {
            return Err(j.field(format!(
                "{at} {}: transformers' MptForCausalLM computes its model as if it were {default} (its MLP four times the width, ALiBi's slopes down to 2^-8, ...); zrt trains the model it computes: set it to {default} or leave it out",
                given.map_or(Value::Null, Clone::clone)
            )));
        }
    }
    let mut out = Map::new();
    out.insert("model_type".into(), "mpt".into());
    own_names::keep(j, &mut out);
    own_names::copy(j, &[("attn_config", &attn)], &FIELDS, &mut out);
    if let Some(s) = attn.get("softmax_scale").filter(|v| !v.is_null()) {
        out.insert("softmax_scale".into(), s.clone());
    }
    let hidden = out.get("hidden_size").and_then(Value::as_i64).unwrap_or(0);
    out.insert("intermediate_size".into(), (4 * hidden).into());
    let rate = out.get("attention_dropout").cloned().unwrap_or(Value::Null);
    out.insert("resid_pdrop".into(), rate);
    out.insert("hidden_act".into(), "gelu".into());
    Ok(j.reading(Value::Object(out)))
}

/// `e` with the flat fields it names renamed to MPT's.
pub(super) fn mpt_names(e: HfError) -> HfError {
    own_names::renamed_as(e, &FIELDS, &OTHERS)
}

/// `c`'s `config.json` as `MptConfig` reads it.
pub(super) fn to_json(c: &LlamaConfig) -> Value {
    debug_assert_eq!(c.family, Family::Mpt);
    json!({
        "model_type": "mpt",
        "architectures": [Family::Mpt.architecture()],
        "vocab_size": c.vocab,
        "d_model": c.hidden,
        "n_heads": c.heads,
        "n_layers": c.layers,
        "max_seq_len": c.positions,
        "layer_norm_epsilon": c.eps,
        "pad_token_id": c.pad_token,
        "attn_config": {
            "attn_pdrop": c.attention_dropout,
            "clip_qkv": c.clip_qkv,
            "softmax_scale": c.attention_multiplier,
        },
    })
}

/// ALiBi's slope for each of `heads` heads, as `transformers`' MPT
/// computes them (`build_mpt_alibi_tensor`, its bias's maximum 8): `2^-(8
/// i / n)` for `i` in `1..=n`, `n` the heads rounded up to a power of
/// two; with fewer heads than that, the odd ones then the even ones, the
/// first `heads` of them.
pub(super) fn alibi_slopes(heads: i64, device: Device) -> Tensor {
    let n = (heads.max(1) as u64).next_power_of_two() as i64;
    let step = (8.0 / n as f64) as f32;
    let all: Vec<f32> = (1..=n).map(|i| 1.0 / 2f32.powf(i as f32 * step)).collect();
    let slopes: Vec<f32> = match n == heads {
        true => all,
        false => (all.iter().skip(1).step_by(2))
            .chain(all.iter().step_by(2))
            .take(heads as usize)
            .copied()
            .collect(),
    };
    Tensor::from_slice(&slopes).to_device(device)
}

/// ALiBi's additive mask for `t` queries after `offset` over `offset +
/// t` keys, `[batch or 1, heads, t, offset + t]` in `kind`: each head's
/// slope times the key's distance back (`j - i`, at most 0) where the
/// query sees the key (causally, and within its document when
/// `documents`), minus infinity elsewhere. `transformers`' MPT adds the
/// slope times `j - (keys - 1)`: the same softmax, a constant apart in
/// each row.
pub(super) fn alibi_mask(
    slopes: &Tensor,
    (t, offset): (i64, i64),
    documents: Option<&Documents>,
    kind: Kind,
) -> Tensor {
    let opts = (Kind::Int64, slopes.device());
    let i = Tensor::arange_start(offset, offset + t, opts).unsqueeze(1);
    let j = Tensor::arange(offset + t, opts).unsqueeze(0);
    let distance = (&j - &i).to_kind(Kind::Float).unsqueeze(0).unsqueeze(0);
    let bias = slopes.view([1, -1, 1, 1]) * distance;
    let visible = match documents {
        Some(d) => d.visible_within(None),
        None => i.ge_tensor(&j).unsqueeze(0).unsqueeze(0),
    };
    let hidden = Tensor::from(f64::NEG_INFINITY).to_device(slopes.device());
    bias.where_self(&visible, &hidden).to_kind(kind)
}
