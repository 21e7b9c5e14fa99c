//! Falcon's layer layouts ([`Family::Falcon`]): which norms a layer
//! has and whether its attention and MLP run side by side, read from
//! `FalconConfig`'s flags, and the config written back.

use serde_json::{json, Value};

use crate::hf::{HfError, HfJson};

use super::config::LlamaConfig;
use super::family::Family;

/// How a Falcon layer is laid out (`parallel_attn`,
/// `new_decoder_architecture`, `num_ln_in_parallel_attn`). Its fused
/// query-key-value matrix holds, for each group of heads sharing keys
/// and values, the group's queries, then its key, then its value: with
/// `multi_query` one group (Falcon 7B), with the new architecture
/// `num_kv_heads` (Falcon 40B and 180B), otherwise one a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FalconLayout {
    /// `new_decoder_architecture`: `num_kv_heads` groups of heads.
    pub new_arch: bool,
    /// `parallel_attn`: the attention and the MLP read the layer's input
    /// side by side, their outputs summed, then dropped out together
    /// (`hidden_dropout`); otherwise one after the other, the
    /// attention's output dropped out at `attention_dropout`.
    pub parallel: bool,
    /// Two norms of the input side by side (`ln_attn`, `ln_mlp`: the new
    /// architecture's default) rather than one (`input_layernorm`).
    pub two_norms: bool,
}

/// Falcon's layout and its key-value heads from the config `j` of
/// `heads` attention heads. ALiBi, and the flag combinations
/// `FalconDecoderLayer` cannot run, are refused.
pub(super) fn layout(j: &HfJson, heads: i64) -> Result<(FalconLayout, i64), HfError> {
    if j.flag_or("alibi", false)? {
        return Err(j.field(
            "alibi true (Falcon-RW's linear attention biases): zrt turns Falcon's heads with rotary embeddings only; set it to false for a model that uses them".into(),
        ));
    }
    let new_arch = j.flag_or("new_decoder_architecture", false)?;
    let parallel = j.flag_or("parallel_attn", true)?;
    let norms = match j.get("num_ln_in_parallel_attn") {
        None if new_arch => 2,
        None => 1,
        Some(v) => match v.as_i64() {
            Some(n @ (1 | 2)) => n,
            _ => {
                return Err(j.field(format!(
                    "num_ln_in_parallel_attn {v}: a Falcon layer normalises its input once or twice (1 or 2)"
                )))
            }
        },
    };
    if new_arch && !parallel {
        return Err(j.field(
            "new_decoder_architecture true with parallel_attn false: FalconDecoderLayer cannot run this pair (its sequential layers are the old architecture's); set parallel_attn true".into(),
        ));
    }
    if !new_arch && parallel && norms == 2 {
        return Err(j.field(
            "num_ln_in_parallel_attn 2 without new_decoder_architecture: FalconDecoderLayer builds the two norms but its old layers read one it lacks; set new_decoder_architecture true or num_ln_in_parallel_attn 1".into(),
        ));
    }
    let kv_heads = match new_arch {
        true => j.size_or_none("num_kv_heads")?.unwrap_or(heads),
        false if j.flag_or("multi_query", true)? => 1,
        false => {
            let given = j.size_or_none("num_kv_heads")?.unwrap_or(heads);
            if given != heads {
                return Err(j.field(format!(
                    "num_kv_heads {given} with multi_query false and the old architecture: every head has its keys and values there ({heads}); leave it out or set new_decoder_architecture true"
                )));
            }
            heads
        }
    };
    let layout = FalconLayout {
        new_arch,
        parallel,
        two_norms: parallel && norms == 2,
    };
    Ok((layout, kv_heads))
}

/// `c`'s `config.json` as `FalconConfig` reads it (no field it lacks:
/// its `head_dim` is a property no config may set).
pub(super) fn to_json(c: &LlamaConfig, f: &FalconLayout) -> Value {
    debug_assert_eq!(c.family, Family::Falcon);
    json!({
        "model_type": "falcon",
        "architectures": [Family::Falcon.architecture()],
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "ffn_hidden_size": c.intermediate,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "new_decoder_architecture": f.new_arch,
        "parallel_attn": f.parallel,
        "num_ln_in_parallel_attn": match (f.new_arch, f.two_norms) {
            (false, _) => None,
            (true, two) => Some(if two { 2 } else { 1 }),
        },
        // The old architecture's groups: one (multi-query), or a head each.
        "multi_query": !f.new_arch && c.kv_heads == 1,
        "num_kv_heads": if f.new_arch { c.kv_heads } else { c.heads },
        "alibi": false,
        "bias": c.o_bias,
        "activation": c.activation.name(),
        "layer_norm_epsilon": c.eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling.to_json(false),
        "max_position_embeddings": c.positions,
        "hidden_dropout": c.resid_dropout,
        "attention_dropout": c.attention_dropout,
        "tie_word_embeddings": c.tied,
        "pad_token_id": c.pad_token,
    })
}
