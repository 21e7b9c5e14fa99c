//! Checks shared by every backend's tests: each rank runs every op on every
//! dtype and size, and asserts its own results against a naive reference
//! computed from the (deterministic) inputs of all ranks.

#![allow(dead_code)]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use half::{bf16, f16};
use zrt_collectives::{chunk_range, Element, ProcessGroup, ReduceOp};

/// Test values of each element type, and the reference result of a
/// reduction computed independently of the backend (in i64 / f64).
pub trait Make: Element {
    fn make(x: i64) -> Self;
    fn expect(xs: &[i64], op: ReduceOp) -> Self;
}

macro_rules! make_float {
    ($t:ty, $from:expr) => {
        impl Make for $t {
            fn make(x: i64) -> Self {
                $from(x as f64)
            }
            fn expect(xs: &[i64], op: ReduceOp) -> Self {
                let sum: i64 = xs.iter().sum();
                $from(match op {
                    ReduceOp::Sum => sum as f64,
                    ReduceOp::Avg => sum as f64 / xs.len() as f64,
                    ReduceOp::Max => *xs.iter().max().unwrap() as f64,
                    ReduceOp::Min => *xs.iter().min().unwrap() as f64,
                })
            }
        }
    };
}
make_float!(f32, |x: f64| x as f32);
make_float!(f64, |x: f64| x);
make_float!(bf16, bf16::from_f64);
make_float!(f16, f16::from_f64);

macro_rules! make_int {
    ($t:ty) => {
        impl Make for $t {
            fn make(x: i64) -> Self {
                x as $t
            }
            fn expect(xs: &[i64], op: ReduceOp) -> Self {
                let sum: i64 = xs.iter().sum();
                (match op {
                    ReduceOp::Sum => sum,
                    ReduceOp::Avg => sum / xs.len() as i64,
                    ReduceOp::Max => *xs.iter().max().unwrap(),
                    ReduceOp::Min => *xs.iter().min().unwrap(),
                }) as $t
            }
        }
    };
}
make_int!(i64);
make_int!(u8);

/// Rank `r`'s i-th input: small non-negative integers, exact in every type.
pub fn val(r: usize, i: usize) -> i64 {
    ((r * 7 + i * 3) % 11) as i64
}

/// Lengths that do not divide evenly by 2, 3 or 4, 64 that does, and 0
/// (every op on empty buffers must work, and agree on zero rounds).
pub const LENS: [usize; 5] = [0, 1, 7, 64, 1001];

/// Every op on `g` for element type T and every length; panics naming the
/// op, dtype, world and length on the first wrong element.
pub fn check_ops<T: Make, G: ProcessGroup>(g: &G) {
    let (me, world) = (g.rank(), g.size());
    let ops = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
    for len in LENS {
        let input: Vec<T> = (0..len).map(|i| T::make(val(me, i))).collect();
        let column = |i: usize| -> Vec<i64> { (0..world).map(|r| val(r, i)).collect() };
        for op in ops {
            let full: Vec<T> = (0..len).map(|i| T::expect(&column(i), op)).collect();
            let got = g.all_reduce(input.clone(), op).wait().unwrap();
            assert_eq!(
                got,
                full,
                "{:?} all_reduce {op:?} world {world} len {len} rank {me}",
                T::DTYPE
            );
            let (back, part) = g
                .reduce_scatter(input.clone(), Vec::new(), op)
                .wait()
                .unwrap();
            assert_eq!(back, input);
            assert_eq!(
                part[..],
                full[chunk_range(len, world, me)],
                "{:?} reduce_scatter {op:?} world {world} len {len} rank {me}",
                T::DTYPE
            );
            let inplace = g.reduce_scatter_in_place(input.clone(), op).wait().unwrap();
            let r = chunk_range(len, world, me);
            assert_eq!(
                inplace[r.clone()],
                full[r],
                "{:?} reduce_scatter_in_place {op:?} world {world} len {len} rank {me}",
                T::DTYPE
            );
        }
        // all_gather in place: own part at its place, the rest overwritten
        // (a sentinel shows every other part is filled in).
        let want: Vec<T> = (0..len)
            .map(|i| {
                let r = (0..world)
                    .find(|&r| chunk_range(len, world, r).contains(&i))
                    .unwrap_or(0);
                T::make(val(r, i))
            })
            .collect();
        let own = chunk_range(len, world, me);
        let buf: Vec<T> = (0..len)
            .map(|i| {
                if own.contains(&i) {
                    want[i]
                } else {
                    T::make(99)
                }
            })
            .collect();
        let got = g.all_gather_in_place(buf).wait().unwrap();
        assert_eq!(
            got,
            want,
            "{:?} all_gather_in_place world {world} len {len} rank {me}",
            T::DTYPE
        );
        check_symmetric::<T, G>(g, len, &input, &want);
        // all_gather: every rank contributes len elements.
        let (back, got) = g.all_gather(input.clone(), Vec::new()).wait().unwrap();
        assert_eq!(back, input);
        let want: Vec<T> = (0..world)
            .flat_map(|r| (0..len).map(move |i| T::make(val(r, i))))
            .collect();
        assert_eq!(
            got,
            want,
            "{:?} all_gather world {world} len {len} rank {me}",
            T::DTYPE
        );
        // all_gather_v of unequal parts: rank r contributes len + r elements.
        let mine: Vec<T> = (0..len + me).map(|i| T::make(val(me, i))).collect();
        let (_, got) = g.all_gather_v(mine, Vec::new()).wait().unwrap();
        let want: Vec<T> = (0..world)
            .flat_map(|r| (0..len + r).map(move |i| T::make(val(r, i))))
            .collect();
        assert_eq!(
            got,
            want,
            "{:?} all_gather_v world {world} len {len} rank {me}",
            T::DTYPE
        );
        // all_to_all: rank q's chunk `me` from every rank q, into a
        // reused buffer of another length holding sentinels.
        let (back, got) = g
            .all_to_all(input.clone(), vec![T::make(99); len + 3])
            .wait()
            .unwrap();
        assert_eq!(back, input);
        let want: Vec<T> = (0..world)
            .flat_map(|q| chunk_range(len, world, me).map(move |i| T::make(val(q, i))))
            .collect();
        assert_eq!(
            got,
            want,
            "{:?} all_to_all world {world} len {len} rank {me}",
            T::DTYPE
        );
        let root = world - 1;
        let b: Vec<T> = if me == root {
            input.clone()
        } else {
            vec![T::ZERO; len]
        };
        let got = g.broadcast(b, root).wait().unwrap();
        let want: Vec<T> = (0..len).map(|i| T::make(val(root, i))).collect();
        assert_eq!(
            got,
            want,
            "{:?} broadcast world {world} len {len} rank {me}",
            T::DTYPE
        );
        g.barrier().wait().unwrap();
    }
}

/// The symmetric-buffer collectives on one allocation reused for every op
/// (as the engine reuses its buffers): reduce_scatter with each op, then
/// all_gather, each against the same reference as the `Vec` collectives.
/// Under `ZRT_BACKEND=shm` the buffer must really be shared.
fn check_symmetric<T: Make, G: ProcessGroup>(g: &G, len: usize, input: &[T], gathered: &[T]) {
    let (me, world) = (g.rank(), g.size());
    let mut buf = g.alloc_symmetric::<T>(len).wait().unwrap();
    assert_eq!(buf.len(), len);
    assert!(buf.iter().all(|x| *x == T::ZERO), "a fresh buffer is zeros");
    let shm = std::env::var("ZRT_BACKEND").as_deref() == Ok("shm");
    assert_eq!(buf.is_shared(), shm, "{buf:?}");
    let r = chunk_range(len, world, me);
    let column = |i: usize| -> Vec<i64> { (0..world).map(|r| val(r, i)).collect() };
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
        buf.copy_from_slice(input);
        buf = g.reduce_scatter_symmetric(buf, op).wait().unwrap();
        let want: Vec<T> = r.clone().map(|i| T::expect(&column(i), op)).collect();
        assert_eq!(
            buf[r.clone()],
            want[..],
            "{:?} reduce_scatter_symmetric {op:?} world {world} len {len} rank {me}",
            T::DTYPE
        );
    }
    for (i, x) in buf.iter_mut().enumerate() {
        *x = if r.contains(&i) {
            gathered[i]
        } else {
            T::make(99)
        };
    }
    let buf = g.all_gather_symmetric(buf).wait().unwrap();
    assert_eq!(
        buf[..],
        gathered[..],
        "{:?} all_gather_symmetric world {world} len {len} rank {me}",
        T::DTYPE
    );
}

/// [`check_ops`] for every element type.
pub fn check_all_dtypes<G: ProcessGroup>(g: &G) {
    check_ops::<f32, G>(g);
    check_ops::<bf16, G>(g);
    check_ops::<f16, G>(g);
    check_ops::<f64, G>(g);
    check_ops::<i64, G>(g);
    check_ops::<u8, G>(g);
}

/// A rank that comes late: the last rank sleeps before a barrier and before
/// broadcasting. No rank may leave the barrier before the last one entered
/// it (compared on the wall clock, which every rank on this host shares:
/// ranks start the check at different times, so a duration each measures
/// would prove nothing), and the late broadcast must still arrive (a wait
/// is timed from the call's start, not from when the data was due); so
/// must a symmetric allocation and a symmetric reduce_scatter the last rank
/// comes late to.
pub fn check_late_rank<G: ProcessGroup>(g: &G) {
    let (me, n) = (g.rank(), g.size());
    let now = || {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos() as i64
    };
    let late = Duration::from_millis(300);
    if me == n - 1 {
        std::thread::sleep(late);
    }
    let entered = now();
    let cpu = cpu_time();
    g.barrier().wait().unwrap();
    let left = now();
    // A process rank waiting for the late one sleeps rather than spins: it
    // would burn a core its peer may need. (Only a process that is one rank
    // can tell: the local backend's test shares its process with others.)
    if std::env::var_os("ZRT_BACKEND").is_some() && me != n - 1 {
        let used = cpu_time() - cpu;
        assert!(
            used < late / 2,
            "rank {me} used {used:?} of CPU waiting {late:?} at a barrier"
        );
    }
    if me == n - 1 {
        std::thread::sleep(late);
    }
    let buf = vec![if me == n - 1 { entered } else { 0 }];
    let last_entered = g.broadcast(buf, n - 1).wait().unwrap()[0];
    assert!(
        left >= last_entered,
        "rank {me} left the barrier {} ms before the last rank entered it",
        (last_entered - left) / 1_000_000
    );
    // A symmetric allocation (collective on shm), and a reduce_scatter over
    // one, wait for a late rank too.
    if me == n - 1 {
        std::thread::sleep(late);
    }
    let mut sym = g.alloc_symmetric::<f32>(16).wait().unwrap();
    sym.fill(1.0);
    if me == n - 1 {
        std::thread::sleep(late);
    }
    let sym = g
        .reduce_scatter_symmetric(sym, ReduceOp::Sum)
        .wait()
        .unwrap();
    let own = chunk_range(16, n, me);
    assert!(sym[own].iter().all(|&x| x == n as f32), "{:?}", &sym[..]);
}

/// CPU time this process has used, user and system.
fn cpu_time() -> Duration {
    // SAFETY: getrusage fills the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) }, 0);
    let d = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    d(u.ru_utime) + d(u.ru_stime)
}

/// A ring of sends: each rank sends its rank to the next and receives from
/// the previous.
pub fn check_send_recv<G: ProcessGroup>(g: &G) {
    let (me, n) = (g.rank(), g.size());
    let sent = g.send(vec![me as f32; 5], (me + 1) % n);
    let got = g.recv::<f32>(5, (me + n - 1) % n).wait().unwrap();
    sent.wait().unwrap();
    assert_eq!(got, vec![((me + n - 1) % n) as f32; 5]);
    // Several messages to one peer before it reads any arrive in order.
    let to = (me + 1) % n;
    let sent: Vec<_> = (0..3)
        .map(|k| g.send(vec![k as i64, me as i64], to))
        .collect();
    let from = (me + n - 1) % n;
    for k in 0..3 {
        let got = g.recv::<i64>(2, from).wait().unwrap();
        assert_eq!(got, [k, from as i64], "message {k} from rank {from}");
    }
    for s in sent {
        s.wait().unwrap();
    }
}
