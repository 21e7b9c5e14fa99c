//! Zamba2 ([`Family::Zamba2`], `Zamba2ForCausalLM`: Zyphra's Zamba2
//! 1.2B, 2.7B and 7B): Mamba-2 layers, and transformer blocks shared by
//! many of them; and the first Zamba ([`Family::Zamba`],
//! `ZambaForCausalLM`: Zamba 7B), the same layout with the differences
//! named at the end.
//!
//! Every layer is a Mamba-2 layer (`input_layernorm`, `mamba`, its
//! output added to the residual). A hybrid layer (`layers_block_type`
//! `"hybrid"`) first runs one of the model's `num_mem_blocks` shared
//! transformer blocks, in turn, on its input beside the embeddings
//! (`cat(x, embeddings)`, twice the width), then its own `linear`, and
//! adds that to its Mamba layer's input (not to the residual). A shared
//! block normalises its input, attends (each head twice the width's
//! share, the scores scaled by `(head_dim / 2)^-0.5`, turned only with
//! `use_mem_rope`), projects back to the width, normalises, and runs a
//! GELU-gated MLP, with no residual inside. Each hybrid layer adds its
//! own low-rank adapters to the block's queries, keys and values (with
//! `use_shared_attention_adapter`) and to its MLP's gate and up
//! projection; they are held in the block, as its class holds them.
//!
//! zrt keeps the shared blocks in the root (`model.shared_transformer.K`),
//! which stays gathered at stage 3 for the whole step
//! (docs/design-deltas.md): every hybrid layer's unit reads them, and
//! their gradient is the sum over their uses. A checkpoint names a
//! block under hybrid layers that use it
//! (`model.layers.N.shared_transformer`): every such name is one
//! parameter, which `transformers` ties, and a file may hold it under
//! one, several or all of them; zrt reads the copy first by name
//! (`ShardPlan::weight_copies`) and writes it under the first layer
//! that uses it. A hybrid layer's Mamba layer is under `mamba_decoder`.
//! LoRA adapters on a block's linear layers (and on the hybrid layers'
//! adapters and `linear`) are matched as PEFT matches them, by the name
//! of the block's first user ([`linear_layers`]): one adapter a module,
//! which every user runs, written under each user's name.
//! The embeddings travel through the layers beside the hidden states
//! (each unit's input and output are twice the width), so that a layer,
//! its recompute and its unit see them as one tensor.
//!
//! The first Zamba differs in this: its Mamba layers are the first
//! Mamba's, split into heads (`llama::mamba1`); it has one shared block
//! (`shared_transf`), with no adapters, no rotary embedding, no biases,
//! and an MLP whose gate and up projections are separate (`gate_proj`,
//! `up_proj`); which layers are hybrid is `layers_block_type`, or,
//! without it, the third and then every `attn_layer_period`-th from
//! `attn_layer_offset` counted from the fourth. `transformers` 4.57's
//! `save_pretrained` writes its block under the hybrid layer whose name
//! sorts last (`model.layers.73` of Zamba 7B's thirteen).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{json, Value};
use tch::nn::{self, Module};
use tch::Tensor;

use crate::blocks::Training;
use crate::hf::{HfError, HfJson};
use crate::kv_cache::{Decoding, LayerCache};
use crate::lora::{Adapted, LoraConfig};

use super::config::{self, LlamaConfig};
use super::family::Family;
use super::norm::rms_normalized;
use super::own_names::{self, field, Default, Field};
use super::rope_scaling::RopeScaling;
use super::Rotary;

/// Which Zamba a [`ZambaConfig`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZambaVersion {
    /// The first (`zamba`): one shared block, `shared_transf`, no
    /// adapters, its MLP's projections separate.
    One,
    /// Zamba2 (`zamba2`): `num_mem_blocks` blocks, `shared_transformer`,
    /// their MLPs' gate and up projections one matrix with its adapters.
    Two,
}

/// Zamba's and Zamba2's own settings beside the flat fields (the first
/// Zamba's: one block, no adapters, no rotary embedding).
#[derive(Debug, Clone, PartialEq)]
pub struct ZambaConfig {
    /// Which Zamba.
    pub version: ZambaVersion,
    /// `layers_block_type`: for each layer, whether it is hybrid (a
    /// shared block and its `linear` before its Mamba layer).
    pub hybrid: Vec<bool>,
    /// `num_mem_blocks`: the shared blocks, which the hybrid layers use
    /// in turn (the `j`-th hybrid layer block `j % num_mem_blocks`).
    pub blocks: i64,
    /// `use_shared_attention_adapter`: each hybrid layer's adapters on
    /// the queries, keys and values.
    pub attention_adapters: bool,
    /// `adapter_rank`: the adapters' rank (0 for the first Zamba, which
    /// has none).
    pub adapter_rank: i64,
    /// `use_mem_rope`: the shared blocks turn their queries and keys.
    pub rope: bool,
    /// Zamba2's `use_long_context`: its context 16384 long and, turning,
    /// the base its class grows (`LlamaConfig::rope_theta` holds the
    /// grown one, the config file the one its class grows).
    pub long_context: bool,
    /// Zamba2's `time_step_min`: its Mamba layers' steps are clamped
    /// below at it (0 for the first Zamba, whose `time_step_min` only
    /// initialises them).
    pub time_step_min: f64,
}

impl ZambaConfig {
    /// The hybrid layers' numbers, in order.
    pub(super) fn hybrid_layers(&self) -> Vec<i64> {
        (self.hybrid.iter().enumerate())
            .filter(|(_, h)| **h)
            .map(|(l, _)| l as i64)
            .collect()
    }

    /// Layer `l`'s place among the hybrid layers, if it is one.
    pub(super) fn ordinal(&self, l: i64) -> Option<i64> {
        self.hybrid_layers()
            .iter()
            .position(|&h| h == l)
            .map(|j| j as i64)
    }

    /// The shared blocks some hybrid layer uses (`transformers` builds
    /// the others and holds them nowhere).
    pub(super) fn used_blocks(&self) -> i64 {
        self.blocks.min(self.hybrid_layers().len() as i64)
    }

    /// The hybrid ordinals whose adapters block `k` holds (none of the
    /// first Zamba's).
    fn adapters_of(&self, k: i64) -> Vec<i64> {
        let n = self.hybrid_layers().len() as i64;
        match self.version {
            ZambaVersion::One => Vec::new(),
            ZambaVersion::Two => (0..n).filter(|j| j % self.blocks == k).collect(),
        }
    }

    /// The name a checkpoint gives a hybrid layer's block.
    pub(super) fn block_name(&self) -> &'static str {
        match self.version {
            ZambaVersion::One => "shared_transf",
            ZambaVersion::Two => "shared_transformer",
        }
    }

    /// The parameters of `c`'s shared blocks (in the root).
    pub(super) fn shared_params(&self, c: &LlamaConfig) -> u64 {
        let (d, two, i, r) = (c.hidden, 2 * c.hidden, c.intermediate, self.adapter_rank);
        let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let biased = c.mamba.as_ref().is_some_and(|m| m.proj_bias);
        let bias = |n: i64| if biased { n } else { 0 };
        let attention = two * q + 2 * two * kv + q * d;
        let block = two + attention + d + (d * 2 * i + bias(2 * i)) + (i * d + bias(d));
        let adapters = |k| {
            let uses = self.adapters_of(k).len() as i64;
            let attention = if self.attention_adapters {
                3 * 2 * two * r
            } else {
                0
            };
            uses * (attention + d * r + r * 2 * i)
        };
        (0..self.used_blocks())
            .map(|k| (block + adapters(k)) as u64)
            .sum()
    }
}

/// Each flat field and Zamba2's name for it, with `Zamba2Config`'s
/// default; the Mamba layers' sizes under the names the shared Mamba
/// reader knows (Bamba's).
const FIELDS: [Field; 19] = [
    field("vocab_size", "vocab_size", Default::Int(32000), false),
    field(
        "max_position_embeddings",
        "max_position_embeddings",
        Default::Int(4096),
        false,
    ),
    field("hidden_size", "hidden_size", Default::Int(2560), false),
    field(
        "num_hidden_layers",
        "num_hidden_layers",
        Default::Int(54),
        false,
    ),
    field(
        "num_attention_heads",
        "num_attention_heads",
        Default::Int(32),
        false,
    ),
    field(
        "num_key_value_heads",
        "num_key_value_heads",
        Default::Null,
        false,
    ),
    field(
        "intermediate_size",
        "intermediate_size",
        Default::Null,
        false,
    ),
    field("hidden_act", "hidden_act", Default::Str("gelu"), false),
    field("rms_norm_eps", "rms_norm_eps", Default::Float(1e-5), false),
    field("rope_theta", "rope_theta", Default::Float(10000.0), false),
    field(
        "attention_dropout",
        "attention_dropout",
        Default::Float(0.0),
        false,
    ),
    field("mamba_d_state", "mamba_d_state", Default::Int(64), false),
    field("mamba_d_conv", "mamba_d_conv", Default::Int(4), false),
    field("mamba_expand", "mamba_expand", Default::Int(2), false),
    field("mamba_n_groups", "mamba_ngroups", Default::Int(1), false),
    field("mamba_n_heads", "n_mamba_heads", Default::Int(8), false),
    field("mamba_chunk_size", "chunk_size", Default::Int(256), false),
    field(
        "mamba_proj_bias",
        "add_bias_linear",
        Default::Bool(false),
        false,
    ),
    field(
        "mamba_conv_bias",
        "use_conv_bias",
        Default::Bool(true),
        false,
    ),
];

/// `Zamba2Config`'s own fields beside [`FIELDS`], kept in the flat
/// config for [`read`].
const OWN: [&str; 7] = [
    "layers_block_type",
    "num_mem_blocks",
    "use_shared_attention_adapter",
    "adapter_rank",
    "use_mem_rope",
    "time_step_min",
    "use_long_context",
];

/// The Zamba2 config `j` as the flat config the shared reader reads:
/// every layer a Mamba layer (`layer_types` left out), the heads twice
/// the width's share (`head_dim`), the MLP four times the width when
/// `intermediate_size` is null, as its class makes them.
pub(super) fn flat(j: &HfJson) -> Result<HfJson, HfError> {
    let (mut out, sizes) = own_names::flat_with(j, "zamba2", &FIELDS);
    if let Some((hidden, heads)) = sizes {
        if (2 * hidden) % heads != 0 {
            return Err(j.field(format!(
                "num_attention_heads {heads} does not divide twice hidden_size ({}): Zamba2's shared blocks attend over the hidden states beside the embeddings, each head the share of both",
                2 * hidden
            )));
        }
        if out.get("intermediate_size").is_none_or(Value::is_null) {
            out.insert("intermediate_size".into(), (4 * hidden).into());
        }
        let head_dim = 2 * hidden / heads;
        out.insert("head_dim".into(), head_dim.into());
        // `use_long_context`: its class makes the context 16384 long
        // and, turning, grows the base it is given by `long_base`,
        // whenever it is built (`from_pretrained` too, from the grown
        // base a saved config holds: zrt reads what it computes).
        if j.flag_or("use_long_context", false)? {
            out.insert("max_position_embeddings".into(), 16384.into());
            if j.flag_or("use_mem_rope", false)? {
                let theta = out
                    .get("rope_theta")
                    .and_then(Value::as_f64)
                    .unwrap_or(10000.0);
                out.insert("rope_theta".into(), (theta * long_base(head_dim)).into());
            }
        }
    }
    own_names::keep_own(j, &OWN, &mut out);
    Ok(j.reading(Value::Object(out)))
}

/// What Zamba2's class multiplies the rotary base by with
/// `use_long_context`, for heads `head_dim` wide: `8^(d / (d - 2))`.
fn long_base(head_dim: i64) -> f64 {
    let d = head_dim as f64;
    8f64.powf(d / (d - 2.0))
}

/// `e` with the flat fields it names renamed to Zamba2's.
pub(super) fn zamba2_names(e: HfError) -> HfError {
    own_names::renamed_as(e, &FIELDS, &[])
}

/// Each flat field and the first Zamba's name for it, with
/// `ZambaConfig`'s default (Zamba 7B's sizes); the Mamba layers' under
/// the names the first Mamba's reader knows (Jamba's, which are its).
const FIELDS_ONE: [Field; 20] = [
    field("vocab_size", "vocab_size", Default::Int(32000), false),
    field(
        "max_position_embeddings",
        "max_position_embeddings",
        Default::Int(4096),
        false,
    ),
    field("hidden_size", "hidden_size", Default::Int(3712), false),
    field(
        "num_hidden_layers",
        "num_hidden_layers",
        Default::Int(76),
        false,
    ),
    field(
        "num_attention_heads",
        "num_attention_heads",
        Default::Int(16),
        false,
    ),
    field(
        "num_key_value_heads",
        "num_key_value_heads",
        Default::Int(16),
        false,
    ),
    field(
        "intermediate_size",
        "intermediate_size",
        Default::Int(14848),
        false,
    ),
    field("head_dim", "attention_head_dim", Default::Null, false),
    field("hidden_act", "hidden_act", Default::Str("gelu"), false),
    field("rms_norm_eps", "rms_norm_eps", Default::Float(1e-5), false),
    field(
        "attention_dropout",
        "attention_dropout",
        Default::Float(0.0),
        false,
    ),
    field("mamba_d_state", "mamba_d_state", Default::Int(16), false),
    field("mamba_d_conv", "mamba_d_conv", Default::Int(4), false),
    field("mamba_expand", "mamba_expand", Default::Int(2), false),
    field(
        "mamba_dt_rank",
        "mamba_dt_rank",
        Default::Str("auto"),
        false,
    ),
    field(
        "mamba_conv_bias",
        "mamba_conv_bias",
        Default::Bool(true),
        false,
    ),
    field(
        "mamba_proj_bias",
        "mamba_proj_bias",
        Default::Bool(false),
        false,
    ),
    field("n_mamba_heads", "n_mamba_heads", Default::Int(2), false),
    field(
        "hidden_mamba_act",
        "hidden_mamba_act",
        Default::Str("silu"),
        false,
    ),
    field(
        "use_mamba_kernels",
        "use_mamba_kernels",
        Default::Bool(true),
        false,
    ),
];

/// The first Zamba's own fields beside [`FIELDS_ONE`], kept in the flat
/// config for [`read`].
const OWN_ONE: [&str; 3] = [
    "layers_block_type",
    "attn_layer_period",
    "attn_layer_offset",
];

/// The first Zamba's config `j` as the flat config the shared reader
/// reads: every layer a Mamba layer, the block's heads
/// `attention_head_dim` wide (null: twice the width over the heads,
/// rounded down, as its class makes them). Its `attention_hidden_size`
/// must be twice the width: the block reads the hidden states beside
/// the embeddings.
pub(super) fn flat_first(j: &HfJson) -> Result<HfJson, HfError> {
    let (mut out, sizes) = own_names::flat_with(j, "zamba", &FIELDS_ONE);
    if let Some((hidden, heads)) = sizes {
        if let Some(given) = j.get("attention_hidden_size").filter(|v| !v.is_null()) {
            if given.as_i64() != Some(2 * hidden) {
                return Err(j.field(format!(
                    "attention_hidden_size {given}: Zamba's shared block reads the hidden states beside the embeddings, twice hidden_size ({}), and its class fails on any other; leave it out",
                    2 * hidden
                )));
            }
        }
        if out.get("head_dim").is_none_or(Value::is_null) {
            out.insert("head_dim".into(), (2 * hidden / heads).into());
        }
    }
    own_names::keep_own(j, &OWN_ONE, &mut out);
    Ok(j.reading(Value::Object(out)))
}

/// `e` with the flat fields it names renamed to the first Zamba's.
pub(super) fn zamba_names(e: HfError) -> HfError {
    own_names::renamed_as(e, &FIELDS_ONE, &[])
}

/// The first Zamba's own settings from the flat config `j`, `layers`
/// deep: which layers are hybrid (`layers_block_type`, or as its class
/// makes the list: the first two Mamba layers, the third hybrid, then
/// layer `3 + i` hybrid when `i % attn_layer_period ==
/// attn_layer_offset`), one block.
fn read_first(j: &HfJson, layers: i64) -> Result<ZambaConfig, HfError> {
    let kinds = ("Zamba", ["mamba", "hybrid"], "hybrid");
    let hybrid = match config::kinds_under(j, "layers_block_type", layers, kinds)? {
        Some(hybrid) => hybrid,
        None => {
            let period = j.size_or_none("attn_layer_period")?.unwrap_or(6);
            let offset = config::count_or(j, "attn_layer_offset", 4)?;
            if layers < 3 {
                return Err(j.field(format!(
                    "num_hidden_layers {layers} without layers_block_type: its class's list starts with three layers whatever the depth (and fails building fewer); give layers_block_type, one a layer"
                )));
            }
            let mut kinds = vec![false, false, true];
            kinds.extend((0..layers - 3).map(|i| i % period == offset));
            kinds
        }
    };
    Ok(ZambaConfig {
        version: ZambaVersion::One,
        hybrid,
        blocks: 1,
        attention_adapters: false,
        adapter_rank: 0,
        rope: false,
        long_context: false,
        time_step_min: 0.0,
    })
}

/// `c`'s first Zamba's `config.json` as `ZambaConfig` reads it (the
/// hybrid layers listed, which its class takes over its period).
pub(super) fn to_json_first(c: &LlamaConfig) -> Value {
    let z = c.zamba.as_ref();
    let m = c.mamba1.as_ref();
    json!({
        "model_type": "zamba",
        "architectures": [Family::Zamba.architecture()],
        "vocab_size": c.vocab,
        "max_position_embeddings": c.positions,
        "hidden_size": c.hidden,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads,
        "attention_head_dim": c.head_dim,
        "attention_hidden_size": 2 * c.hidden,
        "intermediate_size": c.intermediate,
        "hidden_act": c.activation.name(),
        "hidden_mamba_act": m.and_then(|m| m.activation).map(|a| a.name()),
        "rms_norm_eps": c.eps,
        "attention_dropout": c.attention_dropout,
        "mamba_d_state": m.map(|m| m.state),
        "mamba_d_conv": m.map(|m| m.conv_kernel),
        "mamba_expand": m.map(|m| m.expand),
        "mamba_dt_rank": m.map(|m| m.dt_rank),
        "mamba_conv_bias": m.map(|m| m.conv_bias),
        "mamba_proj_bias": m.map(|m| m.proj_bias),
        "n_mamba_heads": m.and_then(|m| m.heads),
        "use_mamba_kernels": m.map(|m| m.kernels),
        "layers_block_type": z.map(|z| {
            (z.hybrid.iter())
                .map(|&h| if h { "hybrid" } else { "mamba" })
                .collect::<Vec<_>>()
        }),
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}

/// A Zamba's own settings from the flat config `j` (`family` says
/// which; `layers` deep, its query and key-value heads, each `head_dim`
/// wide), refusing what its class would not compute as zrt does.
pub(super) fn read(
    j: &HfJson,
    family: Family,
    layers: i64,
    (heads, kv_heads, head_dim): (i64, i64, i64),
) -> Result<ZambaConfig, HfError> {
    if family == Family::Zamba {
        return read_first(j, layers);
    }
    let kinds = ("Zamba2", ["mamba", "hybrid"], "hybrid");
    let hybrid = match config::kinds_under(j, "layers_block_type", layers, kinds)? {
        Some(hybrid) => hybrid,
        // `Zamba2Config`'s default, for its 54 layers.
        None => {
            let mut kinds = vec![false];
            for _ in 0..7 {
                kinds.extend([false, false, false, false, false, true]);
            }
            kinds.extend([
                false, false, false, false, true, false, false, false, true, false, false,
            ]);
            if kinds.len() as i64 != layers {
                return Err(j.field(format!(
                    "layers_block_type left out for num_hidden_layers {layers}: its class's default list is 54 layers'; give one a layer"
                )));
            }
            kinds
        }
    };
    let blocks = j.size_or_none("num_mem_blocks")?.unwrap_or(1);
    if blocks == 0 {
        return Err(
            j.field("num_mem_blocks 0: the hybrid layers use at least one shared block".into())
        );
    }
    if !j.flag_or("mamba_conv_bias", true)? {
        return Err(j.field(
            "use_conv_bias false: Zamba2's convolution has a bias whatever it says, and its class's cached step leaves the bias out then; zrt computes its class's full forward, with the bias; give true"
                .into(),
        ));
    }
    let rope = j.flag_or("use_mem_rope", false)?;
    if rope && head_dim % 2 != 0 {
        return Err(j.field(format!(
            "use_mem_rope true with heads {head_dim} wide (twice hidden_size over num_attention_heads): rotary embeddings turn pairs of a head's"
        )));
    }
    let attention_adapters = j.flag_or("use_shared_attention_adapter", false)?;
    if attention_adapters && kv_heads != heads {
        return Err(j.field(format!(
            "use_shared_attention_adapter true with num_key_value_heads {kv_heads} of num_attention_heads {heads}: its adapters add twice the width to the keys and values, which are that wide only when every head has its own (its class fails otherwise)"
        )));
    }
    Ok(ZambaConfig {
        version: ZambaVersion::Two,
        hybrid,
        blocks,
        attention_adapters,
        adapter_rank: j.size_or_none("adapter_rank")?.unwrap_or(128),
        rope,
        long_context: j.flag_or("use_long_context", false)?,
        time_step_min: j.number_or("time_step_min", 0.001)?,
    })
}

/// `c`'s Zamba2 `config.json` as `Zamba2Config` reads it.
pub(super) fn to_json(c: &LlamaConfig) -> Value {
    let z = c.zamba.as_ref();
    let m = c.mamba.as_ref();
    json!({
        "model_type": "zamba2",
        "architectures": [Family::Zamba2.architecture()],
        "vocab_size": c.vocab,
        "max_position_embeddings": c.positions,
        "hidden_size": c.hidden,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads,
        "intermediate_size": c.intermediate,
        "hidden_act": c.activation.name(),
        "rms_norm_eps": c.eps,
        "rope_theta": match z {
            Some(z) if z.long_context && z.rope => c.rope_theta / long_base(c.head_dim),
            _ => c.rope_theta,
        },
        "attention_dropout": c.attention_dropout,
        "use_long_context": z.is_some_and(|z| z.long_context),
        "mamba_d_state": m.map(|m| m.state),
        "mamba_d_conv": m.map(|m| m.conv_kernel),
        "mamba_expand": m.map(|m| m.expand),
        "mamba_ngroups": m.map(|m| m.groups),
        "n_mamba_heads": m.map(|m| m.heads),
        "chunk_size": m.map(|m| m.chunk),
        "add_bias_linear": m.map(|m| m.proj_bias),
        "use_conv_bias": true,
        "layers_block_type": z.map(|z| {
            (z.hybrid.iter())
                .map(|&h| if h { "hybrid" } else { "mamba" })
                .collect::<Vec<_>>()
        }),
        "num_mem_blocks": z.map(|z| z.blocks),
        "use_shared_attention_adapter": z.map(|z| z.attention_adapters),
        "adapter_rank": z.map(|z| z.adapter_rank),
        "use_mem_rope": z.map(|z| z.rope),
        "time_step_min": z.map(|z| z.time_step_min),
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}

/// The model's name of a checkpoint's tensor `name`: a shared block's,
/// under any hybrid layer that uses it, under `model.shared_transformer.K`
/// (the first Zamba's `model.shared_transf.0`; [`is_shared`] names the
/// tensors a file may hold copies of), a hybrid layer's Mamba layer's
/// without `mamba_decoder`; `None` for a name in no layer zrt builds.
pub(super) fn model_name(name: &str, z: &ZambaConfig) -> Option<String> {
    let Some(rest) = name.strip_prefix("model.layers.") else {
        return Some(name.to_string());
    };
    let (layer, inner) = rest.split_once('.')?;
    let l: i64 = layer.parse().ok()?;
    if let Some(block) = inner
        .strip_prefix(z.block_name())
        .and_then(|b| b.strip_prefix('.'))
    {
        // Every user of a block names it (a file holds it under one or
        // more of them: `llama::hf_weight_rules` reads one copy).
        let j = z.ordinal(l)?;
        let shared = z.block_name();
        return Some(format!("model.{shared}.{}.{block}", j % z.blocks));
    }
    match inner.strip_prefix("mamba_decoder.") {
        Some(mamba) if z.ordinal(l).is_some() => Some(format!("model.layers.{l}.{mamba}")),
        _ => Some(name.to_string()),
    }
}

/// Whether the model's tensor `name` is a shared block's: `transformers`
/// ties every hybrid layer's name of a block to one parameter, and a
/// file may hold it under one, several or all of them (4.57's
/// `save_pretrained` writes the first Zamba's under its last hybrid
/// layer by name order; the tests' Zamba2 writer under its first).
pub(super) fn is_shared(name: &str, z: &ZambaConfig) -> bool {
    name.strip_prefix("model.")
        .and_then(|r| r.strip_prefix(z.block_name()))
        .is_some_and(|r| r.starts_with('.'))
}

/// The checkpoint's name of the model's tensor `name`: [`model_name`]
/// undone (a shared block under the first hybrid layer that uses it).
pub(super) fn file_name(name: &str, z: &ZambaConfig) -> String {
    (file_names(name, z).into_iter().next()).unwrap_or_else(|| name.to_string())
}

/// Every name a checkpoint may give the model's tensor (or module)
/// `name`, [`file_name`] first: a shared block's under each hybrid layer
/// that uses it, in order (PEFT writes an adapter on one so, as the
/// block's `state_dict` names it), any other tensor's one name.
pub(super) fn file_names(name: &str, z: &ZambaConfig) -> Vec<String> {
    let hybrid = z.hybrid_layers();
    let shared = z.block_name();
    let rest = name
        .strip_prefix("model.")
        .and_then(|r| r.strip_prefix(shared))
        .and_then(|r| r.strip_prefix('.'));
    if let Some((k, block)) = rest.and_then(|r| r.split_once('.')) {
        if let Ok(k) = k.parse::<usize>() {
            // Block `k`'s users: the hybrid layers whose ordinal is `k`
            // modulo the blocks.
            let users: Vec<String> = (hybrid.iter().enumerate())
                .filter(|(j, _)| (*j as i64) % z.blocks == k as i64)
                .map(|(_, l)| format!("model.layers.{l}.{shared}.{block}"))
                .collect();
            if !users.is_empty() {
                return users;
            }
        }
    }
    if let Some((layer, inner)) = name
        .strip_prefix("model.layers.")
        .and_then(|r| r.split_once('.'))
    {
        let hybrid_layer = layer.parse::<i64>().ok().filter(|l| hybrid.contains(l));
        if let Some(l) = hybrid_layer {
            if inner.starts_with("mamba.") || inner.starts_with("input_layernorm.") {
                return vec![format!("model.layers.{l}.mamba_decoder.{inner}")];
            }
        }
    }
    vec![name.to_string()]
}

/// What builds a shared block's or a hybrid layer's linear layers:
/// `(path, (in, out, bias))`, each with an adapter where the LoRA config
/// targets it, matched by PEFT's name of the module (a shared block's
/// under the first hybrid layer that uses it, [`file_name`]).
type Lin<'a> = dyn Fn(&nn::Path, (i64, i64, bool)) -> Adapted + 'a;

/// [`Lin`] for `z`'s layers, adapted as `lora` targets them.
pub(super) fn linear_layers<'a>(
    z: &'a ZambaConfig,
    lora: Option<&'a LoraConfig>,
    training: &'a Training,
) -> impl Fn(&nn::Path, (i64, i64, bool)) -> Adapted + 'a {
    move |p, dims| {
        let name = file_name(&crate::lora::module_name(p, ""), z);
        Adapted::new_as(p, &name, dims, lora, training)
    }
}

/// A low-rank adapter: `nn.Sequential(Linear(in, r), Linear(r, out))`.
#[derive(Debug)]
struct Adapter {
    down: Adapted,
    up: Adapted,
}

impl Adapter {
    fn new(p: &nn::Path, (i, r, o): (i64, i64, i64), lin: &Lin<'_>) -> Self {
        Self {
            down: lin(&(p / 0), (i, r, false)),
            up: lin(&(p / 1), (r, o, false)),
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        self.up.forward(&self.down.forward(x))
    }

    fn share(&self) -> Self {
        Self {
            down: self.down.share(),
            up: self.up.share(),
        }
    }
}

/// A shared block's MLP's gate and up projections.
#[derive(Debug)]
enum GateUp {
    /// Zamba2's `gate_up_proj`: both in one matrix, the gate first.
    Fused(Adapted),
    /// The first Zamba's `gate_proj` and `up_proj`.
    Split(Adapted, Adapted),
}

/// One shared block (`Zamba2AttentionDecoderLayer`, the first Zamba's
/// `ZambaAttentionDecoderLayer`) and the adapters its
/// hybrid layers add to it, by their ordinal.
#[derive(Debug)]
pub(super) struct Shared {
    input_norm: Tensor,
    q: Adapted,
    k: Adapted,
    v: Adapted,
    o: Adapted,
    qkv_adapters: BTreeMap<i64, [Adapter; 3]>,
    pre_ff_norm: Tensor,
    gate_up: GateUp,
    down: Adapted,
    gate_up_adapters: BTreeMap<i64, Adapter>,
    eps: f64,
}

impl Shared {
    /// Block `k` of `c`'s under `p` (`model.shared_transformer.K`, the
    /// first Zamba's `model.shared_transf.0`), its linear layers (its
    /// hybrid layers' adapters' too) built by `lin`.
    pub(super) fn new(
        p: &nn::Path,
        k: i64,
        (c, z): (&LlamaConfig, &ZambaConfig),
        lin: &Lin<'_>,
    ) -> Self {
        let (d, two, i, r) = (c.hidden, 2 * c.hidden, c.intermediate, z.adapter_rank);
        let bias = c.mamba.as_ref().is_some_and(|m| m.proj_bias);
        let a = p / "self_attn";
        let f = p / "feed_forward";
        let users = z.adapters_of(k);
        let qkv_adapters = (users.iter())
            .filter(|_| z.attention_adapters)
            .map(|&j| {
                let one = |name: &str| Adapter::new(&(&a / name / j), (two, r, two), lin);
                (
                    j,
                    [
                        one("linear_q_adapter_list"),
                        one("linear_k_adapter_list"),
                        one("linear_v_adapter_list"),
                    ],
                )
            })
            .collect();
        let gate_up_adapters = (users.iter())
            .map(|&j| {
                let at = &f / "gate_up_proj_adapter_list" / j;
                (j, Adapter::new(&at, (d, r, 2 * i), lin))
            })
            .collect();
        Self {
            input_norm: (p / "input_layernorm").ones("weight", &[two]),
            q: lin(&(&a / "q_proj"), (two, c.heads * c.head_dim, false)),
            k: lin(&(&a / "k_proj"), (two, c.kv_heads * c.head_dim, false)),
            v: lin(&(&a / "v_proj"), (two, c.kv_heads * c.head_dim, false)),
            o: lin(&(&a / "o_proj"), (c.heads * c.head_dim, d, false)),
            qkv_adapters,
            pre_ff_norm: (p / "pre_ff_layernorm").ones("weight", &[d]),
            gate_up: match z.version {
                ZambaVersion::One => GateUp::Split(
                    lin(&(&f / "gate_proj"), (d, i, false)),
                    lin(&(&f / "up_proj"), (d, i, false)),
                ),
                ZambaVersion::Two => GateUp::Fused(lin(&(&f / "gate_up_proj"), (d, 2 * i, bias))),
            },
            down: lin(&(&f / "down_proj"), (i, d, bias)),
            gate_up_adapters,
            eps: c.eps,
        }
    }

    /// The same tensors, another handle: each hybrid layer holds one.
    pub(super) fn share(&self) -> Self {
        let share3 = |a: &[Adapter; 3]| [a[0].share(), a[1].share(), a[2].share()];
        Self {
            input_norm: self.input_norm.shallow_clone(),
            q: self.q.share(),
            k: self.k.share(),
            v: self.v.share(),
            o: self.o.share(),
            qkv_adapters: (self.qkv_adapters.iter())
                .map(|(j, a)| (*j, share3(a)))
                .collect(),
            pre_ff_norm: self.pre_ff_norm.shallow_clone(),
            gate_up: match &self.gate_up {
                GateUp::Fused(m) => GateUp::Fused(m.share()),
                GateUp::Split(g, u) => GateUp::Split(g.share(), u.share()),
            },
            down: self.down.share(),
            gate_up_adapters: (self.gate_up_adapters.iter())
                .map(|(j, a)| (*j, a.share()))
                .collect(),
            eps: self.eps,
        }
    }

    /// `Zamba2RMSNorm` with weights `w`.
    fn norm(&self, x: &Tensor, w: &Tensor) -> Tensor {
        w * rms_normalized(x, self.eps).to_kind(x.kind())
    }
}

/// A hybrid layer's part before its Mamba layer: its shared block (a
/// handle on the root's), its ordinal among the hybrid layers (its
/// adapters'), its `linear`, the block's rotary embedding, and its own
/// key-value cache.
#[derive(Debug)]
pub(super) struct Hybrid {
    shared: Shared,
    ordinal: i64,
    linear: Adapted,
    rotary: Option<Rotary>,
    cache: LayerCache,
    heads: (i64, i64, i64),
    activation: super::config::Activation,
    dropout: f64,
}

impl Hybrid {
    /// Hybrid layer `ordinal` under `p` (`model.layers.N`), using
    /// `shared` (its block's handle), its `linear` built by `lin`.
    pub(super) fn new(
        p: &nn::Path,
        (ordinal, shared): (i64, Shared),
        (c, lin): (&LlamaConfig, &Lin<'_>),
        decoding: &Arc<Decoding>,
    ) -> Self {
        let rope = c.zamba.as_ref().is_some_and(|z| z.rope);
        Self {
            shared,
            ordinal,
            linear: lin(&(p / "linear"), (c.hidden, c.hidden, false)),
            rotary: rope.then(|| {
                Rotary::new(
                    c.head_dim,
                    c.rope_theta,
                    &RopeScaling::None,
                    c.positions,
                    p.device(),
                )
            }),
            cache: LayerCache::new(decoding, None),
            heads: (c.heads, c.kv_heads, c.head_dim),
            activation: c.activation,
            dropout: c.attention_dropout,
        }
    }

    /// What this layer adds to its Mamba layer's input `x` `[batch, seq,
    /// hidden]`: `linear(block(cat(x, embeddings)))`, dropout on the
    /// attention's weights when `training`.
    pub(super) fn forward(&self, x: &Tensor, embeddings: &Tensor, training: bool) -> Tensor {
        let s = &self.shared;
        let (b, t, _) = x.size3().unwrap_or((1, 1, 1));
        let (heads, kv_heads, hd) = self.heads;
        let h = s.norm(&Tensor::cat(&[x, embeddings], -1), &s.input_norm);
        let adapted = |m: &Adapted, i: usize| match s.qkv_adapters.get(&self.ordinal) {
            Some(a) => m.forward(&h) + a[i].forward(&h),
            None => m.forward(&h),
        };
        let split = |y: Tensor, n: i64| y.view([b, t, n, hd]).transpose(1, 2);
        let (q, k, v) = (
            split(adapted(&s.q, 0), heads),
            split(adapted(&s.k, 1), kv_heads),
            split(adapted(&s.v, 2), kv_heads),
        );
        let dropout = if training { self.dropout } else { 0.0 };
        let scale = (hd as f64 / 2.0).powf(-0.5);
        let out = self.cache.attention(
            self.rotary.as_ref(),
            (q, k, v),
            Some(scale),
            dropout,
            kv_heads != heads,
        );
        let a =
            s.o.forward(&out.transpose(1, 2).contiguous().view([b, t, heads * hd]));
        let m = s.norm(&a, &s.pre_ff_norm);
        let (gate, up) = match &s.gate_up {
            GateUp::Fused(gate_up) => {
                let gate_up = match s.gate_up_adapters.get(&self.ordinal) {
                    Some(adapter) => gate_up.forward(&m) + adapter.forward(&m),
                    None => gate_up.forward(&m),
                };
                let parts = gate_up.chunk(2, -1);
                (parts[0].shallow_clone(), parts[1].shallow_clone())
            }
            GateUp::Split(gate, up) => (gate.forward(&m), up.forward(&m)),
        };
        let mlp = s
            .down
            .forward(&super::glu::gated(self.activation, &gate, &up));
        self.linear.forward(&mlp)
    }
}
