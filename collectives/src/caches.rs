//! Sizes of this host's CPU caches, read once from sysfs: what the shm
//! backend's streaming thresholds (`stream`) and the length of its staging
//! rings (`shm`) are measured against.

/// Assumed when the host does not say: the L3 of the EPYC the streaming
/// thresholds were measured on (and of most server parts' core complexes).
const DEFAULT_LLC_BYTES: usize = 32 << 20;

/// Assumed when the host does not say: the L2 of that EPYC's cores.
const DEFAULT_CORE_CACHE_BYTES: usize = 1 << 20;

/// Where Linux describes the first CPU's caches (`index0`, `index1`, ...).
const SYSFS_CACHES: &str = "/sys/devices/system/cpu/cpu0/cache";

/// Size of the largest cache the first CPU shares, read once from sysfs
/// (`/sys/devices/system/cpu/cpu0/cache/index*/size`): what decides whether
/// an operation's buffers can still be cached. On a desktop part with 8 MiB
/// of L3, 16 MiB gathers already stream; on a part with 96 MiB they do not.
/// [`DEFAULT_LLC_BYTES`] where sysfs has no cache (other systems, some
/// containers).
pub(crate) fn last_level_cache_bytes() -> usize {
    static LLC: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LLC.get_or_init(|| {
        let found = read_cache(SYSFS_CACHES, None);
        tracing::debug!(
            bytes = found.unwrap_or(DEFAULT_LLC_BYTES),
            from_sysfs = found.is_some(),
            "last-level cache size for the streaming thresholds"
        );
        found.unwrap_or(DEFAULT_LLC_BYTES)
    })
}

/// Size of the first CPU's level-2 cache, read once from sysfs: the cache
/// of one core (two hardware threads at most) on current x86 and Arm
/// server parts, where a line a core has read stays until that much else
/// has passed through. [`DEFAULT_CORE_CACHE_BYTES`] where sysfs does not
/// say.
pub(crate) fn core_cache_bytes() -> usize {
    static L2: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *L2.get_or_init(|| {
        let found = read_cache(SYSFS_CACHES, Some(2));
        tracing::debug!(
            bytes = found.unwrap_or(DEFAULT_CORE_CACHE_BYTES),
            from_sysfs = found.is_some(),
            "level-2 cache size for the shm staging rings"
        );
        found.unwrap_or(DEFAULT_CORE_CACHE_BYTES)
    })
}

/// The largest `size` of the data or unified caches under `dir` (`index0`,
/// `index1`, ...), among those of `level` if given, or `None` if there is
/// none to read.
fn read_cache(dir: &str, level: Option<u32>) -> Option<usize> {
    let entries = std::fs::read_dir(dir).ok()?;
    let read = |e: &std::fs::DirEntry, what: &str| std::fs::read_to_string(e.path().join(what));
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("index"))
        // An instruction cache never holds an operation's data.
        .filter(|e| read(e, "type").map_or(true, |t| t.trim() != "Instruction"))
        .filter(|e| level.is_none_or(|l| read(e, "level").is_ok_and(|s| s.trim().parse() == Ok(l))))
        .filter_map(|e| read(&e, "size").ok())
        .filter_map(|s| parse_cache_size(&s))
        .max()
}

/// Parses sysfs's cache sizes: `32768K`, `1M`, `512` (bytes). `None` for
/// anything else, or zero.
fn parse_cache_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let scale = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return None,
    };
    digits
        .parse::<usize>()
        .ok()
        .and_then(|d| d.checked_mul(scale))
        .filter(|&b| b > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sizes_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("1M"), Some(1 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("2G"), Some(2 << 30));
        for bad in ["", "K", "0K", "12 K", "12KB", "-1", "x"] {
            assert_eq!(parse_cache_size(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_largest_data_cache_is_the_last_level_and_level_2_is_found_by_level() {
        let dir = std::env::temp_dir().join(format!("zrt-llc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (i, level, ty, size) in [
            (0, 1, "Data", "48K"),
            (1, 1, "Instruction", "64M"),
            (2, 2, "Unified", "1024K"),
            (3, 3, "Unified", "32768K"),
        ] {
            let d = dir.join(format!("index{i}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("level"), format!("{level}\n")).unwrap();
            std::fs::write(d.join("type"), format!("{ty}\n")).unwrap();
            std::fs::write(d.join("size"), format!("{size}\n")).unwrap();
        }
        // Not a cache: ignored.
        std::fs::create_dir_all(dir.join("power")).unwrap();
        let d = dir.to_str().unwrap();
        let (largest, l2, l1, l4) = (
            read_cache(d, None),
            read_cache(d, Some(2)),
            read_cache(d, Some(1)),
            read_cache(d, Some(4)),
        );
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(largest, Some(32 << 20));
        assert_eq!(l2, Some(1 << 20));
        // The 64M instruction cache is no data cache.
        assert_eq!(l1, Some(48 << 10));
        assert_eq!(l4, None);
        assert_eq!(read_cache("/nonexistent/zrt", None), None);
        assert!(last_level_cache_bytes() > 0);
        assert!(core_cache_bytes() > 0);
    }
}
