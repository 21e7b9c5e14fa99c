//! What trains in a frozen token embedding: a LoRA adapter on it
//! ([`EmbeddingAdapter`], PEFT's `lora_embedding_A` and `_B`), and
//! trainable tokens ([`TrainableTokens`]).
//!
//! PEFT's trainable tokens (`trainable_token_indices`): some rows of a
//! frozen token embedding train, standing in for the matrix's rows (a
//! chat template's new tokens, without training the whole vocabulary).
//! PEFT keeps them as `token_adapter.trainable_tokens_delta` `[n,
//! width]` beside the embedding, starting at the pretrained rows, and
//! computes with the matrix those rows are copied into; a head tied to
//! the embedding computes with it too, and an untied head may have
//! trainable tokens of its own (PEFT's dict form naming it).
//!
//! zrt does not copy the matrix (a vocabulary-sized copy each forward):
//! a lookup takes the trained row where a token has one, and a tied
//! head's logits for those tokens are recomputed from the trained rows.
//! The values are PEFT's.

use tch::nn::{self, Init};
use tch::Tensor;

use super::LoraConfig;

/// A LoRA adapter on a token embedding `[vocab, width]`, as PEFT's
/// `lora.Embedding` computes it: `lora_embedding_A` `[r, vocab]` (zeros)
/// and `lora_embedding_B` `[width, r]` (normal), the lookup's output plus
/// `scale * A^T[ids] B^T` (no dropout; the embedding's padding row of
/// `A^T` gets no gradient, as the lookup's).
#[derive(Debug)]
pub(crate) struct EmbeddingAdapter {
    a: Tensor,
    b: Tensor,
    scale: f64,
    padding: i64,
}

impl EmbeddingAdapter {
    /// The adapter of the embedding `[vocab, width]` under `p` (its
    /// padding row `padding`, or -1), when `lora` targets it by name
    /// (never by `all-linear`; the checkpoint's name, `prefix` before
    /// the VarStore's).
    pub(crate) fn new(
        p: &nn::Path,
        (vocab, width): (i64, i64),
        padding: i64,
        (lora, prefix): (Option<&LoraConfig>, &str),
    ) -> Option<Self> {
        let name = super::module_name(p, prefix);
        let c = lora.filter(|c| c.targets_by_name(&name))?;
        let normal = Init::Randn {
            mean: 0.0,
            stdev: 1.0,
        };
        let r = c.rank_of(&name);
        Some(Self {
            a: p.var("lora_embedding_A", &[r, vocab], Init::Const(0.0)),
            b: p.var("lora_embedding_B", &[width, r], normal),
            scale: c.scale_of(&name),
            padding,
        })
    }

    /// The embeddings `looked_up` of `ids` plus the adapter's update.
    pub(crate) fn add(&self, ids: &Tensor, looked_up: Tensor) -> Tensor {
        let after_a = Tensor::embedding(&self.a.tr(), ids, self.padding, false, false);
        let update = after_a.matmul(&self.b.tr()) * self.scale;
        let kind = looked_up.kind();
        (looked_up + update).to_kind(kind)
    }
}

/// The VarStore name's end of the trained rows.
pub(crate) const DELTA: &str = "token_adapter.trainable_tokens_delta";

/// The rows of a token embedding that train, or of an untied head (its
/// logits of those tokens computed from them).
#[derive(Debug)]
pub(crate) struct TrainableTokens {
    /// `[n, width]`, in the order of `indices`: set to the pretrained
    /// rows while the model is built (`super::init_from_checkpoint`).
    delta: Tensor,
    /// `[n]`: their token ids.
    indices: Tensor,
    /// `[vocab]`: each token's row of `delta`, or -1.
    slots: Tensor,
}

impl TrainableTokens {
    /// The rows `ids` of the embedding `[vocab, width]` under `p`, or
    /// `None` for none. An id past the vocabulary is refused when the
    /// rows are read from the checkpoint; here it has no slot.
    pub(crate) fn new(p: &nn::Path, (vocab, width): (i64, i64), ids: &[i64]) -> Option<Self> {
        if ids.is_empty() {
            return None;
        }
        let n = ids.len() as i64;
        let delta =
            (p / "token_adapter").var("trainable_tokens_delta", &[n, width], Init::Const(0.0));
        let indices = Tensor::from_slice(ids).to_device(p.device());
        let mut table = vec![-1i64; vocab.max(0) as usize];
        for (row, &id) in ids.iter().enumerate() {
            if let Some(slot) = usize::try_from(id).ok().and_then(|i| table.get_mut(i)) {
                *slot = row as i64;
            }
        }
        let slots = Tensor::from_slice(&table).to_device(p.device());
        Some(Self {
            delta,
            indices,
            slots,
        })
    }

    /// The embeddings `looked_up` of `ids`, each token with a trained row
    /// taking it instead.
    pub(crate) fn lookup(&self, ids: &Tensor, looked_up: Tensor) -> Tensor {
        let slot = self.slots.take(ids);
        let trained = slot.ge(0).unsqueeze(-1);
        let mut shape = ids.size();
        shape.push(self.delta.size()[1]);
        let rows = self
            .delta
            .index_select(0, &slot.clamp_min(0).flatten(0, -1));
        let rows = rows.view(shape.as_slice()).to_kind(looked_up.kind());
        rows.where_self(&trained, &looked_up)
    }

    /// A head's `logits` (`x @ W^T`: a tied embedding's, or an untied
    /// head's without a bias) with the trained tokens' columns computed
    /// from their trained rows.
    pub(crate) fn logits(&self, x: &Tensor, logits: Tensor) -> Tensor {
        let cols = x.matmul(&self.delta.to_kind(x.kind()).tr());
        let last = logits.dim() as i64 - 1;
        logits.index_copy(last, &self.indices, &cols)
    }
}
