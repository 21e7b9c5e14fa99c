//! DeepSpeed's monitors as zrt writes them: `csv_monitor` and
//! `tensorboard` (config blocks `{"enabled", "output_path", "job_name"}`,
//! each writing into `output_path/job_name`).
//!
//! At every accumulation boundary the job's first rank writes DeepSpeed's
//! scalars, each at x = the samples trained so far (boundaries, skipped
//! ones included, times `train_batch_size`):
//!
//! * `Train/Samples/train_loss`: the first rank's loss, averaged over the
//!   step's micro-batches, as passed to `Engine::backward` (a bare
//!   `loss.backward()` shows the engine no loss, and writes none);
//! * `Train/Samples/lr`: the learning rate the step applied (the
//!   schedule's, before any per-parameter scale);
//! * `Train/Samples/loss_scale`: the fp16 loss scale after the step;
//! * with `wall_clock_breakdown`, `Train/Samples/elapsed_time_ms_forward`,
//!   `..._backward` and `..._step`: the step's times.
//!
//! The CSV monitor appends `step,<last part of the tag>` rows to one file
//! per tag (`Train_Samples_train_loss.csv`), with that header first, as
//! DeepSpeed's does. The TensorBoard monitor writes one event file
//! (`events.out.tfevents.<seconds>.<host>.<pid>.<n>`, [`tfevents`]).
//! Neither buffers: each boundary's lines go to the OS as they are
//! written, so a run that dies loses none of the steps it logged.
//! A monitor that cannot write warns once and stops; training goes on
//! (a full disk under the logs should not cost the run).

mod csv;
pub mod tfevents;

use crate::config::MonitorConfig;
use crate::EngineError;

/// The monitors a config enables, open.
pub(crate) struct Monitor {
    csv: Option<csv::Csv>,
    tensorboard: Option<tfevents::Writer>,
}

impl Monitor {
    /// Opens the monitors `cfg` enables (creating their folders); `None`
    /// when it enables none. A folder that cannot be made is an error
    /// naming it and the key.
    pub(crate) fn open(cfg: &MonitorConfig) -> Result<Option<Self>, EngineError> {
        let failed = |key: &str, dir: &std::path::Path, e: std::io::Error| {
            EngineError::Monitor(format!(
                "cannot write `{key}` into {}: {e}; set `{key}.output_path` to a writable folder, or turn the monitor off",
                dir.display()
            ))
        };
        let csv = match &cfg.csv {
            Some(dir) => Some(csv::Csv::open(dir).map_err(|e| failed("csv_monitor", dir, e))?),
            None => None,
        };
        let tensorboard = match &cfg.tensorboard {
            Some(dir) => {
                Some(tfevents::Writer::open(dir).map_err(|e| failed("tensorboard", dir, e))?)
            }
            None => None,
        };
        if csv.is_none() && tensorboard.is_none() {
            return Ok(None);
        }
        Ok(Some(Self { csv, tensorboard }))
    }

    /// Writes `events` (tag, value, samples) to every monitor still open
    /// (unbuffered). A monitor that fails is warned about and closed.
    pub(crate) fn write(&mut self, events: &[(&str, f64, u64)]) {
        if let Some(c) = &mut self.csv {
            if let Err(e) = c.write(events) {
                tracing::warn!("csv_monitor: cannot write into {}: {e}; no more rows are written (training goes on)", c.dir().display());
                self.csv = None;
            }
        }
        if let Some(t) = &mut self.tensorboard {
            if let Err(e) = t.write(events) {
                tracing::warn!("tensorboard: cannot write {}: {e}; no more events are written (training goes on)", t.path().display());
                self.tensorboard = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_monitor_that_cannot_write_is_closed_and_the_others_go_on() {
        let dir = std::env::temp_dir().join(format!("zrt-monitors-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = MonitorConfig {
            csv: Some(dir.join("csv")),
            tensorboard: Some(dir.join("tb")),
        };
        let mut m = Monitor::open(&cfg).unwrap().unwrap();
        // The CSV folder goes away before its first file is made.
        std::fs::remove_dir_all(dir.join("csv")).unwrap();
        m.write(&[("Train/Samples/lr", 0.5, 8)]);
        assert!(m.csv.is_none() && m.tensorboard.is_some());
        m.write(&[("Train/Samples/lr", 0.25, 16)]);
        assert!(!dir.join("csv").exists(), "a closed monitor writes nothing");
        let tb = m.tensorboard.as_ref().unwrap().path().to_path_buf();
        let got = tfevents::read_scalars(&tb).unwrap();
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(Monitor::open(&MonitorConfig::default()).unwrap().is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
