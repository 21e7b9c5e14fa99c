//! What a forward leaves for its backward: the bytes of the tensors
//! autograd saves, for the layouts whose every saved tensor is counted
//! here (Llama's layer: pre-norm attention through the fused kernel and
//! a gated MLP; Gemma's norms and scaled embeddings, and Gemma 2's and
//! 3's norms of each sublayer's output; Phi-3's fused projections and
//! partly turned heads; OLMo's norms after each sublayer; ungated MLPs
//! and LayerNorms; norms of each head, with weights shared or each
//! head's own; heads turned by neighbouring pairs; plain mixtures of
//! experts, GPT-OSS's clamped ones and Llama 4's scaling their input;
//! Gemma 2's soft-capped attention and GPT-OSS's beside its sinks;
//! DeepSeek's latent attention; Llama 4's chunks, L2-normalised heads
//! and queries grown with their position; Apertus's xIELU; LFM2's short
//! convolutions; OPT's and GPT-BigCode's learned positions, OPT's ReLU;
//! GPT-J's fp32 turn of part of each head; MPT's, BLOOM's and
//! Falcon-RW's ALiBi, one mask of every head's scores; BLOOM's norm of
//! its embeddings), the whole model training or LoRA's adapters on a
//! frozen base; and those adapters' parameters. GPT-2's, GPT-NeoX's and
//! Phi's layers are counted in the same terms ([`gpt2`], [`gpt_neox`],
//! [`phi`]). The models' own dropouts are counted (each keeps its mask;
//! dropping out the attention's weights sends libtorch's CPU attention
//! down its plain path, which keeps fp32 weights for every pair of
//! tokens), but where [`dropouts`] says not.
//! `zrt estimate --seq` prints it; `tests/activation_memory.rs` holds it
//! to what libtorch allocates, to the byte.
//!
//! autograd saves a tensor for the gradient of another input of the same
//! operation: a matrix product keeps its input only if its weight trains,
//! a product of two tensors each for the other's gradient. So what a
//! layer keeps follows from which of its tensors need a gradient
//! ("live" below): with a frozen base, the residual stream before the
//! first adapter needs none, and a frozen norm keeps no normalized
//! values.

pub(crate) mod gpt2;
pub(crate) mod gpt_neox;
pub(crate) mod phi;

use tch::Kind;

use super::config::{Activation, LlamaConfig, Mla, MoeConfig};
use super::family::Family;
use super::mamba::{MambaConfig, MambaGate};
use super::mamba1::{Mamba1Config, StepNorms};
use crate::lora::LoraConfig;
use crate::zero::glue::keeps_logits;

/// The bytes of the generator state each recomputed layer keeps to draw
/// its dropout again (libtorch's CPU generator, serialized).
const RNG_STATE_BYTES: u64 = 5056;

/// The bytes a training forward of `rows` rows of `seq` tokens holds for
/// its backward once the loss is computed: every layer's saved tensors
/// (with `recompute`, each layer's input alone), the final norm's, and
/// the loss's: with `fused_loss` (the loss methods' default,
/// [`crate::hf::HfModel::set_fused_loss`]) the head's input and a few
/// bytes a token, else the logits the loss keeps. `kind` is the compute
/// dtype (the weights' and activations'; norms and the loss compute in
/// fp32, as the families' classes do). With `lora`, its adapters train on a frozen
/// base, as [`crate::lora::freeze_base`] leaves it, its dropout (each
/// adapter's own dropped input and mask) too.
///
/// `None` where the count would be a guess: a family not in
/// [`COUNTED_FAMILIES`], or a layer of one unlike what is counted there
/// (a mixture of experts other than those `Experts::of` counts), whose
/// gates save other tensors;
/// a dropout of the model's that it does not follow (`dropouts`: the
/// weights' of an attention not the fused kernel's; the others are
/// counted, each keeping its mask, and the attention's weights' taking
/// libtorch's plain CPU attention, which keeps fp32 weights for every
/// pair of tokens); and LoRA with DoRA, bias
/// terms, or anything besides the layers' adapters training (the head,
/// token rows, `modules_to_save`, parameters).
/// Gemma 2's soft-capped attention and GPT-OSS's beside its sinks are
/// counted as training computes them, a block of queries at a time and
/// again in backward (`eager_attention`), keeping no scores; where the
/// queries need no gradient they are computed whole, four to eight
/// bytes a score a head.
pub fn held_for_backward(
    c: &LlamaConfig,
    (rows, seq): (u64, u64),
    kind: Kind,
    (recompute, fused_loss): (bool, bool),
    lora: Option<&LoraConfig>,
) -> Option<u64> {
    let experts = countable(c, lora)?;
    let (weights_dropout, output_dropout, mlp_dropout) = dropouts(c)?;
    let b = bytes_of(kind)?;
    let post_norms = c.opt.is_some_and(|o| !o.norm_before) || c.family == Family::OpenAiGpt;
    let w = Widths {
        b,
        h: dims(c.hidden),
        i: dims(c.intermediate),
        q: dims(c.heads * c.head_dim),
        kv: dims(c.kv_heads * c.head_dim),
        d: dims(c.head_dim),
        rd: dims(c.rotary_dim()),
        heads: dims(c.heads),
        kv_heads: dims(c.kv_heads),
        qk_norm: QkNorm::of(c),
        norms: Norms::of(c.family),
        // OLMo 2's, 3's and FlexOlmo's (`olmo()`) norms after each
        // sublayer only. OPT-350m's norms of each residual sum keep as
        // much: the sum where the sublayer's output needs a gradient (the
        // layer's input needing one, its output does).
        sandwich: c.family.olmo()
            || matches!(
                c.family,
                Family::Gemma2 | Family::Gemma3 | Family::Exaone4 | Family::Glm4
            )
            || post_norms,
        pre_norms: !(c.family.olmo() || c.family == Family::Exaone4 || post_norms),
        attention_norm: true,
        // Persimmon's heads interleave their queries, keys and values:
        // each is a copy. DBRX's values are a view too, unless clipped:
        // each clamp makes a tensor of its own, and keeps the fused
        // output as its input (`clipped`).
        // Falcon's one key and value (7B's, 180B's) are views too.
        // GPT-BigCode's one key head's queries, keys and values are
        // views as well, but none turns: the fused output is kept once,
        // as the three tensors it holds.
        views: (matches!(c.family, Family::Phi3 | Family::Dbrx) && c.clip_qkv.is_none())
            || (c.family == Family::Falcon && c.kv_heads == 1),
        gated: gated(c),
        xielu: c.activation == Activation::Xielu,
        relu: c.activation == Activation::Relu,
        sub_norms: c.family == Family::Bitnet,
        differential: c.family == Family::DiffLlama,
        mlp: !c.family.mamba_only(),
        rows,
        seq,
        fp32_rope: c.family.olmo()
            || matches!(
                c.family,
                Family::Olmo1
                    | Family::Cohere
                    | Family::Cohere2
                    | Family::DeepseekV2
                    | Family::Llama4
            )
            || c.family.ernie()
            || c.family.gptj(),
        l2_norm: c.llama4.as_ref().is_some_and(|a| a.qk_l2_norm),
        temperature: c.llama4.as_ref().is_some_and(|a| a.temperature.is_some()),
        clipped: c.clip_qkv.is_some(),
        parallel: c.parallel || c.falcon.as_ref().is_some_and(|f| f.parallel),
        two_norms: c.falcon.as_ref().is_some_and(|f| f.parallel && f.two_norms),
        sum_dropped: c.falcon.as_ref().is_some_and(|f| f.parallel),
        scaled_gate: c.falcon_h1.is_some(),
        eager: (c.attn_softcap.is_some() || matches!(c.family, Family::GptOss | Family::Doge))
            .then_some(Eager {
                rows,
                seq,
                capped: c.attn_softcap.is_some(),
                sinks: c.family == Family::GptOss,
                dynamic: c.family == Family::Doge,
            }),
        latent: c.mla.as_ref().map(Latent::of),
        dropout: lora.is_some_and(|l| l.dropout > 0.0),
        attention_dropout: weights_dropout.then_some(seq),
        resid_dropout: (output_dropout, mlp_dropout),
    };
    let tokens = rows * seq;
    let full = lora.is_none();
    // The embedding's output needs a gradient when the embedding trains:
    // its dropout keeps its mask then.
    // OPT-350m's projections in and out of the layers' width: an adapter
    // on the first makes every layer's input need a gradient.
    let (project_in, project_out) = lora.map_or((0, 0), |l| projection_ranks(c, l));
    let mut live = full || project_in > 0;
    let mut held = (full && c.embedding_dropout > 0.0) as u64 * tokens * b * w.h;
    // Learned positions (OPT's, BioGPT's, GPT-BigCode's, GPT-Neo's): the
    // lookup keeps them, int64, where they train.
    held += (full && c.family.learned_positions()) as u64 * 8 * seq;
    // BLOOM's and ModernBERT-decoder's LayerNorm of the embeddings,
    // where they train.
    if matches!(c.family, Family::Bloom | Family::ModernBertDecoder) {
        held += tokens * w.norm(full, full) + w.norm_weights(full);
    }
    let mut mask = 0;
    let mut chunks = 0;
    let mut alibi = 0;
    // Whether a layer's routing probabilities need a gradient, which the
    // load-balancing loss then carries to them.
    let mut balanced = false;
    for layer in 0..c.layers.max(0) {
        let ranks = match lora {
            Some(l) => Ranks::of(l, layer, c),
            None => Ranks::default(),
        };
        let trains = full || ranks.any();
        let mixture = experts.as_ref().filter(|_| c.moe_layer(layer));
        // Layers without rotary embeddings (SmolLM3's and Llama 4's
        // some, OPT's all) keep no cos and sin.
        let turns = c.turns(layer);
        // LFM2's convolution layers in place of attention, the Mambas'
        // scans; a Mamba-2 layer `Ssd::of` does not count leaves the
        // model uncounted.
        let mixer = match (c.short_conv_layer(layer), c.mamba1_layer(layer)) {
            (Some(s), _) => Some(Mixer::ShortConv(dims(s.kernel))),
            (None, Some(m)) => Some(Mixer::Scan(Scan::of(m, c.hidden))),
            (None, None) => match (c.mamba_layer(layer), &c.mamba) {
                (Some(m), _) => Some(Mixer::Ssd(Ssd::of(m, c.hidden, seq, false)?)),
                (None, Some(m)) if c.falcon_h1.is_some() => {
                    Some(Mixer::Beside(Ssd::of(m, c.hidden, seq, true)?))
                }
                _ => None,
            },
        };
        // Doge's attention without a gradient for its queries computes
        // its scores whole, its dynamic mask with them: not counted.
        let q_live = live || full || ranks.q > 0;
        if c.family == Family::Doge && !q_live && ranks.k + ranks.v + ranks.dt > 0 {
            return None;
        }
        // ModernBERT-decoder's first layer attends to its input as it
        // is, without a norm.
        let first_bare = c.family == Family::ModernBertDecoder && layer == 0;
        let (per_token, per_position, per_forward, out_live) = Widths {
            attention_norm: !first_bare,
            ..w
        }
        .layer((live, full), &ranks, mixture, (turns, mixer));
        // A window shorter than the row is a mask of a row's scores in
        // the compute dtype, one for every layer of the forward (the
        // soft-capped scores' is each layer's own, counted with them),
        // which the layers' cache holds until the next forward whether
        // or not a gradient flows through them (ModernBERT-decoder's
        // adapter before its head alone).
        let windowed =
            w.eager.is_none() && c.window(layer).is_some_and(|w| (w.max(0) as u64) < seq);
        if windowed && !recompute {
            mask = seq * seq * b;
        }
        // Llama 4's chunks, shorter than the row: one mask too, its
        // chunked layers', held by the cache as the window's is.
        let chunked = (c.llama4.as_ref())
            .filter(|a| a.chunked.get(layer as usize) == Some(&true))
            .and_then(|a| a.chunk)
            .is_some_and(|size| (size.max(0) as u64) < seq);
        if chunked && !recompute {
            chunks = seq * seq * b;
        }
        // ALiBi's biases: one mask of every head's scores, in the compute
        // dtype, that the layers of the forward share (held as the
        // window's is).
        if c.alibi() && !recompute {
            alibi = dims(c.heads) * seq * seq * b;
        }
        held += w.layer_held(recompute, (live, trains), tokens, || {
            tokens * per_token + seq * per_position + per_forward
        });
        // (Adapters on the experts are not counted: a layer of them
        // whose output needs a gradient routes with one.)
        balanced |= mixture.is_some() && out_live;
        live = out_live;
    }
    // Gemma's embeddings are scaled by a one-value tensor of their
    // dtype, which the product keeps when the embeddings train.
    let scale = (full && w.norms == Norms::Offset) as u64 * b;
    let vocab = (dims(c.vocab), c.final_softcap.is_some());
    // OPT-350m's head reads the embeddings' narrower width, which
    // `project_out` (no bias) takes the layers' output to; it and
    // `project_in` keep their inputs where they train.
    let head = Widths {
        h: dims(c.embedding_width()),
        ..w
    };
    // OPT-350m's projections in and out keep their inputs where they
    // train or an adapter reads them (the embeddings', the last layer's
    // output), their adapters their own.
    let projected = |width: u64, rank: u64, input_live: bool| {
        w.shares(full, &[rank]) as u64 * b * width
            + b * rank
            + w.dropped(width, &[rank], input_live)
    };
    let projections = match c.projected() {
        true => tokens * (projected(head.h, project_in, full) + projected(w.h, project_out, live)),
        false => 0,
    };
    let kept = logits_kept((rows, seq), &head, vocab, (fused_loss, full));
    // ModernBERT-decoder's transform before its head (`lm_head.dense`,
    // the MLP's activation, a LayerNorm): the dense layer keeps its input
    // where it trains or an adapter reads it, the activation its input
    // and the norm its own where a gradient flows through them. An
    // adapter there alone makes the logits need a gradient.
    let transform = match c.family == Family::ModernBertDecoder {
        true => {
            let r = lora.map_or(0, head_transform_rank);
            let (input_live, out_live) = (live || full, live || full || r > 0);
            let dense = w.shares(full, &[r]) as u64 * b * w.h + b * r;
            let dense = dense + w.dropped(w.h, &[r], input_live);
            let act = out_live as u64 * b * w.h;
            tokens * (dense + act + w.norm(out_live, full))
                + (out_live && !input_live) as u64 * kept
        }
        false => 0,
    };
    let ends = (c.final_norm().then_some(&w), &head);
    let head = kept_for_head(ends, tokens, (live, full), (fused_loss, kept));
    // An adapter on OPT-350m's projection out, where nothing before it
    // needs a gradient, makes the logits need one.
    let head = head + (project_out > 0 && !(live || full)) as u64 * kept;
    // The load-balancing loss's seed (f64) and, where a layer's routing
    // needs a gradient, the loss's gradient in the summed probabilities
    // (fp32), once a forward; recomputed layers hold the forward's whole
    // tally for their replays, its counts and sums (f64) too.
    let balance = match experts.filter(|e| e.balance) {
        Some(e) if recompute => 20 * e.count + 8,
        Some(e) => balanced as u64 * 4 * e.count + 8,
        None => 0,
    };
    Some(held + mask + chunks + alibi + scale + projections + transform + head + balance)
}

/// A model of layers alike, each over the whole row (GPT-2's, GPT-NeoX's,
/// Phi's), as its module describes it to the count.
struct Alike {
    /// PEFT's names of its head and of its embedding.
    ends: (&'static str, &'static str),
    layers: i64,
    vocab: u64,
    /// Its layer's widths; the count sets the dtype's bytes, the rows,
    /// the attention's dropout and LoRA's.
    widths: Widths,
    /// The ranks of LoRA's adapters on a layer.
    ranks: fn(&LoraConfig, i64) -> Ranks,
    /// Its attention's weights dropped out (libtorch's plain CPU
    /// attention, [`Widths::attention`]).
    attention_dropout: bool,
    /// The embeddings dropped out: their mask is kept where they train.
    embed_dropout: bool,
    /// Learned positions looked up (GPT-2's): the lookup keeps them,
    /// int64, where they train.
    positions: bool,
}

impl Alike {
    /// [`held_for_backward`] for this model.
    fn held_for_backward(
        &self,
        (rows, seq): (u64, u64),
        kind: Kind,
        (recompute, fused_loss): (bool, bool),
        lora: Option<&LoraConfig>,
    ) -> Option<u64> {
        if lora.is_some_and(|l| !adapters_alone(l, self.ends)) {
            return None;
        }
        let w = Widths {
            b: bytes_of(kind)?,
            rows,
            seq,
            attention_dropout: self.attention_dropout.then_some(seq),
            dropout: lora.is_some_and(|l| l.dropout > 0.0),
            ..self.widths
        };
        let tokens = rows * seq;
        let full = lora.is_none();
        // The embeddings need a gradient where they train: their
        // dropout keeps its mask then.
        let mut live = full;
        let embedded =
            (self.embed_dropout as u64 * tokens * w.b * w.h) + self.positions as u64 * 8 * seq;
        let mut held = full as u64 * embedded;
        for layer in 0..self.layers.max(0) {
            let ranks = lora.map_or_else(Ranks::default, |l| (self.ranks)(l, layer));
            let trains = full || ranks.any();
            let (per_token, per_position, per_forward, out_live) =
                w.layer((live, full), &ranks, None, (true, None));
            held += w.layer_held(recompute, (live, trains), tokens, || {
                tokens * per_token + seq * per_position + per_forward
            });
            live = out_live;
        }
        let kept = logits_kept((rows, seq), &w, (self.vocab, false), (fused_loss, full));
        let ends = (Some(&w), &w);
        Some(held + kept_for_head(ends, tokens, (live, full), (fused_loss, kept)))
    }

    /// [`adapter_params`] for this model.
    fn adapter_params(&self, lora: &LoraConfig) -> Option<u64> {
        if !adapters_alone(lora, self.ends) {
            return None;
        }
        let Widths { h, i, q, kv, .. } = self.widths;
        let per_layer = |r: &Ranks| {
            r.q * (h + q)
                + (r.k + r.v) * (h + kv)
                + r.qkv * (h + q + 2 * kv)
                + r.o * (q + h)
                + (r.up + r.down) * (h + i)
        };
        Some(
            (0..self.layers.max(0))
                .map(|l| per_layer(&(self.ranks)(lora, l)))
                .sum(),
        )
    }
}

/// Where in [`Ranks`] a module's rank goes.
type Slot = fn(&mut Ranks) -> &mut u64;

/// The ranks of `l`'s adapters on the modules `names` (in `prefix`,
/// the layer's name and a dot before each) with each's slot in
/// [`Ranks`]: 0 where it targets none.
fn ranks_of(l: &LoraConfig, prefix: &str, names: &[(&str, Slot)]) -> Ranks {
    let mut r = Ranks::default();
    for (module, slot) in names {
        *slot(&mut r) = rank_at(l, &format!("{prefix}{module}"));
    }
    r
}

/// The ranks of `l`'s adapters on OPT-350m's projections in and out of
/// the layers' width (`project_in`, `project_out`), 0 where it has none.
fn projection_ranks(c: &LlamaConfig, l: &LoraConfig) -> (u64, u64) {
    let [model, ..] = c.family.names();
    match c.projected() {
        true => (
            rank_at(l, &format!("{model}.project_in")),
            rank_at(l, &format!("{model}.project_out")),
        ),
        false => (0, 0),
    }
}

/// The rank of `l`'s adapter on the module `name`, 0 where it targets
/// none.
fn rank_at(l: &LoraConfig, name: &str) -> u64 {
    match l.targets(name) {
        true => l.rank_of(name).max(0) as u64,
        false => 0,
    }
}

/// Which of `c`'s own dropouts are on: of the attention's weights, of
/// its output and of the MLP's output (the embeddings' is read apart);
/// `None` where one is on that this count does not follow: the
/// weights' where the attention is not the fused kernel's
/// (soft-capped, beside sinks, latent or in chunks). Falcon's parallel
/// layers drop out their two outputs' sum (`Widths::sum_dropped`).
/// ALiBi's attention dropped out takes libtorch's plain path as any
/// other, its float mask the one a forward holds.
fn dropouts(c: &LlamaConfig) -> Option<(bool, bool, bool)> {
    let on = (
        c.attention_weights_dropout() > 0.0,
        c.attention_output_dropout() > 0.0,
        c.resid_dropout > 0.0,
    );
    let plain_attention = c.attn_softcap.is_none()
        && c.family != Family::GptOss
        && c.mla.is_none()
        && c.llama4.as_ref().is_none_or(|a| a.chunk.is_none());
    match on.0 && !plain_attention {
        true => None,
        false => Some(on),
    }
}

/// The bytes of a value of the compute dtype `kind`; `None` for a dtype
/// no model computes in.
fn bytes_of(kind: Kind) -> Option<u64> {
    match kind {
        Kind::Float => Some(4),
        Kind::BFloat16 | Kind::Half => Some(2),
        _ => None,
    }
}

/// What the layers leave after them for `tokens` tokens: the final
/// norm's (`norm`, the layers' widths, where there is one), the head's
/// input (`head`'s width) and the loss's (`kept`: what the loss keeps,
/// [`logits_kept`]), given whether the last layer's output needs a
/// gradient (`live`) and the whole model trains (`full`).
fn kept_for_head(
    (norm, head): (Option<&Widths>, &Widths),
    tokens: u64,
    (live, full): (bool, bool),
    (fused_loss, kept): (bool, u64),
) -> u64 {
    let logits_live = live || full;
    let norm = norm.map_or(0, |n| tokens * n.norm(live, full) + n.norm_weights(live));
    // The head's input, when the unfused head trains (the fused loss's
    // is among what it keeps).
    let input = (full && !fused_loss) as u64 * head.b * head.h;
    tokens * input + norm + kept * logits_live as u64
}

/// What the loss keeps of `rows` rows of `seq` tokens' logits of a
/// `vocab` in `b` bytes a value. Unfused, with its count and scalar: the
/// logits in the compute dtype (`glue::cross_entropy`: of one row a view
/// of all of them, of more a copy of every position but each row's
/// last), with more than one row the targets gathered into one int64
/// vector, and, when `capped`, Gemma 2's soft cap's tanh, every
/// position's.
///
/// With `fused_loss`, what `glue::linear_cross_entropy` keeps of every
/// position's that needs a gradient (its matrix trained when `full`):
/// when one block holds every logit (`glue::keeps_logits`) the head's
/// input, one int64 target each, every fp32 log-probability and the soft
/// cap's tanh, and the count and the loss; in blocks, the same with one
/// fp32 log-sum-exp each for the logits, or with the matrix frozen the
/// head's input's gradient in fp32, which forward computed, and the loss
/// alone.
fn logits_kept(
    (rows, seq): (u64, u64),
    w: &Widths,
    (vocab, capped): (u64, bool),
    (fused_loss, full): (bool, bool),
) -> u64 {
    let (tokens, b) = (rows * seq, w.b);
    let capped = capped as u64 * tokens * b * vocab;
    if fused_loss {
        return match (keeps_logits(tokens, vocab), full) {
            (true, _) => tokens * (b * w.h + 8 + 4 * vocab) + capped + 8,
            (false, true) => tokens * (b * w.h + 8 + 4) + 8,
            (false, false) => tokens * 4 * w.h + 4,
        };
    }
    let predicted = rows * seq.saturating_sub(1);
    let (kept, targets) = match rows > 1 {
        true => (predicted, 8 * predicted),
        false => (tokens, 0),
    };
    kept * b * vocab + 8 + targets + capped
}

/// The parameters `lora`'s adapters on the model `c` hold (`r` x (in +
/// out) each), for the layers [`held_for_backward`] counts; `None` for
/// the others, or where more than the layers' adapters trains.
pub fn adapter_params(c: &LlamaConfig, lora: &LoraConfig) -> Option<u64> {
    countable(c, Some(lora))?;
    let (h, i) = (dims(c.hidden), dims(c.intermediate));
    let (mut q, kv) = (dims(c.heads * c.head_dim), dims(c.kv_heads * c.head_dim));
    // The output projection reads each head's values.
    let mut o = q;
    let heads = dims(c.heads);
    let latent = c.mla.as_ref().map(Latent::of);
    if let Some(m) = latent {
        (q, o) = (heads * (m.nope + m.rope), heads * m.v);
    }
    // DeepSeek-V3's latent attention: its bottlenecks' projections.
    let bottlenecks = |r: &Ranks| {
        latent.map_or(0, |m| {
            let q_rank = m.q_rank.unwrap_or(0);
            r.q_a * (h + q_rank)
                + r.q_b * (q_rank + q)
                + r.kv_a * (h + m.kv_rank + m.rope)
                + r.kv_b * (m.kv_rank + heads * (m.nope + m.v))
        })
    };
    // LFM2's convolution layers: `in_proj` makes three widths of the
    // input, `out_proj` reads one. The Mamba scan's: `in_proj` makes
    // the channels and their gate, `x_proj` each token's step, `B` and
    // `C` from the channels, `dt_proj` the channels' steps, `out_proj`
    // reads the channels.
    let per_layer = |l: i64| {
        let r = &Ranks::of(lora, l, c);
        // (`more`: the first Mamba's step projections, Falcon-H1's
        // Mamba's `out_proj`.)
        let (o, conv_in, more) = match (c.short_conv_layer(l), c.mamba1_layer(l)) {
            (Some(_), _) => (h, 3 * h, 0),
            (None, Some(m)) => {
                let s = Scan::of(m, c.hidden);
                let select = r.select * (s.inner + s.rank + 2 * s.state);
                (s.inner, 2 * s.inner, select + r.dt * (s.rank + s.inner))
            }
            // Mamba-2's `in_proj` makes the gate, the channels, `B`, `C`
            // and each head's step.
            (None, None) => match (c.mamba_layer(l), &c.mamba) {
                (Some(m), _) => (dims(m.inner(c.hidden)), dims(m.projected(c.hidden)), 0),
                // Falcon-H1's beside the attention: its `out_proj` reads
                // the channels.
                (None, Some(m)) if c.falcon_h1.is_some() => {
                    let inner = dims(m.inner(c.hidden));
                    let out = r.out * (inner + h);
                    (o, dims(m.projected(c.hidden)), out)
                }
                _ => (o, 0, r.dt * (kv + dims(c.kv_heads))),
            },
        };
        bottlenecks(r)
            + r.conv_in * (h + conv_in)
            + r.q * (h + q)
            + (r.k + r.v) * (h + kv)
            + r.qkv * (h + q + 2 * kv)
            + r.o * (o + h)
            + (r.gate + r.up) * (h + i)
            + r.gate_up * (h + 2 * i)
            + r.down * (i + h)
            + more
    };
    // ModernBERT-decoder's dense layer before its head.
    let transform = match c.family == Family::ModernBertDecoder {
        true => head_transform_rank(lora) * 2 * h,
        false => 0,
    };
    // OPT-350m's projections between the embeddings' width and the
    // layers'.
    let (project_in, project_out) = projection_ranks(c, lora);
    let projections = (project_in + project_out) * (dims(c.embedding_width()) + h);
    Some((0..c.layers.max(0)).map(per_layer).sum::<u64>() + transform + projections)
}

/// The families whose layers [`held_for_backward`] and
/// [`adapter_params`] count (`counted`'s), and GPT-2, GPT-NeoX and Phi,
/// whose [`crate::gpt2::held_for_backward`],
/// [`crate::gpt_neox::held_for_backward`] and
/// [`crate::phi::held_for_backward`] count, as messages name them.
pub const COUNTED_FAMILIES: &str =
    "GPT-2, GPT-NeoX (Pythia), Phi (phi-1, 1.5 and 2), Llama, Mistral, Ministral, Qwen2, Qwen3, Granite, Seed-OSS, Arcee, StarCoder2, Nemotron, ERNIE 4.5 (dense and MoE), Helium, GLM, GLM-4, Hunyuan, Cohere 1 and 2, StableLM, Persimmon, Gemma 1-3, VaultGemma, Phi-3, SmolLM3, OLMo 1-3, EXAONE 4, Mixtral, PhiMoE (Phi-3.5-MoE), Aria (its language model), Qwen2-MoE, Qwen3-MoE, OLMoE, FlexOlmo, Granite-MoE (shared too), Hunyuan-MoE, GLM-4-MoE, dots.llm1, DeepSeek-V2 and V3, Llama 4, Apertus, LFM2, DBRX, Falcon (Falcon-RW too), OPT (350m too), BioGPT, XGLM, GPT-BigCode, GPT-J, CodeGen, GPT-Neo, MPT, BLOOM, OpenAI GPT, CTRL, GPT-NeoX-Japanese, ModernBERT-decoder, BitNet (trained unrounded), DiffLlama, Doge, Mamba, Falcon-Mamba, Jamba, Mamba-2, Bamba, Granite 4.0, Falcon-H1 (their rows longer than a chunk) and GPT-OSS";

/// The rank of `l`'s adapter on ModernBERT-decoder's dense layer before
/// its head, by its checkpoint name under the model's transform
/// (`lm_head.dense`: `all-linear` adapts it, the head being `decoder`).
fn head_transform_rank(l: &LoraConfig) -> u64 {
    rank_at(l, &format!("{}.dense", super::HEAD_TRANSFORM))
}

/// A dimension of a config, 0 where it is negative.
fn dims(x: i64) -> u64 {
    x.max(0) as u64
}

/// Whether `c`'s queries, keys and values are one projection (Phi-3's
/// `qkv_proj`, Persimmon's `query_key_value`, DBRX's `Wqkv`), and
/// whether gate and up are one (Phi-3's and GLM's `gate_up_proj`).
fn fused(c: &LlamaConfig) -> (bool, bool) {
    match c.family {
        Family::Phi3 => (true, true),
        Family::Persimmon
        | Family::Dbrx
        | Family::Falcon
        | Family::GptBigCode
        | Family::CodeGen
        | Family::Mpt
        | Family::Bloom
        | Family::OpenAiGpt
        | Family::GptNeoxJapanese => (true, false),
        f if f.glm() || f == Family::ModernBertDecoder => (false, true),
        _ => (false, false),
    }
}

/// Whether `c`'s MLP is gated (`down(act(gate(x)) * up(x))`): all but
/// Arcee's, Nemotron's and Persimmon's `down(relu2(up(x)))`,
/// StarCoder2's `c_proj(gelu(c_fc(x)))` and Apertus's
/// `down(xielu(up(x)))`, Falcon's and those of GPT-2's era
/// ([`gpt_era`]).
fn gated(c: &LlamaConfig) -> bool {
    !(gpt_era(c.family)
        || matches!(
            c.family,
            Family::Arcee
                | Family::Starcoder2
                | Family::Nemotron
                | Family::Persimmon
                | Family::Apertus
                | Family::Falcon
        ))
}

/// The families of GPT-2's era built as Llama-family models: LayerNorms
/// and an ungated MLP (OPT's and its kin BioGPT's and XGLM's, GPT-J's
/// and CodeGen's, GPT-BigCode's, GPT-Neo's, MPT's, BLOOM's, OpenAI
/// GPT's, CTRL's and GPT-NeoX-Japanese's).
fn gpt_era(family: Family) -> bool {
    matches!(
        family,
        Family::Opt
            | Family::BioGpt
            | Family::Xglm
            | Family::GptBigCode
            | Family::GptJ
            | Family::CodeGen
            | Family::GptNeo
            | Family::Mpt
            | Family::Bloom
            | Family::OpenAiGpt
            | Family::Ctrl
            | Family::GptNeoxJapanese
    )
}

/// What both counts ask first: `c`'s layer is counted, only the
/// layers' adapters train under `lora`, and a mixture of experts is a
/// plain one with no adapter on it. `None` where they do not count;
/// else the mixture, if the model has one.
fn countable(c: &LlamaConfig, lora: Option<&LoraConfig>) -> Option<Option<Experts>> {
    let [model, embedding, ..] = c.family.names();
    let ends = (c.family.head_name(), &*format!("{model}.{embedding}"));
    if !counted(c) || lora.is_some_and(|l| !adapters_alone(l, ends)) {
        return None;
    }
    let Some(m) = &c.moe else {
        return Some(None);
    };
    let experts = Experts::of(c, m)?;
    let on_experts = |l: &LoraConfig| {
        (0..c.layers).any(|layer| c.moe_layer(layer) && adapts_experts(c, m, l, layer))
    };
    match lora.is_some_and(on_experts) {
        true => None,
        false => Some(Some(experts)),
    }
}

/// Whether `c`'s layer is one this module counts ([`COUNTED_FAMILIES`]):
/// the families' own, with their queries' and keys' norms where Qwen3's,
/// Gemma 3's, Qwen3-MoE's, OLMo 2's and 3's, EXAONE 4's and Hunyuan's
/// have them, and without where the others may; DeepSeek's latent
/// attention.
fn counted(c: &LlamaConfig) -> bool {
    match c.family {
        Family::Llama
        | Family::Mistral
        | Family::Ministral
        | Family::SeedOss
        | Family::Arcee
        | Family::Starcoder2
        | Family::Nemotron
        | Family::Ernie4_5
        | Family::Helium
        | Family::Glm
        | Family::Glm4
        | Family::Olmo1
        | Family::Cohere2
        | Family::Qwen2
        | Family::Granite
        | Family::Gemma
        | Family::Gemma2
        | Family::VaultGemma
        | Family::Phi3
        | Family::SmolLm3
        | Family::Mixtral
        | Family::Qwen2Moe
        | Family::GraniteMoe
        | Family::GraniteMoeShared
        | Family::Ernie4_5Moe
        | Family::Dbrx
        | Family::GptOss => !c.qk_norm,
        // OPT's every layout (OPT-350m's norms of each residual sum and
        // its projected embeddings too), BioGPT's learned positions and
        // XGLM's sinusoids.
        Family::Opt | Family::BioGpt | Family::Xglm => true,
        // OpenAI GPT's norms of each residual sum, without a final norm.
        Family::OpenAiGpt => true,
        // GPT-BigCode's (SantaCoder's, StarCoder's): learned positions,
        // one fused projection, one key head or one a head.
        Family::GptBigCode => true,
        // GPT-J's attention and MLP side by side after one LayerNorm,
        // neighbouring pairs of part of each head turned (CodeGen's
        // from one projection).
        Family::GptJ | Family::CodeGen => true,
        // GPT-Neo's learned positions, unscaled scores, local layers in a
        // window.
        Family::GptNeo => true,
        // MPT's, BLOOM's and Falcon-RW's ALiBi, its biases one mask of
        // every head's scores.
        Family::Mpt | Family::Bloom | Family::Falcon => true,
        Family::Qwen3
        | Family::Gemma3
        | Family::Qwen3Moe
        | Family::Olmo2
        | Family::Olmo3
        | Family::Olmoe
        | Family::FlexOlmo
        | Family::Exaone4
        | Family::HunyuanDense
        | Family::HunyuanMoe
        | Family::Dots1
        | Family::Apertus
        | Family::Lfm2 => c.qk_norm,
        // GLM-4-MoE's norms of each head's queries and keys, or none.
        Family::Glm4Moe => true,
        // DeepSeek-V3's latent attention, whose values are no wider than
        // its queries and keys (wider, they take libtorch's attention
        // that keeps every score, not counted).
        Family::DeepseekV3 | Family::DeepseekV2 => {
            (c.mla.as_ref()).is_some_and(|m| m.v <= m.nope + m.rope)
        }
        // Command R+'s and StableLM 2 12B's norms of each head,
        // Persimmon's LayerNorms of each head; Llama 4's L2 norms,
        // chunks and queries grown with their position.
        Family::Cohere | Family::StableLm | Family::Persimmon | Family::Llama4 => true,
        // BitNet's norms of the attention's output and of the MLP's
        // product, where it trains unrounded (its ternary layers round
        // weights and inputs, kept otherwise).
        Family::Bitnet => !c.ternary,
        // DiffLlama's heads in pairs over values twice as wide.
        Family::DiffLlama => true,
        // CTRL's and GPT-NeoX-Japanese's LayerNorms and ungated MLPs.
        Family::Ctrl | Family::GptNeoxJapanese => true,
        Family::ModernBertDecoder => true,
        // Doge's dynamic mask, its attention in blocks of queries.
        Family::Doge => true,
        // The first Mamba's layers, a norm and the scan; Jamba's beside
        // its attention, each with an MLP or experts.
        Family::Mamba | Family::FalconMamba | Family::Jamba => true,
        // Mamba-2's chunked scan, its output normalised after the gate,
        // alone, beside Bamba's attention and MLPs, and beside Granite
        // 4.0's attention and its shared MLP, with experts or without.
        Family::Mamba2 | Family::Bamba | Family::GraniteMoeHybrid => true,
        // PhiMoE's Mixtral layers with LayerNorms, their experts chosen
        // by sparsemixer.
        Family::Phimoe => true,
        // Falcon-H1's attention beside that scan, its gate grouped or
        // plain, its multipliers.
        Family::FalconH1 => true,
        // Aria's stacked experts beside its shared MLP, chosen by a
        // softmax of the top `k` logits.
        Family::AriaText => true,
        _ => false,
    }
}

/// Whether only the layers' adapters train under `l`, with nothing that
/// saves more than this module counts.
fn adapters_alone(l: &LoraConfig, (head, embedding): (&str, &str)) -> bool {
    !l.use_dora
        && !l.train_biases
        && !l.lora_bias
        && l.modules_to_save.is_empty()
        && l.trainable_token_indices.is_empty()
        && l.trainable_tokens_modules.is_empty()
        && l.target_parameters.is_empty()
        && !l.targets_by_name(head)
        && !l.targets_by_name(embedding)
}

/// A layer's mixture of experts (Mixtral's, Qwen3-MoE's, OLMoE's,
/// FlexOlmo's, Granite-MoE's, DBRX's, GPT-OSS's, ERNIE 4.5's, Hunyuan's,
/// GLM-4-MoE's, dots.llm1's and DeepSeek-V2's and V3's; Qwen2-MoE's
/// beside its gated shared expert, Llama 4's beside an ungated one,
/// Granite-MoE-shared's and Granite 4.0's beside a shared MLP whose gate
/// and up are one matrix, Aria's beside a shared MLP; Jamba's and
/// PhiMoE's): each token's top `k` of `count` experts by the router's
/// scores (renormalised when `normalize`), each expert a gated MLP
/// `width` wide run on the tokens that chose it.
struct Experts {
    count: u64,
    k: u64,
    width: u64,
    normalize: bool,
    /// A shared expert: a gated MLP this wide every token goes through,
    /// its output weighed by a sigmoid of one row where `true`
    /// (Qwen2-MoE's; ERNIE 4.5's and Hunyuan's are added as they are).
    shared: Option<(u64, bool)>,
    /// DeepSeek-V3's routing (GLM-4-MoE's, dots.llm1's, DeepSeek-V2's):
    /// its logits in fp32 from the input and the router's weight cast to
    /// fp32, each expert scored by a sigmoid (or a softmax), the choice
    /// within the best groups (or of every expert), the weights in fp32.
    grouped: bool,
    /// Llama 4's router: the top `k` logits, each weighted by its
    /// sigmoid in fp32, scaling the expert's input, not its output.
    sigmoid: bool,
    /// PhiMoE's sparsemixer: its two experts chosen one after the other,
    /// each weighted by a softmax over the experts still in play, with a
    /// gradient of its own to the logits ([`crate::llama`]'s
    /// `sparse_mixer`).
    sparse: bool,
    /// The mixture's input times a uniform draw for each element in
    /// training (Mixtral's and DBRX's router jitter, PhiMoE's input
    /// jitter).
    jitter: bool,
    /// The router's load-balancing loss (`output_router_logits`,
    /// `llama::balance`).
    balance: bool,
    /// GPT-OSS's balance: over a softmax of its top `k` weights
    /// scattered among zeros.
    scattered: bool,
    /// Aria's router: the top `k` logits (in fp32), weighted by a
    /// softmax over them alone.
    top_softmax: bool,
}

impl Experts {
    /// `m`'s experts, where this module counts them: a plain softmax
    /// router (ERNIE 4.5's corrected choice too), Llama 4's sigmoid of
    /// the top `k`, or the grouped one of GLM-4-MoE, dots.llm1 and
    /// DeepSeek-V2 and V3, no shared expert but Qwen2-MoE's, ERNIE 4.5's,
    /// Hunyuan's, Llama 4's, Granite-MoE-shared's and the grouped ones',
    /// PhiMoE's sparsemixer, Aria's softmax of the top `k`, with their
    /// inputs' jitter or without, with the load-balancing loss or
    /// without; no zero experts.
    fn of(c: &LlamaConfig, m: &MoeConfig) -> Option<Self> {
        let routed = matches!(
            c.family,
            Family::Mixtral
                | Family::Qwen3Moe
                | Family::GptOss
                | Family::Olmoe
                | Family::FlexOlmo
                | Family::GraniteMoe
                | Family::Dbrx
                | Family::Jamba
        ) && m.shared.is_none();
        // ERNIE 4.5's router chooses by its scores and a fixed
        // correction, and keeps what a plain one does: the choices, as
        // the index its scores are gathered by.
        let plain = (routed
            || matches!(
                c.family,
                Family::Qwen2Moe
                    | Family::Ernie4_5Moe
                    | Family::HunyuanMoe
                    | Family::Llama4
                    | Family::GraniteMoeShared
                    | Family::GraniteMoeHybrid
                    | Family::AriaText
            ))
            && m.grouped.is_none();
        let grouped = matches!(
            c.family,
            Family::Glm4Moe | Family::Dots1 | Family::DeepseekV3 | Family::DeepseekV2
        ) && m.grouped.is_some();
        // PhiMoE's sparsemixer draws its choices, and keeps what a
        // plain router's choices and weights keep, its own beside.
        let sparse = c.family == Family::Phimoe && m.sparse_mixer.is_some();
        let counted =
            (plain || grouped || sparse) && (m.sparse_mixer.is_none() || sparse) && m.zero == 0;
        let top_softmax = c.family == Family::AriaText;
        counted.then(|| Self {
            count: dims(m.experts),
            k: dims(m.top_k),
            width: dims(m.intermediate),
            // (Aria's softmax of the top k sums to one by itself.)
            normalize: m.normalize && !top_softmax,
            shared: m.shared.map(|w| (dims(w), c.family == Family::Qwen2Moe)),
            grouped,
            sigmoid: c.family == Family::Llama4,
            sparse,
            jitter: m.jitter > 0.0,
            balance: m.balance.is_some(),
            scattered: c.family == Family::GptOss,
            top_softmax,
        })
    }

    /// What the mixture keeps a token, and once a forward, in a model
    /// `h` wide computing in `b` bytes; `live`: whether its input needs a
    /// gradient, `full`: whether its weights train. The experts' share is
    /// the same whichever experts the tokens choose: `k` rows a token in
    /// all.
    fn layer(&self, b: u64, h: u64, live: bool, full: bool) -> (u64, u64) {
        let Self {
            count,
            k,
            width,
            normalize,
            shared,
            grouped,
            sigmoid,
            sparse,
            jitter,
            balance,
            scattered,
            top_softmax,
        } = *self;
        // The grouped router computes in fp32: its input, and its
        // weights per row.
        let (input, weight) = match grouped {
            true => (4, 4),
            false => (b, b),
        };
        // A training router keeps its input; each expert's first two
        // matrices their rows of it, gathered (Llama 4's scaled by their
        // weights); the down projection its input.
        let mut kept = full as u64 * (input * h + k * b * h + k * b * width);
        let mut per_forward = 0;
        if live {
            // The jitter's draw, kept for its input's gradient (the
            // router and experts keep the jittered input, in place of
            // the one they would keep).
            kept += jitter as u64 * b * h;
            // The scores' fp32 softmax (or sigmoid); the top k's int64
            // choices (or the index the grouped scores are gathered
            // by); with renormalisation the fp32 weights and their sum
            // (and that sum held above 1e-12; the grouped one's plus
            // 1e-20, which keeps nothing).
            let renormalised = match grouped {
                true => 4 * k + 4,
                false => 4 * k + 8,
            };
            kept += 8 * k + normalize as u64 * renormalised;
            // Llama 4's sigmoid of the top k alone (Aria's softmax of
            // them), the others' scores of every expert; sparsemixer's
            // each pick's softmax over the experts in play and the
            // logits (for its gradient), in the compute dtype, and each
            // pick's weight (its choices are the int64 ones above).
            kept += match (sigmoid || top_softmax, sparse) {
                (true, _) => 4 * k,
                // (With the balance, a softmax of every logit of its
                // own, in the compute dtype.)
                (false, true) => (k + 1 + balance as u64) * b * count + k * b,
                (false, false) => 4 * count,
            };
            // Each expert's tokens and slots (int64 pairs), by which its
            // rows are gathered, weighed and added back.
            kept += 16 * k;
            // The weight of each row and the row's output (Llama 4's:
            // its input), each kept for the other's gradient; the gate
            // and up, from which backward computes the activation again
            // (`glu`: GPT-OSS's clamped one from its biased gate and up,
            // one tensor).
            kept += k * weight + k * b * h + 2 * k * b * width;
            // The grouped router's weight cast to fp32, each forward.
            if grouped && b != 4 {
                per_forward += 4 * count * h;
            }
            // The balance's summed probabilities (fp32), which carry its
            // gradient to the router; GPT-OSS's softmax of its scattered
            // weights (fp32), a token.
            per_forward += balance as u64 * 4 * count;
            kept += (balance && scattered) as u64 * 4 * count;
        }
        // The shared expert reads the router's input, kept once (the
        // grouped router keeps an fp32 copy of it instead, so in 16 bits
        // the shared expert's own linear layers keep the input too): its
        // down projection keeps its input where it trains; its gate and
        // up, and, gated, its gate's sigmoid and its output (each kept
        // for the other's gradient) where the input needs a gradient.
        if let Some((w, gated)) = shared {
            let read = (grouped && b != 4) as u64 * b * h;
            let weighed = gated as u64 * (b + b * h);
            kept += full as u64 * (b * w + read) + live as u64 * (2 * b * w + weighed);
        }
        (kept, per_forward)
    }
}

/// Whether `l` puts an adapter on layer `layer`'s router or experts,
/// shared or routed (which [`Experts`] does not count).
fn adapts_experts(c: &LlamaConfig, m: &MoeConfig, l: &LoraConfig, layer: i64) -> bool {
    let MoeModules {
        block,
        routers,
        experts,
        shared: (shared, shared_names),
    } = MoeModules::of(c.family);
    let in_layer = |module: String| l.targets(&format!("model.layers.{layer}.{module}"));
    let at = |module: String| in_layer(format!("{block}.{module}"));
    let shared = m.shared.is_some()
        && (at("shared_expert_gate".into())
            || shared_names
                .iter()
                .any(|n| in_layer(format!("{shared}.{n}"))));
    routers.iter().any(|r| at(r.to_string()))
        || shared
        || (0..m.experts).any(|e| experts.iter().any(|n| at(format!("experts.{e}.{n}"))))
}

/// Where a family's mixture keeps the linear layers an adapter could
/// sit on, under `model.layers.N.{block}`.
struct MoeModules {
    block: &'static str,
    /// The router's linear layers.
    routers: &'static [&'static str],
    /// Each expert's matrices (`experts.E.{name}`); none where the
    /// experts are stacked parameters, which take adapters through
    /// `target_parameters` alone (refused by `adapters_alone`).
    experts: &'static [&'static str],
    /// The shared expert's module, under the layer, and its matrices
    /// (`{module}.{name}`).
    shared: (&'static str, &'static [&'static str]),
}

impl MoeModules {
    /// Those of `family`.
    fn of(family: Family) -> Self {
        const GATED: &[&str] = &["gate_proj", "up_proj", "down_proj"];
        const NONE: (&str, &[&str]) = ("", &[]);
        let (block, routers, experts, shared) = match family {
            // GPT-OSS's router is no linear layer (it takes no adapter).
            Family::GptOss => ("mlp", &[][..], &[][..], NONE),
            // Llama 4's router takes none either (`bare`).
            Family::Llama4 => (
                "feed_forward",
                &[][..],
                &[][..],
                ("feed_forward.shared_expert", GATED),
            ),
            Family::GraniteMoe => ("block_sparse_moe", &["router.layer"][..], &[][..], NONE),
            Family::Jamba => ("feed_forward", &["router"][..], GATED, NONE),
            // Aria's experts are stacked parameters, its router
            // `mlp.router`.
            Family::AriaText => (
                "mlp",
                &["router"][..],
                &[][..],
                ("mlp.shared_experts", GATED),
            ),
            Family::Dbrx => ("ffn", &["router.layer"][..], &[][..], NONE),
            // Granite-MoE-shared's shared MLP is the layer's own (Granite
            // 4.0's too).
            Family::GraniteMoeShared | Family::GraniteMoeHybrid => (
                "block_sparse_moe",
                &["router.layer"][..],
                &[][..],
                ("shared_mlp", &["input_linear", "output_linear"][..]),
            ),
            Family::Mixtral | Family::Phimoe => (
                "block_sparse_moe",
                &["gate"][..],
                &["w1", "w3", "w2"][..],
                NONE,
            ),
            Family::Qwen2Moe => ("mlp", &["gate"][..], GATED, ("mlp.shared_expert", GATED)),
            // Hunyuan's router is `gate.wg`.
            Family::HunyuanMoe => (
                "mlp",
                &["gate", "gate.wg"][..],
                GATED,
                ("mlp.shared_mlp", GATED),
            ),
            _ => ("mlp", &["gate"][..], GATED, ("mlp.shared_experts", GATED)),
        };
        Self {
            block,
            routers,
            experts,
            shared,
        }
    }
}

/// The ranks of a layer's adapters, 0 where it has none (Phi-3's on its
/// fused `qkv_proj` and `gate_up_proj`, the others' on each projection).
#[derive(Default)]
struct Ranks {
    q: u64,
    k: u64,
    v: u64,
    qkv: u64,
    /// DeepSeek-V3's latent attention's: the queries' bottleneck's two
    /// projections, the latent's and its expansion.
    q_a: u64,
    q_b: u64,
    kv_a: u64,
    kv_b: u64,
    /// LFM2's convolution's `in_proj`.
    conv_in: u64,
    /// Doge's dynamic mask's `dt_proj`, which reads the values; the
    /// Mamba scan's, which reads a part of `x_proj`'s output.
    dt: u64,
    /// The Mamba scan's `x_proj`, which reads the convolved channels
    /// (its `in_proj` is [`Ranks::conv_in`], its `out_proj`
    /// [`Ranks::o`]).
    select: u64,
    o: u64,
    /// Falcon-H1's Mamba's `out_proj`, beside the attention's `o_proj`
    /// (its `in_proj` is [`Ranks::conv_in`]).
    out: u64,
    gate: u64,
    up: u64,
    gate_up: u64,
    down: u64,
}

impl Ranks {
    /// Whether the layer has an adapter.
    fn any(&self) -> bool {
        let attention = self.attention_input()
            + self.q_b
            + self.kv_b
            + self.dt
            + self.select
            + self.o
            + self.out;
        attention + self.mlp_input() + self.down > 0
    }

    /// The ranks of the adapters reading the attention's input.
    fn attention_input(&self) -> u64 {
        self.attention_ranks().iter().sum()
    }

    /// Those adapters' ranks, one by one.
    fn attention_ranks(&self) -> [u64; 7] {
        [
            self.q,
            self.k,
            self.v,
            self.qkv,
            self.q_a,
            self.kv_a,
            self.conv_in,
        ]
    }

    /// The ranks of the adapters reading the MLP's input, one by one.
    fn mlp_ranks(&self) -> [u64; 3] {
        [self.gate, self.up, self.gate_up]
    }

    /// The ranks of the adapters reading the MLP's input.
    fn mlp_input(&self) -> u64 {
        self.gate + self.up + self.gate_up
    }

    /// The ranks of `l`'s adapters on layer `layer` of `c`: none on a
    /// module the layer lacks (Arcee's gate).
    fn of(l: &LoraConfig, layer: i64, c: &LlamaConfig) -> Self {
        // Each layer under its checkpoint name (OPT's
        // `model.decoder.layers.0`, Falcon's `transformer.h.0`).
        let [model, _, blocks, _] = c.family.names();
        let rank = |module: &str| rank_at(l, &format!("{model}.{blocks}.{layer}.{module}"));
        // StarCoder2's MLP under GPT-2's names, Persimmon's layer under
        // GPT-NeoX's, Llama 4's, Jamba's and Bamba's MLP under
        // `feed_forward`, LFM2's too
        // under Llama's original names, OPT's under fairseq's.
        let (qkv, o, gate, up, down) = match c.family {
            f if f.fairseq() => ("qkv_proj", "out_proj", "", "fc1", "fc2"),
            Family::GptBigCode | Family::OpenAiGpt => {
                ("c_attn", "c_proj", "", "mlp.c_fc", "mlp.c_proj")
            }
            Family::GptNeo => ("qkv_proj", "out_proj", "", "mlp.c_fc", "mlp.c_proj"),
            Family::Mpt => ("Wqkv", "out_proj", "", "ffn.up_proj", "ffn.down_proj"),
            f if f.gptj() => ("qkv_proj", "out_proj", "", "mlp.fc_in", "mlp.fc_out"),
            Family::Starcoder2 => ("qkv_proj", "o_proj", "", "mlp.c_fc", "mlp.c_proj"),
            Family::Persimmon => (
                "query_key_value",
                "dense",
                "",
                "mlp.dense_h_to_4h",
                "mlp.dense_4h_to_h",
            ),
            Family::Llama4 | Family::Jamba | Family::Bamba | Family::FalconH1 => (
                "qkv_proj",
                "o_proj",
                "feed_forward.gate_proj",
                "feed_forward.up_proj",
                "feed_forward.down_proj",
            ),
            Family::Lfm2 => (
                "qkv_proj",
                "out_proj",
                "feed_forward.w1",
                "feed_forward.w3",
                "feed_forward.w2",
            ),
            // DBRX's layers are all experts (no dense MLP).
            Family::Dbrx => ("Wqkv", "out_proj", "", "", ""),
            // CTRL's MLP a sequence of modules, its ReLU between.
            Family::Ctrl => ("", "dense", "", "ffn.0", "ffn.2"),
            // ModernBERT-decoder's gate and up one `Wi`.
            Family::ModernBertDecoder => ("", "Wo", "", "mlp.Wi", "mlp.Wo"),
            Family::Falcon | Family::Bloom | Family::GptNeoxJapanese => (
                "query_key_value",
                "dense",
                "",
                "mlp.dense_h_to_4h",
                "mlp.dense_4h_to_h",
            ),
            _ => (
                "qkv_proj",
                "o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            ),
        };
        // DBRX's attention under its norms' module.
        let attn = match c.family {
            Family::Dbrx => "norm_attn_norm.attn",
            Family::Falcon | Family::Bloom => "self_attention",
            f if f.gptj()
                || matches!(
                    f,
                    Family::GptBigCode | Family::OpenAiGpt | Family::ModernBertDecoder
                ) =>
            {
                "attn"
            }
            Family::GptNeo => "attn.attention",
            Family::Mpt => "attn",
            Family::Ctrl => "multi_head_attention",
            Family::GptNeoxJapanese => "attention",
            _ => "self_attn",
        };
        // CTRL's queries, keys and values under names of its own.
        let (q, k, v) = match c.family {
            Family::Ctrl => ("Wq", "Wk", "Wv"),
            _ => ("q_proj", "k_proj", "v_proj"),
        };
        let (fused_qkv, fused_gate_up) = fused(c);
        let mut r = Self {
            o: rank(&format!("{attn}.{o}")),
            dt: match c.family {
                Family::Doge => rank(&format!("{attn}.dt_proj")),
                _ => 0,
            },
            down: rank(down),
            ..Self::default()
        };
        match fused_qkv {
            // LFM2's convolution layers: `in_proj` reads the input,
            // `out_proj` is the layer's output projection.
            _ if c.short_conv_layer(layer).is_some() => {
                (r.conv_in, r.o) = (rank("conv.in_proj"), rank("conv.out_proj"))
            }
            // Mamba-2's: `in_proj` reads the input.
            _ if c.mamba_layer(layer).is_some() => {
                let rank = |m: &str| rank(&format!("{}.{m}", scan_module(c)));
                (r.conv_in, r.o) = (rank("in_proj"), rank("out_proj"))
            }
            // The first Mamba's: `in_proj` reads the input.
            _ if c.mamba1_layer(layer).is_some() => {
                let rank = |m: &str| rank(&format!("{}.{m}", scan_module(c)));
                (r.conv_in, r.select, r.dt, r.o) = (
                    rank("in_proj"),
                    rank("x_proj"),
                    rank("dt_proj"),
                    rank("out_proj"),
                )
            }
            _ if c.mla.is_some() => {
                (r.q, r.q_a, r.q_b, r.kv_a, r.kv_b) = (
                    rank("self_attn.q_proj"),
                    rank("self_attn.q_a_proj"),
                    rank("self_attn.q_b_proj"),
                    rank("self_attn.kv_a_proj_with_mqa"),
                    rank("self_attn.kv_b_proj"),
                )
            }
            true => r.qkv = rank(&format!("{attn}.{qkv}")),
            false => {
                (r.q, r.k, r.v) = (
                    rank(&format!("{attn}.{q}")),
                    rank(&format!("{attn}.{k}")),
                    rank(&format!("{attn}.{v}")),
                )
            }
        }
        // Falcon-H1's Mamba beside the attention: `in_proj` reads the
        // input, `out_proj` the channels.
        if c.falcon_h1.is_some() {
            (r.conv_in, r.out) = (rank("mamba.in_proj"), rank("mamba.out_proj"));
        }
        // A mixture's layer has no dense MLP (where its experts' names
        // are a dense MLP's, as GPT-OSS's, they are none of its), nor
        // have the Mambas' layers.
        if c.moe_layer(layer) || c.family.mamba_only() {
            r.down = 0;
            return r;
        }
        match (fused_gate_up, gated(c)) {
            // Granite 4.0's dense layers' MLP is its shared MLP alone.
            _ if c.family == Family::GraniteMoeHybrid => {
                (r.gate_up, r.down) = (
                    rank("shared_mlp.input_linear"),
                    rank("shared_mlp.output_linear"),
                )
            }
            (true, _) if c.family == Family::ModernBertDecoder => r.gate_up = rank(up),
            (true, _) => r.gate_up = rank("mlp.gate_up_proj"),
            (false, true) => (r.gate, r.up) = (rank(gate), rank(up)),
            (false, false) => r.up = rank(up),
        }
        r
    }
}

/// The module a layer's Mamba scan is under: the Mambas' `mixer`, the
/// hybrids' `mamba` (Jamba's, Bamba's, Granite 4.0's).
fn scan_module(c: &LlamaConfig) -> &'static str {
    match c.family.mamba_only() {
        true => "mixer",
        false => "mamba",
    }
}

/// How a layer's norms compute, which decides what each keeps (see
/// [`Widths::norm_of`] and [`Widths::norm_weights_of`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Norms {
    /// Llama's RMSNorm: its input in fp32 and a reciprocal; the
    /// normalized values in the compute dtype, times the weight.
    Rms,
    /// Gemma's: times `1 + weight` in fp32, a tensor of its own each
    /// forward; the normalized values in fp32.
    Offset,
    /// OLMo 2's and 3's, Helium's: the weights times the normalized
    /// values in fp32 (in a 16-bit model the weights cast to fp32 each
    /// forward).
    Fp32,
    /// StarCoder2's, StableLM's and Persimmon's LayerNorms: each keeps its input as
    /// it is, and a mean and a reciprocal a token in its dtype
    /// (libtorch's CPU kernel's; its CUDA kernel keeps them in fp32).
    Layer,
    /// Nemotron's LayerNorms of `1 + weight`, a tensor of its own each
    /// forward in the weights' dtype.
    LayerOneP,
    /// OLMo 1's LayerNorms without weights, of the input in fp32: each
    /// keeps that fp32 input and a mean and a reciprocal in fp32.
    Bare,
}

impl Norms {
    /// Those of `family`'s layers.
    fn of(family: Family) -> Self {
        match family {
            Family::Gemma | Family::Gemma2 | Family::VaultGemma | Family::Gemma3 => Self::Offset,
            // Cohere's LayerNorm keeps the same: its centred input in
            // fp32 and a reciprocal, the normalized values in fp32.
            Family::Olmo2
            | Family::Olmo3
            | Family::FlexOlmo
            | Family::Helium
            | Family::Cohere
            | Family::Cohere2
            | Family::GptOss => Self::Fp32,
            Family::Starcoder2
            | Family::StableLm
            | Family::Persimmon
            | Family::Dbrx
            | Family::Falcon
            | Family::ModernBertDecoder
            | Family::Phimoe => Self::Layer,
            f if gpt_era(f) => Self::Layer,
            Family::Nemotron => Self::LayerOneP,
            Family::Olmo1 => Self::Bare,
            _ => Self::Rms,
        }
    }
}

/// How a layer normalises its queries and keys.
#[derive(Clone, Copy, PartialEq, Eq)]
enum QkNorm {
    None,
    /// Over each head, with weights every head shares (Qwen3's).
    Shared,
    /// Over each head, with weights of the head's own (Command R+'s
    /// `[heads, head_dim]` in one norm, StableLM 2 12B's one LayerNorm
    /// a head, each input a view of the projection's output).
    OwnWeights,
    /// Over the whole projections before the heads are split (OLMo's).
    Whole,
}

impl QkNorm {
    /// Those of `c`'s layers.
    fn of(c: &LlamaConfig) -> Self {
        match (c.qk_norm, c.family) {
            (false, _) => Self::None,
            (true, f) if f.whole_qk_norm() => Self::Whole,
            (true, f) if f.qk_norm_of_each_head() => Self::OwnWeights,
            (true, _) => Self::Shared,
        }
    }
}

/// A layer's widths and the compute dtype's bytes `b`.
#[derive(Clone, Copy)]
struct Widths {
    b: u64,
    h: u64,
    i: u64,
    q: u64,
    kv: u64,
    d: u64,
    /// The width of each head the rotary embedding turns.
    rd: u64,
    heads: u64,
    kv_heads: u64,
    /// The norms of the queries and keys, if any.
    qk_norm: QkNorm,
    /// How its norms compute.
    norms: Norms,
    /// Gemma 2's and 3's norms of each sublayer's output too (OLMo 2's
    /// and 3's only).
    sandwich: bool,
    /// Norms before each sublayer (all but OLMo 2's and 3's).
    pre_norms: bool,
    /// The norm before the attention, where [`Widths::pre_norms`] (all
    /// but ModernBERT-decoder's first layer's).
    attention_norm: bool,
    /// Phi-3's (and DBRX's unclipped) fused projection: queries, keys
    /// and values one output, which the values, a view of it, keep
    /// whole.
    views: bool,
    /// A gated MLP (`down(act(gate(x)) * up(x))`), not Arcee's
    /// `down(relu2(up(x)))` or StarCoder2's `c_proj(gelu(c_fc(x)))`.
    gated: bool,
    /// Heads turned in fp32 (OLMo's halves, ERNIE 4.5's neighbouring
    /// pairs): the cosines and sines they keep are fp32.
    fp32_rope: bool,
    /// Llama 4's queries and keys L2-normalised in fp32 after they turn,
    /// in the layers that turn them (`use_qk_norm`).
    l2_norm: bool,
    /// Llama 4's queries grown with their position in the layers that
    /// do not turn them (`attn_temperature_tuning`).
    temperature: bool,
    /// Queries, keys and values clamped (OLMo 1's `clip_qkv`): the
    /// clamp keeps its input.
    clipped: bool,
    /// Cohere's attention and MLP side by side after one norm
    /// (`x + attn(n(x)) + mlp(n(x))`): both read one normalised tensor.
    parallel: bool,
    /// Falcon 40B's and 180B's two LayerNorms of the input side by side
    /// (`ln_attn`, `ln_mlp`): the second keeps its own mean and
    /// reciprocal (the input is the first's), and the MLP reads its own
    /// normalised tensor.
    two_norms: bool,
    /// Falcon's parallel layers drop out the sum of the attention's and
    /// the MLP's outputs (`hidden_dropout`), not each: its mask is kept
    /// where either needs a gradient.
    sum_dropped: bool,
    /// Falcon-H1's MLP scales its gate inside the activation: the
    /// product is computed as it reads (not by `glu`), the activation
    /// keeping its input and the product its output.
    scaled_gate: bool,
    /// Gemma 2's soft-capped attention scores, GPT-OSS's beside its
    /// sinks, computed by blocks of queries or whole rather than by the
    /// fused kernel.
    eager: Option<Eager>,
    /// DeepSeek-V3's latent attention in place of heads projected from
    /// the input.
    latent: Option<Latent>,
    /// LoRA's dropout of each adapter's input (`lora_dropout` > 0).
    dropout: bool,
    /// The model's dropout of the attention's weights over rows of this
    /// many tokens (GPT-2's `attn_pdrop`, the Llama family's
    /// `attention_dropout`): libtorch's CPU attention then takes its
    /// plain path ([`Widths::attention`]).
    attention_dropout: Option<u64>,
    /// The model's dropout of the attention's output and of the MLP's
    /// before the residual (GPT-2's `resid_pdrop`, both; StableLM's
    /// `hidden_dropout`, the MLP's alone): its mask, in the compute
    /// dtype, kept where that output needs a gradient.
    resid_dropout: (bool, bool),
    /// Apertus's xIELU in place of the ungated MLP's activation.
    xielu: bool,
    /// OPT's plain ReLU as the ungated MLP's activation, which keeps its
    /// output (the down projection's input).
    relu: bool,
    /// BitNet's RMSNorms of the attention's output before the output
    /// projection (`attn_sub_norm`) and of the MLP's product before the
    /// down projection (`ffn_sub_norm`).
    sub_norms: bool,
    /// DiffLlama's differential attention: every head over every head's
    /// keys and over values twice as wide, the heads' outputs combined
    /// in pairs and RMS-normalised ([`super::differential`]).
    differential: bool,
    /// An MLP after the layer's attention (or what mixes its tokens in
    /// its place): all but the Mambas', whose layers are a norm and the
    /// scan alone.
    mlp: bool,
    /// The rows of the forward, and each's tokens.
    rows: u64,
    seq: u64,
}

/// The widths of DeepSeek-V3's latent attention ([`Mla`]).
#[derive(Clone, Copy)]
struct Latent {
    /// The queries' bottleneck, if any (`q_lora_rank`).
    q_rank: Option<u64>,
    /// The keys' and values' latent (`kv_lora_rank`).
    kv_rank: u64,
    /// Each head's unturned and turned query and key dimensions, and
    /// its value's.
    nope: u64,
    rope: u64,
    v: u64,
}

impl Latent {
    fn of(m: &Mla) -> Self {
        Self {
            q_rank: m.q_rank.map(dims),
            kv_rank: dims(m.kv_rank),
            nope: dims(m.nope),
            rope: dims(m.rope),
            v: dims(m.v),
        }
    }
}

/// Attention computed as `transformers`' eager attention computes it
/// (`eager_attention`): over `rows` rows of `seq` tokens, its scores
/// soft-capped (Gemma 2's) or beside a sink a head (GPT-OSS's).
#[derive(Clone, Copy)]
struct Eager {
    rows: u64,
    seq: u64,
    capped: bool,
    sinks: bool,
    /// Doge's bias on each key, `[rows, heads, 1, seq]`, which each
    /// block keeps as an input.
    dynamic: bool,
}

/// What mixes a layer's tokens in place of attention.
#[derive(Clone, Copy)]
enum Mixer {
    /// LFM2's gated short convolution of this many tokens.
    ShortConv(u64),
    /// The first Mamba's selective scan.
    Scan(Scan),
    /// Mamba-2's chunked scan.
    Ssd(Ssd),
    /// Falcon-H1's: attention and Mamba-2's chunked scan side by side,
    /// each reading the normalised input times a factor of its own.
    Beside(Ssd),
}

/// The widths of Mamba-2's chunked scan ([`MambaConfig`]) and how its
/// output is gated.
#[derive(Clone, Copy)]
struct Ssd {
    /// The channels scanned, `heads` of them a head.
    inner: u64,
    heads: u64,
    /// The convolution's channels: the inner width and `B` and `C`.
    channels: u64,
    /// Each channel's state.
    state: u64,
    /// The scan's chunk of tokens.
    chunk: u64,
    /// The causal convolution's width.
    kernel: u64,
    /// How its output is gated (and normalised).
    gate: MambaGate,
    /// Falcon-H1's multipliers of `in_proj`'s parts: its output times
    /// a tensor of them, cast to the compute dtype each forward.
    mup: bool,
}

impl Ssd {
    /// `m`'s, in a model `hidden` wide, over rows of `seq` tokens
    /// (`mup`: Falcon-H1's, multiplied); `None` for a row within one
    /// chunk, one head or a state of one (libtorch's einsum keeps views
    /// of its operands there, where it keeps copies otherwise).
    fn of(m: &MambaConfig, hidden: i64, seq: u64, mup: bool) -> Option<Self> {
        let inner = m.inner(hidden);
        let countable = m.heads > 1 && m.state > 1 && seq.div_ceil(dims(m.chunk).max(1)) > 1;
        countable.then(|| Self {
            inner: dims(inner),
            heads: dims(m.heads),
            channels: dims(inner + 2 * m.groups * m.state),
            state: dims(m.state),
            chunk: dims(m.chunk).max(1),
            kernel: dims(m.conv_kernel),
            gate: m.gate,
            mup,
        })
    }
}

/// The widths of the first Mamba's selective scan ([`Mamba1Config`]).
#[derive(Clone, Copy)]
struct Scan {
    /// The channels scanned.
    inner: u64,
    /// Each channel's state.
    state: u64,
    /// The width each token's step is projected through.
    rank: u64,
    /// The causal convolution's width.
    kernel: u64,
    /// Falcon-Mamba's RMS norms without weights of each token's step,
    /// `B` and `C`, or Jamba's with (`weighted`).
    normed: bool,
    weighted: bool,
}

impl Scan {
    fn of(m: &Mamba1Config, hidden: i64) -> Self {
        Self {
            inner: dims(m.inner(hidden)),
            state: dims(m.state),
            rank: dims(m.dt_rank),
            kernel: dims(m.conv_kernel),
            normed: m.step_norms != StepNorms::None,
            weighted: m.step_norms == StepNorms::Weighted,
        }
    }
}

impl Widths {
    /// A layer of LayerNorms before attention and an ungated MLP, one
    /// after the other, and nothing else ([`Alike`]'s models set theirs
    /// apart): `h` wide, its MLP `i`, `heads` heads of queries over
    /// `kv_heads` of keys and values, each `d` wide, `rd` of it turned;
    /// in fp32 over one row until the count sets those.
    fn layer_normed((h, i): (u64, u64), (heads, kv_heads, d, rd): (u64, u64, u64, u64)) -> Self {
        Self {
            b: 4,
            h,
            i,
            q: heads * d,
            kv: kv_heads * d,
            d,
            rd,
            heads,
            kv_heads,
            qk_norm: QkNorm::None,
            norms: Norms::Layer,
            sandwich: false,
            pre_norms: true,
            attention_norm: true,
            views: false,
            gated: false,
            fp32_rope: false,
            l2_norm: false,
            temperature: false,
            clipped: false,
            parallel: false,
            two_norms: false,
            sum_dropped: false,
            scaled_gate: false,
            eager: None,
            latent: None,
            dropout: false,
            attention_dropout: None,
            resid_dropout: (false, false),
            xielu: false,
            relu: false,
            sub_norms: false,
            differential: false,
            mlp: true,
            rows: 1,
            seq: 1,
        }
    }

    /// Whether the layer is Doge's: its dynamic mask on the keys, its
    /// residuals weighted.
    fn doge(&self) -> bool {
        self.eager.is_some_and(|e| e.dynamic)
    }

    /// What a layer holds for `tokens` tokens: with `recompute` its
    /// input, its one saved tensor, and the generator state to recompute
    /// it with, nothing where no gradient reaches (`live`) or leaves it
    /// (`trains`: it runs as a plain forward then); else what it keeps
    /// (`kept`).
    fn layer_held(
        &self,
        recompute: bool,
        (live, trains): (bool, bool),
        tokens: u64,
        kept: impl FnOnce() -> u64,
    ) -> u64 {
        match recompute {
            true if live || trains => tokens * self.b * self.h + RNG_STATE_BYTES,
            true => 0,
            false => kept(),
        }
    }

    /// Whether the readers of one tensor keep it as it is: the base's
    /// matrix where it trains (`base`), or an adapter of `ranks` (0
    /// where there is none) without LoRA's dropout.
    fn shares(&self, base: bool, ranks: &[u64]) -> bool {
        base || (!self.dropout && ranks.iter().any(|&r| r > 0))
    }

    /// What LoRA's dropout keeps for the adapters of `ranks` reading one
    /// tensor `width` wide a token: each its own dropped copy (its `A`
    /// keeps it), and, where the tensor needs a gradient (`live`), the
    /// scaled mask it was multiplied by, in the compute dtype (libtorch's
    /// CPU dropout).
    fn dropped(&self, width: u64, ranks: &[u64], live: bool) -> u64 {
        let adapters = ranks.iter().filter(|&&r| r > 0).count() as u64;
        self.dropout as u64 * adapters * self.b * width * (1 + live as u64)
    }

    /// What an RMSNorm keeps per token: its input in fp32 (in fp32 the
    /// input itself, else its fp32 copy) and one fp32 reciprocal when
    /// the gradient flows through it; its normalized values when its
    /// weight trains (Gemma's in fp32, the dtype they are multiplied
    /// in).
    fn norm(&self, live: bool, trains: bool) -> u64 {
        self.norm_of((self.h, 1), live, trains)
    }

    /// [`Widths::norm`] of `width` values in `rows` norms a token.
    fn norm_of(&self, (width, rows): (u64, u64), live: bool, trains: bool) -> u64 {
        let rms =
            |normed: u64| live as u64 * (4 * width + 4 * rows) + trains as u64 * normed * width;
        match self.norms {
            Norms::Rms => rms(self.b),
            Norms::Offset | Norms::Fp32 => rms(4),
            Norms::Layer | Norms::LayerOneP => {
                (live || trains) as u64 * self.b * (width + 2 * rows)
            }
            Norms::Bare => live as u64 * (4 * width + 8 * rows),
        }
    }

    /// What a norm of the model's width keeps once a forward, whatever
    /// the tokens: Gemma's `1 + weight` in fp32, a tensor of its own,
    /// kept when the gradient flows through it; OLMo's weights cast to
    /// fp32, in a 16-bit model (Llama's product keeps the weight itself,
    /// no new memory).
    fn norm_weights(&self, live: bool) -> u64 {
        self.norm_weights_of(self.h, live)
    }

    /// [`Widths::norm_weights`] of a norm `width` wide.
    fn norm_weights_of(&self, width: u64, live: bool) -> u64 {
        let own = match self.norms {
            Norms::Offset => 4,
            Norms::Fp32 if self.b != 4 => 4,
            // Nemotron's `1 + weight`, in the weights' dtype.
            Norms::LayerOneP => self.b,
            _ => 0,
        };
        live as u64 * own * width
    }

    /// What the attention keeps a token and once a forward, given which
    /// of its queries, keys and values need a gradient, and whether its
    /// output projection keeps its input (`o_kept`: its weight trains or
    /// it has an adapter).
    fn attention(&self, (q_live, k_live, v_live): (bool, bool, bool), o_kept: bool) -> (u64, u64) {
        let Self {
            b, q, kv, heads, ..
        } = *self;
        match self.eager {
            // Scores whose queries train: a block of queries at a time,
            // each computed again in backward (`eager_attention`),
            // keeping the queries, the keys and values repeated for every
            // head of their group, and the generator's state for each
            // block. The output is copied token by token for the output
            // projection.
            Some(Eager {
                rows, seq, dynamic, ..
            }) if q_live => {
                let (r, h, s) = (rows as i64, heads as i64, seq as i64);
                let blocks = seq.div_ceil(super::eager_attention::block_rows(r, h, s) as u64);
                let bias = dynamic as u64 * b * heads;
                (
                    3 * b * q + o_kept as u64 * b * q + bias,
                    blocks * RNG_STATE_BYTES,
                )
            }
            // (Doge's whole, its dynamic mask beside it, is not counted:
            // `held_for_backward` gives up before.)
            Some(Eager {
                rows,
                seq,
                capped,
                sinks,
                ..
            }) => {
                // Whole: each product keeping what the other factor's
                // gradient needs (the queries, the keys and values
                // repeated for every head of their group); the cap's
                // tanh, the mask and the fp32 softmax (over the sinks'
                // column too) where the scores need a gradient, and the
                // weights in the compute dtype where the values do (in
                // fp32 the softmax's own). The output is copied token by
                // token for the output projection.
                let qk_live = q_live || k_live;
                let mut per_token = b * q * (k_live as u64 + q_live as u64 + qk_live as u64);
                if o_kept {
                    per_token += b * q;
                }
                let columns = seq + sinks as u64;
                let weights = match b {
                    4 => (v_live && !qk_live) as u64 * 4 * columns,
                    _ => v_live as u64 * b * seq,
                };
                let softmax = qk_live as u64 * (capped as u64 * b * seq + 4 * columns);
                let scores = rows * heads * seq * (softmax + weights) + qk_live as u64 * seq * seq;
                (per_token, scores)
            }
            // Dropped out, libtorch's CPU attention takes its plain path,
            // in fp32 whatever the dtype, the keys and values repeated for
            // every head of their group: where the queries or keys need a
            // gradient, the values, the softmax and the dropout's mask;
            // where the queries do, the scaled keys; where the keys do,
            // the scaled queries; where the values do, the dropped
            // weights. The weights are `seq` x `seq` a row and head.
            None if self.attention_dropout.is_some() && (q_live || k_live || v_live) => {
                let seq = self.attention_dropout.unwrap_or(0);
                let qk = q_live || k_live;
                let per_token = 4 * q * (q_live as u64 + k_live as u64 + qk as u64);
                let weights = 2 * qk as u64 + v_live as u64;
                let scores = self.rows * heads * 4 * weights * seq * seq;
                (per_token + o_kept as u64 * b * q, scores)
            }
            // DiffLlama's: the fused kernel's queries and keys padded to
            // the values' width, each head's values two heads' side by
            // side, and its output: four tensors each `2 q` wide; the
            // log-sum-exp per head.
            None if self.differential && (q_live || k_live || v_live) => (8 * b * q + 4 * heads, 0),
            // The fused attention keeps its inputs, output and fp32 log-
            // sum-exp per head; its output is the output projection's
            // input. Phi-3's values are a view of the fused projection's
            // output, all of which they keep.
            None if q_live || k_live || v_live => (
                b * (2 * q + 2 * kv) + 4 * heads + self.views as u64 * b * (q + kv),
                0,
            ),
            None => (o_kept as u64 * b * q, 0),
        }
    }

    /// What the queries, keys and values of heads each projected from
    /// the layer's input keep (and the attention of them), a token, a
    /// position and once a forward, and whether the attention's output
    /// needs a gradient; `normed`: whether the input does, `full`:
    /// whether the base trains, `r`: the layer's adapters, `o_kept`:
    /// whether the output projection keeps the attention's output,
    /// `turns`: whether the layer turns its heads.
    fn heads(
        &self,
        (normed, full): (bool, bool),
        r: &Ranks,
        o_kept: bool,
        turns: bool,
    ) -> (u64, u64, u64, bool) {
        let Self {
            b,
            q,
            kv,
            d,
            rd,
            heads,
            kv_heads,
            qk_norm,
            fp32_rope,
            clipped,
            l2_norm,
            temperature,
            ..
        } = *self;
        let (mut per_token, mut per_forward) = (0, 0);
        // What reads one fused output needs a gradient where any part of
        // it does.
        let qkv = r.qkv > 0;
        let (q_live, k_live, v_live) = (
            normed || full || qkv || r.q > 0,
            normed || full || qkv || r.k > 0,
            normed || full || qkv || r.v > 0,
        );
        // OLMo 1's clamp keeps the projections' outputs.
        if clipped {
            per_token += b * (q * q_live as u64 + kv * (k_live as u64 + v_live as u64));
        }
        // Qwen3 norms each head's queries and keys before they turn,
        // OLMo the whole projections.
        let (q_rows, kv_rows, q_weights, kv_weights) = match qk_norm {
            QkNorm::Shared => (heads, kv_heads, d, d),
            QkNorm::OwnWeights => (heads, kv_heads, q, kv),
            QkNorm::Whole => (1, 1, q, kv),
            QkNorm::None => (0, 0, 0, 0),
        };
        if qk_norm != QkNorm::None {
            per_token += self.norm_of((q, q_rows), q_live, full);
            per_token += self.norm_of((kv, kv_rows), k_live, full);
            per_forward +=
                self.norm_weights_of(q_weights, q_live) + self.norm_weights_of(kv_weights, k_live);
        }
        // Each of queries and keys multiplies cos and sin (OLMo's and
        // ERNIE's in fp32), which it keeps when it needs a gradient.
        // Llama 4's layers that do not turn multiply their queries by
        // one fp32 factor a position instead, kept alike.
        let turned = if fp32_rope { 4 } else { b };
        let per_position = match turns {
            true => 2 * turned * rd * (q_live as u64 + k_live as u64),
            false => temperature as u64 * 4 * q_live as u64,
        };
        // Llama 4's L2 norm of each turned head, without weights: its
        // input in fp32 and a reciprocal a head, where a gradient flows
        // through it.
        if l2_norm && turns {
            per_token += 4 * (q_live as u64 * (q + heads) + k_live as u64 * (kv + kv_heads));
        }
        let attended = q_live || k_live || v_live;
        let (token, forward) = self.attention((q_live, k_live, v_live), o_kept);
        per_token += token;
        per_forward += forward;
        // Doge's bias on each key from its values: `dt_proj` keeps its
        // input (the value heads side by side, a copy) where it trains
        // or an adapter reads it; the softplus its input and the
        // exponential its output where a gradient flows; the product with
        // `A` the softplus's output where `A` trains.
        if self.doge() {
            let dt_live = v_live || full || r.dt > 0;
            per_token += self.shares(full, &[r.dt]) as u64 * b * kv
                + b * r.dt
                + self.dropped(kv, &[r.dt], v_live)
                + dt_live as u64 * 2 * b * kv_heads
                + full as u64 * b * kv_heads;
        }
        (per_token, per_position, per_forward, attended)
    }

    /// [`Widths::heads`] for DeepSeek's latent attention `m`: the
    /// queries projected whole or through a normed bottleneck, the keys
    /// and values expanded from a normed latent beside one turned key
    /// every head shares, the fused kernel over queries and keys as wide
    /// as the unturned and turned parts together and values of their
    /// own width.
    fn latent(
        &self,
        m: &Latent,
        (normed, full): (bool, bool),
        r: &Ranks,
        (o_kept, turns): (bool, bool),
    ) -> (u64, u64, u64, bool) {
        let Self { b, heads, .. } = *self;
        let mut per_token = 0;
        // A normed bottleneck `rank` wide: its norm (an RMSNorm, which
        // keeps nothing once a forward), and the second projection
        // reading the norm's output where its weight trains or an adapter
        // reads it. Whether the bottleneck's output needs a gradient,
        // given whether the first projection's does.
        let mut bottleneck = |rank: u64, first_live: bool, second: u64| {
            per_token += self.norm_of((rank, 1), first_live, full);
            per_token += self.shares(full, &[second]) as u64 * b * rank + b * second;
            per_token += self.dropped(rank, &[second], first_live);
            first_live || full || second > 0
        };
        let q_live = match m.q_rank {
            None => normed || full || r.q > 0,
            Some(rank) => bottleneck(rank, normed || full || r.q_a > 0, r.q_b),
        };
        let latent_live = normed || full || r.kv_a > 0;
        let kv_live = bottleneck(m.kv_rank, latent_live, r.kv_b);
        // In fp32 the latent's norm keeps its input, a view of the
        // latent and the turned key's part beside it: all of it.
        if latent_live && b == 4 {
            per_token += 4 * m.rope;
        }
        // The queries' turned part and the shared key multiply cos and
        // sin, which they keep when they need a gradient.
        let turned = if self.fp32_rope { 4 } else { b };
        let per_position = 2 * turned * m.rope * (q_live as u64 + latent_live as u64);
        let per_position = turns as u64 * per_position;
        let attended = q_live || kv_live;
        let qk = heads * (m.nope + m.rope);
        // The values as the kernel takes them: padded to the queries'
        // width, a tensor of their own, where narrower; else a view of
        // the expansion, which they keep whole.
        let (values, out) = match m.v < m.nope + m.rope {
            true => (qk, qk),
            false => (heads * (m.nope + m.v), heads * m.v),
        };
        // The kernel keeps the queries, the keys (the shared turned key
        // copied to every head), the values, its output and each head's
        // fp32 log-sum-exp. Its output is laid out by head, as the
        // queries are, so the output projection reads a copy of it by
        // token, which it keeps where its weight trains or an adapter
        // reads it.
        per_token += attended as u64 * (b * (2 * qk + values + out) + 4 * heads);
        per_token += o_kept as u64 * b * heads * m.v;
        (per_token, per_position, 0, attended)
    }

    /// What the causal convolution (`short_conv::CausalConv`, LFM2's and
    /// both Mambas') keeps beyond a row's tokens, once a forward: its
    /// output of `channels` values a token is `kernel - 1` positions
    /// longer than each row, and what reads it keeps it whole.
    fn conv_overhang(&self, kernel: u64, channels: u64) -> u64 {
        self.rows * kernel.saturating_sub(1) * self.b * channels
    }

    /// [`Widths::heads`] for LFM2's short convolution of `kernel` tokens:
    /// `in_proj`'s `B`, `C` and `x` (views of its output, which `B x`
    /// and `C` times the convolution's output keep whole), `B x` (the
    /// convolution's input) and the convolution's output, `kernel - 1`
    /// positions longer than each row, where a gradient flows through
    /// them; and the output projection's input, a copy of the gated
    /// output laid out by token.
    fn conv(
        &self,
        kernel: u64,
        (normed, full): (bool, bool),
        r: &Ranks,
        o_kept: bool,
    ) -> (u64, u64, u64, bool) {
        let Self { b, h, .. } = *self;
        let live = normed || full || r.conv_in > 0;
        let per_token = live as u64 * 5 * b * h + o_kept as u64 * b * h;
        let per_forward = live as u64 * self.conv_overhang(kernel, h);
        (per_token, 0, per_forward, live)
    }

    /// [`Widths::heads`] for the first Mamba's selective scan `s`
    /// (`mamba1`, as `transformers`' `slow_forward` computes it), given
    /// whether its input needs a gradient (`normed`), its base trains
    /// (`full`), its adapters `r` (`in_proj`'s among the readers of its
    /// input, counted by the layer) and whether the output projection
    /// keeps its input (`o_kept`). Where a gradient flows through them:
    /// `in_proj`'s output (its gate's activation keeps it, its channels a
    /// view); the convolution's output, `kernel - 1` positions longer
    /// than each row; the convolved channels' activation, which the skip
    /// keeps where `D` trains and the scan's input product in fp32 (in 16
    /// bits an fp32 copy); `x_proj`'s output (the steps' input, `B` and
    /// `C` views of it; in 16 bits `B` an fp32 copy), the steps before
    /// and after their softplus. The discretised `A` and `B x`, `[rows,
    /// inner, seq, state]` in fp32, and every token's state after it (in
    /// 16 bits its copy too, which reads `C`), are each four bytes a
    /// channel a state a token, the scan's cost in memory; `A` once a
    /// forward, twice where it trains, and the zero state it starts from.
    /// Then the scan's output and the gate's activation, each the
    /// other's factor. `x_proj` reads the channels laid out by channel:
    /// where its weight trains, and for its adapter, a copy by token.
    fn scan(
        &self,
        s: &Scan,
        (normed, full): (bool, bool),
        r: &Ranks,
        o_kept: bool,
    ) -> (u64, u64, u64, bool) {
        let Self { b, rows, seq, .. } = *self;
        let Scan {
            inner: i,
            state: n,
            rank,
            kernel,
            normed: step_norms,
            weighted,
        } = *s;
        let wide = b != 4;
        // Where a gradient flows: `in_proj`'s output and the channels;
        // `x_proj`'s output; the steps (`dt_proj`'s), through which every
        // later tensor needs one.
        let projected = normed || full || r.conv_in > 0;
        let selected = projected || r.select > 0;
        let steps = selected || r.dt > 0;
        let [p, sel, st] = [projected, selected, steps].map(u64::from);
        // `in_proj`'s output, the convolution's, the scan's output; `B
        // x`, which the channels' gradient reads.
        let mut per_token = p * (4 * b * i + 4 * i * n);
        // The steps before and after their softplus (the steps after it
        // where `A` trains or `B` needs a gradient), the gate's
        // activation; the discretised `A`.
        per_token += st * (2 * b * i + 4 * i * n);
        per_token += u64::from(full || selected) * b * i;
        // `x_proj`'s output: the steps' input, `B` and `C` are views of
        // it. Falcon-Mamba's and Jamba's norms of them (RMS, in fp32)
        // read it in its place: where they need a gradient, their fp32
        // input (in fp32 the output itself) and a reciprocal each; where
        // Jamba's weights train, the normalized values they multiply, in
        // the compute dtype; then the steps' norm where `dt_proj` keeps
        // it as it is, `B`'s in fp32 (in 16 bits its fp32 copy, below,
        // instead) and `C`'s.
        let selection = b * (rank + 2 * n);
        per_token += match step_norms {
            false => st * selection,
            true => {
                let own = u64::from(self.shares(full, &[r.dt])) * b * rank;
                sel * (12 + u64::from(wide) * 4 * (rank + 2 * n) + u64::from(!wide) * selection)
                    + own
                    + u64::from(weighted && full) * selection
                    + st * b * n * (1 + u64::from(!wide))
            }
        };
        // The channels: the skip keeps them where `D` trains, the scan's
        // input product for `B x`'s gradient (in 16 bits an fp32 copy,
        // with one of `B`); in 16 bits each state's copy, which reads
        // `C`.
        per_token += u64::from(full || (!wide && steps)) * b * i;
        per_token += u64::from(wide && steps) * 4 * (i + n);
        per_token += u64::from(wide && selected) * b * i * n;
        // `x_proj`'s copy by token where its weight trains, and its
        // adapter's (under LoRA's dropout, its dropped copy, laid out
        // by channel as the channels are, copied by token again, and
        // its mask); `dt_proj`'s adapter reads a view of `x_proj`'s
        // output (under LoRA's dropout, its own dropped copy).
        let adapted = u64::from(r.select > 0 && !self.dropout);
        per_token += (u64::from(full) + adapted) * b * i + self.dropped(i, &[r.select], projected);
        per_token += b * (r.select + r.dt) + self.dropped(rank, &[r.dt], selected);
        per_token += u64::from(o_kept) * b * i;
        // Once a forward: the convolution's output's longer rows, `A`
        // (and its exponential where it trains), the zero state the
        // scan starts from and each state after a token, in fp32, but
        // the last, which is kept only for `C`'s gradient, and in 16
        // bits not even then (its copy is).
        let mut per_forward = p * self.conv_overhang(kernel, i);
        per_forward += (st + u64::from(full)) * 4 * i * n + st * rows * i * n * b;
        per_forward += st * rows * seq.saturating_sub(1) * 4 * i * n;
        per_forward += u64::from(!wide && selected) * rows * 4 * i * n;
        (per_token, 0, per_forward, steps)
    }

    /// [`Widths::heads`] for Mamba-2's chunked scan `s` (`mamba`,
    /// `transformers`' `torch_forward`), given whether its input needs a
    /// gradient (`normed`), its base trains (`full`) and whether the
    /// output projection keeps its input (`o_kept`). Where a gradient
    /// flows through the scan (its input needs one, its base trains or
    /// `in_proj` has an adapter) everything after `in_proj` needs one,
    /// and it keeps: `in_proj`'s output (the convolution's input, a view
    /// of it), the convolution's output, `kernel - 1` positions longer
    /// than each row, and its activation's (in 16 bits the channels' fp32
    /// copy and the gate's instead); the steps before, within and after
    /// their softplus; then, over each row padded to whole chunks, in
    /// fp32, each chunk's decays between its tokens, the products of
    /// its `C` and `B` and the two times its channels (`12 heads chunk`
    /// bytes a token, the scan's share that grows with the chunk), five
    /// copies of `B` or `C` a head, three of the channels (the einsum's
    /// operands and the products it keeps), two decays a head, and the
    /// scan's output; the gate's activation, the gated output and a
    /// reciprocal; and once a forward each chunk's states as two einsums
    /// keep them, the decays between chunks, `A` and the masks of the
    /// segment sums. Where the base trains: the padded channels `D`
    /// multiplies, the normalized values the norm's weights multiply (in
    /// fp32, the scan's dtype, as `transformers`' norm takes it; the
    /// output projection reads their product cast), `A_log`'s
    /// exponential.
    fn ssd(
        &self,
        s: &Ssd,
        (normed, full): (bool, bool),
        r: &Ranks,
        o_kept: bool,
    ) -> (u64, u64, u64, bool) {
        let Self { b, rows, seq, .. } = *self;
        let Ssd {
            inner: i,
            heads,
            channels: c,
            state: n,
            chunk,
            kernel,
            gate,
            mup,
        } = *s;
        let live = normed || full || r.conv_in > 0;
        let [lv, f] = [live, full].map(u64::from);
        let own = match b == 4 {
            true => 4 * c,
            false => 8 * i,
        };
        let gated = match gate {
            // The output times `silu(gate)`, RMS-normalised (fp32) and
            // times the weights.
            MambaGate::NormedAfter => lv * (own + 8 * i + 4) + f * 4 * i,
            // Falcon-H1's grouped norm, gated before it or after: the
            // same, and a reciprocal a group.
            MambaGate::Grouped { groups, .. } => {
                lv * (own + 8 * i + 4 * dims(groups).max(1)) + f * 4 * i
            }
            // Falcon-H1's without a norm: the fp32 output and the gate's
            // `silu`'s output (in fp32 with what `own` counts, its input
            // a view of `in_proj`'s output).
            MambaGate::Plain => match b == 4 {
                true => lv * (own + 4 * i),
                false => lv * (4 + b) * i,
            },
        };
        let per_token = lv * b * (i + 2 * c + 4 * heads) + gated + u64::from(o_kept) * b * i;
        let chunks = seq.div_ceil(chunk);
        let per_padded =
            lv * (12 * heads * chunk + 20 * heads * n + 16 * i + 8 * heads) + f * 4 * i;
        let between = (chunks + 1) * (chunks + 1);
        let per_forward = rows * chunks * chunk * per_padded
            + lv * (self.conv_overhang(kernel, c)
                + 2 * (chunk * chunk + between)
                + 4 * rows * (heads * between + (2 * chunks + 1) * i * n)
                + 4 * heads)
            + f * 4 * heads
            // Falcon-H1's multipliers cast to the compute dtype, which
            // their product with `in_proj`'s output keeps.
            + (mup && b != 4) as u64 * lv * b * (i + c + heads);
        (per_token, 0, per_forward, live)
    }

    /// What a layer keeps per token, per position (the rotary
    /// embedding's cos and sin, shared by the rows) and once, and
    /// whether its output needs a gradient; `live`: whether its input
    /// does, `full`: whether its base trains, `r`: its adapters,
    /// `experts`: its mixture of experts in place of the MLP, `turns`:
    /// whether it turns its heads, `conv`: LFM2's convolution's kernel
    /// in place of attention. An adapter keeps its input (shared by the
    /// layers reading one tensor; under LoRA's dropout its own dropped
    /// copy, [`Widths::dropped`]) and its `A`'s output.
    fn layer(
        &self,
        (live, full): (bool, bool),
        r: &Ranks,
        experts: Option<&Experts>,
        (turns, mixer): (bool, Option<Mixer>),
    ) -> (u64, u64, u64, bool) {
        let Self {
            b,
            h,
            i,
            sandwich,
            pre_norms,
            gated,
            parallel,
            ..
        } = *self;
        // What reads one fused output needs a gradient where any part of
        // it does.
        let gate_up = r.gate_up > 0;
        let (mut per_token, mut per_forward) = (0, 0);
        if pre_norms && self.attention_norm {
            per_token += self.norm(live, full);
            per_forward += self.norm_weights(live);
        }
        let normed = live || (pre_norms && self.attention_norm && full);
        // Queries, keys and values read one tensor (and, side by side,
        // the MLP's gate and up).
        let mut readers = r.attention_ranks().to_vec();
        if parallel && !self.two_norms {
            readers.extend(r.mlp_ranks());
        }
        per_token += b * readers.iter().sum::<u64>() + self.dropped(h, &readers, normed);
        // Falcon-H1's attention and Mamba each read the normalised input
        // times a factor of its own: two tensors, each kept by its own
        // readers.
        match mixer {
            Some(Mixer::Beside(_)) => {
                let attention = Ranks { conv_in: 0, ..*r }.attention_ranks();
                per_token += self.shares(full, &attention) as u64 * b * h;
                per_token += self.shares(full, &[r.conv_in]) as u64 * b * h;
            }
            _ => per_token += self.shares(full, &readers) as u64 * b * h,
        }
        // The output projection keeps the attention's output where its
        // weight trains or its adapter reads it as it is.
        let o_kept = self.shares(full, &[r.o]);
        // BitNet's sub norm reads the attention's output in its place,
        // DiffLlama's combination of the heads' outputs.
        let o_reads = o_kept && !self.sub_norms && !self.differential;
        // Whether Falcon-H1's Mamba's output needs a gradient.
        let mut scan_live = false;
        let (token, per_position, forward, attended) = match (&self.latent, mixer) {
            (_, Some(Mixer::ShortConv(kernel))) => self.conv(kernel, (normed, full), r, o_reads),
            (_, Some(Mixer::Scan(s))) => self.scan(&s, (normed, full), r, o_reads),
            (_, Some(Mixer::Ssd(s))) => self.ssd(&s, (normed, full), r, o_reads),
            (_, Some(Mixer::Beside(s))) => {
                let (token, position, forward, attended) =
                    self.heads((normed, full), r, o_reads, turns);
                // The Mamba's `out_proj` under its own rank.
                let out = Ranks { o: r.out, ..*r };
                let (scan_token, _, scan_forward, scanned) =
                    self.ssd(&s, (normed, full), &out, self.shares(full, &[r.out]));
                scan_live = scanned || full || r.out > 0;
                let scan_token = scan_token + b * r.out + self.dropped(s.inner, &[r.out], scanned);
                (
                    token + scan_token,
                    position,
                    forward + scan_forward,
                    attended,
                )
            }
            (Some(m), None) => self.latent(m, (normed, full), r, (o_reads, turns)),
            (None, None) => self.heads((normed, full), r, o_reads, turns),
        };
        per_token += token;
        per_forward += forward;
        // DiffLlama's heads combined in pairs (`first - lambda second`),
        // then RMS-normalised without weights: the difference in fp32 (in
        // fp32 itself) and a reciprocal a pair of heads; `lambda` once a
        // forward, in the compute dtype, and the two exponentials it is
        // made of in fp32 where they train. The combination, its heads
        // merged, is a copy the output projection keeps.
        if self.differential {
            let (q, heads) = (self.q, self.heads);
            per_token += attended as u64 * (4 * q + 4 * (heads / 2)) + o_kept as u64 * b * q;
            per_forward += full as u64 * 2 * 4 + attended as u64 * b;
        }
        // BitNet's sub norm of the attention's output: its input in fp32
        // (in fp32 the attention's output itself, which the fused kernel
        // keeps already), a reciprocal a token and, where its weight
        // trains, its normalized values; its output is the output
        // projection's input.
        if self.sub_norms {
            let q = self.q;
            per_token += attended as u64 * (4 + (b != 4) as u64 * 4 * q)
                + full as u64 * b * q
                + o_kept as u64 * b * q;
        }
        let o_width = match mixer {
            Some(Mixer::ShortConv(_)) => self.h,
            Some(Mixer::Scan(s)) => s.inner,
            Some(Mixer::Ssd(s)) => s.inner,
            Some(Mixer::Beside(_)) | None => self.latent.map_or(self.q, |m| self.heads * m.v),
        };
        per_token += b * r.o + self.dropped(o_width, &[r.o], attended);
        let o_live = attended || full || r.o > 0 || scan_live;
        per_token += (self.resid_dropout.0 && o_live) as u64 * b * h;
        // Gemma 3 normalises the attention's output before the residual.
        if sandwich {
            per_token += self.norm(o_live, full);
            per_forward += self.norm_weights(o_live);
        }
        let mid = live || o_live;
        // The Mambas' layers end with the scan's output added.
        if !self.mlp {
            return (per_token, per_position, per_forward, mid);
        }
        // Doge's residuals times weights of their own: where those train,
        // each product keeps its residual, which in fp32 is the norm's
        // input already.
        if self.doge() && full && b != 4 {
            per_token += 2 * b * h;
        }
        if pre_norms && !parallel {
            per_token += self.norm(mid, full);
            per_forward += self.norm_weights(mid);
        }
        // Falcon's second LayerNorm of the same input: its mean and
        // reciprocal in the compute dtype.
        if self.two_norms {
            per_token += (live || full) as u64 * 2 * b;
        }
        let normed = match parallel {
            true => normed,
            false => mid || (pre_norms && full),
        };
        let down_live = match experts {
            Some(m) => {
                let (token, forward) = m.layer(b, h, normed, full);
                per_token += token;
                per_forward += forward;
                // DBRX's dropout of the experts' output keeps its mask.
                per_token += (self.resid_dropout.1 && normed) as u64 * b * h;
                normed
            }
            None => {
                // Gate and up read one tensor (the attention's too, side
                // by side after one norm: counted there).
                if !parallel || self.two_norms {
                    let readers = r.mlp_ranks();
                    per_token += self.shares(full, &readers) as u64 * b * h;
                    per_token += b * r.mlp_input() + self.dropped(h, &readers, normed);
                }
                let up_live = normed || full || gate_up || r.up > 0;
                let inner_live = match gated {
                    // The activation keeps the gate; the product keeps
                    // each factor for the other's gradient; where both
                    // need one, the gate and up alone, from which
                    // backward computes the activation again (`glu`).
                    true => {
                        let gate_live = normed || full || gate_up || r.gate > 0;
                        per_token += b
                            * i
                            * match (gate_live, up_live) {
                                (true, true) => 2 + self.scaled_gate as u64,
                                (gate, up) => 2 * gate as u64 + up as u64,
                            };
                        gate_live || up_live
                    }
                    // Arcee's ReLU keeps its output, which the square
                    // reads (the same tensor); StarCoder2's GELU its
                    // input; Apertus's xIELU its input too, computed
                    // again in backward (`xielu`), and its two factors
                    // cast to the compute dtype, once a forward. OPT's
                    // plain ReLU keeps its output, the down projection's
                    // input: counted there, or here where only the ReLU
                    // keeps it.
                    false => {
                        let down_keeps = self.shares(full, &[r.down]);
                        per_token += b * i * (up_live && !(self.relu && down_keeps)) as u64;
                        per_forward += (self.xielu && up_live) as u64 * 2 * b;
                        up_live
                    }
                };
                // BitNet's sub norm of the product: its input in fp32 (in
                // fp32 the product itself), a reciprocal a token, and its
                // normalized values where its weight trains.
                if self.sub_norms {
                    per_token += self.norm_of((i, 1), inner_live, full);
                }
                // The down projection keeps its input (the sub norm's
                // output, where there is one).
                per_token += self.shares(full, &[r.down]) as u64 * b * i;
                per_token += b * r.down + self.dropped(i, &[r.down], inner_live);
                let down_live = inner_live || full || r.down > 0;
                let dropped = self.resid_dropout.1 && !self.sum_dropped;
                per_token += (dropped && down_live) as u64 * b * h;
                down_live
            }
        };
        // And the MLP's.
        if sandwich {
            per_token += self.norm(down_live, full);
            per_forward += self.norm_weights(down_live);
        }
        per_token +=
            (self.sum_dropped && self.resid_dropout.1 && (o_live || down_live)) as u64 * b * h;
        let out = mid || down_live;
        (per_token, per_position, per_forward, out)
    }
}
