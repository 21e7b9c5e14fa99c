"""Writes a model of a real model's shape (random weights, bf16, in 1 GB
shards) and random token files for the real-size runs the README's
Benchmarks describe. Usage: python make_model.py DIR [LAYERS] [SHAPE]

SHAPE is `tinyllama` (the default: a 1.1B-parameter Llama of TinyLlama's
shape, its 32000 words written as u16 ids; about 5 GB of memory, 20 s,
2.1 GB of files) or `qwen2.5-0.5b` (Qwen2.5-0.5B's: 494M parameters,
151936 words and the head tied, so the ids are u32: pass `--u32`).
LAYERS (the shape's own, 22 or 24, when it is `-` or not given) makes
a smaller model of the same width:
11 of TinyLlama's, 0.6B parameters, for the runs at stages 1 and 2 that
1.1B's state would not fit beside on this machine."""
import sys

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

out = sys.argv[1]
layers = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "-" else None
shape = sys.argv[3] if len(sys.argv) > 3 else "tinyllama"
if shape == "tinyllama":
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers or 22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    build, ids = LlamaForCausalLM, np.uint16
elif shape == "qwen2.5-0.5b":
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers or 24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-06,
        tie_word_embeddings=True,
        use_sliding_window=False,
    )
    build, ids = Qwen2ForCausalLM, np.uint32
else:
    sys.exit(f"unknown shape {shape!r}: tinyllama or qwen2.5-0.5b")
torch.manual_seed(0)
model = build(config).to(torch.bfloat16)
print("params", sum(p.numel() for p in model.parameters()))
model.save_pretrained(f"{out}/hf", max_shard_size="1GB")
rng = np.random.default_rng(0)
rng.integers(3, config.vocab_size, size=200000, dtype=ids).tofile(f"{out}/train.bin")
rng.integers(3, config.vocab_size, size=20000, dtype=ids).tofile(f"{out}/eval.bin")
