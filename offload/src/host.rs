//! What the host has: the memory a run may still take.

/// `MemAvailable` of `/proc/meminfo` in bytes: what the kernel reckons can
/// be allocated without swapping. `None` off Linux, or if the file says
/// something else; callers then skip the checks that need it.
pub fn available_memory() -> Option<u64> {
    parse_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

/// Whether `bytes` (`None`: a count that overflowed) fit in `available`
/// (`None`: unknown, when only an overflow is refused). The rule every
/// up-front memory check applies: the swap's buffers, the benchmarks' sizes.
pub fn fits_in(bytes: Option<u64>, available: Option<u64>) -> bool {
    match (bytes, available) {
        (None, _) => false,
        (Some(b), Some(a)) => b <= a,
        (Some(_), None) => true,
    }
}

fn parse_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_fit_up_to_what_is_available_and_an_overflow_never() {
        assert!(fits_in(Some(4), Some(4)));
        assert!(!fits_in(Some(5), Some(4)));
        assert!(fits_in(Some(u64::MAX), None));
        assert!(!fits_in(None, None));
        assert!(!fits_in(None, Some(u64::MAX)));
    }

    #[test]
    fn reads_mem_available_in_bytes() {
        let info =
            "MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(parse_available(info), Some(2 << 20));
        assert_eq!(parse_available("MemTotal: 1 kB\n"), None);
        assert_eq!(parse_available("MemAvailable: lots kB\n"), None);
        assert_eq!(
            parse_available("MemAvailable: 18446744073709551615 kB\n"),
            None
        );
        // The tests run on Linux, where the file has the line.
        assert!(available_memory().is_some_and(|b| b > 0));
    }
}
