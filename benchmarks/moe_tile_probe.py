"""Probe (issue 27, prefill): the routed experts' tile path (`kernels.moe.moe_experts` above GEMV_MAX_PAIRS) of
one source tree, Flash and Pro width, T = 1024 / 4096 tokens (top-6 of random scores): µs per call in a CUDA graph
(default launch, then the forced tile shapes of --shapes at Flash width) and a checksum of each output's bits,
so two trees can be compared bitwise (run it once per tree: `--tree .bases/<sha>` for the base).

Run: `python benchmarks/moe_tile_probe.py [--tree DIR] [--shapes BM:BN:BKH:W:S,...]` on a GPU.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch


def _bits(y: torch.Tensor) -> str:
    """A checksum of y's bits (int64 sum of the fp32 words times their position mod a prime)."""
    w = y.float().contiguous().view(torch.int32).to(torch.int64).flatten()
    pos = torch.arange(w.numel(), device=w.device, dtype=torch.int64) % 1000003 + 1
    return f"{int((w * pos).sum()) & 0xFFFFFFFFFFFF:012x}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=os.getcwd(), help="source tree whose kernels/ is timed")
    ap.add_argument("--shapes", default="", help="forced tile shapes BM:BN:BKH:warps:stages, comma-separated")
    ap.add_argument("--tokens", default="1024,4096")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree))  # the tree's kernels (and its bench_gemm's timer / weights)
    from benchmarks.bench_gemm import gpu_time, moe_inputs
    from kernels.moe import MoeConfig, moe_experts
    print(f"tree {args.tree}")
    print("| geometry | T | config | µs | TFLOP/s | output bits |")
    print("|---|---:|---|---:|---:|---|")
    for geom, (E, D, I) in {"flash": (256, 4096, 2048), "pro": (384, 7168, 3072)}.items():
        torch.manual_seed(0)  # the same weights and inputs in every tree (the checksums compare them)
        ex = moe_inputs(E, D, I)
        for T in (int(t) for t in args.tokens.split(",")):
            x = (torch.randn(T, D, device="cuda") * 0.3).to(torch.bfloat16)
            idx = torch.rand(T, E, device="cuda").topk(6, dim=-1).indices
            g = torch.rand(T, 6, device="cuda") + 0.1
            cfgs = [None]
            if geom == "flash" and args.shapes:
                cfgs += [MoeConfig("tiles", *map(int, s.split(":"))) for s in args.shapes.split(",")]
            for cfg in cfgs:
                try:
                    y = moe_experts(x, g, idx, ex, 10.0, config=cfg)
                    us = gpu_time(lambda i, cfg=cfg: moe_experts(x, g, idx, ex, 10.0, config=cfg), iters=3, reps=3)
                except Exception as e:  # noqa: BLE001 - a shape that does not build is reported, not fatal
                    print(f"| {geom} | {T} | {cfg and tuple(cfg)[1:]} | {type(e).__name__} | - | - |", flush=True)
                    continue
                tf = 2 * 3 * T * 6 * I * D / us * 1e-6
                name = "default" if cfg is None else tuple(cfg)[1:]
                print(f"| {geom} | {T} | {name} | {us:.0f} | {tf:.0f} | {_bits(y)} |", flush=True)
        ex = None  # free the weights before the next geometry
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
