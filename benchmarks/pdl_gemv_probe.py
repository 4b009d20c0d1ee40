"""Probe (issue 27, decode b=1): Programmatic Dependent Launch on the one-row FP8 GEMVs of a Flash decode layer.

A chain of the layer's one-row GEMV shapes (wqkv_a, wq_b, grouped wo_a, wo_b, the shared expert's w13 and w2),
each reading the previous one's output (so the chain is dependent as in the model), repeated, in one CUDA graph:
(a) plain launches; (b) `launch_pdl=True` with `gdc_wait` first; (c) PDL with the program's first weight chunk
(and its scales) loaded BEFORE `gdc_wait` - the weights do not depend on the previous kernel, so their HBM reads
overlap its tail; (d) as (c) with `gdc_launch_dependents` right after the wait. µs per GEMV, and the chain's output
against (a) bitwise (an unsafe overlap would change it).

The kernel is `kernels.gemm._fp8_gemv_rows_kernel`'s EVEN path (no masks, no act quant) copied here with the PDL
switches.

Run: `python benchmarks/pdl_gemv_probe.py` on a GPU (sm_90+).
"""
from __future__ import annotations

import math
import os
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, os.getcwd())
from kernels.gemm import e8m0_to_f32, round_bf16  # noqa: E402


@triton.jit
def _rows(x_ptr, w_ptr, ws_ptr, y_ptr, N, K, KB, BN: tl.constexpr, BKB: tl.constexpr, PDL: tl.constexpr,
          EARLY: tl.constexpr, TRIGGER: tl.constexpr):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid * BN + tl.arange(0, BN)
    wrow = (g * N + rows).to(tl.int64)[:, None] * K
    srow = (g * N + pid * BN) // 128
    offs = tl.arange(0, BKB * 128)
    blk = tl.arange(0, BKB)
    xrow = x_ptr + g.to(tl.int64) * K
    acc = tl.zeros((BN,), dtype=tl.float32)
    if PDL and not EARLY:
        gdc_wait()
    w0 = tl.load(w_ptr + wrow + offs[None, :])  # the first chunk's weights: independent of the previous kernel
    se0 = tl.load(ws_ptr + srow * KB + blk)
    if PDL and EARLY:
        gdc_wait()
    if PDL and TRIGGER:
        gdc_launch_dependents()
    xv = tl.load(xrow + offs)
    xb = tl.reshape(xv.to(tl.float32), (BKB, 128))
    p = tl.reshape(w0.to(tl.float32), (BN, BKB, 128)) * xb[None, :, :]
    acc += tl.sum(tl.sum(p, axis=2) * e8m0_to_f32(se0.to(tl.int32))[None, :], axis=1)
    for kb in range(BKB, KB, BKB):
        w = tl.load(w_ptr + wrow + kb * 128 + offs[None, :])
        xv = tl.load(xrow + kb * 128 + offs)
        se = tl.load(ws_ptr + srow * KB + kb + blk)
        xb = tl.reshape(xv.to(tl.float32), (BKB, 128))
        p = tl.reshape(w.to(tl.float32), (BN, BKB, 128)) * xb[None, :, :]
        acc += tl.sum(tl.sum(p, axis=2) * e8m0_to_f32(se.to(tl.int32))[None, :], axis=1)
    tl.store(y_ptr + g * N + rows, round_bf16(acc).to(tl.bfloat16))


# (N, K, G, BN, BKB): Flash's one-row decode GEMVs (kernels.gemm ROWS_TUNED / ROWS_DEFAULT)
SHAPES = [(1536, 4096, 1, 8, 8), (32768, 1024, 1, 16, 4), (1024, 4096, 8, 16, 4), (4096, 8192, 1, 8, 8),
          (4096, 4096, 1, 8, 8), (4096, 2048, 1, 8, 8)]


def main() -> int:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    torch.manual_seed(0)
    dev = "cuda"
    ws = []
    for N, K, G, BN, BKB in SHAPES:
        # codes of N(0, 1) values and a scale 2^-round(log2(sqrt(K))): each output has about its input's magnitude,
        # so 120 chained GEMVs stay finite and the bitwise check below compares real numbers
        w = torch.randn(G * N, K, device=dev).to(torch.float8_e4m3fn)
        e = 127 - round(math.log2(math.sqrt(K)))
        s = torch.full((G * N // 128, K // 128), e, dtype=torch.uint8, device=dev)
        ws.append((w, s))
    width = max(G * max(N, K) for N, K, G, *_ in SHAPES)
    bufs = [torch.randn(width, device=dev).to(torch.bfloat16) * 0.1 for _ in range(2)]

    def chain(pdl: bool, early: bool, trigger: bool, reps: int) -> None:
        i = 0
        for _ in range(reps):
            for (N, K, G, BN, BKB), (w, s) in zip(SHAPES, ws):
                src, dst = bufs[i % 2], bufs[(i + 1) % 2]
                _rows[(N // BN, G)](src, w, s, dst, N, K, K // 128, BN=BN, BKB=BKB, PDL=pdl, EARLY=early,
                                    TRIGGER=trigger, num_warps=4, launch_pdl=pdl)
                i += 1

    x0 = bufs[0].clone()
    REPS = 20
    ref = None
    for name, pdl, early, trig in (("plain", False, False, False), ("pdl, wait first", True, False, False),
                                   ("pdl, first chunk before wait", True, True, False),
                                   ("pdl, early + launch_dependents", True, True, True)):
        bufs[0].copy_(x0)
        chain(pdl, early, trig, 1)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        st = torch.cuda.Stream()
        with torch.cuda.stream(st):
            with torch.cuda.graph(g):
                chain(pdl, early, trig, REPS)
        bufs[0].copy_(x0)
        g.replay()
        torch.cuda.synchronize()
        out = bufs[(REPS * len(SHAPES)) % 2].clone()
        if ref is None:
            ref = out
        same = bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
        if not bool(torch.isfinite(out.float()).all()):
            print(f"{name}: the chain's output is not finite: the bitwise check would be void", flush=True)
        ts = []
        for _ in range(7):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e3 / REPS)
        print(f"{name}: {min(ts):.1f} µs per chain of {len(SHAPES)} GEMVs (median {sorted(ts)[3]:.1f}); "
              f"output bitwise the plain chain's: {same} "
              f"(max |out| {float(out.float().abs().max()):.3g})", flush=True)
    byts = sum(G * N * K + G * N * K // 16384 for N, K, G, *_ in SHAPES)
    print(f"weight bytes per chain {byts / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
