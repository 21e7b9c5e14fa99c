//! A whole-model weights file, or a Hugging Face sharded checkpoint read
//! as one: what [`Engine::load_weights`](crate::Engine::load_weights)
//! and `ShardPlan::weights_from_file` take.
//!
//! Models too big for one file come as several safetensors files and an
//! index, `model.safetensors.index.json`, whose `weight_map` names the
//! file each tensor is in (Hugging Face's `save_pretrained` with
//! `max_shard_size`, `transformers`' and `accelerate`'s loaders read the
//! same). Each file is mapped as a lone one is; a tensor is read from the
//! file the index places it in.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::Path;

use safetensors::Dtype;

use super::files::{RankFile, ReadWidened};
use super::CheckpointError;

/// The name Hugging Face gives a sharded checkpoint's index.
pub(crate) const INDEX: &str = "model.safetensors.index.json";
/// The name Hugging Face gives an unsharded checkpoint.
pub(crate) const SINGLE: &str = "model.safetensors";

/// A rule naming a weights file's tensors in the model: the VarStore name
/// for a tensor's name in the file, or `None` to skip it
/// ([`ShardPlan::rename_weights`](crate::ShardPlan::rename_weights)).
pub(crate) type Rename = dyn Fn(&str) -> Option<String> + Send + Sync;

/// One or more mapped safetensors files holding a model's tensors, each
/// tensor in one of them.
pub(crate) struct WeightsFiles {
    files: Vec<RankFile>,
    /// Each tensor by the model's name for it: its file (an index into
    /// `files`) and its name there.
    owner: HashMap<String, (usize, String)>,
    /// A CRC-32 of the names a rename rule gave (`None` without one), so
    /// that ranks whose rules differ do not pass for ranks reading the
    /// same thing.
    renamed: Option<u32>,
}

impl WeightsFiles {
    /// Opens `path`: a safetensors file; an index (a `.json` file) naming
    /// safetensors files beside it; or a directory holding
    /// `model.safetensors.index.json` or else `model.safetensors`. Every
    /// file is checked as [`RankFile::open_weights`] checks one, and
    /// every tensor the index names must be in the file it names. With
    /// `rename`, each tensor goes by the name it gives (skipped when it
    /// gives none); two tensors given one name are refused. Errors are
    /// [`CheckpointError::Weights`] naming `path` (and the file at
    /// fault).
    pub(crate) fn open(path: &Path, rename: Option<&Rename>) -> Result<Self, CheckpointError> {
        let refuse = |msg: String| CheckpointError::Weights {
            path: path.to_path_buf(),
            msg,
        };
        let path = match path.is_dir() {
            false => path.to_path_buf(),
            true => [INDEX, SINGLE]
                .into_iter()
                .map(|f| path.join(f))
                .find(|p| p.is_file())
                .ok_or_else(|| {
                    refuse(format!(
                        "a directory holding neither {INDEX} (a sharded checkpoint's index) nor {SINGLE}; name the file to load"
                    ))
                })?,
        };
        // (file, name in the file) of every tensor.
        let (files, placed) = match path.extension().is_some_and(|e| e == "json") {
            false => {
                let file = RankFile::open_weights(&path)?;
                let placed: Vec<(usize, String)> =
                    file.tensors().map(|(n, ..)| (0, n.to_string())).collect();
                (vec![file], placed)
            }
            true => {
                let map = weight_map(&path).map_err(&refuse)?;
                let dir = path.parent().unwrap_or(Path::new("."));
                // Each file once, in name order (what `identity` hashes).
                let mut names: Vec<&String> = map.values().collect();
                names.sort();
                names.dedup();
                let mut files = Vec::with_capacity(names.len());
                let mut at = HashMap::new();
                for name in names {
                    if Path::new(name).components().count() != 1 {
                        return Err(refuse(format!(
                            "its weight_map names `{name}`, not a file beside the index"
                        )));
                    }
                    at.insert(name.clone(), files.len());
                    files.push(RankFile::open_weights(&dir.join(name))?);
                }
                let mut placed = Vec::with_capacity(map.len());
                for (tensor, file) in map {
                    let k = at[&file];
                    if files[k].tensor(&tensor).is_none() {
                        return Err(refuse(format!(
                            "its weight_map places `{tensor}` in {file}, which does not hold it: the index and its files are from different checkpoints"
                        )));
                    }
                    placed.push((k, tensor));
                }
                (files, placed)
            }
        };
        let mut owner: HashMap<String, (usize, String)> = HashMap::with_capacity(placed.len());
        let mut given = Vec::new();
        for (k, in_file) in placed {
            let model = match rename {
                None => in_file.clone(),
                Some(rule) => match rule(&in_file) {
                    Some(m) => m,
                    None => continue,
                },
            };
            if let Some((_, other)) = owner.get(&model) {
                return Err(refuse(format!(
                    "the plan's rename_weights rule names both `{other}` and `{in_file}` `{model}`: give each tensor a name of its own, or skip one (None)"
                )));
            }
            given.push(format!("{in_file}\u{0}{model}"));
            owner.insert(model, (k, in_file));
        }
        let renamed = rename.map(|_| {
            given.sort();
            crc32fast::hash(given.join("\u{1}").as_bytes())
        });
        Ok(Self {
            files,
            owner,
            renamed,
        })
    }

    /// The tensors, by the model's names for them: name, dtype, shape and
    /// length in bytes.
    pub(crate) fn tensors(&self) -> impl Iterator<Item = (&str, Dtype, &[usize], usize)> {
        (self.owner.iter()).filter_map(|(model, (k, in_file))| {
            let (d, s, len) = self.files.get(*k)?.tensor(in_file)?;
            Some((model.as_str(), d, s, len))
        })
    }

    /// What tells two ranks' checkpoints apart without reading their data
    /// ([`RankFile::identity`] of each file, in order, and the names a
    /// rename rule gave), and their length.
    pub(crate) fn identity(&self) -> (u32, usize) {
        if let ([one], None) = (self.files.as_slice(), self.renamed) {
            return one.identity();
        }
        let mut h = crc32fast::Hasher::new();
        let mut len = 0;
        for f in &self.files {
            let (crc, n) = f.identity();
            h.update(&crc.to_le_bytes());
            h.update(&(n as u64).to_le_bytes());
            len += n;
        }
        if let Some(r) = self.renamed {
            h.update(&r.to_le_bytes());
        }
        (h.finalize(), len)
    }

    /// The file tensor `name` (the model's name) is in, and its name
    /// there.
    pub(crate) fn file_of(&self, name: &str) -> Result<(&RankFile, &str), CheckpointError> {
        match (self.owner.get(name)).and_then(|(k, f)| Some((self.files.get(*k)?, f.as_str()))) {
            Some(found) => Ok(found),
            None => {
                let first = self.files.first().map_or(Path::new(""), |f| f.path());
                Err(CheckpointError::format(
                    first,
                    format!("no tensor `{name}`"),
                ))
            }
        }
    }

    /// [`RankFile::bytes`] from the file tensor `name` is in.
    pub(crate) fn bytes(&self, name: &str) -> Result<(Dtype, &[u8]), CheckpointError> {
        let (file, in_file) = self.file_of(name)?;
        file.bytes(in_file)
    }
}

impl ReadWidened for WeightsFiles {
    /// [`RankFile::read_widened`] from the file tensor `name` is in.
    fn read_widened(
        &self,
        name: &str,
        range: Range<usize>,
        dst: &mut [f32],
    ) -> Result<(), CheckpointError> {
        let (file, in_file) = self.file_of(name)?;
        file.read_widened(in_file, range, dst)
    }
}

/// The `weight_map` of the index at `path`: tensor name -> file name.
fn weight_map(path: &Path) -> Result<BTreeMap<String, String>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read it: {e}"))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("not JSON ({e})"))?;
    let map = (json.get("weight_map").and_then(|m| m.as_object())).ok_or_else(|| {
        "no `weight_map` object (a sharded checkpoint's index maps each tensor to its file)"
            .to_string()
    })?;
    let mut out = BTreeMap::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| format!("its weight_map gives `{tensor}` {file}, not a file name"))?;
        out.insert(tensor.clone(), file.to_string());
    }
    if out.is_empty() {
        return Err("its weight_map is empty".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_index_that_is_not_one_is_refused_naming_what_it_lacks() {
        let dir = crate::test_dir("weights-index");
        let index = dir.join(INDEX);
        for (text, says) in [
            ("{", "not JSON"),
            (r#"{"metadata": {}}"#, "no `weight_map` object"),
            (r#"{"weight_map": {}}"#, "its weight_map is empty"),
            (
                r#"{"weight_map": {"w": 3}}"#,
                "its weight_map gives `w` 3, not a file name",
            ),
            (
                r#"{"weight_map": {"w": "../elsewhere.safetensors"}}"#,
                "its weight_map names `../elsewhere.safetensors`, not a file beside the index",
            ),
        ] {
            std::fs::write(&index, text).unwrap();
            for path in [&index, &dir] {
                let err = WeightsFiles::open(path, None).err().unwrap().to_string();
                assert!(err.contains(says), "{text}: {err}");
                assert!(err.contains(&path.display().to_string()), "{err}");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
