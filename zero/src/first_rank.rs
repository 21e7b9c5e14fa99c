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

/// Where the engine takes the values of the variables a rank released.
pub(crate) enum Values {
    /// The first rank's (`weights_on_first_rank_only`).
    FirstRank,
    /// `weights_from_file`'s file, which the engine loads once built (no
    /// rank's are read).
    File(std::path::PathBuf),
    /// `weights_on_disk_while_built`'s file on the first rank, where each
    /// variable goes before its memory is given back (the engine's build
    /// reads it from there); closed once the engine is built, when the
    /// first rank's values are the engine's own.
    Spill(Arc<Spill>),
}

/// The variables of a VarStore a rank releases: a rank other than the
/// first under `weights_on_first_rank_only`, every rank under
/// `weights_from_file` and `weights_on_disk_while_built`.
pub(crate) struct Release {
    vars: Arc<Mutex<nn::Variables>>,
    pub(crate) values: Values,
}

impl Release {
    /// Releases `vs`'s variables on this rank from now on; the engine
    /// takes their values from `values`.
    pub(crate) fn of(vs: &nn::VarStore, values: Values) -> Self {
        Self {
            vars: vs.variables_.clone(),
            values,
        }
    }

    /// The rule that released them, for messages.
    fn rule(&self) -> &'static str {
        match self.values {
            Values::FirstRank => "weights_on_first_rank_only",
            Values::File(_) => "weights_from_file",
            Values::Spill(_) => "weights_on_disk_while_built",
        }
    }

    /// Gives back the memory of every variable made so far, which then
    /// has none until the engine gives it world rank 0's values: reading
    /// or writing it before then stops the process with an explanation
    /// (the storage points into [`glue::free_storage`]'s guard). What
    /// cannot be released stays whole and is said (the engine overwrites
    /// it all the same).
    /// Under `weights_from_file`, the variables `fresh` names keep
    /// theirs (the file does not hold them).
    pub(crate) fn release_made_so_far(&self, fresh: Option<&crate::plan::NameRule>) {
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
            let kept = matches!(self.values, Values::File(_))
                && fresh.is_some_and(|f| f(&name, &t.size()));
            if kept {
                continue;
            }
            // What could not be written keeps its values (said once).
            if let Values::Spill(s) = &self.values {
                if !s.write(&name, &t) {
                    continue;
                }
            }
            match glue::free_storage(&t) {
                Ok(()) => released = true,
                Err(e) => tracing::warn!("{}: `{name}` keeps its memory: {e}", self.rule()),
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
