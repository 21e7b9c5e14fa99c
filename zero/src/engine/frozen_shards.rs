//! Stage 3's sharded frozen parameters: the `requires_grad` false
//! parameters inside a wrapped module (a LoRA model's frozen base), held as
//! shards and gathered with their unit, as FSDP2 and ZeRO-3 hold them.
//!
//! Each such unit gets a second flat buffer beside its trainable one, in
//! the compute dtype (an fp32 frozen weight becomes bf16 under bf16
//! training, as DeepSpeed's `module.bfloat16()` makes it). It is never
//! reduced and has no optimizer state: this rank keeps its shard, the
//! unit's gathers fill the buffer, its frees empty it. Taken are fp32
//! parameters (the dtype trainable ones are created in) and those already
//! in the compute dtype (a LoRA base loaded in bf16 for bf16 training);
//! any other dtype, and buffers, stay replicated ([`super::frozen`]).
//!
//! Checkpoints and exports hold them whole, in the dtype the model created
//! each in, as a replicated model would write them: a stage-3 checkpoint
//! loads into any stage and back. With `offload_param` the shards live in
//! a swap file of their own (they do not train, so a gather reads them and
//! nothing writes them back; only a load or `with_full_params` does), read
//! ahead with the unit's trainable shard.
//!
//! With `zero_quantized_nontrainable_weights` the shard is held as int8
//! codes and scales ([`quant::quantize_cut`], groups cut at every
//! parameter's bounds, as qwZ's gathers are) and gathered so, every rank
//! unpacking the whole into the buffer: the true values are dropped once
//! the shard is packed, and everything after (forward, backward,
//! `with_full_params`, checkpoints) sees the unpacked ones. Packing
//! unpacked values again gives the same bytes, so a checkpoint resumes to
//! the same bits: in fp32 the scale `max / 127` survives `127 * scale /
//! 127` for every normal `max` below 2^127 and the codes are whole
//! numbers; a 16-bit base is saved in its dtype, and its largest
//! magnitude, a value of that dtype, comes back exactly from its 127 code
//! while the dtype's rounding moves the other codes by at most a quarter.

use std::sync::Arc;

use half::{bf16, f16};
use safetensors::Dtype;
use tch::{Kind, Tensor};
use zrt_collectives::ProcessGroup;
use zrt_kernels::{cast, quant};

use super::elems::Elems;
use super::frozen::dtype_of;
use super::offload::{read_words, recast, FrozenSwap};
use super::overlap::{pack, unpack_all, Fetch};
use super::pool::Pools;
use super::Compute;
use crate::checkpoint::files::ReadWidened;
use crate::flat::FlatLayout;
use crate::EngineError;

/// One unit's frozen parameters: views (`set_data`) into `flat`, which has
/// storage only while the unit is gathered, and this rank's shard of it.
pub(super) struct Part {
    /// The unit's name (for errors).
    unit: String,
    pub(super) layout: FlatLayout,
    pub(super) params: Vec<Tensor>,
    pub(super) flat: Tensor,
    /// The dtype the model created each parameter (slot) in: what a
    /// checkpoint holds it in (F32, BF16 or F16; the buffer may be
    /// narrower).
    pub(super) saved: Vec<Dtype>,
    /// Empty while a gather has it (it comes back with the gathered unit;
    /// a packed one never leaves) and while it lives in `swap`.
    shard: Held,
    /// `zero_quantized_nontrainable_weights`: every rank's cuts of its
    /// shard (its parameters' bounds), in rank order; `None`: unpacked.
    cuts: Option<Vec<Vec<usize>>>,
    /// This rank's place in the shard group.
    rank: usize,
    compute: Compute,
    /// `offload_param`: the swap file holding the shard, and its region.
    swap: Option<(Arc<FrozenSwap>, usize)>,
}

/// How a rank holds its shard of a unit's frozen parameters.
#[derive(Clone)]
enum Held {
    /// In the compute dtype.
    Exact(Elems),
    /// `zero_quantized_nontrainable_weights`: packed as
    /// [`quant::quantize_cut`] packs it, cut at the parameters' bounds.
    Packed(Vec<u8>),
}

impl Held {
    fn bytes(&self) -> usize {
        match self {
            Held::Exact(e) => e.bytes(),
            Held::Packed(b) => b.len(),
        }
    }

    /// The held bytes as f32-sized words, what the swap holds (a packed
    /// shard's last word padded with zero bytes; none are today: its
    /// scales take 4 bytes and its codes one per element of a shard whose
    /// length is a multiple of 16).
    fn words(&self) -> Vec<f32> {
        match self {
            Held::Exact(e) => e.words(),
            Held::Packed(b) => {
                let mut padded = b.clone();
                padded.resize(b.len().next_multiple_of(4), 0);
                recast(&padded)
            }
        }
    }
}

impl Part {
    /// Takes `vars` (fp32 or `compute`'s dtype, [`shardable`], under one
    /// unit) over: world rank 0's values (zeros from `source` File, until
    /// the file is loaded)
    /// become everyone's (across `replicate` first, then inside `group`),
    /// the variables become views of a flat buffer of `compute`'s dtype,
    /// and this rank keeps its shard of it, packed as int8 with `packed`.
    /// The buffer stays full (with the true values) until the engine frees
    /// the unit, which it does before it returns: the first forward
    /// gathers, packed. A collective.
    pub(super) fn new<G: ProcessGroup>(
        unit: &str,
        vars: Vec<(String, Tensor)>,
        compute: Compute,
        source: super::Source<'_>,
        group: &G,
        replicate: Option<&G>,
        packed: bool,
    ) -> Result<Self, EngineError> {
        let layout = FlatLayout::new(
            vars.iter().map(|(n, t)| (n.clone(), t.size())).collect(),
            group.size(),
        );
        let by_name: std::collections::HashMap<String, Tensor> = vars.into_iter().collect();
        // Read before the views replace the variables' data.
        // (A missing variable: `rank0_flat` names it next.)
        let saved = layout
            .slots
            .iter()
            .map(|s| {
                by_name
                    .get(&s.name)
                    .map_or(Ok(Dtype::F32), |t| dtype_of(&s.name, t.kind()))
            })
            .collect::<Result<_, _>>()?;
        // Widened to fp32 on the way (exact), narrowed back into the buffer.
        let (values, flat, params) =
            super::rank0_flat(&layout, &by_name, compute, (group, replicate), source)?;
        let cuts = packed.then(|| layout.shard_segments());
        let mut part = Self {
            unit: unit.to_string(),
            layout,
            params,
            flat,
            saved,
            shard: Held::Exact(Elems::empty(compute)),
            cuts,
            rank: group.rank(),
            compute,
            swap: None,
        };
        part.set(&values[part.layout.shard(part.rank)])?;
        Ok(part)
    }

    /// Whether the shard is held packed
    /// (`zero_quantized_nontrainable_weights`).
    pub(super) fn packed(&self) -> bool {
        self.cuts.is_some()
    }

    /// This rank's cuts of its shard, when packed.
    fn my_cuts(&self) -> Option<&[usize]> {
        self.cuts
            .as_ref()
            .and_then(|c| c.get(self.rank))
            .map(Vec::as_slice)
    }

    /// Elements gathered with the unit.
    pub(super) fn padded(&self) -> usize {
        self.layout.padded
    }

    /// Bytes this rank holds: the shard, and the buffer while gathered.
    pub(super) fn bytes(&self) -> Result<usize, EngineError> {
        Ok(self.shard.bytes() + crate::glue::storage_nbytes(&self.flat)?)
    }

    /// Makes `mine` (fp32, this rank's shard of the padded buffer) its
    /// values, in the compute dtype or packed (written to the swap if it
    /// lives there). The buffer, if gathered, keeps its old values until
    /// the unit is gathered again.
    pub(super) fn set(&mut self, mine: &[f32]) -> Result<(), EngineError> {
        let held = match (self.my_cuts(), self.compute) {
            (Some(cuts), _) => Held::Packed(pack(mine, cuts)?),
            (None, Compute::F32) => Held::Exact(Elems::F32(mine.to_vec())),
            (None, Compute::Bf16) => {
                let mut v = vec![bf16::ZERO; mine.len()];
                cast::f32_to_bf16(mine, &mut v)?;
                Held::Exact(Elems::Bf16(v))
            }
            (None, Compute::F16) => {
                let mut v = vec![f16::ZERO; mine.len()];
                cast::f32_to_f16(mine, &mut v)?;
                Held::Exact(Elems::F16(v))
            }
        };
        self.hold(held)
    }

    /// Makes this rank's range of the gathered buffer, which
    /// `with_full_params` saw changed, its shard (packed again, when
    /// packed).
    pub(super) fn keep_gathered(&mut self) -> Result<(), EngineError> {
        let range = self.layout.shard(self.rank);
        // SAFETY: the buffer is gathered (the caller fingerprinted it), read
        // under the engine's state lock.
        let mine = unsafe { Elems::of_flat(&self.flat, self.layout.padded, self.compute, range) };
        let held = match (self.my_cuts(), mine) {
            (None, mine) => Held::Exact(mine),
            (Some(cuts), Elems::F32(v)) => Held::Packed(pack(&v, cuts)?),
            (Some(cuts), Elems::Bf16(v)) => Held::Packed(pack(&v, cuts)?),
            (Some(cuts), Elems::F16(v)) => Held::Packed(pack(&v, cuts)?),
        };
        self.hold(held)
    }

    /// Keeps `held` as the shard (in the swap if it lives there).
    fn hold(&mut self, held: Held) -> Result<(), EngineError> {
        match &self.swap {
            Some((swap, k)) => swap.write(*k, &held.words())?,
            None => self.shard = held,
        }
        Ok(())
    }

    /// Issues the all-gather of this rank's shard over `g` (from the swap
    /// if it lives there: `ahead` when the parameter swap read it ahead,
    /// else read now), and whether the shard went with it (then
    /// [`Part::give_back`] returns it): an unpacked one goes (a copy of
    /// the whole unit is made from it), a packed one is copied (a
    /// quarter or half of that, and the gather returns no shard).
    pub(super) fn gather<G: ProcessGroup>(
        &mut self,
        g: &G,
        pools: &Pools,
        ahead: Option<Vec<f32>>,
    ) -> Result<(Fetch, bool), EngineError> {
        let held = match (&self.swap, ahead) {
            (Some(_), Some(words)) => self.held_of_words(words),
            (Some(_), None) => self.copy_shard()?,
            (None, _) if self.cuts.is_some() => self.shard.clone(),
            (None, _) => {
                std::mem::replace(&mut self.shard, Held::Exact(Elems::empty(self.compute)))
            }
        };
        Ok(match held {
            Held::Exact(e) => (e.gather(g, self.layout.padded, pools), true),
            Held::Packed(b) => (
                Fetch::Packed(g.all_gather_v(b, Vec::new()), self.all_cuts().to_vec()),
                false,
            ),
        })
    }

    /// Every rank's cuts (none unless packed: a packed gather unpacked
    /// with none fails its length check).
    fn all_cuts(&self) -> &[Vec<usize>] {
        self.cuts.as_deref().unwrap_or_default()
    }

    /// The swap's words back as what [`Held::words`] wrote.
    fn held_of_words(&self, words: Vec<f32>) -> Held {
        match self.my_cuts() {
            Some(cuts) => {
                let mut b: Vec<u8> = recast(&words);
                b.truncate(quant::packed_len_cut(cuts));
                Held::Packed(b)
            }
            None => Held::Exact(Elems::from_words(words, self.compute)),
        }
    }

    /// A copy of this rank's shard (read from the swap if it lives there).
    fn copy_shard(&self) -> Result<Held, EngineError> {
        Ok(match &self.swap {
            Some((swap, k)) => self.held_of_words(read_words(&swap.swap, *k)?),
            None => self.shard.clone(),
        })
    }

    /// Takes the shard back after a gather (dropped when the swap has it:
    /// frozen values do not change).
    pub(super) fn give_back(&mut self, shard: Elems) {
        if self.swap.is_none() {
            self.shard = Held::Exact(shard);
        }
    }

    /// Moves the shard into region `k` of `swap` (`offload_param`).
    pub(super) fn offload(&mut self, swap: Arc<FrozenSwap>, k: usize) -> Result<(), EngineError> {
        let held = std::mem::replace(&mut self.shard, Held::Exact(Elems::empty(self.compute)));
        swap.write(k, &held.words())?;
        self.swap = Some((swap, k));
        Ok(())
    }

    /// Words (f32-sized) of this rank's shard: what the swap holds.
    pub(super) fn shard_words(&self) -> usize {
        match self.my_cuts() {
            Some(cuts) => quant::packed_len_cut(cuts).div_ceil(4),
            None => self.layout.shard_len() * self.compute.bytes() / 4,
        }
    }

    /// Takes this rank's shard of a checkpoint's values from `file` (its
    /// frozen file, which [`super::frozen::Frozen::read`] checked holds
    /// every one in its saved dtype and shape), reading only the shard's
    /// elements: no rank holds the whole frozen base to load it.
    pub(super) fn load(&mut self, file: &impl ReadWidened) -> Result<(), EngineError> {
        let range = self.layout.shard(self.rank);
        let mut mine = vec![0f32; range.len()];
        for (s, elems, dst) in self.layout.pieces(range) {
            file.read_widened(&s.name, elems, &mut mine[dst])?;
        }
        self.set(&mine)
    }

    /// The whole padded buffer widened to fp32 (each parameter at its
    /// slot's offset; unpacked, when packed): what checkpoints and exports
    /// write. All-gathers the shards (a collective over `group`), so it
    /// works whether or not the unit is gathered.
    pub(super) fn whole<G: ProcessGroup>(&self, group: &G) -> Result<Vec<f32>, EngineError> {
        let full: Vec<f32> = match self.copy_shard()? {
            Held::Exact(Elems::F32(v)) => group.all_gather(v, Vec::new()).wait()?.1,
            Held::Exact(Elems::Bf16(v)) => {
                let h = group.all_gather(v, Vec::new()).wait()?.1;
                let mut w = vec![0f32; h.len()];
                cast::bf16_to_f32(&h, &mut w)?;
                w
            }
            Held::Exact(Elems::F16(v)) => {
                let h = group.all_gather(v, Vec::new()).wait()?.1;
                let mut w = vec![0f32; h.len()];
                cast::f16_to_f32(&h, &mut w)?;
                w
            }
            Held::Packed(b) => {
                let packed = group.all_gather_v(b, Vec::new()).wait()?.1;
                let mut w = vec![0f32; self.layout.padded];
                let what = (self.unit.as_str(), "'s frozen parameters");
                unpack_all(what, &packed, self.all_cuts(), &mut w)?;
                w
            }
        };
        if full.len() != self.layout.padded {
            return Err(EngineError::Plan(format!(
                "frozen parameters gathered {} elements but the layout has {}: did every rank build the same model?",
                full.len(),
                self.layout.padded
            )));
        }
        Ok(full)
    }

    /// Gives the buffer zeroed memory (after a failed gather, so autograd
    /// computes garbage instead of reading freed storage).
    pub(super) fn zero_fill(&self) {
        let bytes = self.layout.padded * self.compute.bytes();
        if crate::glue::realloc_storage(&self.flat, bytes).is_ok() {
            let _ = self.flat.shallow_clone().f_zero_();
        }
    }
}

/// Whether `t`, a frozen parameter, is one stage 3 can shard under
/// `compute`: fp32 or `compute` itself (the buffer holds `compute`; a
/// bf16 weight under fp16 training would change its values, and one under
/// fp32 training its dtype, so those stay replicated), and more than
/// `threshold` elements (others stay gathered, as
/// `stage3_param_persistence_threshold` keeps small trainable ones).
pub(super) fn shardable(t: &Tensor, compute: Kind, threshold: usize) -> bool {
    (t.kind() == Kind::Float || t.kind() == compute) && t.numel() > threshold
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp32_or_the_compute_dtype_over_the_threshold_is_sharded() {
        let of = |kind: Kind, n: i64| Tensor::zeros([n], (kind, tch::Device::Cpu));
        // fp32, or already the compute dtype (a bf16 LoRA base).
        assert!(shardable(&of(Kind::Float, 11), Kind::BFloat16, 10));
        assert!(shardable(&of(Kind::BFloat16, 11), Kind::BFloat16, 10));
        assert!(shardable(&of(Kind::Float, 11), Kind::Float, 10));
        // Another 16-bit dtype would change values; a bf16 weight under
        // fp32 training would change dtype.
        assert!(!shardable(&of(Kind::Half, 11), Kind::BFloat16, 10));
        assert!(!shardable(&of(Kind::BFloat16, 11), Kind::Float, 10));
        assert!(!shardable(&of(Kind::Double, 11), Kind::Float, 10));
        // At or under the threshold it stays gathered, in any dtype
        // (DeepSpeed persists `ds_numel <= threshold`); a threshold of 0
        // shards everything (but an empty tensor).
        assert!(!shardable(&of(Kind::Float, 10), Kind::Float, 10));
        assert!(!shardable(&of(Kind::Half, 9), Kind::Float, 10));
        assert!(shardable(&of(Kind::Float, 1), Kind::Float, 0));
        assert!(!shardable(&of(Kind::Float, 0), Kind::Float, 0));
    }
}
