//! What can go wrong with a checkpoint, each with the fix.

use std::path::PathBuf;

/// Why a checkpoint could not be saved, read or used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CheckpointError {
    /// The filesystem refused an operation.
    #[error("cannot {op} {}: {msg}{}", path.display(), io_hint(msg))]
    Io {
        /// What was being done ("write", "create directory", ...).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        msg: String,
    },
    /// A file's contents do not match the checksum it was saved with.
    #[error("checksum mismatch in {}: the file is corrupted or truncated (saved crc32 {expected:08x}, found {found:08x}); load an earlier tag, the files of other tags are not affected", path.display())]
    Checksum {
        /// The damaged file.
        path: PathBuf,
        /// The CRC-32 recorded at save time.
        expected: u32,
        /// The CRC-32 of what is on disk now.
        found: u32,
    },
    /// A file is not what a zrt checkpoint holds (truncated header, another
    /// format, a missing tensor).
    #[error("{} is not a readable zrt checkpoint file: {msg}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// A file the checkpoint needs does not exist.
    #[error("{} is missing: a checkpoint needs meta.json and every rank's file (copy the whole tag directory)", path.display())]
    Missing {
        /// The missing file.
        path: PathBuf,
    },
    /// No tag was given and the directory has no `latest` naming one.
    #[error("{}", no_latest(dir, *exists, tags))]
    NoLatest {
        /// The checkpoint directory.
        dir: PathBuf,
        /// Whether the directory exists at all.
        exists: bool,
        /// The tags found in it (subdirectories holding a `meta.json`).
        tags: Vec<String>,
    },
    /// The checkpoint holds another model's parameters.
    #[error("the checkpoint is of another model: {}; load it into the model it was saved from (same parameter names and shapes)", model_diff(missing, unexpected, misshaped))]
    ModelMismatch {
        /// Parameters of this model the checkpoint does not have.
        missing: Vec<String>,
        /// Parameters in the checkpoint this model does not have.
        unexpected: Vec<String>,
        /// Parameters with another shape: "name: checkpoint [..], model [..]".
        misshaped: Vec<String>,
    },
    /// The checkpoint cannot be loaded this way (e.g. resharding a
    /// checkpoint saved between accumulation boundaries).
    #[error("cannot load this checkpoint here: {0}")]
    Incompatible(String),
    /// A tag that cannot name a directory.
    #[error("invalid checkpoint tag `{0}`: use a non-empty name without `/`, not starting with `.`, other than `latest`")]
    BadTag(String),
    /// Ranks read different checkpoints (other tags or directories): each
    /// "ranks R read PATH (step S)". Nothing was loaded.
    #[error("ranks read different checkpoints: {}; nothing was loaded: every rank must load the same tag from the same directory (on several nodes, one they share)", .0.join("; "))]
    NotTheSame(Vec<String>),
    /// Ranks saved under different tags (each "ranks R saved under `TAG`"):
    /// their files would have gone to different directories, none of them
    /// a whole checkpoint. Nothing was written.
    #[error("ranks saved under different tags: {}; nothing was written: every rank must save under the same tag (DeepSpeed's `checkpoint.tag_validation` check, which zrt always makes)", .0.join("; "))]
    DifferentTags(Vec<String>),
    /// This rank does not see the staging directory rank 0 made in its
    /// checkpoint directory: another directory, or storage rank 0's is not.
    #[error("this rank does not see the staging folder rank 0 made for this save in {0}: every rank must save to the same directory, on several nodes one they share; nothing was committed")]
    NotShared(PathBuf),
    /// Other ranks failed while this one succeeded; nothing was committed
    /// (a save) or changed (a load).
    #[error(
        "rank(s) {ranks:?} failed to {what} (their own errors say why); {}",
        peers_outcome(what)
    )]
    Peers {
        /// The ranks that failed.
        ranks: Vec<usize>,
        /// What they failed to do: "save the checkpoint", "load the
        /// checkpoint", "write the model file", "load the weights file".
        what: &'static str,
    },
    /// A whole-model weights file (`Engine::load_weights`) could not be
    /// opened or is not safetensors.
    #[error("cannot load weights from {}: {msg}; pass a safetensors file of the model's weights (save_16bit_model's, `zrt ckpt consolidate`'s, VarStore::save's)", path.display())]
    Weights {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// A model export (`Engine::save_16bit_model_as` and its kin, `zrt
    /// ckpt consolidate`) was asked for what it cannot write: nothing was
    /// written.
    #[error("cannot export the model to {}: {msg}; nothing was written", path.display())]
    Export {
        /// Where the export was to go.
        path: PathBuf,
        /// What cannot be written, and how to mend it.
        msg: String,
    },
    /// A whole-model weights file does not hold this model's tensors.
    #[error("the weights file {} does not match the model: {}; {}", path.display(), model_diff(missing, unexpected, misshaped), weights_mend(misshaped, *strict))]
    WeightsMismatch {
        /// The file.
        path: PathBuf,
        /// Variables of this model the file does not have.
        missing: Vec<String>,
        /// Tensors in the file this model does not have.
        unexpected: Vec<String>,
        /// Tensors of another shape or a dtype that cannot be read into
        /// the variable: "name: file BF16 [..], model Int64 [..]".
        misshaped: Vec<String>,
        /// Whether the load asked for every variable and nothing else.
        strict: bool,
    },
    /// Ranks read different weights files (each "ranks R read PATH (N
    /// bytes"), told apart by their lengths and a CRC-32 of their headers
    /// and of the ends of their data. Nothing was loaded.
    #[error("ranks read different weights files: {}; nothing was loaded: every rank must load the same file (on several nodes, one they share or identical copies)", .0.join("; "))]
    DifferentWeights(Vec<String>),
}

impl CheckpointError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, e: std::io::Error) -> Self {
        CheckpointError::Io {
            op,
            path: path.into(),
            msg: e.to_string(),
        }
    }

    pub(crate) fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        CheckpointError::Format {
            path: path.into(),
            msg: msg.into(),
        }
    }
}

fn io_hint(msg: &str) -> &'static str {
    if msg.contains("No space left") || msg.contains("File too large") {
        " (the disk is full: free space or save elsewhere; the previous checkpoint is intact)"
    } else if msg.contains("Read-only") || msg.contains("Permission denied") {
        " (the directory is not writable: save elsewhere)"
    } else {
        ""
    }
}

/// The names of a model mismatch in words: up to eight of each kind
/// ("missing 10: a, b, ... and 2 more; unexpected 1: c").
pub(crate) fn model_diff(
    missing: &[String],
    unexpected: &[String],
    misshaped: &[String],
) -> String {
    let mut parts = Vec::new();
    let list = |what: &str, v: &[String]| {
        let shown: Vec<&str> = v.iter().take(8).map(String::as_str).collect();
        let more = if v.len() > 8 {
            format!(" and {} more", v.len() - 8)
        } else {
            String::new()
        };
        format!("{what} {}: {}{more}", v.len(), shown.join(", "))
    };
    if !missing.is_empty() {
        parts.push(list("missing", missing));
    }
    if !unexpected.is_empty() {
        parts.push(list("unexpected", unexpected));
    }
    if !misshaped.is_empty() {
        parts.push(list("mis-shaped", misshaped));
    }
    parts.join("; ")
}

/// What a [`CheckpointError::Peers`] left as it was.
fn peers_outcome(what: &str) -> &'static str {
    match what.starts_with("load") {
        true => "nothing was loaded",
        false => "nothing was committed, the previous checkpoint is intact",
    }
}

/// How to mend a [`CheckpointError::WeightsMismatch`].
fn weights_mend(misshaped: &[String], strict: bool) -> &'static str {
    match (misshaped.is_empty(), strict) {
        (false, _) => "a tensor of another shape is another model's (or another configuration of it), and parameters load from F32, BF16 or F16 tensors, other variables from their own kind: load the file the model was made for",
        (true, true) => "names are the model's VarStore names (ShardPlan::rename_weights maps a file's own names to them); to load a file holding part of the model (a pretrained base under a new head), load it with strict = false: variables it lacks keep their values, tensors the model lacks are skipped",
        (true, false) => "names are the model's VarStore names (ShardPlan::rename_weights maps a file's own names to them)",
    }
}

fn no_latest(dir: &std::path::Path, exists: bool, tags: &[String]) -> String {
    let dir = dir.display();
    if !exists {
        return format!(
            "checkpoint directory {dir} does not exist: pass the directory save_checkpoint wrote to"
        );
    }
    let found = if tags.is_empty() {
        "it holds no checkpoint tag (a subdirectory with a meta.json)".to_string()
    } else {
        format!("tags there: {}", tags.join(", "))
    };
    format!("{dir} has no `latest` file naming the tag to load (a completed save writes it): pass the tag; {found}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io(msg: &str) -> String {
        CheckpointError::Io {
            op: "write",
            path: "/ck/t/x".into(),
            msg: msg.into(),
        }
        .to_string()
    }

    #[test]
    fn io_errors_say_what_to_do_for_a_full_disk_or_a_read_only_directory() {
        let full =
            " (the disk is full: free space or save elsewhere; the previous checkpoint is intact)";
        let ro = " (the directory is not writable: save elsewhere)";
        for (msg, hint) in [
            ("No space left on device (os error 28)", full),
            ("File too large (os error 27)", full),
            ("Read-only file system (os error 30)", ro),
            ("Permission denied (os error 13)", ro),
            ("Input/output error (os error 5)", ""),
        ] {
            assert_eq!(io(msg), format!("cannot write /ck/t/x: {msg}{hint}"));
        }
    }

    #[test]
    fn a_model_mismatch_lists_eight_names_of_each_kind_and_counts_the_rest() {
        let names = |p: &str, n: usize| (0..n).map(|i| format!("{p}{i}")).collect::<Vec<_>>();
        let e = CheckpointError::ModelMismatch {
            missing: names("m", 10),
            unexpected: vec![],
            misshaped: names("s", 8),
        }
        .to_string();
        assert_eq!(
            e,
            "the checkpoint is of another model: missing 10: m0, m1, m2, m3, m4, m5, m6, m7 and 2 more; mis-shaped 8: s0, s1, s2, s3, s4, s5, s6, s7; load it into the model it was saved from (same parameter names and shapes)"
        );
        let e = CheckpointError::ModelMismatch {
            missing: vec![],
            unexpected: names("u", 9),
            misshaped: vec![],
        }
        .to_string();
        assert!(
            e.contains(": unexpected 9: u0, u1, u2, u3, u4, u5, u6, u7 and 1 more; load"),
            "{e}"
        );
    }

    #[test]
    fn no_latest_says_whether_the_directory_exists_and_which_tags_it_holds() {
        let e = |exists, tags: &[&str]| {
            CheckpointError::NoLatest {
                dir: "/ck".into(),
                exists,
                tags: tags.iter().map(|t| t.to_string()).collect(),
            }
            .to_string()
        };
        assert_eq!(
            e(false, &[]),
            "checkpoint directory /ck does not exist: pass the directory save_checkpoint wrote to"
        );
        let head = "/ck has no `latest` file naming the tag to load (a completed save writes it): pass the tag; ";
        assert_eq!(
            e(true, &[]),
            format!("{head}it holds no checkpoint tag (a subdirectory with a meta.json)")
        );
        assert_eq!(e(true, &["a", "b"]), format!("{head}tags there: a, b"));
    }
}
