//! Configs whose fields have names of their own (DBRX's, GPT-J's), read
//! as the flat config the other families share: each field copied under
//! the flat name the shared reader knows (its class's default when the
//! file leaves it out, which a flat config could not tell from another
//! class's), and the shared reader's errors renamed back, so that a
//! user reads the field they wrote.

use serde_json::{Map, Value};

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

/// A class default.
#[derive(Clone, Copy)]
pub(super) enum Default {
    Int(i64),
    Float(f64),
    Str(&'static str),
    Null,
}

impl Default {
    fn value(self) -> Value {
        match self {
            Self::Int(n) => n.into(),
            Self::Float(x) => x.into(),
            Self::Str(s) => s.into(),
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

/// `e` with the flat fields it names given their own names (`renames`:
/// flat, own), word by word, so that a name is renamed once
/// (`hidden_size` within `ffn_config.ffn_hidden_size` stays).
pub(super) fn renamed(e: HfError, renames: &[(&str, &str)]) -> HfError {
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

/// Into `out`, each of [`KEPT`] that `j` gives.
pub(super) fn keep(j: &HfJson, out: &mut Map<String, Value>) {
    for key in KEPT {
        if let Some(v) = j.get(key) {
            out.insert(key.into(), v.clone());
        }
    }
}
