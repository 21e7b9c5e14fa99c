//! RecurrentGemma's recurrent layers ([`Family::RecurrentGemma`],
//! Griffin's recurrent block): in place of attention in the layers
//! `block_types` names `recurrent`. `linear_x` makes the channels the
//! recurrence reads, `linear_y` (through the model's activation) the gate
//! its output is multiplied by; the channels pass a depthwise causal
//! convolution (`conv_1d`), then the RG-LRU (`rg_lru`): per head of
//! channels, an input gate and a recurrence gate (block-diagonal
//! matrices and biases, sigmoids), each channel's decay
//! `a = exp(-8 r softplus(recurrent_param))` for a recurrence gate `r`,
//! and the linear recurrence `h_t = a_t h_{t-1} + sqrt(1 - a_t^2) i_t x_t`
//! accumulated in fp32. `linear_out` is the layer's output projection,
//! held by the layer.
//!
//! As `transformers` computes it: the first token of a sequence (a
//! position 0) starts from a zero state and takes its gated input
//! unscaled; the square root's gradient is bounded at 1000, as its
//! `SqrtBoundDerivative` bounds it (it keeps bf16 training from NaNs
//! where `a` nears 1); the recurrence runs token after token, as the
//! reference's does, so that its rounding is the reference's.
//!
//! While generating, the first forward keeps the convolution's last
//! inputs and the recurrence's state in the layer's cache slot and each
//! later token steps them, as `transformers`' cached path does. A packed
//! row's documents are each run alone, from a zero state, their
//! convolutions starting afresh (`transformers`, given `position_ids`
//! that restart, restarts the recurrence but not the convolution).

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use serde_json::{json, Value};

use crate::hf::{HfError, HfJson};
use crate::kv_cache::LayerCache;
use crate::lora::Adapted;

use super::config::Activation;
use super::layer::Lin;
use super::short_conv::CausalConv;

/// The largest gradient the recurrence's square root passes
/// (`transformers`' `_MAX_SQRT_GRADIENT`).
const MAX_SQRT_GRADIENT: f64 = 1000.0;

/// RecurrentGemma's recurrent layers: their sizes and which layers they
/// are.
#[derive(Debug, Clone, PartialEq)]
pub struct RgLruConfig {
    /// `lru_width` (left out or null: `hidden_size`): the channels the
    /// recurrence runs over.
    pub width: i64,
    /// `conv1d_width`: the tokens each convolution output reads, its own
    /// the last.
    pub conv_width: i64,
    /// `block_types`, repeated over the layers as its class repeats
    /// them: `true` for `"recurrent"`, `false` for `"attention"`.
    pub block_types: Vec<bool>,
    /// `intermediate_size` as given: the MLP is half of it wide, as its
    /// class builds it (kept to be written back as it was read).
    pub intermediate_size: i64,
    /// `w_init_variance_scale`: the spread of a fresh model's gates and
    /// convolution (kept to be written back).
    pub init_scale: f64,
}

impl RgLruConfig {
    /// Whether layer `l` is a recurrent layer (it does not attend).
    pub fn is_recurrent(&self, l: i64) -> bool {
        let n = self.block_types.len().max(1);
        self.block_types.get(l as usize % n) == Some(&true)
    }

    /// The MLP's width: half of `intermediate_size`, floored, as its
    /// class computes it.
    pub fn mlp_width(&self) -> i64 {
        self.intermediate_size / 2
    }

    /// A recurrent layer's parameters in a model `hidden` wide with
    /// `heads` heads: `linear_x`, `linear_y`, `linear_out` (all biased),
    /// the convolution with its bias, `recurrent_param` and the two
    /// gates' block-diagonal weights and biases.
    pub(super) fn params(&self, hidden: i64, heads: i64) -> u64 {
        let (d, w, k) = (hidden, self.width, self.conv_width);
        let block = w / heads;
        let gates = 2 * (heads * block * block + w);
        (2 * (d * w + w) + (w * d + d) + (w * k + w) + w + gates) as u64
    }

    /// Its fields in RecurrentGemma's `config.json`.
    pub(super) fn to_json(&self) -> Value {
        let kinds: Vec<&str> = (self.block_types.iter())
            .map(|&r| if r { "recurrent" } else { "attention" })
            .collect();
        json!({
            "lru_width": self.width,
            "conv1d_width": self.conv_width,
            "block_types": kinds,
            "intermediate_size": self.intermediate_size,
            "w_init_variance_scale": self.init_scale,
        })
    }
}

/// The recurrent layers of `RecurrentGemmaConfig` `j`, `hidden` wide
/// with `heads` heads, with its class's defaults: `lru_width` the
/// width, `conv1d_width` 4, `block_types` two recurrent layers then one
/// attending, `intermediate_size` 7680.
pub(super) fn read(j: &HfJson, hidden: i64, heads: i64) -> Result<RgLruConfig, HfError> {
    let width = j.size_or_null("lru_width", None)?.unwrap_or(hidden);
    // The gates are block-diagonal, a block a head.
    if width % heads != 0 {
        return Err(j.field(format!(
            "lru_width {width} over num_attention_heads {heads}: RecurrentGemma's gates split the recurrence's channels into a block a head; give a multiple"
        )));
    }
    let block_types = match j.get("block_types") {
        None => vec![true, true, false],
        Some(v) => {
            let kinds = v.as_array().filter(|k| !k.is_empty()).ok_or_else(|| {
                j.field(format!(
                    "block_types {v}: a list of \"recurrent\" and \"attention\", repeated over the layers"
                ))
            })?;
            (kinds.iter())
                .map(|k| match k.as_str() {
                    Some("recurrent") => Ok(true),
                    Some("attention") => Ok(false),
                    _ => Err(j.field(format!(
                        "block_types holds {k}: RecurrentGemma's layers are \"recurrent\" or \"attention\""
                    ))),
                })
                .collect::<Result<Vec<bool>, HfError>>()?
        }
    };
    let intermediate_size = j.size_or_none("intermediate_size")?.unwrap_or(3 * 2560);
    if intermediate_size < 2 {
        return Err(j.field(format!(
            "intermediate_size {intermediate_size}: RecurrentGemma's MLP is half of it wide; give at least 2"
        )));
    }
    Ok(RgLruConfig {
        width,
        conv_width: j.size_or_none("conv1d_width")?.unwrap_or(4),
        block_types,
        intermediate_size,
        init_scale: j.number_or("w_init_variance_scale", 0.01)?,
    })
}

/// A block-diagonal gate of the RG-LRU: a `[block, block]` matrix and a
/// bias a head, applied as `x W + b` (not `nn.Linear`'s `x W^T`).
#[derive(Debug)]
struct Gate {
    /// `[heads, block, block]`.
    weight: Tensor,
    /// `[heads, block]`.
    bias: Tensor,
}

impl Gate {
    fn new(p: &nn::Path, name: &str, (heads, block): (i64, i64), stdev: f64) -> Self {
        Self {
            weight: p.var(
                &format!("{name}_weight"),
                &[heads, block, block],
                nn::Init::Randn { mean: 0.0, stdev },
            ),
            bias: p.zeros(&format!("{name}_bias"), &[heads, block]),
        }
    }

    /// The gate's sigmoid for `per_head` `[heads, tokens, block]`, as
    /// `[tokens, heads * block]`.
    fn forward(&self, per_head: &Tensor) -> Tensor {
        let (heads, tokens, block) = per_head.size3().unwrap_or((1, 1, 1));
        // One `baddbmm`, as the reference adds its bias (its rounding).
        (self.bias.unsqueeze(1))
            .baddbmm(per_head, &self.weight, 1, 1)
            .transpose(0, 1)
            .reshape([tokens, heads * block])
            .sigmoid()
    }
}

/// One recurrent layer (`temporal_block`) but for `linear_out`.
#[derive(Debug)]
pub(super) struct RgLru {
    linear_x: Adapted,
    linear_y: Adapted,
    conv: CausalConv,
    /// `rg_lru.recurrent_param` `[width]`: each channel's decay, through
    /// a softplus.
    recurrent_param: Tensor,
    input_gate: Gate,
    recurrent_gate: Gate,
    heads: i64,
    width: i64,
    activation: Activation,
}

impl RgLru {
    /// The layer under `p` (`model.layers.N.temporal_block`) of a model
    /// `hidden` wide with `heads` heads, its linear layers made by
    /// `lin`; its own parameters start as its class initialises them.
    pub(super) fn new(
        p: &nn::Path,
        (hidden, heads, activation): (i64, i64, Activation),
        g: &RgLruConfig,
        lin: &Lin<'_>,
    ) -> Self {
        let (w, block) = (g.width, g.width / heads);
        let rg = p / "rg_lru";
        let gate_spread = (g.init_scale / block as f64).sqrt();
        // `a = exp(-softplus(param))` drawn with `a^2` uniform in
        // [0.81, 0.998]: the parameter is softplus's inverse of
        // `-log(a)`, `log(u^(-1/2) - 1)`.
        let u = Tensor::rand([w], (Kind::Float, p.device())) * (0.999f64.powi(2) - 0.81) + 0.81;
        let param = (u.pow_tensor_scalar(-0.5) - 1.0).log();
        Self {
            linear_x: lin(&(p / "linear_x"), hidden, w, true),
            linear_y: lin(&(p / "linear_y"), hidden, w, true),
            conv: CausalConv::new(
                &(p / "conv_1d"),
                (w, g.conv_width),
                true,
                nn::Init::Randn {
                    mean: 0.0,
                    stdev: (g.init_scale / g.conv_width as f64).sqrt(),
                },
            ),
            recurrent_param: rg.var_copy("recurrent_param", &param),
            input_gate: Gate::new(&rg, "input_gate", (heads, block), gate_spread),
            recurrent_gate: Gate::new(&rg, "recurrent_gate", (heads, block), gate_spread),
            heads,
            width: w,
            activation,
        }
    }

    /// The recurrence of `h` `[batch, seq, hidden]` gated by `linear_y`'s
    /// activation, `[batch, seq, width]` in `h`'s dtype (before
    /// `linear_out`).
    pub(super) fn forward(&self, h: &Tensor, cache: &LayerCache) -> Tensor {
        let y = self.activation.apply(&self.linear_y.forward(h));
        let x = self.linear_x.forward(h);
        let out = match (cache.documents(), cache.state()) {
            // A packed row's documents each run alone, from a zero state.
            (Some(d), _) => d.each_alone(&[&x], |one| self.recur(&one[0], None, cache)),
            (None, state) => self.recur(&x, state, cache),
        };
        (out * y).to_kind(h.kind())
    }

    /// The convolution and the RG-LRU of `x` `[batch, seq, width]`: from a
    /// zero state, its first token a sequence's first, or token by token
    /// after a generation's `state` (the convolution's last inputs and
    /// the recurrence's fp32 state), which goes to `cache` when
    /// generating.
    fn recur(&self, x: &Tensor, state: Option<(Tensor, Tensor)>, cache: &LayerCache) -> Tensor {
        let (b, t, w) = x.size3().unwrap_or((1, 1, self.width));
        let kind = x.kind();
        let (inputs, start) = match state {
            None => (None, None),
            Some((inputs, h)) => (Some(inputs), Some(h)),
        };
        let (conv, inputs) = self.conv.forward(&x.transpose(1, 2), inputs);
        let x = conv.transpose(1, 2);
        let block = w / self.heads;
        let per_head = x.reshape([b * t, self.heads, block]).permute([1, 0, 2]);
        let input_gate = self.input_gate.forward(&per_head).reshape([b, t, w]);
        let recurrence = self.recurrent_gate.forward(&per_head).reshape([b, t, w]);
        // `log a = -8 r softplus(param)`, in the reference's order.
        let log_a = (recurrence * -8.0) * self.recurrent_param.softplus();
        let a = log_a.exp();
        let a_square = (log_a * 2.0).exp();
        let gated = &x * input_gate;
        // A sequence's first token (the reference's reset, where its
        // position is 0) takes its gated input unscaled and nothing of
        // the state before.
        let scale = bounded_sqrt(&(-a_square + 1.0));
        let (scale, a) = match start {
            Some(_) => (scale, a),
            None => {
                let later = Tensor::ones([1, t, 1], (kind, x.device()));
                let _ = later.narrow(1, 0, 1).fill_(0.0);
                let first = -&later + 1.0;
                (first + &later * scale, a * later)
            }
        };
        let normalized = gated * scale.to_kind(kind);
        // Each token's slices taken by one `unbind` apiece (a select's
        // backward would zero a whole-sequence gradient a token).
        let f = Kind::Float;
        let mut h = start.unwrap_or_else(|| Tensor::zeros([b, w], (f, x.device())));
        let mut outs = Vec::with_capacity(t as usize);
        for (a, x) in a.unbind(1).iter().zip(normalized.unbind(1)) {
            h = a.to_kind(f) * &h + x.to_kind(f);
            outs.push(h.to_kind(kind));
        }
        cache.keep_state((inputs, h));
        Tensor::stack(&outs, 1)
    }
}

/// `sqrt(z)`, its gradient `1 / sqrt(max(4 z, 1e-6))`: bounded at
/// [`MAX_SQRT_GRADIENT`] where `z` nears 0, as `transformers`'
/// `SqrtBoundDerivative` computes it. The value is the square root's to
/// the bit (the second term is exactly zero); only the gradient passes
/// through the division.
fn bounded_sqrt(z: &Tensor) -> Tensor {
    let fixed = z.detach();
    let floor = 1.0 / (MAX_SQRT_GRADIENT * MAX_SQRT_GRADIENT);
    let slope = (&fixed * 4.0).clamp_min(floor).sqrt();
    fixed.sqrt() + (z - &fixed) / slope
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bounded_square_root_is_the_square_root_with_its_gradient_clipped() {
        let z = Tensor::from_slice(&[0.25f32, 1e-9, 0.0, 4.0]).set_requires_grad(true);
        let r = bounded_sqrt(&z);
        let want = [0.5f32, 1e-9f32.sqrt(), 0.0, 2.0];
        assert_eq!(Vec::<f32>::try_from(&r.detach()).unwrap(), want);
        r.sum(Kind::Float).backward();
        let g = Vec::<f32>::try_from(&z.grad()).unwrap();
        // 1 / (2 sqrt z) where that is below 1000, 1000 where it is not
        // (a plain square root's would be 15811 and infinite).
        for (g, want) in g.iter().zip([1.0f32, 1000.0, 1000.0, 0.25]) {
            assert!((g - want).abs() <= 1e-4 * want, "{g} against {want}");
        }
    }

    #[test]
    fn block_types_repeat_over_the_layers() {
        let g = RgLruConfig {
            width: 8,
            conv_width: 4,
            block_types: vec![true, true, false],
            intermediate_size: 9,
            init_scale: 0.01,
        };
        let recurrent: Vec<bool> = (0..7).map(|l| g.is_recurrent(l)).collect();
        assert_eq!(recurrent, [true, true, false, true, true, false, true]);
        assert_eq!(g.mlp_width(), 4);
    }
}
