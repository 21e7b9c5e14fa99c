"""Peer for `zrt bench adam`: PyTorch's fused AdamW and DeepSpeed's CPUAdam,
PyTorch's fused SGD (momentum 0.9) for zrt's SGD row, its fused Adagrad
for zrt's Adagrad row, and its RMSprop (momentum 0.9; foreach, as torch has
no fused RMSprop) for zrt's RMSprop row.

A long-lived process so zrt and the peers can be interleaved round by round
without paying for `import torch` each time. Protocol, one JSON object a line:
Every protocol line starts with "@@zrt " (libraries such as DeepSpeed log to
stdout; zrt passes any other line through to its stderr).
  start:   prints {"ready": true, "deepspeed": <bool>, "deepspeed_error": <str>}
  request: {"impl": "torch_fused" | "torch_fused_sgd" | "torch_fused_adagrad"
                    | "torch_rmsprop" | "deepspeed",
            "threads": T, "steps": K}
  reply:   {"times": [seconds of each of K steps]}   (after one warm-up step)
"""
import json
import sys
import time

import torch

n = int(sys.argv[1])
torch.manual_seed(0)
param = torch.nn.Parameter(torch.randn(n))
param.grad = torch.randn(n) * 1e-3

opts = {}
ds_error = ""
try:
    # Builds (first time: JIT with ninja, about a minute) and loads the op now,
    # so a failure reads as "unavailable" rather than a crash mid-benchmark.
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    opts["deepspeed"] = DeepSpeedCPUAdam([param], lr=1e-3, weight_decay=0.01, adamw_mode=True)
except Exception as e:  # deepspeed missing or its op did not build
    ds_error = f"{type(e).__name__}: {e}"


def optimizer(impl):
    if impl not in opts:
        if impl == "torch_fused":
            opts[impl] = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, fused=True)
        elif impl == "torch_fused_sgd":
            opts[impl] = torch.optim.SGD(
                [param], lr=1e-3, momentum=0.9, weight_decay=0.01, fused=True
            )
        elif impl == "torch_fused_adagrad":
            opts[impl] = torch.optim.Adagrad([param], lr=1e-2, weight_decay=0.01, fused=True)
        elif impl == "torch_rmsprop":
            opts[impl] = torch.optim.RMSprop(
                [param], lr=1e-2, momentum=0.9, weight_decay=0.01, foreach=True
            )
        else:
            raise ValueError(f"unknown impl {impl}")
    return opts[impl]


def reply(obj):
    print("@@zrt " + json.dumps(obj), flush=True)


reply({"ready": True, "deepspeed": ds_error == "", "deepspeed_error": ds_error})
for line in sys.stdin:
    req = json.loads(line)
    torch.set_num_threads(req["threads"])
    opt = optimizer(req["impl"])
    opt.step()
    times = []
    for _ in range(req["steps"]):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    reply({"times": times})
