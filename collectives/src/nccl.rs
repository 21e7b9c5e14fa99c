//! NCCL through cudarc, for CUDA devices (feature `cuda`).
//!
//! **This code has never run**: no GPU is available to the project. It is
//! compiled in CI (`cargo check --features cuda`) and kept thin: a group is
//! an NCCL communicator whose unique id travels through the rendezvous
//! store; operations take raw device pointers (tch tensors' `data_ptr()`)
//! wrapped in [`DeviceBuf`], which implements cudarc's `DevicePtr` /
//! `DevicePtrMut` for a *borrowed* pointer (cudarc's `upgrade_device_ptr`
//! would free the tensor's memory on drop, so it is never used).
//!
//! Operations are enqueued on the group's stream and return at once, like
//! the CPU backends' `Work`; [`NcclGroup::wait`] blocks until the stream has
//! run them, at most the timeout, so a stuck peer is an error, never a hang.
//!
//! Loading: cudarc looks for `libnccl.so`, `libnccl.so.13` and older majors,
//! but the PyTorch wheel ships `nvidia/nccl/lib/libnccl.so.2`. `zrt launch`
//! links it as `libnccl.so` in `~/.cache/zrt/nccl` and puts that folder on
//! the ranks' `LD_LIBRARY_PATH`; [`NcclGroup::join`] checks the library is
//! loadable and says so otherwise, instead of cudarc's panic.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use cudarc::nccl::{Comm, Id, NcclType};

use crate::store::StoreClient;
use crate::{CommError, ReduceOp};

/// A borrowed device buffer: `len` elements of T at a raw device pointer
/// owned by someone else (a tch tensor). Never frees anything.
pub struct DeviceBuf<T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _t: PhantomData<T>,
}

impl<T> DeviceBuf<T> {
    /// Wraps `len` elements at `ptr`, used on `stream`.
    ///
    /// # Safety
    /// `ptr` must be a device allocation of the stream's context holding at
    /// least `len` elements of T, alive until every operation enqueued on it
    /// has run (see [`NcclGroup::wait`]).
    pub unsafe fn from_raw(ptr: u64, len: usize, stream: Arc<CudaStream>) -> Self {
        Self {
            ptr,
            len,
            stream,
            _t: PhantomData,
        }
    }
}

impl<T> DeviceSlice<T> for DeviceBuf<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for DeviceBuf<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        // Ordering is the engine's: it enqueues producers and consumers of
        // this memory on the group's stream (or waits on events itself).
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for DeviceBuf<T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

/// One rank's NCCL communicator for a group.
pub struct NcclGroup {
    comm: Comm,
    stream: Arc<CudaStream>,
    name: String,
    world_ranks: Vec<usize>,
    rank: usize,
    timeout: Duration,
}

fn nccl_err(group: &str, call: &str, e: impl std::fmt::Debug) -> CommError {
    CommError::Invalid {
        group: group.to_string(),
        call: call.to_string(),
        why: format!("NCCL: {e:?}"),
    }
}

fn op(o: ReduceOp) -> cudarc::nccl::ReduceOp {
    match o {
        ReduceOp::Sum => cudarc::nccl::ReduceOp::Sum,
        ReduceOp::Avg => cudarc::nccl::ReduceOp::Avg,
        ReduceOp::Max => cudarc::nccl::ReduceOp::Max,
        ReduceOp::Min => cudarc::nccl::ReduceOp::Min,
    }
}

impl NcclGroup {
    /// Creates this rank's communicator on CUDA device `device`: group rank
    /// 0 makes the NCCL unique id and shares it through the store.
    pub fn join(
        store: &StoreClient,
        name: &str,
        world_ranks: Vec<usize>,
        world_rank: usize,
        device: usize,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        let me = world_ranks
            .iter()
            .position(|&r| r == world_rank)
            .ok_or_else(|| CommError::Invalid {
                group: name.to_string(),
                call: "join".into(),
                why: format!("rank {world_rank} is not a member of {world_ranks:?}"),
            })?;
        // SAFETY: only probes whether the libraries can be opened.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CommError::Rendezvous(
                "the CUDA driver (libcuda.so) cannot be loaded: is this a GPU machine?".into(),
            ));
        }
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(CommError::Rendezvous(
                "libnccl.so cannot be loaded: start ranks with `zrt launch` (it links the PyTorch wheel's libnccl.so.2), or put a libnccl.so on LD_LIBRARY_PATH".into(),
            ));
        }
        let key = format!("nccl/{name}/id");
        let id = if me == 0 {
            let id = Id::new().map_err(|e| nccl_err(name, "ncclGetUniqueId", e))?;
            let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
            store.set(&key, &bytes)?;
            id
        } else {
            let bytes = crate::store::await_rank(store, &key, world_ranks[0], timeout, || {
                format!("create NCCL group `{name}`")
            })?;
            let mut internal = [0 as std::ffi::c_char; 128];
            for (d, s) in internal.iter_mut().zip(bytes) {
                *d = s as std::ffi::c_char;
            }
            Id::uninit(internal)
        };
        let ctx = CudaContext::new(device).map_err(|e| nccl_err(name, "cuCtxCreate", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| nccl_err(name, "cuStreamCreate", e))?;
        let comm = Comm::from_rank(stream.clone(), me, world_ranks.len(), id)
            .map_err(|e| nccl_err(name, "ncclCommInitRank", e))?;
        Ok(Self {
            comm,
            stream,
            name: name.to_string(),
            world_ranks,
            rank: me,
            timeout,
        })
    }

    /// The stream operations are enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// This rank in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The members' world ranks.
    pub fn world_ranks(&self) -> &[usize] {
        &self.world_ranks
    }

    /// In-place all_reduce (enqueued).
    pub fn all_reduce<T: NcclType>(
        &self,
        buf: &mut DeviceBuf<T>,
        o: ReduceOp,
    ) -> Result<(), CommError> {
        self.comm
            .all_reduce_in_place(buf, &op(o))
            .map(|_| ())
            .map_err(|e| nccl_err(&self.name, "all_reduce", e))
    }

    /// reduce_scatter of `input` (group size x `out.len()` elements) into `out` (enqueued).
    pub fn reduce_scatter<T: NcclType>(
        &self,
        input: &DeviceBuf<T>,
        out: &mut DeviceBuf<T>,
        o: ReduceOp,
    ) -> Result<(), CommError> {
        self.comm
            .reduce_scatter(input, out, &op(o))
            .map(|_| ())
            .map_err(|e| nccl_err(&self.name, "reduce_scatter", e))
    }

    /// all_gather of `input` into `out` (group size x `input.len()`; enqueued).
    pub fn all_gather<T: NcclType>(
        &self,
        input: &DeviceBuf<T>,
        out: &mut DeviceBuf<T>,
    ) -> Result<(), CommError> {
        self.comm
            .all_gather(input, out)
            .map(|_| ())
            .map_err(|e| nccl_err(&self.name, "all_gather", e))
    }

    /// all_to_all (enqueued): chunk `p` of `input` goes to group rank
    /// `p`, and chunk `q` of `out` receives rank `q`'s chunk of this rank.
    /// Both hold group size x chunk elements (callers pad: NCCL has no
    /// uneven split without per-rank counts). One NCCL group of a send and
    /// a receive per rank, this rank included.
    pub fn all_to_all<T: NcclType>(
        &self,
        input: &DeviceBuf<T>,
        out: &mut DeviceBuf<T>,
    ) -> Result<(), CommError> {
        let n = self.world_ranks.len();
        if input.len != out.len || input.len % n != 0 {
            return Err(CommError::Invalid {
                group: self.name.clone(),
                call: "all_to_all".into(),
                why: format!(
                    "input ({}) and output ({}) must be equally long, a multiple of the group size {n}",
                    input.len, out.len
                ),
            });
        }
        let m = input.len / n;
        let size = std::mem::size_of::<T>() as u64;
        // Chunk `p` of a borrowed buffer: a borrowed buffer too.
        let chunk = |b: &DeviceBuf<T>, p: usize| DeviceBuf::<T> {
            ptr: b.ptr + (p * m) as u64 * size,
            len: m,
            stream: b.stream.clone(),
            _t: PhantomData,
        };
        let err = |call: &str, e| nccl_err(&self.name, call, e);
        cudarc::nccl::result::group_start().map_err(|e| err("ncclGroupStart", e))?;
        // The group is ended whatever happened inside it, so a failed send
        // does not leave this thread's NCCL group open.
        let inside = (0..n).try_for_each(|p| {
            self.comm
                .send(&chunk(input, p), p as i32)
                .map_err(|e| err("ncclSend", e))?;
            self.comm
                .recv(&mut chunk(out, p), p as i32)
                .map(|_| ())
                .map_err(|e| err("ncclRecv", e))
        });
        let end = cudarc::nccl::result::group_end().map_err(|e| err("ncclGroupEnd", e));
        inside.and(end.map(|_| ()))
    }

    /// In-place broadcast from group rank `root` (enqueued).
    pub fn broadcast<T: NcclType>(
        &self,
        buf: &mut DeviceBuf<T>,
        root: usize,
    ) -> Result<(), CommError> {
        self.comm
            .broadcast_in_place(buf, root as i32)
            .map(|_| ())
            .map_err(|e| nccl_err(&self.name, "broadcast", e))
    }

    /// Blocks until everything enqueued on the stream has run, at most the
    /// timeout; a timeout means a peer is stuck or dead (the communicator is
    /// aborted when this group drops).
    pub fn wait(&self) -> Result<(), CommError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let stream = self.stream.clone();
        std::thread::spawn(move || {
            let _ = tx.send(stream.synchronize());
        });
        match rx.recv_timeout(self.timeout) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(nccl_err(&self.name, "cuStreamSynchronize", e)),
            Err(_) => Err(CommError::Timeout {
                group: self.name.clone(),
                call: "wait".into(),
                timeout: self.timeout,
                waiting_for: Vec::new(),
            }),
        }
    }
}
