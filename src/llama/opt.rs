//! OPT's `config.json` ([`Family::Opt`]): what zrt builds of
//! `OPTConfig`'s options, and the config written back.

use serde_json::{json, Value};

use crate::hf::{HfError, HfJson};

use super::config::LlamaConfig;
use super::family::Family;

/// The rows OPT's learned position embeddings keep before position 0
/// (`OPTLearnedPositionalEmbedding`'s offset: a token at position `p`
/// reads row `p + 2`).
pub(super) const POSITION_OFFSET: i64 = 2;

/// Refuses what zrt does not build of the OPT config `j` of width
/// `hidden`, naming the field: OPT-350m's post-norm layers and its
/// projections in and out of a narrower embedding, layers dropped at
/// random, norms without weights, and no final norm.
pub(super) fn check(j: &HfJson, hidden: i64) -> Result<(), HfError> {
    if !j.flag_or("do_layer_norm_before", true)? {
        return Err(j.field(
            "do_layer_norm_before false (OPT-350m's layers, normalised after each sublayer's residual): zrt builds OPT's layers normalised before each sublayer (every OPT but 350m)".into(),
        ));
    }
    if let Some(w) = j.size_or_none("word_embed_proj_dim")? {
        if w != hidden {
            return Err(j.field(format!(
                "word_embed_proj_dim {w} (not hidden_size {hidden}): OPT-350m's embeddings, projected in and out of the layers' width; zrt builds OPTs whose embeddings are the layers' width"
            )));
        }
    }
    let layerdrop = j.number_or("layerdrop", 0.0)?;
    if layerdrop != 0.0 {
        return Err(j.field(format!(
            "layerdrop {layerdrop}: zrt runs every layer every step (set it to 0)"
        )));
    }
    if !j.flag_or("layer_norm_elementwise_affine", true)? {
        return Err(j.field(
            "layer_norm_elementwise_affine false: zrt builds OPT's LayerNorms with weights and biases (set it to true)".into(),
        ));
    }
    if j.flag_or("_remove_final_layer_norm", false)? {
        return Err(j.field(
            "_remove_final_layer_norm true: zrt builds OPT with its final LayerNorm (set it to false)".into(),
        ));
    }
    Ok(())
}

/// `c`'s `config.json` as `OPTConfig` reads it.
pub(super) fn to_json(c: &LlamaConfig) -> Value {
    debug_assert_eq!(c.family, Family::Opt);
    json!({
        "model_type": "opt",
        "architectures": [Family::Opt.architecture()],
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "word_embed_proj_dim": c.hidden,
        "ffn_dim": c.intermediate,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "max_position_embeddings": c.positions,
        "do_layer_norm_before": true,
        "enable_bias": c.o_bias,
        "activation_function": c.activation.name(),
        "dropout": c.resid_dropout,
        "attention_dropout": c.attention_dropout,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}
