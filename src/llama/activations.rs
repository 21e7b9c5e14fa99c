//! What a forward leaves for its backward: the bytes of the tensors
//! autograd saves, for the layouts whose every saved tensor is counted
//! here (Llama's layer: pre-norm attention through the fused kernel and
//! a gated MLP). `zrt estimate --seq` prints it; `tests/activation_memory.rs`
//! holds it to what libtorch allocates, to the byte.

use tch::Kind;

use super::config::LlamaConfig;
use super::family::Family;

/// The bytes of the generator state each recomputed layer keeps to draw
/// its dropout again (libtorch's CPU generator, serialized).
const RNG_STATE_BYTES: u64 = 5056;

/// The bytes a training forward of `rows` rows of `seq` tokens holds for
/// its backward once the loss is computed: every layer's saved tensors
/// (with `recompute`, each layer's input alone), the final norm's and
/// the loss's log-probabilities. `kind` is the compute dtype
/// (the weights' and activations'; norms and the loss compute in fp32, as
/// the families' classes do). `None` where the count would be a guess:
/// the families whose layer is not Llama's (their norms, gates and
/// attention kernels save other tensors), and a sliding window shorter
/// than the row, a dropout or a soft-capping, which save more.
pub fn held_for_backward(
    c: &LlamaConfig,
    (rows, seq): (u64, u64),
    kind: Kind,
    recompute: bool,
) -> Option<u64> {
    let counted = matches!(
        c.family,
        Family::Llama | Family::Mistral | Family::Qwen2 | Family::Granite
    );
    let window_short = c.sliding_window.is_some_and(|w| (w as u64) < seq);
    if !counted
        || window_short
        || c.attention_dropout > 0.0
        || c.attn_softcap.is_some()
        || c.final_softcap.is_some()
        || c.qk_norm
        || c.parallel
    {
        return None;
    }
    let b = match kind {
        Kind::Float => 4,
        Kind::BFloat16 | Kind::Half => 2,
        _ => return None,
    };
    let dims = |x: i64| x.max(0) as u64;
    let (h, i, v) = (dims(c.hidden), dims(c.intermediate), dims(c.vocab));
    let (q, kv) = (dims(c.heads * c.head_dim), dims(c.kv_heads * c.head_dim));
    let (d, heads, layers) = (dims(c.head_dim), dims(c.heads), dims(c.layers));
    // An RMSNorm keeps its input in fp32 (in fp32 the input itself, the
    // residual; else its fp32 copy), the normalized values and its output
    // in the compute dtype, and one fp32 reciprocal per token.
    let norm = 4 * h + 2 * b * h + 4;
    let per_token_layer = match recompute {
        // The layer's input, its one saved tensor.
        true => b * h,
        // Two norms; the attention kernel's queries, keys, values, output
        // and fp32 log-sum-exp per head (its output is the output
        // projection's input); the MLP's gate, up, activated gate and
        // product.
        false => 2 * norm + b * (2 * q + 2 * kv + 4 * i) + 4 * heads,
    };
    let per_layer = match recompute {
        true => RNG_STATE_BYTES,
        // The rotary embedding's cos and sin, twice (queries, keys): one
        // per position, shared by the rows.
        false => seq * 4 * d * b,
    };
    let tokens = rows * seq;
    // The final norm; the loss's fp32 log-probabilities of every
    // position but the last of each row (the logits themselves are not
    // kept), and its scalar; with more than one row, the targets
    // gathered into one int64 vector.
    let predicted = rows * seq.saturating_sub(1);
    let targets = match rows > 1 {
        true => 8 * predicted,
        false => 0,
    };
    let ends = tokens * norm + predicted * 4 * v + 8 + targets;
    Some(layers * (tokens * per_token_layer + per_layer) + ends)
}
