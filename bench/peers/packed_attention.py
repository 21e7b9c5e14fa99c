"""Packed documents' attention, the two ways libtorch can run it: one fused
call over the block-diagonal causal mask (what zrt did until 2026-12-03,
and still does under attention dropout), or one causal call per document
over its own keys, the outputs joined (what `zrt::packing` does now, as
`transformers`' flash-attention path runs packed rows). Forward and
backward of 2 rows x 8 heads x 2048 tokens x 64, documents of one length,
the two interleaved over five rounds, medians. Run with the libtorch
venv's Python (the same libtorch as zrt's):

  ~/.cache/zrt/torch-2.13.0/bin/python bench/peers/packed_attention.py [THREADS]

On 2026-12-03 (torch 2.13.0, AMD EPYC AVX2 VM), one thread: one document
of 2048 1.04 s masked against 0.56 per document (1.9x), 1024: 1.10 against
0.36 (3.0x), 256: 0.99 against 0.12 (8.0x), 64: 1.03 against 0.06 (17x);
two threads 1.9x, 2.8x, 7.2x and 12.8x. The mask's kernels visit every
block of it, the ones it hides too.
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
B, H, T, D = 2, 8, 2048, 64
torch.manual_seed(0)
for n in (2048, 1024, 256, 64):
    q, k, v = [torch.randn(B, H, T, D, requires_grad=True) for _ in range(3)]
    cut = [n] * (T // n)
    doc = torch.repeat_interleave(torch.arange(len(cut)), torch.tensor(cut))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = ((doc[:, None] == doc[None, :]) & causal).expand(B, 1, T, T)

    def masked():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def per_document():
        parts = zip(q.split(cut, 2), k.split(cut, 2), v.split(cut, 2))
        return torch.cat([F.scaled_dot_product_attention(a, b, c, is_causal=True) for a, b, c in parts], 2)

    grad = torch.randn(B, H, T, D)
    times = {masked: [], per_document: []}
    for _ in range(5):
        for f in (masked, per_document):
            t0 = time.perf_counter()
            f().backward(grad)
            times[f].append(time.perf_counter() - t0)
    a, b = statistics.median(times[masked]), statistics.median(times[per_document])
    print(f"documents of {n}: mask {a:.3f} s, per document {b:.3f} s, {a / b:.1f}x")
