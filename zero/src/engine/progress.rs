//! The progress line DeepSpeed's `steps_per_print` asks for: every that
//! many optimizer steps, the first rank logs where training stands.

/// Where training stands at an accumulation boundary.
pub(super) struct Progress {
    /// Boundaries so far, skipped ones included (DeepSpeed's `global_steps`).
    pub(super) boundaries: u64,
    /// Of those, skipped on a gradient overflow.
    pub(super) skipped: u64,
    /// The learning rate of the last applied step.
    pub(super) lr: f64,
    /// Adam's betas of the last applied step (DeepSpeed's `mom`).
    pub(super) betas: (f64, f64),
    /// SGD's or RMSprop's momentum (Adagrad's: 0), which the line says
    /// instead of betas none of them has.
    pub(super) momentum: Option<f64>,
    /// This boundary's gradient norm before clipping; `None` when it was
    /// skipped (no norm is taken then).
    pub(super) norm: Option<f64>,
    /// The fp16 loss scale now.
    pub(super) loss_scale: Option<f64>,
}

/// The line to log at this boundary, if `steps_per_print` (`every`) asks
/// for one: on boundaries that are a multiple of it, as DeepSpeed counts
/// them (skipped steps included, so the lines stay evenly spaced). 0 turns
/// the lines off; DeepSpeed would divide by it.
pub(super) fn line(every: u64, p: &Progress) -> Option<String> {
    if every == 0 || p.boundaries == 0 || p.boundaries % every != 0 {
        return None;
    }
    let mom = match p.momentum {
        Some(m) => sig6(m),
        None => format!("({}, {})", sig6(p.betas.0), sig6(p.betas.1)),
    };
    let mut s = format!(
        "step={}, skipped={}, lr={}, mom={mom}",
        p.boundaries,
        p.skipped,
        sig6(p.lr),
    );
    match p.norm {
        Some(n) => s.push_str(&format!(", grad_norm={}", sig6(n))),
        None => s.push_str(", grad_norm=none (step skipped)"),
    }
    if let Some(scale) = p.loss_scale {
        s.push_str(&format!(", loss_scale={}", sig6(scale)));
    }
    Some(s)
}

/// `x` to six significant digits, trailing zeros dropped (C's `%g`): a
/// schedule's lr is `0.00084`, not `0.0008400000000000001`.
fn sig6(x: f64) -> String {
    fn trim(s: &str) -> &str {
        match s.contains('.') {
            true => s.trim_end_matches('0').trim_end_matches('.'),
            false => s,
        }
    }
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let exp = x.abs().log10().floor() as i32;
    if (-5..6).contains(&exp) {
        let decimals = usize::try_from(5 - exp).unwrap_or(0);
        trim(&format!("{x:.decimals$}")).to_string()
    } else {
        let s = format!("{x:.5e}");
        match s.split_once('e') {
            Some((mantissa, e)) => format!("{}e{e}", trim(mantissa)),
            None => s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(boundaries: u64, norm: Option<f64>, loss_scale: Option<f64>) -> Progress {
        Progress {
            boundaries,
            skipped: 1,
            lr: 0.001,
            betas: (0.9, 0.999),
            momentum: None,
            norm,
            loss_scale,
        }
    }

    #[test]
    fn a_line_every_steps_per_print_boundaries_and_none_between() {
        let printed: Vec<u64> = (0..=9)
            .filter(|&b| line(3, &at(b, Some(1.0), None)).is_some())
            .collect();
        assert_eq!(printed, [3, 6, 9]);
        assert!((0..=9).all(|b| line(0, &at(b, Some(1.0), None)).is_none()));
        assert!(line(1, &at(1, None, None)).is_some());
    }

    #[test]
    fn numbers_are_printed_to_six_significant_digits() {
        let cases = [
            (0.0008400000000000001, "0.00084"),
            (0.001515, "0.001515"),
            (0.9, "0.9"),
            (2.8519481234, "2.85195"),
            (32768.0, "32768"),
            (65536.0 * 65536.0, "4.29497e9"),
            (1.5e-7, "1.5e-7"),
            (-0.25, "-0.25"),
            (0.0, "0"),
            (f64::INFINITY, "inf"),
            (f64::NAN, "NaN"),
        ];
        for (x, want) in cases {
            assert_eq!(sig6(x), want, "{x:e}");
        }
    }

    #[test]
    fn the_line_says_the_step_the_schedule_and_what_the_step_saw() {
        assert_eq!(
            line(2, &at(4, Some(0.25), None)).as_deref(),
            Some("step=4, skipped=1, lr=0.001, mom=(0.9, 0.999), grad_norm=0.25")
        );
        assert_eq!(
            line(2, &at(4, None, Some(32768.0))).as_deref(),
            Some(
                "step=4, skipped=1, lr=0.001, mom=(0.9, 0.999), grad_norm=none (step skipped), loss_scale=32768"
            )
        );
        let sgd = Progress {
            momentum: Some(0.9),
            ..at(4, Some(0.25), None)
        };
        assert_eq!(
            line(2, &sgd).as_deref(),
            Some("step=4, skipped=1, lr=0.001, mom=0.9, grad_norm=0.25")
        );
    }
}
