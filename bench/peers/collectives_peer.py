"""Peer for `zrt bench collectives`: torch.distributed with gloo, 2 ranks.

Started once per round by zrt as WORLD_SIZE processes with the torchrun
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). argv: sizes in MiB
(comma-separated), iterations. Rank 0 prints one protocol line:
  @@zrt {"results": [{"op": ..., "mib": ..., "times": [...]}, ...]}
"""
import json
import sys
import time

import torch
import torch.distributed as dist

sizes = [int(s) for s in sys.argv[1].split(",")]
iters = int(sys.argv[2])
torch.set_num_threads(1)
dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()


def reduce_scatter(out, inp):
    try:
        dist.reduce_scatter_tensor(out, inp)
    except (RuntimeError, NotImplementedError):
        dist.reduce_scatter(out, list(inp.chunk(world)))


results = []
for mib in sizes:
    n = mib * (1 << 20) // 4
    full = torch.ones(n)
    part = torch.ones(n // world)
    other = torch.ones(n)
    ops = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: reduce_scatter(part, full),
        "all_gather": lambda: dist.all_gather_into_tensor(full, part),
        "all_to_all": lambda: dist.all_to_all_single(other, full),
    }
    for name, op in ops.items():
        # Untimed warm-up, as many as zrt's ranks run (WARMUP there).
        for _ in range(5):
            op()
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
        # The slowest rank decides an op's time.
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results.append({"op": name, "mib": mib, "times": t.tolist()})
if rank == 0:
    print("@@zrt " + json.dumps({"results": results}), flush=True)
dist.destroy_process_group()
