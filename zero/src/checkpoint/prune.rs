//! Keeping a directory's newest checkpoints only ([`keep_latest`]), for a
//! job that saves every few steps: each tag holds the whole model state,
//! and a long run's would fill the disk.

use std::num::NonZeroUsize;
use std::path::Path;

use super::{CheckpointError, Meta};

/// Removes the checkpoints in `dir` but the `keep` newest (by the step
/// each was saved at, then by tag) and the one `DIR/latest` names, and
/// returns the removed tags, oldest first. Only committed checkpoints
/// (a readable `meta.json`) are counted or removed: a folder whose
/// `meta.json` does not read is left for its owner, as are a failed save's
/// staging folders. Call it on one rank, after a save has returned on
/// every rank (the save commits before it returns).
pub fn keep_latest(dir: &Path, keep: NonZeroUsize) -> Result<Vec<String>, CheckpointError> {
    let entries = std::fs::read_dir(dir).map_err(|e| CheckpointError::io("read", dir, e))?;
    let latest = std::fs::read_to_string(dir.join("latest"))
        .ok()
        .map(|t| t.trim().to_string());
    let mut saved: Vec<((u64, u64), String)> = Vec::new();
    for e in entries.flatten() {
        let tag = e.file_name().to_string_lossy().into_owned();
        if tag.starts_with('.') || !e.path().join("meta.json").is_file() {
            continue;
        }
        if let Ok(meta) = Meta::read(&e.path()) {
            saved.push(((meta.global_step, meta.micro_steps), tag));
        }
    }
    // Newest first; names order checkpoints of one step (`step10` sorts
    // before `step9` by name, which is why the step comes first).
    saved.sort_by(|a, b| b.cmp(a));
    let mut removed = Vec::new();
    for (_, tag) in saved.into_iter().skip(keep.get()) {
        if latest.as_deref() == Some(tag.as_str()) {
            continue;
        }
        let path = dir.join(&tag);
        std::fs::remove_dir_all(&path).map_err(|e| CheckpointError::io("remove", &path, e))?;
        removed.push(tag);
    }
    removed.reverse();
    Ok(removed)
}
