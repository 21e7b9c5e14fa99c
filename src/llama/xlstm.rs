//! xLSTM ([`Family::Xlstm`], `xLSTMForCausalLM`: NX-AI's xLSTM 7B):
//! its `config.json` read flat and written back, and its mLSTM cell,
//! which takes the place of a layer's attention.
//!
//! Each block (`backbone.blocks.N`) RMS-normalises its input
//! (`norm_mlstm`) for the mLSTM layer (`mlstm_layer`) and adds its
//! output to the residual, then normalises again (`norm_ffn`) for a
//! SiLU-gated MLP (`ffn`: `proj_up_gate`, `proj_up`, `proj_down`). The
//! mLSTM layer projects each token to its queries and keys
//! (`qk_dim_factor` of the width), values and output gate
//! (`v_dim_factor`), and each head's input and forget gates,
//! soft-capped (`gate_soft_cap`); the cell (below) gives each head's
//! output, which is layer-normalised a head at a time
//! (`multihead_norm`), gated by the output gate's sigmoid and projected
//! back (`out_proj`). The logits are soft-capped too
//! (`output_logit_soft_cap`). The token embedding has no `padding_idx`:
//! every row trains.
//!
//! The cell is a matrix memory per head: `C_t = f_t C_{t-1} + i_t k_t
//! v_t^T`, `n_t = f_t n_{t-1} + i_t k_t`, `h_t = q_t C_t / max(|q_t
//! n_t|, exp(-m_t))` (the queries scaled by the key width's inverse
//! root, plus `eps`), its gates exponential and stabilised by a running
//! maximum `m_t = max(log f_t + m_{t-1}, i_t)` from a zero state.
//! `transformers`' sequence kernel steps it token by token; zrt computes
//! the same numbers for [`CHUNK`] tokens at once (each output a weighted
//! sum over the tokens before it, as attention is, the weights
//! `exp(log f_{s+1} + .. + log f_t + i_s - m_t)`, and the state before
//! the block), in fp32, each block from the state the one before ends
//! in, and steps from the state a forward ends in while generating. A
//! packed row's documents are each computed alone.
//!
//! `transformers` 4.57 runs its chunkwise kernel (in training, and in
//! inference past `chunk_size` tokens), which fails on CPU without the
//! `xlstm` package; its sequence kernel, which it runs on fewer tokens
//! than `chunk_size`, is what the tests hold zrt to. The kernel choices
//! (`mode`, `chunk_size`, the kernels' names, `autocast_kernel_dtype`)
//! are not read. `weight_mode` "fused" is refused: `transformers`
//! 4.57's class fails building one (its weight initialisation sizes
//! the fused gates' biases wrongly), so there is nothing to hold it to.

use serde_json::{json, Value};
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use crate::hf::{HfError, HfJson};
use crate::kv_cache::LayerCache;
use crate::lora::Adapted;

use super::config::LlamaConfig;
use super::family::Family;
use super::layer::Lin;
use super::own_names::{self, field, Default, Field};

/// xLSTM's own settings beside the flat fields.
#[derive(Debug, Clone, PartialEq)]
pub struct XlstmConfig {
    /// `qk_dim_factor`: the queries' and keys' width over the model's
    /// (truncated, as its layer computes it).
    pub qk_factor: f64,
    /// `v_dim_factor`: the values' and output gate's.
    pub v_factor: f64,
    /// `ffn_proj_factor`: the MLP's width over the model's, rounded up
    /// to a multiple of `ffn_round_up_to_multiple_of`.
    pub ffn_factor: f64,
    /// `ffn_round_up_to_multiple_of`.
    pub ffn_multiple: i64,
    /// `eps`: added to the cell's denominator.
    pub eps: f64,
    /// `gate_soft_cap`: the input and forget gates' pre-activations
    /// capped at it (`cap * tanh(x / cap)`); `None`: not capped.
    pub gate_cap: Option<f64>,
    /// `use_bias`: every projection and norm has a bias (the gates'
    /// projections always, the final norm never).
    pub bias: bool,
}

impl std::default::Default for XlstmConfig {
    /// `xLSTMConfig`'s defaults.
    fn default() -> Self {
        Self {
            qk_factor: 0.5,
            v_factor: 1.0,
            ffn_factor: 2.667,
            ffn_multiple: 64,
            eps: 1e-6,
            gate_cap: Some(15.0),
            bias: false,
        }
    }
}

impl XlstmConfig {
    /// The queries' and keys' width in a model `hidden` wide.
    pub fn qk_dim(&self, hidden: i64) -> i64 {
        (hidden as f64 * self.qk_factor) as i64
    }

    /// The values' width.
    pub fn v_dim(&self, hidden: i64) -> i64 {
        (hidden as f64 * self.v_factor) as i64
    }

    /// A block's parameters in `c`.
    pub(super) fn block_params(&self, c: &LlamaConfig) -> u64 {
        let (d, h, i) = (c.hidden, c.heads, c.intermediate);
        let (qk, v) = (self.qk_dim(d), self.v_dim(d));
        let b = |n: i64| if self.bias { n } else { 0 };
        let norms = 2 * (d + b(d));
        let projections = d * (2 * qk + 2 * v) + b(2 * qk + 2 * v);
        let gates = 2 * (d * h + h);
        let cell_out = v + b(v) + v * d + b(d);
        let mlp = 2 * (d * i + b(i)) + i * d + b(d);
        (norms + projections + gates + cell_out + mlp) as u64
    }
}

/// `x` rounded up to a multiple of `of`, as its config's
/// `round_up_to_next_multiple_of` rounds a float.
fn round_up(x: f64, of: i64) -> i64 {
    (((x + of as f64 - 1.0) / of as f64).floor() * of as f64) as i64
}

/// Each flat field and xLSTM's name for it, with `xLSTMConfig`'s
/// default (`embedding_dim` and `num_blocks` read when `hidden_size`
/// and `num_hidden_layers` are null).
const FIELDS: [Field; 5] = [
    field("vocab_size", "vocab_size", Default::Int(50304), false),
    field("hidden_size", "hidden_size", Default::Int(4096), false),
    field(
        "num_hidden_layers",
        "num_hidden_layers",
        Default::Int(32),
        false,
    ),
    field("num_attention_heads", "num_heads", Default::Int(8), false),
    field("rms_norm_eps", "norm_eps", Default::Float(1e-6), false),
];

/// xLSTM's own fields beside [`FIELDS`], kept in the flat config for
/// [`read`].
const OWN: [&str; 11] = [
    "qk_dim_factor",
    "v_dim_factor",
    "ffn_proj_factor",
    "ffn_round_up_to_multiple_of",
    "eps",
    "gate_soft_cap",
    "output_logit_soft_cap",
    "weight_mode",
    "use_bias",
    "norm_reduction_force_float32",
    "tie_word_embeddings",
];

/// The xLSTM config `j` as the flat config the shared reader reads:
/// the heads the values' width over `num_heads`, the MLP's width its
/// class's, every head its own keys.
pub(super) fn flat(j: &HfJson) -> Result<HfJson, HfError> {
    let (mut out, _) = own_names::flat_with(j, "xlstm", &FIELDS);
    // Its class reads `embedding_dim` and `num_blocks` when the others
    // are null (not when they are left out: their defaults then).
    for (key, alias) in [
        ("hidden_size", "embedding_dim"),
        ("num_hidden_layers", "num_blocks"),
    ] {
        if j.has(key) && j.get(key).is_none() {
            if let Some(v) = j.get(alias) {
                out.insert(key.into(), v.clone());
            }
        }
    }
    // Null too: a null cap is no cap, where a missing one is 15 or 30.
    own_names::keep_own(j, &OWN, &mut out);
    let size = |key: &str| out.get(key).and_then(Value::as_i64).filter(|&n| n > 0);
    if let (Some(hidden), Some(heads)) = (size("hidden_size"), size("num_attention_heads")) {
        let x = read(&j.reading(Value::Object(out.clone())))?;
        let (qk, v) = (x.qk_dim(hidden), x.v_dim(hidden));
        if qk % heads != 0 || v % heads != 0 || qk == 0 || v == 0 {
            return Err(j.field(format!(
                "num_heads {heads} with queries and keys {qk} wide and values {v} (hidden_size {hidden} x qk_dim_factor {} and v_dim_factor {}): each must be a whole number of heads, at least one (its class splits them so)",
                x.qk_factor, x.v_factor
            )));
        }
        out.insert("head_dim".into(), (v / heads).into());
        out.insert("num_key_value_heads".into(), heads.into());
        let width = round_up(hidden as f64 * x.ffn_factor, x.ffn_multiple);
        out.insert("intermediate_size".into(), width.into());
    }
    Ok(j.reading(Value::Object(out)))
}

/// `e` with the flat fields it names renamed to xLSTM's.
pub(super) fn xlstm_names(e: HfError) -> HfError {
    own_names::renamed_as(e, &FIELDS, &[])
}

/// xLSTM's own settings from the flat config `j`, refusing what zrt
/// would not compute as its class does.
pub(super) fn read(j: &HfJson) -> Result<XlstmConfig, HfError> {
    let positive = |key: &str, default: f64| -> Result<f64, HfError> {
        let v = j.number_or(key, default)?;
        match v > 0.0 {
            true => Ok(v),
            false => Err(j.field(format!("{key} {v}: a width factor above 0"))),
        }
    };
    match j.get("weight_mode") {
        None | Some(Value::Null) => {}
        Some(v) if v == "single" => {}
        Some(v) if v == "fused" => {
            return Err(j.field(
                "weight_mode \"fused\": transformers 4.57's class fails building a fused xLSTM (its weight initialisation sizes the fused gates' biases wrongly), so zrt has no reference to hold one to; give \"single\" (its projections apart)".into(),
            ))
        }
        Some(v) => {
            return Err(j.field(format!(
                "weight_mode {v}: xLSTM's are \"single\" and \"fused\""
            )))
        }
    }
    if !j.flag_or("norm_reduction_force_float32", true)? {
        return Err(j.field(
            "norm_reduction_force_float32 false: zrt's norms reduce in fp32 always; give true (the same numbers in fp32)".into(),
        ));
    }
    Ok(XlstmConfig {
        qk_factor: positive("qk_dim_factor", 0.5)?,
        v_factor: positive("v_dim_factor", 1.0)?,
        ffn_factor: positive("ffn_proj_factor", 2.667)?,
        ffn_multiple: j.size_or_none("ffn_round_up_to_multiple_of")?.unwrap_or(64),
        eps: j.number_or("eps", 1e-6)?,
        gate_cap: j.number_or_null("gate_soft_cap", Some(15.0))?,
        bias: j.flag_or("use_bias", false)?,
    })
}

/// `c`'s `config.json` as `xLSTMConfig` reads it.
pub(super) fn to_json(c: &LlamaConfig) -> Value {
    let x = c.xlstm.as_ref();
    json!({
        "model_type": "xlstm",
        "architectures": [Family::Xlstm.architecture()],
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "embedding_dim": c.hidden,
        "num_hidden_layers": c.layers,
        "num_blocks": c.layers,
        "num_heads": c.heads,
        "norm_eps": c.eps,
        "qk_dim_factor": x.map(|x| x.qk_factor),
        "v_dim_factor": x.map(|x| x.v_factor),
        "ffn_proj_factor": x.map(|x| x.ffn_factor),
        "ffn_round_up_to_multiple_of": x.map(|x| x.ffn_multiple),
        "eps": x.map(|x| x.eps),
        "gate_soft_cap": x.and_then(|x| x.gate_cap),
        "output_logit_soft_cap": c.final_softcap,
        "weight_mode": "single",
        "use_bias": x.is_some_and(|x| x.bias),
        "norm_reduction_force_float32": true,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}

/// `cap * tanh(x / cap)`, or `x` without a cap.
fn soft_cap(x: Tensor, cap: Option<f64>) -> Tensor {
    match cap {
        Some(cap) => (x / cap).tanh() * cap,
        None => x,
    }
}

/// The mLSTM layer (`mlstm_layer`) but its `out_proj` (the layer's
/// output projection): its projections of each token (`q`, `k`, `v`,
/// `ogate_preact`, `igate_preact`, `fgate_preact`), its per-head norm's
/// weights (`multihead_norm`), and the cell's sizes.
#[derive(Debug)]
pub(super) struct Mlstm {
    q: Adapted,
    k: Adapted,
    v: Adapted,
    o: Adapted,
    i: Adapted,
    f: Adapted,
    norm_weight: Tensor,
    norm_bias: Option<Tensor>,
    heads: i64,
    qk: i64,
    v_dim: i64,
    norm_eps: f64,
    sizes: XlstmConfig,
}

/// The tokens the cell computes at once: a longer sequence runs in
/// blocks of this many, each from the state the one before ends in, so
/// that its weights take `[heads, CHUNK, CHUNK]` a block, not the whole
/// sequence squared. zrt's own choice; `chunk_size` is `transformers`'
/// kernels' and is not read.
const CHUNK: i64 = 256;

/// The cell's state a head: its memory `C` `[batch, heads, key, value]`,
/// and its normaliser `n` with the stabiliser `m` after it `[batch,
/// heads, key + 1]`, in fp32.
type State = (Tensor, Tensor);

impl Mlstm {
    /// Under `a` (`mlstm_layer`), for `c`'s sizes (its class's defaults
    /// for a config read as another family's, which builds none).
    pub(super) fn new(a: &nn::Path, c: &LlamaConfig, lin: &Lin<'_>) -> Self {
        let x = &c.xlstm.clone().unwrap_or_default();
        let (d, h) = (c.hidden, c.heads);
        let (qk, v, b) = (x.qk_dim(d), x.v_dim(d), x.bias);
        let n = a / "multihead_norm";
        Self {
            q: lin(&(a / "q"), d, qk, b),
            k: lin(&(a / "k"), d, qk, b),
            v: lin(&(a / "v"), d, v, b),
            o: lin(&(a / "ogate_preact"), d, v, b),
            i: lin(&(a / "igate_preact"), d, h, true),
            f: lin(&(a / "fgate_preact"), d, h, true),
            norm_weight: n.ones("weight", &[v]),
            norm_bias: b.then(|| n.zeros("bias", &[v])),
            heads: h,
            qk,
            v_dim: v,
            norm_eps: c.eps,
            sizes: x.clone(),
        }
    }

    /// `h` `[batch, seq, d]` (normalised) through the cell, each head's
    /// output normalised and gated: `[batch, seq, v]` in `h`'s dtype,
    /// before `out_proj`.
    pub(super) fn forward(&self, h: &Tensor, cache: &LayerCache) -> Tensor {
        let (q, k, v) = (self.q.forward(h), self.k.forward(h), self.v.forward(h));
        let cap = self.sizes.gate_cap;
        let i = soft_cap(self.i.forward(h), cap);
        let f = soft_cap(self.f.forward(h), cap);
        let inputs = [&q, &k, &v, &i, &f];
        let cell = match (cache.documents(), cache.state()) {
            // A packed row's documents each from a zero state.
            (Some(d), _) => d.each_alone(&inputs, |one| {
                self.cell([&one[0], &one[1], &one[2], &one[3], &one[4]], None, cache)
            }),
            (None, state) => self.cell(inputs, state, cache),
        };
        let normed = self.head_norm(&cell.to_kind(h.kind()));
        self.o.forward(h).sigmoid() * normed
    }

    /// The cell over `[q, k, v, i, f]` (`[batch, seq, width]`, the gates
    /// `[batch, seq, heads]`), from `state` or a zero one, the state it
    /// ends in kept in `cache` when generating: each head's output
    /// `[batch, seq, heads, value]` in fp32. [`CHUNK`] tokens at a time,
    /// each block from the state the one before ends in.
    fn cell(
        &self,
        [q, k, v, i, f]: [&Tensor; 5],
        state: Option<State>,
        cache: &LayerCache,
    ) -> Tensor {
        let fp32 = Kind::Float;
        let (b, t, _) = q.size3().unwrap_or((1, 1, 1));
        let (heads, dk, dv) = (self.heads, self.qk / self.heads, self.v_dim / self.heads);
        let split = |x: &Tensor, w: i64| x.reshape([b, t, heads, w]).transpose(1, 2).to_kind(fp32);
        let q = split(q, dk) * (dk as f64).powf(-0.5);
        let (k, v) = (split(k, dk), split(v, dv));
        // [b, heads, t]
        let (i, log_f) = (
            i.transpose(1, 2).to_kind(fp32),
            f.transpose(1, 2).to_kind(fp32).log_sigmoid(),
        );
        let mut state = state.unwrap_or_else(|| {
            (
                Tensor::zeros([b, heads, dk, dv], (fp32, q.device())),
                Tensor::zeros([b, heads, dk + 1], (fp32, q.device())),
            )
        });
        let mut outs = Vec::new();
        let mut at = 0;
        while at < t {
            let n = CHUNK.min(t - at);
            let part = |x: &Tensor| x.narrow(2, at, n);
            let gates = [i.narrow(-1, at, n), log_f.narrow(-1, at, n)];
            let last = at + n == t;
            let (out, next) = self.block(
                [&part(&q), &part(&k), &part(&v), &gates[0], &gates[1]],
                &state,
                !last || cache.generating(),
            );
            outs.push(out);
            if let Some(next) = next {
                state = next;
            }
            at += n;
        }
        if cache.generating() {
            cache.keep_state(state);
        }
        Tensor::cat(&outs, 2).transpose(1, 2)
    }

    /// One block of the cell: `[q, k, v, i, log f]` (`[batch, heads,
    /// seq, width]`, `q` scaled; the gates `[batch, heads, seq]`) after
    /// `state`, in fp32: each head's output `[batch, heads, seq, value]`,
    /// and, when `then` asks for it, the state after its last token.
    fn block(
        &self,
        [q, k, v, i, log_f]: [&Tensor; 5],
        (c0, nm0): &State,
        then: bool,
    ) -> (Tensor, Option<State>) {
        let fp32 = Kind::Float;
        let (b, heads, t, dk) = q.size4().unwrap_or((1, 1, 1, 1));
        let (n0, m0) = (nm0.narrow(-1, 0, dk), nm0.narrow(-1, dk, 1));
        // The forget gates' log-sums: token s's input reaches token t
        // weighted by `exp(cum_t - cum_s + i_s)`, the state before the
        // block by `exp(cum_t + m0)`.
        let cum = log_f.cumsum(-1, fp32);
        let reach = cum.unsqueeze(-1) - (&cum - i).unsqueeze(-2);
        let later = Tensor::ones([t, t], (Kind::Bool, q.device())).triu(1);
        let reach = reach.masked_fill(&later, f64::NEG_INFINITY);
        let from_state = &cum + &m0;
        // The running maximum the recurrence keeps.
        let m = reach.amax([-1], false).maximum(&from_state);
        let weights = (reach - m.unsqueeze(-1)).exp();
        let carried = (&from_state - &m).exp();
        let scores = q.matmul(&k.transpose(-1, -2)) * &weights;
        let num = scores.matmul(v) + carried.unsqueeze(-1) * q.matmul(c0);
        let qn = scores.sum_dim_intlist(-1, false, fp32)
            + &carried * q.matmul(&n0.unsqueeze(-1)).squeeze_dim(-1);
        let den = qn.abs().maximum(&(-&m).exp()) + self.sizes.eps;
        let out = num / den.unsqueeze(-1);
        let next = then.then(|| {
            let last = weights.select(2, t - 1).unsqueeze(-1);
            let carry = carried.select(-1, t - 1);
            let weighted = k * last;
            let c = weighted.transpose(-1, -2).matmul(v) + carry.view([b, heads, 1, 1]) * c0;
            let n = weighted.sum_dim_intlist(-2, false, fp32) + carry.unsqueeze(-1) * &n0;
            let m = m.select(-1, t - 1).unsqueeze(-1);
            (c, Tensor::cat(&[n, m], -1))
        });
        (out, next)
    }

    /// Each head's output `[batch, seq, heads, value]` layer-normalised
    /// over its own width in fp32, then cast, flattened and weighted
    /// (`xLSTMMultiHeadLayerNorm`).
    fn head_norm(&self, x: &Tensor) -> Tensor {
        let (b, t, _, _) = x.size4().unwrap_or((1, 1, 1, 1));
        let h = x.to_kind(Kind::Float);
        let centred = &h - h.mean_dim(-1, true, Kind::Float);
        let var = centred.square().mean_dim(-1, true, Kind::Float);
        let normed = (centred * (var + self.norm_eps).rsqrt())
            .to_kind(x.kind())
            .reshape([b, t, self.v_dim]);
        let weighted = normed * &self.norm_weight;
        match &self.norm_bias {
            Some(bias) => weighted + bias,
            None => weighted,
        }
    }
}
