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


def _time(fn, iters: int = 3, reps: int = 3) -> float:
    """µs per call: best of `reps` replays of a CUDA graph holding `iters` calls of fn(i)."""
    for i in range(2):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(iters):
            fn(i)
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / iters)
    return best


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
    sys.path.insert(0, os.path.abspath(args.tree))
    from kernels.moe import MoeConfig, StackedExperts, moe_experts
    print(f"tree {args.tree}")
    print("| geometry | T | config | µs | TFLOP/s | output bits |")
    print("|---|---:|---|---:|---:|---|")
    for geom, (E, D, I) in {"flash": (256, 4096, 2048), "pro": (384, 7168, 3072)}.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        parts = {}
        for n, (o, i) in {"1": (I, D), "3": (I, D), "2": (D, I)}.items():
            parts["w" + n] = torch.randint(-128, 128, (E, o, i // 2), dtype=torch.int8, device="cuda", generator=gen)
            parts["s" + n] = torch.randint(118, 126, (E, o, i // 32), dtype=torch.uint8, device="cuda",
                                           generator=gen).view(torch.float8_e8m0fnu)
        ex = StackedExperts(**parts)
        for T in (int(t) for t in args.tokens.split(",")):
            x = (torch.randn(T, D, device="cuda", generator=gen) * 0.3).to(torch.bfloat16)
            idx = torch.rand(T, E, device="cuda", generator=gen).topk(6, dim=-1).indices
            g = torch.rand(T, 6, device="cuda", generator=gen) + 0.1
            cfgs = [None]
            if geom == "flash" and args.shapes:
                cfgs += [MoeConfig("tiles", *map(int, s.split(":"))) for s in args.shapes.split(",")]
            for cfg in cfgs:
                try:
                    y = moe_experts(x, g, idx, ex, 10.0, config=cfg)
                    us = _time(lambda i, cfg=cfg: moe_experts(x, g, idx, ex, 10.0, config=cfg))
                except Exception as e:  # noqa: BLE001 - a shape that does not build is reported, not fatal
                    print(f"| {geom} | {T} | {cfg and tuple(cfg)[1:]} | {type(e).__name__} | - | - |", flush=True)
                    continue
                tf = 2 * 3 * T * 6 * I * D / us * 1e-6
                name = "default" if cfg is None else tuple(cfg)[1:]
                print(f"| {geom} | {T} | {name} | {us:.0f} | {tf:.0f} | {_bits(y)} |", flush=True)
        del ex
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
