//! Saving and loading an engine's state: the engine side of
//! [`crate::checkpoint`] (whose docs describe the files).
//!
//! Both directions run in phases separated by an exchange of success flags,
//! so a failure on any rank becomes an error on every rank (never a hang,
//! never a half-committed checkpoint), and a load changes nothing until
//! every rank has verified everything it needs (every file's checksum and
//! every range it will read; the values themselves are read unit by unit
//! as they are applied, so a load never holds a rank's whole state) and
//! the ranks have checked that they all read the same checkpoint.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;
use zrt_collectives::ProcessGroup;

use super::frozen::{self, Frozen};
use super::groups;
use super::{Compute, Engine, OwnedState, Scaler, State};
use crate::checkpoint::consolidate::{encode, export_metadata};
use crate::checkpoint::files::{
    f32_bytes, json_with_crc, sync_dir, Planned, RankFile, Sink, TensorWriter,
};
use crate::checkpoint::{
    rank_file_name, replica_grads_file_name, resolve_tag, write_atomic, CheckpointError,
    ExportLayout, FrozenMeta, Locator, Meta, SlotMeta, UnitMeta, Whose, FORMAT, FROZEN_FILE,
};
use crate::config::OptimizerKind;
use crate::{glue, EngineError};

/// Reads elements `need` of unit `u`'s state (zero moments for
/// `ModuleOnly`) from the files `read_checkpoint` checked; `moments` is
/// how many this run's optimizer keeps (the `v` of Lion, Adagrad, SGD and
/// RMSprop without momentum stays empty, and the `m` of SGD without
/// momentum).
fn read_state(
    loc: &mut Locator,
    u: &super::Unit,
    need: Range<usize>,
    what: What,
    moments: usize,
) -> Result<OwnedState, CheckpointError> {
    let mut state = OwnedState::afresh(vec![0.0; need.len()], moments, 0.0);
    for (s, elems, dst) in u.layout.pieces(need) {
        loc.read_param(
            &s.name,
            "master",
            elems.clone(),
            &mut state.master[dst.clone()],
        )?;
        if what == What::Everything && moments >= 1 {
            loc.read_param(&s.name, "m", elems.clone(), &mut state.m[dst.clone()])?;
            if moments == 2 {
                loc.read_param(&s.name, "v", elems, &mut state.v[dst])?;
            }
        }
    }
    Ok(state)
}

/// What an optimizer keeping `moments` moments holds per element, in words.
fn moments_held(moments: usize) -> &'static str {
    match moments {
        2 => "two moments, m and v",
        1 => "one moment, m",
        _ => "no moment",
    }
}

/// The tensors of a parameter's state that a rank file holds: the master
/// and the moments of an optimizer keeping `moments` of them.
fn state_parts(moments: usize) -> &'static [&'static str] {
    match moments {
        2 => &["master", "m", "v"],
        1 => &["master", "m"],
        _ => &["master"],
    }
}

/// The optimizer a checkpoint's run trained with and how many moments its
/// rank files hold (an optimizer zrt does not know: Adam's two, which
/// every checkpoint from before Lion holds; SGD's and RMSprop's buffer if
/// its recorded momentum is above 0).
fn saved_optimizer(meta: &Meta) -> (OptimizerKind, usize) {
    let kind = OptimizerKind::from_name(meta.optimizer()).unwrap_or(OptimizerKind::Adam);
    (kind, kind.moments(meta.momentum() > 0.0 || meta.centered()))
}

/// The name of unit `unit`'s accumulated gradient in a rank file or a
/// replica's gradient file.
fn grad_name(unit: &str) -> String {
    format!("{unit}/grad")
}

/// Checks that `f` holds unit `unit`'s accumulated gradient of `len`
/// elements.
fn check_grad(f: &RankFile, unit: &str, len: usize) -> Result<(), CheckpointError> {
    let name = grad_name(unit);
    let n = f.f32_len(&name)?;
    if n != len {
        return Err(CheckpointError::format(
            f.path(),
            format!("`{name}` holds {n} elements, this engine accumulates {len}"),
        ));
    }
    Ok(())
}

/// Unit `unit`'s accumulated gradient of `len` elements from `f`.
fn read_grad(f: &RankFile, unit: &str, len: usize) -> Result<Vec<f32>, CheckpointError> {
    check_grad(f, unit, len)?;
    let mut g = vec![0.0; len];
    f.read_f32(&grad_name(unit), 0..len, &mut g)?;
    Ok(g)
}

/// What a load applies.
#[derive(Clone, Copy, PartialEq, Eq)]
enum What {
    /// The training state: parameters, optimizer, counters, scaler, RNG.
    Everything,
    /// The parameters only (`load_checkpoint_module_only`).
    ModuleOnly,
}

/// Everything a load verified, applied only once every rank has.
struct Loaded {
    tag: String,
    meta: Meta,
    /// The rank files, checked; each unit reads its part in `apply`.
    loc: Locator,
    rng: Option<Vec<u8>>,
    /// Where this rank's accumulated gradients come from.
    grads: Grads,
    /// The frozen variables' values (`None`: the checkpoint predates them).
    frozen: Option<frozen::Values>,
}

/// Where a load takes this rank's accumulated gradients from: decided
/// once, in `read_checkpoint`, which checks them there, and `apply`
/// reads them there.
enum Grads {
    /// None were saved (a checkpoint at a boundary), or the load is of the
    /// module only: they start from zero.
    Zero,
    /// This rank's rank file.
    Rank,
    /// This replica's own file: hybrid stage 1 saved between boundaries,
    /// a replica after the first (its local sums are not the first's).
    Replica(RankFile),
}

impl Grads {
    /// The file holding this rank's gradients (`None`: zero them).
    fn file<'a>(
        &'a self,
        loc: &'a mut Locator,
        rank: usize,
    ) -> Result<Option<&'a RankFile>, CheckpointError> {
        match self {
            Grads::Zero => Ok(None),
            Grads::Rank => loc.file(rank).map(Some),
            Grads::Replica(f) => Ok(Some(f)),
        }
    }
}

/// How ranks' reads are told apart and named: by a CRC-32 of what each
/// read (the checkpoint's meta.json, a weights file's header) and a number
/// worth showing (the step, the file's length).
#[derive(Clone, Copy)]
pub(super) struct Reads {
    /// The number in words: "step 5", "1024 bytes".
    pub(super) detail: fn(u64) -> String,
    /// What the CRC is of: "meta.json crc".
    pub(super) crc_of: &'static str,
    /// The error naming what each rank read.
    pub(super) error: fn(Vec<String>) -> CheckpointError,
}

/// A checkpoint's reads.
const CHECKPOINT_READS: Reads = Reads {
    detail: |step| format!("step {step}"),
    crc_of: "meta.json crc",
    error: CheckpointError::NotTheSame,
};

/// What each world rank read, from its (CRC, detail, path): one phrase
/// per distinct read, ranks that read the same named together; the CRC is
/// shown where one path and detail hold different contents (the same
/// directory on two nodes' own disks).
fn what_each_read(reads: &[(u64, u64, String)], how: Reads) -> Vec<String> {
    // (CRC, path and detail), and the ranks that read it.
    let keys = (reads.iter()).map(|(crc, n, path)| (*crc, format!("{path} ({}", (how.detail)(*n))));
    let seen = by_rank(keys);
    let shared = |it: &str| seen.iter().filter(|((_, x), _)| x == it).count() > 1;
    seen.iter()
        .map(|((crc, it), ranks)| {
            let crc = match shared(it) {
                true => format!(", {} {crc:08x}", how.crc_of),
                false => String::new(),
            };
            format!("{ranks} read {it}{crc})")
        })
        .collect()
}

/// Groups the ranks (their index in `values`) by the value each gave, in
/// the order of each value's first rank: (value, "rank 2" or "ranks 0,
/// 1"), for an error naming what every rank did.
fn by_rank<T: PartialEq>(values: impl IntoIterator<Item = T>) -> Vec<(T, String)> {
    let mut seen: Vec<(T, Vec<String>)> = Vec::new();
    for (r, v) in values.into_iter().enumerate() {
        match seen.iter_mut().find(|(x, _)| *x == v) {
            Some((_, rs)) => rs.push(r.to_string()),
            None => seen.push((v, vec![r.to_string()])),
        }
    }
    (seen.into_iter())
        .map(|(v, rs)| {
            let s = if rs.len() > 1 { "s" } else { "" };
            (v, format!("rank{s} {}", rs.join(", ")))
        })
        .collect()
}

/// A save or load whose collectives met another call, a rank that left or
/// a timeout: most often not every rank called it. Says so, keeping the
/// collectives' own words.
pub(super) fn called_by_every_rank(what: &str, e: EngineError) -> EngineError {
    use zrt_collectives::CommError as C;
    match e {
        EngineError::Comm(c @ (C::Mismatch { .. } | C::RankDied { .. } | C::Timeout { .. })) => {
            EngineError::CallOrder(format!(
                "{what} is a collective: every rank calls it, at the same point of the program (not only under `if rank == 0`); if every rank did, a rank failed or is stuck. The collectives said: {c}"
            ))
        }
        e => e,
    }
}

/// A name for one save's staging directory that no earlier save used:
/// the time in nanoseconds and the process id, mixed.
fn save_token() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 40)
}

/// Removes the staging directories earlier saves of `tag` left in `dir`
/// (a crash, or a failure its cleanup could not finish): `.TAG.partial`
/// (as zrt named them before) and `.TAG.partial-<16 hex digits>`, not
/// another tag's that happens to start alike.
fn remove_stagings(dir: &Path, tag: &str) {
    let prefix = format!(".{tag}.partial");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return; // no directory yet: nothing left behind
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let ours = match name.strip_prefix(&prefix) {
            Some("") => true,
            Some(rest) => rest
                .strip_prefix('-')
                .is_some_and(|t| t.len() == 16 && t.bytes().all(|b| b.is_ascii_hexdigit())),
            None => false,
        };
        if ours {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn check_tag(tag: &str) -> Result<(), CheckpointError> {
    if tag.is_empty() || tag.contains('/') || tag.starts_with('.') || tag == "latest" {
        return Err(CheckpointError::BadTag(tag.to_string()));
    }
    Ok(())
}

fn io<T>(op: &'static str, path: &Path, r: std::io::Result<T>) -> Result<T, CheckpointError> {
    r.map_err(|e| CheckpointError::io(op, path, e))
}

/// What keeps a checkpoint saved between accumulation boundaries
/// (`meta`) from loading into an engine at `stage` on `mesh` (replicate,
/// shard sizes) with `st`'s units: its accumulated gradients are laid out
/// for the engine that saved them. `None` if nothing does.
fn mid_step_differs(meta: &Meta, st: &State, stage: u8, mesh: (usize, usize)) -> Option<String> {
    if meta.stage != stage {
        return Some(format!(
            "saved at stage {}, loading at stage {stage}",
            meta.stage
        ));
    }
    if meta.mesh != mesh {
        let (a, b) = (meta.mesh, mesh);
        return Some(format!(
            "saved on a mesh of {} x {} ranks (replicas x shard group), loading on {} x {}",
            a.0, a.1, b.0, b.1
        ));
    }
    let saved: Vec<_> = meta.units.iter().map(|u| (&*u.name, u.padded)).collect();
    let here: Vec<_> = st
        .units
        .iter()
        .map(|u| (&*u.name, u.layout.padded))
        .collect();
    if saved != here {
        let show = |v: &[(&str, usize)]| {
            v.iter()
                .map(|(n, p)| format!("{n} ({p})"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Some(format!(
            "its units (elements) were {}, here they are {} (another ShardedModule wrapping, or at stage 3 another stage3_param_persistence_threshold)",
            show(&saved),
            show(&here)
        ));
    }
    None
}

impl<G: ProcessGroup + 'static> Engine<G> {
    /// Turns this rank's outcome of one phase into every rank's: an error
    /// anywhere is an error everywhere (this rank's own, or one naming the
    /// ranks that failed).
    pub(super) fn agree<T>(
        &self,
        local: Result<T, CheckpointError>,
        what: &'static str,
    ) -> Result<T, EngineError> {
        let flag = u8::from(local.is_err());
        // This all_gather(u8 x 1) is `CHECKPOINT_AGREEMENT`: a training
        // collective that meets it is named as a peer checkpointing, so
        // training must never issue one of the same signature.
        let (_, flags) = self.inner.group.all_gather(vec![flag], Vec::new()).wait()?;
        // Hybrid sharding: the other shard groups' outcomes too.
        let flags = match &self.inner.replicate {
            Some(r) => {
                let mine = u8::from(flags.iter().any(|&f| f != 0));
                let (_, groups) = r.all_gather(vec![mine], Vec::new()).wait()?;
                if groups.iter().any(|&f| f != 0) && mine == 0 {
                    // Another shard group failed: name its world ranks
                    // (group g holds ranks g*S .. g*S+S-1).
                    let s = flags.len();
                    groups
                        .iter()
                        .flat_map(|&f| std::iter::repeat_n(f, s))
                        .collect()
                } else {
                    flags
                }
            }
            None => flags,
        };
        let failed: Vec<usize> = flags
            .iter()
            .enumerate()
            .filter(|(_, &f)| f != 0)
            .map(|(r, _)| r)
            .collect();
        match local {
            Err(e) => Err(e.into()),
            Ok(_) if !failed.is_empty() => Err(CheckpointError::Peers {
                ranks: failed,
                what,
            }
            .into()),
            Ok(v) => Ok(v),
        }
    }

    /// Saves a checkpoint as `DIR/TAG` (a collective: every rank calls it
    /// with the same arguments) and, once every rank's files are durable,
    /// points `DIR/latest` at it. Each rank writes its shards of the fp32
    /// master weights and Adam state (and, between accumulation boundaries,
    /// its accumulated gradients) and its RNG state; rank 0 writes
    /// `meta.json`. On any rank's failure every rank gets an error and the
    /// previous checkpoint and `latest` are untouched. An existing `TAG` is
    /// replaced. Returns `DIR/TAG`.
    pub fn save_checkpoint(
        &self,
        dir: impl AsRef<Path>,
        tag: &str,
    ) -> Result<PathBuf, EngineError> {
        self.save_checkpoint_with(dir, tag, &serde_json::Value::Null)
    }

    /// [`Engine::save_checkpoint`] with `client_state`, the program's own
    /// state (DeepSpeed's `client_state`: an epoch, a data position), which
    /// [`Engine::load_checkpoint_with`] hands back. World rank 0's is saved
    /// (in `meta.json`).
    pub fn save_checkpoint_with(
        &self,
        dir: impl AsRef<Path>,
        tag: &str,
        client_state: &serde_json::Value,
    ) -> Result<PathBuf, EngineError> {
        self.save_inner(dir.as_ref(), tag, client_state)
            .map_err(|e| called_by_every_rank("save_checkpoint", e))
    }

    fn save_inner(
        &self,
        dir: &Path,
        tag: &str,
        client_state: &serde_json::Value,
    ) -> Result<PathBuf, EngineError> {
        let i = &*self.inner;
        check_tag(tag)?;
        {
            let mut st = i.st.lock();
            self.take_error(&mut st)?;
        }
        // Under hybrid sharding one shard group (replica 0) writes; world
        // rank 0 (its shard rank 0) also writes meta.json and commits.
        let writer = i.replica() == 0;
        // Every replica's RNG state goes to the writer: replicas draw
        // different dropout masks, and each must resume its own stream.
        let rngs = self.replica_rngs()?;
        let rank = if writer { i.group.rank() } else { usize::MAX };
        let target = dir.join(tag);
        // 1. Rank 0 makes an empty staging directory for everyone, named
        // for this save: a staging directory a failed save left behind
        // (removed here, but on another rank's storage perhaps not) never
        // takes this save's files.
        let token = match rank {
            0 => save_token(),
            _ => 0,
        };
        let staging_of = |token: u64| dir.join(format!(".{tag}.partial-{token:016x}"));
        let made = if rank == 0 {
            remove_stagings(dir, tag);
            let staging = staging_of(token);
            io(
                "create directory",
                &staging,
                std::fs::create_dir_all(&staging),
            )
        } else {
            Ok(())
        };
        self.agree(made, "save the checkpoint")?;
        let cleanup = |e| {
            if rank == 0 {
                let _ = std::fs::remove_dir_all(staging_of(token));
            }
            e
        };
        // Every rank is saving now (the agreement above is where a rank
        // still training meets the save): check they save the same tag,
        // and learn rank 0's staging directory, before anything is written.
        let token = self.same_tag(tag, token).map_err(cleanup)?;
        let staging = staging_of(token);
        // Every rank must see it: a rank given another directory, or on a
        // node whose storage is not rank 0's, would write where rank 0
        // never commits.
        let sees = match staging.is_dir() {
            true => Ok(()),
            false => Err(CheckpointError::NotShared(dir.to_path_buf())),
        };
        self.agree(sees, "save the checkpoint").map_err(cleanup)?;
        // 2. Every rank writes its file; rank 0 also meta.json.
        let wrote = {
            let mut st = i.st.lock();
            let drained = i.drain_prefetch(&mut st).map_err(|e| {
                CheckpointError::Incompatible(format!("finishing gathers in flight: {e}"))
            });
            // The writers' shard group gathers stage 3's sharded frozen
            // parameters into rank 0's frozen file (a collective in it).
            let frozen = match (writer, drained) {
                (true, Ok(())) => self.save_frozen(&st, &staging, rank == 0),
                (_, d) => d.map(|()| Vec::new()),
            };
            let mut r = match (writer, frozen) {
                (_, Err(e)) => Err(e),
                (true, Ok(f)) => match &rngs {
                    Ok(rngs) => self.write_rank_file(&st, &staging, rngs).map(|()| f),
                    Err(e) => Err(e.clone()),
                },
                (false, Ok(f)) => match self.replicas_keep_own_grads(&st) {
                    true => self.write_replica_grads(&st, &staging).map(|()| f),
                    false => Ok(f),
                },
            };
            if rank == 0 {
                if let Ok(f) = r {
                    r = self
                        .write_meta(&st, &staging, tag, client_state, f)
                        .map(|()| Vec::new());
                }
            }
            r.map(drop)
        };
        if let Err(e) = self.agree(wrote, "save the checkpoint") {
            if rank == 0 {
                let _ = std::fs::remove_dir_all(&staging);
            }
            return Err(e);
        }
        // 3. Rank 0 moves the complete directory into place, then `latest`.
        let committed = if rank == 0 {
            commit(dir, &staging, &target, tag)
        } else {
            Ok(())
        };
        self.agree(committed, "save the checkpoint")?;
        tracing::info!(dir = %target.display(), "checkpoint saved");
        Ok(target)
    }

    /// This rank's libtorch CPU RNG state and, under hybrid sharding, its
    /// replicas' (a collective over the replicate group), in replica order.
    /// A rank whose state cannot be read still takes part in the gather
    /// (with nothing), so its peers get the error instead of a hang.
    fn replica_rngs(&self) -> Result<Result<Vec<Vec<u8>>, CheckpointError>, EngineError> {
        let own = glue::cpu_rng_state()
            .map_err(|e| CheckpointError::Incompatible(format!("reading the RNG state: {e}")));
        let Some(r) = &self.inner.replicate else {
            return Ok(own.map(|v| vec![v]));
        };
        let len = own.as_ref().map_or(0, Vec::len);
        let lens = r.all_gather(vec![len as i64], Vec::new()).wait()?.1;
        let all = r
            .all_gather_v(own.clone().unwrap_or_default(), Vec::new())
            .wait()?
            .1;
        if let Some(j) = lens.iter().position(|&l| l <= 0) {
            return Ok(Err(CheckpointError::Incompatible(format!(
                "replica {j} could not read its RNG state"
            ))));
        }
        let mut at = 0;
        Ok(Ok(lens
            .iter()
            .map(|&l| {
                let v = all[at..at + l as usize].to_vec();
                at += l as usize;
                v
            })
            .collect()))
    }

    /// Writes this rank's file, one unit's state at a time (a unit's
    /// shard is read from the swap only when its turn comes, so saving
    /// never holds the whole of an offloaded optimizer state).
    fn write_rank_file(
        &self,
        st: &State,
        dir: &Path,
        rngs: &[Vec<u8>],
    ) -> Result<(), CheckpointError> {
        let i = &*self.inner;
        let (rank, world) = (i.group.rank(), i.group.size());
        let pending = st.micro != st.boundary_at;
        // Replica 0's (this rank's) RNG state as `rng`, replica j's as
        // `rng/replica{j}`.
        let rng_name = |j: usize| match j {
            0 => "rng".to_string(),
            _ => format!("rng/replica{j}"),
        };
        let mut plan = Vec::new();
        for (u, sh) in st.units.iter().zip(&st.shards) {
            let n = u.layout.shard(rank).len() as i64;
            for part in state_parts(i.moments()) {
                plan.push(Planned::new(
                    &format!("{}/{part}", u.name),
                    Dtype::F32,
                    &[n],
                ));
            }
            if pending {
                let g = sh.g.len() as i64;
                plan.push(Planned::new(&grad_name(&u.name), Dtype::F32, &[g]));
            }
        }
        for (j, rng) in rngs.iter().enumerate() {
            plan.push(Planned::new(&rng_name(j), Dtype::U8, &[rng.len() as i64]));
        }
        let meta = Whose {
            replica: None,
            rank,
            world,
        }
        .header();
        let path = dir.join(rank_file_name(rank, world));
        let mut w = TensorWriter::create(&path, &plan, meta)?;
        for (k, (u, sh)) in st.units.iter().zip(&st.shards).enumerate() {
            let state = i
                .shard_state(st, k)
                .map_err(|e| CheckpointError::format(&path, e.to_string()))?;
            w.write(&format!("{}/master", u.name), f32_bytes(&state.master))?;
            // Lion, Adagrad, SGD and RMSprop without momentum keep no
            // `v`, SGD without momentum no `m` either (an
            // empty one is still Adam's, of a unit with no trainable
            // element on this rank).
            if i.moments() >= 1 {
                w.write(&format!("{}/m", u.name), f32_bytes(&state.m))?;
            }
            if i.moments() == 2 {
                w.write(&format!("{}/v", u.name), f32_bytes(&state.v))?;
            }
            if pending {
                w.write(&grad_name(&u.name), f32_bytes(&sh.g))?;
            }
        }
        for (j, rng) in rngs.iter().enumerate() {
            w.write(&rng_name(j), rng)?;
        }
        w.finish()
    }

    /// Whether each replica must save its own accumulated gradients: stage
    /// 1 under hybrid sharding between accumulation boundaries. Stage 1
    /// sums each rank's micro-steps locally until the boundary, so the
    /// replicas' sums differ; the other stages average every micro-step
    /// across the replicas, which then hold the same gradients.
    fn replicas_keep_own_grads(&self, st: &State) -> bool {
        let i = &*self.inner;
        st.micro != st.boundary_at && i.stage == 1 && i.replicate.is_some()
    }

    /// A replica after the first writes its accumulated gradients (see
    /// [`Engine::replicas_keep_own_grads`]) to a file of its own.
    fn write_replica_grads(&self, st: &State, dir: &Path) -> Result<(), CheckpointError> {
        let i = &*self.inner;
        let (rank, world, replica) = (i.group.rank(), i.group.size(), i.replica());
        let plan: Vec<_> = st
            .units
            .iter()
            .zip(&st.shards)
            .map(|(u, sh)| Planned::new(&grad_name(&u.name), Dtype::F32, &[sh.g.len() as i64]))
            .collect();
        let meta = Whose {
            replica: Some(replica),
            rank,
            world,
        }
        .header();
        let path = dir.join(replica_grads_file_name(replica, rank, world));
        let mut w = TensorWriter::create(&path, &plan, meta)?;
        for (u, sh) in st.units.iter().zip(&st.shards) {
            w.write(&grad_name(&u.name), f32_bytes(&sh.g))?;
        }
        w.finish()
    }

    /// Rank 0's `meta.json`, listing the `frozen` variables its frozen
    /// file holds.
    fn write_meta(
        &self,
        st: &State,
        dir: &Path,
        tag: &str,
        client_state: &serde_json::Value,
        frozen: Vec<FrozenMeta>,
    ) -> Result<(), CheckpointError> {
        let i = &*self.inner;
        let world = i.group.size();
        let c = &i.cfg.config;
        let meta = Meta {
            format: FORMAT.into(),
            zrt_version: env!("CARGO_PKG_VERSION").into(),
            tag: tag.into(),
            world,
            mesh: i.mesh(),
            stage: i.stage,
            compute: match i.compute {
                Compute::F32 => "fp32",
                Compute::Bf16 => "bf16",
                Compute::F16 => "fp16",
            }
            .into(),
            global_step: st.step,
            optimizer_step: Some(st.opt_step),
            micro_steps: st.micro,
            boundary_at: st.boundary_at,
            skipped_steps: st.skipped,
            lr: st.lr,
            lr_set: st.lr_set,
            loss_scaler: st.scaler.as_ref().map(Scaler::meta),
            grads_saved: st.micro != st.boundary_at,
            units: st
                .units
                .iter()
                .map(|u| UnitMeta {
                    name: u.name.clone(),
                    padded: u.layout.padded,
                    shard_len: u.layout.shard_len(),
                    slots: u
                        .layout
                        .slots
                        .iter()
                        .map(|s| SlotMeta {
                            name: s.name.clone(),
                            shape: s.shape.clone(),
                            offset: s.offset,
                            numel: s.numel,
                        })
                        .collect(),
                })
                .collect(),
            files: (0..world).map(|r| rank_file_name(r, world)).collect(),
            replica_grad_files: match self.replicas_keep_own_grads(st) {
                true => {
                    let replicas = i.mesh().0;
                    (1..replicas)
                        .flat_map(|j| (0..world).map(move |r| replica_grads_file_name(j, r, world)))
                        .collect()
                }
                false => Vec::new(),
            },
            frozen: Some(frozen),
            no_weight_decay: Some(i.settings.excluded()),
            lr_scales: Some(i.settings.lr_scales()),
            muon: (c.optimizer.kind == OptimizerKind::Muon).then(|| i.settings.muon()),
            client_state: client_state.clone(),
            config: serde_json::json!({
                "zero_optimization": {"stage": c.zero.stage},
                "train_batch_size": i.cfg.batch.train,
                "train_micro_batch_size_per_gpu": i.cfg.batch.micro,
                "gradient_accumulation_steps": i.cfg.batch.gas,
                "gradient_clipping": c.gradient_clipping,
                "optimizer": {
                    "type": c.optimizer.kind.name(),
                    "lr": c.optimizer.lr.value(),
                    "betas": [c.optimizer.betas.0, c.optimizer.betas.1],
                    "eps": c.optimizer.eps,
                    "weight_decay": c.optimizer.weight_decay.value(),
                    "adam_w_mode": c.optimizer.adam_w_mode,
                    "bias_correction": c.optimizer.bias_correction,
                    "momentum": c.optimizer.momentum,
                    "dampening": c.optimizer.dampening,
                    "nesterov": c.optimizer.nesterov,
                    "maximize": c.optimizer.maximize,
                    "max_coeff": c.optimizer.max_coeff,
                    "min_coeff": c.optimizer.min_coeff,
                    "eps_inside_sqrt": c.optimizer.eps_inside_sqrt,
                    "lr_decay": c.optimizer.lr_decay,
                    "initial_accumulator_value": c.optimizer.initial_accumulator_value,
                    "alpha": c.optimizer.alpha,
                    "centered": c.optimizer.centered,
                    "adam_lr": c.optimizer.adam_lr,
                    "ns_steps": c.optimizer.ns_steps,
                    "ns_coefficients": c.optimizer.ns_coefficients,
                    "match_rms_adamw": c.optimizer.match_rms_adamw,
                },
                "precision": format!("{:?}", c.precision),
                "scheduler": format!("{:?}", c.scheduler),
            }),
        };
        let body = serde_json::to_string_pretty(&meta)
            .map_err(|e| CheckpointError::format(dir.join("meta.json"), e.to_string()))?;
        write_atomic(&dir.join("meta.json"), json_with_crc(&body).as_bytes())
    }

    /// Loads checkpoint `DIR/TAG` (`tag` `None`: the tag `DIR/latest` names)
    /// into this engine (a collective) and returns the tag. On the world
    /// size, stage and model it was saved from, training goes on exactly as
    /// if it had never stopped (fp32: bit-identical). On another world size
    /// or stage the shards are re-cut from the saved ranges (DeepSpeed's
    /// universal checkpoint); the model's parameter names and shapes must
    /// match. Nothing changes unless every rank verified
    /// everything it needs. It also restores libtorch's (process-global)
    /// CPU random generator to the state this rank saved.
    pub fn load_checkpoint(
        &self,
        dir: impl AsRef<Path>,
        tag: Option<&str>,
    ) -> Result<String, EngineError> {
        self.load_checkpoint_with(dir, tag).map(|(tag, _)| tag)
    }

    /// [`Engine::load_checkpoint`], returning the tag and the client state
    /// saved with it ([`Engine::save_checkpoint_with`]; `null` if none).
    pub fn load_checkpoint_with(
        &self,
        dir: impl AsRef<Path>,
        tag: Option<&str>,
    ) -> Result<(String, serde_json::Value), EngineError> {
        self.load_inner(dir.as_ref(), tag, What::Everything)
            .map_err(|e| called_by_every_rank("load_checkpoint", e))
    }

    /// The latest checkpoint in `dir`, loaded as
    /// [`Engine::load_checkpoint_with`] loads it (its tag and client
    /// state), or `None` when `dir` holds none yet (no `DIR/latest`; the
    /// engine is untouched): what a program that may have been started
    /// again (`zrt launch --max-restarts`, a scheduler's requeue) calls
    /// before training, to go on from where the job stopped or start
    /// afresh. A collective. Ranks that disagree on whether there is one
    /// (a directory some ranks do not see) all get an error naming them,
    /// and nothing loads: a rank starting afresh beside ranks that resumed
    /// would train another model unsaid.
    pub fn resume_from(
        &self,
        dir: impl AsRef<Path>,
    ) -> Result<Option<(String, serde_json::Value)>, EngineError> {
        let dir = dir.as_ref();
        let seen = self
            .each_ranks(dir.join("latest").exists())
            .map_err(|e| called_by_every_rank("resume_from", e))?;
        if seen.iter().all(|&s| !s) {
            return Ok(None);
        }
        if seen.iter().all(|&s| s) {
            return self.load_checkpoint_with(dir, None).map(Some);
        }
        let ranks = |want: bool| {
            let r: Vec<String> = (seen.iter().enumerate())
                .filter(|(_, &s)| s == want)
                .map(|(r, _)| r.to_string())
                .collect();
            format!("rank(s) {}", r.join(", "))
        };
        // Each rank knows only its own path (the same string may name
        // another disk on another node).
        Err(CheckpointError::NotTheSame(vec![
            format!("{} found one", ranks(true)),
            format!(
                "{} found none (in {}, as this rank sees it)",
                ranks(false),
                dir.display()
            ),
        ])
        .into())
    }

    /// Every world rank's `flag`, in world rank order (under hybrid
    /// sharding shard group g holds ranks g*S .. g*S+S-1).
    fn each_ranks(&self, flag: bool) -> Result<Vec<bool>, EngineError> {
        // `CHECKPOINT_AGREEMENT`'s signature (all_gather of u8 x 1): a
        // peer in training that meets it is named as checkpointing, which
        // this rank is.
        let (_, flags) = (self.inner.group)
            .all_gather(vec![u8::from(flag)], Vec::new())
            .wait()?;
        let flags = match &self.inner.replicate {
            Some(r) => r.all_gather(flags, Vec::new()).wait()?.1,
            None => flags,
        };
        Ok(flags.into_iter().map(|f| f != 0).collect())
    }

    /// Loads only the model from checkpoint `DIR/TAG` (a collective), for
    /// fine-tuning from a pre-training run: DeepSpeed's
    /// `load_checkpoint(.., load_module_only=True)`. The parameters (fp32
    /// masters, their compute copies and the frozen variables) take the
    /// saved values, on any world size or stage as with
    /// [`Engine::load_checkpoint`]; the optimizer starts afresh, as a new
    /// one would (Adam's moments at zero, Adagrad's sums at their initial
    /// value, and the step count that bias correction, SGD's first step and
    /// Adagrad's rate decay go by at 0); the engine's step count,
    /// learning-rate schedule, loss scaler and random generator are not
    /// touched, and
    /// gradients accumulated since the last step are dropped (call it
    /// before training, or right after a `step`). Returns the tag and the
    /// client state saved with it.
    pub fn load_checkpoint_module_only(
        &self,
        dir: impl AsRef<Path>,
        tag: Option<&str>,
    ) -> Result<(String, serde_json::Value), EngineError> {
        self.load_inner(dir.as_ref(), tag, What::ModuleOnly)
            .map_err(|e| called_by_every_rank("load_checkpoint_module_only", e))
    }

    /// Fails with an error a collective left pending, as every engine
    /// call does, but not with the one of gradients a failed backward
    /// left unusable: a load is the way out of those (it replaces them).
    pub(super) fn pending_error_but_broken(&self) -> Result<(), EngineError> {
        let mut st = self.inner.st.lock();
        let broken = st.broken.take();
        let pending = self.take_error(&mut st);
        st.broken = broken;
        pending
    }

    fn load_inner(
        &self,
        dir: &Path,
        tag: Option<&str>,
        what: What,
    ) -> Result<(String, serde_json::Value), EngineError> {
        self.pending_error_but_broken()?;
        let read = self.read_checkpoint(dir.as_ref(), tag, what);
        let loaded = self.agree(read, "load the checkpoint")?;
        self.same_checkpoint(dir, &loaded)?;
        let tag = loaded.tag.clone();
        let client_state = loaded.meta.client_state.clone();
        let saved_decay = loaded.meta.no_weight_decay.clone();
        // Checkpoints from before scales were recorded had none.
        let saved_scales = loaded.meta.lr_scales.clone().unwrap_or_default();
        self.apply(loaded, what)?;
        if what == What::Everything && self.inner.first_rank() {
            let now = &self.inner.settings;
            let decay = saved_decay.and_then(|saved| groups::changed(&saved, &now.excluded()));
            let scales = groups::lr_changed(&saved_scales, &now.lr_scales());
            for change in decay.into_iter().chain(scales) {
                tracing::warn!("{change}");
            }
        }
        tracing::info!(tag = %tag, module_only = what == What::ModuleOnly, "checkpoint loaded");
        Ok((tag, client_state))
    }

    /// Checks that every rank of the world read the same checkpoint (a
    /// CRC-32 of its meta.json as read): ranks given other tags or
    /// directories would each load their own, and the model would mix
    /// shards of different steps without an error. When they differ,
    /// every rank fails naming what each read, before anything is applied.
    fn same_checkpoint(&self, dir: &Path, loaded: &Loaded) -> Result<(), EngineError> {
        let path = dir.join(&loaded.tag);
        let meta = serde_json::to_vec(&loaded.meta)
            .map_err(|e| CheckpointError::format(path.join("meta.json"), e.to_string()))?;
        let crc = crc32fast::hash(&meta);
        let path = path.display().to_string();
        self.read_the_same(crc, loaded.meta.global_step, path, CHECKPOINT_READS)
    }

    /// Checks that every rank of the world read the same thing, by the
    /// CRC-32 `crc` of what this rank read at `path` and a number `n`
    /// worth showing (`how` names them). When they differ, every rank
    /// fails naming what each read, before anything is applied.
    pub(super) fn read_the_same(
        &self,
        crc: u32,
        n: u64,
        path: String,
        how: Reads,
    ) -> Result<(), EngineError> {
        let i = &*self.inner;
        // Per rank: CRC-32, the number, the path's length.
        let mine = vec![i64::from(crc), n as i64, path.len() as i64];
        let what = || "this rank compared what it read with the other ranks'".to_string();
        let all = super::agree::world_gather(&i.group, i.replicate.as_ref(), mine, false, what)?;
        let each: Vec<(u64, u64, usize)> = all
            .chunks(3)
            .map(|c| match c {
                &[crc, n, len] => (crc as u64, n as u64, len as usize),
                _ => (0, 0, 0),
            })
            .collect();
        if each.iter().all(|e| e.0 == each[0].0) {
            return Ok(());
        }
        // Every rank saw the same CRCs, so every rank is here. World rank
        // r is the r-th part (the shard groups in replica order).
        let lens: Vec<usize> = each.iter().map(|x| x.2).collect();
        let paths = super::agree::world_parts(
            &i.group,
            i.replicate.as_ref(),
            path.into_bytes(),
            &lens,
            what,
        )?;
        let reads: Vec<_> = each
            .iter()
            .zip(paths)
            .map(|(&(crc, n, _), p)| (crc, n, String::from_utf8_lossy(&p).into_owned()))
            .collect();
        Err((how.error)(what_each_read(&reads, how)).into())
    }

    /// Checks that every rank of the world saves under `tag`, and returns
    /// world rank 0's `token` (its staging directory's name; the others
    /// give 0). Ranks given other tags would write their files into other
    /// staging directories, which rank 0 never commits. When they differ,
    /// every rank fails naming each rank's tag.
    fn same_tag(&self, tag: &str, token: u64) -> Result<u64, EngineError> {
        let i = &*self.inner;
        let mine = vec![
            i64::from(crc32fast::hash(tag.as_bytes())),
            tag.len() as i64,
            token as i64,
        ];
        let what = || "this rank compared the tag it saves under with the other ranks'".to_string();
        let all = super::agree::world_gather(&i.group, i.replicate.as_ref(), mine, false, what)?;
        // World rank 0 is the first part.
        if all.chunks(3).all(|c| c[..2] == all[..2]) {
            return Ok(all[2] as u64);
        }
        let lens: Vec<usize> = all.chunks(3).map(|c| c[1] as usize).collect();
        let tags = super::agree::world_parts(
            &i.group,
            i.replicate.as_ref(),
            tag.as_bytes().to_vec(),
            &lens,
            what,
        )?;
        let each = by_rank(tags.iter().map(|t| String::from_utf8_lossy(t).into_owned()))
            .into_iter()
            .map(|(t, ranks)| format!("{ranks} saved under `{t}`"))
            .collect();
        Err(CheckpointError::DifferentTags(each).into())
    }

    /// Reads and verifies the checkpoint for a load of `what` (the
    /// accumulated gradients only for `Everything`).
    fn read_checkpoint(
        &self,
        dir: &Path,
        tag: Option<&str>,
        what: What,
    ) -> Result<Loaded, CheckpointError> {
        let i = &*self.inner;
        let rank = i.group.rank();
        let (tag, tag_dir) = resolve_tag(dir, tag)?;
        let meta = Meta::read(&tag_dir)?;
        let st = i.st.lock();
        check_model(&st, &meta)?;
        let frozen = frozen_values(&st, &meta, &tag_dir)?;
        for f in meta.files.iter().chain(&meta.replica_grad_files) {
            let p = tag_dir.join(f);
            if !p.is_file() {
                return Err(CheckpointError::Missing { path: p });
            }
        }
        let grads = self.grads_to_load(&st, &meta, &tag_dir, what)?;
        if what == What::Everything {
            self.check_optimizer(&meta)?;
        }
        // Everything a unit will read is checked now (its files mapped and
        // verified, every range present), and read only when the unit's
        // turn comes in `apply`: one unit's state in memory at a time.
        // A module-only load reads the masters alone.
        let parts = match what {
            What::Everything => state_parts(i.moments()),
            What::ModuleOnly => &["master"][..],
        };
        let mut loc = Locator::new(&meta, &tag_dir);
        for u in &st.units {
            let need = i.own_range(u);
            for (s, elems, _) in u.layout.pieces(need) {
                for what in parts {
                    loc.check_param(&s.name, what, elems.clone())?;
                }
            }
        }
        for (u, sh) in st.units.iter().zip(&st.shards) {
            if let Some(f) = grads.file(&mut loc, rank)? {
                check_grad(f, &u.name, sh.g.len())?;
            }
        }
        let rng = rng_stream(&mut loc, &meta, rank, i.replica())?;
        Ok(Loaded {
            tag,
            meta,
            loc,
            rng,
            grads,
            frozen,
        })
    }

    /// Where this rank's accumulated gradients come from: none (a
    /// checkpoint at a boundary, or a module-only load), its rank file,
    /// or under hybrid stage 1 its replica's own; a checkpoint saved
    /// between boundaries that this engine cannot resume is refused.
    fn grads_to_load(
        &self,
        st: &State,
        meta: &Meta,
        tag_dir: &Path,
        what: What,
    ) -> Result<Grads, CheckpointError> {
        let i = &*self.inner;
        let (rank, world) = (i.group.rank(), i.group.size());
        let replica = i.replica();
        // A module-only load reads the parameters alone.
        let load_grads = meta.grads_saved && what == What::Everything;
        if load_grads {
            if let Some(differs) = mid_step_differs(meta, st, i.stage, i.mesh()) {
                return Err(CheckpointError::Incompatible(format!(
                    "it was saved between accumulation boundaries (micro-step {}, last boundary at {}), with its gradients, which load only into the engine that accumulated them: {differs}. Load it with the same stage, mesh and ShardedModule wrapping, or save right after a step() at an accumulation boundary, which loads anywhere",
                    meta.micro_steps, meta.boundary_at
                )));
            }
        }
        // Hybrid stage 1: replicas after the first read their own sums.
        Ok(match (load_grads, meta.stage == 1 && replica > 0) {
            (false, _) => Grads::Zero,
            (true, false) => Grads::Rank,
            (true, true) => {
                let name = replica_grads_file_name(replica, rank, world);
                if !meta.replica_grad_files.contains(&name) {
                    return Err(CheckpointError::Incompatible(format!(
                        "it was saved between accumulation boundaries at stage 1 under hybrid sharding by a zrt that kept only the first replica's gradients (no `{name}`), so replica {replica} cannot resume its own; load one saved right after a step() at an accumulation boundary"
                    )));
                }
                let f = RankFile::open(&tag_dir.join(&name))?;
                let whose = Whose {
                    replica: Some(replica),
                    rank,
                    world,
                };
                whose.check(&f)?;
                Grads::Replica(f)
            }
        })
    }

    /// Refuses a checkpoint whose optimizer state this engine's optimizer
    /// cannot take (another optimizer's, other moments, or Muon's
    /// matrices chosen otherwise), naming the setting that would take it.
    fn check_optimizer(&self, meta: &Meta) -> Result<(), CheckpointError> {
        let i = &*self.inner;
        let kind = i.cfg.config.optimizer.kind;
        let saved = meta.optimizer();
        let (saved_kind, held) = saved_optimizer(meta);
        // RMSprop's `v` is the momentum buffer, or, centered, the
        // gradient's average: as many moments, not the same.
        let centered = i.cfg.config.optimizer.centered;
        let centered_differs = kind == OptimizerKind::Rmsprop && meta.centered() != centered;
        let differs = !kind.same_state(saved_kind) || held != i.moments() || centered_differs;
        if differs {
            // SGD or RMSprop with and without momentum (or centered): the
            // same optimizer, whose settings decide the state.
            let mend = match (kind.same_state(saved_kind), centered_differs) {
                (true, true) => format!(
                    "or set `optimizer.params.centered` to the saved run's {}",
                    meta.centered()
                ),
                (true, false) => format!(
                    "or set `optimizer.params.momentum` to the saved run's {}",
                    meta.momentum()
                ),
                (false, _) => format!("or set `optimizer.type` to \"{saved}\""),
            };
            let state = |moments, centered| match (moments, centered) {
                (2, true) if kind == OptimizerKind::Rmsprop => {
                    "two moments, m and v: the square average and the gradient's average"
                }
                (2, false) if kind == OptimizerKind::Rmsprop => {
                    "two moments, m and v: the square average and the momentum buffer"
                }
                (n, _) => moments_held(n),
            };
            let saved_state = match kind.same_state(saved_kind) {
                true => state(held, meta.centered()),
                false => moments_held(held),
            };
            return Err(CheckpointError::Incompatible(format!(
                "its run trained with {saved}, whose optimizer state ({saved_state}) is not {}'s ({}). Load it with load_checkpoint_module_only to start {} from its parameters with zero moments, {mend}",
                kind.name(),
                state(i.moments(), centered),
                kind.name(),
            )));
        }
        if kind == OptimizerKind::Muon {
            let saved = meta.muon.clone().unwrap_or_default();
            if let Some(change) = groups::muon_changed(&saved, &i.settings.muon()) {
                return Err(CheckpointError::Incompatible(format!(
                    "{change}: a Muon parameter's saved m is its momentum buffer, an AdamW one's its first moment, and neither reads as the other. Give ShardPlan::use_muon the saved run's rule, or load it with load_checkpoint_module_only to start the optimizer from its parameters with zero moments"
                )));
            }
        }
        Ok(())
    }

    fn apply(&self, l: Loaded, what: What) -> Result<(), EngineError> {
        let i = &*self.inner;
        let rank = i.group.rank();
        let mut guard = i.st.lock();
        let st = &mut *guard;
        i.drain_prefetch(st)?;
        let mut loc = l.loc;
        for (k, (u, sh)) in st.units.iter().zip(st.shards.iter_mut()).enumerate() {
            let need = i.own_range(u);
            let mut state = read_state(&mut loc, u, need.clone(), what, i.moments())?;
            if what == What::ModuleOnly {
                // Moments start afresh, as in a new engine (Adagrad's sum
                // at its initial_accumulator_value).
                state.m.fill(i.cfg.config.optimizer.initial_m());
            }
            i.install(u, sh, k, need, state)?;
            // `read_checkpoint` checked that every saved gradient is there
            // and of this engine's length.
            match l.grads.file(&mut loc, rank)? {
                Some(f) => sh.g = read_grad(f, &u.name, sh.g.len())?,
                None => sh.g.fill(0.0),
            }
            sh.reduced = Vec::new();
        }
        // Every unit's accumulated gradient was just replaced: a boundary
        // backward's reduction of the old ones serves no step.
        st.broken = None;
        st.reduced_in_backward = false;
        if what == What::Everything {
            let m = &l.meta;
            st.step = m.global_step;
            st.opt_step = m.optimizer_step.unwrap_or(m.global_step);
            st.micro = m.micro_steps;
            st.boundary_at = m.boundary_at;
            st.step_called_at = m.micro_steps;
            st.skipped = m.skipped_steps;
            st.lr = m.lr;
            // A config `scheduler` sets the rate at every step, and
            // refuses set_lr: a rate the saved run set does not override it.
            st.lr_set = m.lr_set.filter(|_| i.cfg.config.scheduler.is_none());
            st.norm = None;
            // The monitors' train loss must not mix in losses of
            // micro-batches the load undid (a step resumed mid-way
            // reports the mean of those it sees).
            st.loss_sum = None;
            if let (Some(s), Some(saved)) = (st.scaler.as_mut(), &m.loss_scaler) {
                s.restore(saved);
            }
            if let Some(rng) = &l.rng {
                glue::set_cpu_rng_state(rng)?;
            }
        } else {
            // The moments start afresh, and their step count with them;
            // the schedules go on from the engine's own step.
            st.opt_step = 0;
        }
        if let Some(v) = &l.frozen {
            st.frozen.restore(v)?;
            for u in &mut st.units {
                if let (Some(p), Some(f)) = (&mut u.frozen, &v.file) {
                    p.load(f)?;
                }
            }
        }
        i.share_shards(st)
    }

    /// Writes the whole model in the compute dtype (bf16/fp16 training:
    /// 16-bit; fp32: fp32) to one safetensors file at `path`, under the
    /// model's VarStore names: DeepSpeed's `save_16bit_model` (with
    /// `stage3_gather_16bit_weights_on_model_save`). A collective: the
    /// parameters are gathered one unit at a time and rank 0 writes each
    /// as it comes, so no rank holds the whole model.
    pub fn save_16bit_model(&self, path: impl AsRef<Path>) -> Result<(), EngineError> {
        self.save_16bit_model_as(path, None, &ExportLayout::new())
    }

    /// As [`Engine::save_16bit_model`], into the directory `dir` as
    /// Hugging Face's sharded checkpoint (`save_pretrained` with
    /// `max_shard_size`): files of at most `max_shard_bytes` bytes of
    /// tensors each (a larger tensor alone in its own),
    /// `model-0000k-of-0000n.safetensors`, and their index
    /// `model.safetensors.index.json`; a model that fits in one file is
    /// `model.safetensors`, with no index. [`Engine::load_weights`] reads
    /// either. A collective, as `save_16bit_model`.
    pub fn save_16bit_model_sharded(
        &self,
        dir: impl AsRef<Path>,
        max_shard_bytes: u64,
    ) -> Result<(), EngineError> {
        self.save_16bit_model_as(dir, Some(max_shard_bytes), &ExportLayout::new())
    }

    /// As [`Engine::save_16bit_model`] (`max_shard_bytes` `None`: one file
    /// at `path`) or [`Engine::save_16bit_model_sharded`] (`Some`: a
    /// directory), each tensor named and laid out as `layout` says: a
    /// model whose VarStore is not the file's consumer's, written in that
    /// program's names and layout. A fine-tuned GPT-2 for `transformers`:
    ///
    /// ```no_run
    /// # fn f(engine: &zrt_zero::Engine<zrt_collectives::local::LocalGroup>) -> Result<(), zrt_zero::EngineError> {
    /// use zrt_zero::ExportLayout;
    /// let conv1d = ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"];
    /// let layout = ExportLayout::new()
    ///     .rename(|n| format!("transformer.{n}"))
    ///     .transpose(move |n| conv1d.iter().any(|w| n.ends_with(w)));
    /// engine.save_16bit_model_as("gpt2-tuned", Some(5 << 30), &layout)?;
    /// # Ok(()) }
    /// ```
    ///
    /// A layout giving two tensors one name, transposing one that is not
    /// a matrix, or naming a path for a file, is refused on every rank
    /// before anything is gathered; a file that cannot be written fails
    /// every rank's call. A transposed matrix is transposed on the
    /// writing rank, one tensor at a time.
    pub fn save_16bit_model_as(
        &self,
        path: impl AsRef<Path>,
        max_shard_bytes: Option<u64>,
        layout: &ExportLayout,
    ) -> Result<(), EngineError> {
        let path = path.as_ref();
        let i = &*self.inner;
        let float = i.compute.kind();
        let dtype = file_dtype(Some(float));
        // Every rank lays the file out (the same way, so a refused variable
        // fails on all of them before any gather), rank 0 writes it as the
        // gathers come: one unit's parameters at a time, never the model.
        let (plan, meta) = {
            let st = i.st.lock();
            let mut plan: Vec<Planned> = st
                .units
                .iter()
                .flat_map(|u| &u.layout.slots)
                .map(|s| Planned::new(&s.name, dtype, &s.shape))
                .collect();
            if !layout.is_trainable_only() {
                plan.extend(frozen_plan(&st, Some(float))?);
            }
            // Frozen values a stage-3 unit holds packed are exported
            // unpacked: the file's metadata names them.
            (plan, export_metadata(packed_frozen(&st)))
        };
        let (plan, names) = layout.apply(&plan, path, max_shard_bytes)?;
        let out = (path, max_shard_bytes);
        let mut sink = Sink::open(i.group.rank() == 0, out, &plan, meta).named(names);
        let units = i.st.lock().units.len();
        for k in 0..units {
            let Some(full) = self.whole_master(k)? else {
                continue;
            };
            if sink.wants() {
                for s in &i.st.lock().units[k].layout.slots {
                    sink.write(&s.name, &encode(&full[s.offset..s.offset + s.numel], dtype));
                }
            }
        }
        // The tensors that do not train belong to the model too
        // (floating-point ones in the export's dtype, as DeepSpeed's
        // half-precision module holds them). A collective at stage 3; a
        // write error on rank 0 reaches every rank through the agreement.
        if !layout.is_trainable_only() {
            let mut st = i.st.lock();
            i.drain_prefetch(&mut st)?;
            self.stream_frozen(&st, Some(float), &mut sink)?;
        }
        let written = sink.finish().and_then(|()| match i.group.rank() {
            0 => layout.write_files(path, max_shard_bytes.is_some(), dtype),
            _ => Ok(()),
        });
        self.agree(written, "write the model file")
    }
}

impl<G: ProcessGroup + 'static> Engine<G> {
    /// Rank 0's frozen file in the checkpoint being staged in `dir` (when
    /// the model has frozen variables; `write`: this is rank 0), gathered
    /// unit by unit with the rest of the shard group; what `meta.json`
    /// lists of it.
    fn save_frozen(
        &self,
        st: &State,
        dir: &Path,
        write: bool,
    ) -> Result<Vec<FrozenMeta>, CheckpointError> {
        let gathering = |e: EngineError| {
            CheckpointError::Incompatible(format!("gathering frozen parameters: {e}"))
        };
        let plan = frozen_plan(st, None).map_err(gathering)?;
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        let path = dir.join(FROZEN_FILE);
        let mut sink = Sink::open(write && !plan.is_empty(), (&path, None), &plan, meta);
        self.stream_frozen(st, None, &mut sink).map_err(gathering)?;
        sink.finish()?;
        let mut metas = Frozen::metas(&plan);
        // Which of them a stage-3 unit held packed: their saved values are
        // the unpacked ones (`zrt ckpt inspect` says so; a run that does
        // not pack them is told when it loads them).
        let packed = packed_frozen(st);
        for m in &mut metas {
            m.quantized = packed.contains(m.name.as_str());
        }
        Ok(metas)
    }

    /// Writes the frozen variables to `sink` as [`frozen_plan`] lists
    /// them: stage 3's sharded ones gathered unit by unit (a collective
    /// over the group, which every rank joins whether it writes or not),
    /// so no rank holds more than one unit's at a time; then the
    /// replicated ones. No gather may be in flight.
    fn stream_frozen(
        &self,
        st: &State,
        float: Option<tch::Kind>,
        sink: &mut Sink,
    ) -> Result<(), EngineError> {
        for p in st.units.iter().filter_map(|u| u.frozen.as_ref()) {
            let full = p.whole(&self.inner.group)?;
            for (s, &saved) in p.layout.slots.iter().zip(&p.saved) {
                if sink.wants() {
                    let v = &full[s.offset..s.offset + s.numel];
                    sink.write(&s.name, &encode(v, sharded_dtype(saved, float)));
                }
            }
        }
        st.frozen.write(float, sink);
        Ok(())
    }
}

/// The dtype an export's parameters are written in: `float` when given,
/// else fp32.
fn file_dtype(float: Option<tch::Kind>) -> Dtype {
    match float {
        Some(tch::Kind::BFloat16) => Dtype::BF16,
        Some(tch::Kind::Half) => Dtype::F16,
        _ => Dtype::F32,
    }
}

/// The dtype a sharded frozen parameter the model created in `saved` is
/// written in: an export's `float` when given, else `saved` (checkpoints
/// keep the model's dtype, as for replicated frozen variables).
fn sharded_dtype(saved: Dtype, float: Option<tch::Kind>) -> Dtype {
    match float {
        Some(_) => file_dtype(float),
        None => saved,
    }
}

/// The frozen parameters this engine holds packed as int8
/// (`zero_quantized_nontrainable_weights`).
fn packed_frozen(st: &State) -> HashSet<&str> {
    st.units
        .iter()
        .filter_map(|u| u.frozen.as_ref().filter(|p| p.packed()))
        .flat_map(|p| p.layout.slots.iter().map(|s| s.name.as_str()))
        .collect()
}

/// The frozen tensors a model file holds, in the order
/// [`Engine::stream_frozen`] writes them: each stage-3 unit's sharded
/// ones, then the replicated ones.
fn frozen_plan(st: &State, float: Option<tch::Kind>) -> Result<Vec<Planned>, EngineError> {
    let mut plan: Vec<Planned> = st
        .units
        .iter()
        .filter_map(|u| u.frozen.as_ref())
        .flat_map(|p| p.layout.slots.iter().zip(&p.saved))
        .map(|(s, &saved)| Planned::new(&s.name, sharded_dtype(saved, float), &s.shape))
        .collect();
    plan.extend(st.frozen.plan(float)?);
    Ok(plan)
}

/// Moves the complete staging directory to `target` and then rewrites
/// `latest`: a crash in between leaves `latest` at the previous tag.
fn commit(dir: &Path, staging: &Path, target: &Path, tag: &str) -> Result<(), CheckpointError> {
    sync_dir(staging)?;
    if target.exists() {
        let old = dir.join(format!(".{tag}.old"));
        let _ = std::fs::remove_dir_all(&old);
        io("rename", target, std::fs::rename(target, &old))?;
        io("rename", staging, std::fs::rename(staging, target))?;
        let _ = std::fs::remove_dir_all(&old);
    } else {
        io("rename", staging, std::fs::rename(staging, target))?;
    }
    sync_dir(dir)?;
    write_atomic(&dir.join("latest"), format!("{tag}\n").as_bytes())
}

/// Every parameter of the engine as (name, shape).
fn param_shapes(st: &State) -> impl Iterator<Item = (&str, &[i64])> {
    st.units.iter().flat_map(|u| {
        u.layout
            .slots
            .iter()
            .map(|s| (s.name.as_str(), s.shape.as_slice()))
    })
}

/// The checkpoint must hold exactly this model's parameters and shapes.
fn check_model(st: &State, meta: &Meta) -> Result<(), CheckpointError> {
    let ours: HashMap<&str, &[i64]> = param_shapes(st).collect();
    let saved: HashMap<&str, &[i64]> = meta
        .params()
        .map(|s| (s.name.as_str(), s.shape.as_slice()))
        .collect();
    let mut missing: Vec<String> = ours
        .keys()
        .filter(|k| !saved.contains_key(*k))
        .map(|k| k.to_string())
        .collect();
    let mut unexpected: Vec<String> = saved
        .keys()
        .filter(|k| !ours.contains_key(*k))
        .map(|k| k.to_string())
        .collect();
    let mut misshaped: Vec<String> = ours
        .iter()
        .filter_map(|(k, s)| {
            saved
                .get(k)
                .filter(|t| t != &s)
                .map(|t| format!("{k}: checkpoint {t:?}, model {s:?}"))
        })
        .collect();
    if missing.is_empty() && unexpected.is_empty() && misshaped.is_empty() {
        return Ok(());
    }
    missing.sort();
    unexpected.sort();
    misshaped.sort();
    Err(CheckpointError::ModelMismatch {
        missing,
        unexpected,
        misshaped,
    })
}

/// The frozen variables' values a checkpoint holds, read into this
/// run's layout (`None`: the checkpoint predates them, and they keep
/// their values, with a warning).
fn frozen_values(
    st: &State,
    meta: &Meta,
    tag_dir: &Path,
) -> Result<Option<frozen::Values>, CheckpointError> {
    Ok(match &meta.frozen {
        Some(saved) => {
            // Written only when there is something to hold.
            let f = match saved.is_empty() {
                true => None,
                false => Some(RankFile::open(&tag_dir.join(FROZEN_FILE))?),
            };
            let values = st.frozen.read(saved, f)?;
            // Rounded values going into parameters this run holds
            // exactly: say so once (resuming a packing run is silent).
            let packed = packed_frozen(st);
            let rounded = saved
                .iter()
                .filter(|s| s.quantized && !packed.contains(s.name.as_str()))
                .count();
            if rounded > 0 {
                tracing::warn!("{rounded} frozen parameter(s) in checkpoint {} hold values unpacked from int8 (its run set `zero_optimization.zero_quantized_nontrainable_weights`): they load as saved, rounded, not as the base's true values", tag_dir.display());
            }
            Some(values)
        }
        None => {
            if !st.frozen.is_empty() {
                tracing::warn!("the checkpoint was written before zrt saved frozen variables (requires_grad false): they keep their current values");
            }
            None
        }
    })
}

/// The random-number stream rank `rank` of replica `replica` resumes
/// (`None`: a rank the saved world did not have).
fn rng_stream(
    loc: &mut Locator,
    meta: &Meta,
    rank: usize,
    replica: usize,
) -> Result<Option<Vec<u8>>, CheckpointError> {
    // Replica j resumes replica j's stream when the checkpoint has it
    // (saved on a mesh with that many replicas), else replica 0's.
    Ok(match rank < meta.world {
        true => {
            let f = loc.file(rank)?;
            let own = (replica > 0)
                .then(|| f.bytes(&format!("rng/replica{replica}")).ok())
                .flatten();
            Some(match own {
                Some((_, b)) => b.to_vec(),
                None => f.bytes("rng")?.1.to_vec(),
            })
        }
        false => None,
    })
}

#[cfg(test)]
mod tests {
    use super::{remove_stagings, what_each_read};

    #[test]
    fn a_save_removes_its_tags_stale_staging_folders_and_no_others() {
        let dir = std::env::temp_dir().join(format!("zrt-stagings-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let names = [
            ".a.partial",
            ".a.partial-0123456789abcdef",
            ".a.partial-x.partial-0123456789abcdef",
            ".a.partial-0123",
            ".ab.partial",
            "a",
        ];
        for n in names {
            std::fs::create_dir_all(dir.join(n)).unwrap();
        }
        remove_stagings(&dir, "a");
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                ".a.partial-0123",
                ".a.partial-x.partial-0123456789abcdef",
                ".ab.partial",
                "a"
            ]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn each_checkpoint_read_is_named_once_with_its_ranks_and_a_crc_where_paths_agree() {
        let r = |crc, step, p: &str| (crc, step, p.to_string());
        let reads = [
            r(1, 1, "d/a"),
            r(2, 2, "d/b"),
            r(1, 1, "d/a"),
            r(3, 2, "d/b"),
        ];
        assert_eq!(
            what_each_read(&reads, super::CHECKPOINT_READS),
            [
                "ranks 0, 2 read d/a (step 1)",
                "rank 1 read d/b (step 2, meta.json crc 00000002)",
                "rank 3 read d/b (step 2, meta.json crc 00000003)",
            ]
        );
    }
}
