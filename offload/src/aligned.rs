//! Page-aligned f32 buffers, as O_DIRECT requires.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// The alignment of buffers, file offsets and request sizes.
pub(crate) const ALIGN: usize = 4096;

/// A zeroed, `ALIGN`-aligned buffer of f32s (its byte length a multiple of
/// `ALIGN`).
pub(crate) struct AlignedBuf {
    ptr: NonNull<f32>,
    len: usize,
}

// SAFETY: the buffer owns its memory exclusively, like a Vec<f32>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// `len` f32s; `len * 4` must be a positive multiple of `ALIGN`.
    pub(crate) fn new(len: usize) -> Self {
        assert!(
            len > 0 && (len * 4) % ALIGN == 0,
            "aligned buffer of {len} f32s"
        );
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(p.cast::<f32>()) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        // Cannot fail: ALIGN is a power of two and the size is small enough
        // for any buffer this crate asks for.
        Layout::from_size_align(len * 4, ALIGN).unwrap_or_else(|_| Layout::new::<u8>())
    }

    pub(crate) fn as_slice(&self) -> &[f32] {
        // SAFETY: `len` initialised (zeroed) f32s owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: as above, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: any f32 is four valid bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<u8>(), self.len * 4) }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: any four bytes are a valid f32.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<u8>(), self.len * 4) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr().cast::<u8>(), Self::layout(self.len)) }
    }
}
