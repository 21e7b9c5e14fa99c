//! Llama as Hugging Face's `transformers` lays it out
//! (`LlamaForCausalLM`, and Mistral's, Ministral's, Qwen2's, Qwen3's, Gemma 1-3's,
//! Phi-3's, Granite's, OLMo 2's and 3's, SmolLM3's, StarCoder2's, StableLM's,
//! Cohere's and Cohere 2's, GLM's and GLM-4's, and the mixtures of
//! experts Mixtral's, OLMoE's, Qwen2-MoE's, Qwen3-MoE's and DeepSeek-V3's (its
//! latent attention too), the same layers with variations:
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
//! dimensions turned (Cohere 2's in its windowed layers only). Llama's logits match `transformers`' to the bit here, every
//! family's three AdamW steps its losses (`tests/from_hf.rs`).
//!
//! The token embedding's gradient is sparse (`embedding(.., sparse =
//! true)`: the rows looked up), which zrt's engine adds straight into its
//! flat gradient buffer, never a dense vocabulary-sized matrix of its own;
//! tch's `nn::Optimizer` takes dense gradients only, so train the model
//! with the engine (any stage, one rank too).

pub(crate) mod activations;
pub(crate) mod balance;
pub(crate) mod bare;
mod bloom;
mod config;
mod ctrl;
mod dbrx;
mod delta_net;
mod differential;
mod doge;
mod eager_attention;
mod falcon;
mod family;
mod glu;
mod gpt_bigcode;
mod gpt_neo;
mod gptj;
mod jetmoe;
mod layer;
mod lightning;
mod mamba;
mod mamba1;
mod modernbert_decoder;
mod mpt;
mod norm;
mod openai_gpt;
mod opt;
mod own_names;
mod rg_lru;
mod rope_scaling;
mod rotary;
mod rwkv;
mod short_conv;
mod sparse_mixer;
#[cfg(test)]
pub(crate) mod tests;
mod xglm;
mod xielu;
mod xlstm;
mod z_loss;
mod zamba;

pub use activations::{adapter_params, held_for_backward, COUNTED_FAMILIES};
pub(crate) use config::{pad_token, rotary_dim};
pub use config::{
    Activation, FalconH1Multipliers, GroupRouting, Llama4Attention, LlamaConfig, Mla, MoeConfig,
    Scoring,
};
pub use delta_net::DeltaNetConfig;
pub use falcon::FalconLayout;
pub use family::Family;
pub use layer::Layer;
pub use lightning::{LightningConfig, ResidualFactors};
pub use mamba::{MambaConfig, MambaGate};
pub use mamba1::{Mamba1Config, StepNorms};
pub use opt::OptLayout;
pub use rg_lru::RgLruConfig;
pub use xlstm::XlstmConfig;
pub use zamba::{ZambaConfig, ZambaVersion};
// BitNet's ternary linear layers' input norm (`lora::Adapted`).
pub(crate) use norm::rms_normalized;
pub(crate) use rope_scaling::rope_scaling;
pub use rope_scaling::RopeScaling;
pub(crate) use rotary::{rope_at, rope_from, Rotary};
pub use short_conv::{MlpWidth, ShortConvConfig};

use std::sync::Arc;

use tch::nn::{self, Module};
use tch::Tensor;

use crate::blocks::{Ends, LossFusing, Run, Training};
use crate::kv_cache::Decoding;
use crate::lora::{Adapted, LoraConfig};
use crate::packing::Documents;
use crate::zero::glue::LogitsAfter;
use crate::zero::{EngineError, ExportLayout, ShardPlan, ShardedModule};

use norm::Norm;

/// The [`Llama`] VarStore name of a tensor of a Hugging Face Llama
/// checkpoint (its own), or `None` for what the model does not hold:
/// older checkpoints' rotary buffers (`rotary_emb.inv_freq`) and, when
/// the head is tied, a written-out `lm_head.weight`.
pub fn hf_name(name: &str, tied: bool) -> Option<String> {
    let skipped = name.ends_with("rotary_emb.inv_freq") || (tied && name == "lm_head.weight");
    (!skipped).then(|| name.to_string())
}

/// Sets `plan`'s rename rule for a Hugging Face Llama checkpoint
/// ([`hf_name`]; a file written from the base model, its names without
/// the family's `model.`, `transformer.` or `biogpt.`, gets it, as
/// `from_pretrained` gives it; a tied head written out, `lm_head` or
/// BioGPT's `output_projection`, is skipped), and for a mixture of experts declares the experts'
/// parameters [`ShardPlan::partly_unused_on_some_ranks`]. Call it on
/// every rank before the engine is built.
pub fn hf_weight_rules(plan: &ShardPlan, cfg: &LlamaConfig) -> Result<(), EngineError> {
    let (tied, layers) = (cfg.tied, cfg.layers);
    // DeepSeek-V3's and GLM-4-MoE's files hold their multi-token-
    // prediction layers after the last (`model.layers.61` of 61,
    // GLM-4.5-Air's `model.layers.46`), which `transformers` skips too.
    let beyond = cfg.family.prediction_layers();
    // ERNIE 4.5's, Qwen3-Next's and LongCat-Flash's hold theirs under
    // `mtp` names, which `transformers` skips by that pattern.
    let mtp = matches!(
        cfg.family,
        Family::Ernie4_5Moe | Family::Qwen3Next | Family::LongcatFlash
    );
    // A multimodal checkpoint (Llama 4's published files, Gemma 3's
    // from 4B up, Mistral Small 3's, Qwen-VL's, LLaVA's: the wrappers
    // `crate::hf::MULTIMODAL` reads) holds the language model under a
    // prefix of its own (`LANGUAGE_MODEL`, or as the text model's,
    // Qwen-VL's), a vision or audio encoder and projector beside it
    // (`TOWERS`), which the text model leaves out.
    let multimodal = cfg.language_model_of.is_some();
    // A file written from the base model (`OPTModel.save_pretrained`;
    // Meta's OPT files and BigScience's BLOOM files are named so) names
    // its tensors without the base model's prefix (`model`,
    // `transformer`), which `from_pretrained` adds.
    let [root, ..] = cfg.family.names();
    let base = root.split('.').next().unwrap_or(root);
    // BioGPT's head is `output_projection`; a tied one written out is
    // skipped as a tied `lm_head` is.
    let head = format!("{}.", cfg.family.head_name());
    let tied_head = format!("{head}weight");
    // ModernBERT-decoder's prediction head (`lm_head.dense`,
    // `lm_head.norm`) is outside its base model too.
    let beside = (cfg.family == Family::ModernBertDecoder).then(|| format!("{HEAD_TRANSFORM}."));
    let outside: Vec<String> = std::iter::once(head.clone()).chain(beside).collect();
    // Zamba's shared blocks under any user's names, one copy read, its
    // hybrid layers' Mamba layers under `mamba_decoder`
    // (`zamba::model_name`).
    let zamba = cfg.zamba.clone();
    if let Some(z) = zamba.clone() {
        plan.weight_copies(move |n| zamba::is_shared(n, &z))?;
    }
    plan.rename_weights(move |n| {
        let shared;
        let n = match &zamba {
            Some(z) => {
                shared = zamba::model_name(n, z)?;
                shared.as_str()
            }
            None => n,
        };
        let nested;
        let n = match multimodal {
            true if TOWERS.iter().any(|v| n.starts_with(v)) => return None,
            // The text model's base model (whose own prefix is
            // `transformer` for some) under [`LANGUAGE_MODEL`]'s names;
            // `language_model.lm_head`.
            true => match (LANGUAGE_MODEL.iter()).find_map(|p| n.strip_prefix(p)) {
                Some(rest) => {
                    nested = format!("{base}.{rest}");
                    nested.as_str()
                }
                None => n.strip_prefix("language_model.").unwrap_or(n),
            },
            false => n,
        };
        let n = crate::hf::under_base(n, base, &outside);
        match layer_of(&n) {
            Some(l) if beyond && l >= layers => None,
            _ if mtp && n.contains("mtp") => None,
            _ if tied && n == tied_head => None,
            _ => hf_name(&n, tied),
        }
    })?;
    // OpenAI GPT's Conv1D matrices are `[in, out]` in its files.
    if cfg.family.conv1d() {
        plan.transpose_weights(crate::gpt2::is_conv1d_weight)?;
    }
    // An expert no token of a rank chose gets no gradient there.
    if cfg.moe.is_some() {
        plan.partly_unused_on_some_ranks(|name, _| name.contains(".experts."))?;
    }
    Ok(())
}

/// Where a multimodal checkpoint holds its language model's base model:
/// `language_model.model.layers...` (the files `transformers` 4.57
/// writes), `model.language_model.layers...` (later ones),
/// `model.text_model.layers...` (Idefics3's and SmolVLM's).
const LANGUAGE_MODEL: [&str; 3] = [
    "model.language_model.",
    "language_model.model.",
    "model.text_model.",
];

/// The prefixes of a multimodal checkpoint's tensors that are not its
/// language model's: Llama 4's vision encoder, the towers of Gemma 3
/// (SigLIP), Mistral 3 (Pixtral), LLaVA and the others, their
/// projectors (Idefics3's `connector`), Qwen-VL's (`visual`, its merger
/// within), LLaVA-NeXT's `image_newline`, Video-LLaVA's image and video
/// towers, Janus's image generation parts, DeepSeek-VL's `aligner` (and
/// its hybrid's high-resolution tower),
/// Ovis2's visual embeddings, Fuyu's patch projection, and the audio encoders of Qwen2-Audio and
/// Voxtral (`audio_tower`) and Granite Speech (`encoder`, `projector`),
/// under either layout's names.
const TOWERS: &[&str] = &[
    "vision_model.",
    "vision_tower.",
    "multi_modal_projector.",
    "visual.",
    "image_newline",
    "image_tower.",
    "video_tower.",
    "audio_tower.",
    "encoder.",
    "projector.",
    "model.visual.",
    "model.vision_model.",
    "model.vision_tower.",
    "model.image_tower.",
    "model.video_tower.",
    "model.multi_modal_projector.",
    "model.connector.",
    "model.image_newline",
    "model.aligner.",
    "model.generation_aligner.",
    "model.generation_embeddings.",
    "model.generation_head.",
    "model.vqmodel.",
    "model.visual_embeddings_table.",
    "vision_embed_tokens.",
    "model.vision_embed_tokens.",
    "model.high_res_vision_",
];

/// The decoder layer a tensor named `model.layers.N. ...` belongs to.
fn layer_of(name: &str) -> Option<i64> {
    let rest = name.strip_prefix("model.layers.")?;
    rest.split('.').next()?.parse().ok()
}

/// Hugging Face's layout for an export of a [`Llama`]
/// ([`Engine::save_16bit_model_as`](crate::zero::Engine::save_16bit_model_as)):
/// its own names (OpenAI GPT's Conv1D matrices transposed back to
/// `[in, out]`), and `cfg`'s `config.json` beside them, so that
/// `LlamaForCausalLM.from_pretrained(dir)` loads it.
pub fn hf_export_layout(cfg: &LlamaConfig) -> ExportLayout {
    tensor_layout(cfg).with_file("config.json", cfg.to_hf_json())
}

/// How `cfg`'s VarStore names become its checkpoint's where they differ
/// (Zamba's and Zamba2's: `zamba::file_name`, and a shared block's under
/// each later user too, `zamba::file_names`), for an adapter's export.
pub(crate) fn file_names(cfg: &LlamaConfig) -> Option<crate::lora::FileNames> {
    let z = cfg.zamba.clone()?;
    Some(Box::new(move |n: &str| zamba::file_names(n, &z)))
}

/// The model's name of a tensor or module of the checkpoint whose
/// config is `j`, where a model holds one module under several names
/// (Zamba's shared blocks, under each hybrid layer using them:
/// `zamba::model_name`); `None` for a model whose names are its own.
pub(crate) fn model_names(
    j: &crate::hf::HfJson,
) -> Result<Option<crate::lora::ModelNames>, crate::hf::HfError> {
    let family = j.model_type().as_deref().and_then(Family::of);
    if !matches!(family, Some(Family::Zamba | Family::Zamba2)) {
        return Ok(None);
    }
    let Some(z) = LlamaConfig::from_json(j)?.zamba else {
        return Ok(None);
    };
    Ok(Some(Box::new(move |n: &str| {
        zamba::model_name(n, &z).unwrap_or_else(|| n.to_string())
    })))
}

/// [`hf_export_layout`]'s transposes (and Zamba's names), no files.
pub(crate) fn tensor_layout(cfg: &LlamaConfig) -> ExportLayout {
    match (cfg.family.conv1d(), &cfg.zamba) {
        (true, _) => ExportLayout::new().transpose(crate::gpt2::is_conv1d_weight),
        (false, Some(z)) => {
            let z = z.clone();
            ExportLayout::new().rename(move |n| zamba::file_name(n, &z))
        }
        (false, None) => ExportLayout::new(),
    }
}

/// ModernBERT-decoder's prediction head's name (`lm_head`: its
/// vocabulary's matrix is `decoder`).
const HEAD_TRANSFORM: &str = "lm_head";

/// ModernBERT-decoder's prediction head: `norm(act(dense(x)))`, the
/// MLP's activation.
#[derive(Debug)]
struct HeadTransform {
    dense: Adapted,
    norm: Norm,
}

/// Llama with a language-modelling head (`LlamaForCausalLM`).
#[derive(Debug)]
pub struct Llama {
    ends: Ends,
    /// GPT-BigCode's and OPT's learned position embeddings (`wpe`,
    /// `embed_positions`), in the root.
    wpe: Option<nn::Embedding>,
    /// BLOOM's LayerNorm of the embeddings (`word_embeddings_layernorm`),
    /// in the root.
    embedding_norm: Option<Norm>,
    /// OPT-350m's projections of its narrower embeddings into the
    /// layers' width and back (`project_in`, `project_out`), in the root.
    projections: Option<[Adapted; 2]>,
    layers: Vec<ShardedModule<Run<Layer>>>,
    /// The final norm (`None` for OPT-350m's post-norm layers).
    norm: Option<Norm>,
    /// CTRL's head's bias beside its tied matrix (`lm_head.bias`), in
    /// the root (an untied head holds its own).
    tied_head_bias: Option<Tensor>,
    /// ModernBERT-decoder's prediction head before the vocabulary's
    /// matrix, in the root.
    head_transform: Option<HeadTransform>,
    training: Training,
    decoding: Arc<Decoding>,
    /// Whether its losses fuse the head with the cross-entropy
    /// ([`Llama::set_fused_loss`]; on when built).
    fusing: LossFusing,
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
        let [model, embedding, blocks, final_norm] = cfg.family.names();
        // OPT's `model.decoder`: a path a name at a time.
        let m = model.split('.').fold(p.clone(), |m, name| &m / name);
        // The root's variables before the first unit: a plan releasing
        // the model as it is built (`weights_from_file`) releases what
        // was made before each `ShardedModule::new`, and would leave a
        // root made after the last one held until the engine is built.
        // RWKV's `ln_out` keeps nn.LayerNorm's epsilon whatever
        // `layer_norm_epsilon` says (the blocks' norms read it).
        let rwkv = LlamaConfig {
            eps: 1e-5,
            ..cfg.clone()
        };
        // xLSTM's `out_norm` has no bias whatever `use_bias` says.
        let xlstm = LlamaConfig {
            xlstm: None,
            ..cfg.clone()
        };
        let final_cfg = match cfg.family {
            Family::Rwkv => &rwkv,
            Family::Xlstm => &xlstm,
            _ => cfg,
        };
        let norm = cfg
            .final_norm()
            .then(|| Norm::new(&m / final_norm, cfg.hidden, final_cfg));
        let tied_head_bias = (cfg.tied && cfg.head_bias)
            .then(|| (p / cfg.family.head_name()).zeros("bias", &[cfg.vocab]));
        let embedding_norm = match cfg.family {
            Family::Bloom => Some(Norm::new(&m / "word_embeddings_layernorm", cfg.hidden, cfg)),
            Family::ModernBertDecoder => {
                Some(Norm::new(&m / "embeddings" / "norm", cfg.hidden, cfg))
            }
            _ => None,
        };
        let wpe = cfg.family.learned_positions().then(|| {
            let name = match cfg.family {
                f if f.fairseq() => "embed_positions",
                Family::OpenAiGpt => "positions_embed",
                _ => "wpe",
            };
            let rows = cfg.positions + cfg.family.position_offset();
            nn::embedding(&m / name, rows, cfg.hidden, Default::default())
        });
        let training = Training::default();
        let head_transform = (cfg.family == Family::ModernBertDecoder).then(|| {
            let h = p / HEAD_TRANSFORM;
            let d = cfg.hidden;
            HeadTransform {
                dense: Adapted::new(&(&h / "dense"), (d, d, false), lora, &training),
                norm: Norm::new(&h / "norm", d, cfg),
            }
        });
        let width = cfg.embedding_width();
        let projections = cfg.projected().then(|| {
            let lin = |name: &str, i, o| Adapted::new(&(&m / name), (i, o, false), lora, &training);
            [
                lin("project_in", width, cfg.hidden),
                lin("project_out", cfg.hidden, width),
            ]
        });
        // Zamba's shared blocks, in the root, which stays gathered at
        // stage 3 while every hybrid layer's unit reads them.
        // Their linear layers and the hybrid layers' `linear` adapted as
        // PEFT adapts them: a shared block's once, under its first user's
        // name.
        let shared: Vec<zamba::Shared> = (cfg.zamba.as_ref()).map_or_else(Vec::new, |z| {
            let lin = zamba::linear_layers(z, lora, &training);
            (0..z.used_blocks())
                .map(|k| zamba::Shared::new(&(&m / z.block_name() / k), k, (cfg, z), &lin))
                .collect()
        });
        // ModernBERT-decoder's `embeddings.tok_embeddings`.
        let e = embedding.split('.').fold(m.clone(), |e, name| &e / name);
        let embed = Ends::embedding(
            plan,
            &e,
            (cfg.vocab, width),
            (cfg.padding_row(), cfg.tied),
            lora,
        );
        let decoding = Decoding::new();
        let layers = (0..cfg.layers)
            .map(|i| {
                let lp = &m / blocks / i;
                let layer = Layer::new(&lp, i, cfg, (&training, &decoding), lora);
                let hybrid = (cfg.zamba.as_ref()).and_then(|z| z.ordinal(i).map(|j| (z, j)));
                let layer = match hybrid {
                    Some((z, j)) => {
                        let block = shared[(j % z.blocks) as usize].share();
                        let lin = zamba::linear_layers(z, lora, &training);
                        let hybrid = zamba::Hybrid::new(&lp, (j, block), (cfg, &lin), &decoding);
                        layer.with_hybrid(hybrid)
                    }
                    None => layer,
                };
                let run = Run::with_state(layer, checkpointed, (&training, &decoding));
                ShardedModule::new(plan, &lp, run)
            })
            .collect();
        // GPT-J's head has a bias, PhiMoE's may.
        let bias = cfg.head_bias;
        let head = p / cfg.family.head_name();
        let ends = embed.with_head(plan, &head, bias, (lora, &training));
        Self {
            ends,
            wpe,
            embedding_norm,
            projections,
            layers,
            norm,
            tied_head_bias,
            head_transform,
            training,
            decoding,
            fusing: LossFusing::default(),
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
        let x = self.hidden_in(tokens, documents);
        let logits = self.ends.head(&x);
        let logits = self
            .logits_after()
            .apply(logits, self.tied_head_bias.as_ref());
        z_loss::record(&self.decoding, &logits, self.cfg.z_loss);
        logits
    }

    /// What the model does to its head's product before the loss: CTRL's
    /// tied head's bias, Granite's `logits_scaling`, Cohere's
    /// `logit_scale`, Gemma 2's soft cap, in the order its class applies
    /// them.
    fn logits_after(&self) -> LogitsAfter {
        LogitsAfter {
            bias_after: self.tied_head_bias.is_some(),
            divide: self.cfg.logits_scaling,
            multiply: self.cfg.logit_scale,
            softcap: self.cfg.final_softcap,
        }
    }

    /// Turns the fusing of the head with the loss on or off (on when
    /// built; [`crate::hf::HfModel::set_fused_loss`]).
    pub fn set_fused_loss(&self, on: bool) {
        self.fusing.set(on);
    }

    /// The causal-LM loss of `tokens`' predictions whose targets
    /// `counted` (`[batch, seq]`, nonzero, by the token predicted:
    /// [`crate::hf::counted_targets`]) marks, the tokens packed in
    /// `documents` when given: their mean (`mean`; 0 when none counts)
    /// or sum, in fp32, with the head and the cross-entropy fused
    /// ([`crate::zero::glue::linear_cross_entropy`]): no `[tokens,
    /// vocab]` logits are held, in forward or backward. `None`, before
    /// anything runs, when it cannot fuse them: turned off
    /// ([`Llama::set_fused_loss`]), a z-loss (which reads the logits), a
    /// LoRA adapter or trainable tokens on the head, a target outside the
    /// vocabulary. The auxiliary losses are the caller's to add
    /// ([`Llama::plus_aux_losses`]).
    pub(crate) fn fused_loss(
        &self,
        tokens: &Tensor,
        documents: Option<Documents>,
        (counted, mean): (&Tensor, bool),
    ) -> Option<Tensor> {
        if self.cfg.z_loss > 0.0 {
            return None;
        }
        let after = (self.tied_head_bias.as_ref(), self.logits_after());
        let hidden = || self.hidden_in(tokens, documents);
        (self.fusing).head_loss(&self.ends, (tokens, (counted, mean)), after, hidden)
    }

    /// The hidden states the head reads for `tokens`, packed in
    /// `documents` when given: everything of [`Self::forward_in`] but
    /// the head and what follows it.
    fn hidden_in(&self, tokens: &Tensor, documents: Option<Documents>) -> Tensor {
        self.decoding.set_documents(documents);
        let balance = (self.cfg.moe.as_ref()).and_then(|m| m.balance.map(|c| (c, m.experts)));
        balance::start(&self.decoding, balance, self.decoding.generating());
        // NEFTune's noise joins the embedding module's output: Gemma 3's,
        // BioGPT's and XGLM's scale the rows inside it, the others' models
        // outside.
        let inside = matches!(
            self.cfg.family,
            Family::Gemma3 | Family::BioGpt | Family::Xglm
        );
        let embedded = self.ends.embed(tokens);
        let embedded = match inside {
            true => embedded,
            false => self.training.embedding_noise(embedded),
        };
        let recurrent_gemma = self.cfg.family == Family::RecurrentGemma;
        let scaled = self.cfg.family.gemma() || recurrent_gemma;
        let mut x = match (scaled, self.cfg.embedding_multiplier) {
            (false, 1.0) => embedded,
            (false, m) => embedded * m,
            (true, _) => {
                // The width's square root in the embeddings' dtype, as
                // `transformers` rounds it (to 55.5 for 3072 in bf16);
                // RecurrentGemma's rounded to bf16 whatever the dtype (its
                // class keeps it so: 50.5 for 2560, not 50.596).
                let root = Tensor::from((self.cfg.hidden as f64).sqrt() as f32);
                let root = match recurrent_gemma {
                    true => root.to_kind(tch::Kind::BFloat16),
                    false => root,
                };
                let root = root.to_kind(embedded.kind()).to_device(embedded.device());
                embedded * root
            }
        };
        if inside {
            x = self.training.embedding_noise(x);
        }
        if let Some([project_in, _]) = &self.projections {
            x = project_in.forward(&x);
        }
        // GPT-BigCode's learned positions: each token's in its document
        // when packed, after the tokens a cache holds when generating.
        if let Some(wpe) = &self.wpe {
            let pos = self.decoding.positions(tokens);
            let pos = match self.cfg.family.position_offset() {
                0 => pos,
                offset => pos + offset,
            };
            // Not in place: the embedding's output may be saved for backward.
            let placed = &x + wpe.forward(&pos);
            x = placed;
        }
        // XGLM's sinusoidal positions, as the learned ones are placed.
        if self.cfg.family.sinusoidal_positions() {
            let pos = self.decoding.positions(tokens);
            let table = match self.cfg.family {
                Family::Ctrl => ctrl::sinusoidal(&pos, self.cfg.hidden),
                _ => xglm::sinusoidal(&pos, self.cfg.hidden, self.cfg.pad_token),
            };
            let placed = &x + table.to_kind(x.kind());
            x = placed;
        }
        if let Some(norm) = &self.embedding_norm {
            x = norm.forward(&x);
        }
        x = self.training.dropout(x, self.cfg.embedding_dropout);
        // Zamba's layers carry the embeddings beside the hidden states
        // (its class's `original_hidden_states`).
        let zamba = self.cfg.zamba.is_some();
        if zamba {
            x = Tensor::cat(&[&x, &x], -1);
        }
        // OPT's and BioGPT's LayerDrop draws a number from the CPU's generator before
        // each layer in training, `layerdrop` 0 or not (zrt refuses any
        // other): the same draws keep its dropout masks `transformers'`.
        let layer_drop = self.cfg.family.fairseq() && self.training.on();
        for l in &self.layers {
            if layer_drop {
                let _ = Tensor::rand([], (tch::Kind::Float, tch::Device::Cpu));
            }
            x = l.forward(&x);
        }
        if zamba {
            x = x.narrow(-1, 0, self.cfg.hidden);
        }
        // The caches hold these tokens now.
        self.decoding.advance(tokens);
        if let Some(norm) = &self.norm {
            x = norm.forward(&x);
        }
        if let Some([_, project_out]) = &self.projections {
            x = project_out.forward(&x);
        }
        if let Some(h) = &self.head_transform {
            let dense = self.cfg.activation.apply(&h.dense.forward(&x));
            x = h.norm.forward(&dense);
        }
        x
    }

    /// `LlamaForCausalLM`'s loss with `labels = tokens`
    /// ([`crate::hf::causal_lm_loss`]; the head fused with it where
    /// [`Self::set_fused_loss`] can), plus the auxiliary losses its
    /// config asks for ([`Self::plus_aux_losses`]).
    pub fn loss(&self, tokens: &Tensor) -> Tensor {
        let counted = crate::hf::counted_targets(tokens, None, None);
        let lm = self.fused_loss(tokens, None, (&counted, true));
        let lm = lm.unwrap_or_else(|| crate::hf::causal_lm_loss(&self.forward(tokens), tokens));
        self.plus_aux_losses(lm)
    }

    /// `loss` plus the last forward's auxiliary losses, as `transformers`
    /// adds them given labels: the router's load-balancing loss times
    /// `router_aux_loss_coef` when the config has `output_router_logits`
    /// (`loss += router_aux_loss_coef * aux_loss`: the Switch
    /// Transformer's balance over every layer with experts,
    /// `load_balancing_loss_func`), its gradient reaching the routers when
    /// `loss` is back-propagated; Bamba's z-loss when its
    /// `z_loss_coefficient` is above 0 ([`LlamaConfig::z_loss`]). It takes
    /// that forward's terms: a second call adds nothing. `loss` itself
    /// otherwise.
    pub fn plus_aux_losses(&self, loss: Tensor) -> Tensor {
        z_loss::plus(balance::plus(loss, &self.decoding), &self.decoding)
    }

    /// The sizes it was built with.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }
}
