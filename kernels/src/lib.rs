//! # zrt-kernels
//!
//! Fused per-element math of a ZeRO step on flat `f32` slices.
