//! OPT's `config.json` ([`Family::Opt`]): what zrt builds of
//! `OPTConfig`'s options (OPT-350m's layout too), and the config
//! written back; and BioGPT's ([`Family::BioGpt`]), OPT's kin.

use serde_json::{json, Value};

use crate::hf::{HfError, HfJson};

use super::config::LlamaConfig;
use super::family::Family;

/// The rows OPT's learned position embeddings keep before position 0
/// (`OPTLearnedPositionalEmbedding`'s offset: a token at position `p`
/// reads row `p + 2`).
pub(super) const POSITION_OFFSET: i64 = 2;

/// How an OPT is laid out (`do_layer_norm_before`,
/// `word_embed_proj_dim`, `_remove_final_layer_norm`): every OPT but
/// 350m normalises each sublayer's input and ends with a final norm;
/// OPT-350m normalises each sublayer's residual sum instead, has no
/// final norm, and embeds its tokens narrower than its layers, projected
/// in (`project_in`) and out (`project_out`) by matrices without biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptLayout {
    /// `do_layer_norm_before`: each sublayer's input is normalised;
    /// otherwise each sublayer's output added to its input is.
    pub norm_before: bool,
    /// A final LayerNorm (`final_layer_norm`) before the head: with
    /// norms before the sublayers, unless `_remove_final_layer_norm`.
    pub final_norm: bool,
    /// `word_embed_proj_dim`: the token embeddings' (and the tied
    /// head's) width; another than `hidden_size` puts `project_in` and
    /// `project_out` between them and the layers.
    pub embedding_width: i64,
}

/// OPT's layout from the config `j` of width `hidden`. Refused, naming
/// the field: layers dropped at random and norms without weights.
pub(super) fn layout(j: &HfJson, hidden: i64) -> Result<OptLayout, HfError> {
    zero_rates(j, &[LAYERDROP])?;
    if !j.flag_or("layer_norm_elementwise_affine", true)? {
        return Err(j.field(
            "layer_norm_elementwise_affine false: zrt builds OPT's LayerNorms with weights and biases (set it to true)".into(),
        ));
    }
    let norm_before = j.flag_or("do_layer_norm_before", true)?;
    // `OPTDecoder` builds its final norm only for norms before the
    // sublayers, and then not when the flag removes it.
    let final_norm = norm_before && !j.flag_or("_remove_final_layer_norm", false)?;
    let embedding_width = j.size_or_none("word_embed_proj_dim")?.unwrap_or(hidden);
    Ok(OptLayout {
        norm_before,
        final_norm,
        embedding_width,
    })
}

/// LayerDrop's rate, which zrt refuses above 0, and why.
const LAYERDROP: (&str, &str) = ("layerdrop", "zrt runs every layer every step");

/// Refuses what zrt does not build of the BioGPT or XGLM config `j`, naming
/// the field: layers dropped at random and dropout between the MLP's
/// matrices.
pub(super) fn check_drops(j: &HfJson) -> Result<(), HfError> {
    zero_rates(
        j,
        &[
            LAYERDROP,
            (
                "activation_dropout",
                "zrt drops out the MLP's output, not its activations",
            ),
        ],
    )
}

/// Refuses each of `rates` (a field and why zrt wants it 0) that `j`
/// gives above 0, naming it.
fn zero_rates(j: &HfJson, rates: &[(&str, &str)]) -> Result<(), HfError> {
    for (key, what) in rates {
        let rate = j.number_or(key, 0.0)?;
        if rate != 0.0 {
            return Err(j.field(format!("{key} {rate}: {what} (set it to 0)")));
        }
    }
    Ok(())
}

/// `c`'s `config.json` as `BioGptConfig` reads it.
pub(super) fn biogpt_json(c: &LlamaConfig) -> Value {
    debug_assert_eq!(c.family, Family::BioGpt);
    json!({
        "model_type": "biogpt",
        "architectures": [Family::BioGpt.architecture()],
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "intermediate_size": c.intermediate,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "max_position_embeddings": c.positions,
        "hidden_act": c.activation.name(),
        "scale_embedding": c.embedding_multiplier != 1.0,
        "hidden_dropout_prob": c.resid_dropout,
        "attention_probs_dropout_prob": c.attention_dropout,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}

/// `c`'s `config.json` as `OPTConfig` reads it.
pub(super) fn to_json(c: &LlamaConfig, layout: &OptLayout) -> Value {
    debug_assert_eq!(c.family, Family::Opt);
    json!({
        "model_type": "opt",
        "architectures": [Family::Opt.architecture()],
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "word_embed_proj_dim": layout.embedding_width,
        "ffn_dim": c.intermediate,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "max_position_embeddings": c.positions,
        "do_layer_norm_before": layout.norm_before,
        "_remove_final_layer_norm": layout.norm_before && !layout.final_norm,
        "enable_bias": c.o_bias,
        "activation_function": c.activation.name(),
        "dropout": c.resid_dropout,
        "attention_dropout": c.attention_dropout,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}
