"""Probe (issue 27): the sparse decode attention of one layer at batch 1 / 8 / 32 (Flash: 64 heads, hd 512, a 4096
context; CSA = window 128 + top-512 of the 1024 entries, HCA = window + all 32 entries, SWA = window only), µs per
call in a CUDA graph, for launch variants of `kernels.attention.sparse_attn` with the output RoPE de-rotation
(rd 64, as the model calls it): the default, other output-column splits (dv), split counts and warps. Each
variant's output against the default's (max |diff| / max |o|). Run on a GPU: `python benchmarks/attn_decode_probe.py`.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))

from bench_attention import decode_case  # noqa: E402
from bench_gemm import gpu_time  # noqa: E402
from kernels.attention import sparse_attn  # noqa: E402

VARIANTS = [("default", {})] + [(f"dv{dv} s{s} w{w}", dict(dv=dv, num_splits=s, num_warps=w))
                                for dv in (128, 256, 512) for s in (1, 2, 4, 8, 20) for w in (4, 8)]


def main() -> int:
    torch.manual_seed(0)
    rd = 64
    inv_freq = (1.0 / 10000 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)).cuda()
    print("| batch | layer | default µs | five fastest: µs, rel err |\n|---:|---|---:|---|")
    for b in (1, 8, 32):
        for kind, topk in (("csa", 512), ("hca", 0), ("swa", 0)):
            q, kv, sink, idx = decode_case([4096] * b, 64, kind, topk)
            pos = torch.full((b, 1), 4095, dtype=torch.int64, device="cuda")
            ref = sparse_attn(q, kv, sink, idx, 0.04, rope=(pos, inv_freq, rd))
            rows = []
            for name, kw in VARIANTS:
                try:
                    o = sparse_attn(q, kv, sink, idx, 0.04, rope=(pos, inv_freq, rd), **kw)
                    err = float((o.float() - ref.float()).abs().max() / ref.float().abs().max())
                    us = gpu_time(lambda i: sparse_attn(q, kv, sink, idx, 0.04, rope=(pos, inv_freq, rd), **kw),
                                  iters=20, reps=5)
                    rows.append((us, name, err))
                except Exception as e:  # noqa: BLE001 - a variant that does not build is reported, not fatal
                    print(f"  [{name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}]", file=sys.stderr)
            default = [r for r in rows if r[1] == "default"][0][0]
            rows.sort()
            print(f"| {b} | {kind} | {default:.1f} | " + "; ".join(f"{n}: {u:.1f}, {e:.0e}" for u, n, e in rows[:5])
                  + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
