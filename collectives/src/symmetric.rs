//! Symmetric buffers: one buffer per rank, allocated by every rank of a
//! group together, which the shared-memory backend's peers read in place.
//!
//! A process cannot read a peer's private memory, so a collective over
//! ordinary `Vec`s must stage every byte a peer needs through a shared
//! segment: a copy in, a copy out. When the buffer itself lives in shared
//! memory that every rank has mapped, a peer reads it where it is: the
//! reduce-scatter reads each rank's part once and writes the result once,
//! the all-gather copies each peer's part once. This is the idea of NCCL's
//! user-buffer registration and of PyTorch's `SymmetricMemory`: allocation
//! is a collective (every rank allocates the same length, in the same
//! order), so the n buffers of one allocation are known to belong together.
//!
//! Backends without shared memory (local threads, tcp) hand out ordinary
//! heap buffers and run the ordinary in-place collectives on them, so code
//! written against [`SymmetricBuf`] runs everywhere.

use std::fmt;
use std::ops::{Deref, DerefMut};

use memmap2::MmapMut;

use crate::Element;

/// A buffer allocated by every rank of a group together
/// ([`ProcessGroup::alloc_symmetric`](crate::ProcessGroup::alloc_symmetric)):
/// a slice of `T` this rank reads and writes as any other, which the other
/// ranks read (never write) during the group's symmetric collectives.
///
/// It belongs to the group that allocated it: another shm group refuses it
/// (backends without shared memory take it through a copy). Dropping it
/// frees this rank's mapping; the memory goes when every rank has dropped
/// its own.
pub struct SymmetricBuf<T: Element> {
    len: usize,
    mem: Mem<T>,
}

enum Mem<T> {
    /// Backends without shared memory.
    Heap(Vec<T>),
    /// The shm backend: this rank's buffer and its view of every peer's.
    Shared(Shared),
}

/// The shm backend's side of a buffer.
pub(crate) struct Shared {
    /// Which group allocated it (a process-unique serial).
    pub(crate) group: u64,
    /// The allocation's number within that group (the same on every rank).
    pub(crate) id: u32,
    /// Every rank's buffer, in group order (this rank's own among them).
    pub(crate) maps: Vec<MmapMut>,
    /// This rank's index in `maps`.
    pub(crate) me: usize,
}

impl Shared {
    /// Rank `r`'s buffer.
    pub(crate) fn ptr<T>(&self, r: usize) -> *mut T {
        self.maps[r].as_ptr() as *mut T
    }
}

impl<T: Element> SymmetricBuf<T> {
    /// An ordinary heap buffer (backends without shared memory).
    pub(crate) fn heap(v: Vec<T>) -> Self {
        Self {
            len: v.len(),
            mem: Mem::Heap(v),
        }
    }

    /// A buffer of `len` elements in `shared`'s mappings (which hold at
    /// least that many bytes each, zero-filled).
    pub(crate) fn shared(shared: Shared, len: usize) -> Self {
        debug_assert!(shared
            .maps
            .iter()
            .all(|m| m.len() >= len * std::mem::size_of::<T>()));
        Self {
            len,
            mem: Mem::Shared(shared),
        }
    }

    /// The heap buffer, or `self` back when it lives in shared memory.
    pub(crate) fn into_heap(self) -> Result<Vec<T>, Self> {
        match self.mem {
            Mem::Heap(v) => Ok(v),
            mem => Err(Self { len: self.len, mem }),
        }
    }

    /// The shared-memory side, if it has one.
    pub(crate) fn shared_part(&self) -> Option<&Shared> {
        match &self.mem {
            Mem::Shared(s) => Some(s),
            Mem::Heap(_) => None,
        }
    }

    /// Whether peers read this buffer in place (the shm backend), rather
    /// than it being an ordinary heap buffer.
    pub fn is_shared(&self) -> bool {
        matches!(self.mem, Mem::Shared(_))
    }
}

impl<T: Element> Deref for SymmetricBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.mem {
            Mem::Heap(v) => v,
            // SAFETY: the mapping holds `len` elements (checked when made),
            // page-aligned, and every bit pattern is a valid `Element`.
            // Peers only read this rank's buffer, and only inside a
            // collective, which owns the buffer meanwhile.
            Mem::Shared(s) => unsafe {
                std::slice::from_raw_parts(s.ptr::<T>(s.me) as *const T, self.len)
            },
        }
    }
}

impl<T: Element> DerefMut for SymmetricBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.mem {
            Mem::Heap(v) => v,
            // SAFETY: as in `deref`; `&mut self` makes the borrow unique.
            Mem::Shared(s) => unsafe { std::slice::from_raw_parts_mut(s.ptr::<T>(s.me), self.len) },
        }
    }
}

impl<T: Element> fmt::Debug for SymmetricBuf<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("SymmetricBuf");
        d.field("dtype", &T::DTYPE).field("len", &self.len);
        if let Mem::Shared(s) = &self.mem {
            d.field("allocation", &s.id);
        }
        d.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::SymmetricBuf;

    #[test]
    fn debug_names_the_type_and_length_not_the_contents() {
        let b = SymmetricBuf::heap(vec![1.5f32; 3]);
        assert_eq!(format!("{b:?}"), "SymmetricBuf { dtype: F32, len: 3 }");
    }
}
