"""Probe (issue 27, prefill): the sparse attention of one prefill (batch 1, Flash 64 / Pro 128 heads, hd 512,
official plumbing: `bench_attention.prefill_case`) with the output RoPE de-rotation (rd 64, as the model calls
it), µs per call in a CUDA graph: the default, the head-block kernel (`path="blocks"`, 16 heads a program) and the
all-heads kernel (`path="heads"`, 64 heads a program: the KV rows gathered once per query instead of once per 16
heads) with stage / prefetch variants. Each output against the head-block kernel's (max |diff| / max |blocks|).
Run on a GPU: `python benchmarks/attn_prefill_probe.py [--seqlens 1024,4096]`.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))

from bench_attention import prefill_case  # noqa: E402
from bench_gemm import gpu_time  # noqa: E402
from kernels.attention import sparse_attn  # noqa: E402

VARIANTS = [("default", {}), ("blocks", dict(path="blocks")), ("heads no prefetch", dict(path="heads", prefetch=False)),
            ("heads st4", dict(path="heads", num_stages=4)), ("blocks bh32 w8", dict(path="blocks", block_h=32,
                                                                                    num_warps=8))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="1024,4096")
    a = ap.parse_args()
    rd = 64
    inv_freq = (1.0 / 10000 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)).cuda()
    print("| heads | S | layer | variant | µs | TFLOP/s | rel err vs blocks |\n|---:|---:|---|---|---:|---:|---|")
    for heads in (64, 128):
        for S in (int(s) for s in a.seqlens.split(",")):
            for kind, topk in (("csa", 512), ("hca", 0), ("swa", 0)):
                torch.manual_seed(S + heads)
                q, kv, sink, idx = prefill_case(S, heads, kind, topk)
                pos = torch.arange(S, dtype=torch.int64, device="cuda")
                ref = sparse_attn(q, kv, sink, idx, 0.04, rope=(pos, inv_freq, rd), path="blocks").float()
                k = idx.shape[-1]
                for name, kw in VARIANTS:
                    try:
                        o = sparse_attn(q, kv, sink, idx, 0.04, rope=(pos, inv_freq, rd), **kw)
                        err = float((o.float() - ref).abs().max() / ref.abs().max())
                        us = gpu_time(lambda i: sparse_attn(q, kv, sink, idx, 0.04, rope=(pos, inv_freq, rd), **kw),
                                      iters=5, reps=3)
                    except Exception as e:  # noqa: BLE001 - a variant that does not build is reported, not fatal
                        print(f"| {heads} | {S} | {kind} | {name} | {type(e).__name__}: {str(e)[:80]} | | |",
                              flush=True)
                        continue
                    tf = 4 * S * heads * k * 512 / us * 1e-6
                    print(f"| {heads} | {S} | {kind} | {name} | {us:.0f} | {tf:.0f} | {err:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
