//! zrt's integration tests, one module per file of this folder, in one
//! binary: as separate binaries, each compiled and linked the engine's
//! code again (Cargo.toml says what that cost).
//! `cargo test --test integration engine_parity::` runs one file's tests.
//! `checkpoint_memory`, `launch_oom` and `own_project` stay binaries of
//! their own (Cargo.toml; each file's first lines say why).

mod common;

mod activation_checkpointing;
mod checkpoint;
mod cli;
mod engine_behaviour;
mod engine_parity;
mod freed_params;
mod frozen_shards;
mod full_params;
mod kernels_vs_libtorch;
mod launch;
mod offload;
