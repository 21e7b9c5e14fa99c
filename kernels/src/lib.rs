//! # zrt-kernels
//!
//! The per-element math of a ZeRO step, on flat slices, with no libtorch in
//! the library: fused Adam/AdamW ([`adam`]), Lion ([`lion`]), SGD ([`sgd`]), LAMB ([`lamb`]), Adagrad ([`adagrad`]) and RMSprop ([`rmsprop`]), Muon's element-wise halves ([`muon`]: plain loops on the caller's thread,
//! as its step's time is the Newton-Schulz iterations the engine runs), the helpers around it ([`reduce`]:
//! sum of squares for the global norm, any-inf-or-nan for fp16 overflow, scale
//! in place), f32 <-> bf16/f16 casts bit-identical to libtorch's
//! ([`cast`]) and the block-wise int8 packing of quantized weight gathers
//! ([`quant`]).
//!
//! ## How it is fast
//!
//! - **Vectorized by the compiler, dispatched at run time.** Each hot loop is
//!   plain Rust over equal-length slices that LLVM vectorizes; [`simd`]
//!   compiles it three times (baseline x86-64, AVX2+FMA+F16C, AVX-512) and
//!   picks the widest the CPU has, once. We chose this over a SIMD crate
//!   because the loops are element-wise maps with no shuffles or horizontal
//!   work except the sum of squares, which LLVM handles with independent
//!   accumulators; portable code keeps one source of truth, and since Rust
//!   never contracts `a * b + c` into an FMA on its own, every dispatch level
//!   gives **bit-identical** results. That matters: NVMe offload and
//!   in-memory training must agree to the bit on different machines.
//! - **Threads over contiguous ranges.** A [`Threads`] pool (rayon, sized by
//!   the caller, default: available cores) splits a shard into one range per
//!   thread, aligned to 64 elements. The only allocation per call is the
//!   list of those ranges (one entry per thread), none on one thread.
//! - **One pass over memory.** Each optimizer walks the shard in L1-sized
//!   blocks (`walk.rs`, which every optimizer shares); the
//!   optional compute-dtype copy of the updated parameters is written from
//!   the block while it is still in cache, so p, g, m, v are read once and
//!   p, m, v (and the copy) written once.
//! - **Software prefetch.** Adam is memory-bound; one core alone cannot keep
//!   enough cache misses in flight on its four streams with the hardware
//!   prefetcher only, so the loop asks for each array's lines 2 KiB ahead
//!   (+5-10% at 1 thread, measured; nothing lost at 2 threads, where the
//!   cores saturate memory together).
//!
//! The CUDA version of Adam (NVRTC through cudarc, behind the `cuda` feature)
//! is compiled in CI and has **never run on a GPU**.

pub mod adagrad;
pub mod adam;
pub mod cast;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
pub mod lamb;
pub mod lion;
pub mod muon;
pub mod quant;
pub mod reduce;
pub mod rmsprop;
pub mod sgd;
pub mod simd;
#[cfg(test)]
mod test_data;
mod threads;
mod walk;

pub use adagrad::{adagrad_step, AdagradConfig};
pub use adam::{adam_step, AdamConfig, AdamShard, ComputeCopy};
pub use error::KernelError;
pub use lamb::{lamb_moments, lamb_update, LambConfig};
pub use lion::lion_step;
pub use muon::{muon_apply, muon_momentum, MuonConfig};
pub use rmsprop::{rmsprop_step, RmspropConfig};
pub use sgd::{sgd_step, SgdConfig};
pub use threads::Threads;
