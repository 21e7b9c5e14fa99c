//! Llama as Hugging Face's `transformers` lays it out
//! (`LlamaForCausalLM`, and Mistral's, Qwen2's and Qwen3's, the same layers: see
//! [`Family`]), in tch, its decoder layers wrapped in [`ShardedModule`]:
//! a `save_pretrained` checkpoint loads into it under any ZeRO stage
//! without a rank holding the whole model, and a fine-tuned one is
//! written back for `from_pretrained`.
//!
//! Its VarStore names are Hugging Face's own (`model.embed_tokens`,
//! `model.layers.0.self_attn.q_proj`, ..., `model.norm`, `lm_head`) and
//! its matrices are `nn.Linear`'s, so a file loads as it is
//! ([`hf_weight_rules`] only skips what the model does not hold):
//!
//! ```no_run
//! use zrt::llama::{hf_weight_rules, Llama, LlamaConfig};
//! use zrt::zero::ShardPlan;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = std::path::Path::new("llama"); // config.json, model*.safetensors
//! let cfg = LlamaConfig::from_hf_dir(dir)?;
//! let vs = tch::nn::VarStore::new(tch::Device::Cpu);
//! let plan = ShardPlan::new();
//! hf_weight_rules(&plan, &cfg)?;
//! plan.weights_from_file(&vs, dir)?; // no rank holds the model while it is built
//! let model = Llama::new(&vs.root(), &plan, &cfg);
//! // Engine::from_config(&vs, &plan, ...) loads each rank's shard of the file.
//! # let _ = model; Ok(()) }
//! ```
//!
//! The forward is `transformers`' (in evaluation until
//! [`Llama::set_training`] turns its attention dropout on, where it draws
//! the masks `transformers` draws from the same seed): RMSNorm computed in
//! fp32, rotary position embeddings (unscaled, or [`RopeScaling`]'s
//! `linear` and `llama3` kinds) with cosines and sines computed in fp32,
//! grouped-query causal attention (in Mistral's sliding window when it
//! has one), a SiLU-gated MLP. Its logits match `transformers`' to the
//! bit here (`tests/from_hf.rs`).
//!
//! The token embedding's gradient is sparse (`embedding(.., sparse =
//! true)`: the rows looked up), which zrt's engine adds straight into its
//! flat gradient buffer, never a dense vocabulary-sized matrix of its own;
//! tch's `nn::Optimizer` takes dense gradients only, so train the model
//! with the engine (any stage, one rank too).

use std::path::Path;

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use crate::blocks::{token_embedding, Run, TiedEmbedding, Training};
use crate::hf::{HfError, HfJson};
use crate::zero::{EngineError, ExportLayout, ShardPlan, ShardedModule};

/// Which of Hugging Face's Llama-shaped models a checkpoint is: the
/// same layers, names and matrices, told apart by `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `llama` (`LlamaForCausalLM`): Llama 1-3.
    Llama,
    /// `mistral` (`MistralForCausalLM`): Llama's layers, attention in a
    /// sliding window when its config gives one.
    Mistral,
    /// `qwen2` (`Qwen2ForCausalLM`): Llama's layers, biases on the query,
    /// key and value projections.
    Qwen2,
    /// `qwen3` (`Qwen3ForCausalLM`): Llama's layers, each head's queries
    /// and keys RMS-normalised before the rotation (`q_norm`, `k_norm`).
    Qwen3,
}

impl Family {
    /// Its `model_type`, or `None` for another.
    pub fn of(model_type: &str) -> Option<Self> {
        match model_type {
            "llama" => Some(Self::Llama),
            "mistral" => Some(Self::Mistral),
            "qwen2" => Some(Self::Qwen2),
            "qwen3" => Some(Self::Qwen3),
            _ => None,
        }
    }

    /// Its `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
        }
    }

    /// Its `transformers` class.
    fn architecture(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
        }
    }
}

/// How the rotary embedding's frequencies are scaled: the config's
/// `rope_scaling`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// None: `rope_theta`'s frequencies.
    None,
    /// `"linear"`: every frequency divided by `factor`.
    Linear {
        /// `factor`.
        factor: f64,
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
}

/// Sizes of a [`Llama`], Hugging Face's `LlamaConfig` fields (and
/// Mistral's and Qwen2's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaConfig {
    /// Which model it is.
    pub family: Family,
    /// `vocab_size`.
    pub vocab: i64,
    /// `hidden_size`: the model's width.
    pub hidden: i64,
    /// `intermediate_size`: the MLP's width.
    pub intermediate: i64,
    /// `num_hidden_layers`.
    pub layers: i64,
    /// `num_attention_heads`.
    pub heads: i64,
    /// `num_key_value_heads` (fewer than `heads`: grouped-query
    /// attention; it must divide `heads`).
    pub kv_heads: i64,
    /// `head_dim` (`hidden / heads` unless the config says).
    pub head_dim: i64,
    /// `rms_norm_eps`.
    pub eps: f64,
    /// `rope_theta`.
    pub rope_theta: f64,
    /// `rope_scaling`.
    pub rope_scaling: RopeScaling,
    /// `max_position_embeddings` (kept for the exported config; the
    /// forward takes any length).
    pub positions: i64,
    /// The query, key and value projections have biases (Llama's
    /// `attention_bias`, always for Qwen2).
    pub qkv_bias: bool,
    /// The output projection has a bias (Llama's `attention_bias`).
    pub o_bias: bool,
    /// `mlp_bias`: the three MLP projections have biases.
    pub mlp_bias: bool,
    /// Mistral's `sliding_window`: a token attends to itself and the
    /// `w - 1` before it only.
    pub sliding_window: Option<i64>,
    /// `tie_word_embeddings`: the head is the token embedding.
    pub tied: bool,
    /// `attention_dropout`: dropout on the attention weights, when
    /// training (0 in every released Llama, Mistral and Qwen).
    pub attention_dropout: f64,
    /// Each head's queries and keys are RMS-normalised (over the head's
    /// width, with weights of their own) before the rotation: Qwen3's
    /// `q_norm` and `k_norm`.
    pub qk_norm: bool,
}

impl LlamaConfig {
    /// Reads `dir/config.json` (or `dir` itself), as `transformers`'
    /// `save_pretrained` writes it: `model_type` `llama`, `mistral`,
    /// `qwen2` or `qwen3`, `hidden_act` `silu`, `rope_scaling` none,
    /// `linear` or `llama3`. What this model does not compute is refused
    /// naming the field: other rope scalings (`dynamic`, `yarn`, ...), a
    /// partial rotary factor, Qwen's sliding-window layers.
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self, HfError> {
        Self::from_json(&HfJson::read(dir.as_ref(), None)?)
    }

    /// As [`LlamaConfig::from_hf_dir`], from a config already read.
    pub(crate) fn from_json(j: &HfJson) -> Result<Self, HfError> {
        let family = j.model_type();
        let Some(family) = family.as_deref().and_then(Family::of) else {
            return Err(j.field(format!(
                "model_type {family:?}: a Llama is \"llama\", \"mistral\" or \"qwen2\""
            )));
        };
        j.only("hidden_act", "silu", "this Llama computes silu only")?;
        if j.number_or("partial_rotary_factor", 1.0)? != 1.0 {
            return Err(j.field(
                "partial_rotary_factor: this Llama rotates every dimension of a head".into(),
            ));
        }
        let (hidden, heads) = (j.size("hidden_size")?, j.size("num_attention_heads")?);
        let kv_heads = j.size_or_none("num_key_value_heads")?.unwrap_or(heads);
        if heads % kv_heads != 0 {
            return Err(j.field(format!(
                "num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}"
            )));
        }
        let head_dim = match j.size_or_none("head_dim")? {
            Some(d) => d,
            None if hidden % heads == 0 => hidden / heads,
            None => {
                return Err(j.field(format!(
                    "num_attention_heads {heads} does not divide hidden_size {hidden} (and no head_dim)"
                )))
            }
        };
        if head_dim % 2 != 0 {
            return Err(j.field(format!(
                "head_dim {head_dim} is odd: rotary embeddings turn pairs"
            )));
        }
        let attention_bias = j.flag_or("attention_bias", false)?;
        let sliding_window = match family {
            Family::Mistral => j.size_or_none("sliding_window")?,
            Family::Qwen2 | Family::Qwen3 if j.flag_or("use_sliding_window", false)? => {
                return Err(j.field(
                    "use_sliding_window true: this Llama computes Qwen's full-attention layers only"
                        .into(),
                ))
            }
            _ => None,
        };
        // Per-layer attention kinds (newer configs write them all out):
        // every layer the same, full or the model's one window.
        let kinds = j.get("layer_types").and_then(|v| v.as_array());
        let window_kind = match family {
            Family::Mistral if sliding_window.is_some() => "sliding_attention",
            _ => "full_attention",
        };
        if let Some(other) = kinds
            .into_iter()
            .flatten()
            .find(|k| k.as_str() != Some(window_kind))
        {
            return Err(j.field(format!(
                "layer_types holds {other}: this Llama computes every layer's attention alike ({window_kind:?})"
            )));
        }
        Ok(Self {
            family,
            vocab: j.size("vocab_size")?,
            hidden,
            intermediate: j.size("intermediate_size")?,
            layers: j.size("num_hidden_layers")?,
            heads,
            kv_heads,
            head_dim,
            eps: j.number_or("rms_norm_eps", 1e-6)?,
            rope_theta: j.number_or("rope_theta", 10000.0)?,
            rope_scaling: rope_scaling(j)?,
            positions: j.size_or_none("max_position_embeddings")?.unwrap_or(2048),
            qkv_bias: attention_bias || family == Family::Qwen2,
            o_bias: attention_bias,
            mlp_bias: j.flag_or("mlp_bias", false)?,
            sliding_window,
            tied: j.flag_or("tie_word_embeddings", false)?,
            attention_dropout: j.rate_or("attention_dropout", 0.0)?,
            qk_norm: family == Family::Qwen3,
        })
    }

    /// The parameters of each unit a [`Llama`] wraps, by its name
    /// (`model.embed_tokens`, the head too when tied; `model.layers.0`,
    /// ...; `lm_head` when untied), and last the root's (`model.norm`)
    /// under `""`: counted from the sizes, nothing built.
    pub fn unit_params(&self) -> Vec<(String, u64)> {
        let (v, d, hd) = (self.vocab as u64, self.hidden as u64, self.head_dim as u64);
        let (q, kv, i) = (
            self.heads as u64 * hd,
            self.kv_heads as u64 * hd,
            self.intermediate as u64,
        );
        let bias = |on: bool, n: u64| if on { n } else { 0 };
        let attention = (d * q + bias(self.qkv_bias, q))
            + 2 * (d * kv + bias(self.qkv_bias, kv))
            + (q * d + bias(self.o_bias, d))
            + bias(self.qk_norm, 2 * hd);
        let mlp = 2 * (d * i + bias(self.mlp_bias, i)) + (i * d + bias(self.mlp_bias, d));
        let layer = 2 * d + attention + mlp;
        let mut units = vec![("model.embed_tokens".to_string(), v * d)];
        units.extend((0..self.layers).map(|l| (format!("model.layers.{l}"), layer)));
        if !self.tied {
            units.push(("lm_head".to_string(), v * d));
        }
        units.push((String::new(), d));
        units
    }

    /// The `config.json` `transformers` reads this model from.
    pub fn to_hf_json(&self) -> String {
        let rope_scaling = match self.rope_scaling {
            RopeScaling::None => serde_json::Value::Null,
            RopeScaling::Linear { factor } => {
                serde_json::json!({"rope_type": "linear", "factor": factor})
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
        };
        let mut json = serde_json::json!({
            "model_type": self.family.model_type(),
            "architectures": [self.family.architecture()],
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.positions,
            "tie_word_embeddings": self.tied,
            "attention_dropout": self.attention_dropout,
        });
        let extra = match self.family {
            Family::Llama => serde_json::json!({
                "attention_bias": self.o_bias,
                "mlp_bias": self.mlp_bias,
            }),
            Family::Mistral => serde_json::json!({"sliding_window": self.sliding_window}),
            Family::Qwen2 => serde_json::json!({"use_sliding_window": false}),
            Family::Qwen3 => serde_json::json!({
                "attention_bias": self.o_bias,
                "use_sliding_window": false,
            }),
        };
        if let (Some(all), Some(extra)) = (json.as_object_mut(), extra.as_object()) {
            all.extend(extra.clone());
        }
        format!("{json:#}\n")
    }
}

/// The config's `rope_scaling`: none, or a kind this model computes.
fn rope_scaling(j: &HfJson) -> Result<RopeScaling, HfError> {
    let Some(v) = j.get("rope_scaling") else {
        return Ok(RopeScaling::None);
    };
    let kind = (v.get("rope_type").or_else(|| v.get("type"))).and_then(|t| t.as_str());
    let num = |key: &str| {
        (v.get(key).and_then(|n| n.as_f64())).ok_or_else(|| {
            j.field(format!(
                "rope_scaling {v}: its `{key}` is missing or not a number"
            ))
        })
    };
    match kind {
        Some("default") => Ok(RopeScaling::None),
        Some("linear") => Ok(RopeScaling::Linear {
            factor: num("factor")?,
        }),
        Some("llama3") => Ok(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_positions: num("original_max_position_embeddings")?,
        }),
        _ => Err(j.field(format!(
            "rope_scaling {v}: this Llama computes the \"linear\" and \"llama3\" kinds only"
        ))),
    }
}

/// The [`Llama`] VarStore name of a tensor of a Hugging Face Llama
/// checkpoint (its own), or `None` for what the model does not hold:
/// older checkpoints' rotary buffers (`rotary_emb.inv_freq`) and, when
/// the head is tied, a written-out `lm_head.weight`.
pub fn hf_name(name: &str, tied: bool) -> Option<String> {
    let skipped = name.ends_with("rotary_emb.inv_freq") || (tied && name == "lm_head.weight");
    (!skipped).then(|| name.to_string())
}

/// Sets `plan`'s rename rule for a Hugging Face Llama checkpoint
/// ([`hf_name`]). Call it on every rank before the engine is built.
pub fn hf_weight_rules(plan: &ShardPlan, cfg: &LlamaConfig) -> Result<(), EngineError> {
    let tied = cfg.tied;
    plan.rename_weights(move |n| hf_name(n, tied))
}

/// Hugging Face's layout for an export of a [`Llama`]
/// ([`Engine::save_16bit_model_as`](crate::zero::Engine::save_16bit_model_as)):
/// its own names, and `cfg`'s `config.json` beside them, so that
/// `LlamaForCausalLM.from_pretrained(dir)` loads it.
pub fn hf_export_layout(cfg: &LlamaConfig) -> ExportLayout {
    ExportLayout::new().with_file("config.json", cfg.to_hf_json())
}

/// Llama's RMSNorm: `weight * x / sqrt(mean(x^2) + eps)`, the statistic in
/// fp32.
#[derive(Debug)]
struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    fn new(p: nn::Path, width: i64, eps: f64) -> Self {
        Self {
            weight: p.ones("weight", &[width]),
            eps,
        }
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Tensor {
        let h = x.to_kind(Kind::Float);
        let var = h.pow_tensor_scalar(2).mean_dim(-1, true, None::<Kind>);
        let h = h * (var + self.eps).rsqrt();
        &self.weight * h.to_kind(x.kind())
    }
}

/// A linear layer with or without bias.
fn linear(p: &nn::Path, i: i64, o: i64, bias: bool) -> nn::Linear {
    let cfg = nn::LinearConfig {
        bias,
        ..Default::default()
    };
    nn::linear(p, i, o, cfg)
}

/// One decoder layer: `x + attn(input_layernorm(x))`, then `x +
/// mlp(post_attention_layernorm(x))`.
#[derive(Debug)]
pub struct Layer {
    input_layernorm: RmsNorm,
    q_proj: nn::Linear,
    k_proj: nn::Linear,
    v_proj: nn::Linear,
    o_proj: nn::Linear,
    post_attention_layernorm: RmsNorm,
    gate_proj: nn::Linear,
    up_proj: nn::Linear,
    down_proj: nn::Linear,
    /// Qwen3's per-head query and key norms.
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    /// The rotary embedding's inverse frequencies ([`inv_freq`]).
    inv_freq: Tensor,
    training: Training,
    cfg: LlamaConfig,
}

impl Layer {
    fn new(p: &nn::Path, c: &LlamaConfig, training: &Training) -> Self {
        let (a, m) = (p / "self_attn", p / "mlp");
        let (d, hd, qkv, mb) = (c.hidden, c.head_dim, c.qkv_bias, c.mlp_bias);
        Self {
            input_layernorm: RmsNorm::new(p / "input_layernorm", d, c.eps),
            q_proj: linear(&(&a / "q_proj"), d, c.heads * hd, qkv),
            k_proj: linear(&(&a / "k_proj"), d, c.kv_heads * hd, qkv),
            v_proj: linear(&(&a / "v_proj"), d, c.kv_heads * hd, qkv),
            o_proj: linear(&(&a / "o_proj"), c.heads * hd, d, c.o_bias),
            post_attention_layernorm: RmsNorm::new(p / "post_attention_layernorm", d, c.eps),
            gate_proj: linear(&(&m / "gate_proj"), d, c.intermediate, mb),
            up_proj: linear(&(&m / "up_proj"), d, c.intermediate, mb),
            down_proj: linear(&(&m / "down_proj"), c.intermediate, d, mb),
            qk_norm: c.qk_norm.then(|| {
                let norm = |n: &str| RmsNorm::new(&a / n, hd, c.eps);
                (norm("q_norm"), norm("k_norm"))
            }),
            inv_freq: inv_freq(c, p.device()),
            training: training.clone(),
            cfg: *c,
        }
    }
}

/// The rotary embedding's inverse frequencies, `[head_dim / 2]` in fp32,
/// computed as `transformers` computes them (each operation in its
/// order, so that the angles are its to the bit): `theta^(-2i/d)`, scaled
/// as `rope_scaling` says.
fn inv_freq(c: &LlamaConfig, device: tch::Device) -> Tensor {
    let hd = c.head_dim;
    let exponents =
        Tensor::arange_start_step(0, hd, 2, (Kind::Int64, device)).to_kind(Kind::Float) / hd as f64;
    let inv = Tensor::pow_scalar(c.rope_theta, &exponents).reciprocal();
    match c.rope_scaling {
        RopeScaling::None => inv,
        RopeScaling::Linear { factor } => inv / factor,
        RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_positions: old,
        } => {
            let wavelen = inv.reciprocal() * (2.0 * std::f64::consts::PI);
            let long = wavelen.gt(old / low);
            let scaled = (&inv / factor).where_self(&long, &inv);
            let smooth = (wavelen.reciprocal() * old - low) / (high - low);
            let smoothed = (smooth.neg() + 1.0) * &scaled / factor + &smooth * &scaled;
            let short = wavelen.lt(old / high);
            let medium = short.logical_not().logical_and(&long.logical_not());
            smoothed.where_self(&medium, &scaled)
        }
    }
}

/// Rotary position embedding of `x` `[batch, heads, seq, head_dim]`:
/// `x * cos + rotate_half(x) * sin`, `rotate_half` turning the second half
/// of each head's dimensions before the first (`transformers`'
/// convention), the angles computed in fp32 from `inv_freq`.
fn rope(x: &Tensor, inv_freq: &Tensor) -> Tensor {
    let (t, hd) = (x.size()[2], x.size()[3]);
    let opts = (Kind::Float, x.device());
    let freqs = Tensor::arange(t, opts).unsqueeze(1) * inv_freq.unsqueeze(0);
    let emb = Tensor::cat(&[&freqs, &freqs], -1);
    let (cos, sin) = (emb.cos().to_kind(x.kind()), emb.sin().to_kind(x.kind()));
    let (x1, x2) = (x.narrow(-1, 0, hd / 2), x.narrow(-1, hd / 2, hd / 2));
    let rotated = Tensor::cat(&[&x2.neg(), &x1], -1);
    x * cos + rotated * sin
}

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> Tensor {
        let (b, t, _) = x.size3().unwrap_or((1, 1, 1));
        let c = &self.cfg;
        let h = self.input_layernorm.forward(x);
        let heads = |proj: &nn::Linear, n: i64, norm: Option<&RmsNorm>| {
            let x = proj.forward(&h).view([b, t, n, c.head_dim]);
            let x = match norm {
                Some(norm) => norm.forward(&x),
                None => x,
            };
            x.transpose(1, 2)
        };
        let (qn, kn) = match &self.qk_norm {
            Some((q, k)) => (Some(q), Some(k)),
            None => (None, None),
        };
        let q = rope(&heads(&self.q_proj, c.heads, qn), &self.inv_freq);
        let k = rope(&heads(&self.k_proj, c.kv_heads, kn), &self.inv_freq);
        let v = heads(&self.v_proj, c.kv_heads, None);
        let grouped = c.kv_heads != c.heads;
        // Within a sliding window shorter than the sequence, a token sees
        // itself and the `w - 1` before it; else every earlier token.
        let window = c.sliding_window.filter(|&w| w < t).map(|w| {
            let i = Tensor::arange(t, (Kind::Int64, x.device()));
            let back = i.unsqueeze(1) - i.unsqueeze(0);
            back.ge(0).logical_and(&back.lt(w))
        });
        let causal = window.is_none();
        let dropout = self.training.attention(c.attention_dropout);
        let a = Tensor::scaled_dot_product_attention(
            &q, &k, &v, window, dropout, causal, None, grouped,
        );
        let a = a
            .transpose(1, 2)
            .contiguous()
            .view([b, t, c.heads * c.head_dim]);
        let x = x + self.o_proj.forward(&a);
        let h = self.post_attention_layernorm.forward(&x);
        let m = self.gate_proj.forward(&h).silu() * self.up_proj.forward(&h);
        &x + self.down_proj.forward(&m)
    }
}

/// The token embedding, and the head when it is its own matrix.
#[derive(Debug)]
enum Ends {
    /// The head is the embedding: one unit, run at both ends.
    Tied(ShardedModule<TiedEmbedding>),
    /// Each its own unit.
    Apart {
        embed: ShardedModule<nn::Embedding>,
        head: ShardedModule<nn::Linear>,
    },
}

/// Llama with a language-modelling head (`LlamaForCausalLM`).
#[derive(Debug)]
pub struct Llama {
    ends: Ends,
    layers: Vec<ShardedModule<Run<Layer>>>,
    norm: RmsNorm,
    training: Training,
    cfg: LlamaConfig,
}

impl Llama {
    /// Builds the model under `p` with Hugging Face's names, each decoder
    /// layer (`model.layers.0`, ...) a unit of `plan`; the token
    /// embedding (the head too when tied, run at both ends) and an untied
    /// head are units of their own (the largest matrices), the final norm
    /// forms the root.
    /// Values are tch's initialisation (the norms' weights one): a
    /// pretrained model's come from its file.
    pub fn new(p: &nn::Path, plan: &ShardPlan, cfg: &LlamaConfig) -> Self {
        Self::build(p, plan, cfg, false)
    }

    /// As [`Llama::new`], every decoder layer's activations recomputed in
    /// backward (`transformers`' `gradient_checkpointing_enable()`): the
    /// same results, less memory, one more layer forward per backward.
    pub fn new_checkpointed(p: &nn::Path, plan: &ShardPlan, cfg: &LlamaConfig) -> Self {
        Self::build(p, plan, cfg, true)
    }

    fn build(p: &nn::Path, plan: &ShardPlan, cfg: &LlamaConfig, checkpointed: bool) -> Self {
        let m = p / "model";
        // The root's variables before the first unit: a plan releasing
        // the model as it is built (`weights_from_file`) releases what
        // was made before each `ShardedModule::new`, and would leave a
        // root made after the last one held until the engine is built.
        let norm = RmsNorm::new(&m / "norm", cfg.hidden, cfg.eps);
        let embed_path = &m / "embed_tokens";
        let embed = token_embedding(&embed_path, cfg.vocab, cfg.hidden);
        let embed = match cfg.tied {
            true => Err(ShardedModule::new(plan, &embed_path, TiedEmbedding(embed))),
            false => Ok(ShardedModule::new(plan, &embed_path, embed)),
        };
        let training = Training::default();
        let layers = (0..cfg.layers)
            .map(|i| {
                let lp = &m / "layers" / i;
                let run = Run::new(Layer::new(&lp, cfg, &training), checkpointed);
                ShardedModule::new(plan, &lp, run)
            })
            .collect();
        let ends = match embed {
            Err(tied) => Ends::Tied(tied),
            Ok(embed) => {
                let hp = p / "lm_head";
                let head = linear(&hp, cfg.hidden, cfg.vocab, false);
                let head = ShardedModule::new(plan, &hp, head);
                Ends::Apart { embed, head }
            }
        };
        Self {
            ends,
            layers,
            norm,
            training,
            cfg: *cfg,
        }
    }

    /// Turns dropout (`attention_dropout`) on or off: PyTorch's
    /// `model.train()` and `model.eval()`. Off when built, as
    /// `from_pretrained` returns a model in evaluation.
    pub fn set_training(&self, on: bool) {
        self.training.set(on);
    }

    /// Logits `[batch, seq, vocab]` for token ids `[batch, seq]` (int64).
    pub fn forward(&self, tokens: &Tensor) -> Tensor {
        let mut x = match &self.ends {
            Ends::Tied(e) => e.forward(tokens),
            Ends::Apart { embed, .. } => embed.forward(tokens),
        };
        for l in &self.layers {
            x = l.forward(&x);
        }
        let x = self.norm.forward(&x);
        match &self.ends {
            Ends::Tied(e) => e.forward(&x),
            Ends::Apart { head, .. } => head.forward(&x),
        }
    }

    /// `LlamaForCausalLM`'s loss with `labels = tokens`
    /// ([`crate::hf::causal_lm_loss`]).
    pub fn loss(&self, tokens: &Tensor) -> Tensor {
        crate::hf::causal_lm_loss(&self.forward(tokens), tokens)
    }

    /// The sizes it was built with.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn a_checkpoints_names_are_the_models_but_what_it_does_not_hold() {
        for (name, tied, ours) in [
            ("model.layers.0.self_attn.q_proj.weight", false, true),
            ("lm_head.weight", false, true),
            ("lm_head.weight", true, false),
            ("model.layers.3.self_attn.rotary_emb.inv_freq", false, false),
        ] {
            let want = ours.then(|| name.to_string());
            assert_eq!(hf_name(name, tied), want, "{name} tied {tied}");
        }
    }

    #[test]
    fn a_config_is_read_and_what_the_model_does_not_compute_is_refused() {
        let dir = std::env::temp_dir().join(format!("zrt-llama-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Llama 3.2 1B's config.json.
        let good = r#"{"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "max_position_embeddings": 131072, "tie_word_embeddings": true}"#;
        std::fs::write(dir.join("config.json"), good).unwrap();
        let cfg = LlamaConfig::from_hf_dir(&dir).unwrap();
        let want = LlamaConfig {
            family: Family::Llama,
            vocab: 128256,
            hidden: 2048,
            intermediate: 8192,
            layers: 16,
            heads: 32,
            kv_heads: 8,
            head_dim: 64,
            eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_positions: 8192.0,
            },
            positions: 131072,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            sliding_window: None,
            tied: true,
            attention_dropout: 0.0,
            qk_norm: false,
        };
        assert_eq!(cfg, want);
        std::fs::write(dir.join("ours.json"), cfg.to_hf_json()).unwrap();
        assert_eq!(
            LlamaConfig::from_hf_dir(dir.join("ours.json")).unwrap(),
            cfg
        );
        // Qwen2 has biases on q, k and v; Mistral a sliding window.
        let qwen = good.replace(r#""llama""#, r#""qwen2""#);
        std::fs::write(dir.join("config.json"), &qwen).unwrap();
        let q = LlamaConfig::from_hf_dir(&dir).unwrap();
        assert_eq!(
            (q.family, q.qkv_bias, q.o_bias),
            (Family::Qwen2, true, false)
        );
        let mistral = good.replace(r#""llama""#, r#""mistral", "sliding_window": 4096"#);
        std::fs::write(dir.join("config.json"), &mistral).unwrap();
        let m = LlamaConfig::from_hf_dir(&dir).unwrap();
        assert_eq!((m.family, m.sliding_window), (Family::Mistral, Some(4096)));
        // Qwen3 normalises queries and keys, biases only when
        // attention_bias; layer_types all full attention is every layer's.
        let full = r#""full_attention", "full_attention""#;
        let qwen3 = good.replace(
            r#""llama""#,
            &format!(r#""qwen3", "attention_bias": true, "layer_types": [{full}]"#),
        );
        std::fs::write(dir.join("config.json"), &qwen3).unwrap();
        let q3 = LlamaConfig::from_hf_dir(&dir).unwrap();
        assert_eq!(
            (q3.family, q3.qk_norm, q3.qkv_bias, q3.o_bias),
            (Family::Qwen3, true, true, true)
        );
        for cfg in [q, m, q3] {
            std::fs::write(dir.join("ours.json"), cfg.to_hf_json()).unwrap();
            assert_eq!(
                LlamaConfig::from_hf_dir(dir.join("ours.json")).unwrap(),
                cfg
            );
        }
        for (from, to, says) in [
            (r#""llama""#, r#""gemma""#, "model_type Some(\"gemma\")"),
            (
                r#""high_freq_factor": 4.0, "#,
                "",
                "its `high_freq_factor` is missing",
            ),
            (
                r#""rope_scaling": {"#,
                r#""rope_scaling": {"rope_type": "yarn"}, "was": {"#,
                "computes the \"linear\" and \"llama3\" kinds only",
            ),
            (
                r#""llama""#,
                r#""qwen2", "use_sliding_window": true"#,
                "use_sliding_window true",
            ),
            (
                r#""llama""#,
                r#""qwen3", "layer_types": ["full_attention", "sliding_attention"]"#,
                "layer_types holds \"sliding_attention\"",
            ),
            (r#""silu""#, r#""gelu""#, "hidden_act \"gelu\""),
            (
                r#""num_key_value_heads": 8"#,
                r#""num_key_value_heads": 5"#,
                "num_key_value_heads 5 does not divide num_attention_heads 32",
            ),
            (
                r#""tie_word_embeddings": true"#,
                r#""tie_word_embeddings": "yes""#,
                "`tie_word_embeddings` is \"yes\", not true or false",
            ),
        ] {
            std::fs::write(dir.join("config.json"), good.replace(from, to)).unwrap();
            let err = LlamaConfig::from_hf_dir(&dir).unwrap_err().to_string();
            assert!(err.contains(says) && err.contains("config.json"), "{err}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Each unit's parameters as the built model holds them (variables
    /// under the unit's name; the root's those under none).
    pub(crate) fn held_by_unit(vs: &nn::VarStore, units: &[(String, u64)]) -> Vec<(String, u64)> {
        let vars = vs.variables();
        let under = |v: &str, u: &str| !u.is_empty() && v.starts_with(&format!("{u}."));
        (units.iter())
            .map(|(u, _)| {
                let n = (vars.iter())
                    .filter(|(v, _)| match u.is_empty() {
                        true => !units.iter().any(|(w, _)| under(v, w)),
                        false => under(v, u),
                    })
                    .map(|(_, t)| t.numel() as u64)
                    .sum();
                (u.clone(), n)
            })
            .collect()
    }

    #[test]
    fn unit_params_count_what_the_built_model_holds() {
        let base = LlamaConfig {
            family: Family::Llama,
            vocab: 96,
            hidden: 64,
            intermediate: 160,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::None,
            positions: 64,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            sliding_window: None,
            tied: false,
            attention_dropout: 0.0,
            qk_norm: false,
        };
        let variants = [
            base,
            LlamaConfig {
                tied: true,
                qkv_bias: true,
                o_bias: true,
                mlp_bias: true,
                head_dim: 8,
                ..base
            },
            LlamaConfig {
                family: Family::Qwen3,
                qk_norm: true,
                tied: true,
                ..base
            },
        ];
        for cfg in variants {
            let vs = nn::VarStore::new(tch::Device::Cpu);
            let _model = Llama::new(&vs.root(), &ShardPlan::new(), &cfg);
            let units = cfg.unit_params();
            assert_eq!(held_by_unit(&vs, &units), units, "{cfg:?}");
        }
    }
}
