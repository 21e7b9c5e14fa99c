//! The first Mamba's layers: Jamba's ([`Family::Jamba`]) beside its
//! attending ones, those of Mamba and Falcon-Mamba
//! ([`Family::Mamba`], [`Family::FalconMamba`]), which are nothing but
//! them, and Zamba's ([`Family::Zamba`]), split into heads that each
//! select their own step, `B` and `C`. The selective scan (one state
//! per channel, its step, `B` and `C` chosen by each token), its sizes
//! read from the config (Mamba's
//! and Falcon-Mamba's under names of their own, read flat as Jamba's),
//! and the layer computed as `transformers`' `slow_forward` computes
//! it: a scan over the tokens one after another, so that its rounding
//! is the reference's.
//!
//! While generating, the first forward scans the prompt and keeps the
//! layer's last convolution inputs and its state in its cache slot; each
//! later token steps them, as `transformers`' cached path does. A packed
//! row's documents are each scanned alone, from a zero state.
//!
//! The scan is a loop over the tokens, as the reference's is: its cost
//! grows with the sequence in steps of a few small operations, and its
//! intermediate `[batch, inner, seq, state]` tensors (the discretised
//! `A` and `B x`) are held in fp32 whole, as there. The CUDA kernels
//! that make Mamba fast are not part of zrt.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use serde_json::{json, Value};

use crate::hf::{HfError, HfJson};
use crate::kv_cache::LayerCache;
use crate::lora::Adapted;

use super::config::{Activation, LlamaConfig};
use super::family::Family;
use super::layer::Lin;
use super::norm::{rms_normalized, RmsNorm};
use super::own_names::{self, field, Default, Field};
use super::short_conv::CausalConv;

/// How a Mamba layer normalises each token's step, `B` and `C` before
/// the scan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepNorms {
    /// Mamba's: not at all.
    None,
    /// Jamba's: RMSNorms with weights (`dt_layernorm`, `b_layernorm`,
    /// `c_layernorm`), at the model's epsilon.
    Weighted,
    /// Falcon-Mamba's: RMS-normalised without weights, at its
    /// `mixer_rms_eps`.
    Plain(f64),
}

/// A model's first-generation Mamba layers: their sizes (`mamba_*`) and
/// which layers they are.
#[derive(Debug, Clone, PartialEq)]
pub struct Mamba1Config {
    /// `mamba_d_state`: each channel's state.
    pub state: i64,
    /// `mamba_d_conv`: the causal convolution's width.
    pub conv_kernel: i64,
    /// `mamba_expand`: the inner width over the model's.
    pub expand: i64,
    /// `mamba_dt_rank` (`"auto"`: the model's width over 16, rounded
    /// up): the width each token's step is projected through.
    pub dt_rank: i64,
    /// `mamba_conv_bias`.
    pub conv_bias: bool,
    /// `mamba_proj_bias`: `in_proj` and `out_proj` have biases.
    pub proj_bias: bool,
    /// Jamba's `attn_layer_period` and `attn_layer_offset`: layer `l`
    /// attends when `l % period == offset`; the others are Mamba layers.
    /// `None`: every layer is (Mamba's, Falcon-Mamba's).
    pub attention: Option<(i64, i64)>,
    /// How each token's step, `B` and `C` are normalised.
    pub step_norms: StepNorms,
    /// `use_mamba_kernels`: whether `transformers` is to run these layers
    /// with the `mamba-ssm` CUDA kernels (it refuses to run them on CPU
    /// then). zrt has no such kernels and scans as the slow path does
    /// either way; the field is kept to be written back as it was read.
    pub kernels: bool,
    /// Zamba's `n_mamba_heads`: the channels split into that many heads,
    /// each with its own selection (`x_proj_weight`, `dt_proj_weight`,
    /// `dt_proj_bias`, one matrix a head, its own `B` and `C`). `None`:
    /// the first Mamba's one selection for every channel (`x_proj`,
    /// `dt_proj`).
    pub heads: Option<i64>,
    /// Zamba's `hidden_mamba_act`, the layers' own activation (its
    /// `hidden_act` is the shared block's MLP's). `None`: the model's.
    pub activation: Option<Activation>,
}

impl Mamba1Config {
    /// The inner width, `expand` times the model's `hidden`.
    pub fn inner(&self, hidden: i64) -> i64 {
        self.expand * hidden
    }

    /// Whether layer `l` is a Mamba layer (it does not attend).
    pub fn is_mamba(&self, l: i64) -> bool {
        self.attention
            .is_none_or(|(period, offset)| l % period != offset)
    }

    /// A Mamba layer's parameters in a model `hidden` wide (with
    /// Jamba's norms' weights).
    pub(super) fn params(&self, hidden: i64) -> u64 {
        let (d, inner, n, r) = (hidden, self.inner(hidden), self.state, self.dt_rank);
        let bias = |on: bool, n: i64| if on { n } else { 0 };
        let count = (d * 2 * inner + bias(self.proj_bias, 2 * inner))
            + (inner * self.conv_kernel + bias(self.conv_bias, inner))
            + inner * (r + 2 * n)
            + (r * inner + inner)
            + inner * n
            + inner
            + (inner * d + bias(self.proj_bias, d))
            + bias(self.step_norms == StepNorms::Weighted, r + 2 * n);
        count as u64
    }

    /// Its fields in Jamba's `config.json`.
    pub(super) fn to_json(&self) -> Value {
        let (period, offset) = self.attention.unwrap_or((1, 0));
        json!({
            "mamba_d_state": self.state,
            "mamba_d_conv": self.conv_kernel,
            "mamba_expand": self.expand,
            "mamba_dt_rank": self.dt_rank,
            "mamba_conv_bias": self.conv_bias,
            "mamba_proj_bias": self.proj_bias,
            "attn_layer_period": period,
            "attn_layer_offset": offset,
            "use_mamba_kernels": self.kernels,
        })
    }
}

/// A layer period and offset of `JambaConfig` `j` (`attn_layer_*` or
/// `expert_layer_*`), checked as its class checks them.
pub(super) fn period(j: &HfJson, what: &str, default: (i64, i64)) -> Result<(i64, i64), HfError> {
    let (pk, ok) = (
        format!("{what}_layer_period"),
        format!("{what}_layer_offset"),
    );
    let period = j.size_or_none(&pk)?.unwrap_or(default.0);
    let offset = super::config::count_or(j, &ok, default.1)?;
    if period == 0 || offset >= period {
        return Err(j.field(format!(
            "{pk} {period} and {ok} {offset}: the offset must be below the period (its class raises otherwise)"
        )));
    }
    Ok((period, offset))
}

/// The period and offset `JambaConfig` writes for the layers of `layers`
/// that `on` picks: the shortest period whose offset picks them all and
/// no other (Jamba's classes can express no other layout; a config read
/// from one always has such a period).
pub(super) fn period_of(layers: i64, on: impl Fn(i64) -> bool) -> (i64, i64) {
    (1..=layers.max(1))
        .flat_map(|period| (0..period).map(move |offset| (period, offset)))
        .find(|(period, offset)| (0..layers).all(|l| on(l) == (l % period == *offset)))
        .unwrap_or((layers.max(1), 0))
}

/// The Mamba layers of `JambaConfig` `j` (its defaults where it leaves
/// a field out; Mamba's and Falcon-Mamba's read [`flat`]), for a model
/// `hidden` wide: `family` says whose.
pub(super) fn read(j: &HfJson, family: Family, hidden: i64) -> Result<Mamba1Config, HfError> {
    let dt_rank = match j.get("mamba_dt_rank") {
        None | Some(serde_json::Value::Null) => (hidden + 15) / 16,
        Some(v) if v.as_str() == Some("auto") => (hidden + 15) / 16,
        Some(_) => j.size("mamba_dt_rank")?,
    };
    let conv_kernel = j.size_or_none("mamba_d_conv")?.unwrap_or(4);
    let (state, expand) = (
        j.size_or_none("mamba_d_state")?.unwrap_or(16),
        j.size_or_none("mamba_expand")?.unwrap_or(2),
    );
    if [dt_rank, conv_kernel, state, expand].contains(&0) {
        return Err(j.field(format!(
            "mamba_dt_rank {dt_rank}, mamba_d_conv {conv_kernel}, mamba_d_state {state} and mamba_expand {expand}: each at least 1"
        )));
    }
    let heads = match family {
        Family::Zamba => {
            let heads = j.size_or_none("n_mamba_heads")?.unwrap_or(2);
            if heads == 0 || (expand * hidden) % heads != 0 {
                return Err(j.field(format!(
                    "n_mamba_heads {heads} does not divide the Mamba layers' {} channels (mamba_expand {expand} x hidden_size {hidden}): each head is an equal share (its class asserts so)",
                    expand * hidden
                )));
            }
            Some(heads)
        }
        _ => None,
    };
    Ok(Mamba1Config {
        state,
        conv_kernel,
        expand,
        dt_rank,
        conv_bias: j.flag_or("mamba_conv_bias", true)?,
        proj_bias: j.flag_or("mamba_proj_bias", false)?,
        attention: match family {
            Family::Jamba => Some(period(j, "attn", (8, 4))?),
            _ => None,
        },
        step_norms: match family {
            Family::Jamba => StepNorms::Weighted,
            Family::FalconMamba => StepNorms::Plain(j.number_or("mixer_rms_eps", 1e-6)?),
            _ => StepNorms::None,
        },
        kernels: j.flag_or("use_mamba_kernels", true)?,
        heads,
        activation: match family {
            Family::Zamba => Some(Activation::read(
                j,
                "hidden_mamba_act",
                Activation::Silu,
                "Zamba",
            )?),
            _ => None,
        },
    })
}

/// How a Mamba layer selects each token's step, `B` and `C`.
#[derive(Debug)]
enum Selection {
    /// One selection for every channel: `x_proj` to the step's rank,
    /// `B` and `C`; `dt_proj` up to a step a channel.
    Whole { x_proj: Adapted, dt_proj: Adapted },
    /// Zamba's: each head of `heads` its own (`x_proj_weight` `[heads,
    /// rank + 2 state, head]`, `dt_proj_weight` `[heads, head, rank]`,
    /// `dt_proj_bias` `[heads, head]`), read as its class's parameters
    /// (not linear layers: no adapter goes on them).
    Heads {
        x_proj: Tensor,
        dt_weight: Tensor,
        dt_bias: Tensor,
        heads: i64,
    },
}

/// One Mamba layer (`mamba`): `in_proj` to the channels and their gate;
/// a depthwise causal convolution (`conv1d`); `x_proj` to each token's
/// step (through `dt_proj`), `B` and `C`, each RMS-normalised
/// (Jamba's `dt_layernorm`, `b_layernorm`, `c_layernorm`; Falcon-Mamba's
/// without weights; Mamba's not at all); the scan with
/// `A = -exp(A_log)` and the skip `D`; the gate. Its `out_proj` is the
/// layer's output projection, held by the layer.
#[derive(Debug)]
pub(super) struct Mamba1 {
    in_proj: Adapted,
    conv: CausalConv,
    select: Selection,
    a_log: Tensor,
    d: Tensor,
    /// Jamba's norms of each token's step, `B` and `C`.
    norms: Option<[RmsNorm; 3]>,
    sizes: Mamba1Config,
    inner: i64,
    activation: Activation,
}

impl Mamba1 {
    /// The Mamba layer under `p` (Jamba's and Zamba's
    /// `model.layers.N.mamba`, the others' `backbone.layers.N.mixer`),
    /// its linear layers made by `lin`; its parameters start as its
    /// class initialises them.
    pub(super) fn new(p: &nn::Path, c: &LlamaConfig, m: &Mamba1Config, lin: &Lin<'_>) -> Self {
        let (d, inner, n, r) = (c.hidden, m.inner(c.hidden), m.state, m.dt_rank);
        let states = Tensor::arange_start(1, n + 1, (Kind::Float, p.device()));
        let a_log = states.log().unsqueeze(0).expand([inner, n], false);
        // Made in its class's order (the adapters' draws follow it).
        let in_proj = lin(&(p / "in_proj"), d, 2 * inner, m.proj_bias);
        let conv = CausalConv::new(
            &(p / "conv1d"),
            (inner, m.conv_kernel),
            m.conv_bias,
            nn::Init::Randn {
                mean: 0.0,
                stdev: 0.02,
            },
        );
        // Zamba's per-head parameters are shaped by head.
        let (select, a_log, d_shape) = match m.heads {
            None => (
                Selection::Whole {
                    x_proj: lin(&(p / "x_proj"), inner, r + 2 * n, false),
                    dt_proj: lin(&(p / "dt_proj"), r, inner, true),
                },
                a_log,
                vec![inner],
            ),
            Some(heads) => {
                let head = inner / heads;
                let bound = (r as f64).powf(-0.5);
                (
                    Selection::Heads {
                        x_proj: p.var(
                            "x_proj_weight",
                            &[heads, r + 2 * n, head],
                            nn::Init::Randn {
                                mean: 0.0,
                                stdev: 0.02,
                            },
                        ),
                        dt_weight: p.var(
                            "dt_proj_weight",
                            &[heads, head, r],
                            nn::Init::Uniform {
                                lo: -bound,
                                up: bound,
                            },
                        ),
                        dt_bias: p.var_copy("dt_proj_bias", &initial_step_bias([heads, head])),
                        heads,
                    },
                    a_log.reshape([heads, head, n]),
                    vec![heads, head],
                )
            }
        };
        Self {
            in_proj,
            conv,
            select,
            a_log: p.var_copy("A_log", &a_log.contiguous()),
            d: p.ones("D", &d_shape),
            norms: (m.step_norms == StepNorms::Weighted).then(|| {
                [("dt_layernorm", r), ("b_layernorm", n), ("c_layernorm", n)]
                    .map(|(name, width)| RmsNorm::new(p / name, width, c))
            }),
            sizes: m.clone(),
            inner,
            activation: m.activation.unwrap_or(c.activation),
        }
    }

    /// The gated scan of `h` `[batch, seq, hidden]`, `[batch, seq,
    /// inner]` in `h`'s dtype (before `out_proj`), as `transformers`'
    /// `slow_forward` computes it. While generating, the first forward
    /// scans the prompt and keeps the layer's state in `cache`; each
    /// later token steps it, as its cached path does.
    pub(super) fn forward(&self, h: &Tensor, cache: &LayerCache) -> Tensor {
        let projected = self.in_proj.forward(h);
        let (x, gate) = match self.sizes.heads {
            None => (
                projected.narrow(-1, 0, self.inner),
                projected.narrow(-1, self.inner, self.inner),
            ),
            // Zamba's `in_proj` interleaves them: each channel's gate
            // right after it (its class views the projection as
            // `[batch, inner, 2, seq]`).
            Some(_) => {
                let pairs = projected.unflatten(-1, [self.inner, 2]);
                (pairs.select(-1, 0), pairs.select(-1, 1))
            }
        };
        let y = match (cache.documents(), cache.state()) {
            // A packed row's documents each scanned alone, from a zero
            // state, their convolutions starting afresh.
            (Some(d), _) => d.each_alone(&[&x], |one| self.scan(&one[0], None, cache)),
            (None, state) => self.scan(&x, state, cache),
        };
        (y * self.activation.apply(&gate)).to_kind(h.kind())
    }

    /// The scan of the channels `x_in` `[batch, seq, inner]` (before the
    /// convolution), from a zero state, or token by token from a
    /// generation's `state` (the convolution's last inputs and the
    /// scan's state): the outputs `[batch, seq, inner]` with the skip
    /// added, before the gate. The convolution's last inputs and the
    /// final state go to `cache` when generating.
    fn scan(&self, x_in: &Tensor, state: Option<(Tensor, Tensor)>, cache: &LayerCache) -> Tensor {
        let m = &self.sizes;
        let (b, t, _) = x_in.size3().unwrap_or((1, 1, 1));
        let (inner, n) = (self.inner, m.state);
        let kind = x_in.kind();
        let channels = x_in.transpose(1, 2);
        // The depthwise causal convolution: over the whole sequence, or a
        // token at a time over the kept inputs.
        let (inputs, ssm) = match state {
            None => (None, Tensor::zeros([b, inner, n], (kind, x_in.device()))),
            Some((inputs, ssm)) => (Some(inputs), ssm),
        };
        let (conv, inputs) = self.conv.forward(&channels, inputs);
        let x = self.activation.apply(&conv).to_kind(kind);
        let (dt, bb, cc) = self.select(&x);
        let heads = bb.size()[1];
        let head = inner / heads;
        // Discretised: [b, inner, t, n], in fp32 (each head's channels
        // take its B).
        let a = -self.a_log.to_kind(Kind::Float).exp().reshape([inner, n]);
        let da = (a.unsqueeze(0).unsqueeze(2) * dt.unsqueeze(-1)).exp();
        let db =
            dt.reshape([b, heads, head, t]).unsqueeze(-1) * bb.unsqueeze(2).to_kind(Kind::Float);
        let dbu = db.reshape([b, inner, t, n]) * x.unsqueeze(-1).to_kind(Kind::Float);
        // Each token's slices taken by one `unbind` apiece, not a
        // `select` a token: a select's backward writes its gradient into
        // a zeroed tensor of the whole sequence, which made backward
        // quadratic in the length (`transformers`' `slow_forward` indexes
        // so, and is); an unbind's backward is one stack.
        let mut ssm = ssm;
        let mut ys = Vec::with_capacity(t as usize);
        for ((da, dbu), c) in da.unbind(2).iter().zip(dbu.unbind(2)).zip(cc.unbind(2)) {
            ssm = da * &ssm + dbu;
            let by_head = ssm.to_kind(kind).reshape([b, heads, head, n]);
            ys.push(by_head.matmul(&c.unsqueeze(-1)).reshape([b, inner]));
        }
        cache.keep_state((inputs, ssm.to_kind(kind)));
        let y = Tensor::stack(&ys, -1) + &x * self.d.reshape([inner]).unsqueeze(-1);
        y.transpose(1, 2)
    }

    /// Each token's step `[batch, inner, seq]` (after its softplus), `B`
    /// and `C` `[batch, heads, seq, state]` (one head but Zamba's), from
    /// the convolved channels `x` `[batch, inner, seq]`, normalised as
    /// the layer's class normalises them.
    fn select(&self, x: &Tensor) -> (Tensor, Tensor, Tensor) {
        let m = &self.sizes;
        let (r, n) = (m.dt_rank, m.state);
        match &self.select {
            Selection::Whole { x_proj, dt_proj } => {
                let params = x_proj.forward(&x.transpose(1, 2));
                let part = |at, width, i: usize| {
                    let p = params.narrow(-1, at, width);
                    match (&self.norms, m.step_norms) {
                        (Some(norms), _) => norms[i].forward(&p),
                        (None, StepNorms::Plain(eps)) => rms_normalized(&p, eps).to_kind(p.kind()),
                        (None, _) => p,
                    }
                };
                let (dt, bb, cc) = (part(0, r, 0), part(r, n, 1), part(r + n, n, 2));
                let dt = dt_proj.forward(&dt).softplus().transpose(1, 2);
                (dt, bb.unsqueeze(1), cc.unsqueeze(1))
            }
            Selection::Heads {
                x_proj,
                dt_weight,
                dt_bias,
                heads,
            } => {
                let (b, inner, t) = x.size3().unwrap_or((1, 1, 1));
                let by_head = x.reshape([b, *heads, inner / heads, t]);
                // [b, heads, t, rank + 2 state]
                let params = x_proj.unsqueeze(0).matmul(&by_head).transpose(-1, -2);
                let (dt, bb, cc) = (
                    params.narrow(-1, 0, r),
                    params.narrow(-1, r, n),
                    params.narrow(-1, r + n, n),
                );
                let dt = dt_weight.unsqueeze(0).matmul(&dt.transpose(-1, -2))
                    + dt_bias.unsqueeze(0).unsqueeze(-1);
                (dt.softplus().reshape([b, inner, t]), bb, cc)
            }
        }
    }
}

/// The steps' biases `[heads, head]` as Zamba's class initialises them:
/// the inverse softplus of steps drawn log-uniformly between 0.001 and
/// 0.1 (its `time_step_min` and `time_step_max`), floored at 1e-4.
fn initial_step_bias(shape: [i64; 2]) -> Tensor {
    let (lo, hi) = (0.001f64.ln(), 0.1f64.ln());
    let dt = (Tensor::rand(shape, (Kind::Float, tch::Device::Cpu)) * (hi - lo) + lo)
        .exp()
        .clamp_min(1e-4);
    &dt + (-(-&dt).expm1()).log()
}

/// Each flat field and where `MambaConfig` and `FalconMambaConfig` keep
/// it, with their defaults (the same for both).
const FIELDS: [Field; 11] = [
    field("hidden_size", "hidden_size", Default::Int(768), false),
    field(
        "num_hidden_layers",
        "num_hidden_layers",
        Default::Int(32),
        false,
    ),
    field("vocab_size", "vocab_size", Default::Int(50280), false),
    own_names::EPSILON,
    field("hidden_act", "hidden_act", Default::Str("silu"), false),
    field("mamba_d_state", "state_size", Default::Int(16), false),
    field("mamba_d_conv", "conv_kernel", Default::Int(4), false),
    field("mamba_expand", "expand", Default::Int(2), false),
    field(
        "mamba_dt_rank",
        "time_step_rank",
        Default::Str("auto"),
        false,
    ),
    field("mamba_proj_bias", "use_bias", Default::Bool(false), false),
    field(
        "mamba_conv_bias",
        "use_conv_bias",
        Default::Bool(true),
        false,
    ),
];

/// Mamba's or Falcon-Mamba's config `j` read flat, as Jamba's: its
/// sizes under Jamba's `mamba_*` names, one head (nothing attends),
/// `intermediate_size` the scan's inner width (no layer has an MLP).
/// Its class's `intermediate_size` (written by `save_pretrained`) must
/// be `expand` times the width, as its class computes it.
/// `residual_in_fp32` is not read: zrt's residual stream is in the
/// model's dtype (`transformers`' is in fp32 when it is true, its
/// default; the same numbers when training in fp32).
pub(super) fn flat(j: &HfJson, family: Family) -> Result<HfJson, HfError> {
    let mut out = own_names::attention_free(j, family.model_type(), &FIELDS);
    if family == Family::FalconMamba {
        if let Some(eps) = j.get("mixer_rms_eps") {
            out.insert("mixer_rms_eps".into(), eps.clone());
        }
    }
    // The class's own, written by save_pretrained.
    if let (Some(given), Some(inner)) = (
        j.get("intermediate_size").filter(|v| !v.is_null()),
        out.get("intermediate_size").and_then(Value::as_i64),
    ) {
        if given.as_i64() != Some(inner) {
            return Err(j.field(format!(
                "intermediate_size {given}: its class makes it expand x hidden_size ({inner}), and zrt builds that; give the two that agree"
            )));
        }
    }
    Ok(j.reading(Value::Object(out)))
}

/// `e` with the flat fields it names renamed to Mamba's.
pub(super) fn mamba_names(e: HfError) -> HfError {
    own_names::renamed_as(e, &FIELDS, &[])
}

/// `c`'s `config.json` as `MambaConfig` or `FalconMambaConfig` reads it.
pub(super) fn to_json(c: &LlamaConfig, m: &Mamba1Config) -> Value {
    let mut json = json!({
        "model_type": c.family.model_type(),
        "architectures": [c.family.architecture()],
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "num_hidden_layers": c.layers,
        "intermediate_size": m.inner(c.hidden),
        "layer_norm_epsilon": c.eps,
        "hidden_act": c.activation.name(),
        "state_size": m.state,
        "conv_kernel": m.conv_kernel,
        "expand": m.expand,
        "time_step_rank": m.dt_rank,
        "use_bias": m.proj_bias,
        "use_conv_bias": m.conv_bias,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    });
    if let (StepNorms::Plain(eps), Some(all)) = (m.step_norms, json.as_object_mut()) {
        all.insert("mixer_rms_eps".into(), eps.into());
    }
    json
}
