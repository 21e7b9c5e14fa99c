//! GPT-J's and CodeGen's `config.json` ([`Family::GptJ`],
//! [`Family::CodeGen`]): GPT-2's names for their sizes (`n_embd`,
//! `n_head`, ...), read as the flat config the other families share
//! ([`own_names`]) and written back as `GPTJConfig` (`CodeGenConfig`)
//! writes it.

use serde_json::{json, Map, Value};

use crate::hf::{HfError, HfJson};

use super::config::LlamaConfig;
use super::family::Family;
use super::own_names::{self, field, Default, Field};

/// Each flat field and GPT-J's name for it, with `GPTJConfig`'s
/// default; the first four as its `attribute_map` lets a config spell
/// them too.
const FIELDS: [Field; 10] = [
    field("hidden_size", "n_embd", Default::Int(4096), true),
    field("num_attention_heads", "n_head", Default::Int(16), true),
    field("num_hidden_layers", "n_layer", Default::Int(28), true),
    field(
        "max_position_embeddings",
        "n_positions",
        Default::Int(2048),
        true,
    ),
    field("vocab_size", "vocab_size", Default::Int(50400), false),
    field(
        "hidden_act",
        "activation_function",
        Default::Str("gelu_new"),
        false,
    ),
    field(
        "layer_norm_epsilon",
        "layer_norm_epsilon",
        Default::Float(1e-5),
        false,
    ),
    field("resid_pdrop", "resid_pdrop", Default::Float(0.0), false),
    field("embd_pdrop", "embd_pdrop", Default::Float(0.0), false),
    field(
        "attention_dropout",
        "attn_pdrop",
        Default::Float(0.0),
        false,
    ),
];

/// The flat fields read beside [`FIELDS`] that need more than a copy.
const OTHERS: [(&str, &str); 2] = [
    ("intermediate_size", "n_inner"),
    ("partial_rotary_factor", "rotary_dim"),
];

/// The GPT-J (or CodeGen) config `j` as the flat config the shared reader reads (the
/// file's text kept: an export writes it back verbatim). Its MLP is
/// `n_inner` wide (null: four times the width); each head turns its
/// first `rotary_dim` dimensions (read as their share of the head).
pub(super) fn flat(j: &HfJson, family: Family) -> Result<HfJson, HfError> {
    let mut out = Map::new();
    out.insert("model_type".into(), family.model_type().into());
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
    // CodeGen's query-value-key matrix holds a quarter of the heads in
    // each of its four blocks.
    let blocks = super::layer::CODEGEN_BLOCKS;
    if family == Family::CodeGen && heads % blocks != 0 {
        return Err(j.field(format!(
            "n_head {heads}: CodeGen's query-value-key matrix holds a quarter of the heads in each of its {blocks} blocks, so they are a multiple of {blocks}"
        )));
    }
    let head = hidden / heads.max(1);
    // Left out, its class's 64.
    let given = match j.has("rotary_dim") {
        false => Some(Value::from(64)),
        true => j.get("rotary_dim").cloned(),
    };
    let turned = match given.as_ref().and_then(Value::as_i64) {
        Some(n) if n > 0 && n <= head && n % 2 == 0 => n,
        _ => {
            let v = given.map_or("null".to_string(), |v| v.to_string());
            return Err(j.field(format!(
                "rotary_dim {v}: GPT-J turns that many of each head's {head} dimensions, an even count of them up to all (64 when left out; null would turn the whole width, which its attention cannot)"
            )));
        }
    };
    out.insert(
        "partial_rotary_factor".into(),
        (turned as f64 / head as f64).into(),
    );
    Ok(j.reading(Value::Object(out)))
}

/// `e` with the flat fields it names renamed to GPT-J's.
pub(super) fn gptj_names(e: HfError) -> HfError {
    let renames: Vec<(&str, &str)> = (FIELDS.iter().map(|f| (f.flat, f.own)))
        .chain(OTHERS)
        .collect();
    own_names::renamed(e, &renames)
}

/// `c`'s `config.json` as `GPTJConfig` reads it.
pub(super) fn to_json(c: &LlamaConfig) -> Value {
    debug_assert!(c.family.gptj());
    json!({
        "model_type": c.family.model_type(),
        "architectures": [c.family.architecture()],
        "vocab_size": c.vocab,
        "n_embd": c.hidden,
        "n_head": c.heads,
        "n_layer": c.layers,
        "n_positions": c.positions,
        "n_inner": c.intermediate,
        "rotary_dim": c.rotary_dim(),
        "activation_function": c.activation.name(),
        "layer_norm_epsilon": c.eps,
        "resid_pdrop": c.resid_dropout,
        "embd_pdrop": c.embedding_dropout,
        "attn_pdrop": c.attention_dropout,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}
