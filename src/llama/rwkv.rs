//! RWKV-4 ([`Family::Rwkv`], `RwkvForCausalLM`): its `config.json` read
//! flat and written back, and its two token mixers, which take the
//! places of a layer's attention and MLP.
//!
//! Each block normalises its input (`ln1`, `ln2`; the first block its
//! embeddings too, `pre_ln`) before a time mix (`attention`) and a
//! channel mix (`feed_forward`), each added to the residual. Both read
//! each token beside the one before it (`time_shift`: the sequence
//! shifted by one, a zero first), mixed by trained per-channel weights
//! (`time_mix_*`). The time mix's keys and values run through the WKV
//! recurrence, token after token in fp32 as `transformers`' CPU path
//! (`rwkv_linear_attention_cpu`) runs it, gated by the receptance's
//! sigmoid, then `attention.output`; the channel mix is
//! `sigmoid(receptance) * value(relu(key)^2)`.
//!
//! While generating, each mixer keeps its last input and the time mix
//! its recurrence's state (numerator, denominator, running maximum) in a
//! cache slot, as `transformers`' `state` does. A packed row's documents
//! are each mixed alone, their shifts and recurrences starting afresh.
//!
//! Not followed: `rescale_every`. `transformers` halves the hidden
//! states every that many blocks when not training (and scales two
//! matrices to match), which the LayerNorms undo but for their epsilon;
//! zrt computes the training model's numbers always, and writes the
//! field back as it read it.

use serde_json::{json, Value};
use tch::nn::{self, Init, Module};
use tch::{Kind, Tensor};

use crate::hf::{HfError, HfJson};
use crate::kv_cache::{Decoding, LayerCache};
use crate::lora::Adapted;

use super::config::LlamaConfig;
use super::family::Family;
use super::layer::Lin;
use super::own_names::{self, field, Default, Field, EPSILON};

/// Each flat field and RWKV's name for it, with `RwkvConfig`'s default:
/// the time mix's width (`attention_hidden_size`, null: the model's) as
/// the one head's, the channel mix's (`intermediate_size`, null: four
/// times the model's) as the MLP's.
const FIELDS: [Field; 8] = [
    field("hidden_size", "hidden_size", Default::Int(4096), false),
    field(
        "num_hidden_layers",
        "num_hidden_layers",
        Default::Int(32),
        false,
    ),
    field("vocab_size", "vocab_size", Default::Int(50277), false),
    field(
        "max_position_embeddings",
        "context_length",
        Default::Int(1024),
        true,
    ),
    EPSILON,
    field(
        "intermediate_size",
        "intermediate_size",
        Default::Null,
        false,
    ),
    field("head_dim", "attention_hidden_size", Default::Null, false),
    field("rescale_every", "rescale_every", Default::Int(6), false),
];

/// The RWKV config `j` as the flat config the shared reader reads: one
/// head, as wide as the time mix; the widths left null filled as its
/// class fills them.
pub(super) fn flat(j: &HfJson) -> Result<HfJson, HfError> {
    let mut out = own_names::attention_free(j, "rwkv", &FIELDS);
    let hidden = out.get("hidden_size").and_then(Value::as_i64);
    if let Some(hidden) = hidden.filter(|&h| h > 0) {
        for (key, width) in [("intermediate_size", 4 * hidden), ("head_dim", hidden)] {
            if out.get(key).is_none_or(Value::is_null) {
                out.insert(key.into(), width.into());
            }
        }
    }
    Ok(j.reading(Value::Object(out)))
}

/// `e` with the flat fields it names renamed to RWKV's.
pub(super) fn rwkv_names(e: HfError) -> HfError {
    own_names::renamed_as(e, &FIELDS, &[])
}

/// `rescale_every` of the flat config `j`: a whole number (0 or less:
/// never), kept to be written back.
pub(super) fn rescale_every(j: &HfJson) -> Result<i64, HfError> {
    let v = j.get("rescale_every").cloned().unwrap_or(Value::Null);
    v.as_i64().ok_or_else(|| {
        j.field(format!(
            "rescale_every {v}: a whole number of blocks (6 by default; 0: never)"
        ))
    })
}

/// `c`'s `config.json` as `RwkvConfig` reads it; `use_cache` false when
/// the time mix is not the model's width (its class's cache is
/// `hidden_size` wide, and a forward with it fails).
pub(super) fn to_json(c: &LlamaConfig) -> Value {
    debug_assert_eq!(c.family, Family::Rwkv);
    let mut json = json!({
        "model_type": "rwkv",
        "architectures": [Family::Rwkv.architecture()],
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "num_hidden_layers": c.layers,
        "attention_hidden_size": c.heads * c.head_dim,
        "intermediate_size": c.intermediate,
        "context_length": c.positions,
        "layer_norm_epsilon": c.eps,
        "rescale_every": c.rescale_every.unwrap_or(6),
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    });
    if let (true, Some(all)) = (c.heads * c.head_dim != c.hidden, json.as_object_mut()) {
        all.insert("use_cache".into(), false.into());
    }
    json
}

/// What the mixing weights start as (a checkpoint overwrites them): an
/// even mix of each token and the one before.
const HALF: Init = Init::Const(0.5);

/// `h` `[batch, seq, d]` shifted one token later (`time_shift`): the
/// first token's place holds `last` (a generation's previous token),
/// else zeros.
fn shifted(h: &Tensor, last: Option<&Tensor>) -> Tensor {
    let t = h.size()[1];
    let first = match last {
        Some(last) => last.unsqueeze(1).to_kind(h.kind()),
        None => h.narrow(1, 0, 1).zeros_like(),
    };
    Tensor::cat(&[first, h.narrow(1, 0, t - 1)], 1)
}

/// `h * mix + before * (1 - mix)`, as its class computes it.
fn mixed(h: &Tensor, before: &Tensor, mix: &Tensor) -> Tensor {
    h * mix + before * (-mix + 1.0)
}

/// The time mix (`attention`): its mixing weights, its recurrence's
/// decay and first-token bonus, a channel each, and its key, value and
/// receptance matrices (`attention.output` is the layer's output
/// projection).
#[derive(Debug)]
pub(super) struct TimeMix {
    time_decay: Tensor,
    time_first: Tensor,
    mix_key: Tensor,
    mix_value: Tensor,
    mix_receptance: Tensor,
    key: Adapted,
    value: Adapted,
    receptance: Adapted,
}

impl TimeMix {
    /// Under `a` (`attention`), for `c`'s width and its one head's.
    pub(super) fn new(a: &nn::Path, c: &LlamaConfig, lin: &Lin<'_>) -> Self {
        let (d, w) = (c.hidden, c.heads * c.head_dim);
        Self {
            time_decay: a.zeros("time_decay", &[w]),
            time_first: a.zeros("time_first", &[w]),
            mix_key: a.var("time_mix_key", &[1, 1, d], HALF),
            mix_value: a.var("time_mix_value", &[1, 1, d], HALF),
            mix_receptance: a.var("time_mix_receptance", &[1, 1, d], HALF),
            key: lin(&(a / "key"), d, w, false),
            value: lin(&(a / "value"), d, w, false),
            receptance: lin(&(a / "receptance"), d, w, false),
        }
    }

    /// `h` `[batch, seq, d]` (normalised) mixed: the receptance's gate
    /// times the recurrence's output, `[batch, seq, width]` in `h`'s
    /// dtype.
    pub(super) fn forward(&self, h: &Tensor, cache: &LayerCache) -> Tensor {
        match (cache.documents(), cache.state()) {
            (Some(d), _) => d.each_alone(&[h], |one| self.mix(&one[0], None, cache)),
            (None, state) => self.mix(h, state, cache),
        }
    }

    /// [`TimeMix::forward`] from a zero state, or after a generation's
    /// `state` (the last input, and the recurrence's numerator,
    /// denominator and maximum stacked), kept in `cache` for the next.
    fn mix(&self, h: &Tensor, state: Option<(Tensor, Tensor)>, cache: &LayerCache) -> Tensor {
        let (last, wkv) = state.unzip();
        let before = shifted(h, last.as_ref());
        let key = self.key.forward(&mixed(h, &before, &self.mix_key));
        let value = self.value.forward(&mixed(h, &before, &self.mix_value));
        let receptance = (self.receptance)
            .forward(&mixed(h, &before, &self.mix_receptance))
            .sigmoid();
        let (out, wkv) = self.wkv(&key, &value, wkv);
        cache.keep_state((h.select(1, -1), wkv));
        receptance * out
    }

    /// The WKV recurrence over `key` and `value` `[batch, seq, width]`
    /// in fp32 (its outputs in the keys' dtype), from `state` or from a
    /// zero one (its maximum at -1e38), with the state it ends in.
    fn wkv(&self, key: &Tensor, value: &Tensor, state: Option<Tensor>) -> (Tensor, Tensor) {
        let f = Kind::Float;
        let (b, _, w) = key.size3().unwrap_or((1, 1, 1));
        // `-exp(time_decay)` in the parameter's dtype, as its class
        // computes it; each sum then in fp32.
        let decay = (-self.time_decay.exp()).to_kind(f);
        let first = self.time_first.to_kind(f);
        let [mut num, mut den, mut max] = match state {
            Some(s) => [s.select(1, 0), s.select(1, 1), s.select(1, 2)],
            None => {
                let zeros = Tensor::zeros([b, w], (f, key.device()));
                [zeros.copy(), zeros.copy(), zeros - 1e38]
            }
        };
        let mut outs = Vec::new();
        // Each token's slices by one `unbind` apiece (a select's backward
        // would zero a whole-sequence gradient a token).
        for (k, v) in key.unbind(1).iter().zip(value.unbind(1)) {
            let (k, v) = (k.to_kind(f), v.to_kind(f));
            let bonus = &k + &first;
            let top = max.maximum(&bonus);
            let (e1, e2) = ((&max - &top).exp(), (&bonus - &top).exp());
            let numerator = &e1 * &num + &e2 * &v;
            let denominator = &e1 * &den + &e2;
            outs.push((numerator / denominator).to_kind(key.kind()));
            let decayed = &max + &decay;
            let top = decayed.maximum(&k);
            let (e1, e2) = ((&decayed - &top).exp(), (&k - &top).exp());
            num = &e1 * num + &e2 * v;
            den = e1 * den + e2;
            max = top;
        }
        let state = Tensor::stack(&[num, den, max], 1);
        (Tensor::stack(&outs, 1), state)
    }
}

/// The channel mix (`feed_forward`): its mixing weights, its key (up,
/// `intermediate_size` wide), value (down) and receptance matrices, and
/// a cache slot of its own for its last input while generating.
#[derive(Debug)]
pub(super) struct ChannelMix {
    mix_key: Tensor,
    mix_receptance: Tensor,
    key: Adapted,
    receptance: Adapted,
    value: Adapted,
    cache: LayerCache,
}

impl ChannelMix {
    /// Under `m` (`feed_forward`), for `c`'s widths.
    pub(super) fn new(
        m: &nn::Path,
        c: &LlamaConfig,
        lin: &Lin<'_>,
        decoding: &std::sync::Arc<Decoding>,
    ) -> Self {
        let (d, i) = (c.hidden, c.intermediate);
        Self {
            mix_key: m.var("time_mix_key", &[1, 1, d], HALF),
            mix_receptance: m.var("time_mix_receptance", &[1, 1, d], HALF),
            key: lin(&(m / "key"), d, i, false),
            receptance: lin(&(m / "receptance"), d, d, false),
            value: lin(&(m / "value"), i, d, false),
            cache: LayerCache::new(decoding, None),
        }
    }

    /// `h` `[batch, seq, d]` (normalised) mixed: `sigmoid(receptance) *
    /// value(relu(key)^2)`, each document of a packed row alone.
    pub(super) fn forward(&self, h: &Tensor) -> Tensor {
        match (self.cache.documents(), self.cache.state()) {
            (Some(d), _) => d.each_alone(&[h], |one| self.mix(&one[0], None)),
            (None, state) => self.mix(h, state.map(|(last, _)| last)),
        }
    }

    /// [`ChannelMix::forward`] after a generation's `last` input (none:
    /// zeros), this forward's last kept for the next.
    fn mix(&self, h: &Tensor, last: Option<Tensor>) -> Tensor {
        let before = shifted(h, last.as_ref());
        let key = self.key.forward(&mixed(h, &before, &self.mix_key));
        let value = self.value.forward(&key.relu().square());
        let receptance = (self.receptance)
            .forward(&mixed(h, &before, &self.mix_receptance))
            .sigmoid();
        let end = h.select(1, -1);
        self.cache.keep_state((end.shallow_clone(), end));
        receptance * value
    }
}
