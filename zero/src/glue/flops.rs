//! Counting the multiply-accumulates of matrix products as libtorch runs
//! them (`csrc/flops.cpp`), for the flops profiler: linear, matmul and
//! scaled-dot-product attention from their own inputs (what they run
//! inside is theirs), and mm, addmm, bmm, baddbmm and the fused attention
//! kernels called directly; each product once.

use std::ffi::{c_char, c_int};

use super::{check, GlueError};

mod ffi {
    use super::*;

    extern "C" {
        pub fn zrt_flops_count(on: c_int) -> *mut c_char;
        pub fn zrt_flops_macs() -> i64;
    }
}

/// Starts (`true`) or stops counting the matrix products this thread
/// runs. While any thread counts, every operator call in the process
/// passes through a callback (a cost of the order of a microsecond), so
/// count only what is profiled.
pub fn count_macs(on: bool) -> Result<(), GlueError> {
    // SAFETY: flips a thread-local flag and (un)registers a callback
    // under a lock.
    check("count_macs", unsafe {
        ffi::zrt_flops_count(c_int::from(on))
    })
}

/// The multiply-accumulates counted on this thread so far (it only
/// grows: take differences).
pub fn macs_counted() -> u64 {
    // SAFETY: reads a thread-local counter.
    unsafe { ffi::zrt_flops_macs() }.max(0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{nn, nn::Module, Device, Kind, Tensor};

    /// What `f` counts on this thread.
    fn counted(f: impl FnOnce()) -> u64 {
        count_macs(true).unwrap();
        let before = macs_counted();
        f();
        let n = macs_counted() - before;
        count_macs(false).unwrap();
        n
    }

    #[test]
    fn matrix_products_count_once_whatever_calls_them() {
        let vs = nn::VarStore::new(Device::Cpu);
        let lin = nn::linear(vs.root() / "l", 16, 24, Default::default());
        let x = Tensor::randn([5, 16], (Kind::Float, Device::Cpu));
        // addmm: 5 x 16 x 24.
        assert_eq!(counted(|| drop(lin.forward(&x))), 5 * 16 * 24);
        // Over [2, 5, 16]: folded into one product of 10 rows.
        let x3 = Tensor::randn([2, 5, 16], (Kind::Float, Device::Cpu));
        assert_eq!(counted(|| drop(lin.forward(&x3))), 10 * 16 * 24);
        let a = Tensor::randn([3, 4, 7], (Kind::Float, Device::Cpu));
        let b = Tensor::randn([3, 7, 2], (Kind::Float, Device::Cpu));
        assert_eq!(counted(|| drop(a.matmul(&b))), 3 * 4 * 7 * 2);
        assert_eq!(counted(|| drop(a.get(0).mm(&b.get(0)))), 4 * 7 * 2);
        // A bias-free linear over a batch of sequences (whose mm libtorch
        // does not record) and a matmul of a vector.
        let bare = nn::linear(
            vs.root() / "b",
            16,
            8,
            nn::LinearConfig {
                bias: false,
                ..Default::default()
            },
        );
        assert_eq!(counted(|| drop(bare.forward(&x3))), 10 * 16 * 8);
        let v = Tensor::randn([7], (Kind::Float, Device::Cpu));
        assert_eq!(counted(|| drop(a.matmul(&v))), 3 * 4 * 7);
        // Attention, as training runs it: q k^T and its weights times v.
        let q = Tensor::randn([2, 3, 8, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let sdpa = || {
            drop(Tensor::scaled_dot_product_attention::<Tensor>(
                &q, &q, &q, None, 0.0, true, None, false,
            ))
        };
        assert_eq!(counted(sdpa), 2 * 3 * 8 * 8 * (4 + 4));
        // And as inference runs it.
        let _g = tch::no_grad_guard();
        assert_eq!(counted(sdpa), 2 * 3 * 8 * 8 * (4 + 4));
        assert_eq!(counted(|| drop(bare.forward(&x3))), 10 * 16 * 8);
        // Elementwise work is not counted, nor anything while not counting.
        assert_eq!(counted(|| drop(x.relu() + 1.0)), 0);
        let before = macs_counted();
        drop(lin.forward(&x));
        assert_eq!(macs_counted(), before);
    }
}
