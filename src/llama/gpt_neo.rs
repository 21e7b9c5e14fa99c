//! GPT-Neo's `config.json` ([`Family::GptNeo`]): its own names for its
//! sizes (`num_layers`, `num_heads`, `window_size`) and its layers'
//! attention kinds (`attention_types`), read as the flat config the
//! other families share ([`own_names`]) and written back as
//! `GPTNeoConfig` writes it.

use serde_json::{json, Value};

use crate::hf::{HfError, HfJson};

use super::config::LlamaConfig;
use super::family::Family;
use super::own_names::{self, field, Default, Field};

/// Each flat field and GPT-Neo's name for it, with `GPTNeoConfig`'s
/// default; the layers' and heads' counts as its `attribute_map` lets a
/// config spell them too.
const FIELDS: [Field; 10] = [
    field("hidden_size", "hidden_size", Default::Int(2048), false),
    field("num_hidden_layers", "num_layers", Default::Int(24), true),
    field("num_attention_heads", "num_heads", Default::Int(16), true),
    field(
        "max_position_embeddings",
        "max_position_embeddings",
        Default::Int(2048),
        false,
    ),
    field("vocab_size", "vocab_size", Default::Int(50257), false),
    field(
        "hidden_act",
        "activation_function",
        Default::Str("gelu_new"),
        false,
    ),
    own_names::EPSILON,
    field("resid_pdrop", "resid_dropout", Default::Float(0.0), false),
    field("embd_pdrop", "embed_dropout", Default::Float(0.0), false),
    field("sliding_window", "window_size", Default::Int(256), false),
];

/// The flat fields read beside [`FIELDS`] that need more than a copy.
const OTHERS: [(&str, &str); 2] = [
    ("intermediate_size", "intermediate_size"),
    ("attention_layers", "attention_types"),
];

/// The GPT-Neo config `j` as the flat config the shared reader reads
/// (the file's text kept: an export writes it back verbatim): its MLP
/// `intermediate_size` wide (null: four times the width), and
/// `attention_types` (`[[["global", "local"], 12]]`: the pair twelve
/// times) expanded to one kind a layer, as many as the layers.
pub(super) fn flat(j: &HfJson) -> Result<HfJson, HfError> {
    let (mut out, sizes) = own_names::flat_with(j, "gpt_neo", &FIELDS);
    let Some((hidden, _)) = sizes else {
        return Ok(j.reading(Value::Object(out)));
    };
    if let Some(v) = j.get("attention_dropout") {
        out.insert("attention_dropout".into(), v.clone());
    }
    let width = match j.get("intermediate_size") {
        None => Value::from(4 * hidden),
        Some(v) => v.clone(),
    };
    out.insert("intermediate_size".into(), width);
    let types = match j.get("attention_types") {
        None => json!([[["global", "local"], 12]]),
        Some(v) => v.clone(),
    };
    let kinds = expanded(&types).ok_or_else(|| {
        j.field(format!(
            "attention_types {types}: a list of [kinds, times] pairs, each kind \"global\" or \"local\" ([[[\"global\", \"local\"], 12]])"
        ))
    })?;
    let layers = out.get("num_hidden_layers").and_then(Value::as_i64);
    if layers != Some(kinds.len() as i64) {
        return Err(j.field(format!(
            "attention_types {types} gives {} layers' kinds, not num_layers' {}: GPTNeoConfig refuses them; give one kind a layer",
            kinds.len(),
            layers.map_or("?".into(), |n| n.to_string())
        )));
    }
    out.insert("attention_layers".into(), json!(kinds));
    Ok(j.reading(Value::Object(out)))
}

/// `attention_types` expanded as `GPTNeoConfig` expands them: each
/// pair's kinds, its times over; `true` for a local layer.
fn expanded(types: &Value) -> Option<Vec<bool>> {
    let mut kinds = vec![];
    for pair in types.as_array()? {
        let (names, times) = match pair.as_array()?.as_slice() {
            [names, times] => (names.as_array()?, times.as_u64()?),
            _ => return None,
        };
        let local: Vec<bool> = (names.iter())
            .map(|n| match n.as_str() {
                Some("local") => Some(true),
                Some("global") => Some(false),
                _ => None,
            })
            .collect::<Option<_>>()?;
        for _ in 0..times {
            kinds.extend(&local);
        }
    }
    Some(kinds)
}

/// `e` with the flat fields it names renamed to GPT-Neo's.
pub(super) fn gpt_neo_names(e: HfError) -> HfError {
    own_names::renamed_as(e, &FIELDS, &OTHERS)
}

/// `c`'s `config.json` as `GPTNeoConfig` reads it: its layers' kinds
/// as the shortest pattern that repeats to them (`[[["global",
/// "local"], 12]]`).
pub(super) fn to_json(c: &LlamaConfig) -> Value {
    debug_assert_eq!(c.family, Family::GptNeo);
    let local = c.local_layers.clone().unwrap_or_default();
    let n = local.len().max(1);
    let period = (1..=n)
        .find(|&p| n % p == 0 && (0..local.len()).all(|l| local[l] == local[l % p]))
        .unwrap_or(n);
    let kinds: Vec<&str> = (local.iter().take(period))
        .map(|&l| if l { "local" } else { "global" })
        .collect();
    json!({
        "model_type": "gpt_neo",
        "architectures": [Family::GptNeo.architecture()],
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "num_layers": c.layers,
        "num_heads": c.heads,
        "max_position_embeddings": c.positions,
        "intermediate_size": c.intermediate,
        "window_size": c.sliding_window,
        "attention_types": [[kinds, n / period]],
        "activation_function": c.activation.name(),
        "layer_norm_epsilon": c.eps,
        "resid_dropout": c.resid_dropout,
        "embed_dropout": c.embedding_dropout,
        "attention_dropout": c.attention_dropout,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}
