//! Owned elements of the compute dtype: a stage-3 frozen shard, an hpZ
//! secondary copy. One type, so that every such buffer is sliced from a
//! gathered flat tensor, swapped and all-gathered the same way.

use half::{bf16, f16};
use tch::Tensor;
use zrt_collectives::ProcessGroup;

use super::offload::recast;
use super::overlap::Fetch;
use super::pool::Pools;
use super::{elems, Compute};

/// Elements of the compute dtype.
#[derive(Clone)]
pub(super) enum Elems {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl Elems {
    /// None of `compute`'s dtype.
    pub(super) fn empty(compute: Compute) -> Self {
        Self::from_words(Vec::new(), compute)
    }

    /// A copy of `range` of `flat`, a flat tensor of `compute`'s dtype with
    /// `padded` elements.
    ///
    /// # Safety
    /// As [`elems()`]: `flat` has storage for `padded` elements of that dtype
    /// and nothing writes it meanwhile (the engine's state lock).
    pub(super) unsafe fn of_flat(
        flat: &Tensor,
        padded: usize,
        compute: Compute,
        range: std::ops::Range<usize>,
    ) -> Self {
        match compute {
            Compute::F32 => Elems::F32(elems::<f32>(flat, padded)[range].to_vec()),
            Compute::Bf16 => Elems::Bf16(elems::<bf16>(flat, padded)[range].to_vec()),
            Compute::F16 => Elems::F16(elems::<f16>(flat, padded)[range].to_vec()),
        }
    }

    /// Bytes held.
    pub(super) fn bytes(&self) -> usize {
        match self {
            Elems::F32(v) => 4 * v.len(),
            Elems::Bf16(v) => 2 * v.len(),
            Elems::F16(v) => 2 * v.len(),
        }
    }

    /// The values as f32-sized words (a swap's unit; the engine's shard
    /// lengths are multiples of 16, so 16-bit ones pair up).
    pub(super) fn words(&self) -> Vec<f32> {
        match self {
            Elems::F32(v) => v.clone(),
            Elems::Bf16(v) => recast(v),
            Elems::F16(v) => recast(v),
        }
    }

    /// [`Elems::words`] back, in `compute`'s dtype.
    pub(super) fn from_words(w: Vec<f32>, compute: Compute) -> Self {
        match compute {
            Compute::F32 => Elems::F32(w),
            Compute::Bf16 => Elems::Bf16(recast(&w)),
            Compute::F16 => Elems::F16(recast(&w)),
        }
    }

    /// Issues the all-gather of these elements over `g` into a pooled
    /// buffer of `padded` elements.
    pub(super) fn gather<G: ProcessGroup>(self, g: &G, padded: usize, pools: &Pools) -> Fetch {
        match self {
            Elems::F32(v) => Fetch::F32(g.all_gather(v, pools.f32.take(padded, 0.0))),
            Elems::Bf16(v) => Fetch::Bf16(g.all_gather(v, pools.bf16.take(padded, bf16::ZERO))),
            Elems::F16(v) => Fetch::F16(g.all_gather(v, pools.f16.take(padded, f16::ZERO))),
        }
    }
}
