//! The one error type of this crate.

/// Why a kernel refused its arguments. Kernels never fail on values (NaN and
/// inf propagate as IEEE says); they fail only on shapes and settings.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// Slices that must have one length do not.
    #[error("slice `{name}` has {got} elements but `{reference}` has {want}: every slice of one shard must have the same length")]
    LengthMismatch {
        /// The slice that disagrees.
        name: &'static str,
        /// Its length.
        got: usize,
        /// The slice it is compared with.
        reference: &'static str,
        /// That slice's length.
        want: usize,
    },
    /// A slice the kernel has no use for was given elements.
    #[error("slice `{name}` has {got} elements but must be empty: {why}")]
    NotEmpty {
        /// The slice.
        name: &'static str,
        /// Its length.
        got: usize,
        /// Why the kernel has no use for it.
        why: &'static str,
    },
    /// A hyper-parameter outside its domain.
    #[error("invalid optimizer setting `{name}` = {value}: {why}")]
    BadSetting {
        /// The setting, named as in the DeepSpeed config.
        name: &'static str,
        /// Its value.
        value: f64,
        /// What it must be.
        why: &'static str,
    },
    /// The thread pool could not be built.
    #[error("could not start {threads} kernel threads: {msg}")]
    Threads {
        /// Threads asked for.
        threads: usize,
        /// The OS's reason.
        msg: String,
    },
}

/// Checks that `got` has the reference length.
pub(crate) fn same_len(
    name: &'static str,
    got: usize,
    reference: &'static str,
    want: usize,
) -> Result<(), KernelError> {
    if got == want {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch {
            name,
            got,
            reference,
            want,
        })
    }
}

/// Checks that a slice the kernel has no use for is empty (`why` says why).
pub(crate) fn empty(name: &'static str, got: usize, why: &'static str) -> Result<(), KernelError> {
    match got {
        0 => Ok(()),
        _ => Err(KernelError::NotEmpty { name, got, why }),
    }
}

/// Checks that each of `settings` (name, value) is finite and not below 0,
/// in order, naming the first that is not: the domain every optimizer's
/// rate, decay, eps and momentum share.
pub(crate) fn non_negative(settings: &[(&'static str, f64)]) -> Result<(), KernelError> {
    match settings
        .iter()
        .find(|(_, value)| !(*value >= 0.0 && value.is_finite()))
    {
        Some(&(name, value)) => Err(KernelError::BadSetting {
            name,
            value,
            why: "must be finite and >= 0",
        }),
        None => Ok(()),
    }
}
