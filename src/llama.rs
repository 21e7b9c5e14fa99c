//! Llama as Hugging Face's `transformers` lays it out
//! (`LlamaForCausalLM`, and Mistral's, Ministral's, Qwen2's, Qwen3's, Gemma 1-3's,
//! Phi-3's, Granite's, OLMo 2's and 3's, SmolLM3's, StarCoder2's, StableLM's,
//! Cohere's, and the mixtures of
//! experts Mixtral's and Qwen3-MoE's, the same layers with variations:
//! see [`Family`]), in tch, its decoder layers wrapped in [`ShardedModule`]:
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
//! `linear`, `dynamic`, `llama3`, `longrope` and `yarn` kinds) with cosines and sines
//! computed in fp32,
//! grouped-query causal attention (in Mistral's sliding window when it
//! has one, Gemma's on all but every n-th layer), a SiLU- or GELU-gated
//! MLP; Gemma's norms offset from one, its embeddings scaled, Gemma 2's
//! soft caps; Cohere's sublayers side by side, its pairs of neighbouring
//! dimensions turned. Llama's logits match `transformers`' to the bit here, every
//! family's three AdamW steps its losses (`tests/from_hf.rs`).
//!
//! The token embedding's gradient is sparse (`embedding(.., sparse =
//! true)`: the rows looked up), which zrt's engine adds straight into its
//! flat gradient buffer, never a dense vocabulary-sized matrix of its own;
//! tch's `nn::Optimizer` takes dense gradients only, so train the model
//! with the engine (any stage, one rank too).

use std::path::Path;
use std::sync::Arc;

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use crate::blocks::{layer_norm, Ends, Run, Training};
use crate::hf::{HfError, HfJson};
use crate::kv_cache::{Decoding, LayerCache};
use crate::lora::{Adapted, LoraConfig};
use crate::packing::{in_window, Documents};
use crate::zero::{EngineError, ExportLayout, ShardPlan, ShardedModule};

/// What builds a decoder layer's linear layers: `(path, in, out, bias)`.
type Lin<'a> = dyn Fn(&nn::Path, i64, i64, bool) -> Adapted + 'a;

/// Which of Hugging Face's Llama-shaped models a checkpoint is: the
/// same layers, names and matrices, told apart by `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `llama` (`LlamaForCausalLM`): Llama 1-3.
    Llama,
    /// `mistral` (`MistralForCausalLM`): Llama's layers, attention in a
    /// sliding window when its config gives one.
    Mistral,
    /// `ministral` (`MinistralForCausalLM`, Ministral 8B): Mistral's
    /// layers, which of them attend in the window read from
    /// `layer_types`.
    Ministral,
    /// `qwen2` (`Qwen2ForCausalLM`): Llama's layers, biases on the query,
    /// key and value projections.
    Qwen2,
    /// `qwen3` (`Qwen3ForCausalLM`): Llama's layers, each head's queries
    /// and keys RMS-normalised before the rotation (`q_norm`, `k_norm`).
    Qwen3,
    /// `gemma` (`GemmaForCausalLM`): Llama's layers, RMSNorm weights as
    /// offsets from one (`x * (1 + w)`, in fp32), the embeddings scaled
    /// by the width's square root, a GELU-gated MLP, the head tied.
    Gemma,
    /// `gemma2` (`Gemma2ForCausalLM`): Gemma's, each sublayer's output
    /// normalised too (`post_attention_layernorm`,
    /// `pre_feedforward_layernorm`, `post_feedforward_layernorm`), every
    /// other layer in a sliding window, attention scores and logits
    /// soft-capped (`tanh(s / cap) * cap`), scores scaled by
    /// `query_pre_attn_scalar`.
    Gemma2,
    /// `gemma3_text` (`Gemma3ForCausalLM`, Gemma 3 1B and 270M):
    /// Gemma 2's layers without the caps, queries and keys normalised as
    /// Qwen3's, every sixth layer global and the others in a window with
    /// rotary embeddings of their own base (`rope_local_base_freq`).
    Gemma3,
    /// `phi3` (`Phi3ForCausalLM`: Phi-3, Phi-4): Llama's layers with the
    /// query, key and value projections one matrix (`qkv_proj`) and the
    /// gate and up projections one (`gate_up_proj`), rotary embeddings
    /// on a part of each head (`partial_rotary_factor`), dropout on each
    /// sublayer's output (`resid_pdrop`).
    Phi3,
    /// `granite` (`GraniteForCausalLM`, IBM's Granite 3): Llama's layers,
    /// the embeddings, each sublayer's output, the attention scores and
    /// the logits scaled by the config's multipliers.
    Granite,
    /// `olmo2` (`Olmo2ForCausalLM`): Llama's layers normalised after
    /// each sublayer instead of before (`post_attention_layernorm`,
    /// `post_feedforward_layernorm`), queries and keys RMS-normalised
    /// over the whole projection before the heads are split.
    Olmo2,
    /// `olmo3` (`Olmo3ForCausalLM`): OLMo 2's layers, all but every
    /// fourth in a sliding window, whose rotary embeddings are unscaled.
    Olmo3,
    /// `smollm3` (`SmolLM3ForCausalLM`): Llama's layers, every fourth
    /// without rotary embeddings (`no_rope_layers`).
    SmolLm3,
    /// `mixtral` (`MixtralForCausalLM`): Mistral's layers with a sparse
    /// mixture of experts for the MLP (`block_sparse_moe`: a router,
    /// experts `w1`/`w3`/`w2`), each token through its top `k`.
    Mixtral,
    /// `qwen3_moe` (`Qwen3MoeForCausalLM`): Qwen3's layers with a sparse
    /// mixture of experts for the MLP (`mlp.gate`, `mlp.experts.N`), the
    /// top `k` weights renormalised when `norm_topk_prob`.
    Qwen3Moe,
    /// `starcoder2` (`Starcoder2ForCausalLM`, BigCode's StarCoder2):
    /// Llama's layers with LayerNorms (weights and biases) for the
    /// RMSNorms, a non-gated MLP (`mlp.c_fc`, `mlp.c_proj`), biases on
    /// every projection (`use_bias`), dropout on the embeddings and each
    /// sublayer's output.
    Starcoder2,
    /// `stablelm` (`StableLmForCausalLM`: StableLM 3B 4E1T, StableLM 2
    /// 1.6B, Zephyr 3B): Llama's layers with LayerNorms (weights and
    /// biases), rotary embeddings on a quarter of each head by default
    /// (`partial_rotary_factor`), biases on the query, key and value
    /// projections when `use_qkv_bias`, dropout on the MLP's output
    /// (`hidden_dropout`). Not StableLM 2 12B's per-head norms
    /// (`qk_layernorm`) or parallel residual (`use_parallel_residual`):
    /// refused.
    StableLm,
    /// `cohere` (`CohereForCausalLM`: Command R, Aya 23, Aya Expanse):
    /// Llama's projections and gated MLP side by side after one norm
    /// (`x + attn(n(x)) + mlp(n(x))`), its norms LayerNorms without
    /// biases computed in fp32, rotary embeddings turning neighbouring
    /// pairs of dimensions (in fp32), the logits times `logit_scale`,
    /// the head tied. Not Command R+'s per-head query and key norms
    /// (`use_qk_norm`): refused.
    Cohere,
}

impl Family {
    /// Every family, in the order the docs list them.
    pub const ALL: [Family; 18] = [
        Self::Llama,
        Self::Mistral,
        Self::Ministral,
        Self::Qwen2,
        Self::Qwen3,
        Self::Gemma,
        Self::Gemma2,
        Self::Gemma3,
        Self::Phi3,
        Self::Granite,
        Self::Olmo2,
        Self::Olmo3,
        Self::SmolLm3,
        Self::Mixtral,
        Self::Qwen3Moe,
        Self::Starcoder2,
        Self::StableLm,
        Self::Cohere,
    ];

    /// Every family's `model_type`, quoted, comma-separated: what an
    /// error naming another lists.
    pub fn model_types() -> String {
        let quoted: Vec<String> = (Self::ALL.iter())
            .map(|f| format!("{:?}", f.model_type()))
            .collect();
        quoted.join(", ")
    }

    /// Its `model_type`, or `None` for another.
    pub fn of(model_type: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.model_type() == model_type)
    }

    /// Its `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Ministral => "ministral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Gemma => "gemma",
            Self::Gemma2 => "gemma2",
            Self::Gemma3 => "gemma3_text",
            Self::Phi3 => "phi3",
            Self::Granite => "granite",
            Self::Olmo2 => "olmo2",
            Self::Olmo3 => "olmo3",
            Self::SmolLm3 => "smollm3",
            Self::Mixtral => "mixtral",
            Self::Qwen3Moe => "qwen3_moe",
            Self::Starcoder2 => "starcoder2",
            Self::StableLm => "stablelm",
            Self::Cohere => "cohere",
        }
    }

    /// Its `transformers` class.
    fn architecture(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Ministral => "MinistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Gemma => "GemmaForCausalLM",
            Self::Gemma2 => "Gemma2ForCausalLM",
            Self::Gemma3 => "Gemma3ForCausalLM",
            Self::Phi3 => "Phi3ForCausalLM",
            Self::Granite => "GraniteForCausalLM",
            Self::Olmo2 => "Olmo2ForCausalLM",
            Self::Olmo3 => "Olmo3ForCausalLM",
            Self::SmolLm3 => "SmolLM3ForCausalLM",
            Self::Mixtral => "MixtralForCausalLM",
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
            Self::Starcoder2 => "Starcoder2ForCausalLM",
            Self::StableLm => "StableLmForCausalLM",
            Self::Cohere => "CohereForCausalLM",
        }
    }

    /// Gemma's: norms as offsets from one, the embeddings scaled.
    fn gemma(self) -> bool {
        matches!(self, Self::Gemma | Self::Gemma2 | Self::Gemma3)
    }

    /// Each sublayer's output normalised before the residual (Gemma 2
    /// and 3), the MLP's input by a norm of its own.
    fn sandwich(self) -> bool {
        matches!(self, Self::Gemma2 | Self::Gemma3)
    }

    /// StarCoder2's and StableLM's: LayerNorms (with biases) where the
    /// others have RMSNorms.
    fn layer_norm(self) -> bool {
        matches!(self, Self::Starcoder2 | Self::StableLm)
    }

    /// Cohere's: the attention and the MLP side by side after one norm.
    fn parallel(self) -> bool {
        self == Self::Cohere
    }

    /// An MLP of a gate and an up projection (all but StarCoder2's).
    fn gated(self) -> bool {
        self != Self::Starcoder2
    }

    /// OLMo's: each sublayer's output normalised, not its input; the
    /// norms multiply by their weights in fp32; queries and keys
    /// normalised over the whole projection.
    fn olmo(self) -> bool {
        matches!(self, Self::Olmo2 | Self::Olmo3)
    }

    /// What its `transformers` config class (4.57) gives the fields a
    /// config leaves out: one table, so a family's defaults read
    /// together and are checked against the classes' own
    /// (`tests/from_hf.rs`).
    fn defaults(self) -> Defaults {
        const LLAMA: Defaults = Defaults {
            eps: 1e-6,
            rope_theta: 10000.0,
            kv_heads: None,
            head_dim: None,
            window: None,
            tied: false,
            pad: None,
            activation: Activation::Silu,
            positions: 2048,
        };
        const GEMMA: Defaults = Defaults {
            head_dim: Some(256),
            tied: true,
            pad: Some(0),
            activation: Activation::GeluTanh,
            positions: 8192,
            ..LLAMA
        };
        match self {
            Self::Llama | Self::Granite => LLAMA,
            Self::Mistral | Self::Ministral => Defaults {
                kv_heads: Some(8),
                window: Some(4096),
                positions: 131072,
                ..LLAMA
            },
            Self::Qwen2 => Defaults {
                kv_heads: Some(32),
                positions: 32768,
                ..LLAMA
            },
            Self::Qwen3 => Defaults {
                kv_heads: Some(32),
                head_dim: Some(128),
                positions: 32768,
                ..LLAMA
            },
            Self::Gemma => Defaults {
                kv_heads: Some(16),
                ..GEMMA
            },
            Self::Gemma2 => Defaults {
                kv_heads: Some(4),
                window: Some(4096),
                ..GEMMA
            },
            Self::Gemma3 => Defaults {
                rope_theta: 1e6,
                kv_heads: Some(4),
                window: Some(4096),
                positions: 131072,
                ..GEMMA
            },
            Self::Phi3 => Defaults {
                eps: 1e-5,
                pad: Some(32000),
                positions: 4096,
                ..LLAMA
            },
            Self::Olmo2 => Defaults {
                eps: 1e-5,
                pad: Some(1),
                ..LLAMA
            },
            Self::Olmo3 => Defaults {
                eps: 1e-5,
                window: Some(4096),
                pad: Some(1),
                ..LLAMA
            },
            Self::SmolLm3 => Defaults {
                rope_theta: 2e6,
                kv_heads: Some(4),
                tied: true,
                pad: Some(128004),
                positions: 32768,
                ..LLAMA
            },
            Self::Mixtral => Defaults {
                eps: 1e-5,
                rope_theta: 1e6,
                kv_heads: Some(8),
                positions: 131072,
                ..LLAMA
            },
            Self::Qwen3Moe => Defaults {
                kv_heads: Some(4),
                positions: 32768,
                ..LLAMA
            },
            // `PretrainedConfig`'s tied head, its class setting none.
            Self::Starcoder2 => Defaults {
                eps: 1e-5,
                kv_heads: Some(2),
                tied: true,
                activation: Activation::GeluTanh,
                positions: 4096,
                ..LLAMA
            },
            Self::StableLm => Defaults {
                eps: 1e-5,
                kv_heads: Some(32),
                positions: 4096,
                ..LLAMA
            },
            Self::Cohere => Defaults {
                eps: 1e-5,
                tied: true,
                pad: Some(0),
                positions: 8192,
                ..LLAMA
            },
        }
    }

    /// The config field of its norms' epsilon.
    fn eps_key(self) -> &'static str {
        match self {
            Self::Starcoder2 => "norm_epsilon",
            Self::StableLm | Self::Cohere => "layer_norm_eps",
            _ => "rms_norm_eps",
        }
    }

    /// The config field naming the MLP's activation: Gemma 2 and 3 read
    /// `hidden_activation`, the others `hidden_act` (Gemma's too, in
    /// `transformers` 4.57).
    fn activation_key(self) -> &'static str {
        match self {
            Self::Gemma2 | Self::Gemma3 => "hidden_activation",
            _ => "hidden_act",
        }
    }
}

/// A [`Family`]'s config class's value for each field a config leaves
/// out (present and null is another thing: `sliding_window: null` turns
/// the window off).
#[derive(Debug, Clone, Copy)]
struct Defaults {
    /// `rms_norm_eps`.
    eps: f64,
    /// `rope_theta`.
    rope_theta: f64,
    /// `num_key_value_heads`; `None`: `num_attention_heads`.
    kv_heads: Option<i64>,
    /// `head_dim`; `None`: `hidden_size / num_attention_heads`.
    head_dim: Option<i64>,
    /// `sliding_window`, for the families that read one.
    window: Option<i64>,
    /// `tie_word_embeddings`.
    tied: bool,
    /// `pad_token_id`.
    pad: Option<i64>,
    /// `hidden_act` (Gemma 2's and 3's `hidden_activation`).
    activation: Activation,
    /// `max_position_embeddings`.
    positions: i64,
}

/// A sparse mixture of experts in place of the MLP (Mixtral, Qwen3-MoE):
/// a router scores `experts` per token, each token goes through its top
/// `top_k` experts, their outputs summed weighted by the router's
/// softmax (renormalised over the `k` when `normalize`).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// `num_local_experts` (Mixtral), `num_experts` (Qwen3-MoE).
    pub experts: i64,
    /// `num_experts_per_tok`.
    pub top_k: i64,
    /// Each expert's MLP width (`intermediate_size` for Mixtral,
    /// `moe_intermediate_size` for Qwen3-MoE).
    pub intermediate: i64,
    /// The top `k` weights divided by their sum (Mixtral always;
    /// Qwen3-MoE's `norm_topk_prob`).
    pub normalize: bool,
    /// Qwen3-MoE's `decoder_sparse_step`: layer `l` has experts when
    /// `(l + 1) % step == 0` and it is not in `dense_layers`.
    pub sparse_step: i64,
    /// Qwen3-MoE's `mlp_only_layers`: layers with a dense MLP
    /// (`intermediate_size` wide).
    pub dense_layers: Vec<i64>,
}

/// The gate's activation in the MLP (`down(act(gate(x)) * up(x))`): the
/// config's `hidden_act` (Gemma 2's and 3's `hidden_activation`; the
/// MLP's only activation in GPT-NeoX and Phi).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `"silu"` (Llama, Mistral, Qwen).
    Silu,
    /// `"gelu"`: the exact GELU (Pythia).
    Gelu,
    /// `"gelu_pytorch_tanh"`: GELU's tanh approximation, libtorch's
    /// kernel (Gemma).
    GeluTanh,
    /// `"gelu_new"`: the same approximation, written out as
    /// `transformers`' `NewGELUActivation` computes it, operation by
    /// operation (Phi-1 and 2), so that its rounding is theirs.
    GeluNew,
}

impl Activation {
    const ALL: [Self; 4] = [Self::Silu, Self::Gelu, Self::GeluTanh, Self::GeluNew];

    /// The activation `transformers` names `name`, or `None`.
    pub(crate) fn of(name: &str) -> Option<Self> {
        match name {
            "swish" => Some(Self::Silu),
            _ => Self::ALL.into_iter().find(|a| a.name() == name),
        }
    }

    /// The config's `key` (`hidden_act`), `default` when left out; one
    /// this crate does not compute is refused naming the field, for a
    /// `model` (its name in the error).
    pub(crate) fn read(j: &HfJson, key: &str, default: Self, model: &str) -> Result<Self, HfError> {
        let Some(v) = j.get(key) else {
            return Ok(default);
        };
        v.as_str().and_then(Self::of).ok_or_else(|| {
            let names: Vec<String> = Self::ALL
                .iter()
                .map(|a| format!("{:?}", a.name()))
                .collect();
            j.field(format!(
                "{key} {v}: this {model} computes {}",
                names.join(", ")
            ))
        })
    }

    /// Its `transformers` name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Silu => "silu",
            Self::Gelu => "gelu",
            Self::GeluTanh => "gelu_pytorch_tanh",
            Self::GeluNew => "gelu_new",
        }
    }

    pub(crate) fn apply(self, x: &Tensor) -> Tensor {
        match self {
            Self::Silu => x.silu(),
            Self::Gelu => x.gelu("none"),
            Self::GeluTanh => x.gelu("tanh"),
            // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
            Self::GeluNew => {
                let inner =
                    (x + x.pow_tensor_scalar(3.0) * 0.044715) * (2.0 / std::f64::consts::PI).sqrt();
                (x * 0.5) * (inner.tanh() + 1.0)
            }
        }
    }
}

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
                ..
            } => serde_json::json!({
                "rope_type": "longrope",
                "short_factor": short,
                "long_factor": long,
                "attention_factor": attention_factor,
            }),
            RopeScaling::Yarn {
                factor,
                original_positions,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
            } => serde_json::json!({
                "rope_type": "yarn",
                "factor": factor,
                "original_max_position_embeddings": original_positions,
                "beta_fast": beta_fast,
                "beta_slow": beta_slow,
                "truncate": truncate,
                "attention_factor": attention_factor,
            }),
        }
    }
}

/// Sizes of a [`Llama`], Hugging Face's `LlamaConfig` fields (and
/// those of the other [`Family`] members).
#[derive(Debug, Clone, PartialEq)]
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
    /// `sliding_window` (Mistral's, Ministral's, Phi-3's, Gemma 2's and 3's, OLMo
    /// 3's): a token attends to itself and the `w - 1` before it only, on
    /// every layer or as [`LlamaConfig::full_every`] says.
    pub sliding_window: Option<i64>,
    /// `tie_word_embeddings`: the head is the token embedding.
    pub tied: bool,
    /// `attention_dropout`: dropout on the attention weights, when
    /// training (0 in every released Llama, Mistral and Qwen).
    pub attention_dropout: f64,
    /// Queries and keys are RMS-normalised, with weights of their own,
    /// before the rotation: `q_norm` and `k_norm`, over each head's width
    /// (Qwen3, Gemma 3) or over the whole projection (OLMo 2 and 3).
    pub qk_norm: bool,
    /// The MLP's activation (`hidden_act`).
    pub activation: Activation,
    /// `pad_token_id`: the embedding's row that gets no gradient from
    /// the lookup (`transformers` makes it `nn.Embedding`'s
    /// `padding_idx`).
    pub pad_token: Option<i64>,
    /// Gemma 2's and 3's `query_pre_attn_scalar`: attention scores are
    /// scaled by its inverse square root, not the head width's.
    pub query_scalar: Option<f64>,
    /// Gemma 2's `attn_logit_softcapping`: attention scores become
    /// `tanh(s / cap) * cap` before the mask and softmax.
    pub attn_softcap: Option<f64>,
    /// Gemma 2's `final_logit_softcapping`: logits become `tanh(l / cap)
    /// * cap`.
    pub final_softcap: Option<f64>,
    /// With a `sliding_window`, every `n`-th layer (the `n`-th, the
    /// `2n`-th, ...) attends to every earlier token and the others in the
    /// window (Gemma 2: 2, Gemma 3: 6, OLMo 3: 4, from `layer_types`);
    /// `None`: every layer alike.
    pub full_every: Option<i64>,
    /// The windowed layers' rotary base, their frequencies unscaled
    /// (Gemma 3's `rope_local_base_freq`; OLMo 3's `rope_theta`): the
    /// global layers' are `rope_theta`'s, scaled as `rope_scaling` says.
    pub local_rope_theta: Option<f64>,
    /// Phi-3's and StableLM's `partial_rotary_factor`: the share of each
    /// head's dimensions the rotary embedding turns, the first ones
    /// ([`LlamaConfig::rotary_dim`]); 1 for the other families.
    pub partial_rotary: f64,
    /// Phi-3's `resid_pdrop`, StarCoder2's `residual_dropout`: dropout
    /// on each sublayer's output, when training; StableLM's
    /// `hidden_dropout`, on the MLP's output only
    /// ([`LlamaConfig::attention_output_dropout`]).
    pub resid_dropout: f64,
    /// StarCoder2's `embedding_dropout`: dropout on the embeddings, when
    /// training.
    pub embedding_dropout: f64,
    /// Granite's `embedding_multiplier`: the embeddings' factor.
    pub embedding_multiplier: f64,
    /// Granite's `residual_multiplier`: each sublayer's output's factor
    /// before it joins the residual.
    pub residual_multiplier: f64,
    /// Granite's `attention_multiplier`: the attention scores' factor
    /// (the head width's inverse square root unless given).
    pub attention_multiplier: Option<f64>,
    /// Granite's `logits_scaling`: the logits are divided by it.
    pub logits_scaling: f64,
    /// Cohere's `logit_scale`: the logits are multiplied by it (1 for
    /// the other families).
    pub logit_scale: f64,
    /// SmolLM3's `no_rope_layers`: for each layer, whether it turns its
    /// queries and keys (the others attend without positions); `None`:
    /// every layer turns.
    pub rope_layers: Option<Vec<bool>>,
    /// Mixtral's and Qwen3-MoE's experts in place of the MLP.
    pub moe: Option<MoeConfig>,
}

impl LlamaConfig {
    /// Reads `dir/config.json` (or `dir` itself), as `transformers`'
    /// `save_pretrained` writes it: `model_type` one of [`Family::ALL`]'s,
    /// `hidden_act` `silu`, `gelu`, `gelu_pytorch_tanh` or `gelu_new`, `rope_scaling`
    /// none, `linear`, `dynamic`, `llama3`, `longrope` or `yarn` (Phi-3's
    /// `longrope` only); a field left out takes the default of the
    /// family's `transformers` config class. What this model does not
    /// compute is refused naming the field: other rope scalings, a
    /// partial rotary factor but
    /// Phi-3's, windowed layers in any order but every `n`-th global
    /// (Qwen's), Gemma 3's bidirectional attention.
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self, HfError> {
        Self::from_json(&HfJson::read(dir.as_ref(), None)?)
    }

    /// As [`LlamaConfig::from_hf_dir`], from a config already read.
    pub(crate) fn from_json(j: &HfJson) -> Result<Self, HfError> {
        let family = j.model_type();
        let Some(family) = family.as_deref().and_then(Family::of) else {
            return Err(j.field(format!(
                "model_type {family:?}: a Llama is one of {}",
                Family::model_types()
            )));
        };
        let defaults = family.defaults();
        let key = family.activation_key();
        let activation = Activation::read(j, key, defaults.activation, "Llama")?;
        let partial = match family {
            Family::StableLm => j.number_or("partial_rotary_factor", 0.25)?,
            _ => j.number_or("partial_rotary_factor", 1.0)?,
        };
        if partial != 1.0 && !matches!(family, Family::Phi3 | Family::StableLm) {
            return Err(j.field(format!(
                "partial_rotary_factor {partial}: this {} rotates every dimension of a head",
                family.model_type()
            )));
        }
        if j.flag_or("use_bidirectional_attention", false)? {
            return Err(j.field(
                "use_bidirectional_attention true: this Llama computes causal attention only"
                    .into(),
            ));
        }
        if family == Family::StableLm {
            for (key, what) in [
                (
                    "qk_layernorm",
                    "normalises each head's queries and keys with a LayerNorm of its own",
                ),
                (
                    "use_parallel_residual",
                    "runs the attention and the MLP side by side",
                ),
            ] {
                if j.flag_or(key, false)? {
                    return Err(j.field(format!(
                        "{key} true (StableLM 2 12B's layers, which {what}): zrt builds StableLM's sequential layers without it"
                    )));
                }
            }
        }
        if family == Family::Cohere && j.flag_or("use_qk_norm", false)? {
            return Err(j.field(
                "use_qk_norm true (Command R+'s layers, which normalise each head's queries and keys with weights of their own): zrt builds Cohere's layers without it".into(),
            ));
        }
        let (hidden, heads) = (j.size("hidden_size")?, j.size("num_attention_heads")?);
        // Left out, the class's default; null, as many as the heads.
        let kv_heads = (j.size_or_null("num_key_value_heads", defaults.kv_heads)?).unwrap_or(heads);
        if heads % kv_heads != 0 {
            return Err(j.field(format!(
                "num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}"
            )));
        }
        let head_dim = match j.size_or_null("head_dim", defaults.head_dim)? {
            Some(d) => d,
            None if hidden % heads == 0 => hidden / heads,
            None => {
                return Err(j.field(format!(
                    "num_attention_heads {heads} does not divide hidden_size {hidden} (and no head_dim)"
                )))
            }
        };
        let rotary_dim = rotary_dim(head_dim, partial);
        if rotary_dim % 2 != 0 || rotary_dim <= 0 || rotary_dim > head_dim {
            return Err(j.field(format!(
                "head_dim {head_dim} x partial_rotary_factor {partial} is {rotary_dim} dimensions: rotary embeddings turn pairs of a head's"
            )));
        }
        // StarCoder2's `use_bias` is every projection's.
        let attention_bias = match family {
            Family::Starcoder2 => j.flag_or("use_bias", true)?,
            // StableLM's output projection has none.
            Family::StableLm => false,
            _ => j.flag_or("attention_bias", false)?,
        };
        let qkv_bias = match family {
            Family::Qwen2 => true,
            Family::StableLm => j.flag_or("use_qkv_bias", false)?,
            _ => attention_bias,
        };
        let sliding_window = match family {
            Family::Mistral
            | Family::Ministral
            | Family::Phi3
            | Family::Mixtral
            | Family::Gemma2
            | Family::Gemma3
            | Family::Olmo3
            | Family::Starcoder2 => j.size_or_null("sliding_window", defaults.window)?,
            Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe | Family::SmolLm3
                if j.flag_or("use_sliding_window", false)? =>
            {
                return Err(j.field(format!(
                    "use_sliding_window true: this Llama computes {}'s full-attention layers only",
                    family.model_type()
                )))
            }
            _ => None,
        };
        let full_every = full_every(j, family, sliding_window)?;
        let vocab = j.size("vocab_size")?;
        let pad_token = pad_token(j, defaults.pad, vocab)?;
        let sandwich = family.sandwich();
        let rope_theta = j.number_or("rope_theta", defaults.rope_theta)?;
        let granite = |key: &str| match family {
            Family::Granite => j.number_or(key, 1.0),
            _ => Ok(1.0),
        };
        Ok(Self {
            family,
            vocab,
            hidden,
            intermediate: j.size("intermediate_size")?,
            layers: j.size("num_hidden_layers")?,
            heads,
            kv_heads,
            head_dim,
            eps: j.number_or(family.eps_key(), defaults.eps)?,
            rope_theta,
            rope_scaling: rope_scaling(j, family.model_type(), rotary_dim)?,
            positions: (j.size_or_none("max_position_embeddings")?).unwrap_or(defaults.positions),
            qkv_bias,
            o_bias: attention_bias,
            mlp_bias: match family {
                Family::Starcoder2 => attention_bias,
                _ => j.flag_or("mlp_bias", false)?,
            },
            sliding_window,
            tied: j.flag_or("tie_word_embeddings", defaults.tied)?,
            attention_dropout: j.rate_or("attention_dropout", 0.0)?,
            qk_norm: matches!(family, Family::Qwen3 | Family::Qwen3Moe | Family::Gemma3)
                || family.olmo(),
            activation,
            pad_token,
            query_scalar: match sandwich {
                true => Some(j.number_or("query_pre_attn_scalar", 256.0)?),
                false => None,
            },
            attn_softcap: match family {
                Family::Gemma2 => j.number_or_null("attn_logit_softcapping", Some(50.0))?,
                Family::Gemma3 => j.number_or_null("attn_logit_softcapping", None)?,
                _ => None,
            },
            final_softcap: match family {
                Family::Gemma2 => j.number_or_null("final_logit_softcapping", Some(30.0))?,
                Family::Gemma3 => j.number_or_null("final_logit_softcapping", None)?,
                _ => None,
            },
            full_every,
            local_rope_theta: match family {
                Family::Gemma3 => Some(j.number_or("rope_local_base_freq", 10000.0)?),
                // OLMo 3's windowed layers turn unscaled.
                Family::Olmo3 => Some(rope_theta),
                _ => None,
            },
            partial_rotary: partial,
            resid_dropout: match family {
                Family::Phi3 => j.rate_or("resid_pdrop", 0.0)?,
                Family::Starcoder2 => j.rate_or("residual_dropout", 0.0)?,
                Family::StableLm => j.rate_or("hidden_dropout", 0.0)?,
                _ => 0.0,
            },
            embedding_dropout: match family {
                Family::Starcoder2 => j.rate_or("embedding_dropout", 0.0)?,
                _ => 0.0,
            },
            embedding_multiplier: granite("embedding_multiplier")?,
            residual_multiplier: granite("residual_multiplier")?,
            attention_multiplier: match family {
                Family::Granite => Some(granite("attention_multiplier")?),
                _ => None,
            },
            logits_scaling: granite("logits_scaling")?,
            logit_scale: match family {
                Family::Cohere => j.number_or("logit_scale", 0.0625)?,
                _ => 1.0,
            },
            rope_layers: match family {
                Family::SmolLm3 => Some(rope_layers(j)?),
                _ => None,
            },
            moe: moe(j, family)?,
        })
    }

    /// The dimensions of each head the rotary embedding turns: `head_dim`
    /// times `partial_rotary_factor`, truncated as `transformers` does.
    pub fn rotary_dim(&self) -> i64 {
        rotary_dim(self.head_dim, self.partial_rotary)
    }

    /// The dropout on the attention's output, when training: the
    /// sublayers' [`LlamaConfig::resid_dropout`], but StableLM's, which
    /// drops out the MLP's output only.
    pub fn attention_output_dropout(&self) -> f64 {
        match self.family {
            Family::StableLm => 0.0,
            _ => self.resid_dropout,
        }
    }

    /// Whether layer `l`'s MLP is a mixture of experts.
    pub fn moe_layer(&self, l: i64) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| (l + 1) % m.sparse_step == 0 && !m.dense_layers.contains(&l))
    }

    /// Layer `l`'s sliding window: `None` when it attends to every
    /// earlier token.
    pub fn window(&self, l: i64) -> Option<i64> {
        match self.full_every {
            Some(n) if (l + 1) % n == 0 => None,
            _ => self.sliding_window,
        }
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
            + match self.family.olmo() {
                // OLMo's normalise the whole projections, the others a head.
                true => bias(self.qk_norm, q + kv),
                false => bias(self.qk_norm, 2 * hd),
            };
        // Gated (gate and up), or StarCoder2's one matrix up.
        let ups = if self.family.gated() { 2 } else { 1 };
        let mlp = ups * (d * i + bias(self.mlp_bias, i)) + (i * d + bias(self.mlp_bias, d));
        // A router and each expert's three matrices.
        let experts = (self.moe.as_ref()).map_or(0, |m| {
            let (e, w) = (m.experts as u64, m.intermediate as u64);
            d * e + e * 3 * d * w
        });
        let norms = match self.family {
            f if f.sandwich() => 4,
            f if f.parallel() => 1,
            _ => 2,
        };
        // A LayerNorm's bias beside its weights.
        let norm = if self.family.layer_norm() { 2 * d } else { d };
        let layer = |l: i64| {
            let mlp = if self.moe_layer(l) { experts } else { mlp };
            norms * norm + attention + mlp
        };
        let mut units = vec![("model.embed_tokens".to_string(), v * d)];
        units.extend((0..self.layers).map(|l| (format!("model.layers.{l}"), layer(l))));
        if !self.tied {
            units.push(("lm_head".to_string(), v * d));
        }
        units.push((String::new(), norm));
        units
    }

    /// The `config.json` `transformers` reads this model from.
    pub fn to_hf_json(&self) -> String {
        let rope_scaling = self.rope_scaling.to_json(self.family == Family::Phi3);
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
            self.family.activation_key(): self.activation.name(),
            "pad_token_id": self.pad_token,
            self.family.eps_key(): self.eps,
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
            Family::Mistral | Family::Ministral => {
                serde_json::json!({"sliding_window": self.sliding_window})
            }
            Family::Qwen2 => serde_json::json!({"use_sliding_window": false}),
            Family::Qwen3 => serde_json::json!({
                "attention_bias": self.o_bias,
                "use_sliding_window": false,
            }),
            Family::Gemma => serde_json::json!({"attention_bias": self.o_bias}),
            Family::Phi3 => serde_json::json!({
                "sliding_window": self.sliding_window,
                "partial_rotary_factor": self.partial_rotary,
                "resid_pdrop": self.resid_dropout,
            }),
            Family::Granite => serde_json::json!({
                "attention_bias": self.o_bias,
                "mlp_bias": self.mlp_bias,
                "embedding_multiplier": self.embedding_multiplier,
                "residual_multiplier": self.residual_multiplier,
                "attention_multiplier": self.attention_multiplier,
                "logits_scaling": self.logits_scaling,
            }),
            Family::Olmo2 => serde_json::json!({"attention_bias": self.o_bias}),
            Family::Olmo3 => serde_json::json!({
                "attention_bias": self.o_bias,
                "sliding_window": self.sliding_window,
            }),
            Family::Mixtral => serde_json::json!({
                "sliding_window": self.sliding_window,
                "num_local_experts": self.moe.as_ref().map(|m| m.experts),
                "num_experts_per_tok": self.moe.as_ref().map(|m| m.top_k),
                "output_router_logits": false,
            }),
            Family::Qwen3Moe => serde_json::json!({
                "attention_bias": self.o_bias,
                "use_sliding_window": false,
                "num_experts": self.moe.as_ref().map(|m| m.experts),
                "num_experts_per_tok": self.moe.as_ref().map(|m| m.top_k),
                "moe_intermediate_size": self.moe.as_ref().map(|m| m.intermediate),
                "norm_topk_prob": self.moe.as_ref().map(|m| m.normalize),
                "decoder_sparse_step": self.moe.as_ref().map(|m| m.sparse_step),
                "mlp_only_layers": self.moe.as_ref().map(|m| m.dense_layers.clone()),
                "output_router_logits": false,
            }),
            Family::SmolLm3 => serde_json::json!({
                "attention_bias": self.o_bias,
                "mlp_bias": self.mlp_bias,
                "use_sliding_window": false,
                "no_rope_layers": self.rope_layers.as_ref().map(|l| {
                    l.iter().map(|&r| i64::from(r)).collect::<Vec<_>>()
                }),
            }),
            Family::Starcoder2 => serde_json::json!({
                "use_bias": self.o_bias,
                "sliding_window": self.sliding_window,
                "residual_dropout": self.resid_dropout,
                "embedding_dropout": self.embedding_dropout,
            }),
            Family::Cohere => serde_json::json!({
                "attention_bias": self.o_bias,
                "logit_scale": self.logit_scale,
                "use_qk_norm": false,
            }),
            Family::StableLm => serde_json::json!({
                "use_qkv_bias": self.qkv_bias,
                "qk_layernorm": false,
                "use_parallel_residual": false,
                "partial_rotary_factor": self.partial_rotary,
                "hidden_dropout": self.resid_dropout,
            }),
            Family::Gemma2 | Family::Gemma3 => serde_json::json!({
                "attention_bias": self.o_bias,
                "sliding_window": self.sliding_window,
                "query_pre_attn_scalar": self.query_scalar,
                "attn_logit_softcapping": self.attn_softcap,
                "final_logit_softcapping": self.final_softcap,
                "rope_local_base_freq": self.local_rope_theta,
            }),
        };
        if let RopeScaling::LongRope {
            original_positions, ..
        } = &self.rope_scaling
        {
            json["original_max_position_embeddings"] = (*original_positions).into();
        }
        if self.full_every.is_some() {
            let kinds: Vec<&str> = (0..self.layers)
                .map(|l| match self.window(l) {
                    Some(_) => "sliding_attention",
                    None => "full_attention",
                })
                .collect();
            json["layer_types"] = kinds.into();
        }
        if let (Some(all), Some(extra)) = (json.as_object_mut(), extra.as_object()) {
            all.extend(extra.clone());
        }
        format!("{json:#}\n")
    }
}

/// Mixtral's and Qwen3-MoE's experts ([`MoeConfig`]), `None` for the
/// other families. The router's load-balancing loss (`output_router_logits`)
/// and Mixtral's router jitter are refused: zrt's loss is the language
/// model's alone.
fn moe(j: &HfJson, family: Family) -> Result<Option<MoeConfig>, HfError> {
    let (experts_key, width_key, normalize) = match family {
        Family::Mixtral => ("num_local_experts", "intermediate_size", true),
        Family::Qwen3Moe => (
            "num_experts",
            "moe_intermediate_size",
            j.flag_or("norm_topk_prob", false)?,
        ),
        _ => return Ok(None),
    };
    if j.flag_or("output_router_logits", false)? {
        return Err(j.field(
            "output_router_logits true: zrt's loss is the language model's; it does not add the router's load-balancing loss (set it to false)".into(),
        ));
    }
    let jitter = j.number_or("router_jitter_noise", 0.0)?;
    if jitter != 0.0 {
        return Err(j.field(format!(
            "router_jitter_noise {jitter}: zrt's routers take the hidden states as they are (set it to 0)"
        )));
    }
    let defaults = match family {
        Family::Mixtral => (8, 2),
        _ => (128, 8),
    };
    let experts = j.size_or_none(experts_key)?.unwrap_or(defaults.0);
    let top_k = j.size_or_none("num_experts_per_tok")?.unwrap_or(defaults.1);
    if top_k > experts {
        return Err(j.field(format!(
            "num_experts_per_tok {top_k} is more than the {experts} experts"
        )));
    }
    let dense_layers = match j.get("mlp_only_layers") {
        None => Vec::new(),
        Some(v) => (v.as_array())
            .and_then(|l| l.iter().map(|n| n.as_i64()).collect::<Option<Vec<i64>>>())
            .ok_or_else(|| j.field(format!("mlp_only_layers {v}: a list of layer numbers")))?,
    };
    Ok(Some(MoeConfig {
        experts,
        top_k,
        intermediate: match family {
            Family::Mixtral => j.size(width_key)?,
            _ => j.size_or_none(width_key)?.unwrap_or(768),
        },
        normalize,
        sparse_step: j.size_or_none("decoder_sparse_step")?.unwrap_or(1),
        dense_layers,
    }))
}

/// SmolLM3's `no_rope_layers` (1: the layer turns, 0: it does not), or
/// every `no_rope_layer_interval`-th layer (4 unless it says) without.
fn rope_layers(j: &HfJson) -> Result<Vec<bool>, HfError> {
    let layers = j.size("num_hidden_layers")?;
    let Some(v) = j.get("no_rope_layers") else {
        let every = j.size_or_none("no_rope_layer_interval")?.unwrap_or(4);
        return Ok((0..layers).map(|l| (l + 1) % every != 0).collect());
    };
    let list = v.as_array().and_then(|l| {
        l.iter()
            .map(|n| match n.as_i64() {
                Some(0) => Some(false),
                Some(1) => Some(true),
                _ => None,
            })
            .collect::<Option<Vec<bool>>>()
    });
    match list {
        Some(l) if l.len() as i64 == layers => Ok(l),
        _ => Err(j.field(format!(
            "no_rope_layers {v}: one 1 (turns) or 0 (does not) for each of the {layers} layers"
        ))),
    }
}

/// The dimensions of a head of `head_dim` the rotary embedding turns
/// with `partial_rotary_factor` `partial` (`int(head_dim * partial)`).
pub(crate) fn rotary_dim(head_dim: i64, partial: f64) -> i64 {
    (head_dim as f64 * partial) as i64
}

/// The config's `pad_token_id` (`default`, the config class's, when
/// left out: Gemma's 0, ...), a token id of the `vocab`, or none.
pub(crate) fn pad_token(
    j: &HfJson,
    default: Option<i64>,
    vocab: i64,
) -> Result<Option<i64>, HfError> {
    let v = match j.get("pad_token_id") {
        None if !j.has("pad_token_id") => default.map(serde_json::Value::from),
        None => None,
        Some(v) => Some(v.clone()),
    };
    let Some(v) = v else {
        return Ok(None);
    };
    match v.as_i64().filter(|p| (0..vocab).contains(p)) {
        Some(p) => Ok(Some(p)),
        None => Err(j.field(format!(
            "pad_token_id {v} is not a token id (0 to vocab_size {vocab} - 1)"
        ))),
    }
}

/// Which layers attend to every earlier token when the model has a
/// sliding window ([`LlamaConfig::full_every`]): read from `layer_types`
/// when the config lists them, else the family's (Gemma 2: every other
/// layer; Gemma 3: every `sliding_window_pattern`-th, 6 unless it says).
fn full_every(j: &HfJson, family: Family, window: Option<i64>) -> Result<Option<i64>, HfError> {
    let default = match family {
        Family::Gemma2 => Some(2),
        Family::Olmo3 => Some(4),
        Family::Gemma3 => Some(j.size_or_none("sliding_window_pattern")?.unwrap_or(6)),
        _ => None,
    };
    let Some(v) = j.get("layer_types") else {
        return Ok(default);
    };
    let list = v.as_array().map(|kinds| {
        (kinds.iter())
            .map(|k| match k.as_str() {
                Some("full_attention") => Some(true),
                Some("sliding_attention") => Some(false),
                _ => None,
            })
            .collect::<Option<Vec<bool>>>()
    });
    let Some(Some(full)) = list else {
        return Err(j.field(format!(
            "layer_types {v}: a list of \"full_attention\" and \"sliding_attention\""
        )));
    };
    let layers = j.size("num_hidden_layers")?;
    if full.len() as i64 != layers {
        return Err(j.field(format!(
            "layer_types lists {} layers, num_hidden_layers is {layers}",
            full.len()
        )));
    }
    // The first global layer's position is the period; every layer
    // sliding has none.
    let every = full.iter().position(|&f| f).map(|i| i as i64 + 1);
    let global = |l: usize| every.is_some_and(|n| (l as i64 + 1) % n == 0);
    if full.iter().enumerate().any(|(l, &f)| f != global(l)) {
        return Err(j.field(format!(
            "layer_types {v}: this Llama computes every n-th layer's attention full and the others' in the window"
        )));
    }
    if every != Some(1) && window.is_none() {
        return Err(j.field(format!(
            "layer_types {v} has sliding_attention layers and no sliding_window"
        )));
    }
    Ok(every)
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
    let Some(v) = j.get("rope_scaling") else {
        return Ok(RopeScaling::None);
    };
    let kind = (v.get("rope_type").or_else(|| v.get("type"))).and_then(|t| t.as_str());
    let num = |key: &str| scaling_number(j, v, key);
    let phi3 = model_type == Family::Phi3.model_type();
    match kind {
        Some("default") => Ok(RopeScaling::None),
        Some("longrope") | Some("su") => long_rope(j, v, rotary_dim),
        Some("yarn") if phi3 => long_rope(j, v, rotary_dim),
        // Phi-3's config class refuses every other kind.
        Some("linear") if !phi3 => Ok(RopeScaling::Linear {
            factor: num("factor")?,
        }),
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
    // transformers' `get_mscale`.
    let mscale = |scale: f64, m: f64| match scale <= 1.0 {
        true => 1.0,
        false => 0.1 * m * scale.ln() + 1.0,
    };
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
    let (original_positions, growth) = match j.size_or_none("original_max_position_embeddings")? {
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
    })
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
/// ([`hf_name`]), and for a mixture of experts declares the experts'
/// parameters [`ShardPlan::partly_unused_on_some_ranks`]. Call it on
/// every rank before the engine is built.
pub fn hf_weight_rules(plan: &ShardPlan, cfg: &LlamaConfig) -> Result<(), EngineError> {
    let tied = cfg.tied;
    plan.rename_weights(move |n| hf_name(n, tied))?;
    // An expert no token of a rank chose gets no gradient there.
    if cfg.moe.is_some() {
        plan.partly_unused_on_some_ranks(|name, _| name.contains(".experts."))?;
    }
    Ok(())
}

/// Hugging Face's layout for an export of a [`Llama`]
/// ([`Engine::save_16bit_model_as`](crate::zero::Engine::save_16bit_model_as)):
/// its own names, and `cfg`'s `config.json` beside them, so that
/// `LlamaForCausalLM.from_pretrained(dir)` loads it.
pub fn hf_export_layout(cfg: &LlamaConfig) -> ExportLayout {
    ExportLayout::new().with_file("config.json", cfg.to_hf_json())
}

/// An RMSNorm, `x / sqrt(mean(x^2) + eps)` in fp32 times its weights,
/// as the family multiplies them ([`NormWeights`]).
#[derive(Debug)]
struct RmsNorm {
    weight: Tensor,
    eps: f64,
    weights: NormWeights,
}

/// How an RMSNorm's weights multiply the normalised values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NormWeights {
    /// Llama's: the values cast back to the input's dtype, then times
    /// the weights.
    Llama,
    /// Gemma's: times `1 + weight` in fp32, then cast (its weights are
    /// offsets from one, zero when new).
    Offset,
    /// OLMo's: times the weights in fp32, then cast.
    Fp32,
}

impl RmsNorm {
    fn new(p: nn::Path, width: i64, c: &LlamaConfig) -> Self {
        let weights = match c.family {
            f if f.gemma() => NormWeights::Offset,
            f if f.olmo() => NormWeights::Fp32,
            _ => NormWeights::Llama,
        };
        let weight = match weights {
            NormWeights::Offset => p.zeros("weight", &[width]),
            _ => p.ones("weight", &[width]),
        };
        Self {
            weight,
            eps: c.eps,
            weights,
        }
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Tensor {
        let h = x.to_kind(Kind::Float);
        let var = h.pow_tensor_scalar(2).mean_dim(-1, true, None::<Kind>);
        let h = h * (var + self.eps).rsqrt();
        match self.weights {
            NormWeights::Llama => &self.weight * h.to_kind(x.kind()),
            NormWeights::Offset => (h * (self.weight.to_kind(Kind::Float) + 1.0)).to_kind(x.kind()),
            NormWeights::Fp32 => (self.weight.to_kind(Kind::Float) * h).to_kind(x.kind()),
        }
    }
}

/// Cohere's LayerNorm: no bias, `(x - mean) / sqrt(var + eps)` times
/// its weights, all in fp32, then cast back (`CohereLayerNorm`,
/// operation for operation).
#[derive(Debug)]
struct CohereNorm {
    weight: Tensor,
    eps: f64,
}

impl Module for CohereNorm {
    fn forward(&self, x: &Tensor) -> Tensor {
        let h = x.to_kind(Kind::Float);
        let centred = &h - h.mean_dim(-1, true, None::<Kind>);
        let var = centred
            .pow_tensor_scalar(2)
            .mean_dim(-1, true, None::<Kind>);
        let h = centred * (var + self.eps).rsqrt();
        (self.weight.to_kind(Kind::Float) * h).to_kind(x.kind())
    }
}

/// A layer's or the model's norm: the family's RMSNorm, StarCoder2's
/// and StableLM's LayerNorm, or Cohere's.
#[derive(Debug)]
enum Norm {
    Rms(RmsNorm),
    /// Boxed: tch's LayerNorm carries its config, three times an
    /// RMSNorm's size.
    Layer(Box<nn::LayerNorm>),
    Cohere(CohereNorm),
}

impl Norm {
    /// The family's norm under `p`, of `width`.
    fn new(p: nn::Path, width: i64, c: &LlamaConfig) -> Self {
        match c.family {
            Family::Cohere => Self::Cohere(CohereNorm {
                weight: p.ones("weight", &[width]),
                eps: c.eps,
            }),
            f if f.layer_norm() => Self::Layer(Box::new(layer_norm(p, width, c.eps))),
            _ => Self::Rms(RmsNorm::new(p, width, c)),
        }
    }
}

impl Module for Norm {
    fn forward(&self, x: &Tensor) -> Tensor {
        match self {
            Self::Rms(n) => n.forward(x),
            Self::Layer(n) => n.forward(x),
            Self::Cohere(n) => n.forward(x),
        }
    }
}

/// Where a decoder layer normalises: its norms, by position.
#[derive(Debug)]
enum Norms {
    /// Llama's: each sublayer's input (`input_layernorm` before the
    /// attention, `post_attention_layernorm` before the MLP).
    Pre { input: Norm, before_mlp: Norm },
    /// Gemma 2's and 3's: each sublayer's input and output
    /// (`input_layernorm`, `post_attention_layernorm` on the attention's
    /// output, `pre_feedforward_layernorm`, `post_feedforward_layernorm`).
    Sandwich {
        input: Norm,
        after_attention: Norm,
        before_mlp: Norm,
        after_mlp: Norm,
    },
    /// OLMo's: each sublayer's output only (`post_attention_layernorm`,
    /// `post_feedforward_layernorm`).
    Post {
        after_attention: Norm,
        after_mlp: Norm,
    },
    /// Cohere's: one norm, whose output the attention and the MLP both
    /// read (`input_layernorm`).
    Parallel { input: Norm },
}

impl Norms {
    /// The family's norms of the layer under `p`, of width `d`.
    fn new(p: &nn::Path, d: i64, c: &LlamaConfig) -> Self {
        let norm = |n: &str| Norm::new(p / n, d, c);
        match c.family {
            f if f.sandwich() => Self::Sandwich {
                input: norm("input_layernorm"),
                after_attention: norm("post_attention_layernorm"),
                before_mlp: norm("pre_feedforward_layernorm"),
                after_mlp: norm("post_feedforward_layernorm"),
            },
            f if f.olmo() => Self::Post {
                after_attention: norm("post_attention_layernorm"),
                after_mlp: norm("post_feedforward_layernorm"),
            },
            f if f.parallel() => Self::Parallel {
                input: norm("input_layernorm"),
            },
            _ => Self::Pre {
                input: norm("input_layernorm"),
                before_mlp: norm("post_attention_layernorm"),
            },
        }
    }

    /// The attention's input: `x`, normalised unless OLMo's.
    fn attention_input(&self, x: &Tensor) -> Tensor {
        match self {
            Self::Pre { input, .. } | Self::Sandwich { input, .. } | Self::Parallel { input } => {
                input.forward(x)
            }
            Self::Post { .. } => x.shallow_clone(),
        }
    }

    /// The attention's output `a`, normalised when the family does.
    fn attention_output(&self, a: Tensor) -> Tensor {
        match self {
            Self::Pre { .. } | Self::Parallel { .. } => a,
            Self::Sandwich {
                after_attention, ..
            }
            | Self::Post {
                after_attention, ..
            } => after_attention.forward(&a),
        }
    }

    /// The MLP's input: `x` (the residual after the attention),
    /// normalised unless OLMo's; Cohere's reads `h`, the attention's
    /// input.
    fn mlp_input(&self, x: &Tensor, h: Tensor) -> Tensor {
        match self {
            Self::Pre { before_mlp, .. } | Self::Sandwich { before_mlp, .. } => {
                before_mlp.forward(x)
            }
            Self::Post { .. } => x.shallow_clone(),
            Self::Parallel { .. } => h,
        }
    }

    /// The MLP's output `m`, normalised when the family does.
    fn mlp_output(&self, m: Tensor) -> Tensor {
        match self {
            Self::Pre { .. } | Self::Parallel { .. } => m,
            Self::Sandwich { after_mlp, .. } | Self::Post { after_mlp, .. } => {
                after_mlp.forward(&m)
            }
        }
    }
}

/// One decoder layer: `x + attn(input_layernorm(x))`, then `x +
/// mlp(post_attention_layernorm(x))` (or normalised where the family
/// does: around each sublayer for Gemma 2 and 3, after it for OLMo;
/// Cohere's `x + attn(n(x)) + mlp(n(x))`).
#[derive(Debug)]
pub struct Layer {
    norms: Norms,
    qkv: Qkv,
    o_proj: Adapted,
    mlp: Mlp,
    /// Qwen3's and Gemma 3's per-head query and key norms, OLMo's over
    /// the whole projections.
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    /// Its rotary embedding, `None` for SmolLM3's layers without.
    rotary: Option<Rotary>,
    /// Its sliding window ([`LlamaConfig::window`]).
    window: Option<i64>,
    training: Training,
    /// Its keys (turned) and values while generating with a cache.
    cache: LayerCache,
    cfg: LlamaConfig,
}

/// The query, key and value projections: three matrices, or Phi-3's
/// one (`qkv_proj`, their rows one after the other).
#[derive(Debug)]
enum Qkv {
    Apart {
        q_proj: Adapted,
        k_proj: Adapted,
        v_proj: Adapted,
    },
    Fused(Adapted),
}

/// The MLP's gate and up projections: two matrices, or Phi-3's one
/// (`gate_up_proj`, the gate's rows first).
#[derive(Debug)]
enum GateUp {
    Apart {
        gate_proj: Adapted,
        up_proj: Adapted,
    },
    Fused(Adapted),
}

/// A layer's MLP: dense and gated, StarCoder2's (`c_proj(act(c_fc(x)))`),
/// or a mixture of experts.
#[derive(Debug)]
enum Mlp {
    Dense { gate_up: GateUp, down_proj: Adapted },
    Plain { c_fc: Adapted, c_proj: Adapted },
    Experts(Experts),
}

/// A sparse mixture of experts ([`MoeConfig`]): the router (`gate`) and
/// each expert's gate, up and down matrices.
#[derive(Debug)]
struct Experts {
    router: Adapted,
    experts: Vec<[Adapted; 3]>,
    top_k: i64,
    normalize: bool,
}

impl Experts {
    /// Under `p` (`block_sparse_moe` or `mlp`), each expert's matrices
    /// named as the family names them.
    fn new(p: &nn::Path, d: i64, m: &MoeConfig, family: Family, lin: &Lin<'_>) -> Self {
        let names = match family {
            Family::Mixtral => ["w1", "w3", "w2"],
            _ => ["gate_proj", "up_proj", "down_proj"],
        };
        let w = m.intermediate;
        let experts = (0..m.experts)
            .map(|e| {
                let ep = p / "experts" / e;
                [
                    lin(&(&ep / names[0]), d, w, false),
                    lin(&(&ep / names[1]), d, w, false),
                    lin(&(&ep / names[2]), w, d, false),
                ]
            })
            .collect();
        Self {
            router: lin(&(p / "gate"), d, m.experts, false),
            experts,
            top_k: m.top_k,
            normalize: m.normalize,
        }
    }

    /// `h` `[batch, seq, d]` through each token's top experts, as
    /// `transformers`' sparse blocks compute it: the routing softmax in
    /// fp32, the experts in order, each on its tokens only, their
    /// weighted outputs added into the result in that order. An expert no
    /// token chose runs on nothing, and its parameters get no gradient
    /// (the plan declares them: [`hf_weight_rules`]).
    fn forward(&self, h: &Tensor, act: Activation) -> Tensor {
        let (b, t, d) = h.size3().unwrap_or((1, 1, 1));
        let h = h.view([-1, d]);
        let probs = self.router.forward(&h).softmax(1, Kind::Float);
        let (weights, chosen) = probs.topk(self.top_k, -1, true, true);
        let weights = match self.normalize {
            true => &weights / weights.sum_dim_intlist(-1, true, Kind::Float),
            false => weights,
        };
        let weights = weights.to_kind(h.kind());
        let mut out = Tensor::zeros([b * t, d], (h.kind(), h.device()));
        // [experts, k, tokens]: which of each token's k slots chose it.
        let mask = chosen.one_hot(self.experts.len() as i64).permute([2, 1, 0]);
        for (e, [gate, up, down]) in self.experts.iter().enumerate() {
            let hits = mask.get(e as i64).nonzero();
            if hits.size()[0] == 0 {
                continue;
            }
            let (slot, token) = (hits.select(1, 0), hits.select(1, 1));
            let x = h.index_select(0, &token);
            let y = down.forward(&(act.apply(&gate.forward(&x)) * up.forward(&x)));
            let w = weights.index(&[Some(token.shallow_clone()), Some(slot)]);
            let y = y * w.unsqueeze(-1);
            let _ = out.index_add_(0, &token, &y.to_kind(h.kind()));
        }
        out.view([b, t, d])
    }
}

impl Layer {
    /// Decoder layer `l` under `p`, its linear layers with the adapters
    /// `lora` targets.
    fn new(
        p: &nn::Path,
        l: i64,
        c: &LlamaConfig,
        (training, decoding): (&Training, &Arc<Decoding>),
        lora: Option<&LoraConfig>,
    ) -> Self {
        let lin = |p: &nn::Path, i, o, bias| Adapted::new(p, (i, o, bias), lora, training);
        let lin: &Lin<'_> = &lin;
        let (a, m) = (p / "self_attn", p / "mlp");
        let (d, hd, qkv, mb) = (c.hidden, c.head_dim, c.qkv_bias, c.mlp_bias);
        let window = c.window(l);
        // Gemma 3's and OLMo 3's windowed layers turn unscaled (Gemma 3's
        // at a base of their own).
        let rope = match (window, c.local_rope_theta) {
            (Some(_), Some(theta)) => (theta, RopeScaling::None),
            _ => (c.rope_theta, c.rope_scaling.clone()),
        };
        // OLMo normalises whole projections, the others each head.
        let (q_width, k_width) = match c.family.olmo() {
            true => (c.heads * hd, c.kv_heads * hd),
            false => (hd, hd),
        };
        let turns = (c.rope_layers.as_ref()).is_none_or(|r| r.get(l as usize) == Some(&true));
        let rotary = turns.then(|| {
            let r = Rotary::new(c.rotary_dim(), rope.0, &rope.1, c.positions, p.device());
            match c.family {
                Family::Cohere => r.interleaved(),
                _ => r,
            }
        });
        Self {
            norms: Norms::new(p, d, c),
            qkv: match c.family {
                Family::Phi3 => {
                    let rows = (c.heads + 2 * c.kv_heads) * hd;
                    Qkv::Fused(lin(&(&a / "qkv_proj"), d, rows, qkv))
                }
                _ => Qkv::Apart {
                    q_proj: lin(&(&a / "q_proj"), d, c.heads * hd, qkv),
                    k_proj: lin(&(&a / "k_proj"), d, c.kv_heads * hd, qkv),
                    v_proj: lin(&(&a / "v_proj"), d, c.kv_heads * hd, qkv),
                },
            },
            o_proj: lin(&(&a / "o_proj"), c.heads * hd, d, c.o_bias),
            mlp: match (&c.moe, c.moe_layer(l)) {
                (Some(moe), true) => {
                    let under = match c.family {
                        Family::Mixtral => p / "block_sparse_moe",
                        _ => m,
                    };
                    Mlp::Experts(Experts::new(&under, d, moe, c.family, lin))
                }
                _ if !c.family.gated() => Mlp::Plain {
                    c_fc: lin(&(&m / "c_fc"), d, c.intermediate, mb),
                    c_proj: lin(&(&m / "c_proj"), c.intermediate, d, mb),
                },
                _ => Mlp::Dense {
                    gate_up: match c.family {
                        Family::Phi3 => {
                            GateUp::Fused(lin(&(&m / "gate_up_proj"), d, 2 * c.intermediate, mb))
                        }
                        _ => GateUp::Apart {
                            gate_proj: lin(&(&m / "gate_proj"), d, c.intermediate, mb),
                            up_proj: lin(&(&m / "up_proj"), d, c.intermediate, mb),
                        },
                    },
                    down_proj: lin(&(&m / "down_proj"), c.intermediate, d, mb),
                },
            },
            qk_norm: c.qk_norm.then(|| {
                (
                    RmsNorm::new(&a / "q_norm", q_width, c),
                    RmsNorm::new(&a / "k_norm", k_width, c),
                )
            }),
            cache: LayerCache::new(decoding, rotary.as_ref().and_then(Rotary::fixed_up_to)),
            rotary,
            window,
            training: training.clone(),
            cfg: c.clone(),
        }
    }
}

/// A layer's rotary embedding: its inverse frequencies, and under
/// LongRoPE those for a sequence longer than the pretrained one and the
/// factor on the cosines and sines.
#[derive(Debug)]
pub(crate) struct Rotary {
    inv_freq: Tensor,
    /// LongRoPE's `long_factor` frequencies, and the longest sequence
    /// `inv_freq` is for.
    long: Option<(Tensor, i64)>,
    /// The cosines' and sines' factor (LongRoPE's and YaRN's
    /// `attention_factor`).
    scale: f64,
    /// Under the `dynamic` scaling, the frequencies of the longest
    /// sequence seen.
    dynamic: Option<Dynamic>,
    /// Cohere's: neighbouring dimensions turn together (`x[2i]`,
    /// `x[2i + 1]`), in fp32, rather than the halves of the head.
    interleaved: bool,
}

/// The `dynamic` scaling's state, `transformers`' own (its rotary
/// embedding's `max_seq_len_cached`): a sequence longer than the longest
/// seen past `positions` computes its frequencies, which the sequences
/// after it use until one shorter than `positions` comes. Each layer
/// keeps its own; every layer sees the same lengths, so they agree.
#[derive(Debug)]
struct Dynamic {
    factor: f64,
    positions: i64,
    hd: i64,
    theta: f64,
    /// The longest length seen since the last reset and its frequencies
    /// (`None`: the unscaled ones, for up to `positions` tokens).
    seen: parking_lot::Mutex<(i64, Option<Tensor>)>,
}

impl Dynamic {
    /// The inverse frequencies for a sequence of `t` tokens, the
    /// unscaled ones being `unscaled`.
    fn inv_freq(&self, t: i64, unscaled: &Tensor) -> Tensor {
        let mut seen = self.seen.lock();
        if t > seen.0 {
            *seen = (t, Some(self.grown(t, unscaled.device())));
        }
        if t < self.positions && seen.0 > self.positions {
            *seen = (self.positions, None);
        }
        seen.1.as_ref().unwrap_or(unscaled).shallow_clone()
    }

    /// The frequencies for `t` tokens past `positions`, operation for
    /// operation as `transformers` computes them from a length held in a
    /// tensor (the base in fp32, not in Python's doubles).
    fn grown(&self, t: i64, device: tch::Device) -> Tensor {
        let (f, d) = (self.factor, self.hd as f64);
        let n = Tensor::from_slice(&[t]).to_device(device).squeeze();
        let base = ((n * f) / self.positions as f64 - (f - 1.0)).pow_tensor_scalar(d / (d - 2.0))
            * self.theta;
        let exponents = Tensor::arange_start_step(0, self.hd, 2, (Kind::Int64, device))
            .to_kind(Kind::Float)
            / d;
        base.pow(&exponents).reciprocal()
    }
}

impl Rotary {
    /// Turning `hd` dimensions at base `theta`, scaled as `scaling` says
    /// (`positions`, `max_position_embeddings`, is what the `dynamic`
    /// scaling grows past).
    pub(crate) fn new(
        hd: i64,
        theta: f64,
        scaling: &RopeScaling,
        positions: i64,
        device: tch::Device,
    ) -> Self {
        let powers = base_powers(hd, theta, device);
        let long = match scaling {
            RopeScaling::LongRope {
                long,
                original_positions,
                ..
            } => Some((divided(&powers, long), *original_positions)),
            _ => None,
        };
        let scale = match scaling {
            RopeScaling::LongRope {
                attention_factor, ..
            }
            | RopeScaling::Yarn {
                attention_factor, ..
            } => *attention_factor,
            _ => 1.0,
        };
        let dynamic = match scaling {
            RopeScaling::Dynamic { factor } => Some(Dynamic {
                factor: *factor,
                positions,
                hd,
                theta,
                seen: parking_lot::Mutex::new((positions, None)),
            }),
            _ => None,
        };
        Self {
            inv_freq: inv_freq(&powers, hd, theta, scaling, positions),
            long,
            scale,
            dynamic,
            interleaved: false,
        }
    }

    /// As it is, turning neighbouring pairs of dimensions (Cohere's).
    fn interleaved(self) -> Self {
        Self {
            interleaved: true,
            ..self
        }
    }

    /// Up to which sequence length its frequencies stay the same
    /// (`None`: at every length): LongRoPE's short factors serve up to
    /// `original_max_position_embeddings`, the `dynamic` scaling leaves
    /// the base as it is up to `max_position_embeddings` (a sequence
    /// shorter than it resets a base grown before).
    pub(crate) fn fixed_up_to(&self) -> Option<i64> {
        match (&self.long, &self.dynamic) {
            (Some((_, original)), _) => Some(*original),
            (_, Some(dynamic)) => Some(dynamic.positions),
            _ => None,
        }
    }

    /// The inverse frequencies for a sequence of `t` tokens.
    fn inv_freq(&self, t: i64) -> Tensor {
        match (&self.long, &self.dynamic) {
            (Some((long, original)), _) if t > *original => long.shallow_clone(),
            (_, Some(dynamic)) => dynamic.inv_freq(t, &self.inv_freq),
            _ => self.inv_freq.shallow_clone(),
        }
    }
}

/// `theta^(2i/hd)` for each pair `i` a head of `hd` rotated dimensions
/// turns, `[hd / 2]` in fp32, as `transformers` computes it (each
/// operation in its order, so that the angles are its to the bit).
fn base_powers(hd: i64, theta: f64, device: tch::Device) -> Tensor {
    let exponents =
        Tensor::arange_start_step(0, hd, 2, (Kind::Int64, device)).to_kind(Kind::Float) / hd as f64;
    Tensor::pow_scalar(theta, &exponents)
}

/// LongRoPE's inverse frequencies: `1 / (factors * powers)`.
fn divided(powers: &Tensor, factors: &[f64]) -> Tensor {
    let factors = Tensor::from_slice(factors)
        .to_kind(Kind::Float)
        .to_device(powers.device());
    (factors * powers).reciprocal()
}

/// The rotary embedding's inverse frequencies, `[hd / 2]` in fp32 (`hd`
/// the dimensions it turns, `powers` their [`base_powers`] at `theta`),
/// computed as `transformers` computes them: `theta^(-2i/hd)`, scaled as
/// `scaling` says (LongRoPE's for a sequence up to the pretrained
/// length).
fn inv_freq(powers: &Tensor, hd: i64, theta: f64, scaling: &RopeScaling, positions: i64) -> Tensor {
    match scaling {
        RopeScaling::None => powers.reciprocal(),
        RopeScaling::Linear { factor } => powers.reciprocal() / *factor,
        // Up to `max_position_embeddings` `m` tokens: the base grown by
        // `factor * m / m - (factor - 1)` in Python's doubles, as
        // `transformers` initialises it (1, or an ulp from it).
        RopeScaling::Dynamic { factor } => {
            let m = positions as f64;
            let grown = (factor * m / m - (factor - 1.0)).powf(hd as f64 / (hd as f64 - 2.0));
            base_powers(hd, theta * grown, powers.device()).reciprocal()
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_positions: old,
        } => {
            let (factor, low, high, old) = (*factor, *low, *high, *old);
            let inv = powers.reciprocal();
            let wavelen = inv.reciprocal() * (2.0 * std::f64::consts::PI);
            let long = wavelen.gt(old / low);
            let scaled = (&inv / factor).where_self(&long, &inv);
            let smooth = (wavelen.reciprocal() * old - low) / (high - low);
            let smoothed = (smooth.neg() + 1.0) * &scaled / factor + &smooth * &scaled;
            let short = wavelen.lt(old / high);
            let medium = short.logical_not().logical_and(&long.logical_not());
            smoothed.where_self(&medium, &scaled)
        }
        RopeScaling::LongRope { short, .. } => divided(powers, short),
        RopeScaling::Yarn {
            factor,
            original_positions,
            beta_fast,
            beta_slow,
            truncate,
            ..
        } => yarn_inv_freq(
            powers,
            hd,
            theta,
            *factor,
            *original_positions,
            (*beta_fast, *beta_slow),
            *truncate,
        ),
    }
}

/// YaRN's inverse frequencies from `powers` ([`base_powers`] of `hd`
/// dimensions at base `theta`), operation for operation as
/// `transformers` computes them: the pairs that turn fewer than
/// `beta_slow` times over `original` positions interpolated (divided by
/// `factor`), those turning more than `beta_fast` times kept, a linear
/// ramp over the dimensions between.
fn yarn_inv_freq(
    powers: &Tensor,
    hd: i64,
    theta: f64,
    factor: f64,
    original: f64,
    (beta_fast, beta_slow): (f64, f64),
    truncate: bool,
) -> Tensor {
    let dim = hd as f64;
    // The dimension at which a frequency turns `rotations` times.
    let at = |rotations: f64| {
        (dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * theta.ln())
    };
    let (low, high) = match truncate {
        true => (at(beta_fast).floor(), at(beta_slow).ceil()),
        false => (at(beta_fast), at(beta_slow)),
    };
    let (low, high) = (low.max(0.0), high.min(dim - 1.0));
    let high = if low == high { high + 0.001 } else { high };
    let ramp = ((Tensor::arange(hd / 2, (Kind::Float, powers.device())) - low) / (high - low))
        .clamp(0.0, 1.0);
    let kept = ramp.neg() + 1.0;
    let interpolated = (powers * factor).reciprocal();
    let extrapolated = powers.reciprocal();
    interpolated * (kept.neg() + 1.0) + extrapolated * kept
}

/// Rotary position embedding of `x` `[batch, heads, seq, head_dim]`:
/// `x * cos + rotate_half(x) * sin`, `rotate_half` turning the second half
/// of each head's dimensions before the first (`transformers`'
/// convention), the angles computed in fp32 from the rotary's inverse
/// frequencies for the sequence's length (and its cosines and sines
/// scaled by its factor, in fp32). Only the first `2 * inv_freq.len()`
/// dimensions turn (all but under Phi-3's `partial_rotary_factor`); the
/// rest pass as they are. `x`'s positions start at `offset` (the tokens
/// a generation's cache holds before it; 0 without one).
pub(crate) fn rope_from(x: &Tensor, rotary: &Rotary, offset: i64) -> Tensor {
    let t = x.size()[2];
    let opts = (Kind::Float, x.device());
    let positions = match offset {
        0 => Tensor::arange(t, opts),
        o => Tensor::arange_start(o, o + t, opts),
    };
    rope(x, rotary, &rotary.inv_freq(offset + t), &positions)
}

/// As [`rope_from`], each token of `x` `[batch, heads, seq, head_dim]`
/// turned at its position in its packed document (`documents`), the
/// frequencies those of the longest position's length, as `transformers`
/// turns at `position_ids`.
pub(crate) fn rope_at(x: &Tensor, rotary: &Rotary, documents: &Documents) -> Tensor {
    let positions = documents.positions.to_kind(Kind::Float).unsqueeze(1);
    rope(x, rotary, &rotary.inv_freq(documents.longest), &positions)
}

/// The rotary embedding of `x` at `positions` (`[seq]`, or `[batch, 1,
/// seq]` for each row its own), fp32, with inverse frequencies `inv_freq`.
fn rope(x: &Tensor, rotary: &Rotary, inv_freq: &Tensor, positions: &Tensor) -> Tensor {
    let hd = x.size()[3];
    let rd = 2 * inv_freq.size()[0];
    let freqs = positions.unsqueeze(-1) * inv_freq;
    if rotary.interleaved {
        return rope_interleaved(x, &freqs, rotary.scale);
    }
    let emb = Tensor::cat(&[&freqs, &freqs], -1);
    let (cos, sin) = match rotary.scale {
        1.0 => (emb.cos(), emb.sin()),
        s => (emb.cos() * s, emb.sin() * s),
    };
    let (cos, sin) = (cos.to_kind(x.kind()), sin.to_kind(x.kind()));
    let turned = match rd < hd {
        true => x.narrow(-1, 0, rd),
        false => x.shallow_clone(),
    };
    let (x1, x2) = (
        turned.narrow(-1, 0, rd / 2),
        turned.narrow(-1, rd / 2, rd / 2),
    );
    let rotated = Tensor::cat(&[&x2.neg(), &x1], -1);
    let turned = turned * cos + rotated * sin;
    match rd < hd {
        true => Tensor::cat(&[&turned, &x.narrow(-1, rd, hd - rd)], -1),
        false => turned,
    }
}

/// Cohere's rotary embedding of `x` `[batch, heads, seq, head_dim]` at
/// angles `freqs` `[seq, head_dim / 2]`: each pair `(x[2i], x[2i + 1])`
/// turned by angle `i`, in fp32 (the cosines and sines rounded to `x`'s
/// dtype first), then cast back, as `transformers`' Cohere does.
fn rope_interleaved(x: &Tensor, freqs: &Tensor, scale: f64) -> Tensor {
    let emb = freqs.repeat_interleave_self_int(2, Some(-1), None);
    let (cos, sin) = match scale {
        1.0 => (emb.cos(), emb.sin()),
        s => (emb.cos() * s, emb.sin() * s),
    };
    let rounded = |t: Tensor| t.to_kind(x.kind()).to_kind(Kind::Float);
    let (cos, sin) = (rounded(cos), rounded(sin));
    let h = x.to_kind(Kind::Float);
    let last = *h.size().last().unwrap_or(&0);
    let (even, odd) = (h.slice(-1, 0, last, 2), h.slice(-1, 1, last, 2));
    let rotated = Tensor::stack(&[odd.neg(), even], -1).flatten(-2, -1);
    (h * cos + rotated * sin).to_kind(x.kind())
}

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> Tensor {
        let (b, t, _) = x.size3().unwrap_or((1, 1, 1));
        let c = &self.cfg;
        let h = self.norms.attention_input(x);
        let (q, k, v) = match &self.qkv {
            Qkv::Apart {
                q_proj,
                k_proj,
                v_proj,
            } => (q_proj.forward(&h), k_proj.forward(&h), v_proj.forward(&h)),
            Qkv::Fused(qkv) => {
                let qkv = qkv.forward(&h);
                let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
                (
                    qkv.narrow(-1, 0, q),
                    qkv.narrow(-1, q, kv),
                    qkv.narrow(-1, q + kv, kv),
                )
            }
        };
        // Normalised over the projection before the heads are split
        // (OLMo), or over each head after.
        let whole = c.family.olmo();
        let heads = |x: Tensor, n: i64, norm: Option<&RmsNorm>| {
            let normed = |x: Tensor| norm.map_or_else(|| x.shallow_clone(), |nm| nm.forward(&x));
            let x = if whole { normed(x) } else { x };
            let x = x.view([b, t, n, c.head_dim]);
            let x = if whole { x } else { normed(x) };
            x.transpose(1, 2)
        };
        let (qn, kn) = match &self.qk_norm {
            Some((q, k)) => (Some(q), Some(k)),
            None => (None, None),
        };
        // Generating with a cache: these tokens come after `offset`.
        let offset = self.cache.offset();
        let documents = self.cache.documents();
        let turned = |x: Tensor| match (&self.rotary, &documents) {
            (Some(rotary), Some(d)) => rope_at(&x, rotary, d),
            (Some(rotary), None) => rope_from(&x, rotary, offset),
            (None, _) => x,
        };
        let q = turned(heads(q, c.heads, qn));
        let k = turned(heads(k, c.kv_heads, kn));
        let v = heads(v, c.kv_heads, None);
        let (k, v) = self.cache.extend(k, v);
        let a = self.attention(&q, &k, &v, offset, documents.as_ref());
        let a = a
            .transpose(1, 2)
            .contiguous()
            .view([b, t, c.heads * c.head_dim]);
        let a = self
            .training
            .dropout(self.o_proj.forward(&a), c.attention_output_dropout());
        let x = x + self.residual(self.norms.attention_output(a));
        // (Cohere's MLP output joins the sum after the attention's, as
        // there.)
        let h = self.norms.mlp_input(&x, h);
        let m = match &self.mlp {
            Mlp::Dense { gate_up, down_proj } => {
                let (gate, up) = match gate_up {
                    GateUp::Apart { gate_proj, up_proj } => {
                        (gate_proj.forward(&h), up_proj.forward(&h))
                    }
                    GateUp::Fused(gate_up) => {
                        let both = gate_up.forward(&h);
                        let i = c.intermediate;
                        (both.narrow(-1, 0, i), both.narrow(-1, i, i))
                    }
                };
                let m = c.activation.apply(&gate) * up;
                self.training
                    .dropout(down_proj.forward(&m), c.resid_dropout)
            }
            Mlp::Plain { c_fc, c_proj } => {
                let m = c.activation.apply(&c_fc.forward(&h));
                self.training.dropout(c_proj.forward(&m), c.resid_dropout)
            }
            Mlp::Experts(experts) => experts.forward(&h, c.activation),
        };
        &x + self.residual(self.norms.mlp_output(m))
    }
}

impl Layer {
    /// A sublayer's output `y` as it joins the residual: times Granite's
    /// `residual_multiplier`.
    fn residual(&self, y: Tensor) -> Tensor {
        match self.cfg.residual_multiplier {
            1.0 => y,
            m => y * m,
        }
    }

    /// Causal grouped-query attention of `q` `[batch, heads, seq, hd]`
    /// over `k` and `v` (`kv_heads` heads), in the layer's window,
    /// `[batch, heads, seq, hd]`: libtorch's fused kernel, or, when the
    /// scores are soft-capped (Gemma 2), `transformers`' eager attention
    /// operation for operation (the fused kernel cannot cap them). Packed
    /// `documents` each attend within themselves (and their window).
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        offset: i64,
        documents: Option<&Documents>,
    ) -> Tensor {
        let c = &self.cfg;
        let t = q.size()[2];
        // Within a sliding window shorter than the sequence, a token sees
        // itself and the `w - 1` before it; else every earlier token.
        // Queries at `offset..offset + t` over keys from 0 (a cache's).
        let visible = |w: i64| {
            let opts = (Kind::Int64, q.device());
            let (i, j) = match offset {
                0 => (Tensor::arange(t, opts), Tensor::arange(t, opts)),
                o => (
                    Tensor::arange_start(o, o + t, opts),
                    Tensor::arange(o + t, opts),
                ),
            };
            let back = i.unsqueeze(1) - j.unsqueeze(0);
            back.ge(0).logical_and(&back.lt(w))
        };
        let dropout = self.training.attention(c.attention_dropout);
        let scale = (c.attention_multiplier).or(c.query_scalar.map(|s| s.powf(-0.5)));
        let Some(cap) = c.attn_softcap else {
            let grouped = c.kv_heads != c.heads;
            if let Some(d) = documents {
                return d.attend((q, k, v), self.window, scale, dropout, grouped);
            }
            // A cache's keys reach back past the queries: an explicit mask.
            let window = match offset {
                0 => self.window.filter(|&w| w < t).map(visible),
                _ => Some(visible(self.window.unwrap_or(offset + t + 1))),
            };
            let causal = window.is_none();
            return Tensor::scaled_dot_product_attention(
                q, k, v, window, dropout, causal, scale, grouped,
            );
        };
        let groups = c.heads / c.kv_heads;
        let (k, v) = (
            k.repeat_interleave_self_int(groups, 1, None),
            v.repeat_interleave_self_int(groups, 1, None),
        );
        let scale = scale.unwrap_or((c.head_dim as f64).powf(-0.5));
        let eager = |q: &Tensor, k: &Tensor, v: &Tensor, visible: &Tensor| {
            let scores = q.matmul(&k.transpose(2, 3)) * scale;
            let scores = (scores / cap).tanh() * cap;
            let scores = scores.masked_fill(&visible.logical_not(), f64::NEG_INFINITY);
            let weights = scores.softmax(-1, Kind::Float).to_kind(q.kind());
            self.training
                .dropout(weights, c.attention_dropout)
                .matmul(v)
        };
        let window = self.window.unwrap_or(offset + t + 1);
        match documents {
            // Without dropout, each document's scores alone (as the fused
            // kernel's, `Documents::attend`): the row's would be `seq`
            // squared a head. With it, the row's, so that the weights
            // dropped are those `transformers` drops.
            Some(d) if dropout == 0.0 => d.per_document((q, &k, &v), |q, k, v, n| {
                eager(q, k, v, &in_window(n, window, q.device()))
            }),
            Some(d) => eager(q, &k, &v, &d.visible_within(self.window)),
            None => eager(q, &k, &v, &visible(window)),
        }
    }
}

/// Llama with a language-modelling head (`LlamaForCausalLM`).
#[derive(Debug)]
pub struct Llama {
    ends: Ends,
    layers: Vec<ShardedModule<Run<Layer>>>,
    norm: Norm,
    training: Training,
    decoding: Arc<Decoding>,
    /// Boxed: the config is a few hundred bytes, [`crate::hf::HfModel`]'s
    /// variants stay alike in size.
    cfg: Box<LlamaConfig>,
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
        Self::build(p, plan, cfg, false, None)
    }

    /// As [`Llama::new`], every decoder layer's activations recomputed in
    /// backward (`transformers`' `gradient_checkpointing_enable()`): the
    /// same results, less memory, one more layer forward per backward.
    pub fn new_checkpointed(p: &nn::Path, plan: &ShardPlan, cfg: &LlamaConfig) -> Self {
        Self::build(p, plan, cfg, true, None)
    }

    /// As [`Llama::new`] (or [`Llama::new_checkpointed`] when
    /// `checkpointed`), each linear layer of the decoder layers that
    /// `lora` targets with a LoRA adapter under PEFT's names
    /// (`q_proj.lora_A.weight`, `q_proj.lora_B.weight`: [`crate::lora`]).
    /// Everything trains until [`crate::lora::freeze_base`] freezes all
    /// but the adapters; a base from its checkpoint wants the plan's
    /// `fresh_weights` to name them ([`crate::hf::HfModel::from_pretrained_with`]
    /// does all of it).
    pub fn with_lora(
        p: &nn::Path,
        plan: &ShardPlan,
        cfg: &LlamaConfig,
        lora: &LoraConfig,
        checkpointed: bool,
    ) -> Self {
        Self::build(p, plan, cfg, checkpointed, Some(lora))
    }

    fn build(
        p: &nn::Path,
        plan: &ShardPlan,
        cfg: &LlamaConfig,
        checkpointed: bool,
        lora: Option<&LoraConfig>,
    ) -> Self {
        let m = p / "model";
        // The root's variables before the first unit: a plan releasing
        // the model as it is built (`weights_from_file`) releases what
        // was made before each `ShardedModule::new`, and would leave a
        // root made after the last one held until the engine is built.
        let norm = Norm::new(&m / "norm", cfg.hidden, cfg);
        let embed = Ends::embedding(
            plan,
            &(&m / "embed_tokens"),
            (cfg.vocab, cfg.hidden),
            (cfg.pad_token, cfg.tied),
            lora,
        );
        let training = Training::default();
        let decoding = Decoding::new();
        let layers = (0..cfg.layers)
            .map(|i| {
                let lp = &m / "layers" / i;
                let layer = Layer::new(&lp, i, cfg, (&training, &decoding), lora);
                let run = Run::with_state(layer, checkpointed, (&training, &decoding));
                ShardedModule::new(plan, &lp, run)
            })
            .collect();
        let ends = embed.with_head(plan, &(p / "lm_head"), false, (lora, &training));
        Self {
            ends,
            layers,
            norm,
            training,
            decoding,
            cfg: Box::new(cfg.clone()),
        }
    }

    /// Its layers' key-value caches (see [`crate::kv_cache`]).
    pub(crate) fn decoding(&self) -> &Decoding {
        &self.decoding
    }

    /// Turns dropout (`attention_dropout`) on or off: PyTorch's
    /// `model.train()` and `model.eval()`. Off when built, as
    /// `from_pretrained` returns a model in evaluation.
    pub fn set_training(&self, on: bool) {
        self.training.set(on);
    }

    /// Its dropout switch and embedding noise.
    pub(crate) fn training(&self) -> &Training {
        &self.training
    }

    /// Whether dropout is on.
    pub fn is_training(&self) -> bool {
        self.training.on()
    }

    /// Logits `[batch, seq, vocab]` for token ids `[batch, seq]` (int64).
    pub fn forward(&self, tokens: &Tensor) -> Tensor {
        self.forward_in(tokens, None)
    }

    /// As [`Self::forward`], the tokens packed in `documents` when given
    /// ([`crate::hf::HfModel::forward_packed`]).
    pub(crate) fn forward_in(&self, tokens: &Tensor, documents: Option<Documents>) -> Tensor {
        self.decoding.set_documents(documents);
        // NEFTune's noise joins the embedding module's output: Gemma 3's
        // scales the rows inside it, the others' models outside.
        let gemma3 = self.cfg.family == Family::Gemma3;
        let embedded = self.ends.embed(tokens);
        let embedded = match gemma3 {
            true => embedded,
            false => self.training.embedding_noise(embedded),
        };
        let mut x = match (self.cfg.family.gemma(), self.cfg.embedding_multiplier) {
            (false, 1.0) => embedded,
            (false, m) => embedded * m,
            (true, _) => {
                // The width's square root in the embeddings' dtype, as
                // `transformers` rounds it (to 55.5 for 3072 in bf16).
                let root = Tensor::from((self.cfg.hidden as f64).sqrt() as f32);
                let root = root.to_kind(embedded.kind()).to_device(embedded.device());
                embedded * root
            }
        };
        if gemma3 {
            x = self.training.embedding_noise(x);
        }
        x = self.training.dropout(x, self.cfg.embedding_dropout);
        for l in &self.layers {
            x = l.forward(&x);
        }
        // The caches hold these tokens now.
        self.decoding.advance(tokens);
        let x = self.norm.forward(&x);
        let logits = self.ends.head(&x);
        let logits = match self.cfg.logits_scaling {
            1.0 => logits,
            s => logits / s,
        };
        let logits = match self.cfg.logit_scale {
            1.0 => logits,
            s => logits * s,
        };
        match self.cfg.final_softcap {
            Some(cap) => (logits / cap).tanh() * cap,
            None => logits,
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

    /// A scratch directory the config tests write configs into, removed
    /// when dropped.
    struct ConfigDir(std::path::PathBuf);

    impl ConfigDir {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("zrt-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }

        /// `text` written as `config.json`, read.
        fn read(&self, text: &str) -> Result<LlamaConfig, HfError> {
            std::fs::write(self.0.join("config.json"), text).unwrap();
            LlamaConfig::from_hf_dir(&self.0)
        }

        /// Each config reads back from the `config.json` it writes
        /// (`to_hf_json`) as itself.
        fn round_trips(&self, cfgs: impl IntoIterator<Item = LlamaConfig>) {
            for cfg in cfgs {
                let ours = self.0.join("ours.json");
                std::fs::write(&ours, cfg.to_hf_json()).unwrap();
                assert_eq!(LlamaConfig::from_hf_dir(&ours).unwrap(), cfg);
            }
        }
    }

    impl Drop for ConfigDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

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
        let dir = ConfigDir::new("llama-config");
        // Llama 3.2 1B's config.json.
        let good = r#"{"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "max_position_embeddings": 131072, "tie_word_embeddings": true}"#;
        let cfg = dir.read(good).unwrap();
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
            activation: Activation::Silu,
            pad_token: None,
            query_scalar: None,
            attn_softcap: None,
            final_softcap: None,
            full_every: None,
            local_rope_theta: None,
            partial_rotary: 1.0,
            resid_dropout: 0.0,
            embedding_dropout: 0.0,
            embedding_multiplier: 1.0,
            residual_multiplier: 1.0,
            attention_multiplier: None,
            logits_scaling: 1.0,
            logit_scale: 1.0,
            rope_layers: None,
            moe: None,
        };
        assert_eq!(cfg, want);
        dir.round_trips([cfg.clone()]);
        // Qwen2 has biases on q, k and v; Mistral a sliding window.
        let qwen = good.replace(r#""llama""#, r#""qwen2""#);
        let q = dir.read(&qwen).unwrap();
        assert_eq!(
            (q.family, q.qkv_bias, q.o_bias),
            (Family::Qwen2, true, false)
        );
        let mistral = good.replace(r#""llama""#, r#""mistral", "sliding_window": 4096"#);
        let m = dir.read(&mistral).unwrap();
        assert_eq!((m.family, m.sliding_window), (Family::Mistral, Some(4096)));
        // Qwen3 normalises queries and keys, biases only when
        // attention_bias; layer_types all full attention is every layer's.
        let full = vec![r#""full_attention""#; 16].join(", ");
        let qwen3 = good.replace(
            r#""llama""#,
            &format!(r#""qwen3", "attention_bias": true, "layer_types": [{full}]"#),
        );
        let q3 = dir.read(&qwen3).unwrap();
        assert_eq!(
            (q3.family, q3.qk_norm, q3.qkv_bias, q3.o_bias),
            (Family::Qwen3, true, true, true)
        );
        let dynamic = dir
            .read(&good.replace(
                r#""rope_scaling": {"#,
                r#""rope_scaling": {"rope_type": "dynamic", "factor": 4.0}, "was": {"#,
            ))
            .unwrap();
        assert_eq!(dynamic.rope_scaling, RopeScaling::Dynamic { factor: 4.0 });
        dir.round_trips([q, m, q3, dynamic]);
        let full_sliding = r#""full_attention", "sliding_attention""#;
        let sliding_full = r#""sliding_attention", "full_attention""#;
        for (from, to, says) in [
            (r#""llama""#, r#""gemma4""#, "model_type Some(\"gemma4\")"),
            (
                r#""high_freq_factor": 4.0, "#,
                "",
                "its `high_freq_factor` is missing",
            ),
            (
                r#""rope_scaling": {"#,
                r#""rope_scaling": {"rope_type": "ntk-by-parts"}, "was": {"#,
                "this llama computes the \"linear\", \"dynamic\", \"llama3\", \"longrope\" and \"yarn\" kinds only",
            ),
            (
                r#""llama""#,
                r#""phi3""#,
                "this phi3 computes the \"longrope\" (\"su\", \"yarn\") kinds only",
            ),
            (
                r#""rope_scaling": {"#,
                r#""rope_scaling": {"rope_type": "yarn"}, "was": {"#,
                "its `factor` is missing or not a number",
            ),
            (
                r#""llama""#,
                r#""qwen2", "use_sliding_window": true"#,
                "use_sliding_window true",
            ),
            (
                r#""llama""#,
                &format!(
                    r#""qwen3", "layer_types": [{}]"#,
                    [full_sliding; 8].join(", ")
                ),
                "every n-th layer's attention full",
            ),
            (
                r#""llama""#,
                &format!(
                    r#""qwen3", "layer_types": [{}]"#,
                    [sliding_full; 8].join(", ")
                ),
                "has sliding_attention layers and no sliding_window",
            ),
            (
                r#""llama""#,
                r#""llama", "layer_types": ["full_attention"]"#,
                "layer_types lists 1 layers, num_hidden_layers is 16",
            ),
            (r#""silu""#, r#""relu""#, "hidden_act \"relu\""),
            (
                r#""llama""#,
                r#""llama", "pad_token_id": 128256"#,
                "pad_token_id 128256 is not a token id",
            ),
            (
                r#""llama""#,
                r#""gemma3_text", "use_bidirectional_attention": true"#,
                "use_bidirectional_attention true",
            ),
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
            let err = dir.read(&good.replace(from, to)).unwrap_err().to_string();
            assert!(err.contains(says) && err.contains("config.json"), "{err}");
        }
    }

    #[test]
    fn gemma_configs_are_read_as_transformers_reads_them_and_counted() {
        let dir = ConfigDir::new("gemma-config");
        // Gemma 2 2B's and Gemma 3 1B's config.json; their parameter
        // counts are transformers' (2614341888, 999885952).
        let gemma2 = r#"{"architectures": ["Gemma2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32", "vocab_size": 256000}"#;
        let gemma3 = r#"{"architectures": ["Gemma3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "attn_logit_softcapping": null, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106], "final_logit_softcapping": null, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": true, "vocab_size": 262144}"#;
        let read = |text: &str| dir.read(text);
        let g2 = read(gemma2).unwrap();
        assert_eq!(
            (g2.family, g2.activation, g2.pad_token, g2.tied, g2.head_dim),
            (Family::Gemma2, Activation::GeluTanh, Some(0), true, 256)
        );
        assert_eq!(
            (g2.query_scalar, g2.attn_softcap, g2.final_softcap),
            (Some(256.0), Some(50.0), Some(30.0))
        );
        assert_eq!((g2.sliding_window, g2.full_every), (Some(4096), Some(2)));
        assert_eq!((g2.window(0), g2.window(1)), (Some(4096), None));
        let g3 = read(gemma3).unwrap();
        assert_eq!(
            (g3.family, g3.qk_norm, g3.attn_softcap, g3.final_softcap),
            (Family::Gemma3, true, None, None)
        );
        assert_eq!(
            (g3.rope_theta, g3.local_rope_theta, g3.full_every),
            (1e6, Some(10000.0), Some(6))
        );
        let globals: Vec<i64> = (0..26).filter(|&l| g3.window(l).is_none()).collect();
        assert_eq!(globals, [5, 11, 17, 23]);
        let total = |c: &LlamaConfig| c.unit_params().iter().map(|u| u.1).sum::<u64>();
        assert_eq!((total(&g2), total(&g3)), (2614341888, 999885952));
        // Left out: the family's defaults (Gemma: tied, head_dim 256,
        // the tanh GELU; Gemma 2: the caps, a window, every other layer).
        let bare = r#"{"model_type": "gemma2", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}"#;
        let b = read(bare).unwrap();
        assert_eq!(
            (
                b.tied,
                b.head_dim,
                b.activation,
                b.sliding_window,
                b.full_every
            ),
            (true, 256, Activation::GeluTanh, Some(4096), Some(2))
        );
        assert_eq!((b.attn_softcap, b.final_softcap), (Some(50.0), Some(30.0)));
        // Gemma reads hidden_act (exact GELU in Gemma 1's releases), its
        // sequels hidden_activation (its class's 16 key-value heads would
        // not divide these 4 heads: given).
        let g1 = read(
            &bare
                .replace("gemma2", "gemma")
                .replace("{", r#"{"hidden_act": "gelu", "num_key_value_heads": 1, "#),
        )
        .unwrap();
        assert_eq!(
            (g1.activation, g1.full_every, g1.sliding_window),
            (Activation::Gelu, None, None)
        );
        // What the model writes it reads back.
        dir.round_trips([g1, g2, g3, b]);
        // Windowed layers in another order than every n-th global.
        let odd = gemma3.replace(
            r#""sliding_window_pattern": 6"#,
            r#""num_hidden_layers": 3, "layer_types": ["full_attention", "sliding_attention", "full_attention"]"#,
        ).replace(r#""num_hidden_layers": 26, "#, "");
        let err = read(&odd).unwrap_err().to_string();
        assert!(err.contains("every n-th layer's attention full"), "{err}");
    }

    #[test]
    fn a_phi3_config_is_read_as_transformers_reads_it_and_counted() {
        let dir = ConfigDir::new("phi3-config");
        // Phi-3-mini-4k-instruct's config.json; 3821079552 parameters as
        // transformers builds it.
        let phi3 = r#"{"architectures": ["Phi3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 32064}"#;
        let read = |text: &str| dir.read(text);
        let c = read(phi3).unwrap();
        assert_eq!(
            (
                c.family,
                c.pad_token,
                c.sliding_window,
                c.rotary_dim(),
                c.eps
            ),
            (Family::Phi3, Some(32000), Some(2047), 96, 1e-5)
        );
        let total: u64 = c.unit_params().iter().map(|u| u.1).sum();
        assert_eq!(total, 3821079552);
        // Phi-4-mini's part of each head turns; its longrope is refused.
        let partial = phi3.replace(
            r#""resid_pdrop": 0.0"#,
            r#""resid_pdrop": 0.1, "partial_rotary_factor": 0.75"#,
        );
        let p = read(&partial).unwrap();
        assert_eq!((p.rotary_dim(), p.resid_dropout), (72, 0.1));
        // Phi-3.5-mini's LongRoPE (its 48 factors each), its context 32
        // times the pretrained 4096: the cosines' factor is
        // sqrt(1 + ln 32 / ln 4096). Phi-3's class reads "su" as it.
        let (short, long): (Vec<f64>, Vec<f64>) = (0..48)
            .map(|i| (1.0 + i as f64 / 100.0, 1.0 + i as f64))
            .unzip();
        let longrope = format!(
            r#""rope_scaling": {{"type": "su", "short_factor": {short:?}, "long_factor": {long:?}}}, "max_position_embeddings": 131072"#
        );
        let l = read(
            &phi3
                .replace(r#""rope_scaling": null"#, &longrope)
                .replace(r#""max_position_embeddings": 4096, "#, ""),
        )
        .unwrap();
        let want = RopeScaling::LongRope {
            short,
            long,
            original_positions: 4096,
            attention_factor: (1.0 + 32f64.ln() / 4096f64.ln()).sqrt(),
        };
        assert_eq!(l.rope_scaling, want);
        let RopeScaling::LongRope {
            attention_factor, ..
        } = want
        else {
            unreachable!()
        };
        assert!((attention_factor - 1.1902380714238083).abs() < 1e-15);
        dir.round_trips([c, p, l]);
        for (from, to, says) in [
            (
                r#""rope_scaling": null"#,
                r#""rope_scaling": {"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}"#,
                "its `short_factor` has 1 numbers, one for each of the 48 pairs a head turns",
            ),
            (
                r#""resid_pdrop": 0.0"#,
                r#""partial_rotary_factor": 0.7"#,
                "is 67 dimensions: rotary embeddings turn pairs",
            ),
            (
                r#""model_type": "phi3""#,
                r#""model_type": "llama", "partial_rotary_factor": 0.5"#,
                "partial_rotary_factor 0.5: this llama rotates every dimension",
            ),
        ] {
            let err = read(&phi3.replace(from, to)).unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
        }
    }

    #[test]
    fn granite_olmo2_and_smollm3_configs_are_read_and_counted() {
        let dir = ConfigDir::new("more-configs");
        // Granite 3 2B's, OLMo 2 1B's and SmolLM3 3B's shapes; the counts
        // are transformers' for these configs.
        let granite = r#"{"model_type": "granite", "vocab_size": 49155, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 10000000.0, "max_position_embeddings": 4096, "tie_word_embeddings": true, "attention_bias": false, "mlp_bias": false, "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625, "logits_scaling": 8.0, "pad_token_id": 0}"#;
        let olmo2 = r#"{"model_type": "olmo2", "vocab_size": 100352, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 500000, "max_position_embeddings": 4096, "tie_word_embeddings": false, "attention_bias": false, "pad_token_id": 100277}"#;
        let smollm3 = r#"{"model_type": "smollm3", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 5000000.0, "max_position_embeddings": 65536, "tie_word_embeddings": true, "pad_token_id": 128004, "no_rope_layer_interval": 4, "use_sliding_window": false}"#;
        let read = |text: &str| dir.read(text);
        let total = |c: &LlamaConfig| c.unit_params().iter().map(|u| u.1).sum::<u64>();
        let g = read(granite).unwrap();
        assert_eq!(
            (g.embedding_multiplier, g.residual_multiplier),
            (12.0, 0.22)
        );
        assert_eq!(
            (g.attention_multiplier, g.logits_scaling),
            (Some(0.015625), 8.0)
        );
        let o = read(olmo2).unwrap();
        assert_eq!(
            (o.family, o.qk_norm, o.pad_token),
            (Family::Olmo2, true, Some(100277))
        );
        let sm = read(smollm3).unwrap();
        let turning: Vec<bool> = sm
            .rope_layers
            .clone()
            .unwrap()
            .into_iter()
            .take(8)
            .collect();
        assert_eq!(turning, [true, true, true, false, true, true, true, false]);
        assert_eq!(
            (total(&g), total(&o), total(&sm)),
            (2533531648, 1484916736, 3075098624)
        );
        // OLMo 3 leaves its windows to the defaults: 4096, every fourth
        // layer global, the windowed ones turning at the same base
        // unscaled.
        let o3 = read(&olmo2.replace("olmo2", "olmo3")).unwrap();
        assert_eq!(
            (o3.sliding_window, o3.full_every, o3.local_rope_theta),
            (Some(4096), Some(4), Some(500000.0))
        );
        dir.round_trips([g, o, o3, sm]);
        for (text, says) in [
            (
                smollm3.replace(
                    r#""no_rope_layer_interval": 4"#,
                    r#""no_rope_layers": [1, 0]"#,
                ),
                "no_rope_layers [1,0]: one 1 (turns) or 0 (does not) for each of the 36 layers",
            ),
            (
                smollm3.replace(
                    r#""use_sliding_window": false"#,
                    r#""use_sliding_window": true"#,
                ),
                "use_sliding_window true: this Llama computes smollm3's full-attention layers only",
            ),
            (olmo2.replace(r#", "pad_token_id": 100277"#, ""), ""),
        ] {
            let got = read(&text);
            match says.is_empty() {
                // Left out, OLMo's config class pads with 1.
                true => assert_eq!(got.unwrap().pad_token, Some(1)),
                false => {
                    let err = got.unwrap_err().to_string();
                    assert!(err.contains(says), "{err}");
                }
            }
        }
    }

    #[test]
    fn stablelm_configs_are_read_and_counted_and_the_12bs_layers_refused() {
        let dir = ConfigDir::new("stablelm-configs");
        // StableLM 2 1.6B's config.json; the count is transformers'.
        let two = r#"{"architectures": ["StableLmForCausalLM"], "bos_token_id": 100257, "eos_token_id": 100257, "hidden_act": "silu", "hidden_dropout": 0.0, "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5632, "layer_norm_eps": 1e-05, "max_position_embeddings": 4096, "model_type": "stablelm", "num_attention_heads": 32, "num_hidden_layers": 24, "num_key_value_heads": 32, "partial_rotary_factor": 0.25, "qk_layernorm": false, "rope_scaling": null, "rope_theta": 10000, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true, "use_parallel_residual": false, "use_qkv_bias": true, "vocab_size": 100352}"#;
        let c = dir.read(two).unwrap();
        assert_eq!(
            (c.family, c.rotary_dim(), c.qkv_bias, c.o_bias, c.mlp_bias),
            (Family::StableLm, 16, true, false, false)
        );
        let total = |c: &LlamaConfig| c.unit_params().iter().map(|u| u.1).sum::<u64>();
        assert_eq!(total(&c), 1644515328);
        // StableLM 3B 4E1T's sizes, the rest left to the class: a quarter
        // turned, no biases but the norms'.
        let three = r#"{"model_type": "stablelm", "vocab_size": 50304, "hidden_size": 2560, "intermediate_size": 6912, "num_hidden_layers": 32, "num_attention_heads": 32}"#;
        let t = dir.read(three).unwrap();
        assert_eq!((t.rotary_dim(), t.kv_heads, t.qkv_bias), (20, 32, false));
        assert_eq!(total(&t), 2795443200);
        dir.round_trips([c, t]);
        for key in ["qk_layernorm", "use_parallel_residual"] {
            let text = two.replace(&format!(r#""{key}": false"#), &format!(r#""{key}": true"#));
            let err = dir.read(&text).unwrap_err().to_string();
            assert!(
                err.contains(&format!("{key} true (StableLM 2 12B's layers")),
                "{err}"
            );
        }
        // Its dropout is the MLP's only.
        let d = dir.read(&two.replace(r#""hidden_dropout": 0.0"#, r#""hidden_dropout": 0.1"#));
        let d = d.unwrap();
        assert_eq!((d.resid_dropout, d.attention_output_dropout()), (0.1, 0.0));
    }

    #[test]
    fn a_cohere_config_is_read_and_counted_and_command_r_plus_qk_norms_refused() {
        let dir = ConfigDir::new("cohere-configs");
        // Aya Expanse 8B's sizes; the count is transformers'.
        let aya = r#"{"model_type": "cohere", "vocab_size": 256000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "logit_scale": 0.125, "rope_theta": 10000, "max_position_embeddings": 8192, "layer_norm_eps": 1e-05, "use_qk_norm": false, "attention_bias": false, "tie_word_embeddings": true}"#;
        let c = dir.read(aya).unwrap();
        assert_eq!(
            (c.family, c.logit_scale, c.tied, c.pad_token),
            (Family::Cohere, 0.125, true, Some(0))
        );
        let total: u64 = c.unit_params().iter().map(|u| u.1).sum();
        assert_eq!(total, 8028033024);
        dir.round_trips([c]);
        let plus = aya.replace(r#""use_qk_norm": false"#, r#""use_qk_norm": true"#);
        let err = dir.read(&plus).unwrap_err().to_string();
        assert!(
            err.contains("use_qk_norm true (Command R+'s layers"),
            "{err}"
        );
    }

    #[test]
    fn yarn_is_read_as_transformers_reads_it() {
        let dir = ConfigDir::new("yarn-config");
        // Qwen3's long-context recipe: YaRN over 32768 positions, 4 times.
        let qwen3 = r#"{"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}"#;
        let read = |text: &str| dir.read(text);
        let c = read(qwen3).unwrap();
        let want = RopeScaling::Yarn {
            factor: 4.0,
            original_positions: 32768.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: 0.1 * 4f64.ln() + 1.0,
        };
        assert_eq!(c.rope_scaling, want);
        // DeepSeek's mscale pair: their ratio; given, the factor itself.
        let m = read(&qwen3.replace(
            r#""factor": 4.0"#,
            r#""factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16"#,
        ))
        .unwrap();
        let RopeScaling::Yarn {
            attention_factor,
            beta_fast,
            ..
        } = m.rope_scaling.clone()
        else {
            panic!("{:?}", m.rope_scaling)
        };
        assert_eq!((attention_factor, beta_fast), (1.0, 16.0));
        let a = read(&qwen3.replace(
            r#""factor": 4.0"#,
            r#""factor": 4.0, "attention_factor": 0.8"#,
        ))
        .unwrap();
        assert!(
            matches!(a.rope_scaling, RopeScaling::Yarn { attention_factor, .. } if attention_factor == 0.8)
        );
        dir.round_trips([c, m, a]);
    }

    #[test]
    fn mixture_of_experts_configs_are_read_and_counted() {
        let dir = ConfigDir::new("moe-config");
        // Mixtral 8x7B's and Qwen3-30B-A3B's shapes; the counts are
        // transformers' for these configs.
        let mixtral = r#"{"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": false, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": null, "output_router_logits": false, "router_aux_loss_coef": 0.02}"#;
        let qwen3_moe = r#"{"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": false, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": false}"#;
        let read = |text: &str| dir.read(text);
        let total = |c: &LlamaConfig| c.unit_params().iter().map(|u| u.1).sum::<u64>();
        let m = read(mixtral).unwrap();
        let q = read(qwen3_moe).unwrap();
        assert_eq!((total(&m), total(&q)), (46702792704, 30532122624));
        let want = MoeConfig {
            experts: 128,
            top_k: 8,
            intermediate: 768,
            normalize: true,
            sparse_step: 1,
            dense_layers: vec![],
        };
        assert_eq!((q.moe.clone(), q.qk_norm), (Some(want), true));
        // Dense layers where Qwen3-MoE says.
        let d =
            read(&qwen3_moe.replace(r#""mlp_only_layers": []"#, r#""mlp_only_layers": [0, 47]"#))
                .unwrap();
        assert_eq!(
            (d.moe_layer(0), d.moe_layer(1), d.moe_layer(47)),
            (false, true, false)
        );
        dir.round_trips([m, q, d]);
        for (from, to, says) in [
            (
                r#""output_router_logits": false"#,
                r#""output_router_logits": true"#,
                "does not add the router's load-balancing loss",
            ),
            (
                r#""router_aux_loss_coef": 0.02"#,
                r#""router_jitter_noise": 0.01"#,
                "router_jitter_noise",
            ),
            (
                r#""num_experts_per_tok": 2"#,
                r#""num_experts_per_tok": 9"#,
                "num_experts_per_tok 9 is more than the 8 experts",
            ),
        ] {
            let err = read(&mixtral.replace(from, to)).unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
        }
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
            activation: Activation::Silu,
            pad_token: None,
            query_scalar: None,
            attn_softcap: None,
            final_softcap: None,
            full_every: None,
            local_rope_theta: None,
            partial_rotary: 1.0,
            resid_dropout: 0.0,
            embedding_dropout: 0.0,
            embedding_multiplier: 1.0,
            residual_multiplier: 1.0,
            attention_multiplier: None,
            logits_scaling: 1.0,
            logit_scale: 1.0,
            rope_layers: None,
            moe: None,
        };
        let variants = [
            base.clone(),
            LlamaConfig {
                tied: true,
                qkv_bias: true,
                o_bias: true,
                mlp_bias: true,
                head_dim: 8,
                ..base.clone()
            },
            LlamaConfig {
                family: Family::Qwen3,
                qk_norm: true,
                tied: true,
                ..base.clone()
            },
            LlamaConfig {
                family: Family::Gemma2,
                tied: true,
                ..base.clone()
            },
            LlamaConfig {
                family: Family::Gemma3,
                qk_norm: true,
                tied: true,
                ..base.clone()
            },
            LlamaConfig {
                family: Family::Phi3,
                partial_rotary: 0.75,
                ..base.clone()
            },
            LlamaConfig {
                family: Family::Olmo2,
                qk_norm: true,
                ..base.clone()
            },
            LlamaConfig {
                family: Family::Granite,
                tied: true,
                rope_layers: Some(vec![true, false]),
                ..base.clone()
            },
            LlamaConfig {
                family: Family::Qwen3Moe,
                qk_norm: true,
                moe: Some(MoeConfig {
                    experts: 4,
                    top_k: 2,
                    intermediate: 24,
                    normalize: true,
                    sparse_step: 1,
                    dense_layers: vec![1],
                }),
                ..base.clone()
            },
            LlamaConfig {
                family: Family::Mixtral,
                moe: Some(MoeConfig {
                    experts: 3,
                    top_k: 1,
                    intermediate: 40,
                    normalize: true,
                    sparse_step: 1,
                    dense_layers: vec![],
                }),
                ..base.clone()
            },
            LlamaConfig {
                family: Family::Starcoder2,
                qkv_bias: true,
                o_bias: true,
                mlp_bias: true,
                ..base.clone()
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
