"""Peer for `zrt bench hf`: `transformers`' own model of a `config.json`,
trained step by step on the same tokens as zrt's, with PyTorch's fused
AdamW.

A long-lived process so zrt and the peer can be interleaved round by round
without paying for `import transformers` each time. It also writes the
checkpoint zrt loads, so both start from the same weights and the losses
they print show they did the same work. Protocol, one JSON object a line,
each starting with "@@zrt " (zrt passes any other line through to its
stderr):
  argv:    config.json, directory to write the checkpoint in, batch, seq,
           threads, and optionally LoRA's settings as JSON ({"r": R,
           "alpha": A, "targets": [...] or null for PEFT's default})
  start:   builds the model from the config (seed 0, fp32), writes it with
           `save_pretrained` (and, for a config with a
           `quantization_config`, reads it back with `from_pretrained`);
           with LoRA, wraps it with PEFT's `get_peft_model` and writes
           the adapters as drawn into `adapter/` beside the checkpoint,
           for zrt to start from; prints {"ready": true, "params": N
           (those that train), "attn_implementation": <str>,
           "transformers": <version>}
  request: {"steps": K}
  reply:   {"times": [seconds of each of K steps], "losses": [...],
            "parts": [[forward, backward, optimizer seconds] of each step],
            "peak_rss_bytes": the process's peak resident bytes so far}
           (a step: forward with labels = tokens, backward, AdamW step,
           gradients set to None)
"""
import json
import resource
import sys
import time

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

config_path, out, batch, seq, threads = sys.argv[1:6]
batch, seq, threads = int(batch), int(seq), int(threads)
lora = json.loads(sys.argv[6]) if len(sys.argv) > 6 else None
torch.set_num_threads(threads)
torch.manual_seed(0)
config = AutoConfig.from_pretrained(config_path)
# Doge's `sdpa` path passes its dynamic mask as the whole mask, dropping
# the causal one (a token sees the ones after it): its eager attention is
# the model zrt computes.
eager = {"attn_implementation": "eager"} if config.model_type == "doge" else {}
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **eager)
# transformers 4.57's `save_pretrained` refuses Zamba2's shared blocks
# (its tied-weight patterns miss their names): each tensor once, under
# its first name, which `from_pretrained` (and zrt) read.
shared = None
if config.model_type == "zamba2":
    seen, shared = set(), {}
    for k, v in model.state_dict().items():
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            shared[k] = v.detach().clone()
model.save_pretrained(out, state_dict=shared)
# A quantization_config (BitNet's AutoBitLinear in online mode, trained
# quantization-aware) is applied by `from_pretrained` alone: the model
# trained is the checkpoint read back, as a user's would be.
if getattr(config, "quantization_config", None) is not None:
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **eager)
if lora is not None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        model,
        LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=lora["targets"], lora_dropout=0.0),
    )
    model.save_pretrained(f"{out}/adapter")
model.train()
# The tokens zrt's side makes with the same formula: every step the same.
vocab = config.get_text_config().vocab_size
tokens = ((torch.arange(batch * seq) * 7919 + 13) % vocab).view(batch, seq)
trained = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(trained, lr=1e-4, weight_decay=0.0, fused=True)
# RecurrentGemma's RG-LRUs keep their last state, graph and all, for the
# next forward, whose backward then fails ("backward through the graph a
# second time"): forgotten before each step, which changes no number (a
# sequence's first token multiplies it by zero). Its config in
# bench/hf-configs turns `use_cache` off, without which its attention's
# keys and values get no gradient.
kept_states = [m for m in model.modules() if type(m).__name__ == "RecurrentGemmaRglru"]


def step():
    """One step's loss and its parts' seconds: forward, backward, optimizer."""
    for m in kept_states:
        m.recurrent_states = None
    t0 = time.perf_counter()
    loss = model(input_ids=tokens, labels=tokens).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    return loss.item(), [t1 - t0, t2 - t1, t3 - t2]


def reply(obj):
    print("@@zrt " + json.dumps(obj), flush=True)


reply(
    {
        "ready": True,
        "params": sum(p.numel() for p in trained),
        "attn_implementation": getattr(config, "_attn_implementation", None) or "eager",
        "transformers": transformers.__version__,
    }
)
for line in sys.stdin:
    req = json.loads(line)
    times, losses, parts = [], [], []
    for _ in range(req["steps"]):
        t = time.perf_counter()
        loss, part = step()
        times.append(time.perf_counter() - t)
        losses.append(loss)
        parts.append(part)
    # ru_maxrss is in KiB on Linux: this process's peak so far.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    reply({"times": times, "losses": losses, "parts": parts, "peak_rss_bytes": peak})
