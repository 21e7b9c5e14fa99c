//! Keys a JSON object repeats. `serde_json` keeps the last one without a
//! word; DeepSpeed refuses such a config ("Duplicate keys in DeepSpeed
//! config"), and so does zrt: a `"stage": 3` followed further down by a
//! forgotten `"stage": 1` would otherwise train at stage 1.

use std::collections::HashSet;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// The dotted paths (`zero_optimization.stage`, `a.b[2].c`) of the keys an
/// object of `text` repeats, in document order. Empty when there are none,
/// or when `text` is not JSON (the parser reports that).
pub(super) fn duplicate_keys(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut de = serde_json::Deserializer::from_str(text);
    let _ = Walk {
        path: String::new(),
        found: &mut found,
    }
    .deserialize(&mut de);
    found
}

/// Visits one value at `path`, recording repeated keys into `found`.
struct Walk<'a> {
    path: String,
    found: &'a mut Vec<String>,
}

impl<'de> DeserializeSeed<'de> for Walk<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let Walk { path, found } = self;
        let mut i = 0;
        while seq
            .next_element_seed(Walk {
                path: format!("{path}[{i}]"),
                found: &mut *found,
            })?
            .is_some()
        {
            i += 1;
        }
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let Walk { path, found } = self;
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            let at = match path.is_empty() {
                true => key.clone(),
                false => format!("{path}.{key}"),
            };
            if !seen.insert(key) {
                found.push(at.clone());
            }
            map.next_value_seed(Walk {
                path: at,
                found: &mut *found,
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::duplicate_keys;

    #[test]
    fn repeated_keys_are_found_at_any_depth_and_nothing_else() {
        let text = r#"{"a": 1, "z": {"stage": 3, "x": [{"k": 1, "k": 2}], "stage": 1}, "a": 2}"#;
        assert_eq!(duplicate_keys(text), ["z.x[0].k", "z.stage", "a"]);
        assert!(duplicate_keys(r#"{"a": {"b": 1}, "b": {"b": [1, 1]}}"#).is_empty());
        assert!(duplicate_keys("not json").is_empty());
        // Array elements are numbered from 0 in the path.
        assert_eq!(
            duplicate_keys(r#"{"x": [1, 2, {"k": 1, "k": 2}]}"#),
            ["x[2].k"]
        );
    }
}
