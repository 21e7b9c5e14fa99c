//! The communication worker every CPU backend runs per group: a thread that
//! executes issued operations one at a time, in issue order, and hands each
//! result to its [`Work`] handle.
//!
//! A caller that waits for an operation the worker has not started yet, with
//! every earlier operation of the group finished, runs it itself
//! ([`Ticket::run_here`]) instead of waking the worker and then being woken
//! by it. On this project's VM each of those two thread wake-ups cost
//! 10-90 us, as long as a whole 1 MiB collective; an operation issued early
//! (a prefetch) is still run by the worker while the caller computes.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::Sender;
use parking_lot::{Condvar, Mutex};

use crate::{CommError, OpDesc, Stats, Work};

type Job = Box<dyn FnOnce() + Send>;

/// Runs `f`, returning a panic in it as [`CommError::Panicked`] for `desc`
/// on `group` (logged too). Nothing a caller or a peer does should make a
/// collective panic, so one is a bug in zrt; contained, it reaches the
/// caller as an error like any other, and the backends leave the group on
/// it as on any failure, so peers fail at once instead of at the timeout.
pub(crate) fn contain<R>(
    group: &str,
    desc: &OpDesc,
    f: impl FnOnce() -> Result<R, CommError>,
) -> Result<R, CommError> {
    std::panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let why = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_string());
        tracing::error!(group, call = %desc, "a collective panicked: {why}");
        Err(CommError::Panicked {
            group: group.to_string(),
            call: desc.to_string(),
            why,
        })
    })
}

/// One issued operation: its place in the group's order and its job, taken
/// by whichever of the worker and the waiting caller gets to it first.
pub(crate) struct Ticket {
    seq: u64,
    job: Mutex<Option<Job>>,
    order: Arc<Order>,
}

/// How many of a group's operations have finished, in issue order.
#[derive(Default)]
struct Order {
    done: Mutex<u64>,
    moved: Condvar,
}

impl Order {
    /// Blocks until operation `seq` may start: every earlier one finished.
    fn wait_turn(&self, seq: u64) {
        let mut done = self.done.lock();
        while *done < seq {
            self.moved.wait(&mut done);
        }
    }

    fn finish(&self, seq: u64) {
        *self.done.lock() = seq + 1;
        self.moved.notify_all();
    }
}

/// Marks a ticket finished when dropped, so a job that panics cannot leave
/// the group's later operations waiting for it.
struct Finish<'a>(&'a Ticket);

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        self.0.order.finish(self.0.seq);
    }
}

impl Ticket {
    /// Runs the job on the calling thread if no thread has taken it and it
    /// is the group's next operation (every earlier one finished), so the
    /// order on the group is what it would be on the worker. Returns whether
    /// it ran here. Jobs made by [`Worker::submit`] return their panics as
    /// errors ([`contain`]); one that panics anyway is contained here too.
    pub(crate) fn run_here(&self) -> bool {
        if *self.order.done.lock() != self.seq {
            return false;
        }
        let Some(job) = self.job.lock().take() else {
            return false;
        };
        let _finish = Finish(self);
        let _ = std::panic::catch_unwind(AssertUnwindSafe(job));
        true
    }

    /// The worker's side: waits for its turn, then runs the job unless a
    /// caller took it (then the caller marks it finished). A panic is
    /// contained, so the worker goes on to later jobs and its exit hook.
    fn run_on_worker(&self) {
        self.order.wait_turn(self.seq);
        let job = self.job.lock().take();
        if let Some(job) = job {
            let _finish = Finish(self);
            let _ = std::panic::catch_unwind(AssertUnwindSafe(job));
        }
    }
}

/// A group's worker thread; dropping it lets queued work finish, then joins.
pub(crate) struct Worker {
    group: String,
    /// The queue, and the next ticket's number: issued under one lock, so
    /// queue order and ticket order agree when threads issue concurrently.
    tx: Mutex<Option<(Sender<Arc<Ticket>>, u64)>>,
    order: Arc<Order>,
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
        let (tx, rx) = crossbeam_channel::unbounded::<Arc<Ticket>>();
        let thread = std::thread::Builder::new()
            .name(format!("zrt-comm-{group}-{rank}"))
            .spawn(move || {
                for ticket in rx {
                    ticket.run_on_worker();
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
            tx: Mutex::new(Some((tx, 0))),
            order: Arc::default(),
            thread: Some(thread),
            stats: Arc::new(Stats::default()),
        })
    }

    /// The group's counters.
    pub(crate) fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Queues `f`; it returns `(result, bytes sent, bytes received)`, which
    /// are counted against `desc`'s operation when it succeeds. A panic in
    /// `f` is its result, as [`CommError::Panicked`].
    pub(crate) fn submit<R: Send + 'static>(
        &self,
        desc: OpDesc,
        f: impl FnOnce() -> Result<(R, usize, usize), CommError> + Send + 'static,
    ) -> Work<R> {
        let (rtx, rrx) = crossbeam_channel::bounded(1);
        let stats = self.stats.clone();
        let group = self.group.clone();
        let job: Job = Box::new(move || {
            let t = Instant::now();
            let r = contain(&group, &desc, f).map(|(out, sent, received)| {
                stats.record(&desc.kind, sent, received, t.elapsed());
                out
            });
            let _ = rtx.send(r);
        });
        let call = desc.to_string();
        let mut q = self.tx.lock();
        let queued = q.as_mut().and_then(|(tx, next)| {
            let ticket = Arc::new(Ticket {
                seq: *next,
                job: Mutex::new(Some(job)),
                order: self.order.clone(),
            });
            tx.send(ticket.clone()).ok()?;
            *next += 1;
            Some(ticket)
        });
        drop(q);
        match queued {
            Some(ticket) => Work::new(rrx, &self.group, call).runnable_by_waiter(ticket),
            None => Work::ready(
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

impl Worker {
    /// Lets the worker finish what was issued, run its `on_exit`, and stop;
    /// operations issued afterwards fail with [`CommError::Closed`]. Returns
    /// once the worker thread has ended. Dropping the worker does the same.
    pub(crate) fn close(&mut self) {
        // Closing the queue lets the worker finish what was issued, then exit.
        self.tx.lock().take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ticket(order: &Arc<Order>, seq: u64, job: impl FnOnce() + Send + 'static) -> Arc<Ticket> {
        Arc::new(Ticket {
            seq,
            job: Mutex::new(Some(Box::new(job))),
            order: order.clone(),
        })
    }

    fn logger() -> (Arc<Mutex<Vec<&'static str>>>, impl Fn(&'static str) + Clone) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let l = log.clone();
        (log, move |s| l.lock().push(s))
    }

    #[test]
    fn a_waiter_runs_the_next_operation_but_never_one_out_of_turn() {
        let order = Arc::new(Order::default());
        let (log, say) = logger();
        let (s0, s1) = (say.clone(), say);
        let t0 = ticket(&order, 0, move || s0("0"));
        let t1 = ticket(&order, 1, move || s1("1"));
        assert!(!t1.run_here(), "operation 1 ran before operation 0");
        assert!(log.lock().is_empty());
        assert!(t0.run_here());
        assert!(!t0.run_here(), "an operation ran twice");
        assert!(t1.run_here());
        assert_eq!(*log.lock(), ["0", "1"]);
        assert_eq!(*order.done.lock(), 2);
        // The worker finds both taken and does nothing.
        t0.run_on_worker();
        t1.run_on_worker();
        assert_eq!(*log.lock(), ["0", "1"]);
    }

    #[test]
    fn the_worker_waits_for_an_operation_a_caller_is_still_running() {
        let order = Arc::new(Order::default());
        let (log, say) = logger();
        let (go, wait_go) = crossbeam_channel::bounded::<()>(0);
        let (s0, s1) = (say.clone(), say);
        let t0 = ticket(&order, 0, move || {
            s0("0 start");
            let _ = wait_go.recv_timeout(Duration::from_secs(5));
            s0("0 end");
        });
        let t1 = ticket(&order, 1, move || s1("1"));
        std::thread::scope(|s| {
            let caller = s.spawn(|| t0.run_here());
            let t = std::time::Instant::now();
            while log.lock().is_empty() {
                // Bounded: a caller that never runs it fails, not hangs.
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "the caller did not run operation 0"
                );
                std::thread::yield_now();
            }
            let worker = s.spawn(|| {
                t0.run_on_worker();
                t1.run_on_worker();
            });
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(*log.lock(), ["0 start"], "the worker did not wait its turn");
            go.send(()).unwrap();
            assert!(caller.join().unwrap());
            worker.join().unwrap();
        });
        assert_eq!(*log.lock(), ["0 start", "0 end", "1"]);
    }

    #[test]
    fn an_operation_that_panics_on_a_waiter_or_the_worker_lets_the_next_one_run() {
        let order = Arc::new(Order::default());
        let t0 = ticket(&order, 0, || panic!("boom"));
        assert!(t0.run_here());
        assert_eq!(*order.done.lock(), 1);
        // On the worker, too, a panic is contained (it would end the
        // worker's thread, and with it every later operation of the group).
        ticket(&order, 1, || panic!("boom")).run_on_worker();
        assert_eq!(*order.done.lock(), 2);
        let (log, say) = logger();
        ticket(&order, 2, move || say("2")).run_on_worker();
        assert_eq!(*log.lock(), ["2"]);
    }

    #[test]
    fn dropping_the_worker_finishes_what_was_issued_then_runs_on_exit() {
        let (log, say) = logger();
        let s = say.clone();
        let w = Worker::start("t", 0, move || s("exit")).unwrap();
        let op = w.submit(OpDesc::new(crate::OpKind::Barrier, None, 0), move || {
            std::thread::sleep(Duration::from_millis(100));
            say("op");
            Ok(((), 0, 0))
        });
        drop(op);
        drop(w);
        assert_eq!(*log.lock(), ["op", "exit"]);
    }

    #[test]
    fn a_closed_worker_has_finished_its_work_and_refuses_more() {
        let (log, say) = logger();
        let s = say.clone();
        let mut w = Worker::start("t", 0, move || s("exit")).unwrap();
        let op = w.submit(OpDesc::new(crate::OpKind::Barrier, None, 0), move || {
            std::thread::sleep(Duration::from_millis(100));
            say("op");
            Ok(((), 0, 0))
        });
        w.close();
        assert_eq!(*log.lock(), ["op", "exit"]);
        assert!(op.wait().is_ok());
        let late = w.submit(OpDesc::new(crate::OpKind::Barrier, None, 0), || {
            Ok(((), 0, 0))
        });
        assert!(matches!(late.wait(), Err(CommError::Closed { .. })));
    }

    #[test]
    fn a_job_that_panics_returns_the_panic_and_the_worker_lives_on() {
        let (log, say) = logger();
        let s = say.clone();
        let w = Worker::start("t", 0, move || s("exit")).unwrap();
        let barrier = || OpDesc::new(crate::OpKind::Barrier, None, 0);
        let boom =
            |n: usize| move || -> Result<((), usize, usize), CommError> { panic!("boom {n}") };
        // A short wait leaves the job to the worker; a full one runs it here.
        let on_worker = w
            .submit(barrier(), boom(1))
            .wait_timeout(Duration::from_secs(10));
        let on_waiter = w.submit(barrier(), boom(2)).wait();
        for (r, n) in [(on_worker, 1), (on_waiter, 2)] {
            match r {
                Err(CommError::Panicked { group, call, why }) => {
                    assert_eq!((group.as_str(), why), ("t", format!("boom {n}")));
                    assert!(call.contains("barrier"), "{call}");
                }
                other => panic!("job {n}: {other:?}"),
            }
        }
        let next = w.submit(barrier(), move || {
            say("next");
            Ok(((), 0, 0))
        });
        assert!(next.wait_timeout(Duration::from_secs(10)).is_ok());
        drop(w);
        assert_eq!(*log.lock(), ["next", "exit"]);
    }

    #[test]
    fn a_wait_shorter_than_the_deadline_leaves_the_operation_to_the_worker() {
        let w = Worker::start("t", 0, || {}).unwrap();
        let op = w.submit(OpDesc::new(crate::OpKind::Barrier, None, 0), || {
            Ok((std::thread::current().name().map(str::to_string), 0, 0))
        });
        // Run here, it could not be cut short at the wait's timeout.
        let ran_on = op.wait_timeout(crate::default_timeout() / 2).unwrap();
        assert_eq!(ran_on.as_deref(), Some("zrt-comm-t-0"));
    }
}
