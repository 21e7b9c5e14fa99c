//! The `optimizer` block: its type, the keys each optimizer takes (a key
//! another optimizer's is named with the one that takes it, as
//! DeepSpeed's keyword arguments fail on it), and each optimizer's
//! settings with their defaults and ranges.

use serde_json::{Map, Value};

use super::{Setting, P};
use crate::config::{OptimizerConfig, OptimizerKind, NS_COEFFICIENTS};

/// `optimizer.params` keys of Adam's that mean nothing to Lion.
const ADAM_ONLY: [&str; 6] = [
    "eps",
    "adam_w_mode",
    "bias_correction",
    "torch_adam",
    "amsgrad",
    "fused",
];
/// `torch.optim.SGD`'s keys that no other optimizer takes
/// (`maximize`, `foreach` and `differentiable` are torch's Adam's
/// too, but not DeepSpeed's FusedAdam's, so still unknown there).
const SGD_ONLY: [&str; 3] = ["momentum", "dampening", "nesterov"];
/// DeepSpeed's `FusedLamb`'s keys that no other optimizer takes.
const LAMB_ONLY: [&str; 4] = ["max_coeff", "min_coeff", "eps_inside_sqrt", "max_grad_norm"];
/// `torch.optim.Adagrad`'s keys that no other optimizer takes.
const ADAGRAD_ONLY: [&str; 2] = ["lr_decay", "initial_accumulator_value"];
/// `torch.optim.RMSprop`'s keys that no other optimizer takes (its
/// `momentum` is SGD's too).
const RMSPROP_ONLY: [&str; 2] = ["alpha", "centered"];
/// DeepSpeed's Muon's and `torch.optim.Muon`'s keys that no other
/// optimizer takes (`momentum` and `nesterov` are SGD's too).
const MUON_ONLY: [&str; 6] = [
    "muon_lr",
    "adam_lr",
    "ns_method",
    "ns_steps",
    "ns_coefficients",
    "adjust_lr_fn",
];

/// The config without an `optimizer` block: DeepSpeed's FusedAdam's
/// defaults (AdamW), and every other optimizer's settings at theirs.
fn default_config() -> OptimizerConfig {
    OptimizerConfig {
        kind: OptimizerKind::AdamW,
        lr: Setting::Value(1e-3),
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: Setting::Value(0.0),
        adam_w_mode: true,
        bias_correction: true,
        momentum: 0.0,
        dampening: 0.0,
        nesterov: false,
        maximize: false,
        lr_decay: 0.0,
        initial_accumulator_value: 0.0,
        alpha: 0.99,
        centered: false,
        max_coeff: 10.0,
        min_coeff: 0.01,
        eps_inside_sqrt: false,
        adam_lr: None,
        ns_steps: 5,
        ns_coefficients: NS_COEFFICIENTS,
        match_rms_adamw: false,
    }
}

/// Whether `kind` is one of torch.optim's own (its implementation keys,
/// `maximize` and its coupled weight decay), not DeepSpeed's.
fn is_torch_optim(kind: OptimizerKind) -> bool {
    matches!(
        kind,
        OptimizerKind::Sgd | OptimizerKind::Adagrad | OptimizerKind::Rmsprop
    )
}

/// The `optimizer.params` keys zrt knows under any optimizer (those of
/// another optimizer are refused by name before), and torch.optim's
/// implementation keys under its own.
fn known_params(kind: OptimizerKind) -> Vec<&'static str> {
    let mut known = vec![
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "adam_w_mode",
        "bias_correction",
        "torch_adam",
        "amsgrad",
        "fused",
    ];
    known.extend(SGD_ONLY);
    known.extend(LAMB_ONLY);
    known.extend(ADAGRAD_ONLY);
    known.extend(RMSPROP_ONLY);
    known.extend(MUON_ONLY);
    if is_torch_optim(kind) {
        // torch's own implementation choices: zrt has one.
        known.extend(["maximize", "foreach", "differentiable"]);
    }
    if kind == OptimizerKind::Rmsprop {
        known.push("capturable");
    }
    known
}

/// The momentum settings of SGD, RMSprop and Muon (zeros for the others).
struct Momentum {
    momentum: f64,
    dampening: f64,
    nesterov: bool,
    /// RMSprop's `centered`.
    centered: bool,
}

impl P {
    /// The `optimizer` block (AdamW with FusedAdam's defaults, and a
    /// warning, without one).
    pub(super) fn optimizer(&mut self, top: &Map<String, Value>) -> OptimizerConfig {
        let default = default_config();
        let Some(o) = self.object(top, "optimizer") else {
            self.warnings.push(
                "no `optimizer` block: zrt uses AdamW with lr 1e-3, betas (0.9, 0.999), eps 1e-8, no weight decay (DeepSpeed's FusedAdam defaults)".into(),
            );
            return default;
        };
        self.keys(o, "optimizer", &["type", "params"], &[], false);
        let kind = match self.string(o, "optimizer", "type") {
            None => OptimizerKind::Adam,
            Some(t) => OptimizerKind::from_name(&t).unwrap_or_else(|| {
                self.problems.push(format!(
                    "`optimizer.type` \"{}\" is not supported by zrt: use \"Adam\", \"AdamW\", \"Lion\", \"SGD\", \"Lamb\", \"Adagrad\", \"RMSprop\" or \"Muon\"",
                    t.to_ascii_lowercase()
                ));
                OptimizerKind::Adam
            }),
        };
        let empty = Map::new();
        let p = match o.get("params") {
            Some(Value::Object(m)) => m,
            None => &empty,
            Some(v) => {
                self.problems
                    .push(format!("`optimizer.params` must be an object, got {v}"));
                &empty
            }
        };
        let path = "optimizer.params";
        self.refuse_adam_keys(kind, p, path);
        self.refuse_others_keys(kind, p, path);
        self.keys(p, path, &known_params(kind), &[], false);
        // (Lion's and SGD's blocks were refused the key above; FusedLamb
        // and DeepSpeed's CPU Adagrad refuse amsgrad too.)
        if matches!(
            kind,
            OptimizerKind::Adam
                | OptimizerKind::AdamW
                | OptimizerKind::Lamb
                | OptimizerKind::Adagrad
        ) && self.bool_or(p, path, "amsgrad", false)
        {
            self.problems.push("`optimizer.params.amsgrad` is not implemented by zrt: remove it or set it to false".into());
        }
        let muon = kind == OptimizerKind::Muon;
        let betas = self.betas(kind, p, path);
        // DeepSpeed's Adam defaults to decoupled decay (adam_w_mode = true);
        // torch.optim's decay (SGD's, Adagrad's, RMSprop's) is coupled.
        let adam_w_mode = match kind {
            OptimizerKind::Adam => self.bool_or(p, path, "adam_w_mode", true),
            OptimizerKind::AdamW
            | OptimizerKind::Lion
            | OptimizerKind::Lamb
            | OptimizerKind::Muon => true,
            OptimizerKind::Sgd | OptimizerKind::Adagrad | OptimizerKind::Rmsprop => false,
        };
        let adagrad = kind == OptimizerKind::Adagrad;
        let (lr_decay, initial_accumulator_value) = match adagrad {
            true => self.adagrad(p, path),
            false => (0.0, 0.0),
        };
        let lamb = kind == OptimizerKind::Lamb;
        let (max_coeff, min_coeff) = match lamb {
            true => self.lamb(p, path),
            false => (default.max_coeff, default.min_coeff),
        };
        let rmsprop = kind == OptimizerKind::Rmsprop;
        let alpha = match rmsprop {
            true => self.f64_or(p, path, "alpha", 0.99),
            false => 0.99,
        };
        if !(0.0..=1.0).contains(&alpha) {
            self.problems
                .push(format!("`{path}.alpha` must be in [0, 1], got {alpha}"));
        }
        let Momentum {
            momentum,
            dampening,
            nesterov,
            centered,
        } = self.momentum(kind, p, path);
        let (lr, adam_lr) = match muon {
            true => self.muon_rates(p, path),
            // torch's Adagrad's and RMSprop's defaults; FusedAdam's for the
            // others.
            false => {
                let lr = if adagrad || rmsprop { 1e-2 } else { 1e-3 };
                (self.f64_setting(p, path, "lr", lr), None)
            }
        };
        let (ns_steps, ns_coefficients, match_rms_adamw) = match muon {
            true => self.muon_iteration(p, path),
            false => (default.ns_steps, NS_COEFFICIENTS, false),
        };
        OptimizerConfig {
            kind,
            lr,
            betas,
            eps: self.f64_auto(p, path, "eps", if adagrad || muon { 1e-10 } else { 1e-8 }),
            weight_decay: self.f64_setting(p, path, "weight_decay", 0.0),
            adam_w_mode,
            bias_correction: self.bool_or(p, path, "bias_correction", true),
            momentum,
            dampening,
            nesterov,
            maximize: is_torch_optim(kind) && self.bool_or(p, path, "maximize", false),
            lr_decay,
            initial_accumulator_value,
            alpha,
            centered,
            max_coeff,
            min_coeff,
            eps_inside_sqrt: lamb && self.bool_or(p, path, "eps_inside_sqrt", false),
            adam_lr,
            ns_steps,
            ns_coefficients,
            match_rms_adamw,
        }
    }

    /// The keys of `keys` present in `p`.
    fn present(p: &Map<String, Value>, keys: &[&'static str]) -> Vec<&'static str> {
        keys.iter()
            .copied()
            .filter(|k| p.contains_key(*k))
            .collect()
    }

    /// Refuses Adam's settings an optimizer of `kind` does not take,
    /// saying what it has instead. DeepSpeed hands the params to the
    /// optimizer as keyword arguments, and fails on one it does not take;
    /// zrt names them instead.
    fn refuse_adam_keys(&mut self, kind: OptimizerKind, p: &Map<String, Value>, path: &str) {
        let (refused, why): (Vec<&str>, &str) = match kind {
            OptimizerKind::Lion => (
                Self::present(p, &ADAM_ONLY),
                "Lion does not take (Lion keeps one moment and no second, has no eps, and always decouples its weight decay)",
            ),
            OptimizerKind::Sgd => (
                (Self::present(p, &ADAM_ONLY).into_iter())
                    .chain(Self::present(p, &["betas"]))
                    .collect(),
                "SGD does not take (torch.optim.SGD has momentum, dampening, nesterov and weight_decay)",
            ),
            // FusedLamb takes eps, betas and bias_correction, not these.
            OptimizerKind::Lamb => (
                Self::present(p, &["adam_w_mode", "torch_adam", "fused"]),
                "Lamb does not take (DeepSpeed's FusedLamb adds its weight decay to the update, inside the trust ratio)",
            ),
            // torch's Adagrad takes eps, and DeepSpeed's CPU Adagrad an
            // amsgrad (false), but neither these.
            OptimizerKind::Adagrad => (
                Self::present(p, &["adam_w_mode", "bias_correction", "torch_adam", "betas"]),
                "Adagrad does not take (torch.optim.Adagrad has lr_decay, weight_decay, eps and initial_accumulator_value)",
            ),
            // torch's RMSprop takes eps, and none of these.
            OptimizerKind::Rmsprop => (
                Self::present(
                    p,
                    &[
                        "adam_w_mode",
                        "bias_correction",
                        "torch_adam",
                        "amsgrad",
                        "fused",
                        "betas",
                    ],
                ),
                "RMSprop does not take (torch.optim.RMSprop has alpha, eps, momentum and weight_decay)",
            ),
            // DeepSpeed's Muon hands its AdamW half lr, betas, eps and
            // weight_decay only.
            OptimizerKind::Muon => (
                Self::present(p, &ADAM_ONLY[1..]),
                "Muon does not take (its AdamW half has betas, eps, weight_decay and adam_lr)",
            ),
            OptimizerKind::Adam | OptimizerKind::AdamW => (Vec::new(), ""),
        };
        for key in refused {
            self.problems.push(format!(
                "`{path}.{key}` is an Adam setting that {why}: remove it, or use \"AdamW\""
            ));
        }
    }

    /// Refuses the keys only another optimizer than `kind` takes, naming
    /// that one.
    fn refuse_others_keys(&mut self, kind: OptimizerKind, p: &Map<String, Value>, path: &str) {
        let others: [(OptimizerKind, &[&'static str], &str); 4] = [
            (OptimizerKind::Muon, &MUON_ONLY, "a Muon"),
            (OptimizerKind::Lamb, &LAMB_ONLY, "a Lamb"),
            (OptimizerKind::Adagrad, &ADAGRAD_ONLY, "an Adagrad"),
            (OptimizerKind::Rmsprop, &RMSPROP_ONLY, "an RMSprop"),
        ];
        for (other, keys, a) in others.into_iter().filter(|(o, _, _)| *o != kind) {
            for key in Self::present(p, keys) {
                self.problems.push(format!(
                    "`{path}.{key}` is {a} setting that {} does not take: remove it, or use \"{}\"",
                    kind.name(),
                    other.name()
                ));
            }
        }
        if kind != OptimizerKind::Sgd {
            let why = match kind {
                OptimizerKind::Adagrad => "it keeps a sum of squares, no momentum",
                OptimizerKind::Rmsprop => "its momentum buffer is neither damped nor Nesterov's",
                OptimizerKind::Muon => "its momentum buffer is not damped",
                _ => "its moments decay by `betas`",
            };
            // RMSprop has a momentum of its own, Muon a Nesterov's too.
            let refused: &[&str] = match kind {
                OptimizerKind::Rmsprop => &SGD_ONLY[1..],
                OptimizerKind::Muon => &["dampening"],
                _ => &SGD_ONLY[..],
            };
            for key in Self::present(p, refused) {
                self.problems.push(format!(
                    "`{path}.{key}` is an SGD setting that {} does not take ({why}): remove it, or use \"SGD\"",
                    kind.name()
                ));
            }
        }
    }

    /// `betas`, each in [0, 1) (DeepSpeed's Muon gives its AdamW half
    /// (0.9, 0.95)); torch.optim's blocks were refused the key already.
    fn betas(&mut self, kind: OptimizerKind, p: &Map<String, Value>, path: &str) -> (f64, f64) {
        let default_betas = match kind {
            OptimizerKind::Muon => (0.9, 0.95),
            _ => (0.9, 0.999),
        };
        let betas = match p.get("betas") {
            None => default_betas,
            Some(_) if self.noted_auto(p, path, "betas") => default_betas,
            Some(Value::Array(a)) if a.len() == 2 => {
                let b1 = self
                    .number(&a[0], "optimizer.params.betas[0]")
                    .unwrap_or(0.9);
                let b2 = self
                    .number(&a[1], "optimizer.params.betas[1]")
                    .unwrap_or(0.999);
                (b1, b2)
            }
            Some(v) => {
                self.problems.push(format!(
                    "`optimizer.params.betas` must be [beta1, beta2], got {v}"
                ));
                default_betas
            }
        };
        // (torch.optim's blocks were refused their betas above: said once.)
        let has_betas = !is_torch_optim(kind);
        for (i, b) in [betas.0, betas.1].iter().enumerate() {
            if has_betas && !(0.0..1.0).contains(b) {
                self.problems.push(format!(
                    "`optimizer.params.betas[{i}]` must be in [0, 1), got {b}"
                ));
            }
        }
        betas
    }

    /// Adagrad's `lr_decay` and `initial_accumulator_value`.
    fn adagrad(&mut self, p: &Map<String, Value>, path: &str) -> (f64, f64) {
        let lr_decay = self.f64_or(p, path, "lr_decay", 0.0);
        if !(lr_decay >= 0.0 && lr_decay.is_finite()) {
            self.problems.push(format!(
                "`{path}.lr_decay` must be finite and >= 0, got {lr_decay}"
            ));
        }
        let initial = self.f64_or(p, path, "initial_accumulator_value", 0.0);
        if !(initial >= 0.0 && initial.is_finite()) {
            // torch's own check, plus finiteness.
            self.problems.push(format!(
                "`{path}.initial_accumulator_value` must be finite and >= 0, got {initial}"
            ));
        }
        (lr_decay, initial)
    }

    /// FusedLamb's trust-ratio bounds (`max_coeff`, `min_coeff`), and its
    /// old clipping refused.
    fn lamb(&mut self, p: &Map<String, Value>, path: &str) -> (f64, f64) {
        let max_coeff = self.f64_or(p, path, "max_coeff", 10.0);
        let min_coeff = self.f64_or(p, path, "min_coeff", 0.01);
        if !(min_coeff >= 0.0 && max_coeff >= min_coeff && max_coeff.is_finite()) {
            self.problems.push(format!(
                "`{path}.min_coeff` and `max_coeff` must be 0 <= min_coeff <= max_coeff, finite, got {min_coeff} and {max_coeff}"
            ));
        }
        if self.f64_or(p, path, "max_grad_norm", 0.0) != 0.0 {
            self.problems.push(format!(
                "`{path}.max_grad_norm` is FusedLamb's old clipping, which zrt does not implement: set `gradient_clipping` instead"
            ));
        }
        (max_coeff, min_coeff)
    }

    /// SGD's momentum, dampening and Nesterov; RMSprop's momentum and
    /// `centered`; Muon's momentum (0.95) and Nesterov (on); zeros for
    /// the others.
    fn momentum(&mut self, kind: OptimizerKind, p: &Map<String, Value>, path: &str) -> Momentum {
        let (sgd, rmsprop, muon) = (
            kind == OptimizerKind::Sgd,
            kind == OptimizerKind::Rmsprop,
            kind == OptimizerKind::Muon,
        );
        let centered = rmsprop && self.bool_or(p, path, "centered", false);
        let momentum = if sgd || rmsprop {
            self.f64_or(p, path, "momentum", 0.0)
        } else if muon {
            self.f64_or(p, path, "momentum", 0.95)
        } else {
            0.0
        };
        if muon && !(0.0..1.0).contains(&momentum) {
            self.problems.push(format!(
                "`{path}.momentum` must be in [0, 1) for Muon (the share of the old buffer kept each step; 0.95 is usual), got {momentum}"
            ));
        }
        let dampening = if sgd {
            self.f64_or(p, path, "dampening", 0.0)
        } else {
            0.0
        };
        let nesterov = match kind {
            OptimizerKind::Sgd => self.bool_or(p, path, "nesterov", false),
            OptimizerKind::Muon => self.bool_or(p, path, "nesterov", true),
            _ => false,
        };
        if !(momentum >= 0.0 && momentum.is_finite()) {
            self.problems.push(format!(
                "`{path}.momentum` must be finite and >= 0, got {momentum}"
            ));
        }
        if !dampening.is_finite() {
            self.problems.push(format!(
                "`{path}.dampening` must be finite, got {dampening}"
            ));
        }
        if centered && momentum > 0.0 {
            self.problems.push(format!(
                "`{path}.centered` with `momentum` above 0 is not implemented by zrt: it keeps a third array per parameter (the gradient's average and the momentum buffer, beside the square average), which zrt's flat state does not have; set centered to false or momentum to 0"
            ));
        }
        if sgd && nesterov && (momentum <= 0.0 || dampening != 0.0) {
            // torch.optim.SGD's own refusal.
            self.problems.push(format!(
                "`{path}.nesterov` needs momentum > 0 and dampening 0 (got momentum {momentum}, dampening {dampening}): set momentum, drop dampening, or set nesterov to false"
            ));
        }
        Momentum {
            momentum,
            dampening,
            nesterov,
            centered,
        }
    }

    /// Muon's two rates as DeepSpeed gives its two parameter groups: the
    /// Muon half `muon_lr`, else `lr`, else 0.02; the AdamW half
    /// `adam_lr`, else `lr`, else 3e-4 (`None`: the Muon half's, when
    /// `lr` alone sets both).
    fn muon_rates(&mut self, p: &Map<String, Value>, path: &str) -> (Setting<f64>, Option<f64>) {
        let own = |me: &mut Self, key: &str| match p.contains_key(key) {
            true => Some(me.f64_or(p, path, key, 0.0)),
            false => None,
        };
        let (muon_lr, adam_lr) = (own(self, "muon_lr"), own(self, "adam_lr"));
        let has_lr = p.contains_key("lr");
        let lr = match muon_lr {
            Some(r) => Setting::Value(r),
            None => self.f64_setting(p, path, "lr", 0.02),
        };
        let adam = match (adam_lr, has_lr, muon_lr) {
            (Some(r), _, _) => Some(r),
            // `lr` sets both; with `muon_lr` too, it is the AdamW half's.
            (None, true, None) => None,
            (None, true, Some(_)) => match self.f64_setting(p, path, "lr", 0.02) {
                Setting::Value(r) => Some(r),
                Setting::Auto => None,
            },
            (None, false, _) => Some(3e-4),
        };
        for (key, r) in [("muon_lr", muon_lr), ("adam_lr", adam)] {
            if let Some(r) = r.filter(|r| !(*r >= 0.0 && r.is_finite())) {
                self.problems
                    .push(format!("`{path}.{key}` must be finite and >= 0, got {r}"));
            }
        }
        (lr, adam)
    }

    /// Muon's Newton-Schulz settings: `ns_steps` (5), `ns_coefficients`
    /// (torch's), `adjust_lr_fn` (whether it is `"match_rms_adamw"`), and
    /// `ns_method`, of which zrt runs `"standard"` whatever it says.
    fn muon_iteration(
        &mut self,
        p: &Map<String, Value>,
        path: &str,
    ) -> (u32, (f64, f64, f64), bool) {
        let steps = self.u64_or(p, path, "ns_steps", 5);
        if !(1..100).contains(&steps) {
            // torch.optim.Muon refuses 100 and more.
            self.problems.push(format!(
                "`{path}.ns_steps` must be from 1 to 99 (Newton-Schulz iterations; 5 is usual), got {steps}"
            ));
        }
        let adjust = match self.string(p, path, "adjust_lr_fn").as_deref() {
            None | Some("original") => false,
            Some("match_rms_adamw") => true,
            Some(other) => {
                self.problems.push(format!(
                    "`{path}.adjust_lr_fn` must be \"original\" (each matrix's rate times sqrt(max(1, rows / cols))) or \"match_rms_adamw\" (times 0.2 sqrt(max(rows, cols))), got \"{other}\""
                ));
                false
            }
        };
        match self.string(p, path, "ns_method").as_deref() {
            None | Some("standard") => {}
            Some("gram") => self.warnings.push(format!(
                "`{path}.ns_method` = \"gram\": zrt runs the standard Newton-Schulz iteration (torch.optim.Muon's), which gives the same orthogonalization with more multiplications on wide matrices; set \"standard\" to silence this"
            )),
            Some(other) => self.problems.push(format!(
                "`{path}.ns_method` must be \"standard\" or \"gram\", got \"{other}\""
            )),
        }
        let coefficients = match p.get("ns_coefficients") {
            None => NS_COEFFICIENTS,
            Some(Value::Array(a))
                if a.len() == 3 && a.iter().all(|x| x.as_f64().is_some_and(f64::is_finite)) =>
            {
                let x: Vec<f64> = a.iter().filter_map(Value::as_f64).collect();
                (x[0], x[1], x[2])
            }
            Some(v) => {
                let (a, b, c) = NS_COEFFICIENTS;
                self.problems.push(format!(
                    "`{path}.ns_coefficients` must be three finite numbers [a, b, c], the iteration's a x + b x^3 + c x^5 (torch's default [{a}, {b}, {c}]), got {v}"
                ));
                NS_COEFFICIENTS
            }
        };
        (steps.clamp(1, 99) as u32, coefficients, adjust)
    }
}
