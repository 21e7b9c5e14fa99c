//! What GPT-2's blocks ([`crate::gpt2`]) leave for their backward, in the
//! terms the Llama family's count uses: LayerNorms, one projection of
//! the queries, keys and values (each a view of it, so the attention
//! keeps it whole: the same bytes as three tensors and the output), no
//! rotary embedding, an ungated MLP of the tanh GELU; and its dropouts,
//! 0.1 each unless the config says: a mask of each block's two outputs
//! and of the embeddings, and the attention's, which takes libtorch's
//! plain path on a CPU, keeping fp32 weights for every pair of tokens.

use tch::Kind;

use super::{dims, ranks_of, Alike, Ranks, Widths};
use crate::gpt2::Gpt2Config;
use crate::lora::LoraConfig;

/// The bytes a training forward of `rows` rows of `seq` tokens of the
/// GPT-2 model `c` holds for its backward once the loss is computed, as
/// [`crate::llama::held_for_backward`] counts a Llama-family model's:
/// each block's saved tensors (with `recompute`, its input alone), the
/// final norm's and the loss's (`fused_loss`: the head fused with it),
/// `kind` the compute dtype, the whole model training or `lora`'s
/// adapters on a frozen base; its dropouts' masks included. `None` under
/// LoRA with more than the blocks' adapters training.
pub fn held_for_backward(
    c: &Gpt2Config,
    rows_seq: (u64, u64),
    kind: Kind,
    keeping: (bool, bool),
    lora: Option<&LoraConfig>,
) -> Option<u64> {
    alike(c).held_for_backward(rows_seq, kind, keeping, lora)
}

/// The parameters `lora`'s adapters on `c`'s blocks hold (`r` x (in +
/// out) each); `None` where more than the blocks' adapters trains.
pub fn adapter_params(c: &Gpt2Config, lora: &LoraConfig) -> Option<u64> {
    alike(c).adapter_params(lora)
}

/// `c` as the count sees it.
fn alike(c: &Gpt2Config) -> Alike {
    let (h, heads) = (dims(c.width), dims(c.heads));
    let d = h / heads.max(1);
    let i = dims(c.inner.unwrap_or(4 * c.width));
    // No rotary embedding: nothing turned.
    let plain = Widths::layer_normed((h, i), (heads, heads, d, 0));
    Alike {
        ends: ("lm_head", "transformer.wte"),
        layers: c.layers,
        vocab: dims(c.vocab),
        widths: Widths {
            resid_dropout: (c.resid_dropout > 0.0, c.resid_dropout > 0.0),
            ..plain
        },
        ranks,
        attention_dropout: c.attn_dropout > 0.0,
        embed_dropout: c.embd_dropout > 0.0,
        positions: true,
    }
}

/// The ranks of `l`'s adapters on GPT-2's block `layer`: `c_attn`, the
/// attention's `c_proj`, and the MLP's `c_fc` and `c_proj`.
fn ranks(l: &LoraConfig, layer: i64) -> Ranks {
    ranks_of(
        l,
        &format!("transformer.h.{layer}."),
        &[
            ("attn.c_attn", |r| &mut r.qkv),
            ("attn.c_proj", |r| &mut r.o),
            ("mlp.c_fc", |r| &mut r.up),
            ("mlp.c_proj", |r| &mut r.down),
        ],
    )
}
