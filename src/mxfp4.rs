//! An MXFP4 checkpoint (GPT-OSS's as published) written out with its
//! experts in bf16: what `transformers` computes when it loads one where
//! no kernel runs MXFP4 (`Mxfp4Config(dequantize=True)`, or any CPU),
//! done on the files, a tensor at a time, so that zrt loads, trains and
//! exports the result as it does any bf16 checkpoint.
//!
//! MXFP4 (the OCP microscaling format) stores a matrix's rows in blocks
//! of 32 values: 16 bytes of 4-bit floats (e2m1, the low nibble first)
//! and one byte of scale, a power of two biased by 127 (e8m0). A
//! projection `p` of GPT-OSS's experts is held as `p_blocks`
//! `[experts, rows, blocks, 16]` and `p_scales` `[experts, rows,
//! blocks]`, each expert's matrix the transpose of the one its class
//! multiplies by; dequantized, it is `p` `[experts, blocks * 32, rows]`,
//! the layout of an unquantized GPT-OSS checkpoint.
//!
//! ```no_run
//! let done = zrt::mxfp4::dequantize("gpt-oss-20b".as_ref(), "gpt-oss-20b-bf16".as_ref())?;
//! println!("{} tensors dequantized", done.tensors.len());
//! # Ok::<(), zrt::hf::HfError>(())
//! ```

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use crate::hf::HfError;
use crate::lora::merge::{base_files, read_header, same_place, INDEX};

/// The values of the sixteen e2m1 codes, by code.
const FP4_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// What [`dequantize`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dequantized {
    /// The tensors dequantized, by their unquantized names, sorted.
    pub tensors: Vec<String>,
    /// The safetensors files written.
    pub files: usize,
}

/// A tensor of a safetensors file, as its header describes it.
#[derive(Debug, Clone)]
struct Meta {
    /// Its file, an index into the checkpoint's files.
    file: usize,
    dtype: String,
    shape: Vec<u64>,
    /// Where its bytes are, from the start of the file's data.
    from: u64,
    to: u64,
}

/// A tensor as it is written: copied, or dequantized from its blocks
/// and scales.
enum Out<'a> {
    Copy(&'a Meta),
    Dequantize { blocks: &'a Meta, scales: &'a Meta },
}

impl Out<'_> {
    /// Its dtype and shape in the file written.
    fn header(&self) -> (String, Vec<u64>) {
        match self {
            Out::Copy(m) => (m.dtype.clone(), m.shape.clone()),
            // `[experts, rows, blocks, 16]` to `[experts, blocks * 32, rows]`.
            Out::Dequantize { blocks, .. } => {
                let s = &blocks.shape;
                ("BF16".into(), vec![s[0], s[2] * 32, s[1]])
            }
        }
    }

    /// Its length in bytes in the file written.
    fn len(&self) -> u64 {
        match self {
            Out::Copy(m) => m.to - m.from,
            Out::Dequantize { .. } => self.header().1.iter().product::<u64>() * 2,
        }
    }
}

/// Writes to `out` the MXFP4 checkpoint `from` (a `save_pretrained`
/// directory whose `config.json` has a `quantization_config` of
/// `quant_method` `mxfp4`) with each `p_blocks`/`p_scales` pair
/// replaced by `p` in bf16, dequantized as `transformers`' `dequantize`
/// computes it (each 4-bit code's value times two to its block's scale
/// less 127, rounded to bf16; each expert's matrix transposed). Every
/// other tensor is copied as it is, each in the file it was in; the
/// index's `weight_map` and `total_size` follow, the config loses its
/// `quantization_config`, and the tokenizer's and generation files are
/// copied beside them. One expert's matrix is in memory at a time.
/// Everything is checked before anything is written: blocks without
/// their scales (or the reverse), dtypes other than `U8`, and shapes that
/// do not pair are refused naming the tensor; `out` may not be `from`.
pub fn dequantize(from: &Path, out: &Path) -> Result<Dequantized, HfError> {
    if same_place(from, out) {
        return Err(HfError::Setting(format!(
            "{}: the dequantized checkpoint would overwrite the quantized one: give --out another directory",
            out.display()
        )));
    }
    let config_path = from.join("config.json");
    let mut config = read_json(&config_path)?;
    let field = |msg: String| HfError::Field {
        path: config_path.clone(),
        msg,
    };
    let method =
        (config.get("quantization_config")).map(|q| q.get("quant_method").and_then(|m| m.as_str()));
    match method {
        Some(Some("mxfp4")) => {}
        None => {
            return Err(field(
                "no quantization_config: the checkpoint is not quantized; load it as it is".into(),
            ))
        }
        Some(m) => {
            let m = m.map_or("missing".to_string(), |m| format!("{m:?}"));
            return Err(field(format!(
                "quantization_config's quant_method {m}: zrt dequantizes mxfp4 only; dequantize it with transformers (from_pretrained, then save_pretrained)"
            )));
        }
    }
    let paths: Vec<PathBuf> = base_files(from)?.into_iter().map(|(p, _)| p).collect();
    // Each file's tensors, and the file kept open to read them from.
    let mut tensors: HashMap<String, Meta> = HashMap::new();
    let mut sources = Vec::with_capacity(paths.len());
    for (file, path) in paths.iter().enumerate() {
        let ((f, start), header) = read_header(path)?;
        for (name, v) in header.iter().filter(|(k, _)| *k != "__metadata__") {
            tensors.insert(name.clone(), meta(path, file, name, v)?);
        }
        sources.push(Source {
            path: path.clone(),
            file: f,
            start,
        });
    }
    let pairs = pairs(&tensors, from)?;
    // Each file's tensors as they are written, in the order of its data.
    let mut outs: Vec<Vec<(String, Out)>> = (0..paths.len()).map(|_| Vec::new()).collect();
    let mut in_order: Vec<(&String, &Meta)> = tensors.iter().collect();
    in_order.sort_by_key(|(n, m)| (m.file, m.from, n.as_str()));
    // `n` less `suffix`, when that is a pair's projection.
    let paired = |n: &str, suffix: &str| -> Option<String> {
        (n.strip_suffix(suffix))
            .filter(|p| pairs.contains_key(p))
            .map(str::to_string)
    };
    for (name, m) in in_order {
        if paired(name, "_scales").is_some() {
            continue;
        }
        let out_tensor =
            match paired(name, "_blocks").and_then(|p| Some((pairs.get(p.as_str())?, p))) {
                Some((&(blocks, scales), p)) => (p, Out::Dequantize { blocks, scales }),
                None => (name.clone(), Out::Copy(m)),
            };
        outs[m.file].push(out_tensor);
    }
    let io = |path: &Path, what: &str, e: &dyn std::fmt::Display| HfError::Read {
        path: path.to_path_buf(),
        msg: format!("cannot {what} it: {e}"),
    };
    std::fs::create_dir_all(out).map_err(|e| io(out, "create", &e))?;
    let mut total = 0;
    for (k, tensors) in outs.iter().enumerate() {
        let name = paths[k].file_name().unwrap_or_default();
        let to = out.join(name);
        total += write_file(&to, tensors, &mut sources)?;
    }
    // The index names each dequantized tensor where its blocks were.
    let index = from.join(INDEX);
    if index.is_file() {
        let mut j = read_json(&index)?;
        if let Some(map) = j.get_mut("weight_map").and_then(|m| m.as_object_mut()) {
            let renamed: serde_json::Map<String, serde_json::Value> = (map.iter())
                .filter(|(n, _)| paired(n, "_scales").is_none())
                .map(|(n, f)| match paired(n, "_blocks") {
                    Some(p) => (p, f.clone()),
                    None => (n.clone(), f.clone()),
                })
                .collect();
            *map = renamed;
        }
        // `base_files` read its weight_map: the index is an object.
        if let Some(all) = j.as_object_mut() {
            let meta = all
                .entry("metadata")
                .or_insert_with(|| serde_json::json!({}));
            if let Some(meta) = meta.as_object_mut() {
                meta.insert("total_size".into(), total.into());
            }
        }
        write_json(&out.join(INDEX), &j)?;
    }
    if let Some(c) = config.as_object_mut() {
        c.remove("quantization_config");
    }
    write_json(&out.join("config.json"), &config)?;
    for name in crate::hf::CARRIED {
        let src = from.join(name);
        if src.is_file() {
            std::fs::copy(&src, out.join(name)).map_err(|e| io(&src, "copy", &e))?;
        }
    }
    let mut done: Vec<String> = pairs.keys().map(|p| p.to_string()).collect();
    done.sort();
    Ok(Dequantized {
        tensors: done,
        files: paths.len(),
    })
}

/// The header entry `v` of tensor `name` in `path` (the checkpoint's
/// `file`-th file).
fn meta(path: &Path, file: usize, name: &str, v: &serde_json::Value) -> Result<Meta, HfError> {
    let bad = |msg: &str| HfError::Read {
        path: path.to_path_buf(),
        msg: format!("`{name}`: {msg} in its header"),
    };
    let numbers = |key: &str| -> Option<Vec<u64>> {
        let a = v.get(key)?.as_array()?;
        a.iter().map(|d| d.as_u64()).collect()
    };
    let dtype = (v.get("dtype").and_then(|d| d.as_str())).ok_or_else(|| bad("no dtype"))?;
    let shape = numbers("shape").ok_or_else(|| bad("no shape"))?;
    let Some(&[from, to]) = numbers("data_offsets").as_deref() else {
        return Err(bad("no data_offsets"));
    };
    if to < from {
        return Err(bad("data_offsets backwards"));
    }
    Ok(Meta {
        file,
        dtype: dtype.to_string(),
        shape,
        from,
        to,
    })
}

/// Each quantized projection's blocks and scales, by the projection's
/// name, each checked: both `U8`, the blocks `[experts, rows, blocks,
/// 16]`, the scales `[experts, rows, blocks]`, their bytes as many as
/// their shapes hold.
fn pairs<'a>(
    tensors: &'a HashMap<String, Meta>,
    from: &Path,
) -> Result<BTreeMap<&'a str, (&'a Meta, &'a Meta)>, HfError> {
    let bad = |msg: String| HfError::Read {
        path: from.to_path_buf(),
        msg,
    };
    let mut pairs = BTreeMap::new();
    for (name, m) in tensors {
        if let Some(p) = name.strip_suffix("_scales") {
            if !tensors.contains_key(&format!("{p}_blocks")) {
                return Err(bad(format!(
                    "`{name}` has no `{p}_blocks` beside it: the checkpoint is missing a file or is not MXFP4"
                )));
            }
            continue;
        }
        let Some(p) = name.strip_suffix("_blocks") else {
            continue;
        };
        let scales = tensors.get(&format!("{p}_scales")).ok_or_else(|| {
            bad(format!(
                "`{name}` has no `{p}_scales` beside it: the checkpoint is missing a file or is not MXFP4"
            ))
        })?;
        let (b, s) = (&m.shape, &scales.shape);
        let fits = m.dtype == "U8"
            && scales.dtype == "U8"
            && b.len() == 4
            && b[3] == 16
            && s.as_slice() == &b[..3]
            && m.to - m.from == b.iter().product::<u64>()
            && scales.to - scales.from == s.iter().product::<u64>();
        if !fits {
            return Err(bad(format!(
                "`{name}` is {} {b:?} and `{p}_scales` {} {s:?}: MXFP4's are U8 [experts, rows, blocks, 16] and U8 [experts, rows, blocks]",
                m.dtype, scales.dtype
            )));
        }
        pairs.insert(p, (m, scales));
    }
    Ok(pairs)
}

/// A file of the quantized checkpoint, read where its tensors lie.
struct Source {
    path: PathBuf,
    file: File,
    /// Where its data starts.
    start: u64,
}

impl Source {
    /// `len` bytes from `at` (from the start of the data) into `buf`.
    fn read(&mut self, at: u64, buf: &mut [u8]) -> Result<(), HfError> {
        self.file
            .seek(SeekFrom::Start(self.start + at))
            .and_then(|_| self.file.read_exact(buf))
            .map_err(|e| HfError::Read {
                path: self.path.clone(),
                msg: format!("cannot read it: {e}"),
            })
    }
}

/// Writes the safetensors file `to` holding `tensors` in order,
/// returning the bytes of tensor data written.
fn write_file(
    to: &Path,
    tensors: &[(String, Out)],
    sources: &mut [Source],
) -> Result<u64, HfError> {
    let io = |e: std::io::Error| HfError::Read {
        path: to.to_path_buf(),
        msg: format!("cannot write it: {e}"),
    };
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut at = 0;
    for (name, t) in tensors {
        let (dtype, shape) = t.header();
        let len = t.len();
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, at + len]}),
        );
        at += len;
    }
    let mut text = serde_json::to_vec(&header).map_err(|e| HfError::Setting(e.to_string()))?;
    // The data starts 8-byte aligned, as the safetensors writers leave it.
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let mut w = std::io::BufWriter::new(File::create(to).map_err(io)?);
    w.write_all(&(text.len() as u64).to_le_bytes())
        .and_then(|_| w.write_all(&text))
        .map_err(io)?;
    for (_, t) in tensors {
        match t {
            Out::Copy(m) => {
                // In slices of 64 MiB: an embedding is gigabytes.
                let mut at = m.from;
                while at < m.to {
                    let mut buf = vec![0u8; (m.to - at).min(64 << 20) as usize];
                    sources[m.file].read(at, &mut buf)?;
                    w.write_all(&buf).map_err(io)?;
                    at += buf.len() as u64;
                }
            }
            Out::Dequantize { blocks, scales } => {
                let s = &blocks.shape;
                let (rows, groups) = (s[1], s[2]);
                let (per_blocks, per_scales) = (rows * groups * 16, rows * groups);
                for e in 0..s[0] {
                    let mut b = vec![0u8; per_blocks as usize];
                    let mut sc = vec![0u8; per_scales as usize];
                    sources[blocks.file].read(blocks.from + e * per_blocks, &mut b)?;
                    sources[scales.file].read(scales.from + e * per_scales, &mut sc)?;
                    let m = expert(&b, &sc, rows as i64, groups as i64).map_err(|e| {
                        HfError::Setting(format!("dequantizing into {}: {e}", to.display()))
                    })?;
                    w.write_all(&m).map_err(io)?;
                }
            }
        }
    }
    w.flush().map_err(io)?;
    Ok(at)
}

/// One expert's matrix from its `blocks` (`[rows, groups, 16]` bytes)
/// and `scales` (`[rows, groups]`): `[groups * 32, rows]` in bf16, its
/// bytes. As `transformers`' `convert_moe_packed_tensors`: each byte's
/// low nibble the even value, its high nibble the odd one, looked up in
/// bf16, times two to the scale less 127 (`ldexp`: in fp32, rounded to
/// bf16), then transposed.
fn expert(blocks: &[u8], scales: &[u8], rows: i64, groups: i64) -> Result<Vec<u8>, tch::TchError> {
    let b = Tensor::f_from_data_size(blocks, &[rows * groups, 16], Kind::Uint8)?;
    let s = Tensor::f_from_data_size(scales, &[rows * groups, 1], Kind::Uint8)?;
    let exp = s.to_kind(Kind::Int) - 127;
    let lut = Tensor::from_slice(&FP4_VALUES).to_kind(Kind::BFloat16);
    let lo = lut.f_index_select(0, &b.bitwise_and(0x0F).to_kind(Kind::Int64).view(-1))?;
    let hi = lut.f_index_select(
        0,
        &b.bitwise_right_shift_tensor_scalar(4)
            .to_kind(Kind::Int64)
            .view(-1),
    )?;
    let values = Tensor::stack(&[lo, hi], -1).view([rows * groups, 32]);
    let out = values.empty_like();
    let _ = values.f_ldexp_out(&out, &exp)?;
    let m = out.view([rows, groups * 32]).tr().contiguous();
    let n = (rows * groups * 32 * 2) as usize;
    let mut bytes = vec![0u8; n];
    m.f_copy_data_u8(&mut bytes, m.numel())?;
    Ok(bytes)
}

/// The JSON file `path`.
fn read_json(path: &Path) -> Result<serde_json::Value, HfError> {
    let bad = |msg: String| HfError::Read {
        path: path.to_path_buf(),
        msg,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
    serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))
}

/// Writes `v` to `path` as `transformers` writes its JSON: indented.
fn write_json(path: &Path, v: &serde_json::Value) -> Result<(), HfError> {
    let text = serde_json::to_string_pretty(v).map_err(|e| HfError::Setting(e.to_string()))?;
    std::fs::write(path, text + "\n").map_err(|e| HfError::Read {
        path: path.to_path_buf(),
        msg: format!("cannot write it: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch checkpoint: `config` as its `config.json`, `tensors` in
    /// its `model.safetensors`.
    fn checkpoint(name: &str, config: &str, tensors: &[(&str, Tensor)]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("zrt-mxfp4-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), config).unwrap();
        Tensor::write_safetensors(tensors, dir.join("model.safetensors")).unwrap();
        dir
    }

    const MXFP4: &str =
        r#"{"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}"#;

    #[test]
    fn what_is_not_an_mxfp4_checkpoint_is_refused_naming_why() {
        let u8s = |shape: &[i64]| Tensor::zeros(shape, (Kind::Uint8, tch::Device::Cpu));
        let refused = |name: &str, config: &str, tensors: &[(&str, Tensor)]| {
            let dir = checkpoint(name, config, tensors);
            let err = dequantize(&dir, &dir.join("out")).unwrap_err().to_string();
            std::fs::remove_dir_all(&dir).unwrap();
            err
        };
        let plain = refused("plain", r#"{"model_type": "gpt_oss"}"#, &[]);
        assert!(
            plain.contains("no quantization_config: the checkpoint is not quantized"),
            "{plain}"
        );
        let other = refused(
            "other",
            r#"{"quantization_config": {"quant_method": "fp8"}}"#,
            &[],
        );
        assert!(
            other.contains(r#"quant_method "fp8": zrt dequantizes mxfp4 only"#),
            "{other}"
        );
        let alone = refused(
            "alone",
            MXFP4,
            &[("e.down_proj_blocks", u8s(&[2, 4, 1, 16]))],
        );
        assert!(
            alone.contains("`e.down_proj_blocks` has no `e.down_proj_scales` beside it"),
            "{alone}"
        );
        let scales = refused("scales", MXFP4, &[("e.down_proj_scales", u8s(&[2, 4, 1]))]);
        assert!(
            scales.contains("`e.down_proj_scales` has no `e.down_proj_blocks`"),
            "{scales}"
        );
        let shapes = refused(
            "shapes",
            MXFP4,
            &[
                ("e.down_proj_blocks", u8s(&[2, 4, 1, 16])),
                ("e.down_proj_scales", u8s(&[2, 4, 2])),
            ],
        );
        assert!(
            shapes.contains(
                "`e.down_proj_blocks` is U8 [2, 4, 1, 16] and `e.down_proj_scales` U8 [2, 4, 2]"
            ),
            "{shapes}"
        );
        // Nothing is written over the quantized files.
        let dir = checkpoint("same", MXFP4, &[]);
        let err = dequantize(&dir, &dir).unwrap_err().to_string();
        assert!(err.contains("would overwrite the quantized one"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn each_code_and_scale_is_the_value_it_stands_for() {
        // One row of one block: the codes 0..16 twice over (low nibble
        // first), scale 2^1; a second row at 2^-2.
        let mut blocks: Vec<u8> = (0..16u8).map(|c| c | (((c + 1) % 16) << 4)).collect();
        blocks.extend(blocks.clone());
        let bytes = expert(&blocks, &[128, 125], 2, 1).unwrap();
        let m = Tensor::from_data_size(&bytes, &[32, 2], Kind::BFloat16).to_kind(Kind::Float);
        for (row, scale) in [(0, 2.0), (1, 0.25)] {
            for i in 0..32 {
                let code = match i % 2 {
                    0 => i / 2,
                    _ => (i / 2 + 1) % 16,
                };
                let want = FP4_VALUES[code as usize] as f64 * scale;
                assert_eq!(m.double_value(&[i, row]), want, "row {row}, value {i}");
            }
        }
    }
}
