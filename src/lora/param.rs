//! LoRA on stacked experts' parameters (PEFT's `target_parameters`,
//! its `ParamWrapper`): GPT-OSS's and Llama 4's `gate_up_proj` and `down_proj` and
//! Granite-MoE's `input_linear.weight` and `output_linear.weight` are
//! `[experts, p, q]` parameters, not linear layers, so an adapter on
//! them is one `A` `[r experts, p]` and one `B` `[q, r experts]` for all
//! the experts, expert `e`'s update `s A_e^T B_e^T` `[p, q]` added to its
//! matrix, where `A_e` is `A`'s rows `e r .. (e + 1) r` and `B_e` is `B`'s
//! columns `e, e + experts, e + 2 experts, ...` (PEFT reshapes `A` to
//! `[experts, r, p]` and `B` to `[q, r, experts]`: the two orders are its
//! file's, and a merge must read them so).
//!
//! PEFT adds the update to the whole parameter before each forward; zrt
//! multiplies each expert's tokens by the two factors instead (the same
//! sum, without an `[experts, p, q]` tensor a step). Several parameters
//! of one module nest in PEFT, the first the module registers wrapped
//! first: its adapter is named under `base_layer.` once for each
//! targeted parameter registered after it
//! (`mlp.experts.base_layer.lora_A.weight` is `gate_up_proj`'s when
//! `down_proj` takes one too, `mlp.experts.lora_A.weight` then
//! `down_proj`'s).

use std::collections::HashMap;

use tch::{nn, Kind, Tensor};

use super::{module_name, LoraConfig};
use crate::hf::HfError;

/// The order in which GPT-OSS's and Llama 4's experts register the
/// matrices an adapter can target (GPT-OSS's biases, between them,
/// cannot take one); every
/// other stacked module zrt builds holds one (`weight`). It decides the
/// nesting of their adapters' names.
pub(crate) const REGISTERED: [&str; 2] = ["gate_up_proj", "down_proj"];

/// An adapter on an `[experts, p, q]` parameter (see the module's doc).
#[derive(Debug)]
pub(crate) struct ParamAdapter {
    a: Tensor,
    b: Tensor,
    experts: i64,
    rank: i64,
    scale: f64,
}

impl ParamAdapter {
    /// What `x @ W_e` gains for `x` `[n, p]`: `x @ (s A_e^T B_e^T)`,
    /// `[n, q]` (GPT-OSS's experts multiply from the left).
    pub(crate) fn right(&self, e: i64, x: &Tensor) -> Tensor {
        let (a, b) = self.factors(e);
        x.matmul(&a.tr()).matmul(&b.tr()) * self.scale
    }

    /// What `x @ W_e^T` gains for `x` `[n, q]`: `x @ (s B_e A_e)`, `[n,
    /// p]` (Granite-MoE's experts are linear layers' `[out, in]`).
    pub(crate) fn left(&self, e: i64, x: &Tensor) -> Tensor {
        let (a, b) = self.factors(e);
        x.matmul(&b).matmul(&a) * self.scale
    }

    /// Expert `e`'s `A_e` `[r, p]` and `B_e` `[q, r]`.
    fn factors(&self, e: i64) -> (Tensor, Tensor) {
        let (r, q) = (self.rank, self.b.size()[0]);
        let a = self.a.narrow(0, e * r, r);
        let b = self.b.view([q, r, self.experts]).select(2, e);
        (a, b)
    }
}

/// The adapters `cfg` puts on the parameters `params` (their names and
/// `[experts, p, q]` shapes, in the order the module registers them) of
/// the module under `p`, one a parameter (`None` where none is
/// targeted), named as PEFT nests them. `A` is drawn as PEFT draws it
/// (uniform in `±1/sqrt(p)`), `B` is zeros.
pub(crate) fn on_module(
    p: &nn::Path,
    params: &[(&str, [i64; 3])],
    cfg: Option<&LoraConfig>,
) -> Vec<Option<ParamAdapter>> {
    let module = module_name(p, "");
    let full = |name: &str| format!("{module}.{name}");
    let targeted: Vec<bool> = (params.iter())
        .map(|(name, _)| cfg.is_some_and(|c| c.targets_parameter(&full(name))))
        .collect();
    let mut after = targeted.iter().filter(|t| **t).count();
    let adapters = params
        .iter()
        .zip(&targeted)
        .map(|(&(name, [e, i, o]), &t)| {
            let c = cfg.filter(|_| t)?;
            after -= 1;
            let at = (0..after).fold(p.clone(), |at, _| at / "base_layer");
            let r = c.rank_of(&full(name));
            let bound = 1.0 / (i as f64).sqrt();
            let uniform = nn::Init::Uniform {
                lo: -bound,
                up: bound,
            };
            Some(ParamAdapter {
                a: (&at / "lora_A").var("weight", &[r * e, i], uniform),
                b: (&at / "lora_B").var("weight", &[o, r * e], nn::Init::Const(0.0)),
                experts: e,
                rank: r,
                scale: c.scale_of(&full(name)),
            })
        });
    adapters.collect()
}

/// Refuses what PEFT's `ParamWrapper` refuses beside
/// `target_parameters`: dropout (the update is added to the weight, so
/// no input of its own can be dropped), DoRA, B's bias and
/// `fan_in_fan_out`; and an empty name.
pub(crate) fn check(cfg: &LoraConfig, refuse: &dyn Fn(String) -> HfError) -> Result<(), HfError> {
    if cfg.target_parameters.is_empty() {
        return Ok(());
    }
    let with = |what: &str| {
        Err(refuse(format!(
            "target_parameters {:?} with {what}: PEFT's adapters on parameters take none (it refuses them too); leave it off",
            cfg.target_parameters
        )))
    };
    if cfg.dropout > 0.0 {
        return with(&format!("lora_dropout {}", cfg.dropout));
    }
    if cfg.use_dora {
        return with("use_dora");
    }
    if cfg.lora_bias {
        return with("lora_bias");
    }
    if cfg.fan_in_fan_out {
        return with("fan_in_fan_out");
    }
    if cfg.target_parameters.iter().any(|t| t.is_empty()) {
        return Err(refuse(format!(
            "target_parameters {:?} holds an empty name: name parameters (mlp.experts.gate_up_proj)",
            cfg.target_parameters
        )));
    }
    Ok(())
}

/// Refuses a `target_parameters` entry that names none of the model's
/// stacked experts' parameters (`variables`: each variable's full name
/// and dimensions): PEFT refuses a list matching nothing; zrt also
/// refuses one naming a matrix (a linear layer's `weight`, which
/// `target_modules` adapts), even beside stacked parameters.
pub(crate) fn check_matched<'a>(
    cfg: &LoraConfig,
    variables: impl Iterator<Item = (&'a str, usize)> + Clone,
) -> Result<(), HfError> {
    for t in &cfg.target_parameters {
        let mut hits = variables.clone().filter(|(n, _)| super::names(t, n));
        if hits.clone().next().is_none() {
            return Err(HfError::Lora(format!(
                "target_parameters: `{t}` names no parameter of the model: name stacked experts' parameters by the end of their names (GPT-OSS's mlp.experts.gate_up_proj and mlp.experts.down_proj, Granite-MoE's block_sparse_moe.input_linear.weight and block_sparse_moe.output_linear.weight)"
            )));
        }
        // Every one it names: PEFT would adapt a matrix too (Granite-MoE-
        // shared's `shared_mlp.input_linear.weight` ends as its experts' do).
        if let Some((name, dim)) = hits.find(|&(_, dim)| dim != 3) {
            // DBRX's experts' rows (`ffn.experts.mlp.w1`, `v1`, `w2`,
            // `[experts x width, hidden]`): PEFT 0.18 wraps their module,
            // and DBRX's experts then fail to read `mlp.w1` through it.
            if dim == 2 && !name.ends_with(".weight") {
                return Err(HfError::Lora(format!(
                    "target_parameters: `{t}` names `{name}`, a 2-dimensional parameter that is no linear layer's matrix (DBRX's experts' rows): zrt adapts [experts, in, out] parameters only, and PEFT cannot adapt these either (its wrapper hides them from DBRX's experts, which read them by attribute: AttributeError); adapt the attention and the router through target_modules"
                )));
            }
            return Err(HfError::Lora(format!(
                "target_parameters: `{t}` names `{name}`, a {dim}-dimensional parameter: zrt adapts stacked experts' ([experts, in, out]) through target_parameters; name them alone (by more of their names), and put a linear layer's module in target_modules"
            )));
        }
    }
    Ok(())
}

/// The `[experts, p, q]` update of the adapter `(a, b)` of rank `r`, in
/// fp32 (PEFT's `get_delta_weight`: `einsum("o r e, e r i -> e i o")`,
/// times the factor).
pub(crate) fn delta(a: &Tensor, b: &Tensor, r: i64, scale: f64) -> Tensor {
    let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
    let (re, p) = (a.size()[0], a.size()[1]);
    let (q, experts) = (b.size()[0], re / r);
    let a = a.view([experts, r, p]);
    let b = b.view([q, r, experts]).permute([2, 1, 0]);
    a.transpose(1, 2).matmul(&b) * scale
}

/// The parameter the adapter named `key` in an adapter's file (its
/// module, `model.layers.0.mlp.experts`, under PEFT's `base_layer.`s)
/// adapts in a base holding `held` (names and shapes): of the module's
/// `[experts, p, q]` parameters `cfg` targets, in [`REGISTERED`]'s
/// order (others after, by name), the one with as many targeted after
/// it as `key` has `base_layer.`s. `None` for an adapter of a linear
/// layer.
pub(crate) fn parameter_of(
    key: &str,
    held: &HashMap<&str, &[i64]>,
    cfg: &LoraConfig,
) -> Option<String> {
    if cfg.target_parameters.is_empty() {
        return None;
    }
    let mut module = key;
    let mut depth = 0;
    while let Some(m) = module.strip_suffix(".base_layer") {
        module = m;
        depth += 1;
    }
    let mut targeted: Vec<&str> = (held.iter())
        .filter(|(_, shape)| shape.len() == 3)
        .filter_map(|(name, _)| name.strip_prefix(module)?.strip_prefix('.'))
        .filter(|p| !p.contains('.') && cfg.targets_parameter(&format!("{module}.{p}")))
        .collect();
    let rank = |p: &str| {
        REGISTERED
            .iter()
            .position(|r| *r == p)
            .unwrap_or(REGISTERED.len())
    };
    targeted.sort_by_key(|p| (rank(p), p.to_string()));
    let at = targeted.len().checked_sub(depth + 1)?;
    Some(format!("{module}.{}", targeted[at]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_experts_update_is_pefts_reshape_of_a_and_b() {
        // A [r E, p] as [E, r, p], B [q, r E] as [q, r, E]: expert e's
        // update [p, q] is s sum_r A[e r + j, i] B[o, j E + e].
        let (e, r, p, q, s) = (3, 2, 4, 5, 0.5);
        let a = Tensor::randn([r * e, p], (Kind::Float, tch::Device::Cpu));
        let b = Tensor::randn([q, r * e], (Kind::Float, tch::Device::Cpu));
        let d = delta(&a, &b, r, s);
        assert_eq!(d.size(), [e, p, q]);
        let adapter = ParamAdapter {
            a: a.shallow_clone(),
            b: b.shallow_clone(),
            experts: e,
            rank: r,
            scale: s,
        };
        let x = Tensor::randn([7, p], (Kind::Float, tch::Device::Cpu));
        let y = Tensor::randn([7, q], (Kind::Float, tch::Device::Cpu));
        for ex in 0..e {
            let mut want = Tensor::zeros([p, q], (Kind::Float, tch::Device::Cpu));
            for j in 0..r {
                let col = b.select(1, j * e + ex).unsqueeze(0);
                let row = a.select(0, ex * r + j).unsqueeze(1);
                want += row.matmul(&col) * s;
            }
            assert!(d.get(ex).allclose(&want, 1e-5, 1e-6, false), "expert {ex}");
            let right = adapter.right(ex, &x);
            assert!(right.allclose(&x.matmul(&want), 1e-5, 1e-5, false));
            let left = adapter.left(ex, &y);
            assert!(left.allclose(&y.matmul(&want.tr()), 1e-5, 1e-5, false));
        }
    }

    #[test]
    fn dbrxs_expert_rows_and_linear_matrices_are_refused_apart() {
        let cfg = LoraConfig {
            target_parameters: vec!["ffn.experts.mlp.w1".into()],
            ..LoraConfig::new(2, 8.0, &[])
        };
        let held = [
            ("transformer.blocks.0.ffn.experts.mlp.w1", 2),
            ("transformer.blocks.0.norm_attn_norm.attn.Wqkv.weight", 2),
        ];
        let err = check_matched(&cfg, held.iter().copied()).unwrap_err();
        assert!(
            err.to_string()
                .contains("no linear layer's matrix (DBRX's experts' rows)")
                && err.to_string().contains("PEFT cannot adapt these either"),
            "{err}"
        );
        let cfg = LoraConfig {
            target_parameters: vec!["Wqkv.weight".into()],
            ..cfg
        };
        let err = check_matched(&cfg, held.iter().copied()).unwrap_err();
        assert!(
            err.to_string()
                .contains("put a linear layer's module in target_modules"),
            "{err}"
        );
    }

    #[test]
    fn adapters_nest_as_pefts_and_a_merge_finds_their_parameters() {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let p = vs.root() / "model" / "layers" / 0 / "mlp" / "experts";
        let both = LoraConfig {
            target_parameters: vec!["mlp.experts.gate_up_proj".into(), "down_proj".into()],
            rank_pattern: vec![("down_proj".into(), 1)],
            ..LoraConfig::new(2, 4.0, &[])
        };
        let shapes = [("gate_up_proj", [3, 4, 6]), ("down_proj", [3, 3, 4])];
        let made = on_module(&p, &shapes, Some(&both));
        assert!(made.iter().all(Option::is_some));
        let mut names: Vec<(String, Vec<i64>)> = (vs.variables().into_iter())
            .map(|(n, t)| (n, t.size()))
            .collect();
        names.sort();
        let under = "model.layers.0.mlp.experts";
        assert_eq!(
            names,
            [
                (format!("{under}.base_layer.lora_A.weight"), vec![6, 4]),
                (format!("{under}.base_layer.lora_B.weight"), vec![6, 6]),
                (format!("{under}.lora_A.weight"), vec![3, 3]),
                (format!("{under}.lora_B.weight"), vec![4, 3]),
            ]
        );
        // A merge's way back, from the base's names and shapes.
        let (gate_up, down) = (
            format!("{under}.gate_up_proj"),
            format!("{under}.down_proj"),
        );
        let bias = format!("{under}.gate_up_proj_bias");
        let held: HashMap<&str, &[i64]> = [
            (gate_up.as_str(), &[3, 4, 6][..]),
            (down.as_str(), &[3, 3, 4]),
            (bias.as_str(), &[3, 6]),
        ]
        .into();
        let of = |key: &str, cfg: &LoraConfig| parameter_of(key, &held, cfg);
        assert_eq!(
            of(&format!("{under}.base_layer"), &both),
            Some(gate_up.clone())
        );
        assert_eq!(of(under, &both), Some(down.clone()));
        // One targeted: no nesting, its adapter on the module itself.
        let one = LoraConfig {
            target_parameters: vec!["gate_up_proj".into()],
            ..both.clone()
        };
        assert_eq!(of(under, &one), Some(gate_up.clone()));
        assert_eq!(of(&format!("{under}.base_layer"), &one), None);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let p = vs.root() / "model" / "layers" / 0 / "mlp" / "experts";
        let made = on_module(&p, &shapes, Some(&one));
        assert!(made[0].is_some() && made[1].is_none());
        assert!(vs
            .variables()
            .contains_key(&format!("{under}.lora_A.weight")));
        // A linear layer's adapter is no parameter's.
        assert_eq!(of("model.layers.0.self_attn.q_proj", &both), None);
    }

    #[test]
    fn what_pefts_adapters_on_parameters_refuse_is_refused() {
        let base = LoraConfig {
            target_parameters: vec!["gate_up_proj".into()],
            ..LoraConfig::new(2, 4.0, &[])
        };
        assert!(base.check("cfg").is_ok());
        for (bad, says) in [
            (
                LoraConfig {
                    use_dora: true,
                    ..base.clone()
                },
                "with use_dora",
            ),
            (
                LoraConfig {
                    lora_bias: true,
                    ..base.clone()
                },
                "with lora_bias",
            ),
            (
                LoraConfig {
                    fan_in_fan_out: true,
                    ..base.clone()
                },
                "with fan_in_fan_out",
            ),
            (
                LoraConfig {
                    target_parameters: vec![String::new()],
                    ..base.clone()
                },
                "holds an empty name",
            ),
            (
                LoraConfig {
                    target_parameters: vec![],
                    ..base.clone()
                },
                "target_modules []",
            ),
        ] {
            let err = bad.check("cfg").unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
        }
    }
}
