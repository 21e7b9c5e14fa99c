//! `csv_monitor`: one CSV file per tag, as DeepSpeed's `csvMonitor` lays
//! them out (`Train/Samples/lr` -> `Train_Samples_lr.csv`, header
//! `step,lr`).

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// An open `csv_monitor` folder.
pub(super) struct Csv {
    dir: PathBuf,
    files: HashMap<String, File>,
}

impl Csv {
    /// Makes the folder (and its parents) if it is not there.
    pub(super) fn open(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            files: HashMap::new(),
        })
    }

    /// The folder written into.
    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Appends a row `samples,value` to each event's file, opening it on
    /// its first event (a header first when the file is new or empty: a
    /// resumed run appends to its files without a second header).
    pub(super) fn write(&mut self, events: &[(&str, f64, u64)]) -> std::io::Result<()> {
        for &(tag, value, samples) in events {
            let f = match self.files.entry(tag.to_string()) {
                std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    let name = format!("{}.csv", tag.replace(['/', ' '], "_"));
                    let mut f = OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(self.dir.join(name))?;
                    if f.metadata()?.len() == 0 {
                        let header = tag.rsplit('/').next().unwrap_or(tag);
                        writeln!(f, "step,{header}")?;
                    }
                    v.insert(f)
                }
            };
            // Rust's shortest round-trip form, as Python's csv writes a float.
            writeln!(f, "{samples},{value}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_tag_gets_its_file_with_a_header_once_even_across_runs() {
        let dir = std::env::temp_dir().join(format!("zrt-csv-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let run = |events: &[(&str, f64, u64)]| {
            let mut c = Csv::open(&dir.join("job")).unwrap();
            c.write(events).unwrap();
        };
        run(&[
            ("Train/Samples/train_loss", 2.5, 8),
            ("Train/Samples/lr", 1e-4, 8),
        ]);
        run(&[("Train/Samples/train_loss", 0.1, 16)]);
        let read = |name: &str| std::fs::read_to_string(dir.join("job").join(name)).unwrap();
        assert_eq!(
            read("Train_Samples_train_loss.csv"),
            "step,train_loss\n8,2.5\n16,0.1\n"
        );
        assert_eq!(read("Train_Samples_lr.csv"), "step,lr\n8,0.0001\n");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
