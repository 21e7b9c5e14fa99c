//! What the Hugging Face model layouts ([`crate::gpt2`], [`crate::llama`])
//! share: reading a `config.json` as `transformers`' `save_pretrained`
//! writes it, and its errors.

use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

/// Why a `config.json` is not a model this crate can build.
#[derive(Debug, thiserror::Error)]
pub enum HfConfigError {
    /// The file could not be read or parsed.
    #[error("{path}: {msg}")]
    Read {
        /// The config file.
        path: PathBuf,
        /// What went wrong.
        msg: String,
    },
    /// A field is missing, of the wrong type, or asks for what the model
    /// does not compute.
    #[error("{path}: {msg}")]
    Field {
        /// The config file.
        path: PathBuf,
        /// Which field and why.
        msg: String,
    },
}

/// A parsed `config.json`, its fields read with errors naming them.
pub(crate) struct HfJson {
    path: PathBuf,
    json: serde_json::Value,
}

impl HfJson {
    /// Reads `dir/config.json`, or `dir` itself when it is a file, and
    /// checks its `model_type` is `model_type`.
    pub(crate) fn read(dir: &Path, model_type: &str) -> Result<Self, HfConfigError> {
        let path = match dir.is_dir() {
            true => dir.join("config.json"),
            false => dir.to_path_buf(),
        };
        let read = |msg: String| HfConfigError::Read {
            path: path.clone(),
            msg,
        };
        let text =
            std::fs::read_to_string(&path).map_err(|e| read(format!("cannot read it: {e}")))?;
        let json = serde_json::from_str(&text).map_err(|e| read(format!("not JSON ({e})")))?;
        let me = Self { path, json };
        match me.get("model_type").and_then(|v| v.as_str()) {
            Some(t) if t == model_type => Ok(me),
            other => Err(me.field(format!(
                "model_type is {other:?}, not \"{model_type}\": this is another architecture's config"
            ))),
        }
    }

    /// A [`HfConfigError::Field`] saying `msg`.
    pub(crate) fn field(&self, msg: String) -> HfConfigError {
        HfConfigError::Field {
            path: self.path.clone(),
            msg,
        }
    }

    /// Field `key`, unless absent or null.
    pub(crate) fn get(&self, key: &str) -> Option<&serde_json::Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }

    /// Field `key`, a positive integer.
    pub(crate) fn size(&self, key: &str) -> Result<i64, HfConfigError> {
        self.get(key)
            .and_then(|v| v.as_i64())
            .filter(|&n| n > 0)
            .ok_or_else(|| self.field(format!("`{key}` is missing or not a positive integer")))
    }

    /// Field `key`, a positive integer, or `None` when absent or null.
    pub(crate) fn size_or_none(&self, key: &str) -> Result<Option<i64>, HfConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.size(key).map(Some),
        }
    }

    /// Field `key`, a number, or `default` when absent or null.
    pub(crate) fn number_or(&self, key: &str, default: f64) -> Result<f64, HfConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.field(format!("`{key}` is {v}, not a number"))),
        }
    }

    /// Field `key`, a boolean, or `default` when absent or null.
    pub(crate) fn flag_or(&self, key: &str, default: bool) -> Result<bool, HfConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.field(format!("`{key}` is {v}, not true or false"))),
        }
    }

    /// Refuses field `key` unless absent or `want` (a string).
    pub(crate) fn only(&self, key: &str, want: &str, why: &str) -> Result<(), HfConfigError> {
        match self.get(key) {
            Some(v) if v.as_str() != Some(want) => Err(self.field(format!("{key} {v}: {why}"))),
            _ => Ok(()),
        }
    }
}

/// A causal language model's loss as `transformers` computes it with
/// `labels = tokens`: the mean cross-entropy of `logits` `[batch, seq,
/// vocab]` at positions `..seq-1` predicting `tokens[:, 1:]`, in fp32.
pub fn causal_lm_loss(logits: &Tensor, tokens: &Tensor) -> Tensor {
    let t = tokens.size().get(1).copied().unwrap_or(2);
    let vocab = logits.size().last().copied().unwrap_or(1);
    let y = tokens.narrow(1, 1, t - 1);
    (logits
        .narrow(1, 0, t - 1)
        .to_kind(Kind::Float)
        .reshape([-1, vocab]))
    .cross_entropy_for_logits(&y.reshape([-1]))
}
