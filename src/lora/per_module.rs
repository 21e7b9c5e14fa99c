//! What PEFT decides module by module: which layers take adapters
//! (`layers_to_transform`, `layers_pattern`) and the rank and alpha a
//! module's adapter takes (`rank_pattern`, `alpha_pattern`), matched as
//! PEFT 0.18 matches them (`check_target_module_exists`,
//! `get_pattern_key`).
//!
//! PEFT keeps both patterns as Python dicts, whose order decides which
//! key a module takes when several match: they are read and written
//! here in the file's order ([`Ordered`]), where a `serde_json::Map`
//! would sort them.

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, Serializer};

/// The index of the layer the module `module` is in, as PEFT finds it
/// for `layers_to_transform`: the number after the last component
/// (matched greedily) that is followed by one, or, given
/// `layers_pattern`, after the first of them (a regular expression)
/// that precedes one. `None` when the name has none (`lm_head`,
/// `model.embed_tokens`).
pub(super) fn layer_index(module: &str, layers_pattern: &[String]) -> Option<i64> {
    let patterns: Vec<String> = match layers_pattern {
        [] => vec![r"^.*\.[^.]*\.(\d+)\.".into()],
        given => (given.iter())
            .map(|p| format!(r"^.*\.(?:{p})\.(\d+)\."))
            .collect(),
    };
    patterns.iter().find_map(|p| {
        let re = regex::Regex::new(p).ok()?;
        re.captures(module)?.get(1)?.as_str().parse().ok()
    })
}

/// Whether the key `key` of `rank_pattern` or `alpha_pattern` (a
/// regular expression) names the module `module`: the whole name, or
/// its end after a dot (PEFT's `re.match(rf"(.*\.)?({key})$", name)`).
pub(super) fn key_names(key: &str, module: &str) -> bool {
    key_pattern(key).is_ok_and(|r| r.is_match(module))
}

/// The regular expression [`key_names`] matches with.
pub(super) fn key_pattern(key: &str) -> Result<regex::Regex, regex::Error> {
    regex::Regex::new(&format!(r"^(?:.*\.)?(?:{key})$"))
}

/// The value of the first key in `pairs` naming `module` (PEFT takes
/// the dict's first match), if any.
pub(super) fn first_match<T: Copy>(pairs: &[(String, T)], module: &str) -> Option<T> {
    (pairs.iter())
        .find(|(k, _)| key_names(k, module))
        .map(|&(_, v)| v)
}

/// A JSON object's entries in the order they are written: PEFT's
/// `rank_pattern` and `alpha_pattern`, whose first matching key wins.
#[derive(Debug, Clone, PartialEq, Default)]
pub(super) struct Ordered<T>(pub(super) Vec<(String, T)>);

impl<T: Serialize> Serialize for Ordered<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Ordered<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Entries<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for Entries<T> {
            type Value = Ordered<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of module names (or patterns) and numbers")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut m: M) -> Result<Self::Value, M::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = m.next_entry()? {
                    entries.push(entry);
                }
                Ok(Ordered(entries))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Ordered(Vec::new()))
            }
        }
        d.deserialize_any(Entries(std::marker::PhantomData))
    }
}

/// The fields of an `adapter_config.json` whose order matters, read in
/// the file's order.
#[derive(Debug, Default, serde::Deserialize)]
pub(super) struct Patterns {
    /// `rank_pattern`, absent or null read as empty.
    #[serde(default)]
    pub(super) rank_pattern: Ordered<i64>,
    /// `alpha_pattern`, likewise.
    #[serde(default)]
    pub(super) alpha_pattern: Ordered<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_indices_are_found_as_peft_finds_them() {
        assert_eq!(layer_index("model.layers.3.self_attn.q_proj", &[]), Some(3));
        assert_eq!(layer_index("transformer.h.11.attn.c_attn", &[]), Some(11));
        // Greedy: the last numbered component followed by more.
        assert_eq!(layer_index("model.layers.1.mlp.experts.7.w1", &[]), Some(7));
        assert_eq!(layer_index("model.layers.1.mlp.experts.7", &[]), Some(1));
        // No component before the number, or none after it: no layer.
        assert_eq!(layer_index("layers.3.q_proj", &[]), None);
        assert_eq!(layer_index("lm_head", &[]), None);
        assert_eq!(layer_index("model.embed_tokens", &[]), None);
        let layers = ["layers".to_string()];
        assert_eq!(
            layer_index("model.layers.1.mlp.experts.7.w1", &layers),
            Some(1)
        );
        assert_eq!(layer_index("transformer.h.2.attn.c_attn", &layers), None);
        let either = ["blocks".to_string(), "h".to_string()];
        assert_eq!(layer_index("transformer.h.2.attn.c_attn", &either), Some(2));
    }

    #[test]
    fn pattern_keys_match_a_name_or_its_end_and_the_first_wins() {
        assert!(key_names("q_proj", "model.layers.0.self_attn.q_proj"));
        assert!(key_names("q_proj", "q_proj"));
        assert!(!key_names("q_proj", "model.layers.0.self_attn.qq_proj"));
        assert!(!key_names("q_proj", "model.layers.0.self_attn.q_proj.x"));
        // A regular expression, anchored at the start by `^` alone.
        assert!(key_names(
            r"layers\.[01]\.self_attn\..*",
            "model.layers.1.self_attn.v_proj"
        ));
        assert!(key_names(
            "^model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.q_proj"
        ));
        assert!(!key_names(
            "^layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.q_proj"
        ));
        let pairs = vec![("v_proj".to_string(), 2), (r"layers\.1\..*".to_string(), 8)];
        assert_eq!(
            first_match(&pairs, "model.layers.1.self_attn.v_proj"),
            Some(2)
        );
        assert_eq!(
            first_match(&pairs, "model.layers.1.self_attn.q_proj"),
            Some(8)
        );
        assert_eq!(first_match(&pairs, "model.layers.0.self_attn.q_proj"), None);
    }

    #[test]
    fn patterns_read_and_write_in_the_files_order() {
        let p: Patterns = serde_json::from_str(
            r#"{"r": 4, "rank_pattern": {"z": 1, "a": 2}, "alpha_pattern": null}"#,
        )
        .unwrap();
        assert_eq!(
            p.rank_pattern.0,
            [("z".to_string(), 1), ("a".to_string(), 2)]
        );
        assert!(p.alpha_pattern.0.is_empty());
        assert_eq!(
            serde_json::to_string(&p.rank_pattern).unwrap(),
            r#"{"z":1,"a":2}"#
        );
        let none: Patterns = serde_json::from_str("{}").unwrap();
        assert!(none.rank_pattern.0.is_empty());
        assert!(serde_json::from_str::<Patterns>(r#"{"rank_pattern": {"q": "8"}}"#).is_err());
    }
}
