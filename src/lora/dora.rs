//! DoRA's magnitudes at the start: each adapted layer's pretrained rows'
//! norms, `||W[o, :]||`, as PEFT's `DoraLinearLayer.update_layer` sets
//! them (with `B` zero, `W + s B A` is `W`).
//!
//! Read from the checkpoint's files while the model is built, not from
//! the engine after: under `weights_from_file` the base exists only once
//! the engine's build has loaded it, and a step a caller had to remember
//! would leave magnitudes of one, silently. Each rank reads the adapted
//! matrices, one at a time (not whole files), and computes the same
//! norms; the build then takes world rank 0's, as for every fresh
//! variable.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use tch::{nn, Kind, Tensor};

use super::merge::{base_files, read_header};
use crate::hf::HfError;

/// Sets every `...lora_magnitude_vector` variable of `vs` to the norms of
/// its layer's rows, read from the checkpoint `dir`, whose names are the
/// VarStore's after `prefix` (GPT-2's `transformer.`) and whose
/// matrices are `[in, out]` when `fan_in_fan_out`. Returns how many it set.
pub(crate) fn init_magnitudes(
    vs: &nn::VarStore,
    dir: &Path,
    prefix: &str,
    fan_in_fan_out: bool,
) -> Result<usize, HfError> {
    let wanted: HashMap<String, Tensor> = (vs.variables().into_iter())
        .filter_map(|(name, t)| {
            let module = name.strip_suffix(".lora_magnitude_vector")?;
            Some((format!("{prefix}{module}.weight"), t))
        })
        .collect();
    if wanted.is_empty() {
        return Ok(0);
    }
    let mut set = 0;
    for (file, names) in base_files(dir)? {
        let here: Vec<&String> = (names.iter())
            .map(|(n, _)| n)
            .filter(|n| wanted.contains_key(*n))
            .collect();
        if here.is_empty() {
            continue;
        }
        let mut reader = Reader::open(&file)?;
        for name in here {
            let w = reader.matrix(name)?;
            let w = if fan_in_fan_out { w.tr() } else { w };
            let norms = w.linalg_norm(2.0, [1i64].as_slice(), false, None::<Kind>);
            let m = &wanted[name];
            if m.size() != norms.size() {
                return Err(HfError::Lora(format!(
                    "`{name}` has {:?} rows, its magnitude vector {:?}: a checkpoint of another model",
                    norms.size(),
                    m.size()
                )));
            }
            tch::no_grad(|| m.shallow_clone().copy_(&norms));
            set += 1;
        }
    }
    if set < wanted.len() {
        let mut lacking: Vec<&String> = wanted.keys().collect();
        lacking.sort();
        return Err(HfError::Lora(format!(
            "{}: DoRA's magnitudes start at the adapted matrices' row norms, and the checkpoint lacks some of them (first: {})",
            dir.display(),
            lacking[0]
        )));
    }
    Ok(set)
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

    /// Tensor `name`, a matrix of f32, bf16 or f16, widened to f32.
    fn matrix(&mut self, name: &str) -> Result<Tensor, HfError> {
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
        let mut bytes = vec![0u8; (to - from) as usize];
        self.file
            .seek(SeekFrom::Start(self.start + from))
            .and_then(|_| self.file.read_exact(&mut bytes))
            .map_err(|e| bad(format!("cannot read it: {e}")))?;
        let t = Tensor::f_from_data_size(&bytes, &[a, b], kind)
            .map_err(|e| bad(format!("cannot make a tensor of it: {e}")))?;
        Ok(t.to_kind(Kind::Float))
    }
}
