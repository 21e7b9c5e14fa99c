//! A checkpoint's `config.json` read into [`LlamaConfig`] (each
//! [`Family`]'s defaults where it is silent) and written back.

use std::path::Path;

use tch::Tensor;

use crate::hf::{HfError, HfJson};

use super::bloom;
use super::ctrl;
use super::dbrx;
use super::delta_net::{self, DeltaNetConfig};
use super::doge;
use super::falcon::{self, FalconLayout};
use super::family::Family;
use super::gpt_bigcode;
use super::gpt_neo;
use super::gptj;
use super::lightning::{self, LightningConfig, ResidualFactors};
use super::mamba::{self, MambaConfig};
use super::mamba1::{self, Mamba1Config};
use super::modernbert_decoder;
use super::mpt;
use super::openai_gpt;
use super::opt::{self, OptLayout};
use super::rg_lru::{self, RgLruConfig};
use super::rope_scaling::{rope_scaling, RopeScaling};
use super::rwkv;
use super::short_conv::{self, ShortConvConfig};
use super::xglm;
use super::xlstm::{self, XlstmConfig};
use super::zamba::{self, ZambaConfig};

/// A sparse mixture of experts in place of the MLP (Mixtral, OLMoE,
/// Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and V3, GLM-4-MoE, GPT-OSS,
/// Granite-MoE): a router scores `experts` per token, each token goes
/// through its top `top_k` experts, their outputs summed weighted by the
/// router's softmax (renormalised over the `k` when `normalize`), or as
/// [`GroupRouting`] chooses; Qwen2-MoE, DeepSeek-V2 and V3 and GLM-4-MoE add a
/// shared expert every token goes through.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// `num_local_experts` (Mixtral), `num_experts` (Qwen2-MoE,
    /// Qwen3-MoE).
    pub experts: i64,
    /// `num_experts_per_tok`.
    pub top_k: i64,
    /// Each expert's MLP width (`intermediate_size` for Mixtral,
    /// `moe_intermediate_size` for the Qwens).
    pub intermediate: i64,
    /// The top `k` weights divided by their sum (Mixtral always;
    /// the Qwens' `norm_topk_prob`).
    pub normalize: bool,
    /// The Qwens' `decoder_sparse_step`: layer `l` has experts when
    /// `(l + 1) % step == 0` and it is not in `dense_layers`.
    pub sparse_step: i64,
    /// The Qwens' `mlp_only_layers`: layers with a dense MLP
    /// (`intermediate_size` wide).
    pub dense_layers: Vec<i64>,
    /// Qwen2-MoE's `shared_expert_intermediate_size` (DeepSeek-V3's and
    /// GLM-4-MoE's `n_shared_experts` times the experts' width): the
    /// width of the shared expert every token goes through beside its
    /// top `k`, Qwen2-MoE's output times a sigmoid gate of the token;
    /// `None`: no shared expert (Mixtral, OLMoE, Qwen3-MoE).
    pub shared: Option<i64>,
    /// DeepSeek-V3's, GLM-4-MoE's and DeepSeek-V2's routing
    /// ([`GroupRouting`]); `None`: the softmax's top `k`.
    pub grouped: Option<GroupRouting>,
    /// DBRX's `moe_jitter_eps` (0: none): in training, the experts'
    /// input (the router's and, as `transformers` scales it in place,
    /// the experts') times a uniform draw within `1 ± jitter`; PhiMoE's
    /// `input_jitter_noise`, Mixtral's and MiniMax's
    /// `router_jitter_noise`, the same.
    pub jitter: f64,
    /// PhiMoE's sparsemixer, at its `router_jitter_noise` `eps` (`None`:
    /// the others' routers): for each of the two experts a token takes,
    /// the router's logits within `2 eps` (relative) of the best left in
    /// play, the best of them taken (a Gumbel draw among them in
    /// training); its weight its softmax's over them, scaled in training
    /// by 1 or 1/3 as Heun's third-order estimate draws, whose gradient
    /// reaches the logits as sparsemixer's own backward sends it.
    pub sparse_mixer: Option<f64>,
    /// The router's load-balancing loss's coefficient
    /// (`router_aux_loss_coef`; DBRX's `ffn_config.moe_loss_weight`)
    /// when `output_router_logits` is true,
    /// `None` when it is false: the loss of a training forward is then
    /// the language model's plus this times the Switch Transformer's
    /// balance over every layer with experts, as `transformers` adds it
    /// ([`crate::hf::HfModel::plus_aux_losses`]).
    pub balance: Option<f64>,
    /// LongCat-Flash's `zero_expert_num` (0 for the others): experts
    /// after the `experts` real ones that compute nothing, each token
    /// that chose one passed through it unchanged, times its weight.
    pub zero: i64,
}

/// Falcon-H1's µP multipliers ([`Family::FalconH1`]), each 1 unless
/// its config says.
#[derive(Debug, Clone, PartialEq)]
pub struct FalconH1Multipliers {
    /// `attention_in_multiplier`: the attention's input's factor.
    pub attention_in: f64,
    /// `attention_out_multiplier`: the attention's output's factor.
    pub attention_out: f64,
    /// `key_multiplier`: the keys' factor (before they turn).
    pub key: f64,
    /// `ssm_in_multiplier`: the Mamba layer's input's factor.
    pub ssm_in: f64,
    /// `ssm_out_multiplier`: the Mamba layer's output's factor.
    pub ssm_out: f64,
    /// `ssm_multipliers`: the factors of `in_proj`'s five parts (the
    /// gate, the channels, `B`, `C`, the steps).
    pub ssm: [f64; 5],
    /// `mlp_multipliers`: the gate projection's factor (inside the
    /// activation) and the down projection's.
    pub mlp: [f64; 2],
}

impl FalconH1Multipliers {
    /// Those of `FalconH1Config` `j`.
    fn read(j: &HfJson) -> Result<Self, HfError> {
        let list = |key: &str, n: usize| -> Result<Vec<f64>, HfError> {
            match j.get(key) {
                None | Some(serde_json::Value::Null) => Ok(vec![1.0; n]),
                Some(v) => (v.as_array())
                    .and_then(|l| l.iter().map(|x| x.as_f64()).collect::<Option<Vec<f64>>>())
                    .filter(|l| l.len() == n)
                    .ok_or_else(|| j.field(format!("{key} {v}: a list of {n} numbers"))),
            }
        };
        let one = |key: &str| j.number_or_null(key, Some(1.0)).map(|x| x.unwrap_or(1.0));
        let ssm = list("ssm_multipliers", 5)?;
        let mlp = list("mlp_multipliers", 2)?;
        Ok(Self {
            attention_in: one("attention_in_multiplier")?,
            attention_out: one("attention_out_multiplier")?,
            key: one("key_multiplier")?,
            ssm_in: one("ssm_in_multiplier")?,
            ssm_out: one("ssm_out_multiplier")?,
            ssm: [ssm[0], ssm[1], ssm[2], ssm[3], ssm[4]],
            mlp: [mlp[0], mlp[1]],
        })
    }
}

/// Llama 4's attention ([`Family::Llama4`]): which layers attend within
/// chunks, whether the turning layers' queries and keys are
/// L2-normalised, and how the other layers' queries grow with the
/// position.
#[derive(Debug, Clone, PartialEq)]
pub struct Llama4Attention {
    /// `attention_chunk_size`: a chunked layer's token attends to the
    /// earlier tokens of its chunk of the row (`None`: of the row).
    pub chunk: Option<i64>,
    /// `layer_types`: for each layer, whether it attends in chunks
    /// (`chunked_attention`; by default the layers that turn).
    pub chunked: Vec<bool>,
    /// `use_qk_norm`: each head's queries and keys of the layers that
    /// turn, L2-normalised (`x / sqrt(mean(x^2) + eps)`, no weights, in
    /// fp32) after they turn.
    pub qk_l2_norm: bool,
    /// `attn_temperature_tuning` with its `floor_scale` and
    /// `attn_scale`: the queries of the layers that do not turn, at row
    /// position `p`, times `log(1 + floor((p + 1) / floor_scale)) *
    /// attn_scale + 1`.
    pub temperature: Option<(f64, f64)>,
}

/// DeepSeek's routing: each expert scored ([`Scoring`]), the experts
/// chosen among the `top_groups` best of `groups` groups, each chosen
/// expert weighted by its score (normalised over the `k` when
/// [`MoeConfig::normalize`]) times `scale`.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupRouting {
    /// `n_group` (DeepSeek-V2's `greedy` `topk_method`: one).
    pub groups: i64,
    /// `topk_group`.
    pub top_groups: i64,
    /// `routed_scaling_factor`.
    pub scale: f64,
    /// How the experts are scored and the groups valued.
    pub scoring: Scoring,
}

/// How [`GroupRouting`] scores experts and values groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    /// DeepSeek-V3's (GLM-4-MoE's): a sigmoid of each expert's logit;
    /// the experts chosen by score plus a fixed correction
    /// (`e_score_correction_bias`, a buffer of the checkpoint, never
    /// trained); a group's worth its two best.
    Sigmoid,
    /// DeepSeek-V2's: a softmax over every expert's logit, no
    /// correction; a group's worth its best.
    Softmax,
}

/// DeepSeek-V3's multi-head latent attention: each head's queries and
/// keys have `nope` dimensions without positions and `rope` turned ones
/// after them; the queries come through a low-rank bottleneck
/// (`q_a_proj`, an RMSNorm, `q_b_proj`) or one `q_proj`; the keys and
/// values come from one latent of `kv_rank` a token
/// (`kv_a_proj_with_mqa`, an RMSNorm, `kv_b_proj`), and the keys'
/// turned part from `rope` more of its dimensions, shared by every head.
#[derive(Debug, Clone, PartialEq)]
pub struct Mla {
    /// `q_lora_rank`; `None`: one `q_proj`.
    pub q_rank: Option<i64>,
    /// `kv_lora_rank`.
    pub kv_rank: i64,
    /// `qk_nope_head_dim`.
    pub nope: i64,
    /// `qk_rope_head_dim`.
    pub rope: i64,
    /// `v_head_dim`.
    pub v: i64,
    /// `rope_interleave`: the turned dimensions are pairs of neighbours
    /// (regrouped into halves before the rotation). DeepSeek-V2's are
    /// neighbours too, but turned where they are, in fp32, by the
    /// layer's rotary embedding: `false` for it.
    pub interleave: bool,
    /// `rope_scaling`'s `mscale_all_dim` (0 when it has none): with a
    /// scaling, the scores' scale grows by its mscale squared.
    pub mscale_all_dim: f64,
    /// LongCat-Flash's factors of the queries (after `q_b_proj`) and of
    /// the keys' and values' normalised latent (before `kv_b_proj`):
    /// `sqrt(hidden_size / q_lora_rank)` and `sqrt(hidden_size /
    /// kv_lora_rank)`, as its class always scales them; `None` for
    /// DeepSeek's.
    pub scales: Option<(f64, f64)>,
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
    /// `"relu2"`: the squared ReLU (Arcee's AFM).
    Relu2,
    /// `"relu"` (OPT).
    Relu,
    /// `"xielu"`: Apertus's xIELU, whose parameters its MLP trains and
    /// holds (applied there); read for Apertus only, and computed here
    /// at its class's initial parameters.
    Xielu,
}

impl Activation {
    const ALL: [Self; 6] = [
        Self::Silu,
        Self::Gelu,
        Self::GeluTanh,
        Self::GeluNew,
        Self::Relu2,
        Self::Relu,
    ];

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
            Self::Relu2 => "relu2",
            Self::Relu => "relu",
            Self::Xielu => "xielu",
        }
    }

    pub(crate) fn apply(self, x: &Tensor) -> Tensor {
        match self {
            Self::Silu => x.silu(),
            Self::Relu2 => x.relu().square(),
            Self::Relu => x.relu(),
            Self::Xielu => super::xielu::initial(x),
            Self::Gelu => x.gelu("none"),
            Self::GeluTanh => x.gelu("tanh"),
            Self::GeluNew => super::glu::gelu_new(x),
        }
    }
}

/// Sizes of a [`Llama`](super::Llama), Hugging Face's `LlamaConfig` fields (and
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
    /// (Qwen3, Gemma 3) or over the whole projection (OLMo 2 and 3, OLMoE);
    /// LayerNormed, each head with weights of its own, in StableLM 2 12B
    /// (`qk_layernorm`) and Command R+ (`use_qk_norm`).
    pub qk_norm: bool,
    /// The attention and the MLP side by side, both reading one norm of
    /// the layer's input (`x + attn(n(x)) + mlp(n(x))`): Cohere's, GPT-J's,
    /// CodeGen's, and StableLM's with `use_parallel_residual` (StableLM 2
    /// 12B).
    pub parallel: bool,
    /// The MLP's activation (`hidden_act`).
    pub activation: Activation,
    /// `pad_token_id`: the embedding's row that gets no gradient from
    /// the lookup (`transformers` makes it `nn.Embedding`'s
    /// `padding_idx`), in the families whose classes do
    /// ([`LlamaConfig::padding_row`]).
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
    /// Phi-3's, StableLM's and the GLMs' `partial_rotary_factor`: the
    /// share of each head's dimensions the rotary embedding turns, the
    /// first ones ([`LlamaConfig::rotary_dim`]); 1 for the other
    /// families.
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
    /// The head has a bias: GPT-J's and CodeGen's always, PhiMoE's with
    /// `lm_head_bias`.
    pub head_bias: bool,
    /// SmolLM3's `no_rope_layers`: for each layer, whether it turns its
    /// queries and keys (the others attend without positions); `None`:
    /// every layer turns.
    pub rope_layers: Option<Vec<bool>>,
    /// Granite 4.0's, Bamba's, Mamba-2's and Falcon-H1's Mamba-2 layers
    /// ([`MambaConfig`]; Falcon-H1's beside its attention:
    /// [`LlamaConfig::mamba_beside`]); `None`: every layer attends, alone.
    pub mamba: Option<MambaConfig>,
    /// Jamba's, Mamba's and Falcon-Mamba's Mamba layers
    /// ([`Mamba1Config`]: the first Mamba's selective scan); `None`:
    /// every layer attends.
    pub mamba1: Option<Mamba1Config>,
    /// LFM2's convolution layers ([`ShortConvConfig`]) in place of
    /// attention; `None`: every layer attends.
    pub short_conv: Option<ShortConvConfig>,
    /// MiniMax's lightning layers ([`LightningConfig`]) in place of
    /// attention; `None`: every layer attends with softmax.
    pub lightning: Option<LightningConfig>,
    /// MiniMax's residual factors; `None` for the other families.
    pub residual_factors: Option<ResidualFactors>,
    /// Qwen3-Next's gated DeltaNet layers ([`DeltaNetConfig`]) in place
    /// of attention; `None`: every layer attends with softmax.
    pub delta_net: Option<DeltaNetConfig>,
    /// RecurrentGemma's recurrent layers ([`RgLruConfig`]) in place of
    /// attention; `None`: every layer attends.
    pub rg_lru: Option<RgLruConfig>,
    /// Mixtral's, OLMoE's, the Qwens', DeepSeek's, GLM-4-MoE's, GPT-OSS's
    /// and Granite-MoE's experts in place of the MLP.
    pub moe: Option<MoeConfig>,
    /// OLMoE's `clip_qkv`: queries (normalised), keys (normalised) and
    /// values clamped to `[-c, c]`.
    pub clip_qkv: Option<f64>,
    /// DeepSeek-V3's attention ([`Mla`]): `head_dim` is its query and
    /// key heads' width (`nope + rope`), `kv_heads` is kept for the
    /// config but unused (every head has its keys and values).
    pub mla: Option<Mla>,
    /// Llama 4's attention ([`Llama4Attention`]); `None` for the others.
    pub llama4: Option<Llama4Attention>,
    /// Falcon-H1's multipliers; `None` for the other families.
    pub falcon_h1: Option<FalconH1Multipliers>,
    /// Falcon's layer layout ([`FalconLayout`]); `None` for the others.
    pub falcon: Option<FalconLayout>,
    /// OPT's layout ([`OptLayout`]: OPT-350m's norms and projections);
    /// `None` for the others.
    pub opt: Option<OptLayout>,
    /// GPT-Neo's `attention_types`, one a layer: `true` for a layer
    /// attending in [`LlamaConfig::sliding_window`]; `None` for the
    /// others ([`LlamaConfig::full_every`] says there).
    pub local_layers: Option<Vec<bool>>,
    /// BitNet's quantization-aware training (a `quantization_config` of
    /// `quant_method` `bitnet`, `linear_class` `autobitlinear`,
    /// `quantization_mode` `online`): every linear layer of the decoder
    /// layers (not the head) computes on its weights rounded to -1, 0
    /// and 1 times their mean magnitude and on its inputs rounded to 8
    /// bits per token, as `transformers`' `AutoBitLinear` does, the
    /// gradients passing straight through to the full-precision weights
    /// and inputs. `false` for the other families.
    pub ternary: bool,
    /// Under [`LlamaConfig::ternary`], the `quantization_config`'s
    /// `rms_norm_eps` when its `use_rms_norm` is true: each of those
    /// linear layers normalises its input by an RMS norm of its own
    /// (`rms_norm.weight` beside its weight, Llama's) before rounding
    /// it, as `AutoBitLinear` does then. `None`: no such norm.
    pub ternary_norm: Option<f64>,
    /// Bamba's `z_loss_coefficient`: the loss methods add it times the
    /// mean over every position of the square of the logits'
    /// log-sum-exp, as `BambaForCausalLM` adds it given labels
    /// ([`crate::hf::HfModel::plus_aux_losses`]). 0 (none) for the other
    /// families.
    pub z_loss: f64,
    /// Doge's dynamic mask: its `keep_window_size`, how many keys a
    /// query keeps once more are visible (those the mask biases most;
    /// `llama::doge`). `None` for the other families, which
    /// have no dynamic mask.
    pub keep_window: Option<i64>,
    /// RWKV's `rescale_every`, kept to be written back (zrt computes
    /// without that inference-time rescaling: `llama::rwkv`).
    /// `None` for the other families.
    pub rescale_every: Option<i64>,
    /// The multimodal model (its `model_type`: `llava`, `gemma3`) whose
    /// checkpoint this language model was read from, whose names its
    /// tensors carry there (`model.language_model.`, beside a vision
    /// tower zrt leaves out). `None` for a text model's own checkpoint.
    pub language_model_of: Option<&'static str>,
    /// Zamba's and Zamba2's hybrid layers and shared blocks
    /// (`llama::zamba`); `None` for the other families.
    pub zamba: Option<ZambaConfig>,
    /// xLSTM's mLSTM layers' sizes and settings (`llama::xlstm`); `None`
    /// for the other families.
    pub xlstm: Option<XlstmConfig>,
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
        // DBRX's nested fields and the GPT-2 names of GPT-J's, CodeGen's
        // and GPT-BigCode's, read flat; errors name their own.
        let family = j.model_type().as_deref().and_then(Family::of);
        let (flat, own_names): (HfJson, fn(HfError) -> HfError) = match family {
            Some(Family::Dbrx) => (dbrx::flat(j)?, dbrx::dbrx_names),
            Some(f) if f.gptj() => (gptj::flat(j, f)?, gptj::gptj_names),
            Some(Family::GptBigCode) => (gpt_bigcode::flat(j)?, gpt_bigcode::bigcode_names),
            Some(Family::GptNeo) => (gpt_neo::flat(j)?, gpt_neo::gpt_neo_names),
            Some(Family::Mpt) => (mpt::flat(j)?, mpt::mpt_names),
            Some(Family::Bloom) => (bloom::flat(j)?, bloom::bloom_names),
            Some(Family::Xglm) => (xglm::flat(j)?, xglm::xglm_names),
            Some(Family::Ctrl) => (ctrl::flat(j)?, ctrl::ctrl_names),
            Some(Family::OpenAiGpt) => (openai_gpt::flat(j)?, openai_gpt::openai_gpt_names),
            Some(Family::Mamba2) => (super::mamba::flat(j)?, super::mamba::mamba2_names),
            Some(Family::Rwkv) => (rwkv::flat(j)?, rwkv::rwkv_names),
            Some(Family::Zamba2) => (zamba::flat(j)?, zamba::zamba2_names),
            Some(Family::Zamba) => (zamba::flat_first(j)?, zamba::zamba_names),
            Some(Family::Xlstm) => (xlstm::flat(j)?, xlstm::xlstm_names),
            Some(f) if f.mamba_only() => (super::mamba1::flat(j, f)?, super::mamba1::mamba_names),
            _ => return Self::read(j),
        };
        Self::read(&flat).map_err(own_names)
    }

    /// As [`LlamaConfig::from_json`], from a flat config.
    fn read(j: &HfJson) -> Result<Self, HfError> {
        let family = j.model_type();
        let Some(family) = family.as_deref().and_then(Family::of) else {
            return Err(j.field(format!(
                "{}: a Llama is one of {}",
                j.model_type_named(),
                Family::model_types()
            )));
        };
        let ternary = family == Family::Bitnet && ternary(j)?;
        let ternary_norm = match ternary {
            true => ternary_norm(j)?,
            false => None,
        };
        // A quantized checkpoint's matrices are not the ones this
        // model trains (GPT-OSS's published mxfp4 blocks and scales).
        if let Some(q) = j.get("quantization_config").filter(|_| !ternary) {
            let method = q.get("quant_method").and_then(|m| m.as_str());
            let named = method.map_or("missing".to_string(), |m| format!("{m:?}"));
            let how = match method {
                Some("mxfp4") => "write its experts out in bf16 once, as transformers dequantizes them: `zrt dequantize --from DIR --out DIR-bf16`, then load DIR-bf16",
                _ => "load a bf16 or fp32 one (transformers' from_pretrained dequantizes it, then save_pretrained)",
            };
            return Err(j.field(format!(
                "quantization_config (quant_method {named}): zrt trains a checkpoint's unquantized weights; {how}"
            )));
        }
        // GPT-OSS's class clamps its experts at 7 whatever the config
        // says: another limit would train a model other than the one
        // the config describes.
        if family == Family::GptOss {
            let limit = j.number_or("swiglu_limit", 7.0)?;
            if limit != 7.0 {
                return Err(j.field(format!(
                    "swiglu_limit {limit}: transformers' GPT-OSS clamps its experts at 7.0 whatever the config says, so zrt does too; set it to 7.0 (or leave it out)"
                )));
            }
        }
        let defaults = family.defaults();
        let key = family.activation_key();
        let activation = match j.get(key).and_then(|v| v.as_str()) {
            // Apertus's MLP holds xIELU's parameters; no other layer does.
            Some("xielu") if family == Family::Apertus => Activation::Xielu,
            // LFM2's MLP is SiLU-gated whatever the config says.
            _ if family == Family::Lfm2 => Activation::Silu,
            _ => Activation::read(j, key, defaults.activation, "Llama")?,
        };
        let partial = match family {
            // Bamba's class turns half of each head, whatever its config says.
            Family::Bamba => 0.5,
            Family::StableLm | Family::Qwen3Next => j.number_or("partial_rotary_factor", 0.25)?,
            Family::Nemotron | Family::Persimmon | Family::RecurrentGemma => {
                j.number_or("partial_rotary_factor", 0.5)?
            }
            // Its class reads `rotary_pct` (its config's
            // `partial_rotary_factor` a copy of it).
            Family::GptNeoxJapanese => j.number_or("rotary_pct", 1.0)?,
            f if f.glm() || f == Family::Glm4Moe => j.number_or("partial_rotary_factor", 0.5)?,
            _ => j.number_or("partial_rotary_factor", 1.0)?,
        };
        let partly = matches!(
            family,
            Family::Phi3
                | Family::StableLm
                | Family::Glm4Moe
                | Family::Nemotron
                | Family::Persimmon
                | Family::Bamba
                | Family::Qwen3Next
                | Family::RecurrentGemma
                | Family::GptNeoxJapanese
        ) || family.gptj();
        if partial != 1.0 && !partly && !family.glm() {
            return Err(j.field(format!(
                "partial_rotary_factor {partial}: this {} rotates every dimension of a head",
                family.model_type()
            )));
        }
        // RecurrentGemma's class cuts each head into `1 / factor` pieces
        // and turns the first of two: a half.
        if family == Family::RecurrentGemma && partial != 0.5 {
            return Err(j.field(format!(
                "partial_rotary_factor {partial}: RecurrentGemma's class splits each head in two and turns the first half (another factor fails there); give 0.5"
            )));
        }
        // Bamba's z-loss; `transformers` adds it when above 0, so a
        // negative one would be ignored there: refused here.
        let z_loss = match family {
            Family::Bamba => j.number_or("z_loss_coefficient", 0.0)?,
            _ => 0.0,
        };
        if !(z_loss.is_finite() && z_loss >= 0.0) {
            return Err(j.field(format!(
                "z_loss_coefficient {z_loss}: the z-loss's weight is 0 (none) or more"
            )));
        }
        if j.flag_or("use_bidirectional_attention", false)? {
            return Err(j.field(
                "use_bidirectional_attention true: this Llama computes causal attention only"
                    .into(),
            ));
        }
        // Falcon's class takes its width as `n_embed` too (over `hidden_size`).
        let hidden = match family {
            Family::Falcon if j.has("n_embed") => j.size("n_embed")?,
            _ => j.size("hidden_size")?,
        };
        let heads = match family {
            Family::JetMoe => jetmoe_heads(j)?,
            _ => j.size("num_attention_heads")?,
        };
        let opt = match family {
            Family::Opt => Some(opt::layout(j, hidden)?),
            _ => None,
        };
        if matches!(family, Family::BioGpt | Family::Xglm) {
            opt::check_drops(j)?;
        }
        if family == Family::ModernBertDecoder {
            modernbert_decoder::check(j)?;
        }
        let falcon = match family {
            Family::Falcon => Some(falcon::layout(j, heads)?),
            _ => None,
        };
        // Left out, the class's default; null, as many as the heads.
        let kv_heads = match falcon {
            Some((_, kv)) => kv,
            None if matches!(family, Family::Persimmon | Family::GptNeoxJapanese) => heads,
            None => (j.size_or_null("num_key_value_heads", defaults.kv_heads)?).unwrap_or(heads),
        };
        let mla = mla(j, family, (hidden, heads, kv_heads))?;
        if heads % kv_heads != 0 && mla.is_none() {
            let key = match family {
                Family::Falcon => "num_kv_heads",
                _ => "num_key_value_heads",
            };
            return Err(j.field(format!(
                "{key} {kv_heads} does not divide num_attention_heads {heads}"
            )));
        }
        // DiffLlama's heads pair up, the first half with the second.
        if family == Family::DiffLlama && heads % 2 != 0 {
            return Err(j.field(format!(
                "num_attention_heads {heads}: DiffLlama's differential attention pairs each head of the first half with one of the second; give an even number"
            )));
        }
        // Apertus's class deletes `head_dim`: its heads are the width's
        // share, whatever the config says.
        let given_head_dim = match family {
            // Falcon's `head_dim` is a property of its class's, the same.
            Family::Apertus | Family::Falcon => None,
            // JetMoE's heads are `kv_channels` wide.
            Family::JetMoe => j.size_or_null("kv_channels", defaults.head_dim)?,
            _ => j.size_or_null("head_dim", defaults.head_dim)?,
        };
        let head_dim = match given_head_dim {
            _ if mla.is_some() => mla.as_ref().map_or(0, |m| m.nope + m.rope),
            Some(d) => d,
            None if hidden % heads == 0 => hidden / heads,
            None => {
                return Err(j.field(format!(
                    "num_attention_heads {heads} does not divide hidden_size {hidden} (and no head_dim)"
                )))
            }
        };
        // The families whose classes need the heads to fill the width
        // exactly, and why.
        let filling = match family {
            Family::Helium => Some("Helium's output projection is hidden_size square (its class builds it so); give sizes that agree"),
            Family::RecurrentGemma => Some("RecurrentGemma's attention views its heads as hidden_size wide; leave head_dim out"),
            Family::Bitnet => Some("BitNet normalises the attention's output over hidden_size weights (attn_sub_norm); give sizes that agree"),
            // Its rotary embedding is sized by `head_dim`, its heads by
            // the width's share.
            Family::GptNeoxJapanese => Some("GPT-NeoX-Japanese's heads are the width's share and its class fails turning them by another head_dim; leave head_dim out"),
            _ => None,
        };
        if let Some(why) = filling.filter(|_| heads * head_dim != hidden) {
            return Err(j.field(format!(
                "num_attention_heads {heads} x head_dim {head_dim} is not hidden_size {hidden}: {why}"
            )));
        }
        let rotary_dim = match &mla {
            Some(m) => m.rope,
            None => rotary_dim(head_dim, partial),
        };
        // (The Mambas, RWKV and xLSTM turn nothing: their heads' width is
        // any. Zamba2's shared blocks turn with `use_mem_rope` alone,
        // checked there; the first Zamba's not at all.)
        let unturned =
            family.mamba_only() || family.zamba() || matches!(family, Family::Rwkv | Family::Xlstm);
        if !unturned && (rotary_dim % 2 != 0 || rotary_dim <= 0 || rotary_dim > head_dim) {
            return Err(j.field(format!(
                "head_dim {head_dim} x partial_rotary_factor {partial} is {rotary_dim} dimensions: rotary embeddings turn pairs of a head's"
            )));
        }
        // StarCoder2's `use_bias` is every projection's.
        let attention_bias = match family {
            Family::Starcoder2 => j.flag_or("use_bias", true)?,
            f if f.ernie() || f == Family::Xlstm => j.flag_or("use_bias", false)?,
            // GPT-OSS's class sets it, whatever the config says.
            Family::GptOss => true,
            // Llama 4's, Bamba's and Jamba's classes set none, whatever
            // the config says.
            // GPT-NeoX-Japanese's last layer's `dense_bias` is apart.
            Family::Llama4
            | Family::Bamba
            | Family::Jamba
            | Family::FalconH1
            | Family::Lfm2
            | Family::GptNeoxJapanese => false,
            // Falcon's `bias` is every projection's.
            Family::Falcon => j.flag_or("bias", false)?,
            // GPT-BigCode's projections all have biases; OPT's
            // `enable_bias` is every projection's; GPT-Neo's output
            // projection has one, its queries, keys and values none.
            Family::GptBigCode | Family::GptNeo | Family::Bloom | Family::Persimmon => true,
            // RecurrentGemma's `o_proj` always has one (`attention_bias`
            // is the queries', keys' and values').
            Family::RecurrentGemma => true,
            Family::Opt => j.flag_or("enable_bias", true)?,
            Family::BioGpt | Family::Xglm | Family::Ctrl | Family::OpenAiGpt => true,
            // Seed-OSS's `attention_bias` is the query, key and value
            // projections'.
            Family::SeedOss => j.flag_or("attention_out_bias", false)?,
            // StableLM's, Qwen2-MoE's and Helium's output projections
            // have none.
            Family::StableLm | Family::Qwen2Moe | Family::Helium => false,
            // GLM's `attention_bias` is the query, key and value
            // projections' (the output's has none).
            f if f.glm() || f == Family::Glm4Moe => false,
            _ => j.flag_or("attention_bias", false)?,
        };
        let qkv_bias = match family {
            Family::Qwen2 => true,
            f if f.glm() => j.flag_or("attention_bias", true)?,
            Family::Glm4Moe => j.flag_or("attention_bias", false)?,
            Family::Qwen2Moe => j.flag_or("qkv_bias", true)?,
            Family::SeedOss => j.flag_or("attention_bias", true)?,
            Family::StableLm => j.flag_or("use_qkv_bias", false)?,
            Family::Helium | Family::RecurrentGemma => j.flag_or("attention_bias", false)?,
            Family::GptNeo => false,
            _ => attention_bias,
        };
        let sliding_window = match family {
            Family::Mistral
            | Family::Ministral
            | Family::Phi3
            | Family::Mixtral
            | Family::MiniMax
            | Family::Phimoe
            | Family::Gemma2
            | Family::VaultGemma
            | Family::Gemma3
            | Family::Olmo3
            | Family::Starcoder2
            | Family::Cohere2
            | Family::Exaone4
            | Family::GptOss
            | Family::Doge
            | Family::GptNeo => j.size_or_null("sliding_window", defaults.window)?,
            // Every attending layer of RecurrentGemma's is local.
            // (Its class's default window is the family's default.)
            Family::RecurrentGemma => j.size_or_none("attention_window_size")?.or(defaults.window),
            Family::ModernBertDecoder => modernbert_decoder::window(j)?,
            Family::Qwen2
            | Family::Qwen3
            | Family::Qwen2Moe
            | Family::Qwen3Moe
            | Family::SmolLm3
                if j.flag_or("use_sliding_window", false)? =>
            {
                return Err(j.field(format!(
                    "use_sliding_window true: this Llama computes {}'s full-attention layers only",
                    family.model_type()
                )))
            }
            // dots.llm1's layers from `max_window_layers` on are
            // windowed (none, as published).
            Family::Dots1 => {
                let layers = j.size("num_hidden_layers")?;
                let from = j.size_or_none("max_window_layers")?.unwrap_or(62);
                let listed = (j.get("layer_types").and_then(|v| v.as_array()))
                    .is_some_and(|l| l.iter().any(|k| k.as_str() == Some("sliding_attention")));
                let window = j.size_or_null("sliding_window", Some(4096))?;
                if window.is_some() && (listed || (from < layers && !j.has("layer_types"))) {
                    return Err(j.field(format!(
                        "sliding_window {window:?} from max_window_layers {from} (or layer_types): this Llama computes dots1's full-attention layers only"
                    )));
                }
                None
            }
            _ => None,
        };
        let full_every = full_every(j, family, sliding_window)?;
        // Nemotron's class turns unscaled whatever the config says.
        let scaling = match family {
            // Jamba's attention takes no positions at all.
            f if matches!(
                f,
                Family::Nemotron
                    | Family::Bamba
                    | Family::Jamba
                    | Family::RecurrentGemma
                    | Family::Rwkv
                    | Family::Zamba2
                    | Family::Zamba
                    | Family::Xlstm
            ) || f.mamba_only() =>
            {
                RopeScaling::None
            }
            _ => rope_scaling(j, family.model_type(), rotary_dim)?,
        };
        // Llama 4's class scales by Llama 3's whenever it scales.
        if family == Family::Llama4
            && !matches!(scaling, RopeScaling::None | RopeScaling::Llama3 { .. })
        {
            return Err(j.field(format!(
                "rope_scaling {}: Llama 4's class scales by Llama 3's (\"llama3\") whatever rope_type says; give that",
                j.get("rope_scaling").map(|v| v.to_string()).unwrap_or_default()
            )));
        }
        let vocab = j.size("vocab_size")?;
        let pad_token = pad_token(j, defaults.pad, vocab)?;
        let sandwich = family.sandwich();
        // Bamba's class fixes its base (and its scaling: none); Jamba's
        // has none (its attention takes no positions).
        let rope_theta = match family {
            Family::Bamba | Family::Jamba => 10000.0,
            // LFM2's class reads `theta` over it (its original name).
            Family::Lfm2 if j.has("theta") => j.number_or("theta", defaults.rope_theta)?,
            // GPT-NeoX-Japanese's reads `rotary_emb_base` (its config's
            // `rope_theta` a copy of it).
            Family::GptNeoxJapanese => j.number_or("rotary_emb_base", 10000.0)?,
            // ModernBERT-decoder's global and local layers alike (its
            // class builds both rotary embeddings from `rope_theta`, its
            // `attribute_map`'s `global_rope_theta`; `local_rope_theta`
            // is read by nothing).
            Family::ModernBertDecoder => j.number_or("global_rope_theta", 160000.0)?,
            _ => j.number_or("rope_theta", defaults.rope_theta)?,
        };
        let rg = match family {
            Family::RecurrentGemma => Some(rg_lru::read(j, hidden, heads)?),
            _ => None,
        };
        let granite = |key: &str| match family {
            f if f.granite() => j.number_or(key, 1.0),
            _ => Ok(1.0),
        };
        Ok(Self {
            family,
            vocab,
            hidden,
            // Llama 4's dense layers' width (its experts' is the other).
            intermediate: match family {
                Family::Llama4 => j.size_or_none("intermediate_size_mlp")?.unwrap_or(16384),
                Family::Falcon => j.size_or_none("ffn_hidden_size")?.unwrap_or(4 * hidden),
                Family::LongcatFlash => j.size_or_none("ffn_hidden_size")?.unwrap_or(12288),
                Family::GptNeoxJapanese => neox_japanese_mlp_width(j, hidden)?,
                Family::Opt => j.size_or_none("ffn_dim")?.unwrap_or(3072),
                Family::Lfm2 => short_conv::mlp_width(j)?.width(),
                Family::RecurrentGemma => rg.as_ref().map_or(0, RgLruConfig::mlp_width),
                // Granite 4.0's dense models: the shared MLP alone.
                Family::GraniteMoeHybrid if granite_dense(j)? => {
                    count_or(j, "shared_intermediate_size", 1024)?
                }
                _ => j.size("intermediate_size")?,
            },
            // LongCat-Flash's `num_layers` layers, each of two sublayers
            // (its `num_hidden_layers` counts the sublayers).
            layers: match family {
                Family::LongcatFlash => j.size_or_none("num_layers")?.unwrap_or(28),
                _ => j.size("num_hidden_layers")?,
            },
            heads,
            kv_heads,
            head_dim,
            // OPT's and BioGPT's LayerNorms keep nn.LayerNorm's epsilon
            // (no field sets it; BioGPT's `layer_norm_eps` is not read).
            eps: match family {
                f if f.fairseq() => defaults.eps,
                _ => j.number_or(family.eps_key(), defaults.eps)?,
            },
            rope_theta,
            rope_scaling: scaling.clone(),
            positions: (j.size_or_none("max_position_embeddings")?).unwrap_or(defaults.positions),
            qkv_bias,
            o_bias: attention_bias,
            mlp_bias: match family {
                Family::Xlstm
                | Family::Starcoder2
                | Family::Ernie4_5
                | Family::Ernie4_5Moe
                | Family::Falcon
                | Family::Opt
                | Family::BioGpt
                | Family::Xglm
                | Family::Ctrl
                | Family::OpenAiGpt
                | Family::Persimmon => attention_bias,
                // Apertus's class deletes `mlp_bias`; OLMo 1's, Hunyuan's
                // and Llama 4's MLPs have none whatever it says.
                f if matches!(
                    f,
                    Family::Apertus
                        | Family::Olmo1
                        | Family::Llama4
                        | Family::Bamba
                        | Family::Jamba
                        | Family::FalconH1
                        | Family::Lfm2
                        | Family::Qwen3Next
                        | Family::DiffLlama
                        | Family::Bitnet
                        | Family::GptNeoxJapanese
                        | Family::Zamba2
                        | Family::Zamba
                ) || f.hunyuan() =>
                {
                    false
                }
                // GPT-J's MLP has biases, its attention none.
                f if f.gptj()
                    || matches!(
                        f,
                        Family::GptBigCode
                            | Family::GptNeo
                            | Family::Bloom
                            | Family::RecurrentGemma
                    ) =>
                {
                    true
                }
                _ => j.flag_or("mlp_bias", false)?,
            },
            sliding_window,
            tied: match family {
                // LFM2's class reads `tie_embedding` over it (its
                // original name).
                Family::Lfm2 if j.has("tie_embedding") => j.flag_or("tie_embedding", true)?,
                _ => j.flag_or("tie_word_embeddings", defaults.tied)?,
            },
            // ERNIE 4.5's attention sets none, whatever the config says.
            attention_dropout: match family {
                f if f.ernie() => 0.0,
                Family::SeedOss => j.rate_or("attention_dropout", 0.1)?,
                Family::BioGpt => j.rate_or("attention_probs_dropout_prob", 0.1)?,
                Family::GptNeoxJapanese | Family::OpenAiGpt => {
                    j.rate_or("attention_dropout", 0.1)?
                }
                _ => j.rate_or("attention_dropout", 0.0)?,
            },
            qk_norm: match family {
                Family::Qwen3
                | Family::Qwen3Moe
                | Family::Gemma3
                | Family::Exaone4
                | Family::Dots1
                | Family::Apertus
                | Family::HunyuanDense
                | Family::HunyuanMoe
                | Family::Lfm2
                | Family::Qwen3Next
                | Family::Doge => true,
                Family::Glm4Moe => j.flag_or("use_qk_norm", false)?,
                Family::Persimmon => j.flag_or("qk_layernorm", true)?,
                Family::StableLm => j.flag_or("qk_layernorm", false)?,
                Family::Cohere => j.flag_or("use_qk_norm", false)?,
                f => f.whole_qk_norm(),
            },
            parallel: match family {
                Family::StableLm => j.flag_or("use_parallel_residual", false)?,
                f => f.parallel(),
            },
            clip_qkv: match family {
                Family::Olmoe | Family::Olmo1 | Family::Dbrx | Family::Mpt => {
                    j.number_or_null("clip_qkv", None)?
                }
                _ => None,
            },
            activation,
            pad_token,
            query_scalar: match sandwich || family == Family::VaultGemma {
                true => Some(j.number_or("query_pre_attn_scalar", 256.0)?),
                false => None,
            },
            attn_softcap: match family {
                f if f.gemma2() => j.number_or_null("attn_logit_softcapping", Some(50.0))?,
                Family::Gemma3 => j.number_or_null("attn_logit_softcapping", None)?,
                _ => None,
            },
            final_softcap: match family {
                f if f.gemma2() => j.number_or_null("final_logit_softcapping", Some(30.0))?,
                Family::Gemma3 => j.number_or_null("final_logit_softcapping", None)?,
                // Its class always caps them.
                Family::RecurrentGemma => Some(j.number_or("logits_soft_cap", 30.0)?),
                Family::Xlstm => j.number_or_null("output_logit_soft_cap", Some(30.0))?,
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
                Family::SeedOss => j.rate_or("residual_dropout", 0.1)?,
                Family::StableLm | Family::Persimmon | Family::GptNeoxJapanese | Family::Doge => {
                    j.rate_or("hidden_dropout", 0.0)?
                }
                Family::Dbrx | Family::Mpt | Family::Bloom => j.rate_or("resid_pdrop", 0.0)?,
                Family::Falcon => j.rate_or("hidden_dropout", 0.0)?,
                f if f.gptj() || matches!(f, Family::GptBigCode | Family::GptNeo) => {
                    j.rate_or("resid_pdrop", 0.0)?
                }
                Family::Opt => j.rate_or("dropout", 0.1)?,
                Family::BioGpt => j.rate_or("hidden_dropout_prob", 0.1)?,
                Family::Xglm | Family::Ctrl | Family::OpenAiGpt => j.rate_or("resid_pdrop", 0.1)?,
                _ => 0.0,
            },
            embedding_dropout: match family {
                Family::Starcoder2 | Family::ModernBertDecoder => {
                    j.rate_or("embedding_dropout", 0.0)?
                }
                Family::Dbrx => j.rate_or("emb_pdrop", 0.0)?,
                f if f.gptj() || matches!(f, Family::GptBigCode | Family::GptNeo) => {
                    j.rate_or("embd_pdrop", 0.0)?
                }
                Family::BioGpt => j.rate_or("hidden_dropout_prob", 0.1)?,
                Family::Xglm | Family::Ctrl | Family::OpenAiGpt => j.rate_or("embd_pdrop", 0.1)?,
                _ => 0.0,
            },
            // BioGPT's and XGLM's `scale_embedding`: the width's square root.
            embedding_multiplier: match family {
                Family::BioGpt | Family::Xglm if j.flag_or("scale_embedding", true)? => {
                    (hidden as f64).sqrt()
                }
                // CTRL's, always.
                Family::Ctrl => (hidden as f64).sqrt(),
                Family::FalconH1 => j.number_or("embedding_multiplier", 1.0)?,
                _ => granite("embedding_multiplier")?,
            },
            residual_multiplier: granite("residual_multiplier")?,
            attention_multiplier: match (family, &mla) {
                (f, _) if f.granite() => Some(granite("attention_multiplier")?),
                // transformers' DeepSeek-V2 leaves `mscale_all_dim` out
                // of its scores' scale.
                (Family::DeepseekV2, Some(_)) => Some((head_dim as f64).powf(-0.5)),
                // GPT-BigCode's scores unscaled (`scale_attn_weights` false),
                // GPT-Neo's always.
                (Family::GptBigCode, _) if !j.flag_or("scale_attn_weights", true)? => Some(1.0),
                (Family::GptNeo, _) => Some(1.0),
                // MPT's `softmax_scale` (null: one over the heads' root).
                (Family::Mpt, _) => j.number_or_null("softmax_scale", None)?,
                (_, Some(m)) => Some(m.scores_scale(head_dim, &scaling)),
                _ => None,
            },
            logits_scaling: granite("logits_scaling")?,
            logit_scale: match family {
                f if f.cohere() => j.number_or("logit_scale", 0.0625)?,
                Family::FalconH1 => j.number_or("lm_head_multiplier", 1.0)?,
                _ => 1.0,
            },
            head_bias: match family {
                f if f.gptj() || f == Family::Ctrl => true,
                Family::Phimoe => j.flag_or("lm_head_bias", false)?,
                Family::ModernBertDecoder => j.flag_or("decoder_bias", true)?,
                _ => false,
            },
            rope_layers: match family {
                Family::SmolLm3 | Family::Llama4 => Some(rope_layers(j, family)?),
                // Jamba attends without positions (Mamba, Falcon-Mamba and
                // RWKV not at all).
                f if matches!(f, Family::Jamba | Family::Rwkv | Family::Xlstm)
                    || f.zamba()
                    || f.mamba_only() =>
                {
                    Some(vec![false; j.size("num_hidden_layers")? as usize])
                }
                // Granite 4.0 turns only with `position_embedding_type`
                // "rope".
                Family::GraniteMoeHybrid => {
                    let rope = match j.get("position_embedding_type") {
                        None | Some(serde_json::Value::Null) => false,
                        Some(v) if v == "rope" => true,
                        Some(v) if v == "nope" => false,
                        Some(v) => {
                            return Err(j.field(format!(
                                "position_embedding_type {v}: Granite 4.0 turns its queries and keys with \"rope\" or attends without positions (\"nope\", null)"
                            )))
                        }
                    };
                    Some(vec![rope; j.size("num_hidden_layers")? as usize])
                }
                // Cohere 2's windowed layers turn, its global ones do not
                // (nor any, when it has no window).
                Family::Cohere2 => Some(
                    (0..j.size("num_hidden_layers")?)
                        .map(|l| {
                            sliding_window.is_some() && full_every.is_none_or(|n| (l + 1) % n != 0)
                        })
                        .collect(),
                ),
                // EXAONE 4's windowed layers turn, its global ones do not
                // (all turn, when it has no window).
                Family::Exaone4 => Some(
                    (0..j.size("num_hidden_layers")?)
                        .map(|l| {
                            sliding_window.is_none() || full_every.is_none_or(|n| (l + 1) % n != 0)
                        })
                        .collect(),
                ),
                _ => None,
            },
            moe: moe(j, family)?,
            mamba: match family {
                f if super::mamba::built_by(f) => Some(super::mamba::read(j, f, hidden)?),
                _ => None,
            },
            mamba1: match family {
                Family::Jamba | Family::Mamba | Family::FalconMamba | Family::Zamba => {
                    Some(super::mamba1::read(j, family, hidden)?)
                }
                _ => None,
            },
            lightning: match family {
                Family::MiniMax => Some(lightning::read(j, j.size("num_hidden_layers")?)?),
                _ => None,
            },
            residual_factors: match family {
                Family::MiniMax => Some(ResidualFactors::read(j)?),
                _ => None,
            },
            delta_net: match family {
                Family::Qwen3Next => Some(delta_net::read(j, j.size("num_hidden_layers")?)?),
                _ => None,
            },
            rg_lru: rg,
            short_conv: match family {
                f if short_conv::built_by(f) => {
                    Some(short_conv::read(j, j.size("num_hidden_layers")?)?)
                }
                _ => None,
            },
            mla,
            falcon_h1: match family {
                Family::FalconH1 => Some(FalconH1Multipliers::read(j)?),
                _ => None,
            },
            llama4: match family {
                Family::Llama4 => Some(llama4_attention(j)?),
                _ => None,
            },
            falcon: falcon.map(|(layout, _)| layout),
            opt,
            local_layers: match family {
                Family::GptNeo => Some(local_layers(j)?),
                Family::ModernBertDecoder => Some(modernbert_decoder::local_layers(
                    j,
                    j.size("num_hidden_layers")?,
                )?),
                _ => None,
            },
            ternary,
            ternary_norm,
            z_loss,
            keep_window: match family {
                Family::Doge => Some(doge::keep_window(j)?),
                _ => None,
            },
            rescale_every: match family {
                Family::Rwkv => Some(rwkv::rescale_every(j)?),
                _ => None,
            },
            language_model_of: j.wrapper(),
            xlstm: match family {
                Family::Xlstm => Some(xlstm::read(j)?),
                _ => None,
            },
            zamba: match family {
                f if f.zamba() => Some(zamba::read(
                    j,
                    family,
                    j.size("num_hidden_layers")?,
                    (heads, kv_heads, head_dim),
                )?),
                _ => None,
            },
        })
    }

    /// The dimensions of each head the rotary embedding turns: `head_dim`
    /// times `partial_rotary_factor`, truncated as `transformers` does
    /// (DeepSeek-V3's `qk_rope_head_dim`).
    pub fn rotary_dim(&self) -> i64 {
        match &self.mla {
            Some(m) => m.rope,
            None => rotary_dim(self.head_dim, self.partial_rotary),
        }
    }

    /// The modules (by last name) PEFT refuses LoRA adapters on in this
    /// family: the Mambas' (1 and 2, Falcon-Mamba) and Falcon-H1's
    /// `out_proj` and `conv1d` (the
    /// CUDA kernels their classes run with read those weights directly).
    pub fn lora_refused_modules(&self) -> &'static [&'static str] {
        match self.family.mamba_only() || self.family == Family::FalconH1 {
            true => &["out_proj", "conv1d"],
            false => &[],
        }
    }

    /// The token embedding's row that gets no gradient from the lookup:
    /// [`LlamaConfig::pad_token`] where the family's class makes it the
    /// embedding's `padding_idx`; none for GPT-J, CodeGen, GPT-BigCode,
    /// GPT-Neo, MPT, BLOOM, Falcon, Mamba and Falcon-Mamba, whose
    /// classes train every row.
    pub fn padding_row(&self) -> Option<i64> {
        self.pad_token.filter(|_| self.family.pads_embedding())
    }

    /// Each head's value width: DeepSeek-V3's `v_head_dim`, else
    /// `head_dim`.
    pub fn v_head_dim(&self) -> i64 {
        self.mla.as_ref().map_or(self.head_dim, |m| m.v)
    }

    /// The token embeddings' width: OPT-350m's `word_embed_proj_dim`,
    /// else `hidden_size`.
    pub fn embedding_width(&self) -> i64 {
        self.opt.map_or(self.hidden, |o| o.embedding_width)
    }

    /// Whether the token embeddings are projected in and out of the
    /// layers' width (OPT-350m's `project_in` and `project_out`).
    pub fn projected(&self) -> bool {
        self.embedding_width() != self.hidden
    }

    /// Whether a final norm precedes the head (all but OPT-350m, an OPT
    /// with `_remove_final_layer_norm` and OpenAI GPT).
    pub fn final_norm(&self) -> bool {
        self.family != Family::OpenAiGpt && self.opt.is_none_or(|o| o.final_norm)
    }

    /// Whether layer `l` turns its queries and keys by their positions:
    /// not where positions are embedded (learned or sinusoidal) or
    /// ALiBi's biases stand for them, nor in SmolLM3's and Llama 4's
    /// layers without rotary embeddings (`rope_layers`).
    pub(crate) fn turns(&self, l: i64) -> bool {
        !self.family.learned_positions()
            && !self.family.sinusoidal_positions()
            && !self.alibi()
            && (self.rope_layers.as_ref()).is_none_or(|r| r.get(l as usize) == Some(&true))
    }

    /// Whether the heads take ALiBi's biases in place of positions:
    /// MPT's and BLOOM's, and Falcon-RW's (`alibi`).
    pub fn alibi(&self) -> bool {
        self.family.alibi() || self.falcon.is_some_and(|f| f.alibi)
    }

    /// The dropout on the attention's output, when training: the
    /// sublayers' [`LlamaConfig::resid_dropout`], but StableLM's and
    /// Persimmon's, which drop out the MLP's output only, Falcon's: its
    /// `attention_dropout` in sequential layers, none in parallel ones
    /// (the sum of both outputs is dropped out there), and
    /// ModernBERT-decoder's: its `attention_dropout` (its MLP's output is
    /// not dropped out).
    pub fn attention_output_dropout(&self) -> f64 {
        match (self.family, &self.falcon) {
            (Family::StableLm | Family::Persimmon, _) => 0.0,
            (Family::ModernBertDecoder, _) => self.attention_dropout,
            (_, Some(f)) if f.parallel => 0.0,
            (_, Some(_)) => self.attention_dropout,
            _ => self.resid_dropout,
        }
    }

    /// The dropout on the attention's weights, when training:
    /// [`LlamaConfig::attention_dropout`], but Falcon's, whose rotary
    /// attention drops none (its rate drops the output out; Falcon-RW's
    /// ALiBi attention drops both).
    pub fn attention_weights_dropout(&self) -> f64 {
        match self.family {
            Family::Falcon if !self.alibi() => 0.0,
            _ => self.attention_dropout,
        }
    }

    /// Granite 4.0's and Bamba's Mamba layers' sizes when layer `l` is one of them.
    pub fn mamba_layer(&self, l: i64) -> Option<&MambaConfig> {
        (self.mamba.as_ref()).filter(|m| m.layers.get(l as usize) == Some(&true))
    }

    /// Falcon-H1's own fields in its `config.json`: its Mamba layers'
    /// and its multipliers.
    fn falcon_h1_json(&self) -> serde_json::Value {
        let mut extra = self
            .mamba
            .as_ref()
            .map_or(serde_json::json!({}), |m| m.to_json());
        if let Some(all) = extra.as_object_mut() {
            all.remove("layer_types");
            if let Some(m) = &self.mamba {
                let (norm, before) = match m.gate {
                    mamba::MambaGate::Grouped { before_gate, .. } => (true, before_gate),
                    _ => (false, true),
                };
                all.insert("mamba_d_ssm".into(), m.d_ssm.into());
                all.insert("projectors_bias".into(), m.out_bias().into());
                all.insert("mamba_rms_norm".into(), norm.into());
                all.insert("mamba_norm_before_gate".into(), before.into());
            }
            if let Some(f) = &self.falcon_h1 {
                let fields = serde_json::json!({
                    "attention_in_multiplier": f.attention_in,
                    "attention_out_multiplier": f.attention_out,
                    "key_multiplier": f.key,
                    "ssm_in_multiplier": f.ssm_in,
                    "ssm_out_multiplier": f.ssm_out,
                    "ssm_multipliers": f.ssm,
                    "mlp_multipliers": f.mlp,
                });
                if let serde_json::Value::Object(fields) = fields {
                    all.extend(fields);
                }
            }
            all.insert("lm_head_multiplier".into(), self.logit_scale.into());
            all.insert(
                "embedding_multiplier".into(),
                self.embedding_multiplier.into(),
            );
        }
        extra
    }

    /// Falcon-H1's Mamba-2 layers, one beside each layer's attention
    /// (its output added to the attention's).
    pub fn mamba_beside(&self) -> Option<&MambaConfig> {
        (self.mamba.as_ref()).filter(|_| self.family == Family::FalconH1)
    }

    /// Jamba's Mamba layers' sizes when layer `l` is one of them.
    pub fn mamba1_layer(&self, l: i64) -> Option<&Mamba1Config> {
        (self.mamba1.as_ref()).filter(|m| m.is_mamba(l))
    }

    /// LFM2's convolution layers' sizes when layer `l` is one of them.
    pub fn short_conv_layer(&self, l: i64) -> Option<&ShortConvConfig> {
        (self.short_conv.as_ref()).filter(|c| c.is_conv(l))
    }

    /// The values of the buffers its class writes into its files and zrt
    /// holds as frozen variables, which [`LlamaConfig::unit_params`] does
    /// not count (as `transformers` counts parameters): MiniMax's decays.
    pub fn frozen_buffers(&self) -> u64 {
        (0..self.layers)
            .filter_map(|l| self.lightning_layer(l))
            .map(|g| g.buffers(self.heads))
            .sum()
    }

    /// Whether layer `l`'s attention output takes a bias of its own
    /// (`attention.dense_bias`): GPT-NeoX-Japanese's last layer's.
    pub fn last_dense_bias(&self, l: i64) -> bool {
        self.family == Family::GptNeoxJapanese && l == self.layers - 1
    }

    /// Whether its attention's output is gated by a sigmoid of a second
    /// half of `q_proj`, each head's gate after its queries (Qwen3-Next's).
    pub fn gated_attention(&self) -> bool {
        self.family == Family::Qwen3Next
    }

    /// Qwen3-Next's DeltaNet layers' config when layer `l` is one of
    /// them.
    pub fn delta_net_layer(&self, l: i64) -> Option<&DeltaNetConfig> {
        (self.delta_net.as_ref()).filter(|c| c.is_delta_net(l))
    }

    /// RecurrentGemma's recurrent layers' config when layer `l` is one
    /// of them.
    pub fn rg_lru_layer(&self, l: i64) -> Option<&RgLruConfig> {
        (self.rg_lru.as_ref()).filter(|c| c.is_recurrent(l))
    }

    /// MiniMax's lightning layers' block when layer `l` is one of them.
    pub fn lightning_layer(&self, l: i64) -> Option<&LightningConfig> {
        (self.lightning.as_ref()).filter(|c| c.is_lightning(l))
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
        if let Some(local) = &self.local_layers {
            let windowed = local.get(l as usize) == Some(&true);
            return self.sliding_window.filter(|_| windowed);
        }
        match self.full_every {
            Some(n) if (l + 1) % n == 0 => None,
            _ => self.sliding_window,
        }
    }

    /// The parameters of each unit a [`Llama`](super::Llama) wraps, by its name
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
        let attention = match &self.mla {
            Some(m) => {
                let (h, on) = (self.heads as u64, self.o_bias);
                let (kr, r, vd) = (m.kv_rank as u64, m.rope as u64, m.v as u64);
                // The queries' bottleneck (its norm's weights) or one matrix.
                let queries = match m.q_rank.map(|r| r as u64) {
                    Some(qr) => d * qr + bias(on, qr) + qr + qr * q,
                    None => d * q,
                };
                // The latent and the shared turned keys, the latent's
                // norm, its keys and values for every head, the output.
                queries
                    + (d * (kr + r) + bias(on, kr + r))
                    + kr
                    + kr * h * (m.nope as u64 + vd)
                    + (h * vd * d + bias(on, d))
            }
            None => {
                // Qwen3-Next's `q_proj` makes each head's output gate too;
                // DiffLlama's four lambda vectors.
                let gates = 1 + u64::from(self.gated_attention());
                let lambdas = bias(self.family == Family::DiffLlama, 4 * hd);
                // Doge's dynamic mask: `A` and `dt_proj`, a key-value
                // head each.
                let kvh = self.kv_heads as u64;
                let dynamic =
                    (self.keep_window).map_or(0, |_| kvh + kv * kvh + bias(self.o_bias, kvh));
                lambdas
                    + dynamic
                    + gates * (d * q + bias(self.qkv_bias, q))
                    + 2 * (d * kv + bias(self.qkv_bias, kv))
                    + (q * d + bias(self.o_bias, d))
                    + match self.family.whole_qk_norm() || self.family.qk_norm_of_each_head() {
                        // OLMo's normalise the whole projections, StableLM's
                        // and Cohere's each head with its own weights, the
                        // others a head with weights shared by every head
                        // (Persimmon's LayerNorms with biases too).
                        true => bias(self.qk_norm, q + kv),
                        false if self.family == Family::Persimmon => bias(self.qk_norm, 4 * hd),
                        false => bias(self.qk_norm, 2 * hd),
                    }
            }
        };
        // JetMoE's mixture of attention heads: a router, each expert's
        // query and output matrices, the output's bias, and the keys'
        // and values' projection.
        let attention = match (self.family, &self.moe) {
            (Family::JetMoe, Some(m)) => {
                let e = m.experts as u64;
                e * d + 2 * e * kv * d + d + 2 * kv * d
            }
            _ => attention,
        };
        // Gated (gate and up), or StarCoder2's one matrix up.
        let ups = if self.family.gated() { 2 } else { 1 };
        // BitNet's norms of the attention's output and of the MLP's
        // gated product.
        let sub_norms = bias(self.family == Family::Bitnet, d + i);
        // And under `use_rms_norm` a norm of each linear layer's input:
        // the queries', keys', values', gate's and up's (the width each),
        // the output's (the heads') and down's (the MLP's).
        let sub_norms = sub_norms + bias(self.ternary_norm.is_some(), 5 * d + q + i);
        let mlp = ups * (d * i + bias(self.mlp_bias, i)) + (i * d + bias(self.mlp_bias, d));
        // A router and each expert's three matrices; a shared expert's
        // three (and Qwen2-MoE's gate's row); DeepSeek-V3's router's
        // correction, a buffer zrt holds as a frozen parameter; GPT-OSS's
        // router's and experts' biases. LongCat-Flash's router scores its
        // zero experts too, which have no weights.
        let oss = self.family == Family::GptOss;
        let experts = (self.moe.as_ref()).map_or(0, |m| {
            let (e, w) = (m.experts as u64, m.intermediate as u64);
            let routed = e + m.zero as u64;
            let shared = m.shared.map_or(0, |s| 3 * d * s as u64);
            // Aria's shared MLP's biases (`mlp_bias`).
            let shared = shared
                + (m.shared)
                    .filter(|_| self.family == Family::AriaText && self.mlp_bias)
                    .map_or(0, |s| 2 * s as u64 + d);
            let gate = bias(
                matches!(self.family, Family::Qwen2Moe | Family::Qwen3Next),
                d,
            );
            let sigmoid = m.grouped.as_ref().map(|g| g.scoring) == Some(Scoring::Sigmoid);
            let corrected = matches!(self.family, Family::Ernie4_5Moe | Family::LongcatFlash);
            let correction = bias(sigmoid || corrected, routed);
            let biases = bias(oss, e + e * (2 * w + d));
            // JetMoE's bias on the experts' sum.
            let sum_bias = bias(self.family == Family::JetMoe, d);
            d * routed + e * 3 * d * w + shared + gate + correction + biases + sum_bias
        });
        // GPT-OSS's sinks: a logit a head.
        let sinks = bias(oss, self.heads as u64);
        let norms = match (self.family, &self.falcon) {
            (f, _) if f.sandwich() || f == Family::Glm4 => 4,
            _ if self.parallel => 1,
            (_, Some(f)) if f.parallel && !f.two_norms => 1,
            _ => 2,
        };
        // A LayerNorm's bias beside its weights.
        let norm = match self.family {
            f if f.layer_norm() => 2 * d,
            // OLMo 1's norms have no weights.
            Family::Olmo1 => 0,
            _ => d,
        };
        // Apertus's xIELU: two trained scalars, two frozen ones.
        let act = if self.activation == Activation::Xielu {
            4
        } else {
            0
        };
        let mlp = mlp + act;
        let layer = |l: i64| {
            // RWKV's block: two LayerNorms (the first block's embeddings'
            // too), the time mix (a decay and a bonus a channel of its
            // width, three mixing weights, key, value, receptance and
            // output), the channel mix (two mixing weights, key,
            // receptance, value).
            if self.family == Family::Rwkv {
                let w = q;
                let norms = bias(l == 0, norm) + 2 * norm;
                let time = 2 * w + 3 * d + 3 * d * w + w * d;
                let channel = 2 * d + d * i + d * d + i * d;
                return norms + time + channel;
            }
            // LongCat-Flash's two sublayers, each with its attention and
            // dense MLP, and the experts beside them.
            if self.family == Family::LongcatFlash {
                return 2 * (norms * norm + attention + mlp) + experts;
            }
            // Mamba's and Falcon-Mamba's layers have no MLP, one norm;
            // xLSTM's blocks are its own.
            if let Some(x) = &self.xlstm {
                return x.block_params(self);
            }
            // Zamba's neither (a hybrid one its `linear` too).
            if self.family.zamba() {
                let hybrid = (self.zamba.as_ref()).is_some_and(|z| z.ordinal(l).is_some());
                let mamba = match (self.mamba_layer(l), self.mamba1_layer(l)) {
                    (Some(m), _) => m.params(self.hidden),
                    (None, m) => m.map_or(0, |m| m.params(self.hidden)),
                };
                return norm + mamba + bias(hybrid, d * d);
            }
            let (mlp, norms) = match self.family.mamba_only() {
                true => (0, 1),
                false if self.moe_layer(l) => (experts, norms),
                false => (mlp, norms),
            };
            // Granite 4.0's, Bamba's and Jamba's Mamba layers in place of
            // attention.
            let mixer = match (self.mamba_layer(l), self.mamba1_layer(l)) {
                (Some(m), _) => m.params(self.hidden),
                (None, Some(m)) => m.params(self.hidden),
                // LFM2's convolution layers and MiniMax's lightning ones
                // in place of attention.
                (None, None) => match (self.short_conv_layer(l), self.lightning_layer(l)) {
                    (Some(c), _) => c.params(self.hidden),
                    (None, Some(_)) => {
                        LightningConfig::params(self.hidden, self.heads, self.head_dim)
                    }
                    // Qwen3-Next's DeltaNet layers.
                    (None, None) => match (self.delta_net_layer(l), self.rg_lru_layer(l)) {
                        (Some(g), _) => g.params(self.hidden),
                        // RecurrentGemma's recurrent layers.
                        (None, Some(g)) => g.params(self.hidden, self.heads),
                        (None, None) => attention + sinks,
                    },
                },
            };
            // Falcon-H1's Mamba layer beside its attention;
            // GPT-NeoX-Japanese's last layer's `dense_bias`.
            let mixer = mixer + self.mamba_beside().map_or(0, |m| m.params(self.hidden));
            let mixer = mixer + bias(self.last_dense_bias(l), d);
            // Doge's weights on each sublayer's residual.
            let mixer = mixer + bias(self.family == Family::Doge, 2 * d);
            // ModernBERT-decoder's first layer has no norm before its
            // attention.
            let norms = match (self.family, l) {
                (Family::ModernBertDecoder, 0) => norms - 1,
                _ => norms,
            };
            norms * norm + mixer + mlp + sub_norms
        };
        let [model, embedding, blocks, _] = self.family.names();
        // OPT-350m's embeddings (and tied head) are narrower.
        let w = self.embedding_width() as u64;
        // CTRL's tied head's bias is the root's.
        let tied_bias = bias(self.tied && self.head_bias, v);
        let mut units = vec![(format!("{model}.{embedding}"), v * w)];
        units.extend((0..self.layers).map(|l| (format!("{model}.{blocks}.{l}"), layer(l))));
        if !self.tied {
            // GPT-J's head has a bias, PhiMoE's may.
            let head = self.family.head_name().to_string();
            units.push((head, v * w + bias(self.head_bias, v)));
        }
        // GPT-BigCode's and OPT's learned positions join the final norm
        // there.
        let rows = self.positions + self.family.position_offset();
        let positions = bias(self.family.learned_positions(), rows as u64 * d);
        // BLOOM's and ModernBERT-decoder's norm of the embeddings joins
        // it too, and ModernBERT-decoder's prediction head.
        let modernbert = self.family == Family::ModernBertDecoder;
        let embedding_norm = bias(self.family == Family::Bloom || modernbert, norm);
        let head_transform = bias(modernbert, d * d + norm);
        // OPT-350m has no final norm, and projects in and out there.
        let final_norm = bias(self.final_norm(), norm);
        let projections = bias(self.projected(), 2 * d * w);
        // Zamba's shared blocks are the root's.
        let shared = (self.zamba.as_ref()).map_or(0, |z| z.shared_params(self));
        units.push((
            String::new(),
            final_norm
                + positions
                + embedding_norm
                + projections
                + tied_bias
                + head_transform
                + shared,
        ));
        units
    }

    /// The `config.json` `transformers` reads this model from.
    pub fn to_hf_json(&self) -> String {
        // The families whose configs name their fields their own ways.
        let own = match (self.family, &self.falcon) {
            (Family::Dbrx, _) => Some(dbrx::to_json(self)),
            (_, Some(f)) => Some(falcon::to_json(self, f)),
            (f, _) if f.gptj() => Some(gptj::to_json(self)),
            (Family::GptBigCode, _) => Some(gpt_bigcode::to_json(self)),
            (Family::Opt, _) => self.opt.as_ref().map(|o| opt::to_json(self, o)),
            (Family::BioGpt, _) => Some(opt::biogpt_json(self)),
            (Family::Xglm, _) => Some(xglm::to_json(self)),
            (Family::Ctrl, _) => Some(ctrl::to_json(self)),
            (Family::OpenAiGpt, _) => Some(openai_gpt::to_json(self)),
            (Family::ModernBertDecoder, _) => Some(modernbert_decoder::to_json(self)),
            (Family::GptNeo, _) => Some(gpt_neo::to_json(self)),
            (Family::Mpt, _) => Some(mpt::to_json(self)),
            (Family::Bloom, _) => Some(bloom::to_json(self)),
            (Family::Mamba2, _) => (self.mamba.as_ref()).map(|m| mamba::to_json(self, m)),
            (Family::Rwkv, _) => Some(rwkv::to_json(self)),
            (Family::Zamba2, _) => Some(zamba::to_json(self)),
            (Family::Zamba, _) => Some(zamba::to_json_first(self)),
            (Family::Xlstm, _) => Some(xlstm::to_json(self)),
            (f, _) if f.mamba_only() => (self.mamba1.as_ref()).map(|m| mamba1::to_json(self, m)),
            _ => None,
        };
        if let Some(json) = own {
            return format!("{json:#}\n");
        }
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
        // ERNIE 4.5's and LFM2's classes have no attention dropout to
        // write; LFM2's no activation.
        if let (true, Some(all)) = (
            self.family.ernie() || self.family == Family::Lfm2,
            json.as_object_mut(),
        ) {
            all.remove("attention_dropout");
        }
        if let (Family::Lfm2, Some(all)) = (self.family, json.as_object_mut()) {
            all.remove("hidden_act");
        }
        // RecurrentGemma's class has no positions to bound (its rotary
        // embedding turns any).
        if let (Family::RecurrentGemma, Some(all)) = (self.family, json.as_object_mut()) {
            all.remove("max_position_embeddings");
        }
        // LongCat-Flash's reads its MLPs' width as `ffn_hidden_size`
        // (below).
        if let (Family::LongcatFlash, Some(all)) = (self.family, json.as_object_mut()) {
            all.remove("intermediate_size");
        }
        // GPT-NeoX-Japanese's class computes its heads' width, gives every
        // head its own key and value, and reads its MLP's width and its
        // rotary base under names of its own (below).
        if let (Family::GptNeoxJapanese, Some(all)) = (self.family, json.as_object_mut()) {
            for key in [
                "intermediate_size",
                "head_dim",
                "num_key_value_heads",
                "rope_theta",
            ] {
                all.remove(key);
            }
        }
        // JetMoE's class computes its heads and reads their width as
        // `kv_channels` (below).
        if let (Family::JetMoe, Some(all)) = (self.family, json.as_object_mut()) {
            all.remove("head_dim");
        }
        let extra = match self.family {
            Family::Llama => serde_json::json!({
                "attention_bias": self.o_bias,
                "mlp_bias": self.mlp_bias,
            }),
            Family::Mistral | Family::Ministral => {
                serde_json::json!({"sliding_window": self.sliding_window})
            }
            Family::DiffLlama => serde_json::json!({"attention_bias": self.o_bias}),
            Family::Doge => doge::json(self),
            // Its shared MLP's width as a number of experts'.
            Family::AriaText => {
                let m = self.moe.as_ref();
                serde_json::json!({
                    "attention_bias": self.o_bias,
                    "mlp_bias": self.mlp_bias,
                    "moe_num_experts": m.map(|m| m.experts),
                    "moe_topk": m.map(|m| m.top_k),
                    "moe_num_shared_experts": m.and_then(|m| m.shared.map(|s| s / m.intermediate.max(1))),
                })
            }
            Family::JetMoe => serde_json::json!({
                "kv_channels": self.head_dim,
                "num_local_experts": self.moe.as_ref().map(|m| m.experts),
                "num_experts_per_tok": self.moe.as_ref().map(|m| m.top_k),
                "output_router_logits": false,
            }),
            Family::Bitnet => match self.ternary {
                true => serde_json::json!({
                    "attention_bias": self.o_bias,
                    "quantization_config": {
                        "quant_method": "bitnet",
                        "linear_class": "autobitlinear",
                        "quantization_mode": "online",
                        "use_rms_norm": self.ternary_norm.is_some(),
                        "rms_norm_eps": self.ternary_norm.unwrap_or(1e-6),
                    },
                }),
                false => serde_json::json!({"attention_bias": self.o_bias}),
            },
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
            Family::GraniteMoe | Family::GraniteMoeShared | Family::GraniteMoeHybrid => {
                serde_json::json!({
                    "attention_bias": self.o_bias,
                    "embedding_multiplier": self.embedding_multiplier,
                    "residual_multiplier": self.residual_multiplier,
                    "attention_multiplier": self.attention_multiplier,
                    "logits_scaling": self.logits_scaling,
                    "num_local_experts": self.moe.as_ref().map(|m| m.experts),
                    "num_experts_per_tok": self.moe.as_ref().map(|m| m.top_k),
                    "output_router_logits": false,
                })
            }
            Family::Olmo2 => serde_json::json!({"attention_bias": self.o_bias}),
            Family::Olmo1 => serde_json::json!({
                "attention_bias": self.o_bias,
                "clip_qkv": self.clip_qkv,
            }),
            Family::Olmo3 => serde_json::json!({
                "attention_bias": self.o_bias,
                "sliding_window": self.sliding_window,
            }),
            Family::MiniMax => {
                let mut extra = serde_json::json!({
                    "sliding_window": self.sliding_window,
                    "num_local_experts": self.moe.as_ref().map(|m| m.experts),
                    "num_experts_per_tok": self.moe.as_ref().map(|m| m.top_k),
                    "router_jitter_noise": self.moe.as_ref().map(|m| m.jitter),
                    "output_router_logits": false,
                });
                let parts = [
                    self.lightning.as_ref().map(LightningConfig::to_json),
                    self.residual_factors.map(ResidualFactors::to_json),
                ];
                if let Some(all) = extra.as_object_mut() {
                    for part in parts.into_iter().flatten() {
                        if let serde_json::Value::Object(part) = part {
                            all.extend(part);
                        }
                    }
                }
                extra
            }
            Family::Mixtral => serde_json::json!({
                "sliding_window": self.sliding_window,
                "num_local_experts": self.moe.as_ref().map(|m| m.experts),
                "num_experts_per_tok": self.moe.as_ref().map(|m| m.top_k),
                "router_jitter_noise": self.moe.as_ref().map(|m| m.jitter),
                "output_router_logits": false,
            }),
            // Its Mamba layers' fields are written below (the Mambas'
            // whole configs by `mamba1::to_json` and `mamba::to_json`).
            Family::Bamba | Family::Mamba | Family::FalconMamba | Family::Mamba2 => {
                serde_json::json!({})
            }
            Family::FalconH1 => self.falcon_h1_json(),
            // Its convolutions and its MLP's width.
            Family::Lfm2 => (self.short_conv.as_ref())
                .map_or_else(|| serde_json::json!({}), |c| c.to_json(self.intermediate)),
            Family::Jamba => {
                let moe = self.moe.as_ref();
                let (period, offset) = super::mamba1::period_of(self.layers, |l| self.moe_layer(l));
                serde_json::json!({
                    // One expert: every layer dense.
                    "num_experts": moe.map_or(1, |m| m.experts),
                    "num_experts_per_tok": moe.map_or(1, |m| m.top_k),
                    "expert_layer_period": period,
                    "expert_layer_offset": offset,
                    "output_router_logits": false,
                })
            }
            Family::Phimoe => serde_json::json!({
                "attention_bias": self.o_bias,
                "lm_head_bias": self.head_bias,
                "sliding_window": self.sliding_window,
                "num_local_experts": self.moe.as_ref().map(|m| m.experts),
                "num_experts_per_tok": self.moe.as_ref().map(|m| m.top_k),
                "router_jitter_noise": self.moe.as_ref().and_then(|m| m.sparse_mixer),
                "input_jitter_noise": self.moe.as_ref().map(|m| m.jitter),
                "output_router_logits": false,
            }),
            Family::Glm | Family::Glm4 => serde_json::json!({
                "attention_bias": self.qkv_bias,
                "partial_rotary_factor": self.partial_rotary,
            }),
            Family::GptOss => serde_json::json!({
                "attention_bias": true,
                "sliding_window": self.sliding_window,
                "num_local_experts": self.moe.as_ref().map(|m| m.experts),
                "num_experts_per_tok": self.moe.as_ref().map(|m| m.top_k),
                "output_router_logits": false,
            }),
            Family::Glm4Moe => serde_json::json!({
                "attention_bias": self.qkv_bias,
                "use_qk_norm": self.qk_norm,
                "partial_rotary_factor": self.partial_rotary,
            }),
            Family::DeepseekV3 | Family::DeepseekV2 => {
                let m = self.mla.as_ref();
                let mut j = m.map_or_else(|| serde_json::json!({}), Mla::to_json);
                j["attention_bias"] = self.o_bias.into();
                if self.family == Family::DeepseekV3 {
                    j["rope_interleave"] = m.map(|m| m.interleave).into();
                } else {
                    // One group: the greedy choice (written without
                    // groups).
                    let grouped = (self.moe.as_ref()).and_then(|e| e.grouped.as_ref());
                    let greedy = grouped.is_none_or(|g| g.groups == 1);
                    j["topk_method"] = if greedy {
                        "greedy"
                    } else {
                        "group_limited_greedy"
                    }
                    .into();
                }
                j
            }
            // Its layers as `num_layers` (and their sublayers as
            // `num_hidden_layers`), its MLPs' width as `ffn_hidden_size`.
            Family::LongcatFlash => {
                let e = self.moe.as_ref();
                let mut j = (self.mla.as_ref()).map_or_else(|| serde_json::json!({}), Mla::to_json);
                let own = serde_json::json!({
                    "attention_bias": self.o_bias,
                    "num_layers": self.layers,
                    "num_hidden_layers": 2 * self.layers,
                    "ffn_hidden_size": self.intermediate,
                    "n_routed_experts": e.map(|e| e.experts),
                    "zero_expert_num": e.map(|e| e.zero),
                    "moe_topk": e.map(|e| e.top_k),
                    "expert_ffn_hidden_size": e.map(|e| e.intermediate),
                    "routed_scaling_factor": e.and_then(|e| e.grouped.as_ref()).map(|g| g.scale),
                });
                if let (Some(all), serde_json::Value::Object(own)) = (j.as_object_mut(), own) {
                    all.extend(own);
                }
                j
            }
            // Its MLP's width as a multiple of the width (exact where the
            // ratio is, else a hair above, so that its class's
            // truncation gives the width back).
            Family::GptNeoxJapanese => {
                let (i, d) = (self.intermediate as f64, self.hidden as f64);
                let multiple = match (d * (i / d)).floor() == i {
                    true => i / d,
                    false => (i + 0.5) / d,
                };
                serde_json::json!({
                    "intermediate_multiple_size": multiple,
                    "rotary_pct": self.partial_rotary,
                    "rotary_emb_base": self.rope_theta,
                    "hidden_dropout": self.resid_dropout,
                })
            }
            Family::FlexOlmo => serde_json::json!({
                "attention_bias": self.o_bias,
                "num_experts": self.moe.as_ref().map(|m| m.experts),
                "num_experts_per_tok": self.moe.as_ref().map(|m| m.top_k),
                "norm_topk_prob": self.moe.as_ref().map(|m| m.normalize),
                "output_router_logits": false,
            }),
            Family::Olmoe => serde_json::json!({
                "attention_bias": self.o_bias,
                "clip_qkv": self.clip_qkv,
                "num_experts": self.moe.as_ref().map(|m| m.experts),
                "num_experts_per_tok": self.moe.as_ref().map(|m| m.top_k),
                "norm_topk_prob": self.moe.as_ref().map(|m| m.normalize),
                "output_router_logits": false,
            }),
            Family::Qwen2Moe => serde_json::json!({
                "qkv_bias": self.qkv_bias,
                "use_sliding_window": false,
                "num_experts": self.moe.as_ref().map(|m| m.experts),
                "num_experts_per_tok": self.moe.as_ref().map(|m| m.top_k),
                "moe_intermediate_size": self.moe.as_ref().map(|m| m.intermediate),
                "shared_expert_intermediate_size": self.moe.as_ref().and_then(|m| m.shared),
                "norm_topk_prob": self.moe.as_ref().map(|m| m.normalize),
                "decoder_sparse_step": self.moe.as_ref().map(|m| m.sparse_step),
                "mlp_only_layers": self.moe.as_ref().map(|m| m.dense_layers.clone()),
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
            Family::Qwen3Next => {
                let moe = self.moe.as_ref();
                let mut extra = serde_json::json!({
                    "attention_bias": self.o_bias,
                    "partial_rotary_factor": self.partial_rotary,
                    "num_experts": moe.map_or(0, |m| m.experts),
                    "num_experts_per_tok": moe.map(|m| m.top_k),
                    "moe_intermediate_size": moe.map(|m| m.intermediate),
                    "shared_expert_intermediate_size": moe.and_then(|m| m.shared),
                    "norm_topk_prob": moe.map(|m| m.normalize),
                    "decoder_sparse_step": moe.map(|m| m.sparse_step),
                    "mlp_only_layers": moe.map(|m| m.dense_layers.clone()),
                    "output_router_logits": false,
                });
                if let (Some(all), Some(serde_json::Value::Object(delta))) = (
                    extra.as_object_mut(),
                    self.delta_net.as_ref().map(DeltaNetConfig::to_json),
                ) {
                    all.extend(delta);
                }
                // Left out, a written null would fail its class's checks.
                if let Some(all) = extra.as_object_mut() {
                    all.retain(|_, v| !v.is_null());
                }
                extra
            }
            Family::RecurrentGemma => {
                let mut extra = serde_json::json!({
                    "attention_bias": self.qkv_bias,
                    "partial_rotary_factor": self.partial_rotary,
                    "attention_window_size": self.sliding_window,
                    "logits_soft_cap": self.final_softcap,
                    // Its class with its cache on (the default) takes
                    // keys and values through a cache written without
                    // gradients, and a forward longer than the window
                    // attends to the window's last keys from every
                    // token: off, it trains and evaluates what zrt did.
                    "use_cache": false,
                });
                if let (Some(all), Some(serde_json::Value::Object(rg))) = (
                    extra.as_object_mut(),
                    self.rg_lru.as_ref().map(RgLruConfig::to_json),
                ) {
                    all.extend(rg);
                }
                extra
            }
            Family::SmolLm3 => serde_json::json!({
                "attention_bias": self.o_bias,
                "mlp_bias": self.mlp_bias,
                "use_sliding_window": false,
                "no_rope_layers": self.rope_layers.as_ref().map(|l| {
                    l.iter().map(|&r| i64::from(r)).collect::<Vec<_>>()
                }),
            }),
            Family::Ernie4_5 => serde_json::json!({"use_bias": self.o_bias}),
            Family::SeedOss => serde_json::json!({
                "attention_bias": self.qkv_bias,
                "attention_out_bias": self.o_bias,
                "mlp_bias": self.mlp_bias,
                "residual_dropout": self.resid_dropout,
            }),
            Family::Ernie4_5Moe => {
                let m = self.moe.as_ref();
                // The experts' layers: those between the dense ones
                // before and after.
                let dense = m.map_or(vec![], |m| m.dense_layers.clone());
                let start = (0..self.layers).find(|l| !dense.contains(l));
                let end = (0..self.layers).rev().find(|l| !dense.contains(l));
                serde_json::json!({
                    "use_bias": self.o_bias,
                    "moe_num_experts": m.map(|m| m.experts),
                    "moe_k": m.map(|m| m.top_k),
                    "moe_intermediate_size": m.map(|m| m.intermediate),
                    "moe_num_shared_experts": m.map(|m| m.shared.map_or(0, |s| s / m.intermediate)),
                    "moe_layer_start_index": start,
                    "moe_layer_end_index": end,
                    "moe_layer_interval": m.map(|m| m.sparse_step),
                    "output_router_logits": false,
                })
            }
            Family::Starcoder2 => serde_json::json!({
                "use_bias": self.o_bias,
                "sliding_window": self.sliding_window,
                "residual_dropout": self.resid_dropout,
                "embedding_dropout": self.embedding_dropout,
            }),
            Family::Cohere => serde_json::json!({
                "attention_bias": self.o_bias,
                "logit_scale": self.logit_scale,
                "use_qk_norm": self.qk_norm,
            }),
            Family::Cohere2 => serde_json::json!({
                "attention_bias": self.o_bias,
                "logit_scale": self.logit_scale,
                "sliding_window": self.sliding_window,
            }),
            Family::Exaone4 => serde_json::json!({"sliding_window": self.sliding_window}),
            // Every layer full, whatever `max_window_layers` defaults to.
            Family::Dots1 => serde_json::json!({
                "attention_bias": self.o_bias,
                "layer_types": vec!["full_attention"; self.layers as usize],
            }),
            Family::Apertus | Family::HunyuanDense => {
                serde_json::json!({"attention_bias": self.o_bias})
            }
            Family::HunyuanMoe => serde_json::json!({
                "attention_bias": self.o_bias,
                "num_experts": self.moe.as_ref().map(|m| m.experts),
                "moe_topk": self.moe.as_ref().map(|m| m.top_k),
            }),
            Family::Llama4 => {
                let (moe, a) = (self.moe.as_ref(), self.llama4.as_ref());
                let temperature = a.and_then(|a| a.temperature);
                serde_json::json!({
                    "intermediate_size": moe.map(|m| m.intermediate),
                    "intermediate_size_mlp": self.intermediate,
                    "num_local_experts": moe.map(|m| m.experts),
                    "num_experts_per_tok": moe.map(|m| m.top_k),
                    "moe_layers": (0..self.layers).filter(|&l| self.moe_layer(l)).collect::<Vec<_>>(),
                    "no_rope_layers": self.rope_layers.as_ref().map(|l| {
                        l.iter().map(|&r| i64::from(r)).collect::<Vec<_>>()
                    }),
                    "attention_chunk_size": a.and_then(|a| a.chunk),
                    "layer_types": a.map(|a| {
                        (a.chunked.iter())
                            .map(|&c| if c { "chunked_attention" } else { "full_attention" })
                            .collect::<Vec<_>>()
                    }),
                    "use_qk_norm": a.is_some_and(|a| a.qk_l2_norm),
                    "attn_temperature_tuning": temperature.is_some(),
                    "floor_scale": temperature.map_or(8192.0, |t| t.0),
                    "attn_scale": temperature.map_or(0.1, |t| t.1),
                    "output_router_logits": false,
                })
            }
            // Written whole above.
            Family::Dbrx
            | Family::Falcon
            | Family::GptJ
            | Family::CodeGen
            | Family::GptBigCode
            | Family::Opt
            | Family::BioGpt
            | Family::Xglm
            | Family::Ctrl
            | Family::OpenAiGpt
            | Family::ModernBertDecoder
            | Family::Rwkv
            | Family::Zamba2
            | Family::Zamba
            | Family::Xlstm
            | Family::GptNeo
            | Family::Mpt
            | Family::Bloom => {
                serde_json::json!({})
            }
            Family::Nemotron => serde_json::json!({
                "attention_bias": self.o_bias,
                "mlp_bias": self.mlp_bias,
                "partial_rotary_factor": self.partial_rotary,
            }),
            Family::Helium => serde_json::json!({
                "attention_bias": self.qkv_bias,
                "mlp_bias": self.mlp_bias,
            }),
            Family::Arcee => serde_json::json!({
                "attention_bias": self.o_bias,
                "mlp_bias": self.mlp_bias,
            }),
            Family::Persimmon => serde_json::json!({
                "qk_layernorm": self.qk_norm,
                "partial_rotary_factor": self.partial_rotary,
                "hidden_dropout": self.resid_dropout,
            }),
            Family::StableLm => serde_json::json!({
                "use_qkv_bias": self.qkv_bias,
                "qk_layernorm": self.qk_norm,
                "use_parallel_residual": self.parallel,
                "partial_rotary_factor": self.partial_rotary,
                "hidden_dropout": self.resid_dropout,
            }),
            Family::Gemma2 | Family::VaultGemma | Family::Gemma3 => serde_json::json!({
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
        // The router's load-balancing loss, which the model trains with.
        if let (Some(coef), Some(all)) = (
            self.moe.as_ref().and_then(|m| m.balance),
            json.as_object_mut(),
        ) {
            all.insert("output_router_logits".into(), true.into());
            all.insert("router_aux_loss_coef".into(), coef.into());
        }
        // Persimmon's class has no count of key-value heads: every head
        // has its own.
        if let (Family::Persimmon, Some(all)) = (self.family, json.as_object_mut()) {
            all.remove("num_key_value_heads");
        }
        // OLMo 1's norms take no epsilon from the config (theirs is 1e-5).
        if let (Family::Olmo1, Some(all)) = (self.family, json.as_object_mut()) {
            all.remove(self.family.eps_key());
        }
        if self.family == Family::GraniteMoeShared {
            let shared = self.moe.as_ref().and_then(|m| m.shared);
            json["shared_intermediate_size"] = shared.unwrap_or(0).into();
        }
        // Jamba's Mamba layers and where it attends.
        if let (Family::Jamba, Some(m), Some(all)) =
            (self.family, &self.mamba1, json.as_object_mut())
        {
            if let serde_json::Value::Object(fields) = m.to_json() {
                all.extend(fields);
            }
            // Its attention takes no positions: its class has no base.
            all.remove("rope_theta");
        }
        // Bamba's Mamba layers and the layers that attend.
        if let (Family::Bamba, Some(m), Some(all)) =
            (self.family, &self.mamba, json.as_object_mut())
        {
            if let serde_json::Value::Object(fields) = m.to_json() {
                all.extend(fields);
            }
            all.remove("layer_types");
            // Null when none attends, as its class's default says.
            let at = m.attention_layers();
            let at = match at.is_empty() {
                true => serde_json::Value::Null,
                false => at.into(),
            };
            all.insert("attn_layer_indices".into(), at);
            all.insert("z_loss_coefficient".into(), self.z_loss.into());
        }
        // Granite 4.0's: its shared MLP (the MLP's width in a dense
        // model), its Mamba layers, whether it turns.
        if let (Family::GraniteMoeHybrid, Some(m), Some(all)) =
            (self.family, &self.mamba, json.as_object_mut())
        {
            let shared = match &self.moe {
                Some(e) => e.shared.unwrap_or(0),
                None => self.intermediate,
            };
            all.insert("shared_intermediate_size".into(), shared.into());
            all.insert(
                "num_local_experts".into(),
                self.moe.as_ref().map_or(0, |e| e.experts).into(),
            );
            let rope = (self.rope_layers.as_ref()).is_some_and(|r| r.iter().any(|&t| t));
            all.insert(
                "position_embedding_type".into(),
                // Its class's default (None) attends without positions.
                if rope {
                    "rope".into()
                } else {
                    serde_json::Value::Null
                },
            );
            if let serde_json::Value::Object(fields) = m.to_json() {
                all.extend(fields);
            }
        }
        // DeepSeek-V2's and V3's and GLM-4-MoE's experts.
        if let (true, Some(e), Some(all)) = (
            self.family.deepseek_experts(),
            &self.moe,
            json.as_object_mut(),
        ) {
            // DeepSeek-V2's greedy routing: no groups (its class's
            // nulls).
            let greedy = self.family == Family::DeepseekV2;
            let routing = e.grouped.as_ref();
            let g = routing.filter(|g| !(greedy && g.groups == 1));
            let experts = serde_json::json!({
                "n_routed_experts": e.experts,
                "num_experts_per_tok": e.top_k,
                "moe_intermediate_size": e.intermediate,
                "n_shared_experts": e.shared.map(|s| s / e.intermediate),
                "first_k_dense_replace": e.dense_layers.len(),
                "norm_topk_prob": e.normalize,
                "n_group": g.map(|g| g.groups),
                "topk_group": g.map(|g| g.top_groups),
                "routed_scaling_factor": routing.map(|g| g.scale),
            });
            if let serde_json::Value::Object(experts) = experts {
                all.extend(experts);
            }
        }
        // DeepSeek-V3's scores grow with the scaling's `mscale_all_dim`.
        if let (Some(m), Some(scaling)) = (&self.mla, json["rope_scaling"].as_object_mut()) {
            if m.mscale_all_dim != 0.0 {
                scaling.insert("mscale_all_dim".into(), m.mscale_all_dim.into());
            }
        }
        format!("{json:#}\n")
    }
}

/// Mixtral's, OLMoE's, Qwen2-MoE's, Qwen3-MoE's, DeepSeek-V2's and
/// V3's, GLM-4-MoE's, GPT-OSS's and Granite-MoE's experts
/// ([`MoeConfig`]), `None` for the other families. The router's
/// load-balancing loss (`output_router_logits`) is taken for the families
/// [`Family::balance_default`] names and refused for the others;
/// A router jitter is refused for the families whose classes have none.
fn moe(j: &HfJson, family: Family) -> Result<Option<MoeConfig>, HfError> {
    let (experts_key, width_key, normalize) = match family {
        // GPT-OSS's softmax over the top `k` logits: the top `k` of the
        // softmax, renormalised.
        // Granite-MoE's too.
        f if matches!(
            f,
            Family::Mixtral | Family::MiniMax | Family::GptOss | Family::JetMoe
        ) || f.granite_moe() =>
        {
            ("num_local_experts", "intermediate_size", true)
        }
        // sparsemixer's weights are its softmaxes', as they are.
        Family::Phimoe => ("num_local_experts", "intermediate_size", false),
        Family::Olmoe | Family::FlexOlmo => (
            "num_experts",
            "intermediate_size",
            j.flag_or("norm_topk_prob", false)?,
        ),
        f if f.deepseek_experts() => (
            "n_routed_experts",
            "moe_intermediate_size",
            j.flag_or(
                "norm_topk_prob",
                !matches!(f, Family::DeepseekV2 | Family::Dots1),
            )?,
        ),
        Family::Qwen2Moe | Family::Qwen3Moe => (
            "num_experts",
            "moe_intermediate_size",
            j.flag_or("norm_topk_prob", false)?,
        ),
        Family::Qwen3Next => (
            "num_experts",
            "moe_intermediate_size",
            j.flag_or("norm_topk_prob", true)?,
        ),
        Family::Ernie4_5Moe => ("moe_num_experts", "moe_intermediate_size", true),
        // Llama 4's: sigmoids of the top logits, not renormalised.
        Family::Llama4 => ("num_local_experts", "intermediate_size", false),
        // LongCat-Flash's: softmax scores, scaled, not renormalised.
        Family::LongcatFlash => ("n_routed_experts", "expert_ffn_hidden_size", false),
        // Jamba's: the softmax's top `k`, as they are.
        Family::Jamba => ("num_experts", "intermediate_size", false),
        // Hunyuan's experts and shared MLP are all the MLP's width.
        Family::HunyuanMoe => ("num_experts", "intermediate_size", true),
        // Aria's: a softmax over the top logits alone.
        Family::AriaText => ("moe_num_experts", "intermediate_size", true),
        // DBRX's `moe_normalize_expert_weights`, read as a flag.
        Family::Dbrx => (
            "num_local_experts",
            "intermediate_size",
            j.flag_or("norm_topk_prob", true)?,
        ),
        _ => return Ok(None),
    };
    if family == Family::GraniteMoeHybrid && granite_dense(j)? {
        return Ok(None);
    }
    // Qwen3-Next's layers without experts are dense.
    if family == Family::Qwen3Next && count_or(j, "num_experts", 512)? == 0 {
        return Ok(None);
    }
    // Jamba's layers with one expert are dense (`JambaMLP`).
    if family == Family::Jamba && j.size_or_none("num_experts")?.unwrap_or(16) <= 1 {
        return Ok(None);
    }
    let balance = match (
        j.flag_or("output_router_logits", false)?,
        family.balance_default(),
    ) {
        (false, _) => None,
        (true, Some(default)) => Some(j.number_or("router_aux_loss_coef", default)?),
        // `JetMoeForCausalLM` adds it only when its forward is given
        // `output_router_logits=True`, and then fails (it has no
        // `num_experts`): there is no loss of its to train as.
        (true, None) if family == Family::JetMoe => {
            return Err(j.field(
                "output_router_logits true: transformers' JetMoeForCausalLM never adds its routers' load-balancing loss from the config (asked in forward, it fails: it has no num_experts), so zrt has no JetMoE balance to train as; set it to false".into(),
            ));
        }
        (true, None) => {
            return Err(j.field(format!(
                "output_router_logits true: zrt adds the router's load-balancing loss for Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, FlexOlmo, MiniMax, Qwen3-Next, Jamba, the Granite MoEs, DBRX, GPT-OSS, PhiMoE and ERNIE 4.5, as transformers does, not for {} (transformers' class adds none); set it to false",
                family.model_type()
            )));
        }
    };
    if family == Family::Ernie4_5Moe {
        if j.flag_or("use_bias", false)? {
            return Err(j.field(
                "use_bias true: zrt builds ERNIE 4.5's experts and head without biases (its published models have none); set it to false".into(),
            ));
        }
        let min = j.number_or("moe_norm_min", 1e-12)?;
        if min != 1e-12 {
            return Err(j.field(format!(
                "moe_norm_min {min}: zrt renormalises ERNIE 4.5's expert weights over a sum of at least 1e-12, its class's default; set it to 1e-12"
            )));
        }
    }
    // Mixtral's and MiniMax's router jitter is read below; PhiMoE's is
    // sparsemixer's margin. No other class jitters (Llama 4's config
    // has the field, its model never reads it).
    let jitter = match family {
        Family::Phimoe | Family::Mixtral | Family::MiniMax => 0.0,
        _ => j.number_or("router_jitter_noise", 0.0)?,
    };
    if jitter != 0.0 {
        return Err(j.field(format!(
            "router_jitter_noise {jitter}: zrt's routers take the hidden states as they are, as transformers' {} does (set it to 0)",
            family.model_type()
        )));
    }
    // The config classes' experts, top k and expert width.
    let defaults = match family {
        Family::Mixtral
        | Family::MiniMax
        | Family::GraniteMoe
        | Family::GraniteMoeShared
        | Family::GraniteMoeHybrid
        | Family::JetMoe => (8, 2, 0),
        Family::Phimoe | Family::Jamba => (16, 2, 0),
        Family::Dbrx => (4, 1, 3584),
        Family::HunyuanMoe => (1, 1, 0),
        Family::AriaText => (8, 2, 4096),
        Family::Llama4 => (16, 1, 8192),
        Family::Olmoe => (64, 8, 0),
        Family::FlexOlmo => (7, 5, 0),
        Family::Qwen2Moe => (60, 4, 1408),
        Family::Qwen3Next => (512, 10, 512),
        Family::DeepseekV3 => (256, 8, 2048),
        Family::DeepseekV2 => (64, 0, 1407),
        Family::Ernie4_5Moe => (64, 6, 1536),
        Family::Dots1 => (0, 0, 1408),
        Family::Glm4Moe => (128, 8, 1408),
        Family::GptOss => (128, 4, 0),
        Family::LongcatFlash => (512, 12, 2048),
        _ => (128, 8, 768),
    };
    // Hunyuan's class takes a list a layer too: zrt builds one count.
    if family == Family::HunyuanMoe {
        for key in ["num_experts", "moe_topk"] {
            if let Some(v) = j.get(key).filter(|v| v.is_array()) {
                return Err(j.field(format!(
                    "{key} {v}: a count for each layer; zrt builds every layer with one (give a number)"
                )));
            }
        }
    }
    let experts = match family {
        // dots1's class has no default.
        Family::Dots1 => j.size_or_none(experts_key)?.ok_or_else(|| {
            j.field("no n_routed_experts: dots1's config class has no default; give it".into())
        })?,
        _ => j.size_or_none(experts_key)?.unwrap_or(defaults.0),
    };
    // DeepSeek-V2's class has no default.
    let top_k = match family {
        Family::Ernie4_5Moe => j.size_or_none("moe_k")?.unwrap_or(defaults.1),
        Family::LongcatFlash => j.size_or_none("moe_topk")?.unwrap_or(defaults.1),
        Family::HunyuanMoe | Family::AriaText => j.size_or_none("moe_topk")?.unwrap_or(defaults.1),
        Family::Dots1 => j.size_or_none("num_experts_per_tok")?.ok_or_else(|| {
            j.field("no num_experts_per_tok: dots1's config class has no default; give it".into())
        })?,
        Family::DeepseekV2 => j.size_or_none("num_experts_per_tok")?.ok_or_else(|| {
            j.field("no num_experts_per_tok: DeepSeek-V2's config class has no default (its models route 6 experts a token); give it".into())
        })?,
        _ => j.size_or_none("num_experts_per_tok")?.unwrap_or(defaults.1),
    };
    if family == Family::Phimoe && top_k != 2 {
        return Err(j.field(format!(
            "num_experts_per_tok {top_k}: PhiMoE's sparsemixer routes each token to 2 experts (its class raises otherwise); set it to 2"
        )));
    }
    let zero = match family {
        Family::LongcatFlash => longcat_zero_experts(j)?,
        _ => 0,
    };
    if top_k > experts + zero {
        let key = match family {
            Family::Ernie4_5Moe => "moe_k",
            Family::HunyuanMoe | Family::LongcatFlash | Family::AriaText => "moe_topk",
            _ => "num_experts_per_tok",
        };
        return Err(j.field(format!(
            "{key} {top_k} is more than the {} experts",
            experts + zero
        )));
    }
    let dense_layers = match j.get("mlp_only_layers") {
        // Llama 4's `moe_layers` (by default every
        // `interleave_moe_layer_step`-th): the others are dense.
        _ if family == Family::Llama4 => {
            let layers = j.size("num_hidden_layers")?;
            let step = j
                .size_or_none("interleave_moe_layer_step")?
                .unwrap_or(1)
                .max(1);
            let sparse: Vec<i64> = match j.get("moe_layers") {
                None | Some(serde_json::Value::Null) => {
                    (step - 1..layers).step_by(step as usize).collect()
                }
                Some(v) => (v.as_array())
                    .and_then(|l| l.iter().map(|n| n.as_i64()).collect::<Option<Vec<i64>>>())
                    .ok_or_else(|| j.field(format!("moe_layers {v}: a list of layer numbers")))?,
            };
            (0..layers).filter(|l| !sparse.contains(l)).collect()
        }
        // Jamba's experts: every `expert_layer_period`-th layer, from
        // `expert_layer_offset`.
        _ if family == Family::Jamba => {
            let (period, offset) = super::mamba1::period(j, "expert", (2, 1))?;
            (0..j.size("num_hidden_layers")?)
                .filter(|l| l % period != offset)
                .collect()
        }
        // DeepSeek-V3's (and GLM-4-MoE's) first `first_k_dense_replace`
        // layers.
        _ if family.deepseek_experts() => {
            let dense = match family {
                Family::Glm4Moe => 1,
                Family::DeepseekV2 | Family::Dots1 => 0,
                _ => 3,
            };
            (0..count_or(j, "first_k_dense_replace", dense)?).collect()
        }
        // ERNIE 4.5's experts: the layers from `moe_layer_start_index`
        // to `moe_layer_end_index` (-1: the last), every
        // `moe_layer_interval`-th (the sparse step).
        _ if family == Family::Ernie4_5Moe => {
            let layers = j.size("num_hidden_layers")?;
            let start = count_or(j, "moe_layer_start_index", 1)?;
            let end = match j.get("moe_layer_end_index").and_then(|v| v.as_i64()) {
                None | Some(-1) => layers - 1,
                Some(e) => e,
            };
            (0..layers).filter(|&l| l < start || l > end).collect()
        }
        None => Vec::new(),
        Some(v) => (v.as_array())
            .and_then(|l| l.iter().map(|n| n.as_i64()).collect::<Option<Vec<i64>>>())
            .ok_or_else(|| j.field(format!("mlp_only_layers {v}: a list of layer numbers")))?,
    };
    let intermediate = match family {
        f if matches!(
            f,
            Family::Mixtral
                | Family::MiniMax
                | Family::Olmoe
                | Family::FlexOlmo
                | Family::GptOss
                | Family::HunyuanMoe
                | Family::Jamba
        ) || f.granite_moe() =>
        {
            j.size(width_key)?
        }
        _ => j.size_or_none(width_key)?.unwrap_or(defaults.2),
    };
    let grouped = match family {
        f if f.deepseek_experts() => Some(group_routing(j, f, experts)?),
        // One group: the top `k` of every expert, zero ones too.
        Family::LongcatFlash => Some(GroupRouting {
            groups: 1,
            top_groups: 1,
            scale: j.number_or("routed_scaling_factor", 6.0)?,
            scoring: Scoring::Softmax,
        }),
        _ => None,
    };
    Ok(Some(MoeConfig {
        experts,
        top_k,
        intermediate,
        normalize,
        sparse_step: match family {
            Family::Ernie4_5Moe => j.size_or_none("moe_layer_interval")?.unwrap_or(1),
            _ => j.size_or_none("decoder_sparse_step")?.unwrap_or(1),
        },
        dense_layers,
        shared: match family {
            Family::Qwen2Moe => Some(
                j.size_or_none("shared_expert_intermediate_size")?
                    .unwrap_or(5632),
            ),
            Family::Qwen3Next => Some(
                j.size_or_none("shared_expert_intermediate_size")?
                    .unwrap_or(512),
            ),
            // `moe_num_shared_experts` experts' width (none when 0).
            Family::Ernie4_5Moe => Some(count_or(j, "moe_num_shared_experts", 2)?)
                .filter(|&n| n > 0)
                .map(|n| intermediate * n),
            // `n_shared_experts` experts' width, one MLP (DeepSeek-V2's
            // two unless it says, none when null).
            Family::DeepseekV2 => {
                (j.size_or_null("n_shared_experts", Some(2))?).map(|n| intermediate * n)
            }
            // `moe_num_shared_experts` experts' width, one MLP.
            Family::AriaText => Some(intermediate * aria_shared_experts(j)?),
            // Hunyuan's shared MLP, the MLP's width; Llama 4's shared
            // expert, an expert's.
            Family::HunyuanMoe | Family::Llama4 => Some(intermediate),
            // Granite-MoE-shared's width, none when 0 (its default).
            Family::GraniteMoeShared => {
                Some(count_or(j, "shared_intermediate_size", 0)?).filter(|&n| n > 0)
            }
            Family::GraniteMoeHybrid => {
                Some(count_or(j, "shared_intermediate_size", 1024)?).filter(|&n| n > 0)
            }
            // dots1's: none unless it says.
            Family::Dots1 => (j.size_or_null("n_shared_experts", None)?).map(|n| intermediate * n),
            f if f.deepseek_experts() => {
                Some(intermediate * j.size_or_none("n_shared_experts")?.unwrap_or(1))
            }
            _ => None,
        },
        grouped,
        jitter: match family {
            Family::Dbrx => j.number_or("moe_jitter_eps", 0.0)?,
            Family::Phimoe => j.rate_or("input_jitter_noise", 0.0)?,
            Family::Mixtral | Family::MiniMax => j.rate_or("router_jitter_noise", 0.0)?,
            _ => 0.0,
        },
        sparse_mixer: match family {
            Family::Phimoe => Some(j.number_or("router_jitter_noise", 0.01)?),
            _ => None,
        },
        balance,
        zero,
    }))
}

/// GPT-NeoX-Japanese's MLP width: `hidden_size` times
/// `intermediate_multiple_size` (4 unless it says), truncated as its
/// class truncates it.
fn neox_japanese_mlp_width(j: &HfJson, hidden: i64) -> Result<i64, HfError> {
    let multiple = j.number_or("intermediate_multiple_size", 4.0)?;
    let width = (hidden as f64 * multiple) as i64;
    if !(multiple.is_finite() && width >= 1) {
        return Err(j.field(format!(
            "intermediate_multiple_size {multiple}: the MLP is hidden_size {hidden} times it wide (truncated); give a positive number"
        )));
    }
    Ok(width)
}

/// Aria's `moe_num_shared_experts` (2 unless it says): at least one,
/// as its class always builds the shared MLP and adds it.
fn aria_shared_experts(j: &HfJson) -> Result<i64, HfError> {
    match count_or(j, "moe_num_shared_experts", 2)? {
        0 => Err(j.field(
            "moe_num_shared_experts 0: Aria's class always adds its shared experts' MLP, which zrt builds from one expert's width up; give 1 or more".into(),
        )),
        n => Ok(n),
    }
}

/// LongCat-Flash's `zero_expert_num` (256 unless it says), after
/// refusing what its class would not compute: a router bias (it builds
/// one and never adds it) and zero experts of a `zero_expert_type`
/// other than `identity` (LongCat's own code's field; the class's are
/// always identities).
fn longcat_zero_experts(j: &HfJson) -> Result<i64, HfError> {
    if j.flag_or("router_bias", false)? {
        return Err(j.field(
            "router_bias true: transformers' LongCat-Flash builds a bias for its router and never adds it, so zrt builds none; set it to false".into(),
        ));
    }
    match j.get("zero_expert_type") {
        None | Some(serde_json::Value::Null) => {}
        Some(v) if v == "identity" => {}
        Some(v) => {
            return Err(j.field(format!(
                "zero_expert_type {v}: transformers' LongCat-Flash passes a token through its zero experts unchanged (\"identity\"); give that"
            )))
        }
    }
    count_or(j, "zero_expert_num", 256)
}

/// Whether Granite 4.0's config `j` has no experts (`num_local_experts`
/// 0): its layers' MLP is the shared one alone.
fn granite_dense(j: &HfJson) -> Result<bool, HfError> {
    Ok(count_or(j, "num_local_experts", 8)? == 0)
}

/// The `layer_types` of config `j`, `layers` deep, of a family (`whose`)
/// whose layers are of the two `kinds`: for each layer, whether it is
/// of kind `marked`; `None` when the field is absent or null.
pub(super) fn layer_kinds(
    j: &HfJson,
    layers: i64,
    whose: &str,
    kinds: [&str; 2],
    marked: &str,
) -> Result<Option<Vec<bool>>, HfError> {
    kinds_under(j, "layer_types", layers, (whose, kinds, marked))
}

/// [`layer_kinds`] under the field `key` (Zamba's `layers_block_type`).
pub(super) fn kinds_under(
    j: &HfJson,
    key: &str,
    layers: i64,
    (whose, kinds, marked): (&str, [&str; 2], &str),
) -> Result<Option<Vec<bool>>, HfError> {
    let [a, b] = kinds;
    let Some(given) = j.get(key).filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let Some(list) = given.as_array() else {
        return Err(j.field(format!(
            "{key} {given}: give a list of \"{a}\" or \"{b}\", one a layer"
        )));
    };
    if list.len() as i64 != layers {
        return Err(j.field(format!(
            "{key} has {} entries for num_hidden_layers {layers}: give one a layer",
            list.len()
        )));
    }
    (list.iter())
        .map(|k| match k.as_str() {
            Some(kind) if kinds.contains(&kind) => Ok(kind == marked),
            _ => Err(j.field(format!(
                "{key} entry {k}: {whose}'s layers are \"{a}\" or \"{b}\""
            ))),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// The layers config `j` says attend by their numbers under `key`
/// (Bamba's `attn_layer_indices`, LFM2's `full_attn_idxs`): for each of
/// `layers`, whether it attends; `None` when the field is absent or null.
pub(super) fn attending_at(
    j: &HfJson,
    key: &str,
    layers: i64,
) -> Result<Option<Vec<bool>>, HfError> {
    let Some(v) = j.get(key).filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let at = (v.as_array())
        .and_then(|l| l.iter().map(|n| n.as_i64()).collect::<Option<Vec<i64>>>())
        .filter(|at| at.iter().all(|l| (0..layers).contains(l)))
        .ok_or_else(|| {
            j.field(format!(
                "{key} {v}: the numbers of the layers that attend, each below num_hidden_layers {layers}"
            ))
        })?;
    Ok(Some((0..layers).map(|l| at.contains(&l)).collect()))
}

/// Field `key`, a whole number not below 0, `default` when absent.
pub(super) fn count_or(j: &HfJson, key: &str, default: i64) -> Result<i64, HfError> {
    match j.get(key) {
        None => Ok(default),
        Some(v) => (v.as_i64().filter(|n| *n >= 0))
            .ok_or_else(|| j.field(format!("{key} {v}: a whole number, 0 or more"))),
    }
}

/// DeepSeek-V3's routing of `experts` ([`GroupRouting`]), with the
/// `family`'s config class's defaults (GLM-4-MoE's: one group, no
/// scale).
fn group_routing(j: &HfJson, family: Family, experts: i64) -> Result<GroupRouting, HfError> {
    if family == Family::DeepseekV2 {
        return softmax_routing(j, experts);
    }
    let (groups, top_groups, scale) = match family {
        Family::Glm4Moe | Family::Dots1 => (1, 1, 1.0),
        _ => (8, 4, 2.5),
    };
    let groups = j.size_or_none("n_group")?.unwrap_or(groups);
    let top_groups = j.size_or_none("topk_group")?.unwrap_or(top_groups);
    // A group is worth its two best experts.
    if experts % groups != 0 || experts / groups < 2 {
        return Err(j.field(format!(
            "n_group {groups}: the {experts} experts must split into groups of two or more"
        )));
    }
    if top_groups > groups {
        return Err(j.field(format!(
            "topk_group {top_groups} is more than the n_group {groups} groups"
        )));
    }
    // dots1's class ignores its `scoring_func` (its configs say
    // "noaux_tc"), as it does its `topk_method`.
    let scoring = j.get("scoring_func").and_then(|v| v.as_str());
    if scoring.is_some_and(|s| s != "sigmoid") && family != Family::Dots1 {
        return Err(j.field(format!(
            "scoring_func {scoring:?}: {}'s routers score experts by a sigmoid",
            family.model_type()
        )));
    }
    Ok(GroupRouting {
        groups,
        top_groups,
        scale: j.number_or("routed_scaling_factor", scale)?,
        scoring: Scoring::Sigmoid,
    })
}

/// DeepSeek-V2's routing of `experts` ([`Scoring::Softmax`]), as
/// `transformers`' `DeepseekV2MoEGate` computes it: `topk_method`
/// `greedy` (its default: the softmax's top `k`, one group) or
/// `group_limited_greedy` (within the `topk_group` best of `n_group`).
/// Its class leaves `norm_topk_prob` unused where DeepSeek's own code
/// normalises: a config asking for it is refused (DeepSeek-V2's are
/// false), as are an `mlp_bias` its experts would not have, a
/// `scoring_func` other than `softmax` and a `moe_layer_freq` other than
/// 1 (DeepSeek's code's, which the class ignores).
fn softmax_routing(j: &HfJson, experts: i64) -> Result<GroupRouting, HfError> {
    let scoring = j.get("scoring_func").and_then(|v| v.as_str());
    if scoring.is_some_and(|s| s != "softmax") {
        return Err(j.field(format!(
            "scoring_func {scoring:?}: DeepSeek-V2's routers score experts by a softmax"
        )));
    }
    let every = j.size_or_none("moe_layer_freq")?.unwrap_or(1);
    if every != 1 {
        return Err(j.field(format!(
            "moe_layer_freq {every}: transformers' DeepSeek-V2 puts experts on every layer after first_k_dense_replace, so zrt does; set it to 1"
        )));
    }
    if j.flag_or("norm_topk_prob", false)? {
        return Err(j.field(
            "norm_topk_prob true: transformers' DeepSeek-V2 never normalises its experts' weights (DeepSeek's own code does), so the two disagree on this model; set it to false".into(),
        ));
    }
    if j.flag_or("mlp_bias", false)? {
        return Err(j.field(
            "mlp_bias true: zrt builds DeepSeek-V2's experts without biases (DeepSeek-V2's configs have none); set it to false".into(),
        ));
    }
    let method = j.get("topk_method").and_then(|m| m.as_str());
    let (groups, top_groups) = match method {
        None | Some("greedy") => (1, 1),
        Some("group_limited_greedy") => (j.size("n_group")?, j.size("topk_group")?),
        Some(m) => {
            return Err(j.field(format!(
                "topk_method {m:?}: transformers' DeepSeek-V2 routes by \"greedy\" or \"group_limited_greedy\""
            )))
        }
    };
    if groups <= 0 || experts % groups != 0 {
        return Err(j.field(format!(
            "n_group {groups}: the {experts} experts must split into that many groups"
        )));
    }
    if top_groups > groups {
        return Err(j.field(format!(
            "topk_group {top_groups} is more than the n_group {groups} groups"
        )));
    }
    Ok(GroupRouting {
        groups,
        top_groups,
        scale: j.number_or("routed_scaling_factor", 1.0)?,
        scoring: Scoring::Softmax,
    })
}

/// DeepSeek-V3's attention ([`Mla`]), `None` for the other families.
/// A `head_dim` other than `qk_rope_head_dim` (the width its config
/// class turns) is refused. `sizes` are the config's `hidden_size`,
/// `num_attention_heads` and key-value heads as already read, which
/// LongCat-Flash's scales and checks take.
fn mla(j: &HfJson, family: Family, sizes: (i64, i64, i64)) -> Result<Option<Mla>, HfError> {
    if !family.latent_attention() {
        return Ok(None);
    }
    let rope = j.size_or_none("qk_rope_head_dim")?.unwrap_or(64);
    if rope % 2 != 0 {
        return Err(j.field(format!(
            "qk_rope_head_dim {rope}: rotary embeddings turn pairs of dimensions"
        )));
    }
    let name = match family {
        Family::DeepseekV2 => "DeepSeek-V2",
        Family::LongcatFlash => "LongCat-Flash",
        _ => "DeepSeek-V3",
    };
    // LongCat-Flash's config class has a `head_dim` of its own (64).
    let head_dim = match family {
        Family::LongcatFlash => Some(j.size_or_none("head_dim")?.unwrap_or(64)),
        _ => j.size_or_none("head_dim")?,
    };
    if let Some(d) = head_dim.filter(|&d| d != rope) {
        return Err(j.field(format!(
            "head_dim {d}: {name}'s config class turns head_dim dimensions, which must be qk_rope_head_dim {rope}"
        )));
    }
    let (nope, v) = (
        j.size_or_none("qk_nope_head_dim")?.unwrap_or(128),
        j.size_or_none("v_head_dim")?.unwrap_or(128),
    );
    let q_rank = j.size_or_null("q_lora_rank", Some(1536))?;
    let kv_rank = j.size_or_none("kv_lora_rank")?.unwrap_or(512);
    let scales = match family {
        Family::LongcatFlash => Some(longcat_scales(j, sizes, (q_rank, kv_rank, nope + rope))?),
        _ => None,
    };
    let scaling = j.get("rope_scaling").filter(|v| !v.is_null());
    let mscale_all_dim = match scaling.and_then(|v| v.get("mscale_all_dim")) {
        None => 0.0,
        Some(v) => v
            .as_f64()
            .ok_or_else(|| j.field(format!("rope_scaling's mscale_all_dim {v}: not a number")))?,
    };
    Ok(Some(Mla {
        q_rank,
        kv_rank,
        nope,
        rope,
        v,
        interleave: match family {
            Family::DeepseekV2 => false,
            // LongCat-Flash's class always regroups the pairs.
            Family::LongcatFlash => true,
            _ => j.flag_or("rope_interleave", true)?,
        },
        mscale_all_dim,
        scales,
    }))
}

/// LongCat-Flash's [`Mla::scales`], after refusing what its class
/// cannot build: no query bottleneck (its scale divides by
/// `q_lora_rank`), keys and values of fewer heads than the queries (its
/// latent gives every head its own), a `qk_head_dim` other than the
/// two parts' sum, and LongCat's own code's flags turning the scales
/// off (the class always scales).
fn longcat_scales(
    j: &HfJson,
    (hidden, heads, kv_heads): (i64, i64, i64),
    (q_rank, kv_rank, qk): (Option<i64>, i64, i64),
) -> Result<(f64, f64), HfError> {
    let Some(q_rank) = q_rank else {
        return Err(j.field(
            "q_lora_rank null: transformers' LongCat-Flash scales its queries by hidden_size over q_lora_rank, so it always has the bottleneck; give a rank".into(),
        ));
    };
    if kv_heads != heads {
        return Err(j.field(format!(
            "num_key_value_heads {kv_heads}: LongCat-Flash's latent attention gives each of the {heads} heads its own keys and values (its class fails on fewer); leave it out"
        )));
    }
    if let Some(given) = j.size_or_null("qk_head_dim", None)?.filter(|&d| d != qk) {
        return Err(j.field(format!(
            "qk_head_dim {given}: LongCat-Flash's queries and keys are qk_nope_head_dim + qk_rope_head_dim = {qk} wide; leave it out"
        )));
    }
    for key in ["mla_scale_q_lora", "mla_scale_kv_lora"] {
        if !j.flag_or(key, true)? {
            return Err(j.field(format!(
                "{key} false: transformers' LongCat-Flash always scales its latent attention's bottlenecks; set it to true (or leave it out)"
            )));
        }
    }
    let hidden = hidden as f64;
    Ok((
        (hidden / q_rank as f64).sqrt(),
        (hidden / kv_rank as f64).sqrt(),
    ))
}

impl Mla {
    /// Its sizes as DeepSeek-V3's and LongCat-Flash's configs name them,
    /// `head_dim` the turned width (the width their classes turn).
    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "q_lora_rank": self.q_rank,
            "kv_lora_rank": self.kv_rank,
            "qk_nope_head_dim": self.nope,
            "qk_rope_head_dim": self.rope,
            "head_dim": self.rope,
            "v_head_dim": self.v,
        })
    }

    /// The attention scores' scale: the query-key head width's inverse
    /// square root, times the squared mscale of `mscale_all_dim` when the
    /// rotary embeddings are scaled (`DeepseekV3Attention`'s).
    pub(crate) fn scores_scale(&self, head_dim: i64, scaling: &RopeScaling) -> f64 {
        let base = (head_dim as f64).powf(-0.5);
        match scaling.factor() {
            Some(f) if self.mscale_all_dim != 0.0 && f > 1.0 => {
                let m = 0.1 * self.mscale_all_dim * f.ln() + 1.0;
                base * m * m
            }
            _ => base,
        }
    }
}

/// SmolLM3's and Llama 4's `no_rope_layers` (1: the layer turns, 0: it
/// does not; a longer list's first, as their classes read it), or every
/// `no_rope_layer_interval`-th layer (4 unless it says) without: where
/// it is left out or null, and for Llama 4 where it is empty
/// (`Llama4TextConfig` takes `[]` for the default, a case it names, as
/// Llama 4's published configs give it; SmolLM3's class would fail on
/// its first layer).
fn rope_layers(j: &HfJson, family: Family) -> Result<Vec<bool>, HfError> {
    let layers = j.size("num_hidden_layers")?;
    let given = j.get("no_rope_layers").filter(|v| match v {
        serde_json::Value::Null => false,
        serde_json::Value::Array(l) => !l.is_empty() || family != Family::Llama4,
        _ => true,
    });
    let Some(v) = given else {
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
        Some(mut l) if l.len() as i64 >= layers => {
            l.truncate(layers.max(0) as usize);
            Ok(l)
        }
        _ => Err(j.field(format!(
            "no_rope_layers {v}: one 1 (turns) or 0 (does not) for each of the {layers} layers"
        ))),
    }
}

/// Llama 4's attention settings ([`Llama4Attention`]), with its config
/// class's defaults.
fn llama4_attention(j: &HfJson) -> Result<Llama4Attention, HfError> {
    let turns = rope_layers(j, Family::Llama4)?;
    let chunked = match j.get("layer_types") {
        None | Some(serde_json::Value::Null) => turns,
        Some(v) => (v.as_array())
            .and_then(|l| {
                (l.iter())
                    .map(|t| match t.as_str() {
                        Some("chunked_attention") => Some(true),
                        Some("full_attention") => Some(false),
                        _ => None,
                    })
                    .collect::<Option<Vec<bool>>>()
            })
            .filter(|l| l.len() == turns.len())
            .ok_or_else(|| {
                j.field(format!(
                    "layer_types {v}: \"chunked_attention\" or \"full_attention\" for each of the {} layers",
                    turns.len()
                ))
            })?,
    };
    // Its class only tests it (`if self.attn_temperature_tuning`).
    let temperature = match j.truthy_or("attn_temperature_tuning", true)? {
        true => Some((
            j.number_or("floor_scale", 8192.0)?,
            j.number_or("attn_scale", 0.1)?,
        )),
        false => None,
    };
    Ok(Llama4Attention {
        chunk: j.size_or_null("attention_chunk_size", Some(8192))?,
        chunked,
        qk_l2_norm: j.flag_or("use_qk_norm", true)?,
        temperature,
    })
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

/// GPT-Neo's layers' kinds, as [`gpt_neo::flat`] expanded them
/// (`attention_layers`): `true` for a local one.
fn local_layers(j: &HfJson) -> Result<Vec<bool>, HfError> {
    let kinds = j.get("attention_layers").and_then(|v| v.as_array());
    let local = kinds.and_then(|k| k.iter().map(|v| v.as_bool()).collect::<Option<Vec<bool>>>());
    local.ok_or_else(|| j.field("attention_types: one kind a layer".into()))
}

/// JetMoE's attention heads: `num_key_value_heads` (16 by default) for
/// each of the `num_experts_per_tok` (2) experts a token's queries come
/// from, as its config class computes them; a `num_attention_heads`
/// that says otherwise (which the class would take, and its attention
/// then fail on) is refused.
fn jetmoe_heads(j: &HfJson) -> Result<i64, HfError> {
    let kv = j
        .size_or_null("num_key_value_heads", Some(16))?
        .unwrap_or(16);
    let k = j.size_or_null("num_experts_per_tok", Some(2))?.unwrap_or(2);
    match j.size_or_none("num_attention_heads")? {
        Some(h) if h != kv * k => Err(j.field(format!(
            "num_attention_heads {h}: JetMoE's attention has num_key_value_heads {kv} x num_experts_per_tok {k} = {} heads (its class computes them); leave it out or give that",
            kv * k
        ))),
        _ => Ok(kv * k),
    }
}

/// Whether a BitNet config asks for quantization-aware training
/// ([`LlamaConfig::ternary`]): its `quantization_config`'s `quant_method`
/// `bitnet` with `linear_class` `autobitlinear` in `online` mode, the
/// only kind `transformers` trains. A config without one is a plain
/// model of full-precision linear layers, as `transformers` builds it;
/// another `quant_method` is left to the refusal every family shares.
fn ternary(j: &HfJson) -> Result<bool, HfError> {
    let Some(q) = j.get("quantization_config") else {
        return Ok(false);
    };
    if q.get("quant_method").and_then(|m| m.as_str()) != Some("bitnet") {
        return Ok(false);
    }
    let text = |key: &str, default: &'static str| match q.get(key) {
        None | Some(serde_json::Value::Null) => default.to_string(),
        Some(v) => v.as_str().map_or_else(|| v.to_string(), str::to_string),
    };
    let (class, mode) = (
        text("linear_class", "bitlinear"),
        text("quantization_mode", "offline"),
    );
    if class != "autobitlinear" {
        return Err(j.field(format!(
            "quantization_config's linear_class {class:?}: its weights are packed ternary values, which transformers loads frozen and zrt does not unpack; train from full-precision weights (BitNet's -bf16 checkpoint) with linear_class \"autobitlinear\" and quantization_mode \"online\""
        )));
    }
    if mode != "online" {
        return Err(j.field(format!(
            "quantization_config's quantization_mode {mode:?}: transformers freezes an offline AutoBitLinear (its weights already rounded, a fixed weight_scale beside them); train with quantization_mode \"online\", which rounds the full-precision weights at every step"
        )));
    }
    let kept = q.get("modules_to_not_convert").and_then(|m| m.as_array());
    if let Some(m) = kept
        .into_iter()
        .flatten()
        .find(|m| m.as_str() != Some("lm_head"))
    {
        return Err(j.field(format!(
            "quantization_config's modules_to_not_convert names {m}: zrt rounds every linear layer of the decoder layers and keeps the head (lm_head) whole, as transformers does by default; leave the list out or name lm_head alone"
        )));
    }
    Ok(true)
}

/// The epsilon of the RMS norm a ternary BitNet's linear layers put
/// before their inputs' rounding ([`LlamaConfig::ternary_norm`]): its
/// `quantization_config`'s `rms_norm_eps` (1e-6 left out) when its
/// `use_rms_norm` is true, else `None`.
fn ternary_norm(j: &HfJson) -> Result<Option<f64>, HfError> {
    let Some(q) = j.get("quantization_config") else {
        return Ok(None);
    };
    let on = match q.get("use_rms_norm") {
        None | Some(serde_json::Value::Null) => false,
        Some(v) => v.as_bool().ok_or_else(|| {
            j.field(format!(
                "quantization_config's use_rms_norm {v}: true or false"
            ))
        })?,
    };
    let eps = match q.get("rms_norm_eps") {
        None | Some(serde_json::Value::Null) => 1e-6,
        Some(v) => v.as_f64().filter(|e| *e > 0.0).ok_or_else(|| {
            j.field(format!(
                "quantization_config's rms_norm_eps {v}: a number above 0"
            ))
        })?,
    };
    Ok(on.then_some(eps))
}

/// Which layers attend to every earlier token when the model has a
/// sliding window ([`LlamaConfig::full_every`]): read from `layer_types`
/// when the config lists them, else the family's (Gemma 2: every other
/// layer; Gemma 3: every `sliding_window_pattern`-th, 6 unless it says).
fn full_every(j: &HfJson, family: Family, window: Option<i64>) -> Result<Option<i64>, HfError> {
    // dots1's `layer_types` are all full (others are refused); Llama
    // 4's name its chunked layers ([`Llama4Attention::chunked`]), Granite
    // 4.0's its Mamba layers ([`MambaConfig::layers`]), LFM2's its
    // convolution layers ([`ShortConvConfig::layers`]), ModernBERT-
    // decoder's its windowed layers ([`LlamaConfig::local_layers`]).
    if matches!(
        family,
        Family::Dots1
            | Family::Llama4
            | Family::GraniteMoeHybrid
            | Family::Lfm2
            | Family::MiniMax
            | Family::Qwen3Next
            | Family::ModernBertDecoder
    ) {
        return Ok(None);
    }
    let default = match family {
        Family::Gemma2 | Family::VaultGemma | Family::GptOss => Some(2),
        Family::Olmo3 => Some(4),
        Family::Gemma3 => Some(j.size_or_none("sliding_window_pattern")?.unwrap_or(6)),
        Family::Cohere2 => Some(j.size_or_none("sliding_window_pattern")?.unwrap_or(4)),
        // EXAONE 4's configs may spell the pattern ("LLLG") beside the
        // list, which then says.
        Family::Exaone4 if j.has("layer_types") => Some(4),
        Family::Exaone4 => Some(j.size_or_none("sliding_window_pattern")?.unwrap_or(4)),
        _ => None,
    };
    let Some(v) = j.get("layer_types") else {
        // Without a window every layer is global (as `to_hf_json` writes
        // it back).
        return Ok(default.map(|n| if window.is_some() { n } else { 1 }));
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
