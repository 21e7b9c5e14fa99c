//! Configs whose fields have names of their own (DBRX's, GPT-J's), read
//! as the flat config the other families share: each field copied under
//! the flat name the shared reader knows (its class's default when the
//! file leaves it out, which a flat config could not tell from another
//! class's), and the shared reader's errors renamed back, so that a
//! user reads the field they wrote.

use serde_json::{json, Map, Value};

use super::config::LlamaConfig;

use crate::hf::{HfError, HfJson};

/// A field: its flat name, its own (`attn_config.kv_n_heads` for one
/// nested in a sub-config), its class's default, and whether a config
/// may spell it by the flat name too (a class's `attribute_map`; the
/// flat name wins, as the class sets it after its own).
#[derive(Clone, Copy)]
pub(super) struct Field {
    pub(super) flat: &'static str,
    pub(super) own: &'static str,
    pub(super) default: Default,
    pub(super) aliased: bool,
}

/// A [`Field`] (a function, to keep tables of them short).
pub(super) const fn field(
    flat: &'static str,
    own: &'static str,
    default: Default,
    aliased: bool,
) -> Field {
    Field {
        flat,
        own,
        default,
        aliased,
    }
}

/// `layer_norm_epsilon`, under that name, nn.LayerNorm's 1e-5 by
/// default (GPT-2's heirs', MPT's, BLOOM's).
pub(super) const EPSILON: Field = field(
    "layer_norm_epsilon",
    "layer_norm_epsilon",
    Default::Float(1e-5),
    false,
);

/// A class default.
#[derive(Clone, Copy)]
pub(super) enum Default {
    Int(i64),
    Float(f64),
    Str(&'static str),
    Bool(bool),
    Null,
}

impl Default {
    fn value(self) -> Value {
        match self {
            Self::Int(n) => n.into(),
            Self::Float(x) => x.into(),
            Self::Str(s) => s.into(),
            Self::Bool(b) => b.into(),
            Self::Null => Value::Null,
        }
    }
}

/// Into `out`, each of `fields` as `j` gives it (a nested one from the
/// sub-config `subs` holds under its first name), or its default.
pub(super) fn copy(
    j: &HfJson,
    subs: &[(&str, &Map<String, Value>)],
    fields: &[Field],
    out: &mut Map<String, Value>,
) {
    for f in fields {
        let own = match f.own.split_once('.') {
            Some((sub, key)) => (subs.iter())
                .find(|(name, _)| *name == sub)
                .and_then(|(_, map)| map.get(key).cloned()),
            None => j.get(f.own).cloned(),
        };
        let given = match f.aliased {
            true => j.get(f.flat).cloned().or(own),
            false => own,
        };
        out.insert(f.flat.into(), given.unwrap_or_else(|| f.default.value()));
    }
}

/// `e` with the flat fields it names given their own names: `fields`'
/// and `others` (flat, own) read beside them.
pub(super) fn renamed_as(e: HfError, fields: &[Field], others: &[(&str, &str)]) -> HfError {
    let renames: Vec<(&str, &str)> = (fields.iter().map(|f| (f.flat, f.own)))
        .chain(others.iter().copied())
        .collect();
    renamed(e, &renames)
}

/// `e` with the flat fields it names given their own names (`renames`:
/// flat, own), word by word, so that a name is renamed once
/// (`hidden_size` within `ffn_config.ffn_hidden_size` stays).
fn renamed(e: HfError, renames: &[(&str, &str)]) -> HfError {
    let HfError::Field { path, msg } = e else {
        return e;
    };
    let rename = |word: &str| renames.iter().find(|(flat, _)| *flat == word).map(|r| r.1);
    let mut out = String::with_capacity(msg.len());
    let mut word = String::new();
    for ch in msg.chars().chain(std::iter::once('\0')) {
        if ch.is_ascii_alphanumeric() || ch == '_' || ch == '.' {
            word.push(ch);
            continue;
        }
        out.push_str(rename(&word).unwrap_or(&word));
        word.clear();
        if ch != '\0' {
            out.push(ch);
        }
    }
    HfError::Field { path, msg: out }
}

/// The top-level fields the shared reader takes as every class names
/// them.
pub(super) const KEPT: [&str; 8] = [
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "output_router_logits",
    "tie_word_embeddings",
    "use_cache",
    "dtype",
    "torch_dtype",
];

/// Into `out`, each of a family's own fields `keys` that `j` has, null
/// too (a null the family's reader tells from a missing field, xLSTM's
/// caps; the other readers read null as missing).
pub(super) fn keep_own(j: &HfJson, keys: &[&str], out: &mut Map<String, Value>) {
    for key in keys.iter().filter(|k| j.has(k)) {
        let v = j.get(key).cloned().unwrap_or(Value::Null);
        out.insert((*key).into(), v);
    }
}

/// Into `out`, each of [`KEPT`] that `j` gives.
pub(super) fn keep(j: &HfJson, out: &mut Map<String, Value>) {
    for key in KEPT {
        if let Some(v) = j.get(key) {
            out.insert(key.into(), v.clone());
        }
    }
}

/// The defaults of a config class that names its sizes as GPT-2's does
/// (`GPTJConfig`, `CodeGenConfig`, `GPTBigCodeConfig`).
pub(super) struct Gpt2Defaults {
    pub(super) width: i64,
    pub(super) heads: i64,
    pub(super) layers: i64,
    pub(super) positions: i64,
    pub(super) vocab: i64,
    pub(super) activation: &'static str,
    /// `resid_pdrop`, `embd_pdrop` and `attn_pdrop`'s.
    pub(super) dropout: f64,
}

/// The fields such a class names as GPT-2 does, with its defaults; the
/// first four as its `attribute_map` lets a config spell them too.
pub(super) const fn gpt2_fields(d: Gpt2Defaults) -> [Field; 10] {
    [
        field("hidden_size", "n_embd", Default::Int(d.width), true),
        field("num_attention_heads", "n_head", Default::Int(d.heads), true),
        field("num_hidden_layers", "n_layer", Default::Int(d.layers), true),
        field(
            "max_position_embeddings",
            "n_positions",
            Default::Int(d.positions),
            true,
        ),
        field("vocab_size", "vocab_size", Default::Int(d.vocab), false),
        field(
            "hidden_act",
            "activation_function",
            Default::Str(d.activation),
            false,
        ),
        EPSILON,
        field(
            "resid_pdrop",
            "resid_pdrop",
            Default::Float(d.dropout),
            false,
        ),
        field("embd_pdrop", "embd_pdrop", Default::Float(d.dropout), false),
        field(
            "attention_dropout",
            "attn_pdrop",
            Default::Float(d.dropout),
            false,
        ),
    ]
}

/// A config `j` without sub-configs read flat as `model_type`: [`KEPT`]
/// and `fields` copied, and its width and heads when both are sizes
/// (`None`: the shared reader names the field that is not).
pub(super) fn flat_with(
    j: &HfJson,
    model_type: &str,
    fields: &[Field],
) -> (Map<String, Value>, Option<(i64, i64)>) {
    let mut out = Map::new();
    out.insert("model_type".into(), model_type.into());
    keep(j, &mut out);
    copy(j, &[], fields, &mut out);
    let size = |key: &str| out.get(key).and_then(Value::as_i64).filter(|&n| n > 0);
    let sizes = size("hidden_size").zip(size("num_attention_heads"));
    (out, sizes)
}

/// A Mamba's config `j` (nothing attends, no MLP) read flat as
/// `model_type`: [`flat_with`], one attention head (none is built), and
/// `intermediate_size` the scan's inner width (`mamba_expand` times the
/// width), which the shared reader takes as the MLP's.
pub(super) fn attention_free(j: &HfJson, model_type: &str, fields: &[Field]) -> Map<String, Value> {
    let (mut out, _) = flat_with(j, model_type, fields);
    out.insert("num_attention_heads".into(), 1.into());
    let size = |key: &str| out.get(key).and_then(Value::as_i64).filter(|&n| n > 0);
    if let (Some(hidden), Some(expand)) = (size("hidden_size"), size("mamba_expand")) {
        out.insert("intermediate_size".into(), (expand * hidden).into());
    }
    out
}

/// A GPT-2-named config `j` read flat as `model_type`
/// ([`flat_with`]), the MLP `n_inner` wide (null: four times the
/// width).
pub(super) fn gpt2_flat(
    j: &HfJson,
    model_type: &str,
    fields: &[Field],
) -> (Map<String, Value>, Option<(i64, i64)>) {
    let (mut out, sizes) = flat_with(j, model_type, fields);
    let Some((hidden, heads)) = sizes else {
        return (out, None);
    };
    let width = match j.get("n_inner") {
        None => Value::from(4 * hidden),
        Some(v) => v.clone(),
    };
    out.insert("intermediate_size".into(), width);
    (out, Some((hidden, heads)))
}

/// `c`'s `config.json` as a GPT-2-named class reads it, with the
/// family's `extra` fields.
pub(super) fn gpt2_json(c: &LlamaConfig, extra: Value) -> Value {
    let mut json = json!({
        "model_type": c.family.model_type(),
        "architectures": [c.family.architecture()],
        "vocab_size": c.vocab,
        "n_embd": c.hidden,
        "n_head": c.heads,
        "n_layer": c.layers,
        "n_positions": c.positions,
        "n_inner": c.intermediate,
        "activation_function": c.activation.name(),
        "layer_norm_epsilon": c.eps,
        "resid_pdrop": c.resid_dropout,
        "embd_pdrop": c.embedding_dropout,
        "attn_pdrop": c.attention_dropout,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    });
    if let (Some(all), Value::Object(extra)) = (json.as_object_mut(), extra) {
        all.extend(extra);
    }
    json
}
