//! The integration tests that set libtorch's process-global RNG state
//! outside the model-building lock: checkpoint loads (which restore the
//! RNG) and checkpointed blocks (whose recompute restores it). Each of
//! them holds `common::serial()` for the whole test, so they run one at a
//! time among themselves; in the same process as the other integration
//! tests, a restore could land between another test's seeding and its
//! model's draws, and that test's two builds of one model would differ
//! (2026-11-28: `engine_parity` failed so, once in five CI runs, after
//! the tests had been merged into one binary). `cargo test --test
//! rng_state checkpoint::` runs one file's tests.

mod common;

mod activation_checkpointing;
mod adagrad;
mod checkpoint;
mod config_sweep;
mod dropout;
mod experts;
mod flops_profiler;
mod frozen_shards;
mod lamb;
mod lion;
mod muon;
mod quantized_frozen;
mod rmsprop;
mod sgd;
