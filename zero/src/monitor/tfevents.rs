//! TensorBoard event files, written without TensorFlow or a protobuf
//! library: the file is a sequence of records, each
//!
//! ```text
//! u64 length (little-endian) | u32 masked CRC-32C of those 8 bytes
//! length bytes of data       | u32 masked CRC-32C of the data
//! ```
//!
//! (masked: `rotate_right(15) + 0xa282ead8`), whose data is a serialized
//! `tensorflow.Event`: `wall_time` (field 1, double), `step` (2, int64),
//! and either `file_version` (3, string; the first record says
//! `brain.Event:2`) or `summary` (5), a `Summary` whose `value`s (1) each
//! hold a `tag` (1, string) and a `simple_value` (2, float). Only those
//! fields are written, which is all TensorBoard needs for scalars.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// An open event file.
pub(crate) struct Writer {
    path: PathBuf,
    file: File,
}

impl Writer {
    /// Makes `dir` (and its parents) if needed and starts a new event file
    /// there, named as TensorFlow names them (TensorBoard reads every file
    /// whose name holds `tfevents`; the process id and a count keep two
    /// runs started in one second apart).
    pub(crate) fn open(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let now = now();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        // Engines built one after another in one process (tests) get
        // files of their own.
        static OPENED: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "events.out.tfevents.{}.{host}.{}.{}",
            now as u64,
            std::process::id(),
            OPENED.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)?;
        file.write_all(&record(&event(now, 0, Body::FileVersion("brain.Event:2"))))?;
        Ok(Self { path, file })
    }

    /// The file written.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one scalar event per `(tag, value, step)`, in one write.
    pub(crate) fn write(&mut self, events: &[(&str, f64, u64)]) -> std::io::Result<()> {
        let now = now();
        let mut out = Vec::new();
        for &(tag, value, step) in events {
            // TensorBoard's scalars are f32 (`simple_value`).
            let body = Body::Scalar(tag, value as f32);
            out.extend(record(&event(now, step as i64, body)));
        }
        self.file.write_all(&out)
    }
}

/// The scalars of the event file at `path`: `(tag, step, value)` in file
/// order. Reads what zrt's `tensorboard` monitor writes (and TensorFlow's scalar events of
/// the same form), checking both checksums of every record; an event
/// holding anything else is skipped. For tests and tools that want a
/// run's numbers back without TensorBoard.
pub fn read_scalars(path: &Path) -> std::io::Result<Vec<(String, i64, f32)>> {
    let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    let bytes = std::fs::read(path)?;
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let field = |from: usize, n: usize| {
            (bytes.get(from..from + n)).ok_or_else(|| {
                bad(format!(
                    "{}: a record ends short at byte {from}",
                    path.display()
                ))
            })
        };
        let len_bytes = field(at, 8)?;
        let crc = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if crc(field(at + 8, 4)?) != masked_crc(len_bytes) {
            return Err(bad(format!(
                "{}: the length at byte {at} fails its checksum",
                path.display()
            )));
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(len_bytes);
        let len = usize::try_from(u64::from_le_bytes(len)).map_err(|e| bad(e.to_string()))?;
        let data = field(at + 12, len)?;
        if crc(field(at + 12 + len, 4)?) != masked_crc(data) {
            return Err(bad(format!(
                "{}: the record at byte {at} fails its checksum",
                path.display()
            )));
        }
        out.extend(scalars_of(data).ok_or_else(|| {
            bad(format!(
                "{}: the record at byte {at} is not an event",
                path.display()
            ))
        })?);
        at += 16 + len;
    }
    Ok(out)
}

/// One protobuf field: its number, wire type, value (varints) and bytes
/// (the others).
type Field<'a> = (u64, u8, u64, &'a [u8]);

/// The protobuf fields of `b`, in order.
fn fields(mut b: &[u8]) -> Option<Vec<Field<'_>>> {
    fn read_varint(b: &mut &[u8]) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = b.split_first()?;
            *b = rest;
            v |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                return Some(v);
            }
        }
        None
    }
    let mut out = Vec::new();
    while !b.is_empty() {
        let key = read_varint(&mut b)?;
        let wire = (key & 7) as u8;
        let (v, data) = match wire {
            0 => (read_varint(&mut b)?, &[][..]),
            1 | 5 => {
                let n = if wire == 1 { 8 } else { 4 };
                let (d, rest) = (b.get(..n)?, b.get(n..)?);
                b = rest;
                (0, d)
            }
            2 => {
                let n = usize::try_from(read_varint(&mut b)?).ok()?;
                let (d, rest) = (b.get(..n)?, b.get(n..)?);
                b = rest;
                (0, d)
            }
            _ => return None,
        };
        out.push((key >> 3, wire, v, data));
    }
    Some(out)
}

/// The scalars of one serialized event (none for other events).
fn scalars_of(event: &[u8]) -> Option<Vec<(String, i64, f32)>> {
    let fs = fields(event)?;
    let step = fs
        .iter()
        .find(|f| f.0 == 2 && f.1 == 0)
        .map_or(0, |f| f.2 as i64);
    let mut out = Vec::new();
    for (_, _, _, summary) in fs.iter().filter(|f| f.0 == 5 && f.1 == 2) {
        for (_, _, _, value) in fields(summary)?.iter().filter(|f| f.0 == 1 && f.1 == 2) {
            let vf = fields(value)?;
            let tag = vf.iter().find(|f| f.0 == 1 && f.1 == 2);
            let simple = vf.iter().find(|f| f.0 == 2 && f.1 == 5);
            if let (Some(tag), Some(simple)) = (tag, simple) {
                let mut v = [0u8; 4];
                v.copy_from_slice(simple.3);
                let tag = String::from_utf8_lossy(tag.3).into_owned();
                out.push((tag, step, f32::from_le_bytes(v)));
            }
        }
    }
    Some(out)
}

/// Seconds since the epoch (0 should the clock be before it).
fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// What an event carries besides its time and step.
pub(crate) enum Body<'a> {
    /// The file's first event.
    FileVersion(&'a str),
    /// One scalar.
    Scalar(&'a str, f32),
}

/// A serialized `tensorflow.Event`.
pub(crate) fn event(wall_time: f64, step: i64, body: Body) -> Vec<u8> {
    let mut e = vec![0x09]; // field 1, 64-bit
    e.extend(wall_time.to_le_bytes());
    e.push(0x10); // field 2, varint
    varint(&mut e, step as u64);
    match body {
        Body::FileVersion(v) => bytes_field(&mut e, 0x1a, v.as_bytes()), // field 3
        Body::Scalar(tag, value) => {
            let mut v = Vec::new();
            bytes_field(&mut v, 0x0a, tag.as_bytes()); // Value.tag
            v.push(0x15); // Value.simple_value: field 2, 32-bit
            v.extend(value.to_le_bytes());
            let mut summary = Vec::new();
            bytes_field(&mut summary, 0x0a, &v); // Summary.value
            bytes_field(&mut e, 0x2a, &summary); // Event.summary: field 5
        }
    }
    e
}

/// A length-delimited field: its key byte, the length, the bytes.
fn bytes_field(out: &mut Vec<u8>, key: u8, b: &[u8]) {
    out.push(key);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// Protobuf's base-128 varint.
fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// `data` framed as a record (see the module docs).
pub(crate) fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut r = Vec::with_capacity(data.len() + 16);
    r.extend(len);
    r.extend(masked_crc(&len).to_le_bytes());
    r.extend_from_slice(data);
    r.extend(masked_crc(data).to_le_bytes());
    r
}

/// The record format's masked CRC-32C.
pub(crate) fn masked_crc(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82f63b78), bit by bit:
/// a few hundred bytes a step need no table.
pub(crate) fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_its_published_check_value() {
        // The check value of CRC-32C (RFC 3720, B.4; the CRC catalogue).
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
        // 32 zero bytes: RFC 3720's first test vector.
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
    }

    #[test]
    fn a_scalar_event_is_the_protobuf_bytes_worked_out_by_hand() {
        let e = event(1.5, 8, Body::Scalar("a", 0.5));
        let want: Vec<u8> = [
            &[0x09][..],
            &[0, 0, 0, 0, 0, 0, 0xf8, 0x3f], // 1.5 as a little-endian f64
            &[0x10, 0x08],                   // step 8
            &[0x2a, 0x0a],                   // summary, 10 bytes
            &[0x0a, 0x08],                   // one value, 8 bytes
            &[0x0a, 0x01, b'a'],             // tag "a"
            &[0x15, 0, 0, 0, 0x3f],          // simple_value 0.5
        ]
        .concat();
        assert_eq!(e, want);
        // A step past 127 takes two varint bytes: 300 = 0xac 0x02, and
        // 200 = 0xc8 0x01 (its low byte has the top bit set already).
        let e = event(0.0, 300, Body::FileVersion("v"));
        assert_eq!(&e[9..], [0x10, 0xac, 0x02, 0x1a, 0x01, b'v']);
        let e = event(0.0, 200, Body::FileVersion("v"));
        assert_eq!(&e[9..12], [0x10, 0xc8, 0x01]);
    }

    #[test]
    fn a_written_file_reads_back_and_a_flipped_byte_is_caught() {
        let dir = std::env::temp_dir().join(format!("zrt-tfevents-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut w = Writer::open(&dir).unwrap();
        w.write(&[
            ("Train/Samples/lr", 1e-4, 8),
            ("Train/Samples/train_loss", 2.5, 8),
        ])
        .unwrap();
        w.write(&[("Train/Samples/lr", 2e-4, 300)]).unwrap();
        let path = w.path().to_path_buf();
        assert!(path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("events.out.tfevents."));
        let got = read_scalars(&path).unwrap();
        let want = [
            ("Train/Samples/lr", 8, 1e-4f32),
            ("Train/Samples/train_loss", 8, 2.5),
            ("Train/Samples/lr", 300, 2e-4),
        ];
        assert_eq!(got.len(), want.len(), "{got:?}");
        for (g, w) in got.iter().zip(want) {
            assert_eq!((g.0.as_str(), g.1, g.2), w);
        }
        // The first record is the file version, which holds no scalar,
        // stamped with the time now, as the file's name is.
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.windows(13).any(|w| w == b"brain.Event:2"));
        let wall = f64::from_le_bytes(bytes[13..21].try_into().unwrap());
        let real = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!((wall - real).abs() < 60.0, "{wall}");
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let secs: f64 = name.split('.').nth(3).unwrap().parse().unwrap();
        assert!((secs - wall).abs() < 2.0, "{name}");
        let mut flipped = bytes.clone();
        let last = flipped.len() - 6;
        flipped[last] ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        let e = read_scalars(&path).unwrap_err().to_string();
        assert!(e.contains("fails its checksum"), "{e}");
        std::fs::write(&path, &bytes[..bytes.len() - 2]).unwrap();
        let e = read_scalars(&path).unwrap_err().to_string();
        assert!(e.contains("a record ends short"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn records_frame_their_data_with_both_checksums() {
        let r = record(b"abc");
        assert_eq!(r.len(), 8 + 4 + 3 + 4);
        assert_eq!(&r[..8], 3u64.to_le_bytes());
        let masked = |d: &[u8]| crc32c(d).rotate_right(15).wrapping_add(0xa282_ead8);
        assert_eq!(&r[8..12], masked(&3u64.to_le_bytes()).to_le_bytes());
        assert_eq!(&r[12..15], b"abc");
        assert_eq!(&r[15..], masked(b"abc").to_le_bytes());
    }
}
