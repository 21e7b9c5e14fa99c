//! Safe wrappers over `csrc/glue.cpp`: what FSDP needs from libtorch that tch
//! 0.26 does not expose.
//!
//! Today: freeing and re-allocating a tensor's storage *in place*. Stage 3
//! frees a unit's gathered parameters after its forward, but autograd has
//! saved views of them for backward; replacing the tensors would leave those
//! views pinning the memory. Freeing the storage itself releases the bytes
//! while every view (and every saved view) stays valid, and re-allocating +
//! refilling it before backward makes them see the right values again —
//! or, without a copy, by *adopting* a gathered buffer as the storage's
//! memory ([`adopt_storage`]), which libtorch hands back when it lets go.

use std::ffi::{c_char, CStr};

mod allocated;
mod flops;
mod freed;
mod linear_loss;
mod loss;
pub use allocated::{allocated, reset_peak_allocated, track_allocations, Allocated};
pub use flops::{count_macs, macs_counted};
pub use linear_loss::{keeps_logits, linear_cross_entropy, LogitsAfter, BLOCK_LOGITS};
pub use loss::cross_entropy;

use tch::Tensor;

/// An error raised by libtorch inside the glue.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GlueError {
    /// libtorch threw; the message is its own.
    #[error("libtorch glue `{op}` failed: {msg}")]
    Torch {
        /// The glue function that failed.
        op: &'static str,
        /// libtorch's message.
        msg: String,
    },
}

mod ffi {
    use std::ffi::c_char;
    use torch_sys::C_tensor;

    extern "C" {
        pub fn zrt_free_error(err: *mut c_char);
        pub fn zrt_storage_nbytes(
            t: *const C_tensor,
            out: *mut usize,
            data: *mut *const std::ffi::c_void,
        ) -> *mut c_char;
        pub fn zrt_storage_free(t: *mut C_tensor, guard: *mut std::ffi::c_void) -> *mut c_char;
        pub fn zrt_storage_realloc(t: *mut C_tensor, nbytes: usize) -> *mut c_char;
        pub fn zrt_storage_adopt(
            t: *mut C_tensor,
            data: *mut std::ffi::c_void,
            nbytes: usize,
            ctx: *mut std::ffi::c_void,
            del: extern "C" fn(*mut std::ffi::c_void),
        ) -> *mut c_char;
        pub fn zrt_clear_grad(t: *mut C_tensor) -> *mut c_char;
        pub fn zrt_register_grad_hook(
            t: *mut C_tensor,
            cb: extern "C" fn(*mut std::ffi::c_void),
            drop: extern "C" fn(*mut std::ffi::c_void),
            ctx: *mut std::ffi::c_void,
        ) -> *mut c_char;
        pub fn zrt_register_post_acc_hook(
            t: *mut C_tensor,
            cb: extern "C" fn(*mut std::ffi::c_void),
            drop: extern "C" fn(*mut std::ffi::c_void),
            ctx: *mut std::ffi::c_void,
        ) -> *mut c_char;
        pub fn zrt_tensor_impl(
            t: *const C_tensor,
            out: *mut *const std::ffi::c_void,
        ) -> *mut c_char;
        pub fn zrt_graph_kept(out: *mut std::ffi::c_int) -> *mut c_char;
        pub fn zrt_backward_id(out: *mut i64) -> *mut c_char;
        pub fn zrt_will_accumulate(t: *const C_tensor, out: *mut std::ffi::c_int) -> *mut c_char;
        pub fn zrt_graph_leaves(
            t: *const C_tensor,
            stop: *const C_tensor,
            out: *mut *const std::ffi::c_void,
            cap: usize,
            len: *mut usize,
        ) -> *mut c_char;
        pub fn zrt_cpu_rng_get(out: *mut u8, cap: usize, len: *mut usize) -> *mut c_char;
        pub fn zrt_cpu_rng_set(state: *const u8, len: usize) -> *mut c_char;
        pub fn zrt_untracked_alias(t: *const C_tensor, out: *mut *mut C_tensor) -> *mut c_char;
        pub fn zrt_grad_alias(t: *const C_tensor, out: *mut *mut C_tensor) -> *mut c_char;
        pub fn zrt_deferred(
            y: *const C_tensor,
            s: *const C_tensor,
            w: *const C_tensor,
            scale: *const C_tensor,
            out: *mut *mut C_tensor,
        ) -> *mut c_char;
        pub fn zrt_probe(
            value: *const C_tensor,
            scale: *const C_tensor,
            out: *mut *mut C_tensor,
        ) -> *mut c_char;
        pub fn zrt_checkpoint(
            inputs: *const *mut C_tensor,
            n: usize,
            run: extern "C" fn(
                *mut std::ffi::c_void,
                *mut *mut C_tensor,
                usize,
                *mut *mut C_tensor,
            ) -> *mut c_char,
            recomputed: extern "C" fn(*mut std::ffi::c_void),
            drop: extern "C" fn(*mut std::ffi::c_void),
            ctx: *mut std::ffi::c_void,
            draws: bool,
            out: *mut *mut C_tensor,
        ) -> *mut c_char;
    }
}

/// Turns the glue's error convention (null = ok, else an owned C string) into a `Result`.
fn check(op: &'static str, err: *mut c_char) -> Result<(), GlueError> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null return is a NUL-terminated string from strdup, which
    // we own and free exactly once here.
    let msg = unsafe { CStr::from_ptr(err) }
        .to_string_lossy()
        .into_owned();
    unsafe { ffi::zrt_free_error(err) };
    Err(GlueError::Torch { op, msg })
}

/// Bytes currently held by the storage behind `t` (0 after [`free_storage`]).
pub fn storage_nbytes(t: &Tensor) -> Result<usize, GlueError> {
    let (n, data) = storage(t)?;
    Ok(match freed::guarded(data as usize) {
        true => 0,
        false => n,
    })
}

/// The storage's length and data pointer.
fn storage(t: &Tensor) -> Result<(usize, *const std::ffi::c_void), GlueError> {
    let mut out = 0usize;
    let mut data = std::ptr::null();
    // SAFETY: `t.as_ptr()` is a live `torch::Tensor*` for the borrow's duration.
    check("storage_nbytes", unsafe {
        ffi::zrt_storage_nbytes(t.as_ptr(), &mut out, &mut data)
    })?;
    Ok((out, data))
}

/// Releases the memory behind `t`'s storage, in place.
///
/// Every tensor sharing the storage (views, and views autograd saved for
/// backward) stays alive but must not be read until [`realloc_storage`] gives
/// the storage memory again and the caller refills it. A CPU storage points
/// into an inaccessible guard meanwhile, so a read stops the process with an
/// explanation (`freed`) rather than reading nothing.
///
/// A storage [`free_storage_to_zeros`] freed moves to an inaccessible guard.
pub fn free_storage(t: &Tensor) -> Result<(), GlueError> {
    free_to(t, false)
}

/// As [`free_storage`], but a CPU storage then reads as zeros (writing it
/// still stops the process), at no cost in memory. For a moment when a
/// read must not fault: the engine frees a unit so after its first
/// forward, so that a later unit using one of its parameters (a tied
/// weight) computes on zeros and the engine names the tie, rather than the
/// read stopping the process. Zeros are wrong values: move the storage to
/// an inaccessible guard ([`free_storage`]) as soon as that moment ends.
pub fn free_storage_to_zeros(t: &Tensor) -> Result<(), GlueError> {
    free_to(t, true)
}

/// Whether `t`'s storage was freed by [`free_storage_to_zeros`] (and reads
/// as zeros).
pub fn reads_zeros(t: &Tensor) -> Result<bool, GlueError> {
    Ok(freed::reads_zeros(storage(t)?.1 as usize))
}

fn free_to(t: &Tensor, zeros: bool) -> Result<(), GlueError> {
    let (n, data) = storage(t)?;
    if freed::guarded(data as usize) && freed::reads_zeros(data as usize) == zeros {
        return Ok(());
    }
    let guard = freed::guard(n, zeros).unwrap_or(std::ptr::null_mut());
    // SAFETY: as above; the glue only touches the storage, which the tensor
    // keeps alive, and tch's handle is not mutated. The guard outlives the
    // process's storages (it is never unmapped), and a guarded storage's old
    // data pointer owns nothing.
    check("storage_free", unsafe {
        ffi::zrt_storage_free(t.as_ptr() as *mut _, guard)
    })
}

/// Whether `t`'s storage was freed ([`free_storage`] or
/// [`free_storage_to_zeros`]) and has no memory.
pub fn is_freed(t: &Tensor) -> Result<bool, GlueError> {
    Ok(freed::guarded(storage(t)?.1 as usize))
}

/// Gives a freed storage back as much fresh, uninitialised memory as it
/// had (refill it before anything reads it); a no-op on one that was not
/// freed. Returns whether it was.
pub fn realloc_if_freed(t: &Tensor) -> Result<bool, GlueError> {
    let (n, data) = storage(t)?;
    if !freed::guarded(data as usize) {
        return Ok(false);
    }
    realloc_storage(t, n)?;
    Ok(true)
}

/// Gives `t`'s storage `nbytes` of fresh, uninitialised memory from its own
/// allocator and device. Refill it (e.g. `copy_`) before anything reads it.
pub fn realloc_storage(t: &Tensor, nbytes: usize) -> Result<(), GlueError> {
    // SAFETY: as in `free_storage`.
    check("storage_realloc", unsafe {
        ffi::zrt_storage_realloc(t.as_ptr() as *mut _, nbytes)
    })
}

/// What a storage adopted from Rust holds: the buffer, and what to do with
/// it when libtorch lets go.
struct Adopted<T> {
    buf: Vec<T>,
    on_release: Box<dyn FnOnce(Vec<T>) + Send>,
}

/// The storage's deleter: hands the buffer to its `on_release`.
extern "C" fn release_adopted<T>(ctx: *mut std::ffi::c_void) {
    // SAFETY: `ctx` is the `Box<Adopted<T>>` `adopt_storage` leaked, and
    // libtorch calls the deleter exactly once.
    let a = unsafe { Box::from_raw(ctx.cast::<Adopted<T>>()) };
    // A panic must not unwind into C++: `on_release` only returns the buffer
    // to a pool, but catch anything anyway (the buffer is then just dropped).
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || (a.on_release)(a.buf)));
}

/// Makes `buf` the memory of `t`'s (freed, CPU) storage without copying;
/// when libtorch releases it (the storage freed with [`free_storage`],
/// re-allocated, or dropped) the buffer goes to `on_release` — a pool, so
/// the next gather reuses memory that is already paged in.
///
/// `buf` must hold exactly the bytes the storage needs. On error the buffer
/// is dropped and the storage is as it was.
pub fn adopt_storage<T: Copy + Send + 'static>(
    t: &Tensor,
    buf: Vec<T>,
    on_release: impl FnOnce(Vec<T>) + Send + 'static,
) -> Result<(), GlueError> {
    let nbytes = std::mem::size_of_val(buf.as_slice());
    let mut a = Box::new(Adopted {
        buf,
        on_release: Box::new(on_release),
    });
    // The Vec's heap block does not move when the Box (or Vec) does.
    let data = a.buf.as_mut_ptr().cast::<std::ffi::c_void>();
    let ctx = Box::into_raw(a).cast::<std::ffi::c_void>();
    // SAFETY: `t.as_ptr()` is live; `data` is valid for `nbytes` for as long
    // as `ctx` is, and the deleter frees `ctx` once.
    let r = check("storage_adopt", unsafe {
        ffi::zrt_storage_adopt(
            t.as_ptr() as *mut _,
            data,
            nbytes,
            ctx,
            release_adopted::<T>,
        )
    });
    if r.is_err() {
        // SAFETY: on error the glue did not take `ctx`; reclaim and drop it.
        drop(unsafe { Box::from_raw(ctx.cast::<Adopted<T>>()) });
    }
    r
}

/// A tensor over the same memory as `t` (same storage, offset, sizes and
/// strides) with its own autograd version counter and no history.
///
/// Write through it to refill a storage after [`realloc_storage`]: writing
/// through `t` or any of its views would bump the version counter autograd
/// checks on saved views, and backward would refuse them ("modified by an
/// inplace operation"). This is what FSDP2 does with
/// `_unsafe_preserve_version_counter`; it is only sound because the refill
/// restores exactly the values the saved views held.
pub fn untracked_alias(t: &Tensor) -> Result<Tensor, GlueError> {
    made_from("untracked_alias", t, ffi::zrt_untracked_alias)
}

/// `y`, through a node whose backward gives `s` the gradient `w` times
/// `scale`'s one element, both read when backward reaches it (filled by
/// the caller after the forward; [`probe`] fills `scale`): a loss term
/// whose gradient in `s` is known only once the whole forward has run,
/// carried by a module's one output (a mixture-of-experts layer's share
/// of the router's load-balancing loss over every layer), so it survives
/// activation checkpointing, whose recompute runs the node again. `scale`
/// NaN when backward reaches the node is an error: the loss holding the
/// term was not the one back-propagated. Megatron's
/// `MoEAuxLossAutoScaler` is the same idea.
pub fn deferred(y: &Tensor, s: &Tensor, w: &Tensor, scale: &Tensor) -> Result<Tensor, GlueError> {
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: every pointer is a live `torch::Tensor*` for the call; on
    // success `out` is a fresh heap `torch::Tensor*` that the returned
    // `Tensor` owns.
    check("deferred", unsafe {
        ffi::zrt_deferred(y.as_ptr(), s.as_ptr(), w.as_ptr(), scale.as_ptr(), &mut out)
    })?;
    // SAFETY: non-null on success, ownership transferred to tch.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// A copy of `value` that needs a gradient, whose backward writes the
/// gradient it is given (the seed: a loss scale, one over the
/// accumulation steps) into `scale` (one element) and goes no further:
/// what [`deferred`]'s gradients are scaled by. Add it to the loss that
/// is back-propagated; autograd runs it before any node of the forward
/// it follows (its node is the newest).
pub fn probe(value: &Tensor, scale: &Tensor) -> Result<Tensor, GlueError> {
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: as in `deferred`.
    check("probe", unsafe {
        ffi::zrt_probe(value.as_ptr(), scale.as_ptr(), &mut out)
    })?;
    // SAFETY: non-null on success, ownership transferred to tch.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// A glue function that makes a new tensor from `t` into `*out`.
type MakeFrom = unsafe extern "C" fn(
    *const torch_sys::C_tensor,
    *mut *mut torch_sys::C_tensor,
) -> *mut std::ffi::c_char;

/// Calls `make` (named `what` in its error) on `t` and owns the tensor
/// it makes.
fn made_from(what: &'static str, t: &Tensor, make: MakeFrom) -> Result<Tensor, GlueError> {
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: `t.as_ptr()` is live for the call; on success `out` is a fresh
    // heap `torch::Tensor*` that the returned `Tensor` owns and frees.
    check(what, unsafe { make(t.as_ptr(), &mut out) })?;
    // SAFETY: non-null on success, ownership transferred to tch.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// A new leaf over `t`'s values (a leaf that requires grad) whose
/// gradient, each time backward accumulates it, is moved into `t`'s
/// `.grad` (added to it when it has one). A use of `t` through the alias
/// hands its gradient over at once; uses of `t` itself wait for each other
/// in libtorch's input buffer and are summed into a new tensor. A tied
/// embedding's head uses its matrix so: the head's gradient is `t`'s
/// `.grad` when the lookup's sparse rows arrive, and they are added into
/// it in place, where they would have been summed into a third matrix.
pub fn grad_alias(t: &Tensor) -> Result<Tensor, GlueError> {
    made_from("grad_alias", t, ffi::zrt_grad_alias)
}

/// The state of libtorch's default CPU generator (`torch.get_rng_state()`).
pub fn cpu_rng_state() -> Result<Vec<u8>, GlueError> {
    let mut len = 0usize;
    // SAFETY: a null buffer asks for the size only.
    check("cpu_rng_state", unsafe {
        ffi::zrt_cpu_rng_get(std::ptr::null_mut(), 0, &mut len)
    })?;
    let mut out = vec![0u8; len];
    // SAFETY: `out` has `len` writable bytes; the C side checks the capacity.
    check("cpu_rng_state", unsafe {
        ffi::zrt_cpu_rng_get(out.as_mut_ptr(), out.len(), &mut len)
    })?;
    out.truncate(len);
    Ok(out)
}

/// Restores a state [`cpu_rng_state`] returned; libtorch rejects a state of
/// the wrong size or version.
pub fn set_cpu_rng_state(state: &[u8]) -> Result<(), GlueError> {
    // SAFETY: `state` is readable for its length during the call.
    check("set_cpu_rng_state", unsafe {
        ffi::zrt_cpu_rng_set(state.as_ptr(), state.len())
    })
}

/// Drops `t`'s `.grad` (tch has no setter for it), releasing its memory.
pub fn clear_grad(t: &Tensor) -> Result<(), GlueError> {
    // SAFETY: `t.as_ptr()` is live for the call; only its grad field changes.
    check("clear_grad", unsafe {
        ffi::zrt_clear_grad(t.as_ptr() as *mut _)
    })
}

// Send, not Sync: autograd calls a hook once per backward, never concurrently.
type HookFn = Box<dyn Fn() + Send>;

extern "C" fn call_hook(ctx: *mut std::ffi::c_void) {
    // SAFETY: `ctx` is the `Box<HookFn>` leaked in `on_grad`, alive until `drop_hook`.
    let f = unsafe { &*(ctx as *const HookFn) };
    // Never unwind into libtorch's C++ frames.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
}

extern "C" fn drop_hook(ctx: *mut std::ffi::c_void) {
    // SAFETY: called exactly once by the hook's owner, with the pointer `on_grad` leaked.
    drop(unsafe { Box::from_raw(ctx as *mut HookFn) });
}

/// Runs `f` when backward has computed the gradient with respect to `t`,
/// before the nodes that consume that gradient run (PyTorch's
/// `Tensor.register_hook`, without changing the gradient). Stage 3 uses it
/// on a unit's output to re-gather the unit's parameters just in time.
/// `f` runs on the thread that runs backward; a panic in it is swallowed.
pub fn on_grad(t: &Tensor, f: impl Fn() + Send + 'static) -> Result<(), GlueError> {
    let boxed: Box<HookFn> = Box::new(Box::new(f));
    let ctx = Box::into_raw(boxed) as *mut std::ffi::c_void;
    // SAFETY: `t` is live; the glue owns `ctx` from here on and calls
    // `drop_hook` exactly once (also on error).
    check("register_grad_hook", unsafe {
        ffi::zrt_register_grad_hook(t.as_ptr() as *mut _, call_hook, drop_hook, ctx)
    })
}

/// Runs `f` each time backward has accumulated a gradient into the leaf
/// `t`'s `.grad` (PyTorch's `register_post_accumulate_grad_hook`; one per
/// leaf, a second call replaces the first). The engine uses it to reduce a
/// unit's gradients as soon as the last of them is ready, while backward
/// goes on with earlier units. `f` runs on the thread that runs backward; a
/// panic in it is swallowed.
pub fn on_grad_accumulated(t: &Tensor, f: impl Fn() + Send + 'static) -> Result<(), GlueError> {
    let boxed: Box<HookFn> = Box::new(Box::new(f));
    let ctx = Box::into_raw(boxed) as *mut std::ffi::c_void;
    // SAFETY: `t` is live; the glue owns `ctx` from here on and calls
    // `drop_hook` exactly once (when the hook dies, or on error).
    check("register_post_acc_hook", unsafe {
        ffi::zrt_register_post_acc_hook(t.as_ptr() as *mut _, call_hook, drop_hook, ctx)
    })
}

/// Whether the backward running on this thread keeps its graph
/// (`retain_graph`, `create_graph`: another backward, a gradient
/// penalty's, may run through the same nodes and the parameters they
/// saved). Outside a backward: `true`.
pub fn graph_kept() -> Result<bool, GlueError> {
    let mut out: std::ffi::c_int = 0;
    // SAFETY: `out` receives a flag only.
    check("graph_kept", unsafe { ffi::zrt_graph_kept(&mut out) })?;
    Ok(out != 0)
}

/// Which backward runs on this thread (`None` outside one): libtorch's
/// graph task id, the same inside a checkpointed segment's recompute (a
/// backward of its own, nested in the one that reached the segment).
pub fn backward_id() -> Result<Option<i64>, GlueError> {
    let mut out: i64 = -1;
    // SAFETY: `out` receives a number only.
    check("backward_id", unsafe { ffi::zrt_backward_id(&mut out) })?;
    Ok((out >= 0).then_some(out))
}

/// Whether the backward running on this thread accumulates a gradient into
/// the leaf `t`'s `.grad`: not one that asked for other tensors' gradients
/// only (`torch.autograd.grad(loss, x)`, whose parameters' gradient hooks
/// never fire). Outside a backward, or in one that runs every node: whether
/// `t` requires grad. PyTorch's `_will_engine_execute_node`.
pub fn will_accumulate(t: &Tensor) -> Result<bool, GlueError> {
    let mut out: std::ffi::c_int = 0;
    // SAFETY: `t` is live for the call; `out` receives a flag only.
    check("will_accumulate", unsafe {
        ffi::zrt_will_accumulate(t.as_ptr(), &mut out)
    })?;
    Ok(out != 0)
}

/// Whether the backward running on this thread accumulates into any of
/// `ts` ([`will_accumulate`] of each, stopping at the first that does).
pub fn will_accumulate_any<'a>(
    ts: impl IntoIterator<Item = &'a Tensor>,
) -> Result<bool, GlueError> {
    for t in ts {
        if will_accumulate(t)? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The address of the `TensorImpl` behind `t`: the identity autograd's
/// leaves have (a `shallow_clone` shares it).
pub fn tensor_impl(t: &Tensor) -> Result<usize, GlueError> {
    let mut out: *const std::ffi::c_void = std::ptr::null();
    // SAFETY: `t` is live for the call; `out` receives an address only.
    check("tensor_impl", unsafe {
        ffi::zrt_tensor_impl(t.as_ptr(), &mut out)
    })?;
    Ok(out as usize)
}

/// The leaves (as [`tensor_impl`] addresses) backward from `t` would
/// accumulate into, not looking past `stop`'s history: with `stop` a
/// module's input and `t` its output, the parameters the module used; with
/// no `stop` and `t` a loss, every parameter its backward will reach
/// (but for those a checkpointed segment hides until its recompute).
pub fn graph_leaves(t: &Tensor, stop: Option<&Tensor>) -> Result<Vec<usize>, GlueError> {
    let stop = stop.map_or(std::ptr::null(), |s| s.as_ptr());
    let mut cap = 64;
    loop {
        let mut out: Vec<*const std::ffi::c_void> = vec![std::ptr::null(); cap];
        let mut len = 0usize;
        // SAFETY: `t` and `stop` (or null) are live; `out` has `cap`
        // writable slots and the C side writes at most that many.
        check("graph_leaves", unsafe {
            ffi::zrt_graph_leaves(t.as_ptr(), stop, out.as_mut_ptr(), cap, &mut len)
        })?;
        if len <= cap {
            return Ok(out[..len].iter().map(|&p| p as usize).collect());
        }
        cap = len;
    }
}

/// A checkpointed segment's body: the output from the inputs.
type SegmentBody = Box<dyn Fn(&[Tensor]) -> Result<Tensor, String> + Send>;

/// A checkpointed segment's body and what to call when a backward's
/// recompute has accumulated its gradients.
struct SegmentFn {
    body: SegmentBody,
    recomputed: Box<dyn Fn() + Send>,
}

extern "C" fn run_segment(
    ctx: *mut std::ffi::c_void,
    inputs: *mut *mut torch_sys::C_tensor,
    n: usize,
    out: *mut *mut torch_sys::C_tensor,
) -> *mut c_char {
    // SAFETY: `ctx` is the `Box<SegmentFn>` leaked in `checkpoint`, alive
    // until `drop_segment`; `inputs` holds `n` fresh handles this call owns.
    let f = unsafe { &*(ctx as *const SegmentFn) };
    let xs: Vec<Tensor> = (0..n)
        .map(|i| unsafe { Tensor::from_ptr(*inputs.add(i)) })
        .collect();
    // Never unwind into libtorch's C++ frames.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (f.body)(&xs)))
        .unwrap_or_else(|p| {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(format!("the checkpointed segment panicked: {what}"))
        });
    match result {
        Ok(mut y) => {
            // SAFETY: the handle moves to the glue, which deletes it.
            unsafe { *out = y.as_mut_ptr() };
            std::mem::forget(y);
            std::ptr::null_mut()
        }
        // The glue frees it with `zrt_free_error` (strdup's allocator).
        Err(msg) => match std::ffi::CString::new(msg.replace('\0', " ")) {
            Ok(c) => unsafe { libc_strdup(c.as_ptr()) },
            Err(_) => std::ptr::null_mut(),
        },
    }
}

extern "C" {
    #[link_name = "strdup"]
    fn libc_strdup(s: *const c_char) -> *mut c_char;
}

extern "C" fn segment_recomputed(ctx: *mut std::ffi::c_void) {
    // SAFETY: as in `run_segment`.
    let f = unsafe { &*(ctx as *const SegmentFn) };
    // Never unwind into libtorch's C++ frames; what it tells the engine
    // is bookkeeping, and a panic there leaves the engine to reduce the
    // units at the end of backward.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (f.recomputed)()));
}

extern "C" fn drop_segment(ctx: *mut std::ffi::c_void) {
    // SAFETY: called exactly once by the segment's owner, with the pointer
    // `checkpoint` leaked.
    let f = unsafe { Box::from_raw(ctx as *mut SegmentFn) };
    // Never unwind into libtorch's C++ frames (the closures' captures
    // may tell an engine something when dropped).
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(f)));
}

/// Runs `f` on `inputs` without keeping its activations, and returns its
/// output, whose backward runs `f` again (with its graph) and
/// back-propagates through that: activation checkpointing, as PyTorch's
/// reentrant `torch.utils.checkpoint`. The CPU generator's state is put
/// back for the second run, so dropout draws the same masks. `f` must
/// compute the same function both times. An error or panic in `f` is
/// returned here (forward) or by the backward (the second run).
pub fn checkpoint(
    inputs: &[&Tensor],
    f: impl Fn(&[Tensor]) -> Result<Tensor, String> + Send + 'static,
) -> Result<Tensor, GlueError> {
    checkpoint_with(inputs, f, || {})
}

/// [`checkpoint`] of a segment that draws no random numbers (an
/// activation): no generator state is kept, so the forward keeps its
/// inputs and nothing else. A segment that draws anyway draws other
/// numbers in the recompute, and its gradient is wrong.
pub fn checkpoint_without_draws(
    inputs: &[&Tensor],
    f: impl Fn(&[Tensor]) -> Result<Tensor, String> + Send + 'static,
) -> Result<Tensor, GlueError> {
    segment(inputs, (Box::new(f), Box::new(|| {})), false)
}

/// [`checkpoint`], calling `recomputed` each time a backward has run `f`
/// again and back-propagated through it, accumulating its parameters'
/// gradients (not for `torch.autograd.grad`, which accumulates none).
/// `f` and `recomputed` are dropped with the graph that holds the segment.
pub fn checkpoint_with(
    inputs: &[&Tensor],
    f: impl Fn(&[Tensor]) -> Result<Tensor, String> + Send + 'static,
    recomputed: impl Fn() + Send + 'static,
) -> Result<Tensor, GlueError> {
    segment(inputs, (Box::new(f), Box::new(recomputed)), true)
}

/// The checkpointed segment `body` on `inputs`, keeping the generator's
/// state for its recompute when it `draws`.
fn segment(
    inputs: &[&Tensor],
    (body, recomputed): (SegmentBody, Box<dyn Fn() + Send>),
    draws: bool,
) -> Result<Tensor, GlueError> {
    let boxed = Box::new(SegmentFn { body, recomputed });
    let ctx = Box::into_raw(boxed) as *mut std::ffi::c_void;
    let handles: Vec<*mut torch_sys::C_tensor> =
        inputs.iter().map(|t| t.as_ptr() as *mut _).collect();
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: the handles are live for the call (the glue copies them); the
    // glue owns `ctx` from here on and calls `drop_segment` exactly once.
    check("checkpoint", unsafe {
        ffi::zrt_checkpoint(
            handles.as_ptr(),
            handles.len(),
            run_segment,
            segment_recomputed,
            drop_segment,
            ctx,
            draws,
            &mut out,
        )
    })?;
    // SAFETY: on success `out` is a fresh handle this side owns.
    Ok(unsafe { Tensor::from_ptr(out) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// `w` used by a head (`x @ w^T`, through a gradient alias or not) and
    /// a sparse lookup of `ids`, the lookup built first when `lookup_first`
    /// (autograd runs the later-built term's backward first); the loss's
    /// gradient in `w.grad`, and whether the alias kept any.
    fn grad_of(alias: bool, lookup_first: bool) -> (Tensor, bool) {
        let w = Tensor::arange(12, (Kind::Float, Device::Cpu))
            .view([4, 3])
            .sin()
            .set_requires_grad(true);
        let x = Tensor::from_slice(&[0.5f32, -1.0, 2.0, 0.25, 1.5, -0.5]).view([2, 3]);
        let ids = Tensor::from_slice(&[1i64, 3, 1]);
        let a = match alias {
            true => grad_alias(&w).unwrap(),
            false => w.shallow_clone(),
        };
        let head = || (x.matmul(&a.tr())).square().sum(Kind::Float);
        let lookup = || {
            Tensor::embedding(&w, &ids, -1, false, true)
                .cos()
                .sum(Kind::Float)
        };
        match lookup_first {
            // The lookup's sparse rows reach `w.grad` first, then the
            // head's dense gradient is added to them (a new dense sum).
            false => (head() + lookup()).backward(),
            // The head's gradient is `w.grad` first (a tied embedding's
            // order), the rows added into it in place.
            true => (lookup() + head()).backward(),
        }
        let kept = a.grad().defined() && alias;
        (w.grad(), kept)
    }

    #[test]
    fn a_gradient_alias_moves_its_gradient_into_its_target() {
        let (want, _) = grad_of(false, false);
        assert!(!want.is_sparse());
        for lookup_first in [false, true] {
            let (got, kept) = grad_of(true, lookup_first);
            assert!(!kept, "the alias kept its gradient");
            let got = got.to_dense(None, false);
            let diff = (&got - &want).abs().max().double_value(&[]);
            assert!(diff < 1e-6, "lookup first {lookup_first}: {diff}");
        }
        // Only through the alias: its gradient is the target's.
        let w = Tensor::ones([2, 2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let a = grad_alias(&w).unwrap();
        (&a * 3.0).sum(Kind::Float).backward();
        assert_eq!(
            Vec::<f32>::try_from(w.grad().flatten(0, -1)).unwrap(),
            vec![3.0; 4]
        );
        assert!(!a.grad().defined());
        // A tensor that does not train has no gradient to move.
        let frozen = Tensor::ones([2], (Kind::Float, Device::Cpu));
        let err = grad_alias(&frozen).unwrap_err().to_string();
        assert!(err.contains("needs a leaf that requires grad"), "{err}");
    }
    #[test]
    fn a_deferred_gradient_reaches_its_tensor_scaled_by_the_probed_seed() {
        let cpu = (Kind::Float, Device::Cpu);
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).set_requires_grad(true);
        let s = &x * 2.0;
        let (w, scale) = (
            Tensor::zeros([3], cpu),
            Tensor::zeros([1], (Kind::Double, Device::Cpu)),
        );
        let y = deferred(&(&x * 1.0), &s, &w, &scale).unwrap();
        // Filled after the forward, as the balance fills them.
        w.shallow_clone()
            .copy_(&Tensor::from_slice(&[0.5f32, -1.0, 4.0]));
        let _ = scale.shallow_clone().fill_(f64::NAN);
        let value = Tensor::from(7.0f32);
        let loss = y.sum(Kind::Float) + probe(&value, &scale).unwrap();
        assert_eq!(loss.double_value(&[]), 13.0);
        (loss * 3.0).backward();
        // y's own gradient (3 each), and s's: w times the seed 3, times
        // 2 through s = 2x.
        let got = Vec::<f32>::try_from(x.grad()).unwrap();
        assert_eq!(got, vec![3.0 + 3.0, 3.0 - 6.0, 3.0 + 24.0]);
        assert_eq!(scale.double_value(&[0]), 3.0);
        // Back-propagating from the term's tensor without the loss that
        // holds the probe: the seed is unknown, and backward says so.
        let x = Tensor::from_slice(&[1.0f32]).set_requires_grad(true);
        let _ = scale.shallow_clone().fill_(f64::NAN);
        let y = deferred(&(&x * 1.0), &(&x * 1.0), &w.narrow(0, 0, 1), &scale).unwrap();
        let err = y.sum(Kind::Float).f_backward().unwrap_err().to_string();
        assert!(err.contains("reached before the loss holding it"), "{err}");
    }
}
