//! A cross-entropy that keeps, for its backward, the logits it is given
//! rather than their fp32 log-probabilities (`csrc/loss.cpp`).
//!
//! A causal LM's loss casts its `[rows, vocab]` logits to fp32 and takes
//! libtorch's cross-entropy, whose log-softmax keeps its fp32 output for
//! backward: 4 bytes a vocabulary entry a token, the largest tensor a
//! forward keeps at a 128k or 256k vocabulary (255 of Gemma 3 1B's 983 MiB
//! at 256 tokens). [`cross_entropy`] keeps the logits in their own dtype
//! (half of that in bf16; nothing new when they are a view of the head's
//! output) and the count of rows it averaged over, and runs libtorch's
//! log-softmax again in backward, a block of rows at a time (about 32 MiB
//! of fp32 each), and libtorch's own backward kernels on it: the same
//! gradients to the bit, the loss to the bit when one block holds every
//! row (else within fp32's rounding of the blocks' sum), and no fp32 copy
//! of the whole matrix in forward or backward either. The cost is one
//! more log-softmax over the logits.
//! Liger-Kernel's and torchtune's chunked losses go further, recomputing
//! the head too; this one leaves the head to autograd.

use std::ffi::{c_char, c_int};

use tch::Tensor;

use super::{check, GlueError};

mod ffi {
    use super::*;
    use torch_sys::C_tensor;

    extern "C" {
        pub fn zrt_cross_entropy(
            logits: *const C_tensor,
            targets: *const C_tensor,
            ignore: i64,
            mean: c_int,
            out: *mut *mut C_tensor,
        ) -> *mut c_char;
    }
}

/// The cross-entropy of `logits` `[rows, vocab]` (any floating dtype)
/// against `targets` `[rows]` (int64), over the rows whose target is not
/// `ignore` (PyTorch's `ignore_index`), computed in fp32 (or the logits'
/// dtype when wider): the sum over those rows, or with `mean` their mean
/// (NaN when no row counts, as libtorch's). An fp32 scalar, whose
/// gradient in `logits` has their dtype. Logits and targets of other
/// shapes, targets not int64 or out of the vocabulary are errors.
pub fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    ignore: i64,
    mean: bool,
) -> Result<Tensor, GlueError> {
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: both pointers are live `torch::Tensor*` for the call; on
    // success `out` is a fresh heap `torch::Tensor*` the returned
    // `Tensor` owns.
    check("cross_entropy", unsafe {
        ffi::zrt_cross_entropy(
            logits.as_ptr(),
            targets.as_ptr(),
            ignore,
            c_int::from(mean),
            &mut out,
        )
    })?;
    // SAFETY: non-null on success, ownership transferred to tch.
    Ok(unsafe { Tensor::from_ptr(out) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Reduction};

    /// Logits `[rows, vocab]` in `kind` that need a gradient, from seed 7.
    fn logits(rows: i64, vocab: i64, kind: Kind) -> Tensor {
        tch::manual_seed(7);
        (Tensor::randn([rows, vocab], (Kind::Float, Device::Cpu)) * 3.0)
            .to_kind(kind)
            .set_requires_grad(true)
    }

    /// libtorch's loss of `x` in fp32 (as the causal-LM losses took it)
    /// and its gradient, next to [`cross_entropy`]'s.
    fn both(x: &Tensor, y: &Tensor, mean: bool) -> [(Tensor, Tensor); 2] {
        let reduction = match mean {
            true => Reduction::Mean,
            false => Reduction::Sum,
        };
        let run = |loss: Tensor| {
            let g = Tensor::run_backward(&[&loss], &[x], false, false);
            (loss.detach(), g[0].shallow_clone())
        };
        let theirs = x
            .to_kind(Kind::Float)
            .cross_entropy_loss::<Tensor>(y, None, reduction, -100, 0.0);
        [run(theirs), run(cross_entropy(x, y, -100, mean).unwrap())]
    }

    #[test]
    fn its_loss_and_gradient_are_libtorchs() {
        // 1100 rows of a 20000-word vocabulary span three blocks of 419.
        for (rows, vocab) in [(5, 11), (1100, 20_000)] {
            for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
                for mean in [true, false] {
                    let x = logits(rows, vocab, kind);
                    let y = Tensor::arange(rows, (Kind::Int64, Device::Cpu)).remainder(vocab);
                    // Some rows ignored, the first and every seventh.
                    let y = y.index_fill(
                        0,
                        &Tensor::arange_start_step(0, rows, 7, (Kind::Int64, Device::Cpu)),
                        -100,
                    );
                    let [(l0, g0), (l1, g1)] = both(&x, &y, mean);
                    assert_eq!(l1.kind(), Kind::Float);
                    assert_eq!(g1.kind(), kind);
                    // One block sums as libtorch does; three add their
                    // sums, in another order.
                    let dl = (l0.double_value(&[]) - l1.double_value(&[])).abs();
                    let bound = match rows > 419 {
                        true => 1e-6 * l0.double_value(&[]).abs(),
                        false => 0.0,
                    };
                    assert!(
                        dl <= bound,
                        "{rows}x{vocab} {kind:?} mean {mean}: loss {l0} against {l1}"
                    );
                    // Row by row, the same kernels: the same bits.
                    assert!(
                        g0.equal(&g1),
                        "{rows}x{vocab} {kind:?} mean {mean}: gradients differ"
                    );
                    // Ignored rows get no gradient.
                    assert_eq!(g1.get(0).abs().sum(Kind::Float).double_value(&[]), 0.0);
                }
            }
        }
    }

    #[test]
    fn mean_over_no_counted_row_is_nan_and_bad_shapes_are_errors() {
        let x = logits(3, 5, Kind::Float);
        let none = Tensor::from_slice(&[-100i64, -100, -100]);
        assert!(cross_entropy(&x, &none, -100, true)
            .unwrap()
            .double_value(&[])
            .is_nan());
        assert_eq!(
            cross_entropy(&x, &none, -100, false)
                .unwrap()
                .double_value(&[]),
            0.0
        );
        let e = cross_entropy(&x, &Tensor::from_slice(&[1i64, 2]), -100, true).unwrap_err();
        assert!(e.to_string().contains("targets [rows]"), "{e}");
        let e = cross_entropy(&x, &Tensor::from_slice(&[1i32, 2, 3]), -100, true).unwrap_err();
        assert!(e.to_string().contains("int64"), "{e}");
        let e = cross_entropy(&x, &Tensor::from_slice(&[1i64, 2, 9]), -100, true).unwrap_err();
        assert!(e.to_string().contains("cross_entropy"), "{e}");
    }
}
