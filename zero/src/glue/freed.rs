//! Where a freed parameter's storage points, so that reading it stops the
//! process with an explanation instead of a bare crash or a file of
//! nothing.
//!
//! Stage 3 frees a unit's parameters between uses, as FSDP does: the
//! storage object stays (with every view and every tensor autograd saved)
//! but has no memory. FSDP's `resize_(0)` leaves a null pointer and zero
//! bytes. Code that reads the bytes itself then misbehaves: libtorch's
//! `.pt` pickler (tch's `VarStore::save`) writes zero-byte storages and
//! reports success, so the file cannot be loaded again; the safetensors path
//! dereferences null and the process dies of SIGSEGV with no word of why.
//!
//! So a freed CPU storage keeps its length and points into a *guard*: a
//! reserved, inaccessible (`PROT_NONE`) range of address space that costs
//! no memory. Every read faults, and a SIGSEGV handler recognises a fault
//! inside a guard, prints what happened and what to do instead, and lets
//! the signal stop the process. Any other fault goes to the handler that
//! was there before (Rust's stack-overflow report, a debugger's).
//! [`super::storage_nbytes`] reports a guarded storage as 0 bytes.
//!
//! A second kind of guard reads as zeros (`PROT_READ` over no memory: the
//! kernel maps its shared zero page) and faults only on a write. The engine
//! points a unit's storage there after the unit's first forward, so that a
//! later unit reading one of its parameters (a tied weight) computes on
//! zeros instead of faulting, and the engine names the tie from the graph
//! ([`super::free_storage_to_zeros`]); then it moves them to an
//! inaccessible guard.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// Guards reserved so far: (start, length) pairs, read by the handler.
const MAX_GUARDS: usize = 32;
static GUARDS: [(AtomicUsize, AtomicUsize); MAX_GUARDS] =
    [const { (AtomicUsize::new(0), AtomicUsize::new(0)) }; MAX_GUARDS];
/// Which of [`GUARDS`] read as zeros.
static READABLE: [AtomicBool; MAX_GUARDS] = [const { AtomicBool::new(false) }; MAX_GUARDS];
static RESERVE: Mutex<usize> = Mutex::new(0);
/// The SIGSEGV disposition before ours.
static PREV: OnceLock<libc::sigaction> = OnceLock::new();

/// Reserved at least this much at a time, so a model reserves once.
const MIN_GUARD: usize = 1 << 30;

/// What the handler prints (no allocation is allowed there).
const MESSAGE: &str = "\nzrt: a stage-3 parameter whose memory the engine freed was read or written outside a forward, a backward or with_full_params (VarStore::save or load, printing or copying a weight). Between steps stage 3 keeps only each rank's shard: the parameters themselves have no memory. Save the model with engine.with_full_params(|| vs.save(path)), export it with engine.save_16bit_model(path), or call engine.unshard() first to use it whole (after the engine, for inference). If it happened inside a forward or backward of the wrapped units, zrt freed a unit that autograd still needed: that is zrt's defect, please report it with how the units are used (run twice, checkpointed, shared weights). On a rank other than the first, under ShardPlan::weights_on_first_rank_only (on every rank under ShardPlan::weights_from_file and weights_on_disk_while_built), every weight has no memory from its block's ShardedModule::new until the engine is built: load pretrained weights on rank 0 only (under weights_from_file the engine loads the file; under weights_on_disk_while_built use weights_from_file instead), and build the engine before anything uses the model. The process is stopped (SIGSEGV).\n";

/// The start of a guard at least `nbytes` long, reserving one (and
/// installing the handler) if none is; `None` if the address space or the
/// table of guards is exhausted (the storage is then freed to null).
/// `readable`: one that reads as zeros (see the module's docs).
pub(super) fn guard(nbytes: usize, readable: bool) -> Option<*mut std::ffi::c_void> {
    let mut reserved = RESERVE.lock().unwrap_or_else(|e| e.into_inner());
    let found = GUARDS[..*reserved]
        .iter()
        .zip(&READABLE)
        .map(|((s, l), r)| {
            (
                s.load(Ordering::Acquire),
                l.load(Ordering::Acquire),
                r.load(Ordering::Acquire),
            )
        })
        .find(|&(_, l, r)| l >= nbytes && r == readable);
    if let Some((start, _, _)) = found {
        return Some(start as *mut _);
    }
    if *reserved == MAX_GUARDS {
        return None;
    }
    let len = nbytes.max(MIN_GUARD).checked_next_power_of_two()?;
    // SAFETY: a fresh anonymous mapping nobody else knows of; PROT_NONE (or
    // PROT_READ: reads map the kernel's shared zero page) and MAP_NORESERVE,
    // so it takes address space only.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            if readable {
                libc::PROT_READ
            } else {
                libc::PROT_NONE
            },
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        tracing::warn!(
            len,
            "no address space for a freed-parameter guard: freed parameters point at null"
        );
        return None;
    }
    let (s, l) = &GUARDS[*reserved];
    READABLE[*reserved].store(readable, Ordering::Release);
    s.store(p as usize, Ordering::Release);
    l.store(len, Ordering::Release);
    *reserved += 1;
    install();
    Some(p)
}

/// Whether `p` points into a guard (a freed storage's data).
pub(super) fn guarded(p: usize) -> bool {
    which(p).is_some()
}

/// Whether `p` points into a guard that reads as zeros.
pub(super) fn reads_zeros(p: usize) -> bool {
    which(p).is_some_and(|k| READABLE[k].load(Ordering::Acquire))
}

/// The guard `p` points into.
fn which(p: usize) -> Option<usize> {
    GUARDS.iter().position(|(s, l)| {
        let start = s.load(Ordering::Acquire);
        start != 0 && p >= start && p - start < l.load(Ordering::Acquire)
    })
}

/// Installs [`on_segv`] once, keeping the previous disposition to chain to.
fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: plain sigaction calls with zeroed, then filled, structs;
        // the handler only reads atomics and the saved disposition, and
        // writes with write(2), all async-signal-safe.
        unsafe {
            let mut ours: libc::sigaction = std::mem::zeroed();
            ours.sa_sigaction = on_segv as *const () as usize;
            // On the thread's alternate stack when it has one (Rust gives
            // each thread one, for its stack-overflow report).
            ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut ours.sa_mask);
            let mut prev: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGSEGV, &ours, &mut prev) == 0 {
                let _ = PREV.set(prev);
            }
        }
    });
}

extern "C" fn on_segv(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    if guarded(addr) {
        // SAFETY: write(2) and signal(2) are async-signal-safe. Returning
        // runs the faulting read again, which the default action now
        // turns into the usual SIGSEGV exit (and core dump).
        unsafe {
            let _ = libc::write(2, MESSAGE.as_ptr().cast(), MESSAGE.len());
            libc::signal(libc::SIGSEGV, libc::SIG_DFL);
        }
        return;
    }
    // Not ours: the previous disposition's.
    let Some(prev) = PREV.get() else {
        // SAFETY: as above.
        unsafe { libc::signal(libc::SIGSEGV, libc::SIG_DFL) };
        return;
    };
    match prev.sa_sigaction {
        libc::SIG_DFL | libc::SIG_IGN => {
            // SAFETY: restores the saved disposition; the fault repeats
            // under it.
            unsafe { libc::sigaction(libc::SIGSEGV, prev, std::ptr::null_mut()) };
        }
        h if prev.sa_flags & libc::SA_SIGINFO != 0 => {
            // SAFETY: the previous handler was installed with SA_SIGINFO,
            // so this is its signature.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(h) };
            f(sig, info, ctx);
        }
        h => {
            // SAFETY: a plain handler's signature.
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(h) };
            f(sig);
        }
    }
}
