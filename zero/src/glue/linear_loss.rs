//! A language model's head and cross-entropy in one autograd node that
//! never holds the whole `[rows, vocab]` logits (`csrc/linear_loss.cpp`):
//! the chunked loss of Liger-Kernel's `FusedLinearCrossEntropy` and
//! torchtune's chunked output, written again for the CPU and for zrt's
//! units.
//!
//! Unfused, a causal LM's logits are the largest tensor of its step at a
//! large vocabulary: 4 GiB in bf16 for Gemma 3 1B at 8192 tokens (its
//! 262144 words), kept for the loss's backward, and their gradient, as
//! large, made at the start of backward while every layer's saved tensors
//! are still held. [`cross_entropy`](super::cross_entropy) already keeps
//! them in their own dtype; [`linear_cross_entropy`] keeps none of them:
//!
//! - forward computes the logits a block of vocabulary columns at a
//!   time (about 32 MiB of fp32 each), every row in each block, and keeps
//!   each row's log-sum-exp running (its largest logit so far and the
//!   sum of the exponentials below it): one fp32 number a row is kept;
//! - backward computes the logits again the same way, and from the
//!   log-sum-exp their softmax's gradient. Each block gives its rows of
//!   the matrix's gradient (one product over every row, as the unfused
//!   head's backward computes it) and adds its share of the hidden
//!   states' gradient to an fp32 sum, rounded to their dtype once at
//!   the end.
//!
//! Blocks of columns keep each product as wide in its rows as the
//! unfused head's: on a CPU, blocks of 32 rows of a 262144-word
//! vocabulary ran their products at less than half the speed.
//!
//! It keeps what the head keeps anyway (its input and its matrix), one
//! fp32 number a row and the count of counted rows. The cost is the
//! head's product once more (four products of the head's size where the
//! unfused head and loss run three).
//!
//! When the matrix is frozen (and its bias, if any: LoRA leaves the head
//! so) and only the hidden states need a gradient, forward computes that
//! gradient as it goes and keeps it alone (fp32): each block's
//! exponentials below the row's largest logit so far, through the steps
//! after the product, times its rows of the matrix, summed and rescaled
//! as the largest logit grows; the division by the sum and the target's
//! term wait for the last block. Backward multiplies it by the seed it
//! is given. Two products of the head's size, as unfused, and the
//! exponentials once.
//!
//! When one block holds every column (few tokens, or a small vocabulary:
//! [`BLOCK_LOGITS`] logits), forward runs the unfused loss's own kernels
//! on whole rows and keeps what their backward reads, as the unfused loss
//! does: the log-probabilities in fp32 (and a soft cap's tanh). Backward
//! then computes no product again, the gradients are the unfused loss's
//! bits, and it costs the unfused loss's time. What it keeps is at most
//! one block: on a CPU the product again cost small models about a tenth
//! of their step (`zrt bench hf`), for at most 32 MiB saved.

use std::ffi::{c_char, c_int};

use tch::Tensor;

use super::{check, GlueError};

mod ffi {
    use super::*;
    use torch_sys::C_tensor;

    extern "C" {
        pub fn zrt_linear_cross_entropy(
            h: *const C_tensor,
            w: *const C_tensor,
            b: *const C_tensor,
            targets: *const C_tensor,
            ignore: i64,
            mean: c_int,
            bias_after: c_int,
            divide: f64,
            multiply: f64,
            cap: f64,
            block_logits: i64,
            out: *mut *mut C_tensor,
        ) -> *mut c_char;
    }
}

/// What a model does to its head's product before the loss, in this
/// order and with the same ops (each on the logits' dtype, as the model's
/// own code runs them): its bias added after the product rather than
/// inside it, a division, a multiplication, a soft cap. The default
/// leaves the product as it is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogitsAfter {
    /// The bias is added to the product (`h.matmul(wᵀ) + b`: CTRL's tied
    /// head's), not inside it (`linear(h, w, b)`: an `nn.Linear`'s).
    pub bias_after: bool,
    /// The logits are divided by it (Granite's `logits_scaling`).
    pub divide: f64,
    /// Then multiplied by it (Cohere's `logit_scale`).
    pub multiply: f64,
    /// Then capped: `tanh(z / cap) * cap` (Gemma 2's
    /// `final_logit_softcapping`).
    pub softcap: Option<f64>,
}

impl Default for LogitsAfter {
    fn default() -> Self {
        Self {
            bias_after: false,
            divide: 1.0,
            multiply: 1.0,
            softcap: None,
        }
    }
}

/// The cross-entropy of the logits `after(h wᵀ + b)` against `targets`,
/// without holding them whole (see the module): `h` `[rows, width]`, `w`
/// `[vocab, width]` of one floating dtype, `b` `[vocab]`, `targets`
/// `[rows]` int64 (`ignore`: not counted, PyTorch's `ignore_index`). In
/// fp32 (or `h`'s dtype when wider): the sum over the counted rows, or
/// with `mean` their mean (NaN when no row counts, as libtorch's). Its
/// gradients reach `h`, `w` and `b` in their dtypes; a matrix that needs
/// none (frozen under LoRA) costs no product for it, and with more than
/// one block `h`'s gradient is then computed in forward (see the module).
///
/// Against the unfused head and [`cross_entropy`](super::cross_entropy):
/// the loss is the same within fp32's rounding, the matrix's gradient
/// within the softmax's fp32 rounding, and `h`'s gradient closer to the
/// exact one (summed in fp32, rounded once); the gradients are the same
/// bits when one block holds every row's logits (fewer than
/// [`BLOCK_LOGITS`]), and forward then keeps them (their fp32
/// log-probabilities) for backward, as the unfused loss does.
/// Shapes, dtypes or a soft cap of 0 or less that do not fit, and
/// targets outside the vocabulary, are errors.
pub fn linear_cross_entropy(
    h: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    targets: &Tensor,
    ignore: i64,
    mean: bool,
    after: LogitsAfter,
) -> Result<Tensor, GlueError> {
    let cap = match after.softcap {
        None => 0.0,
        Some(c) if c > 0.0 && c.is_finite() => c,
        Some(c) => {
            return Err(GlueError::Torch {
                op: "linear_cross_entropy",
                msg: format!("a soft cap of {c}: give a finite number above 0, or none"),
            })
        }
    };
    let mut out: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: every pointer is a live `torch::Tensor*` (or null for no
    // bias) for the call; on success `out` is a fresh heap
    // `torch::Tensor*` the returned `Tensor` owns.
    check("linear_cross_entropy", unsafe {
        ffi::zrt_linear_cross_entropy(
            h.as_ptr(),
            w.as_ptr(),
            b.map_or(std::ptr::null(), |b| b.as_ptr()),
            targets.as_ptr(),
            ignore,
            c_int::from(mean),
            c_int::from(after.bias_after),
            after.divide,
            after.multiply,
            cap,
            BLOCK_LOGITS as i64,
            &mut out,
        )
    })?;
    // SAFETY: non-null on success, ownership transferred to tch.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// Whether [`linear_cross_entropy`] of `rows` rows of a `vocab` runs as
/// one block, and so keeps every logit's fp32 log-probability for
/// backward: when their `rows * vocab` logits fit [`BLOCK_LOGITS`]
/// (precisely, when a block of `BLOCK_LOGITS / rows` columns, at least
/// one, holds the `vocab`).
pub fn keeps_logits(rows: u64, vocab: u64) -> bool {
    (BLOCK_LOGITS / rows.max(1)).max(1) >= vocab
}

/// The logits of one block of [`linear_cross_entropy`]: `8 << 20`, 32 MiB
/// in fp32. Each block is a whole number of vocabulary columns over every
/// row; how many are held at once, not how much is computed.
pub const BLOCK_LOGITS: u64 = 8 << 20;

impl LogitsAfter {
    /// Its steps on the head's `product` (`bias` added when
    /// [`LogitsAfter::bias_after`]), as a model's own code runs them and
    /// as [`linear_cross_entropy`] runs them on each block.
    pub fn apply(&self, product: Tensor, bias: Option<&Tensor>) -> Tensor {
        let z = match (bias, self.bias_after) {
            (Some(b), true) => product + b,
            _ => product,
        };
        let z = match self.divide {
            1.0 => z,
            d => z / d,
        };
        let z = match self.multiply {
            1.0 => z,
            m => z * m,
        };
        match self.softcap {
            Some(cap) => (z / cap).tanh() * cap,
            None => z,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// Random `[rows, cols]` in `kind`, times `scale`, needing a gradient.
    fn leaf(shape: &[i64], scale: f64, kind: Kind) -> Tensor {
        (Tensor::randn(shape, (Kind::Float, Device::Cpu)) * scale)
            .to_kind(kind)
            .set_requires_grad(true)
    }

    /// The unfused head and loss: the product, `after`'s steps,
    /// [`cross_entropy`](super::super::cross_entropy).
    fn unfused(
        (h, w, b): (&Tensor, &Tensor, Option<&Tensor>),
        y: &Tensor,
        mean: bool,
        after: LogitsAfter,
    ) -> Tensor {
        let product = match (b, after.bias_after) {
            (Some(b), false) => h.linear(w, Some(b)),
            _ => h.matmul(&w.tr()),
        };
        super::super::cross_entropy(&after.apply(product, b), y, -100, mean).unwrap()
    }

    /// The loss and the gradients of the leaves among `xs`.
    fn run(loss: Tensor, xs: &[&Tensor]) -> (f64, Vec<Tensor>) {
        let g = Tensor::run_backward(&[&loss], xs, false, false);
        (loss.double_value(&[]), g)
    }

    /// The largest difference of `a` and `b` over `b`'s largest magnitude.
    fn off(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
        (a - &b).abs().max().double_value(&[]) / b.abs().max().double_value(&[]).max(1e-30)
    }

    /// Every step after the product but the bias: a division, a
    /// multiplication, a soft cap.
    const CAPPED: LogitsAfter = LogitsAfter {
        bias_after: false,
        divide: 1.5,
        multiply: 2.0,
        softcap: Some(4.0),
    };

    /// `rows` targets spread over the `vocab`, every seventh row's
    /// ignored (-100) from the first.
    fn targets(rows: i64, vocab: i64) -> Tensor {
        let every_seventh = Tensor::arange_start_step(0, rows, 7, (Kind::Int64, Device::Cpu));
        (Tensor::arange(rows, (Kind::Int64, Device::Cpu)) * 7919)
            .remainder(vocab)
            .index_fill(0, &every_seventh, -100)
    }

    #[test]
    fn its_loss_and_gradients_are_the_unfused_heads() {
        tch::manual_seed(3);
        // 5 rows of 11 words: one block. 700 rows of a 20000-word
        // vocabulary: two blocks of 11983 columns.
        for (rows, vocab, width) in [(5, 11, 4), (700, 20_000, 16)] {
            for kind in [Kind::Float, Kind::BFloat16] {
                for (bias, bias_after) in [(false, false), (true, false), (true, true)] {
                    for post in [LogitsAfter::default(), CAPPED] {
                        for mean in [true, false] {
                            let after = LogitsAfter { bias_after, ..post };
                            let h = leaf(&[rows, width], 1.0, kind);
                            let w = leaf(&[vocab, width], 0.5, kind);
                            let b = bias.then(|| leaf(&[vocab], 0.5, kind));
                            let y = targets(rows, vocab);
                            let mut xs = vec![&h, &w];
                            xs.extend(b.as_ref());
                            let at = format!(
                                "{rows}x{vocab} {kind:?} bias {bias} after {after:?} mean {mean}"
                            );
                            let (l0, g0) = run(unfused((&h, &w, b.as_ref()), &y, mean, after), &xs);
                            let fused =
                                linear_cross_entropy(&h, &w, b.as_ref(), &y, -100, mean, after);
                            let (l1, g1) = run(fused.unwrap(), &xs);
                            assert!(
                                (l0 - l1).abs() <= 1e-5 * l0.abs(),
                                "{at}: loss {l0} against {l1}"
                            );
                            // fp32: the same sums in other orders. bf16:
                            // the matrix's rows within two of its units
                            // in the last place, h's summed in fp32.
                            let bound = match kind {
                                Kind::Float => 1e-5,
                                _ => 1.0 / 128.0,
                            };
                            for (i, (a, b)) in g0.iter().zip(&g1).enumerate() {
                                assert_eq!(b.kind(), kind, "{at}");
                                let d = off(b, a);
                                assert!(d <= bound, "{at}: gradient {i} off by {d}");
                                // One block of columns: the unfused
                                // kernels, the same bits.
                                if rows < 100 {
                                    assert!(a.equal(b), "{at}: gradient {i} off by {d}");
                                }
                            }
                            // An ignored row's hidden state gets nothing.
                            assert_eq!(g1[0].get(0).abs().sum(Kind::Float).double_value(&[]), 0.0);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_frozen_matrix_gets_no_gradient_and_the_states_theirs() {
        tch::manual_seed(4);
        let h = leaf(&[40, 8], 1.0, Kind::Float);
        let w = Tensor::randn([300, 8], (Kind::Float, Device::Cpu));
        let y = (Tensor::arange(40, (Kind::Int64, Device::Cpu)) * 13).remainder(300);
        let after = LogitsAfter::default();
        let (_, g0) = run(unfused((&h, &w, None), &y, true, after), &[&h]);
        let fused = linear_cross_entropy(&h, &w, None, &y, -100, true, after).unwrap();
        let (_, g1) = run(fused, &[&h]);
        assert!(off(&g1[0], &g0[0]) <= 1e-6);
        assert!(!w.grad().defined());
    }

    #[test]
    fn a_frozen_matrix_of_many_blocks_has_h_get_its_gradient_from_forward() {
        // 700 rows of 20000 words: two blocks, the matrix (and bias)
        // frozen, so forward computes h's gradient. Through every step
        // after the product, a seed other than 1 (the loss scaled) and
        // ignored rows, against the unfused head's.
        tch::manual_seed(5);
        let (rows, vocab, width) = (700, 20_000, 16);
        for kind in [Kind::Float, Kind::BFloat16] {
            for post in [LogitsAfter::default(), CAPPED] {
                for (mean, scale) in [(true, 1.0), (false, 1.0), (true, 0.25)] {
                    let h = leaf(&[rows, width], 1.0, kind);
                    let w = leaf(&[vocab, width], 0.5, kind).set_requires_grad(false);
                    let b = leaf(&[vocab], 0.5, kind).set_requires_grad(false);
                    let y = targets(rows, vocab);
                    let at = format!("{kind:?} {post:?} mean {mean} seed {scale}");
                    let (l0, g0) = run(unfused((&h, &w, Some(&b)), &y, mean, post) * scale, &[&h]);
                    let fused = linear_cross_entropy(&h, &w, Some(&b), &y, -100, mean, post);
                    let (l1, g1) = run(fused.unwrap() * scale, &[&h]);
                    assert!(
                        (l0 - l1).abs() <= 1e-5 * l0.abs(),
                        "{at}: {l0} against {l1}"
                    );
                    assert_eq!(g1[0].kind(), kind, "{at}");
                    // Against the exact gradient (the unfused head's in
                    // fp64 on the same inputs), about as close as the
                    // unfused head's in `kind` (forward's sum is in fp32,
                    // rounded once; in bf16 both start from the product's
                    // rounded logits).
                    let hd = h.to_kind(Kind::Double).detach().set_requires_grad(true);
                    let (wd, bd) = (w.to_kind(Kind::Double), b.to_kind(Kind::Double));
                    let (_, exact) = run(
                        unfused((&hd, &wd, Some(&bd)), &y, mean, post) * scale,
                        &[&hd],
                    );
                    let (ours, theirs) = (off(&g1[0], &exact[0]), off(&g0[0], &exact[0]));
                    let floor = match kind {
                        Kind::Float => 1e-6,
                        _ => 1.0 / 256.0,
                    };
                    assert!(
                        ours <= 1.25 * theirs.max(floor),
                        "{at}: h's gradient off the exact by {ours}, the unfused head's by {theirs}"
                    );
                    assert_eq!(g1[0].get(0).abs().sum(Kind::Float).double_value(&[]), 0.0);
                    // Without a gradient to compute, the same loss.
                    let l2 = tch::no_grad(|| {
                        linear_cross_entropy(&h, &w, Some(&b), &y, -100, mean, post).unwrap()
                    });
                    assert_eq!(l2.double_value(&[]) * scale, l1, "{at}");
                }
            }
        }
    }

    #[test]
    fn no_counted_row_and_bad_inputs() {
        let h = leaf(&[3, 4], 1.0, Kind::Float);
        let w = leaf(&[5, 4], 1.0, Kind::Float);
        let none = Tensor::from_slice(&[-100i64, -100, -100]);
        let after = LogitsAfter::default();
        let loss = |y: &Tensor, mean| linear_cross_entropy(&h, &w, None, y, -100, mean, after);
        assert!(loss(&none, true).unwrap().double_value(&[]).is_nan());
        let sum = loss(&none, false).unwrap();
        assert_eq!(sum.double_value(&[]), 0.0);
        // Its backward still reaches both, with zeros.
        let (_, g) = run(sum, &[&h, &w]);
        assert_eq!(g[1].abs().sum(Kind::Float).double_value(&[]), 0.0);
        for (y, says) in [
            (Tensor::from_slice(&[1i64, 2]), "int64 targets [rows]"),
            (Tensor::from_slice(&[1i32, 2, 3]), "int64 targets [rows]"),
            (
                Tensor::from_slice(&[1i64, 2, 9]),
                "outside the vocabulary of 5 words",
            ),
            (
                Tensor::from_slice(&[1i64, -3, 2]),
                "outside the vocabulary of 5 words",
            ),
        ] {
            let e = loss(&y, true).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
        let y = Tensor::from_slice(&[1i64, 2, 3]);
        let w16 = w.to_kind(Kind::BFloat16);
        let e = linear_cross_entropy(&h, &w16, None, &y, -100, true, after).unwrap_err();
        assert!(e.to_string().contains("of one dtype"), "{e}");
        let narrow = Tensor::zeros([5, 3], (Kind::Float, Device::Cpu));
        let e = linear_cross_entropy(&h, &narrow, None, &y, -100, true, after).unwrap_err();
        assert!(e.to_string().contains("[vocab, width]"), "{e}");
        let b = Tensor::zeros([4], (Kind::Float, Device::Cpu));
        let e = linear_cross_entropy(&h, &w, Some(&b), &y, -100, true, after).unwrap_err();
        assert!(e.to_string().contains("a bias [vocab]"), "{e}");
        let zero_cap = LogitsAfter {
            softcap: Some(0.0),
            ..after
        };
        let e = linear_cross_entropy(&h, &w, None, &y, -100, true, zero_cap).unwrap_err();
        assert!(e.to_string().contains("a soft cap of 0"), "{e}");
    }
}
