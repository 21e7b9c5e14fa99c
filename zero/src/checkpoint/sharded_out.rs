//! A model export in several files: Hugging Face's sharded checkpoint
//! layout, the one `transformers` and `accelerate` load (not run here)
//! and [`Engine::load_weights`](crate::Engine::load_weights) reads.
//!
//! DeepSpeed's `zero_to_fp32.py --max_shard_size` writes the same: the
//! tensors in order, a new file started whenever the next tensor would
//! take the current one past the limit (a tensor larger than the limit
//! alone in its file), the files named `model-0000k-of-0000n.safetensors`
//! and an index, `model.safetensors.index.json`, mapping each tensor to
//! its file. A model that fits in one file is written as
//! `model.safetensors`, with no index, as Hugging Face writes it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use super::files::{write_atomic, Planned, TensorWriter};
use super::weights_files::{INDEX, SINGLE};
use super::CheckpointError;

/// Where a model export is written, one tensor at a time.
pub(crate) enum ModelWriter {
    /// One safetensors file.
    One(TensorWriter),
    /// Several, and their index.
    Sharded(ShardedWriter),
}

impl ModelWriter {
    /// A writer of `plan` (in that order) to the file `out`, or with
    /// `max_shard_bytes` to files of at most that many bytes of tensors
    /// (but a larger tensor's own) in the directory `out`, each with
    /// `meta` in its header.
    pub(crate) fn create(
        out: &Path,
        max_shard_bytes: Option<u64>,
        plan: &[Planned],
        meta: HashMap<String, String>,
    ) -> Result<Self, CheckpointError> {
        Ok(match max_shard_bytes {
            None => Self::One(TensorWriter::create(out, plan, meta)?),
            Some(max) => Self::Sharded(ShardedWriter::create(out, max, plan, meta)?),
        })
    }

    /// Writes tensor `name`, the next of the plan, whole.
    pub(crate) fn write(&mut self, name: &str, data: &[u8]) -> Result<(), CheckpointError> {
        match self {
            Self::One(w) => w.write(name, data),
            Self::Sharded(w) => w.write(name, data),
        }
    }

    /// How many safetensors files it writes.
    pub(crate) fn files(&self) -> usize {
        match self {
            Self::One(_) => 1,
            Self::Sharded(w) => w.parts.len(),
        }
    }

    /// Checks every tensor was written and makes the export durable
    /// under its names (the index last).
    pub(crate) fn finish(self) -> Result<(), CheckpointError> {
        match self {
            Self::One(w) => w.finish(),
            Self::Sharded(w) => w.finish(),
        }
    }
}

/// Files of a sharded export, each written as one [`TensorWriter`].
pub(crate) struct ShardedWriter {
    dir: PathBuf,
    /// Each file's name and writer, in order.
    parts: Vec<(String, TensorWriter)>,
    /// Each tensor's file (an index into `parts`).
    part_of: HashMap<String, usize>,
    /// Bytes of tensors in all the files.
    total: u64,
}

impl ShardedWriter {
    fn create(
        dir: &Path,
        max: u64,
        plan: &[Planned],
        meta: HashMap<String, String>,
    ) -> Result<Self, CheckpointError> {
        if max == 0 {
            return Err(CheckpointError::Export {
                path: dir.to_path_buf(),
                msg: "a largest file of 0 bytes: give the most bytes of tensors a file may hold"
                    .into(),
            });
        }
        std::fs::create_dir_all(dir).map_err(|e| CheckpointError::io("create", dir, e))?;
        let groups = split(plan, max)?;
        let n = groups.len();
        let mut parts = Vec::with_capacity(n);
        let mut part_of = HashMap::with_capacity(plan.len());
        for (k, group) in groups.into_iter().enumerate() {
            let name = match n {
                1 => SINGLE.to_string(),
                _ => format!("model-{:05}-of-{n:05}.safetensors", k + 1),
            };
            part_of.extend(group.iter().map(|t| (t.name.clone(), k)));
            parts.push((
                name.clone(),
                TensorWriter::create(&dir.join(name), group, meta.clone())?,
            ));
        }
        let total = plan.iter().filter_map(Planned::bytes).sum::<usize>() as u64;
        Ok(Self {
            dir: dir.to_path_buf(),
            parts,
            part_of,
            total,
        })
    }

    fn write(&mut self, name: &str, data: &[u8]) -> Result<(), CheckpointError> {
        // Each file's writer checks the order of its own tensors.
        match (self.part_of.get(name)).and_then(|&k| self.parts.get_mut(k)) {
            Some((_, w)) => w.write(name, data),
            None => Err(CheckpointError::format(
                &self.dir,
                format!("tensor `{name}` is not one the export planned"),
            )),
        }
    }

    fn finish(self) -> Result<(), CheckpointError> {
        let names: Vec<String> = self.parts.iter().map(|(f, _)| f.clone()).collect();
        for (_, w) in self.parts {
            w.finish()?;
        }
        // An earlier export's files in the same directory would be read
        // with these (a loader taking every file, or an index left from
        // one cut into more files): gone, as `save_pretrained` removes
        // them.
        let stale = |f: &str| {
            let part = f.starts_with("model-") && f.contains("-of-") && f.ends_with(".safetensors");
            (part || f == INDEX || f == SINGLE) && !names.iter().any(|n| n == f)
        };
        for f in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            if stale(&f.file_name().to_string_lossy()) {
                let _ = std::fs::remove_file(f.path());
            }
        }
        if names.len() == 1 {
            return Ok(());
        }
        let weight_map: BTreeMap<&String, &String> = (self.part_of.iter())
            .map(|(t, &k)| (t, &names[k]))
            .collect();
        let index = serde_json::json!({
            "metadata": {"total_size": self.total},
            "weight_map": weight_map,
        });
        let text = serde_json::to_string_pretty(&index)
            .map_err(|e| CheckpointError::format(&self.dir, e.to_string()))?;
        write_atomic(&self.dir.join(INDEX), text.as_bytes())
    }
}

/// `plan` cut, in order, into runs of at most `max` bytes of tensors (a
/// tensor larger than `max` alone in its run).
fn split(plan: &[Planned], max: u64) -> Result<Vec<&[Planned]>, CheckpointError> {
    let mut groups = Vec::new();
    let (mut start, mut size) = (0, 0u64);
    for (i, t) in plan.iter().enumerate() {
        let n = t.bytes().ok_or_else(|| {
            CheckpointError::format(Path::new(&t.name), "a tensor too large to write")
        })? as u64;
        if i > start && size + n > max {
            groups.push(&plan[start..i]);
            (start, size) = (i, 0);
        }
        size += n;
    }
    groups.push(&plan[start..]);
    Ok(groups)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::Dtype;

    fn plan(sizes: &[usize]) -> Vec<Planned> {
        (sizes.iter().enumerate())
            .map(|(i, &n)| Planned::new(&format!("t{i}"), Dtype::F32, &[n as i64]))
            .collect()
    }

    fn names(groups: &[&[Planned]]) -> Vec<Vec<String>> {
        (groups.iter())
            .map(|g| g.iter().map(|t| t.name.clone()).collect())
            .collect()
    }

    #[test]
    fn tensors_are_cut_in_order_at_the_limit_and_a_large_one_stands_alone() {
        // 4 bytes an element: 40, 40, 80, 400, 4 bytes against 100.
        let p = plan(&[10, 10, 20, 100, 1]);
        let groups = split(&p, 100).unwrap();
        assert_eq!(
            names(&groups),
            [vec!["t0", "t1"], vec!["t2"], vec!["t3"], vec!["t4"]]
        );
        assert_eq!(
            names(&split(&p, 1 << 20).unwrap()),
            [vec!["t0", "t1", "t2", "t3", "t4"]]
        );
        assert_eq!(names(&split(&[], 100).unwrap()), [Vec::<String>::new()]);
    }
}
