//! A generation's key-value cache, shared by the decoder layouts.
//!
//! While [`crate::hf::HfModel::greedy`] or `sample` run, each attention
//! layer keeps the keys and values of the tokens so far, and each forward
//! takes only the tokens after them: a new token costs a forward over
//! itself rather than over the whole sequence (`transformers`'
//! `use_cache=True`). A model owns one [`Decoding`]; each of its layers
//! holds a [`LayerCache`] slot in it, so starting and ending a generation
//! touches the model only, not every (sharded) layer.
//!
//! Training and plain forwards never see it: it is off unless a
//! generation switched it on.
//!
//! The [`Decoding`] also carries what a forward of packed documents
//! ([`crate::packing`]) tells every layer: each token's position in its
//! document and which keys each query sees, until the next forward; a
//! checkpointed layer takes them with its forward and puts them back for
//! its recompute (`blocks::Run::with_state`).

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tch::{Kind, Tensor};

use crate::llama::balance::Tally;
use crate::llama::{rope_at, rope_from, Rotary};
use crate::packing::Documents;

/// One model's switch, the tokens its layers' caches hold, and the caches.
#[derive(Debug)]
pub(crate) struct Decoding {
    on: AtomicBool,
    /// How many tokens the caches hold: the next forward's first position.
    offset: AtomicI64,
    /// The longest sequence every layer can be cached for (see
    /// [`LayerCache::new`]); `i64::MAX` unless a layer said less.
    longest: AtomicI64,
    /// Per layer, the keys (after any rotary turn) and values so far,
    /// `[batch, kv_heads, seq, head_dim]`.
    slots: Mutex<Vec<Option<(Tensor, Tensor)>>>,
    /// The last forward's packed documents, if it was given any.
    documents: Mutex<Option<Documents>>,
    /// The last ALiBi mask its layers attended with, by its queries,
    /// offset and dtype: every layer of one forward computes the same
    /// (MPT's and BLOOM's slopes are the model's, not a layer's).
    alibi: Mutex<Option<(AlibiKey, Tensor)>>,
    /// The last sliding window's mask its layers attended with, as
    /// scores (0, or minus infinity where a key is out of the window),
    /// by its queries, offset, window and dtype: every windowed layer of
    /// one forward shares it, and autograd keeps one copy for them all
    /// (given the window as a boolean mask, each layer's attention made
    /// and kept scores of its own, a row's squared each).
    window: Mutex<Option<(WindowKey, Tensor)>>,
    /// The last chunks' mask Llama 4's chunked layers attended with, as
    /// scores, by its queries, offset, chunk and dtype: shared as the
    /// window's is (each layer's own kept a row's squared scores each,
    /// 18 GiB over Llama 4 Scout's 36 chunked layers at 16384 tokens
    /// in bf16).
    chunks: Mutex<Option<(WindowKey, Tensor)>>,
    /// The running forward's router balance (`output_router_logits`),
    /// and whether its layers record into it (not in a checkpointed
    /// layer's recompute).
    tally: Mutex<Option<(Arc<Tally>, bool)>>,
    /// The last forward's z-loss term (Bamba's `z_loss_coefficient`),
    /// with its graph, until a loss takes it.
    z_loss: Mutex<Option<Tensor>>,
}

/// What an ALiBi mask is made for: its queries, their offset, its dtype.
type AlibiKey = (i64, i64, Kind);

/// What a window's mask is made for: its queries, their offset, the
/// window (a chunk's: the chunk), its dtype.
type WindowKey = (i64, i64, i64, Kind);

/// The boolean mask `visible` as the attention turns it into scores in
/// `kind`: 0 where a query sees a key, minus infinity elsewhere.
fn scores(visible: &Tensor, kind: Kind) -> Tensor {
    Tensor::zeros(visible.size(), (kind, visible.device()))
        .masked_fill(&visible.logical_not(), f64::NEG_INFINITY)
}

/// The mask `slot` holds for `key`, else `make`'s, then held there for
/// the layers after (every layer of one forward asks for the same).
fn shared<K: PartialEq>(
    slot: &Mutex<Option<(K, Tensor)>>,
    key: K,
    make: impl FnOnce() -> Tensor,
) -> Tensor {
    let mut held = slot.lock();
    if let Some((k, mask)) = held.as_ref() {
        if *k == key {
            return mask.shallow_clone();
        }
    }
    let mask = make();
    *held = Some((key, mask.shallow_clone()));
    mask
}

impl Decoding {
    /// A model's, off, no layer yet.
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            on: AtomicBool::new(false),
            offset: AtomicI64::new(0),
            longest: AtomicI64::new(i64::MAX),
            slots: Mutex::new(Vec::new()),
            documents: Mutex::new(None),
            alibi: Mutex::new(None),
            window: Mutex::new(None),
            chunks: Mutex::new(None),
            tally: Mutex::new(None),
            z_loss: Mutex::new(None),
        })
    }

    /// Whether a generation with caches is running.
    pub(crate) fn generating(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Sets the router balance this forward's layers see (and whether
    /// they record into it), until another is set or a loss takes it.
    pub(crate) fn set_tally(&self, tally: Option<(Arc<Tally>, bool)>) {
        *self.tally.lock() = tally;
    }

    /// The router balance the layers see, if any.
    pub(crate) fn tally(&self) -> Option<(Arc<Tally>, bool)> {
        self.tally.lock().clone()
    }

    /// The last forward's router balance, taken: a loss adds it once.
    pub(crate) fn take_tally(&self) -> Option<Arc<Tally>> {
        self.tally.lock().take().map(|(t, _)| t)
    }

    /// Sets the last forward's z-loss term (`None`: it has none).
    pub(crate) fn set_z_loss(&self, term: Option<Tensor>) {
        *self.z_loss.lock() = term;
    }

    /// The last forward's z-loss term, taken: a loss adds it once.
    pub(crate) fn take_z_loss(&self) -> Option<Tensor> {
        self.z_loss.lock().take()
    }

    /// Sets the documents this forward's tokens are packed in (`None`: a
    /// plain causal forward), for every layer, until the next forward
    /// sets others.
    pub(crate) fn set_documents(&self, documents: Option<Documents>) {
        *self.documents.lock() = documents;
        // The mask held was the last documents'.
        *self.alibi.lock() = None;
        *self.window.lock() = None;
        *self.chunks.lock() = None;
    }

    /// The documents the last forward ran with, if any.
    pub(crate) fn documents(&self) -> Option<Documents> {
        self.documents.lock().as_ref().map(Documents::shared)
    }

    /// Starts a generation that runs to at most `longest` tokens (the
    /// prompt and the new ones) with every cache empty, unless some layer
    /// cannot be cached that far; says whether it started.
    pub(crate) fn start(&self, longest: i64) -> bool {
        if longest > self.longest.load(Ordering::Relaxed) {
            return false;
        }
        self.end();
        self.on.store(true, Ordering::Relaxed);
        true
    }

    /// Ends a generation, dropping what the caches hold.
    pub(crate) fn end(&self) {
        self.on.store(false, Ordering::Relaxed);
        self.offset.store(0, Ordering::Relaxed);
        self.slots.lock().iter_mut().for_each(|s| *s = None);
    }

    /// A forward of `tokens` (`[batch, seq]`) ran through every layer:
    /// the caches hold its tokens now.
    pub(crate) fn advance(&self, tokens: &Tensor) {
        if self.on.load(Ordering::Relaxed) {
            let t = tokens.size().last().copied().unwrap_or(0);
            self.offset.fetch_add(t, Ordering::Relaxed);
        }
    }

    /// Where this forward's tokens start: the caches' length, 0 when no
    /// generation runs with a cache.
    pub(crate) fn offset(&self) -> i64 {
        match self.on.load(Ordering::Relaxed) {
            true => self.offset.load(Ordering::Relaxed),
            false => 0,
        }
    }

    /// This forward's `tokens`' positions (int64, for learned position
    /// embeddings): each token's in its document when packed
    /// ([`Decoding::set_documents`] first), else its row's, after the
    /// tokens the caches hold when generating.
    pub(crate) fn positions(&self, tokens: &Tensor) -> Tensor {
        if let Some(d) = self.documents() {
            return d.positions.shallow_clone();
        }
        let t = tokens.size().get(1).copied().unwrap_or(1);
        let opts = (Kind::Int64, tokens.device());
        match self.offset() {
            0 => Tensor::arange(t, opts),
            o => Tensor::arange_start(o, o + t, opts),
        }
    }
}

/// One attention layer's place in its model's [`Decoding`].
#[derive(Debug)]
pub(crate) struct LayerCache {
    decoding: Arc<Decoding>,
    slot: usize,
}

impl LayerCache {
    /// A slot in `decoding` for one layer, which can be cached for
    /// sequences of up to `up_to` tokens (`None`: any). A rotary embedding
    /// whose frequencies change with the sequence's length (`dynamic`
    /// past `max_position_embeddings`, LongRoPE past its original length)
    /// turns every key at the current length's when it runs over the
    /// whole sequence, while a cache's keys were turned at the lengths
    /// they came at: a generation that may run past `up_to` goes
    /// uncached, a full forward a token.
    pub(crate) fn new(decoding: &Arc<Decoding>, up_to: Option<i64>) -> Self {
        if let Some(n) = up_to {
            decoding.longest.fetch_min(n, Ordering::Relaxed);
        }
        let mut slots = decoding.slots.lock();
        slots.push(None);
        Self {
            decoding: decoding.clone(),
            slot: slots.len() - 1,
        }
    }

    /// Where this forward's tokens start (see [`Decoding::offset`]).
    pub(crate) fn offset(&self) -> i64 {
        self.decoding.offset()
    }

    /// The documents this forward's tokens are packed in (see
    /// [`Decoding::documents`]).
    pub(crate) fn documents(&self) -> Option<Documents> {
        self.decoding.documents()
    }

    /// The ALiBi mask for `t` queries after `offset` in `kind`: the one
    /// an earlier layer of this forward made, else `make`'s, kept for
    /// the layers after it (and for recomputing them in backward) until
    /// the next forward sets its documents.
    pub(crate) fn alibi_mask(&self, key: AlibiKey, make: impl FnOnce() -> Tensor) -> Tensor {
        shared(&self.decoding.alibi, key, make)
    }

    /// The scores masking `t` queries after `offset` to a window of `w`
    /// tokens in `kind`, `visible` (`[t, offset + t]`, true where a
    /// query sees a key) as the attention would turn it into scores: the
    /// one an earlier layer of this forward made, else made and kept for
    /// the layers after it (and for recomputing them in backward) until
    /// the next forward sets its documents.
    pub(crate) fn window_mask(&self, key: WindowKey, visible: impl FnOnce() -> Tensor) -> Tensor {
        let kind = key.3;
        shared(&self.decoding.window, key, || scores(&visible(), kind))
    }

    /// As [`LayerCache::window_mask`], for chunks of `key.2` tokens
    /// (Llama 4's), `visible` true where a query sees a key (within
    /// its chunk, and its document when packed).
    pub(crate) fn chunk_mask(&self, key: WindowKey, visible: impl FnOnce() -> Tensor) -> Tensor {
        let kind = key.3;
        shared(&self.decoding.chunks, key, || scores(&visible(), kind))
    }

    /// Causal attention of `q`, `k` and `v` (`[batch, heads, seq,
    /// head_dim]`, not yet turned) through this cache: the queries and
    /// keys turned by `rotary` at the positions after the cache's, the
    /// keys and values joined to it (see [`causal_attention`]).
    pub(crate) fn rotary_attention(
        &self,
        rotary: &Rotary,
        qkv: (Tensor, Tensor, Tensor),
        dropout: f64,
        grouped: bool,
    ) -> Tensor {
        self.attention(Some(rotary), qkv, None, dropout, grouped)
    }

    /// As [`LayerCache::rotary_attention`], turned by `rotary` when
    /// given, the scores scaled by `scale` (`None`: one over the root of
    /// the heads' width).
    pub(crate) fn attention(
        &self,
        rotary: Option<&Rotary>,
        (q, k, v): (Tensor, Tensor, Tensor),
        scale: Option<f64>,
        dropout: f64,
        grouped: bool,
    ) -> Tensor {
        if let Some(d) = self.documents() {
            let (q, k) = match rotary {
                Some(r) => (rope_at(&q, r, &d), rope_at(&k, r, &d)),
                None => (q, k),
            };
            return d.attend((&q, &k, &v), None, scale, dropout, grouped);
        }
        let offset = self.offset();
        let (q, k) = match rotary {
            Some(r) => (rope_from(&q, r, offset), rope_from(&k, r, offset)),
            None => (q, k),
        };
        let (k, v) = self.extend(k, v);
        scaled_causal_attention(&q, &k, &v, (offset, scale), dropout, grouped)
    }

    /// A recurrent layer's state while generating (the Mamba layers of
    /// Granite 4.0, Bamba, Jamba, Falcon-H1 and the Mambas: its
    /// convolution's last inputs and its scan's state; LFM2's
    /// convolution layers: their last inputs, twice; MiniMax's lightning
    /// layers: their decayed sum of `k^T v`, twice; Qwen3-Next's DeltaNet
    /// layers: their convolution's last inputs and the delta rule's
    /// state; RecurrentGemma's recurrent layers: their convolution's last
    /// inputs and the RG-LRU's fp32 state), as the last
    /// forward left it; `None` when not generating, or before the
    /// generation's first forward.
    pub(crate) fn state(&self) -> Option<(Tensor, Tensor)> {
        if !self.decoding.on.load(Ordering::Relaxed) {
            return None;
        }
        let slots = self.decoding.slots.lock();
        let (a, b) = slots.get(self.slot)?.as_ref()?;
        Some((a.shallow_clone(), b.shallow_clone()))
    }

    /// Whether a generation runs with a cache: what
    /// [`LayerCache::keep_state`] is given is kept only then (a layer
    /// whose state costs work to make skips it otherwise).
    pub(crate) fn generating(&self) -> bool {
        self.decoding.generating()
    }

    /// Keeps a recurrent layer's `state` for the next forward while
    /// generating (see [`LayerCache::state`]); nothing otherwise.
    pub(crate) fn keep_state(&self, state: (Tensor, Tensor)) {
        if !self.decoding.on.load(Ordering::Relaxed) {
            return;
        }
        if let Some(slot) = self.decoding.slots.lock().get_mut(self.slot) {
            *slot = Some(state);
        }
    }

    /// This forward's keys and values `[batch, kv_heads, seq, head_dim]`
    /// with the cached ones before them, kept for the next forward; as
    /// they are when no generation runs with a cache.
    pub(crate) fn extend(&self, k: Tensor, v: Tensor) -> (Tensor, Tensor) {
        if !self.decoding.on.load(Ordering::Relaxed) {
            return (k, v);
        }
        let mut slots = self.decoding.slots.lock();
        let Some(slot) = slots.get_mut(self.slot) else {
            return (k, v);
        };
        let both = match slot.take() {
            Some((pk, pv)) => (Tensor::cat(&[pk, k], 2), Tensor::cat(&[pv, v], 2)),
            None => (k, v),
        };
        *slot = Some((both.0.shallow_clone(), both.1.shallow_clone()));
        both
    }
}

/// Causal attention (libtorch's fused kernel) of queries `q` `[batch,
/// heads, seq, hd]` at positions `offset..` over keys and values from
/// position 0 (a cache's before this forward's): a query sees its own
/// position and every earlier one. `grouped`: fewer key-value heads than
/// query heads.
pub(crate) fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    offset: i64,
    dropout: f64,
    grouped: bool,
) -> Tensor {
    scaled_causal_attention(q, k, v, (offset, None), dropout, grouped)
}

/// [`causal_attention`], the scores scaled by `scale` (`None`: one over
/// the root of the heads' width).
pub(crate) fn scaled_causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (offset, scale): (i64, Option<f64>),
    dropout: f64,
    grouped: bool,
) -> Tensor {
    let t = q.size()[2];
    // libtorch's `is_causal` aligns the queries with the first keys, not
    // the last: past a cache, an explicit mask (none for one query, which
    // sees every key).
    let mask = (offset > 0 && t > 1).then(|| {
        let opts = (Kind::Int64, q.device());
        let i = Tensor::arange_start(offset, offset + t, opts);
        let j = Tensor::arange(offset + t, opts);
        (i.unsqueeze(1) - j.unsqueeze(0)).ge(0)
    });
    Tensor::scaled_dot_product_attention(q, k, v, mask, dropout, offset == 0, scale, grouped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn attention_over_a_cache_is_the_full_sequences_last_rows() {
        tch::manual_seed(0);
        let opts = (Kind::Float, Device::Cpu);
        let (q, k, v) = (
            Tensor::randn([1, 2, 7, 4], opts),
            Tensor::randn([1, 2, 7, 4], opts),
            Tensor::randn([1, 2, 7, 4], opts),
        );
        let full = causal_attention(&q, &k, &v, 0, 0.0, false);
        // The last 3 queries after 4 cached tokens, then the last alone.
        for (offset, t) in [(4, 3), (6, 1)] {
            let part = causal_attention(&q.narrow(2, offset, t), &k, &v, offset, 0.0, false);
            let want = full.narrow(2, offset, t);
            assert!(part.allclose(&want, 1e-6, 1e-6, false), "offset {offset}");
        }
    }

    #[test]
    fn a_layer_cache_keeps_keys_only_while_a_generation_runs() {
        let d = Decoding::new();
        let (a, b) = (LayerCache::new(&d, None), LayerCache::new(&d, None));
        let kv = |n: i64| Tensor::ones([1, 1, n, 2], (Kind::Float, Device::Cpu));
        // Off: nothing kept.
        let (k, _) = a.extend(kv(3), kv(3));
        assert_eq!((k.size()[2], a.offset()), (3, 0));
        assert!(d.start(1 << 40));
        assert_eq!(a.extend(kv(3), kv(3)).0.size()[2], 3);
        assert_eq!(b.extend(kv(3), kv(3)).0.size()[2], 3);
        d.advance(&Tensor::zeros([1, 3], (Kind::Int64, Device::Cpu)));
        assert_eq!(a.offset(), 3);
        let (k, v) = a.extend(kv(1), kv(1));
        assert_eq!((k.size()[2], v.size()[2]), (4, 4));
        // Each layer its own slot.
        assert_eq!(b.extend(kv(1), kv(1)).0.size()[2], 4);
        d.end();
        assert_eq!((a.offset(), a.extend(kv(1), kv(1)).0.size()[2]), (0, 1));
        // A layer that can be cached up to 16 tokens keeps longer
        // generations uncached.
        let _c = LayerCache::new(&d, Some(16));
        assert!(!d.start(17));
        assert_eq!(a.extend(kv(2), kv(2)).0.size()[2], 2);
        assert!(d.start(16));
    }
}
