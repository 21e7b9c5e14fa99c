//! What libtorch allocates on the CPU, counted (`csrc/allocated.cpp`):
//! the CPU's counterpart of `torch.cuda.memory_allocated` and
//! `max_memory_allocated`. A rank's activations, the tensors autograd saves
//! for backward and its temporaries are all here; the engine's flat
//! buffers (shards, gathered units, gradients once reduced, optimizer
//! state) are not, being Rust's own memory, so a rank's peak resident set
//! is roughly its model state, the units in flight and this count's peak.
//!
//! The count is process-wide: ranks that are threads of one process (the
//! local backend) share it.

use std::ffi::c_char;

use super::{check, GlueError};

mod ffi {
    use super::*;

    extern "C" {
        pub fn zrt_alloc_track() -> *mut c_char;
        pub fn zrt_alloc_now() -> i64;
        pub fn zrt_alloc_peak() -> i64;
        pub fn zrt_alloc_reset_peak();
    }
}

/// Bytes libtorch holds on the CPU through its allocator, since
/// [`track_allocations`] turned the count on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocated {
    /// Held now.
    pub now: u64,
    /// The most held at once since the count began or since
    /// [`reset_peak_allocated`].
    pub peak: u64,
}

/// Turns the count on, once per process (later calls do nothing); the
/// engine does when it is built under `memory_breakdown`. Each allocation from then on costs two
/// atomic additions and 64 bytes more. Memory allocated before is not
/// counted, and neither is its release. Fails if another CPU allocator
/// has taken libtorch's place with a higher priority.
pub fn track_allocations() -> Result<(), GlueError> {
    // SAFETY: installs the counting allocator under a `std::call_once`.
    check("track_allocations", unsafe { ffi::zrt_alloc_track() })
}

/// What libtorch holds now and has held at most (both 0 until
/// [`track_allocations`]).
pub fn allocated() -> Allocated {
    // SAFETY: atomic loads.
    let (now, peak) = unsafe { (ffi::zrt_alloc_now(), ffi::zrt_alloc_peak()) };
    Allocated {
        now: now.max(0) as u64,
        peak: peak.max(0) as u64,
    }
}

/// Starts a new peak from what is held now (`torch.cuda.reset_peak_memory_stats`).
pub fn reset_peak_allocated() {
    // SAFETY: atomic load and store.
    unsafe { ffi::zrt_alloc_reset_peak() }
}

#[cfg(test)]
mod tests {
    // What the count reads is tested in `tests/activation_memory.rs`, a
    // binary of its own: the count is process-wide, and this crate's other
    // unit tests allocate on threads beside it.
    #[test]
    fn the_count_turns_on_once() {
        super::track_allocations().unwrap();
        super::track_allocations().unwrap();
        let a = super::allocated();
        assert!(a.peak >= a.now, "{a:?}");
    }
}
