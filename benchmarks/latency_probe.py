"""Probe (issue 27): where the latency-bound kernels of a batch-1 decode step spend their time, and (fp32lin) the
prefill's fp32-compute linears. Each piece alone in a CUDA graph (`bench_gemm.gpu_time`: µs per call, best of 5
replays of 20 calls on one stream, so the calls run one after another), Flash width, with the variants that
isolate one term of its cost. Outputs are compared where a section says so (topk: the same set as the default;
fp32lin: the error as a fraction of the fp32 summation bound); the other sections time launches only.

`--section trig`: one program computing RoPE angles on a [1, 32] / [1, 128] / [16, 128] tile: the product alone,
    fp64 cos + sin (the kernels' form), fp32 cos + sin, at positions 4095 and 5.
`--section empty`: a one-program and a 132-program Triton kernel that stores one value per program, µs per launch
    in a graph of 20 launches and of 160 (8 per call, each reading the previous one's output): what one launch
    costs when nothing else runs.
`--section rotate`: the indexer query's RoPE + Hadamard + FP4 rounding (`rope_rotate_fp4`, [b, 1, 64, 128]) against
    the same without the RoPE (`rotate_fp4`): what the RoPE inside the launch costs.
`--section topk`: the indexer's top-512 of 1024 entries (a CSA layer at 4096 context) per query row at batch 1 / 8 /
    32: sorted picks (the default) against the same set unsorted, and num_warps 4 / 8 / 16.
`--section mhc`: one mHC site at T = 1 / 8 / 32 (D 4096, hc 4): hc_post alone, hc_pre (split-K mix + finish) at 20
    Sinkhorn iterations against 1 (what the Sinkhorn costs) and with the site's RMSNorm (the norm's launch).
`--section fp32lin`: the prefill's fp32-compute linears (router, compressor wkv / wgate) at 1024 / 4096 rows of
    bf16 x: the fp32 GEMM on upcast copies against the bf16 GEMM with an fp32 output (`kernels.fp32_linear`).

Run on a GPU: `python benchmarks/latency_probe.py [--section trig|empty|rotate|topk|mhc|fp32lin]` (no --section: all).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))

from bench_gemm import gpu_time  # noqa: E402


@triton.jit
def _store_kernel(src, dst):
    pid = tl.program_id(0)
    tl.store(dst + pid, tl.load(src + pid) + 1.0)


def empty() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bufs = [torch.zeros(sms, device="cuda") for _ in range(9)]
    print("\n| launch | µs per call |\n|---|---:|")
    for progs in (1, sms):
        us = gpu_time(lambda i: _store_kernel[(progs,)](bufs[0], bufs[1]))
        print(f"| 20 launches a graph, {progs} programs (per launch) | {us:.2f} |")

        def chain(i):
            for j in range(8):
                _store_kernel[(progs,)](bufs[j], bufs[j + 1])
        us = gpu_time(chain)
        print(f"| 160 launches a graph, chains of 8, {progs} programs (per launch) | {us / 8:.2f} |")


def rotate() -> None:
    from kernels.indexer import rope_rotate_fp4, rotate_fp4
    rd = 64
    inv_freq = (1.0 / 10000 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)).cuda()
    print("\n| batch | rope_rotate_fp4 µs | rotate_fp4 (no RoPE) µs |\n|---:|---:|---:|")
    for b in (1, 8, 32):
        x = (torch.randn(b, 1, 64, 128, device="cuda")).bfloat16()
        pos = torch.full((b, 1), 4095, dtype=torch.int64, device="cuda")
        a = gpu_time(lambda i: rope_rotate_fp4(x, pos, inv_freq, rd))
        c = gpu_time(lambda i: rotate_fp4(x))
        print(f"| {b} | {a:.1f} | {c:.1f} |", flush=True)


def topk() -> None:
    from kernels.indexer import indexer_topk
    print("\n| rows | default (sorted, default warps) µs | variants (sorted, warps): µs, same set |\n|---:|---:|---|")
    for rows in (1, 8, 32):
        sc = torch.randn(rows, 1, 1024, device="cuda")
        ref = indexer_topk(sc, 512)
        d = gpu_time(lambda i: indexer_topk(sc, 512))
        cells = []
        for srt in (True, False):
            for w in (4, 8, 16):
                out = indexer_topk(sc, 512, sorted_picks=srt, num_warps=w)
                same = bool((out.sort(-1).values == ref.sort(-1).values).all())
                us = gpu_time(lambda i: indexer_topk(sc, 512, sorted_picks=srt, num_warps=w))
                cells.append(f"({srt}, {w}): {us:.1f}, {same}")
        print(f"| {rows} | {d:.1f} | " + "; ".join(cells) + " |", flush=True)


class _Norm:
    def __init__(self, D):
        from kernels.norm import rms_norm
        self.weight = torch.rand(D, device="cuda") + 0.5
        self.eps = 1e-6
        self._f = rms_norm

    def __call__(self, x):
        return self._f(x, self.weight, self.eps)


def mhc() -> None:
    from kernels.mhc import hc_post, hc_pre
    HC, D = 4, 4096
    K = HC * D
    print("\n| T | hc_post µs | hc_pre, 20 iters µs | hc_pre, 1 iter µs | hc_pre + norm µs | norm alone µs |"
          "\n|---:|---:|---:|---:|---:|---:|")
    for T in (1, 8, 32):
        H = torch.randn(T, HC, D, device="cuda").bfloat16()
        a = torch.randn(T, D, device="cuda").bfloat16()
        fn = torch.randn((2 + HC) * HC, K, device="cuda") / math.sqrt(K)
        base, scale = torch.randn((2 + HC) * HC, device="cuda") * 0.5, torch.rand(3, device="cuda") + 0.5
        kw = dict(hc_eps=1e-6, norm_eps=1e-6)
        _, post, comb = hc_pre(H, fn, base, scale, sinkhorn_iters=20, **kw)
        norm = _Norm(D)
        x0 = torch.randn(T, D, device="cuda").bfloat16()
        p = gpu_time(lambda i: hc_post(a, H, post, comb))
        h20 = gpu_time(lambda i: hc_pre(H, fn, base, scale, sinkhorn_iters=20, **kw))
        h1 = gpu_time(lambda i: hc_pre(H, fn, base, scale, sinkhorn_iters=1, **kw))
        hn = gpu_time(lambda i: hc_pre(H, fn, base, scale, sinkhorn_iters=20, norm=norm, **kw))
        n = gpu_time(lambda i: norm(x0))
        print(f"| {T} | {p:.1f} | {h20:.1f} | {h1:.1f} | {hn:.1f} | {n:.1f} |", flush=True)


def fp32lin() -> None:
    """The prefill's fp32-compute linears (router gate, the compressors' joint wkv / wgate) at M = 1024 / 4096 rows
    of bf16 x: the fp32 GEMM on upcast copies (the path before) against `fp32_linear` (the bf16 GEMM with an fp32
    output), each error as a fraction of the fp32 summation bound of the tests."""
    from kernels.fp32_linear import fp32_linear, fp32_linear_ref
    from tests.unit.test_fp32_linear import fp32_sum_bound
    print("\n| M | N x K | fp32 GEMM on upcast copies µs | bf16 GEMM, fp32 out µs | ratio | err / bound (fp32, bf16) |"
          "\n|---:|---|---:|---:|---:|---|")
    for M in (1024, 4096):
        for N in (256, 512, 1024, 2048):
            K = 4096
            x = (torch.randn(M, K, device="cuda")).bfloat16()
            w = (torch.randn(N, K, device="cuda") / 64).bfloat16()
            ref = fp32_linear_ref(x, w)
            old = torch.mm(x.float(), w.float().T)
            new = fp32_linear(x, w)
            bound = fp32_sum_bound(x, w)
            e_old = float(((old.double() - ref.double()).abs() / bound).max())
            e_new = float(((new.double() - ref.double()).abs() / bound).max())
            a = gpu_time(lambda i: torch.mm(x.float(), w.float().T))
            b = gpu_time(lambda i: fp32_linear(x, w))
            print(f"| {M} | {N} x {K} | {a:.1f} | {b:.1f} | {a / b:.2f} | {e_old:.1e}, {e_new:.1e} |", flush=True)


@triton.jit
def _trig_kernel(pos_ptr, f_ptr, out_ptr, MODE: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)[:, None]
    c = tl.arange(0, C)[None, :]
    p = tl.load(pos_ptr + r * 0)
    f = tl.load(f_ptr + c % 32)
    if MODE == 0:
        y = (p.to(tl.float64) * f).to(tl.float32)
    elif MODE == 1:
        ang = p.to(tl.float64) * f
        y = tl.cos(ang).to(tl.float32) + tl.sin(ang).to(tl.float32)
    else:
        ang = (p.to(tl.float64) * f).to(tl.float32)
        y = tl.cos(ang) + tl.sin(ang)
    tl.store(out_ptr + r * C + c, y)


def trig() -> None:
    """One program computing RoPE angles p * inv_freq on an [R, C] tile: the product alone, fp64 cos + sin (what
    the kernels do, for bitwise agreement with the reference), fp32 cos + sin of the rounded angle; at position
    4095 and 5 (the fp64 range reduction may take a slow path for large arguments)."""
    rd = 64
    f = (1.0 / 10000 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)).cuda()
    out = torch.empty(16 * 128, device="cuda")
    print("\n| tile | position | product only µs | fp64 cos + sin µs | fp32 cos + sin µs |\n|---|---:|---:|---:|---:|")
    for R, C in ((1, 32), (1, 128), (16, 128)):
        for p in (4095, 5):
            pos = torch.tensor([p], dtype=torch.int64, device="cuda")
            t = [gpu_time(lambda i: _trig_kernel[(1,)](pos, f, out, MODE=m, R=R, C=C)) for m in (0, 1, 2)]
            print(f"| [{R}, {C}] | {p} | {t[0]:.2f} | {t[1]:.2f} | {t[2]:.2f} |", flush=True)


SECTIONS = {"trig": trig, "empty": empty, "rotate": rotate, "topk": topk, "mhc": mhc, "fp32lin": fp32lin}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--section", choices=sorted(SECTIONS), default=None)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for name, fn in SECTIONS.items():
        if a.section in (None, name):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - one failing section must not end the probe
                print(f"[{name}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
