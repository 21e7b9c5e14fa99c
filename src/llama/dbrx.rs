//! DBRX's `config.json` ([`Family::Dbrx`]): its sizes under names of
//! its own, some nested in `attn_config` and `ffn_config`, read as the
//! flat config the other families share, and written back nested.
//!
//! Reading copies each DBRX field (or `DbrxConfig`'s default, which a
//! flat config could not tell from another class's) under the flat
//! name the shared reader knows. The shared reader's errors then name
//! a flat field; [`dbrx_names`] puts DBRX's name back, so a user reads
//! `attn_config.kv_n_heads`, the field they wrote.

use serde_json::{json, Map, Value};

use crate::hf::{HfError, HfJson};

use super::config::LlamaConfig;
use super::family::Family;
use super::own_names::{self, field, Default, Field};

/// Each flat field and where DBRX keeps it, with `DbrxConfig`'s (and
/// its sub-configs') default. The top level's first four may take
/// their flat names, as `DbrxConfig`'s `attribute_map` lets a config
/// spell them.
const FIELDS: [Field; 14] = [
    field("hidden_size", "d_model", Default::Int(2048), true),
    field("num_attention_heads", "n_heads", Default::Int(16), true),
    field("num_hidden_layers", "n_layers", Default::Int(24), true),
    field(
        "max_position_embeddings",
        "max_seq_len",
        Default::Int(2048),
        true,
    ),
    field("vocab_size", "vocab_size", Default::Int(32000), false),
    field("resid_pdrop", "resid_pdrop", Default::Float(0.0), false),
    field("emb_pdrop", "emb_pdrop", Default::Float(0.0), false),
    field(
        "attention_dropout",
        "attn_config.attn_pdrop",
        Default::Float(0.0),
        false,
    ),
    field("clip_qkv", "attn_config.clip_qkv", Default::Null, false),
    field(
        "num_key_value_heads",
        "attn_config.kv_n_heads",
        Default::Int(1),
        false,
    ),
    field(
        "rope_theta",
        "attn_config.rope_theta",
        Default::Float(10000.0),
        false,
    ),
    field(
        "intermediate_size",
        "ffn_config.ffn_hidden_size",
        Default::Int(3584),
        false,
    ),
    field(
        "num_local_experts",
        "ffn_config.moe_num_experts",
        Default::Int(4),
        false,
    ),
    field(
        "num_experts_per_tok",
        "ffn_config.moe_top_k",
        Default::Int(1),
        false,
    ),
];

/// The flat fields read beside [`FIELDS`] that need more than a copy.
const OTHERS: [(&str, &str); 4] = [
    ("hidden_act", "ffn_config.ffn_act_fn"),
    ("moe_jitter_eps", "ffn_config.moe_jitter_eps"),
    ("norm_topk_prob", "ffn_config.moe_normalize_expert_weights"),
    ("router_aux_loss_coef", "ffn_config.moe_loss_weight"),
];

/// What each sub-config's class takes (it raises on any other field);
/// `model_type` and the like it drops.
const ATTN: [&str; 4] = ["attn_pdrop", "clip_qkv", "kv_n_heads", "rope_theta"];
const FFN: [&str; 7] = [
    "ffn_act_fn",
    "ffn_hidden_size",
    "moe_num_experts",
    "moe_top_k",
    "moe_jitter_eps",
    "moe_loss_weight",
    "moe_normalize_expert_weights",
];
const DROPPED: [&str; 6] = [
    "model_type",
    "attn_implementation",
    "transformers_version",
    "_commit_hash",
    "torch_dtype",
    "dtype",
];

/// The DBRX config `j` as the flat config the shared reader reads (the
/// file's text kept: an export writes it back verbatim).
pub(super) fn flat(j: &HfJson) -> Result<HfJson, HfError> {
    let sub = |name: &str, known: &[&str]| -> Result<Map<String, Value>, HfError> {
        let map = match j.get(name) {
            None => Map::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(v) => return Err(j.field(format!("`{name}` is {v}, not an object"))),
        };
        let unknown = map
            .keys()
            .find(|k| !known.contains(&k.as_str()) && !DROPPED.contains(&k.as_str()));
        match unknown {
            Some(k) => Err(j.field(format!(
                "{name}.{k}: DbrxConfig's {name} has no such field (it takes {}); remove it",
                known.join(", ")
            ))),
            None => Ok(map),
        }
    };
    let (attn, ffn) = (sub("attn_config", &ATTN)?, sub("ffn_config", &FFN)?);
    if j.flag_or("tie_word_embeddings", false)? {
        return Err(j.field(
            "tie_word_embeddings true: DBRX's head is its own matrix (DbrxConfig refuses a tied one); set it to false".into(),
        ));
    }
    let mut out = Map::new();
    out.insert("model_type".into(), "dbrx".into());
    own_names::keep(j, &mut out);
    own_names::copy(
        j,
        &[("attn_config", &attn), ("ffn_config", &ffn)],
        &FIELDS,
        &mut out,
    );
    let act = match ffn.get("ffn_act_fn") {
        None | Some(Value::Null) => Value::from("silu"),
        Some(Value::Object(f)) => match (f.get("name"), f.len()) {
            (Some(name @ Value::String(_)), 1) => name.clone(),
            _ => {
                return Err(j.field(format!(
                    "ffn_config.ffn_act_fn {}: zrt reads an activation by its name alone ({{\"name\": \"silu\"}}); give the name without arguments",
                    Value::Object(f.clone())
                )))
            }
        },
        Some(v) => {
            return Err(j.field(format!(
                "ffn_config.ffn_act_fn {v}: an object naming the activation ({{\"name\": \"silu\"}})"
            )))
        }
    };
    out.insert("hidden_act".into(), act);
    let jitter = match ffn.get("moe_jitter_eps") {
        None | Some(Value::Null) => 0.0,
        Some(v) => match v.as_f64() {
            Some(eps) if (0.0..1.0).contains(&eps) => eps,
            _ => {
                return Err(j.field(format!(
                    "ffn_config.moe_jitter_eps {v}: the router's input is scaled by a uniform draw within 1 ± it, so it is a number in [0, 1) (or null: none)"
                )))
            }
        },
    };
    out.insert("moe_jitter_eps".into(), jitter.into());
    let normalize = match ffn.get("moe_normalize_expert_weights") {
        None => true,
        Some(Value::Null) => false,
        Some(v) if v.as_f64() == Some(1.0) => true,
        Some(v) => {
            return Err(j.field(format!(
                "ffn_config.moe_normalize_expert_weights {v}: zrt divides the chosen experts' weights by their sum (1, the published models' and the class's default) or not at all (null); set one of them"
            )))
        }
    };
    out.insert("norm_topk_prob".into(), normalize.into());
    // The routers' load-balancing loss's weight, read where the shared
    // reader reads the others' (`output_router_logits` is top-level).
    if let Some(w) = ffn.get("moe_loss_weight") {
        out.insert("router_aux_loss_coef".into(), w.clone());
    }
    Ok(j.reading(Value::Object(out)))
}

/// `e` with the flat fields it names renamed to DBRX's.
pub(super) fn dbrx_names(e: HfError) -> HfError {
    own_names::renamed_as(e, &FIELDS, &OTHERS)
}

/// `c`'s `config.json` as `DbrxConfig` reads it.
pub(super) fn to_json(c: &LlamaConfig) -> Value {
    debug_assert_eq!(c.family, Family::Dbrx);
    let moe = c.moe.as_ref();
    json!({
        "model_type": "dbrx",
        "architectures": [Family::Dbrx.architecture()],
        "vocab_size": c.vocab,
        "d_model": c.hidden,
        "n_heads": c.heads,
        "n_layers": c.layers,
        "max_seq_len": c.positions,
        "resid_pdrop": c.resid_dropout,
        "emb_pdrop": c.embedding_dropout,
        "pad_token_id": c.pad_token,
        "tie_word_embeddings": false,
        "output_router_logits": moe.and_then(|m| m.balance).is_some(),
        "attn_config": {
            "attn_pdrop": c.attention_dropout,
            "clip_qkv": c.clip_qkv,
            "kv_n_heads": c.kv_heads,
            "rope_theta": c.rope_theta,
        },
        "ffn_config": {
            "ffn_act_fn": {"name": c.activation.name()},
            "ffn_hidden_size": moe.map_or(c.intermediate, |m| m.intermediate),
            "moe_num_experts": moe.map_or(1, |m| m.experts),
            "moe_top_k": moe.map_or(1, |m| m.top_k),
            "moe_jitter_eps": moe.map(|m| m.jitter).filter(|&j| j > 0.0),
            "moe_normalize_expert_weights": moe.is_none_or(|m| m.normalize).then_some(1.0),
            // The class's default unless the model trains with another.
            "moe_loss_weight": moe.and_then(|m| m.balance).unwrap_or(0.01),
        },
    })
}
