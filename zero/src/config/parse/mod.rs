//! Walking the JSON: every problem is collected, never just the first.
//! The blocks with the most rules have modules of their own:
//! `optimizer` and `scheduler`; resolving `"auto"` for a world is
//! `super::resolve`'s.

use serde_json::{Map, Value};

use super::keys::{self, closest};
use super::{
    AioConfig, CommsLoggerConfig, Config, ConfigError, ElasticityConfig, FlopsProfilerConfig,
    LossScaleConfig, MonitorConfig, OffloadConfig, OffloadDevice, Precision, SchedulerConfig,
    ZeroConfig,
};

mod optimizer;
mod scheduler;

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

    /// `elasticity`: the block when `enabled`, checked as DeepSpeed checks
    /// it (its version 0.1; 0.2's node-granular rule is refused).
    fn elasticity(&mut self, top: &Map<String, Value>) -> Option<ElasticityConfig> {
        let key = "elasticity";
        let e = self.object(top, key)?;
        self.keys(e, key, keys::ELASTICITY, &[], true);
        if !self.bool_or(e, key, "enabled", false) {
            return None;
        }
        let version = self.f64_or(e, key, "version", 0.1);
        if version != 0.1 {
            self.problems.push(format!(
                "`elasticity.version` {version} is not implemented: zrt chooses the batch by DeepSpeed's version 0.1 (per rank; 0.2 chooses per node, for model parallelism zrt does not have); set \"version\": 0.1"
            ));
        }
        for k in ["model_parallel_size", "num_gpus_per_node"] {
            if e.contains_key(k) && version == 0.1 {
                self.warnings.push(format!(
                    "`elasticity.{k}` belongs to DeepSpeed's version 0.2; version 0.1 does not read it"
                ));
            }
        }
        let max_train_batch_size = self.u64_or(e, key, "max_train_batch_size", 2000);
        let micro_batch_sizes = match e.get("micro_batch_sizes") {
            None | Some(Value::Null) => vec![2, 4, 6],
            Some(Value::Array(a)) => {
                let path = "elasticity.micro_batch_sizes";
                let sizes: Vec<u64> = a.iter().filter_map(|v| self.uint(v, path)).collect();
                if sizes.is_empty() || sizes.contains(&0) {
                    self.problems.push(format!(
                        "`{path}` must list micro-batch sizes of at least 1, got {}",
                        Value::Array(a.clone())
                    ));
                    return None;
                }
                sizes
            }
            Some(v) => {
                self.problems.push(format!(
                    "`elasticity.micro_batch_sizes` must be a list of micro-batch sizes, got {v}"
                ));
                return None;
            }
        };
        if let Some(m) = micro_batch_sizes
            .iter()
            .find(|&&m| m > max_train_batch_size)
        {
            self.problems.push(format!(
                "`elasticity.micro_batch_sizes` holds {m}, above `max_train_batch_size` {max_train_batch_size}: every micro-batch must fit in the largest global batch"
            ));
        }
        let min_gpus = self.u64_or(e, key, "min_gpus", 1);
        let max_gpus = self.u64_or(e, key, "max_gpus", 10000);
        if min_gpus == 0 || min_gpus > max_gpus {
            self.problems.push(format!(
                "`elasticity.min_gpus` {min_gpus} and `max_gpus` {max_gpus} must hold 1 <= min_gpus <= max_gpus"
            ));
        }
        // For the scheduler that scales the job, which zrt's launcher
        // leaves to the user.
        let _ = self.f64_or(e, key, "min_time", 0.0);
        Some(ElasticityConfig {
            max_train_batch_size,
            micro_batch_sizes,
            min_gpus,
            max_gpus,
            prefer_larger_batch: self.bool_or(e, key, "prefer_larger_batch", true),
            ignore_non_elastic_batch_info: self.bool_or(
                e,
                key,
                "ignore_non_elastic_batch_info",
                false,
            ),
        })
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

    /// `flops_profiler`.
    fn flops_profiler(&mut self, top: &Map<String, Value>) -> FlopsProfilerConfig {
        let key = "flops_profiler";
        let d = FlopsProfilerConfig::default();
        let Some(m) = self.object(top, key) else {
            return d;
        };
        self.keys(m, key, keys::FLOPS_PROFILER, &[], true);
        let enabled = self.bool_or(m, key, "enabled", false);
        let recompute_fwd_factor = self.f64_or(m, key, "recompute_fwd_factor", 0.0);
        if recompute_fwd_factor < 0.0 {
            self.problems.push(format!(
                "`flops_profiler.recompute_fwd_factor` is the share of the forward that backward computes again, at least 0, got {recompute_fwd_factor}"
            ));
        }
        match m.get("module_depth") {
            None | Some(Value::Null) => {}
            Some(v) => match v.as_i64() {
                Some(-1 | 1) => {}
                Some(n) if n >= -1 => {
                    if enabled {
                        self.warnings.push(format!("`flops_profiler.module_depth` = {n}: zrt profiles the model's units (its wrapped blocks and the root), one level below the model; every depth shows them"));
                    }
                }
                _ => self.problems.push(format!(
                    "`flops_profiler.module_depth` must be a whole number (-1: every depth), got {v}"
                )),
            },
        }
        let output_file = match m.get("output_file") {
            None | Some(Value::Null) => None,
            Some(_) => self
                .string(m, key, "output_file")
                .map(std::path::PathBuf::from),
        };
        FlopsProfilerConfig {
            enabled,
            profile_step: self.u64_or(m, key, "profile_step", d.profile_step),
            recompute_fwd_factor,
            top_modules: self.u64_or(m, key, "top_modules", d.top_modules),
            detailed: self.bool_or(m, key, "detailed", d.detailed),
            output_file,
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
        memory_breakdown: p.bool_or(&top, "", "memory_breakdown", false),
        dump_state: p.bool_or(&top, "", "dump_state", false),
        fp32_grad_reduce,
        zero: p.zero(&top),
        aio: p.aio(&top),
        monitor: MonitorConfig {
            csv: p.monitor(&top, "csv_monitor"),
            tensorboard: p.monitor(&top, "tensorboard"),
        },
        comms_logger: p.comms_logger(&top),
        flops_profiler: p.flops_profiler(&top),
        elasticity: p.elasticity(&top),
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
