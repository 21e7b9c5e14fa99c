//! Loading a whole-model weights file into a built engine: FSDP2's
//! `set_model_state_dict` from a full state dict, DeepSpeed's pretrained
//! weights under ZeRO-3, without a rank ever holding the whole model.
//!
//! The file is any safetensors file under the model's VarStore names:
//! [`Engine::save_16bit_model`]'s export, `zrt ckpt consolidate`'s output,
//! tch's `VarStore::save`, a converted Hugging Face checkpoint, or several
//! under a sharded checkpoint's index ([`WeightsFiles`]). Each rank
//! maps it and reads only the elements of its own range of each unit (and
//! of its shard of stage 3's frozen parameters), widened to fp32; the
//! variables every rank holds whole it reads whole. Like a checkpoint
//! load it runs in phases: every rank checks the file against the model,
//! the ranks agree that all of them can load it and that they read the
//! same file (by its header and length), and only then does anything
//! change.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use safetensors::Dtype;
use tch::Kind;
use zrt_collectives::ProcessGroup;

use super::checkpoint::Reads;
use super::{elems, frozen, Compute, Engine, OwnedState, State};
use crate::checkpoint::files::ReadWidened;
use crate::checkpoint::weights_files::WeightsFiles;
use crate::checkpoint::CheckpointError;
use crate::plan::NameRule;
use crate::EngineError;

/// What [`Engine::load_weights`] did, as torch's `load_state_dict`
/// reports it: which of the model's variables the file lacked and which
/// of its tensors the model lacks (both empty after a strict load).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadedWeights {
    /// How many of the model's variables took the file's values.
    pub loaded: usize,
    /// The model's variables the file does not hold: they kept their
    /// values. Sorted.
    pub missing: Vec<String>,
    /// The file's tensors the model does not have: skipped. Sorted.
    pub unexpected: Vec<String>,
}

/// A weights file's reads, told apart by a CRC-32 of its header and its
/// data's ends, and its length.
const WEIGHTS_READS: Reads = Reads {
    detail: |len| format!("{len} bytes"),
    crc_of: "crc of header and ends",
    error: CheckpointError::DifferentWeights,
};

/// How a model's variable may be read from a file's tensor.
#[derive(Clone, Copy)]
enum Accepts {
    /// Into an fp32 master or frozen shard: F32, BF16 or F16, widened
    /// exactly.
    Widened,
    /// Into a floating-point variable every rank holds: any float dtype,
    /// cast as `copy_` casts.
    AnyFloat,
    /// Into a variable of another kind: that kind only.
    Exactly(Kind),
}

impl Accepts {
    fn takes(self, dtype: Dtype) -> bool {
        match self {
            Accepts::Widened => matches!(dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16),
            Accepts::AnyFloat => {
                matches!(dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16 | Dtype::F64)
            }
            Accepts::Exactly(k) => frozen::kind_of(dtype) == Some(k),
        }
    }
}

/// Which of the model's variables a load is about.
#[derive(Clone, Copy, Default)]
struct Part<'a> {
    /// Variables the file may lack, which keep their values and are not
    /// reported missing (`ShardPlan::fresh_weights`).
    fresh: Option<&'a NameRule>,
    /// The variables the load is about, when not all
    /// ([`Engine::load_weights_of`]): the others are neither read nor
    /// reported.
    only: Option<&'a Only<'a>>,
}

/// [`Engine::load_weights_of`]'s rule: which variables the load is about.
type Only<'a> = dyn Fn(&str, &[i64]) -> bool + 'a;

/// A file checked against the model on this rank: what the apply phase
/// reads, and the report.
struct Checked {
    file: WeightsFiles,
    /// The model's variables the file holds (their values will be read).
    has: HashSet<String>,
    report: LoadedWeights,
}

impl<G: ProcessGroup + 'static> Engine<G> {
    /// Loads a whole-model weights file at `path` into the engine's
    /// parameters (their fp32 masters and compute copies) and frozen
    /// variables, on any world size and stage: FSDP2's
    /// `set_model_state_dict` with a full state dict. A collective: every
    /// rank calls it with the same file, which every rank must see (one
    /// host, or a shared filesystem); each rank reads only its own range
    /// of the parameters from it, mapped, so no rank holds the model.
    ///
    /// The file is safetensors under the model's VarStore names
    /// ([`Engine::save_16bit_model`]'s, `zrt ckpt consolidate`'s, tch's
    /// `VarStore::save`). A model in several files loads from its index
    /// (Hugging Face's `model.safetensors.index.json`, whose `weight_map`
    /// names each tensor's file, the files beside it), and `path` may be
    /// a directory holding that index or a `model.safetensors`. F32, BF16 and F16 tensors load into
    /// parameters, widened exactly (a 16-bit export loads as its values),
    /// and frozen variables take their own kind (a floating-point one
    /// from any float dtype). A zrt file's CRC-32 is checked.
    ///
    /// `strict` (torch's `load_state_dict(strict=...)`): every variable
    /// of the model must be in the file and nothing else. With `false`,
    /// variables the file lacks keep their values and tensors the model
    /// lacks are skipped (a pretrained base under a new head); both are
    /// returned, and logged by the first rank. A tensor of another shape,
    /// or of a dtype its variable cannot take, is refused either way, as
    /// is a file holding none of the model's variables.
    ///
    /// As [`Engine::load_checkpoint_module_only`]: the optimizer starts
    /// afresh (Adam's moments at zero, its step count at 0), gradients
    /// accumulated since the last step are dropped, and the engine's step
    /// count, schedule, loss scaler and random generator are not touched.
    /// Any rank's refusal is every rank's, before anything changes; ranks
    /// given different files fail naming what each read.
    pub fn load_weights(
        &self,
        path: impl AsRef<Path>,
        strict: bool,
    ) -> Result<LoadedWeights, EngineError> {
        self.load_weights_inner(path.as_ref(), strict, Part::default())
            .map_err(|e| super::checkpoint::called_by_every_rank("load_weights", e))
    }

    /// As [`Engine::load_weights`] (strict), into the variables `only`
    /// names (by VarStore name and shape) and no other: the file must
    /// hold every one of them and nothing else, and every other variable
    /// keeps its values. A part of a model saved apart from it: a LoRA
    /// adapter over its base (`zrt::lora::load_adapter`), a head. The
    /// optimizer starts afresh, as after `load_weights`. A collective.
    pub fn load_weights_of(
        &self,
        path: impl AsRef<Path>,
        only: impl Fn(&str, &[i64]) -> bool,
    ) -> Result<LoadedWeights, EngineError> {
        let part = Part {
            fresh: None,
            only: Some(&only),
        };
        self.load_weights_inner(path.as_ref(), true, part)
            .map_err(|e| super::checkpoint::called_by_every_rank("load_weights_of", e))
    }

    /// The build's load of `ShardPlan::weights_from_file`'s file: strict
    /// but for the variables `fresh` names (`ShardPlan::fresh_weights`),
    /// which the file may lack and which then keep their values.
    pub(super) fn load_weights_except(
        &self,
        path: &Path,
        fresh: Option<&NameRule>,
    ) -> Result<LoadedWeights, EngineError> {
        let part = Part { fresh, only: None };
        self.load_weights_inner(path, true, part)
            .map_err(|e| super::checkpoint::called_by_every_rank("load_weights", e))
    }

    fn load_weights_inner(
        &self,
        path: &Path,
        strict: bool,
        part: Part<'_>,
    ) -> Result<LoadedWeights, EngineError> {
        self.pending_error_but_broken()?;
        let checked = self.check_weights(path, strict, part);
        let checked = self.agree(checked, "load the weights file")?;
        let (crc, len) = checked.file.identity();
        let shown = path.display().to_string();
        self.read_the_same(crc, len as u64, shown, WEIGHTS_READS)?;
        self.apply_weights(&checked)?;
        let r = checked.report;
        tracing::info!(path = %path.display(), loaded = r.loaded, missing = r.missing.len(), unexpected = r.unexpected.len(), "weights loaded");
        if self.inner.first_rank() && !(r.missing.is_empty() && r.unexpected.is_empty()) {
            tracing::warn!(
                "weights file {}: {}",
                path.display(),
                crate::checkpoint::model_diff(&r.missing, &r.unexpected, &[])
            );
        }
        Ok(r)
    }

    /// Maps the file and checks it against the model: names, shapes,
    /// dtypes and byte lengths, without reading a value, against the
    /// variables of `part`.
    fn check_weights(
        &self,
        path: &Path,
        strict: bool,
        part: Part<'_>,
    ) -> Result<Checked, CheckpointError> {
        let file = WeightsFiles::open(path, &self._plan.weight_rules())?;
        let st = self.inner.st.lock();
        let in_file: HashMap<&str, (Dtype, &[usize], usize)> = (file.tensors())
            .map(|(n, d, s, len)| (n, (d, s, len)))
            .collect();
        let trainable = (st.units.iter()).flat_map(|u| &u.layout.slots).map(|s| {
            (
                s.name.clone(),
                s.shape.clone(),
                Kind::Float,
                Accepts::Widened,
            )
        });
        let frozen = (st.frozen.wanted().into_iter()).map(|(n, shape, kind, sharded)| {
            let float = matches!(
                kind,
                Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16
            );
            let reads = match (sharded, float) {
                (true, _) => Accepts::Widened,
                (false, true) => Accepts::AnyFloat,
                (false, false) => Accepts::Exactly(kind),
            };
            (n, shape, kind, reads)
        });
        let mut report = LoadedWeights::default();
        let mut misshaped = Vec::new();
        let mut has = HashSet::new();
        let mut model = HashSet::new();
        let wanted = trainable
            .chain(frozen)
            .filter(|(name, shape, ..)| part.only.is_none_or(|o| o(name, shape)));
        for (name, shape, kind, reads) in wanted {
            model.insert(name.clone());
            let Some(&(dtype, fshape, bytes)) = in_file.get(name.as_str()) else {
                if !part.fresh.is_some_and(|f| f(&name, &shape)) {
                    report.missing.push(name);
                }
                continue;
            };
            let same_shape = fshape.len() == shape.len()
                && fshape.iter().zip(&shape).all(|(&a, &b)| a as i64 == b);
            let numel: usize = fshape.iter().product();
            if !same_shape || !reads.takes(dtype) || bytes != numel * dtype.size() {
                // A matrix of the model's shape reversed is most likely
                // one stored transposed (GPT-2's Conv1D).
                let transposed = matches!((fshape, shape.as_slice()),
                    (&[a, b], &[c, d]) if a as i64 == d && b as i64 == c && a != b);
                let hint = match transposed {
                    true => " (its transpose: ShardPlan::transpose_weights reads it so)",
                    false => "",
                };
                misshaped.push(format!(
                    "{name}: file {dtype:?} {fshape:?}, model {kind:?} {shape:?}{hint}"
                ));
                continue;
            }
            has.insert(name);
        }
        report.unexpected = (in_file.keys())
            .filter(|n| !model.contains(**n))
            .map(|n| n.to_string())
            .collect();
        report.missing.sort();
        report.unexpected.sort();
        misshaped.sort();
        report.loaded = has.len();
        let refused = strict && !(report.missing.is_empty() && report.unexpected.is_empty());
        if !misshaped.is_empty() || refused || has.is_empty() {
            return Err(CheckpointError::WeightsMismatch {
                path: path.to_path_buf(),
                missing: report.missing,
                unexpected: report.unexpected,
                misshaped,
                strict,
            });
        }
        // Stage 3 holds a unit's frozen parameters in one sharded buffer,
        // which a load fills whole.
        for u in &st.units {
            let Some(part) = &u.frozen else { continue };
            let names: Vec<&str> = part.layout.slots.iter().map(|s| s.name.as_str()).collect();
            let lacks: Vec<&str> = (names.iter().copied())
                .filter(|n| !has.contains(*n))
                .collect();
            if !lacks.is_empty() && lacks.len() < names.len() {
                return Err(CheckpointError::Weights {
                    path: path.to_path_buf(),
                    msg: format!(
                        "it lacks frozen {} of unit `{}`, whose frozen parameters stage 3 holds sharded together and loads all or none of; put them in the file",
                        lacks.join(", "),
                        u.name
                    ),
                });
            }
        }
        drop(st);
        Ok(Checked { file, has, report })
    }

    /// Puts the checked file's values into every unit's range and every
    /// frozen variable it holds, the optimizer's state afresh.
    fn apply_weights(&self, c: &Checked) -> Result<(), EngineError> {
        let i = &*self.inner;
        let mut guard = i.st.lock();
        let st = &mut *guard;
        i.drain_prefetch(st)?;
        let moments = i.moments();
        let initial_m = i.cfg.config.optimizer.initial_m();
        for k in 0..st.units.len() {
            let need = i.own_range(&st.units[k]);
            let whole = (st.units[k].layout.slots.iter()).all(|s| c.has.contains(&s.name));
            // A unit the file holds whole is read into zeros (its padding
            // too); one it holds part of keeps the rest of its masters.
            let mut master = match whole {
                true => vec![0.0; need.len()],
                false => self.own_master(st, k)?,
            };
            for (s, elems, dst) in st.units[k].layout.pieces(need.clone()) {
                if c.has.contains(&s.name) {
                    c.file.read_widened(&s.name, elems, &mut master[dst])?;
                }
            }
            let state = OwnedState::afresh(master, moments, initial_m);
            let (u, sh) = (&st.units[k], &mut st.shards[k]);
            i.install(u, sh, k, need, state)?;
            sh.g.fill(0.0);
            sh.reduced = Vec::new();
            // The unit's old master and moments, freed, would otherwise
            // stay resident in glibc's heap (measured: 30-50 MiB a rank
            // on the main job's 101M-parameter GPT at 4 ranks).
            crate::first_rank::give_back_to_the_system();
        }
        st.broken = None;
        st.reduced_in_backward = false;
        st.opt_step = 0;
        st.frozen.load_weights(&c.file, &c.has)?;
        for u in &mut st.units {
            if let Some(part) = &mut u.frozen {
                if part.layout.slots.iter().any(|s| c.has.contains(&s.name)) {
                    part.load(&c.file)?;
                }
            }
        }
        i.share_shards(st)
    }

    /// This rank's fp32 masters of unit `k` over its optimizer range (the
    /// whole unit at stage 0, which keeps them all in memory).
    fn own_master(&self, st: &State, k: usize) -> Result<Vec<f32>, EngineError> {
        let i = &*self.inner;
        let (u, sh) = (&st.units[k], &st.shards[k]);
        Ok(match (i.stage, i.compute) {
            // SAFETY: a read of the fp32 flat tensor (the master at stage
            // 0) under the state lock.
            (0, Compute::F32) => unsafe { elems::<f32>(&u.flat, u.layout.padded) }.to_vec(),
            (0, _) => sh.master.clone(),
            _ => i.shard_state(st, k)?.master.into_owned(),
        })
    }
}
