//! NVMe offload of the optimizer state (`offload_optimizer: {"device":
//! "nvme"}`): the engine side of [`zrt_offload::Swap`].
//!
//! Adam's m and v of this rank's shards always go to the swap file; the
//! fp32 master goes too when the compute dtype is 16-bit (in fp32 training
//! the master *is* the parameters the model runs on, which stay in memory,
//! as DeepSpeed keeps the compute parameters on the device). The step
//! streams every unit's state through the swap's buffers with the same
//! kernel and the same element ranges as in memory, so the result is
//! bit-identical to no offload (LAMB's, which streams the state twice, is
//! within rounding of it: `lamb.rs` says why).

use std::ops::Range;
use std::path::PathBuf;

use zrt_collectives::ProcessGroup;
use zrt_kernels::AdamShard;
use zrt_offload::{Swap, SwapConfig};

use super::v_layout::{VLayout, WHOLE};
use super::{Compute, CopyShard, Inner, Shard, State, Unit};
use crate::config::OffloadDevice;
use crate::{EngineError, Resolved};

/// Whether the swap holds the fp32 master (as its first array).
pub(super) fn swaps_master(compute: Compute) -> bool {
    compute != Compute::F32
}

/// The config's NVMe offload blocks against `stage` and the folders they
/// name: checked before the engine lays out any parameter, so that a
/// mended config builds on the same model (what only the swap file's
/// creation finds, a full or read-only drive, comes later).
pub(super) fn check(cfg: &Resolved, stage: u8) -> Result<(), EngineError> {
    let z = &cfg.config.zero;
    let nvme = |o: &Option<crate::config::OffloadConfig>| {
        o.clone().filter(|o| o.device == OffloadDevice::Nvme)
    };
    let folder = |o: crate::config::OffloadConfig| {
        let path = PathBuf::from(o.nvme_path.unwrap_or_default());
        match path.is_dir() {
            true => Ok(()),
            false => Err(zrt_offload::OffloadError::NoDirectory { path }),
        }
    };
    if let Some(o) = nvme(&z.offload_optimizer) {
        if stage == 0 {
            return Err(EngineError::Unsupported(
                "offload_optimizer needs ZeRO stage 1, 2 or 3 (as in DeepSpeed): set zero_optimization.stage".into(),
            ));
        }
        folder(o)?;
    }
    if let Some(o) = nvme(&z.offload_param) {
        if stage != 3 {
            return Err(EngineError::Unsupported(
                "offload_param needs ZeRO stage 3 (as in DeepSpeed): set zero_optimization.stage to 3 or remove offload_param".into(),
            ));
        }
        folder(o)?;
    }
    Ok(())
}

/// The config's `offload_optimizer` when it asks for NVMe.
fn nvme_optimizer(cfg: &Resolved) -> Option<&crate::config::OffloadConfig> {
    (cfg.config.zero.offload_optimizer.as_ref()).filter(|o| o.device == OffloadDevice::Nvme)
}

/// Whether the optimizer state goes to an NVMe swap (whose arrays keep
/// every element of the optimizer range: Muon's `v` is not packed there).
pub(super) fn swaps_optimizer(cfg: &Resolved) -> bool {
    nvme_optimizer(cfg).is_some()
}

/// Whether anything goes to an NVMe swap (the optimizer state, or stage
/// 3's parameter shards): the build then makes files on a drive that may
/// be too full, after the parameters are laid out.
pub(super) fn swaps_any(cfg: &Resolved) -> bool {
    let params = cfg.config.zero.offload_param.as_ref();
    swaps_optimizer(cfg) || params.is_some_and(|o| o.device == OffloadDevice::Nvme)
}

/// Moves every shard's optimizer state into a new swap file when the config
/// asks for NVMe offload (checked by [`check`]); `None` otherwise.
/// `zero_v`: per unit, the elements whose `v` is always zero (Muon's
/// matrices; empty for other optimizers), which the swap's chunks they
/// cover neither read nor write.
pub(super) fn swap_out(
    cfg: &Resolved,
    compute: Compute,
    rank: usize,
    shards: &mut [Shard],
    zero_v: &[VLayout],
) -> Result<Option<Swap>, EngineError> {
    let Some(o) = nvme_optimizer(cfg) else {
        return Ok(None);
    };
    let dir = PathBuf::from(o.nvme_path.clone().unwrap_or_default());
    let with_master = swaps_master(compute);
    let moments = cfg.config.optimizer.moments();
    if moments + usize::from(with_master) == 0 {
        // SGD without momentum in fp32 keeps no optimizer state at all:
        // its master is the flat tensor itself.
        tracing::warn!(
            "`zero_optimization.offload_optimizer` has nothing to offload: SGD without momentum keeps no optimizer state, and fp32 training's master is the parameters themselves; no swap file is made"
        );
        return Ok(None);
    }
    // Every array of a unit is its optimizer range long: the master when
    // it is swapped (it is still in memory here), else the momentum.
    let lens: Vec<usize> = (shards.iter())
        .map(|s| {
            if with_master {
                s.master.len()
            } else {
                s.m.len()
            }
        })
        .collect();
    let mut swap = Swap::create(
        &SwapConfig {
            dir,
            rank,
            buffer_count: o.buffer_count.max(1) as usize,
            chunk_bytes: cfg.config.aio.block_size as usize,
            direct: true,
        },
        moments + usize::from(with_master),
        &lens,
    )?;
    if moments == 2 {
        // `v` is the last array.
        for (k, holes) in zero_v.iter().enumerate() {
            swap.keep_last_zero(k, |r| holes.covers(r))?;
        }
    }
    for (k, sh) in shards.iter_mut().enumerate() {
        let mut arrays: Vec<&[f32]> = Vec::new();
        if with_master {
            arrays.push(&sh.master);
        }
        // Lion's and SGD's `v` is empty and has no array in the swap, nor
        // has the `m` of SGD without momentum.
        if moments >= 1 {
            arrays.push(&sh.m);
        }
        if moments == 2 {
            arrays.push(&sh.v);
        }
        swap.write_region(k, &arrays)?;
        if with_master {
            sh.master = Vec::new();
        }
        sh.m = Vec::new();
        sh.v = Vec::new();
    }
    tracing::info!(
        file = %swap.path().display(),
        bytes = swap.file_bytes(),
        resident = swap.resident_bytes(),
        direct = swap.direct(),
        "optimizer state offloaded to NVMe"
    );
    Ok(Some(swap))
}

/// This rank's optimizer state of one unit, as owned arrays.
pub(super) struct UnitState {
    /// The fp32 master of the optimizer range, if it lives in the swap.
    pub master: Option<Vec<f32>>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// What a walk over the optimizer state ([`Inner::each_state`]) changes,
/// and so what goes back to the swaps after it: an optimizer's step
/// changes both; LAMB's first pass the moments alone, its second the
/// parameters alone.
#[derive(Debug, Clone, Copy)]
pub(super) struct Writes {
    /// The parameters: the fp32 master (in the optimizer swap under
    /// bf16/fp16) and stage 3's parameter swap.
    pub params: bool,
    /// The moments.
    pub moments: bool,
}

impl Writes {
    /// An optimizer step: parameters and moments.
    pub const ALL: Writes = Writes {
        params: true,
        moments: true,
    };
}

/// A range of one unit's optimizer state, as a walk
/// ([`Inner::each_state`]) hands it out: the fp32 master where it lives
/// apart from the flat tensor (empty when the flat tensor is the master),
/// the reduced gradient, which a walk may overwrite (Muon's passes leave
/// their intermediate results there: the gradient is spent once the step
/// has read it), and the moments (empty for each the optimizer has not).
pub(super) struct StateRange<'a> {
    /// The fp32 master (empty when the flat tensor is the master).
    pub p: &'a mut [f32],
    /// The reduced gradient.
    pub g: &'a mut [f32],
    /// The first moment (empty for an optimizer with none).
    pub m: &'a mut [f32],
    /// The second moment (empty for an optimizer with none), packed as
    /// `v_layout` says: [`VLayout::at`] finds a piece's.
    pub v: &'a mut [f32],
    /// Which elements `v` keeps (in memory, Muon's matrices' are left
    /// out; the swap's chunks keep every one).
    pub v_layout: &'a VLayout,
}

impl<'a> StateRange<'a> {
    /// The same range as the kernels take it (the gradient read-only).
    pub(super) fn adam(self) -> AdamShard<'a> {
        debug_assert!(self.v_layout.is_whole(), "Adam's v is never packed");
        AdamShard {
            p: self.p,
            g: self.g,
            m: self.m,
            v: self.v,
        }
    }
}

impl<G: ProcessGroup + 'static> Inner<G> {
    /// Runs `f` over this rank's optimizer state wherever it lives: each
    /// unit whole when the state is in memory, chunk by chunk through the
    /// swap's stream (read ahead, written behind) when it is offloaded.
    /// `f` gets the unit's index, the unit, elements `r` of its optimizer
    /// range and their state, indexed from `r.start`: `p` the fp32 master
    /// where it lives apart from the flat tensor (empty when the flat
    /// tensor is the master: fp32, stages 0-2), the gradient, the moments
    /// (an empty slice for each the optimizer has not); and the unit's
    /// compute-copy shard. Stage 3's parameter swap pages each unit in
    /// before its first elements and out after its last. What `writes`
    /// says the walk changes goes back to the swaps, nothing else (an
    /// array of the optimizer swap it does not flag is read, never
    /// written).
    pub(super) fn each_state(
        &self,
        st: &mut State,
        stage1: bool,
        writes: Writes,
        mut f: impl FnMut(
            usize,
            &Unit,
            Range<usize>,
            StateRange<'_>,
            &mut CopyShard,
        ) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        let State { units, shards, .. } = st;
        let Some(swap) = &self.swap else {
            for (k, (u, sh)) in units.iter().zip(shards.iter_mut()).enumerate() {
                self.page_in(sh, k, ReadAhead::Update)?;
                let Shard {
                    master,
                    m,
                    v,
                    v_layout,
                    g,
                    reduced,
                    copy,
                } = sh;
                let g: &mut [f32] = if stage1 { reduced } else { g };
                let r = 0..self.own_range(u).len();
                let s = StateRange {
                    p: master,
                    g,
                    m,
                    v,
                    v_layout,
                };
                f(k, u, r, s, copy)?;
                self.page_out(sh, k, writes.params)?;
            }
            return Ok(());
        };
        let with_master = swaps_master(self.compute);
        // The swap's arrays: the master if it is swapped, then each moment.
        let mut flags = vec![writes.params; usize::from(with_master)];
        flags.resize(flags.len() + self.moments(), writes.moments);
        swap.stream_writing(
            &flags,
            |k, r, arrays: &mut [&mut [f32]]| -> Result<(), EngineError> {
                let (u, sh) = (&units[k], &mut shards[k]);
                if r.start == 0 {
                    self.page_in(sh, k, ReadAhead::Update)?;
                }
                let last = r.end == swap.region_len(k);
                let Shard {
                    master,
                    g,
                    reduced,
                    copy,
                    ..
                } = sh;
                let g: &mut [f32] = if stage1 {
                    &mut reduced[r.clone()]
                } else {
                    &mut g[r.clone()]
                };
                let (p, mv): (&mut [f32], &mut [&mut [f32]]) = if with_master {
                    let (p, mv) = arrays.split_at_mut(1);
                    (&mut *p[0], mv)
                } else if master.is_empty() {
                    (&mut [], arrays)
                } else {
                    (&mut master[r.clone()], arrays)
                };
                // Adam's m and v, Lion's or SGD's m alone, or nothing
                // (SGD without momentum): one array per moment.
                let (m, v) = match mv {
                    [m, v] => (&mut **m, &mut **v),
                    [m, ..] => (&mut **m, &mut [][..]),
                    [] => (&mut [][..], &mut [][..]),
                };
                let s = StateRange {
                    p,
                    g,
                    m,
                    v,
                    v_layout: &WHOLE,
                };
                f(k, u, r, s, copy)?;
                if last {
                    self.page_out(sh, k, writes.params)?;
                }
                Ok(())
            },
        )
    }

    /// Reads unit `k`'s optimizer state out of the swap.
    pub(super) fn swapped_state(&self, swap: &Swap, k: usize) -> Result<UnitState, EngineError> {
        let n = swap.region_len(k);
        let with_master = swaps_master(self.compute);
        let moments = self.moments();
        let mut arrays = vec![vec![0f32; n]; moments + usize::from(with_master)];
        let mut refs: Vec<&mut [f32]> = arrays.iter_mut().map(Vec::as_mut_slice).collect();
        swap.read_region(k, &mut refs)?;
        // Lion's and SGD's `v` is empty: the swap holds no array for it,
        // nor for the `m` of SGD without momentum.
        let mut pop = |held: bool| match held {
            true => arrays.pop().unwrap_or_default(),
            false => Vec::new(),
        };
        let v = pop(moments == 2);
        let m = pop(moments >= 1);
        Ok(UnitState {
            master: arrays.pop(),
            m,
            v,
        })
    }

    /// Writes unit `k`'s optimizer state into the swap (`master` when the
    /// swap holds it).
    pub(super) fn swap_in(
        &self,
        swap: &Swap,
        k: usize,
        master: &[f32],
        m: &[f32],
        v: &[f32],
    ) -> Result<(), EngineError> {
        let mut arrays: Vec<&[f32]> = Vec::new();
        if swaps_master(self.compute) {
            arrays.push(master);
        }
        let moments = self.moments();
        if moments >= 1 {
            arrays.push(m);
        }
        if moments == 2 {
            arrays.push(v);
        }
        swap.write_region(k, &arrays)?;
        Ok(())
    }
}

/// Stage 3 with `offload_param: {"device": "nvme"}`: each unit's gather
/// source (its 16-bit shard, or in fp32 training its fp32 master shard)
/// lives in a second swap file and is *paged in* only around its uses (a
/// gather, its optimizer update, a checkpoint), then dropped (or written
/// back, after an update). The next unit's shard is read ahead on a thread
/// while the current one is gathered, and its frozen shard with it.
pub(super) struct ParamSwap {
    swap: std::sync::Arc<Swap>,
    /// The units' sharded frozen parameters (`frozen_shards`), a region
    /// each (empty for units without them); `None` when there are none.
    frozen: Option<std::sync::Arc<FrozenSwap>>,
    /// A read of (unit, words) started ahead of its gather.
    ahead: parking_lot::Mutex<Option<(usize, Ahead)>>,
    /// The frozen shard the last used read-ahead brought: (unit, the
    /// frozen swap's write count when the read began, words).
    ready_frozen: parking_lot::Mutex<Option<(usize, u64, Vec<f32>)>>,
    /// The unit paged in last, to guess the direction (forward or backward).
    last: std::sync::atomic::AtomicUsize,
}

/// What [`Inner::page_in`] reads ahead once its unit is in.
#[derive(Clone, Copy, Debug)]
pub(super) enum ReadAhead {
    /// The page-in is a gather's: read the unit gathered next (the recorded
    /// run order's, else the index's guess) and its frozen shard, which
    /// that gather will need too.
    Gather(Option<usize>),
    /// The page-in is an update's or a write-back's: read the next unit by
    /// index, its trainable shard only. Nothing there uses frozen shards, so
    /// reading them would only be disk traffic thrown away (two thirds of a
    /// block's bytes when its MLP is frozen).
    Update,
}

/// What a read-ahead brings: a unit's gather source and, when it has
/// sharded frozen parameters, their shard with the frozen swap's write
/// count when the read began.
struct Read {
    words: Vec<f32>,
    frozen: Option<(u64, Vec<f32>)>,
}

type Ahead = std::thread::JoinHandle<Result<Read, zrt_offload::OffloadError>>;

/// The frozen shards' swap file (`offload_param`) and how many writes it
/// has had (a load or `with_full_params` writes it; training never does):
/// a shard read ahead is used only if no write came after its read began.
pub(super) struct FrozenSwap {
    pub(super) swap: Swap,
    writes: std::sync::atomic::AtomicU64,
}

impl FrozenSwap {
    /// Writes region `k` (a unit's frozen shard), then counts the write.
    pub(super) fn write(&self, k: usize, words: &[f32]) -> Result<(), EngineError> {
        self.swap.write_region(k, &[words])?;
        self.writes
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Ok(())
    }

    fn writes(&self) -> u64 {
        self.writes.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Copies `src`'s bytes into a Vec of `T` (both plain numbers).
pub(super) fn recast<S: Copy, T: Copy + Default>(src: &[S]) -> Vec<T> {
    let bytes = std::mem::size_of_val(src);
    let mut out = vec![T::default(); bytes / std::mem::size_of::<T>()];
    // SAFETY: both are plain-old-data number types; `out` has room for
    // exactly `bytes` bytes and the regions do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(
            src.as_ptr().cast::<u8>(),
            out.as_mut_ptr().cast::<u8>(),
            bytes,
        )
    };
    out
}

pub(super) fn read_words(swap: &Swap, k: usize) -> Result<Vec<f32>, zrt_offload::OffloadError> {
    let mut w = vec![0f32; swap.region_len(k)];
    swap.read_region(k, &mut [w.as_mut_slice()])?;
    Ok(w)
}

impl ParamSwap {
    /// Words (f32-sized) of unit `k`'s source shard, from the read-ahead if
    /// it holds that unit.
    fn words(&self, k: usize) -> Result<Vec<f32>, EngineError> {
        let pending = self.ahead.lock().take();
        if let Some((j, h)) = pending {
            let got = h.join().map_err(|_| {
                EngineError::Plan("the parameter read-ahead thread panicked".into())
            })?;
            if j == k {
                let read = got?;
                *self.ready_frozen.lock() = read.frozen.map(|(at, w)| (k, at, w));
                return Ok(read.words);
            }
        }
        Ok(read_words(&self.swap, k)?)
    }

    /// Unit `k`'s frozen shard if the read-ahead brought it and nothing
    /// wrote the frozen swap since that read began.
    pub(super) fn frozen_ahead(&self, k: usize) -> Option<Vec<f32>> {
        let fs = self.frozen.as_ref()?;
        match self.ready_frozen.lock().take() {
            Some((j, at, w)) if j == k && at == fs.writes() => Some(w),
            _ => None,
        }
    }

    /// Starts reading the unit paged in after `k`: for a gather, the one
    /// the recorded run order gathers next when known, and its frozen shard
    /// with it; else the one guessed by index (the next one going up, the
    /// previous going down).
    fn read_ahead(&self, k: usize, then: ReadAhead) {
        use std::sync::atomic::Ordering;
        let last = self.last.swap(k, Ordering::Relaxed);
        let guess = if k >= last { k + 1 } else { k.wrapping_sub(1) };
        let (next, with_frozen) = match then {
            ReadAhead::Gather(next) => (next.unwrap_or(guess), true),
            ReadAhead::Update => (guess, false),
        };
        if next >= self.swap.regions() {
            return;
        }
        let swap = self.swap.clone();
        let frozen = self
            .frozen
            .clone()
            .filter(|f| with_frozen && f.swap.region_len(next) > 0);
        let h = std::thread::spawn(move || {
            let words = read_words(&swap, next)?;
            let frozen = match frozen {
                Some(f) => {
                    // Counted before the read: a write during it shows.
                    let at = f.writes();
                    Some((at, read_words(&f.swap, next)?))
                }
                None => None,
            };
            Ok(Read { words, frozen })
        });
        // A previous read-ahead nobody used: let it finish, drop its data.
        if let Some((_, old)) = self.ahead.lock().replace((next, h)) {
            let _ = old.join();
        }
    }

    /// Writes unit `k`'s source shard, first dropping a read-ahead of it,
    /// which holds the values being replaced: a later page-in would take
    /// them from there.
    fn write(&self, k: usize, words: &[f32]) -> Result<(), EngineError> {
        self.cancel_ahead(k);
        self.swap.write_region(k, &[words])?;
        Ok(())
    }

    /// Bytes of memory the swaps' buffers hold, and a frozen shard the
    /// read-ahead brought that no gather has used yet.
    fn resident_bytes(&self) -> usize {
        let ready = self
            .ready_frozen
            .lock()
            .as_ref()
            .map_or(0, |(_, _, w)| 4 * w.len());
        self.swap.resident_bytes()
            + self.frozen.as_ref().map_or(0, |f| f.swap.resident_bytes())
            + ready
    }

    /// Bytes of the swap files (trainable sources and frozen shards).
    fn file_bytes(&self) -> u64 {
        self.swap.file_bytes() + self.frozen.as_ref().map_or(0, |f| f.swap.file_bytes())
    }

    /// Drops a read-ahead of unit `k` (before a write makes it stale).
    fn cancel_ahead(&self, k: usize) {
        let mut ahead = self.ahead.lock();
        if ahead.as_ref().is_some_and(|(j, _)| *j == k) {
            if let Some((_, h)) = ahead.take() {
                let _ = h.join();
            }
        }
    }
}

/// Creates the parameter swap for stage 3 when the config asks for it
/// (checked by [`check`]) and moves every unit's gather source into it.
pub(super) fn params_out(
    cfg: &Resolved,
    rank: usize,
    shards: &mut [Shard],
    units: &mut [Unit],
) -> Result<Option<ParamSwap>, EngineError> {
    let Some(o) = cfg
        .config
        .zero
        .offload_param
        .as_ref()
        .filter(|o| o.device == OffloadDevice::Nvme)
    else {
        return Ok(None);
    };
    let words = |sh: &Shard| match &sh.copy {
        CopyShard::Bf16(v) => recast::<_, f32>(v),
        CopyShard::F16(v) => recast::<_, f32>(v),
        CopyShard::None => sh.master.clone(),
    };
    let sources: Vec<Vec<f32>> = shards.iter().map(words).collect();
    let swap_cfg = SwapConfig {
        dir: PathBuf::from(o.nvme_path.clone().unwrap_or_default()),
        rank,
        buffer_count: o.buffer_count.max(1) as usize,
        chunk_bytes: cfg.config.aio.block_size as usize,
        direct: true,
    };
    let swap = Swap::create(
        &swap_cfg,
        1,
        &sources.iter().map(Vec::len).collect::<Vec<_>>(),
    )?;
    for (k, (w, sh)) in sources.iter().zip(shards.iter_mut()).enumerate() {
        swap.write_region(k, &[w])?;
        match &mut sh.copy {
            CopyShard::Bf16(v) => *v = Vec::new(),
            CopyShard::F16(v) => *v = Vec::new(),
            CopyShard::None => sh.master = Vec::new(),
        }
    }
    tracing::info!(file = %swap.path().display(), bytes = swap.file_bytes(), "stage-3 parameter shards offloaded to NVMe");
    let frozen = match units.iter().any(|u| u.frozen.is_some()) {
        false => None,
        true => {
            let lens: Vec<usize> = units
                .iter()
                .map(|u| u.frozen.as_ref().map_or(0, |p| p.shard_words()))
                .collect();
            let fswap = std::sync::Arc::new(FrozenSwap {
                swap: Swap::create(&swap_cfg, 1, &lens)?,
                writes: std::sync::atomic::AtomicU64::new(0),
            });
            for (k, u) in units.iter_mut().enumerate() {
                if let Some(p) = &mut u.frozen {
                    p.offload(fswap.clone(), k)?;
                }
            }
            tracing::info!(file = %fswap.swap.path().display(), bytes = fswap.swap.file_bytes(), "stage-3 frozen parameter shards offloaded to NVMe");
            Some(fswap)
        }
    };
    Ok(Some(ParamSwap {
        frozen,
        swap: std::sync::Arc::new(swap),
        ahead: parking_lot::Mutex::new(None),
        ready_frozen: parking_lot::Mutex::new(None),
        last: std::sync::atomic::AtomicUsize::new(0),
    }))
}

impl<G: ProcessGroup + 'static> Inner<G> {
    /// Brings unit `k`'s gather source into memory (no-op without a
    /// parameter swap, or when it is already in), and starts reading the
    /// one paged in after it (`then`).
    pub(super) fn page_in(
        &self,
        sh: &mut Shard,
        k: usize,
        then: ReadAhead,
    ) -> Result<(), EngineError> {
        let Some(ps) = &self.pswap else {
            return Ok(());
        };
        match &mut sh.copy {
            CopyShard::Bf16(v) if v.is_empty() => *v = recast(&ps.words(k)?),
            CopyShard::F16(v) if v.is_empty() => *v = recast(&ps.words(k)?),
            CopyShard::None if sh.master.is_empty() => sh.master = ps.words(k)?,
            _ => return Ok(()),
        }
        ps.read_ahead(k, then);
        Ok(())
    }

    /// Drops unit `k`'s gather source from memory, first writing it to the
    /// parameter swap when it changed (`write`).
    pub(super) fn page_out(
        &self,
        sh: &mut Shard,
        k: usize,
        write: bool,
    ) -> Result<(), EngineError> {
        let Some(ps) = &self.pswap else {
            return Ok(());
        };
        if write {
            let words = match &sh.copy {
                CopyShard::Bf16(v) => recast::<_, f32>(v),
                CopyShard::F16(v) => recast::<_, f32>(v),
                CopyShard::None => std::mem::take(&mut sh.master),
            };
            ps.write(k, &words)?;
        }
        match &mut sh.copy {
            CopyShard::Bf16(v) => *v = Vec::new(),
            CopyShard::F16(v) => *v = Vec::new(),
            CopyShard::None => sh.master = Vec::new(),
        }
        Ok(())
    }

    /// Unit `k`'s fp32 master shard from the parameter swap (fp32 stage 3,
    /// where the gather source is the master), leaving it paged out.
    pub(super) fn paged_master(&self, k: usize) -> Result<Vec<f32>, EngineError> {
        match &self.pswap {
            Some(ps) => ps.words(k),
            None => Ok(Vec::new()),
        }
    }

    /// Bytes of memory the parameter swap holds ([`ParamSwap::resident_bytes`]).
    pub(super) fn pswap_resident(&self) -> usize {
        self.pswap.as_ref().map_or(0, ParamSwap::resident_bytes)
    }

    /// Bytes of the parameter swap files ([`ParamSwap::file_bytes`]).
    pub(super) fn pswap_bytes(&self) -> u64 {
        self.pswap.as_ref().map_or(0, ParamSwap::file_bytes)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, AtomicUsize};
    use std::sync::Arc;

    use parking_lot::Mutex;

    use super::*;

    /// A parameter swap of 3 units, each with a trainable and a frozen
    /// region of 8 words holding `10 k` and `100 k`, in a new temporary
    /// directory named for the test (returned, to remove).
    fn three_units(test: &str) -> (PathBuf, ParamSwap) {
        let dir = std::env::temp_dir().join(format!("zrt-pswap-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = SwapConfig {
            dir: dir.clone(),
            rank: 0,
            buffer_count: 1,
            chunk_bytes: 4096,
            direct: false,
        };
        let swap = Swap::create(&cfg, 1, &[8; 3]).unwrap();
        let frozen = FrozenSwap {
            swap: Swap::create(&SwapConfig { rank: 1, ..cfg }, 1, &[8; 3]).unwrap(),
            writes: AtomicU64::new(0),
        };
        for k in 0..3 {
            swap.write_region(k, &[&[10.0 * k as f32; 8]]).unwrap();
            frozen.write(k, &[100.0 * k as f32; 8]).unwrap();
        }
        let ps = ParamSwap {
            swap: Arc::new(swap),
            frozen: Some(Arc::new(frozen)),
            ahead: Mutex::new(None),
            ready_frozen: Mutex::new(None),
            last: AtomicUsize::new(0),
        };
        (dir, ps)
    }

    /// Waits until a read-ahead of unit `k` has finished reading; fails
    /// (instead of spinning forever) when none of `k` was started.
    fn wait_for_read_ahead(ps: &ParamSwap, k: usize) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            match ps.ahead.lock().as_ref() {
                Some((j, h)) if *j == k => {
                    if h.is_finished() {
                        return;
                    }
                }
                other => panic!("no read-ahead of unit {k}: {:?}", other.map(|a| a.0)),
            }
            assert!(
                std::time::Instant::now() < deadline,
                "read-ahead of {k} never finished"
            );
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_frozen_shard_read_ahead_is_used_unless_written_since() {
        let (dir, ps) = three_units("ahead");
        // Unit 0 in: unit 1 is read ahead, frozen shard and all.
        ps.read_ahead(0, ReadAhead::Gather(None));
        assert_eq!(ps.words(1).unwrap(), vec![10.0; 8]);
        assert_eq!(ps.frozen_ahead(1), Some(vec![100.0; 8]));
        assert_eq!(ps.frozen_ahead(1), None, "used once");
        // Unit 1 in: unit 2 is read ahead; then a load rewrites unit 2's
        // frozen shard. The read-ahead is stale and must not be used.
        ps.read_ahead(1, ReadAhead::Gather(Some(2)));
        wait_for_read_ahead(&ps, 2);
        ps.frozen.as_ref().unwrap().write(2, &[7.0; 8]).unwrap();
        assert_eq!(ps.words(2).unwrap(), vec![20.0; 8]);
        assert_eq!(ps.frozen_ahead(2), None);
        // Nor is one of another unit; a known next unit is read, not the
        // index's guess.
        ps.read_ahead(1, ReadAhead::Gather(Some(0)));
        assert_eq!(ps.words(0).unwrap(), vec![0.0; 8]);
        assert_eq!(ps.frozen_ahead(2), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_write_drops_the_read_ahead_of_its_unit_only() {
        let (dir, ps) = three_units("write");
        // Unit 1 is read ahead (old values), then written: the next
        // page-in of unit 1 must see the new values.
        ps.read_ahead(0, ReadAhead::Update);
        // Finished before the write, so a kept read-ahead would be stale.
        wait_for_read_ahead(&ps, 1);
        ps.write(1, &[5.0; 8]).unwrap();
        assert_eq!(ps.words(1).unwrap(), vec![5.0; 8]);
        // A write of another unit leaves the read-ahead to be used.
        ps.read_ahead(1, ReadAhead::Update);
        ps.write(0, &[6.0; 8]).unwrap();
        assert!(ps.ahead.lock().as_ref().is_some_and(|(j, _)| *j == 2));
        assert_eq!(ps.words(2).unwrap(), vec![20.0; 8]);
        assert_eq!(ps.words(0).unwrap(), vec![6.0; 8]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_counts_hold_both_swaps_and_an_unused_frozen_read_ahead() {
        let (dir, ps) = three_units("count");
        let frozen = &ps.frozen.as_ref().unwrap().swap;
        let buffers = ps.swap.resident_bytes() + frozen.resident_bytes();
        assert!(ps.swap.resident_bytes() > 0 && frozen.resident_bytes() > 0);
        assert_eq!(ps.resident_bytes(), buffers);
        assert_eq!(ps.file_bytes(), ps.swap.file_bytes() + frozen.file_bytes());
        assert!(ps.swap.file_bytes() > 0 && frozen.file_bytes() > 0);
        // Unit 1's frozen shard (8 words) is read ahead and held until its
        // gather takes it.
        ps.read_ahead(0, ReadAhead::Gather(Some(1)));
        ps.words(1).unwrap();
        assert_eq!(ps.resident_bytes(), buffers + 8 * 4);
        assert!(ps.frozen_ahead(1).is_some());
        assert_eq!(ps.resident_bytes(), buffers);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_update_reads_ahead_no_frozen_shard() {
        let (dir, ps) = three_units("update");
        // An optimizer step pages unit 0 in: unit 1's trainable shard is
        // read ahead, its frozen shard (no use in a step) is not.
        ps.read_ahead(0, ReadAhead::Update);
        let read = ps
            .ahead
            .lock()
            .take()
            .map(|(k, h)| (k, h.join().unwrap().unwrap()));
        let (k, read) = read.expect("a read-ahead was started");
        assert_eq!((k, read.words), (1, vec![10.0; 8]));
        assert!(
            read.frozen.is_none(),
            "the frozen shard was read for an update"
        );
        // Nothing it brought is held afterwards, and the memory count says so.
        ps.read_ahead(1, ReadAhead::Update);
        assert_eq!(ps.words(2).unwrap(), vec![20.0; 8]);
        assert!(ps.ready_frozen.lock().is_none());
        // A gather's read-ahead does bring it, and it is counted until used.
        ps.read_ahead(2, ReadAhead::Gather(Some(1)));
        assert_eq!(ps.words(1).unwrap(), vec![10.0; 8]);
        assert!(ps.ready_frozen.lock().is_some());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
