"""Probe (issue 27): how close a one-launch FP8 decode GEMV can get to the copy bandwidth at Flash's shapes.

For each decode linear of a Flash layer (batch 1) it times, in a CUDA graph over enough weight copies that L2
(50 MB on an H200) cannot hold them: the shipped `kernels.gemm.fp8_linear` (default launch), a lean no-split
kernel (`_lean_gemv_kernel`: BN rows x all of K per program, BKB K blocks per load, x pre-quantized) at a few
shapes, a read-only kernel over the same bytes (the achievable floor of one launch of that size), and cuBLAS's
bf16 GEMV on the dequantized weight (what a user without FP8 kernels runs). The lean kernel's output is checked
against `fp8_linear_ref` (one bf16 rounding apart at most).

Run: `python benchmarks/gemv_probe.py` on a GPU.
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_gemm import gpu_time  # noqa: E402
from kernels.gemm import GemvConfig, RowsConfig, act_quant, fp8_grouped_gemv, fp8_linear, fp8_linear_ref  # noqa: E402
from kernels.jit_formats import e8m0_to_f32  # noqa: E402


@triton.jit
def _lean_gemv_kernel(x_ptr, w_ptr, ws_ptr, y_ptr, N, K, KB, BN: tl.constexpr, BKB: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    srow = (pid * BN) // 128
    acc = tl.zeros([BN], tl.float32)
    offs = tl.arange(0, BKB * 128)
    r64 = rows.to(tl.int64)[:, None] * K
    for kb in range(0, KB, BKB):
        w = tl.load(w_ptr + r64 + kb * 128 + offs[None, :])
        x = tl.load(x_ptr + kb * 128 + offs).to(tl.float32)
        p = w.to(tl.float32) * x[None, :]
        part = tl.sum(tl.reshape(p, (BN, BKB, 128)), axis=2)
        sw = e8m0_to_f32(tl.load(ws_ptr + srow * KB + kb + tl.arange(0, BKB)).to(tl.int32))
        acc += tl.sum(part * sw[None, :], axis=1)
    tl.store(y_ptr + rows, acc.to(tl.bfloat16))


@triton.jit
def _read_kernel(w_ptr, out_ptr, K, KB, BN: tl.constexpr, BKB: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    offs = tl.arange(0, BKB * 128)
    acc = tl.zeros([BN, BKB * 128], tl.int32)
    r64 = rows.to(tl.int64)[:, None] * K
    for kb in range(0, KB, BKB):
        acc += tl.load(w_ptr.to(tl.pointer_type(tl.uint8)) + r64 + kb * 128 + offs[None, :]).to(tl.int32)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


SHAPES = [("wqkv_a", 4096, 1536), ("wq_b", 1024, 32768), ("wo_b", 8192, 4096), ("w13 (shared)", 4096, 4096),
          ("w2 (shared)", 2048, 4096)]


def main() -> int:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    print("| linear | K->N | MB | fp8_linear µs | read-only µs (best) | lean µs (best: BN, BKB, warps) | "
          "cuBLAS bf16 µs | lean / read | max |lean - ref| in ulp |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, K, N in SHAPES:
        KB = K // 128
        mb = N * K / 1e6
        R = max(2, int(160 / mb) + 1)
        ws = [(torch.randn(N, K, device="cuda") * 0.5).to(torch.float8_e4m3fn) for _ in range(R)]
        ss = [torch.randint(120, 128, (N // 128, KB), device="cuda", dtype=torch.uint8) for _ in range(R)]
        x = (torch.randn(1, K, device="cuda")).to(torch.bfloat16)
        t_ship = gpu_time(lambda i: fp8_linear(x, ws[i % R], ss[i % R].view(torch.float8_e8m0fnu)), iters=40)
        xq = act_quant(x, sim=True)[0]
        ref = fp8_linear_ref(x, ws[0], ss[0].view(torch.float8_e8m0fnu))
        best_read = float("inf")
        out = torch.empty(N, dtype=torch.int32, device="cuda")
        for BN, BKB, nw in ((16, 4, 4), (32, 2, 4), (8, 8, 4), (16, 8, 8)):
            if N % BN or KB % BKB:
                continue
            t = gpu_time(lambda i: _read_kernel[(N // BN,)](ws[i % R], out, K, KB, BN=BN, BKB=BKB, num_warps=nw),
                         iters=40)
            best_read = min(best_read, t)
        best = (float("inf"), None)
        y = torch.empty(1, N, dtype=torch.bfloat16, device="cuda")
        for BN, BKB, nw in ((4, 4, 4), (8, 4, 4), (8, 8, 4), (16, 4, 4), (16, 8, 8), (32, 2, 4), (32, 4, 8),
                            (64, 1, 4), (64, 2, 8)):
            if N % BN or KB % BKB:
                continue
            t = gpu_time(lambda i: _lean_gemv_kernel[(N // BN,)](xq, ws[i % R], ss[i % R], y, N, K, KB, BN=BN,
                                                                 BKB=BKB, num_warps=nw), iters=40)
            if t < best[0]:
                best = (t, (BN, BKB, nw))
        BN, BKB, nw = best[1]
        _lean_gemv_kernel[(N // BN,)](xq, ws[0], ss[0], y, N, K, KB, BN=BN, BKB=BKB, num_warps=nw)
        ulp = ((y.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-30) * 128).max().item()
        wb = [w.to(torch.bfloat16) for w in ws[: max(2, R // 2)]]
        t_cub = gpu_time(lambda i: torch.mm(x, wb[i % len(wb)].T), iters=40)
        print(f"| {name} | {K}->{N} | {mb:.1f} | {t_ship:.2f} | {best_read:.2f} | {best[0]:.2f} {best[1]} | "
              f"{t_cub:.2f} | {best[0] / best_read:.2f} | {ulp:.2f} |", flush=True)
    # the grouped wo_a (8 groups of [1024, 4096], no activation quantization): the shipped launch against the
    # split-K launch it replaced at M = 1 and a few one-row launches
    G, K, N = 8, 4096, 1024
    R = 6
    ws = [(torch.randn(G * N, K, device="cuda") * 0.5).to(torch.float8_e4m3fn) for _ in range(R)]
    ss = [torch.randint(120, 128, (G * N // 128, K // 128), device="cuda", dtype=torch.uint8).view(
        torch.float8_e8m0fnu) for _ in range(R)]
    x = torch.randn(1, G * K, device="cuda").to(torch.bfloat16)
    print("\n| wo_a (G=8, 4096->1024 each, 33.6 MB) launch | µs |\n|---|---|")
    for label, cfg in (("shipped (gemv_config)", None),
                       ("split-K GemvConfig(dot=False, bn=128, unroll=4, per_sm=4, num_warps=8) (before)",
                        GemvConfig(dot=False, bn=128, unroll=4, per_sm=4, num_warps=8)),
                       ("RowsConfig(8, 8, 4)", RowsConfig(8, 8, 4)), ("RowsConfig(16, 4, 4)", RowsConfig(16, 4, 4)),
                       ("RowsConfig(16, 8, 8)", RowsConfig(16, 8, 8)), ("RowsConfig(4, 8, 4)", RowsConfig(4, 8, 4))):
        t = gpu_time(lambda i: fp8_grouped_gemv(x, ws[i % R], ss[i % R], G, gemv=cfg), iters=40)
        print(f"| {label} | {t:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
