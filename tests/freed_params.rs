//! Reading a stage-3 parameter the engine freed, outside
//! `with_full_params`, through code that reads its bytes directly
//! (`VarStore::save`, libtorch's serializer): the process still stops (the
//! storage has no memory), but it says why and what to do, where before the
//! `.pt` path wrote a file of zero-byte storages and reported success and
//! the `.safetensors` path died of a bare SIGSEGV. The crashes run in a
//! child process (this test binary run again, `ZRT_FREED_CHILD` saying
//! what to do). Faults outside the freed memory still reach the handler
//! the program had before (Rust's, or its own).

use crate::common;

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use common::{config_zero, model, solo_engine, tokens};
use tch::nn;
use zrt::collectives::local::LocalGroup;
use zrt::zero::Engine;

const CHILD: &str = "ZRT_FREED_CHILD";
const THIS: &str = "freed_params::saving_a_freed_stage_3_model_names_the_problem_and_the_fix";

/// A one-rank stage-3 model after a step: every parameter freed.
fn freed_model() -> (nn::VarStore, Engine<LocalGroup>) {
    let (vs, plan, gpt) = model();
    let cfg = config_zero(3, 1, 0.0, "", r#""stage3_param_persistence_threshold": 0,"#);
    let e = solo_engine(&vs, &plan, &cfg).unwrap();
    e.backward(&gpt.loss(&tokens(0, 0, 0, 1))).unwrap();
    e.step().unwrap();
    (vs, e)
}

/// Runs this binary's [`THIS`] test as a child doing `what`; its stderr and
/// how it ended.
fn child(what: &str) -> (String, std::process::ExitStatus) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", THIS, "--nocapture", "--test-threads=1"])
        .env(CHILD, what)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (err, out.status)
}

#[test]
fn saving_a_freed_stage_3_model_names_the_problem_and_the_fix() {
    match std::env::var(CHILD).as_deref() {
        Ok("overflow") => return overflow_after_a_free(),
        Ok("plain") => return fault_under_a_plain_handler(),
        Ok("released") => return forward_before_the_engine(),
        Ok(path) => {
            let (vs, _e) = freed_model();
            eprintln!("saving");
            let r = vs.save(path);
            // Not reached when the save stops the process as it should.
            eprintln!("save returned {r:?}");
            return;
        }
        Err(_) => {}
    }
    for ext in ["pt", "safetensors"] {
        let path = std::env::temp_dir().join(format!("zrt-freed-{}.{ext}", std::process::id()));
        let (err, status) = child(&path.display().to_string());
        let _ = std::fs::remove_file(&path);
        assert!(err.contains("saving"), "{ext}: {err}");
        assert_eq!(status.signal(), Some(libc::SIGSEGV), "{ext}: {err}");
        for words in [
            "a stage-3 parameter whose memory the engine freed was read or written",
            "engine.with_full_params(|| vs.save(path))",
            "engine.save_16bit_model(path)",
            "engine.unshard()",
        ] {
            assert!(err.contains(words), "{ext}: `{words}` not in:\n{err}");
        }
    }
}

/// Frees a stage-3 model (installing zrt's handler), then overflows a
/// thread's stack: the fault is not in a guard, so Rust's own report must
/// still run.
fn overflow_after_a_free() {
    let _model = freed_model();
    fn deep(n: u64) -> u64 {
        let pad = std::hint::black_box([n; 64]);
        match n {
            u64::MAX => 0,
            _ => pad[1] + deep(n + 1),
        }
    }
    let t = std::thread::Builder::new()
        .stack_size(1 << 16)
        .spawn(|| deep(0));
    let _ = t.unwrap().join();
}

/// What the program's own SIGSEGV handler writes before it exits with 7.
const PLAIN: &str = "the program's own SIGSEGV handler ran\n";

extern "C" fn plain_handler(_: libc::c_int) {
    // SAFETY: write(2) and _exit(2) are async-signal-safe.
    unsafe {
        libc::write(2, PLAIN.as_ptr().cast(), PLAIN.len());
        libc::_exit(7);
    }
}

/// Installs a plain (not `SA_SIGINFO`) SIGSEGV handler, as a program's own
/// crash reporter might, then frees a stage-3 model (installing zrt's
/// handler over it) and faults outside any guard.
fn fault_under_a_plain_handler() {
    // SAFETY: installs a handler that only makes async-signal-safe calls.
    unsafe {
        libc::signal(
            libc::SIGSEGV,
            plain_handler as *const () as libc::sighandler_t,
        )
    };
    let _model = freed_model();
    // SAFETY: none needed: this read faults on purpose (address 8 is
    // never mapped), which is the point.
    let v = unsafe { std::ptr::read_volatile(8 as *const u8) };
    eprintln!("read {v}");
}

/// A rank other than the first of a plan under
/// `ShardPlan::weights_on_first_rank_only` runs the model before any
/// engine gave it weights.
fn forward_before_the_engine() {
    let (_vs, _plan, gpt) = common::built_on(&common::GPT, zrt::gpt::Gpt::new, Some(1));
    eprintln!("forward");
    let loss = gpt.loss(&tokens(0, 0, 1, 1));
    // Not reached when the forward stops the process as it should.
    eprintln!("loss {}", loss.double_value(&[]));
}

#[test]
fn a_forward_before_the_engine_on_a_rank_that_released_its_weights_says_why() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let (err, status) = child("released");
    assert!(err.contains("forward"), "{err}");
    assert!(!err.contains("loss "), "{err}");
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "{err}");
    for words in [
        "under ShardPlan::weights_on_first_rank_only (on every rank under ShardPlan::weights_from_file and weights_on_disk_while_built), every weight has no memory",
        "load pretrained weights on rank 0 only",
    ] {
        assert!(err.contains(words), "`{words}` not in:\n{err}");
    }
}

#[test]
fn other_faults_still_reach_the_handler_that_was_there_before() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    // Rust's own (SA_SIGINFO, for its stack-overflow report).
    let (err, status) = child("overflow");
    assert!(err.contains("has overflowed its stack"), "{err}");
    assert!(!err.contains("zrt: a stage-3 parameter"), "{err}");
    assert_eq!(status.signal(), Some(libc::SIGABRT), "{err}");
    // A plain one the program installed.
    let (err, status) = child("plain");
    assert!(err.contains(PLAIN.trim_end()), "{err}");
    assert!(!err.contains("zrt: a stage-3 parameter"), "{err}");
    assert_eq!(status.code(), Some(7), "{err}");
}
