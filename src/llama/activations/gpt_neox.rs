//! What GPT-NeoX's layers (Pythia's, [`crate::gpt_neox`]) leave for their
//! backward, in the terms the Llama family's count uses: LayerNorms, one
//! projection of each head's query, key and value side by side (the
//! values a view of it, which the attention keeps whole), a part of each
//! head turned, an ungated GELU MLP, and the two sublayers side by side
//! after a LayerNorm each (`use_parallel_residual`, Falcon 40B's) or one
//! after the other.

use tch::Kind;

use super::{dims, ranks_of, Alike, Ranks, Widths};
use crate::gpt_neox::GptNeoxConfig;
use crate::lora::LoraConfig;

/// The bytes a training forward of `rows` rows of `seq` tokens of the
/// GPT-NeoX model `c` holds for its backward once the loss is computed,
/// as [`crate::llama::held_for_backward`] counts a Llama-family model's:
/// each layer's saved tensors (with `recompute`, its input alone), the
/// final norm's and the loss's (`fused_loss`: the head fused with it),
/// `kind` the compute dtype, the whole model training or `lora`'s
/// adapters on a frozen base, its dropouts too (`hidden_dropout`'s
/// masks of the embeddings and each sublayer's output;
/// `attention_dropout`'s plain CPU attention). `None` under LoRA with
/// more than the layers' adapters training.
pub fn held_for_backward(
    c: &GptNeoxConfig,
    rows_seq: (u64, u64),
    kind: Kind,
    keeping: (bool, bool),
    lora: Option<&LoraConfig>,
) -> Option<u64> {
    alike(c).held_for_backward(rows_seq, kind, keeping, lora)
}

/// The parameters `lora`'s adapters on `c`'s layers hold (`r` x (in +
/// out) each); `None` where more than the layers' adapters trains.
pub fn adapter_params(c: &GptNeoxConfig, lora: &LoraConfig) -> Option<u64> {
    alike(c).adapter_params(lora)
}

/// `c` as the count sees it.
fn alike(c: &GptNeoxConfig) -> Alike {
    let heads = dims(c.heads);
    let turned = (heads, heads, dims(c.head_dim()), dims(c.rotary_dim()));
    let plain = Widths::layer_normed((dims(c.hidden), dims(c.intermediate)), turned);
    Alike {
        ends: ("embed_out", "gpt_neox.embed_in"),
        layers: c.layers,
        vocab: dims(c.vocab),
        widths: Widths {
            // Each head's query, key and value are views of one output:
            // the turned queries and keys are tensors of their own, the
            // values keep the whole output.
            views: true,
            // Side by side, each sublayer after a LayerNorm of its own.
            parallel: c.parallel_residual,
            two_norms: c.parallel_residual,
            resid_dropout: (c.hidden_dropout > 0.0, c.hidden_dropout > 0.0),
            ..plain
        },
        ranks,
        attention_dropout: c.attention_dropout > 0.0,
        embed_dropout: c.hidden_dropout > 0.0,
        positions: false,
    }
}

/// The ranks of `l`'s adapters on GPT-NeoX's layer `layer`: its fused
/// `query_key_value`, `dense`, and the MLP's two matrices.
fn ranks(l: &LoraConfig, layer: i64) -> Ranks {
    ranks_of(
        l,
        &format!("gpt_neox.layers.{layer}."),
        &[
            ("attention.query_key_value", |r| &mut r.qkv),
            ("attention.dense", |r| &mut r.o),
            ("mlp.dense_h_to_4h", |r| &mut r.up),
            ("mlp.dense_4h_to_h", |r| &mut r.down),
        ],
    )
}
