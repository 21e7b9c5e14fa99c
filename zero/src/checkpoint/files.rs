//! Files of a checkpoint: safetensors with a CRC-32 in the header, JSON with
//! a CRC-32 field, all written atomically (temporary name, fsync, rename).

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors, View};

use super::CheckpointError;

#[cfg(target_endian = "big")]
compile_error!(
    "checkpoints store little-endian data (safetensors); big-endian hosts are not supported"
);

/// The header key of a safetensors file's CRC-32.
const CRC_KEY: &str = "zrt_crc32";

/// One tensor to write: little-endian bytes of `dtype` in `shape`.
pub(crate) struct Entry<'a> {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: &'a [u8],
}

impl View for &Entry<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// The bytes of an f32 slice (little-endian hosts only, checked above).
pub(crate) fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// The checksum of a set of tensors: names and data in name order, so it
/// does not depend on where the writer placed them in the file.
fn crc_of<'a>(mut parts: Vec<(&'a str, &'a [u8])>) -> u32 {
    parts.sort_by(|a, b| a.0.cmp(b.0));
    let mut h = crc32fast::Hasher::new();
    for (name, data) in parts {
        h.update(name.as_bytes());
        h.update(data);
    }
    h.finalize()
}

fn tmp_name(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

/// Makes `tmp` durable and gives it its final name.
fn commit(tmp: &Path, path: &Path) -> Result<(), CheckpointError> {
    let f = std::fs::File::open(tmp).map_err(|e| CheckpointError::io("open", tmp, e))?;
    f.sync_all()
        .map_err(|e| CheckpointError::io("fsync", tmp, e))?;
    std::fs::rename(tmp, path).map_err(|e| CheckpointError::io("rename", path, e))?;
    if let Some(dir) = path.parent() {
        sync_dir(dir)?;
    }
    Ok(())
}

/// fsyncs a directory, so renames in it survive a crash.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    let d = std::fs::File::open(dir).map_err(|e| CheckpointError::io("open", dir, e))?;
    d.sync_all()
        .map_err(|e| CheckpointError::io("fsync", dir, e))
}

/// Writes `bytes` to `path` atomically: a reader sees the old file or the
/// whole new one, never a torn one.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let tmp = tmp_name(path);
    let res = std::fs::File::create(&tmp)
        .and_then(|mut f| f.write_all(bytes))
        .map_err(|e| CheckpointError::io("write", path, e))
        .and_then(|()| commit(&tmp, path));
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// Writes `entries` as a safetensors file with `meta` and a CRC-32 in its
/// header, atomically.
pub(crate) fn write_safetensors(
    path: &Path,
    entries: &[Entry<'_>],
    mut meta: HashMap<String, String>,
) -> Result<(), CheckpointError> {
    let crc = crc_of(entries.iter().map(|e| (e.name.as_str(), e.data)).collect());
    meta.insert(CRC_KEY.into(), format!("{crc:08x}"));
    let tmp = tmp_name(path);
    let res = safetensors::tensor::serialize_to_file(
        entries.iter().map(|e| (e.name.as_str(), e)),
        &Some(meta),
        &tmp,
    )
    .map_err(|e| match e {
        SafeTensorError::IoError(io) => CheckpointError::io("write", path, io),
        other => CheckpointError::format(path, format!("{other:?}")),
    })
    .and_then(|()| commit(&tmp, path));
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

fn read(path: &Path) -> Result<Vec<u8>, CheckpointError> {
    std::fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => CheckpointError::Missing {
            path: path.to_path_buf(),
        },
        _ => CheckpointError::io("read", path, e),
    })
}

/// How a checksummed JSON file starts: `{"crc32":"XXXXXXXX","body":...}`.
const JSON_HEAD: &str = "{\"crc32\":\"";

/// The bytes of a checksummed JSON file holding `body` (itself JSON).
pub(crate) fn json_with_crc(body: &str) -> String {
    let crc = crc32fast::hash(body.as_bytes());
    // The body is spliced verbatim, so the reader can hash exactly its bytes.
    format!("{JSON_HEAD}{crc:08x}\",\"body\":{body}}}\n")
}

/// Reads a file written from [`json_with_crc`], checks its CRC-32 and
/// returns the body's text.
pub(crate) fn read_json(path: &Path) -> Result<String, CheckpointError> {
    let bytes = read(path)?;
    let text = String::from_utf8(bytes).map_err(|_| CheckpointError::format(path, "not UTF-8"))?;
    let head = "{\"crc32\":\"00000000\",\"body\":".len();
    let text = text.trim_end();
    if !text.starts_with(JSON_HEAD) || text.len() < head + 1 || !text.ends_with('}') {
        return Err(CheckpointError::format(
            path,
            "not a zrt checksummed JSON file",
        ));
    }
    let expected = u32::from_str_radix(&text[JSON_HEAD.len()..JSON_HEAD.len() + 8], 16)
        .map_err(|_| CheckpointError::format(path, "bad crc32 field"))?;
    let body = &text[head..text.len() - 1];
    let found = crc32fast::hash(body.as_bytes());
    if found != expected {
        return Err(CheckpointError::Checksum {
            path: path.to_path_buf(),
            expected,
            found,
        });
    }
    Ok(body.to_string())
}

/// One rank's safetensors file, read whole and verified against its CRC-32.
pub(crate) struct RankFile {
    path: PathBuf,
    bytes: Vec<u8>,
    /// name -> (dtype, byte range in `bytes`)
    tensors: HashMap<String, (Dtype, Range<usize>)>,
    meta: HashMap<String, String>,
}

impl RankFile {
    /// Reads and verifies `path`.
    pub(crate) fn open(path: &Path) -> Result<Self, CheckpointError> {
        let bytes = read(path)?;
        let (n, header) = SafeTensors::read_metadata(&bytes).map_err(|e| {
            CheckpointError::format(
                path,
                format!("bad header ({e:?}); the file is truncated or not safetensors"),
            )
        })?;
        let start = 8 + n;
        let meta = header.metadata().clone().unwrap_or_default();
        let tensors: HashMap<String, (Dtype, Range<usize>)> = header
            .tensors()
            .into_iter()
            .map(|(k, info)| {
                let (a, b) = info.data_offsets;
                (k, (info.dtype, start + a..start + b))
            })
            .collect();
        let expected = meta
            .get(CRC_KEY)
            .and_then(|s| u32::from_str_radix(s, 16).ok())
            .ok_or_else(|| CheckpointError::format(path, "no zrt_crc32 in its header"))?;
        let found = crc_of(
            tensors
                .iter()
                .map(|(k, (_, r))| (k.as_str(), &bytes[r.clone()]))
                .collect(),
        );
        if found != expected {
            return Err(CheckpointError::Checksum {
                path: path.to_path_buf(),
                expected,
                found,
            });
        }
        Ok(Self {
            path: path.to_path_buf(),
            bytes,
            tensors,
            meta,
        })
    }

    /// The header metadata (string map).
    pub(crate) fn meta(&self, key: &str) -> Result<&str, CheckpointError> {
        self.meta
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| CheckpointError::format(&self.path, format!("no `{key}` in its header")))
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The raw bytes of tensor `name` and its dtype.
    pub(crate) fn bytes(&self, name: &str) -> Result<(Dtype, &[u8]), CheckpointError> {
        let (dtype, r) = self
            .tensors
            .get(name)
            .ok_or_else(|| CheckpointError::format(&self.path, format!("no tensor `{name}`")))?;
        Ok((*dtype, &self.bytes[r.clone()]))
    }

    /// Copies elements `range` of the f32 tensor `name` into `dst`.
    pub(crate) fn read_f32(
        &self,
        name: &str,
        range: Range<usize>,
        dst: &mut [f32],
    ) -> Result<(), CheckpointError> {
        let (dtype, b) = self.bytes(name)?;
        if dtype != Dtype::F32 || range.end * 4 > b.len() || dst.len() != range.len() {
            return Err(CheckpointError::format(
                &self.path,
                format!("tensor `{name}` is not an f32 tensor covering {range:?}"),
            ));
        }
        for (d, c) in dst
            .iter_mut()
            .zip(b[range.start * 4..range.end * 4].chunks_exact(4))
        {
            *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        Ok(())
    }

    /// Elements of the f32 tensor `name`.
    pub(crate) fn f32_len(&self, name: &str) -> Result<usize, CheckpointError> {
        Ok(self.bytes(name)?.1.len() / 4)
    }
}
