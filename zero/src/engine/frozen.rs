//! Frozen variables: the model's tensors that do not train (`requires_grad`
//! false: frozen parameters, and buffers such as running statistics).
//!
//! Stage 3 shards the fp32 (and compute-dtype) frozen parameters of the
//! units it frees ([`super::frozen_shards`]), as FSDP2 and ZeRO-3 do.
//! Everything else here — buffers, the root's frozen parameters, those of
//! other dtypes, all of them at stages 0-2 — every rank keeps whole, as
//! DDP would. What the engine owes them is
//! what DDP and FSDP give them: world rank 0's values on every rank when
//! the engine is built (`sync_module_states`), rank 0's values in a
//! checkpoint and back on every rank after a load, and a place in the
//! exported model. This type lists them all and moves the replicated ones.

use safetensors::Dtype;
use tch::{Kind, Tensor};
use zrt_collectives::ProcessGroup;

use crate::checkpoint::files::{Planned, RankFile, Sink};
use crate::checkpoint::weights_files::WeightsFiles;
use crate::checkpoint::{CheckpointError, FrozenMeta};
use crate::EngineError;

/// The model's frozen variables, sorted by name.
pub(super) struct Frozen {
    /// Those every rank holds whole.
    vars: Vec<(String, Tensor)>,
    /// Those of `vars` that are fp32 parameters cast to the 16-bit compute
    /// dtype: checkpoints hold them in fp32, as the model created them, so
    /// a checkpoint loads whatever the precision or stage.
    widened: std::collections::HashSet<String>,
    /// Stage 3's sharded frozen parameters (`frozen_shards`): name, shape
    /// and the dtype checkpoints hold them in (whole, as the model created
    /// them).
    sharded: Vec<(String, Vec<i64>, Dtype)>,
}

/// Frozen values a checkpoint holds, as [`Frozen::read`] returns them.
pub(super) struct Values {
    /// The replicated variables', in [`Frozen`]'s order.
    replicated: Vec<Tensor>,
    /// The checkpoint's frozen file, checked to hold the sharded
    /// parameters in their dtypes: each unit reads its shard of them from
    /// it.
    pub(super) file: Option<RankFile>,
}

impl Frozen {
    /// The variables in `vars` whose `requires_grad` is false, and the
    /// `sharded` ones stage-3 units hold. Those of them that are fp32
    /// parameters (their TensorImpl in `params`, not buffers) become
    /// `compute` (a 16-bit one; DeepSpeed's `module.bfloat16()` casts the
    /// frozen parameters too), so that they meet the 16-bit activations.
    pub(super) fn of(
        vars: std::collections::HashMap<String, Tensor>,
        mut sharded: Vec<(String, Vec<i64>, Dtype)>,
        params: &std::collections::HashSet<usize>,
        compute: Kind,
    ) -> Result<Self, EngineError> {
        let mut vars: Vec<(String, Tensor)> = vars
            .into_iter()
            .filter(|(_, t)| !t.requires_grad())
            .collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        sharded.sort_by(|a, b| a.0.cmp(&b.0));
        let mut widened = std::collections::HashSet::new();
        for (name, t) in &mut vars {
            if compute != Kind::Float
                && t.kind() == Kind::Float
                && params.contains(&crate::glue::tensor_impl(t)?)
            {
                // Released while the model was built
                // (`weights_on_first_rank_only`): still without memory,
                // in the new dtype, for `sync` to fill.
                let cast = match crate::glue::is_freed(t)? {
                    true => {
                        let empty = Tensor::f_empty(t.size(), (compute, t.device()))?;
                        crate::glue::free_storage(&empty)?;
                        empty
                    }
                    false => t.f_to_kind(compute)?,
                };
                t.set_data(&cast);
                widened.insert(name.clone());
            }
        }
        Ok(Self {
            vars,
            widened,
            sharded,
        })
    }

    /// Makes world rank 0's values everyone's: across replicas first, then
    /// inside the shard group (whose rank 0 then holds them), one variable at
    /// a time so no copy of them all is ever made. A collective.
    pub(super) fn sync<G: ProcessGroup>(
        &self,
        group: &G,
        replicate: Option<&G>,
        source: super::Source<'_>,
    ) -> Result<(), EngineError> {
        if let super::Source::File(_) = source {
            // No rank's values: memory (zeros) for the file's, which the
            // build loads next.
            for (_, t) in &self.vars {
                if crate::glue::is_freed(t)? {
                    crate::glue::realloc_if_freed(t)?;
                    drop(tch::no_grad(|| t.shallow_clone().f_zero_())?);
                }
            }
        }
        // Only world rank 0's bytes are kept; every other rank sends a
        // buffer of the right length and takes the result (so a large frozen
        // model is copied out once, on rank 0, and never written back there).
        // Every rank refused a dtype no checkpoint holds before anything
        // was laid out (`check_dtypes`).
        let root = super::is_first_rank(group, replicate);
        for (name, t) in &self.vars {
            let kind = t.f_kind()?;
            let shape = t.size();
            if !source.takes_rank0(name, &shape) {
                continue;
            }
            if let (true, super::Source::FirstRank(Some(spill))) = (root, source) {
                spill.restore(name, t)?;
            }
            let bytes = match root {
                true => raw(name, t)?.2,
                false => vec![0u8; t.numel() * kind.elt_size_in_bytes()],
            };
            let bytes = match replicate {
                Some(r) => r.broadcast(bytes, 0).wait()?,
                None => bytes,
            };
            let bytes = group.broadcast(bytes, 0).wait()?;
            if !root {
                assign(t, &bytes, &shape, kind)?;
            }
        }
        Ok(())
    }

    /// The kind variable `name` is saved in: `float` for a floating-point
    /// one when given (a 16-bit export's dtype), else the kind the model
    /// created it in.
    fn saved_kind(&self, name: &str, t: &Tensor, float: Option<Kind>) -> Result<Kind, EngineError> {
        Ok(match float {
            Some(k) if t.is_floating_point() => k,
            None if self.widened.contains(name) => Kind::Float,
            _ => t.f_kind()?,
        })
    }

    /// Every replicated frozen variable as a model file lists it, in the
    /// order [`Frozen::write`] writes them.
    pub(super) fn plan(&self, float: Option<Kind>) -> Result<Vec<Planned>, EngineError> {
        self.vars
            .iter()
            .map(|(name, t)| {
                let kind = self.saved_kind(name, t, float)?;
                Ok(Planned::new(name, dtype_of(name, kind)?, &t.size()))
            })
            .collect()
    }

    /// Writes every replicated frozen variable to `sink` (one at a time),
    /// as [`Frozen::plan`] lists them. A local step: an error goes into
    /// the sink.
    pub(super) fn write(&self, float: Option<Kind>, sink: &mut Sink) {
        for (name, t) in &self.vars {
            if !sink.wants() {
                return;
            }
            // A cast to the kind it has already is the tensor itself.
            let bytes = self
                .saved_kind(name, t, float)
                .and_then(|k| Ok(t.f_to_kind(k)?))
                .and_then(|t| raw(name, &t));
            match bytes {
                Ok((_, _, b)) => sink.write(name, &b),
                Err(e) => sink.fail(CheckpointError::Incompatible(format!(
                    "frozen `{name}`: {e}"
                ))),
            }
        }
    }

    /// What `meta.json` records of the frozen tensors in `plan`, by name.
    pub(super) fn metas(plan: &[Planned]) -> Vec<FrozenMeta> {
        let mut m: Vec<FrozenMeta> = plan
            .iter()
            .map(|p| FrozenMeta {
                name: p.name.clone(),
                dtype: p.dtype,
                shape: p.shape.iter().map(|&d| d as i64).collect(),
                quantized: false,
            })
            .collect();
        m.sort_by(|a, b| a.name.cmp(&b.name));
        m
    }

    /// Reads this model's frozen variables from `file` (a checkpoint's
    /// [`FROZEN_FILE`](crate::checkpoint::FROZEN_FILE), listed by `saved`;
    /// `None` when `saved` is empty):
    /// every one must be there with its dtype and shape, and nothing else.
    pub(super) fn read(
        &self,
        saved: &[FrozenMeta],
        file: Option<RankFile>,
    ) -> Result<Values, CheckpointError> {
        let mut missing = Vec::new();
        let mut misshaped = Vec::new();
        let mut values = Values {
            replicated: Vec::with_capacity(self.vars.len()),
            file: None,
        };
        let replicated = self.vars.iter().map(|(n, t)| {
            let kind = match self.widened.contains(n) {
                true => Kind::Float,
                false => t.kind(),
            };
            (n, kind, t.size(), false)
        });
        let sharded = self
            .sharded
            .iter()
            .map(|(n, s, d)| (n, kind_of(*d).unwrap_or(Kind::Float), s.clone(), true));
        for (name, kind, shape, is_sharded) in replicated.chain(sharded) {
            let Some(s) = saved.iter().find(|s| &s.name == name) else {
                missing.push(name.clone());
                continue;
            };
            if kind_of(s.dtype) != Some(kind) || s.shape != shape {
                misshaped.push(format!(
                    "{name}: checkpoint {:?} {:?}, model {kind:?} {shape:?}",
                    s.dtype, s.shape
                ));
                continue;
            }
            let Some(file) = file.as_ref() else {
                // `saved` lists it, so the checkpoint wrote the file.
                return Err(CheckpointError::Incompatible(format!(
                    "frozen `{name}` is listed but no frozen file was opened"
                )));
            };
            let (_, bytes) = file.bytes(name)?;
            if is_sharded {
                // Read later, each rank its shard; checked now, before
                // anything changes.
                let numel: i64 = s.shape.iter().product();
                if bytes.len() as i64 != numel * s.dtype.size() as i64 {
                    return Err(CheckpointError::format(
                        file.path(),
                        format!(
                            "frozen `{name}`: {} bytes for {numel} {:?} elements",
                            bytes.len(),
                            s.dtype
                        ),
                    ));
                }
                continue;
            }
            let v = from_bytes(bytes, &s.shape, kind).map_err(|e| {
                CheckpointError::format(file.path(), format!("frozen `{name}`: {e}"))
            })?;
            values.replicated.push(v);
        }
        let unexpected: Vec<String> = saved
            .iter()
            .filter(|s| {
                !self.vars.iter().any(|(n, _)| n == &s.name)
                    && !self.sharded.iter().any(|(n, _, _)| n == &s.name)
            })
            .map(|s| s.name.clone())
            .collect();
        if missing.is_empty() && misshaped.is_empty() && unexpected.is_empty() {
            values.file = file;
            return Ok(values);
        }
        Err(CheckpointError::ModelMismatch {
            missing,
            unexpected,
            misshaped,
        })
    }

    /// Copies the replicated variables' values [`Frozen::read`] returned
    /// into them (the sharded ones go to their units' shards).
    pub(super) fn restore(&self, values: &Values) -> Result<(), EngineError> {
        for ((_, t), v) in self.vars.iter().zip(&values.replicated) {
            tch::no_grad(|| t.shallow_clone().f_copy_(v))?;
        }
        Ok(())
    }

    /// Every frozen variable as a whole-model weights file holds it: name,
    /// shape, kind, and whether stage 3 holds it sharded (in a unit's
    /// frozen part, which reads it from the file widened to fp32).
    pub(super) fn wanted(&self) -> Vec<(String, Vec<i64>, Kind, bool)> {
        let whole = (self.vars.iter()).map(|(n, t)| (n.clone(), t.size(), t.kind(), false));
        let sharded = (self.sharded.iter()).map(|(n, s, d)| {
            (
                n.clone(),
                s.clone(),
                kind_of(*d).unwrap_or(Kind::Float),
                true,
            )
        });
        whole.chain(sharded).collect()
    }

    /// Copies into the variables every rank holds whole those of them a
    /// weights file holds (`has`; checked to be of their shapes, and of
    /// their kind unless both are floating-point), cast from the file's
    /// dtype to the variable's, one at a time.
    pub(super) fn load_weights(
        &self,
        file: &WeightsFiles,
        has: &std::collections::HashSet<String>,
    ) -> Result<(), EngineError> {
        for (name, t) in self.vars.iter().filter(|(n, _)| has.contains(n)) {
            let (dtype, bytes) = file.bytes(name)?;
            let Some(kind) = kind_of(dtype) else {
                let path = file.file_of(name)?.0.path();
                return Err(CheckpointError::format(path, format!("`{name}` is {dtype:?}")).into());
            };
            // `copy_` casts from the file's kind to the variable's.
            assign(t, &bytes, &t.size(), kind)?;
        }
        Ok(())
    }

    /// Whether the model has none.
    pub(super) fn is_empty(&self) -> bool {
        self.vars.is_empty() && self.sharded.is_empty()
    }
}

/// `t`'s kind, shape and little-endian bytes.
fn raw(name: &str, t: &Tensor) -> Result<(Kind, Vec<i64>, Vec<u8>), EngineError> {
    let kind = t.f_kind()?;
    dtype_of(name, kind)?;
    let c = t.detach().f_contiguous()?;
    let n = c.numel();
    let mut bytes = vec![0u8; n * kind.elt_size_in_bytes()];
    c.f_copy_data_u8(&mut bytes, n)?;
    Ok((kind, c.size(), bytes))
}

/// Overwrites `t` with `bytes` of `kind` in `shape`.
fn assign(t: &Tensor, bytes: &[u8], shape: &[i64], kind: Kind) -> Result<(), EngineError> {
    let v = from_bytes(bytes, shape, kind).map_err(EngineError::Unsupported)?;
    // Released while the model was built (`weights_on_first_rank_only`).
    crate::glue::realloc_if_freed(t)?;
    tch::no_grad(|| t.shallow_clone().f_copy_(&v))?;
    Ok(())
}

/// A tensor of `kind` in `shape` holding `bytes`, which must be exactly
/// that many elements (libtorch would read past a short slice).
fn from_bytes(bytes: &[u8], shape: &[i64], kind: Kind) -> Result<Tensor, String> {
    let numel: i64 = shape.iter().product();
    let want = usize::try_from(numel).unwrap_or(usize::MAX) * kind.elt_size_in_bytes();
    if bytes.len() != want {
        return Err(format!(
            "{} bytes for {kind:?} {shape:?}, which needs {want}",
            bytes.len()
        ));
    }
    Tensor::f_from_data_size(bytes, shape, kind).map_err(|e| e.to_string())
}

/// Refuses a frozen variable (or buffer) of `vs` no checkpoint can hold,
/// on every rank, before the engine lays anything out: refused later
/// (by the stage-3 frozen parts, say), stage 3 would have freed units a
/// second build could not read.
pub(super) fn check_dtypes(vs: &tch::nn::VarStore) -> Result<(), EngineError> {
    let mut vars: Vec<(String, Tensor)> = (vs.variables().into_iter())
        .filter(|(_, t)| !t.requires_grad())
        .collect();
    // The first by name, as every rank names the same one.
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, t) in &vars {
        dtype_of(name, t.f_kind()?)?;
    }
    Ok(())
}

/// The safetensors dtype of `kind`, or why a variable of that kind cannot
/// be saved.
pub(super) fn dtype_of(name: &str, kind: Kind) -> Result<Dtype, EngineError> {
    Ok(match kind {
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Int16 => Dtype::I16,
        Kind::Int8 => Dtype::I8,
        Kind::Uint8 => Dtype::U8,
        Kind::Bool => Dtype::BOOL,
        other => {
            return Err(EngineError::Unsupported(format!(
                "frozen variable `{name}` is {other:?}, which checkpoints cannot hold: use a real, integer or bool tensor"
            )))
        }
    })
}

/// The tch kind of a safetensors dtype [`dtype_of`] produces.
pub(super) fn kind_of(d: Dtype) -> Option<Kind> {
    Some(match d {
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::I16 => Kind::Int16,
        Dtype::I8 => Kind::Int8,
        Dtype::U8 => Kind::Uint8,
        Dtype::BOOL => Kind::Bool,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_maps_to_a_dtype_and_back() {
        for k in [
            Kind::Float,
            Kind::Double,
            Kind::Half,
            Kind::BFloat16,
            Kind::Int64,
            Kind::Int,
            Kind::Int16,
            Kind::Int8,
            Kind::Uint8,
            Kind::Bool,
        ] {
            assert_eq!(kind_of(dtype_of("x", k).unwrap()), Some(k));
        }
        assert!(dtype_of("x", Kind::ComplexFloat)
            .unwrap_err()
            .to_string()
            .contains("frozen variable `x` is ComplexFloat"));
    }

    #[test]
    fn a_16_bit_export_casts_floating_variables_only() {
        let cpu = tch::Device::Cpu;
        let w = Tensor::ones([4], (Kind::Float, cpu));
        let buf = Tensor::ones([4], (Kind::Float, cpu));
        let steps = Tensor::ones([1], (Kind::Int64, cpu));
        let params = [crate::glue::tensor_impl(&w).unwrap()].into();
        let vars = [("w", &w), ("buf", &buf), ("steps", &steps)]
            .into_iter()
            .map(|(n, t)| (n.to_string(), t.shallow_clone()))
            .collect();
        let f = Frozen::of(vars, Vec::new(), &params, Kind::BFloat16).unwrap();
        let kind = |name: &str, float| {
            let (_, t) = f.vars.iter().find(|(n, _)| n == name).unwrap();
            f.saved_kind(name, t, float).unwrap()
        };
        // An export in a 16-bit dtype casts the floating-point ones...
        assert_eq!(kind("w", Some(Kind::Half)), Kind::Half);
        assert_eq!(kind("buf", Some(Kind::Half)), Kind::Half);
        // ...and keeps an integer buffer as it is.
        assert_eq!(kind("steps", Some(Kind::Half)), Kind::Int64);
        // A checkpoint holds each as the model created it: the fp32
        // parameter the engine cast to bf16 as fp32 again.
        assert_eq!(kind("w", None), Kind::Float);
        assert_eq!(kind("buf", None), Kind::Float);
        assert_eq!(kind("steps", None), Kind::Int64);
    }

    #[test]
    fn raw_bytes_round_trip_a_strided_tensor() {
        let t = Tensor::arange(12, (Kind::Int64, tch::Device::Cpu)).view([3, 4]);
        let (kind, shape, bytes) = raw("t", &t.tr()).unwrap();
        assert_eq!((kind, shape.as_slice()), (Kind::Int64, &[4i64, 3][..]));
        let back = Tensor::zeros([4, 3], (Kind::Int64, tch::Device::Cpu));
        assign(&back, &bytes, &shape, kind).unwrap();
        assert!(back.equal(&t.tr()));
        let short = from_bytes(&bytes[1..], &shape, kind).unwrap_err();
        assert_eq!(short, "95 bytes for Int64 [4, 3], which needs 96");
    }
}
