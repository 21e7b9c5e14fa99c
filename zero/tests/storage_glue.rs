//! Proves the libtorch glue's storage trick that stage 3 depends on: a tensor's
//! storage can be freed while autograd holds a view of it, the bytes really go
//! back to the OS, and after re-allocating and refilling it backward computes
//! the right gradient from the refilled values.

use tch::{Device, Kind, Tensor};
use zrt_zero::glue;

/// Held by the tests that measure the RSS, whose 128-256 MiB would
/// otherwise move each other's figures.
static RSS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Resident set size of this process, from /proc/self/statm.
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("read /proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("statm resident field");
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    pages * page
}

#[test]
fn freed_storage_is_released_and_backward_sees_refilled_values() {
    let _rss = RSS.lock().unwrap_or_else(|e| e.into_inner());
    const N: i64 = 64 << 20; // 64 Mi floats = 256 MiB
    const OFF: i64 = 16;
    let pattern = || Tensor::arange(N, (Kind::Float, Device::Cpu)).remainder(7.0);

    // The "gathered flat buffer" and a parameter view into it, as stage 3 has.
    let flat = pattern();
    let w = flat.narrow(0, OFF, N - OFF);
    let x = Tensor::ones([N - OFF], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    // MulBackward saves `w` to compute d(sum(x*w))/dx = w.
    let y = (&x * &w).sum(Kind::Float);

    let nbytes = glue::storage_nbytes(&flat).unwrap();
    assert_eq!(nbytes, (N as usize) * 4);

    let before = rss_bytes();
    glue::free_storage(&flat).unwrap();
    let after = rss_bytes();
    assert_eq!(glue::storage_nbytes(&flat).unwrap(), 0);
    assert_eq!(
        glue::storage_nbytes(&w).unwrap(),
        0,
        "views share the storage"
    );
    let released = before.saturating_sub(after);
    assert!(
        released >= 200 << 20,
        "freeing 256 MiB released only {} MiB of RSS (before {} MiB, after {} MiB)",
        released >> 20,
        before >> 20,
        after >> 20
    );

    // Re-allocate and refill, as the pre-backward re-gather does.
    glue::realloc_storage(&flat, nbytes).unwrap();
    let mut writer = glue::untracked_alias(&flat).unwrap();
    writer.copy_(&pattern());

    y.backward();
    let grad = x.grad();
    let expected = pattern().narrow(0, OFF, N - OFF);
    assert!(
        grad.equal(&expected),
        "gradient does not equal the refilled values"
    );
    // And the forward value was computed before the free: sum over the view
    // (an f32 reduction of 64 Mi terms, so compare relatively).
    let want: f64 = expected.sum(Kind::Double).double_value(&[]);
    let got = y.double_value(&[]);
    assert!(
        (got - want).abs() <= 1e-6 * want,
        "forward sum {got} != {want}"
    );
}

#[test]
fn storage_not_owned_by_torch_is_refused_with_a_reason() {
    let mut data = vec![1.0f32; 64];
    // SAFETY: `data` outlives `t`, and has 64 f32s as described.
    let t = unsafe {
        Tensor::from_blob(
            data.as_mut_ptr() as *const u8,
            &[64],
            &[1],
            Kind::Float,
            Device::Cpu,
        )
    };
    let err = glue::free_storage(&t).unwrap_err().to_string();
    assert!(err.contains("not resizable"), "unexpected error: {err}");
    // Untouched on refusal.
    assert_eq!(glue::storage_nbytes(&t).unwrap(), 64 * 4);
    drop(t);
    assert_eq!(data[0], 1.0);
}

#[test]
fn refilling_through_the_tensor_itself_is_caught_by_autograd() {
    // Why `untracked_alias` exists: a write through a saved view's own tensor
    // bumps its version and backward refuses it. If this ever stops failing,
    // libtorch changed and the alias is no longer needed.
    let flat = Tensor::ones([1024], (Kind::Float, Device::Cpu));
    let w = flat.narrow(0, 0, 512);
    let x = Tensor::ones([512], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let y = (&x * &w).sum(Kind::Float);
    tch::no_grad(|| {
        let mut f = flat.shallow_clone();
        let _ = f.fill_(2.0);
    });
    let err = y.f_backward().unwrap_err().to_string();
    assert!(err.contains("modified by an inplace operation"), "{err}");
}

#[test]
fn a_grad_hook_refills_freed_storage_before_the_nodes_that_need_it() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    // Stage 3's pattern: a unit's parameters are views of `flat`; after the
    // unit's forward the storage is freed; a hook on the unit's output
    // re-gathers (here: refills) it before the unit's backward runs.
    let values = Tensor::arange(32, (Kind::Float, Device::Cpu)) * 0.25 - 3.0;
    let flat = values.copy();
    let w = flat.narrow(0, 0, 16).view([4, 4]);
    let x = Tensor::ones([2, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let y = x.matmul(&w.tr());
    let calls = Arc::new(AtomicUsize::new(0));
    let (c, alias, src) = (
        calls.clone(),
        glue::untracked_alias(&flat).unwrap(),
        values.copy(),
    );
    let nbytes = glue::storage_nbytes(&flat).unwrap();
    glue::on_grad(&y, move || {
        c.fetch_add(1, Ordering::SeqCst);
        glue::realloc_storage(&alias, nbytes).unwrap();
        alias.shallow_clone().copy_(&src);
    })
    .unwrap();
    glue::free_storage(&flat).unwrap();
    assert_eq!(glue::storage_nbytes(&w).unwrap(), 0);
    y.sum(Kind::Float).backward();
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the hook ran once");
    // d sum(x W^T) / dx = column sums of W, from the refilled values.
    let want = values
        .narrow(0, 0, 16)
        .view([4, 4])
        .sum_dim_intlist(0, false, Kind::Float)
        .unsqueeze(0)
        .expand([2, 4], false);
    assert!(
        x.grad().allclose(&want, 0.0, 0.0, false),
        "gradient from refilled values"
    );
    let e = glue::on_grad(&Tensor::ones([1], (Kind::Float, Device::Cpu)), || {}).unwrap_err();
    assert!(e.to_string().contains("does not require grad"), "{e}");
}

#[test]
fn post_accumulate_grad_hooks_fire_once_per_backward_after_the_grad_is_in() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let w = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let seen = Arc::new(AtomicUsize::new(0));
    let sum = Arc::new(std::sync::Mutex::new(0.0f64));
    let (s2, w2, sum2) = (seen.clone(), w.shallow_clone(), sum.clone());
    glue::on_grad_accumulated(&w, move || {
        s2.fetch_add(1, Ordering::SeqCst);
        // The gradient is already accumulated when the hook runs.
        *sum2.lock().unwrap() = w2.grad().sum(Kind::Float).double_value(&[]);
    })
    .unwrap();
    // w used twice: one accumulation, one call.
    let y = (&w * 2.0 + &w * 3.0).sum(Kind::Float);
    y.backward();
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    assert_eq!(*sum.lock().unwrap(), 15.0);
    (&w * 1.0).sum(Kind::Float).backward();
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    assert_eq!(*sum.lock().unwrap(), 18.0);
    // Not a leaf: refused.
    let v = &w * 2.0;
    assert!(glue::on_grad_accumulated(&v, || {}).is_err());
}

#[test]
fn an_adopted_buffer_is_the_storage_until_freed_then_comes_back() {
    // A stage-3 unit: a flat buffer and a parameter view that autograd saves.
    let flat = Tensor::zeros([8], (Kind::Float, Device::Cpu));
    let w = flat.narrow(0, 2, 4);
    let x = Tensor::ones([4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let y = (&x * &w).sum(Kind::Float);
    glue::free_storage(&flat).unwrap();

    // Gathered values become the storage without a copy.
    let gathered: Vec<f32> = (0..8).map(|i| i as f32 * 1.5).collect();
    let at = gathered.as_ptr() as usize;
    let back = std::sync::Arc::new(std::sync::Mutex::new(None));
    let back2 = back.clone();
    glue::adopt_storage(&flat, gathered, move |v: Vec<f32>| {
        *back2.lock().unwrap() = Some(v);
    })
    .unwrap();
    assert_eq!(
        flat.data_ptr() as usize,
        at,
        "the buffer itself, not a copy"
    );
    assert_eq!(glue::storage_nbytes(&w).unwrap(), 32);
    y.backward();
    assert_eq!(
        Vec::<f32>::try_from(&x.grad()).unwrap(),
        vec![3.0, 4.5, 6.0, 7.5],
        "backward read the adopted values through the saved view"
    );
    assert!(
        back.lock().unwrap().is_none(),
        "held while the storage uses it"
    );

    // Freeing the storage hands the buffer back, contents intact.
    glue::free_storage(&flat).unwrap();
    let v = back.lock().unwrap().take().expect("returned on free");
    assert_eq!(v.as_ptr() as usize, at);
    assert_eq!(v[7], 10.5);
}

#[test]
fn a_storage_that_cannot_adopt_drops_the_buffer_and_stays_as_it_was() {
    // Memory torch does not own (from_slice copies, so wrap a blob).
    let mut data = [1f32, 2.0, 3.0];
    // SAFETY: `data` outlives `t`, which is dropped at the end of the test.
    let t = unsafe {
        Tensor::from_blob(
            data.as_mut_ptr().cast(),
            &[3],
            &[1],
            Kind::Float,
            Device::Cpu,
        )
    };
    let called = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let c2 = called.clone();
    let e = glue::adopt_storage(&t, vec![9f32; 3], move |_| {
        c2.store(true, std::sync::atomic::Ordering::SeqCst)
    })
    .unwrap_err();
    assert!(e.to_string().contains("not resizable"), "{e}");
    assert!(
        !called.load(std::sync::atomic::Ordering::SeqCst),
        "not a release"
    );
    assert_eq!(Vec::<f32>::try_from(&t).unwrap(), vec![1.0, 2.0, 3.0]);
}

#[test]
fn a_storage_freed_to_zeros_reads_zeros_for_no_memory_until_guarded() {
    let _rss = RSS.lock().unwrap_or_else(|e| e.into_inner());
    const N: i64 = 32 << 20; // 32 Mi floats = 128 MiB
    let flat = Tensor::ones([N], (Kind::Float, Device::Cpu));
    let w = flat.narrow(0, 8, N - 8);
    let nbytes = glue::storage_nbytes(&flat).unwrap();
    let before = rss_bytes();
    glue::free_storage_to_zeros(&flat).unwrap();
    assert_eq!(glue::storage_nbytes(&flat).unwrap(), 0, "held no memory");
    assert!(glue::reads_zeros(&w).unwrap());
    // A reader (a tied weight's other unit) computes on zeros: every page
    // read maps the kernel's one zero page, so the RSS stays down.
    let sum = w.sum(Kind::Double).double_value(&[]);
    assert_eq!(sum, 0.0);
    let after = rss_bytes();
    assert!(
        before.saturating_sub(after) >= 100 << 20,
        "freeing 128 MiB to zeros and reading it left RSS at {} MiB from {} MiB",
        after >> 20,
        before >> 20
    );
    // Then into the inaccessible guard, and back to memory as usual.
    glue::free_storage(&flat).unwrap();
    assert!(!glue::reads_zeros(&flat).unwrap());
    assert_eq!(glue::storage_nbytes(&flat).unwrap(), 0);
    glue::realloc_storage(&flat, nbytes).unwrap();
    assert!(!glue::reads_zeros(&flat).unwrap());
    assert_eq!(glue::storage_nbytes(&flat).unwrap(), nbytes);
    // A storage with memory frees straight to zeros again.
    glue::free_storage_to_zeros(&flat).unwrap();
    assert!(glue::reads_zeros(&flat).unwrap());
}
