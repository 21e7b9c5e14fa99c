//! # zrt-offload
//!
//! Where optimizer state lives: on the device, in host memory, or streamed
//! through NVMe swap files. Not implemented yet; the crate exists so the
//! workspace has its final shape (DESIGN.md, "Layout").
