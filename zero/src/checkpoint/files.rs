//! Files of a checkpoint: safetensors with a CRC-32 in the header, JSON with
//! a CRC-32 field, all written atomically (temporary name, fsync, rename).

use std::collections::HashMap;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors};

use super::export_layout::OutNames;
use super::sharded_out::ModelWriter;
use super::CheckpointError;

#[cfg(target_endian = "big")]
compile_error!(
    "checkpoints store little-endian data (safetensors); big-endian hosts are not supported"
);

/// The header key of a safetensors file's CRC-32.
const CRC_KEY: &str = "zrt_crc32";

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

/// A tensor a [`TensorWriter`] will write: its name, dtype and shape.
#[derive(Debug, Clone)]
pub(crate) struct Planned {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl Planned {
    /// A tensor of `dtype` in `shape` (libtorch's `i64` dimensions).
    pub(crate) fn new(name: &str, dtype: Dtype, shape: &[i64]) -> Self {
        Self {
            name: name.to_string(),
            dtype,
            shape: shape.iter().map(|&d| d.max(0) as usize).collect(),
        }
    }

    /// Its length in bytes (`None` past `usize`).
    pub(crate) fn bytes(&self) -> Option<usize> {
        self.shape
            .iter()
            .try_fold(self.dtype.size(), |n, &d| n.checked_mul(d))
    }
}

/// A safetensors file written one tensor at a time, so that its writer
/// never holds more than the tensor in hand (one unit's gathered values
/// instead of a whole model). The header — names, dtypes, shapes and
/// offsets, all known before any value — goes first; the CRC-32 it holds
/// is patched in once the last tensor is written. The file appears under
/// its name only from [`TensorWriter::finish`] (temporary name, fsync,
/// rename); dropped unfinished, it leaves nothing.
pub(crate) struct TensorWriter {
    path: PathBuf,
    tmp: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
    /// Name and byte length of every tensor, in file order.
    plan: Vec<(String, usize)>,
    next: usize,
    /// Each written tensor's CRC state (its name's bytes, then its data):
    /// combined in name order at the end, they give the same checksum
    /// [`crc_of`] computes over the whole file, whatever the file order.
    crcs: Vec<(String, crc32fast::Hasher)>,
    /// Where the CRC's eight hex digits sit in the file.
    crc_at: u64,
    finished: bool,
}

/// What the header holds as the CRC until the data is written.
const CRC_PLACEHOLDER: &str = "00000000";

impl TensorWriter {
    /// Starts `path` (under a temporary name) with the header of `plan`,
    /// in that order, and `meta` (plus the CRC) as its metadata.
    pub(crate) fn create(
        path: &Path,
        plan: &[Planned],
        meta: HashMap<String, String>,
    ) -> Result<Self, CheckpointError> {
        // The CRC first, so its place does not depend on the other keys.
        let head = format!("{{\"__metadata__\":{{\"{CRC_KEY}\":\"");
        let mut header = format!("{head}{CRC_PLACEHOLDER}\"");
        let mut keys: Vec<_> = meta.iter().filter(|(k, _)| *k != CRC_KEY).collect();
        keys.sort();
        for (k, v) in keys {
            header.push_str(&format!(",{}:{}", to_json(path, k)?, to_json(path, v)?));
        }
        header.push('}');
        let mut seen = std::collections::HashSet::new();
        let mut at = 0usize;
        let mut lens = Vec::with_capacity(plan.len());
        for t in plan {
            if t.name == "__metadata__" || !seen.insert(t.name.as_str()) {
                return Err(CheckpointError::format(
                    path,
                    format!("tensor name `{}` twice or reserved", t.name),
                ));
            }
            let n = t.bytes().ok_or_else(|| {
                CheckpointError::format(path, format!("tensor `{}` is too large", t.name))
            })?;
            header.push_str(&format!(
                ",{}:{{\"dtype\":{},\"shape\":{},\"data_offsets\":[{at},{}]}}",
                to_json(path, &t.name)?,
                to_json(path, &t.dtype)?,
                to_json(path, &t.shape)?,
                at + n
            ));
            lens.push((t.name.clone(), n));
            at += n;
        }
        header.push('}');
        // safetensors pads its header with spaces to 8 bytes, so the data
        // that follows is aligned.
        while header.len() % 8 != 0 {
            header.push(' ');
        }
        let tmp = tmp_name(path);
        let file =
            std::fs::File::create(&tmp).map_err(|e| CheckpointError::io("create", &tmp, e))?;
        let mut w = Self {
            path: path.to_path_buf(),
            tmp,
            file: std::io::BufWriter::with_capacity(1 << 20, file),
            plan: lens,
            next: 0,
            crcs: Vec::with_capacity(plan.len()),
            crc_at: (8 + head.len()) as u64,
            finished: false,
        };
        let mut start = (header.len() as u64).to_le_bytes().to_vec();
        start.extend_from_slice(header.as_bytes());
        w.put(&start)?;
        Ok(w)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), CheckpointError> {
        self.file
            .write_all(bytes)
            .map_err(|e| CheckpointError::io("write", &self.path, e))
    }

    /// Writes tensor `name`, which must be the next one of the plan, whole.
    pub(crate) fn write(&mut self, name: &str, data: &[u8]) -> Result<(), CheckpointError> {
        match self.plan.get(self.next) {
            Some((n, len)) if n == name && *len == data.len() => {}
            planned => {
                return Err(CheckpointError::format(
                    &self.path,
                    format!(
                        "tensor `{name}` ({} bytes) written where the header planned {planned:?}",
                        data.len()
                    ),
                ))
            }
        }
        self.next += 1;
        let mut h = crc32fast::Hasher::new();
        h.update(name.as_bytes());
        h.update(data);
        self.crcs.push((name.to_string(), h));
        self.put(data)
    }

    /// Checks every planned tensor was written, puts the CRC in the header
    /// and makes the file durable under its name.
    pub(crate) fn finish(mut self) -> Result<(), CheckpointError> {
        if let Some((name, _)) = self.plan.get(self.next) {
            return Err(CheckpointError::format(
                &self.path,
                format!("tensor `{name}` was planned but never written"),
            ));
        }
        let mut crcs = std::mem::take(&mut self.crcs);
        crcs.sort_by(|a, b| a.0.cmp(&b.0));
        let mut crc = crc32fast::Hasher::new();
        for (_, h) in &crcs {
            crc.combine(h);
        }
        let digits = format!("{:08x}", crc.finalize());
        let patched = self
            .file
            .flush()
            .and_then(|()| {
                use std::io::{Seek, SeekFrom};
                let f = self.file.get_mut();
                f.seek(SeekFrom::Start(self.crc_at))?;
                f.write_all(digits.as_bytes())
            })
            .map_err(|e| CheckpointError::io("write", &self.path, e));
        patched.and_then(|()| commit(&self.tmp, &self.path))?;
        self.finished = true;
        Ok(())
    }
}

impl Drop for TensorWriter {
    fn drop(&mut self) {
        if !self.finished {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Where a rank streams a file only one rank writes, while every rank
/// takes part in the gathers that feed it: the writer (the writing rank),
/// nothing (the others), or the writer's first error, kept so the writing
/// rank goes on through the collectives its peers are in and reports the
/// error after them instead of leaving them waiting.
pub(crate) enum Sink {
    /// This rank does not write.
    Skip,
    /// This rank writes, each tensor under its name in the file and in
    /// its layout there (an [`ExportLayout`](super::ExportLayout)'s) when
    /// given.
    Writing(ModelWriter, Option<OutNames>),
    /// This rank was writing and failed.
    Failed(CheckpointError),
}

impl Sink {
    /// A writer of `plan` to `path` when `write`, else [`Sink::Skip`]:
    /// one file, or with a largest file's bytes a directory of them
    /// ([`ModelWriter::create`]).
    pub(crate) fn open(
        write: bool,
        (path, max_shard_bytes): (&Path, Option<u64>),
        plan: &[Planned],
        meta: HashMap<String, String>,
    ) -> Self {
        match write {
            false => Self::Skip,
            true => match ModelWriter::create(path, max_shard_bytes, plan, meta) {
                Ok(w) => Self::Writing(w, None),
                Err(e) => Self::Failed(e),
            },
        }
    }

    /// Writes each tensor as `names` says (opened with the plan `names`
    /// came with).
    pub(crate) fn named(self, names: OutNames) -> Self {
        match self {
            Self::Writing(w, _) => Self::Writing(w, Some(names)),
            other => other,
        }
    }

    /// Whether it takes values (so that the others need not encode them).
    pub(crate) fn wants(&self) -> bool {
        matches!(self, Self::Writing(..))
    }

    /// Writes the next tensor (`name` the model's), or keeps the error.
    pub(crate) fn write(&mut self, name: &str, data: &[u8]) {
        if let Self::Writing(w, names) = self {
            let written = match names {
                None => w.write(name, data),
                Some(n) => n.write(w, name, data),
            };
            if let Err(e) = written {
                *self = Self::Failed(e);
            }
        }
    }

    /// Fails with `e` unless it already failed (the first error is kept).
    pub(crate) fn fail(&mut self, e: CheckpointError) {
        if !matches!(self, Self::Failed(_)) {
            *self = Self::Failed(e);
        }
    }

    /// Finishes the file; the first error if any.
    pub(crate) fn finish(self) -> Result<(), CheckpointError> {
        match self {
            Self::Skip => Ok(()),
            Self::Writing(w, _) => w.finish(),
            Self::Failed(e) => Err(e),
        }
    }
}

/// `v` as JSON text, for a header being written to `path`.
fn to_json<T: serde::Serialize + ?Sized>(path: &Path, v: &T) -> Result<String, CheckpointError> {
    serde_json::to_string(v).map_err(|e| CheckpointError::format(path, e.to_string()))
}

fn read(path: &Path) -> Result<Vec<u8>, CheckpointError> {
    std::fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => CheckpointError::Missing {
            path: path.to_path_buf(),
        },
        _ => CheckpointError::io("read", path, e),
    })
}

/// `path` mapped read-only.
fn map(path: &Path) -> Result<memmap2::Mmap, CheckpointError> {
    let f = std::fs::File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => CheckpointError::Missing {
            path: path.to_path_buf(),
        },
        _ => CheckpointError::io("open", path, e),
    })?;
    // SAFETY: checkpoint files are written under a temporary name and
    // renamed into place, never changed after, so the mapping's bytes do
    // not move under it. (A file truncated in place by another program
    // while mapped would fault, as it would under every safetensors loader
    // that maps.)
    unsafe { memmap2::Mmap::map(&f) }.map_err(|e| CheckpointError::io("map", path, e))
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

/// What holds tensors that read widened to fp32: a checkpoint's rank
/// file, a whole-model weights file or several.
pub(crate) trait ReadWidened {
    /// Copies elements `range` of tensor `name`, an F32, BF16 or F16
    /// one, into `dst`, widened to fp32 (exactly).
    fn read_widened(
        &self,
        name: &str,
        range: Range<usize>,
        dst: &mut [f32],
    ) -> Result<(), CheckpointError>;
}

impl ReadWidened for RankFile {
    fn read_widened(
        &self,
        name: &str,
        range: Range<usize>,
        dst: &mut [f32],
    ) -> Result<(), CheckpointError> {
        let (dtype, b) = self.bytes(name)?;
        let mut widen = |f: fn(u16) -> f32| -> Result<(), CheckpointError> {
            if range.start > range.end || range.end * 2 > b.len() || dst.len() != range.len() {
                return Err(CheckpointError::format(
                    &self.path,
                    format!(
                        "tensor `{name}` does not cover {range:?} into {}",
                        dst.len()
                    ),
                ));
            }
            let src = &b[range.start * 2..range.end * 2];
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f(u16::from_le_bytes([c[0], c[1]]));
            }
            self.forget(src);
            Ok(())
        };
        match dtype {
            Dtype::BF16 => widen(|h| half::bf16::from_bits(h).to_f32()),
            Dtype::F16 => widen(|h| half::f16::from_bits(h).to_f32()),
            _ => self.read_f32(name, range.clone(), dst),
        }
    }
}

/// One rank's safetensors file, mapped and verified against its CRC-32.
///
/// Mapped rather than read: a rank takes only its part of a file (its
/// shard of each frozen parameter, its range of a re-cut checkpoint), and
/// the pages it maps are the page cache's, which the kernel can drop,
/// instead of a copy of the whole file in the rank's own memory. The
/// widening reads ([`ReadWidened`], what weights files load through)
/// drop the pages they copied out of the rank's resident set
/// ([`RankFile::forget`]).
pub(crate) struct RankFile {
    path: PathBuf,
    bytes: memmap2::Mmap,
    /// name -> (dtype, byte range in `bytes`, shape)
    tensors: HashMap<String, (Dtype, Range<usize>, Vec<usize>)>,
    meta: HashMap<String, String>,
    /// Where the data starts: 8 bytes of length, then the header.
    data_start: usize,
}

impl RankFile {
    /// Maps and verifies `path`.
    pub(crate) fn open(path: &Path) -> Result<Self, CheckpointError> {
        let f = Self::parse(path, map(path)?)?;
        match f.meta.contains_key(CRC_KEY) {
            true => f.verified(),
            false => Err(CheckpointError::format(path, "no zrt_crc32 in its header")),
        }
    }

    /// Maps a whole-model weights file: any safetensors file (zrt's
    /// exports, tch's `VarStore::save`, Hugging Face's), verified against
    /// its CRC-32 when zrt wrote one into it. The errors are
    /// [`CheckpointError::Weights`].
    pub(crate) fn open_weights(path: &Path) -> Result<Self, CheckpointError> {
        let weights = |msg: String| CheckpointError::Weights {
            path: path.to_path_buf(),
            msg,
        };
        let bytes = map(path).map_err(|e| match e {
            CheckpointError::Missing { .. } => weights("no such file".into()),
            e => weights(e.to_string()),
        })?;
        let f = Self::parse(path, bytes).map_err(|e| weights(e.to_string()))?;
        match f.meta.contains_key(CRC_KEY) {
            true => f.verified_by_reading(),
            false => Ok(f),
        }
    }

    /// [`RankFile::verified`], the data read through a small buffer
    /// instead of the mapping: every rank checks a whole-model file of
    /// which it keeps a part, and pages touched through a mapping count
    /// in the rank's resident set (and its peak) for as long as it is
    /// mapped, as if each rank held the model.
    fn verified_by_reading(self) -> Result<Self, CheckpointError> {
        use std::io::{Read, Seek, SeekFrom};
        let mut order: Vec<(&str, &Range<usize>)> = (self.tensors.iter())
            .map(|(k, (_, r, _))| (k.as_str(), r))
            .collect();
        order.sort_by(|a, b| a.0.cmp(b.0));
        let io = |e| CheckpointError::io("read", &self.path, e);
        let mut f = std::fs::File::open(&self.path).map_err(io)?;
        let mut h = crc32fast::Hasher::new();
        let mut buf = vec![0u8; 1 << 20];
        for (name, r) in order {
            h.update(name.as_bytes());
            f.seek(SeekFrom::Start(r.start as u64)).map_err(io)?;
            let mut left = r.len();
            while left > 0 {
                let n = left.min(buf.len());
                f.read_exact(&mut buf[..n]).map_err(io)?;
                h.update(&buf[..n]);
                left -= n;
            }
        }
        self.if_crc_is(h.finalize())
    }

    /// `bytes` (`path`'s) read as safetensors: its header, unverified.
    fn parse(path: &Path, bytes: memmap2::Mmap) -> Result<Self, CheckpointError> {
        let (n, header) = SafeTensors::read_metadata(&bytes).map_err(|e| {
            CheckpointError::format(
                path,
                format!("bad header ({e:?}); the file is truncated or not safetensors"),
            )
        })?;
        let start = 8 + n;
        let meta = header.metadata().clone().unwrap_or_default();
        let tensors: HashMap<String, (Dtype, Range<usize>, Vec<usize>)> = header
            .tensors()
            .into_iter()
            .map(|(k, info)| {
                let (a, b) = info.data_offsets;
                (k, (info.dtype, start + a..start + b, info.shape.clone()))
            })
            .collect();
        // The header's offsets are checked against the file's length.
        if tensors.values().any(|(_, r, _)| r.end > bytes.len()) {
            return Err(CheckpointError::format(
                path,
                "its header places tensors past its end: the file is truncated",
            ));
        }
        Ok(Self {
            path: path.to_path_buf(),
            bytes,
            tensors,
            meta,
            data_start: start,
        })
    }

    /// Self, if `found` (a CRC-32 of its tensors as [`crc_of`] takes
    /// them) is the one its header records.
    fn if_crc_is(self, found: u32) -> Result<Self, CheckpointError> {
        let expected = (self.meta.get(CRC_KEY))
            .and_then(|s| u32::from_str_radix(s, 16).ok())
            .ok_or_else(|| CheckpointError::format(&self.path, "bad zrt_crc32 in its header"))?;
        match found == expected {
            true => Ok(self),
            false => Err(CheckpointError::Checksum {
                path: self.path,
                expected,
                found,
            }),
        }
    }

    /// Self, once its tensors' CRC-32 is the one its header records.
    fn verified(self) -> Result<Self, CheckpointError> {
        let found = crc_of(
            (self.tensors.iter())
                .map(|(k, (_, r, _))| (k.as_str(), &self.bytes[r.clone()]))
                .collect(),
        );
        self.if_crc_is(found)
    }

    /// Tensor `name`'s dtype, shape and length in bytes, if it has one.
    pub(crate) fn tensor(&self, name: &str) -> Option<(Dtype, &[usize], usize)> {
        (self.tensors.get(name)).map(|(d, r, s)| (*d, s.as_slice(), r.len()))
    }

    /// Every tensor's name, dtype, shape and length in bytes.
    pub(crate) fn tensors(&self) -> impl Iterator<Item = (&str, Dtype, &[usize], usize)> {
        (self.tensors.iter()).map(|(k, (d, r, s))| (k.as_str(), *d, s.as_slice(), r.len()))
    }

    /// A CRC-32 of the file's header (names, dtypes, shapes, offsets,
    /// metadata, zrt's checksum of the data) and of the first and last 64
    /// KiB of its data, and the file's length: what tells two ranks' files
    /// apart without reading all their data (two files of one model
    /// written without zrt's checksum have the same header).
    pub(crate) fn identity(&self) -> (u32, usize) {
        const SAMPLE: usize = 64 << 10;
        let len = self.bytes.len();
        let head = &self.bytes[..(self.data_start + SAMPLE).min(len)];
        let tail = &self.bytes[len.saturating_sub(SAMPLE).max(self.data_start)..];
        let mut h = crc32fast::Hasher::new();
        h.update(head);
        h.update(tail);
        (h.finalize(), len)
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
        let (dtype, r, _) = self
            .tensors
            .get(name)
            .ok_or_else(|| CheckpointError::format(&self.path, format!("no tensor `{name}`")))?;
        Ok((*dtype, &self.bytes[r.clone()]))
    }

    /// The bytes of elements `range` of the f32 tensor `name`, checked to
    /// be there.
    pub(crate) fn f32s(&self, name: &str, range: Range<usize>) -> Result<&[u8], CheckpointError> {
        let (dtype, b) = self.bytes(name)?;
        if dtype != Dtype::F32 || range.start > range.end || range.end * 4 > b.len() {
            return Err(CheckpointError::format(
                &self.path,
                format!("tensor `{name}` is not an f32 tensor covering {range:?}"),
            ));
        }
        Ok(&b[range.start * 4..range.end * 4])
    }

    /// Copies elements `range` of the f32 tensor `name` into `dst`.
    pub(crate) fn read_f32(
        &self,
        name: &str,
        range: Range<usize>,
        dst: &mut [f32],
    ) -> Result<(), CheckpointError> {
        if dst.len() != range.len() {
            return Err(CheckpointError::format(
                &self.path,
                format!(
                    "{} elements of `{name}` asked into {}",
                    range.len(),
                    dst.len()
                ),
            ));
        }
        let src = self.f32s(name, range)?;
        for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
            *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        self.forget(src);
        Ok(())
    }

    /// Drops the pages of `part` (bytes of this file's mapping, copied out
    /// and not needed again) from this process's resident set. Pages read
    /// through a mapping count in the resident set, and in its peak, for
    /// as long as the file is mapped: a rank loading its half of a
    /// whole-model file showed that half on top of what it keeps (177 MiB
    /// of a 763 MiB build peak for a 124.7M-parameter model on 2 ranks).
    /// The pages stay in the page cache; the mapping reads them again if
    /// asked. Advice only: a refusal changes nothing and is not an error.
    pub(crate) fn forget(&self, part: &[u8]) {
        let base = self.bytes.as_ptr() as usize;
        let Some(offset) = (part.as_ptr() as usize).checked_sub(base) else {
            return;
        };
        if part.is_empty() || offset + part.len() > self.bytes.len() {
            return;
        }
        // SAFETY: a read-only shared mapping of a file that is never
        // changed in place (see `map`): dropping its pages keeps every
        // byte, which the next read faults in from the file again; no
        // reference into the mapping is invalidated.
        let done = unsafe {
            self.bytes.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                offset,
                part.len(),
            )
        };
        if let Err(e) = done {
            tracing::debug!("madvise(DONTNEED) on {}: {e}", self.path.display());
        }
    }

    /// Elements of the f32 tensor `name`.
    pub(crate) fn f32_len(&self, name: &str) -> Result<usize, CheckpointError> {
        Ok(self.bytes(name)?.1.len() / 4)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Vec<Planned> {
        // Not in name order, with an empty tensor and an odd length, so the
        // data starts unaligned after the first and the CRC is combined
        // out of file order.
        vec![
            Planned::new("z", Dtype::F32, &[2, 3]),
            Planned::new("a\"quoted", Dtype::U8, &[3]),
            Planned::new("empty", Dtype::BF16, &[0, 4]),
            Planned::new("m", Dtype::I64, &[1]),
        ]
    }

    fn write_all(w: &mut TensorWriter) {
        let z: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
        w.write("z", f32_bytes(&z)).unwrap();
        w.write("a\"quoted", &[7, 8, 9]).unwrap();
        w.write("empty", &[]).unwrap();
        w.write("m", &(-5i64).to_le_bytes()).unwrap();
    }

    #[test]
    fn streamed_file_is_safetensors_with_the_crc_of_its_tensors() {
        let dir = std::env::temp_dir().join(format!("zrt-writer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        let meta = HashMap::from([("rank".to_string(), "3".to_string())]);
        let mut w = TensorWriter::create(&path, &plan(), meta).unwrap();
        write_all(&mut w);
        // Nothing under the final name until it is finished.
        assert!(!path.exists());
        w.finish().unwrap();

        let bytes = std::fs::read(&path).unwrap();
        // safetensors itself parses it, offsets and all.
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let z = st.tensor("z").unwrap();
        assert_eq!((z.dtype(), z.shape()), (Dtype::F32, &[2usize, 3][..]));
        assert_eq!(&z.data()[4..8], &0.5f32.to_le_bytes());
        assert_eq!(st.tensor("a\"quoted").unwrap().data(), &[7, 8, 9]);
        assert_eq!(st.tensor("empty").unwrap().shape(), &[0, 4]);
        assert_eq!(st.tensor("m").unwrap().data(), &(-5i64).to_le_bytes());
        // The header is padded so the data starts 8-aligned.
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0);
        // The CRC is the one the whole-file reader computes (and checks).
        let f = RankFile::open(&path).unwrap();
        assert_eq!(f.meta("rank").unwrap(), "3");
        let expected = crc_of(vec![
            ("z", &bytes[8 + n..8 + n + 24]),
            ("a\"quoted", &[7, 8, 9]),
            ("empty", &[]),
            ("m", &bytes[8 + n + 27..8 + n + 35]),
        ]);
        assert_eq!(f.meta(CRC_KEY).unwrap(), format!("{expected:08x}"));
        // A flipped data byte fails the check.
        let mut bad = bytes.clone();
        bad[8 + n + 25] ^= 1;
        std::fs::write(&path, &bad).unwrap();
        assert!(matches!(
            RankFile::open(&path),
            Err(CheckpointError::Checksum { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Resident KiB of the mapping holding `addr`, from /proc/self/smaps
    /// (this mapping's own count: other threads' memory does not move it).
    fn mapped_kib(addr: usize) -> Option<u64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().and_then(|r| {
                let (a, b) = r.split_once('-')?;
                Some((
                    usize::from_str_radix(a, 16).ok()?,
                    usize::from_str_radix(b, 16).ok()?,
                ))
            });
            match range {
                Some((a, b)) if line.contains(' ') && !line.starts_with("Rss") => {
                    inside = (a..b).contains(&addr);
                }
                _ if inside && line.starts_with("Rss:") => {
                    return line.split_whitespace().nth(1)?.parse().ok();
                }
                _ => {}
            }
        }
        None
    }

    #[test]
    fn pages_read_through_the_mapping_leave_the_resident_set() {
        let dir = std::env::temp_dir().join(format!("zrt-forget-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.safetensors");
        // 8 MiB of f32 and 4 MiB of bf16.
        let n = 2usize << 20;
        let plan = vec![
            Planned::new("f", Dtype::F32, &[n as i64]),
            Planned::new("h", Dtype::BF16, &[n as i64]),
        ];
        let mut w = TensorWriter::create(&path, &plan, HashMap::new()).unwrap();
        let f: Vec<f32> = (0..n).map(|i| i as f32).collect();
        w.write("f", f32_bytes(&f)).unwrap();
        w.write("h", &vec![0x3f; 2 * n]).unwrap();
        w.finish().unwrap();
        let file = RankFile::open_weights(&path).unwrap();
        let at = file.bytes.as_ptr() as usize;
        let mut dst = vec![0f32; n];
        file.read_widened("f", 0..n, &mut dst).unwrap();
        assert_eq!(dst[n - 1], (n - 1) as f32);
        file.read_widened("h", 0..n, &mut dst).unwrap();
        assert_eq!(dst[0], half::bf16::from_bits(0x3f3f).to_f32());
        // Read, copied out, and gone from this process's memory (but for
        // the header's page and the pages at the ends of the ranges): not
        // the 12 MiB read.
        let kib = mapped_kib(at).expect("the mapping is in /proc/self/smaps");
        assert!(kib <= 64, "{kib} KiB of the file still resident");
        // Read again: the same values, from the page cache.
        file.read_widened("f", 0..n, &mut dst).unwrap();
        assert_eq!(dst[n - 1], (n - 1) as f32);
        drop(file);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn writes_off_the_plan_are_refused_and_leave_no_file() {
        let dir = std::env::temp_dir().join(format!("zrt-writer-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        let mut w = TensorWriter::create(&path, &plan(), HashMap::new()).unwrap();
        let e = w.write("a\"quoted", &[1, 2, 3]).unwrap_err().to_string();
        assert!(
            e.contains(
                "tensor `a\"quoted` (3 bytes) written where the header planned Some((\"z\", 24))"
            ),
            "{e}"
        );
        let e = w.write("z", &[0; 20]).unwrap_err().to_string();
        assert!(e.contains("(20 bytes)"), "{e}");
        w.write("z", &[0; 24]).unwrap();
        let e = w.finish().unwrap_err().to_string();
        assert!(
            e.contains("tensor `a\"quoted` was planned but never written"),
            "{e}"
        );
        // Neither the file nor its temporary is left behind.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        let mut twice = plan();
        twice.push(Planned::new("z", Dtype::U8, &[1]));
        let e = TensorWriter::create(&path, &twice, HashMap::new())
            .err()
            .unwrap();
        assert!(e.to_string().contains("tensor name `z` twice"), "{e}");
        // A sink keeps the first error and finishes with it.
        let mut sink = Sink::open(true, (&path, None), &plan(), HashMap::new());
        assert!(sink.wants());
        sink.write("m", &[0; 8]);
        assert!(!sink.wants());
        sink.write("z", &[0; 24]);
        let e = sink.finish().unwrap_err().to_string();
        assert!(e.contains("tensor `m` (8 bytes)"), "{e}");
        assert!(Sink::open(false, (&path, None), &plan(), HashMap::new())
            .finish()
            .is_ok());
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
