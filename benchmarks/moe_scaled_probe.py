"""Probe (issue 27, prefill): the routed experts' prefill tiles with `tl.dot_scaled` (the compiler's MXFP4 path:
on sm_90 it upcasts the e2m1 operand to bf16 itself, on sm_100 it is the native block-scaled MMA) against the
shipped `_moe_up_tile_kernel` / `_moe_down_tile_kernel` (hand-written nibble decode, two dots over the even and odd
inputs of the halves layout). Flash / Pro width, top-6 of random scores, one CUDA graph per variant, µs per call
and max |diff| / max |shipped| of the outputs.

The probe kernels read x / h in the natural channel order (dot_scaled takes the packed e2m1 bytes as they are
stored: the first input in the low nibble) and are otherwise the shipped kernels' tiles (same route, same grid
order, same SwiGLU epilogue).

Run: `python benchmarks/moe_scaled_probe.py [--tokens 4096] [--shapes BM:BN:BKH:W:S,...]` on a GPU.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
from benchmarks.bench_gemm import gpu_time, moe_inputs, rel_err  # noqa: E402
from kernels.gemm import round_bf16  # noqa: E402
from kernels.moe import (TILES_LARGE, MoeConfig, _swiglu, moe_config, moe_down_tiles, moe_route,  # noqa: E402
                         moe_up_tiles)
from kernels.quant import act_quant_sim  # noqa: E402


@triton.jit
def _up_scaled_kernel(xq_ptr, g_ptr, row_pair_ptr, tile_e_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr,
                      E, D, I, K_SLOTS, limit, HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BKH: tl.constexpr, SWAP: tl.constexpr):
    pid = tl.program_id(0)
    tile = pid // (I // BN)
    e = tl.load(tile_e_ptr + tile)
    offs_r = tile * BM + tl.arange(0, BM)
    offs_n = (pid % (I // BN)) * BN + tl.arange(0, BN)
    if e < E:
        pair = tl.load(row_pair_ptr + offs_r)
        valid = pair >= 0
        tok = tl.where(valid, pair // K_SLOTS, 0).to(tl.int64)
        rows64 = e.to(tl.int64) * I + offs_n
        KH = D // 2
        KS = D // 32
        offs_j = tl.arange(0, BKH)
        offs_k = tl.arange(0, 2 * BKH)
        offs_s = tl.arange(0, BKH // 16)
        if SWAP:
            u = tl.zeros((BN, BM), dtype=tl.float32)
            v = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            u = tl.zeros((BM, BN), dtype=tl.float32)
            v = tl.zeros((BM, BN), dtype=tl.float32)
        for kh0 in range(0, KH, BKH):
            s1 = tl.load(s1_ptr + rows64[:, None] * KS + kh0 // 16 + offs_s[None, :])
            s3 = tl.load(s3_ptr + rows64[:, None] * KS + kh0 // 16 + offs_s[None, :])
            if SWAP:
                x = tl.load(xq_ptr + tok[None, :] * D + (2 * kh0 + offs_k)[:, None], mask=valid[None, :], other=0.0)
                w1 = tl.load(w1_ptr + rows64[:, None] * KH + (kh0 + offs_j)[None, :])
                w3 = tl.load(w3_ptr + rows64[:, None] * KH + (kh0 + offs_j)[None, :])
                u = tl.dot_scaled(w1, s1, "e2m1", x, None, "bf16", acc=u)
                v = tl.dot_scaled(w3, s3, "e2m1", x, None, "bf16", acc=v)
            else:
                x = tl.load(xq_ptr + tok[:, None] * D + (2 * kh0 + offs_k)[None, :], mask=valid[:, None], other=0.0)
                w1 = tl.load(w1_ptr + rows64[None, :] * KH + (kh0 + offs_j)[:, None])
                w3 = tl.load(w3_ptr + rows64[None, :] * KH + (kh0 + offs_j)[:, None])
                u = tl.dot_scaled(x, None, "bf16", w1, s1, "e2m1", acc=u)
                v = tl.dot_scaled(x, None, "bf16", w3, s3, "e2m1", acc=v)
        g = tl.load(g_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0)
        if SWAP:
            h = _swiglu(u, v, g[None, :], limit, HAS_LIMIT)
            tl.store(h_ptr + offs_r.to(tl.int64)[None, :] * I + offs_n[:, None], round_bf16(h).to(tl.bfloat16))
        else:
            h = _swiglu(u, v, g[:, None], limit, HAS_LIMIT)
            tl.store(h_ptr + offs_r.to(tl.int64)[:, None] * I + offs_n[None, :], round_bf16(h).to(tl.bfloat16))
    else:
        tl.store(h_ptr + offs_r.to(tl.int64)[None, :] * I + offs_n[:, None], tl.zeros((BN, BM), dtype=tl.bfloat16))


@triton.jit
def _down_scaled_kernel(hq_ptr, row_pair_ptr, tile_e_ptr, w2_ptr, s2_ptr, y_ptr, E, D, I,
                        BM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr, SWAP: tl.constexpr):
    pid = tl.program_id(0)
    tile = pid // (D // BN)
    e = tl.load(tile_e_ptr + tile)
    if e < E:
        offs_r = tile * BM + tl.arange(0, BM)
        pair = tl.load(row_pair_ptr + offs_r)
        valid = pair >= 0
        offs_n = (pid % (D // BN)) * BN + tl.arange(0, BN)
        rows64 = e.to(tl.int64) * D + offs_n
        KH = I // 2
        KS = I // 32
        offs_j = tl.arange(0, BKH)
        offs_k = tl.arange(0, 2 * BKH)
        offs_s = tl.arange(0, BKH // 16)
        r64 = offs_r.to(tl.int64)
        if SWAP:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kh0 in range(0, KH, BKH):
            s2 = tl.load(s2_ptr + rows64[:, None] * KS + kh0 // 16 + offs_s[None, :])
            if SWAP:
                hx = tl.load(hq_ptr + r64[None, :] * I + (2 * kh0 + offs_k)[:, None])
                w = tl.load(w2_ptr + rows64[:, None] * KH + (kh0 + offs_j)[None, :])
                acc = tl.dot_scaled(w, s2, "e2m1", hx, None, "bf16", acc=acc)
            else:
                hx = tl.load(hq_ptr + r64[:, None] * I + (2 * kh0 + offs_k)[None, :])
                w = tl.load(w2_ptr + rows64[None, :] * KH + (kh0 + offs_j)[:, None])
                acc = tl.dot_scaled(hx, None, "bf16", w, s2, "e2m1", acc=acc)
        p64 = tl.where(valid, pair, 0).to(tl.int64)
        if SWAP:
            tl.store(y_ptr + p64[None, :] * D + offs_n[:, None], round_bf16(acc).to(tl.bfloat16), mask=valid[None, :])
        else:
            tl.store(y_ptr + p64[:, None] * D + offs_n[None, :], round_bf16(acc).to(tl.bfloat16), mask=valid[:, None])


def up_scaled(xq, weights, route, ex, limit, cfg, swap):
    E, I, D = ex.w1.shape[0], ex.w1.shape[1], ex.w1.shape[2] * 2
    h = torch.empty(route.row_pair.numel(), I, dtype=torch.bfloat16, device=xq.device)
    u8 = lambda t: t.view(torch.uint8)  # noqa: E731
    _up_scaled_kernel[(I // cfg.block_n * route.tile_expert.numel(),)](
        xq, weights, route.row_pair, route.tile_expert, u8(ex.w1), u8(ex.s1), u8(ex.w3), u8(ex.s3), h,
        E, D, I, weights.shape[1], float(limit), HAS_LIMIT=limit > 0, BM=cfg.block_m, BN=cfg.block_n,
        BKH=cfg.block_kh, SWAP=swap, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return h


def down_scaled(hq, route, ex, P, cfg, swap):
    E, D, I = ex.w2.shape[0], ex.w2.shape[1], ex.w2.shape[2] * 2
    y = torch.empty(P, D, dtype=torch.bfloat16, device=hq.device)
    _down_scaled_kernel[(D // cfg.block_n * route.tile_expert.numel(),)](
        hq, route.row_pair, route.tile_expert, ex.w2.view(torch.uint8), ex.s2.view(torch.uint8), y, E, D, I,
        BM=cfg.block_m, BN=cfg.block_n, BKH=cfg.block_kh, SWAP=swap, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return y


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--shapes", default="128:128:64:8:3,64:128:64:4:3,128:128:128:8:3,128:64:64:4:3,"
                    "64:128:128:4:3,128:128:64:8:4")
    ap.add_argument("--geoms", default="flash,pro")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    print("| geometry | T | kernel | tiles BM:BN:BKH:W:S | µs | rel. diff vs shipped |")
    print("|---|---:|---|---|---:|---:|")
    geoms = {"flash": (256, 4096, 2048), "pro": (384, 7168, 3072)}
    for geom in args.geoms.split(","):
        E, D, I = geoms[geom]
        torch.manual_seed(0)
        ex = moe_inputs(E, D, I)
        for T in (int(t) for t in args.tokens.split(",")):
            x = (torch.randn(T, D, device="cuda") * 0.3).to(torch.bfloat16)
            scores = torch.randn(T, E, device="cuda")
            w, idx = scores.softmax(-1).topk(6, dim=-1)
            idx = idx.to(torch.int32)
            P = T * 6
            dflt = moe_config(P, E)
            shapes = [dflt] + [MoeConfig("tiles", *map(int, s.split(":"))) for s in args.shapes.split(",") if s]
            xq_h = act_quant_sim(x, 128, halves=True)
            xq_n = act_quant_sim(x, 128)
            for cfg in shapes:
                route = moe_route(idx, E, cfg.block_m)
                tag = f"{cfg.block_m}:{cfg.block_n}:{cfg.block_kh}:{cfg.num_warps}:{cfg.num_stages}"
                try:
                    h0 = moe_up_tiles(xq_h, w, route, ex, 10.0, cfg, "bf16x2")
                    t0 = gpu_time(lambda i: moe_up_tiles(xq_h, w, route, ex, 10.0, cfg, "bf16x2"), iters=5, reps=3)
                    print(f"| {geom} | {T} | shipped up | {tag} | {t0:.0f} | 0 |", flush=True)
                except Exception as exc:  # noqa: BLE001 - a probe: report and go on
                    print(f"| {geom} | {T} | shipped up | {tag} | failed: {type(exc).__name__}: {str(exc)[:200]} | |")
                    continue
                hq_h = act_quant_sim(h0, 128, halves=True)
                hq_n = act_quant_sim(h0, 128)
                y0 = moe_down_tiles(hq_h, route, ex, P, cfg, "bf16x2")
                t0 = gpu_time(lambda i: moe_down_tiles(hq_h, route, ex, P, cfg, "bf16x2"), iters=5, reps=3)
                print(f"| {geom} | {T} | shipped down | {tag} | {t0:.0f} | 0 |", flush=True)
                for swap in (True, False):
                    name = "swapped" if swap else "x-lhs"
                    try:
                        h1 = up_scaled(xq_n, w, route, ex, 10.0, cfg, swap)
                        t1 = gpu_time(lambda i: up_scaled(xq_n, w, route, ex, 10.0, cfg, swap), iters=5, reps=3)
                        print(f"| {geom} | {T} | dot_scaled up {name} | {tag} | {t1:.0f} | "
                              f"{rel_err(h1.float(), h0.float()):.1e} |", flush=True)
                        y1 = down_scaled(hq_n, route, ex, P, cfg, swap)
                        t1 = gpu_time(lambda i: down_scaled(hq_n, route, ex, P, cfg, swap), iters=5, reps=3)
                        print(f"| {geom} | {T} | dot_scaled down {name} | {tag} | {t1:.0f} | "
                              f"{rel_err(y1.float(), y0.float()):.1e} |", flush=True)
                    except Exception as exc:  # noqa: BLE001
                        print(f"| {geom} | {T} | dot_scaled {name} | {tag} | failed: {type(exc).__name__}: "
                              f"{str(exc)[:300]} | |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
