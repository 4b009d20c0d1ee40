"""Probe (issue 27, prefill): the FP4 tile path of `kernels.moe.moe_experts` with the packed PTX nibble decode
(mma="bf16x2", `_e2m1_bf16x2`) (the default since the second session of 2026-12-06) against the element-wise decode (mma="bf16"), Flash and Pro width, T = 1024 / 4096 tokens
(6 experts per token): µs per call in a CUDA graph and whether the outputs are bitwise equal.

Run: `python benchmarks/moe_tile_decode_probe.py` on a GPU.
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
    print("| geometry | T | bf16 µs | bf16x2 µs | ratio | bitwise equal |")
    print("|---|---:|---:|---:|---:|---|")
    bad = 0
    for geom, (E, D, I) in {"flash": (256, 4096, 2048), "pro": (384, 7168, 3072)}.items():
        ex = moe_inputs(E, D, I)
        for T in (1024, 4096):
            x = (torch.randn(T, D, device="cuda") * 0.3).to(torch.bfloat16)
            idx = torch.rand(T, E, device="cuda").topk(6, dim=-1).indices
            g = torch.rand(T, 6, device="cuda") + 0.1
            ys = {m: moe_experts(x, g, idx, ex, 10.0, mma=m) for m in ("bf16", "bf16x2")}
            same = torch.equal(ys["bf16"].view(torch.int16), ys["bf16x2"].view(torch.int16))
            bad += not same
            us = {m: gpu_time(lambda i, m=m: moe_experts(x, g, idx, ex, 10.0, mma=m), iters=4, reps=5)
                  for m in ("bf16", "bf16x2")}
            print(f"| {geom} | {T} | {us['bf16']:.0f} | {us['bf16x2']:.0f} | {us['bf16'] / us['bf16x2']:.2f}x | "
                  f"{same} |", flush=True)
        del ex
        torch.cuda.empty_cache()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
