//! The families' norms: RMSNorm (weights as each family multiplies
//! them), Cohere's mean-centred one, and where a layer puts them.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use crate::blocks::layer_norm;

use super::config::LlamaConfig;
use super::family::Family;

/// An RMSNorm, `x / sqrt(mean(x^2) + eps)` in fp32 times its weights,
/// as the family multiplies them ([`NormWeights`]).
#[derive(Debug)]
pub(super) struct RmsNorm {
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
    /// OLMo's, GPT-OSS's and Helium's: times the weights in fp32, then
    /// cast.
    Fp32,
}

impl RmsNorm {
    /// As it is, with `eps` for the config's (DeepSeek-V3's latent
    /// norms keep their class's 1e-6).
    pub(super) fn with_eps(self, eps: f64) -> Self {
        Self { eps, ..self }
    }

    pub(super) fn new(p: nn::Path, width: i64, c: &LlamaConfig) -> Self {
        let weights = match c.family {
            f if f.gemma() || matches!(f, Family::Qwen3Next | Family::RecurrentGemma) => {
                NormWeights::Offset
            }
            f if f.olmo() || matches!(f, Family::GptOss | Family::Helium) => NormWeights::Fp32,
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

/// `x / sqrt(mean(x^2) + eps)` over the last dimension, in fp32: an
/// RMSNorm before its weights (Llama 4's `Llama4TextL2Norm`, cast back,
/// has none).
pub(crate) fn rms_normalized(x: &Tensor, eps: f64) -> Tensor {
    let h = x.to_kind(Kind::Float);
    let var = h.pow_tensor_scalar(2).mean_dim(-1, true, None::<Kind>);
    h * (var + eps).rsqrt()
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Tensor {
        let h = rms_normalized(x, self.eps);
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
pub(super) struct CohereNorm {
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
/// and StableLM's LayerNorm, Cohere's, OLMo 1's or Nemotron's.
#[derive(Debug)]
pub(super) enum Norm {
    Rms(RmsNorm),
    /// Boxed: tch's LayerNorm carries its config, three times an
    /// RMSNorm's size.
    Layer(Box<nn::LayerNorm>),
    Cohere(CohereNorm),
    /// OLMo 1's: a LayerNorm without weights or biases, in fp32 at
    /// `eps`, then cast back.
    Bare {
        eps: f64,
    },
    /// DBRX's, MPT's and ModernBERT-decoder's: a LayerNorm with weights
    /// and no bias, in the input's dtype (`nn.LayerNorm(bias=False)`).
    Unbiased {
        weight: Tensor,
        eps: f64,
    },
    /// Nemotron's `LayerNorm1P`: a LayerNorm (with a bias) whose weights
    /// are offsets from one, zero when new.
    OneP {
        weight: Tensor,
        bias: Tensor,
        eps: f64,
    },
    /// xLSTM's with `use_bias`: an RMSNorm, then a bias added.
    RmsBiased(RmsNorm, Tensor),
    /// StableLM 2 12B's query and key norms: one LayerNorm without a
    /// bias a head (`norms.{i}`), each over its head's width of
    /// `[.., heads, head_dim]`.
    EachHead(Vec<Norm>),
}

impl Norm {
    /// The family's norm under `p`, of `width`.
    pub(super) fn new(p: nn::Path, width: i64, c: &LlamaConfig) -> Self {
        match c.family {
            f if f.cohere() => Self::Cohere(CohereNorm {
                weight: p.ones("weight", &[width]),
                eps: c.eps,
            }),
            Family::Olmo1 => Self::Bare { eps: 1e-5 },
            Family::Dbrx | Family::Mpt | Family::ModernBertDecoder => Self::Unbiased {
                weight: p.ones("weight", &[width]),
                eps: c.eps,
            },
            Family::Nemotron => Self::OneP {
                weight: p.zeros("weight", &[width]),
                bias: p.zeros("bias", &[width]),
                eps: c.eps,
            },
            f if f.layer_norm() => Self::Layer(Box::new(layer_norm(p, width, c.eps))),
            Family::Xlstm if c.xlstm.as_ref().is_some_and(|x| x.bias) => {
                let norm = RmsNorm::new(p.clone(), width, c);
                Self::RmsBiased(norm, p.zeros("bias", &[width]))
            }
            _ => Self::Rms(RmsNorm::new(p, width, c)),
        }
    }

    /// The norm of `heads` heads' queries or keys under `p`, each head
    /// with weights of its own (see [`Family::qk_norm_of_each_head`]):
    /// Cohere's with weights `[heads, head_dim]` (Command R+), or a
    /// LayerNorm without a bias a head (StableLM 2 12B).
    pub(super) fn of_each_head(p: nn::Path, heads: i64, head_dim: i64, c: &LlamaConfig) -> Self {
        match c.family {
            f if f.cohere() => Self::Cohere(CohereNorm {
                weight: p.ones("weight", &[heads, head_dim]),
                eps: c.eps,
            }),
            _ => Self::EachHead(
                (0..heads)
                    .map(|h| Self::Unbiased {
                        weight: (&p / "norms" / h).ones("weight", &[head_dim]),
                        eps: c.eps,
                    })
                    .collect(),
            ),
        }
    }
}

impl Module for Norm {
    fn forward(&self, x: &Tensor) -> Tensor {
        match self {
            Self::Rms(n) => n.forward(x),
            Self::RmsBiased(n, bias) => n.forward(x) + bias,
            Self::Layer(n) => n.forward(x),
            Self::Cohere(n) => n.forward(x),
            Self::Bare { eps } => {
                let h = x.to_kind(Kind::Float);
                let width = [h.size()[h.dim() - 1]];
                let normed = h.layer_norm(width, None::<&Tensor>, None::<&Tensor>, *eps, false);
                normed.to_kind(x.kind())
            }
            Self::Unbiased { weight, eps } => {
                let width = [x.size()[x.dim() - 1]];
                x.layer_norm(width, Some(weight), None::<&Tensor>, *eps, false)
            }
            // `weight + 1` in the weights' dtype, as `transformers` adds it.
            Self::OneP { weight, bias, eps } => {
                let w = weight + 1.0;
                x.layer_norm([x.size()[x.dim() - 1]], Some(&w), Some(bias), *eps, false)
            }
            // Head by head, as `transformers` splits them, so that each
            // head's LayerNorm multiplies its own weights in the kernel.
            Self::EachHead(norms) => {
                let parts = x.split(1, -2);
                let normed: Vec<Tensor> = (norms.iter().zip(&parts))
                    .map(|(n, part)| n.forward(part))
                    .collect();
                Tensor::cat(&normed, -2)
            }
        }
    }
}

/// Where a decoder layer normalises: its norms, by position.
#[derive(Debug)]
pub(super) enum Norms {
    /// Llama's: each sublayer's input (`input_layernorm` before the
    /// attention, `post_attention_layernorm` before the MLP).
    Pre { input: Norm, before_mlp: Norm },
    /// Gemma 2's and 3's: each sublayer's input and output
    /// (`input_layernorm`, `post_attention_layernorm` on the attention's
    /// output, `pre_feedforward_layernorm`, `post_feedforward_layernorm`;
    /// GLM-4's `input_layernorm`, `post_self_attn_layernorm`,
    /// `post_attention_layernorm` before the MLP, `post_mlp_layernorm`).
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
    /// Falcon 40B's and 180B's: two norms of the layer's input side by
    /// side, one for the attention (`ln_attn`), one for the MLP
    /// (`ln_mlp`).
    ParallelTwo { attention: Norm, mlp: Norm },
    /// OPT-350m's and OpenAI GPT's: each sublayer's output added to its
    /// input, the sum normalised (`self_attn_layer_norm`,
    /// `final_layer_norm`; `ln_1`, `ln_2`: the original Transformer's
    /// post-norm).
    AfterResidual {
        after_attention: Norm,
        after_mlp: Norm,
    },
    /// Mamba's and Falcon-Mamba's: one norm (`norm`) before the layer's
    /// only sublayer, the scan.
    Alone { input: Norm },
    /// ModernBERT-decoder's first layer: its attention reads the
    /// embeddings (already normalised) as they are, a norm before its
    /// MLP only (`mlp_norm`).
    BeforeMlp { before_mlp: Norm },
}

impl Norms {
    /// The family's norms of layer `l` under `p`, of width `d`
    /// (LongCat-Flash's sublayer `sub`'s: `input_layernorm.{sub}`, ...).
    pub(super) fn new((p, sub, l): (&nn::Path, Option<i64>, i64), d: i64, c: &LlamaConfig) -> Self {
        // JetMoE's class builds its layers' norms at their default eps,
        // 1e-6, whatever the config says (`rms_norm_eps` is the final
        // norm's).
        let jetmoe;
        let c = match c.family {
            Family::JetMoe => {
                jetmoe = LlamaConfig {
                    eps: 1e-6,
                    ..c.clone()
                };
                &jetmoe
            }
            _ => c,
        };
        let norm = |n: &str| match sub {
            Some(i) => Norm::new(p / n / i, d, c),
            None => Norm::new(p / n, d, c),
        };
        // The families' names of the norms before their two sublayers.
        let pre = || {
            let (input, before_mlp) = match c.family {
                Family::VaultGemma => ("input_layernorm", "pre_feedforward_layernorm"),
                Family::Bamba | Family::Jamba | Family::FalconH1 => {
                    ("input_layernorm", "pre_ff_layernorm")
                }
                Family::Apertus => ("attention_layernorm", "feedforward_layernorm"),
                Family::Lfm2 => ("operator_norm", "ffn_norm"),
                Family::RecurrentGemma => ("temporal_pre_norm", "channel_pre_norm"),
                Family::GptBigCode | Family::GptNeo => ("ln_1", "ln_2"),
                Family::Mpt => ("norm_1", "norm_2"),
                Family::Ctrl => ("layernorm1", "layernorm2"),
                Family::Rwkv => ("ln1", "ln2"),
                Family::Xlstm => ("norm_mlstm", "norm_ffn"),
                f if f.fairseq() => ("self_attn_layer_norm", "final_layer_norm"),
                _ => ("input_layernorm", "post_attention_layernorm"),
            };
            Self::Pre {
                input: norm(input),
                before_mlp: norm(before_mlp),
            }
        };
        match c.family {
            Family::Glm4 => Self::Sandwich {
                input: norm("input_layernorm"),
                after_attention: norm("post_self_attn_layernorm"),
                before_mlp: norm("post_attention_layernorm"),
                after_mlp: norm("post_mlp_layernorm"),
            },
            f if f.sandwich() => Self::Sandwich {
                input: norm("input_layernorm"),
                after_attention: norm("post_attention_layernorm"),
                before_mlp: norm("pre_feedforward_layernorm"),
                after_mlp: norm("post_feedforward_layernorm"),
            },
            f if f.olmo() || f == Family::Exaone4 => Self::Post {
                after_attention: norm("post_attention_layernorm"),
                after_mlp: norm("post_feedforward_layernorm"),
            },
            f if f.gptj() => Self::Parallel {
                input: norm("ln_1"),
            },
            _ if c.parallel => Self::Parallel {
                input: norm("input_layernorm"),
            },
            Family::Falcon => match c.falcon {
                Some(f) if f.two_norms => Self::ParallelTwo {
                    attention: norm("ln_attn"),
                    mlp: norm("ln_mlp"),
                },
                Some(f) if f.parallel => Self::Parallel {
                    input: norm("input_layernorm"),
                },
                _ => pre(),
            },
            Family::Opt if c.opt.is_some_and(|o| !o.norm_before) => Self::AfterResidual {
                after_attention: norm("self_attn_layer_norm"),
                after_mlp: norm("final_layer_norm"),
            },
            Family::OpenAiGpt => Self::AfterResidual {
                after_attention: norm("ln_1"),
                after_mlp: norm("ln_2"),
            },
            Family::ModernBertDecoder if l == 0 => Self::BeforeMlp {
                before_mlp: norm("mlp_norm"),
            },
            Family::ModernBertDecoder => Self::Pre {
                input: norm("attn_norm"),
                before_mlp: norm("mlp_norm"),
            },
            f if f.mamba_only() => Self::Alone {
                input: norm("norm"),
            },
            Family::Zamba2 | Family::Zamba => Self::Alone {
                input: norm("input_layernorm"),
            },
            Family::Dbrx => Self::Pre {
                input: Norm::new(p / "norm_attn_norm" / "norm_1", d, c),
                before_mlp: Norm::new(p / "norm_attn_norm" / "norm_2", d, c),
            },
            _ => pre(),
        }
    }

    /// The attention's input: `x`, normalised unless OLMo's.
    pub(super) fn attention_input(&self, x: &Tensor) -> Tensor {
        match self {
            Self::Pre { input, .. }
            | Self::Sandwich { input, .. }
            | Self::Parallel { input }
            | Self::Alone { input } => input.forward(x),
            Self::ParallelTwo { attention, .. } => attention.forward(x),
            Self::Post { .. } | Self::AfterResidual { .. } | Self::BeforeMlp { .. } => {
                x.shallow_clone()
            }
        }
    }

    /// The attention's output `a`, normalised when the family does.
    pub(super) fn attention_output(&self, a: Tensor) -> Tensor {
        match self {
            Self::Pre { .. }
            | Self::Parallel { .. }
            | Self::ParallelTwo { .. }
            | Self::AfterResidual { .. }
            | Self::Alone { .. }
            | Self::BeforeMlp { .. } => a,
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
    /// input; Falcon's with two norms normalises `x`, there the layer's
    /// input (its attention's output joins after the MLP).
    pub(super) fn mlp_input(&self, x: &Tensor, h: Tensor) -> Tensor {
        match self {
            Self::Pre { before_mlp, .. }
            | Self::Sandwich { before_mlp, .. }
            | Self::BeforeMlp { before_mlp } => before_mlp.forward(x),
            Self::Post { .. } | Self::AfterResidual { .. } | Self::Alone { .. } => {
                x.shallow_clone()
            }
            Self::Parallel { .. } => h,
            Self::ParallelTwo { mlp, .. } => mlp.forward(x),
        }
    }

    /// The MLP's output `m`, normalised when the family does.
    pub(super) fn mlp_output(&self, m: Tensor) -> Tensor {
        match self {
            Self::Pre { .. }
            | Self::Parallel { .. }
            | Self::ParallelTwo { .. }
            | Self::AfterResidual { .. }
            | Self::Alone { .. }
            | Self::BeforeMlp { .. } => m,
            Self::Sandwich { after_mlp, .. } | Self::Post { after_mlp, .. } => {
                after_mlp.forward(&m)
            }
        }
    }

    /// The residual stream `x` after the attention joined it: normalised
    /// by OPT-350m's post-norm layers, left as it is by the others.
    pub(super) fn after_attention(&self, x: Tensor) -> Tensor {
        match self {
            Self::AfterResidual {
                after_attention, ..
            } => after_attention.forward(&x),
            _ => x,
        }
    }

    /// The layer's output `x` (the residual stream after the MLP joined
    /// it): normalised by OPT-350m's post-norm layers, left as it is by
    /// the others.
    pub(super) fn after_mlp(&self, x: Tensor) -> Tensor {
        match self {
            Self::AfterResidual { after_mlp, .. } => after_mlp.forward(&x),
            _ => x,
        }
    }
}
