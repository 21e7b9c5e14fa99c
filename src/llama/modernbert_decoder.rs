//! ModernBERT-decoder's `config.json` ([`Family::ModernBertDecoder`]):
//! its window and which layers attend in it, what zrt refuses of it, and
//! the config written back as `ModernBertDecoderConfig` writes it.

use serde_json::{json, Value};

use crate::hf::{HfError, HfJson};

use super::config::{layer_kinds, LlamaConfig};
use super::family::Family;

/// `local_attention`'s default: its window is half of it.
const LOCAL_ATTENTION: i64 = 128;

/// `global_attn_every_n_layers`' default.
const GLOBAL_EVERY: i64 = 3;

/// Refuses what zrt does not build of the config `j`, naming the field
/// and its fix: biased norms, dropout inside the MLP, a biased
/// prediction head or one activated otherwise than the MLP.
pub(super) fn check(j: &HfJson) -> Result<(), HfError> {
    if j.flag_or("norm_bias", false)? {
        return Err(j.field(
            "norm_bias true: zrt builds ModernBERT-decoder's LayerNorms without biases, its default (set it to false)".into(),
        ));
    }
    let rate = j.number_or("mlp_dropout", 0.0)?;
    if rate != 0.0 {
        return Err(j.field(format!(
            "mlp_dropout {rate}: zrt drops out nothing inside the MLP (set it to 0)"
        )));
    }
    if j.flag_or("classifier_bias", false)? {
        return Err(j.field(
            "classifier_bias true: zrt builds the prediction head's `lm_head.dense` without a bias, its default (set it to false)".into(),
        ));
    }
    let act = |key: &str| {
        j.get(key)
            .and_then(Value::as_str)
            .unwrap_or("gelu")
            .to_string()
    };
    let (head, mlp) = (act("classifier_activation"), act("hidden_activation"));
    if head != mlp {
        return Err(j.field(format!(
            "classifier_activation {head:?}: zrt activates the prediction head as the MLP (hidden_activation {mlp:?}); give the same"
        )));
    }
    Ok(())
}

/// The window of `j`'s sliding layers: half of `local_attention` (as
/// the class computes `sliding_window`); none given is refused.
pub(super) fn window(j: &HfJson) -> Result<Option<i64>, HfError> {
    let local = match j.has("local_attention") {
        true => j.size_or_null("local_attention", None)?,
        false => Some(LOCAL_ATTENTION),
    };
    match local {
        Some(n) if n >= 2 => Ok(Some(n / 2)),
        // Named as the file gives it (`1`, `null`).
        _ => Err(j.field(format!(
            "local_attention {}: ModernBERT-decoder's sliding layers attend within half of it; give 2 or more",
            j.get("local_attention").unwrap_or(&Value::Null)
        ))),
    }
}

/// For each of `j`'s `layers`, whether it attends in the window: as
/// `layer_types` lists them, else every layer but each
/// `global_attn_every_n_layers`-th from the first.
pub(super) fn local_layers(j: &HfJson, layers: i64) -> Result<Vec<bool>, HfError> {
    let kinds = ["full_attention", "sliding_attention"];
    let listed = layer_kinds(j, layers, "ModernBERT-decoder", kinds, kinds[1])?;
    if let Some(local) = listed {
        return Ok(local);
    }
    let every = j
        .size_or_none("global_attn_every_n_layers")?
        .unwrap_or(GLOBAL_EVERY);
    Ok((0..layers).map(|l| l % every != 0).collect())
}

/// `c`'s `config.json` as `ModernBertDecoderConfig` reads it.
pub(super) fn to_json(c: &LlamaConfig) -> Value {
    debug_assert_eq!(c.family, Family::ModernBertDecoder);
    let kinds: Vec<&str> = (0..c.layers)
        .map(|l| match c.window(l) {
            Some(_) => "sliding_attention",
            None => "full_attention",
        })
        .collect();
    let window = c.sliding_window.unwrap_or(LOCAL_ATTENTION / 2);
    let act = c.activation.name();
    json!({
        "model_type": "modernbert-decoder",
        "architectures": [Family::ModernBertDecoder.architecture()],
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "intermediate_size": c.intermediate,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "max_position_embeddings": c.positions,
        "hidden_activation": act,
        "classifier_activation": act,
        "norm_eps": c.eps,
        "global_rope_theta": c.rope_theta,
        "local_attention": 2 * window,
        "layer_types": kinds,
        "attention_bias": c.o_bias,
        "mlp_bias": c.mlp_bias,
        "decoder_bias": c.head_bias,
        "embedding_dropout": c.embedding_dropout,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}
