//! The kernels' thread pool.

use crate::KernelError;

/// Elements per range are rounded to this, so every range but the last
/// starts on a 256-byte boundary of an aligned buffer and vector loops have
/// no ragged heads.
pub(crate) const ALIGN: usize = 64;

/// Below this many elements a call runs on the calling thread: waking
/// workers costs more than the work.
const SERIAL_BELOW: usize = 1 << 15;

/// A fixed set of worker threads for kernel calls.
///
/// Built once and reused: a call splits its slices into one contiguous range
/// per thread and allocates nothing.
pub struct Threads {
    pool: Option<rayon::ThreadPool>,
    n: usize,
}

impl std::fmt::Debug for Threads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Threads").field("n", &self.n).finish()
    }
}

impl Threads {
    /// A pool of `n` threads (`0` means the available cores). With `n == 1`
    /// no thread is started and calls run on the caller.
    pub fn new(n: usize) -> Result<Self, KernelError> {
        let n = if n == 0 {
            std::thread::available_parallelism().map_or(1, |c| c.get())
        } else {
            n
        };
        let pool = if n > 1 {
            Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .thread_name(|i| format!("zrt-kernel-{i}"))
                    .build()
                    .map_err(|e| KernelError::Threads {
                        threads: n,
                        msg: e.to_string(),
                    })?,
            )
        } else {
            None
        };
        Ok(Self { pool, n })
    }

    /// How many threads calls use.
    pub fn count(&self) -> usize {
        self.n
    }

    /// Elements per range for `len` elements, or `None` to run serially.
    pub(crate) fn chunk_len(&self, len: usize) -> Option<usize> {
        if self.pool.is_none() || len < SERIAL_BELOW {
            return None;
        }
        let per = len.div_ceil(self.n);
        Some(per.div_ceil(ALIGN) * ALIGN)
    }

    /// Runs `f` inside the pool (so rayon's parallel iterators use it).
    pub(crate) fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }
}
