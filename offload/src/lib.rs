//! # zrt-offload
//!
//! Where optimizer state lives when it does not fit in memory: streamed
//! through per-rank NVMe swap files ([`Swap`]), as DeepSpeed's ZeRO-Infinity
//! `offload_optimizer: {"device": "nvme"}` does.
//!
//! A swap file holds, for each *region* (one unit's shard), a few f32
//! *arrays* of equal length (Adam's m and v, Lion's m or SGD's buffer, and the fp32
//! master when it is not the parameters themselves), cut into chunks.
//! [`Swap::stream`] runs a caller's function over every chunk of every
//! region while a reader thread reads the next chunks ahead and a writer
//! thread writes finished ones behind, through `buffer_count` fixed,
//! page-aligned buffers: the optimizer works on one buffer while others
//! are on the disk, and resident memory is `buffer_count x chunk bytes`
//! whatever the model size. A region may declare chunks whose last array
//! is zero and stays so ([`Swap::keep_last_zero`]: Muon's matrices keep
//! no second moment): streams then move the other arrays alone, one
//! contiguous, aligned request still.
//!
//! ## Why O_DIRECT and threads, not io_uring
//!
//! The files are opened with `O_DIRECT` (falling back to the page cache,
//! with a warning, on filesystems that refuse it, such as tmpfs): each byte
//! crosses the memory bus once, and the page cache does not grow by the
//! size of the optimizer state, which is the point of offloading. Two I/O
//! threads with large sequential requests (`aio.block_size` per array per
//! chunk) already keep a single NVMe drive at its sequential speed; io_uring
//! would save the threads but is disabled by the seccomp profiles of many
//! container runtimes, where zrt must still work, and it needs a dependency
//! this crate does not otherwise have.
//!
//! ## Files
//!
//! Each rank's file is `NVME_PATH/zrt-optim-<pid>-r<rank>-<nanos>.swap`:
//! unique per process and run, preallocated in full at creation (a full
//! disk is an error at start-up, not in the middle of a step), removed when
//! the [`Swap`] is dropped. Files left by a process that crashed are never
//! read by a later run (the names differ) and are removed by the next
//! [`Swap::create`] in that directory once their process is gone.

mod aligned;
mod disk;
mod error;
mod host;
mod swap;

pub use disk::raw_write_read;
pub use error::OffloadError;
pub use host::{available_memory, fits_in};
pub use swap::{Swap, SwapConfig};
