//! GPT-BigCode's `config.json` ([`Family::GptBigCode`]): GPT-2's names
//! for its sizes, read as the flat config the other families share
//! ([`own_names`]) and written back as `GPTBigCodeConfig` writes it.

use serde_json::{json, Value};

use crate::hf::{HfError, HfJson};

use super::config::LlamaConfig;
use super::family::Family;
use super::own_names::{self, Field, Gpt2Defaults};

/// Each flat field and GPT-BigCode's name for it, with
/// `GPTBigCodeConfig`'s default (its dropouts 0.1).
const FIELDS: [Field; 10] = own_names::gpt2_fields(Gpt2Defaults {
    width: 768,
    heads: 12,
    layers: 12,
    positions: 1024,
    vocab: 50257,
    activation: "gelu_pytorch_tanh",
    dropout: 0.1,
});

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
    let (mut out, sizes) = own_names::gpt2_flat(j, "gpt_bigcode", &FIELDS);
    let Some((_, heads)) = sizes else {
        return Ok(j.reading(Value::Object(out)));
    };
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
    own_names::renamed_as(e, &FIELDS, &OTHERS)
}

/// `c`'s `config.json` as `GPTBigCodeConfig` reads it.
pub(super) fn to_json(c: &LlamaConfig) -> Value {
    debug_assert_eq!(c.family, Family::GptBigCode);
    let extra = json!({
        "multi_query": c.kv_heads == 1 && c.heads > 1,
        "scale_attn_weights": c.attention_multiplier.is_none(),
    });
    own_names::gpt2_json(c, extra)
}
