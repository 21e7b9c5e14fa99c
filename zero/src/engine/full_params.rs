//! Whole parameters between steps: [`Engine::with_full_params`] (FSDP's
//! `summon_full_params`, with its default `writeback=True`) and
//! [`Engine::unshard`].
//!
//! What `f` changes is kept. Nothing watches the parameters: every unit's
//! gathered buffers (trainable and, at stage 3, frozen) are fingerprinted
//! (CRC-32) before and after `f`, the ranks compare fingerprints, and a
//! unit whose values moved on any rank is written back. Each rank writes
//! its own range of it into whatever the optimizer and the next gather
//! read: the fp32 master, the 16-bit shard stage 3 gathers from, the
//! swap files and the frozen shards. With 16-bit compute, only the master
//! elements whose compute value changed take the new value, so an
//! untouched weight keeps its fp32 precision. Every rank must make the
//! same change. If they differ, world rank 0's values become everyone's
//! first, as DeepSpeed's `GatheredParameters(modifier_rank=0)` makes them,
//! so the ranks never diverge, and the call returns an error naming the
//! ranks that disagreed.

use half::{bf16, f16};
use zrt_collectives::ProcessGroup;
use zrt_kernels::cast;

use super::offload::ReadAhead;
use super::{elems, Compute, CopyShard, Engine, Inner, OwnedState, Shard, State, Unit};
use crate::EngineError;

/// A unit's fingerprint: the CRC-32 of its gathered buffers, or `None`
/// when it is not gathered (a forward inside `f` freed it).
type Print = Option<u32>;

impl<G: ProcessGroup + 'static> Engine<G> {
    /// Runs `f` with every parameter of the model in memory, whole, then
    /// frees what stage 3 keeps freed: FSDP's `summon_full_params`,
    /// DeepSpeed's `GatheredParameters`. A collective (every rank calls it).
    ///
    /// Between steps, stage 3 leaves each unit's parameters without memory
    /// (their storage is freed while their shapes stay), and reading or
    /// writing them then stops the process with a message saying so
    /// (`vs.save(..)`, printing a weight; see [`crate::glue`]). Inside `f` they hold the current compute-dtype values, so
    /// `engine.with_full_params(|| vs.save("model.safetensors"))` works on
    /// every stage.
    ///
    /// Changes `f` makes to the parameters are kept, as FSDP's default
    /// `writeback=True` keeps them: they reach the optimizer's fp32 master
    /// and every copy the engine gathers from (with 16-bit compute, only
    /// the elements whose 16-bit value changed take it, widened; so an
    /// element set to the value its 16-bit copy already had keeps its
    /// fp32 master, as nothing tells that it was written). Every
    /// rank must make the same change. If they differ, world rank 0's
    /// values are kept everywhere and the call fails, naming the ranks
    /// that differed. A forward run inside `f` at stage 3 frees its units
    /// again, and a change made to them before it is lost. Loading
    /// pretrained weights is better done into the VarStore before building
    /// the engine (it takes rank 0's values), or from a checkpoint with
    /// [`Engine::load_checkpoint`] (resume) or
    /// [`Engine::load_checkpoint_module_only`] (fine-tune).
    pub fn with_full_params<R>(&self, f: impl FnOnce() -> R) -> Result<R, EngineError> {
        let i = &*self.inner;
        self.unshard()?;
        let before = i.prints(&i.st.lock());
        // Not under the state lock: `f` may run the model, whose hooks take it.
        let r = f();
        let kept = self.write_back(&before);
        {
            let mut st = i.st.lock();
            for k in 0..st.units.len() {
                i.free_if_gathered(&mut st, k)?;
            }
        }
        kept.map(|()| r)
    }

    /// Stage 3: gathers every unit's parameters into memory and leaves them
    /// there (FSDP2's `unshard`), until a forward frees its unit again or a
    /// step frees them all. A collective; nothing to do on stages 0-2.
    ///
    /// Call it before dropping the engine to keep using the model: the
    /// parameters then hold the trained compute-dtype values, whole, for
    /// inference or `vs.save`. Dropped without it, a stage-3 model's
    /// parameters have no memory and any use of them fails.
    pub fn unshard(&self) -> Result<(), EngineError> {
        let i = &*self.inner;
        if i.stage != 3 {
            return Ok(());
        }
        let mut st = i.st.lock();
        self.take_error(&mut st)?;
        if st.prog.in_backward() {
            return Err(EngineError::CallOrder(
                "unshard or with_full_params during a backward: call it between steps".into(),
            ));
        }
        i.drain_prefetch(&mut st)?;
        for k in 0..st.units.len() {
            i.gather(&mut st, k, true)?;
        }
        Ok(())
    }

    /// Writes back the units whose fingerprints moved from `before` on any
    /// rank (a collective over the world: the fingerprints are exchanged
    /// even when nothing changed, so every rank agrees on what to do).
    fn write_back(&self, before: &[Print]) -> Result<(), EngineError> {
        let i = &*self.inner;
        let mut st = i.st.lock();
        let after = i.prints(&st);
        // Per unit: 1 if it changed here, then its fingerprint (-1: not
        // gathered), gathered from every rank of the world.
        let mine: Vec<i64> = before
            .iter()
            .zip(&after)
            .flat_map(|(b, a)| [i64::from(a.is_some() && a != b), a.map_or(-1, i64::from)])
            .collect();
        let all = i.world_gather(mine)?;
        let n = st.units.len();
        let world = all.len() / (2 * n).max(1);
        let mut disagreed = Vec::new();
        for k in 0..n {
            let of = |r: usize| (all[r * 2 * n + 2 * k], all[r * 2 * n + 2 * k + 1]);
            if !(0..world).any(|r| of(r).0 == 1) {
                continue;
            }
            let name = st.units[k].name.clone();
            if let Some(r) = (0..world).find(|&r| of(r).1 < 0) {
                return Err(EngineError::CallOrder(format!(
                    "unit `{name}` changed inside with_full_params but world rank {r} no longer held it when `f` returned (a forward inside `f` frees its units again at stage 3): change parameters outside any forward"
                )));
            }
            let differ: Vec<usize> = (1..world).filter(|&r| of(r).1 != of(0).1).collect();
            if !differ.is_empty() {
                i.rank0_values(&st, k)?;
                disagreed.push(format!("`{name}` (world ranks {differ:?})"));
            }
            i.write_back_unit(&mut st, k)?;
        }
        if disagreed.is_empty() {
            return Ok(());
        }
        Err(EngineError::CallOrder(format!(
            "with_full_params: the ranks changed units {} differently from world rank 0; rank 0's values were kept on every rank. Make the same change on every rank (a change meant for one rank's copy only cannot be kept: the parameters are one model)",
            disagreed.join(", ")
        )))
    }
}

impl<G: ProcessGroup + 'static> Inner<G> {
    /// Every unit's fingerprint.
    fn prints(&self, st: &State) -> Vec<Print> {
        st.units
            .iter()
            .enumerate()
            .map(|(k, u)| {
                if self.stage == 3 && !st.gathered[k] {
                    return None;
                }
                let mut h = crc32fast::Hasher::new();
                for (flat, n) in self.gathered_flats(u) {
                    // SAFETY: gathered flat tensors of the compute dtype
                    // (stage 3: checked above; stages 0-2 always hold
                    // them), read under the state lock.
                    h.update(unsafe { elems::<u8>(flat, n) });
                }
                Some(h.finalize())
            })
            .collect()
    }

    /// Unit `u`'s flat tensors a gather fills (trainable, then frozen), with
    /// their lengths in bytes.
    fn gathered_flats<'u>(&self, u: &'u Unit) -> Vec<(&'u tch::Tensor, usize)> {
        let bytes = self.compute.bytes();
        let mut flats = vec![(&u.flat, u.layout.padded * bytes)];
        if let Some(p) = &u.frozen {
            flats.push((&p.flat, p.padded() * bytes));
        }
        flats
    }

    /// `mine` from every rank of the world, in world order (the shard
    /// group's ranks inside each replica). A collective.
    fn world_gather(&self, mine: Vec<i64>) -> Result<Vec<i64>, EngineError> {
        let what = || "with_full_params exchanged its fingerprints of the units".to_string();
        super::agree::world_gather(&self.group, self.replicate.as_ref(), mine, false, what)
    }

    /// Makes world rank 0's gathered values of unit `k` (trainable and
    /// frozen) everyone's: across replicas, then inside the shard group.
    fn rank0_values(&self, st: &State, k: usize) -> Result<(), EngineError> {
        for (flat, n) in self.gathered_flats(&st.units[k]) {
            // SAFETY: a gathered flat tensor (checked by the caller's
            // fingerprints), under the state lock.
            let data = unsafe { elems::<u8>(flat, n) };
            let mut v = data.to_vec();
            if let Some(r) = &self.replicate {
                v = r.broadcast(v, 0).wait()?;
            }
            v = self.group.broadcast(v, 0).wait()?;
            data.copy_from_slice(&v);
        }
        Ok(())
    }

    /// Writes unit `k`'s gathered values, which changed, back into this
    /// rank's range of everything they are gathered or stepped from.
    fn write_back_unit(&self, st: &mut State, k: usize) -> Result<(), EngineError> {
        if self.stage == 0 {
            return self.write_back_whole(st, k);
        }
        let need = self.own_range(&st.units[k]);
        let s = self.shard_state(st, k)?;
        let mut state = OwnedState {
            master: s.master.into_owned(),
            m: s.m.into_owned(),
            v: s.v.into_owned(),
        };
        self.merge_into_master(&st.units[k], need.clone(), &mut state.master)?;
        let (units, shards) = (&mut st.units, &mut st.shards);
        let u = &mut units[k];
        if let Some(p) = &mut u.frozen {
            p.keep_gathered()?;
        }
        self.install(u, &mut shards[k], k, need, state)
    }

    /// Stage 0's write-back: every rank holds and steps the whole unit, so
    /// the change goes into its fp32 master where it lies, without the
    /// copy of the unit's master, m and v that the sharded stages install
    /// (m and v do not change).
    fn write_back_whole(&self, st: &mut State, k: usize) -> Result<(), EngineError> {
        let (u, sh) = (&st.units[k], &mut st.shards[k]);
        let padded = u.layout.padded;
        if sh.master.is_empty() {
            // fp32: the flat tensor is the master, and `f` changed it.
            return Ok(());
        }
        self.merge_into_master(u, 0..padded, &mut sh.master)?;
        // The compute copy, as the optimizer leaves it: the merged master
        // rounded (what `f` wrote, for every element it changed).
        // SAFETY: the unit's flat tensor of the compute dtype, under the
        // state lock (no forward or backward runs).
        match self.compute {
            Compute::F32 => unsafe { elems::<f32>(&u.flat, padded) }.copy_from_slice(&sh.master),
            Compute::Bf16 => {
                cast::f32_to_bf16(&sh.master, unsafe { elems::<bf16>(&u.flat, padded) })?
            }
            Compute::F16 => cast::f32_to_f16(&sh.master, unsafe { elems::<f16>(&u.flat, padded) })?,
        }
        Ok(())
    }

    /// Takes the gathered compute values of unit `u` over elements `need`
    /// into `master` (the fp32 master of those elements): all of them in
    /// fp32; with 16-bit compute only those whose 16-bit value differs from
    /// the master's rounding, so an untouched weight keeps its fp32 bits.
    fn merge_into_master(
        &self,
        u: &Unit,
        need: std::ops::Range<usize>,
        master: &mut [f32],
    ) -> Result<(), EngineError> {
        let padded = u.layout.padded;
        // SAFETY: the gathered flat tensor of the compute dtype, under the
        // state lock.
        match self.compute {
            Compute::F32 => master.copy_from_slice(&unsafe { elems::<f32>(&u.flat, padded) }[need]),
            Compute::Bf16 => {
                let now = &unsafe { elems::<bf16>(&u.flat, padded) }[need.clone()];
                let mut was = vec![bf16::ZERO; need.len()];
                cast::f32_to_bf16(master, &mut was)?;
                take_changed(master, now, &was, bf16::to_bits, bf16::to_f32);
            }
            Compute::F16 => {
                let now = &unsafe { elems::<f16>(&u.flat, padded) }[need.clone()];
                let mut was = vec![f16::ZERO; need.len()];
                cast::f32_to_f16(master, &mut was)?;
                take_changed(master, now, &was, f16::to_bits, f16::to_f32);
            }
        }
        Ok(())
    }

    /// Installs `s`, this rank's state over elements `need` of unit `k`
    /// (its whole optimizer range, the `v` of every element): the master
    /// and moments (in memory, `v` packed, or the swap) and the compute
    /// copy this rank writes, as the optimizer would after a step.
    pub(super) fn install(
        &self,
        u: &Unit,
        sh: &mut Shard,
        k: usize,
        need: std::ops::Range<usize>,
        s: OwnedState,
    ) -> Result<(), EngineError> {
        let padded = u.layout.padded;
        self.page_in(sh, k, ReadAhead::Update)?;
        match (self.compute, self.stage) {
            // SAFETY: the unit's flat tensor of the compute dtype, under
            // the state lock (no forward or backward runs).
            (Compute::F32, 0..=2) => {
                (unsafe { elems::<f32>(&u.flat, padded) })[need].copy_from_slice(&s.master)
            }
            (Compute::F32, _) => {}
            (Compute::Bf16, 3) | (Compute::F16, 3) => match &mut sh.copy {
                CopyShard::Bf16(c) => cast::f32_to_bf16(&s.master, c)?,
                CopyShard::F16(c) => cast::f32_to_f16(&s.master, c)?,
                CopyShard::None => {}
            },
            (Compute::Bf16, _) => cast::f32_to_bf16(
                &s.master,
                &mut unsafe { elems::<bf16>(&u.flat, padded) }[need],
            )?,
            (Compute::F16, _) => cast::f32_to_f16(
                &s.master,
                &mut unsafe { elems::<f16>(&u.flat, padded) }[need],
            )?,
        }
        match &self.swap {
            Some(swap) => self.swap_in(swap, k, &s.master, &s.m, &s.v)?,
            None => {
                sh.m = s.m;
                sh.v = sh.v_layout.pack(s.v);
            }
        }
        // Empty when the master lives in the flat tensor or the swap.
        if !sh.master.is_empty() {
            sh.master = s.master;
        }
        self.page_out(sh, k, true)
    }
}

/// Sets the master elements whose 16-bit value `now` differs from `was`
/// (the master's own rounding) to `now`, widened; the others keep their
/// fp32 bits.
fn take_changed<T: Copy>(
    master: &mut [f32],
    now: &[T],
    was: &[T],
    bits: fn(T) -> u16,
    widen: fn(T) -> f32,
) {
    for ((m, &n), &w) in master.iter_mut().zip(now).zip(was) {
        if bits(n) != bits(w) {
            *m = widen(n);
        }
    }
}
