//! GPT-NeoX as Hugging Face's `transformers` lays it out
//! (`GPTNeoXForCausalLM`: EleutherAI's Pythia suite, GPT-NeoX-20B), in
//! tch, its layers wrapped in [`ShardedModule`](crate::zero::ShardedModule): a `save_pretrained`
//! checkpoint loads into it under any ZeRO stage without a rank holding
//! the whole model, and a fine-tuned one is written back for
//! `from_pretrained`.
//!
//! Its VarStore names are Hugging Face's own (`gpt_neox.embed_in`,
//! `gpt_neox.layers.0.attention.query_key_value`, ...,
//! `gpt_neox.final_layer_norm`, `embed_out`) and its matrices
//! `nn.Linear`'s, so a file loads as it is ([`hf_weight_rules`] only
//! skips what the model does not hold):
//!
//! ```no_run
//! use zrt::gpt_neox::{hf_weight_rules, GptNeox, GptNeoxConfig};
//! use zrt::zero::ShardPlan;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = std::path::Path::new("pythia-160m"); // config.json, model*.safetensors
//! let cfg = GptNeoxConfig::from_hf_dir(dir)?;
//! let vs = tch::nn::VarStore::new(tch::Device::Cpu);
//! let plan = ShardPlan::new();
//! hf_weight_rules(&plan, &cfg)?;
//! plan.weights_from_file(&vs, dir)?; // no rank holds the model while it is built
//! let model = GptNeox::new(&vs.root(), &plan, &cfg);
//! // Engine::from_config(&vs, &plan, ...) loads each rank's shard of the file.
//! # let _ = model; Ok(()) }
//! ```
//!
//! The forward is `transformers`' (in evaluation until
//! [`GptNeox::set_training`] turns its dropout on): LayerNorms with
//! biases, one projection for the queries, keys and values laid out
//! head by head (`[heads, 3, head_dim]` in its rows), rotary embeddings
//! on the first `rotary_pct` of each head's dimensions (scaled as
//! [`RopeScaling`] says), causal attention, a GELU MLP with biases, and
//! the two sublayers side by side (`x + attn(ln1(x)) + mlp(ln2(x))`,
//! `use_parallel_residual`, as in every Pythia) or one after the other.
//! Its logits match `transformers`' to the bit in fp32 here
//! (`tests/from_hf.rs`).

use std::path::Path;
use std::sync::Arc;

use tch::nn::{self, Module};
use tch::Tensor;

use crate::blocks::{layer_norm, Decoder, Ends, Training};
use crate::hf::{HfError, HfJson};
use crate::kv_cache::{Decoding, LayerCache};
use crate::llama::{rope_scaling, rotary_dim, Activation, RopeScaling, Rotary};
use crate::lora::{Adapted, LoraConfig};
use crate::packing::Documents;
use crate::zero::{EngineError, ExportLayout, ShardPlan};

pub use crate::llama::activations::gpt_neox::{adapter_params, held_for_backward};

/// Sizes of a [`GptNeox`], Hugging Face's `GPTNeoXConfig` fields.
#[derive(Debug, Clone, PartialEq)]
pub struct GptNeoxConfig {
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
    /// `layer_norm_eps`.
    pub eps: f64,
    /// `rotary_pct`: the share of each head's dimensions the rotary
    /// embedding turns, the first ones ([`GptNeoxConfig::rotary_dim`]).
    pub rotary_pct: f64,
    /// `rotary_emb_base`: the rotary embedding's base.
    pub rope_theta: f64,
    /// `rope_scaling`.
    pub rope_scaling: RopeScaling,
    /// `max_position_embeddings` (kept for the exported config and the
    /// scalings that read it; the forward takes any length).
    pub positions: i64,
    /// `use_parallel_residual`: `x + attn(ln1(x)) + mlp(ln2(x))`, else
    /// `x + attn(ln1(x))`, then that plus `mlp(ln2(.))` of it.
    pub parallel_residual: bool,
    /// `attention_bias`: the attention's two projections have biases
    /// (the MLP's always do).
    pub attention_bias: bool,
    /// `tie_word_embeddings`: the head (`embed_out`) is the token
    /// embedding (`embed_in`).
    pub tied: bool,
    /// The MLP's activation (`hidden_act`).
    pub activation: Activation,
    /// `attention_dropout`: dropout on the attention weights, when
    /// training.
    pub attention_dropout: f64,
    /// `hidden_dropout`: dropout on the embeddings and on each
    /// sublayer's output, when training.
    pub hidden_dropout: f64,
}

impl GptNeoxConfig {
    /// Reads `dir/config.json` (or `dir` itself), as `transformers`'
    /// `save_pretrained` writes it: `model_type` `gpt_neox`, a field left
    /// out taking `GPTNeoXConfig`'s default (`rotary_pct` 0.25, a GELU,
    /// parallel residuals, biases, the head untied). What this model does
    /// not compute is refused naming the field: activations but `gelu`,
    /// `silu`, `gelu_pytorch_tanh` and `gelu_new`, rotary dimensions that are not
    /// whole pairs, the rope scalings [`crate::llama::LlamaConfig`]
    /// refuses.
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self, HfError> {
        Self::from_json(&HfJson::read(dir.as_ref(), Some("gpt_neox"))?)
    }

    /// As [`GptNeoxConfig::from_hf_dir`], from a config already read.
    pub(crate) fn from_json(j: &HfJson) -> Result<Self, HfError> {
        let activation = Activation::read(j, "hidden_act", Activation::Gelu, "GPT-NeoX")?;
        let (hidden, heads) = (j.size("hidden_size")?, j.size("num_attention_heads")?);
        if hidden % heads != 0 {
            return Err(j.field(format!(
                "num_attention_heads {heads} does not divide hidden_size {hidden}"
            )));
        }
        // `GPTNeoXConfig` sets `partial_rotary_factor` and `rope_theta`
        // from these two, whatever else the file says.
        let rotary_pct = j.number_or("rotary_pct", 0.25)?;
        let turned = rotary_dim(hidden / heads, rotary_pct);
        if turned % 2 != 0 || turned <= 0 || turned > hidden / heads {
            return Err(j.field(format!(
                "rotary_pct {rotary_pct} of a head's {} dimensions is {turned}: rotary embeddings turn pairs of a head's",
                hidden / heads
            )));
        }
        Ok(Self {
            vocab: j.size("vocab_size")?,
            hidden,
            intermediate: j.size("intermediate_size")?,
            layers: j.size("num_hidden_layers")?,
            heads,
            eps: j.number_or("layer_norm_eps", 1e-5)?,
            rotary_pct,
            rope_theta: j.number_or("rotary_emb_base", 10000.0)?,
            rope_scaling: rope_scaling(j, "gpt_neox", turned)?,
            positions: (j.size_or_none("max_position_embeddings")?).unwrap_or(2048),
            parallel_residual: j.flag_or("use_parallel_residual", true)?,
            attention_bias: j.flag_or("attention_bias", true)?,
            tied: j.flag_or("tie_word_embeddings", false)?,
            activation,
            attention_dropout: j.rate_or("attention_dropout", 0.0)?,
            hidden_dropout: j.rate_or("hidden_dropout", 0.0)?,
        })
    }

    /// Each head's width.
    pub fn head_dim(&self) -> i64 {
        self.hidden / self.heads
    }

    /// The dimensions of each head the rotary embedding turns:
    /// `head_dim` times `rotary_pct`, truncated as `transformers` does.
    pub fn rotary_dim(&self) -> i64 {
        rotary_dim(self.head_dim(), self.rotary_pct)
    }

    /// The parameters of each unit a [`GptNeox`] wraps, by its name
    /// (`gpt_neox.embed_in`, the head too when tied;
    /// `gpt_neox.layers.0`, ...; `embed_out` when untied), and last the
    /// root's (`gpt_neox.final_layer_norm`) under `""`: counted from the
    /// sizes, nothing built.
    pub fn unit_params(&self) -> Vec<(String, u64)> {
        let (v, d, i) = (
            self.vocab as u64,
            self.hidden as u64,
            self.intermediate as u64,
        );
        let bias = |n: u64| if self.attention_bias { n } else { 0 };
        // Two LayerNorms, the fused projection and the output one, the MLP.
        let layer =
            2 * 2 * d + (d * 3 * d + bias(3 * d)) + (d * d + bias(d)) + (d * i + i) + (i * d + d);
        let mut units = vec![("gpt_neox.embed_in".to_string(), v * d)];
        units.extend((0..self.layers).map(|l| (format!("gpt_neox.layers.{l}"), layer)));
        if !self.tied {
            units.push(("embed_out".to_string(), v * d));
        }
        units.push((String::new(), 2 * d));
        units
    }

    /// The `config.json` `transformers` reads this model from.
    pub fn to_hf_json(&self) -> String {
        let json = serde_json::json!({
            "model_type": "gpt_neox",
            "architectures": ["GPTNeoXForCausalLM"],
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "hidden_act": self.activation.name(),
            "layer_norm_eps": self.eps,
            "rotary_pct": self.rotary_pct,
            "rotary_emb_base": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_json(false),
            "max_position_embeddings": self.positions,
            "use_parallel_residual": self.parallel_residual,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tied,
            "attention_dropout": self.attention_dropout,
            "hidden_dropout": self.hidden_dropout,
        });
        format!("{json:#}\n")
    }
}

/// The [`GptNeox`] VarStore name of a tensor of a Hugging Face GPT-NeoX
/// checkpoint (its own), or `None` for what the model does not hold:
/// older checkpoints' attention mask and rotary buffers
/// (`attention.bias`, `attention.masked_bias`, `rotary_emb.inv_freq`)
/// and, when the head is tied, a written-out `embed_out.weight`. A file
/// written from the base model (`GPTNeoXModel`) names its tensors
/// without `gpt_neox.`, which is added as `from_pretrained` adds it.
pub fn hf_name(name: &str, tied: bool) -> Option<String> {
    let name = crate::hf::under_base(name, "gpt_neox", &["embed_out."]);
    let skipped = [
        ".attention.bias",
        ".attention.masked_bias",
        "rotary_emb.inv_freq",
    ]
    .iter()
    .any(|s| name.ends_with(s))
        || (tied && name == "embed_out.weight");
    (!skipped).then(|| name.into_owned())
}

/// Sets `plan`'s rename rule for a Hugging Face GPT-NeoX checkpoint
/// ([`hf_name`]). Call it on every rank before the engine is built.
pub fn hf_weight_rules(plan: &ShardPlan, cfg: &GptNeoxConfig) -> Result<(), EngineError> {
    let tied = cfg.tied;
    plan.rename_weights(move |n| hf_name(n, tied))
}

/// Hugging Face's layout for an export of a [`GptNeox`]
/// ([`Engine::save_16bit_model_as`](crate::zero::Engine::save_16bit_model_as)):
/// its own names, and `cfg`'s `config.json` beside them, so that
/// `GPTNeoXForCausalLM.from_pretrained(dir)` loads it.
pub fn hf_export_layout(cfg: &GptNeoxConfig) -> ExportLayout {
    ExportLayout::new().with_file("config.json", cfg.to_hf_json())
}

/// One GPT-NeoX layer ([`GptNeoxConfig::parallel_residual`] says how
/// its two sublayers join the residual).
#[derive(Debug)]
pub struct Layer {
    input_layernorm: nn::LayerNorm,
    post_attention_layernorm: nn::LayerNorm,
    /// The queries', keys' and values' rows, head by head: each head's
    /// query, key and value rows one after the other.
    query_key_value: Adapted,
    dense: Adapted,
    dense_h_to_4h: Adapted,
    dense_4h_to_h: Adapted,
    rotary: Rotary,
    /// Its keys (turned) and values while generating with a cache.
    cache: LayerCache,
    training: Training,
    cfg: GptNeoxConfig,
}

impl Layer {
    /// The layer under `p`.
    fn new(
        p: &nn::Path,
        c: &GptNeoxConfig,
        (training, decoding): (&Training, &Arc<Decoding>),
        lora: Option<&LoraConfig>,
    ) -> Self {
        let lin = |p: nn::Path, i, o, bias| Adapted::new(&p, (i, o, bias), lora, training);
        let rotary = Rotary::new(
            c.rotary_dim(),
            c.rope_theta,
            &c.rope_scaling,
            c.positions,
            p.device(),
        );
        let (d, i) = (c.hidden, c.intermediate);
        let ln = |name: &str| layer_norm(p / name, d, c.eps);
        let (a, m) = (p / "attention", p / "mlp");
        Self {
            input_layernorm: ln("input_layernorm"),
            post_attention_layernorm: ln("post_attention_layernorm"),
            query_key_value: lin(&a / "query_key_value", d, 3 * d, c.attention_bias),
            dense: lin(&a / "dense", d, d, c.attention_bias),
            dense_h_to_4h: lin(&m / "dense_h_to_4h", d, i, true),
            dense_4h_to_h: lin(&m / "dense_4h_to_h", i, d, true),
            cache: LayerCache::new(decoding, rotary.fixed_up_to()),
            rotary,
            training: training.clone(),
            cfg: c.clone(),
        }
    }

    /// The attention's output for the normalised `h` `[batch, seq,
    /// hidden]`, dropped out at `hidden_dropout` when training.
    fn attention(&self, h: &Tensor) -> Tensor {
        let (c, t) = (&self.cfg, &self.training);
        let (b, s, d) = h.size3().unwrap_or((1, 1, 1));
        let hd = c.head_dim();
        // Each head's query, key and value rows are together:
        // `[batch, heads, seq, 3 * hd]`, then split.
        let qkv = (self.query_key_value.forward(h))
            .view([b, s, c.heads, 3 * hd])
            .transpose(1, 2);
        let (q, k, v) = (
            qkv.narrow(-1, 0, hd),
            qkv.narrow(-1, hd, hd),
            qkv.narrow(-1, 2 * hd, hd),
        );
        let dropout = t.attention(c.attention_dropout);
        let a = (self.cache).rotary_attention(&self.rotary, (q, k, v), dropout, false);
        let a = a.transpose(1, 2).contiguous().view([b, s, d]);
        t.dropout(self.dense.forward(&a), c.hidden_dropout)
    }

    /// The MLP's output for the normalised `h`, dropped out at
    /// `hidden_dropout` when training.
    fn mlp(&self, h: &Tensor) -> Tensor {
        let c = &self.cfg;
        let m = c.activation.apply(&self.dense_h_to_4h.forward(h));
        (self.training).dropout(self.dense_4h_to_h.forward(&m), c.hidden_dropout)
    }
}

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> Tensor {
        // Added in `transformers`' order (float sums depend on it), the
        // attention's output dropped out before the MLP runs, as there.
        let a = self.attention(&self.input_layernorm.forward(x));
        match self.cfg.parallel_residual {
            true => {
                let m = self.mlp(&self.post_attention_layernorm.forward(x));
                m + a + x
            }
            false => {
                let a = a + x;
                let m = self.mlp(&self.post_attention_layernorm.forward(&a));
                m + a
            }
        }
    }
}

/// GPT-NeoX with a language-modelling head (`GPTNeoXForCausalLM`).
#[derive(Debug)]
pub struct GptNeox {
    decoder: Decoder<Layer>,
    cfg: GptNeoxConfig,
}

impl GptNeox {
    /// Builds the model under `p` with Hugging Face's names, each layer
    /// (`gpt_neox.layers.0`, ...) a unit of `plan`; the token embedding
    /// (`gpt_neox.embed_in`, the head too when tied, run at both ends)
    /// and an untied head (`embed_out`) are units of their own (the
    /// largest matrices), the final norm forms the root. Values are
    /// tch's initialisation: a pretrained model's come from its file.
    pub fn new(p: &nn::Path, plan: &ShardPlan, cfg: &GptNeoxConfig) -> Self {
        Self::build(p, plan, cfg, false, None)
    }

    /// As [`GptNeox::new`], every layer's activations recomputed in
    /// backward (`transformers`' `gradient_checkpointing_enable()`): the
    /// same results, less memory, one more layer forward per backward.
    pub fn new_checkpointed(p: &nn::Path, plan: &ShardPlan, cfg: &GptNeoxConfig) -> Self {
        Self::build(p, plan, cfg, true, None)
    }

    /// As [`GptNeox::new`] (or [`GptNeox::new_checkpointed`] when
    /// `checkpointed`), each linear layer of the layers that `lora`
    /// targets with a LoRA adapter ([`crate::llama::Llama::with_lora`]'s).
    pub fn with_lora(
        p: &nn::Path,
        plan: &ShardPlan,
        cfg: &GptNeoxConfig,
        lora: &LoraConfig,
        checkpointed: bool,
    ) -> Self {
        Self::build(p, plan, cfg, checkpointed, Some(lora))
    }

    fn build(
        p: &nn::Path,
        plan: &ShardPlan,
        cfg: &GptNeoxConfig,
        checkpointed: bool,
        lora: Option<&LoraConfig>,
    ) -> Self {
        let m = p / "gpt_neox";
        let norm = layer_norm(&m / "final_layer_norm", cfg.hidden, cfg.eps);
        let embed_in = &m / "embed_in";
        // `GPTNeoXModel`'s embedding has no `padding_idx`.
        let dims = (cfg.vocab, cfg.hidden);
        let embed = Ends::embedding(plan, &embed_in, dims, (None, cfg.tied), lora);
        let layer =
            |lp: &nn::Path, t: &Training, d: &Arc<Decoding>| Layer::new(lp, cfg, (t, d), lora);
        let (layers, head) = (&m / "layers", p / "embed_out");
        Self {
            decoder: Decoder::build(
                plan,
                norm,
                embed,
                &layers,
                cfg.layers,
                layer,
                checkpointed,
                (&head, false, lora),
            ),
            cfg: cfg.clone(),
        }
    }

    /// Turns dropout (`attention_dropout`, `hidden_dropout`) on or off:
    /// PyTorch's `model.train()` and `model.eval()`. Off when built, as
    /// `from_pretrained` returns a model in evaluation.
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
            .forward(tokens, self.cfg.hidden_dropout, documents)
    }

    /// `GPTNeoXForCausalLM`'s loss with `labels = tokens`
    /// ([`crate::hf::causal_lm_loss`]; the head fused with it unless
    /// [`Self::set_fused_loss`] turned that off).
    pub fn loss(&self, tokens: &Tensor) -> Tensor {
        self.decoder.loss(tokens, self.cfg.hidden_dropout)
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
        (self.decoder).fused_loss(tokens, (self.cfg.hidden_dropout, documents), counted)
    }

    /// The sizes it was built with.
    pub fn config(&self) -> &GptNeoxConfig {
        &self.cfg
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pythia-70M's `config.json`, as its repository holds it.
    const PYTHIA: &str = r#"{"architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu", "hidden_size": 512, "initializer_range": 0.02, "intermediate_size": 2048, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 8, "num_hidden_layers": 6, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": false, "torch_dtype": "float16", "transformers_version": "4.24.0", "use_cache": true, "use_parallel_residual": true, "vocab_size": 50304}"#;

    fn pythia() -> GptNeoxConfig {
        GptNeoxConfig {
            vocab: 50304,
            hidden: 512,
            intermediate: 2048,
            layers: 6,
            heads: 8,
            eps: 1e-5,
            rotary_pct: 0.25,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::None,
            positions: 2048,
            parallel_residual: true,
            attention_bias: true,
            tied: false,
            activation: Activation::Gelu,
            attention_dropout: 0.0,
            hidden_dropout: 0.0,
        }
    }

    #[test]
    fn a_checkpoints_names_are_the_models_but_its_buffers_and_a_tied_head() {
        for (name, tied, ours) in [
            (
                "gpt_neox.layers.0.attention.query_key_value.weight",
                false,
                true,
            ),
            ("gpt_neox.embed_in.weight", true, true),
            ("embed_out.weight", false, true),
            ("embed_out.weight", true, false),
            ("gpt_neox.layers.3.attention.bias", false, false),
            ("gpt_neox.layers.3.attention.masked_bias", false, false),
            (
                "gpt_neox.layers.3.attention.rotary_emb.inv_freq",
                false,
                false,
            ),
            ("gpt_neox.layers.3.attention.dense.bias", false, true),
        ] {
            let want = ours.then(|| name.to_string());
            assert_eq!(hf_name(name, tied), want, "{name} tied {tied}");
        }
    }

    #[test]
    fn pythias_config_reads_back_and_what_the_model_does_not_compute_is_refused() {
        let dir = std::env::temp_dir().join(format!("zrt-neox-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let read = |text: &str| {
            std::fs::write(dir.join("config.json"), text).unwrap();
            GptNeoxConfig::from_hf_dir(&dir)
        };
        let cfg = read(PYTHIA).unwrap();
        assert_eq!(cfg, pythia());
        assert_eq!((cfg.head_dim(), cfg.rotary_dim()), (64, 16));
        // What it writes reads back as itself, its other settings too.
        let other = GptNeoxConfig {
            parallel_residual: false,
            attention_bias: false,
            tied: true,
            rotary_pct: 1.0,
            rope_scaling: RopeScaling::Linear { factor: 4.0 },
            activation: Activation::GeluTanh,
            hidden_dropout: 0.1,
            ..pythia()
        };
        for c in [cfg, other] {
            assert_eq!(read(&c.to_hf_json()).unwrap(), c);
        }
        for (from, to, says) in [
            (r#""gpt_neox""#, r#""gpt2""#, "model_type \"gpt2\", not"),
            (
                r#""num_attention_heads": 8"#,
                r#""num_attention_heads": 7"#,
                "num_attention_heads 7 does not divide hidden_size 512",
            ),
            (
                r#""rotary_pct": 0.25"#,
                r#""rotary_pct": 0.02"#,
                "rotary_pct 0.02 of a head's 64 dimensions is 1",
            ),
            (r#""gelu""#, r#""relu6""#, "hidden_act \"relu6\""),
            (
                r#""use_cache": true"#,
                r#""rope_scaling": {"rope_type": "ntk"}"#,
                "this gpt_neox computes the \"linear\", \"dynamic\"",
            ),
            (
                r#""use_cache": true"#,
                r#""hidden_dropout": 1.0"#,
                "`hidden_dropout` is 1, not a dropout rate in [0, 1)",
            ),
        ] {
            let err = read(&PYTHIA.replace(from, to)).unwrap_err().to_string();
            assert!(err.contains(says) && err.contains("config.json"), "{err}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn unit_params_count_what_the_built_model_holds() {
        let small = GptNeoxConfig {
            vocab: 96,
            hidden: 64,
            intermediate: 200,
            layers: 2,
            heads: 4,
            ..pythia()
        };
        let others = GptNeoxConfig {
            tied: true,
            attention_bias: false,
            ..small.clone()
        };
        for cfg in [small, others] {
            let vs = nn::VarStore::new(tch::Device::Cpu);
            let _model = GptNeox::new(&vs.root(), &ShardPlan::new(), &cfg);
            let units = cfg.unit_params();
            let held = crate::llama::tests::held_by_unit(&vs, &units);
            assert_eq!(held, units, "{cfg:?}");
        }
    }
}
