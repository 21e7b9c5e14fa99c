//! The config's `rope_scaling`: how the rotary embedding's frequencies
//! are scaled ([`RopeScaling`]), read from the config and written back.

use crate::hf::{HfError, HfJson};

use super::family::Family;

/// How the rotary embedding's frequencies are scaled: the config's
/// `rope_scaling`.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// None: `rope_theta`'s frequencies.
    None,
    /// `"linear"`: every frequency divided by `factor`.
    Linear {
        /// `factor`.
        factor: f64,
    },
    /// `"dynamic"` (dynamic NTK): for a sequence of `n` tokens longer
    /// than `max_position_embeddings` `m`, the base grows to
    /// `rope_theta * (factor * n / m - (factor - 1))^(d / (d - 2))` (`d`
    /// the dimensions turned). As `transformers` does, a model keeps
    /// the longest such sequence's frequencies for the sequences after
    /// it, until one shorter than `m` comes (whose are `rope_theta`'s).
    Dynamic {
        /// `factor`.
        factor: f64,
    },
    /// Hunyuan's `"dynamic"` with an `alpha` (`transformers`' HunYuan
    /// rotary embedding reads it; no other class does): up to
    /// `max_position_embeddings` the base is `rope_theta * alpha^(d / (d
    /// - 2))`, past it [`Self::Dynamic`]'s growth of `rope_theta` itself
    /// (as `transformers` computes it, the alpha left out).
    DynamicAlpha {
        /// `factor`.
        factor: f64,
        /// `alpha`.
        alpha: f64,
    },
    /// `"llama3"` (Llama 3.1 and 3.2): long wavelengths divided by
    /// `factor`, short ones kept, those between interpolated.
    Llama3 {
        /// `factor`.
        factor: f64,
        /// `low_freq_factor`.
        low_freq_factor: f64,
        /// `high_freq_factor`.
        high_freq_factor: f64,
        /// `original_max_position_embeddings`.
        original_positions: f64,
    },
    /// `"longrope"` (Phi-3.5, Phi-4-mini, Phi-3's 128k releases): each
    /// frequency divided by its own factor, from `short_factor` for a
    /// sequence up to `original_positions` long and from `long_factor`
    /// beyond, the cosines and sines multiplied by `attention_factor`.
    LongRope {
        /// `short_factor`: one a rotated pair.
        short: Vec<f64>,
        /// `long_factor`: one a rotated pair.
        long: Vec<f64>,
        /// `original_max_position_embeddings` (a top-level field; else
        /// `max_position_embeddings`).
        original_positions: i64,
        /// `attention_factor`, or as `transformers` derives it from the
        /// context's growth `f = max_position_embeddings /
        /// original_max_position_embeddings` (or `factor`):
        /// `sqrt(1 + ln f / ln original)`, 1 when `f <= 1`.
        attention_factor: f64,
        /// PhiMoE's `short_mscale` and `long_mscale`: the factor on the
        /// cosines and sines for a sequence up to `original_positions`
        /// long and beyond, in place of `attention_factor` (`None`: the
        /// other families).
        mscales: Option<(f64, f64)>,
    },
    /// `"yarn"` (Qwen's and SmolLM3's long-context configs): frequencies
    /// that turn fewer than `beta_slow` times over the pretrained length
    /// divided by `factor`, those turning more than `beta_fast` times
    /// kept, a linear ramp between; the cosines and sines multiplied by
    /// `attention_factor`.
    Yarn {
        /// `factor`.
        factor: f64,
        /// `original_max_position_embeddings` (of `rope_scaling`, else
        /// `max_position_embeddings`).
        original_positions: f64,
        /// `beta_fast` (32 unless given).
        beta_fast: f64,
        /// `beta_slow` (1 unless given).
        beta_slow: f64,
        /// `truncate` (true unless given): the ramp's ends rounded out
        /// to whole dimensions.
        truncate: bool,
        /// `attention_factor`, or `0.1 ln(factor) + 1` (DeepSeek's
        /// `mscale` and `mscale_all_dim` when both are given: their
        /// ratio).
        attention_factor: f64,
    },
}

impl RopeScaling {
    /// Its `factor`: `None` unscaled, and for LongRoPE (a factor a pair).
    pub(crate) fn factor(&self) -> Option<f64> {
        match self {
            Self::None | Self::LongRope { .. } => None,
            Self::Linear { factor }
            | Self::Dynamic { factor }
            | Self::DynamicAlpha { factor, .. }
            | Self::Llama3 { factor, .. }
            | Self::Yarn { factor, .. } => Some(*factor),
        }
    }

    /// Its `rope_scaling` in a `config.json` (null for none); `phi3`:
    /// in the three keys Phi-3's config class takes.
    pub(crate) fn to_json(&self, phi3: bool) -> serde_json::Value {
        match self {
            RopeScaling::None => serde_json::Value::Null,
            RopeScaling::Linear { factor } => {
                serde_json::json!({"rope_type": "linear", "factor": factor})
            }
            RopeScaling::Dynamic { factor } => {
                serde_json::json!({"rope_type": "dynamic", "factor": factor})
            }
            RopeScaling::DynamicAlpha { factor, alpha } => {
                serde_json::json!({"rope_type": "dynamic", "factor": factor, "alpha": alpha})
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_positions,
            } => serde_json::json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_positions,
            }),
            // Phi-3's config class takes exactly these three keys.
            RopeScaling::LongRope { short, long, .. } if phi3 => {
                serde_json::json!({"type": "longrope", "short_factor": short, "long_factor": long})
            }
            RopeScaling::LongRope {
                short,
                long,
                attention_factor,
                mscales,
                original_positions,
            } => {
                let mut v = serde_json::json!({
                    "rope_type": "longrope",
                    "short_factor": short,
                    "long_factor": long,
                    "attention_factor": attention_factor,
                });
                // PhiMoE's class reads these three within.
                if let Some((short, long)) = mscales {
                    v["short_mscale"] = (*short).into();
                    v["long_mscale"] = (*long).into();
                    v["original_max_position_embeddings"] = (*original_positions).into();
                }
                v
            }
            RopeScaling::Yarn {
                factor,
                original_positions,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
            } => {
                let mut v = serde_json::json!({
                    "rope_type": "yarn",
                    "factor": factor,
                    "original_max_position_embeddings": original_positions,
                    "beta_fast": beta_fast,
                    "beta_slow": beta_slow,
                    "truncate": truncate,
                });
                // Written where it is not what `transformers` computes
                // from the factor alone, so that a config that left it
                // out reads back as the same config.
                if *attention_factor != yarn_mscale(*factor, 1.0) {
                    v["attention_factor"] = (*attention_factor).into();
                }
                v
            }
        }
    }
}

/// The config's `rope_scaling`: none, or a kind this model computes
/// (`rotary_dim` the dimensions of a head it turns), for a model of
/// `model_type`. Phi-3's config class reads `"su"` and `"yarn"` as
/// `"longrope"`.
pub(crate) fn rope_scaling(
    j: &HfJson,
    model_type: &str,
    rotary_dim: i64,
) -> Result<RopeScaling, HfError> {
    // GPT-OSS's and Apertus's classes scale by default: left out (not
    // null), their YaRN and Llama 3's, read as a config giving them.
    let default = match model_type {
        t if t == Family::GptOss.model_type() => Some(serde_json::json!({"rope_type": "yarn",
            "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false,
            "original_max_position_embeddings": 4096})),
        t if t == Family::Apertus.model_type() => Some(serde_json::json!({"rope_type": "llama3",
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192})),
        _ => None,
    };
    let v = match (j.get("rope_scaling"), default) {
        (Some(v), _) => v.clone(),
        (None, Some(d)) if !j.has("rope_scaling") => d,
        _ => return Ok(RopeScaling::None),
    };
    let v = &v;
    let kind = (v.get("rope_type").or_else(|| v.get("type"))).and_then(|t| t.as_str());
    let num = |key: &str| scaling_number(j, v, key);
    let phi3 = model_type == Family::Phi3.model_type();
    let phimoe = model_type == Family::Phimoe.model_type();
    match kind {
        Some("default") => Ok(RopeScaling::None),
        Some("longrope") if phimoe => phimoe_long_rope(j, v, rotary_dim),
        // PhiMoE's rotary embedding scales by its own factors and reads
        // its pretrained length within whatever the kind.
        _ if phimoe => Err(j.field(format!(
            "rope_scaling {v}: zrt computes PhiMoE's \"longrope\" kind only (with its `short_mscale`, `long_mscale` and `original_max_position_embeddings`)"
        ))),
        Some("longrope") | Some("su") => long_rope(j, v, rotary_dim),
        Some("yarn") if phi3 => long_rope(j, v, rotary_dim),
        // Phi-3's config class refuses every other kind.
        Some("linear") if !phi3 => Ok(RopeScaling::Linear {
            factor: num("factor")?,
        }),
        // Hunyuan's class reads an alpha when it is there and not 0.
        Some("dynamic") if Family::of(model_type).is_some_and(Family::hunyuan) => {
            let alpha = match v.get("alpha") {
                None | Some(serde_json::Value::Null) => None,
                Some(_) => Some(num("alpha")?).filter(|a| *a != 0.0),
            };
            match alpha {
                Some(alpha) => Ok(RopeScaling::DynamicAlpha {
                    factor: num("factor")?,
                    alpha,
                }),
                None => Ok(RopeScaling::Dynamic {
                    factor: num("factor")?,
                }),
            }
        }
        Some("dynamic") if !phi3 => Ok(RopeScaling::Dynamic {
            factor: num("factor")?,
        }),
        Some("llama3") if !phi3 => Ok(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_positions: num("original_max_position_embeddings")?,
        }),
        Some("yarn") => yarn(j, v),
        _ => Err(j.field(format!(
            "rope_scaling {v}: this {model_type} computes the {} kinds only",
            match phi3 {
                true => "\"longrope\" (\"su\", \"yarn\")",
                false => "\"linear\", \"dynamic\", \"llama3\", \"longrope\" and \"yarn\"",
            }
        ))),
    }
}

/// Field `key` of the config's `rope_scaling` `v`, a number.
fn scaling_number(j: &HfJson, v: &serde_json::Value, key: &str) -> Result<f64, HfError> {
    (v.get(key).and_then(|n| n.as_f64())).ok_or_else(|| {
        j.field(format!(
            "rope_scaling {v}: its `{key}` is missing or not a number"
        ))
    })
}

/// `transformers`' `get_mscale`: YaRN's attention factor for a
/// `scale`, with DeepSeek's `m`.
fn yarn_mscale(scale: f64, m: f64) -> f64 {
    match scale <= 1.0 {
        true => 1.0,
        false => 0.1 * m * scale.ln() + 1.0,
    }
}

/// The `"yarn"` scaling `v` ([`RopeScaling::Yarn`]), read as
/// `transformers` reads it.
fn yarn(j: &HfJson, v: &serde_json::Value) -> Result<RopeScaling, HfError> {
    let num = |key: &str| v.get(key).filter(|n| !n.is_null());
    let number = |key: &str, default: f64| match num(key) {
        None => Ok(default),
        Some(_) => scaling_number(j, v, key),
    };
    let factor = scaling_number(j, v, "factor")?;
    let positions = j.size_or_none("max_position_embeddings")?.unwrap_or(2048) as f64;
    let mscale = yarn_mscale;
    let attention_factor = match (
        num("attention_factor"),
        num("mscale"),
        num("mscale_all_dim"),
    ) {
        (Some(_), _, _) => number("attention_factor", 1.0)?,
        (None, Some(_), Some(_)) => {
            let (m, all) = (number("mscale", 1.0)?, number("mscale_all_dim", 1.0)?);
            match m != 0.0 && all != 0.0 {
                true => mscale(factor, m) / mscale(factor, all),
                false => mscale(factor, 1.0),
            }
        }
        _ => mscale(factor, 1.0),
    };
    let truncate = match num("truncate") {
        None => true,
        Some(t) => t.as_bool().ok_or_else(|| {
            j.field(format!(
                "rope_scaling {v}: its `truncate` is not true or false"
            ))
        })?,
    };
    Ok(RopeScaling::Yarn {
        factor,
        original_positions: number("original_max_position_embeddings", positions)?,
        beta_fast: number("beta_fast", 32.0)?,
        beta_slow: number("beta_slow", 1.0)?,
        truncate,
        attention_factor,
    })
}

/// The `"longrope"` scaling `v` of a config whose heads turn
/// `rotary_dim` dimensions ([`RopeScaling::LongRope`]), read as
/// `transformers` reads it.
fn long_rope(j: &HfJson, v: &serde_json::Value, rotary_dim: i64) -> Result<RopeScaling, HfError> {
    let original = j.size_or_none("original_max_position_embeddings")?;
    long_rope_from(j, v, rotary_dim, (original, None))
}

/// [`long_rope`] with the pretrained length `original` (`None`: not
/// given, `max_position_embeddings` is) and PhiMoE's `mscales`.
fn long_rope_from(
    j: &HfJson,
    v: &serde_json::Value,
    rotary_dim: i64,
    (original, mscales): (Option<i64>, Option<(f64, f64)>),
) -> Result<RopeScaling, HfError> {
    let pairs = (rotary_dim / 2) as usize;
    let factors = |key: &str| {
        let list = v
            .get(key)
            .and_then(|l| l.as_array())
            .and_then(|l| l.iter().map(|n| n.as_f64()).collect::<Option<Vec<f64>>>());
        match list {
            Some(l) if l.len() == pairs => Ok(l),
            Some(l) => Err(j.field(format!(
                "rope_scaling: its `{key}` has {} numbers, one for each of the {pairs} pairs a head turns",
                l.len()
            ))),
            None => Err(j.field(format!(
                "rope_scaling: its `{key}` is missing or not a list of numbers"
            ))),
        }
    };
    let (short, long) = (factors("short_factor")?, factors("long_factor")?);
    let positions = j.size_or_none("max_position_embeddings")?.unwrap_or(2048);
    // Phi-3 keeps the pretrained length beside the extended one, and
    // their ratio is the growth; else `factor` says it.
    let (original_positions, growth) = match original {
        Some(o) => (o, Some(positions as f64 / o as f64)),
        None => (positions, v.get("factor").and_then(|f| f.as_f64())),
    };
    let attention_factor = match (v.get("attention_factor").and_then(|a| a.as_f64()), growth) {
        (Some(a), _) => a,
        (None, Some(f)) if f <= 1.0 => 1.0,
        (None, Some(f)) => (1.0 + f.ln() / (original_positions as f64).ln()).sqrt(),
        (None, None) => {
            return Err(j.field(
                "rope_scaling longrope: give `attention_factor`, `factor` or a top-level `original_max_position_embeddings`".into(),
            ))
        }
    };
    Ok(RopeScaling::LongRope {
        short,
        long,
        original_positions,
        attention_factor,
        mscales,
    })
}

/// PhiMoE's `"longrope"` scaling `v` ([`long_rope`]'s, with its
/// `short_mscale` and `long_mscale`): its config class refuses a scaling
/// without them, and takes the pretrained length from within `v`, where
/// its rotary embedding reads it.
fn phimoe_long_rope(
    j: &HfJson,
    v: &serde_json::Value,
    rotary_dim: i64,
) -> Result<RopeScaling, HfError> {
    let mscales = (
        scaling_number(j, v, "short_mscale")?,
        scaling_number(j, v, "long_mscale")?,
    );
    let original = scaling_number(j, v, "original_max_position_embeddings")?;
    long_rope_from(j, v, rotary_dim, (Some(original as i64), Some(mscales)))
}
