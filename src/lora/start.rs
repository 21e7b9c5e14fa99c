//! What adapters start from that the checkpoint holds: DoRA's
//! magnitudes, each adapted layer's pretrained rows' norms, `||W[o,
//! :]||`, as PEFT's `DoraLinearLayer.update_layer` sets them (with `B`
//! zero, `W + s B A` is `W`); trainable tokens' rows, the pretrained
//! embedding's rows of those tokens (PEFT's `TrainableTokensLayer`).
//!
//! Read from the checkpoint's files while the model is built, not from
//! the engine after: under `weights_from_file` the base exists only once
//! the engine's build has loaded it, and a step a caller had to remember
//! would leave magnitudes of one and rows of zeros, silently. Each rank
//! reads what it needs (an adapted matrix at a time, the trained rows
//! alone of an embedding), and computes the same values; the build then
//! takes world rank 0's, as for every fresh variable.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use tch::{nn, Kind, Tensor};

use super::embedding::DELTA;
use super::merge::{base_files, read_header};
use super::{FileNames, LoraConfig};
use crate::hf::HfError;

/// What a variable starts from.
enum Start {
    /// The norms of its matrix's rows (`[in, out]` when transposed).
    RowNorms { transposed: bool },
    /// These rows of its matrix.
    Rows(Vec<i64>),
}

/// Sets every DoRA magnitude vector and trainable tokens' rows of `vs`
/// from the checkpoint `dir`, whose names are the VarStore's after
/// `prefix` (GPT-2's `transformer.`) or as `names` gives them (Zamba's:
/// a shared block's under any user's name), as `cfg` builds them.
/// Returns how many it set.
pub(crate) fn init_from_checkpoint(
    vs: &nn::VarStore,
    dir: &Path,
    (prefix, names): (&str, Option<&FileNames>),
    cfg: &LoraConfig,
) -> Result<usize, HfError> {
    let delta = format!(".{DELTA}");
    // Each variable, what it starts from, and the names its matrix may
    // have in the files.
    let wanted: Vec<(Vec<String>, Tensor, Start)> = (vs.variables().into_iter())
        .filter_map(|(name, t)| {
            let (module, start) = match (
                name.strip_suffix(".lora_magnitude_vector"),
                name.strip_suffix(delta.as_str()),
            ) {
                (Some(m), _) => (
                    m,
                    Start::RowNorms {
                        transposed: cfg.fan_in_fan_out,
                    },
                ),
                (_, Some(m)) => {
                    let rows = cfg.trainable_rows(&format!("{prefix}{m}"), true);
                    (m, Start::Rows(rows.to_vec()))
                }
                _ => return None,
            };
            let matrix = format!("{module}.weight");
            let in_files = match names {
                Some(rule) => rule(&matrix),
                None => vec![matrix],
            };
            let in_files = in_files.iter().map(|n| format!("{prefix}{n}")).collect();
            Some((in_files, t, start))
        })
        .collect();
    if wanted.is_empty() {
        return Ok(0);
    }
    let by_name: HashMap<&str, usize> = (wanted.iter().enumerate())
        .flat_map(|(i, (names, _, _))| names.iter().map(move |n| (n.as_str(), i)))
        .collect();
    let mut set = vec![false; wanted.len()];
    for (file, names) in base_files(dir)? {
        let here: Vec<(&String, usize)> = (names.iter())
            .filter_map(|(n, _)| by_name.get(n.as_str()).map(|&i| (n, i)))
            .collect();
        if here.iter().all(|&(_, i)| set[i]) {
            continue;
        }
        let mut reader = Reader::open(&file)?;
        for (name, i) in here {
            if set[i] {
                // Another copy of a matrix already read.
                continue;
            }
            let (_, v, start) = &wanted[i];
            let values = match start {
                Start::RowNorms { transposed } => {
                    let w = reader.matrix(name, None)?;
                    let w = if *transposed { w.tr() } else { w };
                    w.linalg_norm(2.0, [1i64].as_slice(), false, None::<Kind>)
                }
                Start::Rows(ids) => reader.matrix(name, Some(ids))?,
            };
            if v.size() != values.size() {
                return Err(HfError::Lora(format!(
                    "`{name}` gives {:?} where its adapter's `{}` is {:?}: a checkpoint of another model",
                    values.size(),
                    match start {
                        Start::RowNorms { .. } => "lora_magnitude_vector",
                        Start::Rows(_) => DELTA,
                    },
                    v.size()
                )));
            }
            tch::no_grad(|| v.shallow_clone().copy_(&values));
            set[i] = true;
        }
    }
    let mut lacking: Vec<&String> = (wanted.iter().zip(&set))
        .filter(|(_, set)| !**set)
        .filter_map(|((names, _, _), _)| names.first())
        .collect();
    lacking.sort();
    if let Some(first) = lacking.first() {
        return Err(HfError::Lora(format!(
            "{}: DoRA's magnitudes and trainable tokens start from the checkpoint's matrices, and it lacks some of them (first: {first})",
            dir.display(),
        )));
    }
    Ok(wanted.len())
}

/// A safetensors file read a tensor at a time (its header parsed once).
struct Reader {
    path: PathBuf,
    file: std::fs::File,
    /// Where the data starts.
    start: u64,
    header: serde_json::Map<String, serde_json::Value>,
}

impl Reader {
    fn open(path: &Path) -> Result<Self, HfError> {
        let ((file, start), header) = read_header(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            start,
            header,
        })
    }

    /// Tensor `name`, a matrix of f32, bf16 or f16, widened to f32: the
    /// whole of it, or its rows `rows` alone (each read where it lies),
    /// an index past its rows refused naming it.
    fn matrix(&mut self, name: &str, rows: Option<&[i64]>) -> Result<Tensor, HfError> {
        let bad = |msg: String| HfError::Read {
            path: self.path.clone(),
            msg: format!("`{name}`: {msg}"),
        };
        let entry = self
            .header
            .get(name)
            .ok_or_else(|| bad("not in the file".into()))?;
        let dtype = entry.get("dtype").and_then(|d| d.as_str()).unwrap_or("");
        let shape: Vec<i64> = (entry.get("shape").and_then(|s| s.as_array()))
            .map(|s| s.iter().filter_map(|d| d.as_i64()).collect())
            .unwrap_or_default();
        let offsets: Vec<u64> = (entry.get("data_offsets").and_then(|s| s.as_array()))
            .map(|s| s.iter().filter_map(|d| d.as_u64()).collect())
            .unwrap_or_default();
        let (size, kind) = match dtype {
            "F32" => (4, Kind::Float),
            "BF16" => (2, Kind::BFloat16),
            "F16" => (2, Kind::Half),
            other => return Err(bad(format!("dtype {other:?}, not F32, BF16 or F16"))),
        };
        let n: i64 = shape.iter().product();
        let (&[a, b], &[from, to]) = (shape.as_slice(), offsets.as_slice()) else {
            return Err(bad(format!("shape {shape:?}: not a matrix")));
        };
        if to < from || to - from != n as u64 * size {
            return Err(bad(format!(
                "offsets {from}..{to} do not hold {n} elements"
            )));
        }
        let row = b as u64 * size;
        let spans: Vec<(u64, u64)> = match rows {
            None => vec![(from, to - from)],
            Some(rows) => {
                if let Some(r) = rows.iter().find(|&&r| !(0..a).contains(&r)) {
                    return Err(bad(format!(
                        "row {r} asked for (trainable_token_indices), of {a}: give token ids below the vocabulary's size"
                    )));
                }
                rows.iter().map(|&r| (from + r as u64 * row, row)).collect()
            }
        };
        let mut bytes = Vec::with_capacity(spans.iter().map(|s| s.1 as usize).sum());
        for (at, len) in spans {
            let start = bytes.len();
            bytes.resize(start + len as usize, 0);
            self.file
                .seek(SeekFrom::Start(self.start + at))
                .and_then(|_| self.file.read_exact(&mut bytes[start..]))
                .map_err(|e| bad(format!("cannot read it: {e}")))?;
        }
        let shape = [rows.map_or(a, |r| r.len() as i64), b];
        let t = Tensor::f_from_data_size(&bytes, &shape, kind)
            .map_err(|e| bad(format!("cannot make a tensor of it: {e}")))?;
        Ok(t.to_kind(Kind::Float))
    }
}
