//! A model whose weights only the first rank holds while it is built
//! ([`ShardPlan::weights_on_first_rank_only`](crate::ShardPlan::weights_on_first_rank_only)).
//!
//! The engine takes world rank 0's values for every parameter and buffer
//! whatever the other ranks built (DDP's and FSDP's `sync_module_states`),
//! so their own copies are drawn only to be overwritten. With this set,
//! each of those ranks gives the memory of its variables back as each
//! block is wrapped: building the model holds one block on them, not the
//! whole model, as FSDP's meta-device initialisation with
//! `sync_module_states` and Hugging Face Accelerate's
//! `cpu_ram_efficient_loading` arrange in Python. What N ranks on one
//! host hold while the model is built falls from N models to one.
//!
//! [`ShardPlan::weights_from_file`](crate::ShardPlan::weights_from_file)
//! releases on every rank, the first too: the engine then reads no
//! rank's values and loads a file instead.
//! [`ShardPlan::weights_on_disk_while_built`](crate::ShardPlan::weights_on_disk_while_built)
//! releases on the first rank too, after writing each variable to a
//! file the build reads it back from ([`crate::spill`]).

use std::sync::{Arc, Mutex};

use tch::nn;

use crate::glue;
use crate::spill::Spill;

/// The variables of a VarStore a rank releases: a rank other than the
/// first under `weights_on_first_rank_only`, every rank under
/// `weights_from_file`.
pub(crate) struct Release {
    vars: Arc<Mutex<nn::Variables>>,
    /// `weights_from_file`'s file, whose values the engine loads once
    /// built (no rank's are read).
    file: Option<std::path::PathBuf>,
    /// `weights_on_disk_while_built`'s file on the first rank, where each
    /// variable goes before its memory is given back (the engine's build
    /// reads it from there); dropped once the engine is built.
    pub(crate) spill: Option<Arc<Spill>>,
}

impl Release {
    /// Releases `vs`'s variables on this rank from now on; the engine
    /// takes the first rank's values.
    pub(crate) fn of(vs: &nn::VarStore) -> Self {
        Self {
            vars: vs.variables_.clone(),
            file: None,
            spill: None,
        }
    }

    /// Releases `vs`'s variables on the first rank from now on, each
    /// written to `spill` first; the engine takes its values from there.
    pub(crate) fn spilled(vs: &nn::VarStore, spill: Spill) -> Self {
        Self {
            vars: vs.variables_.clone(),
            file: None,
            spill: Some(Arc::new(spill)),
        }
    }

    /// Releases `vs`'s variables on this rank from now on; the engine
    /// loads `file`'s values.
    pub(crate) fn from_file(vs: &nn::VarStore, file: std::path::PathBuf) -> Self {
        Self {
            vars: vs.variables_.clone(),
            file: Some(file),
            spill: None,
        }
    }

    /// The file the engine loads the weights from, under
    /// `weights_from_file`.
    pub(crate) fn file(&self) -> Option<&std::path::Path> {
        self.file.as_deref()
    }

    /// Gives back the memory of every variable made so far, which then
    /// has none until the engine gives it world rank 0's values: reading
    /// or writing it before then stops the process with an explanation
    /// (the storage points into [`glue::free_storage`]'s guard). What
    /// cannot be released stays whole and is said (the engine overwrites
    /// it all the same).
    pub(crate) fn release_made_so_far(&self) {
        let vars: Vec<(String, tch::Tensor)> = match self.vars.lock() {
            Ok(v) => (v.named_variables.iter())
                .map(|(n, t)| (n.clone(), t.shallow_clone()))
                .collect(),
            Err(_) => return,
        };
        let mut released = false;
        for (name, t) in vars {
            if t.numel() == 0 || glue::is_freed(&t).unwrap_or(true) {
                continue;
            }
            // What could not be written keeps its values (said once).
            if self.spill.as_ref().is_some_and(|s| !s.write(&name, &t)) {
                continue;
            }
            match glue::free_storage(&t) {
                Ok(()) => released = true,
                Err(e) => {
                    let rule = match (&self.file, &self.spill) {
                        (Some(_), _) => "weights_from_file",
                        (None, Some(_)) => "weights_on_disk_while_built",
                        (None, None) => "weights_on_first_rank_only",
                    };
                    tracing::warn!("{rule}: `{name}` keeps its memory: {e}")
                }
            }
        }
        if released {
            give_back_to_the_system();
        }
    }
}

/// Returns the allocator's free memory to the system (the engine's build
/// calls it too, after freeing each unit). glibc serves a
/// large allocation from its heap rather than its own mapping once one
/// of that size was freed (its mmap threshold rises to it, up to 32 MiB),
/// and a freed chunk inside the heap stays resident: measured on a
/// 118M-parameter GPT on 4 ranks, the released ranks held 227 MiB of the
/// model's 452 after it was built, 3 with this.
pub(crate) fn give_back_to_the_system() {
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        libc::malloc_trim(0);
    }
}
