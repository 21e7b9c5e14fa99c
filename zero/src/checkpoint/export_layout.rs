//! How a model export names and lays out its tensors when the file is for
//! another program: [`ExportLayout`], the reverse of the plan's
//! `rename_weights` and `transpose_weights` (a fine-tuned GPT-2 written
//! back in Hugging Face's names and Conv1D layout, for `transformers`'
//! `from_pretrained`).

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::path::Path;

use safetensors::Dtype;

use super::files::{write_atomic, Planned};
use super::sharded_out::ModelWriter;
use super::transpose::Transpose;
use super::CheckpointError;

/// A rule naming each of the model's tensors in the file.
type RenameOut = dyn Fn(&str) -> String + Send + Sync;
/// A rule saying which matrices the file holds transposed.
type TransposeOut = dyn Fn(&str) -> bool + Send + Sync;
/// A rule naming a second place in the file for some of the tensors.
type AlsoOut = dyn Fn(&str) -> Vec<String> + Send + Sync;
/// A file's contents made for the dtype the tensors are written in.
type MadeFor = dyn Fn(&str) -> Vec<u8> + Send + Sync;

/// What a file written beside the tensors holds.
enum Contents {
    /// These bytes.
    Bytes(Vec<u8>),
    /// What the rule makes of the tensors' dtype (PyTorch's name).
    ForDtype(Box<MadeFor>),
}

/// How [`Engine::save_16bit_model_as`](crate::Engine::save_16bit_model_as)
/// writes each of the model's tensors: under which name, and whether a
/// matrix is written transposed (`[cols, rows]` for the model's `[rows,
/// cols]`), and which files go with them (a `config.json`). The default
/// writes the tensors as the model has them, and nothing else.
#[derive(Default)]
pub struct ExportLayout {
    rename: Option<Box<RenameOut>>,
    transpose: Option<Box<TransposeOut>>,
    also: Option<Box<AlsoOut>>,
    /// (file name, contents) written beside the tensors.
    files: Vec<(String, Contents)>,
    /// Set by [`ExportLayout::trainable_only`].
    trainable_only: bool,
}

impl std::fmt::Debug for ExportLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportLayout")
            .field("renames", &self.rename.is_some())
            .field("transposes", &self.transpose.is_some())
            .field("writes_twice", &self.also.is_some())
            .field("trainable_only", &self.trainable_only)
            .field(
                "files",
                &self.files.iter().map(|f| &f.0).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl ExportLayout {
    /// The model's own names and layout.
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes the model's tensor `name` as `rule(name)`. Two tensors
    /// given one name are refused.
    pub fn rename(mut self, rule: impl Fn(&str) -> String + Send + Sync + 'static) -> Self {
        self.rename = Some(Box::new(rule));
        self
    }

    /// Writes the matrices `rule` is true of (given the model's names)
    /// transposed. A tensor it names that is not a matrix is refused.
    pub fn transpose(mut self, rule: impl Fn(&str) -> bool + Send + Sync + 'static) -> Self {
        self.transpose = Some(Box::new(rule));
        self
    }

    /// Writes the model's tensor `name` again under each of
    /// `rule(name)` (files' names, not renamed), right after the first
    /// (in its layout there): a tied tensor a reader wants under all its
    /// names (PEFT's adapter file holds a saved, tied embedding as the
    /// head too, and an adapter on a module several layers share under
    /// each of them). A name already taken is refused.
    pub fn also_write(
        mut self,
        rule: impl Fn(&str) -> Vec<String> + Send + Sync + 'static,
    ) -> Self {
        self.also = Some(Box::new(rule));
        self
    }

    /// Writes the parameters that train and nothing else: no frozen
    /// variable is gathered or written. A LoRA model's adapters over its
    /// frozen base, as PEFT's `adapter_model.safetensors` holds them.
    pub fn trainable_only(mut self) -> Self {
        self.trainable_only = true;
        self
    }

    /// Whether [`Self::trainable_only`] was set.
    pub(crate) fn is_trainable_only(&self) -> bool {
        self.trainable_only
    }

    /// Writes a file `name` holding `contents` beside the tensors (in the
    /// export's directory, or the directory of its one file), once they
    /// are written, as the rank writing them writes them (under a
    /// temporary name, then renamed): `transformers` wants the model's
    /// `config.json` there. `name` must be a file name, not a path.
    pub fn with_file(mut self, name: impl Into<String>, contents: impl Into<Vec<u8>>) -> Self {
        self.files
            .push((name.into(), Contents::Bytes(contents.into())));
        self
    }

    /// As [`Self::with_file`], the contents made by `make` from the dtype
    /// the export's tensors are written in, as PyTorch names it
    /// (`"float32"`, `"bfloat16"`, `"float16"`): a `config.json` whose
    /// `dtype` must say what the file holds, since `transformers` loads a
    /// model in it (`dtype="auto"`).
    pub fn with_file_for_dtype(
        mut self,
        name: impl Into<String>,
        make: impl Fn(&str) -> Vec<u8> + Send + Sync + 'static,
    ) -> Self {
        let make: Box<MadeFor> = Box::new(make);
        self.files.push((name.into(), Contents::ForDtype(make)));
        self
    }

    /// Writes the [`Self::with_file`] files for the export at `out` (one
    /// file when not `sharded`) whose tensors are written in `dtype`.
    pub(crate) fn write_files(
        &self,
        out: &Path,
        sharded: bool,
        dtype: Dtype,
    ) -> Result<(), CheckpointError> {
        let dir = match sharded {
            true => out,
            false => out.parent().unwrap_or(Path::new(".")),
        };
        for (name, contents) in &self.files {
            let made;
            let bytes = match contents {
                Contents::Bytes(b) => b,
                Contents::ForDtype(make) => {
                    made = make(torch_name(dtype));
                    &made
                }
            };
            write_atomic(&dir.join(name), bytes)?;
        }
        Ok(())
    }

    /// `plan` (the model's names and shapes) as the file holds it, and
    /// what turns each tensor's values into the file's, for an export at
    /// `out` in files of at most `max_shard_bytes` (one file when `None`);
    /// errors name `out`. The same on every rank, so a refusal is every
    /// rank's before anything is gathered.
    pub(crate) fn apply(
        &self,
        plan: &[Planned],
        out: &Path,
        max_shard_bytes: Option<u64>,
    ) -> Result<(Vec<Planned>, OutNames), CheckpointError> {
        let refuse = |msg: String| CheckpointError::Export {
            path: out.to_path_buf(),
            msg,
        };
        if max_shard_bytes == Some(0) {
            return Err(refuse(
                "files of at most 0 bytes: give the most bytes of tensors a file may hold".into(),
            ));
        }
        for (name, _) in &self.files {
            if Path::new(name).components().count() != 1 || name == ".." {
                return Err(refuse(format!(
                    "the export layout's file `{name}` is not a file name: name a file to write beside the tensors"
                )));
            }
        }
        let mut names = HashMap::with_capacity(plan.len());
        let mut taken = HashSet::with_capacity(plan.len());
        let mut mapped = Vec::with_capacity(plan.len());
        for p in plan {
            let name = self
                .rename
                .as_ref()
                .map_or_else(|| p.name.clone(), |r| r(&p.name));
            if !taken.insert(name.clone()) {
                return Err(refuse(format!(
                    "the export layout names two of the model's tensors `{name}` (one is `{}`): give each a name of its own",
                    p.name
                )));
            }
            let transposed = match self.transpose.as_ref().is_some_and(|t| t(&p.name)) {
                false => None,
                true => match p.shape.as_slice() {
                    &[rows, cols] => Some((Transpose { rows, cols }, p.dtype.size())),
                    shape => {
                        return Err(refuse(format!(
                            "the export layout transposes `{}`, of shape {shape:?}: only a matrix (2 dimensions) transposes",
                            p.name
                        )))
                    }
                },
            };
            let shape = match transposed {
                Some((t, _)) => vec![t.cols, t.rows],
                None => p.shape.clone(),
            };
            let also = self.also.as_ref().map(|a| a(&p.name)).unwrap_or_default();
            let mut out = vec![(name, transposed)];
            out.extend(also.into_iter().map(|a| (a, transposed)));
            for (i, (name, _)) in out.iter().enumerate() {
                if i > 0 && !taken.insert(name.clone()) {
                    return Err(refuse(format!(
                        "the export layout writes `{}` a second time as `{name}`, a name taken: give it a name of its own",
                        p.name
                    )));
                }
                mapped.push(Planned {
                    name: name.clone(),
                    dtype: p.dtype,
                    shape: shape.clone(),
                });
            }
            names.insert(p.name.clone(), out);
        }
        Ok((mapped, OutNames(names)))
    }
}

/// PyTorch's name of an export's `dtype` (`torch.bfloat16` is
/// `"bfloat16"`), as Hugging Face configs write it.
fn torch_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::BF16 => "bfloat16",
        Dtype::F16 => "float16",
        // An export writes its trained tensors in f32, bf16 or f16: no
        // other dtype is an export's.
        _ => "float32",
    }
}

/// Each of the model's tensors' names in the file (its second too, for
/// [`ExportLayout::also_write`]), and for one written transposed its
/// transpose and the bytes of an element.
pub(crate) struct OutNames(HashMap<String, Vec<OutName>>);

/// A name in the file, and for a tensor written transposed its
/// transpose and the bytes of an element.
type OutName = (String, Option<(Transpose, usize)>);

impl OutNames {
    /// Tensor `name`'s names in the file, each with its bytes as the file
    /// holds them (`data` is the model's layout); a name it does not know
    /// goes as it is.
    fn map<'a>(&'a self, name: &'a str, data: &'a [u8]) -> Vec<(&'a str, Cow<'a, [u8]>)> {
        let Some(out) = self.0.get(name) else {
            return vec![(name, Cow::Borrowed(data))];
        };
        (out.iter())
            .map(|(out, transposed)| match transposed {
                None => (out.as_str(), Cow::Borrowed(data)),
                Some((t, size)) => (out.as_str(), Cow::Owned(t.copy(data, *size))),
            })
            .collect()
    }

    /// Writes the model's tensor `name` (its bytes `data`) to `w` under
    /// its names in the file, in its layout there.
    pub(crate) fn write(
        &self,
        w: &mut ModelWriter,
        name: &str,
        data: &[u8],
    ) -> Result<(), CheckpointError> {
        for (name, data) in self.map(name, data) {
            w.write(name, &data)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_renames_and_transposes_and_refuses_what_it_cannot_write() {
        let plan = [
            Planned::new("a.w", Dtype::F32, &[2, 3]),
            Planned::new("a.b", Dtype::F32, &[3]),
        ];
        let out = Path::new("/x/out");
        let layout = ExportLayout::new()
            .rename(|n| format!("m.{n}"))
            .transpose(|n| n.ends_with(".w"));
        let (mapped, names) = layout.apply(&plan, out, None).unwrap();
        let shapes: Vec<(&str, &[usize])> = (mapped.iter())
            .map(|p| (p.name.as_str(), p.shape.as_slice()))
            .collect();
        assert_eq!(shapes, [("m.a.w", &[3, 2][..]), ("m.a.b", &[3][..])]);
        // [[1, 2, 3], [4, 5, 6]] is written [[1, 4], [2, 5], [3, 6]].
        let w: Vec<u8> = (1..=6u32).flat_map(|v| (v as f32).to_le_bytes()).collect();
        let floats = |t: &[u8]| -> Vec<f32> {
            (t.chunks_exact(4))
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let [(name, t)] = &names.map("a.w", &w)[..] else {
            panic!("one name")
        };
        assert_eq!((*name, floats(t)), ("m.a.w", vec![1., 4., 2., 5., 3., 6.]));
        let [(name, b)] = &names.map("a.b", &w[..12])[..] else {
            panic!("one name")
        };
        assert_eq!((*name, &b[..]), ("m.a.b", &w[..12]));
        // A second name: planned right after the first, written the same.
        let also = ExportLayout::new()
            .rename(|n| format!("m.{n}"))
            .transpose(|n| n.ends_with(".w"))
            .also_write(|n| match n {
                "a.w" => vec!["tied.w".to_string(), "again.w".to_string()],
                _ => vec![],
            });
        let (mapped, names) = also.apply(&plan, out, None).unwrap();
        let order: Vec<&str> = mapped.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(order, ["m.a.w", "tied.w", "again.w", "m.a.b"]);
        assert_eq!(
            (&mapped[1].shape, &mapped[2].shape),
            (&vec![3, 2], &vec![3, 2])
        );
        let both: Vec<(&str, Vec<f32>)> = (names.map("a.w", &w).iter())
            .map(|(n, t)| (*n, floats(t)))
            .collect();
        let want = vec![1., 4., 2., 5., 3., 6.];
        let thrice = [
            ("m.a.w", want.clone()),
            ("tied.w", want.clone()),
            ("again.w", want),
        ];
        assert_eq!(both, thrice);
        let taken = ExportLayout::new()
            .rename(|n| format!("m.{n}"))
            .also_write(|n| {
                (n == "a.b")
                    .then(|| "m.a.w".to_string())
                    .into_iter()
                    .collect()
            });
        let err = taken.apply(&plan, out, None).err().unwrap().to_string();
        assert!(
            err.contains("writes `a.b` a second time as `m.a.w`"),
            "{err}"
        );
        let twice = ExportLayout::new().rename(|_| "same".into());
        let err = twice.apply(&plan, out, None).err().unwrap().to_string();
        assert!(
            err.contains("names two of the model's tensors `same`") && err.contains("/x/out"),
            "{err}"
        );
        let vector = ExportLayout::new().transpose(|_| true);
        let err = vector.apply(&plan, out, None).err().unwrap().to_string();
        assert!(err.contains("transposes `a.b`, of shape [3]"), "{err}");
        let none = ExportLayout::new().apply(&plan, out, Some(0));
        let err = none.err().unwrap().to_string();
        assert!(err.contains("files of at most 0 bytes"), "{err}");
        for name in ["../config.json", "a/b.json", "/etc/x"] {
            let path = ExportLayout::new().with_file(name, "{}");
            let err = path.apply(&plan, out, None).err().unwrap().to_string();
            assert!(
                err.contains(&format!("file `{name}` is not a file name")),
                "{err}"
            );
        }
    }

    #[test]
    fn files_are_written_beside_the_tensors_made_for_their_dtype() {
        let dir = std::env::temp_dir().join(format!("zrt-export-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let layout = ExportLayout::new()
            .with_file("a.txt", "fixed")
            .with_file_for_dtype("config.json", |d| format!("in {d}").into_bytes());
        for (dtype, name) in [
            (Dtype::F32, "float32"),
            (Dtype::BF16, "bfloat16"),
            (Dtype::F16, "float16"),
        ] {
            // A directory (sharded) gets them inside; one file beside it.
            layout.write_files(&dir, true, dtype).unwrap();
            std::fs::create_dir_all(dir.join("sub")).unwrap();
            layout
                .write_files(&dir.join("sub").join("model.safetensors"), false, dtype)
                .unwrap();
            for d in [dir.clone(), dir.join("sub")] {
                let read = |f: &str| std::fs::read_to_string(d.join(f)).unwrap();
                assert_eq!(read("a.txt"), "fixed");
                assert_eq!(read("config.json"), format!("in {name}"));
            }
            let _ = std::fs::remove_dir_all(dir.join("sub"));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
