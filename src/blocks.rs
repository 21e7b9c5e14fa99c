//! A block as a model of this crate runs it: plain, or with its
//! activations recomputed in backward ([`Checkpointed`]), chosen when the
//! model is built.

use tch::nn::Module;
use tch::Tensor;

use crate::zero::activation::Checkpointed;

/// A block, plain or checkpointed.
#[derive(Debug)]
pub(crate) enum Run<B: Module + 'static> {
    Plain(Box<B>),
    Checkpointed(Checkpointed<B>),
}

impl<B: Module + 'static> Run<B> {
    /// `block`, checkpointed when `checkpointed`.
    pub(crate) fn new(block: B, checkpointed: bool) -> Self {
        match checkpointed {
            true => Run::Checkpointed(Checkpointed::new(block)),
            false => Run::Plain(Box::new(block)),
        }
    }

    /// Runs `f` on the block.
    pub(crate) fn with_inner<R>(&self, f: impl FnOnce(&B) -> R) -> R {
        match self {
            Run::Plain(b) => f(b),
            Run::Checkpointed(b) => b.with_inner(f),
        }
    }
}

impl<B: Module + 'static> Module for Run<B> {
    fn forward(&self, x: &Tensor) -> Tensor {
        match self {
            Run::Plain(b) => b.forward(x),
            Run::Checkpointed(b) => b.forward(x),
        }
    }
}

/// A token embedding that is the model's head too (`tie_word_embeddings`),
/// as one module so that it can be one unit run twice a forward: on
/// token ids (an integer tensor) it looks them up, on hidden states it
/// gives their logits (`x @ weight^T`). Stage 3 then shards the tied
/// matrix, usually the model's largest, and gathers it for each of its
/// two uses, where left in the root unit it would stay whole on every
/// rank (a unit run twice is reduced once, after its first run's
/// backward).
#[derive(Debug)]
pub(crate) struct TiedEmbedding(pub(crate) tch::nn::Embedding);

impl Module for TiedEmbedding {
    fn forward(&self, x: &Tensor) -> Tensor {
        match x.is_floating_point() {
            true => x.matmul(&self.0.ws.tr()),
            false => self.0.forward(x),
        }
    }
}
