//! The per-rank swap file and the read-ahead / write-behind stream over it.

use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam_channel::bounded;

use crate::aligned::{AlignedBuf, ALIGN};
use crate::OffloadError;

/// How to build a [`Swap`].
#[derive(Debug, Clone)]
pub struct SwapConfig {
    /// The directory of the swap file (`nvme_path`).
    pub dir: PathBuf,
    /// This rank (part of the file name).
    pub rank: usize,
    /// Buffers in flight (`buffer_count`, at least 1; 3 or more lets a
    /// read, the optimizer and a write run at once).
    pub buffer_count: usize,
    /// Bytes of each array per chunk (`aio.block_size`), rounded up to 4 KiB.
    pub chunk_bytes: usize,
    /// Open with O_DIRECT where the filesystem allows it.
    pub direct: bool,
}

/// One region: `len` elements of each array, in `chunks` slots from byte `start`.
#[derive(Debug, Clone)]
struct Region {
    start: u64,
    len: usize,
    chunks: usize,
    /// Per chunk: the last array's piece is zeros and stays so (see
    /// [`Swap::keep_last_zero`]); empty: none is.
    zero_last: Vec<bool>,
}

/// A rank's optimizer-state swap file: regions of `arrays` f32 arrays each,
/// streamed through a fixed set of aligned buffers (see the crate docs).
pub struct Swap {
    path: PathBuf,
    file: File,
    arrays: usize,
    /// Elements of one array per chunk.
    chunk: usize,
    regions: Vec<Region>,
    buffer_count: usize,
    bufs: pool::Pool,
    bytes: u64,
    direct: bool,
    /// Bytes read from and written to the file so far.
    read: AtomicU64,
    written: AtomicU64,
}

/// The swap's idle buffers, kept between streams (no allocation per step).
mod pool {
    use super::AlignedBuf;
    use std::sync::Mutex;

    pub(super) struct Pool(Mutex<Vec<AlignedBuf>>);

    impl Pool {
        pub(super) fn new() -> Self {
            Self(Mutex::new(Vec::new()))
        }
        /// `n` buffers of `len` f32s: pooled ones first, new ones if the
        /// pool has fewer (another thread holds the rest).
        pub(super) fn take(&self, n: usize, len: usize) -> Vec<AlignedBuf> {
            let mut v = {
                let mut pool = self.0.lock().unwrap_or_else(|e| e.into_inner());
                let at = pool.len() - pool.len().min(n);
                pool.split_off(at)
            };
            while v.len() < n {
                v.push(AlignedBuf::new(len));
            }
            v
        }
        /// Returns buffers to the pool, which keeps at most `cap` (the
        /// swap's `buffer_count`: its resident bound).
        pub(super) fn put(&self, bufs: impl IntoIterator<Item = AlignedBuf>, cap: usize) {
            let mut pool = self.0.lock().unwrap_or_else(|e| e.into_inner());
            for b in bufs {
                if pool.len() < cap {
                    pool.push(b);
                }
            }
        }
    }
}

/// Refuses `buffer_count` buffers of `slot` bytes that cannot fit in the
/// `available` memory (unknown: only a product past 2^64 is refused): the
/// stream would otherwise abort the process allocating them, mid-step.
fn check_buffers(
    buffer_count: usize,
    slot: u64,
    available: Option<u64>,
) -> Result<(), OffloadError> {
    if crate::fits_in(slot.checked_mul(buffer_count as u64), available) {
        return Ok(());
    }
    Err(OffloadError::Buffers {
        buffer_count: buffer_count as u64,
        slot_bytes: slot,
        available: available.unwrap_or(0),
    })
}

impl Swap {
    /// Creates and preallocates a swap file in `cfg.dir` for regions of the
    /// given lengths, each holding `arrays` f32 arrays (zeros).
    pub fn create(cfg: &SwapConfig, arrays: usize, lens: &[usize]) -> Result<Self, OffloadError> {
        if !cfg.dir.is_dir() {
            return Err(OffloadError::NoDirectory {
                path: cfg.dir.clone(),
            });
        }
        if arrays == 0 {
            return Err(OffloadError::Shape(
                "a swap needs at least one array".into(),
            ));
        }
        // Elements of one array per chunk; an absurd `aio.block_size`
        // saturates here and is refused as buffers that cannot fit below.
        let chunk = cfg
            .chunk_bytes
            .max(ALIGN)
            .div_ceil(ALIGN)
            .saturating_mul(ALIGN)
            / 4;
        let slot = (arrays as u64).saturating_mul(chunk as u64 * 4);
        check_buffers(cfg.buffer_count.max(1), slot, crate::available_memory())?;
        remove_stale(&cfg.dir);
        let mut regions = Vec::new();
        let mut at = 0u64;
        for &len in lens {
            let chunks = len.div_ceil(chunk);
            regions.push(Region {
                start: at,
                len,
                chunks,
                zero_last: Vec::new(),
            });
            at = (chunks as u64)
                .checked_mul(slot)
                .and_then(|b| b.checked_add(at))
                .ok_or_else(|| OffloadError::NoSpace {
                    path: cfg.dir.clone(),
                    bytes: u64::MAX,
                    msg: "the swap file would be larger than 2^64 bytes".into(),
                })?;
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let path = cfg.dir.join(format!(
            "zrt-optim-{}-r{}-{nanos}.swap",
            std::process::id(),
            cfg.rank
        ));
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.read(true).write(true).create_new(true);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(&path)
        };
        let (file, direct) = match open(cfg.direct) {
            Ok(f) => (f, cfg.direct),
            Err(e) if cfg.direct && e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::warn!(dir = %cfg.dir.display(), "the filesystem refuses O_DIRECT: the optimizer swap goes through the page cache");
                let _ = std::fs::remove_file(&path);
                (
                    open(false).map_err(|e| OffloadError::io("create", &path, &e))?,
                    false,
                )
            }
            Err(e) => return Err(OffloadError::io("create", &path, &e)),
        };
        if at > 0 {
            // SAFETY: a valid open descriptor; the length fits in off_t.
            let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, at as libc::off_t) };
            if rc != 0 {
                let e = std::io::Error::from_raw_os_error(rc);
                let _ = std::fs::remove_file(&path);
                return Err(match rc {
                    libc::ENOSPC | libc::EFBIG => OffloadError::NoSpace {
                        path,
                        bytes: at,
                        msg: e.to_string(),
                    },
                    _ => OffloadError::io("preallocate", &path, &e),
                });
            }
        }
        tracing::debug!(path = %path.display(), bytes = at, direct, "optimizer swap file created");
        Ok(Self {
            path,
            file,
            arrays,
            chunk,
            regions,
            buffer_count: cfg.buffer_count.max(1),
            bufs: pool::Pool::new(),
            bytes: at,
            direct,
            read: AtomicU64::new(0),
            written: AtomicU64::new(0),
        })
    }

    /// Declares that in region `r` the last array is zero wherever
    /// `zero(elements)` says so of a chunk's elements, and stays so: the
    /// streams neither read (their buffers hold zeros there) nor write
    /// that piece, and [`Swap::write_region`] writes zeros there whatever
    /// it is given. Muon's matrices keep no second moment: for them a
    /// stream moves the master and the momentum alone.
    pub fn keep_last_zero(
        &mut self,
        r: usize,
        zero: impl Fn(Range<usize>) -> bool,
    ) -> Result<(), OffloadError> {
        let chunks = self
            .regions
            .get(r)
            .ok_or_else(|| OffloadError::Shape(format!("no region {r}")))?
            .chunks;
        let flags: Vec<bool> = (0..chunks).map(|c| zero(self.chunk_range(r, c))).collect();
        self.regions[r].zero_last = flags;
        Ok(())
    }

    /// Bytes read from the file and written to it so far (what the
    /// optimizer's offload costs in I/O).
    pub fn io_bytes(&self) -> (u64, u64) {
        (
            self.read.load(Ordering::Relaxed),
            self.written.load(Ordering::Relaxed),
        )
    }

    /// Whether chunk `c` of region `r` keeps its last array zero.
    fn zero_last(&self, r: usize, c: usize) -> bool {
        self.regions[r].zero_last.get(c).copied().unwrap_or(false)
    }

    /// The swap file.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Bytes of the swap file.
    pub fn file_bytes(&self) -> u64 {
        self.bytes
    }
    /// Bytes of memory the swap's buffers hold (its whole resident cost).
    pub fn resident_bytes(&self) -> usize {
        self.buffer_count * self.slot_len() * 4
    }
    /// Whether the file bypasses the page cache (O_DIRECT).
    pub fn direct(&self) -> bool {
        self.direct
    }
    /// Regions in the swap.
    pub fn regions(&self) -> usize {
        self.regions.len()
    }
    /// Elements per array of region `r`.
    pub fn region_len(&self, r: usize) -> usize {
        self.regions.get(r).map_or(0, |g| g.len)
    }

    fn slot_len(&self) -> usize {
        self.arrays * self.chunk
    }

    fn slot_offset(&self, r: usize, c: usize) -> u64 {
        self.regions[r].start + (c * self.slot_len() * 4) as u64
    }

    fn chunk_range(&self, r: usize, c: usize) -> Range<usize> {
        let a = c * self.chunk;
        a..(a + self.chunk).min(self.regions[r].len)
    }

    /// Reads a slot; of a chunk that keeps its last array zero, the
    /// other arrays (a prefix of the slot, 4 KiB-aligned) and zeros.
    fn read_slot(&self, r: usize, c: usize, buf: &mut AlignedBuf) -> Result<(), OffloadError> {
        let piece = self.chunk * 4;
        let used = match self.zero_last(r, c) {
            true => (self.arrays - 1) * piece,
            false => self.arrays * piece,
        };
        buf.bytes_mut()[used..].fill(0);
        self.read_exact_at(&mut buf.bytes_mut()[..used], self.slot_offset(r, c))
    }

    /// Fills `b` from byte `offset`; an end of file first is a short read.
    fn read_exact_at(&self, b: &mut [u8], offset: u64) -> Result<(), OffloadError> {
        let mut got = 0;
        while got < b.len() {
            match self.file.read_at(&mut b[got..], offset + got as u64) {
                Ok(0) => {
                    return Err(OffloadError::ShortRead {
                        path: self.path.clone(),
                        offset,
                        want: b.len(),
                        got,
                    })
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(OffloadError::io("read", &self.path, &e)),
            }
        }
        self.read.fetch_add(b.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Writes `b` at byte `offset`.
    fn write_all_at(&self, b: &[u8], offset: u64) -> Result<(), OffloadError> {
        self.file
            .write_all_at(b, offset)
            .map_err(|e| OffloadError::io("write", &self.path, &e))?;
        self.written.fetch_add(b.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn write_slot(&self, r: usize, c: usize, buf: &AlignedBuf) -> Result<(), OffloadError> {
        self.write_all_at(buf.bytes(), self.slot_offset(r, c))
    }

    /// Writes back the arrays of a slot that `write` flags, but not a last
    /// array the chunk keeps zero: each run of neighbouring arrays in one
    /// write (the whole slot when every array goes back; each piece is
    /// contiguous and 4 KiB-aligned in the file, as [`Swap::read_array`]
    /// reads it); nothing when none does.
    fn write_slot_arrays(
        &self,
        r: usize,
        c: usize,
        buf: &AlignedBuf,
        write: &[bool],
    ) -> Result<(), OffloadError> {
        let zero_last = self.zero_last(r, c);
        let goes = |a: usize| write[a] && !(zero_last && a + 1 == self.arrays);
        let piece = self.chunk * 4;
        let mut a = 0;
        while a < self.arrays {
            if !goes(a) {
                a += 1;
                continue;
            }
            let from = a;
            while a < self.arrays && goes(a) {
                a += 1;
            }
            let bytes = &buf.bytes()[from * piece..a * piece];
            self.write_all_at(bytes, self.slot_offset(r, c) + (from * piece) as u64)?;
        }
        Ok(())
    }

    fn check(&self, r: usize, lens: impl Iterator<Item = usize>) -> Result<(), OffloadError> {
        let region = self
            .regions
            .get(r)
            .ok_or_else(|| OffloadError::Shape(format!("no region {r}")))?;
        let lens: Vec<usize> = lens.collect();
        if lens.len() != self.arrays || lens.iter().any(|&l| l != region.len) {
            return Err(OffloadError::Shape(format!(
                "region {r} holds {} arrays of {} elements, got lengths {lens:?}",
                self.arrays, region.len
            )));
        }
        Ok(())
    }

    /// Writes region `r`'s arrays (one slice per array, each the region's
    /// length), synchronously; zeros where the region keeps its last array
    /// zero ([`Swap::keep_last_zero`]).
    pub fn write_region(&self, r: usize, arrays: &[&[f32]]) -> Result<(), OffloadError> {
        self.check(r, arrays.iter().map(|a| a.len()))?;
        let mut bufs = self.bufs.take(1, self.slot_len());
        let res = (|| {
            let buf = &mut bufs[0];
            for c in 0..self.regions[r].chunks {
                let range = self.chunk_range(r, c);
                let s = buf.as_mut_slice();
                let zero_last = self.zero_last(r, c);
                for (a, src) in arrays.iter().enumerate() {
                    let dst = &mut s[a * self.chunk..(a + 1) * self.chunk];
                    if zero_last && a + 1 == self.arrays {
                        dst.fill(0.0);
                        continue;
                    }
                    dst[..range.len()].copy_from_slice(&src[range.clone()]);
                    dst[range.len()..].fill(0.0);
                }
                self.write_slot(r, c, buf)?;
            }
            Ok(())
        })();
        self.bufs.put(bufs, self.buffer_count);
        res
    }

    /// Reads region `r`'s arrays into `out` (one slice per array).
    pub fn read_region(&self, r: usize, out: &mut [&mut [f32]]) -> Result<(), OffloadError> {
        self.check(r, out.iter().map(|a| a.len()))?;
        let mut bufs = self.bufs.take(1, self.slot_len());
        let res = (|| {
            let buf = &mut bufs[0];
            for c in 0..self.regions[r].chunks {
                let range = self.chunk_range(r, c);
                self.read_slot(r, c, buf)?;
                let s = buf.as_slice();
                for (a, dst) in out.iter_mut().enumerate() {
                    dst[range.clone()]
                        .copy_from_slice(&s[a * self.chunk..a * self.chunk + range.len()]);
                }
            }
            Ok(())
        })();
        self.bufs.put(bufs, self.buffer_count);
        res
    }

    /// Reads array `a` of region `r` alone into `out` (the region's length):
    /// `1 / arrays` of [`Swap::read_region`]'s I/O, for a caller that needs
    /// one array (the fp32 master of an export, not its Adam moments). Each
    /// chunk's piece of one array is contiguous and 4 KiB-aligned in the
    /// file, so this stays O_DIRECT.
    pub fn read_array(&self, r: usize, a: usize, out: &mut [f32]) -> Result<(), OffloadError> {
        if a >= self.arrays {
            return Err(OffloadError::Shape(format!(
                "array {a} asked of a swap of {} arrays",
                self.arrays
            )));
        }
        self.check(r, std::iter::repeat_n(out.len(), self.arrays))?;
        let mut bufs = self.bufs.take(1, self.slot_len());
        let res = (|| {
            let buf = &mut bufs[0];
            for c in 0..self.regions[r].chunks {
                let range = self.chunk_range(r, c);
                let offset = self.slot_offset(r, c) + (a * self.chunk * 4) as u64;
                self.read_exact_at(&mut buf.bytes_mut()[..self.chunk * 4], offset)?;
                out[range.clone()].copy_from_slice(&buf.as_slice()[..range.len()]);
            }
            Ok(())
        })();
        self.bufs.put(bufs, self.buffer_count);
        res
    }

    /// Runs `f(region, elements, arrays)` over every chunk of every region,
    /// in order, and writes each chunk back after `f` returns: a reader
    /// thread reads ahead and a writer thread writes behind through the
    /// swap's `buffer_count` buffers. `arrays` holds this chunk of each
    /// array (`elements` of the region). The first error (of `f`, a read or
    /// a write) stops the stream and is returned; chunks `f` finished before
    /// it are on disk.
    pub fn stream<E: From<OffloadError>>(
        &self,
        f: impl FnMut(usize, Range<usize>, &mut [&mut [f32]]) -> Result<(), E>,
    ) -> Result<(), E> {
        self.stream_writing(&vec![true; self.arrays], f)
    }

    /// [`Swap::stream`] writing back only the arrays `write` flags (one
    /// flag per array): a pass that reads some arrays and changes others
    /// (LAMB's two passes) writes what it changed, and one that changes
    /// none writes nothing. What `f` does to an unflagged array's chunk is
    /// not kept.
    pub fn stream_writing<E: From<OffloadError>>(
        &self,
        write: &[bool],
        mut f: impl FnMut(usize, Range<usize>, &mut [&mut [f32]]) -> Result<(), E>,
    ) -> Result<(), E> {
        if write.len() != self.arrays {
            return Err(OffloadError::Shape(format!(
                "{} write-back flags for a swap of {} arrays",
                write.len(),
                self.arrays
            ))
            .into());
        }
        let items: Vec<(usize, usize)> = (0..self.regions.len())
            .flat_map(|r| (0..self.regions[r].chunks).map(move |c| (r, c)))
            .collect();
        if items.is_empty() {
            return Ok(());
        }
        let n = self.buffer_count;
        let (free_tx, free_rx) = bounded::<AlignedBuf>(n);
        for b in self.bufs.take(n, self.slot_len()) {
            // Cannot fail: the channel holds n and the receiver is alive.
            let _ = free_tx.send(b);
        }
        let (rd_tx, rd_rx) = bounded::<(usize, usize, AlignedBuf)>(n);
        let (wr_tx, wr_rx) = bounded::<(usize, usize, AlignedBuf)>(n);
        let mut done = 0;
        let (computed, read, written) = std::thread::scope(|s| {
            let free_rx = &free_rx;
            let items = &items;
            let reader = s.spawn(move || -> Result<(), OffloadError> {
                for &(r, c) in items {
                    let Ok(mut b) = free_rx.recv() else {
                        return Ok(()); // the writer stopped: its error is reported
                    };
                    self.read_slot(r, c, &mut b)?;
                    if rd_tx.send((r, c, b)).is_err() {
                        return Ok(()); // the optimizer stopped
                    }
                }
                Ok(())
            });
            let writer = s.spawn(move || -> Result<(), OffloadError> {
                for (r, c, b) in wr_rx.iter() {
                    let res = self.write_slot_arrays(r, c, &b, write);
                    let _ = free_tx.send(b);
                    res?;
                }
                Ok(())
            });
            let computed = (|| -> Result<(), E> {
                let (rd_rx, wr_tx) = (rd_rx, wr_tx);
                for (r, c, mut b) in rd_rx.iter() {
                    let range = self.chunk_range(r, c);
                    let len = range.len();
                    let mut parts: Vec<&mut [f32]> = b
                        .as_mut_slice()
                        .chunks_mut(self.chunk)
                        .map(|p| &mut p[..len])
                        .collect();
                    f(r, range, &mut parts)?;
                    if wr_tx.send((r, c, b)).is_err() {
                        return Ok(()); // the writer failed: its error is reported
                    }
                    done += 1;
                }
                Ok(())
            })();
            let read = reader.join().unwrap_or_else(|_| {
                Err(OffloadError::Compute(
                    "the swap reader thread panicked".into(),
                ))
            });
            let written = writer.join().unwrap_or_else(|_| {
                Err(OffloadError::Compute(
                    "the swap writer thread panicked".into(),
                ))
            });
            (computed, read, written)
        });
        self.bufs.put(free_rx.try_iter(), self.buffer_count);
        computed?;
        read?;
        written?;
        if done != items.len() {
            return Err(OffloadError::Compute(format!(
                "the swap stream stopped after {done} of {} chunks",
                items.len()
            ))
            .into());
        }
        Ok(())
    }
}

impl Drop for Swap {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), "cannot remove the optimizer swap file: {e}");
        }
    }
}

impl std::fmt::Debug for Swap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Swap")
            .field("path", &self.path)
            .field("bytes", &self.bytes)
            .field("direct", &self.direct)
            .finish()
    }
}

/// Removes swap files in `dir` whose process is gone (a crashed run's).
fn remove_stale(dir: &Path) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(pid) = name
            .strip_prefix("zrt-optim-")
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: signal 0 only checks that the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone && name.ends_with(".swap") {
            tracing::info!(
                file = name,
                "removing the swap file of a process that is gone"
            );
            let _ = std::fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(dir: &Path, buffers: usize) -> SwapConfig {
        SwapConfig {
            dir: dir.to_path_buf(),
            rank: 0,
            buffer_count: buffers,
            chunk_bytes: 4096,
            direct: true,
        }
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("zrt-swap-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn regions_round_trip_and_stream_updates_every_element_once() {
        let d = dir("roundtrip");
        for buffers in [1, 2, 4] {
            // 1024 elements per chunk: region lengths around the boundary.
            let lens = [1, 1023, 1024, 1025, 5000];
            let swap = Swap::create(&cfg(&d, buffers), 3, &lens).unwrap();
            let data: Vec<Vec<Vec<f32>>> = lens
                .iter()
                .enumerate()
                .map(|(r, &n)| {
                    (0..3)
                        .map(|a| {
                            (0..n)
                                .map(|i| (r * 100_000 + a * 10_000 + i) as f32)
                                .collect()
                        })
                        .collect()
                })
                .collect();
            for (r, arrays) in data.iter().enumerate() {
                let refs: Vec<&[f32]> = arrays.iter().map(Vec::as_slice).collect();
                swap.write_region(r, &refs).unwrap();
            }
            let mut seen = vec![0usize; lens.len()];
            swap.stream(
                |r, range, arrays: &mut [&mut [f32]]| -> Result<(), OffloadError> {
                    assert_eq!(arrays.len(), 3);
                    for (a, part) in arrays.iter_mut().enumerate() {
                        assert_eq!(&part[..], &data[r][a][range.clone()]);
                        part.iter_mut().for_each(|x| *x = -*x);
                    }
                    seen[r] += range.len();
                    Ok(())
                },
            )
            .unwrap();
            assert_eq!(seen, lens);
            for (r, &n) in lens.iter().enumerate() {
                let mut out = vec![vec![0f32; n]; 3];
                let mut refs: Vec<&mut [f32]> = out.iter_mut().map(Vec::as_mut_slice).collect();
                swap.read_region(r, &mut refs).unwrap();
                for a in 0..3 {
                    let want: Vec<f32> = data[r][a].iter().map(|x| -x).collect();
                    assert_eq!(out[a], want, "region {r} array {a}");
                    // One array alone reads the same values.
                    let mut one = vec![0f32; n];
                    swap.read_array(r, a, &mut one).unwrap();
                    assert_eq!(one, want, "read_array region {r} array {a}");
                }
            }
            assert_eq!(swap.resident_bytes(), buffers * 3 * 4096);
            // Each region takes whole chunks of 1024 elements for 3 arrays.
            let chunks: usize = lens.iter().map(|n| n.div_ceil(1024)).sum();
            assert_eq!(swap.file_bytes(), (chunks * 3 * 4096) as u64);
            assert_eq!(
                std::fs::metadata(swap.path()).unwrap().len(),
                swap.file_bytes()
            );
            assert_eq!(swap.regions(), lens.len());
            for (r, &n) in lens.iter().enumerate() {
                assert_eq!(swap.region_len(r), n);
            }
            assert_eq!(swap.region_len(lens.len()), 0);
            let shown = format!("{swap:?}");
            assert!(
                shown.starts_with("Swap") && shown.contains("zrt-optim-"),
                "{shown}"
            );
            let path = swap.path().to_path_buf();
            assert!(path.exists());
            drop(swap);
            assert!(!path.exists(), "removed on drop");
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_stream_writes_back_only_the_arrays_it_flags() {
        let d = dir("write-back");
        let lens = [1500, 3000];
        let swap = Swap::create(&cfg(&d, 2), 3, &lens).unwrap();
        let start = |r: usize, a: usize| vec![(r * 10 + a) as f32; lens[r]];
        for r in 0..lens.len() {
            let arrays: Vec<Vec<f32>> = (0..3).map(|a| start(r, a)).collect();
            let refs: Vec<&[f32]> = arrays.iter().map(Vec::as_slice).collect();
            swap.write_region(r, &refs).unwrap();
        }
        let negate =
            |_: usize, _: Range<usize>, arrays: &mut [&mut [f32]]| -> Result<(), OffloadError> {
                arrays
                    .iter_mut()
                    .for_each(|a| a.iter_mut().for_each(|x| *x = -*x));
                Ok(())
            };
        // Every array is changed; only array 1 is kept, then none.
        swap.stream_writing(&[false, true, false], negate).unwrap();
        swap.stream_writing(&[false, false, false], negate).unwrap();
        for (r, &n) in lens.iter().enumerate() {
            for a in 0..3 {
                let mut one = vec![0f32; n];
                swap.read_array(r, a, &mut one).unwrap();
                let sign = if a == 1 { -1.0 } else { 1.0 };
                let want: Vec<f32> = start(r, a).iter().map(|x| sign * x).collect();
                assert_eq!(one, want, "region {r} array {a}");
            }
        }
        let err = swap.stream_writing(&[true], negate).unwrap_err();
        assert_eq!(
            err.to_string(),
            OffloadError::Shape("1 write-back flags for a swap of 3 arrays".into()).to_string()
        );
        drop(swap);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_last_array_kept_zero_is_neither_read_nor_written_and_stays_zero() {
        let d = dir("zero-last");
        // Chunks of 1024 elements; region 0's three chunks: [0, 1024)
        // zero, [1024, 2048) not, [2048, 2500) zero. Region 1: none.
        let lens = [2500, 1500];
        let mut swap = Swap::create(&cfg(&d, 2), 3, &lens).unwrap();
        swap.keep_last_zero(0, |r| r.start != 1024).unwrap();
        assert!(swap.keep_last_zero(2, |_| true).is_err());
        let start = |r: usize, a: usize| vec![(r * 10 + a + 1) as f32; lens[r]];
        for r in 0..lens.len() {
            let arrays: Vec<Vec<f32>> = (0..3).map(|a| start(r, a)).collect();
            let refs: Vec<&[f32]> = arrays.iter().map(Vec::as_slice).collect();
            swap.write_region(r, &refs).unwrap();
        }
        // The zero chunks' last array holds zeros whatever was written,
        // the streams hand out zeros there, and what a pass writes there
        // is dropped.
        let zero = |r: usize, i: usize| r == 0 && !(1024..2048).contains(&i);
        let want = |r: usize, a: usize, sign: f32| -> Vec<f32> {
            (start(r, a).iter().enumerate())
                .map(|(i, x)| if a == 2 && zero(r, i) { 0.0 } else { sign * x })
                .collect()
        };
        let before = swap.io_bytes();
        swap.stream(
            |r, range, arrays: &mut [&mut [f32]]| -> Result<(), OffloadError> {
                for (a, part) in arrays.iter_mut().enumerate() {
                    assert_eq!(&part[..], &want(r, a, 1.0)[range.clone()], "{r} {a}");
                    part.iter_mut().for_each(|x| *x = -*x - 1.0);
                }
                Ok(())
            },
        )
        .unwrap();
        let (read, written) = swap.io_bytes();
        // 5 chunks of 3 x 4 KiB, 2 of them without their last 4 KiB.
        let moved = (5 * 3 - 2) * 4096;
        assert_eq!((read - before.0, written - before.1), (moved, moved));
        for (r, &n) in lens.iter().enumerate() {
            for a in 0..3 {
                let mut one = vec![0f32; n];
                swap.read_array(r, a, &mut one).unwrap();
                let got: Vec<f32> = want(r, a, 1.0)
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| if a == 2 && zero(r, i) { 0.0 } else { -x - 1.0 })
                    .collect();
                assert_eq!(one, got, "region {r} array {a}");
            }
        }
        drop(swap);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn random_zero_chunks_and_write_flags_keep_what_a_model_of_the_file_says() {
        // Against a plain model of the arrays: random region lengths,
        // random chunks keeping the last array zero, and passes that
        // change every array but write back a random subset of them.
        let d = dir("zero-last-random");
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for case in 0..12 {
            let arrays = 2 + next(2) as usize;
            let lens: Vec<usize> = (0..1 + next(3)).map(|_| next(4000) as usize).collect();
            let mut swap = Swap::create(&cfg(&d, 1 + next(3) as usize), arrays, &lens).unwrap();
            // Per region, which chunks (of 1024) keep the last array zero.
            let zero: Vec<Vec<bool>> = (lens.iter())
                .map(|n| (0..n.div_ceil(1024)).map(|_| next(2) == 0).collect())
                .collect();
            for (r, z) in zero.iter().enumerate() {
                let z = z.clone();
                swap.keep_last_zero(r, move |e| z[e.start / 1024]).unwrap();
            }
            let is_zero = |r: usize, a: usize, i: usize| a + 1 == arrays && zero[r][i / 1024];
            let mut model: Vec<Vec<Vec<f32>>> = (lens.iter().enumerate())
                .map(|(r, &n)| {
                    (0..arrays)
                        .map(|a| {
                            (0..n)
                                .map(|i| (r * 1_000_000 + a * 10_000 + i) as f32)
                                .collect()
                        })
                        .collect()
                })
                .collect();
            for (r, arrays) in model.iter().enumerate() {
                let refs: Vec<&[f32]> = arrays.iter().map(Vec::as_slice).collect();
                swap.write_region(r, &refs).unwrap();
            }
            for (r, region) in model.iter_mut().enumerate() {
                for (a, array) in region.iter_mut().enumerate() {
                    for (i, x) in array.iter_mut().enumerate() {
                        if is_zero(r, a, i) {
                            *x = 0.0;
                        }
                    }
                }
            }
            for pass in 0..3 {
                let write: Vec<bool> = (0..arrays).map(|_| next(2) == 0).collect();
                let add = (pass + 1) as f32;
                swap.stream_writing(
                    &write,
                    |r, range, parts: &mut [&mut [f32]]| -> Result<(), OffloadError> {
                        for (a, part) in parts.iter_mut().enumerate() {
                            assert_eq!(&part[..], &model[r][a][range.clone()], "case {case}");
                            part.iter_mut().for_each(|x| *x += add);
                        }
                        Ok(())
                    },
                )
                .unwrap();
                for (r, region) in model.iter_mut().enumerate() {
                    for (a, array) in region.iter_mut().enumerate() {
                        for (i, x) in array.iter_mut().enumerate() {
                            if write[a] && !is_zero(r, a, i) {
                                *x += add;
                            }
                        }
                    }
                }
                for (r, &n) in lens.iter().enumerate() {
                    let mut out = vec![vec![0f32; n]; arrays];
                    let mut refs: Vec<&mut [f32]> = out.iter_mut().map(Vec::as_mut_slice).collect();
                    swap.read_region(r, &mut refs).unwrap();
                    assert_eq!(out, model[r], "case {case} pass {pass} region {r}");
                    // The file itself, where streams skip the zero pieces.
                    let mut last = vec![0f32; n];
                    swap.read_array(r, arrays - 1, &mut last).unwrap();
                    assert_eq!(last, model[r][arrays - 1], "case {case} pass {pass}");
                }
            }
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn the_swap_says_whether_it_bypasses_the_page_cache() {
        let d = dir("direct");
        // Whether this filesystem takes O_DIRECT at all (tmpfs does not).
        let probe = d.join("probe");
        let takes_direct = OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_DIRECT)
            .open(&probe)
            .is_ok();
        let asked = Swap::create(&cfg(&d, 1), 1, &[10]).unwrap();
        assert_eq!(asked.direct(), takes_direct);
        let not_asked = Swap::create(
            &SwapConfig {
                direct: false,
                ..cfg(&d, 1)
            },
            1,
            &[10],
        )
        .unwrap();
        assert!(!not_asked.direct());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn the_pool_keeps_at_most_its_cap_and_hands_pooled_buffers_out_first() {
        let pool = pool::Pool::new();
        let mut bufs = pool.take(3, 1024);
        assert_eq!(bufs.len(), 3);
        // Marked, so a pooled buffer tells itself from a new (zeroed) one
        // even where the allocator hands a freed address out again.
        for b in &mut bufs {
            b.as_mut_slice()[0] = 7.0;
        }
        pool.put(bufs, 2);
        // Two were kept: taking three gives those two back and one new one.
        let again = pool.take(3, 1024);
        assert_eq!(again.len(), 3);
        let reused = again.iter().filter(|b| b.as_slice()[0] == 7.0).count();
        assert_eq!(reused, 2);
    }

    #[test]
    fn buffers_past_the_hosts_memory_are_refused_before_the_file_is_made() {
        let d = dir("buffers");
        // A trillion buffers of three 4 KiB blocks (12 PB), and one buffer
        // of a block size that saturates: both aborted in the allocator of
        // the first stream before.
        for (buffers, block) in [(1_000_000_000_000, 4096), (1, usize::MAX)] {
            let e = Swap::create(
                &SwapConfig {
                    chunk_bytes: block,
                    ..cfg(&d, buffers)
                },
                3,
                &[10],
            )
            .unwrap_err();
            assert!(matches!(e, OffloadError::Buffers { .. }), "{e}");
            let text = e.to_string();
            assert!(
                text.contains(&format!("the swap's {buffers} buffers of "))
                    && text.contains("lower `buffer_count` or `aio.block_size`"),
                "{text}"
            );
        }
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0, "no file made");
        // The rule itself: at most what is available; unknown memory
        // refuses only an overflowing product.
        assert!(check_buffers(4, 1 << 20, Some(4 << 20)).is_ok());
        assert!(check_buffers(5, 1 << 20, Some(4 << 20)).is_err());
        assert!(check_buffers(1 << 20, 1 << 30, None).is_ok());
        let e = check_buffers(1 << 20, 1 << 30, Some(1 << 30)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the swap's 1048576 buffers of 1073741824 bytes each (about \
             1048576.0 GiB) do not fit in the 1.0 GiB of memory this host has \
             available: lower `buffer_count` or `aio.block_size` (each buffer holds \
             `aio.block_size` bytes of each swapped array)"
        );
        assert!(check_buffers(usize::MAX, 1 << 30, None).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn errors_name_the_problem() {
        let d = dir("errors");
        let missing = d.join("nope");
        let e = Swap::create(&cfg(&missing, 2), 2, &[10]).unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
        let swap = Swap::create(&cfg(&d, 1), 2, &[10]).unwrap();
        let e = swap.read_array(0, 2, &mut [0f32; 10]).unwrap_err();
        assert!(
            e.to_string()
                .contains("array 2 asked of a swap of 2 arrays"),
            "{e}"
        );
        let e = swap.read_array(0, 1, &mut [0f32; 9]).unwrap_err();
        assert!(
            e.to_string().contains("holds 2 arrays of 10 elements"),
            "{e}"
        );
        drop(swap);
        // A short read: the file shrinks under the swap.
        let swap = Swap::create(&cfg(&d, 2), 2, &[5000]).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(swap.path())
            .unwrap()
            .set_len(4096)
            .unwrap();
        let e = swap
            .stream(|_, _, _: &mut [&mut [f32]]| -> Result<(), OffloadError> { Ok(()) })
            .unwrap_err();
        assert!(matches!(e, OffloadError::ShortRead { .. }), "{e}");
        assert!(e.to_string().contains("short read"), "{e}");
        // The function's error stops the stream and comes back as it is.
        let swap = Swap::create(&cfg(&d, 3), 1, &[100_000]).unwrap();
        let mut calls = 0;
        let e = swap
            .stream(|_, _, _: &mut [&mut [f32]]| -> Result<(), OffloadError> {
                calls += 1;
                match calls {
                    3 => Err(OffloadError::Compute("stop".into())),
                    _ => Ok(()),
                }
            })
            .unwrap_err();
        assert_eq!(e.to_string(), "stop");
        // ...and the next stream still has its buffers and runs to the end.
        let mut n = 0;
        swap.stream(|_, r, _: &mut [&mut [f32]]| -> Result<(), OffloadError> {
            n += r.len();
            Ok(())
        })
        .unwrap();
        assert_eq!(n, 100_000);
        // A stale file of a process that is gone is removed by the next create.
        let stale = d.join("zrt-optim-999999999-r0-1.swap");
        std::fs::write(&stale, b"x").unwrap();
        // A live process's file, and a file that is not a swap, stay.
        let live = d.join(format!("zrt-optim-{}-r1-1.swap", std::process::id()));
        std::fs::write(&live, b"x").unwrap();
        let other = d.join("zrt-optim-999999999-r0-1.txt");
        std::fs::write(&other, b"x").unwrap();
        let _swap = Swap::create(&cfg(&d, 1), 1, &[1]).unwrap();
        assert!(!stale.exists());
        assert!(live.exists(), "a live process's swap file was removed");
        assert!(other.exists(), "a file that is not a swap was removed");
        let _ = std::fs::remove_dir_all(&d);
    }
}
