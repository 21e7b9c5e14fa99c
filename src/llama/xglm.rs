//! XGLM's `config.json` ([`Family::Xglm`]): its own names for its sizes
//! (`d_model`, `num_layers`, `attention_heads`, `ffn_dim`), read as the
//! flat config the other families share ([`own_names`]) and written back
//! as `XGLMConfig` writes it; and its sinusoidal positions.

use serde_json::{json, Value};
use tch::{Kind, Tensor};

use crate::hf::{HfError, HfJson};

use super::config::LlamaConfig;
use super::family::Family;
use super::own_names::{self, field, Default, Field};

/// Each flat field and XGLM's name for it, with `XGLMConfig`'s default;
/// the width, layers and heads as its `attribute_map` lets a config
/// spell them too. Its one `dropout` is both the sublayers' and the
/// embeddings'.
const FIELDS: [Field; 12] = [
    field("hidden_size", "d_model", Default::Int(1024), true),
    field("num_hidden_layers", "num_layers", Default::Int(24), true),
    field(
        "num_attention_heads",
        "attention_heads",
        Default::Int(16),
        true,
    ),
    field("intermediate_size", "ffn_dim", Default::Int(4096), false),
    field(
        "max_position_embeddings",
        "max_position_embeddings",
        Default::Int(2048),
        false,
    ),
    field("vocab_size", "vocab_size", Default::Int(256008), false),
    field(
        "hidden_act",
        "activation_function",
        Default::Str("gelu"),
        false,
    ),
    field("resid_pdrop", "dropout", Default::Float(0.1), false),
    field("embd_pdrop", "dropout", Default::Float(0.1), false),
    field(
        "attention_dropout",
        "attention_dropout",
        Default::Float(0.1),
        false,
    ),
    field(
        "activation_dropout",
        "activation_dropout",
        Default::Float(0.0),
        false,
    ),
    field("layerdrop", "layerdrop", Default::Float(0.0), false),
];

/// The XGLM config `j` as the flat config the shared reader reads (the
/// file's text kept: an export writes it back verbatim), with
/// `scale_embedding` (true when left out).
pub(super) fn flat(j: &HfJson) -> Result<HfJson, HfError> {
    let (mut out, _) = own_names::flat_with(j, "xglm", &FIELDS);
    let scaled = j.get("scale_embedding").cloned().unwrap_or(true.into());
    out.insert("scale_embedding".into(), scaled);
    Ok(j.reading(Value::Object(out)))
}

/// `e` with the flat fields it names renamed to XGLM's.
pub(super) fn xglm_names(e: HfError) -> HfError {
    own_names::renamed_as(e, &FIELDS, &[])
}

/// `c`'s `config.json` as `XGLMConfig` reads it.
pub(super) fn to_json(c: &LlamaConfig) -> Value {
    debug_assert_eq!(c.family, Family::Xglm);
    json!({
        "model_type": "xglm",
        "architectures": [Family::Xglm.architecture()],
        "vocab_size": c.vocab,
        "d_model": c.hidden,
        "ffn_dim": c.intermediate,
        "num_layers": c.layers,
        "attention_heads": c.heads,
        "max_position_embeddings": c.positions,
        "activation_function": c.activation.name(),
        "scale_embedding": c.embedding_multiplier != 1.0,
        "dropout": c.resid_dropout,
        "attention_dropout": c.attention_dropout,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}

/// XGLM's sinusoidal position embeddings `[batch, t, width]` (fp32) for
/// the positions `pos` `[batch, t]`, as `XGLMSinusoidalPositionalEmbedding`
/// computes its table's rows: row `p + 2` (its offset) holds the sines of
/// `(p + 2) f_k` then their cosines, `f_k = exp(-k ln(10000) / (w/2 - 1))`,
/// in fp32 operation for operation; an odd width gets a zero last; the
/// row of the padding token's index is zeros.
pub(super) fn sinusoidal(pos: &Tensor, width: i64, padding: Option<i64>) -> Tensor {
    let half = width / 2;
    let step = 10000f64.ln() / (half - 1) as f64;
    let opts = (Kind::Float, pos.device());
    let freqs =
        (Tensor::arange(half, (Kind::Int64, pos.device())).to_kind(Kind::Float) * -step).exp();
    let rows = pos + super::opt::POSITION_OFFSET;
    let angles = rows.to_kind(Kind::Float).unsqueeze(-1) * freqs;
    let mut parts = vec![angles.sin(), angles.cos()];
    if width % 2 == 1 {
        let mut shape = rows.size();
        shape.push(1);
        parts.push(Tensor::zeros(shape.as_slice(), opts));
    }
    let emb = Tensor::cat(&parts, -1);
    match padding {
        Some(pad) => emb.masked_fill(&rows.eq(pad).unsqueeze(-1), 0.0),
        None => emb,
    }
}
