//! `ShardPlan::weights_on_first_rank_only`: ranks other than the first
//! give back their weights' memory as each block is wrapped, and the
//! engine gives them the first rank's values; and
//! `weights_on_disk_while_built`, under which the first rank gives its
//! back too, after writing them to a file the engine reads. Each rank of a run so made
//! must end with the bits of a run without it, frozen variables (whole
//! in the root, sharded in a unit at stage 3) included.

use crate::common;

use common::{built_on, config_zero, engine_of, freeze, on_ranks, train_losses, train_world};
use common::{BF16, GPT, SHARD_ALL, WORLD};
use tch::nn;
use zrt::gpt::Gpt;
use zrt::zero::{glue, ShardPlan};

/// Frozen: `wpe` stays whole in the root (the engine copies rank 0's
/// bytes into it), `h.1.fc` is a unit's frozen part at stage 3.
const FROZEN: &[&str] = &["wpe", "h.1.fc"];

/// How a run's ranks build the model.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Rule {
    /// `weights_on_first_rank_only`: the first rank holds the model.
    FirstRank,
    /// `weights_on_disk_while_built`: no rank holds it, the first writes
    /// it to a directory.
    Disk,
}

/// The GPT built on rank `rank` under `rule` (the first rank's file in
/// `dir`).
fn built_under(rule: Rule, rank: usize, dir: &std::path::Path) -> (nn::VarStore, ShardPlan, Gpt) {
    common::built_by(&GPT, Gpt::new, |vs, plan| match rule {
        Rule::FirstRank => plan.weights_on_first_rank_only(vs, rank).unwrap(),
        Rule::Disk => plan.weights_on_disk_while_built(vs, rank, dir).unwrap(),
    })
}

/// This process's open files under `dir`, with their sizes (a spill
/// still open shows as one whose name ends in " (deleted)").
fn open_files_under(dir: &std::path::Path) -> Vec<(String, u64)> {
    (std::fs::read_dir("/proc/self/fd").unwrap().flatten())
        .filter_map(|f| Some((std::fs::read_link(f.path()).ok()?, f.path())))
        .filter(|(l, _)| l.starts_with(dir))
        .map(|(l, fd)| {
            let bytes = std::fs::metadata(fd).map_or(0, |m| m.len());
            (l.display().to_string(), bytes)
        })
        .collect()
}

#[test]
fn ranks_but_the_first_hold_no_weights_until_the_engine_and_train_to_the_same_bits() {
    let steps = 3;
    for (stage, extra, zero) in [
        (0, "", ""),
        (2, "", ""),
        (3, "", SHARD_ALL),
        (3, BF16, SHARD_ALL),
    ] {
        let cfg = config_zero(stage, 1, 1.0, extra, zero);
        let (want_losses, want_params, _) = train_world(&cfg, FROZEN, steps);
        for rule in [Rule::FirstRank, Rule::Disk] {
            let what = format!("stage {stage} {extra} {rule:?}");
            let dir = common::scratch(&format!("spill-{stage}-{}", extra.len()));
            let ranks = on_ranks(WORLD, |r| {
                let (vs, plan, gpt) = built_under(rule, r.rank(), &dir);
                // Every variable of the GPT is made before its last
                // wrapped module (the head), so the released ranks hold
                // none of them.
                let held: Vec<(String, usize)> = (vs.variables().into_iter())
                    .map(|(n, t)| (n, glue::storage_nbytes(&t).unwrap()))
                    .collect();
                freeze(&vs, FROZEN);
                let e = engine_of(&vs, &plan, &cfg, &r);
                let losses = train_losses(&gpt, &e, r.rank(), steps);
                (held, losses, e.gathered_params().unwrap())
            });
            // The spill had no name in the directory, and the engine's
            // build closed it.
            assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "{what}");
            assert_eq!(open_files_under(&dir), [], "{what}");
            let _ = std::fs::remove_dir_all(&dir);
            for (rank, (held, losses, params)) in ranks.into_iter().enumerate() {
                assert!(held.len() > 10, "{what}: {held:?}");
                for (name, bytes) in held {
                    match (rank, rule) {
                        (0, Rule::FirstRank) => {
                            assert!(bytes > 0, "{what}: rank 0's `{name}` was released")
                        }
                        _ => assert_eq!(bytes, 0, "{what}: rank {rank} holds `{name}`"),
                    }
                }
                // The losses are this rank's own micro-batches': rank
                // 0's are the reference's.
                if rank == 0 {
                    assert_eq!(losses, want_losses, "{what}");
                }
                let what = format!("{what}: rank {rank} against the run without it");
                common::assert_bits(&what, &params, &want_params);
            }
        }
    }
}

#[test]
fn the_first_rank_spills_while_it_builds_and_the_build_closes_the_file() {
    // Mid-build: rank 0's released variables are in the (unnamed) file,
    // open; once its engine is built the file is closed.
    let cfg = config_zero(3, 1, 0.0, "", SHARD_ALL);
    let dir = common::scratch("spill-open");
    on_ranks(WORLD, |r| {
        let (vs, plan, _gpt) = built_under(Rule::Disk, r.rank(), &dir);
        if r.rank() == 0 {
            let open = open_files_under(&dir);
            assert_eq!(open.len(), 1, "{open:?}");
            let (file, bytes) = &open[0];
            assert!(file.ends_with(" (deleted)"), "{open:?}");
            // Every variable's bytes, the model as made.
            let model: u64 = (vs.variables().values())
                .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
                .sum();
            assert_eq!(*bytes, model);
        }
        let _e = engine_of(&vs, &plan, &cfg, &r);
        // The other ranks never opened one; rank 0's build closed its.
        if r.rank() == 0 {
            assert_eq!(open_files_under(&dir), []);
        }
    });
    // A directory the first rank cannot write to is refused there,
    // naming it; the other ranks never touch it.
    let missing = dir.join("not-made");
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let plan = ShardPlan::new();
    let err = plan
        .weights_on_disk_while_built(&vs, 0, &missing)
        .unwrap_err();
    let err = err.to_string();
    assert!(
        err.contains("weights_on_disk_while_built: cannot make a file in"),
        "{err}"
    );
    assert!(err.contains("not-made"), "{err}");
    plan.weights_on_disk_while_built(&vs, 1, &missing).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn under_hybrid_sharding_world_rank_0_gives_every_replica_its_weights() {
    // 4 ranks, shard groups of 2: world rank 2 is its shard group's rank
    // 0 but not the world's, and takes rank 0's values across replicas.
    let cfg = config_zero(
        3,
        1,
        1.0,
        "",
        &format!(r#"{SHARD_ALL} "mics_shard_size": 2,"#),
    );
    let (want_losses, want_params, _) = common::train_grouped(4, &cfg, 2);
    let dir = common::scratch("spill-hybrid");
    for rule in [Rule::FirstRank, Rule::Disk] {
        let ranks = on_ranks(4, |mut r| {
            let (vs, plan, gpt) = built_under(rule, r.rank(), &dir);
            let hints = zrt::zero::AutoHints::default();
            let e = zrt::zero::Engine::from_config(&vs, &plan, &cfg, &mut r, &hints).unwrap();
            let losses = train_losses(&gpt, &e, r.rank() % WORLD, 2);
            (losses, e.gathered_params().unwrap())
        });
        for (rank, (losses, params)) in ranks.into_iter().enumerate() {
            if rank == 0 {
                assert_eq!(losses, want_losses, "{rule:?}");
            }
            assert!(
                params == want_params,
                "{rule:?}: rank {rank} differs from the run without the rule"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_rule_is_refused_once_an_engine_holds_the_plan() {
    let cfg = config_zero(3, 1, 0.0, "", SHARD_ALL);
    on_ranks(WORLD, |r| {
        let (vs, plan, _gpt) = common::model();
        let _e = engine_of(&vs, &plan, &cfg, &r);
        let err = plan.weights_on_first_rank_only(&vs, r.rank()).unwrap_err();
        let err = err.to_string();
        assert!(
            err.contains("weights_on_first_rank_only was called after the engine was built"),
            "{err}"
        );
    });
}

#[test]
fn pretrained_weights_loaded_on_rank_0_alone_reach_every_rank() {
    // The recipe the rule's docs give: the other ranks release their
    // weights, rank 0 alone loads the file, the engine spreads it.
    let cfg = config_zero(3, 1, 1.0, "", SHARD_ALL);
    let file = common::scratch("first-rank-load").join("model.safetensors");
    on_ranks(WORLD, |r| {
        let (vs, plan, gpt) = common::model();
        let e = engine_of(&vs, &plan, &cfg, &r);
        train_losses(&gpt, &e, r.rank(), 2);
        e.save_16bit_model(&file).unwrap();
    });
    let want: Vec<(String, tch::Tensor)> = tch::Tensor::read_safetensors(&file).unwrap();
    let ranks = on_ranks(WORLD, |r| {
        let (mut vs, plan, _gpt) = built_on(&GPT, Gpt::new, Some(r.rank()));
        if r.rank() == 0 {
            vs.load(&file).unwrap();
        }
        let e = engine_of(&vs, &plan, &cfg, &r);
        e.gathered_params().unwrap()
    });
    let _ = std::fs::remove_dir_all(file.parent().unwrap());
    for (rank, params) in ranks.into_iter().enumerate() {
        assert_eq!(params.len(), want.len(), "rank {rank}");
        for (name, v) in params {
            let (_, t) = want.iter().find(|(n, _)| *n == name).unwrap();
            let w = Vec::<f32>::try_from(&t.flatten(0, -1)).unwrap();
            assert!(v == w, "rank {rank}'s `{name}` is not the file's");
        }
    }
}

#[test]
fn a_frozen_dtype_no_checkpoint_holds_is_refused_before_anything_is_laid_out() {
    // Stage 3 frees each unit as it lays it out: a refusal after that
    // would leave a model the next build cannot read. So the build checks
    // the frozen variables' dtypes first, and a mended model builds.
    let cfg = config_zero(3, 1, 0.0, "", SHARD_ALL);
    let (vs, plan, gpt) = common::model();
    let z = tch::Tensor::zeros([2], (tch::Kind::ComplexFloat, tch::Device::Cpu));
    let mut odd = vs.root().add("odd", z, false);
    let err = common::solo_engine(&vs, &plan, &cfg)
        .err()
        .expect("refused");
    let err = err.to_string();
    assert!(
        err.contains("frozen variable `odd` is ComplexFloat, which checkpoints cannot hold"),
        "{err}"
    );
    for (name, t) in vs.variables() {
        assert!(glue::storage_nbytes(&t).unwrap() > 0, "`{name}` was freed");
    }
    odd.set_data(&tch::Tensor::zeros(
        [2],
        (tch::Kind::Float, tch::Device::Cpu),
    ));
    let e = common::solo_engine(&vs, &plan, &cfg).unwrap();
    train_losses(&gpt, &e, 0, 1);
}
