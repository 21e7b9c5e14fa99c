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

use std::sync::Arc;

use half::{bf16, f16};
use safetensors::Dtype;
use tch::{Kind, Tensor};
use zrt_collectives::ProcessGroup;
use zrt_kernels::cast;

use super::elems::Elems;
use super::frozen::dtype_of;
use super::offload::{read_words, FrozenSwap};
use super::Compute;
use crate::checkpoint::files::RankFile;
use crate::flat::FlatLayout;
use crate::EngineError;

/// One unit's frozen parameters: views (`set_data`) into `flat`, which has
/// storage only while the unit is gathered, and this rank's shard of it.
pub(super) struct Part {
    pub(super) layout: FlatLayout,
    pub(super) params: Vec<Tensor>,
    pub(super) flat: Tensor,
    /// The dtype the model created each parameter (slot) in: what a
    /// checkpoint holds it in (F32, BF16 or F16; the buffer may be
    /// narrower).
    pub(super) saved: Vec<Dtype>,
    /// Empty while a gather has it (it comes back with the gathered unit)
    /// and while it lives in `swap`.
    shard: Elems,
    compute: Compute,
    /// `offload_param`: the swap file holding the shard, and its region.
    swap: Option<(Arc<FrozenSwap>, usize)>,
}

impl Part {
    /// Takes `vars` (fp32 or `compute`'s dtype, [`shardable`], under one
    /// unit) over: world rank 0's values
    /// become everyone's (across `replicate` first, then inside `group`),
    /// the variables become views of a flat buffer of `compute`'s dtype,
    /// and this rank keeps its shard of it. The buffer stays full until
    /// the engine frees the unit. A collective.
    pub(super) fn new<G: ProcessGroup>(
        vars: Vec<(String, Tensor)>,
        compute: Compute,
        group: &G,
        replicate: Option<&G>,
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
            super::rank0_flat(&layout, &by_name, compute, group, replicate)?;
        let mut part = Self {
            layout,
            params,
            flat,
            saved,
            shard: Elems::empty(compute),
            compute,
            swap: None,
        };
        part.set(&values[part.layout.shard(group.rank())])?;
        Ok(part)
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
    /// values, in the compute dtype (written to the swap if it lives
    /// there). The buffer, if gathered, keeps its old values until the unit
    /// is gathered again.
    pub(super) fn set(&mut self, mine: &[f32]) -> Result<(), EngineError> {
        let held = match self.compute {
            Compute::F32 => Elems::F32(mine.to_vec()),
            Compute::Bf16 => {
                let mut v = vec![bf16::ZERO; mine.len()];
                cast::f32_to_bf16(mine, &mut v)?;
                Elems::Bf16(v)
            }
            Compute::F16 => {
                let mut v = vec![f16::ZERO; mine.len()];
                cast::f32_to_f16(mine, &mut v)?;
                Elems::F16(v)
            }
        };
        self.hold(held)
    }

    /// Makes this rank's range of the gathered buffer, which
    /// `with_full_params` saw changed, its shard.
    pub(super) fn keep_gathered(&mut self, rank: usize) -> Result<(), EngineError> {
        let range = self.layout.shard(rank);
        // SAFETY: the buffer is gathered (the caller fingerprinted it), read
        // under the engine's state lock.
        let mine = unsafe { Elems::of_flat(&self.flat, self.layout.padded, self.compute, range) };
        self.hold(mine)
    }

    /// Keeps `held` as the shard (in the swap if it lives there).
    fn hold(&mut self, held: Elems) -> Result<(), EngineError> {
        match &self.swap {
            Some((swap, k)) => swap.write(*k, &held.words())?,
            None => self.shard = held,
        }
        Ok(())
    }

    /// This rank's shard, for a gather (from the swap if it lives there:
    /// `ahead` when the parameter swap read it ahead, else read now);
    /// [`Part::give_back`] returns it.
    pub(super) fn take_shard(&mut self, ahead: Option<Vec<f32>>) -> Result<Elems, EngineError> {
        match (&self.swap, ahead) {
            (Some(_), Some(words)) => Ok(Elems::from_words(words, self.compute)),
            (Some(_), None) => self.copy_shard(),
            (None, _) => Ok(std::mem::replace(
                &mut self.shard,
                Elems::empty(self.compute),
            )),
        }
    }

    /// A copy of this rank's shard (read from the swap if it lives there).
    fn copy_shard(&self) -> Result<Elems, EngineError> {
        Ok(match &self.swap {
            Some((swap, k)) => Elems::from_words(read_words(&swap.swap, *k)?, self.compute),
            None => self.shard.clone(),
        })
    }

    /// Takes the shard back after a gather (dropped when the swap has it:
    /// frozen values do not change).
    pub(super) fn give_back(&mut self, shard: Elems) {
        if self.swap.is_none() {
            self.shard = shard;
        }
    }

    /// Moves the shard into region `k` of `swap` (`offload_param`).
    pub(super) fn offload(&mut self, swap: Arc<FrozenSwap>, k: usize) -> Result<(), EngineError> {
        let held = self.take_shard(None)?;
        swap.write(k, &held.words())?;
        self.swap = Some((swap, k));
        Ok(())
    }

    /// Words (f32-sized) of this rank's shard: what the swap holds.
    pub(super) fn shard_words(&self) -> usize {
        self.layout.shard_len() * self.compute.bytes() / 4
    }

    /// Takes this rank's shard of a checkpoint's values from `file` (its
    /// frozen file, which [`super::frozen::Frozen::read`] checked holds
    /// every one in its saved dtype and shape), reading only the shard's
    /// elements: no rank holds the whole frozen base to load it.
    pub(super) fn load(&mut self, file: &RankFile, rank: usize) -> Result<(), EngineError> {
        let range = self.layout.shard(rank);
        let mut mine = vec![0f32; range.len()];
        for (s, elems, dst) in self.layout.pieces(range) {
            file.read_widened(&s.name, elems, &mut mine[dst])?;
        }
        self.set(&mine)
    }

    /// The whole padded buffer widened to fp32 (each parameter at its
    /// slot's offset): what checkpoints and exports write. All-gathers the
    /// shards (a collective over `group`), so it works whether or not the
    /// unit is gathered.
    pub(super) fn whole<G: ProcessGroup>(&self, group: &G) -> Result<Vec<f32>, EngineError> {
        let full: Vec<f32> = match self.copy_shard()? {
            Elems::F32(v) => group.all_gather(v, Vec::new()).wait()?.1,
            Elems::Bf16(v) => {
                let h = group.all_gather(v, Vec::new()).wait()?.1;
                let mut w = vec![0f32; h.len()];
                cast::bf16_to_f32(&h, &mut w)?;
                w
            }
            Elems::F16(v) => {
                let h = group.all_gather(v, Vec::new()).wait()?.1;
                let mut w = vec![0f32; h.len()];
                cast::f16_to_f32(&h, &mut w)?;
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
