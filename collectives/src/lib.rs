//! # zrt-collectives
//!
//! Moves flat typed buffers between ranks: process groups, a 2-D device mesh,
//! rendezvous, and the local (threads), shared-memory, TCP and NCCL backends.
//! It knows nothing about tch modules, so it is tested and benchmarked without
//! libtorch.
