//! OpenAI GPT's `config.json` ([`Family::OpenAiGpt`]): GPT-2's names for
//! its sizes and `afn` for its activation, read as the flat config the
//! other families share ([`own_names`]) and written back as
//! `OpenAIGPTConfig` writes it.

use serde_json::{json, Value};

use crate::hf::{HfError, HfJson};

use super::config::{Activation, LlamaConfig};
use super::family::Family;
use super::own_names::{self, field, Default, Field, EPSILON};

/// Each flat field and OpenAI GPT's name for it, with
/// `OpenAIGPTConfig`'s default; the width, heads, layers and positions
/// as its `attribute_map` lets a config spell them too. The class has no
/// field for the MLP's width (four times the layers') nor for biases
/// (every projection has one).
const FIELDS: [Field; 10] = [
    field("hidden_size", "n_embd", Default::Int(768), true),
    field("num_attention_heads", "n_head", Default::Int(12), true),
    field("num_hidden_layers", "n_layer", Default::Int(12), true),
    field(
        "max_position_embeddings",
        "n_positions",
        Default::Int(512),
        true,
    ),
    field("vocab_size", "vocab_size", Default::Int(40478), false),
    field("hidden_act", "afn", Default::Str("gelu"), false),
    EPSILON,
    field("resid_pdrop", "resid_pdrop", Default::Float(0.1), false),
    field("embd_pdrop", "embd_pdrop", Default::Float(0.1), false),
    field(
        "attention_dropout",
        "attn_pdrop",
        Default::Float(0.1),
        false,
    ),
];

/// Each `afn` the class knows (its `ACT_FNS`) and the activation zrt
/// reads it as: its `gelu` is `gelu_new`'s tanh approximation, its
/// `swish` SiLU.
const ACTIVATIONS: [(&str, &str); 4] = [
    ("gelu", "gelu_new"),
    ("relu", "relu"),
    ("silu", "silu"),
    ("swish", "silu"),
];

/// The OpenAI GPT config `j` as the flat config the shared reader reads
/// (the file's text kept: an export writes it back verbatim): its MLP
/// four times the width, its `afn` as [`ACTIVATIONS`] reads it; another
/// `afn` refused, naming the ones the class knows.
pub(super) fn flat(j: &HfJson) -> Result<HfJson, HfError> {
    let (mut out, sizes) = own_names::flat_with(j, "openai-gpt", &FIELDS);
    if let Some((hidden, _)) = sizes {
        out.insert("intermediate_size".into(), (4 * hidden).into());
    }
    let given = out.get("hidden_act").cloned().unwrap_or(Value::Null);
    let read = ACTIVATIONS
        .iter()
        .find(|(afn, _)| given.as_str() == Some(afn))
        .map(|(_, name)| *name);
    let Some(name) = read else {
        let known: Vec<&str> = ACTIVATIONS.iter().map(|(afn, _)| *afn).collect();
        return Err(j.field(format!(
            "afn {given}: OpenAI GPT's class knows {known:?}; give one of them"
        )));
    };
    out.insert("hidden_act".into(), name.into());
    Ok(j.reading(Value::Object(out)))
}

/// `e` with the flat fields it names renamed to OpenAI GPT's.
pub(super) fn openai_gpt_names(e: HfError) -> HfError {
    own_names::renamed_as(e, &FIELDS, &[])
}

/// `c`'s `config.json` as `OpenAIGPTConfig` reads it (its MLP is always
/// four times the width, as [`flat`] reads it).
pub(super) fn to_json(c: &LlamaConfig) -> Value {
    debug_assert_eq!(c.family, Family::OpenAiGpt);
    let afn = match c.activation {
        Activation::GeluNew => "gelu",
        other => other.name(),
    };
    json!({
        "model_type": "openai-gpt",
        "architectures": [Family::OpenAiGpt.architecture()],
        "vocab_size": c.vocab,
        "n_embd": c.hidden,
        "n_layer": c.layers,
        "n_head": c.heads,
        "n_positions": c.positions,
        "afn": afn,
        "layer_norm_epsilon": c.eps,
        "resid_pdrop": c.resid_dropout,
        "embd_pdrop": c.embedding_dropout,
        "attn_pdrop": c.attention_dropout,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}
