//! Qwen3-Next's gated DeltaNet layers ([`Family::Qwen3Next`]): in the
//! layers `layer_types` names `linear_attention` (by default three of
//! every four), a linear attention whose state is a matrix a head,
//! `[key_dim, value_dim]`, decayed and corrected token by token by the
//! gated delta rule:
//!
//! `S_t = g_t S_{t-1} + beta_t k_t (v_t - g_t S_{t-1}^T k_t)^T`,
//! `o_t = S_t^T q_t`,
//!
//! `g_t = exp(-exp(A_log) softplus(a_t + dt_bias))` and `beta_t =
//! sigmoid(b_t)` each head's, `q` and `k` L2-normalised. `in_proj_qkvz`
//! makes the queries, keys, values and the output gate `z`, `in_proj_ba`
//! the `b` and `a`; the queries, keys and values go through a depthwise
//! causal convolution and SiLU first; the output is normalised over each
//! head and gated by `silu(z)` (`norm`); `out_proj` is the layer's output
//! projection, held by the layer.
//!
//! A whole sequence is computed as `transformers`' `torch_chunk_gated_
//! delta_rule` computes it, in chunks of 64 tokens: within a chunk the
//! delta rule's triangular system is solved at once (a triangular solve,
//! where the reference substitutes row by row: the same system), across
//! chunks the state is carried. While generating, the convolution's last
//! inputs and the state are the layer's cache; each later token steps
//! them, as the reference's recurrent path does. A packed row's
//! documents are each computed alone.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use serde_json::{json, Value};

use crate::hf::{HfError, HfJson};
use crate::kv_cache::LayerCache;
use crate::lora::Adapted;

use super::layer::Lin;
use super::short_conv::CausalConv;

/// The tokens the whole-sequence path computes together
/// (`torch_chunk_gated_delta_rule`'s `chunk_size`).
const CHUNK: i64 = 64;

/// The epsilon of the queries' and keys' L2 norm (the reference's).
const L2_EPS: f64 = 1e-6;

/// Qwen3-Next's gated DeltaNet layers: their widths and which layers
/// they are.
#[derive(Debug, Clone, PartialEq)]
pub struct DeltaNetConfig {
    /// `linear_conv_kernel_dim`: the tokens each convolution output reads.
    pub kernel: i64,
    /// `linear_num_key_heads`: the heads of queries and keys.
    pub key_heads: i64,
    /// `linear_num_value_heads`: the heads of values (and of the state),
    /// a multiple of `key_heads` (each query and key head serves that
    /// many).
    pub value_heads: i64,
    /// `linear_key_head_dim`.
    pub key_dim: i64,
    /// `linear_value_head_dim`.
    pub value_dim: i64,
    /// `layer_types`, one a layer: `true` for a DeltaNet layer
    /// (`"linear_attention"`), `false` for one that attends with softmax
    /// (`"full_attention"`).
    pub layers: Vec<bool>,
}

impl DeltaNetConfig {
    /// Whether layer `l` is a DeltaNet layer.
    pub fn is_delta_net(&self, l: i64) -> bool {
        self.layers.get(l as usize) == Some(&true)
    }

    /// The convolved channels: the queries', keys' and values' widths.
    fn conv_dim(&self) -> i64 {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// The width of the values over every head (`out_proj`'s input).
    pub(super) fn value_width(&self) -> i64 {
        self.value_heads * self.value_dim
    }

    /// A DeltaNet layer's parameters in a model `hidden` wide
    /// (`in_proj_qkvz`, `in_proj_ba`, the convolution, `dt_bias`,
    /// `A_log`, the norm, `out_proj`).
    pub(super) fn params(&self, hidden: i64) -> u64 {
        let (d, vh) = (hidden, self.value_heads);
        let qkvz = d * (self.conv_dim() + self.value_width());
        let ba = d * 2 * vh;
        let conv = self.conv_dim() * self.kernel;
        (qkvz + ba + conv + 2 * vh + self.value_dim + self.value_width() * d) as u64
    }

    /// Its fields in Qwen3-Next's `config.json`.
    pub(super) fn to_json(&self) -> Value {
        let kinds: Vec<&str> = (self.layers.iter())
            .map(|&on| match on {
                true => "linear_attention",
                false => "full_attention",
            })
            .collect();
        json!({
            "linear_conv_kernel_dim": self.kernel,
            "linear_num_key_heads": self.key_heads,
            "linear_num_value_heads": self.value_heads,
            "linear_key_head_dim": self.key_dim,
            "linear_value_head_dim": self.value_dim,
            "layer_types": kinds,
        })
    }
}

/// The DeltaNet layers of `Qwen3NextConfig` `j`, `layers` deep: its
/// `layer_types` (left out or null: all but every
/// `full_attention_interval`-th, by default 4) and the widths, with its
/// class's defaults.
pub(super) fn read(j: &HfJson, layers: i64) -> Result<DeltaNetConfig, HfError> {
    let kinds = ["linear_attention", "full_attention"];
    let delta = match super::config::layer_kinds(j, layers, "Qwen3-Next", kinds, kinds[0])? {
        Some(kinds) => kinds,
        None => {
            let every = j.size_or_none("full_attention_interval")?.unwrap_or(4);
            (0..layers).map(|l| (l + 1) % every != 0).collect()
        }
    };
    let size = |key: &str, default: i64| Ok::<_, HfError>(j.size_or_none(key)?.unwrap_or(default));
    let c = DeltaNetConfig {
        kernel: size("linear_conv_kernel_dim", 4)?,
        key_heads: size("linear_num_key_heads", 16)?,
        value_heads: size("linear_num_value_heads", 32)?,
        key_dim: size("linear_key_head_dim", 128)?,
        value_dim: size("linear_value_head_dim", 128)?,
        layers: delta,
    };
    if c.value_heads % c.key_heads != 0 {
        return Err(j.field(format!(
            "linear_num_value_heads {} over linear_num_key_heads {}: each query and key head serves a whole number of value heads; give a multiple",
            c.value_heads, c.key_heads
        )));
    }
    Ok(c)
}

/// One gated DeltaNet layer (`linear_attn`): its projections in, the
/// convolution, the decay's parameters, the gated norm.
#[derive(Debug)]
pub(super) struct DeltaNet {
    in_proj_qkvz: Adapted,
    in_proj_ba: Adapted,
    conv: CausalConv,
    /// `[value_heads]`: the step's bias before the softplus.
    dt_bias: Tensor,
    /// `[value_heads]`: the log of each head's decay rate.
    a_log: Tensor,
    /// `norm.weight`, `[value_dim]`: the gated norm's (plain, not an
    /// offset from one as the layer's other norms are).
    norm: Tensor,
    eps: f64,
    c: DeltaNetConfig,
}

impl DeltaNet {
    /// The layer under `p` (`model.layers.N.linear_attn`) in a model
    /// `hidden` wide, its norm's epsilon `eps`, its linear layers made by
    /// `lin`.
    pub(super) fn new(
        p: &nn::Path,
        (hidden, eps): (i64, f64),
        c: &DeltaNetConfig,
        lin: &Lin<'_>,
    ) -> Self {
        let normal = nn::Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        let vh = c.value_heads;
        Self {
            in_proj_qkvz: lin(
                &(p / "in_proj_qkvz"),
                hidden,
                c.conv_dim() + c.value_width(),
                false,
            ),
            in_proj_ba: lin(&(p / "in_proj_ba"), hidden, 2 * vh, false),
            conv: CausalConv::new(&(p / "conv1d"), (c.conv_dim(), c.kernel), false, normal),
            dt_bias: p.ones("dt_bias", &[vh]),
            // Rates from 1 to 16, as its class draws them (it draws from
            // 0, whose log is minus infinity; zrt starts from 1).
            a_log: p.var(
                "A_log",
                &[vh],
                nn::Init::Uniform {
                    lo: 0.0,
                    up: 16f64.ln(),
                },
            ),
            norm: (p / "norm").ones("weight", &[c.value_dim]),
            eps,
            c: c.clone(),
        }
    }

    /// The gated, normalised output of `h` `[batch, seq, hidden]`,
    /// `[batch, seq, value_heads x value_dim]` in `h`'s dtype (before
    /// `out_proj`), as `Qwen3NextGatedDeltaNet` computes it.
    pub(super) fn forward(&self, h: &Tensor, cache: &LayerCache) -> Tensor {
        let (b, t, _) = h.size3().unwrap_or((1, 1, 1));
        let c = &self.c;
        let (kh, vh, kd, vd) = (c.key_heads, c.value_heads, c.key_dim, c.value_dim);
        let per = vh / kh;
        // Each key head's queries, keys, values and gates side by side.
        let qkvz = (self.in_proj_qkvz.forward(h)).view([b, t, kh, 2 * kd + 2 * per * vd]);
        let part = |from: i64, width: i64, heads: i64, each: i64| {
            qkvz.narrow(-1, from, width).reshape([b, t, heads * each])
        };
        let q = part(0, kd, kh, kd);
        let k = part(kd, kd, kh, kd);
        let v = part(2 * kd, per * vd, vh, vd);
        let z = part(2 * kd + per * vd, per * vd, vh, vd).view([b, t, vh, vd]);
        let ba = self.in_proj_ba.forward(h).view([b, t, kh, 2 * per]);
        let beta = ba.narrow(-1, 0, per).reshape([b, t, vh]).sigmoid();
        let a = ba.narrow(-1, per, per).reshape([b, t, vh]);
        // In fp32: in fp16 `exp(A_log)` may overflow.
        let rate = self.a_log.to_kind(Kind::Float).exp().neg();
        let g = rate * (a.to_kind(Kind::Float) + &self.dt_bias).softplus();
        // `[batch, seq, channels]`: convolved along the sequence.
        let mixed = Tensor::cat(&[q, k, v], -1);
        let out = match (cache.documents(), cache.state()) {
            (Some(docs), _) => docs.each_alone(&[&mixed, &g, &beta], |one| {
                self.mix(&one[0], &one[1], &one[2], None).0
            }),
            (None, state) => {
                let (out, state) = self.mix(&mixed, &g, &beta, state);
                cache.keep_state(state);
                out
            }
        };
        self.gated_norm(&out, &z).reshape([b, t, vh * vd])
    }

    /// The convolution and the delta rule over `mixed` `[batch, seq,
    /// channels]` with the decays `g` and rates `beta` `[batch, seq,
    /// value_heads]`: from nothing (`state` `None`: the whole sequence
    /// at once) or from a generation's (the convolution's last inputs,
    /// the delta rule's state; token by token). Returns the outputs
    /// `[batch, seq, value_heads, value_dim]` and the state after them.
    fn mix(
        &self,
        mixed: &Tensor,
        g: &Tensor,
        beta: &Tensor,
        state: Option<(Tensor, Tensor)>,
    ) -> (Tensor, (Tensor, Tensor)) {
        let (b, t, _) = mixed.size3().unwrap_or((1, 1, 1));
        let c = &self.c;
        let (kh, vh, kd, vd) = (c.key_heads, c.value_heads, c.key_dim, c.value_dim);
        let (inputs, matrix) = match state {
            Some((inputs, matrix)) => (Some(inputs), Some(matrix)),
            None => (None, None),
        };
        let (convolved, inputs) = self.conv.forward(&mixed.transpose(1, 2), inputs);
        let convolved = convolved.silu().transpose(1, 2);
        let q = convolved.narrow(-1, 0, kh * kd).view([b, t, kh, kd]);
        let k = convolved.narrow(-1, kh * kd, kh * kd).view([b, t, kh, kd]);
        let v = convolved
            .narrow(-1, 2 * kh * kd, vh * vd)
            .view([b, t, vh, vd]);
        // Each query and key head serves `per` value heads, neighbours.
        let per = vh / kh;
        let [q, k] = [q, k].map(|x| match per {
            1 => x,
            _ => x.repeat_interleave_self_int(per, 2, None),
        });
        let kind = q.kind();
        let [q, k] = [q, k].map(|x| {
            let norm = (&x * &x).sum_dim_intlist(-1, true, None::<Kind>) + L2_EPS;
            x * norm.rsqrt()
        });
        // `[batch, heads, seq, ...]`, in fp32.
        let [q, k, v] = [q, k, v].map(|x| x.transpose(1, 2).to_kind(Kind::Float));
        let [g, beta] = [g, beta].map(|x| x.transpose(1, 2).to_kind(Kind::Float));
        let q = q * (kd as f64).powf(-0.5);
        let (out, matrix) = match matrix {
            None => chunked(&q, &k, &v, &g, &beta),
            Some(matrix) => recurrent(&q, &k, &v, &g, &beta, matrix),
        };
        (out.transpose(1, 2).to_kind(kind), (inputs, matrix))
    }

    /// `out` `[batch, seq, heads, value_dim]` normalised over each head,
    /// times `norm`'s weights, gated by `silu(z)`: `Qwen3NextRMSNormGated`.
    fn gated_norm(&self, out: &Tensor, z: &Tensor) -> Tensor {
        let kind = out.kind();
        let normed = super::norm::rms_normalized(out, self.eps).to_kind(kind);
        let weighted = (&self.norm * normed).to_kind(Kind::Float);
        (weighted * z.to_kind(Kind::Float).silu()).to_kind(kind)
    }
}

/// The gated delta rule over whole sequences from a zero state, chunk by
/// chunk: `q`, `k` `[batch, heads, seq, key_dim]` (the queries scaled),
/// `v` `[batch, heads, seq, value_dim]`, `g` (log decays) and `beta`
/// `[batch, heads, seq]`, all fp32. Returns the outputs `[batch, heads,
/// seq, value_dim]` and the state after the last token `[batch, heads,
/// key_dim, value_dim]`.
fn chunked(q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor) -> (Tensor, Tensor) {
    let [b, h, t, kd] = q.size()[..] else {
        return (q.shallow_clone(), q.shallow_clone());
    };
    let vd = v.size()[3];
    let pad = (CHUNK - t % CHUNK) % CHUNK;
    let n = (t + pad) / CHUNK;
    // Padded with zeros: a pad token neither decays nor writes the state.
    let chunks = |x: &Tensor, width: i64| {
        x.constant_pad_nd([0, 0, 0, pad])
            .view([b, h, n, CHUNK, width])
    };
    let v_beta = chunks(&(v * beta.unsqueeze(-1)), vd);
    let k_beta = chunks(&(k * beta.unsqueeze(-1)), kd);
    let (q, k) = (chunks(q, kd), chunks(k, kd));
    let g = g
        .constant_pad_nd([0, pad])
        .view([b, h, n, CHUNK])
        .cumsum(-1, None::<Kind>);
    let opts = (Kind::Bool, q.device());
    // Within a chunk: token i's decay since token j, for j <= i.
    let decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).tril(0).exp().tril(0);
    let upper = Tensor::ones([CHUNK, CHUNK], opts).triu(0);
    // The delta rule's system within a chunk is unit lower triangular:
    // `(I + strict(k_beta k^T decay)) T = I`.
    let strict = (k_beta.matmul(&k.transpose(-1, -2)) * &decay).masked_fill(&upper, 0.0);
    let eye = Tensor::eye(CHUNK, (Kind::Float, q.device()));
    let system = strict + &eye;
    let inverse = system.linalg_solve_triangular(&eye.expand_as(&system), false, true, true);
    let value = inverse.matmul(&v_beta);
    let k_cumdecay = inverse.matmul(&(k_beta * g.exp().unsqueeze(-1)));
    let mut state = Tensor::zeros([b, h, kd, vd], (Kind::Float, q.device()));
    let after = Tensor::ones([CHUNK, CHUNK], opts).triu(1);
    let mut outs = Vec::with_capacity(n as usize);
    // Each chunk's slices by one `unbind` apiece: a `select` a chunk
    // would zero a whole-sequence gradient for each in backward.
    let [qs, ks, vs, gs, decays, k_cumdecays] =
        [&q, &k, &value, &g, &decay, &k_cumdecay].map(|x| x.unbind(2));
    for i in 0..n as usize {
        let [q, k, v, g, decay, k_cumdecay] =
            [&qs, &ks, &vs, &gs, &decays, &k_cumdecays].map(|x| &x[i]);
        let within = (q.matmul(&k.transpose(-1, -2)) * decay).masked_fill(&after, 0.0);
        let v_new = v - k_cumdecay.matmul(&state);
        let inter = (q * g.exp().unsqueeze(-1)).matmul(&state);
        outs.push(inter + within.matmul(&v_new));
        let last = g.narrow(-1, CHUNK - 1, 1);
        let to_end = (&last - g).exp().unsqueeze(-1);
        state = state * last.exp().unsqueeze(-1) + (k * to_end).transpose(-1, -2).matmul(&v_new);
    }
    (Tensor::cat(&outs, 2).narrow(2, 0, t), state)
}

/// The gated delta rule token by token from `state` `[batch, heads,
/// key_dim, value_dim]` (the inputs as [`chunked`] takes them): the
/// outputs and the state after them.
fn recurrent(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    mut state: Tensor,
) -> (Tensor, Tensor) {
    let t = q.size()[2];
    let mut outs = Vec::with_capacity(t as usize);
    for i in 0..t {
        let [q, k, v] = [q, k, v].map(|x| x.select(2, i));
        let [g, beta] = [g, beta].map(|x| x.select(2, i).unsqueeze(-1));
        // New tensors, not in place: autograd keeps the old ones.
        let decayed = state * g.exp().unsqueeze(-1);
        let remembered = (&decayed * k.unsqueeze(-1)).sum_dim_intlist(-2, false, None::<Kind>);
        let delta = (v - remembered) * beta;
        state = decayed + k.unsqueeze(-1) * delta.unsqueeze(-2);
        outs.push((&state * q.unsqueeze(-1)).sum_dim_intlist(-2, false, None::<Kind>));
    }
    (Tensor::stack(&outs, 2), state)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunked path over several chunks (and a part) is the delta
    /// rule stepped token by token: the same outputs and final state.
    #[test]
    fn chunks_compute_the_delta_rule_token_by_token() {
        tch::manual_seed(7);
        let (b, h, t, kd, vd) = (2, 3, 2 * CHUNK + 22, 5, 7);
        let opts = (Kind::Float, tch::Device::Cpu);
        let unit = |x: Tensor| {
            let n = (&x * &x).sum_dim_intlist(-1, true, None::<Kind>).sqrt();
            x / n
        };
        let q = unit(Tensor::randn([b, h, t, kd], opts)) * (kd as f64).powf(-0.5);
        let k = unit(Tensor::randn([b, h, t, kd], opts));
        let v = Tensor::randn([b, h, t, vd], opts);
        // Log decays below 0, some near it (a long memory), and rates in
        // (0, 1).
        let g = -Tensor::rand([b, h, t], opts) * 0.3;
        let beta = Tensor::rand([b, h, t], opts);
        let zero = Tensor::zeros([b, h, kd, vd], opts);
        let (want, want_state) = recurrent(&q, &k, &v, &g, &beta, zero);
        let (got, state) = chunked(&q, &k, &v, &g, &beta);
        assert_eq!(got.size(), want.size());
        let off = (&got - &want).abs().max().double_value(&[]);
        let scale = want.abs().max().double_value(&[]);
        assert!(
            off < 1e-5 * scale.max(1.0),
            "outputs {off} off (scale {scale})"
        );
        let off = (&state - &want_state).abs().max().double_value(&[]);
        assert!(off < 1e-5, "final state {off} off");
        // The state is not the trivial one: the last chunk wrote it.
        assert!(want_state.abs().max().double_value(&[]) > 0.1);
    }
}
