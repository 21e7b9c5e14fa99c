//! NVMe offload of the optimizer state (`offload_optimizer: {"device":
//! "nvme"}`): the engine side of [`zrt_offload::Swap`].
//!
//! Adam's m and v of this rank's shards always go to the swap file; the
//! fp32 master goes too when the compute dtype is 16-bit (in fp32 training
//! the master *is* the parameters the model runs on, which stay in memory,
//! as DeepSpeed keeps the compute parameters on the device). The step
//! streams every unit's state through the swap's buffers with the same
//! kernel and the same element ranges as in memory, so the result is
//! bit-identical to no offload.

use std::path::PathBuf;

use zrt_collectives::ProcessGroup;
use zrt_kernels::AdamShard;
use zrt_offload::{Swap, SwapConfig};

use super::{Compute, Inner, Shard, State, Update};
use crate::config::OffloadDevice;
use crate::{EngineError, Resolved};

/// Whether the swap holds the fp32 master (as its first array).
pub(super) fn swaps_master(compute: Compute) -> bool {
    compute != Compute::F32
}

/// Moves every shard's optimizer state into a new swap file when the config
/// asks for NVMe offload; `None` otherwise.
pub(super) fn swap_out(
    cfg: &Resolved,
    stage: u8,
    compute: Compute,
    rank: usize,
    shards: &mut [Shard],
) -> Result<Option<Swap>, EngineError> {
    let Some(o) = cfg
        .config
        .zero
        .offload_optimizer
        .as_ref()
        .filter(|o| o.device == OffloadDevice::Nvme)
    else {
        return Ok(None);
    };
    if stage == 0 {
        return Err(EngineError::Unsupported(
            "offload_optimizer needs ZeRO stage 1, 2 or 3 (as in DeepSpeed): set zero_optimization.stage".into(),
        ));
    }
    let dir = PathBuf::from(o.nvme_path.clone().unwrap_or_default());
    let with_master = swaps_master(compute);
    let swap = Swap::create(
        &SwapConfig {
            dir,
            rank,
            buffer_count: o.buffer_count.max(1) as usize,
            chunk_bytes: cfg.config.aio.block_size as usize,
            direct: true,
        },
        2 + usize::from(with_master),
        &shards.iter().map(|s| s.m.len()).collect::<Vec<_>>(),
    )?;
    for (k, sh) in shards.iter_mut().enumerate() {
        let mut arrays: Vec<&[f32]> = Vec::new();
        if with_master {
            arrays.push(&sh.master);
        }
        arrays.push(&sh.m);
        arrays.push(&sh.v);
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

impl<G: ProcessGroup + 'static> Inner<G> {
    /// The Adam step of every unit, streamed through the swap.
    pub(super) fn adam_swapped(
        &self,
        swap: &Swap,
        st: &mut State,
        up: &Update<'_>,
        stage1: bool,
    ) -> Result<(), EngineError> {
        let with_master = swaps_master(self.compute);
        let State { units, shards, .. } = st;
        swap.stream(
            |k, r, arrays: &mut [&mut [f32]]| -> Result<(), EngineError> {
                let (u, sh) = (&units[k], &mut shards[k]);
                let Shard {
                    master,
                    g,
                    reduced,
                    copy,
                    ..
                } = sh;
                let g: &[f32] = if stage1 {
                    &reduced[r.clone()]
                } else {
                    &g[r.clone()]
                };
                let (p, mv): (&mut [f32], &mut [&mut [f32]]) = if with_master {
                    let (p, mv) = arrays.split_at_mut(1);
                    (&mut *p[0], mv)
                } else if master.is_empty() {
                    (&mut [], arrays)
                } else {
                    (&mut master[r.clone()], arrays)
                };
                let (m, v) = mv.split_at_mut(1);
                self.adam_on(
                    u,
                    r,
                    AdamShard {
                        p,
                        g,
                        m: &mut *m[0],
                        v: &mut *v[0],
                    },
                    copy,
                    up,
                )
            },
        )
    }

    /// Reads unit `k`'s optimizer state out of the swap.
    pub(super) fn swapped_state(&self, swap: &Swap, k: usize) -> Result<UnitState, EngineError> {
        let n = swap.region_len(k);
        let with_master = swaps_master(self.compute);
        let mut arrays = vec![vec![0f32; n]; 2 + usize::from(with_master)];
        let mut refs: Vec<&mut [f32]> = arrays.iter_mut().map(Vec::as_mut_slice).collect();
        swap.read_region(k, &mut refs)?;
        let v = arrays.pop().unwrap_or_default();
        let m = arrays.pop().unwrap_or_default();
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
        arrays.push(m);
        arrays.push(v);
        swap.write_region(k, &arrays)?;
        Ok(())
    }
}
