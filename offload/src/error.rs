//! Offload errors, each naming the file and the fix.

use std::path::PathBuf;

/// Why the swap could not be created, read or written.
#[derive(Debug, Clone, thiserror::Error)]
pub enum OffloadError {
    /// The swap directory does not exist or is not a directory.
    #[error("offload directory {} does not exist: create it or set `nvme_path` to a directory on the drive to swap to", path.display())]
    NoDirectory {
        /// The configured `nvme_path`.
        path: PathBuf,
    },
    /// The disk cannot hold the swap file.
    #[error("not enough space for the optimizer swap file {} ({bytes} bytes): {msg}; free space on that drive or point `nvme_path` at a larger one", path.display())]
    NoSpace {
        /// The swap file.
        path: PathBuf,
        /// Bytes it needs.
        bytes: u64,
        /// The OS error.
        msg: String,
    },
    /// The swap's buffers would not fit in the host's memory.
    #[error("the swap's {buffer_count} buffers of {slot_bytes} bytes each (about {:.1} GiB) do not fit in the {:.1} GiB of memory this host has available: lower `buffer_count` or `aio.block_size` (each buffer holds `aio.block_size` bytes of each swapped array)", gib(buffer_count.saturating_mul(*slot_bytes)), gib(*available))]
    Buffers {
        /// `buffer_count`.
        buffer_count: u64,
        /// Bytes of one buffer: a chunk of every array.
        slot_bytes: u64,
        /// `MemAvailable`, in bytes.
        available: u64,
    },
    /// An I/O call failed.
    #[error("cannot {op} optimizer swap file {}: {msg}{}", path.display(), hint(msg))]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        msg: String,
    },
    /// A read returned fewer bytes than the file held when written.
    #[error("short read from optimizer swap file {} at byte {offset}: wanted {want}, got {got}; the file was truncated or the drive failed, and the optimizer state in it is lost (resume from a checkpoint)", path.display())]
    ShortRead {
        /// The file.
        path: PathBuf,
        /// Where the read started.
        offset: u64,
        /// Bytes asked for.
        want: usize,
        /// Bytes read.
        got: usize,
    },
    /// A caller passed arrays that do not fit the swap's regions.
    #[error("offload: {0}")]
    Shape(String),
    /// The function run over the chunks failed.
    #[error("{0}")]
    Compute(String),
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn hint(msg: &str) -> &'static str {
    if msg.contains("Read-only") || msg.contains("Permission denied") {
        " (the directory is not writable: point `nvme_path` at a writable one)"
    } else if msg.contains("No space") {
        " (the disk is full)"
    } else {
        ""
    }
}

impl OffloadError {
    pub(crate) fn io(op: &'static str, path: &std::path::Path, e: &std::io::Error) -> Self {
        OffloadError::Io {
            op,
            path: path.to_path_buf(),
            msg: e.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::hint;

    #[test]
    fn io_errors_get_the_fix_for_their_cause() {
        let writable = "point `nvme_path` at a writable one";
        for msg in [
            "Read-only file system (os error 30)",
            "Permission denied (os error 13)",
        ] {
            assert!(hint(msg).contains(writable), "{msg}");
        }
        assert_eq!(
            hint("No space left on device (os error 28)"),
            " (the disk is full)"
        );
        assert_eq!(hint("Input/output error (os error 5)"), "");
    }
}
