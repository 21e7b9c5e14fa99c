//! Gather buffers that outlive the gather: stage 3 gathers a unit straight
//! into a buffer that then *becomes* the unit's parameter storage
//! ([`glue::adopt_storage`](crate::glue::adopt_storage)), and when the unit
//! is freed the buffer comes back here for the next gather.
//!
//! Without it every gather paid twice over: a fresh output buffer (page
//! faults on the communication thread), then a fresh storage (page faults
//! again) and a copy on the compute thread — on a 2-core machine, time taken
//! from the model's matmuls. The role of the caching allocator FSDP2's
//! all-gather outputs come from.

use std::sync::Arc;

use half::{bf16, f16};
use parking_lot::Mutex;

/// Freed buffers of one element type, matched by exact length.
pub(super) struct Pool<T> {
    free: Mutex<Vec<Vec<T>>>,
}

/// Buffers a pool keeps per element type: a unit in use and the one being
/// prefetched is the steady state; more would only hold memory.
const KEEP: usize = 2;

impl<T: Copy + Send + 'static> Pool<T> {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            free: Mutex::new(Vec::new()),
        })
    }

    /// A buffer of `len` elements: a kept one of that length (its contents
    /// are stale, and the caller overwrites all of it), else `zero`-filled.
    pub(super) fn take(&self, len: usize, zero: T) -> Vec<T> {
        let mut free = self.free.lock();
        match free.iter().position(|v| v.len() == len) {
            Some(i) => free.swap_remove(i),
            None => {
                drop(free);
                vec![zero; len]
            }
        }
    }

    /// Keeps `v` for a later [`Pool::take`], or drops it when [`KEEP`] are
    /// kept already (the oldest goes: the newest is the likeliest size).
    pub(super) fn give(&self, v: Vec<T>) {
        let mut free = self.free.lock();
        if free.len() >= KEEP {
            free.remove(0);
        }
        free.push(v);
    }

    /// Bytes held by kept buffers.
    pub(super) fn bytes(&self) -> usize {
        self.free
            .lock()
            .iter()
            .map(|v| std::mem::size_of_val(v.as_slice()))
            .sum()
    }
}

/// One pool per compute dtype.
pub(super) struct Pools {
    pub(super) f32: Arc<Pool<f32>>,
    pub(super) bf16: Arc<Pool<bf16>>,
    pub(super) f16: Arc<Pool<f16>>,
}

impl Pools {
    pub(super) fn new() -> Self {
        Self {
            f32: Pool::new(),
            bf16: Pool::new(),
            f16: Pool::new(),
        }
    }

    /// Bytes held by every kept buffer.
    pub(super) fn bytes(&self) -> usize {
        self.f32.bytes() + self.bf16.bytes() + self.f16.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_by_exact_length_and_keeps_at_most_two() {
        let p = Pool::<f32>::new();
        let a = p.take(4, 0.0);
        assert_eq!(a, vec![0.0; 4]);
        p.give(vec![1.0; 4]);
        p.give(vec![2.0; 8]);
        // Same length: the kept buffer (stale contents), not a new one.
        assert_eq!(p.take(8, 0.0), vec![2.0; 8]);
        assert_eq!(p.take(3, 0.0), vec![0.0; 3], "no kept buffer of 3");
        p.give(vec![3.0; 5]);
        p.give(vec![4.0; 6]);
        assert_eq!(p.bytes(), (5 + 6) * 4, "the oldest (4 elements) went");
        assert_eq!(p.take(4, 0.0), vec![0.0; 4]);
    }

    #[test]
    fn the_bytes_count_every_dtypes_pool() {
        let p = Pools::new();
        p.f32.give(vec![0.0; 4]);
        p.bf16.give(vec![bf16::ZERO; 3]);
        p.f16.give(vec![f16::ZERO; 5]);
        assert_eq!(p.bytes(), 4 * 4 + 3 * 2 + 5 * 2);
    }
}
