//! GPT-2 as Hugging Face's `transformers` lays it out, in tch, its blocks
//! wrapped in [`ShardedModule`]: a pretrained checkpoint (`save_pretrained`'s
//! directory, sharded or not) loads into it under any ZeRO stage without a
//! rank holding the whole model.
//!
//! Hugging Face keeps GPT-2's attention and MLP weights in its `Conv1D`
//! layout, `[in, out]`, where a tch `nn::linear` keeps `[out, in]`, and
//! names everything under `transformer.` with the head tied to the token
//! embedding. [`hf_weight_rules`] tells a plan all three, so the file
//! loads as it is:
//!
//! ```no_run
//! use zrt::gpt2::{hf_weight_rules, Gpt2, Gpt2Config};
//! use zrt::zero::ShardPlan;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = std::path::Path::new("gpt2"); // config.json, model*.safetensors
//! let cfg = Gpt2Config::from_hf_dir(dir)?;
//! let vs = tch::nn::VarStore::new(tch::Device::Cpu);
//! let plan = ShardPlan::new();
//! hf_weight_rules(&plan)?;
//! plan.weights_from_file(&vs, dir)?; // no rank holds the model while it is built
//! let model = Gpt2::new(&vs.root(), &plan, &cfg);
//! // Engine::from_config(&vs, &plan, ...) loads each rank's shard of the file.
//! # let _ = model; Ok(()) }
//! ```
//!
//! The forward is GPT-2's (in evaluation until [`Gpt2::set_training`]
//! turns its dropout on, where it draws the masks `transformers` draws
//! from the same seed): pre-norm
//! blocks, causal attention, `gelu_new` (GELU's tanh form), the head
//! tied to `wte`. Its logits match `transformers`' to float rounding
//! (`tests/from_hf.rs`).
//!
//! The token embedding's gradient is sparse (`embedding(.., sparse =
//! true)`: the rows looked up), which zrt's engine adds straight into its
//! flat gradient buffer, never a dense vocabulary-sized matrix of its own;
//! tch's `nn::Optimizer` takes dense gradients only, so train the model
//! with the engine (any stage, one rank too).

use std::path::Path;
use std::sync::Arc;

use tch::nn::{self, Module};
use tch::Tensor;

use crate::blocks::{
    fused_causal_attention, layer_norm, token_embedding, Decoder, Embedding, TiedEmbedding,
    Training,
};
use crate::hf::{HfError, HfJson};
use crate::kv_cache::{Decoding, LayerCache};
use crate::lora::{Adapted, LoraConfig};
use crate::packing::Documents;
use crate::zero::{EngineError, ExportLayout, ShardPlan, ShardedModule};

pub use crate::llama::activations::gpt2::{adapter_params, held_for_backward};

/// Sizes of a [`Gpt2`], Hugging Face's `GPT2Config` fields.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpt2Config {
    /// `vocab_size`.
    pub vocab: i64,
    /// `n_positions`: the longest sequence.
    pub positions: i64,
    /// `n_embd`: the model's width.
    pub width: i64,
    /// `n_layer`: blocks.
    pub layers: i64,
    /// `n_head`: attention heads (must divide `width`).
    pub heads: i64,
    /// `n_inner`: the MLP's width (`None`: 4 x `width`).
    pub inner: Option<i64>,
    /// `layer_norm_epsilon`.
    pub eps: f64,
    /// `embd_pdrop`: dropout on the embeddings' sum, when training.
    pub embd_dropout: f64,
    /// `attn_pdrop`: dropout on the attention weights, when training.
    pub attn_dropout: f64,
    /// `resid_pdrop`: dropout on each block's two outputs before they are
    /// added to the residual stream, when training.
    pub resid_dropout: f64,
}

impl Gpt2Config {
    /// Reads `dir/config.json` (or `dir` itself, a `config.json`), as
    /// `transformers`' `save_pretrained` writes it: its `model_type` must
    /// be `gpt2`, and the sizes are its `n_*` fields. Activations other
    /// than `gelu_new` and a head not tied to the embedding are refused,
    /// naming the field: this model computes neither.
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self, HfError> {
        Self::from_json(&HfJson::read(dir.as_ref(), Some("gpt2"))?)
    }

    /// As [`Gpt2Config::from_hf_dir`], from a config already read.
    pub(crate) fn from_json(j: &HfJson) -> Result<Self, HfError> {
        let why = "this GPT-2 computes gelu_new only";
        j.only("activation_function", "gelu_new", why)?;
        if !j.flag_or("tie_word_embeddings", true)? {
            return Err(j.field(
                "tie_word_embeddings is false: this GPT-2's head is the token embedding".into(),
            ));
        }
        let cfg = Self {
            vocab: j.size("vocab_size")?,
            positions: j.size("n_positions")?,
            width: j.size("n_embd")?,
            layers: j.size("n_layer")?,
            heads: j.size("n_head")?,
            inner: j.size_or_none("n_inner")?,
            eps: j.number_or("layer_norm_epsilon", 1e-5)?,
            // `GPT2Config`'s defaults.
            embd_dropout: j.rate_or("embd_pdrop", 0.1)?,
            attn_dropout: j.rate_or("attn_pdrop", 0.1)?,
            resid_dropout: j.rate_or("resid_pdrop", 0.1)?,
        };
        if cfg.width % cfg.heads != 0 {
            return Err(j.field(format!(
                "n_head {} does not divide n_embd {}",
                cfg.heads, cfg.width
            )));
        }
        Ok(cfg)
    }

    /// The parameters of each unit a [`Gpt2`] wraps, by its name (`wte`,
    /// the head too; `h.0`, ...), and last the root's (`wpe`, `ln_f`)
    /// under `""`: counted from the sizes, nothing built.
    pub fn unit_params(&self) -> Vec<(String, u64)> {
        let (v, p, d) = (self.vocab as u64, self.positions as u64, self.width as u64);
        let i = self.inner.unwrap_or(4 * self.width) as u64;
        // Two layer norms, the fused qkv and output projections, the MLP.
        let block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * i + i) + (i * d + d);
        let mut units = vec![("wte".to_string(), v * d)];
        units.extend((0..self.layers).map(|l| (format!("h.{l}"), block)));
        units.push((String::new(), p * d + 2 * d));
        units
    }

    /// The `config.json` `transformers` reads this model from: its sizes
    /// in GPT-2's fields, `gelu_new`, the head tied.
    pub fn to_hf_json(&self) -> String {
        let json = serde_json::json!({
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "vocab_size": self.vocab,
            "n_positions": self.positions,
            "n_embd": self.width,
            "n_layer": self.layers,
            "n_head": self.heads,
            "n_inner": self.inner,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": self.eps,
            "embd_pdrop": self.embd_dropout,
            "attn_pdrop": self.attn_dropout,
            "resid_pdrop": self.resid_dropout,
            "tie_word_embeddings": true,
        });
        format!("{json:#}\n")
    }
}

/// Whether `name` (a [`Gpt2`] VarStore name) is a matrix Hugging Face
/// stores in its `Conv1D` layout, `[in, out]`.
pub fn is_conv1d_weight(name: &str) -> bool {
    [
        "attn.c_attn.weight",
        "attn.c_proj.weight",
        "mlp.c_fc.weight",
        "mlp.c_proj.weight",
    ]
    .iter()
    .any(|w| name.ends_with(w))
}

/// The [`Gpt2`] VarStore name of a tensor of a Hugging Face GPT-2
/// checkpoint, or `None` for what it does not load: the tied head
/// (`lm_head.weight`, the token embedding again) and the attention mask
/// buffers older checkpoints hold (`attn.bias`, `attn.masked_bias`).
pub fn hf_name(name: &str) -> Option<String> {
    let name = name.strip_prefix("transformer.").unwrap_or(name);
    let skipped = name.starts_with("lm_head.")
        || name.ends_with(".attn.bias")
        || name.ends_with(".attn.masked_bias");
    (!skipped).then(|| name.to_string())
}

/// Sets `plan`'s rules for a Hugging Face GPT-2 checkpoint:
/// [`hf_name`] renames, [`is_conv1d_weight`] transposes. Call it on every
/// rank before the engine is built.
pub fn hf_weight_rules(plan: &ShardPlan) -> Result<(), EngineError> {
    plan.rename_weights(hf_name)?;
    plan.transpose_weights(is_conv1d_weight)
}

/// Hugging Face's layout for an export of a [`Gpt2`]
/// ([`Engine::save_16bit_model_as`](crate::zero::Engine::save_16bit_model_as)):
/// names under `transformer.`, the Conv1D matrices transposed back to
/// `[in, out]`, and `cfg`'s `config.json` beside them, so that
/// `transformers`' `GPT2LMHeadModel.from_pretrained(dir)` loads it (the
/// tied head is not written, as `save_pretrained` does not).
pub fn hf_export_layout(cfg: &Gpt2Config) -> ExportLayout {
    tensor_layout().with_file("config.json", cfg.to_hf_json())
}

/// [`hf_export_layout`]'s names and transposes, no files.
pub(crate) fn tensor_layout() -> ExportLayout {
    ExportLayout::new()
        .rename(|n| format!("transformer.{n}"))
        .transpose(is_conv1d_weight)
}

/// GPT-2's causal self-attention.
#[derive(Debug)]
struct Attention {
    c_attn: Adapted,
    c_proj: Adapted,
    heads: i64,
}

/// GPT-2's MLP.
#[derive(Debug)]
struct Mlp {
    c_fc: Adapted,
    c_proj: Adapted,
}

/// One GPT-2 block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`
/// (each term dropped out at `resid_pdrop` when training).
#[derive(Debug)]
pub struct Block {
    ln_1: nn::LayerNorm,
    attn: Attention,
    ln_2: nn::LayerNorm,
    mlp: Mlp,
    /// Its keys and values while generating with a cache.
    cache: LayerCache,
    training: Training,
    cfg: Gpt2Config,
}

impl Block {
    fn new(
        p: &nn::Path,
        c: &Gpt2Config,
        (training, decoding): (&Training, &Arc<Decoding>),
        lora: Option<&LoraConfig>,
    ) -> Self {
        // Conv1D's biases, as `nn::linear`'s default.
        let lin = |p: nn::Path, i, o| {
            Adapted::new_under(&p, "transformer.", (i, o, true), lora, training)
        };
        let d = c.width;
        let inner = c.inner.unwrap_or(4 * d);
        let ln = |name: &str| layer_norm(p / name, d, c.eps);
        let (a, m) = (p / "attn", p / "mlp");
        Self {
            ln_1: ln("ln_1"),
            attn: Attention {
                c_attn: lin(&a / "c_attn", d, 3 * d),
                c_proj: lin(&a / "c_proj", d, d),
                heads: c.heads,
            },
            ln_2: ln("ln_2"),
            mlp: Mlp {
                c_fc: lin(&m / "c_fc", d, inner),
                c_proj: lin(&m / "c_proj", inner, d),
            },
            // Learned positions: a cache's keys never change.
            cache: LayerCache::new(decoding, None),
            training: training.clone(),
            cfg: *c,
        }
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Tensor {
        // Dropped out in `transformers`' order (attention weights, the
        // attention's output, the MLP's), so that seeded alike both draw
        // the same masks.
        let (t, c) = (&self.training, &self.cfg);
        let qkv = self.attn.c_attn.forward(&self.ln_1.forward(x));
        let dropout = t.attention(c.attn_dropout);
        let a = fused_causal_attention(&qkv, self.attn.heads, dropout, Some(&self.cache));
        let x = x + t.dropout(self.attn.c_proj.forward(&a), c.resid_dropout);
        let m = (self.mlp.c_fc.forward(&self.ln_2.forward(&x))).gelu("tanh");
        &x + t.dropout(self.mlp.c_proj.forward(&m), c.resid_dropout)
    }
}

/// GPT-2 with a language-modelling head (`GPT2LMHeadModel`): the token
/// embedding a unit, run twice (it is the head too), each block a unit,
/// the position embedding and the final norm the root.
#[derive(Debug)]
pub struct Gpt2 {
    decoder: Decoder<Block>,
    cfg: Gpt2Config,
}

impl Gpt2 {
    /// Builds the model under `p` with Hugging Face's names without their
    /// `transformer.` prefix (`wte`, `wpe`, `h.0.attn.c_attn`, ...,
    /// `ln_f`), the token embedding (`wte`, the head too) and each block
    /// (`h.0`, `h.1`, ...) a unit of `plan`. Values
    /// are tch's initialisation: a pretrained model's come from its file
    /// ([`hf_weight_rules`]).
    pub fn new(p: &nn::Path, plan: &ShardPlan, cfg: &Gpt2Config) -> Self {
        Self::build(p, plan, cfg, false, None)
    }

    /// As [`Gpt2::new`], every block's activations recomputed in
    /// backward (`transformers`' `gradient_checkpointing_enable()`): the
    /// same results, less memory, one more block forward per backward.
    pub fn new_checkpointed(p: &nn::Path, plan: &ShardPlan, cfg: &Gpt2Config) -> Self {
        Self::build(p, plan, cfg, true, None)
    }

    /// As [`Gpt2::new`] (or [`Gpt2::new_checkpointed`] when
    /// `checkpointed`), each Conv1D layer of the blocks that `lora`
    /// targets with a LoRA adapter ([`crate::llama::Llama::with_lora`]'s:
    /// A `[r, in]` and B `[out, r]` as PEFT makes them for a Conv1D, whose
    /// `fan_in_fan_out` touches only how [`crate::lora::merge`] adds
    /// the update).
    pub fn with_lora(
        p: &nn::Path,
        plan: &ShardPlan,
        cfg: &Gpt2Config,
        lora: &LoraConfig,
        checkpointed: bool,
    ) -> Self {
        Self::build(p, plan, cfg, checkpointed, Some(lora))
    }

    fn build(
        p: &nn::Path,
        plan: &ShardPlan,
        cfg: &Gpt2Config,
        checkpointed: bool,
        lora: Option<&LoraConfig>,
    ) -> Self {
        // The root's variables first: a plan that releases the model's
        // memory as it is built (`weights_from_file`) releases what was
        // made before each `ShardedModule::new`, and would leave anything
        // made after the last block held until the engine is built.
        let wpe = nn::embedding(p / "wpe", cfg.positions, cfg.width, Default::default());
        let ln_f = layer_norm(p / "ln_f", cfg.width, cfg.eps);
        let wte_path = p / "wte";
        let dims = (cfg.vocab, cfg.width);
        // The tied head: PEFT names the embedding with its prefix.
        let wte = token_embedding(&wte_path, dims, None, (lora, "transformer."));
        let wte = Embedding::Tied(ShardedModule::new(plan, &wte_path, TiedEmbedding(wte)));
        let block =
            |bp: &nn::Path, t: &Training, d: &Arc<Decoding>| Block::new(bp, cfg, (t, d), lora);
        let decoder = Decoder::build(
            plan,
            ln_f,
            wte,
            &(p / "h"),
            cfg.layers,
            block,
            checkpointed,
            // No head of its own is built: the embedding is the head.
            (&(p / "lm_head"), false, lora),
        );
        Self {
            decoder: decoder.with_positions(wpe),
            cfg: *cfg,
        }
    }

    /// Turns dropout on (`embd_pdrop`, `attn_pdrop`, `resid_pdrop`) or
    /// off: PyTorch's `model.train()` and `model.eval()`. Off when built,
    /// as `from_pretrained` returns a model in evaluation; Hugging Face's
    /// `Trainer` turns it on to train.
    pub fn set_training(&self, on: bool) {
        self.decoder.training().set(on);
    }

    /// Its dropout switch and embedding noise.
    pub(crate) fn training(&self) -> &Training {
        self.decoder.training()
    }

    /// Whether dropout is on.
    pub fn is_training(&self) -> bool {
        self.decoder.training().on()
    }

    /// Its blocks' key-value caches (see [`crate::kv_cache`]).
    pub(crate) fn decoding(&self) -> &Decoding {
        self.decoder.decoding()
    }

    /// Logits `[batch, seq, vocab]` for token ids `[batch, seq]` (int64).
    pub fn forward(&self, tokens: &Tensor) -> Tensor {
        self.forward_in(tokens, None)
    }

    /// As [`Self::forward`], the tokens packed in `documents` when given
    /// ([`crate::hf::HfModel::forward_packed`]): each token's position
    /// embedding is its position in its document.
    pub(crate) fn forward_in(&self, tokens: &Tensor, documents: Option<Documents>) -> Tensor {
        (self.decoder).forward(tokens, self.cfg.embd_dropout, documents)
    }

    /// `GPT2LMHeadModel`'s loss with `labels = tokens`
    /// ([`crate::hf::causal_lm_loss`]; the head fused with it unless
    /// [`Self::set_fused_loss`] turned that off).
    pub fn loss(&self, tokens: &Tensor) -> Tensor {
        self.decoder.loss(tokens, self.cfg.embd_dropout)
    }

    /// Turns the fusing of the head with the loss on or off (on when
    /// built; [`crate::hf::HfModel::set_fused_loss`]).
    pub fn set_fused_loss(&self, on: bool) {
        self.decoder.set_fused_loss(on);
    }

    /// The causal-LM loss of `tokens`' predictions `counted` marks, the
    /// head fused with it ([`crate::blocks::Decoder::fused_loss`]).
    pub(crate) fn fused_loss(
        &self,
        tokens: &Tensor,
        documents: Option<Documents>,
        counted: (&Tensor, bool),
    ) -> Option<Tensor> {
        (self.decoder).fused_loss(tokens, (self.cfg.embd_dropout, documents), counted)
    }

    /// The sizes it was built with.
    pub fn config(&self) -> &Gpt2Config {
        &self.cfg
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hugging_faces_names_map_to_the_models_and_its_conv1d_matrices_transpose() {
        for (hf, ours) in [
            (
                "transformer.h.0.attn.c_attn.weight",
                Some("h.0.attn.c_attn.weight"),
            ),
            ("h.11.mlp.c_proj.bias", Some("h.11.mlp.c_proj.bias")),
            ("transformer.wte.weight", Some("wte.weight")),
            ("lm_head.weight", None),
            ("h.0.attn.bias", None),
            ("transformer.h.3.attn.masked_bias", None),
        ] {
            assert_eq!(hf_name(hf).as_deref(), ours, "{hf}");
        }
        for (name, conv) in [
            ("h.0.attn.c_attn.weight", true),
            ("h.0.attn.c_proj.weight", true),
            ("h.1.mlp.c_fc.weight", true),
            ("h.1.mlp.c_proj.weight", true),
            ("h.1.mlp.c_proj.bias", false),
            ("wte.weight", false),
            ("h.0.ln_1.weight", false),
        ] {
            assert_eq!(is_conv1d_weight(name), conv, "{name}");
        }
    }

    #[test]
    fn a_config_that_is_not_gpt2s_is_refused_naming_the_field() {
        let dir = std::env::temp_dir().join(format!("zrt-gpt2-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = r#"{"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": null, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05}"#;
        std::fs::write(dir.join("config.json"), good).unwrap();
        let cfg = Gpt2Config::from_hf_dir(&dir).unwrap();
        // What it writes reads back the same (dropout rates too).
        std::fs::write(dir.join("ours.json"), cfg.to_hf_json()).unwrap();
        assert_eq!(Gpt2Config::from_hf_dir(dir.join("ours.json")).unwrap(), cfg);
        let other = Gpt2Config {
            embd_dropout: 0.0,
            resid_dropout: 0.25,
            ..cfg
        };
        std::fs::write(dir.join("ours.json"), other.to_hf_json()).unwrap();
        assert_eq!(
            Gpt2Config::from_hf_dir(dir.join("ours.json")).unwrap(),
            other
        );
        assert_eq!(
            cfg,
            Gpt2Config {
                vocab: 50257,
                positions: 1024,
                width: 768,
                layers: 12,
                heads: 12,
                inner: None,
                eps: 1e-5,
                embd_dropout: 0.1,
                attn_dropout: 0.1,
                resid_dropout: 0.1,
            }
        );
        for (from, to, says) in [
            (r#""gpt2""#, r#""llama""#, "model_type \"llama\", not"),
            (
                r#""n_head": 12"#,
                r#""n_head": 7"#,
                "n_head 7 does not divide n_embd 768",
            ),
            (
                r#""n_layer": 12"#,
                r#""n_layer": "12""#,
                "`n_layer` is missing",
            ),
            (r#""gelu_new""#, r#""relu""#, "activation_function \"relu\""),
            (
                r#""n_inner": null"#,
                r#""tie_word_embeddings": false"#,
                "tie_word_embeddings is false",
            ),
            (
                r#""n_inner": null"#,
                r#""attn_pdrop": 1.0"#,
                "`attn_pdrop` is 1, not a dropout rate in [0, 1)",
            ),
        ] {
            std::fs::write(dir.join("config.json"), good.replace(from, to)).unwrap();
            let err = Gpt2Config::from_hf_dir(&dir).unwrap_err().to_string();
            assert!(err.contains(says) && err.contains("config.json"), "{err}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn unit_params_count_what_the_built_model_holds() {
        let base = Gpt2Config {
            vocab: 96,
            positions: 32,
            width: 64,
            layers: 2,
            heads: 4,
            inner: None,
            eps: 1e-5,
            embd_dropout: 0.0,
            attn_dropout: 0.0,
            resid_dropout: 0.0,
        };
        for cfg in [
            base,
            Gpt2Config {
                inner: Some(100),
                ..base
            },
        ] {
            let vs = nn::VarStore::new(tch::Device::Cpu);
            let _model = Gpt2::new(&vs.root(), &ShardPlan::new(), &cfg);
            let units = cfg.unit_params();
            let held = crate::llama::tests::held_by_unit(&vs, &units);
            assert_eq!(held, units, "{cfg:?}");
        }
    }
}
