//! Saving a checkpoint, exporting the model and loading a checkpoint hold
//! one unit's values at a time, never the whole model: the point of ZeRO-3
//! is a model no rank can hold, and a save that gathers it all would fail
//! on exactly those. Stage 3 with a frozen base (sharded) and the optimizer
//! state on NVMe, 2 ranks (threads). And `with_full_params` at stage 0
//! writes a change back into the state where it lies, without a copy of
//! it.
//!
//! Measured with a counting global allocator: the peak of this process's
//! Rust heap (both ranks' threads) above where it stood when the call
//! began. libtorch's own tensors are outside it, and what the engine keeps
//! between steps is not counted (the peak starts from it).
//!
//! In a test binary of its own: the counting allocator is the process's
//! global one, and other tests' threads would add to its peaks.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Barrier;

use common::{config_zero, model_of, nvme, on_ranks, MICRO};
use tch::{Kind, Tensor};
use zrt::gpt::GptConfig;
use zrt::zero::{AutoHints, Engine};

struct Counting;

static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call goes to the system allocator unchanged; the counters
// only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        NOW.fetch_sub(l.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            NOW.fetch_sub(l.size(), Ordering::Relaxed);
            grew(new);
        }
        q
    }
}

fn grew(n: usize) {
    let now = NOW.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The counters are the process's: one test measures at a time.
static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `f` on every rank at once and returns the heap's peak above
/// where it stood before (all ranks' threads together).
fn peak_of(r: usize, gate: &Barrier, f: impl FnOnce()) -> usize {
    gate.wait();
    if r == 0 {
        PEAK.store(NOW.load(Ordering::Relaxed), Ordering::Relaxed);
    }
    gate.wait();
    let before = NOW.load(Ordering::Relaxed);
    f();
    gate.wait();
    PEAK.load(Ordering::Relaxed).saturating_sub(before)
}

/// 16 blocks: a unit is a sixteenth of the model.
const BIG: GptConfig = GptConfig {
    vocab: 64,
    d_model: 192,
    layers: 16,
    heads: 4,
    seq: 8,
};

fn is_frozen(name: &str) -> bool {
    name.ends_with(".fc.weight") || name.ends_with(".out.weight")
}

fn tokens(rank: usize) -> Tensor {
    let n = MICRO * (BIG.seq + 1);
    Tensor::arange(n, (Kind::Int64, tch::Device::Cpu))
        .g_mul_scalar(rank as i64 + 3)
        .remainder(BIG.vocab)
        .view([MICRO, BIG.seq + 1])
}

#[test]
fn save_export_and_load_hold_one_unit_at_a_time() {
    let dir = std::env::temp_dir().join(format!("zrt-ckpt-memory-{}", std::process::id()));
    let swap = dir.join("swap");
    std::fs::create_dir_all(&swap).unwrap();
    let (aio, offload) = nvme(&swap);
    let zero = format!(r#"{offload} "stage3_param_persistence_threshold": 0,"#);
    let cfg = config_zero(3, 1, 1.0, &aio, &zero);
    let _one = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let gate = Barrier::new(2);
    let sizes = on_ranks(2, |r| {
        let (vs, plan, gpt) = model_of(&BIG);
        let (mut frozen, mut trained) = (0usize, 0usize);
        for (name, t) in vs.variables() {
            let bytes = t.numel() * 4;
            match is_frozen(&name) {
                true => {
                    let _ = t.set_requires_grad(false);
                    frozen += bytes;
                }
                false => trained += bytes,
            }
        }
        let g = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg, g, &AutoHints::default()).unwrap();
        e.backward(&gpt.loss(&tokens(r.rank()))).unwrap();
        e.step().unwrap();
        let rank = r.rank();
        let save = peak_of(rank, &gate, || {
            e.save_checkpoint(&dir, "t").map(drop).unwrap();
        });
        let export = peak_of(rank, &gate, || {
            e.save_16bit_model(dir.join("model.safetensors")).unwrap();
        });
        let load = peak_of(rank, &gate, || {
            e.load_checkpoint(&dir, Some("t")).map(drop).unwrap();
        });
        (frozen, trained, save, export, load)
    });
    let (frozen, trained, save, export, load) = sizes[0];
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    eprintln!(
        "frozen {:.1} MiB, trained {:.1} MiB; heap peaks: save {:.1}, export {:.1}, load {:.1} MiB",
        mib(frozen),
        mib(trained),
        mib(save),
        mib(export),
        mib(load)
    );
    assert!(
        frozen > 16 << 20 && trained > 8 << 20,
        "the model is big enough to tell"
    );
    // A unit's gathers are a sixteenth of that. A whole copy of the frozen
    // base on a rank, of the trained parameters on both, or of both ranks'
    // offloaded optimizer states (12 bytes per shard element) is more.
    for (what, peak) in [("save", save), ("export", export), ("load", load)] {
        assert!(
            peak < frozen / 2,
            "{what} held {:.1} MiB at its peak: more than a few units' worth",
            mib(peak)
        );
    }
    // And the files hold what they should: the export, every tensor.
    let file: HashMap<String, Tensor> = Tensor::read_safetensors(dir.join("model.safetensors"))
        .unwrap()
        .into_iter()
        .collect();
    let (vs, _, _) = model_of(&BIG);
    assert_eq!(file.len(), vs.variables().len());
    for (name, t) in vs.variables() {
        assert_eq!(file[&name].size(), t.size(), "{name}");
        if is_frozen(&name) {
            assert!(file[&name].equal(&t), "{name} is the model's frozen value");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn with_full_params_at_stage_0_copies_no_units_state() {
    // bf16: the fp32 master, m and v are three arrays beside the model, and
    // a change must reach the master. Stage 0 holds them whole on every
    // rank; writing back used to copy a unit's three (12 bytes per element)
    // on each rank before putting them back unchanged.
    let cfg = config_zero(0, 1, 1.0, r#""bf16": {"enabled": true},"#, "");
    let _one = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let gate = Barrier::new(2);
    let out = on_ranks(2, |r| {
        let (vs, plan, gpt) = model_of(&BIG);
        let g = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg, g, &AutoHints::default()).unwrap();
        e.backward(&gpt.loss(&tokens(r.rank()))).unwrap();
        e.step().unwrap();
        let w = vs
            .variables()
            .into_iter()
            .find(|(n, _)| n == "h.0.fc.weight")
            .unwrap()
            .1;
        let first = || {
            let t = w.to_kind(Kind::Float).flatten(0, -1).narrow(0, 0, 4);
            Vec::<f32>::try_from(&t).unwrap()
        };
        let before = first();
        let peak = peak_of(r.rank(), &gate, || {
            e.with_full_params(|| {
                tch::no_grad(|| {
                    // Every parameter changes: every unit is written back.
                    for (_, t) in vs.variables() {
                        let _ = t.shallow_clone().g_mul_scalar_(2.0);
                    }
                })
            })
            .unwrap();
        });
        (peak, before, first())
    });
    let (vs, _, _) = model_of(&BIG);
    let unit = vs
        .variables()
        .iter()
        .filter(|(n, _)| n.starts_with("h.0."))
        .map(|(_, t)| t.numel())
        .sum::<usize>();
    let peak = out[0].0;
    eprintln!(
        "a block {:.2} M elements; write-back heap peak {:.2} MiB (both ranks)",
        unit as f64 / 1e6,
        peak as f64 / (1 << 20) as f64
    );
    // Each rank holds the unit's old 16-bit rounding (2 bytes per element)
    // to find what changed; a copy of its state is 12.
    assert!(
        peak < 2 * 4 * unit,
        "write-back held {peak} bytes at its peak: a copy of a unit's state is {} per rank",
        12 * unit
    );
    // And the change took (doubling is exact in bf16), on both ranks.
    for (_, before, after) in &out {
        let twice: Vec<f32> = before.iter().map(|x| 2.0 * x).collect();
        assert!(before.iter().all(|x| *x != 0.0));
        assert_eq!(after, &twice);
    }
}

/// What [`three_steps`] measures of each step.
#[derive(Clone, Copy)]
enum Measured {
    /// Forward, backward and `step()`.
    WholeStep,
    /// `backward` alone.
    Backward,
}

/// Two ranks train the 16-block GPT at stage 3, reductions in buckets of
/// 0.5 M elements (`overlap_comm` as given), for three steps: the model's
/// bytes a rank, and each step's heap peak (both ranks) over `measured`.
fn three_steps(overlap: bool, measured: Measured) -> (usize, Vec<usize>) {
    let zero = format!(
        r#""stage3_param_persistence_threshold": 0, "reduce_bucket_size": 5e5, "overlap_comm": {overlap},"#
    );
    let cfg = config_zero(3, 1, 1.0, "", &zero);
    let _one = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let gate = Barrier::new(2);
    let out = on_ranks(2, |r| {
        let (vs, plan, gpt) = model_of(&BIG);
        let model: usize = vs.variables().values().map(|t| t.numel() * 4).sum();
        let g = r.new_group(&[0, 1]).unwrap();
        let e = Engine::new(&vs, &plan, &cfg, g, &AutoHints::default()).unwrap();
        let mut peaks = Vec::new();
        for _ in 0..3 {
            peaks.push(match measured {
                Measured::WholeStep => peak_of(r.rank(), &gate, || {
                    e.backward(&gpt.loss(&tokens(r.rank()))).unwrap();
                    e.step().unwrap();
                }),
                Measured::Backward => {
                    let loss = gpt.loss(&tokens(r.rank()));
                    let peak = peak_of(r.rank(), &gate, || e.backward(&loss).unwrap());
                    e.step().unwrap();
                    peak
                }
            });
        }
        (model, peaks)
    });
    out.into_iter().next().unwrap()
}

#[test]
fn a_step_holds_a_few_units_of_gradients_and_parameters_and_the_first_no_more() {
    // Stage 3, 16 blocks (a block is 0.44 M elements), reductions in
    // buckets of 0.5 M elements: a step holds a few units' gradients in
    // flight and a few gathered units. Until 2026-11-26 every unit's full
    // gradient stayed in flight to the end of backward (the whole model's,
    // in fp32, on each rank), and the first forward kept every unit
    // gathered until its backward (to name a tied weight).
    let (model, peaks) = &three_steps(true, Measured::WholeStep);
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    println!(
        "model {:.1} MiB a rank; heap peaks of steps 1-3 (both ranks): {:.1}, {:.1}, {:.1} MiB",
        mib(*model),
        mib(peaks[0]),
        mib(peaks[1]),
        mib(peaks[2])
    );
    // Both ranks together: under half the model a rank (at 2026-11-26
    // 23.8 MiB, where all gradients in flight made 88.5). Two buckets of
    // gradients in flight (3.8 MiB a rank) and the newest unit's, the
    // gathered unit and the one prefetched, and the pool's two buffers.
    for (step, peak) in peaks.iter().enumerate() {
        assert!(
            *peak < *model,
            "step {} held {:.1} MiB at its peak (both ranks), the model is {:.1} MiB a rank",
            step + 1,
            mib(*peak),
            mib(*model)
        );
    }
    // The first step no more than a block above the later ones. Their
    // peaks vary with how the ranks' gathers interleave (21.9-23.7 MiB over
    // runs, 23.6-23.7 in most), so the first is held to the higher of the
    // two: a single favourable step 2 failed CI once (23.8 against 21.9).
    let later = peaks[1].max(peaks[2]);
    assert!(
        peaks[0] <= later + model / 16,
        "step 1 held {:.1} MiB, steps 2-3 at most {:.1}: the first forward kept units gathered",
        mib(peaks[0]),
        mib(later)
    );
}

#[test]
fn without_overlap_comm_backward_holds_no_gradients_in_flight() {
    // Stage 3, buckets of 0.5 M elements (2 MB of fp32). With
    // `overlap_comm` (the default) up to two buckets of a rank's gradients
    // stay in flight while backward goes on; without, each unit's hook
    // waits for its reductions and its buffers go back to the pool at once.
    let (on, off) = (
        three_steps(true, Measured::Backward).1,
        three_steps(false, Measured::Backward).1,
    );
    let mib = |b: &Vec<usize>| {
        b.iter()
            .map(|x| format!("{:.1}", *x as f64 / (1 << 20) as f64))
            .collect::<Vec<_>>()
    };
    println!(
        "backward heap peaks, both ranks (MiB): overlap_comm on {:?}, off {:?}",
        mib(&on),
        mib(&off)
    );
    // At 2026-11-26: 15.2-17.7 MiB on, 8.4-8.5 off. Off holds at least a
    // bucket a rank less (the two buckets in flight, less the unit being
    // reduced, which off holds too), in every step.
    let bucket = 500_000 * 4;
    let (most_off, least_on) = (off.iter().max().unwrap(), on.iter().min().unwrap());
    assert!(
        most_off + 2 * bucket <= *least_on,
        "backward peaks {:?} MiB without overlap_comm, {:?} with",
        mib(&off),
        mib(&on)
    );
}

#[test]
fn a_muon_step_holds_about_a_unit_beyond_adamws_not_a_copy_of_the_state() {
    // Muon gathers each matrix whole on its owner to orthogonalize it: a
    // rank holds its own matrices of one unit and one matrix in flight,
    // the rest of its work in the gradients' place. (A first version kept
    // two shard-sized buffers for every unit through the step: the
    // optimizer state's size again; a second gathered whole units and
    // reduce-scattered a unit of results.)
    let zero = r#""stage3_param_persistence_threshold": 0,"#;
    let _one = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let gate = Barrier::new(2);
    let step_peak = |optimizer: &str| {
        let cfg = common::config_of(optimizer, 3, 1, 1.0, "", zero);
        let out = on_ranks(2, |r| {
            let (vs, plan, gpt) = model_of(&BIG);
            let model: usize = vs.variables().values().map(|t| t.numel() * 4).sum();
            let g = r.new_group(&[0, 1]).unwrap();
            let e = Engine::new(&vs, &plan, &cfg, g, &AutoHints::default()).unwrap();
            let mut peak = 0;
            for _ in 0..2 {
                e.backward(&gpt.loss(&tokens(r.rank()))).unwrap();
                peak = peak.max(peak_of(r.rank(), &gate, || {
                    e.step().unwrap();
                }));
            }
            (model, peak)
        });
        out[0]
    };
    let (model, adamw) = step_peak("AdamW");
    let (_, muon) = step_peak("Muon");
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    println!(
        "model {:.1} MiB a rank; step() heap peaks (both ranks): AdamW {:.1} MiB, Muon {:.1} MiB",
        mib(model),
        mib(adamw),
        mib(muon)
    );
    // A block is a sixteenth of the model; each rank holds about half a
    // block's matrices and one matrix (a third of a block) at a time: 2
    // blocks both ranks on 2026-11-30, fifth session (the first version:
    // over 30; the second, gathering whole units: 6).
    let block = model / 16;
    assert!(
        muon <= adamw + 4 * block,
        "Muon's step held {:.1} MiB at its peak (both ranks), AdamW's {:.1}, a block is {:.1}",
        mib(muon),
        mib(adamw),
        mib(block)
    );
}
