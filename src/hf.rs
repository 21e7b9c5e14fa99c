//! Hugging Face checkpoints: [`HfModel::from_pretrained`] builds the
//! model a `save_pretrained` directory holds (one of the layouts
//! [`crate::gpt2`], [`crate::gpt_neox`], [`crate::phi`] and [`crate::llama`] build, chosen by its
//! `config.json`) with no rank holding its weights, as `transformers`'
//! `AutoModelForCausalLM.from_pretrained` chooses the class; and what
//! those layouts share (reading a `config.json`, the loss, the errors).

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use tch::nn::VarStore;
use tch::{Kind, Tensor};

use crate::gpt2::{Gpt2, Gpt2Config};
use crate::gpt_neox::{GptNeox, GptNeoxConfig};
use crate::llama::{Family, Llama, LlamaConfig};
use crate::packing::Documents;
use crate::phi::{Phi, PhiConfig};
use crate::zero::{EngineError, ExportLayout, ShardPlan};

/// Why a Hugging Face checkpoint cannot be built: its `config.json` is
/// not a model this crate builds, or the plan refused its rules.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
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
    /// The plan refused the checkpoint's rules (it was already given
    /// another weights rule, or an engine was built from it).
    #[error(transparent)]
    Plan(#[from] EngineError),
    /// A prompt [`HfModel::greedy`] or [`HfModel::sample`] cannot
    /// continue.
    #[error("cannot continue the prompt: {0}")]
    Prompt(String),
    /// Sampling settings [`crate::generate::Sampling`] cannot sample with.
    #[error("cannot sample: {0}")]
    Sampling(String),
    /// LoRA settings no adapter can be built with, targets that match
    /// none of the model's linear layers, or an adapter that does not fit
    /// its base ([`crate::lora`]).
    #[error("LoRA: {0}")]
    Lora(String),
    /// Positions [`HfModel::forward_packed`] cannot run packed documents
    /// with ([`crate::packing`]).
    #[error("packed documents: {0}")]
    Packed(String),
    /// A training setting the model cannot take.
    #[error("{0}")]
    Setting(String),
}

/// How [`HfModel::from_pretrained_with`] builds a model.
#[derive(Debug, Clone, Default)]
pub struct HfOptions {
    /// Recompute every block's activations in backward, keeping only its
    /// input (`transformers`' `gradient_checkpointing_enable()`).
    pub checkpoint_activations: bool,
    /// LoRA adapters on the linear layers the config targets, the base
    /// frozen (PEFT's `get_peft_model(model, config)`), on any layout
    /// ([`crate::lora`]).
    pub lora: Option<crate::lora::LoraConfig>,
}

/// The files of a checkpoint's directory an export of it carries besides
/// `config.json` (written verbatim): its tokenizer's and generation
/// settings, so that the export loads in `transformers` and its
/// tokenizer as the original does. Weights and anything else stay.
pub(crate) const CARRIED: &[&str] = &[
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
];

/// The configuration of a checkpoint of a layout this crate builds.
enum Layout {
    Gpt2(Gpt2Config),
    GptNeox(Box<GptNeoxConfig>),
    Phi(Box<PhiConfig>),
    Llama(Box<LlamaConfig>),
}

impl Layout {
    /// The token embedding and the head, by their checkpoint names, when
    /// the head is the embedding (for `modules_to_save`).
    fn tied_head(&self) -> Option<crate::lora::TiedHead<'static>> {
        let (embedding, head) = match self {
            Self::Gpt2(_) => ("transformer.wte", "lm_head"),
            Self::GptNeox(c) if c.tied => ("gpt_neox.embed_in", "embed_out"),
            Self::Llama(c) if c.tied => (c.family.embedding_path(), "lm_head"),
            Self::GptNeox(_) | Self::Llama(_) | Self::Phi(_) => return None,
        };
        Some(crate::lora::TiedHead { embedding, head })
    }

    /// Its vocabulary: its head's rows.
    fn vocab(&self) -> i64 {
        match self {
            Self::Gpt2(c) => c.vocab,
            Self::GptNeox(c) => c.vocab,
            Self::Phi(c) => c.vocab,
            Self::Llama(c) => c.vocab,
        }
    }

    /// Reads `config` (a `config.json` or the directory holding it),
    /// choosing the layout by its `model_type`.
    /// The config itself comes back too, for [`Layout::export`].
    fn read(config: &Path) -> Result<(Self, HfJson), HfError> {
        Self::of(HfJson::read(config, None)?)
    }

    /// The layout of the config `j` (read by [`Layout::read`]).
    fn of(j: HfJson) -> Result<(Self, HfJson), HfError> {
        let layout = match j.model_type().as_deref() {
            Some("gpt2") => Self::Gpt2(Gpt2Config::from_json(&j)?),
            Some("gpt_neox") => Self::GptNeox(Box::new(GptNeoxConfig::from_json(&j)?)),
            Some("phi") => Self::Phi(Box::new(PhiConfig::from_json(&j)?)),
            // Llama 4's published checkpoints are its multimodal model's,
            // and so are Gemma 3's from 4B up and Mistral Small 3's; Qwen-VL,
            // LLaVA and the others ([`MULTIMODAL`]) are popular ones: zrt
            // builds (and exports) their language models, from their
            // `text_config`s.
            Some(t) if MULTIMODAL.iter().any(|m| m.model_type == t) => {
                return Self::of(j.text_model()?)
            }
            Some(t) if Family::of(t).is_some() => {
                let c = LlamaConfig::from_json(&j)?;
                head_as_wrapped(&c, &j)?;
                Self::Llama(Box::new(c))
            }
            _ => {
                let (given, known) = (j.model_type_named(), Family::model_types());
                let why = (j.model_type().as_deref())
                    .and_then(|t| NOT_BUILT.iter().find(|(n, _)| *n == t))
                    .map_or(String::new(), |(_, why)| format!(" (not this one: {why})"));
                let msg =
                    format!("{given}: zrt builds \"gpt2\", \"gpt_neox\", \"phi\" and {known}{why}");
                return Err(j.field(msg));
            }
        };
        Ok((layout, j))
    }

    /// The layout its export goes back in: the tensors as the checkpoint
    /// names and lays them out, its `config.json` verbatim (every field
    /// `transformers` and generation read: token ids, rope details, ...)
    /// but for its dtype, which says the export's ([`config_in`]), and
    /// the [`CARRIED`] files beside it.
    fn export(&self, source: &HfJson) -> Result<ExportLayout, HfError> {
        let tensors = match self {
            Self::Gpt2(_) => crate::gpt2::tensor_layout(),
            Self::Llama(c) => crate::llama::tensor_layout(c),
            Self::GptNeox(_) | Self::Phi(_) => ExportLayout::new(),
        };
        let text = source.text.clone();
        let mut layout =
            tensors.with_file_for_dtype("config.json", move |dtype| config_in(&text, dtype));
        let dir = source.path.parent().unwrap_or(Path::new(""));
        for name in CARRIED {
            let path = dir.join(name);
            if path.is_file() {
                let bytes = std::fs::read(&path).map_err(|e| HfError::Read {
                    path: path.clone(),
                    msg: format!("cannot read it for the export: {e}"),
                })?;
                layout = layout.with_file(*name, bytes);
            }
        }
        Ok(layout)
    }
}

/// The config `text` (a `config.json`) of an export whose tensors are
/// `dtype` (PyTorch's name): verbatim when its `dtype` (and the older
/// `torch_dtype`) already say so or are absent, else with them saying
/// `dtype`, every other field as it was (keys sorted, as
/// `save_pretrained` writes them). `transformers` loads a model in its
/// config's dtype (`dtype="auto"`): a bf16 checkpoint fine-tuned in fp32
/// and exported in fp32 would load rounded to bf16 again, and one
/// exported in bf16 from an fp32 original would load in fp32.
fn config_in(text: &str, dtype: &str) -> Vec<u8> {
    let quoted = non_finite_quoted(text);
    let Ok(serde_json::Value::Object(mut json)) = serde_json::from_str(&quoted) else {
        return text.as_bytes().to_vec();
    };
    let mut changed = false;
    for key in ["dtype", "torch_dtype"] {
        if let Some(v) = json.get_mut(key).filter(|v| v.is_string()) {
            changed |= v.as_str() != Some(dtype);
            *v = dtype.into();
        }
    }
    let written = match changed {
        false => return text.as_bytes().to_vec(),
        true => format!("{:#}\n", serde_json::Value::Object(json)),
    };
    // The non-finite numbers back as Python wrote them.
    match quoted {
        std::borrow::Cow::Borrowed(_) => written.into_bytes(),
        std::borrow::Cow::Owned(_) => ["-Infinity", "Infinity", "NaN"]
            .iter()
            .fold(written, |w, word| w.replace(&format!("\"{word}\""), word))
            .into_bytes(),
    }
}

/// The layout an export of the model `config` describes goes back in
/// (`config` a `config.json` or the directory holding it): GPT-2's
/// names and Conv1D matrices, GPT-NeoX's, Phi's or the Llama family's, with the config
/// verbatim beside the tensors and the tokenizer's and generation files
/// found beside it. What `zrt ckpt consolidate --hf-config` writes a
/// checkpoint in.
pub fn export_layout(config: impl AsRef<Path>) -> Result<ExportLayout, HfError> {
    let (layout, source) = Layout::read(config.as_ref())?;
    layout.export(&source)
}

/// The parameters of each unit the model of `config` (a `config.json`
/// or the directory holding it) is built in, by name, the root's last
/// under `""` ([`Gpt2Config::unit_params`], [`GptNeoxConfig::unit_params`],
/// [`PhiConfig::unit_params`],
/// [`LlamaConfig::unit_params`]):
/// what `zrt estimate --hf-config` sizes a run by, nothing built. A
/// quantized checkpoint's config (GPT-OSS's MXFP4) counts as its
/// dequantized model, the one zrt trains (a BitNet's online
/// `autobitlinear` as it trains, its linear layers' norms too). The
/// buffers a unit holds as frozen variables (DeepSeek-V3's routers'
/// corrections, xIELU's constants) count with it; MiniMax's decays do
/// not ([`frozen_buffers`]). With those, the total is what
/// `transformers` writes of the model (each tied tensor once): a test
/// holds every `from_hf` case to it.
pub fn unit_params(config: impl AsRef<Path>) -> Result<Vec<(String, u64)>, HfError> {
    Ok(match counted_layout(config.as_ref())? {
        Layout::Gpt2(c) => c.unit_params(),
        Layout::GptNeox(c) => c.unit_params(),
        Layout::Phi(c) => c.unit_params(),
        Layout::Llama(c) => c.unit_params(),
    })
}

/// The bytes a training forward of `rows` rows of `seq` tokens of the
/// model `config` describes holds for its backward, once the loss is
/// computed, in the compute dtype `kind`, each layer recomputed in
/// backward or not and the head fused with the loss or not (`keeping`;
/// [`HfModel::set_fused_loss`]), the whole model training or `lora`'s
/// adapters ([`crate::llama::held_for_backward`],
/// [`crate::gpt2::held_for_backward`],
/// [`crate::gpt_neox::held_for_backward`], [`crate::phi::held_for_backward`]:
/// what `zrt estimate --seq` prints); `None` for the models whose saved tensors it does not
/// count.
pub fn held_for_backward(
    config: impl AsRef<Path>,
    rows_seq: (u64, u64),
    kind: tch::Kind,
    keeping: (bool, bool),
    lora: Option<&crate::lora::LoraConfig>,
) -> Result<Option<u64>, HfError> {
    Ok(match counted_layout(config.as_ref())? {
        Layout::Llama(c) => crate::llama::held_for_backward(&c, rows_seq, kind, keeping, lora),
        Layout::GptNeox(c) => crate::gpt_neox::held_for_backward(&c, rows_seq, kind, keeping, lora),
        Layout::Phi(c) => crate::phi::held_for_backward(&c, rows_seq, kind, keeping, lora),
        Layout::Gpt2(c) => crate::gpt2::held_for_backward(&c, rows_seq, kind, keeping, lora),
    })
}

/// Whether the model `config` describes, its head fused with its loss,
/// keeps its logits' fp32 log-probabilities for backward over `tokens`
/// tokens a forward: when one block of the fused loss holds them all
/// ([`crate::zero::glue::keeps_logits`]), as [`held_for_backward`] counts.
pub fn fused_loss_keeps_logits(config: impl AsRef<Path>, tokens: u64) -> Result<bool, HfError> {
    let vocab = counted_layout(config.as_ref())?.vocab();
    Ok(crate::zero::glue::keeps_logits(tokens, vocab.max(0) as u64))
}

/// The parameters `lora`'s adapters hold on the model `config`
/// describes ([`crate::llama::adapter_params`],
/// [`crate::gpt2::adapter_params`], [`crate::gpt_neox::adapter_params`],
/// [`crate::phi::adapter_params`]);
/// `None` for the models
/// it does not count.
pub fn adapter_params(
    config: impl AsRef<Path>,
    lora: &crate::lora::LoraConfig,
) -> Result<Option<u64>, HfError> {
    Ok(match counted_layout(config.as_ref())? {
        Layout::Llama(c) => crate::llama::adapter_params(&c, lora),
        Layout::GptNeox(c) => crate::gpt_neox::adapter_params(&c, lora),
        Layout::Phi(c) => crate::phi::adapter_params(&c, lora),
        Layout::Gpt2(c) => crate::gpt2::adapter_params(&c, lora),
    })
}

/// The multimodal model (its `model_type`: `llava`, `gemma3`) whose
/// language model zrt builds from `config`, or `None` for a text model's
/// config: what `zrt estimate` says its count leaves out (the towers,
/// which zrt neither builds nor trains).
pub fn language_model_of(config: impl AsRef<Path>) -> Result<Option<&'static str>, HfError> {
    Ok(match counted_layout(config.as_ref())? {
        Layout::Llama(c) => c.language_model_of,
        _ => None,
    })
}

/// The values of the buffers the model of `config` holds as frozen
/// variables beside its parameters ([`LlamaConfig::frozen_buffers`]:
/// MiniMax's decays; 0 for the other models), which [`unit_params`] does
/// not count.
pub fn frozen_buffers(config: impl AsRef<Path>) -> Result<u64, HfError> {
    Ok(match counted_layout(config.as_ref())? {
        Layout::Llama(c) => c.frozen_buffers(),
        _ => 0,
    })
}

/// The layout of `config` as [`unit_params`] counts it: a quantized
/// checkpoint's as its dequantized model's, but a BitNet's
/// `autobitlinear` in `online` mode as it trains (its quantization
/// happens in the forward, and under `use_rms_norm` each linear layer
/// has a norm of its own, which the count would lose).
fn counted_layout(config: &Path) -> Result<Layout, HfError> {
    let mut j = HfJson::read(config, None)?;
    if let Some(all) = j.json.as_object_mut() {
        let q = all.get("quantization_config");
        let field = |k: &str| q.and_then(|q| q.get(k)).and_then(|v| v.as_str());
        let online = field("linear_class") == Some("autobitlinear")
            && field("quantization_mode") == Some("online");
        if !online {
            all.remove("quantization_config");
        }
    }
    Ok(Layout::of(j)?.0)
}

/// The tokens `transformers`' `generate` stops at for the checkpoint in
/// `dir`: `generation_config.json`'s `eos_token_id` (a token id or a
/// list, Llama 3's instruct models' two) when the file is there, else
/// `config.json`'s; none when it says none. What [`HfModel::greedy`]'s
/// `stop` takes.
pub fn eos_token_ids(dir: impl AsRef<Path>) -> Result<Vec<i64>, HfError> {
    let dir = dir.as_ref();
    let generation = dir.join("generation_config.json");
    let j = match generation.is_file() {
        true => HfJson::read(&generation, None)?,
        false => HfJson::read(dir, None)?,
    };
    let Some(v) = j.get("eos_token_id") else {
        return Ok(Vec::new());
    };
    let ids = match (v.as_i64(), v.as_array()) {
        (Some(id), _) => Some(vec![id]),
        (None, Some(list)) => list.iter().map(|x| x.as_i64()).collect(),
        _ => None,
    };
    ids.ok_or_else(|| j.field(format!("eos_token_id {v}: a token id or a list of them")))
}

/// A causal language model of one of the layouts this crate builds.
#[derive(Debug)]
pub enum HfModel {
    /// `model_type` `gpt2`.
    Gpt2(Gpt2),
    /// `model_type` `gpt_neox` (Pythia, GPT-NeoX-20B).
    GptNeox(GptNeox),
    /// `model_type` `phi` (Phi-1, Phi-1.5, Phi-2).
    Phi(Phi),
    /// The Llama family's ([`Family::ALL`]: `llama`, `mistral`, `ministral`, `qwen2`,
    /// `qwen3`, `gemma`, `gemma2`, `gemma3_text`, `phi3`, `granite`,
    /// `olmo2`, `olmo3`, `smollm3`, `mixtral`, `olmoe`, `qwen2_moe`, `qwen3_moe`, `starcoder2`,
    /// `stablelm`, `cohere`, `cohere2`, `deepseek_v3`, `glm`, `glm4`,
    /// `glm4_moe`, `gpt_oss`, `granitemoe`, `deepseek_v2`, `ernie4_5`,
    /// `ernie4_5_moe`, `seed_oss`, `exaone4`, `arcee`, `dots1`, `granitemoeshared`, `helium`, `apertus`, `hunyuan_v1_dense`, `hunyuan_v1_moe`, `vaultgemma`, `flex_olmo`, `nemotron`, `olmo`, `llama4_text`, `dbrx`, `falcon`, `gptj`, `codegen`, `gpt_bigcode`, `opt`, `gpt_neo`, `mpt`, `bloom`, `persimmon`, `biogpt`, `xglm`, `phimoe`, `granitemoehybrid`, `bamba`, `jamba`, `mamba`, `falcon_mamba`, `mamba2`, `falcon_h1`, `lfm2`, `minimax`, `qwen3_next`, `diffllama`, `bitnet`, `jetmoe`, `recurrent_gemma`, `longcat_flash`, `gpt_neox_japanese`, `aria_text`, `ctrl`, `openai-gpt`, `modernbert-decoder`, `doge`, `rwkv`, `zamba2`, `zamba`, `xlstm`), and the language
    /// models of the multimodal `llama4`, `gemma3`, `mistral3`, `qwen2_vl`,
    /// `qwen2_5_vl`, `qwen3_vl`, `ovis2` and `fuyu`, and of `llava`, `llava_next`,
    /// `llava_next_video`, `llava_onevision`, `vipllava`, `video_llava`,
    /// `internvl`, `aya_vision`, `idefics2`, `idefics3`, `smolvlm`,
    /// `lfm2-vl`, `got_ocr2`, `janus`, `deepseek_vl`, `deepseek_vl_hybrid`,
    /// `cohere2_vision`,
    /// `qwen2_audio`, `voxtral` and `granite_speech`,
    /// whichever of those their `text_config` names (the table
    /// `hf::MULTIMODAL`).
    Llama(Llama),
}

impl HfModel {
    /// Builds the model of the `save_pretrained` directory `dir` on `vs`
    /// and `plan` (its `config.json` names the layout), its weights to
    /// come from the directory's files as the engine is built
    /// ([`ShardPlan::weights_from_file`]: no rank holds the model while
    /// it is built), and the layout its export goes back in (the
    /// checkpoint's names, its `config.json` verbatim and its tokenizer's
    /// and generation files: a directory `transformers` and its tokenizer
    /// load as they load `dir`). Call it on every rank, on a fresh
    /// VarStore and plan, before the engine.
    pub fn from_pretrained(
        vs: &VarStore,
        plan: &ShardPlan,
        dir: impl AsRef<Path>,
    ) -> Result<(Self, ExportLayout), HfError> {
        Self::from_pretrained_with(vs, plan, dir, &HfOptions::default())
    }

    /// As [`HfModel::from_pretrained`], built as `options` say. With
    /// [`HfOptions::lora`] the base loads from `dir` frozen, the adapters
    /// start from world rank 0's draw and are all that trains (DoRA's
    /// magnitudes from the base's row norms, which it reads from `dir`'s
    /// files), and the layout returned is PEFT's adapter
    /// ([`crate::lora::export_layout`]: write it to
    /// `out/adapter_model.safetensors` as one file).
    pub fn from_pretrained_with(
        vs: &VarStore,
        plan: &ShardPlan,
        dir: impl AsRef<Path>,
        options: &HfOptions,
    ) -> Result<(Self, ExportLayout), HfError> {
        let dir = dir.as_ref();
        let (layout, source) = Layout::read(dir)?;
        match &layout {
            Layout::Gpt2(_) => crate::gpt2::hf_weight_rules(plan)?,
            Layout::GptNeox(c) => crate::gpt_neox::hf_weight_rules(plan, c)?,
            Layout::Phi(_) => crate::phi::hf_weight_rules(plan)?,
            Layout::Llama(c) => crate::llama::hf_weight_rules(plan, c)?,
        }
        plan.weights_from_file(vs, dir)?;
        let (root, recompute) = (vs.root(), options.checkpoint_activations);
        if let Some(lora) = &options.lora {
            lora.check("HfOptions::lora")?;
            // The base loads from its checkpoint, the adapters start from
            // world rank 0's draw; an adapter file's names are PEFT's
            // (`base_model.model.` first), for `lora::load_adapter`.
            plan.fresh_weights(|name, _| crate::lora::is_adapter(name))?;
            plan.rename_weights_before(crate::lora::base_name)?;
            // GPT-2's and OpenAI GPT's Conv1D matrices are `[in, out]`
            // in the file (PEFT's `fan_in_fan_out`), GPT-2's names under
            // `transformer.`.
            let gpt2 = matches!(layout, Layout::Gpt2(_));
            let conv1d = gpt2 || matches!(&layout, Layout::Llama(c) if c.family.conv1d());
            let lora = &crate::lora::LoraConfig {
                fan_in_fan_out: conv1d || lora.fan_in_fan_out,
                ..lora.clone()
            };
            let model = match &layout {
                Layout::Llama(c) => Self::Llama(Llama::with_lora(&root, plan, c, lora, recompute)),
                Layout::GptNeox(c) => {
                    Self::GptNeox(GptNeox::with_lora(&root, plan, c, lora, recompute))
                }
                Layout::Phi(c) => Self::Phi(Phi::with_lora(&root, plan, c, lora, recompute)),
                Layout::Gpt2(c) => Self::Gpt2(Gpt2::with_lora(&root, plan, c, lora, recompute)),
            };
            let prefix = if gpt2 { "transformer." } else { "" };
            let tied = layout.tied_head();
            // The linear layers built bare, where PEFT's adapter would
            // not work: refused by name (before the freeze, whose error
            // for targets that match nothing would not say why), written
            // excluded where the targets reach them (`all-linear`), so
            // that PEFT builds from the file what zrt trained.
            let mut exclude_modules = lora.exclude_modules.clone();
            if let Layout::Llama(c) = &layout {
                exclude_modules.extend(crate::llama::bare::check(c, lora)?);
            }
            crate::lora::refuse_convolutions(vs, lora, prefix)?;
            let bare = |m: &str| match &layout {
                Layout::Llama(c) => crate::llama::bare::is_bare(c.family, m),
                _ => false,
            };
            crate::lora::freeze_base_under(vs, lora, (prefix, tied), &bare)?;
            if let Layout::Llama(c) = &layout {
                // PEFT's DoRA reads an `AutoBitLinear`'s weights
                // unrounded; whether its sum then matches is untested.
                if c.ternary && lora.use_dora {
                    return Err(HfError::Lora(
                        "use_dora on a BitNet that trains ternary (quantization_config autobitlinear, online): zrt builds DoRA on full-precision linear layers only; use plain LoRA (use_dora off)".into(),
                    ));
                }
                let refused = c.lora_refused_modules();
                crate::lora::refuse_modules(vs, refused, c.family.model_type())?;
            }
            let names = match &layout {
                Layout::Llama(c) => crate::llama::file_names(c),
                _ => None,
            };
            crate::lora::init_from_checkpoint(vs, dir, (prefix, names.as_ref()), lora)?;
            // `ensure_weight_tying` written where it ties something
            // (PEFT warns of it elsewhere).
            let ties =
                tied.is_some_and(|t| !lora.saved_by(&format!("{}.weight", t.embedding)).is_empty());
            let written = crate::lora::LoraConfig {
                ensure_weight_tying: lora.ensure_weight_tying && ties,
                exclude_modules,
                ..lora.clone()
            };
            let export = crate::lora::export_layout_under(vs, &written, dir, (prefix, names), tied);
            return Ok((model, export));
        }
        let model = match (&layout, recompute) {
            (Layout::Gpt2(c), false) => Self::Gpt2(Gpt2::new(&root, plan, c)),
            (Layout::Gpt2(c), true) => Self::Gpt2(Gpt2::new_checkpointed(&root, plan, c)),
            (Layout::GptNeox(c), false) => Self::GptNeox(GptNeox::new(&root, plan, c)),
            (Layout::GptNeox(c), true) => Self::GptNeox(GptNeox::new_checkpointed(&root, plan, c)),
            (Layout::Phi(c), false) => Self::Phi(Phi::new(&root, plan, c)),
            (Layout::Phi(c), true) => Self::Phi(Phi::new_checkpointed(&root, plan, c)),
            (Layout::Llama(c), false) => Self::Llama(Llama::new(&root, plan, c)),
            (Layout::Llama(c), true) => Self::Llama(Llama::new_checkpointed(&root, plan, c)),
        };
        Ok((model, layout.export(&source)?))
    }

    /// Logits `[batch, seq, vocab]` for token ids `[batch, seq]` (int64).
    pub fn forward(&self, tokens: &Tensor) -> Tensor {
        match self {
            Self::Gpt2(m) => m.forward(tokens),
            Self::GptNeox(m) => m.forward(tokens),
            Self::Phi(m) => m.forward(tokens),
            Self::Llama(m) => m.forward(tokens),
        }
    }

    /// Logits `[batch, seq, vocab]` for token ids `[batch, seq]` packed
    /// in documents ([`crate::packing`]): `positions` (`[batch, seq]`,
    /// int64) count each token's place in its document, a new document
    /// beginning wherever a position is not one more than the one before
    /// it ([`crate::packing::document_positions`] makes them from the
    /// end-of-sequence tokens, [`crate::packing::positions_from_starts`]
    /// from where each document starts). Each token attends to the tokens of its
    /// own document up to itself (within its layer's sliding window) and
    /// is turned, or embedded, at its position: what `transformers`
    /// computes given `position_ids`, no attention mask and no cache
    /// (`use_cache=False`). A checkpointed layer's recompute in backward
    /// sees the documents its forward saw, whatever ran between.
    /// Positions of another shape or type, negative ones, and past
    /// GPT-2's `n_positions` are refused.
    pub fn forward_packed(&self, tokens: &Tensor, positions: &Tensor) -> Result<Tensor, HfError> {
        let documents = self.documents(tokens, positions)?;
        Ok(match self {
            Self::Gpt2(m) => m.forward_in(tokens, Some(documents)),
            Self::GptNeox(m) => m.forward_in(tokens, Some(documents)),
            Self::Phi(m) => m.forward_in(tokens, Some(documents)),
            Self::Llama(m) => m.forward_in(tokens, Some(documents)),
        })
    }

    /// The documents `positions` pack `tokens` in ([`Documents::new`]),
    /// refused past GPT-2's `n_positions`, its position embedding's rows.
    fn documents(&self, tokens: &Tensor, positions: &Tensor) -> Result<Documents, HfError> {
        let documents = Documents::new(tokens, positions)?;
        if let Self::Gpt2(m) = self {
            let most = m.config().positions;
            if documents.longest > most {
                return Err(HfError::Packed(format!(
                    "a position is {}, past GPT-2's n_positions {most}: its documents are longer than it was trained for",
                    documents.longest - 1
                )));
            }
        }
        Ok(documents)
    }

    /// The causal-LM loss of [`HfModel::forward_packed`]'s logits, over
    /// the tokens `mask` marks (nonzero; all without one) but the first
    /// token of every document after the row's first: no document's
    /// first token is predicted from the end of the one before it,
    /// as `DataCollatorWithFlattening`'s labels leave them out
    /// ([`causal_lm_loss_masked`]). A mask of another shape than the
    /// tokens' is refused.
    pub fn loss_packed(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor, HfError> {
        if let Some(m) = mask.filter(|m| m.size() != tokens.size()) {
            return Err(HfError::Packed(format!(
                "a mask {:?} for tokens {:?}: give one value a token",
                m.size(),
                tokens.size()
            )));
        }
        let counted = counted_targets(tokens, Some(positions), mask);
        let documents = self.documents(tokens, positions)?;
        let lm = match self.fused_loss(tokens, Some(documents), &counted, None) {
            Some(lm) => lm,
            None => {
                causal_lm_loss_masked(&self.forward_packed(tokens, positions)?, tokens, &counted)
            }
        };
        Ok(self.plus_aux_losses(lm))
    }

    /// The loss of [`causal_lm_loss_over`] (the counted predictions'
    /// cross-entropies summed and divided by `items`: `transformers`'
    /// loss given `num_items_in_batch`) of the logits of `tokens`, packed
    /// as `positions` say when given ([`HfModel::forward_packed`]), with
    /// the head and the loss fused where it can
    /// ([`HfModel::set_fused_loss`]). Without the auxiliary losses
    /// ([`HfModel::plus_aux_losses`] adds them).
    pub fn loss_over(
        &self,
        tokens: &Tensor,
        positions: Option<&Tensor>,
        counted: &Tensor,
        items: f64,
    ) -> Result<Tensor, HfError> {
        let documents = positions.map(|p| self.documents(tokens, p)).transpose()?;
        if let Some(lm) = self.fused_loss(tokens, documents, counted, Some(items)) {
            return Ok(lm);
        }
        let logits = match positions {
            Some(p) => self.forward_packed(tokens, p)?,
            None => self.forward(tokens),
        };
        Ok(causal_lm_loss_over(&logits, tokens, counted, items))
    }

    /// Turns on or off the fusing of the head with the loss in the loss
    /// methods (`loss`, `loss_masked`, `loss_packed`, `loss_over`): on
    /// when built. Fused, no `[tokens, vocab]` logits are held in forward
    /// or backward ([`crate::zero::glue::linear_cross_entropy`]: the head
    /// runs a block of vocabulary columns at a time, in forward and again
    /// in backward), at the cost of the head's product once more (none
    /// with the head frozen, as under LoRA: forward computes the hidden
    /// states' gradient as it goes); the loss is the same within fp32's
    /// rounding. Logits that one block
    /// holds ([`crate::zero::glue::keeps_logits`]) are kept as fp32
    /// log-probabilities instead, and not computed again. It applies to GPT-2,
    /// GPT-NeoX, Phi and the Llama-family layouts whose head is a plain
    /// matrix (no LoRA adapter or trainable tokens on it) and, for the
    /// Llama family, that have no z-loss (Bamba's reads the logits).
    pub fn set_fused_loss(&self, on: bool) {
        match self {
            Self::Gpt2(m) => m.set_fused_loss(on),
            Self::GptNeox(m) => m.set_fused_loss(on),
            Self::Phi(m) => m.set_fused_loss(on),
            Self::Llama(m) => m.set_fused_loss(on),
        }
    }

    /// The language model's loss with the head fused
    /// ([`HfModel::set_fused_loss`]): the counted predictions' mean (0
    /// when none counts, as [`causal_lm_loss_masked`]'s) or their sum
    /// over `items`. `None`, before anything runs, where it cannot.
    fn fused_loss(
        &self,
        tokens: &Tensor,
        documents: Option<Documents>,
        counted: &Tensor,
        items: Option<f64>,
    ) -> Option<Tensor> {
        let counted = (counted, items.is_none());
        let lm = match self {
            Self::Gpt2(m) => m.fused_loss(tokens, documents, counted),
            Self::GptNeox(m) => m.fused_loss(tokens, documents, counted),
            Self::Phi(m) => m.fused_loss(tokens, documents, counted),
            Self::Llama(m) => m.fused_loss(tokens, documents, counted),
        }?;
        Some(match items {
            Some(n) => lm / n,
            None => lm,
        })
    }

    /// The causal-LM loss with `labels = tokens` ([`causal_lm_loss`]),
    /// plus the auxiliary losses the config asks for: the router's
    /// load-balancing loss (`output_router_logits`), Bamba's z-loss
    /// ([`Self::plus_aux_losses`]; the same in [`Self::loss_masked`] and
    /// [`Self::loss_packed`]).
    pub fn loss(&self, tokens: &Tensor) -> Tensor {
        let counted = counted_targets(tokens, None, None);
        let lm = self.fused_loss(tokens, None, &counted, None);
        let lm = lm.unwrap_or_else(|| causal_lm_loss(&self.forward(tokens), tokens));
        self.plus_aux_losses(lm)
    }

    /// The causal-LM loss over the tokens `mask` marks only
    /// ([`causal_lm_loss_masked`]: a completion's, not its prompt's).
    pub fn loss_masked(&self, tokens: &Tensor, mask: &Tensor) -> Tensor {
        let lm = self.fused_loss(tokens, None, mask, None);
        let lm = lm.unwrap_or_else(|| causal_lm_loss_masked(&self.forward(tokens), tokens, mask));
        self.plus_aux_losses(lm)
    }

    /// `loss` plus the last forward's auxiliary losses, what
    /// `transformers` adds to the loss given `labels`:
    ///
    /// - the router's load-balancing loss times `router_aux_loss_coef`,
    ///   for a model with experts whose config has `output_router_logits`
    ///   true (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, FlexOlmo, MiniMax,
    ///   Qwen3-Next, Jamba, the Granite MoEs, DBRX, GPT-OSS, PhiMoE,
    ///   ERNIE 4.5): the Switch
    ///   Transformer's balance over every layer with experts
    ///   (`load_balancing_loss_func`, over every token: zrt takes no
    ///   attention mask). Its gradient reaches the routers when the sum
    ///   is back-propagated, checkpointed layers' too.
    /// - Bamba's z-loss when its `z_loss_coefficient` is above 0: the
    ///   coefficient times the mean, over every position, of the square
    ///   of the logits' log-sum-exp.
    ///
    /// The loss methods add them; a loss made from [`Self::forward`]'s
    /// logits ([`causal_lm_loss_over`]) takes them here. Each forward's
    /// terms are added once (a second call adds nothing); `loss` itself
    /// for every other model.
    pub fn plus_aux_losses(&self, loss: Tensor) -> Tensor {
        match self {
            Self::Llama(m) => m.plus_aux_losses(loss),
            _ => loss,
        }
    }

    /// Turns the model's dropout on or off (PyTorch's `model.train()` and
    /// `model.eval()`); off when built, as `from_pretrained` returns a
    /// model in evaluation. GPT-2 drops out at its `*_pdrop` rates (0.1
    /// unless its config says), GPT-NeoX at `attention_dropout` and
    /// `hidden_dropout`, Phi at `embd_pdrop`, `resid_pdrop` and
    /// `attention_dropout`, Llama, Mistral and Qwen at `attention_dropout`
    /// (0 in their releases).
    pub fn set_training(&self, on: bool) {
        match self {
            Self::Gpt2(m) => m.set_training(on),
            Self::GptNeox(m) => m.set_training(on),
            Self::Phi(m) => m.set_training(on),
            Self::Llama(m) => m.set_training(on),
        }
    }

    /// NEFTune (`transformers`' `neftune_noise_alpha`, as TRL's
    /// `SFTConfig` sets it): while the model trains
    /// ([`HfModel::set_training`]), its token embeddings take noise
    /// uniform in `±alpha / sqrt(seq * width)`, drawn from libtorch's
    /// generator as `transformers`' `neftune_post_forward_hook` draws it,
    /// so that a program seeded as a Python one draws the same. 0 (the
    /// default) turns it off; evaluation and generation never see it. A
    /// negative or non-finite alpha is refused.
    pub fn set_neftune_alpha(&self, alpha: f64) -> Result<(), HfError> {
        if !(alpha.is_finite() && alpha >= 0.0) {
            return Err(HfError::Setting(format!(
                "NEFTune's alpha is {alpha}: give a number of 0 or more (5 in its paper; 0 turns it off)"
            )));
        }
        let training = match self {
            Self::Gpt2(m) => m.training(),
            Self::GptNeox(m) => m.training(),
            Self::Phi(m) => m.training(),
            Self::Llama(m) => m.training(),
        };
        training.set_noise(alpha);
        Ok(())
    }

    /// Whether dropout is on ([`HfModel::set_training`]).
    pub fn is_training(&self) -> bool {
        match self {
            Self::Gpt2(m) => m.is_training(),
            Self::GptNeox(m) => m.is_training(),
            Self::Phi(m) => m.is_training(),
            Self::Llama(m) => m.is_training(),
        }
    }

    /// The model's width (`n_embd`, `hidden_size`): what DeepSpeed's
    /// `"auto"` bucket sizes and thresholds derive from
    /// ([`AutoHints::hidden_size`](crate::zero::AutoHints)).
    pub fn hidden_size(&self) -> i64 {
        match self {
            Self::Gpt2(m) => m.config().width,
            Self::GptNeox(m) => m.config().hidden,
            Self::Phi(m) => m.config().hidden,
            Self::Llama(m) => m.config().hidden,
        }
    }

    /// The vocabulary's size.
    pub fn vocab(&self) -> i64 {
        match self {
            Self::Gpt2(m) => m.config().vocab,
            Self::GptNeox(m) => m.config().vocab,
            Self::Phi(m) => m.config().vocab,
            Self::Llama(m) => m.config().vocab,
        }
    }
}

/// A multimodal model whose language model zrt builds from its
/// checkpoint: the wrapper's `model_type`; which language model its
/// `text_config` holds ([`TextModel`]); and whether its text fields may
/// stand at the top level instead (older Qwen-VL configs, Fuyu's).
pub(crate) struct Multimodal {
    pub(crate) model_type: &'static str,
    pub(crate) text: TextModel,
    pub(crate) top_level: bool,
}

/// The language model a [`Multimodal`] wrapper holds.
pub(crate) enum TextModel {
    /// One text class, which its `text_config` names itself by
    /// (`named`: `gemma3_text`), read as zrt's `text_type` (`qwen2` for
    /// `qwen2_vl_text`).
    Fixed {
        named: &'static str,
        text_type: &'static str,
    },
    /// Whichever text model its `text_config` names (LLaVA's: a Llama,
    /// a Mistral, a Qwen2, ...), `default` when it names none, as the
    /// wrapper's class reads it; its logits computed by `head`.
    Named {
        default: &'static str,
        head: WrappedHead,
    },
}

/// What a [`TextModel::Named`] wrapper computes its logits with.
pub(crate) enum WrappedHead {
    /// A plain bias-free matrix of its own (`lm_head`) after the text
    /// model's base model (`model.language_model`): what the text class
    /// does to its logits (Cohere 2's `logit_scale`) is not done.
    Plain,
    /// The text model's whole causal LM (`language_model.lm_head`), and
    /// so whatever its class does to the logits.
    TextClass,
}

/// `LlamaConfig`'s sizes.
const LLAMA_SIZES: &[(&str, i64)] = &[
    ("vocab_size", 32000),
    ("hidden_size", 4096),
    ("intermediate_size", 11008),
    ("num_hidden_layers", 32),
    ("num_attention_heads", 32),
];

/// `Qwen2Config`'s and `Qwen3Config`'s sizes.
const QWEN_SIZES: &[(&str, i64)] = &[
    ("vocab_size", 151936),
    ("hidden_size", 4096),
    ("intermediate_size", 22016),
    ("num_hidden_layers", 32),
    ("num_attention_heads", 32),
];

/// `Qwen2VLTextConfig`'s and `Qwen2_5_VLTextConfig`'s sizes.
const QWEN_VL_SIZES: &[(&str, i64)] = &[
    ("vocab_size", 152064),
    ("hidden_size", 8192),
    ("intermediate_size", 29568),
    ("num_hidden_layers", 80),
    ("num_attention_heads", 64),
    ("num_key_value_heads", 8),
];

/// Their defaults that are not `Qwen2Config`'s.
const QWEN_VL_NUMBERS: &[(&str, f64)] = &[("rms_norm_eps", 1e-5), ("rope_theta", 1e6)];

/// A text class's defaults for what a `text_config` may leave out.
struct ClassDefaults {
    /// The class's `model_type`.
    named: &'static str,
    /// Its sizes (zrt's shared reader needs sizes given).
    sizes: &'static [(&'static str, i64)],
    /// Its numbers that are not those of the zrt family it is read as.
    numbers: &'static [(&'static str, f64)],
}

/// The text classes whose defaults published multimodal configs lean
/// on (Gemma 3 4B's `text_config` leaves out `vocab_size` and the heads,
/// LLaVA 1.5 7B's every size but `vocab_size`). A class not here gives
/// its sizes in its `text_config` or is refused naming the first missing.
const CLASS_DEFAULTS: [ClassDefaults; 9] = [
    ClassDefaults {
        named: "llama",
        sizes: LLAMA_SIZES,
        numbers: &[],
    },
    ClassDefaults {
        named: "mistral",
        sizes: &[
            ("vocab_size", 32000),
            ("hidden_size", 4096),
            ("intermediate_size", 14336),
            ("num_hidden_layers", 32),
            ("num_attention_heads", 32),
        ],
        numbers: &[],
    },
    ClassDefaults {
        named: "qwen2",
        sizes: QWEN_SIZES,
        numbers: &[],
    },
    ClassDefaults {
        named: "cohere2",
        sizes: &[
            ("vocab_size", 256000),
            ("hidden_size", 8192),
            ("intermediate_size", 22528),
            ("num_hidden_layers", 40),
            ("num_attention_heads", 64),
        ],
        numbers: &[],
    },
    ClassDefaults {
        named: "gemma3_text",
        sizes: &[
            ("vocab_size", 262208),
            ("hidden_size", 2304),
            ("intermediate_size", 9216),
            ("num_hidden_layers", 26),
            ("num_attention_heads", 8),
        ],
        numbers: &[],
    },
    ClassDefaults {
        named: "qwen2_vl_text",
        sizes: QWEN_VL_SIZES,
        numbers: QWEN_VL_NUMBERS,
    },
    ClassDefaults {
        named: "qwen2_5_vl_text",
        sizes: QWEN_VL_SIZES,
        numbers: QWEN_VL_NUMBERS,
    },
    // `Qwen3VLTextConfig`: `Qwen3Config`'s sizes, a longer context and
    // another rotary base.
    ClassDefaults {
        named: "qwen3_vl_text",
        sizes: &[
            ("vocab_size", 151936),
            ("hidden_size", 4096),
            ("intermediate_size", 22016),
            ("num_hidden_layers", 32),
            ("num_attention_heads", 32),
            ("max_position_embeddings", 128000),
        ],
        numbers: &[("rope_theta", 5e6)],
    },
    ClassDefaults {
        named: "llama4_text",
        sizes: &[],
        numbers: &[],
    },
];

/// The multimodal models zrt trains the language model of:
///
/// - Llama 4's (`Llama4ForConditionalGeneration`);
/// - Gemma 3's (`Gemma3ForConditionalGeneration`, whose published
///   `text_config`s leave `vocab_size` and the heads to
///   `Gemma3TextConfig`'s defaults);
/// - Mistral 3's (`Mistral3ForConditionalGeneration`: Mistral Small 3.1
///   and 3.2, Magistral Small);
/// - Qwen2-VL's and Qwen2.5-VL's, read as Qwen2, and Qwen3-VL's, read as
///   Qwen3: their M-RoPE turns each section of a head's frequencies by
///   one of a token's three position ids (time, height, width), and for
///   text alone the three are the same, which is the text model's own
///   rotary embedding;
/// - LLaVA's (`llava`, LLaVA-NeXT's `llava_next` and its video model's,
///   LLaVA-OneVision's, VipLLaVA's, Video-LLaVA's), Aya Vision's,
///   InternVL's, Idefics2's and 3's, SmolVLM's, LFM2-VL's, GOT-OCR2's,
///   Janus's, DeepSeek-VL's (and its hybrid's) and Command A Vision's,
///   each around the base
///   model of whichever text model its `text_config` names, with a plain
///   head of its own;
/// - Ovis2's, around a Qwen2, and Fuyu's, around a Persimmon (its text
///   fields at the top level in a config without a `text_config`);
/// - Qwen2-Audio's, Voxtral's and Granite Speech's, each around the whole
///   causal LM of the text model its `text_config` names.
pub(crate) const MULTIMODAL: [Multimodal; 28] = [
    fixed("llama4", "llama4_text", "llama4_text", false),
    fixed("gemma3", "gemma3_text", "gemma3_text", false),
    fixed("mistral3", "mistral", "mistral", false),
    fixed("qwen2_vl", "qwen2_vl_text", "qwen2", true),
    fixed("qwen2_5_vl", "qwen2_5_vl_text", "qwen2", true),
    fixed("qwen3_vl", "qwen3_vl_text", "qwen3", false),
    named("llava", "llama"),
    named("llava_next", "llama"),
    named("llava_next_video", "llama"),
    named("llava_onevision", "qwen2"),
    named("aya_vision", "cohere2"),
    named("internvl", "qwen2"),
    named("idefics3", "llama"),
    named("smolvlm", "llama"),
    named("idefics2", "mistral"),
    named("lfm2-vl", "lfm2"),
    named("vipllava", "llama"),
    named("video_llava", "llama"),
    named("got_ocr2", "qwen2"),
    named("janus", "llama"),
    named("deepseek_vl", "llama"),
    named("deepseek_vl_hybrid", "llama"),
    named("cohere2_vision", "cohere2"),
    fixed("ovis2", "qwen2", "qwen2", false),
    fixed("fuyu", "persimmon", "persimmon", true),
    whole("qwen2_audio", "qwen2"),
    whole("voxtral", "llama"),
    whole("granite_speech", "granite"),
];

/// Why Gemma 3n is not built.
const GEMMA3N: &str = "Gemma 3n is not built: transformers 4.57 computes its last layers' keys and values from earlier layers' only when given a cache, and their own otherwise (in training), so one checkpoint gives two models' logits and there is none to hold zrt's to";

/// Models `transformers` has that zrt does not build, and why: what the
/// refusal of one adds to the list of those it builds.
const NOT_BUILT: [(&str, &str); 7] = [
    (
        "blip-2",
        "BLIP-2's forward needs an image (its query tokens read one); it has no text-only language model to train",
    ),
    (
        "instructblip",
        "InstructBLIP's forward needs an image (its query tokens read one); it has no text-only language model to train",
    ),
    (
        "paligemma",
        "PaliGemma's language model attends both ways over the image and the prompt (a prefix-LM), which a text-only causal model does not compute",
    ),
    (
        "mllama",
        "Llama 3.2 Vision's language model holds cross-attention layers that read the image; its text alone skips them, and the text model zrt would export could not hold them",
    ),
    (
        "qwen3_vl_moe",
        "its experts are stacked as Llama 4's are and transformers has no text class to export its language model as",
    ),
    ("gemma3n", GEMMA3N),
    ("gemma3n_text", GEMMA3N),
];

/// Refuses a language model `c` whose class does more to its logits
/// than the wrapper it was read from does, when that wrapper takes
/// the base model of whichever text model its `text_config` names
/// ([`WrappedHead::Plain`]):
/// its head is a plain bias-free matrix, so `transformers` computes
/// Aya Vision's Cohere 2 logits without the text class's `logit_scale`
/// (a Granite's without `logits_scaling`, a Gemma 2's without the
/// soft cap). Which of the two a checkpoint was trained with zrt does
/// not guess; a `text_config` that sets them to do nothing is read.
fn head_as_wrapped(c: &LlamaConfig, j: &HfJson) -> Result<(), HfError> {
    let Some(wrapper) = j.wrapper() else {
        return Ok(());
    };
    let plain = (MULTIMODAL.iter().find(|m| m.model_type == wrapper)).is_some_and(|m| {
        matches!(
            m.text,
            TextModel::Named {
                head: WrappedHead::Plain,
                ..
            }
        )
    });
    let more = [
        (c.logit_scale != 1.0).then(|| format!("multiplies them by logit_scale {}", c.logit_scale)),
        (c.logits_scaling != 1.0)
            .then(|| format!("divides them by logits_scaling {}", c.logits_scaling)),
        (c.final_softcap).map(|cap| format!("caps them (final_logit_softcapping {cap})")),
        c.head_bias.then(|| "adds a bias".to_string()),
    ];
    match (plain, more.into_iter().flatten().next()) {
        (true, Some(more)) => Err(j.field(format!(
            "model_type {wrapper:?}'s head computes its language model's logits as a plain matrix, where {} {more}: which of the two the checkpoint was trained with is not settled, so zrt refuses it; a text_config that makes the class's head plain too (logit_scale 1, logits_scaling 1, no soft cap) is read",
            c.family.architecture()
        ))),
        _ => Ok(()),
    }
}

/// A [`Multimodal`] around one text class.
const fn fixed(
    model_type: &'static str,
    named: &'static str,
    text_type: &'static str,
    top_level: bool,
) -> Multimodal {
    Multimodal {
        model_type,
        text: TextModel::Fixed { named, text_type },
        top_level,
    }
}

/// A [`Multimodal`] around the base model of the text model its
/// `text_config` names, with a plain head of its own.
const fn named(model_type: &'static str, default: &'static str) -> Multimodal {
    Multimodal {
        model_type,
        text: TextModel::Named {
            default,
            head: WrappedHead::Plain,
        },
        top_level: false,
    }
}

/// A [`Multimodal`] around the whole causal LM of the text model its
/// `text_config` names.
const fn whole(model_type: &'static str, default: &'static str) -> Multimodal {
    Multimodal {
        model_type,
        text: TextModel::Named {
            default,
            head: WrappedHead::TextClass,
        },
        top_level: false,
    }
}

/// A parsed `config.json`, its fields read with errors naming them.
pub(crate) struct HfJson {
    path: PathBuf,
    /// The multimodal model's `model_type` when this is its language
    /// model's config ([`HfJson::text_model`]): the checkpoint names its
    /// tensors as the wrapper does.
    wrapper: Option<&'static str>,
    /// The file as read (an export writes it back verbatim).
    text: String,
    json: serde_json::Value,
}

/// `text` with the bare `Infinity`, `-Infinity` and `NaN` that Python's
/// `json` writes for non-finite floats (`Mamba2Config`'s
/// `time_step_limit` `[0.0, Infinity]`) quoted as strings, so that a
/// strict JSON reader takes them: a field that must be a number then
/// says it is not one, and the few that may be infinite read the string.
fn non_finite_quoted(text: &str) -> std::borrow::Cow<'_, str> {
    if !(text.contains("Infinity") || text.contains("NaN")) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    let (mut in_string, mut escaped) = (false, false);
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
        } else if c == '"' {
            in_string = true;
        } else if let Some(word) = ["-Infinity", "Infinity", "NaN"]
            .into_iter()
            .find(|w| rest.starts_with(w))
        {
            out.push('"');
            out.push_str(word);
            out.push('"');
            rest = &rest[word.len()..];
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    std::borrow::Cow::Owned(out)
}

impl HfJson {
    /// Reads `dir/config.json`, or `dir` itself when it is a file, and
    /// checks its `model_type` is `model_type` when given.
    pub(crate) fn read(dir: &Path, model_type: Option<&str>) -> Result<Self, HfError> {
        let path = match dir.is_dir() {
            true => dir.join("config.json"),
            false => dir.to_path_buf(),
        };
        let read = |msg: String| HfError::Read {
            path: path.clone(),
            msg,
        };
        let text =
            std::fs::read_to_string(&path).map_err(|e| read(format!("cannot read it: {e}")))?;
        let json = serde_json::from_str(&non_finite_quoted(&text))
            .map_err(|e| read(format!("not JSON ({e})")))?;
        let me = Self {
            path,
            wrapper: None,
            text,
            json,
        };
        match (me.model_type(), model_type) {
            (_, None) => Ok(me),
            (Some(t), Some(want)) if t == want => Ok(me),
            (_, Some(want)) => Err(me.field(format!(
                "{}, not \"{want}\": this is another architecture's config",
                me.model_type_named()
            ))),
        }
    }

    /// A multimodal config's language model's ([`MULTIMODAL`]: its
    /// `text_config`, or its top-level fields where the wrapper reads
    /// them so; what it leaves out its own class's defaults; an M-RoPE
    /// `rope_scaling` dropped), as the text model's class reads it,
    /// beside the same path.
    fn text_model(&self) -> Result<Self, HfError> {
        let given = self.model_type().unwrap_or_default();
        let Some(m) = MULTIMODAL.iter().find(|m| m.model_type == given) else {
            return Err(self.field(format!(
                "{}: not a multimodal model zrt builds the language model of",
                self.model_type_named()
            )));
        };
        let mut text = match (self.get("text_config"), self.json.as_object()) {
            (Some(serde_json::Value::Object(text)), _) => text.clone(),
            (None, Some(all)) if m.top_level => {
                let mut text = all.clone();
                text.remove("vision_config");
                text.remove("model_type");
                text
            }
            _ => {
                let builds = match m.text {
                    TextModel::Fixed { text_type, .. } => text_type.to_string(),
                    TextModel::Named { .. } => "the text model it names".to_string(),
                };
                return Err(self.field(format!(
                    "model_type {given:?} without a text_config object: zrt builds its language model ({builds}) from it"
                )));
            }
        };
        let names = text.get("model_type").and_then(|t| t.as_str());
        let (named, text_type) = match (&m.text, names) {
            (TextModel::Fixed { named, text_type }, None) => (*named, *text_type),
            (TextModel::Fixed { named, text_type }, Some(other)) if other == *named => {
                (*named, *text_type)
            }
            (TextModel::Fixed { named, text_type }, Some(other)) => {
                return Err(self.field(format!(
                    "text_config's model_type {other:?}: model_type {given:?}'s language model is {named:?}, which zrt builds as {text_type:?}; give that"
                )))
            }
            (TextModel::Named { default, .. }, names) => {
                let named = names.unwrap_or(default);
                match Family::of(named) {
                    Some(family) => (family.model_type(), family.model_type()),
                    None => {
                        return Err(self.field(format!(
                            "text_config's model_type {named:?}: zrt builds model_type {given:?}'s language model when it is one of {}",
                            Family::model_types()
                        )))
                    }
                }
            }
        };
        // A quantized multimodal checkpoint says so at the top level
        // (bitsandbytes', GPTQ's, AWQ's): its language model's matrices
        // are the quantized ones, which zrt refuses to train as if they
        // were not (`LlamaConfig`'s reading says how to load them).
        if let Some(q) = self.get("quantization_config") {
            text.entry("quantization_config").or_insert(q.clone());
        }
        let class = CLASS_DEFAULTS.iter().find(|c| c.named == named);
        for (key, default) in class.map_or(&[][..], |c| c.sizes) {
            text.entry(*key).or_insert((*default).into());
        }
        for (key, default) in class.map_or(&[][..], |c| c.numbers) {
            text.entry(*key).or_insert((*default).into());
        }
        // M-RoPE (its `mrope_section`): the text model's own rotary
        // embedding for text.
        let mrope = (text
            .get("rope_scaling")
            .and_then(|r| r.get("mrope_section")))
        .is_some();
        if mrope {
            text.remove("rope_scaling");
        }
        text.insert("model_type".into(), text_type.into());
        if let Some(family) = Family::of(text_type) {
            text.insert(
                "architectures".into(),
                serde_json::json!([family.architecture()]),
            );
        }
        let json = serde_json::Value::Object(text);
        Ok(Self {
            path: self.path.clone(),
            wrapper: Some(m.model_type),
            text: format!("{json:#}\n"),
            json,
        })
    }

    /// The multimodal model's `model_type` when this is its language
    /// model's config: the checkpoint names its tensors as the wrapper
    /// does.
    pub(crate) fn wrapper(&self) -> Option<&'static str> {
        self.wrapper
    }

    /// The same file read as `json` (DBRX's nested config flattened):
    /// its path for errors and its text for an export stay.
    pub(crate) fn reading(&self, json: serde_json::Value) -> Self {
        Self {
            path: self.path.clone(),
            wrapper: self.wrapper,
            text: self.text.clone(),
            json,
        }
    }

    /// Its `model_type`.
    pub(crate) fn model_type(&self) -> Option<String> {
        self.get("model_type")
            .and_then(|v| v.as_str())
            .map(String::from)
    }

    /// Its `model_type` as an error names it: `model_type "zamba"`, or
    /// `no model_type` when the key is missing.
    pub(crate) fn model_type_named(&self) -> String {
        match self.model_type() {
            Some(t) => format!("model_type {t:?}"),
            None => "no model_type".to_string(),
        }
    }

    /// A [`HfError::Field`] saying `msg`.
    pub(crate) fn field(&self, msg: String) -> HfError {
        HfError::Field {
            path: self.path.clone(),
            msg,
        }
    }

    /// Whether the config has field `key` (null too).
    pub(crate) fn has(&self, key: &str) -> bool {
        self.json.get(key).is_some()
    }

    /// Field `key`, unless absent or null.
    pub(crate) fn get(&self, key: &str) -> Option<&serde_json::Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }

    /// Field `key`, a positive integer.
    pub(crate) fn size(&self, key: &str) -> Result<i64, HfError> {
        self.get(key)
            .and_then(|v| v.as_i64())
            .filter(|&n| n > 0)
            .ok_or_else(|| self.field(format!("`{key}` is missing or not a positive integer")))
    }

    /// Field `key`, a positive integer, or `None` when absent or null.
    pub(crate) fn size_or_none(&self, key: &str) -> Result<Option<i64>, HfError> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.size(key).map(Some),
        }
    }

    /// Field `key`, a positive integer; `None` when null, `default` when
    /// absent (a config class's default, which null overrides).
    pub(crate) fn size_or_null(
        &self,
        key: &str,
        default: Option<i64>,
    ) -> Result<Option<i64>, HfError> {
        match self.json.get(key) {
            None => Ok(default),
            Some(v) if v.is_null() => Ok(None),
            Some(_) => self.size(key).map(Some),
        }
    }

    /// Field `key`, a number, or `default` when absent or null.
    pub(crate) fn number_or(&self, key: &str, default: f64) -> Result<f64, HfError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.field(format!("`{key}` is {v}, not a number"))),
        }
    }

    /// Field `key`, a number; `None` when null, `default` when absent
    /// (a `transformers` config whose default is a number and `None`
    /// turns the feature off).
    pub(crate) fn number_or_null(
        &self,
        key: &str,
        default: Option<f64>,
    ) -> Result<Option<f64>, HfError> {
        match self.json.get(key) {
            None => Ok(default),
            Some(v) if v.is_null() => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.field(format!("`{key}` is {v}, not a number or null"))),
        }
    }

    /// Field `key`, a dropout rate in [0, 1), or `default` when absent
    /// or null.
    pub(crate) fn rate_or(&self, key: &str, default: f64) -> Result<f64, HfError> {
        let p = self.number_or(key, default)?;
        match (0.0..1.0).contains(&p) {
            true => Ok(p),
            false => Err(self.field(format!("`{key}` is {p}, not a dropout rate in [0, 1)"))),
        }
    }

    /// Field `key`, a boolean, or `default` when absent or null.
    pub(crate) fn flag_or(&self, key: &str, default: bool) -> Result<bool, HfError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.field(format!("`{key}` is {v}, not true or false"))),
        }
    }

    /// Field `key` as Python's `if` reads it, where a class only tests
    /// it: true or false, a number (not 0), or null (false); `default`
    /// where absent. Llama 4's published configs give
    /// `"attn_temperature_tuning": 4`.
    pub(crate) fn truthy_or(&self, key: &str, default: bool) -> Result<bool, HfError> {
        match self.get(key) {
            None => Ok(default),
            Some(serde_json::Value::Null) => Ok(false),
            Some(serde_json::Value::Number(n)) => Ok(n.as_f64() != Some(0.0)),
            Some(v) => v.as_bool().ok_or_else(|| {
                self.field(format!("`{key}` is {v}, not true or false (or a number)"))
            }),
        }
    }

    /// Refuses field `key` unless absent or `want` (a string).
    pub(crate) fn only(&self, key: &str, want: &str, why: &str) -> Result<(), HfError> {
        match self.get(key) {
            Some(v) if v.as_str() != Some(want) => Err(self.field(format!("{key} {v}: {why}"))),
            _ => Ok(()),
        }
    }
}

/// A causal language model's loss as `transformers` computes it with
/// `labels = tokens`: the mean cross-entropy of `logits` `[batch, seq,
/// vocab]` at positions `..seq-1` predicting `tokens[:, 1:]`, in fp32.
/// For its backward it keeps the logits in their own dtype, not their
/// fp32 log-probabilities ([`crate::zero::glue::cross_entropy`]).
pub fn causal_lm_loss(logits: &Tensor, tokens: &Tensor) -> Tensor {
    let t = tokens.size().get(1).copied().unwrap_or(2);
    let vocab = logits.size().last().copied().unwrap_or(1);
    let y = tokens.narrow(1, 1, t - 1);
    let flat = logits.narrow(1, 0, t - 1).reshape([-1, vocab]);
    cross_entropy(&flat, &y.reshape([-1]), true)
}

/// The cross-entropy of `flat` logits `[rows, vocab]` against `y`
/// (`-100`: not counted), their mean or their sum, in fp32, through
/// [`crate::zero::glue::cross_entropy`]: the values and gradients of
/// libtorch's cross-entropy of the logits cast to fp32, keeping for
/// backward the logits as they are (bf16: half the bytes; fp32: what the
/// log-probabilities took) and no fp32 copy of the whole matrix. What it
/// refuses (shapes, targets outside the vocabulary) libtorch's refuses
/// too, so then that one runs, and raises its own error as before.
pub(crate) fn cross_entropy(flat: &Tensor, y: &Tensor, mean: bool) -> Tensor {
    crate::zero::glue::cross_entropy(flat, y, -100, mean).unwrap_or_else(|e| {
        tracing::warn!("{e}; libtorch's cross-entropy instead");
        let reduction = match mean {
            true => tch::Reduction::Mean,
            false => tch::Reduction::Sum,
        };
        (flat.to_kind(Kind::Float)).cross_entropy_loss::<Tensor>(y, None, reduction, -100, 0.0)
    })
}

/// As [`causal_lm_loss`], counting only the positions `mask` (`[batch,
/// seq]`, nonzero: counted) marks: `transformers`' loss with `labels`
/// set to -100 where `mask` is 0 (a prompt's tokens, when only the
/// completion trains: TRL's `completion_only_loss`), the mean over the
/// counted predictions of the whole batch. A batch with none counted
/// gives 0 (and no gradient), where libtorch's mean over nothing would
/// be NaN and spoil the step.
pub fn causal_lm_loss_masked(logits: &Tensor, tokens: &Tensor, mask: &Tensor) -> Tensor {
    let (flat, y, on) = predictions(logits, tokens, mask);
    if on.any().int64_value(&[]) == 0 {
        return flat.sum(Kind::Float) * 0.0;
    }
    cross_entropy(&flat, &y, true)
}

/// `logits`' predictions of `tokens[:, 1:]`, flat, their
/// targets with those `counted` (nonzero, by the token predicted) leaves
/// out set to -100, and which are counted.
fn predictions(logits: &Tensor, tokens: &Tensor, counted: &Tensor) -> (Tensor, Tensor, Tensor) {
    let t = tokens.size().get(1).copied().unwrap_or(2);
    let vocab = logits.size().last().copied().unwrap_or(1);
    let on = counted.narrow(1, 1, t - 1).ne(0);
    let y = (tokens.narrow(1, 1, t - 1)).masked_fill(&on.logical_not(), -100);
    let flat = logits.narrow(1, 0, t - 1).reshape([-1, vocab]);
    (flat, y.reshape([-1]), on)
}

/// Which of `tokens`' (`[batch, seq]`) predictions a loss counts, by the
/// token predicted: bool, `[batch, seq]`, never the first column (no
/// token predicts it), elsewhere where `mask` is nonzero (everywhere
/// without one) but, when `positions` pack documents
/// ([`HfModel::forward_packed`]), at no document's first token: the
/// labels `transformers` is given that are not -100.
pub fn counted_targets(
    tokens: &Tensor,
    positions: Option<&Tensor>,
    mask: Option<&Tensor>,
) -> Tensor {
    let counted = match positions {
        Some(p) => crate::packing::document_starts(p).logical_not(),
        None => tokens.ones_like().to_kind(Kind::Bool),
    };
    let counted = match mask {
        Some(m) => counted.logical_and(&m.ne(0)),
        None => counted,
    };
    let t = tokens.size().last().copied().unwrap_or(0);
    // Column 0 is no prediction's target.
    match t {
        0 => counted,
        _ => {
            let none = counted.narrow(-1, 0, 1).zeros_like();
            Tensor::cat(&[none, counted.narrow(-1, 1, t - 1)], -1)
        }
    }
}

/// The cross-entropies of `logits`' predictions whose targets `counted`
/// marks ([`counted_targets`]), summed and divided by `items`:
/// `transformers`' loss given `num_items_in_batch`, with which its
/// `Trainer` weighs every counted token of a step alike, however the
/// micro-batches and ranks share them (`items`, the step's count over
/// them all). In fp32.
pub fn causal_lm_loss_over(
    logits: &Tensor,
    tokens: &Tensor,
    counted: &Tensor,
    items: f64,
) -> Tensor {
    let (flat, y, _) = predictions(logits, tokens, counted);
    cross_entropy(&flat, &y, false) / items
}

/// The `items` to give [`causal_lm_loss_over`] on each micro-batch of a
/// step so that every counted token of the step weighs alike, however
/// its micro-batches and the ranks share them, under an engine that
/// averages the gradients over `ranks` and divides the loss by the `gas`
/// micro-steps (zrt's, DeepSpeed's): the step's count over every
/// micro-batch and rank (`step_items`, at least 1), divided by both.
/// The step's gradient is then that of the summed cross-entropies over
/// that count: `transformers`' `Trainer` with `num_items_in_batch`
/// counted across devices (its default), not the mean of each
/// micro-batch's mean, which weighs a micro-batch of few counted tokens
/// (a short completion) as much as one of many.
pub fn items_per_micro_step(step_items: f64, ranks: usize, gas: u64) -> f64 {
    step_items.max(1.0) / (ranks as f64 * gas as f64)
}

/// A checkpoint tensor's name as the causal language model holds it:
/// `name` itself, or for a file written from the base model alone
/// (`OPTModel.save_pretrained`: `decoder.layers.0...`; BLOOM's published
/// files: `h.0...`), the base model's prefix `base` before it, as
/// `from_pretrained` adds it. Names under `base` and those starting
/// with one of `outside` (the head's, `lm_head.`, and any other module
/// outside the base model) are kept.
pub(crate) fn under_base<'a>(
    name: &'a str,
    base: &str,
    outside: &[impl AsRef<str>],
) -> Cow<'a, str> {
    let under = name.strip_prefix(base).is_some_and(|n| n.starts_with('.'));
    match under || outside.iter().any(|o| name.starts_with(o.as_ref())) {
        true => Cow::Borrowed(name),
        false => Cow::Owned(format!("{base}.{name}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_base_models_names_take_its_prefix_as_from_pretrained_gives_it() {
        let under = |n| under_base(n, "model", &["lm_head."]).into_owned();
        assert_eq!(
            under("decoder.layers.0.fc1.weight"),
            "model.decoder.layers.0.fc1.weight"
        );
        assert_eq!(under("model.norm.weight"), "model.norm.weight");
        assert_eq!(under("lm_head.weight"), "lm_head.weight");
        // A name that only begins like the prefix is not under it.
        assert_eq!(under("models.x"), "model.models.x");
        let under = |n| under_base(n, "transformer", &["lm_head."]).into_owned();
        assert_eq!(
            under("h.0.mlp.dense_h_to_4h.bias"),
            "transformer.h.0.mlp.dense_h_to_4h.bias"
        );
        assert_eq!(
            under("word_embeddings.weight"),
            "transformer.word_embeddings.weight"
        );
    }

    #[test]
    fn generation_stops_at_generation_configs_eos_tokens_else_configs() {
        let dir = std::env::temp_dir().join(format!("zrt-eos-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |f: &str, text: &str| std::fs::write(dir.join(f), text).unwrap();
        write("config.json", r#"{"eos_token_id": 2}"#);
        assert_eq!(eos_token_ids(&dir).unwrap(), [2]);
        // generation_config.json, when there, says (a list: Llama 3's
        // instruct models'), even none.
        write(
            "generation_config.json",
            r#"{"eos_token_id": [128001, 128009]}"#,
        );
        assert_eq!(eos_token_ids(&dir).unwrap(), [128001, 128009]);
        write("generation_config.json", r#"{"eos_token_id": null}"#);
        assert_eq!(eos_token_ids(&dir).unwrap(), [] as [i64; 0]);
        write("generation_config.json", r#"{"eos_token_id": "</s>"}"#);
        let err = eos_token_ids(&dir).unwrap_err().to_string();
        assert!(
            err.contains("generation_config.json: eos_token_id \"</s>\": a token id or a list"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_exports_config_says_the_dtype_its_tensors_are_written_in() {
        let text =
            "{\n  \"vocab_size\": 96,\n  \"dtype\": \"bfloat16\",\n  \"rms_norm_eps\": 1e-05\n}\n";
        let bytes = |t: &str| t.as_bytes().to_vec();
        // Its own dtype: verbatim, spacing, order and number spellings.
        assert_eq!(config_in(text, "bfloat16"), bytes(text));
        // Another: that field changes, and nothing else.
        let json = |b: &[u8]| serde_json::from_slice::<serde_json::Value>(b).unwrap();
        let got = json(&config_in(text, "float32"));
        let mut want = json(text.as_bytes());
        want["dtype"] = "float32".into();
        assert_eq!(got, want);
        // The older key, or both, alike; none: verbatim.
        let older = text.replace("\"dtype\"", "\"torch_dtype\"");
        assert_eq!(
            json(&config_in(&older, "float16"))["torch_dtype"],
            "float16"
        );
        let both = text.replace("{\n", "{\n  \"torch_dtype\": \"bfloat16\",\n");
        let got = json(&config_in(&both, "float32"));
        assert_eq!(
            (&got["dtype"], &got["torch_dtype"]),
            (&"float32".into(), &"float32".into())
        );
        let none = "{\"vocab_size\": 96}";
        assert_eq!(config_in(none, "float32"), bytes(none));
        // Python's non-finite numbers (Mamba-2's `time_step_limit`) read
        // and written back bare.
        let limit = "{\"time_step_limit\": [0.0, Infinity], \"torch_dtype\": \"float32\"}";
        let written = String::from_utf8(config_in(limit, "bfloat16")).unwrap();
        assert!(
            written.contains("Infinity\n") && !written.contains("\"Infinity\""),
            "{written}"
        );
        assert!(
            written.contains("\"torch_dtype\": \"bfloat16\""),
            "{written}"
        );
    }

    #[test]
    fn non_finite_numbers_python_writes_read_as_strings_outside_strings_only() {
        let text = r#"{"limit": [0.0, Infinity], "low": -Infinity, "x": NaN, "s": "NaN \" Infinity", "n": 2}"#;
        let json: serde_json::Value = serde_json::from_str(&non_finite_quoted(text)).unwrap();
        assert_eq!(json["limit"], serde_json::json!([0.0, "Infinity"]));
        assert_eq!(
            (json["low"].as_str(), json["x"].as_str()),
            (Some("-Infinity"), Some("NaN"))
        );
        assert_eq!(json["s"], "NaN \" Infinity");
        assert_eq!(json["n"], 2);
        // Nothing to quote: the text as it was.
        let plain = r#"{"a": 1}"#;
        assert!(matches!(
            non_finite_quoted(plain),
            std::borrow::Cow::Borrowed(_)
        ));
    }
}
