//! BLOOM's `config.json` ([`Family::Bloom`]): its layers' and heads'
//! counts under names of its own (`n_layer`, `n_head`), read as the flat
//! config the other families share ([`own_names`]) and written back as
//! `BloomConfig` writes it.

use serde_json::{json, Value};

use crate::hf::{HfError, HfJson};

use super::config::LlamaConfig;
use super::family::Family;
use super::own_names::{self, field, Default, Field};

/// Each flat field and BLOOM's name for it, with `BloomConfig`'s
/// default; the counts as its `attribute_map` lets a config spell them
/// too.
const FIELDS: [Field; 7] = [
    field("hidden_size", "hidden_size", Default::Int(64), false),
    field("num_hidden_layers", "n_layer", Default::Int(2), true),
    field("num_attention_heads", "n_head", Default::Int(8), true),
    field("vocab_size", "vocab_size", Default::Int(250880), false),
    own_names::EPSILON,
    field("resid_pdrop", "hidden_dropout", Default::Float(0.0), false),
    field(
        "attention_dropout",
        "attention_dropout",
        Default::Float(0.0),
        false,
    ),
];

/// The BLOOM config `j` as the flat config the shared reader reads (the
/// file's text kept: an export writes it back verbatim): its width
/// `n_embed` when given (its class takes that over `hidden_size`), its
/// MLP four times the width. What its class computes otherwise is
/// refused, naming the field.
pub(super) fn flat(j: &HfJson) -> Result<HfJson, HfError> {
    if j.flag_or("apply_residual_connection_post_layernorm", false)? {
        return Err(j.field(
            "apply_residual_connection_post_layernorm true: zrt builds BLOOM's layers adding each sublayer to its input, not to its norm's output (set it to false)".into(),
        ));
    }
    if j.flag_or("slow_but_exact", false)? && j.number_or("pretraining_tp", 1.0)? > 1.0 {
        return Err(j.field(
            "slow_but_exact true with pretraining_tp above 1: transformers then sums the output projections in slices, which zrt does not (set slow_but_exact to false: the same model, one product)".into(),
        ));
    }
    let (mut out, sizes) = own_names::flat_with(j, "bloom", &FIELDS);
    if let Some(w) = j.get("n_embed") {
        out.insert("hidden_size".into(), w.clone());
    }
    if let Some((hidden, _)) = sizes {
        let hidden = out
            .get("hidden_size")
            .and_then(Value::as_i64)
            .unwrap_or(hidden);
        out.insert("intermediate_size".into(), (4 * hidden).into());
    }
    Ok(j.reading(Value::Object(out)))
}

/// `e` with the flat fields it names renamed to BLOOM's.
pub(super) fn bloom_names(e: HfError) -> HfError {
    own_names::renamed_as(e, &FIELDS, &[])
}

/// `c`'s `config.json` as `BloomConfig` reads it.
pub(super) fn to_json(c: &LlamaConfig) -> Value {
    debug_assert_eq!(c.family, Family::Bloom);
    json!({
        "model_type": "bloom",
        "architectures": [Family::Bloom.architecture()],
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "n_layer": c.layers,
        "n_head": c.heads,
        "layer_norm_epsilon": c.eps,
        "hidden_dropout": c.resid_dropout,
        "attention_dropout": c.attention_dropout,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}
