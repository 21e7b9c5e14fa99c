//! Granite 4.0's, Bamba's, Mamba-2's and Falcon-H1's Mamba-2 layers
//! ([`Family::GraniteMoeHybrid`], [`Family::Bamba`], [`Family::Mamba2`],
//! [`Family::FalconH1`], Falcon-H1's beside its attention):
//! their sizes read from the config (Mamba-2's under names of its own,
//! read flat), and the layer itself, computed as
//! `transformers`' `torch_forward` computes it without a cache (the
//! chunked state-space dual form, operation for operation, so that its
//! rounding is the reference's).
//!
//! While generating, the first forward scans the prompt whole and keeps
//! the layer's convolution inputs and final state in its cache slot;
//! each later token steps that state, as `transformers`' cached path
//! does. A packed row's documents are each scanned alone, from a zero
//! state (what `transformers`' CUDA kernels do given `seq_idx`; its
//! `torch_forward` refuses them, so there is no reference on CPU).

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use serde_json::{json, Value};

use crate::hf::{HfError, HfJson};
use crate::kv_cache::LayerCache;
use crate::lora::Adapted;

use super::config::{Activation, LlamaConfig};
use super::family::Family;
use super::own_names::{self, field, Default, Field};
use super::short_conv::CausalConv;

/// How a Mamba-2 layer gates and normalises its scan's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MambaGate {
    /// Granite 4.0's, Bamba's and Mamba-2's: `y` times `silu(gate)`,
    /// RMS-normalised, times the weights (`norm`).
    NormedAfter,
    /// Falcon-H1's without `mamba_rms_norm`: `y` times `silu(gate)`, no
    /// norm (no weights).
    Plain,
    /// Falcon-H1's with `mamba_rms_norm`: RMS-normalised over each group
    /// of channels, times the weights, gated before the norm or after.
    Grouped {
        /// `mamba_n_groups`: the groups normalised apart.
        groups: i64,
        /// `mamba_norm_before_gate`: gated after the norm (`true`) or
        /// before it.
        before_gate: bool,
    },
}

/// A hybrid model's Mamba-2 layers: their sizes (`mamba_*`) and which
/// layers they are (`layer_types`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MambaConfig {
    /// `mamba_n_heads`.
    pub heads: i64,
    /// `mamba_d_head` (`"auto"`: the inner width over the heads).
    pub head_dim: i64,
    /// `mamba_n_groups`: the groups of heads sharing `B` and `C`.
    pub groups: i64,
    /// `mamba_d_state`: each head's state per channel.
    pub state: i64,
    /// `mamba_d_conv`: the causal convolution's width.
    pub conv_kernel: i64,
    /// `mamba_expand`: the inner width over the model's.
    pub expand: i64,
    /// `mamba_chunk_size`: the scan's chunk.
    pub chunk: i64,
    /// `mamba_conv_bias`.
    pub conv_bias: bool,
    /// `mamba_proj_bias`: `in_proj` and `out_proj` have biases.
    pub proj_bias: bool,
    /// Falcon-H1's `mamba_d_ssm`: the inner width, when given (else
    /// `expand` times the model's).
    pub d_ssm: Option<i64>,
    /// Falcon-H1's `projectors_bias`: `out_proj`'s bias, apart from
    /// `in_proj`'s (`None`: [`MambaConfig::proj_bias`]).
    pub out_bias: Option<bool>,
    /// How the scan's output is gated and normalised.
    pub gate: MambaGate,
    /// `layer_types` (Bamba's `attn_layer_indices`): for each layer,
    /// whether it is a Mamba layer (`"mamba"`) or attends
    /// (`"attention"`); all Mamba when left out. Falcon-H1's are all
    /// `false`: each of its layers attends, its Mamba layer beside the
    /// attention ([`LlamaConfig::mamba_beside`](super::LlamaConfig::mamba_beside)).
    pub layers: Vec<bool>,
}

impl MambaConfig {
    /// The inner width: `expand` times the model's `hidden` (Falcon-H1's
    /// `mamba_d_ssm` when given).
    pub fn inner(&self, hidden: i64) -> i64 {
        self.d_ssm.unwrap_or(self.expand * hidden)
    }

    /// Whether `out_proj` has a bias.
    pub(super) fn out_bias(&self) -> bool {
        self.out_bias.unwrap_or(self.proj_bias)
    }

    /// What `in_proj` makes of a token: the gate, the convolved
    /// channels and each head's step.
    pub(super) fn projected(&self, hidden: i64) -> i64 {
        self.inner(hidden) + self.conv_dim(hidden) + self.heads
    }

    /// The convolution's channels: the inner width and `B` and `C`.
    fn conv_dim(&self, hidden: i64) -> i64 {
        self.inner(hidden) + 2 * self.groups * self.state
    }

    /// A Mamba layer's parameters in a model `hidden` wide.
    pub(super) fn params(&self, hidden: i64) -> u64 {
        let (d, inner, conv) = (hidden, self.inner(hidden), self.conv_dim(hidden));
        let bias = |on: bool, n: i64| if on { n } else { 0 };
        let projected = inner + conv + self.heads;
        let n = (d * projected + bias(self.proj_bias, projected))
            + (conv * self.conv_kernel + bias(self.conv_bias, conv))
            + 3 * self.heads
            + bias(self.gate != MambaGate::Plain, inner)
            + (inner * d + bias(self.out_bias(), d));
        n as u64
    }

    /// Its fields in a `config.json` (`layer_types` null when every
    /// layer is a Mamba layer, as its class's default says).
    pub(super) fn to_json(&self) -> serde_json::Value {
        let kinds: Option<Vec<&str>> = (!self.layers.iter().all(|&m| m)).then(|| {
            (self.layers.iter())
                .map(|&m| if m { "mamba" } else { "attention" })
                .collect()
        });
        serde_json::json!({
            "mamba_n_heads": self.heads,
            "mamba_d_head": self.head_dim,
            "mamba_n_groups": self.groups,
            "mamba_d_state": self.state,
            "mamba_d_conv": self.conv_kernel,
            "mamba_expand": self.expand,
            "mamba_chunk_size": self.chunk,
            "mamba_conv_bias": self.conv_bias,
            "mamba_proj_bias": self.proj_bias,
            "layer_types": kinds,
        })
    }

    /// Bamba's way of naming its attending layers, in a `config.json`.
    pub(super) fn attention_layers(&self) -> Vec<i64> {
        (self.layers.iter().enumerate())
            .filter(|(_, m)| !**m)
            .map(|(l, _)| l as i64)
            .collect()
    }
}

/// The Mamba layers of `GraniteMoeHybridConfig` or `BambaConfig` `j`
/// (their defaults where it leaves a field out, the same), checked as
/// their classes check them; `family` says which, as they name their
/// attending layers each their own way.
pub(super) fn read(j: &HfJson, family: Family, hidden: i64) -> Result<MambaConfig, HfError> {
    let layers = j.size("num_hidden_layers")?;
    let kinds = match j.get("layer_types") {
        // Falcon-H1's Mamba layers stand beside its attention, in place
        // of none ([`MambaConfig::layers`]).
        _ if family == Family::FalconH1 => vec![false; layers as usize],
        // Bamba's attending layers by number.
        _ if family == Family::Bamba => {
            match super::config::attending_at(j, "attn_layer_indices", layers)? {
                Some(attends) => attends.iter().map(|a| !a).collect(),
                None => vec![true; layers as usize],
            }
        }
        _ => {
            let kinds = ["mamba", "attention"];
            let whose = match family {
                Family::GraniteMoeHybrid => "Granite 4.0",
                f => f.model_type(),
            };
            super::config::layer_kinds(j, layers, whose, kinds, kinds[0])?
                .unwrap_or_else(|| vec![true; layers as usize])
        }
    };
    let heads = j.size_or_none("mamba_n_heads")?.unwrap_or(128);
    let expand = j.size_or_none("mamba_expand")?.unwrap_or(2);
    let d_ssm = match family {
        Family::FalconH1 => j.size_or_null("mamba_d_ssm", Some(1024))?,
        _ => None,
    };
    let inner = d_ssm.unwrap_or(expand * hidden);
    if heads == 0 || inner % heads != 0 {
        return Err(j.field(format!(
            "mamba_n_heads {heads} does not divide mamba_expand x hidden_size ({inner}), as its class requires"
        )));
    }
    let head_dim = match j.get("mamba_d_head") {
        None | Some(serde_json::Value::Null) => inner / heads,
        Some(v) if v.as_str() == Some("auto") => inner / heads,
        Some(_) => j.size("mamba_d_head")?,
    };
    if head_dim * heads != inner {
        return Err(j.field(format!(
            "mamba_d_head {head_dim} x mamba_n_heads {heads} is not the inner width {inner} (mamba_expand x hidden_size), as its class requires"
        )));
    }
    let groups = j.size_or_none("mamba_n_groups")?.unwrap_or(1);
    if groups == 0 || heads % groups != 0 {
        return Err(j.field(format!(
            "mamba_n_groups {groups} does not divide mamba_n_heads {heads}: each group's B and C serve a whole number of heads"
        )));
    }
    let chunk = j.size_or_none("mamba_chunk_size")?.unwrap_or(256);
    let conv_kernel = j.size_or_none("mamba_d_conv")?.unwrap_or(4);
    if chunk == 0 || conv_kernel == 0 {
        return Err(j.field(format!(
            "mamba_chunk_size {chunk} and mamba_d_conv {conv_kernel}: both at least 1"
        )));
    }
    Ok(MambaConfig {
        heads,
        head_dim,
        groups,
        state: j.size_or_none("mamba_d_state")?.unwrap_or(256),
        conv_kernel,
        expand,
        chunk,
        conv_bias: j.flag_or("mamba_conv_bias", true)?,
        proj_bias: j.flag_or("mamba_proj_bias", false)?,
        d_ssm,
        out_bias: match family {
            Family::FalconH1 => Some(j.flag_or("projectors_bias", false)?),
            _ => None,
        },
        gate: match family {
            Family::FalconH1 if j.flag_or("mamba_rms_norm", false)? => MambaGate::Grouped {
                groups,
                before_gate: j.flag_or("mamba_norm_before_gate", true)?,
            },
            Family::FalconH1 => MambaGate::Plain,
            // Zamba2's gated norm normalises each group of channels, the
            // gate first.
            Family::Zamba2 if groups > 1 => MambaGate::Grouped {
                groups,
                before_gate: false,
            },
            _ => MambaGate::NormedAfter,
        },
        layers: kinds,
    })
}

/// One Mamba-2 layer (`mamba`): `in_proj` to the gate, the convolved
/// channels (the inner states, `B`, `C`) and each head's step `dt`; a
/// depthwise causal convolution (`conv1d`); the scan with `A = -exp(A_log)`
/// and the skip `D`; the gated RMSNorm (`norm`). Its `out_proj` is the
/// layer's output projection, held by the layer.
#[derive(Debug)]
pub(super) struct Mamba {
    in_proj: Adapted,
    conv: CausalConv,
    dt_bias: Tensor,
    a_log: Tensor,
    d: Tensor,
    /// The gated norm's weights (none for Falcon-H1's plain gate).
    norm: Option<Tensor>,
    /// Falcon-H1's `ssm_in_multiplier` (the input's factor) and its µP
    /// vector (`ssm_multipliers` over the gate, the channels, `B`, `C`
    /// and the steps), which `in_proj`'s output is multiplied by.
    mup: Option<(f64, Tensor)>,
    sizes: MambaConfig,
    hidden: i64,
    eps: f64,
    activation: Activation,
    /// The steps' floor after their softplus: Zamba2's `time_step_min`,
    /// 0 for the others (whose classes clamp at their
    /// `time_step_limit`'s 0).
    dt_floor: f64,
}

impl Mamba {
    /// The Mamba layer under `p` (`model.layers.N.mamba`), `in_proj` made
    /// by `lin`; its parameters start as its class initialises them.
    pub(super) fn new(p: &nn::Path, c: &LlamaConfig, m: &MambaConfig, in_proj: Adapted) -> Self {
        let (inner, conv) = (m.inner(c.hidden), m.conv_dim(c.hidden));
        let heads = Tensor::arange_start(1, m.heads + 1, (Kind::Float, p.device()));
        let a_log = p.var_copy("A_log", &heads.log());
        Self {
            in_proj,
            conv: CausalConv::new(
                &(p / "conv1d"),
                (conv, m.conv_kernel),
                m.conv_bias,
                nn::Init::Uniform {
                    lo: -1.0 / (m.conv_kernel as f64).sqrt(),
                    up: 1.0 / (m.conv_kernel as f64).sqrt(),
                },
            ),
            dt_bias: p.ones("dt_bias", &[m.heads]),
            a_log,
            d: p.ones("D", &[m.heads]),
            norm: (m.gate != MambaGate::Plain).then(|| (p / "norm").ones("weight", &[inner])),
            mup: c.falcon_h1.as_ref().map(|f| {
                let bc = m.groups * m.state;
                let widths = [inner, inner, bc, bc, m.heads];
                let parts: Vec<Tensor> = (widths.iter().zip(f.ssm))
                    .map(|(&w, by)| Tensor::full([w], by, (Kind::Float, p.device())))
                    .collect();
                (f.ssm_in, Tensor::cat(&parts, 0))
            }),
            sizes: m.clone(),
            hidden: c.hidden,
            // Zamba2's layers are SiLU-activated, their gated norm at
            // 1e-5, whatever the config's MLP and norms say.
            eps: match &c.zamba {
                Some(_) => 1e-5,
                None => c.eps,
            },
            activation: match &c.zamba {
                Some(_) => Activation::Silu,
                None => c.activation,
            },
            dt_floor: c.zamba.as_ref().map_or(0.0, |z| z.time_step_min),
        }
    }

    /// The scan's output for `h` `[batch, seq, hidden]`, normalised and
    /// gated, in `h`'s dtype (before `out_proj`): `transformers`'
    /// `torch_forward`, its broadcast products and sums taken as matrix
    /// products ([`einsum`]). While generating, the
    /// first forward scans the prompt whole and keeps the layer's state
    /// in `cache`; each later token steps it, as its cached path does.
    pub(super) fn forward(&self, h: &Tensor, cache: &LayerCache) -> Tensor {
        let m = &self.sizes;
        let (inner, conv) = (m.inner(self.hidden), m.conv_dim(self.hidden));
        let kind = h.kind();
        let projected = match &self.mup {
            Some((by, mup)) => self.in_proj.forward(&(h * *by)) * mup.to_kind(kind),
            None => self.in_proj.forward(h),
        };
        let gate = projected.narrow(-1, 0, inner);
        let xbc = projected.narrow(-1, inner, conv);
        let dt = projected.narrow(-1, inner + conv, m.heads);
        let y = match (cache.documents(), cache.state()) {
            // A packed row's documents each scanned alone, from a zero
            // state, their convolutions starting afresh.
            (Some(d), _) => d.each_alone(&[&xbc, &dt], |one| self.scan(&one[0], &one[1], cache)),
            (None, Some(state)) => self.steps(&xbc, &dt, state, cache),
            (None, None) => self.scan(&xbc, &dt, cache),
        };
        self.gated_norm(&y, &gate).to_kind(kind)
    }

    /// The chunked scan of a whole sequence, from a zero state: the
    /// convolved channels `xbc` `[batch, seq, conv]` (before the
    /// convolution) and the steps `dt` `[batch, seq, heads]` to the
    /// heads' outputs `[batch, seq, inner]` in fp32. The convolution's
    /// last inputs and the final state go to `cache` when generating.
    fn scan(&self, xbc_in: &Tensor, dt: &Tensor, cache: &LayerCache) -> Tensor {
        let m = &self.sizes;
        let (b, t, _) = xbc_in.size3().unwrap_or((1, 1, 1));
        let inner = m.inner(self.hidden);
        let (heads, hd, n, chunk) = (m.heads, m.head_dim, m.state, m.chunk);
        // The depthwise causal convolution, and its last inputs (zeros
        // before the first) for a generation's next token.
        let (xbc, last_inputs) = self.conv.forward(&xbc_in.transpose(1, 2), None);
        let xbc = self.activation.apply(&xbc.transpose(1, 2));
        let x = xbc.narrow(-1, 0, inner);
        let bb = xbc.narrow(-1, inner, m.groups * n);
        let cc = xbc.narrow(-1, inner + m.groups * n, m.groups * n);
        let a = -self.a_log.to_kind(Kind::Float).exp();
        let dt = (dt + &self.dt_bias)
            .softplus()
            .clamp(self.dt_floor, f64::INFINITY);
        let x = x.reshape([b, t, -1, hd]).to_kind(Kind::Float);
        let per = heads / m.groups;
        let grouped = |y: &Tensor| {
            y.reshape([b, t, -1, n])
                .to_kind(Kind::Float)
                .repeat_interleave_self_int(per, Some(2), Some(heads))
        };
        let (bb, cc) = (grouped(&bb), grouped(&cc));
        let pad = (chunk - t % chunk) % chunk;
        let d_residual = self.d.unsqueeze(-1) * padded(&x, pad);
        let x = x * dt.unsqueeze(-1);
        let a = a.to_kind(x.kind()) * dt;
        let [x, a, bb, cc] = [x, a, bb, cc].map(|y| chunked(&y, pad, chunk));
        // [b, c, l, h] -> [b, h, c, l]
        let a = a.permute([0, 3, 1, 2]);
        let a_cumsum = a.cumsum(-1, None::<Kind>);
        // 1. Within each chunk (the diagonal blocks).
        let l = segment_sum(&a).exp();
        let g = einsum("bclhn,bcshn->bclsh", &[&cc, &bb]);
        let mm = g * l.permute([0, 2, 3, 4, 1]);
        let y_diag = einsum("bclsh,bcshp->bclhp", &[&mm, &x]);
        // 2. Each chunk's state.
        let last = a_cumsum.narrow(-1, a_cumsum.size()[3] - 1, 1);
        let decay_states = (last - &a_cumsum).exp();
        let b_decay = bb * decay_states.permute([0, 2, 3, 1]).unsqueeze(-1);
        let states = einsum("bclhn,bclhp->bchpn", &[&b_decay, &x]);
        // 3. The states carried across chunks.
        let states = Tensor::cat(&[states.narrow(1, 0, 1).zeros_like(), states], 1);
        let ends = a_cumsum
            .select(-1, a_cumsum.size()[3] - 1)
            .constant_pad_nd([1, 0]);
        let decay_chunk = segment_sum(&ends).exp().transpose(1, 3);
        let new_states = einsum("bjih,bjhpn->bihpn", &[&decay_chunk, &states]);
        let chunks = new_states.size()[1] - 1;
        let states = new_states.narrow(1, 0, chunks);
        // What a generation's next token starts from: the convolution's
        // last inputs, the state after the last chunk, in the input's
        // dtype as `transformers`' cache holds them.
        let state = new_states.select(1, chunks).to_kind(xbc_in.kind());
        cache.keep_state((last_inputs, state));
        // 4. Each chunk's output from the state it starts from.
        let state_decay_out = a_cumsum.exp();
        let y_off = einsum("bclhn,bchpn->bclhp", &[&cc, &states])
            * state_decay_out.permute([0, 2, 3, 1]).unsqueeze(-1);
        let y = (y_diag + y_off).reshape([b, -1, heads, hd]) + d_residual;
        y.narrow(1, 0, t).reshape([b, t, -1])
    }

    /// The tokens of `xbc_in` and `dt` (as [`Mamba::scan`] takes them)
    /// one at a time from the generation's `state` (the convolution's
    /// last inputs and the scan's state), as `transformers`' cached path
    /// steps them; the state after them goes back to `cache`.
    fn steps(
        &self,
        xbc_in: &Tensor,
        dt: &Tensor,
        (inputs, mut ssm): (Tensor, Tensor),
        cache: &LayerCache,
    ) -> Tensor {
        let m = &self.sizes;
        let (b, t, _) = xbc_in.size3().unwrap_or((1, 1, 1));
        let inner = m.inner(self.hidden);
        let (heads, hd, n, g) = (m.heads, m.head_dim, m.state, m.groups);
        let a = (-self.a_log.to_kind(Kind::Float).exp())
            .view([heads, 1, 1])
            .expand([heads, hd, n], false);
        let dt_bias = self.dt_bias.unsqueeze(-1).expand([heads, hd], false);
        let d = self.d.unsqueeze(-1).expand([heads, hd], false);
        let per_head = |y: &Tensor| {
            y.reshape([b, g, -1])
                .unsqueeze(2)
                .expand([b, g, heads / g, n], false)
                .contiguous()
                .reshape([b, -1, n])
        };
        // The convolution of every token over the inputs before it (it
        // does not depend on the scan's state).
        let (convolved, inputs) = self.conv.forward(&xbc_in.transpose(1, 2), Some(inputs));
        let mut ys = Vec::with_capacity(t as usize);
        for i in 0..t {
            let xbc = self.activation.apply(&convolved.select(-1, i));
            let x = xbc.narrow(-1, 0, inner).reshape([b, -1, hd]);
            let bb = per_head(&xbc.narrow(-1, inner, g * n));
            let cc = per_head(&xbc.narrow(-1, inner + g * n, g * n));
            let step = dt.select(1, i).unsqueeze(-1).expand([b, heads, hd], false);
            let step = (step + dt_bias.to_kind(dt.kind()))
                .softplus()
                .clamp(self.dt_floor, f64::INFINITY);
            let da = (step.unsqueeze(-1) * &a).exp();
            let dbx = step.unsqueeze(-1) * bb.unsqueeze(-2) * x.unsqueeze(-1);
            ssm = (&ssm * da + dbx).to_kind(ssm.kind());
            let states = ssm.to_kind(cc.kind());
            let y = states
                .view([b * heads, hd, n])
                .bmm(&cc.view([b * heads, n, 1]))
                .view([b, heads, hd]);
            let y = (&y + &x * &d).to_kind(y.kind());
            ys.push(y.reshape([b, 1, -1]));
        }
        cache.keep_state((inputs, ssm));
        Tensor::cat(&ys, 1)
    }

    /// The scan's output `y` gated by `gate` and normalised, as
    /// [`MambaGate`] says: `GraniteMoeHybridRMSNormGated` (`y` times
    /// `silu(gate)`, both in fp32, RMS-normalised, cast to `y`'s dtype,
    /// times the weights), Falcon-H1's plain gate, or its
    /// `FalconH1RMSNormGated` (over groups of channels, the weights
    /// applied in fp32, gated before or after).
    fn gated_norm(&self, y: &Tensor, gate: &Tensor) -> Tensor {
        let kind = y.kind();
        let gated = |h: Tensor| h * gate.to_kind(Kind::Float).silu();
        let normed = |h: Tensor| {
            let var = h.pow_tensor_scalar(2).mean_dim(-1, true, None::<Kind>);
            h * (var + self.eps).rsqrt()
        };
        match (self.sizes.gate, &self.norm) {
            (
                MambaGate::Grouped {
                    groups,
                    before_gate,
                },
                Some(w),
            ) => {
                let h = y.to_kind(Kind::Float);
                let h = if before_gate { h } else { gated(h) };
                let shape = h.size();
                let mut grouped = shape[..shape.len() - 1].to_vec();
                grouped.extend([groups, -1]);
                let h = normed(h.reshape(&grouped[..])) * w.reshape([groups, -1]);
                let h = h.reshape(&shape[..]);
                let h = if before_gate { gated(h) } else { h };
                h.to_kind(kind)
            }
            (MambaGate::NormedAfter, Some(w)) => {
                w * normed(gated(y.to_kind(Kind::Float))).to_kind(kind)
            }
            _ => y * gate.silu(),
        }
    }
}

/// `x` `[b, t, ...]` with `pad` zero rows after its `t` (`pad_tensor_by_size`).
fn padded(x: &Tensor, pad: i64) -> Tensor {
    let mut widths = vec![0i64; 2 * (x.dim() - 2)];
    widths.extend([0, pad]);
    x.constant_pad_nd(widths)
}

/// `x` `[b, t, ...]` padded and cut into chunks of `chunk`: `[b, -1,
/// chunk, ...]` (`reshape_into_chunks`).
fn chunked(x: &Tensor, pad: i64, chunk: i64) -> Tensor {
    let x = padded(x, pad);
    let mut shape = vec![x.size()[0], -1, chunk];
    shape.extend(&x.size()[2..]);
    x.reshape(shape)
}

/// The contraction `equation` names over `operands`: a product summed
/// by libtorch's matrix multiply, where `transformers`' `torch_forward`
/// multiplies broadcast operands whole and then sums (the same sums in
/// another order; the broadcast product is the size of every index at
/// once, a chunk's length squared times heads, head width and state).
fn einsum(equation: &str, operands: &[&Tensor]) -> Tensor {
    Tensor::einsum(equation, operands, None::<&[i64]>)
}

/// `transformers`' `segment_sum`: for `x` `[..., l]`, `[..., l, l]`
/// whose `[i, j]` is the sum of `x` over `j + 1 ..= i` (0 on the
/// diagonal), minus infinity above it; by cumulative sums of a masked
/// copy, as there.
fn segment_sum(x: &Tensor) -> Tensor {
    let l = x.size()[x.dim() - 1];
    let mut shape = x.size();
    shape.push(l);
    let x = x.unsqueeze(-1).expand(&shape, false);
    let ones = Tensor::ones([l, l], (Kind::Bool, x.device()));
    let x = x.masked_fill(&ones.tril(-1).logical_not(), 0.0);
    let sums = x.cumsum(-2, None::<Kind>);
    sums.masked_fill(&ones.tril(0).logical_not(), f64::NEG_INFINITY)
}

/// Whether `family` builds Mamba-2 layers (Granite 4.0's hybrids,
/// Bamba, Mamba-2).
pub(super) fn built_by(family: Family) -> bool {
    matches!(
        family,
        Family::GraniteMoeHybrid
            | Family::Bamba
            | Family::Mamba2
            | Family::FalconH1
            | Family::Zamba2
    )
}

/// Each flat field and where `Mamba2Config` keeps it, with its default.
const FIELDS: [Field; 14] = [
    field("hidden_size", "hidden_size", Default::Int(4096), false),
    field(
        "num_hidden_layers",
        "num_hidden_layers",
        Default::Int(64),
        false,
    ),
    field("vocab_size", "vocab_size", Default::Int(32768), false),
    own_names::EPSILON,
    field("hidden_act", "hidden_act", Default::Str("silu"), false),
    field("mamba_n_heads", "num_heads", Default::Int(128), false),
    field("mamba_d_head", "head_dim", Default::Int(64), false),
    field("mamba_d_state", "state_size", Default::Int(128), false),
    field("mamba_n_groups", "n_groups", Default::Int(8), false),
    field("mamba_expand", "expand", Default::Int(2), false),
    field("mamba_d_conv", "conv_kernel", Default::Int(4), false),
    field("mamba_chunk_size", "chunk_size", Default::Int(256), false),
    field("mamba_proj_bias", "use_bias", Default::Bool(false), false),
    field(
        "mamba_conv_bias",
        "use_conv_bias",
        Default::Bool(true),
        false,
    ),
];

/// Mamba-2's config `j` read flat, as Granite 4.0's: its sizes under the
/// `mamba_*` names, one head (nothing attends), every layer a Mamba
/// layer. `time_step_limit` other than `[0, Infinity]` (its default, as
/// Python writes it) is refused: zrt's steps are clamped there.
pub(super) fn flat(j: &HfJson) -> Result<HfJson, HfError> {
    if let Some(limit) = j.get("time_step_limit") {
        let bound = |v: &Value| match v {
            Value::String(s) if s == "Infinity" => Some(f64::INFINITY),
            v => v.as_f64(),
        };
        let pair: Option<Vec<f64>> = limit.as_array().and_then(|l| l.iter().map(bound).collect());
        if pair.as_deref() != Some(&[0.0, f64::INFINITY]) {
            return Err(j.field(format!(
                "time_step_limit {limit}: zrt clamps each step to [0, Infinity] (its default), as Granite 4.0's layers do; set that"
            )));
        }
    }
    let out = own_names::attention_free(j, Family::Mamba2.model_type(), &FIELDS);
    Ok(j.reading(Value::Object(out)))
}

/// `e` with the flat fields it names renamed to Mamba-2's.
pub(super) fn mamba2_names(e: HfError) -> HfError {
    own_names::renamed_as(e, &FIELDS, &[])
}

/// `c`'s `config.json` as `Mamba2Config` reads it.
pub(super) fn to_json(c: &LlamaConfig, m: &MambaConfig) -> Value {
    json!({
        "model_type": c.family.model_type(),
        "architectures": [c.family.architecture()],
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "num_hidden_layers": c.layers,
        "layer_norm_epsilon": c.eps,
        "hidden_act": c.activation.name(),
        "num_heads": m.heads,
        "head_dim": m.head_dim,
        "state_size": m.state,
        "n_groups": m.groups,
        "expand": m.expand,
        "conv_kernel": m.conv_kernel,
        "chunk_size": m.chunk,
        "use_bias": m.proj_bias,
        "use_conv_bias": m.conv_bias,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}
