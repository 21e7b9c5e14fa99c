"""FSDP2 where ranks' losses reach different parameters of a module every
rank runs (rank 1 leaves out each block's MLP, the block running; what a
mixture-of-experts layer does when a rank's tokens miss an expert): does
backward go through, hang, or fail? zrt's `partly_unused_on_some_ranks`
is for this case (docs/choices.md, "Experts some ranks' tokens never
reach"). Run with the libtorch venv's Python:

  ~/.cache/zrt/torch-2.13.0/bin/python -m torch.distributed.run --nproc-per-node 2 bench/peers/fsdp2_partly_unused.py

On 2026-11-29 (torch 2.13.0, CPU, gloo) rank 1 aborted (SIGABRT) in
backward: "Received data size doesn't match expected size. Is there a
distributed collective mismatch in your code?" (FSDP2 reduce-scatters the
parameters that have a gradient; pytorch/pytorch issue 158719).
"""
import datetime
import torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank = dist.get_rank()
torch.manual_seed(0)
class Block(nn.Module):
    def __init__(s):
        super().__init__(); s.attn = nn.Linear(16, 16); s.fc = nn.Linear(16, 64); s.out = nn.Linear(64, 16)
    def forward(s, x, skip):
        x = x + s.attn(x)
        return x if skip else x + s.out(torch.relu(s.fc(x)))
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.h = nn.ModuleList([Block(), Block()])
    def forward(s, x, skip):
        for b in s.h: x = b(x, skip)
        return x.square().mean()
m = M()
mesh = init_device_mesh("cpu", (2,))
for b in m.h: fully_shard(b, mesh=mesh)
fully_shard(m, mesh=mesh)
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
try:
    for s in range(2):
        loss = m(torch.randn(4, 16), skip=(rank == 1))
        loss.backward(); opt.step(); opt.zero_grad()
    print(f"rank {rank}: trained", flush=True)
except Exception as e:
    print(f"rank {rank}: {type(e).__name__}: {str(e)[:300]}", flush=True)
