//! The disk's own sequential speed, measured the way the swap does its I/O
//! (O_DIRECT, aligned buffers, one request per block): the limit
//! `zrt bench offload` holds the swap to.

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::Instant;

use crate::aligned::{AlignedBuf, ALIGN};
use crate::OffloadError;

/// Writes `bytes` sequentially to a fresh file in `dir` in requests of
/// `block` bytes, then reads them back the same way, and removes the file.
/// Returns (write seconds, read seconds). Falls back to buffered I/O where
/// the filesystem refuses O_DIRECT, as the swap does.
pub fn raw_write_read(dir: &Path, bytes: u64, block: usize) -> Result<(f64, f64), OffloadError> {
    let block = block.max(ALIGN).div_ceil(ALIGN) * ALIGN;
    let path = dir.join(format!("zrt-disk-probe-{}.tmp", std::process::id()));
    let open = |direct: bool| {
        let mut o = OpenOptions::new();
        o.read(true).write(true).create(true).truncate(true);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(&path)
    };
    let file = open(true)
        .or_else(|_| open(false))
        .map_err(|e| OffloadError::io("create", &path, &e))?;
    let mut buf = AlignedBuf::new(block / 4);
    for (i, x) in buf.as_mut_slice().iter_mut().enumerate() {
        *x = i as f32;
    }
    let n = bytes.div_ceil(block as u64);
    let res = (|| {
        let t = Instant::now();
        for i in 0..n {
            file.write_all_at(buf.bytes(), i * block as u64)
                .map_err(|e| OffloadError::io("write", &path, &e))?;
        }
        let write = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for i in 0..n {
            file.read_exact_at(buf.bytes_mut(), i * block as u64)
                .map_err(|e| OffloadError::io("read", &path, &e))?;
        }
        Ok((write, t.elapsed().as_secs_f64()))
    })();
    let _ = std::fs::remove_file(&path);
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_times_both_directions_and_leaves_no_file() {
        let dir = std::env::temp_dir().join(format!("zrt-probe-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (w, r) = raw_write_read(&dir, 1 << 20, 64 << 10).unwrap();
        let left = std::fs::read_dir(&dir).unwrap().count();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            w > 0.0 && w.is_finite() && r > 0.0 && r.is_finite(),
            "{w} {r}"
        );
        assert_eq!(left, 0, "the probe's file was left behind");
        let gone = dir.join("missing");
        let e = raw_write_read(&gone, 1 << 20, 64 << 10)
            .unwrap_err()
            .to_string();
        assert!(e.contains("create") && e.contains("missing"), "{e}");
    }
}
