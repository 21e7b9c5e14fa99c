//! What Phi's layers (phi-1, phi-1.5, phi-2: [`crate::phi`]) leave for
//! their backward, in the terms the Llama family's count uses: one
//! LayerNorm whose output the attention and the MLP read side by side
//! (Cohere's layer), queries, keys and values each projected, a part of
//! each head turned (`qk_layernorm`: each head's queries and keys
//! LayerNormed first), and an ungated MLP.

use tch::Kind;

use super::{adapters_alone, alike_layers, bytes_of, dims, ranks_of, QkNorm, Ranks, Widths};
use crate::lora::LoraConfig;
use crate::phi::PhiConfig;

/// The names PEFT gives Phi's head and embedding.
const ENDS: (&str, &str) = ("lm_head", "model.embed_tokens");

/// The bytes a training forward of `rows` rows of `seq` tokens of the
/// Phi model `c` holds for its backward once the loss is computed, as
/// [`crate::llama::held_for_backward`] counts a Llama-family model's:
/// each layer's saved tensors (with `recompute`, its input alone), the
/// final norm's and the loss's (`fused_loss`: the head fused with it),
/// `kind` the compute dtype, the whole model training or `lora`'s
/// adapters on a frozen base, the masks of `embd_pdrop` and
/// `resid_pdrop` (phi-2's 0.1) too. `None` with `attention_dropout`
/// (whose plain attention keeps what GPT-2's does where the queries,
/// keys and values all need a gradient, and other tensors where some do
/// not), and under LoRA with more than the layers' adapters training.
pub fn held_for_backward(
    c: &PhiConfig,
    rows_seq: (u64, u64),
    kind: Kind,
    keeping: (bool, bool),
    lora: Option<&LoraConfig>,
) -> Option<u64> {
    if c.attention_dropout > 0.0 {
        return None;
    }
    if lora.is_some_and(|l| !adapters_alone(l, ENDS)) {
        return None;
    }
    let w = widths(c, bytes_of(kind)?, rows_seq.0, lora);
    let ranks = |layer| lora.map_or_else(Ranks::default, |l| ranks(l, layer));
    let sizes = (c.layers, dims(c.vocab));
    let (full, dropped) = (lora.is_none(), c.embd_dropout > 0.0);
    Some(alike_layers(
        &w,
        sizes,
        rows_seq,
        keeping,
        (full, &ranks),
        dropped,
    ))
}

/// The parameters `lora`'s adapters on `c`'s layers hold (`r` x (in +
/// out) each); `None` where more than the layers' adapters trains.
pub fn adapter_params(c: &PhiConfig, lora: &LoraConfig) -> Option<u64> {
    if !adapters_alone(lora, ENDS) {
        return None;
    }
    let w = widths(c, 1, 1, None);
    let per_layer = |r: &Ranks| {
        r.q * (w.h + w.q)
            + (r.k + r.v) * (w.h + w.kv)
            + r.o * (w.q + w.h)
            + (r.up + r.down) * (w.h + w.i)
    };
    Some(
        (0..c.layers.max(0))
            .map(|l| per_layer(&ranks(lora, l)))
            .sum(),
    )
}

/// `c`'s layer's widths in bytes of `b`, over `rows` rows.
fn widths(c: &PhiConfig, b: u64, rows: u64, lora: Option<&LoraConfig>) -> Widths {
    let d = dims(c.head_dim());
    let turned = (dims(c.heads), dims(c.kv_heads), d, dims(c.rotary_dim()));
    let wide = (dims(c.hidden), dims(c.intermediate));
    let dropout = lora.is_some_and(|l| l.dropout > 0.0);
    Widths {
        // One LayerNorm's output, which both sublayers read.
        parallel: true,
        // One LayerNorm of each head's queries and of its keys, its
        // weights every head's.
        resid_dropout: c.resid_dropout > 0.0,
        qk_norm: match c.qk_layernorm {
            true => QkNorm::Shared,
            false => QkNorm::None,
        },
        ..Widths::layer_normed((b, rows), wide, turned, dropout)
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
