"""Writes a 1.1B-parameter Llama of TinyLlama's shape (random weights,
bf16, in 1 GB shards) and random token files for the real-size run the
README's Benchmarks describe. Usage: python make_tinyllama.py DIR
[LAYERS] (about 5 GB of memory, 20 s; the files take 2.1 GB; LAYERS,
22 by default, makes a smaller model of the same width: 11 layers,
0.6B parameters, for the runs at stages 1 and 2 that 1.1B's state
would not fit beside on this machine)."""
import sys

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

out = sys.argv[1]
config = LlamaConfig(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=int(sys.argv[2]) if len(sys.argv) > 2 else 22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
torch.manual_seed(0)
model = LlamaForCausalLM(config).to(torch.bfloat16)
print("params", sum(p.numel() for p in model.parameters()))
model.save_pretrained(f"{out}/hf", max_shard_size="1GB")
rng = np.random.default_rng(0)
rng.integers(3, 32000, size=200000, dtype=np.uint16).tofile(f"{out}/train.bin")
rng.integers(3, 32000, size=20000, dtype=np.uint16).tofile(f"{out}/eval.bin")
