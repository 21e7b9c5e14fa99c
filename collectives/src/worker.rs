//! The communication worker every CPU backend runs per group: a thread that
//! executes issued operations one at a time, in issue order, and hands each
//! result to its [`Work`] handle.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::Sender;

use crate::{CommError, OpDesc, Stats, Work};

type Job = Box<dyn FnOnce() + Send>;

/// A group's worker thread; dropping it lets queued work finish, then joins.
pub(crate) struct Worker {
    group: String,
    tx: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<Stats>,
}

impl Worker {
    /// Starts the worker; `on_exit` runs on its thread after the last job
    /// (backends use it to tell peers this rank has left).
    pub(crate) fn start(
        group: &str,
        rank: usize,
        on_exit: impl FnOnce() + Send + 'static,
    ) -> Result<Self, CommError> {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("zrt-comm-{group}-{rank}"))
            .spawn(move || {
                for job in rx {
                    job();
                }
                on_exit();
            })
            .map_err(|e| CommError::Invalid {
                group: group.to_string(),
                call: "start".into(),
                why: format!("cannot start the communication thread: {e}"),
            })?;
        Ok(Self {
            group: group.to_string(),
            tx: Some(tx),
            thread: Some(thread),
            stats: Arc::new(Stats::default()),
        })
    }

    /// The group's counters.
    pub(crate) fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Queues `f`; it returns `(result, bytes sent, bytes received)`, which
    /// are counted against `desc`'s operation when it succeeds.
    pub(crate) fn submit<R: Send + 'static>(
        &self,
        desc: OpDesc,
        f: impl FnOnce() -> Result<(R, usize, usize), CommError> + Send + 'static,
    ) -> Work<R> {
        let (rtx, rrx) = crossbeam_channel::bounded(1);
        let stats = self.stats.clone();
        let job: Job = Box::new(move || {
            let t = Instant::now();
            let r = f().map(|(out, sent, received)| {
                stats.record(&desc.kind, sent, received, t.elapsed());
                out
            });
            let _ = rtx.send(r);
        });
        let call = desc.to_string();
        match &self.tx {
            Some(tx) if tx.send(job).is_ok() => Work::new(rrx, &self.group, call),
            _ => Work::ready(
                Err(CommError::Closed {
                    group: self.group.clone(),
                    call: call.clone(),
                }),
                &self.group,
                call,
            ),
        }
    }

    /// A handle that fails at once (bad arguments caught at issue time).
    pub(crate) fn fail<R: Send + 'static>(&self, desc: &OpDesc, e: CommError) -> Work<R> {
        Work::ready(Err(e), &self.group, desc.to_string())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing the queue lets the worker finish what was issued, then exit.
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
