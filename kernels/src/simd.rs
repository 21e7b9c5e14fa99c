//! Run-time choice of the widest vector unit, and the macro that compiles a
//! loop once per level.
//!
//! The loops themselves are portable Rust; this module only decides which
//! `#[target_feature]` copy runs. Results are bit-identical across levels
//! (no FMA contraction, IEEE sqrt and division), so the choice is about speed
//! only.

use std::sync::OnceLock;

/// The vector level a kernel call uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Baseline x86-64 (SSE2) or any other architecture.
    Base,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// AVX-512 F/BW/VL on top of AVX2.
    Avx512,
}

/// The level this process uses: the widest the CPU supports, unless
/// `ZRT_SIMD` is set to `base`, `avx2` or `avx512` (never above what the CPU
/// has). Read once.
pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let hw = detect();
        let wanted = match std::env::var("ZRT_SIMD").as_deref() {
            Ok("base") => Level::Base,
            Ok("avx2") => Level::Avx2,
            Ok("avx512") | Ok("") | Err(_) => Level::Avx512,
            Ok(other) => {
                // Only a speed knob, read where nothing can return an error:
                // said loudly, not fatal.
                tracing::warn!(
                    "ZRT_SIMD={other:?} is not base, avx2 or avx512: using the CPU's widest level"
                );
                Level::Avx512
            }
        };
        hw.min(wanted)
    })
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Level {
    if is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
    {
        Level::Avx512
    } else if is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
    {
        Level::Avx2
    } else {
        Level::Base
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Level {
    Level::Base
}

/// Defines `fn $name(args) -> R` that calls the `#[inline(always)]` function
/// `$body` compiled for the best available [`Level`].
macro_rules! multiversion {
    ($vis:vis fn $name:ident($($a:ident : $t:ty),* $(,)?) $(-> $r:ty)? => $body:path) => {
        $vis fn $name($($a: $t),*) $(-> $r)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
                unsafe fn v512($($a: $t),*) $(-> $r)? { $body($($a),*) }
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn v256($($a: $t),*) $(-> $r)? { $body($($a),*) }
                match $crate::simd::level() {
                    // SAFETY: `level()` only reports features the CPU has.
                    $crate::simd::Level::Avx512 => return unsafe { v512($($a),*) },
                    $crate::simd::Level::Avx2 => return unsafe { v256($($a),*) },
                    $crate::simd::Level::Base => {}
                }
            }
            $body($($a),*)
        }
    };
}
pub(crate) use multiversion;
