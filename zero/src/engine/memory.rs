//! DeepSpeed's `memory_breakdown`: what the first rank holds, logged
//! when the engine is built and with each progress line. DeepSpeed's
//! reports its GPU's allocator and the host's virtual memory; a CPU
//! rank's memory is its resident set, which the kernel reports.

/// This process's resident set now and at its peak, in bytes (VmRSS,
/// VmHWM; `None` where /proc does not say): what `memory_breakdown` logs,
/// and what the main job and `zrt bench train` report as peak RSS.
pub fn resident_bytes() -> (Option<f64>, Option<f64>) {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return (None, None);
    };
    let kib = |key: &str| {
        s.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .map(|k| k * 1024.0)
    };
    (kib("VmRSS:"), kib("VmHWM:"))
}

/// The line to log: `when` ("after building the engine", "at step 10"),
/// the resident set now and at its peak, the engine's model state and
/// its reuse pools, and what libtorch holds now and at its peak
/// (activations, autograd's temporaries: [`crate::glue::allocated`]).
pub(super) fn line(
    when: &str,
    model_state: usize,
    pooled: usize,
    torch: crate::glue::Allocated,
) -> String {
    let mib = |b: f64| format!("{:.1} MiB", b / (1u64 << 20) as f64);
    let (now, peak) = resident_bytes();
    let rss = match (now, peak) {
        (Some(n), Some(p)) => format!("resident {} (peak {})", mib(n), mib(p)),
        _ => "resident set unknown (no /proc/self/status)".to_string(),
    };
    format!(
        "memory {when}: {rss}; model state {}, reuse pools {}; libtorch {} (peak {})",
        mib(model_state as f64),
        mib(pooled as f64),
        mib(torch.now as f64),
        mib(torch.peak as f64)
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_line_names_what_it_counts() {
        let torch = crate::glue::Allocated {
            now: 1 << 20,
            peak: 5 << 19,
        };
        let l = super::line("at step 3", 3 << 20, 1 << 19, torch);
        assert!(l.starts_with("memory at step 3: resident "), "{l}");
        assert!(
            l.ends_with(
                "; model state 3.0 MiB, reuse pools 0.5 MiB; libtorch 1.0 MiB (peak 2.5 MiB)"
            ),
            "{l}"
        );
    }
}
