//! Walking the JSON: every problem is collected, never just the first.

use serde_json::{Map, Value};

use super::keys::{self, closest};
use super::{
    AioConfig, AutoHints, Batch, CommsLoggerConfig, Config, ConfigError, LossScaleConfig,
    MonitorConfig, OffloadConfig, OffloadDevice, OptimizerConfig, OptimizerKind, Precision,
    Resolved, SchedulerConfig, ZeroConfig, NS_COEFFICIENTS,
};

/// A value that may be `"auto"` (resolved by [`Config::resolve`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Setting<T> {
    /// Given in the config (or its default).
    Value(T),
    /// `"auto"`: taken from the program's hints at resolve time.
    Auto,
}

impl<T: Copy> Setting<T> {
    /// The value, or `None` while it is `"auto"`.
    pub fn value(&self) -> Option<T> {
        match self {
            Setting::Value(v) => Some(*v),
            Setting::Auto => None,
        }
    }
}

#[derive(Default)]
struct P {
    problems: Vec<String>,
    warnings: Vec<String>,
    /// Keys given as `"auto"` whose fields hold placeholders until resolve.
    autos: Vec<String>,
}

/// A 16-bit block's `enabled`.
#[derive(Clone, Copy, PartialEq)]
enum Enabled {
    Off,
    On,
    /// `"auto"`: the program decides at resolve.
    Auto,
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

impl P {
    /// Checks an object's keys: known ones pass; known-but-unimplemented
    /// ones warn; unknown ones are errors (`strict`) or warnings, naming the
    /// closest known key.
    fn keys(
        &mut self,
        obj: &Map<String, Value>,
        path: &str,
        known: &[&str],
        unimplemented: &[&str],
        strict: bool,
    ) {
        for k in obj.keys() {
            if known.contains(&k.as_str()) {
                continue;
            }
            let at = join(path, k);
            if unimplemented.contains(&k.as_str()) {
                let v = &obj[k];
                let same = keys::SAME_AS_ZRT.iter().find(|(key, _, _)| key == k);
                let disabled = v.get("enabled").and_then(Value::as_bool) == Some(false);
                match same {
                    _ if disabled => {}
                    Some((_, value, _)) if value.is(v) => {}
                    Some((_, keys::AsZrt::Never, instead)) => self.warnings.push(format!(
                        "`{at}` is a DeepSpeed setting zrt does not implement; it is ignored: {instead}"
                    )),
                    Some((_, _, instead)) => self.warnings.push(format!(
                        "`{at}` = {v} is a DeepSpeed setting zrt does not implement; it is ignored: {instead}"
                    )),
                    None => self.warnings.push(format!(
                        "`{at}` is a DeepSpeed setting zrt does not implement yet; it is ignored"
                    )),
                }
                continue;
            }
            if keys::ZERO_DEPRECATED.iter().any(|(d, _)| d == k) && path == "zero_optimization" {
                continue; // mapped by the caller
            }
            let hint = closest(k, known.iter().chain(unimplemented).copied())
                .map_or_else(String::new, |c| {
                    format!("; did you mean `{}`?", join(path, c))
                });
            if strict {
                self.problems.push(format!("unknown key `{at}`{hint}"));
            } else {
                self.warnings
                    .push(format!("unknown key `{at}` is ignored{hint}"));
            }
        }
    }

    fn number(&mut self, v: &Value, at: &str) -> Option<f64> {
        match v.as_f64() {
            Some(x) if x.is_finite() => Some(x),
            // DeepSpeed's schedulers take one value per parameter group.
            None if v.is_array() && at.starts_with("scheduler.params.") => {
                self.problems.push(format!(
                    "`{at}` is a list, DeepSpeed's form for one value per optimizer parameter group, got {v}: zrt's config has no parameter groups; give one number and scale the groups' rates against it with ShardPlan::scale_learning_rate"
                ));
                None
            }
            _ => {
                self.problems
                    .push(format!("`{at}` must be a number, got {v}"));
                None
            }
        }
    }

    fn uint(&mut self, v: &Value, at: &str) -> Option<u64> {
        let x = self.number(v, at)?;
        if x < 0.0 || x.fract() != 0.0 || x > 9.0e15 {
            self.problems.push(format!(
                "`{at}` must be a whole number from 0 to 9e15 (5e8 is fine), got {v}"
            ));
            return None;
        }
        Some(x as u64)
    }

    fn u64_or(&mut self, o: &Map<String, Value>, path: &str, key: &str, default: u64) -> u64 {
        match o.get(key) {
            None => default,
            Some(v) => self.uint(v, &join(path, key)).unwrap_or(default),
        }
    }

    fn u64_setting(
        &mut self,
        o: &Map<String, Value>,
        path: &str,
        key: &str,
        default: u64,
    ) -> Setting<u64> {
        match o.get(key) {
            Some(Value::String(s)) if s == "auto" => Setting::Auto,
            None => Setting::Value(default),
            Some(v) => Setting::Value(self.uint(v, &join(path, key)).unwrap_or(default)),
        }
    }

    fn f64_or(&mut self, o: &Map<String, Value>, path: &str, key: &str, default: f64) -> f64 {
        match o.get(key) {
            None => default,
            Some(v) => self.number(v, &join(path, key)).unwrap_or(default),
        }
    }

    fn f64_setting(
        &mut self,
        o: &Map<String, Value>,
        path: &str,
        key: &str,
        default: f64,
    ) -> Setting<f64> {
        match o.get(key) {
            Some(Value::String(s)) if s == "auto" => Setting::Auto,
            None => Setting::Value(default),
            Some(v) => Setting::Value(self.number(v, &join(path, key)).unwrap_or(default)),
        }
    }

    /// Whether `o[key]` is `"auto"`; if so the key is noted for resolve.
    fn noted_auto(&mut self, o: &Map<String, Value>, path: &str, key: &str) -> bool {
        let auto = o.get(key).is_some_and(|v| v == "auto");
        if auto {
            self.autos.push(join(path, key));
        }
        auto
    }

    /// A number that may be `"auto"`: then `default` stands in and the key
    /// is noted for resolve.
    fn f64_auto(&mut self, o: &Map<String, Value>, path: &str, key: &str, default: f64) -> f64 {
        match self.noted_auto(o, path, key) {
            true => default,
            false => self.f64_or(o, path, key, default),
        }
    }

    /// As [`P::f64_auto`], for a whole number.
    fn u64_auto(&mut self, o: &Map<String, Value>, path: &str, key: &str, default: u64) -> u64 {
        match self.noted_auto(o, path, key) {
            true => default,
            false => self.u64_or(o, path, key, default),
        }
    }

    fn bool_or(&mut self, o: &Map<String, Value>, path: &str, key: &str, default: bool) -> bool {
        match o.get(key) {
            None => default,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                self.problems.push(format!(
                    "`{}` must be true or false, got {v}",
                    join(path, key)
                ));
                default
            }
        }
    }

    fn string(&mut self, o: &Map<String, Value>, path: &str, key: &str) -> Option<String> {
        match o.get(key) {
            None => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(v) => {
                self.problems
                    .push(format!("`{}` must be a string, got {v}", join(path, key)));
                None
            }
        }
    }

    fn object<'a>(
        &mut self,
        o: &'a Map<String, Value>,
        key: &str,
    ) -> Option<&'a Map<String, Value>> {
        match o.get(key) {
            None | Some(Value::Null) => None,
            Some(Value::Object(m)) => Some(m),
            Some(v) => {
                self.problems
                    .push(format!("`{key}` must be an object, got {v}"));
                None
            }
        }
    }

    /// A batch size: absent, `"auto"`, or a whole number >= 1.
    fn batch(&mut self, o: &Map<String, Value>, key: &str) -> Setting<Option<u64>> {
        match o.get(key) {
            None | Some(Value::Null) => Setting::Value(None),
            Some(Value::String(s)) if s == "auto" => Setting::Auto,
            Some(v) => match self.uint(v, key) {
                Some(0) => {
                    self.problems.push(format!("`{key}` must be at least 1"));
                    Setting::Value(None)
                }
                n => Setting::Value(n),
            },
        }
    }

    fn optimizer(&mut self, top: &Map<String, Value>) -> OptimizerConfig {
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
        let default = OptimizerConfig {
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
        };
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
        // DeepSpeed hands the params to the optimizer as keyword arguments,
        // and fails on one it does not take; zrt names them instead.
        let present = |keys: &[&'static str]| -> Vec<&'static str> {
            keys.iter()
                .copied()
                .filter(|k| p.contains_key(*k))
                .collect()
        };
        match kind {
            OptimizerKind::Lion => {
                for key in present(&ADAM_ONLY) {
                    self.problems.push(format!(
                        "`{path}.{key}` is an Adam setting that Lion does not take (Lion keeps one moment and no second, has no eps, and always decouples its weight decay): remove it, or use \"AdamW\""
                    ));
                }
            }
            OptimizerKind::Sgd => {
                for key in present(&ADAM_ONLY).into_iter().chain(present(&["betas"])) {
                    self.problems.push(format!(
                        "`{path}.{key}` is an Adam setting that SGD does not take (torch.optim.SGD has momentum, dampening, nesterov and weight_decay): remove it, or use \"AdamW\""
                    ));
                }
            }
            OptimizerKind::Lamb => {
                // FusedLamb takes eps, betas and bias_correction, not
                // these.
                for key in present(&["adam_w_mode", "torch_adam", "fused"]) {
                    self.problems.push(format!(
                        "`{path}.{key}` is an Adam setting that Lamb does not take (DeepSpeed's FusedLamb adds its weight decay to the update, inside the trust ratio): remove it, or use \"AdamW\""
                    ));
                }
            }
            OptimizerKind::Adagrad => {
                // torch's Adagrad takes eps, and DeepSpeed's CPU Adagrad
                // an amsgrad (false), but neither these.
                let adam = ["adam_w_mode", "bias_correction", "torch_adam", "betas"];
                for key in present(&adam) {
                    self.problems.push(format!(
                        "`{path}.{key}` is an Adam setting that Adagrad does not take (torch.optim.Adagrad has lr_decay, weight_decay, eps and initial_accumulator_value): remove it, or use \"AdamW\""
                    ));
                }
            }
            OptimizerKind::Rmsprop => {
                // torch's RMSprop takes eps, and none of these.
                let adam = [
                    "adam_w_mode",
                    "bias_correction",
                    "torch_adam",
                    "amsgrad",
                    "fused",
                    "betas",
                ];
                for key in present(&adam) {
                    self.problems.push(format!(
                        "`{path}.{key}` is an Adam setting that RMSprop does not take (torch.optim.RMSprop has alpha, eps, momentum and weight_decay): remove it, or use \"AdamW\""
                    ));
                }
            }
            OptimizerKind::Muon => {
                // DeepSpeed's Muon hands its AdamW half lr, betas, eps and
                // weight_decay only.
                for key in present(&ADAM_ONLY[1..]) {
                    self.problems.push(format!(
                        "`{path}.{key}` is an Adam setting that Muon does not take (its AdamW half has betas, eps, weight_decay and adam_lr): remove it, or use \"AdamW\""
                    ));
                }
            }
            OptimizerKind::Adam | OptimizerKind::AdamW => {}
        }
        if kind != OptimizerKind::Muon {
            for key in present(&MUON_ONLY) {
                self.problems.push(format!(
                    "`{path}.{key}` is a Muon setting that {} does not take: remove it, or use \"Muon\"",
                    kind.name()
                ));
            }
        }
        if kind != OptimizerKind::Lamb {
            for key in present(&LAMB_ONLY) {
                self.problems.push(format!(
                    "`{path}.{key}` is a Lamb setting that {} does not take: remove it, or use \"Lamb\"",
                    kind.name()
                ));
            }
        }
        if kind != OptimizerKind::Adagrad {
            for key in present(&ADAGRAD_ONLY) {
                self.problems.push(format!(
                    "`{path}.{key}` is an Adagrad setting that {} does not take: remove it, or use \"Adagrad\"",
                    kind.name()
                ));
            }
        }
        if kind != OptimizerKind::Rmsprop {
            for key in present(&RMSPROP_ONLY) {
                self.problems.push(format!(
                    "`{path}.{key}` is an RMSprop setting that {} does not take: remove it, or use \"RMSprop\"",
                    kind.name()
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
            for key in present(refused) {
                self.problems.push(format!(
                    "`{path}.{key}` is an SGD setting that {} does not take ({why}): remove it, or use \"SGD\"",
                    kind.name()
                ));
            }
        }
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
        let torch_optim = matches!(
            kind,
            OptimizerKind::Sgd | OptimizerKind::Adagrad | OptimizerKind::Rmsprop
        );
        if torch_optim {
            // torch's own implementation choices: zrt has one.
            known.extend(["maximize", "foreach", "differentiable"]);
        }
        if kind == OptimizerKind::Rmsprop {
            known.push("capturable");
        }
        self.keys(p, path, &known, &[], false);
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
        // DeepSpeed's Muon gives its AdamW half betas (0.9, 0.95).
        let default_betas = if muon { (0.9, 0.95) } else { default.betas };
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
        let has_betas = !torch_optim;
        for (i, b) in [betas.0, betas.1].iter().enumerate() {
            if has_betas && !(0.0..1.0).contains(b) {
                self.problems.push(format!(
                    "`optimizer.params.betas[{i}]` must be in [0, 1), got {b}"
                ));
            }
        }
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
        let lr_decay = match adagrad {
            true => self.f64_or(p, path, "lr_decay", 0.0),
            false => 0.0,
        };
        if !(lr_decay >= 0.0 && lr_decay.is_finite()) {
            self.problems.push(format!(
                "`{path}.lr_decay` must be finite and >= 0, got {lr_decay}"
            ));
        }
        let initial_accumulator_value = match adagrad {
            true => self.f64_or(p, path, "initial_accumulator_value", 0.0),
            false => 0.0,
        };
        if !(initial_accumulator_value >= 0.0 && initial_accumulator_value.is_finite()) {
            // torch's own check, plus finiteness.
            self.problems.push(format!(
                "`{path}.initial_accumulator_value` must be finite and >= 0, got {initial_accumulator_value}"
            ));
        }
        let lamb = kind == OptimizerKind::Lamb;
        let lamb_f64 = |me: &mut Self, key: &str, default: f64| match lamb {
            true => me.f64_or(p, path, key, default),
            false => default,
        };
        let max_coeff = lamb_f64(self, "max_coeff", 10.0);
        let min_coeff = lamb_f64(self, "min_coeff", 0.01);
        if !(min_coeff >= 0.0 && max_coeff >= min_coeff && max_coeff.is_finite()) {
            self.problems.push(format!(
                "`{path}.min_coeff` and `max_coeff` must be 0 <= min_coeff <= max_coeff, finite, got {min_coeff} and {max_coeff}"
            ));
        }
        if lamb_f64(self, "max_grad_norm", 0.0) != 0.0 {
            self.problems.push(format!(
                "`{path}.max_grad_norm` is FusedLamb's old clipping, which zrt does not implement: set `gradient_clipping` instead"
            ));
        }
        let rmsprop = kind == OptimizerKind::Rmsprop;
        let alpha = match rmsprop {
            true => self.f64_or(p, path, "alpha", 0.99),
            false => 0.99,
        };
        if !(0.0..=1.0).contains(&alpha) {
            self.problems
                .push(format!("`{path}.alpha` must be in [0, 1], got {alpha}"));
        }
        let centered = rmsprop && self.bool_or(p, path, "centered", false);
        let sgd = kind == OptimizerKind::Sgd;
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
            maximize: torch_optim && self.bool_or(p, path, "maximize", false),
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

    fn scheduler(
        &mut self,
        top: &Map<String, Value>,
        optimizer: OptimizerKind,
    ) -> Option<SchedulerConfig> {
        let o = self.object(top, "scheduler")?;
        self.keys(o, "scheduler", &["type", "params"], &[], false);
        let empty = Map::new();
        let p = match o.get("params") {
            Some(Value::Object(m)) => m,
            _ => &empty,
        };
        let path = "scheduler.params";
        let ty = self.string(o, "scheduler", "type").unwrap_or_default();
        let warmup_type = || {
            p.get("warmup_type")
                .and_then(Value::as_str)
                .unwrap_or("log")
                .to_string()
        };
        let s = match ty.as_str() {
            "WarmupLR" => {
                self.keys(
                    p,
                    path,
                    &[
                        "warmup_min_lr",
                        "warmup_max_lr",
                        "warmup_num_steps",
                        "warmup_type",
                        "last_batch_iteration",
                    ],
                    &[],
                    false,
                );
                SchedulerConfig::WarmupLR {
                    warmup_min_lr: self.f64_auto(p, path, "warmup_min_lr", 0.0),
                    warmup_max_lr: self.warmup_max_lr(p, path, true),
                    warmup_num_steps: self.u64_auto(p, path, "warmup_num_steps", 1000),
                    warmup_type: warmup_type(),
                }
            }
            "WarmupDecayLR" => {
                self.keys(
                    p,
                    path,
                    &[
                        "warmup_min_lr",
                        "warmup_max_lr",
                        "warmup_num_steps",
                        "warmup_type",
                        "total_num_steps",
                        "last_batch_iteration",
                    ],
                    &[],
                    false,
                );
                if !p.contains_key("total_num_steps") {
                    self.problems.push(
                        "`scheduler.params.total_num_steps` is required by WarmupDecayLR".into(),
                    );
                }
                SchedulerConfig::WarmupDecayLR {
                    warmup_min_lr: self.f64_auto(p, path, "warmup_min_lr", 0.0),
                    warmup_max_lr: self.warmup_max_lr(p, path, false),
                    warmup_num_steps: self.u64_auto(p, path, "warmup_num_steps", 1000),
                    warmup_type: warmup_type(),
                    total_num_steps: self.u64_auto(p, path, "total_num_steps", 1),
                }
            }
            "WarmupCosineLR" => {
                self.keys(
                    p,
                    path,
                    &[
                        "total_num_steps",
                        "warmup_min_ratio",
                        "warmup_num_steps",
                        "cos_min_ratio",
                        "warmup_type",
                        "last_batch_iteration",
                    ],
                    &[],
                    false,
                );
                if !p.contains_key("total_num_steps") {
                    self.problems.push(
                        "`scheduler.params.total_num_steps` is required by WarmupCosineLR".into(),
                    );
                }
                SchedulerConfig::WarmupCosineLR {
                    total_num_steps: self.u64_auto(p, path, "total_num_steps", 1),
                    warmup_min_ratio: self.f64_or(p, path, "warmup_min_ratio", 0.0),
                    warmup_num_steps: self.u64_auto(p, path, "warmup_num_steps", 1000),
                    cos_min_ratio: self.f64_or(p, path, "cos_min_ratio", 1e-4),
                    warmup_type: warmup_type(),
                }
            }
            "OneCycle" => self.one_cycle(p, path, optimizer),
            "LRRangeTest" => self.lr_range_test(p, path),
            other => {
                self.problems.push(format!(
                    "`scheduler.type` \"{other}\" is not supported by zrt: use WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest"
                ));
                return None;
            }
        };
        // DeepSpeed starts a schedule at `last_batch_iteration` + 1 without
        // setting its first rate; zrt resumes a schedule from the
        // checkpoint's step instead, and ignoring the key would run another
        // schedule than the one asked for without a word.
        if let Some(v) = p.get("last_batch_iteration") {
            let at = "scheduler.params.last_batch_iteration";
            if self.number(v, at).is_some_and(|n| n != -1.0) {
                self.problems.push(format!("`{at}` is {v}: zrt starts every schedule at its beginning and resumes it from a checkpoint's step; remove the key (or set it to -1) and load the checkpoint to go on"));
            }
        }
        if let SchedulerConfig::WarmupLR {
            warmup_type,
            warmup_num_steps,
            ..
        }
        | SchedulerConfig::WarmupDecayLR {
            warmup_type,
            warmup_num_steps,
            ..
        }
        | SchedulerConfig::WarmupCosineLR {
            warmup_type,
            warmup_num_steps,
            ..
        } = &s
        {
            // DeepSpeed falls back to "log" with a warning; a typo here would
            // change the schedule without a word, so it is refused instead.
            if warmup_type != "log" && warmup_type != "linear" {
                self.problems.push(format!("`scheduler.params.warmup_type` must be \"log\" or \"linear\", got \"{warmup_type}\""));
            }
            if *warmup_num_steps == 0 {
                self.problems.push(format!("`scheduler.params.warmup_num_steps` must be at least 1 for {ty} (DeepSpeed refuses 0 too)"));
            }
        }
        Some(s)
    }

    /// WarmupLR's and WarmupDecayLR's `warmup_max_lr`: a number, or the
    /// optimizer's lr (filled at resolve once that is known) when given
    /// `"auto"` (Hugging Face fills it so) or when left out of a WarmupLR
    /// (`absent_is_lr`: DeepSpeed 0.19's WarmupLR defaults to the
    /// optimizer's lr, its WarmupDecayLR to 1e-3).
    fn warmup_max_lr(&mut self, p: &Map<String, Value>, path: &str, absent_is_lr: bool) -> f64 {
        let from_optimizer = match p.get("warmup_max_lr") {
            None => absent_is_lr,
            Some(v) => v == "auto",
        };
        if from_optimizer {
            self.autos.push(join(path, "warmup_max_lr"));
            1e-3
        } else {
            self.f64_or(p, path, "warmup_max_lr", 1e-3)
        }
    }

    /// DeepSpeed's `OneCycle`, with its defaults; `cycle_min_lr` and
    /// `cycle_max_lr` have none there and are required here.
    fn one_cycle(
        &mut self,
        p: &Map<String, Value>,
        path: &str,
        optimizer: OptimizerKind,
    ) -> SchedulerConfig {
        self.keys(
            p,
            path,
            &[
                "cycle_min_lr",
                "cycle_max_lr",
                "decay_lr_rate",
                "cycle_first_step_size",
                "cycle_second_step_size",
                "cycle_first_stair_count",
                "cycle_second_stair_count",
                "decay_step_size",
                "cycle_momentum",
                "cycle_min_mom",
                "cycle_max_mom",
                "decay_mom_rate",
                "last_batch_iteration",
            ],
            &[],
            false,
        );
        for key in ["cycle_min_lr", "cycle_max_lr"] {
            if !p.contains_key(key) {
                self.problems.push(format!(
                    "`{path}.{key}` is required by OneCycle (DeepSpeed has no default either)"
                ));
            }
        }
        let first = self.u64_or(p, path, "cycle_first_step_size", 2000);
        if first == 0 {
            // DeepSpeed refuses it too: the rising half's slope divides by it.
            self.problems.push(format!(
                "`{path}.cycle_first_step_size` must be at least 1 for OneCycle"
            ));
        }
        let second = self.u64_or(p, path, "cycle_second_step_size", first);
        let first_stairs = self.u64_or(p, path, "cycle_first_stair_count", 0);
        let decay_step_size = self.u64_or(p, path, "decay_step_size", 0);
        let mut cycle_momentum = self.bool_or(p, path, "cycle_momentum", true);
        if cycle_momentum
            && matches!(
                optimizer,
                OptimizerKind::Sgd | OptimizerKind::Adagrad | OptimizerKind::Rmsprop
            )
        {
            // DeepSpeed's OneCycle turns its momentum off, with a warning,
            // for an optimizer without betas.
            let kept = match optimizer {
                OptimizerKind::Sgd => ", SGD's `momentum` stays as set",
                _ => "",
            };
            self.warnings.push(format!(
                "OneCycle cycles momentum as the optimizer's betas, which {} has not: `{path}.cycle_momentum` is off (as DeepSpeed turns it off){kept}; set cycle_momentum to false to silence this",
                optimizer.name()
            ));
            cycle_momentum = false;
        }
        let cycle_min_mom = self.f64_or(p, path, "cycle_min_mom", 0.8);
        let cycle_max_mom = self.f64_or(p, path, "cycle_max_mom", 0.9);
        let decay_mom_rate = self.f64_or(p, path, "decay_mom_rate", 0.0);
        if cycle_momentum {
            // They become Adam's beta1, which the optimizer holds to [0, 1).
            for (key, m) in [
                ("cycle_min_mom", cycle_min_mom),
                ("cycle_max_mom", cycle_max_mom),
            ] {
                if !(0.0..1.0).contains(&m) {
                    self.problems.push(format!(
                        "`{path}.{key}` must be in [0, 1) (it becomes the optimizer's beta1), got {m}"
                    ));
                }
            }
            let (rate, d, max) = (decay_mom_rate, decay_step_size, cycle_max_mom);
            if rate > 0.0 && d > 0 && (0.0..1.0).contains(&max) && max > 0.0 {
                // DeepSpeed's momentum decay multiplies: beta1 grows past the
                // cycle until it reaches 1, where Adam stops (the engine
                // refuses that step rather than diverge).
                let past = (d as f64 * (1.0 / max - 1.0) / rate).ceil();
                self.warnings.push(format!(
                    "`{path}.decay_mom_rate` {rate} raises beta1 after the cycle (OneCycle multiplies `cycle_max_mom` by 1 + rate x iterations / `decay_step_size`, as DeepSpeed does): it reaches 1 about {past} steps after the cycle's {} steps, and the engine stops there; Adam and Lion need beta1 < 1",
                    first + second
                ));
            }
        }
        SchedulerConfig::OneCycle {
            cycle_min_lr: self.f64_or(p, path, "cycle_min_lr", 0.0),
            cycle_max_lr: self.f64_or(p, path, "cycle_max_lr", 0.0),
            decay_lr_rate: self.f64_or(p, path, "decay_lr_rate", 0.0),
            cycle_first_step_size: first,
            cycle_second_step_size: second,
            cycle_first_stair_count: first_stairs,
            cycle_second_stair_count: self.u64_or(
                p,
                path,
                "cycle_second_stair_count",
                first_stairs,
            ),
            decay_step_size,
            cycle_momentum,
            cycle_min_mom,
            cycle_max_mom,
            decay_mom_rate,
        }
    }

    /// DeepSpeed's `LRRangeTest`, with its defaults.
    fn lr_range_test(&mut self, p: &Map<String, Value>, path: &str) -> SchedulerConfig {
        self.keys(
            p,
            path,
            &[
                "lr_range_test_min_lr",
                "lr_range_test_step_size",
                "lr_range_test_step_rate",
                "lr_range_test_staircase",
                "last_batch_iteration",
            ],
            &[],
            false,
        );
        let step_size = self.u64_or(p, path, "lr_range_test_step_size", 2000);
        if step_size == 0 {
            self.problems.push(format!(
                "`{path}.lr_range_test_step_size` must be at least 1 (DeepSpeed refuses 0 too)"
            ));
        }
        SchedulerConfig::LRRangeTest {
            lr_range_test_min_lr: self.f64_or(p, path, "lr_range_test_min_lr", 1e-3),
            lr_range_test_step_size: step_size,
            lr_range_test_step_rate: self.f64_or(p, path, "lr_range_test_step_rate", 1.0),
            lr_range_test_staircase: self.bool_or(p, path, "lr_range_test_staircase", false),
        }
    }

    /// A 16-bit block's `enabled` (absent block or key: off).
    fn enabled(&mut self, o: Option<&Map<String, Value>>, path: &str) -> Enabled {
        let Some(o) = o else { return Enabled::Off };
        match o.get("enabled") {
            Some(Value::String(s)) if s == "auto" => Enabled::Auto,
            _ if self.bool_or(o, path, "enabled", false) => Enabled::On,
            _ => Enabled::Off,
        }
    }

    /// The compute precision the config enables, and the 16-bit ones whose
    /// `enabled` is `"auto"` (for resolve to pick from).
    fn precision(&mut self, top: &Map<String, Value>) -> (Precision, Vec<Precision>) {
        let fp16 = self.object(top, "fp16");
        let bf16 = self.object(top, "bf16");
        let (f, b) = (self.enabled(fp16, "fp16"), self.enabled(bf16, "bf16"));
        if let Some(o) = bf16 {
            // fp16's keys are accepted here (warned below), not flagged unknown.
            let known: Vec<&str> = keys::BF16.iter().chain(keys::FP16).copied().collect();
            self.keys(o, "bf16", &known, &[], false);
            for k in o
                .keys()
                .filter(|k| keys::FP16.contains(&k.as_str()) && !keys::BF16.contains(&k.as_str()))
            {
                // The unknown-key warning above already names it; say why it is harmless.
                self.warnings.push(format!("`bf16.{k}` has no effect: bf16 needs no loss scaling (DeepSpeed ignores it too)"));
            }
            if !self.bool_or(o, "bf16", "immediate_grad_update", true) {
                self.warnings.push("`bf16.immediate_grad_update` = false is ignored: zrt adds each micro-step's gradients into fp32 buffers as soon as they are reduced, which is what true asks for".into());
            }
        }
        if f == Enabled::On && b == Enabled::On {
            self.problems.push(
                "`fp16.enabled` and `bf16.enabled` are both true: choose one compute precision"
                    .into(),
            );
            return (Precision::Fp32, Vec::new());
        }
        let bf = bf16.filter(|_| b != Enabled::Off).map(|o| Precision::Bf16 {
            check_grad_overflow: self.bool_or(o, "bf16", "check_grad_overflow", false),
        });
        let fp = fp16.filter(|_| f != Enabled::Off).map(|o| self.fp16(o));
        let (mut now, mut auto) = (Precision::Fp32, Vec::new());
        for (state, p) in [(b, bf), (f, fp)] {
            match (state, p) {
                (Enabled::On, Some(p)) => now = p,
                (Enabled::Auto, Some(p)) => auto.push(p),
                _ => {}
            }
        }
        (now, auto)
    }

    /// The `fp16` block of a run that may compute in fp16.
    fn fp16(&mut self, o: &Map<String, Value>) -> Precision {
        self.keys(o, "fp16", keys::FP16, &[], false);
        if self.bool_or(o, "fp16", "fp16_master_weights_and_grads", false) {
            self.problems.push("`fp16.fp16_master_weights_and_grads` is not supported: zrt always keeps fp32 master weights".into());
        }
        if self.bool_or(o, "fp16", "auto_cast", false) {
            // DeepSpeed casts the floating inputs of `engine(..)`; a
            // ShardedModule's forward is the program's own call.
            self.warnings.push("`fp16.auto_cast` = true has no effect: zrt does not call the model's forward, so cast floating inputs yourself (`x.to_kind(Kind::Half)`)".into());
        }
        Precision::Fp16(LossScaleConfig {
            loss_scale: self.f64_or(o, "fp16", "loss_scale", 0.0),
            initial_scale_power: self.u64_or(o, "fp16", "initial_scale_power", 16).min(64) as u32,
            loss_scale_window: self.u64_or(o, "fp16", "loss_scale_window", 1000),
            hysteresis: self.u64_or(o, "fp16", "hysteresis", 2).min(u32::MAX as u64) as u32,
            consecutive_hysteresis: self.bool_or(o, "fp16", "consecutive_hysteresis", false),
            min_loss_scale: self.f64_or(o, "fp16", "min_loss_scale", 1.0),
        })
    }

    fn offload(&mut self, o: &Map<String, Value>, path: &str, known: &[&str]) -> OffloadConfig {
        self.keys(o, path, known, &[], true);
        let device = match self.string(o, path, "device").as_deref() {
            None | Some("none") => OffloadDevice::None,
            Some("cpu") => OffloadDevice::Cpu,
            Some("nvme") => OffloadDevice::Nvme,
            Some(other) => {
                self.problems.push(format!(
                    "`{path}.device` must be \"none\", \"cpu\" or \"nvme\", got \"{other}\""
                ));
                OffloadDevice::None
            }
        };
        let nvme_path = self.string(o, path, "nvme_path");
        if device == OffloadDevice::Nvme && nvme_path.is_none() {
            self.problems.push(format!("`{path}.device` is \"nvme\" but `{path}.nvme_path` is missing: name a directory on the NVMe drive"));
        }
        match device {
            OffloadDevice::None => {}
            OffloadDevice::Cpu => self.warnings.push(format!(
                "`{path}.device` = \"cpu\": on a CPU-only run the state already lives in host memory, so nothing is copied (pinned host buffers for CUDA devices are not built yet)"
            )),
            OffloadDevice::Nvme => {}
        }
        // Quiet at DeepSpeed's defaults, which configs spell out.
        let same = |v: &Value, d: &Value| v == d || (v.is_number() && v.as_f64() == d.as_f64());
        for (key, default) in [
            ("fast_init", Value::Bool(false)),
            ("ratio", serde_json::json!(1.0)),
            ("max_in_cpu", serde_json::json!(1e9)),
        ] {
            match o.get(key) {
                Some(v) if !same(v, &default) => self
                    .warnings
                    .push(format!("`{path}.{key}` = {v} is not honoured by zrt")),
                _ => {}
            }
        }
        for key in ["pipeline_read", "pipeline_write", "pipeline"] {
            if o.get(key) == Some(&Value::Bool(false)) {
                self.warnings.push(format!("`{path}.{key}` = false has no effect: zrt's swap always reads ahead and writes behind"));
            }
        }
        // Pinned memory is for copies to and from a GPU: meaningless with
        // no offload, and said of "cpu" by the device's warning above.
        if device == OffloadDevice::Nvme && o.get("pin_memory") == Some(&Value::Bool(true)) {
            self.warnings.push(format!(
                "`{path}.pin_memory` has no effect on a CPU-only run"
            ));
        }
        OffloadConfig {
            device,
            nvme_path,
            pin_memory: self.bool_or(o, path, "pin_memory", false),
            buffer_count: self.u64_or(o, path, "buffer_count", 5),
            buffer_size: self.u64_or(o, path, "buffer_size", 100_000_000),
        }
    }

    /// A monitor block (`csv_monitor`, `tensorboard`): its folder,
    /// `output_path/job_name` with DeepSpeed's defaults ("" and
    /// "DeepSpeedJobName"), when enabled.
    fn monitor(&mut self, top: &Map<String, Value>, key: &str) -> Option<std::path::PathBuf> {
        let m = self.object(top, key)?;
        self.keys(m, key, keys::MONITOR, &[], true);
        let enabled = self.bool_or(m, key, "enabled", false);
        let path = self.string(m, key, "output_path").unwrap_or_default();
        let job = self.string(m, key, "job_name");
        let job = job.unwrap_or_else(|| "DeepSpeedJobName".into());
        if job.is_empty() || job.contains('/') {
            self.problems.push(format!(
                "`{key}.job_name` must name one folder (inside `output_path`), got {job:?}"
            ));
            return None;
        }
        enabled.then(|| std::path::Path::new(&path).join(job))
    }

    /// `checkpoint`: DeepSpeed's checkpoint options. None changes what zrt
    /// does; each is checked, and one asking for something zrt does not do
    /// says what it does instead.
    fn checkpoint(&mut self, top: &Map<String, Value>) {
        let key = "checkpoint";
        let Some(c) = self.object(top, key) else {
            return;
        };
        self.keys(c, key, keys::CHECKPOINT, &[], true);
        if let Some(mode) = self.string(c, key, "tag_validation") {
            // DeepSpeed upper-cases it, and refuses any other mode.
            match mode.to_ascii_lowercase().as_str() {
                "fail" => {}
                "warn" | "ignore" => self.warnings.push(format!(
                    "`checkpoint.tag_validation` = \"{mode}\" is not what zrt does: it fails a save whose ranks give different tags, as \"Fail\" does (their files would go to different directories, none of them a whole checkpoint)"
                )),
                _ => self.problems.push(format!(
                    "`checkpoint.tag_validation` must be \"Ignore\", \"Warn\" or \"Fail\", got \"{mode}\""
                )),
            }
        }
        if self.bool_or(c, key, "load_universal", false) {
            self.warnings.push("`checkpoint.load_universal` = true is not needed: zrt's checkpoints load on any world size and stage as saved (DeepSpeed's universal checkpoint folders are not a format zrt reads)".into());
        }
        if self.bool_or(c, key, "use_node_local_storage", false) {
            self.warnings.push("`checkpoint.use_node_local_storage` = true is not implemented by zrt; it is ignored: rank 0 commits one checkpoint directory, which on several nodes must be storage every rank shares (a rank that cannot write into it fails the save, naming itself)".into());
        }
        let path = "checkpoint.parallel_write";
        match c.get("parallel_write") {
            None | Some(Value::Null) => {}
            Some(Value::Object(w)) => {
                self.keys(w, path, &["pipeline_stage"], &[], true);
                if self.bool_or(w, path, "pipeline_stage", false) {
                    self.warnings.push("`checkpoint.parallel_write.pipeline_stage` = true has no effect: zrt has no pipeline stages, and every rank writes its own file already".into());
                }
            }
            Some(v) => self
                .problems
                .push(format!("`{path}` must be an object, got {v}")),
        }
    }

    /// `comms_logger`, its `prof_ops` mapped to zrt's operation names.
    fn comms_logger(&mut self, top: &Map<String, Value>) -> CommsLoggerConfig {
        let key = "comms_logger";
        let Some(m) = self.object(top, key) else {
            return CommsLoggerConfig::default();
        };
        self.keys(m, key, keys::COMMS_LOGGER, &[], true);
        let enabled = self.bool_or(m, key, "enabled", false);
        let verbose = self.bool_or(m, key, "verbose", false);
        let all = self.bool_or(m, key, "prof_all", true);
        let debug = self.bool_or(m, key, "debug", false);
        let mut ops = Vec::new();
        let names: &[Value] = match m.get("prof_ops") {
            None | Some(Value::Null) => &[],
            Some(Value::Array(a)) => a,
            Some(v) => {
                self.problems.push(format!(
                    "`comms_logger.prof_ops` must be a list of operation names, got {v}"
                ));
                &[]
            }
        };
        for v in names {
            let name = v.as_str().unwrap_or_default();
            match keys::COMM_OPS.iter().find(|(ds, _)| *ds == name) {
                Some((_, Some(op))) => ops.push(op.to_string()),
                Some((_, None)) => self.warnings.push(format!(
                    "`comms_logger.prof_ops` names `{name}`, which zrt never issues: nothing of it to log"
                )),
                None => self.problems.push(format!(
                    "`comms_logger.prof_ops` names {v}, not a communication operation: zrt's are all_reduce, reduce_scatter, all_gather, all_to_all, broadcast, barrier, send and recv (DeepSpeed's names, such as all_gather_into_tensor, are taken too)"
                )),
            }
        }
        if enabled && debug {
            self.warnings.push("`comms_logger.debug` has no effect: zrt names an operation's group, not the function that called it".into());
        }
        if enabled && all && !names.is_empty() {
            self.warnings.push("`comms_logger.prof_ops` is used only when `prof_all` is false, as in DeepSpeed: every operation is logged".into());
        }
        if enabled && !all && names.is_empty() {
            self.warnings.push(
                "`comms_logger` has `prof_all` false and no `prof_ops`: it logs no operation"
                    .into(),
            );
        }
        CommsLoggerConfig {
            enabled,
            verbose,
            ops: (!all).then_some(ops),
        }
    }

    fn aio(&mut self, top: &Map<String, Value>) -> AioConfig {
        let empty = Map::new();
        let a = self.object(top, "aio").unwrap_or(&empty);
        self.keys(a, "aio", keys::AIO, &[], true);
        let d = AioConfig::default();
        // Every `aio` key but `block_size` is read and warned about.
        for &key in keys::AIO.iter().filter(|k| **k != "block_size") {
            if a.contains_key(key) {
                self.warnings.push(format!("`aio.{key}` is not honoured: zrt's swap keeps `buffer_count` chunks in flight on one reader and one writer thread (only `aio.block_size` is used)"));
            }
        }
        let block_size = self.u64_or(a, "aio", "block_size", d.block_size);
        if block_size == 0 {
            self.problems.push(
                "`aio.block_size` must be at least 1 byte (DeepSpeed's default is 1048576)".into(),
            );
        }
        let threads = self.u64_or(a, "aio", "intra_op_parallelism", d.thread_count);
        AioConfig {
            block_size: block_size.max(1),
            queue_depth: self.u64_or(a, "aio", "queue_depth", d.queue_depth),
            thread_count: self.u64_or(a, "aio", "thread_count", threads),
            single_submit: self.bool_or(a, "aio", "single_submit", d.single_submit),
            overlap_events: self.bool_or(a, "aio", "overlap_events", d.overlap_events),
        }
    }

    fn zero(&mut self, top: &Map<String, Value>) -> ZeroConfig {
        let empty = Map::new();
        let z = self.object(top, "zero_optimization").unwrap_or(&empty);
        let path = "zero_optimization";
        self.keys(z, path, keys::ZERO, keys::ZERO_KNOWN_UNIMPLEMENTED, true);
        let stage = self.u64_or(z, path, "stage", 0);
        if stage > 3 {
            self.problems.push(format!(
                "`zero_optimization.stage` must be 0, 1, 2 or 3, got {stage}"
            ));
        }
        // Aliases: DeepSpeed accepts both spellings.
        let alias = |z: &Map<String, Value>, a: &str, b: &str| {
            if z.contains_key(a) {
                a.to_string()
            } else {
                b.to_string()
            }
        };
        let prefetch = alias(z, "stage3_prefetch_bucket_size", "prefetch_bucket_size");
        let persist = alias(
            z,
            "stage3_param_persistence_threshold",
            "param_persistence_threshold",
        );
        let live = alias(z, "stage3_max_live_parameters", "max_live_parameters");
        let reuse = alias(z, "stage3_max_reuse_distance", "max_reuse_distance");
        let mics = match z.get("mics_shard_size") {
            None => None,
            Some(v) if v.as_i64() == Some(-1) => None,
            Some(v) => match self.uint(v, "zero_optimization.mics_shard_size") {
                Some(0) | None => {
                    self.problems.push(
                        "`zero_optimization.mics_shard_size` must be -1 or at least 1".into(),
                    );
                    None
                }
                n => n,
            },
        };
        let mut offload_optimizer = self.object(z, "offload_optimizer").map(|o| {
            self.offload(
                o,
                "zero_optimization.offload_optimizer",
                keys::OFFLOAD_OPTIMIZER,
            )
        });
        let mut offload_param = self
            .object(z, "offload_param")
            .map(|o| self.offload(o, "zero_optimization.offload_param", keys::OFFLOAD_PARAM));
        let cpu = OffloadConfig {
            device: OffloadDevice::Cpu,
            nvme_path: None,
            pin_memory: false,
            buffer_count: 5,
            buffer_size: 100_000_000,
        };
        for (old, new) in keys::ZERO_DEPRECATED {
            if !z.contains_key(*old) {
                continue;
            }
            self.warnings.push(format!(
                "`zero_optimization.{old}` is deprecated: read as `zero_optimization.{new}`"
            ));
            let on = self.bool_or(z, path, old, false);
            match *old {
                "cpu_offload" if on && offload_optimizer.is_none() => {
                    self.warnings.push("`zero_optimization.offload_optimizer.device` = \"cpu\": on a CPU-only run the state already lives in host memory, so nothing is copied".into());
                    offload_optimizer = Some(cpu.clone());
                }
                "cpu_offload_params" | "cpu_offload_param" if on && offload_param.is_none() => {
                    self.warnings.push("`zero_optimization.offload_param.device` = \"cpu\": on a CPU-only run the parameters already live in host memory, so nothing is copied".into());
                    offload_param = Some(cpu.clone());
                }
                "cpu_offload_use_pin_memory" => {
                    for o in [&mut offload_optimizer, &mut offload_param]
                        .into_iter()
                        .flatten()
                    {
                        o.pin_memory = on;
                    }
                }
                _ => {}
            }
        }
        let quantized = self.bool_or(z, path, "zero_quantized_weights", false);
        if quantized && stage < 3 {
            self.warnings.push(format!("`zero_optimization.zero_quantized_weights` = true has no effect at stage {stage}: only stage 3 gathers weights for forward and backward (DeepSpeed ignores it there too); the updated shards are gathered unquantized"));
        }
        let quantized_grads = self.bool_or(z, path, "zero_quantized_gradients", false);
        if quantized_grads && stage < 3 {
            self.warnings.push(format!("`zero_optimization.zero_quantized_gradients` = true has no effect at stage {stage}: zrt quantizes stage 3's gradient reductions only (as DeepSpeed's ZeRO++); gradients are reduced unquantized"));
        }
        let quantized_frozen = self.bool_or(z, path, "zero_quantized_nontrainable_weights", false);
        if quantized_frozen && stage < 3 {
            self.warnings.push(format!("`zero_optimization.zero_quantized_nontrainable_weights` = true has no effect at stage {stage}: only stage 3 shards frozen parameters (DeepSpeed ignores it there too); they stay replicated and unquantized"));
        }
        ZeroConfig {
            stage: stage.min(3) as u8,
            reduce_bucket_size: self.u64_setting(z, path, "reduce_bucket_size", 500_000_000),
            allgather_bucket_size: self.u64_or(z, path, "allgather_bucket_size", 500_000_000),
            // On at every stage (DeepSpeed: at stage 3 only): docs/choices.md
            // says why.
            overlap_comm: self.bool_or(z, path, "overlap_comm", true),
            contiguous_gradients: self.bool_or(z, path, "contiguous_gradients", true),
            stage3_prefetch_bucket_size: self.u64_setting(z, path, &prefetch, 50_000_000),
            stage3_param_persistence_threshold: self.u64_setting(z, path, &persist, 100_000),
            stage3_max_live_parameters: self.u64_or(z, path, &live, 1_000_000_000),
            stage3_max_reuse_distance: self.u64_or(z, path, &reuse, 1_000_000_000),
            mics_shard_size: mics,
            zero_hpz_partition_size: self.u64_or(z, path, "zero_hpz_partition_size", 1).max(1),
            zero_quantized_weights: quantized,
            zero_quantized_gradients: quantized_grads,
            zero_quantized_nontrainable_weights: quantized_frozen,
            offload_optimizer,
            offload_param,
        }
    }
}

/// Parses a document (see [`Config::from_json`]).
pub(super) fn parse(text: &str) -> Result<Config, ConfigError> {
    let (cfg, problems) = parse_all(text)?;
    if problems.is_empty() {
        Ok(cfg)
    } else {
        Err(ConfigError {
            problems,
            ..Default::default()
        })
    }
}

/// Parses as much as it can: the config (defaults where a value was bad)
/// and every problem found, so a caller can resolve it too and report all.
pub(super) fn parse_all(text: &str) -> Result<(Config, Vec<String>), ConfigError> {
    let v: Value = serde_json::from_str(text).map_err(|e| ConfigError {
        problems: vec![format!("not valid JSON: {e}")],
        ..Default::default()
    })?;
    let Value::Object(top) = v else {
        return Err(ConfigError {
            problems: vec!["the config must be a JSON object".into()],
            ..Default::default()
        });
    };
    let mut p = P::default();
    for key in super::duplicates::duplicate_keys(text) {
        p.problems.push(format!(
            "`{key}` is given twice: JSON keeps only the last value, which is rarely what was meant; keep one"
        ));
    }
    p.keys(&top, "", keys::TOP, keys::TOP_KNOWN_UNIMPLEMENTED, false);
    let reduce_dtype = p.string(&top, "", "communication_data_type").or_else(|| {
        top.get("data_types")
            .and_then(|d| d.get("grad_accum_dtype"))
            .and_then(Value::as_str)
            .map(String::from)
    });
    let fp32_grad_reduce = match reduce_dtype.as_deref() {
        None | Some("fp32") | Some("float32") => true,
        Some("bf16") | Some("fp16") | Some("bfloat16") | Some("float16") => false,
        Some(other) => {
            p.problems.push(format!(
                "gradient reduction dtype \"{other}\" must be \"fp32\", \"bf16\" or \"fp16\""
            ));
            true
        }
    };
    // In this order, so that the problems list in the config's usual order.
    let train_batch_size = p.batch(&top, "train_batch_size");
    let micro_batch = p.batch(&top, "train_micro_batch_size_per_gpu");
    let gradient_accumulation_steps = p.batch(&top, "gradient_accumulation_steps");
    let optimizer = p.optimizer(&top);
    let scheduler = p.scheduler(&top, optimizer.kind);
    let (precision, precision_auto) = p.precision(&top);
    p.checkpoint(&top);
    let cfg = Config {
        train_batch_size,
        micro_batch,
        gradient_accumulation_steps,
        optimizer,
        scheduler,
        precision,
        gradient_clipping: p.f64_auto(&top, "", "gradient_clipping", 0.0),
        steps_per_print: p.u64_or(&top, "", "steps_per_print", 10),
        wall_clock_breakdown: p.bool_or(&top, "", "wall_clock_breakdown", false),
        fp32_grad_reduce,
        zero: p.zero(&top),
        aio: p.aio(&top),
        monitor: MonitorConfig {
            csv: p.monitor(&top, "csv_monitor"),
            tensorboard: p.monitor(&top, "tensorboard"),
        },
        comms_logger: p.comms_logger(&top),
        warnings: Vec::new(),
        unresolved: Vec::new(),
        precision_auto,
    };
    if let Some(SchedulerConfig::OneCycle {
        cycle_momentum: true,
        ..
    }) = &cfg.scheduler
    {
        p.warnings.push(format!(
            "OneCycle cycles Adam's beta1 between `cycle_max_mom` and `cycle_min_mom` and sets beta2 to 0.99, as DeepSpeed does: `optimizer.params.betas` {:?} is not used; set `scheduler.params.cycle_momentum` to false to keep it",
            cfg.optimizer.betas
        ));
    }
    if cfg.zero.stage == 3 && cfg.zero.zero_quantized_gradients && !cfg.fp32_grad_reduce {
        p.warnings.push(format!(
            "`communication_data_type` {:?} has no effect with `zero_optimization.zero_quantized_gradients`: stage 3's gradients are reduced as int8 codes and summed in fp32",
            reduce_dtype.as_deref().unwrap_or_default()
        ));
    }
    if cfg.gradient_clipping < 0.0 {
        p.problems.push(format!(
            "`gradient_clipping` must be >= 0 (0 turns it off), got {}",
            cfg.gradient_clipping
        ));
    }
    for w in &p.warnings {
        tracing::warn!("{w}");
    }
    Ok((
        Config {
            warnings: p.warnings,
            unresolved: p.autos,
            ..cfg
        },
        p.problems,
    ))
}

/// The batch rule, DeepSpeed's: any two of (train, micro, gas) determine the
/// third; one alone is completed with gas = 1.
fn batch(
    train: Option<u64>,
    micro: Option<u64>,
    gas: Option<u64>,
    world: u64,
    problems: &mut Vec<String>,
) -> Option<Batch> {
    let div = |a: u64, b: u64, what: &str, problems: &mut Vec<String>| {
        if b == 0 || a % b != 0 {
            problems.push(what.to_string());
            None
        } else {
            Some(a / b)
        }
    };
    let b = match (train, micro, gas) {
        (Some(t), Some(m), Some(g)) => Batch {
            train: t,
            micro: m,
            gas: g,
        },
        (Some(t), Some(m), None) => {
            let g = div(t, m * world, &format!("train_batch_size {t} is not divisible by train_micro_batch_size_per_gpu {m} x world {world}"), problems)?;
            Batch {
                train: t,
                micro: m,
                gas: g,
            }
        }
        (Some(t), None, Some(g)) => {
            let m = div(t, g * world, &format!("train_batch_size {t} is not divisible by gradient_accumulation_steps {g} x world {world}"), problems)?;
            Batch {
                train: t,
                micro: m,
                gas: g,
            }
        }
        (None, Some(m), Some(g)) => Batch {
            train: m * g * world,
            micro: m,
            gas: g,
        },
        (Some(t), None, None) => {
            let m = div(
                t,
                world,
                &format!("train_batch_size {t} is not divisible by the world size {world}"),
                problems,
            )?;
            Batch {
                train: t,
                micro: m,
                gas: 1,
            }
        }
        (None, Some(m), None) => Batch {
            train: m * world,
            micro: m,
            gas: 1,
        },
        (None, None, _) => {
            problems.push("set `train_batch_size` or `train_micro_batch_size_per_gpu` (with `gradient_accumulation_steps` if not 1), or have the program pass its micro-batch in `AutoHints::micro_batch`, as Hugging Face's Trainer fills them".into());
            return None;
        }
    };
    // The config's own keys are refused at 0 when parsed; a 0 here came
    // from the program's AutoHints, and the product rule below would
    // blame train_batch_size for it.
    if b.micro == 0 || b.gas == 0 {
        problems.push(format!(
            "train_micro_batch_size_per_gpu {} and gradient_accumulation_steps {} must both be at least 1: check the values the program passes in AutoHints",
            b.micro, b.gas
        ));
        return None;
    }
    if b.train != b.micro * b.gas * world {
        problems.push(format!(
            "train_batch_size {} != train_micro_batch_size_per_gpu {} x gradient_accumulation_steps {} x world {world} (= {})",
            b.train,
            b.micro,
            b.gas,
            b.micro * b.gas * world
        ));
        return None;
    }
    Some(b)
}

/// Resolves `"auto"` and the batch rule (see [`Config::resolve`]).
/// The program's value for `"auto"` key `name`, logged; or a problem
/// naming what the program did not give (`rule`) and the [`AutoHints`]
/// field that gives it (`field`; `zrt config check` maps it to its flag).
fn auto<T: std::fmt::Debug>(
    name: &str,
    hint: Option<T>,
    (rule, field): (&str, &str),
    problems: &mut Vec<String>,
) -> Option<T> {
    match hint {
        Some(v) => {
            tracing::info!("config: `{name}` \"auto\" resolved to {v:?} ({rule})");
            Some(v)
        }
        None => {
            problems.push(format!("`{name}` is \"auto\" but the program gave no {rule}: set it in the config, or pass it in `AutoHints::{field}`"));
            None
        }
    }
}

/// Fills the keys parsing left to the program ([`Config::unresolved`],
/// [`Config::precision_auto`]) as Hugging Face's integration fills them:
/// betas, eps, the clip, warm-up and total steps and the 16-bit switches
/// from the program; `warmup_min_lr` 0; `warmup_max_lr` the optimizer's lr
/// (also DeepSpeed's WarmupLR's default when the key is left out). Runs
/// after the optimizer's lr is resolved.
fn fill_from_program(c: &mut Config, hints: &AutoHints, problems: &mut Vec<String>) {
    for key in std::mem::take(&mut c.unresolved) {
        let param = key.strip_prefix("scheduler.params.");
        match (key.as_str(), param) {
            ("optimizer.params.betas", _) => {
                if let Some(b) = auto(&key, hints.betas, ("betas", "betas"), problems) {
                    c.optimizer.betas = b;
                }
            }
            ("optimizer.params.eps", _) => {
                if let Some(e) = auto(&key, hints.eps, ("epsilon", "eps"), problems) {
                    c.optimizer.eps = e;
                }
            }
            ("gradient_clipping", _) => {
                if let Some(g) = auto(
                    &key,
                    hints.gradient_clipping,
                    ("gradient clip", "gradient_clipping"),
                    problems,
                ) {
                    c.gradient_clipping = g;
                }
            }
            (_, Some("warmup_max_lr")) => {
                // Unresolved only when the optimizer's lr is "auto" with no
                // hint, which is a problem of its own already.
                if let (Some(lr), Some(s)) = (c.optimizer.lr.value(), &mut c.scheduler) {
                    tracing::info!(
                        "config: `{key}` (\"auto\" or left out) is the optimizer's lr, {lr}"
                    );
                    set_param(s, "warmup_max_lr", lr);
                }
            }
            (_, Some("warmup_min_lr")) => {
                // Parsing left DeepSpeed's default there, 0: what Hugging
                // Face fills.
                tracing::info!("config: `{key}` \"auto\" resolved to 0 (as Hugging Face fills it)");
            }
            (_, Some(param)) => {
                let (value, rule) = match param {
                    "warmup_num_steps" => (
                        hints.warmup_steps.map(|n| n as f64),
                        ("warm-up steps", "warmup_steps"),
                    ),
                    _ => (
                        hints.total_steps.map(|n| n as f64),
                        ("total steps", "total_steps"),
                    ),
                };
                if let (Some(v), Some(s)) = (auto(&key, value, rule, problems), &mut c.scheduler) {
                    set_param(s, param, v);
                }
            }
            _ => {}
        }
    }
    if c.gradient_clipping < 0.0 {
        problems.push(format!(
            "`gradient_clipping` must be >= 0 (0 turns it off), got {} from the program",
            c.gradient_clipping
        ));
    }
    if let Some(
        SchedulerConfig::WarmupLR {
            warmup_num_steps: 0,
            ..
        }
        | SchedulerConfig::WarmupDecayLR {
            warmup_num_steps: 0,
            ..
        }
        | SchedulerConfig::WarmupCosineLR {
            warmup_num_steps: 0,
            ..
        },
    ) = c.scheduler
    {
        problems.push("`scheduler.params.warmup_num_steps` must be at least 1 (DeepSpeed refuses 0 too), got 0 from the program".into());
    }
    let wants = |p: &Precision| match p {
        Precision::Bf16 { .. } => ("bf16.enabled", hints.bf16),
        _ => ("fp16.enabled", hints.fp16),
    };
    for p in std::mem::take(&mut c.precision_auto) {
        let (key, hint) = wants(&p);
        let on = hint.unwrap_or(false);
        tracing::info!("config: `{key}` \"auto\" resolved to {on} (the program's choice; false when it gives none)");
        if !on {
            continue;
        }
        if c.precision != Precision::Fp32 {
            problems.push("`fp16.enabled` and `bf16.enabled` both resolved to true: the program asks for both bf16 and fp16 (AutoHints); choose one".into());
        } else {
            c.precision = p;
        }
    }
}

/// Sets warm-up schedule parameter `param` (`warmup_max_lr`,
/// `warmup_num_steps` or `total_num_steps`: one [`fill_from_program`]
/// fills).
fn set_param(s: &mut SchedulerConfig, param: &str, v: f64) {
    match (s, param) {
        (
            SchedulerConfig::WarmupLR { warmup_max_lr, .. }
            | SchedulerConfig::WarmupDecayLR { warmup_max_lr, .. },
            "warmup_max_lr",
        ) => *warmup_max_lr = v,
        (
            SchedulerConfig::WarmupLR {
                warmup_num_steps, ..
            }
            | SchedulerConfig::WarmupDecayLR {
                warmup_num_steps, ..
            }
            | SchedulerConfig::WarmupCosineLR {
                warmup_num_steps, ..
            },
            "warmup_num_steps",
        ) => *warmup_num_steps = v as u64,
        (
            SchedulerConfig::WarmupDecayLR {
                total_num_steps, ..
            }
            | SchedulerConfig::WarmupCosineLR {
                total_num_steps, ..
            },
            "total_num_steps",
        ) => *total_num_steps = v as u64,
        _ => {}
    }
}

pub(super) fn resolve(
    cfg: &Config,
    world: u64,
    hints: &AutoHints,
) -> Result<Resolved, ConfigError> {
    let mut problems = Vec::new();
    let mut c = cfg.clone();
    let hidden = hints.hidden_size.map(|h| h as f64);
    let fill_u64 = |s: &mut Setting<u64>, v: Option<f64>| {
        if let Some(v) = v {
            *s = Setting::Value(v as u64);
        }
    };
    if c.zero.reduce_bucket_size == Setting::Auto {
        let v = auto(
            "zero_optimization.reduce_bucket_size",
            hidden.map(|h| h * h),
            ("hidden size (hidden^2)", "hidden_size"),
            &mut problems,
        );
        fill_u64(&mut c.zero.reduce_bucket_size, v);
    }
    if c.zero.stage3_prefetch_bucket_size == Setting::Auto {
        let v = auto(
            "zero_optimization.stage3_prefetch_bucket_size",
            hidden.map(|h| (0.9 * h * h).floor()),
            ("hidden size (0.9 hidden^2)", "hidden_size"),
            &mut problems,
        );
        fill_u64(&mut c.zero.stage3_prefetch_bucket_size, v);
    }
    if c.zero.stage3_param_persistence_threshold == Setting::Auto {
        let v = auto(
            "zero_optimization.stage3_param_persistence_threshold",
            hidden.map(|h| 10.0 * h),
            ("hidden size (10 hidden)", "hidden_size"),
            &mut problems,
        );
        fill_u64(&mut c.zero.stage3_param_persistence_threshold, v);
    }
    if c.optimizer.lr == Setting::Auto {
        if let Some(v) = auto(
            "optimizer.params.lr",
            hints.lr,
            ("learning rate", "lr"),
            &mut problems,
        ) {
            c.optimizer.lr = Setting::Value(v);
        }
    }
    if c.optimizer.weight_decay == Setting::Auto {
        if let Some(v) = auto(
            "optimizer.params.weight_decay",
            hints.weight_decay,
            ("weight decay", "weight_decay"),
            &mut problems,
        ) {
            c.optimizer.weight_decay = Setting::Value(v);
        }
    }
    fill_from_program(&mut c, hints, &mut problems);
    // A batch key's hint comes from the program's micro-batch (the
    // train batch is micro x gas x world).
    let b = |s: Setting<Option<u64>>, name: &str, hint: Option<u64>, problems: &mut Vec<String>| {
        match s {
            Setting::Value(v) => v,
            Setting::Auto => {
                let rule = ("value for it", "micro_batch");
                auto(name, hint.map(|h| h as f64), rule, problems).map(|v| v as u64)
            }
        }
    };
    let mut micro = b(
        c.micro_batch,
        "train_micro_batch_size_per_gpu",
        hints.micro_batch,
        &mut problems,
    );
    if micro.is_none() && c.train_batch_size == Setting::Value(None) {
        // No batch keys at all (a template): the program's micro-batch, as
        // Hugging Face's integration fills them.
        if let Some(m) = hints.micro_batch {
            tracing::info!(
                "config: no batch keys; train_micro_batch_size_per_gpu {m} from the program"
            );
            micro = Some(m);
        }
    }
    let gas = b(
        c.gradient_accumulation_steps,
        "gradient_accumulation_steps",
        hints.gradient_accumulation_steps.or(Some(1)),
        &mut problems,
    );
    let train_hint = micro.zip(gas).map(|(m, g)| m * g * world);
    let train = b(
        c.train_batch_size,
        "train_batch_size",
        train_hint,
        &mut problems,
    );
    let resolved = batch(train, micro, gas, world, &mut problems);
    if let Some(s) = c.zero.mics_shard_size {
        if world % s != 0 {
            problems.push(format!(
                "`zero_optimization.mics_shard_size` {s} must divide the world size {world}"
            ));
        }
    }
    if world % c.zero.zero_hpz_partition_size != 0 {
        problems.push(format!(
            "`zero_optimization.zero_hpz_partition_size` {} must divide the world size {world}",
            c.zero.zero_hpz_partition_size
        ));
    }
    match resolved {
        Some(batch) if problems.is_empty() => {
            c.train_batch_size = Setting::Value(Some(batch.train));
            c.micro_batch = Setting::Value(Some(batch.micro));
            c.gradient_accumulation_steps = Setting::Value(Some(batch.gas));
            Ok(Resolved {
                config: c,
                batch,
                world,
            })
        }
        _ => Err(ConfigError {
            problems,
            ..Default::default()
        }),
    }
}
