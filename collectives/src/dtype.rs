//! Element types a collective moves, and how they reduce.

use half::{bf16, f16};

/// The element type of a buffer, as named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// bfloat16.
    BF16,
    /// IEEE half.
    F16,
    /// 64-bit float.
    F64,
    /// 64-bit signed integer.
    I64,
    /// Byte.
    U8,
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F64 => "f64",
            DType::I64 => "i64",
            DType::U8 => "u8",
        })
    }
}

/// A type collectives can move and reduce.
///
/// Half-precision sums are accumulated in f32 and rounded once per element
/// (what NCCL and gloo do), so a sum over ranks loses no more than one
/// rounding. Integer sums wrap.
pub trait Element: Copy + Send + Sync + PartialOrd + std::fmt::Debug + 'static {
    /// This type's tag.
    const DTYPE: DType;
    /// The additive identity.
    const ZERO: Self;
    /// Reduces `xs` (one value per rank, in rank order) with `op`.
    fn reduce(xs: impl Iterator<Item = Self>, op: crate::ReduceOp) -> Self;
}

macro_rules! float_element {
    ($t:ty, $d:expr, $zero:expr, $to:expr, $from:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            const ZERO: Self = $zero;
            fn reduce(xs: impl Iterator<Item = Self>, op: crate::ReduceOp) -> Self {
                use crate::ReduceOp::*;
                let to = $to;
                let from = $from;
                let mut n = 0usize;
                let mut acc: Option<f64> = None;
                for x in xs {
                    let x = to(x);
                    n += 1;
                    acc = Some(match (acc, op) {
                        (None, _) => x,
                        (Some(a), Sum | Avg) => a + x,
                        (Some(a), Max) => {
                            if x > a || x.is_nan() {
                                x
                            } else {
                                a
                            }
                        }
                        (Some(a), Min) => {
                            if x < a || x.is_nan() {
                                x
                            } else {
                                a
                            }
                        }
                    });
                }
                let a = acc.unwrap_or(0.0);
                from(if op == Avg && n > 0 { a / n as f64 } else { a })
            }
        }
    };
}

// Floats reduce in f64 in rank order and round once: at most one rounding
// per element, and every rank computes the same bits.
float_element!(f32, DType::F32, 0.0, |x: f32| x as f64, |x: f64| x as f32);
float_element!(f64, DType::F64, 0.0, |x: f64| x, |x: f64| x);
float_element!(
    bf16,
    DType::BF16,
    bf16::ZERO,
    |x: bf16| x.to_f64(),
    bf16::from_f64
);
float_element!(
    f16,
    DType::F16,
    f16::ZERO,
    |x: f16| x.to_f64(),
    f16::from_f64
);

macro_rules! int_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            const ZERO: Self = 0;
            fn reduce(xs: impl Iterator<Item = Self>, op: crate::ReduceOp) -> Self {
                use crate::ReduceOp::*;
                let mut n: $t = 0;
                let mut acc: Option<$t> = None;
                for x in xs {
                    n = n.wrapping_add(1);
                    acc = Some(match (acc, op) {
                        (None, _) => x,
                        (Some(a), Sum | Avg) => a.wrapping_add(x),
                        (Some(a), Max) => a.max(x),
                        (Some(a), Min) => a.min(x),
                    });
                }
                let a = acc.unwrap_or(0);
                if op == Avg && n > 0 {
                    a / n
                } else {
                    a
                }
            }
        }
    };
}
int_element!(i64, DType::I64);
int_element!(u8, DType::U8);
