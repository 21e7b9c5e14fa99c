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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_the_call_in_aligned_pieces_one_per_thread() {
        let one = Threads::new(1).unwrap();
        assert_eq!(one.count(), 1);
        assert_eq!(one.chunk_len(1 << 20), None, "one thread runs serially");
        let three = Threads::new(3).unwrap();
        assert_eq!(three.count(), 3);
        assert!(format!("{three:?}").contains("n: 3"));
        assert_eq!(
            three.chunk_len(SERIAL_BELOW - 1),
            None,
            "small calls run serially"
        );
        for len in [SERIAL_BELOW, 100_003, 1 << 22] {
            let c = three.chunk_len(len).unwrap();
            assert_eq!(c % ALIGN, 0, "{len}: {c}");
            // Three ranges cover it; two would not.
            assert!(3 * c >= len && 2 * c < len, "{len}: {c}");
        }
    }
}
