//! The group's shared segment: its layout (header, a control block per
//! rank, the rings) and the files behind it and behind symmetric buffers.

use std::fs::OpenOptions;
use std::sync::atomic::AtomicU64;

use memmap2::MmapMut;

use crate::Element;

/// The header's first word, which a rank mapping the segment checks.
pub(super) const MAGIC: u64 = 0x7a72_745f_7368_6d31; // "zrt_shm1"
/// Bytes of a rank's control block.
pub(super) const CTRL: usize = 128;
/// Bytes of the header.
pub(super) const HEADER: usize = 64;
/// Words of a control block: arrive, left, two call slots of three words,
/// then the count of ranks asleep on this rank's arrive word, then how this
/// rank's two steps of a symmetric allocation went (a word each: a fast
/// rank writes the second while a slow one may still read the first).
pub(super) const W_ARRIVE: usize = 0;
pub(super) const W_LEFT: usize = 1;
pub(super) const W_DESC: usize = 2;
pub(super) const W_SLEEPERS: usize = 8;
pub(super) const W_STATUS: usize = 9;

/// The group's segment as this rank maps it, and its shape.
pub(super) struct Segment {
    pub(super) map: MmapMut,
    pub(super) n: usize,
    /// Bytes of one slot, from which windows are cut.
    pub(super) slot: usize,
    /// Slots in each rank's ring (and in the result ring).
    pub(super) laps: usize,
}

impl Segment {
    pub(super) fn base(&self) -> *mut u8 {
        self.map.as_ptr() as *mut u8
    }
    pub(super) fn word(&self, rank: usize, w: usize) -> &AtomicU64 {
        // SAFETY: in bounds (checked at creation), 8-aligned (page-aligned
        // base, 64/128-byte blocks), and only ever accessed atomically.
        unsafe { &*(self.base().add(HEADER + rank * CTRL + w * 8) as *const AtomicU64) }
    }
    fn data_offset(&self) -> usize {
        HEADER + self.n * CTRL
    }
    /// Bytes of each rank's ring.
    fn ring(&self) -> usize {
        self.slot * self.laps
    }
    /// `len` elements of T from element `at` of rank `r`'s staging ring
    /// (`r == n`: the result ring).
    ///
    /// # Safety
    /// The caller must hold the protocol's right to the range: only its owner
    /// writes a slot between two barriers, and readers read after the barrier.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn slot<T: Element>(&self, r: usize, at: usize, len: usize) -> &mut [T] {
        debug_assert!((at + len) * std::mem::size_of::<T>() <= self.ring());
        let p = self.base().add(self.data_offset() + r * self.ring()) as *mut T;
        std::slice::from_raw_parts_mut(p.add(at), len)
    }
    pub(super) fn bytes(n: usize, slot: usize, laps: usize) -> usize {
        HEADER + n * CTRL + (n + 1) * slot * laps
    }
}

/// Removes a file when dropped.
pub(super) struct Unlink(pub(super) String);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Creates `path` (exclusively) with `bytes` reserved and maps it.
pub(super) fn create_mapped(path: &str, bytes: usize) -> Result<MmapMut, String> {
    let _ = std::fs::remove_file(path);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| format!("creating {path}: {e}"))?;
    reserve(&f, bytes).map_err(|e| format!("reserving {bytes} bytes for {path}: {e}"))?;
    // SAFETY: this job's file, sized above; shared only through the
    // symmetric collectives' protocol.
    unsafe { MmapMut::map_mut(&f) }.map_err(|e| format!("mapping {path}: {e}"))
}

/// Maps a peer's file made by [`create_mapped`], checking its size.
pub(super) fn open_mapped(path: &str, bytes: usize) -> Result<MmapMut, String> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| format!("opening {path}: {e}"))?;
    let have = f.metadata().map_err(|e| format!("{path}: {e}"))?.len();
    if have != bytes as u64 {
        return Err(format!("{path} has {have} bytes, not {bytes}"));
    }
    // SAFETY: as in `create_mapped`.
    unsafe { MmapMut::map_mut(&f) }.map_err(|e| format!("mapping {path}: {e}"))
}

/// Sizes `f` to `bytes`, with the pages allocated now where the platform
/// can, so running out of shared memory is an error instead of a SIGBUS.
pub(super) fn reserve(f: &std::fs::File, bytes: usize) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid descriptor, a non-negative range.
        let rc = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, bytes as libc::off_t) };
        if rc == 0 {
            return Ok(());
        }
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    #[allow(unreachable_code)]
    f.set_len(bytes as u64)
}
