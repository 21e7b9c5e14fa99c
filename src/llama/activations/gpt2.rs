//! What GPT-2's blocks ([`crate::gpt2`]) leave for their backward, in the
//! terms the Llama family's count uses: LayerNorms, one projection of
//! the queries, keys and values (each a view of it, so the attention
//! keeps it whole: the same bytes as three tensors and the output), no
//! rotary embedding, an ungated MLP of the tanh GELU; and its dropouts,
//! 0.1 each unless the config says: a mask of each block's two outputs
//! and of the embeddings, and the attention's, which takes libtorch's
//! plain path on a CPU, keeping fp32 weights for every pair of tokens.

use tch::Kind;

use super::{adapters_alone, alike_layers, bytes_of, dims, ranks_of, Ranks, Widths};
use crate::gpt2::Gpt2Config;
use crate::lora::LoraConfig;

/// The names PEFT gives GPT-2's head and embedding.
const ENDS: (&str, &str) = ("lm_head", "transformer.wte");

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
    (rows, seq): (u64, u64),
    kind: Kind,
    keeping: (bool, bool),
    lora: Option<&LoraConfig>,
) -> Option<u64> {
    if lora.is_some_and(|l| !adapters_alone(l, ENDS)) {
        return None;
    }
    let b = bytes_of(kind)?;
    let w = widths(c, (b, rows, seq), lora);
    let ranks = |layer| lora.map_or_else(Ranks::default, |l| ranks(l, layer));
    let full = lora.is_none();
    let sizes = (c.layers, dims(c.vocab));
    let dropped = c.embd_dropout > 0.0;
    let layers = alike_layers(&w, sizes, (rows, seq), keeping, (full, &ranks), dropped);
    // Where the embeddings train the position embedding's lookup keeps
    // the positions (int64).
    Some(layers + full as u64 * 8 * seq)
}

/// The parameters `lora`'s adapters on `c`'s blocks hold (`r` x (in +
/// out) each); `None` where more than the blocks' adapters trains.
pub fn adapter_params(c: &Gpt2Config, lora: &LoraConfig) -> Option<u64> {
    if !adapters_alone(lora, ENDS) {
        return None;
    }
    let w = widths(c, (1, 1, 1), None);
    let per_layer = |r: &Ranks| r.qkv * 4 * w.h + r.o * 2 * w.h + (r.up + r.down) * (w.h + w.i);
    Some(
        (0..c.layers.max(0))
            .map(|l| per_layer(&ranks(lora, l)))
            .sum(),
    )
}

/// `c`'s block's widths in bytes of `b`, over `rows` rows of `seq`
/// tokens.
fn widths(c: &Gpt2Config, (b, rows, seq): (u64, u64, u64), lora: Option<&LoraConfig>) -> Widths {
    let (h, heads) = (dims(c.width), dims(c.heads));
    let d = h / heads.max(1);
    let i = dims(c.inner.unwrap_or(4 * c.width));
    let dropout = lora.is_some_and(|l| l.dropout > 0.0);
    // No rotary embedding: nothing turned.
    let plain = Widths::layer_normed((b, rows), (h, i), (heads, heads, d, 0), dropout);
    Widths {
        attention_dropout: (c.attn_dropout > 0.0).then_some(seq),
        resid_dropout: c.resid_dropout > 0.0,
        ..plain
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
