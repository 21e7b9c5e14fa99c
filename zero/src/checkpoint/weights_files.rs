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
//!
//! The plan's rules ([`NameRules`]) name the file's tensors in the model
//! and say which it holds transposed: a matrix stored `[in, out]`, as
//! GPT-2's Conv1D stores it, is read element by element into a linear's
//! `[out, in]`, straight from the mapped file, with no transposed copy.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use safetensors::Dtype;

use super::files::{RankFile, ReadWidened};
use super::transpose::Transpose;
use super::CheckpointError;

/// The name Hugging Face gives a sharded checkpoint's index.
pub(crate) const INDEX: &str = "model.safetensors.index.json";
/// The name Hugging Face gives an unsharded checkpoint.
pub(crate) const SINGLE: &str = "model.safetensors";

/// A rule naming a weights file's tensors in the model: the VarStore name
/// for a tensor's name in the file, or `None` to skip it
/// ([`ShardPlan::rename_weights`](crate::ShardPlan::rename_weights)).
pub(crate) type Rename = dyn Fn(&str) -> Option<String> + Send + Sync;

/// A rule saying, of each tensor by the model's name for it, whether the
/// file holds it transposed
/// ([`ShardPlan::transpose_weights`](crate::ShardPlan::transpose_weights)).
pub(crate) type TransposeRule = dyn Fn(&str) -> bool + Send + Sync;

/// A rule saying, of each tensor by the model's name for it, whether the
/// file may hold several copies of it
/// ([`ShardPlan::weight_copies`](crate::ShardPlan::weight_copies)).
pub(crate) type CopiesRule = dyn Fn(&str) -> bool + Send + Sync;

/// The plan's rules for reading a weights file into the model.
#[derive(Clone, Default)]
pub(crate) struct NameRules {
    /// The file's names to the model's.
    pub(crate) rename: Option<Arc<Rename>>,
    /// Which tensors (by the model's names) the file holds transposed.
    pub(crate) transpose: Option<Arc<TransposeRule>>,
    /// Which tensors (by the model's names) the file may hold several
    /// copies of ([`ShardPlan::weight_copies`](crate::ShardPlan::weight_copies)).
    pub(crate) copies: Option<Arc<CopiesRule>>,
}

/// Where one of the model's tensors is.
struct Entry {
    /// Its file, an index into `files`.
    file: usize,
    /// Its name there.
    name: String,
    /// Its shape in the model when the file holds it transposed (the
    /// file's `[rows, cols]` as `[cols, rows]`).
    transposed: Option<Vec<usize>>,
}

/// One or more mapped safetensors files holding a model's tensors, each
/// tensor in one of them.
pub(crate) struct WeightsFiles {
    files: Vec<RankFile>,
    /// Each tensor by the model's name for it.
    owner: HashMap<String, Entry>,
    /// A CRC-32 of what the plan's rules made of the file (each tensor's
    /// name in the model and whether it is transposed; `None` without a
    /// rule), so that ranks whose rules differ do not pass for ranks
    /// reading the same thing: a square matrix read transposed on one
    /// rank only has every shape right.
    ruled: Option<u32>,
}

impl WeightsFiles {
    /// Opens `path`: a safetensors file; an index (a `.json` file) naming
    /// safetensors files beside it; or a directory holding
    /// `model.safetensors.index.json` or else `model.safetensors`. Every
    /// file is checked as [`RankFile::open_weights`] checks one, and
    /// every tensor the index names must be in the file it names. Under
    /// `rules.rename`, each tensor goes by the name it gives (skipped when
    /// it gives none); two tensors given one name are refused, unless
    /// `rules.copies` says the file may hold copies of it: then the one
    /// whose name in the file sorts first is read. A tensor
    /// `rules.transpose` names must be a matrix. Errors are
    /// [`CheckpointError::Weights`] naming `path` (and the file at
    /// fault).
    pub(crate) fn open(path: &Path, rules: &NameRules) -> Result<Self, CheckpointError> {
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
                    // Older Hugging Face checkpoints are pickles, which
                    // zrt does not read (unpickling runs code).
                    let pickled = ["pytorch_model.bin", "pytorch_model.bin.index.json"]
                        .into_iter()
                        .find(|f| path.join(f).is_file());
                    let hint = match pickled {
                        Some(f) => format!(
                            "; it holds {f}, a pickled PyTorch checkpoint zrt does not read: convert it once with transformers, AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out) (safetensors by default)"
                        ),
                        None => String::new(),
                    };
                    refuse(format!(
                        "a directory holding neither {INDEX} (a sharded checkpoint's index) nor {SINGLE}; name the file to load{hint}"
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
        let mut owner: HashMap<String, Entry> = HashMap::with_capacity(placed.len());
        let mut given = Vec::new();
        for (file, in_file) in placed {
            let model = match &rules.rename {
                None => in_file.clone(),
                Some(rule) => match rule(&in_file) {
                    Some(m) => m,
                    None => continue,
                },
            };
            let transposed = match rules.transpose.as_ref().is_some_and(|t| t(&model)) {
                false => None,
                true => match files[file].tensor(&in_file).map(|(_, s, _)| s) {
                    Some(&[rows, cols]) => Some(vec![cols, rows]),
                    shape => {
                        return Err(refuse(format!(
                            "the plan's transpose_weights rule names `{model}`, which the file holds with shape {:?}: only a matrix (2 dimensions) reads transposed; leave it out of the rule",
                            shape.unwrap_or_default()
                        )))
                    }
                },
            };
            // Every tensor the rule names, a copy left out too: what
            // ranks compare must not hang on the order the file lists
            // them in.
            given.push(format!(
                "{in_file}\u{0}{model}\u{0}{}",
                transposed.is_some()
            ));
            if let Some(other) = owner.get(&model) {
                // Copies of one tied tensor: the first by name, on every
                // rank alike (the order the file lists them in is not).
                if !rules.copies.as_ref().is_some_and(|c| c(&model)) {
                    return Err(refuse(format!(
                        "the plan's rename_weights rule names both `{}` and `{in_file}` `{model}`: give each tensor a name of its own, or skip one (None)",
                        other.name
                    )));
                }
                if other.name < in_file {
                    continue;
                }
            }
            let name = in_file;
            owner.insert(
                model,
                Entry {
                    file,
                    name,
                    transposed,
                },
            );
        }
        let ruled = (rules.rename.is_some() || rules.transpose.is_some()).then(|| {
            given.sort();
            crc32fast::hash(given.join("\u{1}").as_bytes())
        });
        Ok(Self {
            files,
            owner,
            ruled,
        })
    }

    /// The tensors, by the model's names for them: name, dtype, shape (in
    /// the model: a transposed one's reversed) and length in bytes.
    pub(crate) fn tensors(&self) -> impl Iterator<Item = (&str, Dtype, &[usize], usize)> {
        (self.owner.iter()).filter_map(|(model, e)| {
            let (d, s, len) = self.files.get(e.file)?.tensor(&e.name)?;
            Some((model.as_str(), d, e.transposed.as_deref().unwrap_or(s), len))
        })
    }

    /// What tells two ranks' checkpoints apart without reading their data
    /// ([`RankFile::identity`] of each file, in order, and what the plan's
    /// rules made of it), and their length.
    pub(crate) fn identity(&self) -> (u32, usize) {
        if let ([one], None) = (self.files.as_slice(), self.ruled) {
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
        if let Some(r) = self.ruled {
            h.update(&r.to_le_bytes());
        }
        (h.finalize(), len)
    }

    /// The file tensor `name` (the model's name) is in, and its entry.
    fn entry(&self, name: &str) -> Result<(&RankFile, &Entry), CheckpointError> {
        match (self.owner.get(name)).and_then(|e| Some((self.files.get(e.file)?, e))) {
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

    /// The file tensor `name` (the model's name) is in, and its name
    /// there.
    pub(crate) fn file_of(&self, name: &str) -> Result<(&RankFile, &str), CheckpointError> {
        self.entry(name).map(|(f, e)| (f, e.name.as_str()))
    }

    /// Tensor `name`'s dtype and bytes in the model's layout: the file's
    /// own (mapped), or a transposed tensor's transposed into a copy.
    pub(crate) fn bytes(&self, name: &str) -> Result<(Dtype, Cow<'_, [u8]>), CheckpointError> {
        let (file, e) = self.entry(name)?;
        let (dtype, b) = file.bytes(&e.name)?;
        let Some(shape) = &e.transposed else {
            return Ok((dtype, Cow::Borrowed(b)));
        };
        let size = dtype.size();
        let t = transpose_of(file, name, shape, b.len() / size.max(1))?;
        Ok((dtype, Cow::Owned(t.copy(b, size))))
    }
}

/// The transpose the model reads of tensor `name` of `file` (`numel`
/// elements there), whose shape in the model is `shape`: the file holds
/// the matrix `[shape[1], shape[0]]`. Checked to cover it.
fn transpose_of(
    file: &RankFile,
    name: &str,
    shape: &[usize],
    numel: usize,
) -> Result<Transpose, CheckpointError> {
    match shape {
        &[rows, cols] if rows * cols == numel => Ok(Transpose {
            rows: cols,
            cols: rows,
        }),
        _ => Err(CheckpointError::format(
            file.path(),
            format!("tensor `{name}` does not hold {shape:?} elements"),
        )),
    }
}

impl ReadWidened for WeightsFiles {
    /// [`RankFile::read_widened`] from the file tensor `name` is in; a
    /// transposed one element by element, from the mapped file.
    fn read_widened(
        &self,
        name: &str,
        range: Range<usize>,
        dst: &mut [f32],
    ) -> Result<(), CheckpointError> {
        let (file, e) = self.entry(name)?;
        let Some(shape) = &e.transposed else {
            return file.read_widened(&e.name, range, dst);
        };
        let (dtype, b) = file.bytes(&e.name)?;
        let widen: fn(&[u8]) -> f32 = match dtype {
            Dtype::F32 => |c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            Dtype::BF16 => |c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32(),
            Dtype::F16 => |c| half::f16::from_le_bytes([c[0], c[1]]).to_f32(),
            _ => {
                return Err(CheckpointError::format(
                    file.path(),
                    format!("tensor `{}` is {dtype:?}, not F32, BF16 or F16", e.name),
                ))
            }
        };
        let size = dtype.size();
        let t = transpose_of(file, name, shape, b.len() / size)?;
        if range.start > range.end || range.end > b.len() / size || dst.len() != range.len() {
            return Err(CheckpointError::format(
                file.path(),
                format!(
                    "tensor `{}` does not cover {range:?} into {}",
                    e.name,
                    dst.len()
                ),
            ));
        }
        for (d, i) in dst.iter_mut().zip(range) {
            *d = widen(&b[t.source(i) * size..][..size]);
        }
        // A range of the transposed matrix reads across all of it.
        file.forget(b);
        Ok(())
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
                let err = WeightsFiles::open(path, &NameRules::default())
                    .err()
                    .unwrap()
                    .to_string();
                assert!(err.contains(says), "{text}: {err}");
                assert!(err.contains(&path.display().to_string()), "{err}");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_directory_of_a_pickled_checkpoint_is_refused_naming_the_conversion() {
        let dir = crate::test_dir("weights-pickled");
        std::fs::write(dir.join("pytorch_model.bin"), b"not read").unwrap();
        let err = WeightsFiles::open(&dir, &NameRules::default())
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("nor model.safetensors")
                && err.contains("it holds pytorch_model.bin, a pickled PyTorch checkpoint")
                && err.contains("save_pretrained(out)"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
