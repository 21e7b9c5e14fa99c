//! What Phi's layers (phi-1, phi-1.5, phi-2: [`crate::phi`]) leave for
//! their backward, in the terms the Llama family's count uses: one
//! LayerNorm whose output the attention and the MLP read side by side
//! (Cohere's layer), queries, keys and values each projected, a part of
//! each head turned (`qk_layernorm`: each head's queries and keys
//! LayerNormed first), and an ungated MLP.

use tch::Kind;

use super::{dims, ranks_of, Alike, QkNorm, Ranks, Widths};
use crate::lora::LoraConfig;
use crate::phi::PhiConfig;

/// The bytes a training forward of `rows` rows of `seq` tokens of the
/// Phi model `c` holds for its backward once the loss is computed, as
/// [`crate::llama::held_for_backward`] counts a Llama-family model's:
/// each layer's saved tensors (with `recompute`, its input alone), the
/// final norm's and the loss's (`fused_loss`: the head fused with it),
/// `kind` the compute dtype, the whole model training or `lora`'s
/// adapters on a frozen base, its dropouts too (the masks of
/// `embd_pdrop` and `resid_pdrop`, phi-2's 0.1; `attention_dropout`'s
/// plain CPU attention). `None` under LoRA with more than the layers'
/// adapters training.
pub fn held_for_backward(
    c: &PhiConfig,
    rows_seq: (u64, u64),
    kind: Kind,
    keeping: (bool, bool),
    lora: Option<&LoraConfig>,
) -> Option<u64> {
    alike(c).held_for_backward(rows_seq, kind, keeping, lora)
}

/// The parameters `lora`'s adapters on `c`'s layers hold (`r` x (in +
/// out) each); `None` where more than the layers' adapters trains.
pub fn adapter_params(c: &PhiConfig, lora: &LoraConfig) -> Option<u64> {
    alike(c).adapter_params(lora)
}

/// `c` as the count sees it.
fn alike(c: &PhiConfig) -> Alike {
    let d = dims(c.head_dim());
    let turned = (dims(c.heads), dims(c.kv_heads), d, dims(c.rotary_dim()));
    let plain = Widths::layer_normed((dims(c.hidden), dims(c.intermediate)), turned);
    Alike {
        ends: ("lm_head", "model.embed_tokens"),
        layers: c.layers,
        vocab: dims(c.vocab),
        widths: Widths {
            // One LayerNorm's output, which both sublayers read.
            parallel: true,
            // One LayerNorm of each head's queries and of its keys, its
            // weights every head's.
            qk_norm: match c.qk_layernorm {
                true => QkNorm::Shared,
                false => QkNorm::None,
            },
            resid_dropout: (c.resid_dropout > 0.0, c.resid_dropout > 0.0),
            ..plain
        },
        ranks,
        attention_dropout: c.attention_dropout > 0.0,
        embed_dropout: c.embd_dropout > 0.0,
        positions: false,
    }
}

/// The ranks of `l`'s adapters on Phi's layer `layer`: its queries',
/// keys', values' and output projections, and `fc1` and `fc2`.
fn ranks(l: &LoraConfig, layer: i64) -> Ranks {
    ranks_of(
        l,
        &format!("model.layers.{layer}."),
        &[
            ("self_attn.q_proj", |r| &mut r.q),
            ("self_attn.k_proj", |r| &mut r.k),
            ("self_attn.v_proj", |r| &mut r.v),
            ("self_attn.dense", |r| &mut r.o),
            ("mlp.fc1", |r| &mut r.up),
            ("mlp.fc2", |r| &mut r.down),
        ],
    )
}
