//! `zrt bench ...`: binaries' measurements against a peer and a limit
//! measured in the same run.
//!
//! This machine is noisy (timings swing 20-50%, a core can vanish for
//! minutes), so every benchmark runs zrt and its peers interleaved
//! (A B A B ...) over several rounds and reports medians.

pub mod adam;
pub mod collectives;
pub mod hf;
pub mod loss;
pub mod offload;
pub mod peer;
pub mod plot;
pub mod train;

use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// clap's parser for a count that must be at least 1 (rounds, steps,
/// sizes, threads): a 0 would print NaN rows, or panic, instead of a table.
pub fn at_least_one() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(1..)
}

/// Refuses a benchmark whose buffers cannot fit in this host's memory,
/// before it allocates any: a size past what the host has would otherwise
/// abort in the allocator ("memory allocation failed") or, with the
/// kernel's overcommit, get a rank killed by the OOM killer mid-run.
///
/// `bytes` is what the run holds at its peak (`None` when computing it
/// overflowed, which no host holds); `what` names the flags that set it,
/// as the user typed them. The limit is `MemAvailable` from
/// `/proc/meminfo`; where that cannot be read only the overflow is refused.
pub fn check_fits(bytes: Option<u64>, what: &str) -> Result<()> {
    check_fits_in(bytes, zrt::offload::available_memory(), what)
}

/// [`check_fits`] against a given amount of available memory (`None`:
/// unknown), so the rule is testable without the host's.
fn check_fits_in(bytes: Option<u64>, available: Option<u64>, what: &str) -> Result<()> {
    const GIB: f64 = (1u64 << 30) as f64;
    if zrt::offload::fits_in(bytes, available) {
        return Ok(());
    }
    match (bytes, available) {
        (Some(b), Some(a)) => bail!(
            "{what} needs about {:.1} GiB of memory at once and this host has {:.1} GiB available; give a smaller value",
            b as f64 / GIB,
            a as f64 / GIB
        ),
        _ => bail!(
            "{what} asks for more memory than any host has (the byte count overflows); give a smaller value"
        ),
    }
}

/// Median of `xs` (the mean of the middle two for even lengths).
///
/// Returns NaN for an empty slice, so a missing measurement shows as NaN in
/// a table rather than as a plausible number.
pub fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

/// fp32 matmul FLOP/s on `threads` intra-op threads (the peak MFU is
/// measured against): five products of two 1024 x 1024 matrices after
/// one warm-up. Leaves libtorch on `threads` threads.
pub fn matmul_peak(threads: i32) -> f64 {
    tch::set_num_threads(threads);
    let a = tch::Tensor::randn([1024, 1024], (tch::Kind::Float, tch::Device::Cpu));
    let _ = a.matmul(&a);
    let t = Instant::now();
    for _ in 0..5 {
        let _ = a.matmul(&a);
    }
    2.0 * 1024f64.powi(3) * 5.0 / t.elapsed().as_secs_f64()
}

/// Seconds taken by each of `reps` calls of `f`.
pub fn time_each(reps: usize, mut f: impl FnMut()) -> Vec<f64> {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect()
}

/// A table cell for a figure that is missing without a peer (`NaN`): `-`
/// instead of `NaN`; `suffix` follows the number ("x" for ratios).
pub fn cell(x: f64, decimals: usize, suffix: &str) -> String {
    if x.is_finite() {
        format!("{x:.decimals$}{suffix}")
    } else {
        "-".to_string()
    }
}

/// Nanoseconds for a cache line to go from one core to another and back:
/// two threads, pinned to the first two CPUs this process may use, take
/// turns bumping one atomic (median of three runs of up to 100 000 round
/// trips, each run cut off after half a second: a vCPU the host stops
/// must not stall the benchmark). NaN with fewer than two CPUs. On a VM it
/// tells where the host put the vCPUs: this project's 2-vCPU machine
/// measures about 50 ns or, for minutes at a time, about 400 ns (the cores
/// on different dies: hand-offs between cores slower, more memory
/// bandwidth).
pub fn core_round_trip_ns() -> f64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    const TRIPS: u64 = 100_000;
    const STOP: u64 = u64::MAX;
    const LIMIT: std::time::Duration = std::time::Duration::from_millis(500);
    let cpus = allowed_cpus();
    if cpus.len() < 2 {
        return f64::NAN;
    }
    let once = || {
        let word = AtomicU64::new(0);
        std::thread::scope(|s| {
            s.spawn(|| {
                pin_to(cpus[1]);
                // Answers every odd value with the next even one until told
                // to stop; the compare-exchange never overwrites STOP.
                loop {
                    match word.load(Ordering::Acquire) {
                        STOP => break,
                        x if x % 2 == 1 => {
                            let _ = word.compare_exchange(
                                x,
                                x + 1,
                                Ordering::AcqRel,
                                Ordering::Acquire,
                            );
                        }
                        _ => std::hint::spin_loop(),
                    }
                }
            });
            let _unpin = Unpin(cpus.clone());
            pin_to(cpus[0]);
            let t = Instant::now();
            let mut trips = 0;
            'trips: while trips < TRIPS {
                word.store(2 * trips + 1, Ordering::Release);
                let mut spins = 0u32;
                while word.load(Ordering::Acquire) != 2 * trips + 2 {
                    std::hint::spin_loop();
                    spins = spins.wrapping_add(1);
                    if spins % 4096 == 0 && t.elapsed() > LIMIT {
                        break 'trips;
                    }
                }
                trips += 1;
            }
            let ns = t.elapsed().as_secs_f64() * 1e9 / trips as f64;
            word.store(STOP, Ordering::Release);
            if trips == 0 {
                f64::NAN
            } else {
                ns
            }
        })
    };
    median(&[once(), once(), once()])
}

/// The CPUs this thread may run on.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the call fills it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Pins the calling thread to `cpus` (best effort: a failure leaves it
/// where it is, which only makes the measurement noisier).
fn pin_set(cpus: &[usize]) {
    // SAFETY: as in `allowed_cpus`; the set only holds CPUs it may use.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn pin_to(cpu: usize) {
    pin_set(&[cpu]);
}

/// Restores a thread's CPUs when dropped.
struct Unpin(Vec<usize>);

impl Drop for Unpin {
    fn drop(&mut self) {
        pin_set(&self.0);
    }
}

/// Single- or multi-threaded memory copy bandwidth in GB/s, counting bytes
/// read plus bytes written (the convention the Adam figures use), from the
/// median of `reps` copies of `bytes`.
///
/// One thread copies on the caller: spawning a thread per copy costs tens
/// of microseconds, which measured a 1 MiB copy at 2.6-3.9 GB/s against
/// 19-21 GB/s inline on this VM (and flattered every ratio against it).
pub fn copy_bandwidth(threads: usize, bytes: usize, reps: usize) -> f64 {
    let n = bytes / 4;
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let chunk = n.div_ceil(threads.max(1));
    let times = time_each(reps, || {
        if threads <= 1 {
            dst.copy_from_slice(&src);
            return;
        }
        std::thread::scope(|s| {
            for (d, src) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                s.spawn(move || d.copy_from_slice(src));
            }
        });
    });
    std::hint::black_box(&dst);
    2.0 * (n * 4) as f64 / median(&times) / 1e9
}

/// Both cores' memcpy at once, in GB/s of bytes copied by the pair
/// together (2 S / t, where `t` lasts until the slower copy is done; the
/// memcpy column's convention, S / t, for two copies): two threads, pinned
/// to the first two CPUs this process may use, each copy their own
/// `bytes`, starting together, `reps` times (median). NaN with fewer than
/// two CPUs.
///
/// Divided by one core's memcpy of the same S it says how much more the
/// memory system moves for two cores than for one: about 2 where each
/// core copies within its caches; at 128 MiB on this project's VM 1.2-1.3
/// while its two vCPUs share a cache and 1.7-1.8 while they sit on
/// different dies. The staged rows of `bench collectives`, whose data
/// comes from memory at 16 and 128 MiB, read higher where it is higher
/// (README, "What bounds the staged rows").
pub fn pair_copy_bandwidth(bytes: usize, reps: usize) -> f64 {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let cpus = allowed_cpus();
    if cpus.len() < 2 || reps == 0 {
        return f64::NAN;
    }
    let n = bytes / 4;
    // A spinning barrier: a futex wake-up costs tens of microseconds, as
    // long as a 1 MiB copy. `arrivals` counts both threads' arrivals; the
    // k-th barrier (from 1) is passed when it reaches 2 k. Yields now and
    // then, so a vCPU the host took away does not stall the other.
    let arrivals = AtomicUsize::new(0);
    let barrier = |k: usize| {
        arrivals.fetch_add(1, Ordering::AcqRel);
        let mut spins = 0u32;
        while arrivals.load(Ordering::Acquire) < 2 * k {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins % 4096 == 0 {
                std::thread::yield_now();
            }
        }
    };
    let copies = |times: Option<&mut Vec<f64>>| {
        let src = vec![1.0f32; n];
        let mut dst = vec![0.0f32; n];
        let mut times = times;
        for rep in 0..reps {
            barrier(2 * rep + 1);
            let t = Instant::now();
            dst.copy_from_slice(&src);
            barrier(2 * rep + 2);
            if let Some(times) = times.as_mut() {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        std::hint::black_box(&dst);
    };
    let mut times = Vec::with_capacity(reps);
    std::thread::scope(|s| {
        s.spawn(|| {
            pin_to(cpus[1]);
            copies(None);
        });
        let _unpin = Unpin(cpus.clone());
        pin_to(cpus[0]);
        copies(Some(&mut times));
    });
    2.0 * (n * 4) as f64 / median(&times) / 1e9
}

/// Runs `world` processes of `program args` with the launch contract (the
/// same environment `zrt launch` sets, on loopback) and returns the JSON of
/// the line rank 0 printed as `@@zrt {...}`.
pub fn run_ranks(
    program: &std::path::Path,
    args: &[String],
    world: usize,
    env: &[(&str, String)],
) -> Result<Value> {
    let port = zrt::collectives::store::free_store_port("127.0.0.1")?.to_string();
    let token = format!("bench-{}-{port}", std::process::id());
    let path = peer::venv_path();
    let children: Vec<_> = (0..world)
        .map(|r| {
            let mut c = Command::new(program);
            c.args(args)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("ZRT_TOKEN", &token)
                .env("OMP_NUM_THREADS", "1")
                // DeepSpeed JIT-builds with the venv's ninja.
                .env("PATH", &path)
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit());
            for (k, v) in env {
                c.env(k, v);
            }
            // A benchmark killed mid-run must not leave ranks spinning on
            // the cores the next run measures.
            crate::launch::die_with_launcher(&mut c);
            c.spawn()
                .with_context(|| format!("starting {}", program.display()))
        })
        .collect::<Result<_>>()?;
    let mut line = None;
    for c in children {
        let o = c.wait_with_output()?;
        if !o.status.success() {
            bail!(
                "a rank of {} {:?} failed ({})",
                program.display(),
                args,
                o.status
            );
        }
        for l in String::from_utf8_lossy(&o.stdout).lines() {
            if let Some(j) = l.split_once("@@zrt ").map(|x| x.1) {
                line = Some(serde_json::from_str(j)?);
            }
        }
    }
    line.context("no rank printed results")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn a_run_past_the_available_memory_is_refused_naming_its_flags() {
        let gib = 1u64 << 30;
        assert!(check_fits_in(Some(gib), Some(gib), "--sizes 1").is_ok());
        assert!(check_fits_in(Some(gib), None, "--sizes 1").is_ok());
        let e = check_fits_in(Some(3 * gib), Some(2 * gib), "--sizes 9").unwrap_err();
        assert_eq!(
            e.to_string(),
            "--sizes 9 needs about 3.0 GiB of memory at once and this host has 2.0 GiB \
             available; give a smaller value"
        );
        let e = check_fits_in(None, None, "--params 9").unwrap_err();
        assert!(e
            .to_string()
            .starts_with("--params 9 asks for more memory than any host has"));
    }
}
