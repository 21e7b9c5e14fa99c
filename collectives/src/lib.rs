//! # zrt-collectives
//!
//! Moves flat typed buffers between ranks: process groups, a 2-D device mesh,
//! and backends. It knows nothing about tch modules, so it is tested and
//! benchmarked without libtorch.
//!
//! ## Shape
//!
//! - [`ProcessGroup`] is the interface every backend implements: `all_reduce`
//!   (sum, avg, max, min), `reduce_scatter`, `all_gather`, `all_to_all`,
//!   `broadcast`, `barrier`, `send`/`recv`, over owned typed buffers
//!   (`Vec<T>` for every [`Element`]: f32, bf16, f16, f64, i64, u8).
//! - Every call returns at once with a [`Work`] handle; the operation runs on
//!   the group's communication worker, in the order calls were issued, so
//!   compute goes on meanwhile. `wait` has a timeout ([`default_timeout`]:
//!   300 s, or `ZRT_TIMEOUT` seconds).
//! - Faults never hang: a rank that dies fails every peer's pending and later
//!   collectives with an error naming it; ranks that issue different
//!   collectives at the same position get an error naming both calls.
//! - [`DeviceMesh`] splits a world into shard groups and replicate groups.
//! - [`SymmetricBuf`]: a buffer every rank allocates together
//!   (`alloc_symmetric`), which the shm backend places in shared memory so
//!   its `reduce_scatter_symmetric` / `all_gather_symmetric` read peers'
//!   buffers in place instead of staging them (NCCL's user-buffer
//!   registration, PyTorch's SymmetricMemory); elsewhere a heap buffer.
//!
//! Buffers are owned (moved in, handed back by `wait`) rather than borrowed:
//! an asynchronous operation must own what it writes, and the engine moves
//! its flat buckets through collectives anyway.
//!
//! ## Backends
//!
//! - [`local`]: ranks as threads of one process (tests, and the reference
//!   for the others).
//! - [`shm`]: processes on one host through shared memory, the default CPU
//!   backend; reductions split across ranks.
//!
//! Processes find each other through [`store`], a token-checked TCP
//! key-value store rank 0 serves; [`init_from_env`] reads the environment
//! `zrt launch` sets and joins the job.
//!
//! - [`tcp`]: processes on any hosts (full mesh; tested on loopback).
//! - `nccl` (feature `cuda`): CUDA devices through NCCL. **Never run**: no
//!   GPU is available to the project; compiled in CI only.

mod caches;
mod dtype;
mod env_bytes;
mod error;
mod front;
mod groups;
mod init;
pub mod local;
mod mesh;
#[cfg(feature = "cuda")]
pub mod nccl;
mod op;
mod p2p;
mod rendezvous;
pub mod shm;
mod slot_stores;
mod stats;
mod still_waiting;
pub mod store;
mod stream;
mod symmetric;
pub mod tcp;
mod work;
mod worker;

pub use dtype::{DType, Element};
pub use error::CommError;
pub use groups::Groups;
pub use init::{init_from_env, Backend, Dist, DistEnv, Group};
pub use mesh::DeviceMesh;
pub use op::{chunk_range, OpDesc, OpKind, ProcessGroup, ReduceOp};
pub use stats::{Observer, OpRecord, OpStats, SizeStats, Stats};
pub use symmetric::SymmetricBuf;
pub use work::{deadline_in, default_timeout, Work};
