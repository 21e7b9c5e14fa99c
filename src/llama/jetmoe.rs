//! JetMoE's mixture of attention heads ([`Family::JetMoe`]), as
//! `transformers`' `JetMoeMoA` computes it: a router picks each token's
//! top `k` experts; each chosen expert's `input_linear` matrix makes one
//! set of `num_key_value_heads` query heads for the token, all of them
//! attending over the same keys and values (`kv_proj`); each set's output
//! goes back through the same expert's `output_linear`, weighted by the
//! router's softmax over the top `k` logits, summed, plus a bias.
//!
//! `transformers` lays a token's query heads out slot by slot (its
//! first expert's heads, then its second's) and tiles the keys to match
//! (`repeat`), so query head `i` reads key head `i % kv_heads`. zrt's
//! attention groups query heads the other way (query head `i` reads key
//! head `i / group`), so the queries are handed to it key head by key
//! head (each key head's `k` slots together) and the output is put back
//! in slot order before the experts merge it. The heads' pairing is the
//! same.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use crate::lora::param::{self, ParamAdapter};
use crate::lora::{Adapted, LoraConfig};

use super::config::LlamaConfig;
use super::layer::Lin;

/// JetMoE's gating (`JetMoeTopKGating`, its attention's and its MLP's)
/// of router `logits` `[n, experts]`: each row's top `k` logits in fp32
/// and a softmax over those alone, in `kind` (weights `[n, k]`), and
/// the experts they are (`[n, k]`).
pub(super) fn top_k_softmax(logits: &Tensor, k: i64, kind: Kind) -> (Tensor, Tensor) {
    let (top, chosen) = logits.to_kind(Kind::Float).topk(k, 1, true, true);
    (top.softmax(1, Kind::Float).to_kind(kind), chosen)
}

/// A layer's mixture of attention heads (`self_attention.experts` and
/// `self_attention.kv_proj`).
#[derive(Debug)]
pub(super) struct Moa {
    /// `experts.router.layer`: a logit an expert.
    router: Adapted,
    /// `experts.input_linear.weight` `[experts, kv_heads * head_dim, d]`.
    input: Tensor,
    /// `experts.output_linear.weight` `[experts, d, kv_heads * head_dim]`.
    output: Tensor,
    /// `experts.bias` `[d]`, added to the merged output.
    bias: Tensor,
    /// `kv_proj`: the keys, then the values.
    kv_proj: Adapted,
    /// The adapters `target_parameters` puts on `input_linear.weight`
    /// and `output_linear.weight` (as on Granite-MoE's experts, whose
    /// names these share: PEFT adapts both).
    input_lora: Option<ParamAdapter>,
    output_lora: Option<ParamAdapter>,
    experts: i64,
    top_k: i64,
    kv_heads: i64,
    head_dim: i64,
}

impl Moa {
    /// Under `a` (`self_attention`), for `c`'s sizes, its linear layers
    /// made by `lin`, with the adapters `lora` puts on its experts.
    pub(super) fn new(
        a: &nn::Path,
        c: &LlamaConfig,
        (lin, lora): (&Lin<'_>, Option<&LoraConfig>),
    ) -> Self {
        let (experts, top_k) = c.moe.as_ref().map_or((1, 1), |m| (m.experts, m.top_k));
        let (d, width) = (c.hidden, c.kv_heads * c.head_dim);
        let ex = a / "experts";
        let (i, o) = (&ex / "input_linear", &ex / "output_linear");
        let on = |p: &nn::Path, shape| param::on_module(p, &[("weight", shape)], lora).pop();
        let init = nn::Init::Randn {
            mean: 0.0,
            stdev: 0.01,
        };
        Self {
            router: lin(&(&ex / "router" / "layer"), d, experts, false),
            input: i.var("weight", &[experts, width, d], init),
            output: o.var("weight", &[experts, d, width], init),
            input_lora: on(&i, [experts, width, d]).flatten(),
            output_lora: on(&o, [experts, d, width]).flatten(),
            bias: ex.zeros("bias", &[d]),
            kv_proj: lin(&(a / "kv_proj"), d, 2 * width, false),
            experts,
            top_k,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
        }
    }

    /// Each token's (`x` `[n, d]`) top `k` experts `[n, k]` and their
    /// weights ([`top_k_softmax`]).
    fn route(&self, x: &Tensor) -> (Tensor, Tensor) {
        top_k_softmax(&self.router.forward(x), self.top_k, x.kind())
    }

    /// Each expert's tokens and slots in `chosen` (`[n, k]`): the rows
    /// `(token, slot)` that chose it, by token.
    fn hits(&self, chosen: &Tensor, e: i64) -> Option<(Tensor, Tensor)> {
        let hits = chosen.eq(e).nonzero();
        (hits.size()[0] > 0).then(|| (hits.select(1, 0), hits.select(1, 1)))
    }

    /// The queries (`[b, t, kv_heads * k * head_dim]`, key head by key
    /// head, each key head's `k` slots together), keys and values
    /// (`[b, t, kv_heads * head_dim]` each) of the normalised input `h`
    /// `[b, t, d]`.
    pub(super) fn queries_keys_values(&self, h: &Tensor) -> [Tensor; 3] {
        let (b, t, d) = h.size3().unwrap_or((1, 1, 1));
        let (k, width) = (self.top_k, self.kv_heads * self.head_dim);
        let x = h.reshape([-1, d]);
        // Only the choice: the weights scale the output (`merge`).
        let chosen = tch::no_grad(|| self.route(&x).1);
        let mut q = Tensor::zeros([b * t * k, width], (x.kind(), x.device()));
        for e in 0..self.experts {
            let Some((token, slot)) = self.hits(&chosen, e) else {
                continue;
            };
            let x = x.index_select(0, &token);
            let mut y = x.linear::<Tensor>(&self.input.get(e), None);
            if let Some(a) = &self.input_lora {
                y += a.left(e, &x);
            }
            // (`index_put` keeps only the indices for backward;
            // `index_add` would keep `y` whole, for its shape.)
            q = q.index_put(&[Some(token * k + slot)], &y, true);
        }
        let q = q
            .view([b, t, k, self.kv_heads, self.head_dim])
            .transpose(2, 3)
            .reshape([b, t, -1]);
        let kv = self.kv_proj.forward(h);
        [q, kv.narrow(-1, 0, width), kv.narrow(-1, width, width)]
    }

    /// The attention's output `o` (`[b, t, heads * head_dim]`, in the
    /// order [`Moa::queries_keys_values`] gave the queries) merged by
    /// each token's experts, weighted, in the experts' order, plus the
    /// bias: `[b, t, d]`.
    pub(super) fn merge(&self, h: &Tensor, o: &Tensor) -> Tensor {
        let (b, t, d) = h.size3().unwrap_or((1, 1, 1));
        let (k, width) = (self.top_k, self.kv_heads * self.head_dim);
        let (gates, chosen) = self.route(&h.reshape([-1, d]));
        let o = o
            .view([b, t, self.kv_heads, k, self.head_dim])
            .transpose(2, 3)
            .reshape([b * t * k, width]);
        let mut out = Tensor::zeros([b * t, d], (o.kind(), o.device()));
        for e in 0..self.experts {
            let Some((token, slot)) = self.hits(&chosen, e) else {
                continue;
            };
            let rows = &token * k + &slot;
            let gate = gates.index(&[Some(token.shallow_clone()), Some(slot)]);
            let x = o.index_select(0, &rows);
            let y = x.linear::<Tensor>(&self.output.get(e), None);
            let y = match &self.output_lora {
                Some(a) => y + a.left(e, &x),
                None => y,
            };
            let y = y * gate.unsqueeze(-1);
            out = out.index_put(&[Some(token)], &y, true);
        }
        out.view([b, t, d]) + &self.bias
    }
}
