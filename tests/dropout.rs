//! Dropout in the Hugging Face models: off until `set_training(true)`,
//! and then the masks `transformers` draws from the same seed, in its
//! forward and through training, activations recomputed or not. Here,
//! not in the integration binary, because it seeds libtorch's
//! process-global generator and draws from it (see this binary's doc).

use std::path::Path;

use tch::nn::VarStore;
use tch::Tensor;
use zrt::hf::{HfModel, HfOptions};
use zrt::zero::ShardPlan;

use crate::common::{self, config_zero, scratch, solo_engine, LR, MICRO, SHARD_ALL, WD};

const STEPS: i64 = 3;
const SEQ: i64 = 16;

/// Writes `transformers`' seeded model (`import` gives the config class
/// as `C` and the model's as `M`, `args` the config's arguments) into
/// `dir/hf`, and into `dir/reference.safetensors` a batch of tokens, its
/// logits in evaluation, its logits in training from seed 7, and the
/// losses of AdamW's steps on it in training from seed 8; with NEFTune's
/// hook on the input embeddings at `neftune` (0: none).
fn reference(import: &str, args: &str, dir: &Path, neftune: f64) {
    let model = common::hf_seeded_model(import, args, dir, "");
    common::python(&format!(
        r#"{model}
if {neftune} > 0:
    from transformers.trainer_utils import neftune_post_forward_hook
    emb = m.get_input_embeddings()
    emb.neftune_noise_alpha = {neftune}
    emb.register_forward_hook(neftune_post_forward_hook)
tokens = torch.randint(0, 96, ({MICRO}, {SEQ}))
m.eval()
with torch.no_grad():
    evaluated = m(tokens).logits
m.train()
torch.manual_seed(7)
with torch.no_grad():
    dropped = m(tokens).logits
opt = torch.optim.AdamW(m.parameters(), lr={LR}, weight_decay={WD})
torch.manual_seed(8)
losses = []
for s in range({STEPS}):
    loss = m(tokens, labels=tokens).loss
    losses.append(loss.detach())
    opt.zero_grad()
    loss.backward()
    opt.step()
save_file({{"tokens": tokens, "evaluated": evaluated, "dropped": dropped,
           "losses": torch.stack(losses).double()}}, "{dir}/reference.safetensors")
"#,
        dir = dir.display()
    ));
}

/// The checkpoint `transformers` writes from `args`, in zrt on one rank
/// at stage 0 and at stage 3 recomputing every block: its logits in
/// evaluation and in training, and its training losses, against
/// `transformers`' within `tol` (relative to the logits' scale, the
/// losses'); with NEFTune at `neftune` (0: none) on both sides.
fn dropout_parity(name: &str, import: &str, args: &str, tol: f64) {
    parity_with(name, import, args, tol, 0.0)
}

/// [`dropout_parity`] with NEFTune at `neftune`.
fn parity_with(name: &str, import: &str, args: &str, tol: f64, neftune: f64) {
    let dir = scratch(&format!("dropout-{name}-{neftune}"));
    reference(import, args, &dir, neftune);
    let want = Tensor::read_safetensors(dir.join("reference.safetensors")).unwrap();
    let get = |n: &str| want.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
    let (tokens, losses) = (get("tokens"), get("losses"));
    let close = |what: &str, got: &Tensor, want: &Tensor| {
        let diff = (got - want).abs().max().double_value(&[]);
        let scale = want.abs().max().double_value(&[]).max(1.0);
        assert!(diff <= tol * scale, "{what}: differs by {diff}");
    };
    for (stage, recompute) in [(0u8, false), (3, true)] {
        let what = format!("{name} at stage {stage}, recompute {recompute}");
        // Seeded and drawn from alone (see the module's doc).
        let _serial = common::serial();
        let vs = VarStore::new(tch::Device::Cpu);
        let plan = ShardPlan::new();
        let options = HfOptions {
            checkpoint_activations: recompute,
            ..Default::default()
        };
        let (model, _) =
            HfModel::from_pretrained_with(&vs, &plan, dir.join("hf"), &options).unwrap();
        let ds = config_zero(stage, 1, 0.0, "", SHARD_ALL);
        let e = solo_engine(&vs, &plan, &ds).unwrap();
        let evaluated = tch::no_grad(|| model.forward(&tokens));
        close(&format!("{what}: evaluated"), &evaluated, &get("evaluated"));
        if neftune > 0.0 {
            for bad in [-1.0, f64::NAN, f64::INFINITY] {
                let e = model.set_neftune_alpha(bad).unwrap_err().to_string();
                let says = format!("NEFTune's alpha is {bad}: give a number of 0 or more");
                assert!(e.contains(&says), "{e}");
            }
        }
        model.set_neftune_alpha(neftune).unwrap();
        model.set_training(true);
        tch::manual_seed(7);
        let dropped = tch::no_grad(|| model.forward(&tokens));
        close(&format!("{what}: training"), &dropped, &get("dropped"));
        let moved = (&dropped - &evaluated).abs().max().double_value(&[]);
        assert!(moved > 1e-2, "{what}: no dropout nor noise ({moved})");
        tch::manual_seed(8);
        for s in 0..STEPS {
            let loss = model.loss(&tokens);
            e.backward(&loss).unwrap();
            e.step().unwrap();
            let (got, want) = (loss.double_value(&[]), losses.double_value(&[s]));
            assert!(
                (got - want).abs() <= tol * want.abs(),
                "{what}, step {s}: loss {got}, transformers {want}"
            );
        }
        model.set_training(false);
        let again = tch::no_grad(|| model.forward(&tokens));
        let trained = (&again - &evaluated).abs().max().double_value(&[]);
        assert!(
            trained > 1e-3,
            "{what}: the steps moved nothing ({trained})"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gpt2_drops_out_as_transformers_does_once_training() {
    dropout_parity(
        "gpt2",
        "from transformers import GPT2Config as C, GPT2LMHeadModel as M",
        "vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.1, embd_pdrop=0.2, attn_pdrop=0.3",
        1e-5,
    );
}

#[test]
fn llama_drops_attention_out_as_transformers_does_once_training() {
    dropout_parity(
        "llama",
        "from transformers import LlamaConfig as C, LlamaForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.25",
        1e-5,
    );
}

/// RecurrentGemma's one dropout, the attention weights' (its class's
/// SDPA with its additive mask), in its attending layer between
/// recurrent ones whose draws there are none of.
#[test]
fn recurrent_gemma_drops_attention_out_as_transformers_does_once_training() {
    dropout_parity(
        "recurrent-gemma",
        common::RECURRENT_GEMMA,
        "vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, lru_width=48, conv1d_width=3, attention_window_size=32, attention_dropout=0.25, use_cache=False",
        1e-5,
    );
}

/// LongCat-Flash's one dropout, the attention weights' (its class's
/// SDPA), drawn in each of a layer's two sublayers in turn, its experts
/// drawing nothing between them.
#[test]
fn longcat_flash_drops_both_sublayers_attention_out_as_transformers_does_once_training() {
    dropout_parity(
        "longcat-flash",
        "from transformers import LongcatFlashConfig as C, LongcatFlashForCausalLM as M",
        "vocab_size=96, hidden_size=48, ffn_hidden_size=96, num_layers=2, num_attention_heads=4, max_position_embeddings=64, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, head_dim=8, v_head_dim=10, n_routed_experts=4, zero_expert_num=1, moe_topk=3, expert_ffn_hidden_size=16, routed_scaling_factor=1.5, attention_dropout=0.25",
        1e-5,
    );
}

/// GPT-NeoX-Japanese's dropouts: the attention weights' (its eager
/// attention's), the attention's output (the last layer's with its bias
/// added first) and the MLP's, at `hidden_dropout`.
#[test]
fn gpt_neox_japanese_drops_attention_and_both_sublayers_out_as_transformers_does() {
    dropout_parity(
        "gpt-neox-japanese",
        "from transformers import GPTNeoXJapaneseConfig as C, GPTNeoXJapaneseForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_multiple_size=2.5, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5, attention_dropout=0.25, hidden_dropout=0.1",
        1e-5,
    );
}

/// CTRL's dropouts: the embeddings' with their positions
/// (`embd_pdrop`), and each sublayer's output (`resid_pdrop`); none on
/// the attention's weights.
#[test]
fn ctrl_drops_embeddings_and_sublayers_out_as_transformers_does_once_training() {
    dropout_parity(
        "ctrl",
        "from transformers import CTRLConfig as C, CTRLLMHeadModel as M",
        "vocab_size=96, n_embd=64, dff=128, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.1, embd_pdrop=0.2",
        1e-5,
    );
}

/// OpenAI GPT's dropouts: the embeddings' with their positions
/// (`embd_pdrop`), the attention weights' (`attn_pdrop`, its eager
/// attention's), and each sublayer's output (`resid_pdrop`) before the
/// sum its norm takes.
#[test]
fn openai_gpt_drops_embeddings_attention_and_sublayers_out_as_transformers_does_once_training() {
    dropout_parity(
        "openai-gpt",
        "from transformers import OpenAIGPTConfig as C, OpenAIGPTLMHeadModel as M",
        "vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.1, embd_pdrop=0.2, attn_pdrop=0.15",
        1e-5,
    );
}

/// ModernBERT-decoder's dropouts: the normalised embeddings'
/// (`embedding_dropout`), and the attention's weights and output, both
/// at `attention_dropout` (its MLP's output is not dropped out; dropout
/// inside it is refused).
#[test]
fn modernbert_decoder_drops_embeddings_and_attention_out_as_transformers_does_once_training() {
    dropout_parity(
        "modernbert-decoder",
        "from transformers import ModernBertDecoderConfig as C, ModernBertDecoderForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64, embedding_dropout=0.2, attention_dropout=0.15, pad_token_id=95, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2",
        1e-5,
    );
}

/// Doge's dropouts: the attention's weights (`attention_dropout`,
/// under its dynamic mask) and each sublayer's output (`hidden_dropout`)
/// before its weighted residual joins it.
#[test]
fn doge_drops_attention_and_both_sublayers_out_as_transformers_does_once_training() {
    dropout_parity(
        "doge",
        common::DOGE,
        "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, keep_window_size=6, hidden_dropout=0.1, attention_dropout=0.15",
        1e-5,
    );
}

/// Aria's one dropout, the attention weights' (its class's SDPA),
/// drawn before its experts, which draw nothing.
#[test]
fn aria_text_drops_attention_out_as_transformers_does_once_training() {
    dropout_parity(
        "aria-text",
        "from transformers import AriaTextConfig as C, AriaTextForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, moe_num_experts=4, moe_topk=2, attention_dropout=0.25",
        1e-5,
    );
}

#[test]
fn phi3_drops_sublayer_outputs_out_as_transformers_does_once_training() {
    dropout_parity(
        "phi3",
        "from transformers import Phi3Config as C, Phi3ForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=64, pad_token_id=95, resid_pdrop=0.2, attention_dropout=0.25",
        1e-5,
    );
}

#[test]
fn gemma2_drops_eager_attention_out_as_transformers_eager_does_once_training() {
    dropout_parity(
        "gemma2",
        "from transformers import Gemma2Config as C, Gemma2ForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=5, attn_logit_softcapping=1.5, final_logit_softcapping=2.0, attention_dropout=0.25, attn_implementation='eager'",
        1e-5,
    );
}

#[test]
fn gpt_neox_drops_embeddings_attention_and_both_sublayers_out_as_transformers_does() {
    for (name, extra) in [
        ("gpt-neox", ""),
        ("gpt-neox-sequential", ", use_parallel_residual=False"),
    ] {
        dropout_parity(
            name,
            "from transformers import GPTNeoXConfig as C, GPTNeoXForCausalLM as M",
            &format!("vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, hidden_dropout=0.2, attention_dropout=0.25{extra}"),
            1e-5,
        );
    }
}

/// DBRX's every draw in training: the embeddings' dropout, the
/// attention weights', each sublayer's output's, and the router's
/// jitter, which scales the experts' input too (`transformers` scales
/// it in place).
#[test]
fn dbrx_jitters_its_routers_and_drops_out_as_transformers_does() {
    dropout_parity(
        "dbrx",
        "from transformers import DbrxConfig as C, DbrxForCausalLM as M",
        "vocab_size=96, d_model=64, n_heads=4, n_layers=2, max_seq_len=64, resid_pdrop=0.1, emb_pdrop=0.2, attn_config={'kv_n_heads': 2, 'attn_pdrop': 0.25, 'clip_qkv': 8.0}, ffn_config={'ffn_hidden_size': 32, 'moe_num_experts': 4, 'moe_top_k': 2, 'moe_jitter_eps': 0.2}",
        1e-5,
    );
}

/// Mixtral's and MiniMax's router jitter in training (`transformers`
/// scales the MoE block's input in place: the router's and the experts'
/// input alike, and MiniMax's residual, that same tensor), Mixtral's
/// beside its attention's dropout.
#[test]
fn mixtral_and_minimax_jitter_their_routers_as_transformers_does() {
    dropout_parity(
        "mixtral-jitter",
        "from transformers import MixtralConfig as C, MixtralForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.2, attention_dropout=0.25",
        1e-5,
    );
    dropout_parity(
        "minimax-jitter",
        "from transformers import MiniMaxConfig as C, MiniMaxForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2, block_size=5, layer_types=['linear_attention', 'full_attention', 'linear_attention', 'linear_attention'], router_jitter_noise=0.2",
        1e-5,
    );
}

/// PhiMoE in training: its input jitter, sparsemixer's Gumbel draws of
/// each token's two experts and Heun's draws, and the gradient its own
/// backward sends the router, through three AdamW steps; attention
/// dropout beside them. (The routing is discontinuous: zrt's AdamW
/// rounds a few ulps from torch's, and under other seeds that moved one
/// token's route at the third step. A mutation taking the weights'
/// plain gradient moved the second step's loss by 2e-3.)
#[test]
fn phimoe_draws_its_experts_by_sparse_mixer_as_transformers_does_in_training() {
    dropout_parity(
        "phimoe",
        common::PHIMOE,
        "vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, attention_bias=True, router_jitter_noise=0.3, input_jitter_noise=0.15, attention_dropout=0.25",
        1e-5,
    );
    // With the routers' load-balancing loss, which counts the top 2 of
    // the logits' softmax, not the experts sparsemixer drew. Experts of
    // 48: at 32 an expert took no token in the first two steps, which
    // torch's AdamW then skips and zrt's moves (docs/choices.md).
    dropout_parity(
        "phimoe-balanced",
        common::PHIMOE,
        "vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, attention_bias=True, router_jitter_noise=0.3, input_jitter_noise=0.15, attention_dropout=0.25, output_router_logits=True, router_aux_loss_coef=0.1",
        1e-5,
    );
}

/// Falcon's two ways: parallel layers drop the sum of the attention's
/// and the MLP's outputs out once (`hidden_dropout`); sequential ones
/// drop the attention's output at `attention_dropout` (never the
/// weights of its rotary attention; Falcon-RW's ALiBi attention's too)
/// and the MLP's at `hidden_dropout`.
#[test]
fn falcon_drops_its_sublayer_outputs_out_as_transformers_does() {
    for (name, layout) in [
        (
            "falcon-parallel",
            "new_decoder_architecture=True, num_kv_heads=2",
        ),
        (
            "falcon-sequential",
            "multi_query=False, parallel_attn=False",
        ),
        // Falcon-RW's ALiBi attention drops its weights out too.
        (
            "falcon-rw",
            "multi_query=False, parallel_attn=False, alibi=True",
        ),
    ] {
        dropout_parity(
            name,
            "from transformers import FalconConfig as C, FalconForCausalLM as M",
            &format!("vocab_size=96, hidden_size=64, ffn_hidden_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, hidden_dropout=0.2, attention_dropout=0.3, {layout}"),
            1e-5,
        );
    }
}

/// GPT-J's embeddings, attention weights (its eager attention's) and
/// both side-by-side sublayers' outputs.
#[test]
fn gptj_drops_embeddings_attention_and_sublayers_out_as_transformers_does() {
    dropout_parity(
        "gptj",
        "from transformers import GPTJConfig as C, GPTJForCausalLM as M",
        "vocab_size=96, n_embd=64, n_head=4, n_layer=2, n_positions=64, rotary_dim=8, n_inner=128, embd_pdrop=0.2, attn_pdrop=0.25, resid_pdrop=0.1",
        1e-5,
    );
}

/// GPT-BigCode's dropouts at its class's 0.1: the embeddings' (after
/// the learned positions join them), the attention weights', both
/// sublayers' outputs.
#[test]
fn gpt_bigcode_drops_embeddings_attention_and_sublayers_out_as_transformers_does() {
    dropout_parity(
        "gpt-bigcode",
        "from transformers import GPTBigCodeConfig as C, GPTBigCodeForCausalLM as M",
        "vocab_size=96, n_embd=64, n_head=4, n_layer=2, n_positions=64, n_inner=128",
        1e-5,
    );
}

/// OPT's dropouts: its `dropout` (0.1 by default) on both sublayers'
/// outputs, and the attention weights'; OPT-350m's layout too.
#[test]
fn opt_drops_attention_and_sublayers_out_as_transformers_does() {
    dropout_parity(
        "opt",
        "from transformers import OPTConfig as C, OPTForCausalLM as M",
        "vocab_size=96, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, attention_dropout=0.25",
        1e-5,
    ); // OPT-350m's layout: the same dropouts before each residual sum
       // its post-norm layers normalise.
    dropout_parity(
        "opt-350m",
        "from transformers import OPTConfig as C, OPTForCausalLM as M",
        "vocab_size=96, hidden_size=64, word_embed_proj_dim=32, do_layer_norm_before=False, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, attention_dropout=0.25",
        1e-5,
    );
}

/// GPT-Neo's dropouts: the embeddings' (after the positions join), the
/// attention weights' (its eager attention's, on its local layer too),
/// both sublayers' outputs. To 5e-5: its attention scores are not
/// scaled down, and on an Intel Xeon one CI run's logits in evaluation
/// ended 2.0e-5 (relative) from `transformers`' (the next run's within
/// 1e-5; on the AMD EPYC always within).
#[test]
fn gpt_neo_drops_embeddings_attention_and_sublayers_out_as_transformers_does() {
    dropout_parity(
        "gpt-neo",
        "from transformers import GPTNeoConfig as C, GPTNeoForCausalLM as M",
        "vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=64, intermediate_size=128, attention_types=[[['global', 'local'], 1]], window_size=5, embed_dropout=0.2, attention_dropout=0.25, resid_dropout=0.1",
        5e-5,
    );
}

/// MPT's one rate (`attn_pdrop`) on its ALiBi attention's weights and
/// both sublayers' outputs.
#[test]
fn mpt_drops_attention_and_sublayers_out_at_its_one_rate_as_transformers_does() {
    dropout_parity(
        "mpt",
        "from transformers import MptConfig as C, MptForCausalLM as M",
        "vocab_size=96, d_model=96, n_heads=6, n_layers=2, max_seq_len=64, attn_config={'attn_pdrop': 0.2}",
        1e-5,
    );
}

/// BLOOM's dropouts: its ALiBi attention's weights and both sublayers'
/// outputs (`hidden_dropout`).
#[test]
fn bloom_drops_attention_and_sublayers_out_as_transformers_does() {
    dropout_parity(
        "bloom",
        "from transformers import BloomConfig as C, BloomForCausalLM as M",
        "vocab_size=96, hidden_size=96, n_layer=2, n_head=6, hidden_dropout=0.1, attention_dropout=0.25",
        1e-5,
    );
}

/// BioGPT's dropouts: the embeddings' (after the positions join), the
/// attention weights' and both sublayers' outputs, LayerDrop's draws
/// taken.
#[test]
fn biogpt_drops_embeddings_attention_and_sublayers_out_as_transformers_does() {
    dropout_parity(
        "biogpt",
        "from transformers import BioGptConfig as C, BioGptForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.25",
        1e-5,
    );
}

/// XGLM's dropouts: its one `dropout` on the embeddings (after the
/// sinusoidal positions join) and both sublayers' outputs, the
/// attention weights', LayerDrop's draws taken.
#[test]
fn xglm_drops_embeddings_attention_and_sublayers_out_as_transformers_does() {
    dropout_parity(
        "xglm",
        "from transformers import XGLMConfig as C, XGLMForCausalLM as M",
        "vocab_size=96, d_model=64, ffn_dim=128, num_layers=2, attention_heads=4, max_position_embeddings=64, dropout=0.1, attention_dropout=0.25",
        1e-5,
    );
}

/// Persimmon's dropouts: its attention's weights and its MLP's output
/// (`hidden_dropout`; the attention's output is not dropped out).
#[test]
fn persimmon_drops_attention_and_mlp_out_as_transformers_does() {
    dropout_parity(
        "persimmon",
        "from transformers import PersimmonConfig as C, PersimmonForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, hidden_dropout=0.1, attention_dropout=0.25",
        1e-5,
    );
}

#[test]
fn phi_drops_embeddings_attention_and_sublayers_out_as_transformers_does() {
    dropout_parity(
        "phi",
        "from transformers import PhiConfig as C, PhiForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, embd_pdrop=0.2, resid_pdrop=0.1, attention_dropout=0.25",
        1e-5,
    );
}

/// NEFTune (`HfModel::set_neftune_alpha`): seeded alike, a training
/// forward's logits and three AdamW steps' losses are `transformers`'
/// with its `neftune_post_forward_hook` on the input embeddings (alpha
/// 5), at stage 0 and at stage 3 recomputing every block, to 1e-5;
/// evaluation draws no noise (its logits before training are the plain
/// model's). GPT-2 (the token embedding's rows, not the positions'),
/// GPT-NeoX, Phi, Llama, Gemma (the noise before the width's root scales
/// it), Gemma 3 (after: its embedding module scales) and Granite
/// (before its multiplier). A negative or non-finite alpha is refused.
#[test]
fn neftune_noises_the_embeddings_as_transformers_hook_does_in_training() {
    for (name, import, args) in [
        ("gpt2", "from transformers import GPT2Config as C, GPT2LMHeadModel as M",
         "vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0"),
        ("gpt-neox", "from transformers import GPTNeoXConfig as C, GPTNeoXForCausalLM as M",
         "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64"),
        ("phi", "from transformers import PhiConfig as C, PhiForCausalLM as M",
         "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64"),
        ("llama", "from transformers import LlamaConfig as C, LlamaForCausalLM as M",
         "vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64"),
        ("gemma", "from transformers import GemmaConfig as C, GemmaForCausalLM as M",
         "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64"),
        ("gemma3", "from transformers import Gemma3TextConfig as C, Gemma3ForCausalLM as M",
         "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=5, query_pre_attn_scalar=24"),
        ("granite", "from transformers import GraniteConfig as C, GraniteForCausalLM as M",
         "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0"),
    ] {
        parity_with(name, import, args, 1e-5, 5.0);
    }
}

/// `HfModel::sample` draws with a generator of its own: libtorch's,
/// which the dropout masks come from, is where it was (a sample between
/// training steps leaves the run's masks as they were).
#[test]
fn sampling_leaves_libtorchs_generator_as_it_was() {
    let dir = scratch("dropout-sampling");
    common::write_seeded_model("from transformers import LlamaConfig as C, LlamaForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64", &dir);
    let _serial = common::serial();
    let vs = VarStore::new(tch::Device::Cpu);
    let plan = ShardPlan::new();
    let (model, _) = HfModel::from_pretrained(&vs, &plan, dir.join("hf")).unwrap();
    let _e = solo_engine(&vs, &plan, &config_zero(0, 1, 0.0, "", SHARD_ALL)).unwrap();
    let draw = |sample: bool| {
        tch::manual_seed(11);
        if sample {
            let s = zrt::generate::Sampling::default();
            let new = model.sample(&[1, 2, 3], 8, &[], &s).unwrap();
            assert_eq!(new.len(), 8);
        }
        Vec::<f32>::try_from(Tensor::rand([16], (tch::Kind::Float, tch::Device::Cpu))).unwrap()
    };
    assert_eq!(draw(true), draw(false));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cohere_drops_attention_weights_out_as_transformers_does() {
    dropout_parity(
        "cohere",
        "from transformers import CohereConfig as C, CohereForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.25",
        1e-5,
    );
}

/// Cohere 2: its windowed layers' weights dropped within the window.
#[test]
fn cohere2_drops_windowed_and_global_attention_weights_out_as_transformers_does() {
    dropout_parity(
        "cohere2",
        "from transformers import Cohere2Config as C, Cohere2ForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=5, sliding_window_pattern=2, attention_dropout=0.25",
        1e-5,
    );
}

#[test]
fn stablelm_drops_attention_weights_and_the_mlps_output_out_as_transformers_does() {
    // `hidden_dropout` drops the MLP's output, not the attention's, in
    // sequential layers and in StableLM 2 12B's parallel ones.
    let args = "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, hidden_dropout=0.2, attention_dropout=0.25";
    dropout_parity("stablelm", common::STABLELM, args, 1e-5);
    let twelve = format!("{args}, qk_layernorm=True, use_parallel_residual=True");
    dropout_parity("stablelm-12b", common::STABLELM, &twelve, 1e-5);
}

#[test]
fn starcoder2_drops_embeddings_attention_and_sublayers_out_as_transformers_does() {
    dropout_parity(
        "starcoder2",
        "from transformers import Starcoder2Config as C, Starcoder2ForCausalLM as M",
        "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, embedding_dropout=0.2, residual_dropout=0.1, attention_dropout=0.25",
        1e-5,
    );
}

/// Packed documents in training with attention dropout: the mask's one
/// call over the row (not a call per document, as without dropout), so
/// the weights dropped are the ones `transformers` drops from the same
/// seed given `position_ids` that restart at each document; its logits
/// to 1e-5. Rows cut differently, a sliding window shorter than a
/// document, through the fused kernel (Mistral's) and the soft-capped
/// eager attention (Gemma 2's).
#[test]
fn packed_documents_drop_attention_out_as_transformers_does() {
    for (name, import, args) in [
        ("mistral", "from transformers import MistralConfig as C, MistralForCausalLM as M",
         "vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=4, attention_dropout=0.25, attn_implementation='sdpa'"),
        ("gemma2", "from transformers import Gemma2Config as C, Gemma2ForCausalLM as M",
         "vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=5, attn_logit_softcapping=1.5, final_logit_softcapping=2.0, attention_dropout=0.25, attn_implementation='eager'"),
    ] {
        packed_dropout_parity(name, import, args);
    }
}

/// [`packed_documents_drop_attention_out_as_transformers_does`] for one
/// model.
fn packed_dropout_parity(name: &str, import: &str, args: &str) {
    let dir = scratch(&format!("dropout-packed-{name}"));
    let model = common::hf_seeded_model(import, args, &dir, "");
    common::python(&format!(
        r#"{model}
tokens = torch.randint(0, 96, ({MICRO}, {SEQ}))
positions = torch.cat([torch.cat([torch.arange(n) for n in cut]) for cut in ([5, 7, 4], [9, 7])]).view({MICRO}, {SEQ})
m.train()
torch.manual_seed(7)
with torch.no_grad():
    dropped = m(tokens, position_ids=positions, use_cache=False).logits
save_file({{"tokens": tokens, "positions": positions, "dropped": dropped}}, "{dir}/reference.safetensors")
"#,
        dir = dir.display()
    ));
    let want = Tensor::read_safetensors(dir.join("reference.safetensors")).unwrap();
    let get = |n: &str| want.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
    let _serial = common::serial();
    let vs = VarStore::new(tch::Device::Cpu);
    let plan = ShardPlan::new();
    let (model, _) = HfModel::from_pretrained(&vs, &plan, dir.join("hf")).unwrap();
    let _engine = solo_engine(&vs, &plan, &config_zero(3, 1, 0.0, "", SHARD_ALL)).unwrap();
    model.set_training(true);
    tch::manual_seed(7);
    let got = tch::no_grad(|| model.forward_packed(&get("tokens"), &get("positions"))).unwrap();
    let diff = (&got - get("dropped")).abs().max().double_value(&[]);
    assert!(diff < 1e-5, "{name}: differs from transformers' by {diff}");
    // The same forward with no dropout is another: some weights dropped.
    model.set_training(false);
    let plain = tch::no_grad(|| model.forward_packed(&get("tokens"), &get("positions"))).unwrap();
    let moved = (&plain - &got).abs().max().double_value(&[]);
    assert!(moved > 1e-2, "{name}: nothing dropped ({moved})");
    let _ = std::fs::remove_dir_all(&dir);
}
