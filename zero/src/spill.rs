//! The first rank's weights on disk while the model is built
//! ([`ShardPlan::weights_on_disk_while_built`](crate::ShardPlan::weights_on_disk_while_built)).
//!
//! Under `weights_on_first_rank_only` the first rank keeps the whole
//! model while it is built, because the engine spreads its values. With
//! a spill, it writes each variable's bytes to a file as its block is
//! wrapped and gives the memory back as the other ranks do; the engine's
//! build reads each unit's variables back just before it lays that unit
//! out, so building holds one unit, not the model, on every rank
//! (DeepSpeed's `zero.Init` with `remote_device="nvme"` keeps a
//! partitioned model on NVMe as it is made, for the same reason).
//!
//! The file is removed from its directory as soon as it is made: the
//! process's handle keeps it until the engine is built (or the process
//! ends, however it ends), so no run leaves one behind.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tch::{Kind, Tensor};

use crate::EngineError;

/// An unnamed file holding the variables the first rank released.
pub(crate) struct Spill {
    dir: PathBuf,
    file: File,
    index: Mutex<Index>,
}

/// Where each written variable is, and where the next goes.
#[derive(Default)]
struct Index {
    end: u64,
    at: HashMap<String, Entry>,
    /// A write failed: from then on nothing is released (what was written
    /// still reads back).
    failed: bool,
}

/// One variable's bytes in the file.
struct Entry {
    offset: u64,
    len: usize,
    kind: Kind,
    shape: Vec<i64>,
}

impl Spill {
    /// A new file in `dir`, already unlinked from it.
    pub(crate) fn create(dir: &Path) -> Result<Self, EngineError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let refuse = |e: std::io::Error| {
            EngineError::Plan(format!(
                "weights_on_disk_while_built: cannot make a file in {}: {e}; pass a directory this rank can write to, on a disk with room for the model's weights",
                dir.display()
            ))
        };
        let name = format!(
            ".zrt-weights-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let file = (std::fs::OpenOptions::new().read(true).write(true))
            .create_new(true)
            .open(&path)
            .map_err(refuse)?;
        std::fs::remove_file(&path).map_err(refuse)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            file,
            index: Mutex::new(Index::default()),
        })
    }

    /// Writes variable `name`'s values `t` to the file: whether its
    /// memory may be given back (not when the write failed, now or
    /// before: it then keeps its values, and the build reads them).
    pub(crate) fn write(&self, name: &str, t: &Tensor) -> bool {
        let Ok(mut index) = self.index.lock() else {
            return false;
        };
        if index.failed {
            return false;
        }
        if index.at.contains_key(name) {
            return true;
        }
        match self.append(&mut index, name, t) {
            Ok(()) => true,
            Err(e) => {
                index.failed = true;
                tracing::warn!(
                    "weights_on_disk_while_built: writing `{name}` to {} failed ({e}); it and every variable made after it keep their memory on this rank",
                    self.dir.display()
                );
                false
            }
        }
    }

    fn append(&self, index: &mut Index, name: &str, t: &Tensor) -> Result<(), String> {
        let kind = t.f_kind().map_err(|e| e.to_string())?;
        let c = t.detach().f_contiguous().map_err(|e| e.to_string())?;
        let n = c.numel();
        let mut bytes = vec![0u8; n * kind.elt_size_in_bytes()];
        c.f_copy_data_u8(&mut bytes, n).map_err(|e| e.to_string())?;
        let offset = index.end;
        (self.file.write_all_at(&bytes, offset)).map_err(|e| e.to_string())?;
        index.end += bytes.len() as u64;
        let entry = Entry {
            offset,
            len: bytes.len(),
            kind,
            shape: c.size(),
        };
        index.at.insert(name.to_string(), entry);
        Ok(())
    }

    /// Reads variable `name`'s values, as fp32, into `out` (its
    /// elements' length): whether it was written. For a unit's layout,
    /// which makes the variable a view of its flat buffer next, so no
    /// memory of its own is made for it.
    pub(crate) fn read_f32(&self, name: &str, out: &mut [f32]) -> Result<bool, EngineError> {
        let index = self.index()?;
        let Some(e) = index.at.get(name) else {
            return Ok(false);
        };
        let numel: i64 = e.shape.iter().product();
        if numel as usize != out.len() {
            return Err(EngineError::Plan(format!(
                "weights_on_disk_while_built: `{name}` was written with {numel} elements and is laid out with {}",
                out.len()
            )));
        }
        if e.kind == Kind::Float {
            // The file's bytes are the values: no copy between.
            // SAFETY: any bytes are a valid f32, and the slice is `out`'s.
            let bytes = unsafe {
                std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), out.len() * 4)
            };
            return self.read_at(name, e, bytes).map(|()| true);
        }
        let v = self.tensor(name, e)?.f_to_kind(Kind::Float)?;
        v.f_copy_data(out, out.len())?;
        Ok(true)
    }

    /// The index, locked.
    fn index(&self) -> Result<std::sync::MutexGuard<'_, Index>, EngineError> {
        (self.index.lock()).map_err(|_| EngineError::Plan("the spill's lock was poisoned".into()))
    }

    /// Variable `name`'s bytes, at `e`, into `bytes` (`e.len` of them).
    fn read_at(&self, name: &str, e: &Entry, bytes: &mut [u8]) -> Result<(), EngineError> {
        (self.file.read_exact_at(bytes, e.offset)).map_err(|err| {
            EngineError::Plan(format!(
                "weights_on_disk_while_built: reading `{name}` back from the file in {} failed: {err}",
                self.dir.display()
            ))
        })
    }

    /// Variable `name` (at `e`) as written.
    fn tensor(&self, name: &str, e: &Entry) -> Result<Tensor, EngineError> {
        let mut bytes = vec![0u8; e.len];
        self.read_at(name, e, &mut bytes)?;
        Ok(Tensor::f_from_data_size(&bytes, &e.shape, e.kind)?)
    }

    /// Gives variable `name` (`t`) its values back from the file, if it
    /// was written and has no memory; in `t`'s own dtype, which the
    /// build may have changed since (a frozen fp32 weight cast to bf16
    /// is rounded as a cast of its values would be).
    pub(crate) fn restore(&self, name: &str, t: &Tensor) -> Result<(), EngineError> {
        if !crate::glue::is_freed(t)? {
            return Ok(());
        }
        let index = self.index()?;
        let Some(e) = index.at.get(name) else {
            return Ok(());
        };
        let v = self.tensor(name, e)?;
        crate::glue::realloc_if_freed(t)?;
        tch::no_grad(|| t.shallow_clone().f_copy_(&v))?;
        Ok(())
    }

    /// Bytes written so far.
    #[cfg(test)]
    fn written(&self) -> u64 {
        self.index.lock().map(|i| i.end).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_variable_comes_back_in_its_new_dtype_and_the_file_has_no_name() {
        let dir = crate::test_dir("spill-back");
        let spill = Spill::create(&dir).unwrap();
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        let w = Tensor::from_slice(&[1.0f32, 2.5, -3.0, 1.0 + 1.0 / 256.0]).view([2, 2]);
        let b = Tensor::from_slice(&[7i64, 8, 9]);
        assert!(spill.write("w", &w.tr()));
        assert!(spill.write("b", &b));
        assert_eq!(spill.written(), 16 + 24);
        let w2 = w.tr().copy();
        crate::glue::free_storage(&w2).unwrap();
        let cast = Tensor::empty([2, 2], (Kind::BFloat16, tch::Device::Cpu));
        crate::glue::free_storage(&cast).unwrap();
        spill.restore("w", &w2).unwrap();
        spill.restore("w", &cast).unwrap();
        assert!(w2.equal(&w.tr()));
        let mut out = [0f32; 4];
        assert!(spill.read_f32("w", &mut out).unwrap());
        assert_eq!(out, [1.0, -3.0, 2.5, 1.0 + 1.0 / 256.0]);
        assert!(!spill.read_f32("c", &mut out).unwrap());
        let err = spill.read_f32("b", &mut out).unwrap_err().to_string();
        assert!(
            err.contains("`b` was written with 3 elements and is laid out with 4"),
            "{err}"
        );
        let mut ints = [0f32; 3];
        assert!(spill.read_f32("b", &mut ints).unwrap());
        assert_eq!(ints, [7.0, 8.0, 9.0]);
        assert!(cast.equal(&w.tr().to_kind(Kind::BFloat16)));
        // Held memory is not overwritten; a name never written is left.
        let held = Tensor::zeros([3], (Kind::Int64, tch::Device::Cpu));
        spill.restore("b", &held).unwrap();
        assert_eq!(Vec::<i64>::try_from(&held).unwrap(), [0, 0, 0]);
        let other = Tensor::zeros([3], (Kind::Int64, tch::Device::Cpu));
        crate::glue::free_storage(&other).unwrap();
        spill.restore("c", &other).unwrap();
        assert!(crate::glue::is_freed(&other).unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_directory_that_cannot_hold_it_is_named() {
        let dir = std::env::temp_dir().join("zrt-spill-no-such-dir/below");
        let err = Spill::create(&dir).err().unwrap().to_string();
        assert!(
            err.contains("weights_on_disk_while_built: cannot make a file in"),
            "{err}"
        );
        assert!(err.contains("zrt-spill-no-such-dir/below"), "{err}");
    }
}
