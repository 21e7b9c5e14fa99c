//! Sparse gradients (`embedding(.., sparse = true)`): the engine adds the
//! looked-up rows straight into its flat gradient buffers, and training
//! with them gives what training with the dense gradient gives, at every
//! stage, tied to a head or not, in fp32 and bf16.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use zrt::zero::{Config, ShardPlan, ShardedModule};

use crate::common::{self, config_zero, engine_of, on_ranks, Params, BF16, SHARD_ALL};

const VOCAB: i64 = 40;
const WIDTH: i64 = 8;

/// A token embedding that is the head too when `tied`: ids are looked
/// up, hidden states get logits (zrt's tied embedding, one unit run at
/// both ends).
#[derive(Debug)]
struct Ends(nn::Embedding);

impl Module for Ends {
    fn forward(&self, x: &Tensor) -> Tensor {
        match x.is_floating_point() {
            true => x.matmul(&self.0.ws.tr()),
            false => self.0.forward(x),
        }
    }
}

/// The losses of `micro` micro-steps on 2 ranks (two a step), and the
/// parameters they end with: an embedding (its gradient sparse when
/// `sparse`), a linear, and the embedding again as the head when `tied`
/// (else a head of its own). Each rank's ids repeat tokens, which a
/// sparse gradient holds as separate rows until they are added.
fn trained(cfg: &Config, micro: i64, sparse: bool, tied: bool) -> (Vec<f64>, Params) {
    let ranks = on_ranks(2, |r| {
        let (vs, plan, ends, mid, head) = common::seeded(|| {
            let vs = nn::VarStore::new(tch::Device::Cpu);
            let plan = ShardPlan::new();
            let root = vs.root();
            let emb = nn::EmbeddingConfig {
                sparse,
                ..Default::default()
            };
            let ends = nn::embedding(&root / "ends", VOCAB, WIDTH, emb);
            let ends = ShardedModule::new(&plan, &(&root / "ends"), Ends(ends));
            let mid = common::linear_unit(&vs, &plan, "mid", WIDTH, WIDTH);
            let head = (!tied).then(|| common::linear_unit(&vs, &plan, "head", WIDTH, VOCAB));
            (vs, plan, ends, mid, head)
        });
        let e = engine_of(&vs, &plan, cfg, &r);
        let mut losses = Vec::new();
        for m in 0..micro {
            let first = r.rank() as i64 * 7 + m * 3;
            // 2 sequences of 6 ids, tokens repeating within each.
            let ids = Tensor::from_slice(&[
                first,
                first + 1,
                first,
                5,
                5,
                first + 2,
                9,
                first,
                9,
                first + 3,
                1,
                1,
            ])
            .remainder(VOCAB)
            .view([2, 6]);
            let h = mid.forward(&ends.forward(&ids)).tanh();
            let logits = match &head {
                Some(head) => head.forward(&h),
                None => ends.forward(&h),
            };
            let target = ids.roll([1], [1]);
            let loss = logits
                .to_kind(Kind::Float)
                .view([-1, VOCAB])
                .cross_entropy_for_logits(&target.view([-1]));
            losses.push(loss.double_value(&[]));
            e.backward(&loss).unwrap();
            assert_eq!(e.step().unwrap(), m % 2 == 1, "a step at each boundary");
        }
        (losses, e.gathered_params().unwrap())
    });
    ranks.into_iter().next().unwrap()
}

/// The largest difference between two runs' parameters, checking that
/// they hold the same names.
fn largest_difference(a: &Params, b: &Params) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        for (x, y) in va.iter().zip(vb) {
            worst = worst.max((x - y).abs());
        }
    }
    worst
}

#[test]
fn sparse_embedding_gradients_train_as_dense_ones_at_every_stage() {
    for stage in 0..=3u8 {
        for bf16 in [false, true] {
            for tied in [false, true] {
                let cfg = config_zero(stage, 2, 0.0, if bf16 { BF16 } else { "" }, SHARD_ALL);
                let dense = trained(&cfg, 6, false, tied);
                let sparse = trained(&cfg, 6, true, tied);
                let at = format!("stage {stage}, bf16 {bf16}, tied {tied}");
                let worst = largest_difference(&dense.1, &sparse.1);
                // The embedding trained: its rows moved from their start.
                let start = trained(&cfg, 0, true, tied);
                let moved = largest_difference(&start.1, &sparse.1);
                assert!(moved > 1e-3, "{at}: the embedding did not train ({moved})");
                // fp32: an untied embedding's rows are added in the order
                // a dense gradient adds them, so to the bit; tied, the head's
                // gradient is added to them in another order. bf16: the dense
                // gradient is summed in bf16, the sparse rows in fp32.
                let within = match (bf16, tied) {
                    (false, false) => 0.0,
                    (false, true) => 1e-6,
                    (true, _) => 1e-3,
                };
                assert!(worst <= within, "{at}: parameters differ by {worst}");
                for (d, s) in dense.0.iter().zip(&sparse.0) {
                    assert!(
                        (d - s).abs() <= within as f64 * d.abs(),
                        "{at}: losses {d} and {s}"
                    );
                }
            }
        }
    }
}
