"""Peer for `zrt bench train`: the same GPT in PyTorch, trained with DDP,
FSDP2 (`fully_shard` per block, then the root) or DeepSpeed ZeRO, on CPU
with gloo, one thread per rank.

Started by zrt as WORLD_SIZE processes with the torchrun environment.
argv: mode size micro steps [freeze_mlp [checkpoint [layerdrop [same [mlp_drop]]]]], where mode is one of
ddp, fsdp2_zero3, fsdp2_zero2, deepspeed_zero1, deepspeed_zero2,
deepspeed_zero3; freeze_mlp 1 freezes every block's fc and out weights
(the optimizer then holds the rest); checkpoint 1 recomputes every block's
activations in backward (each block wrapped in `checkpoint_wrapper`, the
non-reentrant `torch.utils.checkpoint`, before `fully_shard` or DDP, as
torchtitan applies it: FSDP2's per-block hooks stay outside the recompute);
layerdrop P leaves each block out of a step's forward with chance P, drawn
on each rank apart exactly as zrt::gpt::layerdrop draws (ddp only, with
find_unused_parameters=True, PyTorch's option for it: FSDP2 and DeepSpeed
have none); same 1 has every rank leave out rank 0's draws; mlp_drop P
leaves each block's MLP out with chance P, the block running, drawn as
zrt draws it (the seed's high bit set; ddp only: FSDP2 aborts on it, see
fsdp2_partly_unused.py); optimizer muon (argv 10; adamw otherwise) steps
the parameters zrt's default rule gives Muon (2+ dimensions, no part of
the name containing `embed` or being wte, wpe, head, lm_head) by
torch.optim.Muon (lr 0.02, weight decay 0.01) and the rest by AdamW (lr
1e-4, betas (0.9, 0.95), eps 1e-10, weight decay 0.01), as zrt's Muon
config there does (ddp only: FSDP2's shards would each orthogonalize a
piece of a matrix).
Rank 0 prints one protocol line:
  @@zrt {"times": [...], "rss": [per-rank peak RSS bytes]}
"""
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

mode, size, micro, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
freeze_mlp = len(sys.argv) > 5 and sys.argv[5] == "1"
checkpoint = len(sys.argv) > 6 and sys.argv[6] == "1"
layerdrop = float(sys.argv[7]) if len(sys.argv) > 7 else 0.0
drawer = 0 if len(sys.argv) > 8 and sys.argv[8] == "1" else int(os.environ["RANK"])
mlp_drop = float(sys.argv[9]) if len(sys.argv) > 9 else 0.0
optimizer = sys.argv[10] if len(sys.argv) > 10 else "adamw"
uneven = layerdrop > 0 or mlp_drop > 0
if uneven and mode != "ddp":
    sys.exit(f"layerdrop and mlp_drop need the ddp mode, not {mode}")
if optimizer == "muon" and mode != "ddp":
    sys.exit(f"muon needs the ddp mode, not {mode}")
SIZES = {
    "base": dict(vocab=8192, d=512, layers=8, heads=8, seq=256),
    "large": dict(vocab=8192, d=768, layers=12, heads=12, seq=256),
    "tiny": dict(vocab=256, d=64, layers=2, heads=2, seq=32),
}
c = SIZES[size]
torch.set_num_threads(1)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads
        self.mlp_left_out = False

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        if self.mlp_left_out:
            return x
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, d, layers, heads, seq):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, tokens, skipped=(), mlps_out=()):
        x, y = tokens[:, :-1], tokens[:, 1:]
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for i, b in enumerate(self.h):
            # On the block itself, inside a checkpoint_wrapper if any.
            getattr(b, "_checkpoint_wrapped_module", b).mlp_left_out = i in mlps_out
            if i not in skipped:
                h = b(h)
        logits = self.head(self.ln_f(h)).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


M64 = (1 << 64) - 1


def dropped(p, layers, seed):
    """The blocks zrt::gpt::layerdrop leaves out (the same splitmix64)."""
    out = []
    for i in range(layers):
        z = ((seed * 0x9E3779B97F4A7C15) & M64) ^ (i + 1)
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        z ^= z >> 31
        if (z >> 11) / float(1 << 53) < p:
            out.append(i)
    return out


def reply(obj):
    print("@@zrt " + json.dumps(obj), flush=True)


torch.manual_seed(0)
model = Gpt(**c)
if freeze_mlp:
    for b in model.h:
        b.fc.weight.requires_grad_(False)
        b.out.weight.requires_grad_(False)
if checkpoint:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, b in enumerate(model.h):
        model.h[i] = checkpoint_wrapper(b)
world = int(os.environ["WORLD_SIZE"])
if mode.startswith("deepspeed"):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": int(mode[-1])},
    }
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trained, config=cfg)

    def step(batch, skipped, mlps_out):
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
else:
    dist.init_process_group("gloo")
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=uneven)
    elif mode.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        reshard = mode.endswith("zero3")
        for b in model.h:
            fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if optimizer == "muon":

        def hidden_matrix(name, p):
            outer = lambda part: "embed" in part.lower() or part in ("wte", "wpe", "head", "lm_head")
            return p.ndim >= 2 and not any(outer(part) for part in name.split("."))

        matrices = [p for n, p in trained if hidden_matrix(n, p)]
        rest = [p for n, p in trained if not hidden_matrix(n, p)]
        opts = [
            torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01),
            torch.optim.AdamW(rest, lr=1e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.01),
        ]
    else:
        opts = [torch.optim.AdamW([p for _, p in trained], lr=1e-4, weight_decay=0.01)]

    def step(batch, skipped, mlps_out):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss = model(batch, skipped, mlps_out)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in trained], 1.0)
        for opt in opts:
            opt.step()


times = []
for s in range(steps + 1):
    batch = torch.randint(c["vocab"], (micro, c["seq"] + 1))
    dist.barrier()
    t0 = time.perf_counter()
    seed = s * world + drawer
    step(batch, dropped(layerdrop, c["layers"], seed), dropped(mlp_drop, c["layers"], seed | 1 << 63))
    if s > 0:
        times.append(time.perf_counter() - t0)
t = torch.tensor(times, dtype=torch.float64)
dist.all_reduce(t, op=dist.ReduceOp.MAX)
rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
all_rss = [torch.zeros_like(rss) for _ in range(world)]
dist.all_gather(all_rss, rss)
if dist.get_rank() == 0:
    reply({"times": t.tolist(), "rss": [r.item() for r in all_rss]})
dist.barrier()
sys.stdout.flush()
# gloo's teardown sometimes aborts ("terminate called without an active
# exception") when the ranks exit at slightly different times: the results
# are out, so leave without running it.
os._exit(0)
