//! Phi as Hugging Face's `transformers` lays it out (`PhiForCausalLM`:
//! Microsoft's Phi-1, Phi-1.5 and Phi-2), in tch, its layers wrapped in
//! [`ShardedModule`](crate::zero::ShardedModule): a `save_pretrained` checkpoint loads into it under
//! any ZeRO stage without a rank holding the whole model, and a
//! fine-tuned one is written back for `from_pretrained`. (Phi-3 and
//! Phi-4 are another layout, a [`crate::llama::Family`].)
//!
//! Its VarStore names are Hugging Face's own (`model.embed_tokens`,
//! `model.layers.0.self_attn.q_proj`, ..., `model.final_layernorm`,
//! `lm_head`) and its matrices `nn.Linear`'s, so a file loads as it is
//! ([`hf_weight_rules`] only skips what the model does not hold):
//!
//! ```no_run
//! use zrt::phi::{hf_weight_rules, Phi, PhiConfig};
//! use zrt::zero::ShardPlan;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = std::path::Path::new("phi-2"); // config.json, model*.safetensors
//! let cfg = PhiConfig::from_hf_dir(dir)?;
//! let vs = tch::nn::VarStore::new(tch::Device::Cpu);
//! let plan = ShardPlan::new();
//! hf_weight_rules(&plan)?;
//! plan.weights_from_file(&vs, dir)?; // no rank holds the model while it is built
//! let model = Phi::new(&vs.root(), &plan, &cfg);
//! // Engine::from_config(&vs, &plan, ...) loads each rank's shard of the file.
//! # let _ = model; Ok(()) }
//! ```
//!
//! The forward is `transformers`' (in evaluation until
//! [`Phi::set_training`] turns its dropout on): one LayerNorm a layer,
//! whose output both sublayers read side by side (`x + attn(ln(x)) +
//! mlp(ln(x))`), grouped-query attention with biases, optionally
//! LayerNorms on each head's queries and keys (`qk_layernorm`), rotary
//! embeddings on the first `partial_rotary_factor` of each head (scaled
//! as [`RopeScaling`] says), a `gelu_new` MLP, and a head with a bias.
//! Its logits match `transformers`' to the bit in fp32 here
//! (`tests/from_hf.rs`).

use std::path::Path;
use std::sync::Arc;

use tch::nn::{self, Module};
use tch::Tensor;

use crate::blocks::{layer_norm, Decoder, Ends, Training};
use crate::hf::{HfError, HfJson};
use crate::kv_cache::{Decoding, LayerCache};
use crate::llama::{pad_token, rope_scaling, rotary_dim, Activation, RopeScaling, Rotary};
use crate::lora::{Adapted, LoraConfig};
use crate::packing::Documents;
use crate::zero::{EngineError, ExportLayout, ShardPlan};

pub use crate::llama::activations::phi::{adapter_params, held_for_backward};

/// Sizes of a [`Phi`], Hugging Face's `PhiConfig` fields.
#[derive(Debug, Clone, PartialEq)]
pub struct PhiConfig {
    /// `vocab_size`.
    pub vocab: i64,
    /// `hidden_size`: the model's width.
    pub hidden: i64,
    /// `intermediate_size`: the MLP's width.
    pub intermediate: i64,
    /// `num_hidden_layers`.
    pub layers: i64,
    /// `num_attention_heads` (they divide `hidden`).
    pub heads: i64,
    /// `num_key_value_heads` (as many as the heads unless given; they
    /// divide them).
    pub kv_heads: i64,
    /// `layer_norm_eps`.
    pub eps: f64,
    /// `partial_rotary_factor`: the share of each head's dimensions the
    /// rotary embedding turns, the first ones ([`PhiConfig::rotary_dim`]).
    pub partial_rotary: f64,
    /// `rope_theta`.
    pub rope_theta: f64,
    /// `rope_scaling`.
    pub rope_scaling: RopeScaling,
    /// `max_position_embeddings` (kept for the exported config and the
    /// scalings that read it; the forward takes any length).
    pub positions: i64,
    /// `qk_layernorm`: each head's queries and keys go through a
    /// LayerNorm of their own before the rotation.
    pub qk_layernorm: bool,
    /// The MLP's activation (`hidden_act`).
    pub activation: Activation,
    /// `pad_token_id`: the embedding's row that gets no gradient from
    /// the lookup.
    pub pad_token: Option<i64>,
    /// `embd_pdrop`: dropout on the embeddings, when training.
    pub embd_dropout: f64,
    /// `resid_pdrop`: dropout on each sublayer's output, when training.
    pub resid_dropout: f64,
    /// `attention_dropout`: dropout on the attention weights, when
    /// training.
    pub attention_dropout: f64,
}

impl PhiConfig {
    /// Reads `dir/config.json` (or `dir` itself), as `transformers`'
    /// `save_pretrained` writes it: `model_type` `phi`, a field left out
    /// taking `PhiConfig`'s default (`partial_rotary_factor` 0.5,
    /// `gelu_new`, the head untied). What this model does not compute is
    /// refused naming the field: a tied head (`PhiConfig` allows one, but
    /// Phi's head has a bias the embedding has not; no release ties it),
    /// a `head_dim` other than `hidden_size / num_attention_heads`,
    /// activations [`Activation`] has not, rotary dimensions that are not
    /// whole pairs, the rope scalings [`crate::llama::LlamaConfig`] refuses.
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self, HfError> {
        Self::from_json(&HfJson::read(dir.as_ref(), Some("phi"))?)
    }

    /// As [`PhiConfig::from_hf_dir`], from a config already read.
    pub(crate) fn from_json(j: &HfJson) -> Result<Self, HfError> {
        if j.flag_or("tie_word_embeddings", false)? {
            return Err(j.field(
                "tie_word_embeddings true: this Phi's head is a matrix of its own, with a bias"
                    .into(),
            ));
        }
        let (hidden, heads) = (j.size("hidden_size")?, j.size("num_attention_heads")?);
        if hidden % heads != 0 {
            return Err(j.field(format!(
                "num_attention_heads {heads} does not divide hidden_size {hidden}"
            )));
        }
        let head_dim = hidden / heads;
        if let Some(d) = j.size_or_none("head_dim")?.filter(|&d| d != head_dim) {
            return Err(j.field(format!(
                "head_dim {d}: this Phi's heads are hidden_size / num_attention_heads = {head_dim} wide"
            )));
        }
        let kv_heads = (j.size_or_none("num_key_value_heads")?).unwrap_or(heads);
        if heads % kv_heads != 0 {
            return Err(j.field(format!(
                "num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}"
            )));
        }
        let partial = j.number_or("partial_rotary_factor", 0.5)?;
        let turned = rotary_dim(head_dim, partial);
        if turned % 2 != 0 || turned <= 0 || turned > head_dim {
            return Err(j.field(format!(
                "partial_rotary_factor {partial} of a head's {head_dim} dimensions is {turned}: rotary embeddings turn pairs of a head's"
            )));
        }
        let vocab = j.size("vocab_size")?;
        Ok(Self {
            vocab,
            hidden,
            intermediate: j.size("intermediate_size")?,
            layers: j.size("num_hidden_layers")?,
            heads,
            kv_heads,
            eps: j.number_or("layer_norm_eps", 1e-5)?,
            partial_rotary: partial,
            rope_theta: j.number_or("rope_theta", 10000.0)?,
            rope_scaling: rope_scaling(j, "phi", turned)?,
            positions: (j.size_or_none("max_position_embeddings")?).unwrap_or(2048),
            qk_layernorm: j.flag_or("qk_layernorm", false)?,
            activation: Activation::read(j, "hidden_act", Activation::GeluNew, "Phi")?,
            pad_token: pad_token(j, None, vocab)?,
            embd_dropout: j.rate_or("embd_pdrop", 0.0)?,
            resid_dropout: j.rate_or("resid_pdrop", 0.0)?,
            attention_dropout: j.rate_or("attention_dropout", 0.0)?,
        })
    }

    /// Each head's width.
    pub fn head_dim(&self) -> i64 {
        self.hidden / self.heads
    }

    /// The dimensions of each head the rotary embedding turns: `head_dim`
    /// times `partial_rotary_factor`, truncated as `transformers` does.
    pub fn rotary_dim(&self) -> i64 {
        rotary_dim(self.head_dim(), self.partial_rotary)
    }

    /// The parameters of each unit a [`Phi`] wraps, by its name
    /// (`model.embed_tokens`, `model.layers.0`, ..., `lm_head`), and last
    /// the root's (`model.final_layernorm`) under `""`: counted from the
    /// sizes, nothing built.
    pub fn unit_params(&self) -> Vec<(String, u64)> {
        let (v, d, i, hd) = (
            self.vocab as u64,
            self.hidden as u64,
            self.intermediate as u64,
            self.head_dim() as u64,
        );
        let (q, kv) = (self.heads as u64 * hd, self.kv_heads as u64 * hd);
        let qk_norms = if self.qk_layernorm { 2 * 2 * hd } else { 0 };
        // A LayerNorm, the four projections with biases, the MLP.
        let layer = 2 * d
            + (d * q + q)
            + 2 * (d * kv + kv)
            + (q * d + d)
            + qk_norms
            + (d * i + i)
            + (i * d + d);
        let mut units = vec![("model.embed_tokens".to_string(), v * d)];
        units.extend((0..self.layers).map(|l| (format!("model.layers.{l}"), layer)));
        units.push(("lm_head".to_string(), v * d + v));
        units.push((String::new(), 2 * d));
        units
    }

    /// The `config.json` `transformers` reads this model from.
    pub fn to_hf_json(&self) -> String {
        let json = serde_json::json!({
            "model_type": "phi",
            "architectures": ["PhiForCausalLM"],
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "hidden_act": self.activation.name(),
            "layer_norm_eps": self.eps,
            "partial_rotary_factor": self.partial_rotary,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_json(false),
            "max_position_embeddings": self.positions,
            "qk_layernorm": self.qk_layernorm,
            "pad_token_id": self.pad_token,
            "tie_word_embeddings": false,
            "embd_pdrop": self.embd_dropout,
            "resid_pdrop": self.resid_dropout,
            "attention_dropout": self.attention_dropout,
        });
        format!("{json:#}\n")
    }
}

/// The [`Phi`] VarStore name of a tensor of a Hugging Face Phi
/// checkpoint (its own), or `None` for older checkpoints' rotary buffers
/// (`rotary_emb.inv_freq`), which the model does not hold. A file
/// written from the base model (`PhiModel`) names its tensors without
/// `model.`, which is added as `from_pretrained` adds it.
pub fn hf_name(name: &str) -> Option<String> {
    let name = crate::hf::under_base(name, "model", &["lm_head."]);
    (!name.ends_with("rotary_emb.inv_freq")).then(|| name.into_owned())
}

/// Sets `plan`'s rename rule for a Hugging Face Phi checkpoint
/// ([`hf_name`]). Call it on every rank before the engine is built.
pub fn hf_weight_rules(plan: &ShardPlan) -> Result<(), EngineError> {
    plan.rename_weights(hf_name)
}

/// Hugging Face's layout for an export of a [`Phi`]
/// ([`Engine::save_16bit_model_as`](crate::zero::Engine::save_16bit_model_as)):
/// its own names, and `cfg`'s `config.json` beside them, so that
/// `PhiForCausalLM.from_pretrained(dir)` loads it.
pub fn hf_export_layout(cfg: &PhiConfig) -> ExportLayout {
    ExportLayout::new().with_file("config.json", cfg.to_hf_json())
}

/// One Phi layer: `attn(ln(x)) + mlp(ln(x)) + x`.
#[derive(Debug)]
pub struct Layer {
    input_layernorm: nn::LayerNorm,
    q_proj: Adapted,
    k_proj: Adapted,
    v_proj: Adapted,
    dense: Adapted,
    /// `qk_layernorm`'s norms of each head's queries and keys.
    qk_layernorm: Option<(nn::LayerNorm, nn::LayerNorm)>,
    fc1: Adapted,
    fc2: Adapted,
    rotary: Rotary,
    /// Its keys (turned) and values while generating with a cache.
    cache: LayerCache,
    training: Training,
    cfg: PhiConfig,
}

impl Layer {
    /// The layer under `p`.
    fn new(
        p: &nn::Path,
        c: &PhiConfig,
        (training, decoding): (&Training, &Arc<Decoding>),
        lora: Option<&LoraConfig>,
    ) -> Self {
        let (d, hd) = (c.hidden, c.head_dim());
        let rotary = Rotary::new(
            c.rotary_dim(),
            c.rope_theta,
            &c.rope_scaling,
            c.positions,
            p.device(),
        );
        // Every projection has a bias.
        let biased = |p: nn::Path, i: i64, o: i64| Adapted::new(&p, (i, o, true), lora, training);
        let (a, m) = (p / "self_attn", p / "mlp");
        Self {
            input_layernorm: layer_norm(p / "input_layernorm", d, c.eps),
            q_proj: biased(&a / "q_proj", d, c.heads * hd),
            k_proj: biased(&a / "k_proj", d, c.kv_heads * hd),
            v_proj: biased(&a / "v_proj", d, c.kv_heads * hd),
            dense: biased(&a / "dense", c.heads * hd, d),
            qk_layernorm: c.qk_layernorm.then(|| {
                (
                    layer_norm(&a / "q_layernorm", hd, c.eps),
                    layer_norm(&a / "k_layernorm", hd, c.eps),
                )
            }),
            fc1: biased(&m / "fc1", d, c.intermediate),
            fc2: biased(&m / "fc2", c.intermediate, d),
            cache: LayerCache::new(decoding, rotary.fixed_up_to()),
            rotary,
            training: training.clone(),
            cfg: c.clone(),
        }
    }

    /// The attention's output for the normalised `h` `[batch, seq,
    /// hidden]`, dropped out at `resid_pdrop` when training.
    fn attention(&self, h: &Tensor) -> Tensor {
        let (c, t) = (&self.cfg, &self.training);
        let (b, s, _) = h.size3().unwrap_or((1, 1, 1));
        let hd = c.head_dim();
        let heads = |x: Tensor, n: i64| x.view([b, s, n, hd]).transpose(1, 2);
        let q = heads(self.q_proj.forward(h), c.heads);
        let k = heads(self.k_proj.forward(h), c.kv_heads);
        let v = heads(self.v_proj.forward(h), c.kv_heads);
        let (q, k) = match &self.qk_layernorm {
            Some((qn, kn)) => (qn.forward(&q), kn.forward(&k)),
            None => (q, k),
        };
        let dropout = t.attention(c.attention_dropout);
        let grouped = c.kv_heads != c.heads;
        let a = (self.cache).rotary_attention(&self.rotary, (q, k, v), dropout, grouped);
        let a = a.transpose(1, 2).contiguous().view([b, s, c.heads * hd]);
        t.dropout(self.dense.forward(&a), c.resid_dropout)
    }
}

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> Tensor {
        let c = &self.cfg;
        let h = self.input_layernorm.forward(x);
        // The attention's output dropped out before the MLP runs, and
        // the sum in `transformers`' order, as its layer does both.
        let a = self.attention(&h);
        let m = c.activation.apply(&self.fc1.forward(&h));
        let m = (self.training).dropout(self.fc2.forward(&m), c.resid_dropout);
        a + m + x
    }
}

/// Phi with a language-modelling head (`PhiForCausalLM`).
#[derive(Debug)]
pub struct Phi {
    decoder: Decoder<Layer>,
    cfg: PhiConfig,
}

impl Phi {
    /// Builds the model under `p` with Hugging Face's names, each layer
    /// (`model.layers.0`, ...) a unit of `plan`; the token embedding
    /// (`model.embed_tokens`) and the head (`lm_head`, with its bias) are
    /// units of their own (the largest matrices), the final norm forms
    /// the root. Values are tch's initialisation: a pretrained model's
    /// come from its file.
    pub fn new(p: &nn::Path, plan: &ShardPlan, cfg: &PhiConfig) -> Self {
        Self::build(p, plan, cfg, false, None)
    }

    /// As [`Phi::new`], every layer's activations recomputed in backward
    /// (`transformers`' `gradient_checkpointing_enable()`): the same
    /// results, less memory, one more layer forward per backward.
    pub fn new_checkpointed(p: &nn::Path, plan: &ShardPlan, cfg: &PhiConfig) -> Self {
        Self::build(p, plan, cfg, true, None)
    }

    /// As [`Phi::new`] (or [`Phi::new_checkpointed`] when
    /// `checkpointed`), each linear layer of the layers that `lora`
    /// targets with a LoRA adapter ([`crate::llama::Llama::with_lora`]'s).
    pub fn with_lora(
        p: &nn::Path,
        plan: &ShardPlan,
        cfg: &PhiConfig,
        lora: &LoraConfig,
        checkpointed: bool,
    ) -> Self {
        Self::build(p, plan, cfg, checkpointed, Some(lora))
    }

    fn build(
        p: &nn::Path,
        plan: &ShardPlan,
        cfg: &PhiConfig,
        checkpointed: bool,
        lora: Option<&LoraConfig>,
    ) -> Self {
        let m = p / "model";
        let norm = layer_norm(&m / "final_layernorm", cfg.hidden, cfg.eps);
        let embed = &m / "embed_tokens";
        let dims = (cfg.vocab, cfg.hidden);
        let embed = Ends::embedding(plan, &embed, dims, (cfg.pad_token, false), lora);
        let layer =
            |lp: &nn::Path, t: &Training, d: &Arc<Decoding>| Layer::new(lp, cfg, (t, d), lora);
        let (layers, head) = (&m / "layers", p / "lm_head");
        Self {
            decoder: Decoder::build(
                plan,
                norm,
                embed,
                &layers,
                cfg.layers,
                layer,
                checkpointed,
                (&head, true, lora),
            ),
            cfg: cfg.clone(),
        }
    }

    /// Turns dropout (`embd_pdrop`, `resid_pdrop`, `attention_dropout`)
    /// on or off: PyTorch's `model.train()` and `model.eval()`. Off when
    /// built, as `from_pretrained` returns a model in evaluation.
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

    /// Its layers' key-value caches (see [`crate::kv_cache`]).
    pub(crate) fn decoding(&self) -> &Decoding {
        self.decoder.decoding()
    }

    /// Logits `[batch, seq, vocab]` for token ids `[batch, seq]` (int64).
    pub fn forward(&self, tokens: &Tensor) -> Tensor {
        self.forward_in(tokens, None)
    }

    /// As [`Self::forward`], the tokens packed in `documents` when given
    /// ([`crate::hf::HfModel::forward_packed`]).
    pub(crate) fn forward_in(&self, tokens: &Tensor, documents: Option<Documents>) -> Tensor {
        self.decoder
            .forward(tokens, self.cfg.embd_dropout, documents)
    }

    /// `PhiForCausalLM`'s loss with `labels = tokens`
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
    pub fn config(&self) -> &PhiConfig {
        &self.cfg
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Phi-2's `config.json`, as its repository holds it.
    const PHI2: &str = r#"{"_name_or_path": "microsoft/phi-2", "architectures": ["PhiForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 50256, "embd_pdrop": 0.0, "eos_token_id": 50256, "hidden_act": "gelu_new", "hidden_size": 2560, "initializer_range": 0.02, "intermediate_size": 10240, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "model_type": "phi", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "partial_rotary_factor": 0.4, "qk_layernorm": false, "resid_pdrop": 0.1, "rope_scaling": null, "rope_theta": 10000.0, "tie_word_embeddings": false, "torch_dtype": "float16", "transformers_version": "4.37.0", "use_cache": true, "vocab_size": 51200}"#;

    fn phi2() -> PhiConfig {
        PhiConfig {
            vocab: 51200,
            hidden: 2560,
            intermediate: 10240,
            layers: 32,
            heads: 32,
            kv_heads: 32,
            eps: 1e-5,
            partial_rotary: 0.4,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::None,
            positions: 2048,
            qk_layernorm: false,
            activation: Activation::GeluNew,
            pad_token: None,
            embd_dropout: 0.0,
            resid_dropout: 0.1,
            attention_dropout: 0.0,
        }
    }

    #[test]
    fn a_checkpoints_names_are_the_models_but_its_rotary_buffers() {
        for (name, ours) in [
            ("model.layers.0.self_attn.q_proj.weight", true),
            ("model.layers.0.self_attn.dense.bias", true),
            ("lm_head.bias", true),
            ("model.final_layernorm.weight", true),
            ("model.layers.3.self_attn.rotary_emb.inv_freq", false),
        ] {
            assert_eq!(hf_name(name), ours.then(|| name.to_string()), "{name}");
        }
    }

    #[test]
    fn phi2s_config_reads_back_and_what_the_model_does_not_compute_is_refused() {
        let dir = std::env::temp_dir().join(format!("zrt-phi-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let read = |text: &str| {
            std::fs::write(dir.join("config.json"), text).unwrap();
            PhiConfig::from_hf_dir(&dir)
        };
        let cfg = read(PHI2).unwrap();
        assert_eq!(cfg, phi2());
        // Phi-2 turns 32 of each head's 80 dimensions.
        assert_eq!((cfg.head_dim(), cfg.rotary_dim()), (80, 32));
        let other = PhiConfig {
            kv_heads: 8,
            qk_layernorm: true,
            partial_rotary: 1.0,
            rope_scaling: RopeScaling::Dynamic { factor: 2.0 },
            activation: Activation::Gelu,
            pad_token: Some(3),
            embd_dropout: 0.2,
            ..phi2()
        };
        for c in [cfg, other] {
            assert_eq!(read(&c.to_hf_json()).unwrap(), c);
        }
        for (from, to, says) in [
            (
                r#""model_type": "phi""#,
                r#""model_type": "phi3""#,
                "model_type \"phi3\", not",
            ),
            (
                r#""tie_word_embeddings": false"#,
                r#""tie_word_embeddings": true"#,
                "tie_word_embeddings true",
            ),
            (
                r#""num_key_value_heads": 32"#,
                r#""num_key_value_heads": 5"#,
                "num_key_value_heads 5 does not divide num_attention_heads 32",
            ),
            (
                r#""num_key_value_heads": 32"#,
                r#""head_dim": 64"#,
                "head_dim 64: this Phi's heads are hidden_size / num_attention_heads = 80 wide",
            ),
            (
                r#""partial_rotary_factor": 0.4"#,
                r#""partial_rotary_factor": 0.01"#,
                "partial_rotary_factor 0.01 of a head's 80 dimensions is 0",
            ),
            (r#""gelu_new""#, r#""relu6""#, "hidden_act \"relu6\""),
            (
                r#""use_cache": true"#,
                r#""pad_token_id": 51200"#,
                "pad_token_id 51200 is not a token id",
            ),
        ] {
            let err = read(&PHI2.replace(from, to)).unwrap_err().to_string();
            assert!(err.contains(says) && err.contains("config.json"), "{err}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn unit_params_count_what_the_built_model_holds() {
        let small = PhiConfig {
            vocab: 96,
            hidden: 64,
            intermediate: 200,
            layers: 2,
            heads: 4,
            kv_heads: 4,
            ..phi2()
        };
        let others = PhiConfig {
            kv_heads: 2,
            qk_layernorm: true,
            ..small.clone()
        };
        for cfg in [small, others] {
            let vs = nn::VarStore::new(tch::Device::Cpu);
            let _model = Phi::new(&vs.root(), &ShardPlan::new(), &cfg);
            let units = cfg.unit_params();
            let held = crate::llama::tests::held_by_unit(&vs, &units);
            assert_eq!(held, units, "{cfg:?}");
        }
    }
}
