//! Byte counts read from the environment (`ZRT_SHM_SLOT_BYTES`,
//! `ZRT_TCP_WINDOW_BYTES`): one parser, so every such setting accepts and
//! refuses the same way and names itself and an example when it refuses.

/// The largest byte count a setting may ask for (1 GiB).
const MAX_BYTES: usize = 1 << 30;

/// The value of `var` (`v`, unset when `None`) as a byte count from `min`
/// to 1 GiB; `default` when unset or blank; else an error naming the
/// variable, the range and the default.
pub(crate) fn parse(
    var: &str,
    v: Option<&str>,
    default: usize,
    min: usize,
) -> Result<usize, String> {
    let Some(v) = v.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(default);
    };
    match v.parse::<usize>() {
        Ok(b) if (min..=MAX_BYTES).contains(&b) => Ok(b),
        _ => Err(format!(
            "{var}={v:?} is not a byte count from {min} to {MAX_BYTES} (e.g. {var}={default}, the default)"
        )),
    }
}

/// [`parse`] of the environment variable `var`.
pub(crate) fn from_env(var: &str, default: usize, min: usize) -> Result<usize, String> {
    parse(var, std::env::var(var).ok().as_deref(), default, min)
}
