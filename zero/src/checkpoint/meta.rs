//! `meta.json`: what a checkpoint holds and where every parameter lives.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::files::{read_json, RankFile};
use super::CheckpointError;

/// The format tag in every `meta.json`; a reader refuses other formats.
pub const FORMAT: &str = "zrt-checkpoint/1";

/// One parameter's place in its unit's flat buffer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlotMeta {
    /// The VarStore name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<i64>,
    /// First element in the unit's flat buffer.
    pub offset: usize,
    /// Elements.
    pub numel: usize,
}

/// The file holding a checkpoint's frozen variables (rank 0's values).
pub const FROZEN_FILE: &str = "frozen.safetensors";

/// A frozen variable (a VarStore tensor with `requires_grad` false: a
/// frozen parameter or a buffer such as a running statistic), saved whole
/// in [`FROZEN_FILE`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrozenMeta {
    /// The VarStore name.
    pub name: String,
    /// Its element type, as safetensors names it (`F32`, `I64`, ...).
    pub dtype: safetensors::Dtype,
    /// Its shape.
    pub shape: Vec<i64>,
    /// Its values were unpacked from int8 codes and scales (stage 3 held
    /// its shard packed: `zero_quantized_nontrainable_weights`): rounded,
    /// the true ones dropped when that run began. It says how the saving
    /// run held them: one that loaded them and held them exactly saves
    /// them unmarked (it was told when it loaded them). Absent (false) in
    /// checkpoints written before zrt recorded it, whose runs packed none.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub quantized: bool,
}

/// One unit's flat layout as saved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnitMeta {
    /// The unit's name (its VarStore prefix, or `<root>`).
    pub name: String,
    /// Elements of the flat buffer, padding included.
    pub padded: usize,
    /// Elements per rank file (`padded / world`).
    pub shard_len: usize,
    /// Its parameters.
    pub slots: Vec<SlotMeta>,
}

/// fp16 dynamic loss scaler state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScalerMeta {
    /// The current scale.
    pub scale: f64,
    /// Overflows left before the next halving.
    pub hysteresis: u32,
    /// Steps seen.
    pub iter: u64,
    /// The step of the last overflow (`null` before the first).
    pub last_overflow: Option<u64>,
}

/// Everything `meta.json` records (rank 0 writes it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// [`FORMAT`].
    pub format: String,
    /// The zrt version that wrote it.
    pub zrt_version: String,
    /// The tag.
    pub tag: String,
    /// Ranks that saved it (one file each).
    pub world: usize,
    /// The mesh as (replicate, shard) sizes.
    pub mesh: (usize, usize),
    /// The ZeRO stage it was trained with.
    pub stage: u8,
    /// The compute dtype: "fp32", "bf16" or "fp16".
    pub compute: String,
    /// Optimizer steps taken.
    pub global_step: u64,
    /// Steps taken since the optimizer state started (the engine's
    /// building, or a module-only load, which starts the moments afresh):
    /// what bias correction and the other per-state step counts go on
    /// from. `None` in checkpoints of zrt before 2026-11-30, whose state
    /// always started with the engine: `global_step`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_step: Option<u64>,
    /// Micro-steps (`backward` calls) taken.
    pub micro_steps: u64,
    /// The micro-step of the last accumulation boundary handled.
    pub boundary_at: u64,
    /// fp16 steps skipped on overflow.
    pub skipped_steps: u64,
    /// The learning rate of the last step.
    pub lr: f64,
    /// The learning rate the program set
    /// ([`Engine::set_lr`](crate::Engine::set_lr)), which steps use until
    /// it sets another; `None` when they follow the config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr_set: Option<f64>,
    /// The fp16 loss scaler, if any.
    pub loss_scaler: Option<ScalerMeta>,
    /// Whether rank files hold accumulated gradients (saved between
    /// accumulation boundaries): then only an engine at the same stage, on
    /// the same mesh and with the same units loads it.
    pub grads_saved: bool,
    /// Units in flat order.
    pub units: Vec<UnitMeta>,
    /// The rank files, in rank order.
    pub files: Vec<String>,
    /// The gradient files of replicas after the first, replica-major
    /// (hybrid stage 1 saved between boundaries: each replica's own
    /// accumulated gradients; the first replica's are in the rank files).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replica_grad_files: Vec<String>,
    /// The frozen variables in [`FROZEN_FILE`]; `None` in checkpoints
    /// written before zrt saved them (loading one leaves them as they are).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen: Option<Vec<FrozenMeta>>,
    /// The parameters the run left out of weight decay
    /// ([`ShardPlan::exclude_from_weight_decay`](crate::ShardPlan::exclude_from_weight_decay)),
    /// sorted; `None` in checkpoints written before zrt recorded them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_weight_decay: Option<Vec<String>>,
    /// The parameters whose learning rate the run scaled
    /// ([`ShardPlan::scale_learning_rate`](crate::ShardPlan::scale_learning_rate)),
    /// with their scales; `None` in checkpoints written before zrt
    /// recorded them (whose runs scaled none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr_scales: Option<std::collections::BTreeMap<String, f64>>,
    /// The parameters Muon's half stepped
    /// ([`ShardPlan::use_muon`](crate::ShardPlan::use_muon)), sorted;
    /// `None` for every other optimizer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub muon: Option<Vec<String>>,
    /// The resolved config (the settings that shape training).
    pub config: serde_json::Value,
    /// What the program saved with the checkpoint (DeepSpeed's
    /// `client_state`: an epoch, a data position), world rank 0's; `null`
    /// when it saved nothing.
    #[serde(default)]
    pub client_state: serde_json::Value,
}

impl Meta {
    /// Reads and verifies `TAG_DIR/meta.json`.
    pub fn read(tag_dir: &Path) -> Result<Meta, CheckpointError> {
        let path = tag_dir.join("meta.json");
        let body = read_json(&path)?;
        let meta: Meta = serde_json::from_str(&body)
            .map_err(|e| CheckpointError::format(&path, e.to_string()))?;
        if meta.format != FORMAT {
            return Err(CheckpointError::format(
                &path,
                format!("format `{}`, this zrt reads `{FORMAT}`", meta.format),
            ));
        }
        if meta.files.len() != meta.world
            || meta
                .units
                .iter()
                .any(|u| u.shard_len * meta.world != u.padded)
        {
            return Err(CheckpointError::format(
                &path,
                "files or shard sizes do not match its world size",
            ));
        }
        Ok(meta)
    }

    /// The optimizer its run trained with, as `optimizer.type` names it
    /// ("Adam", "AdamW", "Lion" or "SGD": every checkpoint records it in its
    /// resolved config), which decides the moments its rank files hold.
    pub fn optimizer(&self) -> &str {
        self.config["optimizer"]["type"].as_str().unwrap_or("AdamW")
    }

    /// SGD's, RMSprop's or Muon's momentum as its run set it (0 when not
    /// recorded: every other optimizer's, and a run without momentum),
    /// which decides whether SGD's and RMSprop's rank files hold a
    /// momentum buffer.
    pub fn momentum(&self) -> f64 {
        self.config["optimizer"]["momentum"].as_f64().unwrap_or(0.0)
    }

    /// Whether its run's RMSprop was centered (its rank files then hold the
    /// gradient's average as `v`); false when not recorded.
    pub fn centered(&self) -> bool {
        self.config["optimizer"]["centered"]
            .as_bool()
            .unwrap_or(false)
    }

    /// Every parameter as (name, shape), in flat order.
    pub fn params(&self) -> impl Iterator<Item = &SlotMeta> {
        self.units.iter().flat_map(|u| &u.slots)
    }
}

/// The file name of rank `rank`'s shards in a world of `world`.
pub(crate) fn rank_file_name(rank: usize, world: usize) -> String {
    format!("rank-{rank:05}-of-{world:05}.safetensors")
}

/// The file of replica `replica`'s accumulated gradients on shard rank
/// `rank` of `world` (see [`Meta::replica_grad_files`]).
pub(crate) fn replica_grads_file_name(replica: usize, rank: usize, world: usize) -> String {
    format!("grads-replica-{replica:05}-rank-{rank:05}-of-{world:05}.safetensors")
}

/// Whose a rank file or a replica's gradient file is, as its header
/// records it: a file copied from another rank or checkpoint has a valid
/// checksum but the wrong contents, and the header says so.
pub(crate) struct Whose {
    /// The replica (replica gradient files only).
    pub(crate) replica: Option<usize>,
    /// The rank in the shard group.
    pub(crate) rank: usize,
    /// The shard group's size.
    pub(crate) world: usize,
}

impl Whose {
    /// The header entries a writer records.
    pub(crate) fn header(&self) -> HashMap<String, String> {
        let mut h = HashMap::from([
            ("rank".to_string(), self.rank.to_string()),
            ("world".to_string(), self.world.to_string()),
        ]);
        if let Some(j) = self.replica {
            h.insert("replica".to_string(), j.to_string());
        }
        h
    }

    /// Checks that `f`'s header names this file.
    pub(crate) fn check(&self, f: &RankFile) -> Result<(), CheckpointError> {
        let replica = match self.replica {
            Some(_) => Some(f.meta("replica")?),
            None => None,
        };
        let (r, w) = (f.meta("rank")?, f.meta("world")?);
        let says = describe(replica, r, w);
        let want = describe(
            self.replica.map(|j| j.to_string()).as_deref(),
            &self.rank.to_string(),
            &self.world.to_string(),
        );
        if says != want {
            return Err(CheckpointError::format(
                f.path(),
                format!("it holds {says}, expected {want}"),
            ));
        }
        Ok(())
    }
}

/// "rank R of W", "replica J rank R of W" with a replica.
fn describe(replica: Option<&str>, rank: &str, world: &str) -> String {
    match replica {
        Some(j) => format!("replica {j} rank {rank} of {world}"),
        None => format!("rank {rank} of {world}"),
    }
}

/// The tag to load (`tag`, or the one `DIR/latest` names) and its directory.
pub(crate) fn resolve_tag(
    dir: &Path,
    tag: Option<&str>,
) -> Result<(String, PathBuf), CheckpointError> {
    let tag = match tag {
        Some(t) => t.to_string(),
        None => {
            let latest = dir.join("latest");
            match std::fs::read_to_string(&latest) {
                Ok(t) => t.trim().to_string(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(CheckpointError::NoLatest {
                        dir: dir.to_path_buf(),
                        exists: dir.is_dir(),
                        tags: tags_in(dir),
                    });
                }
                Err(e) => return Err(CheckpointError::io("read", latest, e)),
            }
        }
    };
    let tag_dir = dir.join(&tag);
    Ok((tag, tag_dir))
}

/// The checkpoint tags under `dir` (subdirectories holding a `meta.json`),
/// sorted; none when it cannot be read.
fn tags_in(dir: &Path) -> Vec<String> {
    let mut tags: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter(|e| e.path().join("meta.json").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    tags.sort();
    tags
}

/// Finds any element of a saved parameter in whichever rank's file holds it.
pub(crate) struct Locator {
    dir: PathBuf,
    /// The checkpoint's world size and rank files.
    world: usize,
    files: Vec<String>,
    /// Each unit's name and shard length.
    units: Vec<(String, usize)>,
    /// name -> (unit, offset in the unit's flat buffer)
    by_name: HashMap<String, (usize, usize)>,
    open: HashMap<usize, RankFile>,
}

impl Locator {
    /// A locator over the rank files in `tag_dir`; files are mapped (and
    /// verified) on first use.
    pub(crate) fn new(meta: &Meta, tag_dir: &Path) -> Self {
        let by_name = meta
            .units
            .iter()
            .enumerate()
            .flat_map(|(u, m)| m.slots.iter().map(move |s| (s.name.clone(), (u, s.offset))))
            .collect();
        Self {
            dir: tag_dir.to_path_buf(),
            world: meta.world,
            files: meta.files.clone(),
            units: meta
                .units
                .iter()
                .map(|u| (u.name.clone(), u.shard_len))
                .collect(),
            by_name,
            open: HashMap::new(),
        }
    }

    /// Rank `rank`'s file, mapped and verified once.
    pub(crate) fn file(&mut self, rank: usize) -> Result<&RankFile, CheckpointError> {
        if !self.open.contains_key(&rank) {
            let name = self.files.get(rank).ok_or_else(|| {
                CheckpointError::format(
                    self.dir.join("meta.json"),
                    format!("no file for rank {rank}"),
                )
            })?;
            let path = self.dir.join(name);
            let f = RankFile::open(&path)?;
            let whose = Whose {
                replica: None,
                rank,
                world: self.world,
            };
            whose.check(&f)?;
            self.open.insert(rank, f);
        }
        Ok(&self.open[&rank])
    }

    /// Copies elements `elems` of parameter `name`'s `what` (`master`, `m`
    /// or `v`) into `dst`, from the rank files that hold them.
    pub(crate) fn read_param(
        &mut self,
        name: &str,
        what: &str,
        elems: Range<usize>,
        dst: &mut [f32],
    ) -> Result<(), CheckpointError> {
        self.walk(name, what, elems, Some(dst))
    }

    /// Checks that [`Locator::read_param`] of the same elements would find
    /// them all (files present and verified, tensors of the right dtype
    /// and length), reading nothing.
    pub(crate) fn check_param(
        &mut self,
        name: &str,
        what: &str,
        elems: Range<usize>,
    ) -> Result<(), CheckpointError> {
        self.walk(name, what, elems, None)
    }

    fn walk(
        &mut self,
        name: &str,
        what: &str,
        elems: Range<usize>,
        mut dst: Option<&mut [f32]>,
    ) -> Result<(), CheckpointError> {
        let &(u, offset) = self.by_name.get(name).ok_or_else(|| {
            CheckpointError::format(self.dir.join("meta.json"), format!("no parameter `{name}`"))
        })?;
        let (unit, shard_len) = self.units[u].clone();
        let tensor = format!("{unit}/{what}");
        let (mut a, b) = (offset + elems.start, offset + elems.end);
        let mut out = 0;
        while a < b {
            let r = a / shard_len;
            let end = b.min((r + 1) * shard_len);
            let base = r * shard_len;
            let n = end - a;
            let f = self.file(r)?;
            match dst.as_deref_mut() {
                Some(d) => f.read_f32(&tensor, a - base..end - base, &mut d[out..out + n])?,
                None => drop(f.f32s(&tensor, a - base..end - base)?),
            }
            out += n;
            a = end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::files::{f32_bytes, json_with_crc, Planned, TensorWriter};
    use safetensors::Dtype;

    /// A fresh empty directory for one test.
    fn dir(name: &str) -> PathBuf {
        crate::test_dir(&format!("meta-{name}"))
    }

    /// Two ranks, one unit `u` of 8 elements: `a` (5) then `b` (3).
    fn meta() -> Meta {
        let slot = |name: &str, offset, numel| SlotMeta {
            name: name.into(),
            shape: vec![numel as i64],
            offset,
            numel,
        };
        Meta {
            format: FORMAT.into(),
            zrt_version: "test".into(),
            tag: "t".into(),
            world: 2,
            mesh: (1, 2),
            stage: 3,
            compute: "fp32".into(),
            global_step: 1,
            optimizer_step: None,
            micro_steps: 1,
            boundary_at: 1,
            skipped_steps: 0,
            lr: 0.1,
            lr_set: None,
            loss_scaler: None,
            grads_saved: false,
            units: vec![UnitMeta {
                name: "u".into(),
                padded: 8,
                shard_len: 4,
                slots: vec![slot("a", 0, 5), slot("b", 5, 3)],
            }],
            files: vec![rank_file_name(0, 2), rank_file_name(1, 2)],
            replica_grad_files: Vec::new(),
            frozen: None,
            no_weight_decay: None,
            lr_scales: None,
            muon: None,
            config: serde_json::Value::Null,
            client_state: serde_json::Value::Null,
        }
    }

    fn write_meta(dir: &Path, m: &Meta) {
        let body = serde_json::to_string(m).unwrap();
        std::fs::write(dir.join("meta.json"), json_with_crc(&body)).unwrap();
    }

    /// Rank `rank`'s file, saying in its header it is rank `says.0` of
    /// `says.1`, holding `u/master` (element i of the flat buffer is i)
    /// and, for `m`, only `len` elements.
    fn write_rank(dir: &Path, rank: usize, says: (usize, usize), m_len: usize) {
        let master: Vec<f32> = (0..4).map(|i| (rank * 4 + i) as f32).collect();
        let m = vec![0.5f32; m_len];
        let plan = [
            Planned::new("u/master", Dtype::F32, &[4]),
            Planned::new("u/m", Dtype::F32, &[m_len as i64]),
        ];
        let header = HashMap::from([
            ("rank".to_string(), says.0.to_string()),
            ("world".to_string(), says.1.to_string()),
        ]);
        let mut w =
            TensorWriter::create(&dir.join(rank_file_name(rank, 2)), &plan, header).unwrap();
        w.write("u/master", f32_bytes(&master)).unwrap();
        w.write("u/m", f32_bytes(&m)).unwrap();
        w.finish().unwrap();
    }

    #[test]
    fn meta_json_must_agree_with_its_world_size_on_both_counts() {
        let d = dir("world");
        write_meta(&d, &meta());
        assert_eq!(Meta::read(&d).unwrap(), meta());
        // Each disagreement on its own is refused.
        let mut one_file = meta();
        one_file.files.pop();
        let mut odd_shards = meta();
        odd_shards.units[0].padded = 10;
        for bad in [one_file, odd_shards] {
            write_meta(&d, &bad);
            let e = Meta::read(&d).unwrap_err().to_string();
            assert!(
                e.contains("files or shard sizes do not match its world size"),
                "{e}"
            );
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn latest_that_cannot_be_read_is_an_io_error_not_a_missing_tag() {
        let d = dir("latest");
        // Only subdirectories holding a meta.json count as tags, sorted.
        for (t, meta) in [("b", true), ("a", true), ("partial", false)] {
            std::fs::create_dir(d.join(t)).unwrap();
            if meta {
                std::fs::write(d.join(t).join("meta.json"), "{}").unwrap();
            }
        }
        match resolve_tag(&d, None) {
            Err(CheckpointError::NoLatest { exists, tags, .. }) => {
                assert!(exists);
                assert_eq!(tags, ["a", "b"]);
            }
            r => panic!("{r:?}"),
        }
        std::fs::create_dir(d.join("latest")).unwrap();
        let e = resolve_tag(&d, None).unwrap_err();
        assert!(matches!(e, CheckpointError::Io { op: "read", .. }), "{e}");
        std::fs::remove_dir(d.join("latest")).unwrap();
        std::fs::write(d.join("latest"), "step7\n").unwrap();
        assert_eq!(
            resolve_tag(&d, None).unwrap(),
            ("step7".into(), d.join("step7"))
        );
        assert_eq!(
            resolve_tag(&d, Some("x")).unwrap(),
            ("x".into(), d.join("x"))
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn reads_span_rank_files_and_a_file_of_another_rank_or_world_is_refused() {
        let d = dir("locate");
        let m = meta();
        write_rank(&d, 0, (0, 2), 4);
        write_rank(&d, 1, (1, 2), 4);
        let mut loc = Locator::new(&m, &d);
        // `a` is elements 0..5: four in rank 0's file, one in rank 1's.
        let mut a = [0f32; 4];
        loc.read_param("a", "master", 1..5, &mut a).unwrap();
        assert_eq!(a, [1., 2., 3., 4.]);
        let mut b = [0f32; 3];
        loc.read_param("b", "master", 0..3, &mut b).unwrap();
        assert_eq!(b, [5., 6., 7.]);
        loc.check_param("b", "m", 0..3).unwrap();
        // Rank 1's `m` is one element short: the check finds it without a
        // destination to read into.
        write_rank(&d, 1, (1, 2), 3);
        let mut loc = Locator::new(&m, &d);
        loc.check_param("a", "m", 0..4).unwrap();
        let e = loc.check_param("b", "m", 0..3).unwrap_err().to_string();
        assert!(
            e.contains("rank-00001-of-00002")
                && e.contains("tensor `u/m` is not an f32 tensor covering 1..4"),
            "{e}"
        );
        // A file whose header names another rank, or another world, is not
        // read even though its checksum is valid.
        for says in [(0, 2), (1, 3)] {
            write_rank(&d, 1, says, 4);
            let mut loc = Locator::new(&m, &d);
            let e = loc
                .check_param("b", "master", 0..3)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!(
                    "it holds rank {} of {}, expected rank 1 of 2",
                    says.0, says.1
                )),
                "{e}"
            );
        }
        let _ = std::fs::remove_dir_all(&d);
    }
}
