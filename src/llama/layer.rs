//! One decoder layer: attention and the MLP (dense, or a mixture of
//! experts), normalised as its family does.

use std::sync::Arc;

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use crate::blocks::Training;
use crate::kv_cache::{Decoding, LayerCache};
use crate::lora::param::{self, ParamAdapter};
use crate::lora::{Adapted, LoraConfig};
use crate::packing::{in_window, in_window_from, Documents};

use super::config::{Activation, GroupRouting, LlamaConfig, Mla, MoeConfig, Scoring};
use super::delta_net::DeltaNet;
use super::differential::Differential;
use super::doge::DynamicMask;
use super::family::Family;
use super::jetmoe::Moa;
use super::lightning::Lightning;
use super::mamba::Mamba;
use super::mamba1::Mamba1;
use super::norm::{rms_normalized, Norm, Norms, RmsNorm};
use super::rg_lru::RgLru;
use super::rope_scaling::RopeScaling;
use super::rotary::{rope_at, rope_from, Rotary};
use super::rwkv::{ChannelMix, TimeMix};
use super::short_conv::ShortConv;
use super::xielu::Xielu;
use super::xlstm::Mlstm;
use super::zamba::Hybrid;

/// What builds a decoder layer's linear layers: `(path, in, out, bias)`.
pub(super) type Lin<'a> = dyn Fn(&nn::Path, i64, i64, bool) -> Adapted + 'a;

/// One decoder layer: `x + attn(input_layernorm(x))`, then `x +
/// mlp(post_attention_layernorm(x))` (or normalised where the family
/// does: around each sublayer for Gemma 2 and 3, after it for OLMo;
/// Cohere's `x + attn(n(x)) + mlp(n(x))`).
#[derive(Debug)]
pub struct Layer {
    norms: Norms,
    qkv: Qkv,
    /// The attention's (or mixer's) output projection; none for JetMoE,
    /// whose experts merge the heads ([`Qkv::Moa`]).
    o_proj: Option<Adapted>,
    mlp: Mlp,
    /// Qwen3's and Gemma 3's per-head query and key norms (Persimmon's
    /// LayerNorms), OLMo's over the whole projections.
    qk_norm: Option<(Norm, Norm)>,
    /// Its rotary embedding, `None` for SmolLM3's layers without.
    rotary: Option<Rotary>,
    /// Its sliding window ([`LlamaConfig::window`]).
    window: Option<i64>,
    /// Llama 4's chunk ([`Llama4Attention::chunk`]), on its chunked
    /// layers.
    chunk: Option<i64>,
    /// GPT-OSS's sinks (`self_attn.sinks`): a logit a head, beside each
    /// query's scores in the softmax's sum, its weight then dropped.
    sinks: Option<Tensor>,
    /// MPT's ALiBi slopes, one a head.
    alibi: Option<Tensor>,
    training: Training,
    /// Its keys (turned) and values while generating with a cache.
    cache: LayerCache,
    /// Falcon-H1's Mamba-2 layer beside the attention.
    beside: Option<Box<Beside>>,
    /// MiniMax's residual factors (alpha, beta) of this layer's
    /// attention and of its MLP.
    factors: Option<((f64, f64), (f64, f64))>,
    /// DiffLlama's differential attention.
    differential: Option<Differential>,
    /// BitNet's norms of the attention's output before `o_proj`
    /// (`attn_sub_norm`) and of the MLP's gated product before
    /// `down_proj` (`ffn_sub_norm`).
    sub_norms: Option<(RmsNorm, RmsNorm)>,
    /// LongCat-Flash's second sublayer and its shortcut experts: this
    /// layer is its first sublayer.
    shortcut: Option<Box<Shortcut>>,
    /// GPT-NeoX-Japanese's last layer's bias on its attention's output
    /// (`attention.dense_bias`), added before the output's dropout.
    dense_bias: Option<Tensor>,
    /// Doge's dynamic mask on its attention's scores.
    dynamic: Option<DynamicMask>,
    /// Doge's weights on the residual each sublayer's output joins
    /// (`input_residual` the attention's, `post_attention_residual` the
    /// MLP's), trained.
    residual_weights: Option<(Tensor, Tensor)>,
    /// RWKV's first block's norm of its input (`pre_ln`), before the
    /// residual stream starts.
    pre_norm: Option<Norm>,
    /// A Zamba or Zamba2 hybrid layer's shared block and `linear`, whose output
    /// joins its Mamba layer's input ([`Layer::with_hybrid`]).
    hybrid: Option<Box<Hybrid>>,
    cfg: LlamaConfig,
}

/// LongCat-Flash's layer past its first sublayer: the second sublayer
/// (`self_attn.1`, `mlps.1`, its norms `.1`), and the experts (`mlp`)
/// that read the first sublayer's MLP input, their output added to the
/// second sublayer's.
#[derive(Debug)]
struct Shortcut {
    second: Layer,
    /// `None` only for a config without experts, which LongCat-Flash's
    /// reading never gives.
    experts: Option<Experts>,
}

/// Falcon-H1's Mamba-2 layer beside a layer's attention, reading the
/// same normalised input: the scan, its output projection, and a cache
/// slot of its own for its state while generating.
#[derive(Debug)]
struct Beside {
    mamba: Mamba,
    out_proj: Adapted,
    cache: LayerCache,
}

/// The query, key and value projections: three matrices, Phi-3's
/// one (`qkv_proj`, their rows one after the other), or DeepSeek-V3's
/// latent attention.
#[derive(Debug)]
enum Qkv {
    Apart {
        q_proj: Adapted,
        k_proj: Adapted,
        v_proj: Adapted,
    },
    Fused(Adapted),
    Latent(Box<Latent>),
    /// Granite 4.0's, Bamba's and Mamba-2's Mamba-2 layers mix the tokens
    /// in place of attention (their `out_proj` is the layer's output
    /// projection).
    Mamba(Box<Mamba>),
    /// Jamba's, Mamba's and Falcon-Mamba's Mamba layers (the first
    /// Mamba's selective scan), the same way.
    Mamba1(Box<Mamba1>),
    /// LFM2's convolution layers, the same way.
    ShortConv(Box<ShortConv>),
    /// MiniMax's lightning attention, the same way.
    Lightning(Box<Lightning>),
    /// Qwen3-Next's gated DeltaNet, the same way.
    DeltaNet(Box<DeltaNet>),
    /// RecurrentGemma's recurrent block, the same way.
    RgLru(Box<RgLru>),
    /// RWKV's time mix, the same way.
    Rwkv(Box<TimeMix>),
    /// xLSTM's mLSTM layer, the same way.
    Mlstm(Box<Mlstm>),
    /// JetMoE's mixture of attention heads: queries from each token's
    /// experts, keys and values from `kv_proj`; the experts merge the
    /// output in place of an output projection.
    Moa(Box<Moa>),
}

/// DeepSeek-V3's multi-head latent attention ([`Mla`]): the queries'
/// projections, the keys' and values' latent (`kv_a_proj_with_mqa`), its
/// norm (`kv_a_layernorm`) and its expansion to every head (`kv_b_proj`).
#[derive(Debug)]
struct Latent {
    queries: Queries,
    kv_a: Adapted,
    kv_norm: RmsNorm,
    kv_b: Adapted,
    mla: Mla,
}

/// DeepSeek-V3's queries: one `q_proj`, or through a bottleneck
/// (`q_a_proj`, `q_a_layernorm`, `q_b_proj`).
#[derive(Debug)]
enum Queries {
    One(Adapted),
    LowRank {
        a: Adapted,
        norm: RmsNorm,
        b: Adapted,
    },
}

impl Latent {
    /// Under `a` (`self_attn`), its biases where `attention_bias` puts
    /// them (the bottleneck's and the latent's first projections).
    fn new(a: &nn::Path, c: &LlamaConfig, m: &Mla, lin: &Lin<'_>) -> Self {
        let (d, h, bias) = (c.hidden, c.heads, c.o_bias);
        let qk = m.nope + m.rope;
        // The class's norms here keep their own epsilon.
        let norm = |name: &str, width| RmsNorm::new(a / name, width, c).with_eps(1e-6);
        let queries = match m.q_rank {
            None => Queries::One(lin(&(a / "q_proj"), d, h * qk, false)),
            Some(r) => Queries::LowRank {
                a: lin(&(a / "q_a_proj"), d, r, bias),
                norm: norm("q_a_layernorm", r),
                b: lin(&(a / "q_b_proj"), r, h * qk, false),
            },
        };
        Self {
            queries,
            kv_a: lin(&(a / "kv_a_proj_with_mqa"), d, m.kv_rank + m.rope, bias),
            kv_norm: norm("kv_a_layernorm", m.kv_rank),
            kv_b: lin(&(a / "kv_b_proj"), m.kv_rank, h * (m.nope + m.v), false),
            mla: m.clone(),
        }
    }

    /// Queries, keys and values `[batch, heads, seq, _]` of `x` `[batch,
    /// seq, d]`, as `DeepseekV3Attention` makes them: each head's
    /// unturned dimensions first, then its turned ones (`turn`), the
    /// keys' turned part one for every head.
    fn forward(&self, x: &Tensor, heads: i64, turn: &dyn Fn(Tensor) -> Tensor) -> [Tensor; 3] {
        let (b, t, _) = x.size3().unwrap_or((1, 1, 1));
        let m = &self.mla;
        let q = match &self.queries {
            Queries::One(q) => q.forward(x),
            Queries::LowRank { a, norm, b } => b.forward(&norm.forward(&a.forward(x))),
        };
        let q = q.view([b, t, heads, m.nope + m.rope]).transpose(1, 2);
        let latent = self.kv_a.forward(x);
        let normed = self.kv_norm.forward(&latent.narrow(-1, 0, m.kv_rank));
        // LongCat-Flash scales the queries and the normalised latent.
        let (q, normed) = match m.scales {
            Some((sq, skv)) => (q * sq, normed * skv),
            None => (q, normed),
        };
        let kv = self.kv_b.forward(&normed);
        let kv = kv.view([b, t, heads, m.nope + m.v]).transpose(1, 2);
        let k_rot = latent
            .narrow(-1, m.kv_rank, m.rope)
            .reshape([b, 1, t, m.rope]);
        // Stored as neighbouring pairs: regrouped into halves, the
        // layout the rotation turns.
        let halves = |x: Tensor| match m.interleave {
            true => {
                let s = x.size();
                let (n, r) = (s[1], m.rope);
                x.reshape([b, n, t, r / 2, 2])
                    .transpose(4, 3)
                    .reshape([b, n, t, r])
            }
            false => x,
        };
        let q_rot = turn(halves(q.narrow(-1, m.nope, m.rope)));
        let k_rot = turn(halves(k_rot)).expand([b, heads, t, m.rope], false);
        let q = Tensor::cat(&[q.narrow(-1, 0, m.nope), q_rot], -1);
        let k = Tensor::cat(&[kv.narrow(-1, 0, m.nope), k_rot], -1);
        [q, k, kv.narrow(-1, m.nope, m.v)]
    }
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

/// The first and second halves of `t`'s last dimension (a fused gate
/// and up projection's outputs, the gate's first).
fn halves(t: &Tensor) -> (Tensor, Tensor) {
    let w = t.size()[t.dim() - 1] / 2;
    (t.narrow(-1, 0, w), t.narrow(-1, w, w))
}

impl GateUp {
    /// The gate's and the up projection's outputs for `h` (a fused
    /// matrix's halves).
    fn forward(&self, h: &Tensor) -> (Tensor, Tensor) {
        match self {
            Self::Apart { gate_proj, up_proj } => (gate_proj.forward(h), up_proj.forward(h)),
            Self::Fused(gate_up) => halves(&gate_up.forward(h)),
        }
    }
}

/// A layer's MLP: dense and gated, StarCoder2's (`c_proj(act(c_fc(x)))`;
/// Arcee's and Nemotron's, `down_proj(relu2(up_proj(x)))`, and
/// Apertus's, of its trained xIELU, in the same shape),
/// or a mixture of experts.
#[derive(Debug)]
enum Mlp {
    Dense {
        gate_up: GateUp,
        down_proj: Adapted,
    },
    Plain {
        c_fc: Adapted,
        c_proj: Adapted,
        /// Apertus's xIELU and its parameters (the config's activation
        /// otherwise).
        xielu: Option<Xielu>,
    },
    Experts(Experts),
    /// RWKV's channel mix.
    ChannelMix(Box<ChannelMix>),
    /// The Mambas' layers (1 and 2, Falcon-Mamba) have none.
    None,
}

/// A sparse mixture of experts ([`MoeConfig`]): the router (`gate`) and
/// each expert's gate, up and down matrices; the shared experts of
/// Qwen2-MoE, DeepSeek-V2 and V3 and GLM-4-MoE.
#[derive(Debug)]
struct Experts {
    router: Router,
    experts: ExpertWeights,
    top_k: i64,
    normalize: bool,
    shared: Option<Box<Shared>>,
    /// JetMoE's bias on the routed sum (`mlp.bias`).
    bias: Option<Tensor>,
    /// The model's shared state, when its config has the router's
    /// load-balancing loss (`output_router_logits`): the forward's
    /// tally the layer records into ([`super::balance`]).
    balance: Option<Arc<Decoding>>,
    /// GPT-OSS's balance: over its router's top `k` weights scattered
    /// over the experts (zeros elsewhere), which its class records, not
    /// over its logits.
    scattered: bool,
    /// LongCat-Flash's zero experts ([`MoeConfig::zero`]), after the
    /// real ones.
    zero: i64,
    /// Aria's: the routed experts gate by SiLU whatever `hidden_act`
    /// says (its class's fixed choice; the shared MLP takes
    /// `hidden_act`).
    silu_routed: bool,
}

/// The experts' matrices: each expert's linear layers, or GPT-OSS's
/// or Granite-MoE's stacked.
#[derive(Debug)]
enum ExpertWeights {
    /// Each expert's gate, up and down projections.
    Apart(Vec<[Adapted; 3]>),
    /// GPT-OSS's ([`Stacked`]).
    Stacked(Box<Stacked>),
    /// Granite-MoE's ([`Parallel`]).
    Parallel(Box<Parallel>),
    /// DBRX's ([`Rows`]).
    Rows(Box<Rows>),
}

/// DBRX's experts (`DbrxExpertGLU`): three parameters `[experts ×
/// width, d]`, expert `e`'s rows `e·width..(e+1)·width` of each: `w1`
/// (the gate) and `v1` (the up) as a linear layer's weights, `w2` (the
/// down) multiplied from the left, `act(x w1ᵀ) * (x v1ᵀ) @ w2`. No
/// adapters: PEFT's `target_parameters` would see 2-D matrices, which
/// zrt does not adapt (its [`Family::Dbrx`] targets `Wqkv` by default).
#[derive(Debug)]
struct Rows {
    w1: Tensor,
    v1: Tensor,
    w2: Tensor,
    width: i64,
}

impl Rows {
    /// Under `p` (`ffn.experts.mlp`), `m`'s experts of a model `d` wide.
    fn new(p: &nn::Path, d: i64, m: &MoeConfig) -> Self {
        let rows = [m.experts * m.intermediate, d];
        Self {
            w1: p.var("w1", &rows, RANDN),
            v1: p.var("v1", &rows, RANDN),
            w2: p.var("w2", &rows, RANDN),
            width: m.intermediate,
        }
    }

    /// Expert `e` on its tokens `x` `[n, d]`.
    fn forward(&self, e: i64, x: &Tensor, act: Activation) -> Tensor {
        let of = |w: &Tensor| w.narrow(0, e * self.width, self.width);
        let gate = x.matmul(&of(&self.w1).tr());
        let up = x.matmul(&of(&self.v1).tr());
        super::glu::gated(act, &gate, &up).matmul(&of(&self.w2))
    }
}

/// Granite-MoE's experts (`GraniteMoeParallelExperts`), one parameter
/// for each of their two matrices, each expert's `[out, in]` as a linear
/// layer's: `input_linear.weight` `[experts, 2 width, d]`, the gate's
/// rows then the up's, and `output_linear.weight` `[experts, d, width]`.
/// Each takes an adapter where `target_parameters` names it
/// (`input_linear.weight`, `output_linear.weight`).
#[derive(Debug)]
struct Parallel {
    input: Tensor,
    output: Tensor,
    input_lora: Option<ParamAdapter>,
    output_lora: Option<ParamAdapter>,
}

impl Parallel {
    /// Under `p` (`block_sparse_moe`), `m`'s experts of a model `d` wide,
    /// with the adapters `lora` puts on them.
    fn new(p: &nn::Path, d: i64, m: &MoeConfig, lora: Option<&LoraConfig>) -> Self {
        let (e, w, init) = (m.experts, m.intermediate, RANDN);
        let (i, o) = (p / "input_linear", p / "output_linear");
        let on = |p: &nn::Path, shape| param::on_module(p, &[("weight", shape)], lora).pop();
        Self {
            input: i.var("weight", &[e, 2 * w, d], init),
            output: o.var("weight", &[e, d, w], init),
            input_lora: on(&i, [e, 2 * w, d]).flatten(),
            output_lora: on(&o, [e, d, w]).flatten(),
        }
    }

    /// Expert `e` on its tokens `x` `[n, d]`: `act(gate) * up`, the
    /// input projection's halves, through the output projection (each
    /// matrix with its adapter's update).
    fn forward(&self, e: i64, x: &Tensor, act: Activation) -> Tensor {
        let mut h = x.linear::<Tensor>(&self.input.get(e), None);
        if let Some(a) = &self.input_lora {
            h += a.left(e, x);
        }
        let (gate, up) = halves(&h);
        let y = super::glu::gated(act, &gate, &up);
        let out = y.linear::<Tensor>(&self.output.get(e), None);
        match &self.output_lora {
            Some(a) => out + a.left(e, &y),
            None => out,
        }
    }
}

/// Experts stacked into one parameter a matrix (`[experts, in, out]`,
/// multiplied from the left as `x @ w`): `gate_up_proj` and
/// `down_proj`, GPT-OSS's with biases ([`Stacked::biases`]). Each
/// matrix takes an adapter where `target_parameters` names it
/// (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).
#[derive(Debug)]
struct Stacked {
    gate_up: Tensor,
    down: Tensor,
    /// GPT-OSS's (`GptOssExperts`'s): biases beside the matrices
    /// (`gate_up_proj_bias`, `down_proj_bias`), each expert's gate and
    /// up columns interleaved, and its activation `(up + 1) * gate *
    /// sigmoid(1.702 gate)`, the gate clamped below 7 and the up
    /// projection within ±7. `None`: Llama 4's (`Llama4TextExperts`'s),
    /// no biases, the gate's columns then the up's, `act(gate) * up`.
    biases: Option<(Tensor, Tensor)>,
    gate_up_lora: Option<ParamAdapter>,
    down_lora: Option<ParamAdapter>,
}

impl ExpertWeights {
    /// How many experts there are.
    fn count(&self) -> i64 {
        match self {
            Self::Apart(experts) => experts.len() as i64,
            Self::Stacked(s) => s.gate_up.size()[0],
            Self::Parallel(s) => s.input.size()[0],
            Self::Rows(s) => s.w1.size()[0] / s.width.max(1),
        }
    }

    /// Expert `e` on its tokens `x` `[n, d]`.
    fn forward(&self, e: i64, x: &Tensor, act: Activation) -> Tensor {
        match self {
            Self::Apart(experts) => gated(&experts[e as usize], x, act),
            Self::Stacked(s) => s.forward(e, x, act),
            Self::Parallel(s) => s.forward(e, x, act),
            Self::Rows(s) => s.forward(e, x, act),
        }
    }
}

/// What the parameters a file always fills start as (`transformers`'
/// `initializer_range` default): the stacked experts, DeepSeek's
/// routers, GPT-OSS's sinks.
const RANDN: nn::Init = nn::Init::Randn {
    mean: 0.0,
    stdev: 0.02,
};

/// The blocks CodeGen's query-value-key matrix is laid out in (its
/// class's `mp_num`, the TPU cores it was trained on).
pub(super) const CODEGEN_BLOCKS: i64 = 4;

impl Stacked {
    /// Under `p` (`mlp.experts`), `m`'s experts of a model `d` wide,
    /// GPT-OSS's when `biased`, with the adapters `lora` puts on them.
    fn new(p: &nn::Path, d: i64, m: &MoeConfig, lora: Option<&LoraConfig>, biased: bool) -> Self {
        let (e, w, init) = (m.experts, m.intermediate, RANDN);
        let [gate_up, down] = param::REGISTERED;
        let shapes = [(gate_up, [e, d, 2 * w]), (down, [e, w, d])];
        let mut adapters = param::on_module(p, &shapes, lora).into_iter();
        Self {
            gate_up: p.var(gate_up, &[e, d, 2 * w], init),
            down: p.var(down, &[e, w, d], init),
            biases: biased.then(|| {
                (
                    p.zeros("gate_up_proj_bias", &[e, 2 * w]),
                    p.zeros("down_proj_bias", &[e, d]),
                )
            }),
            gate_up_lora: adapters.next().flatten(),
            down_lora: adapters.next().flatten(),
        }
    }

    /// Aria's (`AriaGroupedExpertsMLP`) under `p` (`mlp.experts`): Llama
    /// 4's layout, each matrix a module of its own holding one
    /// parameter (`fc1.weight` `[experts, d, 2 width]`, `fc2.weight`
    /// `[experts, width, d]`), each taking an adapter where
    /// `target_parameters` names it.
    fn aria(p: &nn::Path, d: i64, m: &MoeConfig, lora: Option<&LoraConfig>) -> Self {
        let (e, w) = (m.experts, m.intermediate);
        let matrix = |name: &str, shape: [i64; 3]| {
            let at = p / name;
            let adapter = param::on_module(&at, &[("weight", shape)], lora).pop();
            (at.var("weight", &shape, RANDN), adapter.flatten())
        };
        let (gate_up, gate_up_lora) = matrix("fc1", [e, d, 2 * w]);
        let (down, down_lora) = matrix("fc2", [e, w, d]);
        Self {
            gate_up,
            down,
            biases: None,
            gate_up_lora,
            down_lora,
        }
    }

    /// Expert `e` on its tokens `x` `[n, d]` (each matrix with its
    /// adapter's update), Llama 4's (and Aria's) gated by `act`.
    fn forward(&self, e: i64, x: &Tensor, act: Activation) -> Tensor {
        let with = |y: Tensor, a: &Option<ParamAdapter>, x: &Tensor| match a {
            Some(a) => y + a.right(e, x),
            None => y,
        };
        let gate_up = with(x.matmul(&self.gate_up.get(e)), &self.gate_up_lora, x);
        let Some((gate_up_bias, down_bias)) = &self.biases else {
            let (gate, up) = halves(&gate_up);
            let h = super::glu::gated(act, &gate, &up);
            return with(h.matmul(&self.down.get(e)), &self.down_lora, &h);
        };
        let h = super::glu::clamped(&(gate_up + gate_up_bias.get(e)));
        with(h.matmul(&self.down.get(e)), &self.down_lora, &h) + down_bias.get(e)
    }
}

/// How the experts are chosen and weighted.
#[derive(Debug)]
enum Router {
    /// Llama 4's (`feed_forward.router`): a linear layer's top `k`
    /// logits, each expert weighted by its logit's sigmoid (in fp32),
    /// which scales the token's input to it, not its output.
    TopSigmoid { gate: Adapted },
    /// JetMoE's (`mlp.router.layer`, `JetMoeTopKGating`) and Aria's
    /// (`mlp.router`): a linear layer's top `k` logits in fp32, weighted
    /// by a softmax over those alone (the others' softmax, renormalised,
    /// rounds otherwise).
    TopSoftmax { gate: Adapted },
    /// A linear layer's softmax (in fp32), its top `k` (Mixtral, the
    /// Qwens; GPT-OSS's with a bias); ERNIE 4.5's chosen by the scores
    /// plus a fixed correction (`moe_statics.e_score_correction_bias`,
    /// `[1, experts]`, frozen), weighted by the scores alone.
    Softmax {
        gate: Adapted,
        correction: Option<Tensor>,
    },
    /// DeepSeek-V3's, GLM-4-MoE's and DeepSeek-V2's ([`GroupRouting`]):
    /// its weights (`gate.weight`, no linear layer an adapter could
    /// target, as in `transformers`) and, scoring by a sigmoid, its fixed
    /// correction (`gate.e_score_correction_bias`, frozen).
    Grouped {
        weight: Tensor,
        correction: Option<Tensor>,
        routing: GroupRouting,
    },
    /// PhiMoE's (`block_sparse_moe.gate`): a linear layer's logits
    /// through sparsemixer at `router_jitter_noise` `eps`
    /// ([`super::sparse_mixer`]).
    SparseMixer { gate: Adapted, eps: f64 },
}

/// A shared expert every token goes through (gate, up and down
/// matrices: Qwen2-MoE's and Llama 4's `shared_expert`, DeepSeek-V2's,
/// V3's and GLM-4-MoE's `shared_experts`, Hunyuan's `shared_mlp`;
/// Granite-MoE-shared's `shared_mlp`, its gate and up one matrix,
/// `input_linear`, and its down `output_linear`), and Qwen2-MoE's gate
/// (`shared_expert_gate`: one row), whose sigmoid weighs its output.
#[derive(Debug)]
struct Shared {
    gate_up: GateUp,
    down: Adapted,
    gate: Option<Adapted>,
}

/// A gated MLP's `down(act(gate(x)) * up(x))`.
fn gated(mlp: &[Adapted; 3], x: &Tensor, act: Activation) -> Tensor {
    let [gate, up, down] = mlp;
    down.forward(&super::glu::gated(act, &gate.forward(x), &up.forward(x)))
}

impl Experts {
    /// Under `p` (`block_sparse_moe` or `mlp`), each expert's matrices
    /// named as the family names them; Aria's shared MLP biased by
    /// `mlp_bias`.
    fn new(
        (layer, p): (&nn::Path, &nn::Path),
        (d, m, mlp_bias): (i64, &MoeConfig, bool),
        family: Family,
        (lin, lora): (&Lin<'_>, Option<&LoraConfig>),
    ) -> Self {
        let names = match family {
            Family::Mixtral | Family::Phimoe | Family::MiniMax => ["w1", "w3", "w2"],
            _ => ["gate_proj", "up_proj", "down_proj"],
        };
        let w = m.intermediate;
        let experts = match family {
            Family::GptOss | Family::Llama4 => {
                let biased = family == Family::GptOss;
                let stacked = Stacked::new(&(p / "experts"), d, m, lora, biased);
                ExpertWeights::Stacked(Box::new(stacked))
            }
            Family::AriaText => {
                ExpertWeights::Stacked(Box::new(Stacked::aria(&(p / "experts"), d, m, lora)))
            }
            f if f.granite_moe() || f == Family::JetMoe => {
                ExpertWeights::Parallel(Box::new(Parallel::new(p, d, m, lora)))
            }
            Family::Dbrx => {
                ExpertWeights::Rows(Box::new(Rows::new(&(p / "experts" / "mlp"), d, m)))
            }
            _ => ExpertWeights::Apart(
                (0..m.experts)
                    .map(|e| {
                        let ep = p / "experts" / e;
                        [
                            lin(&(&ep / names[0]), d, w, false),
                            lin(&(&ep / names[1]), d, w, false),
                            lin(&(&ep / names[2]), w, d, false),
                        ]
                    })
                    .collect(),
            ),
        };
        let qwen = matches!(family, Family::Qwen2Moe | Family::Qwen3Next);
        let shared = m.shared.map(|w| {
            let (gate_up, down) = match family {
                Family::GraniteMoeShared | Family::GraniteMoeHybrid => {
                    let sp = layer / "shared_mlp";
                    (
                        GateUp::Fused(lin(&(&sp / "input_linear"), d, 2 * w, false)),
                        lin(&(&sp / "output_linear"), w, d, false),
                    )
                }
                _ => {
                    let sp = p / match family {
                        Family::Qwen2Moe | Family::Qwen3Next | Family::Llama4 => "shared_expert",
                        Family::HunyuanMoe => "shared_mlp",
                        _ => "shared_experts",
                    };
                    let bias = family == Family::AriaText && mlp_bias;
                    let gate_up = GateUp::Apart {
                        gate_proj: lin(&(&sp / "gate_proj"), d, w, bias),
                        up_proj: lin(&(&sp / "up_proj"), d, w, bias),
                    };
                    (gate_up, lin(&(&sp / "down_proj"), w, d, bias))
                }
            };
            Box::new(Shared {
                gate_up,
                down,
                gate: qwen.then(|| lin(&(p / "shared_expert_gate"), d, 1, false)),
            })
        });
        let router = match (&m.grouped, m.sparse_mixer) {
            // LongCat-Flash's: its real and zero experts scored by a
            // softmax, chosen with a correction.
            (Some(routing), _) if family == Family::LongcatFlash => {
                let r = p / "router";
                let routed = m.experts + m.zero;
                Router::Grouped {
                    weight: (&r / "classifier").var("weight", &[routed, d], RANDN),
                    correction: Some(r.zeros_no_train("e_score_correction_bias", &[routed])),
                    routing: routing.clone(),
                }
            }
            (None, Some(eps)) => Router::SparseMixer {
                gate: lin(&(p / "gate"), d, m.experts, false),
                eps,
            },
            (Some(routing), _) => {
                let g = p / "gate";
                Router::Grouped {
                    weight: g.var("weight", &[m.experts, d], RANDN),
                    correction: (routing.scoring == Scoring::Sigmoid)
                        .then(|| g.zeros_no_train("e_score_correction_bias", &[m.experts])),
                    routing: routing.clone(),
                }
            }
            // GPT-OSS's router is no linear layer (`GptOssTopKRouter`
            // holds its weight and bias as parameters): `lin` builds it
            // bare, as `bare`'s table says, and Llama 4's.
            (None, _) if family == Family::GptOss => Router::Softmax {
                gate: lin(&(p / "router"), d, m.experts, true),
                correction: None,
            },
            (None, _) if family == Family::JetMoe => Router::TopSoftmax {
                gate: lin(&(p / "router" / "layer"), d, m.experts, false),
            },
            (None, _) if family == Family::AriaText => Router::TopSoftmax {
                gate: lin(&(p / "router"), d, m.experts, false),
            },
            (None, _) if family.granite_moe() || family == Family::Dbrx => Router::Softmax {
                gate: lin(&(p / "router" / "layer"), d, m.experts, false),
                correction: None,
            },
            (None, _) if family == Family::Ernie4_5Moe => Router::Softmax {
                gate: lin(&(p / "gate"), d, m.experts, false),
                correction: Some(
                    (p / "moe_statics").zeros_no_train("e_score_correction_bias", &[1, m.experts]),
                ),
            },
            (None, _) if family == Family::Jamba => Router::Softmax {
                gate: lin(&(p / "router"), d, m.experts, false),
                correction: None,
            },
            (None, _) if family == Family::Llama4 => Router::TopSigmoid {
                gate: lin(&(p / "router"), d, m.experts, false),
            },
            (None, _) if family == Family::HunyuanMoe => Router::Softmax {
                gate: lin(&(p / "gate" / "wg"), d, m.experts, false),
                correction: None,
            },
            (None, _) => Router::Softmax {
                gate: lin(&(p / "gate"), d, m.experts, false),
                correction: None,
            },
        };
        Self {
            router,
            experts,
            top_k: m.top_k,
            normalize: m.normalize,
            shared,
            bias: (family == Family::JetMoe).then(|| p.zeros("bias", &[d])),
            balance: None,
            scattered: family == Family::GptOss,
            zero: m.zero,
            silu_routed: family == Family::AriaText,
        }
    }

    /// `h` `[batch, seq, d]` through each token's top experts, as
    /// `transformers`' sparse blocks compute it: the routing softmax in
    /// fp32, the experts in order, each on its tokens only, their
    /// weighted outputs added into the result in that order. An expert no
    /// token chose runs on nothing, and its parameters get no gradient
    /// (the plan declares them: [`hf_weight_rules`]).
    fn forward(&self, h: &Tensor, act: Activation, training: bool) -> Tensor {
        let (b, t, d) = h.size3().unwrap_or((1, 1, 1));
        let h = h.view([-1, d]);
        let (weights, chosen, probs) = self.route(&h, training);
        // The sum in the weights' dtype: the input's, DeepSeek-V3's fp32.
        let mut out = Tensor::zeros([b * t, d], (weights.kind(), h.device()));
        // [experts, k, tokens]: which of each token's k slots chose it.
        let (real, all) = (self.experts.count(), self.experts.count() + self.zero);
        let routed_act = match self.silu_routed {
            true => Activation::Silu,
            false => act,
        };
        let mask = chosen.one_hot(all).permute([2, 1, 0]);
        for e in 0..all {
            let hits = mask.get(e).nonzero();
            if hits.size()[0] == 0 {
                continue;
            }
            let (slot, token) = (hits.select(1, 0), hits.select(1, 1));
            let w = weights.index(&[Some(token.shallow_clone()), Some(slot)]);
            let x = h.index_select(0, &token);
            // Llama 4's weights scale the expert's input, the others' its
            // output.
            let y = match self.router {
                // LongCat-Flash's zero experts pass the token through.
                _ if e >= real => x * w.unsqueeze(-1),
                Router::TopSigmoid { .. } => {
                    self.experts.forward(e, &(x * w.unsqueeze(-1)), routed_act)
                }
                _ => self.experts.forward(e, &x, routed_act) * w.unsqueeze(-1),
            };
            // Added into the sum by `index_put_`, each token once an
            // expert, as `index_add_` would add it: autograd keeps the
            // latter's source whole for its shape (a token's k outputs),
            // the former's nothing but the indices.
            let _ = out.index_put_(&[Some(token)], &y.to_kind(out.kind()), true);
        }
        let mut out = out.to_kind(h.kind());
        // The shared expert's output (gated, Qwen2-MoE's) joins the
        // routed sum last.
        if let Some(s) = &self.shared {
            let (gate, up) = s.gate_up.forward(&h);
            let y = s.down.forward(&super::glu::gated(act, &gate, &up));
            out += match &s.gate {
                Some(gate) => gate.forward(&h).sigmoid() * y,
                None => y,
            };
        }
        let out = out.view([b, t, d]);
        let out = match &self.bias {
            Some(bias) => out + bias,
            None => out,
        };
        match (&self.balance, probs) {
            (Some(decoding), Some((probs, counted))) => {
                super::balance::balanced(out, &probs, &counted, decoding)
            }
            _ => out,
        }
    }

    /// Each token's `k` experts `[tokens, k]` and their weights: the
    /// softmax's top `k` in the input's dtype, or DeepSeek-V3's choice
    /// within the best groups, its weights in fp32; PhiMoE's
    /// sparsemixer's, drawing in `training`. Third, when the model
    /// trains with the load-balancing loss, the routing probabilities it
    /// balances ([`super::balance`]): the softmax over every expert's
    /// logit (fp32; PhiMoE's in the logits' dtype, as `transformers`
    /// takes it), GPT-OSS's over its scattered weights; and the experts
    /// it counts, that softmax's top `k`, which PhiMoE's sparsemixer and
    /// ERNIE 4.5's correction may not have chosen.
    fn route(&self, h: &Tensor, training: bool) -> (Tensor, Tensor, Option<(Tensor, Tensor)>) {
        let f = Kind::Float;
        match &self.router {
            Router::Softmax {
                gate,
                correction: None,
            } => {
                let probs = gate.forward(h).softmax(1, f);
                let (weights, chosen) = probs.topk(self.top_k, -1, true, true);
                let weights = self.normalized(weights);
                let balanced = self.balance.as_ref().map(|_| {
                    let probs = match self.scattered {
                        true => (probs.zeros_like().scatter(1, &chosen, &weights)).softmax(1, f),
                        false => probs,
                    };
                    (probs, chosen.shallow_clone())
                });
                (weights.to_kind(h.kind()), chosen, balanced)
            }
            _ => {
                // The probabilities come only when the model balances.
                let (weights, chosen, probs) = self.route_other(h, training);
                let balanced = probs.map(|p| {
                    let counted = tch::no_grad(|| p.topk(self.top_k, -1, true, true).1);
                    (p, counted)
                });
                (weights, chosen, balanced)
            }
        }
    }

    /// The top `k` `weights` (fp32) over their sum when the router
    /// renormalises them: over at least ERNIE 4.5's `moe_norm_min`,
    /// 1e-12 (which never binds elsewhere: the top score is 1/experts or
    /// more).
    fn normalized(&self, weights: Tensor) -> Tensor {
        match self.normalize {
            true => {
                &weights
                    / weights
                        .sum_dim_intlist(-1, true, Kind::Float)
                        .clamp_min(1e-12)
            }
            false => weights,
        }
    }

    /// [`Self::route`]'s experts and weights for every router but the
    /// plain softmax, and the softmax of PhiMoE's and ERNIE 4.5's logits
    /// when the model trains with the load-balancing loss (which
    /// `transformers` computes for them).
    fn route_other(&self, h: &Tensor, training: bool) -> (Tensor, Tensor, Option<Tensor>) {
        let (weight, correction, g) = match &self.router {
            Router::SparseMixer { gate, eps } => {
                let logits = gate.forward(h);
                let (weights, chosen) = super::sparse_mixer::route(&logits, *eps, training);
                let probs = (self.balance.as_ref())
                    .map(|_| logits.softmax(-1, logits.kind()).to_kind(Kind::Float));
                return (weights, chosen, probs);
            }
            Router::TopSoftmax { gate } => {
                let (weights, chosen) =
                    super::jetmoe::top_k_softmax(&gate.forward(h), self.top_k, h.kind());
                return (weights, chosen, None);
            }
            Router::TopSigmoid { gate } => {
                let (top, chosen) = gate.forward(h).topk(self.top_k, -1, true, true);
                let weights = top.to_kind(Kind::Float).sigmoid().to_kind(h.kind());
                return (weights, chosen, None);
            }
            Router::Softmax { gate, correction } => {
                let f = Kind::Float;
                let probs = gate.forward(h).softmax(1, f);
                let (weights, chosen) = match correction {
                    None => probs.topk(self.top_k, -1, true, true),
                    Some(c) => {
                        let chosen = tch::no_grad(|| {
                            (&probs + c.to_kind(f)).topk(self.top_k, -1, true, true).1
                        });
                        (probs.gather(1, &chosen, false), chosen)
                    }
                };
                let weights = self.normalized(weights).to_kind(h.kind());
                return (weights, chosen, self.balance.as_ref().map(|_| probs));
            }
            Router::Grouped {
                weight,
                correction,
                routing,
            } => (weight, correction, routing),
        };
        let f = Kind::Float;
        let logits = h.to_kind(f).linear::<&Tensor>(&weight.to_kind(f), None);
        let scores = match g.scoring {
            Scoring::Sigmoid => logits.sigmoid(),
            Scoring::Softmax => logits.softmax(-1, f),
        };
        let chosen = tch::no_grad(|| {
            let choice = match correction {
                Some(c) => &scores + c.to_kind(f).unsqueeze(0),
                None => scores.shallow_clone(),
            };
            let (n, e) = (choice.size()[0], choice.size()[1]);
            let per = e / g.groups;
            // A group's worth: its two best (DeepSeek-V2: its best); the
            // others' experts out.
            let grouped = choice.view([n, g.groups, per]);
            let groups = match g.scoring {
                Scoring::Sigmoid => {
                    (grouped.topk(2, -1, true, true).0).sum_dim_intlist(-1, false, f)
                }
                Scoring::Softmax => grouped.amax(-1, false),
            };
            let best = groups.topk(g.top_groups, -1, true, false).1;
            let kept = groups.zeros_like().scatter_value(1, &best, 1.0);
            let kept = kept
                .unsqueeze(-1)
                .expand([n, g.groups, per], false)
                .reshape([n, e]);
            let choice = choice.masked_fill(&kept.eq(0.0), 0.0);
            choice.topk(self.top_k, -1, true, false).1
        });
        let weights = scores.gather(1, &chosen, false);
        let weights = match self.normalize {
            true => &weights / (weights.sum_dim_intlist(-1, true, f) + 1e-20),
            false => weights,
        };
        (weights * g.scale, chosen, None)
    }
}

impl Layer {
    /// Decoder layer `l` under `p`, its linear layers with the adapters
    /// `lora` targets.
    pub(super) fn new(
        p: &nn::Path,
        l: i64,
        c: &LlamaConfig,
        state: (&Training, &Arc<Decoding>),
        lora: Option<&LoraConfig>,
    ) -> Self {
        if c.family != Family::LongcatFlash {
            return Self::build((p, None), l, c, state, lora);
        }
        // LongCat-Flash's two sublayers and its experts beside them.
        let mut first = Self::build((p, Some(0)), l, c, state, lora);
        let second = Self::build((p, Some(1)), l, c, state, lora);
        let (training, decoding) = state;
        let lin = |p: &nn::Path, i, o, bias| Adapted::new(p, (i, o, bias), lora, training);
        let lin: &Lin<'_> = &lin;
        let experts = c.moe.as_ref().map(|moe| {
            let mut e = Experts::new(
                (p, &(p / "mlp")),
                (c.hidden, moe, c.mlp_bias),
                c.family,
                (lin, lora),
            );
            e.balance = moe.balance.map(|_| decoding.clone());
            e
        });
        first.shortcut = Some(Box::new(Shortcut { second, experts }));
        first
    }

    /// Decoder layer `l` under `p`, or LongCat-Flash's sublayer `sub`
    /// of it.
    fn build(
        (p, sub): (&nn::Path, Option<i64>),
        l: i64,
        c: &LlamaConfig,
        (training, decoding): (&Training, &Arc<Decoding>),
        lora: Option<&LoraConfig>,
    ) -> Self {
        // BitNet's quantization-aware training rounds every linear
        // layer's weights and inputs. The targets match PEFT's names:
        // a Zamba's hybrid layer's Mamba layer is under `mamba_decoder`
        // there, which a pattern may name.
        let lin = |p: &nn::Path, i, o, bias| {
            let name = crate::lora::module_name(p, "");
            let name = match &c.zamba {
                Some(z) => super::zamba::file_name(&name, z),
                None => name,
            };
            // The layers PEFT's adapter would not work on take none.
            let (lora, training) = match super::bare::is_bare(c.family, &name) {
                true => (None, &Training::default()),
                false => (lora, training),
            };
            (Adapted::new_as(p, &name, (i, o, bias), lora, training))
                .ternary(c.ternary)
                .ternary_norm(p, c.ternary_norm)
        };
        let lin: &Lin<'_> = &lin;
        let (a, m) = match c.family {
            Family::Llama4 | Family::Bamba | Family::Jamba | Family::FalconH1 | Family::Lfm2 => {
                (p / "self_attn", p / "feed_forward")
            }
            Family::JetMoe => (p / "self_attention", p / "mlp"),
            Family::RecurrentGemma => (p / "temporal_block", p / "mlp_block"),
            Family::LongcatFlash => {
                let i = sub.unwrap_or(0);
                (p / "self_attn" / i, p / "mlps" / i)
            }
            Family::Dbrx => (p / "norm_attn_norm" / "attn", p / "ffn"),
            Family::Falcon | Family::Bloom => (p / "self_attention", p / "mlp"),
            Family::GptNeoxJapanese => (p / "attention", p / "mlp"),
            f if f.gptj()
                || matches!(
                    f,
                    Family::GptBigCode | Family::OpenAiGpt | Family::ModernBertDecoder
                ) =>
            {
                (p / "attn", p / "mlp")
            }
            Family::GptNeo => (p / "attn" / "attention", p / "mlp"),
            Family::Mpt => (p / "attn", p / "ffn"),
            Family::Ctrl => (p / "multi_head_attention", p / "ffn"),
            Family::Rwkv => (p / "attention", p / "feed_forward"),
            Family::Xlstm => (p / "mlstm_layer", p / "ffn"),
            // OPT's MLP is the layer's own.
            f if f.fairseq() => (p / "self_attn", p.clone()),
            _ => (p / "self_attn", p / "mlp"),
        };
        let (d, hd, qkv, mb) = (c.hidden, c.head_dim, c.qkv_bias, c.mlp_bias);
        let window = c.window(l);
        // Gemma 3's and OLMo 3's windowed layers turn unscaled (Gemma 3's
        // at a base of their own).
        let rope = match (window, c.local_rope_theta) {
            (Some(_), Some(theta)) => (theta, RopeScaling::None),
            _ => (c.rope_theta, c.rope_scaling.clone()),
        };
        // OLMo normalises whole projections, the others each head.
        let (q_width, k_width) = match c.family.whole_qk_norm() {
            true => (c.heads * hd, c.kv_heads * hd),
            false => (hd, hd),
        };
        let turns = c.turns(l);
        let rotary = turns.then(|| {
            let r = Rotary::new(c.rotary_dim(), rope.0, &rope.1, c.positions, p.device());
            match c.family {
                f if f.cohere() => r.interleaved(true),
                f if f.glm() || f == Family::Helium => r.interleaved(false),
                // DeepSeek-V2's turned dimensions, neighbouring pairs,
                // turned in fp32 as complex numbers; ERNIE 4.5's in fp32.
                f if f == Family::DeepseekV2 || f.ernie() => r.interleaved(true),
                // Llama 4's neighbouring pairs, in fp32 as complex numbers;
                // GPT-J's, its angles in fp32.
                f if f == Family::Llama4 || f.gptj() => r.interleaved(true),
                // OLMo's halves in fp32.
                f if f.olmo() || f == Family::Olmo1 => r.in_fp32(),
                _ => r,
            }
        });
        // Granite 4.0's, Bamba's, Jamba's and the Mambas' Mamba layers in
        // place of attention (the Mambas' named `mixer`); Falcon-H1's
        // beside it (`beside`, below).
        let mixer = match c.family.mamba_only() {
            true => p / "mixer",
            false => p / "mamba",
        };
        // LFM2's convolution layers, MiniMax's lightning ones and
        // Qwen3-Next's DeltaNet ones in place of attention too.
        let (conv, lightning) = (c.short_conv_layer(l), c.lightning_layer(l));
        let delta = c.delta_net_layer(l);
        let linear_attn = p / "linear_attn";
        // RecurrentGemma's recurrent blocks too.
        let recurrent = c.rg_lru_layer(l);
        let kind = (
            c.mamba_layer(l),
            c.mamba1_layer(l),
            conv,
            lightning,
            delta,
            recurrent,
        );
        let qkv = match kind {
            (Some(m), ..) => {
                let in_proj = lin(&(&mixer / "in_proj"), d, m.projected(d), m.proj_bias);
                Qkv::Mamba(Box::new(Mamba::new(&mixer, c, m, in_proj)))
            }
            (None, Some(m), ..) => Qkv::Mamba1(Box::new(Mamba1::new(&mixer, c, m, lin))),
            (None, None, Some(s), ..) => {
                Qkv::ShortConv(Box::new(ShortConv::new(&(p / "conv"), d, s, lin)))
            }
            (None, None, None, Some(g), ..) => {
                Qkv::Lightning(Box::new(Lightning::new(&a, c, (l, g.block), lin)))
            }
            (None, None, None, None, Some(g), _) => {
                Qkv::DeltaNet(Box::new(DeltaNet::new(&linear_attn, (d, c.eps), g, lin)))
            }
            (None, None, None, None, None, Some(g)) => {
                Qkv::RgLru(Box::new(RgLru::new(&a, (d, c.heads, c.activation), g, lin)))
            }
            (None, None, None, None, None, None) => match (c.family, &c.mla) {
                (_, Some(mla)) => Qkv::Latent(Box::new(Latent::new(&a, c, mla, lin))),
                (Family::JetMoe, _) => Qkv::Moa(Box::new(Moa::new(&a, c, (lin, lora)))),
                (Family::Rwkv, _) => Qkv::Rwkv(Box::new(TimeMix::new(&a, c, lin))),
                (Family::Xlstm, _) => Qkv::Mlstm(Box::new(Mlstm::new(&a, c, lin))),
                (
                    Family::Phi3
                    | Family::Dbrx
                    | Family::Mpt
                    | Family::Falcon
                    | Family::Bloom
                    | Family::Persimmon
                    | Family::GptNeoxJapanese
                    | Family::CodeGen
                    | Family::GptBigCode
                    | Family::OpenAiGpt,
                    _,
                ) => {
                    let rows = (c.heads + 2 * c.kv_heads) * hd;
                    let name = match c.family {
                        Family::Dbrx | Family::Mpt => "Wqkv",
                        Family::Falcon
                        | Family::Bloom
                        | Family::Persimmon
                        | Family::GptNeoxJapanese => "query_key_value",
                        Family::GptBigCode | Family::OpenAiGpt => "c_attn",
                        // Phi-3's and CodeGen's.
                        _ => "qkv_proj",
                    };
                    Qkv::Fused(lin(&(&a / name), d, rows, qkv))
                }
                _ => {
                    // CTRL's `Wq`, `Wk`, `Wv`.
                    let [q, k, v] = match c.family {
                        Family::Ctrl => ["Wq", "Wk", "Wv"],
                        _ => ["q_proj", "k_proj", "v_proj"],
                    };
                    Qkv::Apart {
                        // Qwen3-Next's each head's output gate after its
                        // queries.
                        q_proj: lin(
                            &(&a / q),
                            d,
                            (1 + i64::from(c.gated_attention())) * c.heads * hd,
                            qkv,
                        ),
                        k_proj: lin(&(&a / k), d, c.kv_heads * hd, qkv),
                        v_proj: lin(&(&a / v), d, c.kv_heads * hd, qkv),
                    }
                }
            },
        };
        let sub_norms = (c.family == Family::Bitnet).then(|| {
            (
                RmsNorm::new(&a / "attn_sub_norm", d, c),
                RmsNorm::new(&m / "ffn_sub_norm", c.intermediate, c),
            )
        });
        Self {
            norms: Norms::new((p, sub, l), d, c),
            qkv,
            o_proj: (c.family != Family::JetMoe).then(|| match kind {
                (Some(m), ..) => lin(&(&mixer / "out_proj"), m.inner(d), d, m.out_bias()),
                (None, Some(m), ..) => lin(&(&mixer / "out_proj"), m.inner(d), d, m.proj_bias),
                (None, None, Some(s), ..) => lin(&(p / "conv" / "out_proj"), d, d, s.bias),
                (None, None, None, Some(_), ..) => lin(&(&a / "out_proj"), c.heads * hd, d, false),
                (None, None, None, None, Some(g), _) => {
                    lin(&(&linear_attn / "out_proj"), g.value_width(), d, false)
                }
                (None, None, None, None, None, Some(g)) => {
                    lin(&(&a / "linear_out"), g.width, d, true)
                }
                (None, None, None, None, None, None) => lin(
                    &(&a / match c.family {
                        f if matches!(
                            f,
                            Family::Dbrx | Family::GptNeo | Family::Mpt | Family::Lfm2
                        ) || f.gptj()
                            || f.fairseq() =>
                        {
                            "out_proj"
                        }
                        Family::Falcon
                        | Family::Bloom
                        | Family::Persimmon
                        | Family::GptNeoxJapanese => "dense",
                        Family::GptBigCode | Family::OpenAiGpt => "c_proj",
                        Family::Ctrl => "dense",
                        Family::ModernBertDecoder => "Wo",
                        Family::Rwkv => "output",
                        Family::Xlstm => "out_proj",
                        _ => "o_proj",
                    }),
                    c.heads * c.v_head_dim(),
                    d,
                    c.o_bias,
                ),
            }),
            mlp: match (&c.moe, c.moe_layer(l)) {
                _ if c.family.mamba_only() || c.family.zamba() => Mlp::None,
                _ if c.family == Family::Rwkv => {
                    Mlp::ChannelMix(Box::new(ChannelMix::new(&m, c, lin, decoding)))
                }
                // LongCat-Flash's experts are the layer's, beside its
                // sublayers' dense MLPs.
                (Some(moe), true) if c.family != Family::LongcatFlash => {
                    let under = match c.family {
                        f if matches!(f, Family::Mixtral | Family::Phimoe | Family::MiniMax)
                            || f.granite_moe() =>
                        {
                            p / "block_sparse_moe"
                        }
                        _ => m,
                    };
                    let mut experts =
                        Experts::new((p, &under), (d, moe, c.mlp_bias), c.family, (lin, lora));
                    experts.balance = moe.balance.map(|_| decoding.clone());
                    Mlp::Experts(experts)
                }
                // StarCoder2's `c_fc`/`c_proj`, Arcee's `up_proj`/`down_proj`.
                _ if !c.family.gated() => {
                    let (up, down) = match c.family {
                        Family::Arcee | Family::Apertus | Family::Nemotron | Family::Mpt => {
                            ("up_proj", "down_proj")
                        }
                        Family::Falcon
                        | Family::Bloom
                        | Family::Persimmon
                        | Family::GptNeoxJapanese => ("dense_h_to_4h", "dense_4h_to_h"),
                        f if f.gptj() => ("fc_in", "fc_out"),
                        f if f.fairseq() => ("fc1", "fc2"),
                        // CTRL's `nn.Sequential`'s first and third.
                        Family::Ctrl => ("0", "2"),
                        _ => ("c_fc", "c_proj"),
                    };
                    let xielu = c.activation == Activation::Xielu;
                    Mlp::Plain {
                        c_fc: lin(&(&m / up), d, c.intermediate, mb),
                        c_proj: lin(&(&m / down), c.intermediate, d, mb),
                        xielu: xielu.then(|| Xielu::new(&(&m / "act_fn"))),
                    }
                }
                // Granite 4.0's dense layers: the shared MLP alone.
                _ if c.family == Family::GraniteMoeHybrid => {
                    let sp = p / "shared_mlp";
                    Mlp::Dense {
                        gate_up: GateUp::Fused(lin(
                            &(&sp / "input_linear"),
                            d,
                            2 * c.intermediate,
                            false,
                        )),
                        down_proj: lin(&(&sp / "output_linear"), c.intermediate, d, false),
                    }
                }
                _ => Mlp::Dense {
                    gate_up: match c.family {
                        f if f == Family::Phi3 || f.glm() => {
                            GateUp::Fused(lin(&(&m / "gate_up_proj"), d, 2 * c.intermediate, mb))
                        }
                        // ModernBERT-decoder's `Wi`: the activated half
                        // first, as Phi-3's gate.
                        Family::ModernBertDecoder => {
                            GateUp::Fused(lin(&(&m / "Wi"), d, 2 * c.intermediate, mb))
                        }
                        Family::Xlstm => GateUp::Apart {
                            gate_proj: lin(&(&m / "proj_up_gate"), d, c.intermediate, mb),
                            up_proj: lin(&(&m / "proj_up"), d, c.intermediate, mb),
                        },
                        // LFM2's `w1` and `w3` (`w2` down).
                        Family::Lfm2 => GateUp::Apart {
                            gate_proj: lin(&(&m / "w1"), d, c.intermediate, mb),
                            up_proj: lin(&(&m / "w3"), d, c.intermediate, mb),
                        },
                        _ => GateUp::Apart {
                            gate_proj: lin(&(&m / "gate_proj"), d, c.intermediate, mb),
                            up_proj: lin(&(&m / "up_proj"), d, c.intermediate, mb),
                        },
                    },
                    down_proj: match c.family {
                        Family::Lfm2 => lin(&(&m / "w2"), c.intermediate, d, mb),
                        Family::Xlstm => lin(&(&m / "proj_down"), c.intermediate, d, mb),
                        Family::ModernBertDecoder => lin(&(&m / "Wo"), c.intermediate, d, mb),
                        _ => lin(&(&m / "down_proj"), c.intermediate, d, mb),
                    },
                },
            },
            // LFM2's convolution layers have none, nor Qwen3-Next's
            // DeltaNet ones.
            qk_norm: (c.qk_norm && conv.is_none() && delta.is_none()).then(|| {
                let (q, k) = match c.family {
                    f if f.hunyuan() => ("query_layernorm", "key_layernorm"),
                    Family::Persimmon | Family::StableLm | Family::Lfm2 => {
                        ("q_layernorm", "k_layernorm")
                    }
                    _ => ("q_norm", "k_norm"),
                };
                // Persimmon's LayerNorms (with biases), StableLM's and
                // Cohere's with weights for each head, the others' RMSNorms.
                let norm = |name: &str, heads, width| match c.family {
                    Family::Persimmon => Norm::new(&a / name, width, c),
                    f if f.qk_norm_of_each_head() => Norm::of_each_head(&a / name, heads, hd, c),
                    _ => Norm::Rms(RmsNorm::new(&a / name, width, c)),
                };
                (norm(q, c.heads, q_width), norm(k, c.kv_heads, k_width))
            }),
            // A Mamba layer's slot holds its state while generating.
            cache: LayerCache::new(decoding, rotary.as_ref().and_then(Rotary::fixed_up_to)),
            beside: c.mamba_beside().map(|m| {
                let in_proj = lin(&(&mixer / "in_proj"), d, m.projected(d), m.proj_bias);
                Box::new(Beside {
                    mamba: Mamba::new(&mixer, c, m, in_proj),
                    out_proj: lin(&(&mixer / "out_proj"), m.inner(d), d, m.out_bias()),
                    cache: LayerCache::new(decoding, None),
                })
            }),
            rotary,
            window,
            chunk: (c.llama4.as_ref())
                .filter(|a| a.chunked.get(l as usize) == Some(&true))
                .and_then(|a| a.chunk),
            sinks: (c.family == Family::GptOss).then(|| a.var("sinks", &[c.heads], RANDN)),
            alibi: match (c.alibi(), c.falcon) {
                (true, Some(_)) => Some(super::falcon::alibi_slopes(c.heads, p.device())),
                (true, None) => Some(super::mpt::alibi_slopes(c.heads, p.device())),
                (false, _) => None,
            },
            differential: (c.family == Family::DiffLlama)
                .then(|| Differential::new(&a, hd, l, c.eps)),
            sub_norms,
            shortcut: None,
            dense_bias: c.last_dense_bias(l).then(|| a.zeros("dense_bias", &[d])),
            dynamic: (c.keep_window).map(|keep| DynamicMask::new(&a, c, keep, lin)),
            pre_norm: (c.family == Family::Rwkv && l == 0).then(|| Norm::new(p / "pre_ln", d, c)),
            hybrid: None,
            residual_weights: (c.family == Family::Doge).then(|| {
                (
                    p.ones("input_residual", &[d]),
                    p.ones("post_attention_residual", &[d]),
                )
            }),
            factors: c.residual_factors.map(|f| match lightning {
                Some(_) => (f.linear, f.mlp),
                None => (f.full, f.mlp),
            }),
            training: training.clone(),
            cfg: c.clone(),
        }
    }
}

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> Tensor {
        // Zamba's layers carry the embeddings beside the hidden states;
        // a hybrid layer's block reads both, and its output joins the
        // Mamba layer's input.
        if self.cfg.family.zamba() {
            let d = self.cfg.hidden;
            let (x, embeddings) = (x.narrow(-1, 0, d), x.narrow(-1, d, d));
            let on = self.training.on();
            let added = (self.hybrid.as_ref()).map(|h| h.forward(&x, &embeddings, on));
            let (y, _) = self.sublayers(&x, added.as_ref());
            return Tensor::cat(&[y, embeddings], -1);
        }
        let (y, h) = self.sublayers(x, None);
        match &self.shortcut {
            // LongCat-Flash's second sublayer, then its experts' output
            // of the first's MLP input, added last as its class adds it.
            Some(s) => {
                let z = s.second.forward(&y);
                match &s.experts {
                    Some(e) => z + e.forward(&h, self.cfg.activation, self.training.on()),
                    None => z,
                }
            }
            None => y,
        }
    }
}

impl Layer {
    /// This Zamba (or Zamba2) layer made hybrid: `hybrid`'s output joins its Mamba
    /// layer's input.
    pub(super) fn with_hybrid(mut self, hybrid: Hybrid) -> Self {
        self.hybrid = Some(Box::new(hybrid));
        self
    }

    /// The layer's output for `x`, and its MLP's input (which
    /// LongCat-Flash's experts read too); `added` joins the attention's
    /// (or mixer's) input before its norm, not the residual (a Zamba
    /// hybrid layer's block's output).
    fn sublayers(&self, x: &Tensor, added: Option<&Tensor>) -> (Tensor, Tensor) {
        let c = &self.cfg;
        let normed;
        let x = match &self.pre_norm {
            Some(norm) => {
                normed = norm.forward(x);
                &normed
            }
            None => x,
        };
        let h = match added {
            Some(a) => self.norms.attention_input(&(x + a)),
            None => self.norms.attention_input(x),
        };
        let a = match (&self.beside, &c.falcon_h1) {
            // Falcon-H1's attention and Mamba layer side by side, each
            // scaled by its multipliers, their outputs added.
            (Some(b), Some(f)) => {
                let a = self.project_out(&h, self.mix(&(&h * f.attention_in)));
                let s = b.out_proj.forward(&b.mamba.forward(&h, &b.cache));
                a * f.attention_out + s * f.ssm_out
            }
            _ => self.project_out(&h, self.mix(&h)),
        };
        let a = match &self.dense_bias {
            Some(bias) => a + bias,
            None => a,
        };
        // Falcon's parallel layers add the attention's output to the
        // MLP's and drop the sum out; the others add it now (Cohere's MLP
        // output joins the sum after it, as there).
        let joint = c.falcon.is_some_and(|f| f.parallel);
        let (x, held) = match joint {
            true => (x.shallow_clone(), Some(a)),
            false => {
                let a = self.training.dropout(a, c.attention_output_dropout());
                let x = match self.factors.map(|f| f.0) {
                    // MiniMax's residual: the normalised input, weighted.
                    Some((alpha, beta)) => &h * alpha + a * beta,
                    None => self.carried(x, false) + self.residual(self.norms.attention_output(a)),
                };
                (self.norms.after_attention(x), None)
            }
        };
        let h = self.norms.mlp_input(&x, h);
        // The router's jitter in training (DBRX's, Mixtral's, MiniMax's;
        // PhiMoE's input jitter), which `transformers` applies to the
        // MoE block's input in place: the experts' input too, and
        // MiniMax's residual, which is that same tensor.
        let h = match (&self.mlp, &c.moe) {
            (Mlp::Experts(_), Some(moe)) => self.training.jitter(h, moe.jitter),
            _ => h,
        };
        let m = match &self.mlp {
            // Mamba's layers end with the scan's output added.
            Mlp::None => return (x, h),
            // Falcon-H1's multiplies the gate inside the activation and
            // the output.
            Mlp::Dense { gate_up, down_proj } => {
                let (gate, up) = gate_up.forward(&h);
                match &c.falcon_h1 {
                    Some(f) => {
                        let [by_gate, by_down] = f.mlp;
                        down_proj.forward(&(up * c.activation.apply(&(gate * by_gate)))) * by_down
                    }
                    None => {
                        let product = super::glu::gated(c.activation, &gate, &up);
                        match &self.sub_norms {
                            Some((_, mlp)) => down_proj.forward(&mlp.forward(&product)),
                            None => down_proj.forward(&product),
                        }
                    }
                }
            }
            Mlp::Plain {
                c_fc,
                c_proj,
                xielu,
            } => {
                let up = c_fc.forward(&h);
                let m = match xielu {
                    Some(act) => act.forward(&up),
                    None => c.activation.apply(&up),
                };
                c_proj.forward(&m)
            }
            Mlp::Experts(experts) => experts.forward(&h, c.activation, self.training.on()),
            Mlp::ChannelMix(mix) => mix.forward(&h),
        };
        let m = match held {
            Some(a) => m + a,
            None => m,
        };
        let m = self.training.dropout(m, c.resid_dropout);
        let out = match self.factors.map(|f| f.1) {
            Some((alpha, beta)) => &h * alpha + m * beta,
            None => self
                .norms
                .after_mlp(self.carried(&x, true) + self.residual(self.norms.mlp_output(m))),
        };
        (out, h)
    }
}

impl Layer {
    /// The mixed tokens (`mixed`, of the normalised input `h`) projected
    /// back to the model's width: through BitNet's sub norm, then the
    /// output projection; JetMoE's merged by its experts.
    fn project_out(&self, h: &Tensor, mixed: Tensor) -> Tensor {
        if let Qkv::Moa(m) = &self.qkv {
            return m.merge(h, &mixed);
        }
        let mixed = match &self.sub_norms {
            Some((attention, _)) => attention.forward(&mixed),
            None => mixed,
        };
        match &self.o_proj {
            Some(o) => o.forward(&mixed),
            None => mixed,
        }
    }

    /// The tokens of the normalised input `h` mixed, before the output
    /// projection: the attention's output, its heads merged, or Granite
    /// 4.0's Mamba layer's.
    fn mix(&self, h: &Tensor) -> Tensor {
        let (b, t, _) = h.size3().unwrap_or((1, 1, 1));
        let c = &self.cfg;
        // Normalised over the projection before the heads are split
        // (OLMo), or over each head after.
        let whole = c.family.whole_qk_norm();
        let heads = |x: Tensor, n: i64, norm: Option<&Norm>| {
            let normed = |x: Tensor| norm.map_or_else(|| x.shallow_clone(), |nm| nm.forward(&x));
            let x = if whole { normed(x) } else { x };
            let x = x.view([b, t, n, c.head_dim]);
            let x = if whole { x } else { normed(x) };
            // OLMoE's clip, after the norms.
            let x = match c.clip_qkv {
                Some(clip) => x.clamp(-clip, clip),
                None => x,
            };
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
        // Hunyuan normalises each head's queries and keys after they
        // turn, the others before.
        let after = c.family.hunyuan();
        let qk = |x: Tensor, n: i64, norm: Option<&Norm>| match (after, norm) {
            (true, Some(norm)) => norm.forward(&turned(heads(x, n, None))),
            _ => turned(heads(x, n, norm)),
        };
        // Falcon-H1's keys scaled before they turn.
        let key_by = c.falcon_h1.as_ref().map(|f| f.key);
        let split = |q, k: Tensor, v| {
            let k = match key_by {
                Some(by) => k * by,
                None => k,
            };
            [
                qk(q, c.heads, qn),
                qk(k, c.kv_heads, kn),
                heads(v, c.kv_heads, None),
            ]
        };
        // Qwen3-Next's output gate, from `q_proj`.
        let mut gate = None;
        let [q, k, v] = match &self.qkv {
            Qkv::Mamba(m) => return m.forward(h, &self.cache),
            Qkv::Mamba1(m) => return m.forward(h, &self.cache),
            Qkv::ShortConv(s) => return s.forward(h, &self.cache),
            Qkv::Lightning(g) => return g.forward(h, &self.cache),
            Qkv::DeltaNet(g) => return g.forward(h, &self.cache),
            Qkv::RgLru(g) => return g.forward(h, &self.cache),
            Qkv::Rwkv(t) => return t.forward(h, &self.cache),
            Qkv::Mlstm(m) => return m.forward(h, &self.cache),
            // Qwen3-Next's: each head's queries, then its output gate.
            Qkv::Apart {
                q_proj,
                k_proj,
                v_proj,
            } if c.gated_attention() => {
                let both = q_proj.forward(h).view([b, t, c.heads, 2 * c.head_dim]);
                let half = |i: i64| {
                    (both.narrow(-1, i * c.head_dim, c.head_dim)).reshape([
                        b,
                        t,
                        c.heads * c.head_dim,
                    ])
                };
                gate = Some(half(1));
                split(half(0), k_proj.forward(h), v_proj.forward(h))
            }
            Qkv::Apart {
                q_proj,
                k_proj,
                v_proj,
            } => split(q_proj.forward(h), k_proj.forward(h), v_proj.forward(h)),
            // Falcon's (GPT-BigCode's: one group, or one a head; BLOOM's,
            // Persimmon's and GPT-NeoX-Japanese's: one a head): each
            // group of heads sharing keys and values holds its queries,
            // then its key, then its value.
            Qkv::Fused(qkv)
                if matches!(
                    c.family,
                    Family::Falcon
                        | Family::GptBigCode
                        | Family::Bloom
                        | Family::Persimmon
                        | Family::GptNeoxJapanese
                ) =>
            {
                let per = c.heads / c.kv_heads;
                let qkv = qkv.forward(h).view([b, t, c.kv_heads, per + 2, c.head_dim]);
                let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
                split(
                    qkv.narrow(3, 0, per).reshape([b, t, q]),
                    qkv.select(3, per).reshape([b, t, kv]),
                    qkv.select(3, per + 1).reshape([b, t, kv]),
                )
            }
            // CodeGen's: four blocks, each a quarter of the heads'
            // queries, then their values, then their keys.
            Qkv::Fused(qkv) if c.family == Family::CodeGen => {
                let (per, width) = (c.heads / CODEGEN_BLOCKS, c.heads * c.head_dim);
                let qvk = qkv
                    .forward(h)
                    .view([b, t, CODEGEN_BLOCKS, 3, per, c.head_dim]);
                let part = |i: i64| qvk.select(3, i).reshape([b, t, width]);
                split(part(0), part(2), part(1))
            }
            Qkv::Fused(qkv) => {
                let qkv = qkv.forward(h);
                let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
                split(
                    qkv.narrow(-1, 0, q),
                    qkv.narrow(-1, q, kv),
                    qkv.narrow(-1, q + kv, kv),
                )
            }
            Qkv::Latent(latent) => latent.forward(h, c.heads, &turned),
            Qkv::Moa(moa) => {
                let [q, k, v] = moa.queries_keys_values(h);
                split(q, k, v)
            }
        };
        let (q, k) = self.llama4_queries_and_keys(q, k, offset);
        let (k, v) = self.cache.extend(k, v);
        // DiffLlama's heads attend over every head's keys and over values
        // twice as wide, and combine in pairs.
        if let Some(diff) = &self.differential {
            let (k, v) = (
                Differential::every_head(&k, c.heads),
                Differential::values(&v, c.heads),
            );
            // libtorch's fused kernel takes one width for all three: the
            // queries and keys padded with zeros to the values' (their
            // products unchanged), the scores scaled by their own width.
            // Unpadded they would take the kernel that keeps every score.
            let d = q.size()[3];
            let (q, k) = (q.constant_pad_nd([0, d]), k.constant_pad_nd([0, d]));
            let out = self.attention(&q, &k, &v, (offset, Some(d)), documents.as_ref());
            return (diff.combine(&out).transpose(1, 2).contiguous()).view([
                b,
                t,
                c.heads * c.head_dim,
            ]);
        }
        // Latent attention's values narrower than its queries and keys
        // (DeepSeek's 128 against 192): libtorch's fused kernel takes
        // them padded with zeros to the queries' width (as
        // `transformers`' FlashAttention-2 path does), where unpadded
        // they would take the kernel that keeps every score.
        let narrow_values = (c.mla.as_ref())
            .map(|m| (m.v, m.nope + m.rope))
            .filter(|(v, qk)| v < qk);
        let out = match narrow_values {
            Some((width, qk)) => {
                let v = v.constant_pad_nd([0, qk - width]);
                (self.attention(&q, &k, &v, (offset, None), documents.as_ref()))
                    .narrow(-1, 0, width)
            }
            None => self.attention(&q, &k, &v, (offset, None), documents.as_ref()),
        };
        let out = (out.transpose(1, 2))
            .contiguous()
            .view([b, t, c.heads * c.v_head_dim()]);
        match gate {
            Some(gate) => out * gate.sigmoid(),
            None => out,
        }
    }
}

/// `x / sqrt(mean(x^2) + eps)` over each head's width, in fp32, then
/// cast back (Llama 4's `Llama4TextL2Norm`).
fn l2_norm(x: &Tensor, eps: f64) -> Tensor {
    rms_normalized(x, eps).to_kind(x.kind())
}

impl Layer {
    /// Llama 4's queries and keys `[batch, heads, seq, hd]` at row
    /// positions from `offset`: a turning layer's L2-normalised (with
    /// `use_qk_norm`), the others' queries grown with the position
    /// (`attn_temperature_tuning`); anyone else's as they are.
    fn llama4_queries_and_keys(&self, q: Tensor, k: Tensor, offset: i64) -> (Tensor, Tensor) {
        let Some(a) = &self.cfg.llama4 else {
            return (q, k);
        };
        match (&self.rotary, a.temperature) {
            (Some(_), _) if a.qk_l2_norm => (l2_norm(&q, self.cfg.eps), l2_norm(&k, self.cfg.eps)),
            (None, Some((floor, scale))) => {
                let t = q.size()[2];
                let p = Tensor::arange_start(offset, offset + t, (Kind::Float, q.device()));
                let grown = ((p + 1.0) / floor).floor().log1p() * scale + 1.0;
                ((&q * grown.view([1, 1, -1, 1])).to_kind(q.kind()), k)
            }
            _ => (q, k),
        }
    }

    /// The residual `x` a sublayer's output joins (the MLP's when `mlp`):
    /// times Doge's weights on it.
    fn carried(&self, x: &Tensor, mlp: bool) -> Tensor {
        match (&self.residual_weights, mlp) {
            (Some((attention, _)), false) => x * attention,
            (Some((_, mlp)), true) => x * mlp,
            (None, _) => x.shallow_clone(),
        }
    }

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
    /// operation for operation (the fused kernel cannot cap them, nor add
    /// GPT-OSS's sinks or Doge's bias; in training without dropout a
    /// block of queries at a time, `eager_attention`). Packed
    /// `documents` each attend within themselves (and their window). The
    /// queries start at row position `offset`; queries and keys padded
    /// with zeros past their own `width` are scaled by it.
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        (offset, width): (i64, Option<i64>),
        documents: Option<&Documents>,
    ) -> Tensor {
        let c = &self.cfg;
        let t = q.size()[2];
        // Within a sliding window shorter than the sequence, a token sees
        // itself and the `w - 1` before it; else every earlier token.
        // Queries at `offset..offset + t` over keys from 0 (a cache's).
        let visible = |w: i64| in_window_from((offset, t), offset + t, w, q.device());
        let dropout = self.training.attention(c.attention_weights_dropout());
        // Queries padded past their `width` are scaled as their own width
        // would be, as the kernel computes it.
        let scale = (c.attention_multiplier)
            .or(c.query_scalar.map(|s| s.powf(-0.5)))
            .or(width.map(|d| 1.0 / (d as f64).sqrt()));
        // Scores the fused kernel cannot compute: soft-capped, beside
        // sinks, or biased by Doge's dynamic mask (which its keys' values
        // make, so its gradient reaches them).
        let eager_only = c.attn_softcap.is_some() || self.sinks.is_some() || self.dynamic.is_some();
        // MPT's, BLOOM's and Falcon-RW's ALiBi: the slopes' bias in the
        // mask.
        if let Some(slopes) = &self.alibi {
            let mask = self
                .cache
                .alibi_mask((t, offset, q.kind()), || match c.falcon {
                    Some(_) => super::falcon::alibi_mask(
                        slopes,
                        (t, offset),
                        documents,
                        (q.kind(), c.head_dim),
                    ),
                    None => super::mpt::alibi_mask(slopes, (t, offset), documents, q.kind()),
                });
            return Tensor::scaled_dot_product_attention(
                q,
                k,
                v,
                Some(mask),
                dropout,
                false,
                scale,
                false,
            );
        }
        if !eager_only {
            // DeepSeek-V3's keys and values are every head's.
            let grouped = c.kv_heads != c.heads && c.mla.is_none();
            // Llama 4's chunked layers: each token sees the earlier ones
            // of its chunk of the row (and of its document), when the
            // row is longer than a chunk. One mask of scores for every
            // chunked layer of the forward, as a window's.
            if let Some(size) = self.chunk.filter(|&s| s < offset + t) {
                let visible = || {
                    let opts = (Kind::Int64, q.device());
                    let i = Tensor::arange_start(offset, offset + t, opts).unsqueeze(1);
                    let j = Tensor::arange(offset + t, opts).unsqueeze(0);
                    let chunk = |x: &Tensor| x.divide_scalar_mode(size, "floor");
                    let mask = chunk(&i)
                        .eq_tensor(&chunk(&j))
                        .logical_and(&i.ge_tensor(&j));
                    match documents {
                        Some(d) => mask.logical_and(&d.visible_within(None)),
                        None => mask,
                    }
                };
                let mask = (self.cache).chunk_mask((t, offset, size, q.kind()), visible);
                return Tensor::scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    Some(mask),
                    dropout,
                    false,
                    scale,
                    grouped,
                );
            }
            if let Some(d) = documents {
                return d.attend((q, k, v), self.window, scale, dropout, grouped);
            }
            // A cache's keys reach back past the queries: an explicit mask.
            // A window's, shared by the layers of this forward.
            let window = match offset {
                0 => (self.window.filter(|&w| w < t))
                    .map(|w| self.cache.window_mask((t, 0, w, q.kind()), || visible(w))),
                _ => Some(visible(self.window.unwrap_or(offset + t + 1))),
            };
            let causal = window.is_none();
            return Tensor::scaled_dot_product_attention(
                q, k, v, window, dropout, causal, scale, grouped,
            );
        }
        let groups = c.heads / c.kv_heads;
        // Doge's bias on each key, from its values.
        let bias = (self.dynamic.as_ref()).map(|m| m.bias(v, c.heads));
        let (k, v) = (
            k.repeat_interleave_self_int(groups, 1, None),
            v.repeat_interleave_self_int(groups, 1, None),
        );
        let scale = scale.unwrap_or((c.head_dim as f64).powf(-0.5));
        let dynamic = (self.dynamic.as_ref()).and_then(|m| Some((bias.as_ref()?, m.keep())));
        let eager = |q: &Tensor, k: &Tensor, v: &Tensor, visible: &Tensor| {
            let (bias, visible) = match dynamic {
                Some((bias, keep)) => (Some(bias), super::doge::kept(bias, visible, keep)),
                None => (None, visible.shallow_clone()),
            };
            let extra = (bias, self.sinks.as_ref());
            let weights =
                super::eager_attention::weights((q, k), &visible, extra, (scale, c.attn_softcap));
            self.training
                .dropout(weights, c.attention_weights_dropout())
                .matmul(v)
        };
        let window = self.window.unwrap_or(offset + t + 1);
        match documents {
            // Without dropout, each document's scores alone (as the fused
            // kernel's, `Documents::attend`): the row's would be `seq`
            // squared a head. With it, the row's, so that the weights
            // dropped are those `transformers` drops.
            // (Doge's bias is the row's keys'.)
            Some(d) if dropout == 0.0 && bias.is_none() => d
                .per_document((q, &k, &v), |q, k, v, n| {
                    eager(q, k, v, &in_window(n, window, q.device()))
                }),
            Some(d) => eager(q, &k, &v, &d.visible_within(self.window)),
            // Training on soft-capped scores, beside sinks or under
            // Doge's dynamic mask: a block of queries at a time, each
            // computed again in backward, so that no layer keeps its
            // scores.
            None if offset == 0 && dropout == 0.0 && q.requires_grad() => {
                let settings = (scale, c.attn_softcap, window);
                let extra = (dynamic, self.sinks.as_ref());
                super::eager_attention::in_blocks((q, &k, &v), extra, settings).unwrap_or_else(
                    |e| {
                        tracing::warn!("{e}: the eager attention runs whole");
                        eager(q, &k, &v, &visible(window))
                    },
                )
            }
            None => eager(q, &k, &v, &visible(window)),
        }
    }
}
