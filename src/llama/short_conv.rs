//! LFM2's convolution layers ([`Family::Lfm2`]): in place of attention
//! in most of its layers, a short gated depthwise convolution
//! (`Lfm2ShortConv`). `in_proj` makes three widths of the layer's
//! input, `B`, `C` and `x`; `B x` is convolved causally over the last
//! `conv_L_cache` tokens, channel by channel, and gated by `C`; its
//! `out_proj` is the layer's output projection, held by the layer.
//!
//! While generating, the first forward keeps the convolution's last
//! inputs in the layer's cache slot and each later token steps them, as
//! `transformers`' cached path does. A packed row's documents are each
//! convolved alone, so a document never reads the end of the one before.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use serde_json::{json, Value};

use crate::hf::{HfError, HfJson};
use crate::kv_cache::LayerCache;
use crate::lora::Adapted;

use super::family::Family;
use super::layer::Lin;

/// LFM2's convolution layers: their width and which layers they are.
#[derive(Debug, Clone, PartialEq)]
pub struct ShortConvConfig {
    /// `conv_L_cache`: the tokens each output reads, its own the last.
    pub kernel: i64,
    /// `conv_bias`: the convolution, `in_proj` and `out_proj` have biases.
    pub bias: bool,
    /// `layer_types`, one a layer: `true` for a convolution layer
    /// (`"conv"`), `false` for one that attends (`"full_attention"`).
    pub layers: Vec<bool>,
    /// How the config gives the MLP's width (kept to be written back as
    /// it was read).
    pub mlp: MlpWidth,
}

/// How `Lfm2Config` gives its MLP's width: `intermediate_size` and the
/// adjustment its class makes of it.
#[derive(Debug, Clone, PartialEq)]
pub struct MlpWidth {
    /// `intermediate_size` (`block_ff_dim` over it when given).
    pub given: i64,
    /// `block_auto_adjust_ff_dim`: two thirds of it, then as below.
    pub adjust: bool,
    /// `block_ffn_dim_multiplier` (`None`: two thirds, unrounded).
    pub multiplier: Option<f64>,
    /// `block_multiple_of`: what the width is rounded up to (0 is taken
    /// as 1).
    pub multiple_of: i64,
}

impl MlpWidth {
    /// The MLP's width, as `Lfm2MLP` computes it.
    pub fn width(&self) -> i64 {
        if !self.adjust {
            return self.given;
        }
        let width = (2 * self.given) / 3;
        let Some(multiplier) = self.multiplier else {
            return width;
        };
        // Python's int() truncates toward zero.
        let width = (multiplier * width as f64).trunc() as i64;
        // (At least 1: a config read refuses 0, one built by hand may
        // hold it.)
        let m = self.multiple_of.max(1);
        // Python's // floors.
        m * (width + m - 1).div_euclid(m)
    }

    /// Its fields in LFM2's `config.json` for an MLP `width` wide: as read
    /// when they give that width, else `width` unadjusted.
    fn to_json(&self, width: i64) -> Value {
        match self.width() == width {
            true => json!({
                "intermediate_size": self.given,
                "block_auto_adjust_ff_dim": self.adjust,
                "block_ffn_dim_multiplier": self.multiplier,
                "block_multiple_of": self.multiple_of,
            }),
            false => json!({
                "intermediate_size": width,
                "block_auto_adjust_ff_dim": false,
            }),
        }
    }
}

impl ShortConvConfig {
    /// Whether layer `l` convolves (it does not attend).
    pub fn is_conv(&self, l: i64) -> bool {
        self.layers.get(l as usize) == Some(&true)
    }

    /// A convolution layer's parameters in a model `hidden` wide
    /// (`in_proj`, the convolution, `out_proj`).
    pub(super) fn params(&self, hidden: i64) -> u64 {
        let bias = |n: i64| if self.bias { n } else { 0 };
        let d = hidden;
        (d * 3 * d + bias(3 * d) + d * self.kernel + bias(d) + d * d + bias(d)) as u64
    }

    /// Its fields in LFM2's `config.json`, with those of an MLP `width`
    /// wide.
    pub(super) fn to_json(&self, width: i64) -> Value {
        let kinds: Vec<&str> = (self.layers.iter())
            .map(|&conv| if conv { "conv" } else { "full_attention" })
            .collect();
        let mut json = json!({
            "conv_L_cache": self.kernel,
            "conv_bias": self.bias,
            "layer_types": kinds,
        });
        if let (Some(all), Value::Object(mlp)) = (json.as_object_mut(), self.mlp.to_json(width)) {
            all.extend(mlp);
        }
        json
    }
}

/// The convolution layers of `Lfm2Config` `j`, `layers` deep: its
/// `layer_types`, or (left out or null) its `full_attn_idxs`, the
/// layers that attend (left out or null: all do), as its class reads
/// them.
pub(super) fn read(j: &HfJson, layers: i64) -> Result<ShortConvConfig, HfError> {
    let kernel = j.size_or_none("conv_L_cache")?.unwrap_or(3);
    let kinds = ["conv", "full_attention"];
    let conv = match super::config::layer_kinds(j, layers, "LFM2", kinds, kinds[0])? {
        Some(kinds) => kinds,
        None => match super::config::attending_at(j, "full_attn_idxs", layers)? {
            Some(attends) => attends.iter().map(|a| !a).collect(),
            None => vec![false; layers as usize],
        },
    };
    // Its cache class looks up the first attending layer.
    if !conv.contains(&false) {
        return Err(j.field(
            "layer_types: no layer attends (\"full_attention\"); LFM2's class needs one".into(),
        ));
    }
    Ok(ShortConvConfig {
        kernel,
        bias: j.flag_or("conv_bias", false)?,
        layers: conv,
        mlp: mlp_width(j)?,
    })
}

/// How `Lfm2Config` `j` gives its MLP's width: its `intermediate_size`
/// (`block_ff_dim` over it when given, as its class reads it), by
/// default 12288, and its adjustment (`block_auto_adjust_ff_dim`, by
/// default on: two thirds of it, times `block_ffn_dim_multiplier` and
/// rounded up to `block_multiple_of`).
pub(super) fn mlp_width(j: &HfJson) -> Result<MlpWidth, HfError> {
    let given = match j.has("block_ff_dim") {
        true => j.size("block_ff_dim")?,
        false => j.size_or_none("intermediate_size")?.unwrap_or(12288),
    };
    let mlp = MlpWidth {
        given,
        adjust: j.flag_or("block_auto_adjust_ff_dim", true)?,
        multiplier: j.number_or_null("block_ffn_dim_multiplier", Some(1.0))?,
        multiple_of: j.size_or_none("block_multiple_of")?.unwrap_or(256),
    };
    match mlp.width() {
        w if w < 1 => Err(j.field(format!(
            "intermediate_size {given} adjusted (block_auto_adjust_ff_dim, block_ffn_dim_multiplier {:?}) is {w}: the MLP needs a width of at least 1",
            mlp.multiplier
        ))),
        _ => Ok(mlp),
    }
}

/// One convolution layer (`conv`): `in_proj` and the depthwise
/// convolution (`conv`, its weight `[hidden, 1, kernel]`).
#[derive(Debug)]
pub(super) struct ShortConv {
    in_proj: Adapted,
    conv: CausalConv,
    hidden: i64,
}

impl ShortConv {
    /// The layer under `p` (`model.layers.N.conv`), its linear layers
    /// made by `lin`.
    pub(super) fn new(p: &nn::Path, hidden: i64, c: &ShortConvConfig, lin: &Lin<'_>) -> Self {
        let normal = nn::Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        Self {
            in_proj: lin(&(p / "in_proj"), hidden, 3 * hidden, c.bias),
            conv: CausalConv::new(&(p / "conv"), (hidden, c.kernel), c.bias, normal),
            hidden,
        }
    }

    /// `C` times the convolution of `B x` for `h` `[batch, seq, hidden]`,
    /// `[batch, seq, hidden]` in `h`'s dtype (before `out_proj`), as
    /// `transformers`' `slow_forward` computes it.
    pub(super) fn forward(&self, h: &Tensor, cache: &LayerCache) -> Tensor {
        let d = self.hidden;
        let projected = self.in_proj.forward(h).transpose(1, 2);
        let (b, c, x) = (
            projected.narrow(1, 0, d),
            projected.narrow(1, d, d),
            projected.narrow(1, 2 * d, d),
        );
        let bx = b * x;
        let convolve = |bx: &Tensor, inputs| {
            let (out, inputs) = self.conv.forward(bx, inputs);
            // The state is the inputs alone; the second half of the slot
            // holds them again.
            cache.keep_state((inputs.shallow_clone(), inputs));
            out
        };
        let out = match (cache.documents(), cache.state()) {
            // `[batch, hidden, seq]`: a row's documents along the last.
            (Some(docs), _) => {
                let seq_major = bx.transpose(1, 2);
                let out = docs.each_alone(&[&seq_major], |one| {
                    convolve(&one[0].transpose(1, 2), None).transpose(1, 2)
                });
                out.transpose(1, 2)
            }
            (None, state) => convolve(&bx, state.map(|(inputs, _)| inputs)),
        };
        (c * out).transpose(1, 2).to_kind(h.kind())
    }
}

/// A depthwise causal convolution (an `nn.Conv1d` with as many groups
/// as channels, padded by `kernel - 1` and cut to the sequence): each
/// output reads its own channel's input and the `kernel - 1` before it.
/// LFM2's, and the Mamba layers' `conv1d`.
#[derive(Debug)]
pub(super) struct CausalConv {
    /// `[channels, 1, kernel]`.
    weight: Tensor,
    bias: Option<Tensor>,
}

impl CausalConv {
    /// The convolution under `p` (its `weight` and, with `bias`, its
    /// `bias`, zeros) of `channels` channels over `kernel` tokens, its
    /// weight started by `init`.
    pub(super) fn new(
        p: &nn::Path,
        (channels, kernel): (i64, i64),
        bias: bool,
        init: nn::Init,
    ) -> Self {
        Self {
            weight: p.var("weight", &[channels, 1, kernel], init),
            bias: bias.then(|| p.zeros("bias", &[channels])),
        }
    }

    /// The convolution of `channels` `[batch, channels, seq]`: over the
    /// whole sequence from zeros (`inputs` `None`), or one token after
    /// another after a generation's `inputs` `[batch, channels, kernel]`
    /// (the last `kernel` inputs, the newest last). Returns the outputs
    /// `[batch, channels, seq]` (before any activation) and the last
    /// `kernel` inputs after them (zeros before the first), as
    /// `transformers`' caches keep them.
    pub(super) fn forward(&self, channels: &Tensor, inputs: Option<Tensor>) -> (Tensor, Tensor) {
        let (k, t) = (self.weight.size()[2], channels.size()[2]);
        let bias = self.bias.as_ref();
        match inputs {
            None => {
                let width = channels.size()[1];
                let out = channels.conv1d(&self.weight, bias, [1], [k - 1], [1], width);
                (out.narrow(-1, 0, t), channels.constant_pad_nd([k - t, 0]))
            }
            Some(mut inputs) => {
                let weight = self.weight.squeeze_dim(1);
                let mut outs = Vec::with_capacity(t as usize);
                for i in 0..t {
                    let token = channels.narrow(-1, i, 1);
                    inputs = Tensor::cat(&[inputs.narrow(-1, 1, k - 1), token], -1);
                    let summed = (&inputs * &weight).sum_dim_intlist(-1, false, None::<Kind>);
                    outs.push(match bias {
                        Some(bias) => summed + bias,
                        None => summed,
                    });
                }
                (Tensor::stack(&outs, -1), inputs)
            }
        }
    }
}

/// Whether `family` has convolution layers.
pub(super) fn built_by(family: Family) -> bool {
    family == Family::Lfm2
}
