//! Offline tools over a checkpoint directory, no ranks needed: rebuild the
//! model's tensors into one safetensors file (zrt's `zero_to_fp32.py`), and
//! describe what a checkpoint holds.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

use safetensors::tensor::Dtype;

use super::export_layout::ExportLayout;
use super::files::{f32_bytes, Planned, RankFile};
use super::meta::{resolve_tag, Locator, Meta, FROZEN_FILE};
use super::sharded_out::ModelWriter;
use super::CheckpointError;

/// The dtype of a consolidated export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportDtype {
    /// The fp32 master weights, exactly.
    F32,
    /// bf16, rounded to nearest even (as libtorch's `to(bfloat16)`).
    Bf16,
}

/// Writes every parameter of the checkpoint `DIR/TAG` (`tag` `None`: the
/// one `latest` names), and its frozen variables, to `out` as one
/// safetensors file under the model's original VarStore names, loadable by
/// tch's `VarStore::load` and Python's `safetensors.torch.load_file`.
/// Returns the number of tensors written.
pub fn consolidate(
    dir: &Path,
    tag: Option<&str>,
    out: &Path,
    dtype: ExportDtype,
) -> Result<usize, CheckpointError> {
    Ok(consolidate_as(dir, tag, out, dtype, None, &ExportLayout::new())?.0)
}

/// As [`consolidate`], into the directory `out` as Hugging Face's
/// sharded checkpoint (DeepSpeed's `zero_to_fp32.py --max_shard_size`):
/// files of at most `max_shard_bytes` bytes of tensors each (a larger
/// tensor alone in its own), `model-0000k-of-0000n.safetensors`, and
/// their index `model.safetensors.index.json`; a model that fits in one
/// is `model.safetensors`, with no index.
/// [`Engine::load_weights`](crate::Engine::load_weights) reads either.
/// Returns the number of tensors and of files written.
pub fn consolidate_sharded(
    dir: &Path,
    tag: Option<&str>,
    out: &Path,
    dtype: ExportDtype,
    max_shard_bytes: u64,
) -> Result<(usize, usize), CheckpointError> {
    let layout = ExportLayout::new();
    consolidate_as(dir, tag, out, dtype, Some(max_shard_bytes), &layout)
}

/// As [`consolidate`] (`max_shard_bytes` `None`: one file `out`) or
/// [`consolidate_sharded`] (`Some`: a directory), each tensor named and
/// laid out as `layout` says and its files written beside them, as
/// [`Engine::save_16bit_model_as`](crate::Engine::save_16bit_model_as)
/// writes an export: a checkpoint of a Hugging Face model written back
/// in its layout, for `from_pretrained`. A layout that cannot be
/// written (two tensors under one name, a vector transposed) is refused
/// before anything is written. Returns the number of tensors and of
/// files written.
pub fn consolidate_as(
    dir: &Path,
    tag: Option<&str>,
    out: &Path,
    dtype: ExportDtype,
    max_shard_bytes: Option<u64>,
    layout: &ExportLayout,
) -> Result<(usize, usize), CheckpointError> {
    let (_, tag_dir) = resolve_tag(dir, tag)?;
    let meta = Meta::read(&tag_dir)?;
    let mut loc = Locator::new(&meta, &tag_dir);
    let dt = match dtype {
        ExportDtype::F32 => Dtype::F32,
        ExportDtype::Bf16 => Dtype::BF16,
    };
    // Frozen variables as saved; fp32 ones in the export's dtype.
    let frozen = meta.frozen.as_deref().unwrap_or_default();
    let file = match frozen.is_empty() {
        true => None,
        false => Some(RankFile::open(&tag_dir.join(FROZEN_FILE))?),
    };
    let as_exported = |d: Dtype| if d == Dtype::F32 { dt } else { d };
    let plan: Vec<Planned> = meta
        .params()
        .map(|s| Planned::new(&s.name, dt, &s.shape))
        .chain(
            frozen
                .iter()
                .map(|f| Planned::new(&f.name, as_exported(f.dtype), &f.shape)),
        )
        .collect();
    // One tensor in memory at a time, whatever the model's size.
    let rounded = frozen
        .iter()
        .filter(|f| f.quantized)
        .map(|f| f.name.as_str());
    let header = export_metadata(rounded);
    let (plan, names) = layout.apply(&plan, out, max_shard_bytes)?;
    let mut w = ModelWriter::create(out, max_shard_bytes, &plan, header)?;
    // Each tensor under its name in the file, in its layout there.
    let mut write = |name: &str, data: &[u8]| names.write(&mut w, name, data);
    for s in meta.params() {
        let mut v = vec![0f32; s.numel];
        loc.read_param(&s.name, "master", 0..s.numel, &mut v)?;
        write(&s.name, &encode(&v, dt))?;
    }
    if let Some(file) = &file {
        for f in frozen {
            let (_, bytes) = file.bytes(&f.name)?;
            match f.dtype {
                Dtype::F32 => {
                    let v: Vec<f32> = bytes
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect();
                    write(&f.name, &encode(&v, dt))?;
                }
                _ => write(&f.name, bytes)?,
            }
        }
    }
    let files = w.files();
    w.finish()?;
    layout.write_files(out, max_shard_bytes.is_some(), dt)?;
    Ok((plan.len(), files))
}

/// The safetensors metadata key of a model export naming the frozen
/// tensors whose values were unpacked from int8
/// (`zero_quantized_nontrainable_weights`): rounded, not the base's true
/// values. Comma-separated names, sorted; absent when there are none.
pub const ROUNDED_KEY: &str = "zrt_int8_rounded";

/// A model export's safetensors metadata: `format: pt`, and the frozen
/// tensors among `rounded` (see [`ROUNDED_KEY`]).
pub(crate) fn export_metadata<'a>(
    rounded: impl IntoIterator<Item = &'a str>,
) -> HashMap<String, String> {
    let mut names: Vec<&str> = rounded.into_iter().collect();
    names.sort_unstable();
    let mut meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    if !names.is_empty() {
        meta.insert(ROUNDED_KEY.to_string(), names.join(","));
    }
    meta
}

/// `v` as little-endian bytes of `dtype` (F32, BF16 or F16; 16-bit rounded
/// to nearest even, as libtorch's casts).
pub(crate) fn encode(v: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::BF16 => v
            .iter()
            .flat_map(|&x| zrt_kernels::cast::f32_to_bf16_bits(x).to_le_bytes())
            .collect(),
        Dtype::F16 => v
            .iter()
            .flat_map(|&x| zrt_kernels::cast::f32_to_f16_bits(x).to_le_bytes())
            .collect(),
        _ => f32_bytes(v).to_vec(),
    }
}

/// A human-readable account of checkpoint `DIR/TAG` (`None`: `latest`):
/// its world, stage, step, units and parameters, and every file with its
/// size and whether its checksum holds. Errors only when `meta.json` itself
/// cannot be read; a damaged rank file is reported in the text.
pub fn inspect(dir: &Path, tag: Option<&str>) -> Result<String, CheckpointError> {
    let (tag, tag_dir) = resolve_tag(dir, tag)?;
    let meta = Meta::read(&tag_dir)?;
    let mut s = String::new();
    let params: usize = meta.params().map(|p| p.numel).sum();
    let _ = writeln!(s, "checkpoint {} (tag `{tag}`)", tag_dir.display());
    let _ = writeln!(
        s,
        "  written by zrt {}, format {}",
        meta.zrt_version, meta.format
    );
    // SGD's and RMSprop's state hang on their momentum: say which it kept.
    let with_momentum = ["sgd", "rmsprop"].map(|k| meta.optimizer().eq_ignore_ascii_case(k));
    // Muon's state hangs on which parameters it stepped.
    let momentum = match (with_momentum.contains(&true), &meta.muon) {
        (true, _) if meta.centered() => format!(" (momentum {}, centered)", meta.momentum()),
        (true, _) => format!(" (momentum {})", meta.momentum()),
        (false, Some(muon)) => format!(" ({} parameter(s) by Muon, the rest by AdamW)", muon.len()),
        (false, None) => String::new(),
    };
    let _ = writeln!(
        s,
        "  world {} (mesh {} x {}), ZeRO stage {}, compute {}, optimizer {}{momentum}",
        meta.world,
        meta.mesh.0,
        meta.mesh.1,
        meta.stage,
        meta.compute,
        meta.optimizer()
    );
    let _ = writeln!(
        s,
        "  step {}{}, micro-step {}, skipped {}, lr {:.3e}{}{}",
        meta.global_step,
        // A module-only load restarted the optimizer's own count.
        match meta.optimizer_step {
            Some(o) if o != meta.global_step => format!(" (optimizer step {o})"),
            _ => String::new(),
        },
        meta.micro_steps,
        meta.skipped_steps,
        meta.lr,
        meta.loss_scaler
            .as_ref()
            .map(|l| format!(", loss scale {}", l.scale))
            .unwrap_or_default(),
        if meta.grads_saved {
            ", saved between accumulation boundaries (holds gradients)"
        } else {
            ""
        }
    );
    let _ = writeln!(
        s,
        "  {} units, {} parameters, {params} elements",
        meta.units.len(),
        meta.params().count()
    );
    for u in &meta.units {
        let n: usize = u.slots.iter().map(|p| p.numel).sum();
        let _ = writeln!(
            s,
            "    {:<24} {:>4} tensors {:>12} elements",
            u.name,
            u.slots.len(),
            n
        );
    }
    let frozen = meta.frozen.as_deref().unwrap_or_default();
    if !frozen.is_empty() {
        let n: i64 = frozen.iter().map(|f| f.shape.iter().product::<i64>()).sum();
        let _ = writeln!(
            s,
            "  {} frozen variables, {n} elements (rank 0's, in {FROZEN_FILE})",
            frozen.len()
        );
        let packed = frozen.iter().filter(|f| f.quantized).count();
        if packed > 0 {
            let _ = writeln!(
                s,
                "    {packed} of them unpacked from int8 (`zero_quantized_nontrainable_weights`): rounded values, not the base's true ones"
            );
        }
    }
    if let Some(names) = meta.no_weight_decay.as_deref().filter(|n| !n.is_empty()) {
        let _ = writeln!(
            s,
            "  {} parameter(s) left out of weight decay: {}",
            names.len(),
            names.join(", ")
        );
    }
    if let Some(scales) = meta.lr_scales.as_ref().filter(|m| !m.is_empty()) {
        let each: Vec<String> = scales.iter().map(|(n, s)| format!("{n} x{s}")).collect();
        let _ = writeln!(
            s,
            "  {} parameter(s) with a scaled learning rate: {}",
            scales.len(),
            each.join(", ")
        );
    }
    if !meta.client_state.is_null() {
        let _ = writeln!(s, "  client state {}", meta.client_state);
    }
    let mut bad = 0;
    let frozen_file = (!frozen.is_empty()).then(|| FROZEN_FILE.to_string());
    for f in meta
        .files
        .iter()
        .chain(&meta.replica_grad_files)
        .chain(&frozen_file)
    {
        let path = tag_dir.join(f);
        let size = std::fs::metadata(&path).map(|m| m.len()).ok();
        let status = match RankFile::open(&path) {
            Ok(_) => "checksum ok".to_string(),
            Err(e) => {
                bad += 1;
                e.to_string()
            }
        };
        let size = size.map_or("missing".into(), |b| {
            format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
        });
        let _ = writeln!(s, "  {f}  {size}  {status}");
    }
    if bad > 0 {
        let _ = writeln!(
            s,
            "  {bad} damaged or missing file(s): this tag cannot be loaded"
        );
    }
    let partial = partial_saves(dir);
    if !partial.is_empty() {
        let _ = writeln!(
            s,
            "  left by interrupted saves in {}: {} (nothing loads them; delete them to free the space)",
            dir.display(),
            partial.join(", ")
        );
    }
    Ok(s)
}

/// The staging directories (`.TAG.partial`) of saves that never completed
/// under `dir`, sorted: a save that succeeds renames its own away, and one
/// that fails removes it, so these are what a killed job left.
fn partial_saves(dir: &Path) -> Vec<String> {
    let mut found: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with('.') && n.ends_with(".partial"))
        .collect();
    found.sort();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exports_metadata_names_its_rounded_tensors_sorted_and_only_them() {
        let none = export_metadata([]);
        assert_eq!(none.len(), 1);
        assert_eq!(none["format"], "pt");
        let some = export_metadata(["h.1.fc.weight", "h.0.fc.weight"]);
        assert_eq!(some[ROUNDED_KEY], "h.0.fc.weight,h.1.fc.weight");
    }
}
