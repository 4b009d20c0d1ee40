"""Probe (issue 27): the routed experts of one decode step (`kernels.moe.moe_experts`, default launch) at Flash
and Pro width for T = 1 / 8 / 32 tokens, µs per call in a CUDA graph over 8 routings (top-6 of random scores).
Run it in two trees (PYTHONPATH) for an A/B of the decode kernels; also prints launches per call.

Run: `python benchmarks/moe_decode_probe.py` on a GPU.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from benchmarks.bench_gemm import gpu_time, moe_inputs  # noqa: E402
from kernels.moe import moe_experts  # noqa: E402


def main() -> int:
    torch.manual_seed(0)
    for geom, (E, D, I) in {"flash": (256, 4096, 2048), "pro": (384, 7168, 3072)}.items():
        ex = moe_inputs(E, D, I)
        for T in (1, 8, 32):
            x = (torch.randn(T, D, device="cuda") * 0.3).to(torch.bfloat16)
            idxs = [torch.rand(T, E, device="cuda").topk(6, dim=-1).indices for _ in range(8)]
            g = torch.rand(T, 6, device="cuda") + 0.1
            us = gpu_time(lambda i: moe_experts(x, g, idxs[i % 8], ex, 10.0), iters=16, reps=5)
            print(f"| {geom} | {T} | {us:.1f} |", flush=True)
        del ex
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
