//! zrt's integration tests, one module per file of this folder, in one
//! binary: as separate binaries, each compiled and linked the engine's
//! code again (Cargo.toml says what that cost).
//! `cargo test --test integration engine_parity::` runs one file's tests.
//! The tests that set libtorch's process-global RNG state (checkpoint
//! loads, checkpointed blocks) are in `tests/rng_state.rs`, a binary of
//! their own; `checkpoint_memory`, `launch_oom` and `own_project` also
//! stay binaries of their own (Cargo.toml; each file's first lines say
//! why).

mod common;

mod cli;
mod engine_behaviour;
mod engine_parity;
mod first_rank_weights;
mod freed_params;
mod from_hf;
mod full_params;
mod kernels_vs_libtorch;
mod launch;
mod learning_rate;
mod load_weights;
mod lora;
mod offload;
mod quantized_gradients;
mod quantized_weights;
mod sparse_gradients;
#[cfg(feature = "tokenize")]
mod tokenize;
mod two_engines;
