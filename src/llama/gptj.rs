//! GPT-J's and CodeGen's `config.json` ([`Family::GptJ`],
//! [`Family::CodeGen`]): GPT-2's names for their sizes (`n_embd`,
//! `n_head`, ...), read as the flat config the other families share
//! ([`own_names`]) and written back as `GPTJConfig` (`CodeGenConfig`)
//! writes it.

use serde_json::{json, Value};

use crate::hf::{HfError, HfJson};

use super::config::LlamaConfig;
use super::family::Family;
use super::own_names::{self, Field, Gpt2Defaults};

/// Each flat field and GPT-J's name for it, with `GPTJConfig`'s
/// default (`CodeGenConfig`'s are the same).
const FIELDS: [Field; 10] = own_names::gpt2_fields(Gpt2Defaults {
    width: 4096,
    heads: 16,
    layers: 28,
    positions: 2048,
    vocab: 50400,
    activation: "gelu_new",
    dropout: 0.0,
});

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
    let (mut out, sizes) = own_names::gpt2_flat(j, family.model_type(), &FIELDS);
    let Some((hidden, heads)) = sizes else {
        return Ok(j.reading(Value::Object(out)));
    };
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
    own_names::renamed_as(e, &FIELDS, &OTHERS)
}

/// `c`'s `config.json` as `GPTJConfig` reads it.
pub(super) fn to_json(c: &LlamaConfig) -> Value {
    debug_assert!(c.family.gptj());
    own_names::gpt2_json(c, json!({"rotary_dim": c.rotary_dim()}))
}
