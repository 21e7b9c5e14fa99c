//! MiniMax's lightning attention ([`Family::MiniMax`]): in the layers
//! `layer_types` names `linear_attention`, a causal linear attention
//! whose past decays by a rate of each head's. Each token's output is
//! `sum over s <= t of exp(-rate (t - s)) (q_t . k_s) v_s`, normalised
//! over all heads, gated by a sigmoid of the layer's input, projected.
//!
//! It is computed as `transformers`' `MiniMaxLightningAttention`
//! computes it, block by block (`block_size` tokens): within a block as
//! masked attention, across blocks through the decayed sum of `k^T v`
//! carried from the blocks before, so that its rounding is the
//! reference's and its memory grows with the block, not the sequence.
//! While generating, that sum is the layer's state; each later token
//! steps it. A packed row's documents are each attended alone.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use serde_json::{json, Value};

use crate::hf::{HfError, HfJson};
use crate::kv_cache::LayerCache;
use crate::lora::Adapted;

use super::config::{Activation, LlamaConfig};
use super::layer::Lin;
use super::norm::RmsNorm;

/// MiniMax's lightning layers: the block and which layers they are.
#[derive(Debug, Clone, PartialEq)]
pub struct LightningConfig {
    /// `block_size`: the tokens computed together.
    pub block: i64,
    /// `layer_types`, one a layer: `true` for a lightning layer
    /// (`"linear_attention"`), `false` for one that attends with
    /// softmax (`"full_attention"`).
    pub layers: Vec<bool>,
}

impl LightningConfig {
    /// Whether layer `l` is a lightning layer.
    pub fn is_lightning(&self, l: i64) -> bool {
        self.layers.get(l as usize) == Some(&true)
    }

    /// A lightning layer's parameters for `heads` heads `head_dim` wide
    /// in a model `hidden` wide (`qkv_proj`, `output_gate`, the norm,
    /// `out_proj`).
    pub(super) fn params(hidden: i64, heads: i64, head_dim: i64) -> u64 {
        let inner = heads * head_dim;
        (hidden * 3 * inner + hidden * inner + inner + inner * hidden) as u64
    }

    /// The values of a lightning layer's decay buffers for `heads` heads
    /// ([`Lightning`]'s `decays`: each head's rate, its query and key
    /// decays over a block, its block-by-block diagonal decay).
    pub(super) fn buffers(&self, heads: i64) -> u64 {
        let block = self.block;
        (heads * (1 + 2 * block + block * block)) as u64
    }
}

/// One lightning layer (`self_attn`): `qkv_proj` (each head's queries,
/// keys and values side by side), the activation on them, the decayed
/// linear attention, `norm` over every head, the sigmoid `output_gate`
/// of the layer's input. Its `out_proj` is the layer's output
/// projection, held by the layer.
#[derive(Debug)]
pub(super) struct Lightning {
    qkv_proj: Adapted,
    output_gate: Adapted,
    norm: RmsNorm,
    /// Each head's decay rate (`slope_rate`, `[heads, 1, 1]`) and what
    /// its class derives from it for a block (`query_decay` and
    /// `key_decay`, `[heads, block, 1]`; `diagonal_decay`, `[1, heads,
    /// block, block]`): buffers it writes out and reads back, held here
    /// as frozen variables so that a file's are the ones used, and
    /// written back.
    decays: [Tensor; 4],
    heads: i64,
    head_dim: i64,
    block: i64,
    activation: Activation,
}

impl Lightning {
    /// Layer `l`'s lightning attention under `p` (`model.layers.N
    /// .self_attn`), its linear layers made by `lin`.
    pub(super) fn new(
        p: &nn::Path,
        c: &LlamaConfig,
        (l, block): (i64, i64),
        lin: &Lin<'_>,
    ) -> Self {
        let (d, heads, hd) = (c.hidden, c.heads, c.head_dim);
        // Its class's: a base of 2^(-8 / heads) to the power of each
        // head's number, smaller in later layers.
        let base = 1.0 / 2f64.powf(8.0 / heads as f64);
        let factor = 1.0 - l as f64 / (c.layers as f64 - 1.0 + 1e-5) + 1e-5;
        let exponent = Tensor::arange_start(1, heads + 1, (Kind::Float, p.device()));
        let rate = Tensor::full([heads], base, (Kind::Float, p.device())).pow(&exponent) * factor;
        let rate = rate.view([heads, 1, 1]);
        let steps = Tensor::arange_start(1, block + 1, (Kind::Float, p.device())).view([block, 1]);
        let apart = (&steps - steps.view([1, block])).view([1, 1, block, block]);
        let diagonal = (&rate * &apart).neg();
        let computed = [
            ("slope_rate", rate.shallow_clone()),
            ("query_decay", (-&rate * &steps).exp()),
            ("key_decay", (-&rate * (-&steps + block as f64)).exp()),
            (
                "diagonal_decay",
                diagonal
                    .masked_fill(&apart.lt(0.0), f64::NEG_INFINITY)
                    .exp(),
            ),
        ];
        let decays = computed.map(|(name, value)| {
            let held = p.zeros_no_train(name, &value.size());
            tch::no_grad(|| held.shallow_clone().copy_(&value));
            held
        });
        Self {
            qkv_proj: lin(&(p / "qkv_proj"), d, 3 * heads * hd, false),
            output_gate: lin(&(p / "output_gate"), d, heads * hd, false),
            // Its class's default epsilon, not the config's.
            norm: RmsNorm::new(p / "norm", heads * hd, c).with_eps(1e-6),
            decays,
            heads,
            head_dim: hd,
            block,
            activation: c.activation,
        }
    }

    /// The gated, normalised attention of `h` `[batch, seq, hidden]`,
    /// `[batch, seq, heads x head_dim]` (before `out_proj`).
    pub(super) fn forward(&self, h: &Tensor, cache: &LayerCache) -> Tensor {
        let (b, t, _) = h.size3().unwrap_or((1, 1, 1));
        let (heads, hd) = (self.heads, self.head_dim);
        let qkv = self.activation.apply(&self.qkv_proj.forward(h));
        let qkv = qkv.view([b, t, heads, 3 * hd]);
        let part = |i: i64| qkv.narrow(-1, i * hd, hd);
        let (q, k, v) = (part(0), part(1), part(2));
        let out = match (cache.documents(), cache.state()) {
            (Some(docs), _) => docs.each_alone(&[&q, &k, &v], |one| {
                let (out, _) = self.blocks(&one[0], &one[1], &one[2]);
                out
            }),
            (None, Some((kv, _))) => {
                let (out, kv) = self.steps(&q, &k, &v, kv);
                cache.keep_state((kv.shallow_clone(), kv));
                out
            }
            (None, None) => {
                let (out, kv) = self.blocks(&q, &k, &v);
                cache.keep_state((kv.shallow_clone(), kv));
                out
            }
        };
        let out = self.norm.forward(&out.reshape([b, t, heads * hd]));
        self.output_gate.forward(h).sigmoid() * out
    }

    /// The attention of `q`, `k`, `v` (`[batch, seq, heads, head_dim]`)
    /// from a zero state, block by block: the outputs `[batch, seq,
    /// heads, head_dim]` and the decayed sum of `k^T v` after them
    /// `[batch, heads, head_dim, head_dim]`.
    fn blocks(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> (Tensor, Tensor) {
        let [q, k, v] = [q, k, v].map(|x| x.transpose(1, 2));
        let (b, kind) = (q.size()[0], q.kind());
        let (heads, hd, block) = (self.heads, self.head_dim, self.block);
        // In the model's dtype, as its class's buffers are cast with it.
        let [rate, query_decay, key_decay, diagonal] =
            &self.decays.each_ref().map(|d| d.to_kind(kind));
        let mut kv = Tensor::zeros([b, heads, hd, hd], (kind, q.device()));
        let mut outs = Vec::new();
        // The blocks by one `split` apiece: a `narrow` a block would zero
        // a whole-sequence gradient for each in backward.
        let [qs, ks, vs] = [&q, &k, &v].map(|x| x.split(block, 2));
        for ((q, k), v) in qs.iter().zip(&ks).zip(&vs) {
            let n = q.size()[2];
            let qd = query_decay.narrow(1, 0, n);
            let kd = key_decay.narrow(1, block - n, n);
            let dd = diagonal.narrow(2, 0, n).narrow(3, 0, n);
            // Computed as it runs, from the cast rates.
            let block_decay = (-rate * n as f64).exp();
            let intra = (q.matmul(&k.transpose(-1, -2)) * dd).matmul(v);
            let inter = (q * qd).matmul(&kv);
            outs.push(inter + intra);
            kv = kv * block_decay + (k * kd).transpose(-1, -2).matmul(v);
        }
        (Tensor::cat(&outs, 2).transpose(1, 2), kv)
    }

    /// The tokens of `q`, `k`, `v` (as [`Lightning::blocks`] takes them)
    /// one at a time from a generation's state `kv`, as `transformers`'
    /// cached path steps them; the outputs and the state after them.
    fn steps(&self, q: &Tensor, k: &Tensor, v: &Tensor, mut kv: Tensor) -> (Tensor, Tensor) {
        let [q, k, v] = [q, k, v].map(|x| x.transpose(1, 2));
        let ratio = (-self.decays[0].to_kind(q.kind())).exp();
        let mut outs = Vec::new();
        for i in 0..q.size()[2] {
            let [q, k, v] = [&q, &k, &v].map(|x| x.narrow(2, i, 1));
            kv = &ratio * kv + k.transpose(-1, -2).matmul(&v);
            outs.push(q.matmul(&kv));
        }
        (Tensor::cat(&outs, 2).transpose(1, 2), kv)
    }
}

/// MiniMax's residual factors: each sublayer's output is `alpha` times
/// its (normalised) input plus `beta` times its result. Its class's
/// residual is the sublayer's input after the norm, not before.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ResidualFactors {
    /// `full_attn_alpha_factor`, `full_attn_beta_factor`.
    pub full: (f64, f64),
    /// `linear_attn_alpha_factor`, `linear_attn_beta_factor`.
    pub linear: (f64, f64),
    /// `mlp_alpha_factor`, `mlp_beta_factor`.
    pub mlp: (f64, f64),
}

impl ResidualFactors {
    /// Those of `MiniMaxConfig` `j` (each 1 by default).
    pub(super) fn read(j: &HfJson) -> Result<Self, HfError> {
        let pair = |what: &str| -> Result<(f64, f64), HfError> {
            Ok((
                j.number_or(&format!("{what}_alpha_factor"), 1.0)?,
                j.number_or(&format!("{what}_beta_factor"), 1.0)?,
            ))
        };
        Ok(Self {
            full: pair("full_attn")?,
            linear: pair("linear_attn")?,
            mlp: pair("mlp")?,
        })
    }

    /// Their fields in MiniMax's `config.json`.
    pub(super) fn to_json(self) -> Value {
        json!({
            "full_attn_alpha_factor": self.full.0,
            "full_attn_beta_factor": self.full.1,
            "linear_attn_alpha_factor": self.linear.0,
            "linear_attn_beta_factor": self.linear.1,
            "mlp_alpha_factor": self.mlp.0,
            "mlp_beta_factor": self.mlp.1,
        })
    }
}

/// The lightning layers of `MiniMaxConfig` `j`, `layers` deep: its
/// `layer_types` (left out or null: every other layer from the second)
/// and `block_size`.
pub(super) fn read(j: &HfJson, layers: i64) -> Result<LightningConfig, HfError> {
    let block = j.size_or_none("block_size")?.unwrap_or(256);
    let kinds = ["full_attention", "linear_attention"];
    let lightning = match super::config::layer_kinds(j, layers, "MiniMax", kinds, kinds[1])? {
        Some(kinds) => kinds,
        None => (0..layers).map(|l| l % 2 == 1).collect(),
    };
    Ok(LightningConfig {
        block,
        layers: lightning,
    })
}

impl LightningConfig {
    /// Its fields in MiniMax's `config.json`.
    pub(super) fn to_json(&self) -> Value {
        let kinds: Vec<&str> = (self.layers.iter())
            .map(|&on| {
                if on {
                    "linear_attention"
                } else {
                    "full_attention"
                }
            })
            .collect();
        json!({"block_size": self.block, "layer_types": kinds})
    }
}
