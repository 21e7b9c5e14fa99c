//! What the models of this crate share: a block run plain or with its
//! activations recomputed in backward ([`Checkpointed`], chosen when the
//! model is built), the dropout switch, the token embedding and head
//! as units ([`Ends`]), and the layers they build alike.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tch::nn::Module;
use tch::Tensor;

use crate::kv_cache::{causal_attention, Decoding, LayerCache};
use crate::lora::{Adapted, EmbeddingAdapter, LoraConfig, TrainableTokens};
use crate::packing::Documents;
use crate::zero::activation::{Capture, Checkpointed, Replay, Restore};
use crate::zero::glue::{linear_cross_entropy, LogitsAfter};
use crate::zero::{ShardPlan, ShardedModule};

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

    /// As [`Run::new`], a checkpointed block's recompute seeing the
    /// dropout switch and the packed documents its forward saw, though
    /// the program changed them before backward.
    pub(crate) fn with_state(
        block: B,
        checkpointed: bool,
        (training, decoding): (&Training, &Arc<Decoding>),
    ) -> Self {
        match checkpointed {
            true => Run::Checkpointed(Checkpointed::with_context(block, state(training, decoding))),
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

/// What the layers of these models read besides their input: whether
/// dropout is on, the documents a forward's rows pack, and the router
/// balance their experts record into (`crate::llama::balance`). Taken when a
/// checkpointed layer's forward runs, put back around its recompute.
fn state(training: &Training, decoding: &Arc<Decoding>) -> Capture {
    let (training, decoding) = (training.clone(), decoding.clone());
    Arc::new(move || {
        let (on, documents) = (training.on(), decoding.documents());
        // The forward's router balance: recorded into by the forward (the
        // replay's first run), carried again by each recompute, which
        // records nothing twice.
        let tally = decoding.tally().map(|(t, _)| t);
        let first = AtomicBool::new(true);
        let (training, decoding) = (training.clone(), decoding.clone());
        let replay: Replay = Box::new(move || {
            let was = (training.on(), decoding.documents(), decoding.tally());
            training.set(on);
            decoding.set_documents(documents.as_ref().map(Documents::shared));
            let recording = first.swap(false, Ordering::Relaxed);
            decoding.set_tally(tally.clone().map(|t| (t, recording)));
            let (training, decoding) = (training.clone(), decoding.clone());
            Restore::new(move || {
                training.set(was.0);
                decoding.set_documents(was.1);
                decoding.set_tally(was.2);
            })
        });
        replay
    })
}

/// Whether a model trains with dropout (PyTorch's `model.train()` and
/// `model.eval()`): one switch its modules share, off until set, as a
/// model `from_pretrained` returns is in evaluation; and the NEFTune
/// noise its embeddings take while it trains.
#[derive(Clone, Debug, Default)]
pub(crate) struct Training {
    on: Arc<AtomicBool>,
    /// NEFTune's alpha, as f64 bits (0: none).
    noise: Arc<AtomicU64>,
}

impl Training {
    /// Turns dropout on or off.
    pub(crate) fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// Whether dropout is on.
    pub(crate) fn on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Sets NEFTune's alpha (0: no noise).
    pub(crate) fn set_noise(&self, alpha: f64) {
        self.noise.store(alpha.to_bits(), Ordering::Relaxed);
    }

    /// The token embeddings `x` (`[batch, seq, width]`) with NEFTune's
    /// noise when training and an alpha is set: uniform in `±alpha /
    /// sqrt(seq * width)`, drawn from libtorch's generator in `x`'s dtype,
    /// the bound rounded to fp32 first, as `transformers`'
    /// `neftune_post_forward_hook` draws it. `x` itself otherwise.
    pub(crate) fn embedding_noise(&self, x: Tensor) -> Tensor {
        let alpha = f64::from_bits(self.noise.load(Ordering::Relaxed));
        if alpha == 0.0 || !self.on() {
            return x;
        }
        let dims = x.size().iter().skip(1).product::<i64>();
        let bound = (alpha as f32 / (dims as f32).sqrt()) as f64;
        let mut noise = x.zeros_like();
        let _ = noise.uniform_(-bound, bound);
        x + noise
    }

    /// `x` with each element zeroed at rate `p` and the others scaled by
    /// `1 / (1 - p)` when training (`nn.Dropout`, drawing from libtorch's
    /// generator as it does), `x` itself otherwise.
    pub(crate) fn dropout(&self, x: Tensor, p: f64) -> Tensor {
        match p > 0.0 && self.on() {
            true => x.dropout(p, true),
            false => x,
        }
    }

    /// `x` times a uniform draw within `1 ± eps` for each element when
    /// training and `eps` > 0 (DBRX's router jitter, drawn from
    /// libtorch's generator in `x`'s dtype as `transformers` draws it),
    /// `x` itself otherwise.
    pub(crate) fn jitter(&self, x: Tensor, eps: f64) -> Tensor {
        if eps <= 0.0 || !self.on() {
            return x;
        }
        let mut scale = x.empty_like();
        let _ = scale.uniform_(1.0 - eps, 1.0 + eps);
        x * scale
    }

    /// The attention's dropout rate: `p` when training, else 0.
    pub(crate) fn attention(&self, p: f64) -> f64 {
        if self.on() {
            p
        } else {
            0.0
        }
    }
}

/// Causal self-attention over a fused projection `qkv` `[batch, seq, 3 *
/// width]` (queries, keys, values, each `heads` heads), before the output
/// projection: `[batch, seq, width]`. The main job's GPT and GPT-2 lay
/// their projections out alike. `dropout`: the rate at which attention
/// weights are dropped (0 but in training). With a `cache`, the queries
/// come after the tokens it holds and the keys and values join it.
pub(crate) fn fused_causal_attention(
    qkv: &Tensor,
    heads: i64,
    dropout: f64,
    cache: Option<&LayerCache>,
) -> Tensor {
    let (b, t, d3) = qkv.size3().unwrap_or((1, 1, 3));
    let d = d3 / 3;
    let qkv = qkv
        .view([b, t, 3, heads, d / heads])
        .permute([2, 0, 3, 1, 4]);
    let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
    if let Some(docs) = cache.and_then(LayerCache::documents) {
        let a = docs.attend((&q, &k, &v), None, None, dropout, false);
        return a.transpose(1, 2).contiguous().view([b, t, d]);
    }
    let (offset, (k, v)) = match cache {
        Some(c) => (c.offset(), c.extend(k, v)),
        None => (0, (k, v)),
    };
    let a = causal_attention(&q, &k, &v, offset, dropout, false);
    a.transpose(1, 2).contiguous().view([b, t, d])
}

/// A linear layer `i -> o` under `p`, with or without bias.
pub(crate) fn linear(p: &tch::nn::Path, i: i64, o: i64, bias: bool) -> tch::nn::Linear {
    let cfg = tch::nn::LinearConfig {
        bias,
        ..Default::default()
    };
    tch::nn::linear(p, i, o, cfg)
}

/// A LayerNorm over the last `width` values under `p`, with weights and
/// biases (`nn.LayerNorm(width, eps)`).
pub(crate) fn layer_norm(p: tch::nn::Path, width: i64, eps: f64) -> tch::nn::LayerNorm {
    let cfg = tch::nn::LayerNormConfig {
        eps,
        ..Default::default()
    };
    tch::nn::layer_norm(p, vec![width], cfg)
}

/// A token embedding `[vocab, width]` under `p` whose backward gives a
/// sparse gradient: the looked-up rows, which the engine adds straight
/// into its flat gradient buffer. A dense one is a second vocabulary-sized
/// matrix, mostly zeros, alive until the unit's gradients are reduced
/// (with a 152k vocabulary and width 512, 297 MiB a rank). Row
/// `padding` gets no gradient from the lookup (`nn.Embedding`'s
/// `padding_idx`, which `transformers` sets to the config's
/// `pad_token_id`). With `lora`, a LoRA adapter when it targets the
/// embedding ([`EmbeddingAdapter`]; by its name in the checkpoint,
/// `prefix` before `p`'s), and the rows of its trainable tokens
/// apart from the matrix ([`TrainableTokens`]).
pub(crate) fn token_embedding(
    p: &tch::nn::Path,
    (vocab, width): (i64, i64),
    padding: Option<i64>,
    (lora, prefix): (Option<&LoraConfig>, &str),
) -> TokenEmbedding {
    let padding = padding.unwrap_or(-1);
    let sparse = tch::nn::EmbeddingConfig {
        sparse: true,
        padding_idx: padding,
        ..Default::default()
    };
    let name = crate::lora::module_name(p, prefix);
    let trained = lora.map_or(&[][..], |l| l.trainable_rows(&name, true));
    TokenEmbedding {
        embed: tch::nn::embedding(p, vocab, width, sparse),
        adapter: EmbeddingAdapter::new(p, (vocab, width), padding, (lora, prefix)),
        tokens: TrainableTokens::new(p, (vocab, width), trained),
    }
}

/// A token embedding ([`token_embedding`]), with a LoRA adapter or not,
/// the rows of some tokens trained apart from it or not.
#[derive(Debug)]
pub(crate) struct TokenEmbedding {
    embed: tch::nn::Embedding,
    adapter: Option<EmbeddingAdapter>,
    tokens: Option<TrainableTokens>,
}

impl TokenEmbedding {
    /// The matrix `[vocab, width]`.
    fn weight(&self) -> &Tensor {
        &self.embed.ws
    }
}

impl Module for TokenEmbedding {
    fn forward(&self, ids: &Tensor) -> Tensor {
        let looked_up = self.embed.forward(ids);
        let looked_up = match &self.adapter {
            Some(a) => a.add(ids, looked_up),
            None => looked_up,
        };
        match &self.tokens {
            Some(t) => t.lookup(ids, looked_up),
            None => looked_up,
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
pub(crate) struct TiedEmbedding(pub(crate) TokenEmbedding);

impl TiedEmbedding {
    /// The matrix as the head reads it.
    fn head_matrix(&self) -> Tensor {
        // The head's gradient goes to the matrix's `.grad` as soon as its
        // backward has it, so that the lookup's sparse rows, at the end of
        // backward, are added into it in place: through the matrix itself
        // libtorch would hold the head's gradient until then and sum the
        // two into a third vocabulary-sized matrix.
        let ws = self.0.weight();
        let w = match ws.requires_grad() {
            true => crate::zero::glue::grad_alias(ws).unwrap_or_else(|e| {
                tracing::warn!("tied embedding: {e}; its head's gradient waits for the lookup's");
                ws.shallow_clone()
            }),
            false => ws.shallow_clone(),
        };
        w
    }
}

impl Module for TiedEmbedding {
    fn forward(&self, x: &Tensor) -> Tensor {
        if !x.is_floating_point() {
            return self.0.forward(x);
        }
        let logits = x.matmul(&self.head_matrix().tr());
        match &self.0.tokens {
            Some(t) => t.logits(x, logits),
            None => logits,
        }
    }
}

/// A causal language model's two ends: the token embedding, and the
/// head when it is its own matrix. Each is a unit of its own (they are
/// the largest matrices); a tied one is one unit run at both ends.
#[derive(Debug)]
pub(crate) enum Ends {
    /// The head is the embedding.
    Tied(ShardedModule<TiedEmbedding>),
    /// Each its own unit.
    Apart {
        embed: ShardedModule<TokenEmbedding>,
        head: ShardedModule<Head>,
    },
}

/// An untied head: a linear map (with a LoRA adapter or not), the rows
/// of some tokens trained apart from its matrix or not (PEFT's dict
/// form of `trainable_token_indices` naming it).
#[derive(Debug)]
pub(crate) struct Head {
    linear: Adapted,
    tokens: Option<TrainableTokens>,
}

impl Head {
    /// Its matrix and bias when it is a plain linear map with no token's
    /// rows apart.
    fn plain(&self) -> Option<(&Tensor, Option<&Tensor>)> {
        self.tokens.is_none().then(|| self.linear.plain()).flatten()
    }
}

impl Module for Head {
    fn forward(&self, x: &Tensor) -> Tensor {
        let logits = self.linear.forward(x);
        match &self.tokens {
            Some(t) => t.logits(x, logits),
            None => logits,
        }
    }
}

/// The token embedding of [`Ends`], built, its head not yet: a model
/// builds its layers between the two, so that the units are in the
/// order they run.
#[derive(Debug)]
pub(crate) enum Embedding {
    Tied(ShardedModule<TiedEmbedding>),
    Apart {
        embed: ShardedModule<TokenEmbedding>,
        vocab: i64,
        width: i64,
    },
}

impl Ends {
    /// The token embedding under `p`, a unit of `plan`
    /// ([`token_embedding`]; the head too when `tied`; the rows of
    /// `lora`'s trainable tokens apart).
    pub(crate) fn embedding(
        plan: &ShardPlan,
        p: &tch::nn::Path,
        (vocab, width): (i64, i64),
        (padding, tied): (Option<i64>, bool),
        lora: Option<&LoraConfig>,
    ) -> Embedding {
        let embed = token_embedding(p, (vocab, width), padding, (lora, ""));
        match tied {
            true => Embedding::Tied(ShardedModule::new(plan, p, TiedEmbedding(embed))),
            false => Embedding::Apart {
                embed: ShardedModule::new(plan, p, embed),
                vocab,
                width,
            },
        }
    }

    /// The token ids' embeddings.
    pub(crate) fn embed(&self, tokens: &Tensor) -> Tensor {
        match self {
            Self::Tied(e) => e.forward(tokens),
            Self::Apart { embed, .. } => embed.forward(tokens),
        }
    }

    /// The hidden states' logits.
    pub(crate) fn head(&self, x: &Tensor) -> Tensor {
        match self {
            Self::Tied(e) => e.forward(x),
            Self::Apart { head, .. } => head.forward(x),
        }
    }

    /// Whether [`Ends::head_loss`] can fuse the head with the loss of
    /// `targets`, `bias` added after the product: the head is a plain
    /// matrix (no LoRA adapter on it, no token's rows trained apart)
    /// with no bias of its own beside `bias`, and every target is -100
    /// or in the vocabulary (else libtorch's loss of the logits says
    /// which is not).
    pub(crate) fn fuses(&self, targets: &Tensor, bias: Option<&Tensor>) -> bool {
        let (vocab, own_bias) = match self {
            Self::Tied(e) if e.inner().0.tokens.is_none() => {
                (e.inner().0.weight().size()[0], false)
            }
            Self::Apart { head, .. } => match head.inner().plain() {
                Some((w, b)) => (w.size()[0], b.is_some()),
                None => return false,
            },
            Self::Tied(_) => return false,
        };
        !(own_bias && bias.is_some()) && targets_fit(targets, vocab)
    }

    /// The cross-entropy of the head's logits of `x` `[rows, width]`
    /// against `targets` `[rows]` (int64, -100: not counted; their mean
    /// or sum), `after`'s steps applied to the product (`bias`: the one
    /// `after` adds, CTRL's tied head's), without holding the logits
    /// whole ([`crate::zero::glue::linear_cross_entropy`]), run as the
    /// head's unit: its output is the loss. Ask [`Ends::fuses`] first:
    /// otherwise it takes the logits whole, as it does should the fused
    /// loss fail anyway.
    pub(crate) fn head_loss(
        &self,
        x: &Tensor,
        (targets, mean): (&Tensor, bool),
        bias: Option<&Tensor>,
        after: LogitsAfter,
    ) -> Tensor {
        // What the unfused head would do, should the fused one fail
        // anyway (out of memory): the unit runs once either way.
        let unfused =
            |logits: Tensor| crate::hf::cross_entropy(&after.apply(logits, bias), targets, mean);
        let loss = |w: &Tensor, b: Option<&Tensor>, logits: &dyn Fn() -> Tensor| {
            linear_cross_entropy(x, w, b, targets, -100, mean, after).unwrap_or_else(|e| {
                tracing::warn!("{e}; the head's logits whole instead");
                unfused(logits())
            })
        };
        match self {
            Self::Tied(e) => e.forward_with(x, |t| loss(&t.head_matrix(), bias, &|| t.forward(x))),
            Self::Apart { head, .. } => head.forward_with(x, |h| match h.plain() {
                Some((w, b)) => loss(w, b.or(bias), &|| h.forward(x)),
                None => unfused(h.forward(x)),
            }),
        }
    }
}

/// Whether a model's loss methods fuse its head with the loss
/// ([`Ends::head_loss`]; on when built), and the targets they give it.
#[derive(Debug)]
pub(crate) struct LossFusing(AtomicBool);

impl Default for LossFusing {
    fn default() -> Self {
        Self(AtomicBool::new(true))
    }
}

impl LossFusing {
    /// Turns it on or off.
    pub(crate) fn set(&self, on: bool) {
        self.0.store(on, Ordering::Relaxed);
    }

    /// The targets of `tokens`' (`[batch, seq]`) predictions, flat:
    /// each position's next token where `counted` (nonzero, by the token
    /// predicted: [`crate::hf::counted_targets`]) marks it, -100
    /// elsewhere and at each row's last position, which predicts none;
    /// and whether to take their mean (`mean`, and some counted: a mean
    /// over nothing is 0, its gradient zeros, the sum's). `None` when
    /// it is off or `counted` is not one value a token.
    pub(crate) fn targets(
        &self,
        tokens: &Tensor,
        (counted, mean): (&Tensor, bool),
    ) -> Option<(Tensor, bool)> {
        let t = tokens.size().last().copied().unwrap_or(0);
        if !self.0.load(Ordering::Relaxed) || t < 1 || counted.size() != tokens.size() {
            return None;
        }
        let next = tokens.narrow(-1, 1, t - 1);
        let next = next.masked_fill(&counted.narrow(-1, 1, t - 1).logical_not(), -100);
        let last = tokens.narrow(-1, 0, 1).full_like(-100);
        let targets = Tensor::cat(&[next, last], -1).reshape([-1]);
        let mean = mean && targets.ne(-100).any().int64_value(&[]) != 0;
        Some((targets, mean))
    }

    /// The causal-LM loss of `tokens`' predictions `counted` marks
    /// ([`LossFusing::targets`]), `ends`' head fused with it
    /// ([`Ends::head_loss`], `bias` and `after` applied to the head's
    /// product) on the hidden states `hidden` computes; `None`, before
    /// `hidden` runs, where it cannot ([`Ends::fuses`]).
    pub(crate) fn head_loss(
        &self,
        ends: &Ends,
        (tokens, counted): (&Tensor, (&Tensor, bool)),
        (bias, after): (Option<&Tensor>, LogitsAfter),
        hidden: impl FnOnce() -> Tensor,
    ) -> Option<Tensor> {
        let (targets, mean) = self.targets(tokens, counted)?;
        if !ends.fuses(&targets, bias) {
            return None;
        }
        let x = hidden();
        let x = x.reshape([-1, x.size().last().copied().unwrap_or(0)]);
        Some(ends.head_loss(&x, (&targets, mean), bias, after))
    }
}

/// Whether `targets` are int64, one dimension, each in `0..vocab` or -100.
fn targets_fit(targets: &Tensor, vocab: i64) -> bool {
    if targets.kind() != tch::Kind::Int64 || targets.dim() != 1 {
        return false;
    }
    let fit = targets
        .ge(0)
        .logical_and(&targets.lt(vocab))
        .logical_or(&targets.eq(-100));
    fit.all().int64_value(&[]) != 0
}

impl Embedding {
    /// The two ends: an untied embedding's head built under `p` (a
    /// linear map, with a bias when `bias`; a LoRA adapter when `lora`
    /// names it, never by `all-linear`, as PEFT's; some tokens' rows
    /// apart when `lora`'s trainable tokens name it), a unit of `plan`.
    pub(crate) fn with_head(
        self,
        plan: &ShardPlan,
        p: &tch::nn::Path,
        bias: bool,
        (lora, training): (Option<&LoraConfig>, &Training),
    ) -> Ends {
        match self {
            Self::Tied(tied) => Ends::Tied(tied),
            Self::Apart {
                embed,
                vocab,
                width,
            } => {
                let name = crate::lora::module_name(p, "");
                let rows = lora.map_or(&[][..], |l| l.trainable_rows(&name, false));
                let lora = lora.filter(|c| c.targets_by_name(&name));
                let head = Head {
                    linear: Adapted::new(p, (width, vocab, bias), lora, training),
                    tokens: TrainableTokens::new(p, (vocab, width), rows),
                };
                let head = ShardedModule::new(plan, p, head);
                Ends::Apart { embed, head }
            }
        }
    }
}

/// What GPT-2, GPT-NeoX and Phi wrap the same way: the two ends, the
/// layers (each a unit of the plan, run plain or checkpointed), a final
/// LayerNorm (the root), and the dropout switch the layers share;
/// forward is embeddings (plus learned positions', GPT-2's), dropout,
/// layers, norm, head.
#[derive(Debug)]
pub(crate) struct Decoder<L: Module + 'static> {
    ends: Ends,
    /// A learned position embedding added to the tokens' (GPT-2's `wpe`;
    /// in the root), or none.
    positions: Option<tch::nn::Embedding>,
    layers: Vec<ShardedModule<Run<L>>>,
    final_norm: tch::nn::LayerNorm,
    training: Training,
    decoding: Arc<Decoding>,
    fusing: LossFusing,
}

impl<L: Module + 'static> Decoder<L> {
    /// The decoder of the final norm and the embedding, built first (the
    /// root's variables before the first unit: a plan releasing the
    /// model as it is built releases what was made before each
    /// `ShardedModule::new`), layer `i` made by `layer` under
    /// `layers / i`, and the head under `head` (with a bias when
    /// `biased`, an adapter when `lora` names it) unless the embedding
    /// is it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn build(
        plan: &ShardPlan,
        final_norm: tch::nn::LayerNorm,
        embedding: Embedding,
        layers: &tch::nn::Path,
        count: i64,
        layer: impl Fn(&tch::nn::Path, &Training, &Arc<Decoding>) -> L,
        checkpointed: bool,
        (head, biased, lora): (&tch::nn::Path, bool, Option<&LoraConfig>),
    ) -> Self {
        let training = Training::default();
        let decoding = Decoding::new();
        let layers = (0..count)
            .map(|i| {
                let lp = layers / i;
                let layer = layer(&lp, &training, &decoding);
                let run = Run::with_state(layer, checkpointed, (&training, &decoding));
                ShardedModule::new(plan, &lp, run)
            })
            .collect();
        Self {
            ends: embedding.with_head(plan, head, biased, (lora, &training)),
            positions: None,
            layers,
            final_norm,
            training,
            decoding,
            fusing: LossFusing::default(),
        }
    }

    /// The decoder with `positions` added to the token embeddings, each
    /// token's row its position (in its document, when packed). Make it
    /// before the first unit, as the final norm (see [`Decoder::build`]).
    pub(crate) fn with_positions(self, positions: tch::nn::Embedding) -> Self {
        Self {
            positions: Some(positions),
            ..self
        }
    }

    /// Its layers' key-value caches (see [`crate::kv_cache`]).
    pub(crate) fn decoding(&self) -> &Decoding {
        &self.decoding
    }

    /// The switch of the layers' dropout.
    pub(crate) fn training(&self) -> &Training {
        &self.training
    }

    /// Logits for token ids, the embeddings dropped out at
    /// `embed_dropout` when training; the tokens packed in `documents`
    /// when given, else one causal sequence a row.
    pub(crate) fn forward(
        &self,
        tokens: &Tensor,
        embed_dropout: f64,
        documents: Option<Documents>,
    ) -> Tensor {
        self.ends
            .head(&self.hidden(tokens, embed_dropout, documents))
    }

    /// What the head reads: all of [`Decoder::forward`] but the head.
    fn hidden(&self, tokens: &Tensor, embed_dropout: f64, documents: Option<Documents>) -> Tensor {
        self.decoding.set_documents(documents);
        let x = self.training.embedding_noise(self.ends.embed(tokens));
        let x = match &self.positions {
            Some(p) => x + p.forward(&self.decoding.positions(tokens)),
            None => x,
        };
        let mut x = self.training.dropout(x, embed_dropout);
        for l in &self.layers {
            x = l.forward(&x);
        }
        self.decoding.advance(tokens);
        self.final_norm.forward(&x)
    }

    /// The causal-LM loss with `labels = tokens`, the head fused with it
    /// ([`Decoder::fused_loss`]) unless turned off, else of
    /// [`Decoder::forward`]'s logits ([`crate::hf::causal_lm_loss`]).
    pub(crate) fn loss(&self, tokens: &Tensor, embed_dropout: f64) -> Tensor {
        let counted = crate::hf::counted_targets(tokens, None, None);
        let lm = self.fused_loss(tokens, (embed_dropout, None), (&counted, true));
        lm.unwrap_or_else(|| {
            let logits = self.forward(tokens, embed_dropout, None);
            crate::hf::causal_lm_loss(&logits, tokens)
        })
    }

    /// Turns the fused head and loss on or off ([`Decoder::fused_loss`]).
    pub(crate) fn set_fused_loss(&self, on: bool) {
        self.fusing.set(on);
    }

    /// The causal-LM loss of `tokens`' predictions `counted` marks (their
    /// mean, or with `mean` false their sum) with the head fused with it
    /// ([`Ends::head_loss`]), as [`Decoder::forward`] runs the rest;
    /// `None`, before anything runs, where it cannot
    /// ([`LossFusing::targets`], [`Ends::fuses`]).
    pub(crate) fn fused_loss(
        &self,
        tokens: &Tensor,
        (embed_dropout, documents): (f64, Option<Documents>),
        counted: (&Tensor, bool),
    ) -> Option<Tensor> {
        let hidden = || self.hidden(tokens, embed_dropout, documents);
        let after = (None, LogitsAfter::default());
        (self.fusing).head_loss(&self.ends, (tokens, counted), after, hidden)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::Mutex;
    use tch::{Device, Kind};

    /// Doubles its input, noting what of its model's state each call saw:
    /// dropout on, and documents given.
    #[derive(Debug)]
    struct Notes {
        training: Training,
        decoding: Arc<Decoding>,
        seen: Arc<Mutex<Vec<(bool, bool)>>>,
    }

    impl Module for Notes {
        fn forward(&self, x: &Tensor) -> Tensor {
            let d = self.decoding.documents().is_some();
            self.seen.lock().push((self.training.on(), d));
            x * 2.0
        }
    }

    #[test]
    fn a_recompute_sees_the_switch_and_documents_its_forward_saw() {
        let (training, decoding) = (Training::default(), Decoding::new());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let notes = Notes {
            training: training.clone(),
            decoding: decoding.clone(),
            seen: seen.clone(),
        };
        let run = Run::with_state(notes, true, (&training, &decoding));
        let tokens = Tensor::zeros([1, 3], (Kind::Int64, Device::Cpu));
        let positions = Tensor::from_slice(&[0i64, 1, 0]).view([1, 3]);
        training.set(true);
        decoding.set_documents(Some(Documents::new(&tokens, &positions).unwrap()));
        let x = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let y = run.forward(&x);
        // An evaluation between forward and backward.
        training.set(false);
        decoding.set_documents(None);
        y.sum(Kind::Float).backward();
        assert_eq!(*seen.lock(), [(true, true), (true, true)]);
        // What the program set is back after the recompute.
        assert!(!training.on() && decoding.documents().is_none());
    }
}
