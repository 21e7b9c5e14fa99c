//! GPT-BigCode's `config.json` ([`Family::GptBigCode`]): GPT-2's names
//! for its sizes, read as the flat config the other families share
//! ([`own_names`]) and written back as `GPTBigCodeConfig` writes it.

use serde_json::{json, Map, Value};

use crate::hf::{HfError, HfJson};

use super::config::LlamaConfig;
use super::family::Family;
use super::own_names::{self, field, Default, Field};

/// Each flat field and GPT-BigCode's name for it, with
/// `GPTBigCodeConfig`'s default (its dropouts 0.1); the first four as
/// its `attribute_map` lets a config spell them too.
const FIELDS: [Field; 10] = [
    field("hidden_size", "n_embd", Default::Int(768), true),
    field("num_attention_heads", "n_head", Default::Int(12), true),
    field("num_hidden_layers", "n_layer", Default::Int(12), true),
    field(
        "max_position_embeddings",
        "n_positions",
        Default::Int(1024),
        true,
    ),
    field("vocab_size", "vocab_size", Default::Int(50257), false),
    field(
        "hidden_act",
        "activation_function",
        Default::Str("gelu_pytorch_tanh"),
        false,
    ),
    field(
        "layer_norm_epsilon",
        "layer_norm_epsilon",
        Default::Float(1e-5),
        false,
    ),
    field("resid_pdrop", "resid_pdrop", Default::Float(0.1), false),
    field("embd_pdrop", "embd_pdrop", Default::Float(0.1), false),
    field(
        "attention_dropout",
        "attn_pdrop",
        Default::Float(0.1),
        false,
    ),
];

/// The flat fields read beside [`FIELDS`] that need more than a copy.
const OTHERS: [(&str, &str); 2] = [
    ("intermediate_size", "n_inner"),
    ("num_key_value_heads", "multi_query"),
];

/// The GPT-BigCode config `j` as the flat config the shared reader
/// reads (the file's text kept: an export writes it back verbatim): its
/// MLP `n_inner` wide (null: four times the width), one key-value head
/// with `multi_query` (its default), else one a head; unscaled scores
/// when `scale_attn_weights` is false.
pub(super) fn flat(j: &HfJson) -> Result<HfJson, HfError> {
    let mut out = Map::new();
    out.insert("model_type".into(), "gpt_bigcode".into());
    own_names::keep(j, &mut out);
    own_names::copy(j, &[], &FIELDS, &mut out);
    let size = |key: &str| out.get(key).and_then(Value::as_i64).filter(|&n| n > 0);
    let (Some(hidden), Some(heads)) = (size("hidden_size"), size("num_attention_heads")) else {
        // The shared reader names the field that is no size.
        return Ok(j.reading(Value::Object(out)));
    };
    let width = match j.get("n_inner") {
        None => Value::from(4 * hidden),
        Some(v) => v.clone(),
    };
    out.insert("intermediate_size".into(), width);
    let kv = match j.flag_or("multi_query", true)? {
        true => 1,
        false => heads,
    };
    out.insert("num_key_value_heads".into(), kv.into());
    out.insert(
        "scale_attn_weights".into(),
        j.flag_or("scale_attn_weights", true)?.into(),
    );
    Ok(j.reading(Value::Object(out)))
}

/// `e` with the flat fields it names renamed to GPT-BigCode's.
pub(super) fn bigcode_names(e: HfError) -> HfError {
    let renames: Vec<(&str, &str)> = (FIELDS.iter().map(|f| (f.flat, f.own)))
        .chain(OTHERS)
        .collect();
    own_names::renamed(e, &renames)
}

/// `c`'s `config.json` as `GPTBigCodeConfig` reads it.
pub(super) fn to_json(c: &LlamaConfig) -> Value {
    debug_assert_eq!(c.family, Family::GptBigCode);
    json!({
        "model_type": "gpt_bigcode",
        "architectures": [Family::GptBigCode.architecture()],
        "vocab_size": c.vocab,
        "n_embd": c.hidden,
        "n_head": c.heads,
        "n_layer": c.layers,
        "n_positions": c.positions,
        "n_inner": c.intermediate,
        "multi_query": c.kv_heads == 1 && c.heads > 1,
        "scale_attn_weights": c.attention_multiplier.is_none(),
        "activation_function": c.activation.name(),
        "layer_norm_epsilon": c.eps,
        "resid_pdrop": c.resid_dropout,
        "embd_pdrop": c.embedding_dropout,
        "attn_pdrop": c.attention_dropout,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}
