//! CTRL's `config.json` ([`Family::Ctrl`]): GPT-2's names for its sizes
//! and its own for the MLP's width (`dff`), read as the flat config the
//! other families share ([`own_names`]) and written back as
//! `CTRLConfig` writes it; and its sinusoidal positions.

use serde_json::{json, Value};
use tch::{Kind, Tensor};

use crate::hf::{HfError, HfJson};

use super::config::LlamaConfig;
use super::family::Family;
use super::own_names::{self, field, Default, Field};

/// Each flat field and CTRL's name for it, with `CTRLConfig`'s default;
/// the width, heads, layers and positions as its `attribute_map` lets a
/// config spell them too. Its class has no activation field (its MLP is
/// a ReLU's) and no attention dropout (`attn_pdrop` is read by nothing).
const FIELDS: [Field; 9] = [
    field("hidden_size", "n_embd", Default::Int(1280), true),
    field("num_attention_heads", "n_head", Default::Int(16), true),
    field("num_hidden_layers", "n_layer", Default::Int(48), true),
    field(
        "max_position_embeddings",
        "n_positions",
        Default::Int(256),
        true,
    ),
    field("intermediate_size", "dff", Default::Int(8192), false),
    field("vocab_size", "vocab_size", Default::Int(246534), false),
    field(
        "layer_norm_epsilon",
        "layer_norm_epsilon",
        Default::Float(1e-6),
        false,
    ),
    field("resid_pdrop", "resid_pdrop", Default::Float(0.1), false),
    field("embd_pdrop", "embd_pdrop", Default::Float(0.1), false),
];

/// The epsilon of the layers' norms, fixed in CTRL's class (the config's
/// `layer_norm_epsilon` is the final norm's alone).
const LAYER_EPSILON: f64 = 1e-6;

/// The CTRL config `j` as the flat config the shared reader reads (the
/// file's text kept: an export writes it back verbatim), its MLP a
/// ReLU's; a `layer_norm_epsilon` other than the layers' fixed 1e-6
/// refused (zrt's norms share one epsilon).
pub(super) fn flat(j: &HfJson) -> Result<HfJson, HfError> {
    let (mut out, _) = own_names::flat_with(j, "ctrl", &FIELDS);
    out.insert("hidden_act".into(), "relu".into());
    let eps = out.get("layer_norm_epsilon").and_then(Value::as_f64);
    if eps.is_some_and(|e| e != LAYER_EPSILON) {
        return Err(j.field(format!(
            "layer_norm_epsilon {}: CTRL's class normalises its layers at a fixed 1e-6 and only its last norm at this, and zrt's norms share one epsilon; give 1e-6",
            eps.unwrap_or_default()
        )));
    }
    Ok(j.reading(Value::Object(out)))
}

/// `e` with the flat fields it names renamed to CTRL's.
pub(super) fn ctrl_names(e: HfError) -> HfError {
    own_names::renamed_as(e, &FIELDS, &[])
}

/// `c`'s `config.json` as `CTRLConfig` reads it.
pub(super) fn to_json(c: &LlamaConfig) -> Value {
    debug_assert_eq!(c.family, Family::Ctrl);
    json!({
        "model_type": "ctrl",
        "architectures": [Family::Ctrl.architecture()],
        "vocab_size": c.vocab,
        "n_embd": c.hidden,
        "dff": c.intermediate,
        "n_layer": c.layers,
        "n_head": c.heads,
        "n_positions": c.positions,
        "layer_norm_epsilon": c.eps,
        "resid_pdrop": c.resid_dropout,
        "embd_pdrop": c.embedding_dropout,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}

/// CTRL's sinusoidal position embeddings `[batch, t, width]` (fp32) for
/// the positions `pos` `[batch, t]`, as its `positional_encoding`
/// computes its table: for each even `i` the sine of `p / 10000^(i /
/// w)`, then for each odd `i` the cosine of `p / 10000^((i - 1) / w)`,
/// in fp32 operation for operation.
pub(super) fn sinusoidal(pos: &Tensor, width: i64) -> Tensor {
    let dev = pos.device();
    let i = Tensor::arange(width, (Kind::Int64, dev)).to_kind(Kind::Float);
    // `2 * (i // 2) / width`, as the class divides: floor first.
    let pairs = (i.floor_divide_scalar(2) * 2.0) / width as f64;
    let rates = Tensor::from(10000f32)
        .to_device(dev)
        .pow(&pairs)
        .reciprocal();
    let angles = pos.to_kind(Kind::Float).unsqueeze(-1) * rates;
    let sines = angles.slice(-1, 0, None, 2).sin();
    let cosines = angles.slice(-1, 1, None, 2).cos();
    Tensor::cat(&[sines, cosines], -1)
}
