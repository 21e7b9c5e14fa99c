//! Checkpoints: sharded save, exact resume, resharding on load, and the
//! offline consolidation into one safetensors file.
//!
//! A checkpoint directory holds one sub-directory per tag and a `latest`
//! file naming the newest complete tag:
//!
//! ```text
//! DIR/latest                                 the newest complete tag (written last)
//! DIR/TAG/meta.json                          rank 0: layout, world, stage, step, config, versions
//! DIR/TAG/rank-00000-of-00002.safetensors    one per rank: its shards of the fp32
//! ...                                        master, Adam's m and v, its RNG state
//! DIR/TAG/frozen.safetensors                 rank 0: the frozen variables, whole
//! DIR/TAG/grads-replica-00001-rank-00000-of-00002.safetensors
//!                                            hybrid stage 1 saved between boundaries:
//!                                            replica 1's own accumulated gradients
//! ```
//!
//! A checkpoint saved between accumulation boundaries also holds each
//! rank's accumulated gradients (in its rank file), laid out for the
//! engine that saved it: it loads only at the same stage, on the same mesh
//! and with the same units, and the error says which of them differs.
//! Under hybrid sharding one shard group writes the rank files; at stage 1,
//! whose ranks sum their micro-steps locally until the boundary, every
//! other replica writes its own gradients to a file of its own.
//!
//! Frozen variables are the model's tensors that do not train
//! (`requires_grad` false: frozen parameters, buffers such as running
//! statistics). They are not sharded; a checkpoint keeps rank 0's, and a
//! load gives them to every rank.
//!
//! Every file carries a CRC-32 of its contents (in the safetensors header
//! metadata as `zrt_crc32`; in `meta.json` as its `crc32` field), checked on
//! every read. A save writes into `DIR/.TAG.partial/` (each file written to
//! a temporary name, fsynced, renamed), and only when every rank reports
//! success does rank 0 move the directory into place and then rewrite
//! `latest`: a save that fails on any rank (a read-only directory, a full
//! disk, a dead peer) leaves the previous checkpoint and `latest` untouched.
//! The directory must be visible to every rank (one host, or a shared
//! filesystem), as DeepSpeed's checkpoints assume.
//!
//! Shards are stored per parameter *range* of each unit's flat buffer, and
//! `meta.json` records every parameter's place in it, so a loader can take
//! any element from whichever rank's file holds it: that is how a
//! checkpoint saved on one world size or stage loads on another (DeepSpeed's
//! universal checkpoint, without a conversion step), and how
//! [`consolidate()`] rebuilds the model's original tensors offline.

pub(crate) mod consolidate;
mod error;
pub(crate) mod export_layout;
pub(crate) mod files;
pub(crate) mod meta;
mod prune;
pub(crate) mod sharded_out;
pub(crate) mod transpose;
pub(crate) mod weights_files;

pub use consolidate::{
    consolidate, consolidate_as, consolidate_sharded, inspect, ExportDtype, ROUNDED_KEY,
};
pub(crate) use error::model_diff;
pub use error::CheckpointError;
pub use export_layout::ExportLayout;
pub use meta::{FrozenMeta, Meta, SlotMeta, UnitMeta, FORMAT, FROZEN_FILE};
pub use prune::keep_latest;

pub(crate) use files::write_atomic;
pub(crate) use meta::{rank_file_name, replica_grads_file_name, resolve_tag, Locator, Whose};
