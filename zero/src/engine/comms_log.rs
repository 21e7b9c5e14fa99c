//! DeepSpeed's `comms_logger`: what the engine's collectives cost, per
//! group, operation and message size.
//!
//! The collectives count every operation of a group on its communication
//! thread, from the moment the thread starts it to its completion, waiting
//! for slower peers included ([`zrt_collectives::Stats`]); nothing here
//! adds a synchronisation (DeepSpeed's logger makes each call blocking to
//! time it). This module turns the counts into the table
//! [`crate::Engine::log_comms_summary`] logs and, with `verbose`, a line per
//! operation. Bandwidths follow nccl-tests: algbw is the message over the
//! time, busbw is algbw times what each rank's link carries of it
//! (2(n-1)/n for all_reduce, (n-1)/n for reduce_scatter and all_gather, 1
//! for broadcast, send and recv). DeepSpeed's logger prints all_reduce's
//! algbw doubled; its busbw is the same.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use zrt_collectives::{OpRecord, ProcessGroup};

use crate::config::CommsLoggerConfig;

/// One row of a [`CommsSummary`]: an operation of one size on one group.
#[derive(Debug, Clone, PartialEq)]
pub struct CommsRow {
    /// What the group is to the engine: `shard` (parameters are sharded
    /// over it), `replicate` (hybrid sharding's average across shard
    /// groups) or `hpz` (ZeRO++'s secondary gathers).
    pub role: &'static str,
    /// The group's name, as the collectives give it.
    pub group: String,
    /// Ranks in the group.
    pub ranks: usize,
    /// The operation (`all_reduce`, `reduce_scatter`, `all_gather`, ...).
    pub op: &'static str,
    /// The message: the whole buffer the operation works on.
    pub bytes: u64,
    /// Completed calls.
    pub calls: u64,
    /// Their total time.
    pub time: Duration,
}

impl CommsRow {
    /// Mean time of one call.
    pub fn latency(&self) -> Duration {
        // In nanoseconds: `Duration / u32` would take calls past u32::MAX
        // as fewer (or as zero, a panic).
        let nanos = self.time.as_nanos() / u128::from(self.calls.max(1));
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    /// Algorithm bandwidth, GB/s (1e9 bytes): the message over the mean
    /// time. `None` for operations that move no data (barrier).
    pub fn algbw(&self) -> Option<f64> {
        algbw(self.bytes, self.latency())
    }

    /// Bus bandwidth, GB/s: [`CommsRow::algbw`] times the share each
    /// rank's link carries (nccl-tests' convention).
    pub fn busbw(&self) -> Option<f64> {
        Some(self.algbw()? * bus_factor(self.op, self.ranks)?)
    }
}

fn algbw(bytes: u64, t: Duration) -> Option<f64> {
    (bytes > 0 && !t.is_zero()).then(|| bytes as f64 / t.as_secs_f64() / 1e9)
}

/// nccl-tests' factor from algbw to busbw for `op` on `n` ranks.
fn bus_factor(op: &str, n: usize) -> Option<f64> {
    let n = n.max(1) as f64;
    match op {
        "all_reduce" => Some(2.0 * (n - 1.0) / n),
        // An all_to_all moves (n - 1) / n of each rank's input, as
        // nccl-tests' alltoall counts it.
        "reduce_scatter" | "all_gather" | "all_to_all" => Some((n - 1.0) / n),
        "broadcast" | "send" | "recv" => Some(1.0),
        _ => None,
    }
}

/// `bytes` for a person: B, KiB, MiB or GiB.
fn size(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..1024 => format!("{bytes} B"),
        1024..1_048_576 => format!("{:.1} KiB", b / 1024.0),
        1_048_576..1_073_741_824 => format!("{:.1} MiB", b / 1_048_576.0),
        _ => format!("{:.2} GiB", b / 1_073_741_824.0),
    }
}

fn cell(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |v| format!("{v:.3}"))
}

/// What the engine's collectives cost on this rank, per group, operation
/// and message size: [`crate::Engine::comms_summary`]. Displayed, a table
/// as DeepSpeed's `log_summary` prints.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CommsSummary {
    /// The rows, by group (shard, replicate, hpz), then operation, then
    /// size.
    pub rows: Vec<CommsRow>,
}

impl fmt::Display for CommsSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let label = |r: &CommsRow| format!("{} {} ({})", r.role, r.group, r.ranks);
        // Group names are the collectives' (`ranks[0, 1]#0`): as wide as
        // the widest.
        let w = self.rows.iter().map(|r| label(r).len()).fold(5, usize::max);
        writeln!(
            f,
            "{:<w$} {:<14} {:>11} {:>7} {:>10} {:>9} {:>10} {:>10}",
            "group", "op", "message", "calls", "total ms", "avg ms", "algbw GB/s", "busbw GB/s"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<w$} {:<14} {:>11} {:>7} {:>10.1} {:>9.3} {:>10} {:>10}",
                label(r),
                r.op,
                size(r.bytes),
                r.calls,
                r.time.as_secs_f64() * 1e3,
                r.latency().as_secs_f64() * 1e3,
                cell(r.algbw()),
                cell(r.busbw()),
            )?;
        }
        Ok(())
    }
}

/// The engine's groups, by role.
pub(super) fn groups<'a, G: ProcessGroup>(
    group: &'a G,
    replicate: Option<&'a G>,
    hpz: Option<&'a G>,
) -> Vec<(&'static str, &'a G)> {
    let mut v = vec![("shard", group)];
    v.extend(replicate.map(|g| ("replicate", g)));
    v.extend(hpz.map(|g| ("hpz", g)));
    v
}

/// The rows of `groups`' counters that `keep` selects (zrt's operation
/// names).
pub(super) fn summary<G: ProcessGroup>(
    groups: &[(&'static str, &G)],
    keep: impl Fn(&str) -> bool,
) -> CommsSummary {
    let rows = groups
        .iter()
        .flat_map(|&(role, g)| {
            g.stats()
                .by_size()
                .into_iter()
                .filter(|s| keep(s.op))
                .map(move |s| CommsRow {
                    role,
                    group: g.name().to_string(),
                    ranks: g.size(),
                    op: s.op,
                    bytes: s.bytes,
                    calls: s.calls,
                    time: s.time,
                })
        })
        .collect();
    CommsSummary { rows }
}

/// Logs each operation `cfg` selects on `groups` as it completes
/// (DeepSpeed's `verbose` line, bandwidths as above). Called on the job's
/// first rank at build, with `verbose`.
///
/// The lines come from the groups' communication threads; they go to the
/// `tracing` subscriber in effect where this is called (the engine's
/// build), as the engine's other lines do, even one set for that thread
/// only.
pub(super) fn observe<G: ProcessGroup>(groups: &[(&'static str, &G)], cfg: &CommsLoggerConfig) {
    let to = tracing::dispatcher::get_default(|d| d.clone());
    for &(role, g) in groups {
        let (c, name, ranks, to) = (cfg.clone(), g.name().to_string(), g.size(), to.clone());
        g.stats().observe(Some(Arc::new(move |o: &OpRecord| {
            if !c.logs(o.op) {
                return;
            }
            let bw = algbw(o.bytes, o.time);
            let bus = bw.zip(bus_factor(o.op, ranks)).map(|(a, b)| a * b);
            tracing::dispatcher::with_default(&to, || {
                tracing::info!(
                    "comm op: {} | group: {role} {name} ({ranks}) | time (ms): {:.3} | msg size: {} | algbw (GB/s): {} | busbw (GB/s): {}",
                    o.op,
                    o.time.as_secs_f64() * 1e3,
                    size(o.bytes),
                    cell(bw),
                    cell(bus),
                )
            });
        })));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(op: &'static str, ranks: usize, bytes: u64, calls: u64, ms: u64) -> CommsRow {
        CommsRow {
            role: "shard",
            group: "world".into(),
            ranks,
            op,
            bytes,
            calls,
            time: Duration::from_millis(ms),
        }
    }

    #[test]
    fn bandwidths_follow_nccl_tests() {
        // 1e9 bytes in 2 calls taking 4 s: 2 s each, 0.5 GB/s.
        let r = row("all_reduce", 4, 1_000_000_000, 2, 4000);
        assert_eq!(r.latency(), Duration::from_secs(2));
        assert_eq!(r.algbw(), Some(0.5));
        assert_eq!(r.busbw(), Some(0.75));
        assert_eq!(
            row("reduce_scatter", 4, 1_000_000_000, 1, 2000).busbw(),
            Some(0.375)
        );
        assert_eq!(
            row("all_gather", 2, 1_000_000_000, 1, 1000).busbw(),
            Some(0.5)
        );
        assert_eq!(
            row("broadcast", 8, 1_000_000_000, 1, 1000).busbw(),
            Some(1.0)
        );
        assert_eq!(row("barrier", 2, 0, 3, 1).algbw(), None);
        assert_eq!(row("barrier", 2, 0, 3, 1).busbw(), None);
        // More calls than a u32 holds: 2^32 calls in 2^32 ns, 1 ns each.
        let mut r = row("barrier", 2, 0, 1 << 32, 0);
        r.time = Duration::from_nanos(1 << 32);
        assert_eq!(r.latency(), Duration::from_nanos(1));
    }

    #[test]
    fn the_table_names_each_row_in_units_a_person_reads() {
        let s = CommsSummary {
            rows: vec![
                row("all_gather", 2, 3 << 20, 10, 25),
                row("barrier", 2, 0, 1, 0),
            ],
        };
        let t = s.to_string();
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(
            lines[0].starts_with("group") && lines[0].ends_with("busbw GB/s"),
            "{t}"
        );
        let cells: Vec<&str> = lines[1].split_whitespace().collect();
        // 3 MiB in 2.5 ms: 1.258 GB/s, half of it over each link.
        assert_eq!(
            cells,
            [
                "shard",
                "world",
                "(2)",
                "all_gather",
                "3.0",
                "MiB",
                "10",
                "25.0",
                "2.500",
                "1.258",
                "0.629"
            ],
            "{t}"
        );
        let cells: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(
            cells,
            ["shard", "world", "(2)", "barrier", "0", "B", "1", "0.0", "0.000", "-", "-"],
            "{t}"
        );
        // A longer group name widens the first column for every row.
        let mut long = row("broadcast", 2, 8, 1, 1);
        long.group = "ranks[0, 1, 2, 3]#12".into();
        let s = CommsSummary {
            rows: vec![row("all_gather", 2, 8, 1, 1), long],
        };
        let t = s.to_string();
        let at: Vec<_> = t
            .lines()
            .map(|l| {
                l.find(" op")
                    .or(l.find(" all_gather"))
                    .or(l.find(" broadcast"))
            })
            .collect();
        // "shard ranks[0, 1, 2, 3]#12 (2)" is 30 characters.
        assert_eq!(at, [Some(30), Some(30), Some(30)], "{t}");
        assert_eq!(size(1023), "1023 B");
        assert_eq!(size(1536), "1.5 KiB");
        assert_eq!(size(5 << 30), "5.00 GiB");
    }
}
