"""Probe (issue 27): three launch choices of the decode step at batch 1..64, each against its alternative in one
process, µs per call in a CUDA graph (`bench_gemm.gpu_time`), Flash width (and Pro where named):

`--section attn`: the sparse decode attention ("heads" path, with its RoPE epilogue, 4096 context; CSA = window +
    top-512, HCA = window + 32 entries, SWA = window) with the default split count (`sparse_attn`: one wave, and no
    split shorter than `kernels.attention.decode_min_split_tiles`) against the rule before it (one wave only:
    `num_splits = min(tiles, SMs // programs)`, given explicitly), Flash (64 heads) and Pro (128 heads).
`--section order`: the routed experts' two gemv kernels (`moe_up_gemv` + `moe_down_gemv`, default shapes and input
    form of that T) with the pairs in expert order (the `torch.sort` of the ids, as `moe_experts` ran them at T > 1
    before the fifth session of 2026-12-06)
    against pair order (order None), and the sort itself (sort + int32 cast), Flash and Pro.
`--section fp8`: the FP8 linears of a Flash layer at M = 8 / 32 / 64 rows (the decode GEMV, `fp8_linear` with
    `gemv=gemv_config(...)`: its default below DECODE_TILES_MIN_M rows) against act_quant + torch's blockwise
    `F.scaled_mm` (CUTLASS, what a user would run) and act_quant
    + the prefill tile kernel `_fp8_gemm_kernel` at 64-row tiles (wgmma), over weight copies that L2 cannot hold,
    with the byte floor (weight bytes / the measured copy bandwidth).
`--section mhc`: `hc_pre` with the fused RMSNorm: the one-launch kernel at ONE_LAUNCH_TOK tokens per block 1 / 2 /
    4 / 8 / 16 against the two-launch path (mix + finish, then the norm); and `hc_post_pre`'s one launch against
    hc_post + hc_pre at T = 1 / 2 / 4 / 8.

Every alternative's outputs are compared with the default's (max |diff| / max |ref|). Run on a GPU:
`python benchmarks/decode_knobs_probe.py --section attn|order|mhc|fp8` (no --section: all four).
"""

from __future__ import annotations

import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))

from bench_gemm import gpu_time, moe_inputs  # noqa: E402


def _err(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def attn() -> None:
    from bench_attention import decode_case
    from kernels import attention as ka
    rd = 64
    inv_freq = (1.0 / 10000 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)).cuda()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("\n| heads | batch | layer | keys | default splits | default µs | one-wave rule splits | one-wave µs | "
          "ratio | rel err |\n|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for heads, batches in ((64, (1, 8, 16, 32, 64)), (128, (1, 8, 16, 32))):
        for b in batches:
            for kind, topk in (("csa", 512), ("hca", 0), ("swa", 0)):
                q, kv, sink, idx = decode_case([4096] * b, heads, kind, topk)
                pos = torch.full((b, 1), 4095, dtype=torch.int64, device="cuda")
                k = idx.shape[-1]
                few = b * triton.cdiv(heads, ka.DECODE_BLOCK_H) <= ka.DECODE_DV_MAX_PROGRAMS
                dv = ka.DECODE_DV if few else 512
                programs = b * triton.cdiv(heads, ka.DECODE_BLOCK_H) * (512 // dv)
                tiles = triton.cdiv(k, 32)
                old = max(1, min(tiles, sms // programs))
                new = max(1, min(tiles // ka.decode_min_split_tiles(ka.DECODE_BLOCK_H, dv, 512, 32, 2),
                                 sms // programs))
                call = lambda i, kw: ka.sparse_attn(q, kv, sink, idx, 0.04, rope=(pos, inv_freq, rd), **kw)  # noqa
                ref = call(0, {})
                o = call(0, dict(num_splits=old))
                t0 = gpu_time(lambda i: call(i, {}), iters=20, reps=5)
                t1 = gpu_time(lambda i: call(i, dict(num_splits=old)), iters=20, reps=5)
                print(f"| {heads} | {b} | {kind} | {k} | {new} | {t0:.1f} | {old} | {t1:.1f} | {t0 / t1:.3f} | "
                      f"{_err(o, ref):.0e} |", flush=True)


def order() -> None:
    from kernels.moe import _gemv_operand, gemv_shapes, moe_down_gemv, moe_up_gemv
    print("\n| geometry | T | expert order µs (kernels) | pair order µs | ratio | sort + cast µs | bitwise |\n"
          "|---|---:|---:|---:|---:|---:|---|")
    for geom, (E, D, I) in {"flash": (256, 4096, 2048), "pro": (384, 7168, 3072)}.items():
        ex = moe_inputs(E, D, I)
        for T in (2, 4, 8, 16, 32, 64):
            x = (torch.randn(T, D, device="cuda") * 0.3).to(torch.bfloat16)
            idxs = [torch.rand(T, E, device="cuda").topk(6, dim=-1).indices for _ in range(8)]
            orders = [torch.sort(i.reshape(-1), stable=True).indices.to(torch.int32) for i in idxs]
            g = torch.rand(T, 6, device="cuda") + 0.1
            up, down = gemv_shapes(T, D, I, None)

            def run(i, sort):
                xin, xkw = _gemv_operand(x, up, None, T, D)
                o = orders[i % 8] if sort else None
                h = moe_up_gemv(xin, g, idxs[i % 8], o, ex, 10.0, up, **xkw)
                hin, hkw = _gemv_operand(h, down, None, T, D)
                return moe_down_gemv(hin, idxs[i % 8], o, ex, down, **hkw)
            same = bool(torch.equal(run(0, True), run(0, False)))
            t0 = gpu_time(lambda i: run(i, True), iters=16, reps=5)
            t1 = gpu_time(lambda i: run(i, False), iters=16, reps=5)
            ts = gpu_time(lambda i: torch.sort(idxs[i % 8].reshape(-1), stable=True).indices.to(torch.int32),
                          iters=16, reps=5)
            print(f"| {geom} | {T} | {t0:.1f} | {t1:.1f} | {t1 / t0:.3f} | {ts:.1f} | {same} |", flush=True)
        del ex
        torch.cuda.empty_cache()


def fp8() -> None:
    from kernels.gemm import _fp8_gemm_kernel, _scaled_mm, act_quant, fp8_linear, fp8_linear_ref, gemv_config
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / gpu_time(lambda i: dst.copy_(src), iters=10, reps=5) / 1e3  # GB/s
    del src, dst
    print(f"\ncopy bandwidth {bw:.0f} GB/s\n\n| linear | K->N | M | floor µs | gemv (default) µs | scaled_mm µs | "
          "tiles 64x128 µs | tiles 64x64 µs | rel err scaled_mm / tiles |\n|---|---|---:|---:|---:|---:|---:|---:|---|")
    for name, K, N in (("wqkv_a", 4096, 1536), ("wq_b", 1024, 32768), ("wo_b", 8192, 4096), ("w13", 4096, 4096),
                       ("w2", 2048, 4096), ("idx wq_b", 1024, 8192)):
        R = max(2, int(160e6 / (N * K)) + 1)
        ws = [(torch.randn(N, K, device="cuda") * 0.5).to(torch.float8_e4m3fn) for _ in range(R)]
        ss = [torch.randint(120, 128, (N // 128, K // 128), device="cuda", dtype=torch.uint8).view(
            torch.float8_e8m0fnu) for _ in range(R)]
        for M in (8, 32, 64):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = fp8_linear_ref(x, ws[0], ss[0])
            out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")

            def smm(i):
                q, sx = act_quant(x)
                return _scaled_mm(q, sx, ws[i % R], ss[i % R], out)

            def tiles(i, BN):
                q, sx = act_quant(x)
                _fp8_gemm_kernel[(triton.cdiv(M, 64) * triton.cdiv(N, BN),)](
                    q, sx, ws[i % R], ss[i % R].view(torch.uint8), out, M, N, K, K // 128, BM=64, BN=BN, GROUP_M=8,
                    MMA=2, num_warps=4, num_stages=4)
                return out
            gcfg = gemv_config(M, N, K, 1, x.device)  # the GEMV (the default below DECODE_TILES_MIN_M rows only)
            t_def = gpu_time(lambda i: fp8_linear(x, ws[i % R], ss[i % R], gemv=gcfg), iters=20, reps=5)
            e_s = _err(smm(0), ref)
            t_s = gpu_time(smm, iters=20, reps=5)
            e_t = _err(tiles(0, 128), ref)
            t_t = gpu_time(lambda i: tiles(i, 128), iters=20, reps=5)
            t_t2 = gpu_time(lambda i: tiles(i, 64), iters=20, reps=5)
            print(f"| {name} | {K}->{N} | {M} | {N * K / bw / 1e3:.1f} | {t_def:.1f} | {t_s:.1f} | {t_t:.1f} | "
                  f"{t_t2:.1f} | {e_s:.0e} / {e_t:.0e} |", flush=True)
        del ws, ss
        torch.cuda.empty_cache()


def mhc() -> None:
    import kernels.mhc as km
    from kernels.mhc import hc_post_pre, hc_pre, hc_pre_ref
    from kernels.norm import rms_norm
    HC, ITERS, EPS, D = 4, 20, 1e-6, 4096
    K = HC * D

    class Norm:
        def __init__(self):
            self.weight = torch.rand(D, device="cuda") + 0.5
            self.eps = 1e-6

        def __call__(self, x):
            return rms_norm(x, self.weight, self.eps)

    norm = Norm()
    fn = torch.randn((2 + HC) * HC, K, device="cuda") / math.sqrt(K)
    base, scale = torch.randn((2 + HC) * HC, device="cuda") * 0.5, torch.rand(3, device="cuda") + 0.5
    kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    print("\n| T | hc_pre one launch, tokens per block: µs (1 / 2 / 4 / 8 / 16) | two launches + norm µs | "
          "max rel err |\n|---:|---|---:|---:|")
    for T in (1, 2, 4, 8, 16, 32, 64):
        H = torch.randn(T, HC, D, device="cuda").bfloat16()
        ref = hc_pre(H, fn, base, scale, norm=norm, **kw)
        cells, err = [], 0.0
        for tok in (1, 2, 4, 8, 16):
            km.ONE_LAUNCH_TOK = tok
            out = hc_pre(H, fn, base, scale, norm=norm, one_launch=True, **kw)
            err = max(err, max(_err(o, r) for o, r in zip(out, ref)))
            cells.append(gpu_time(lambda i: hc_pre(H, fn, base, scale, norm=norm, one_launch=True, **kw),
                                  iters=20, reps=5))
        km.ONE_LAUNCH_TOK = 2
        out = hc_pre(H, fn, base, scale, norm=norm, one_launch=False, **kw)
        err = max(err, max(_err(o, r) for o, r in zip(out, ref)))
        t2 = gpu_time(lambda i: hc_pre(H, fn, base, scale, norm=norm, one_launch=False, **kw), iters=20, reps=5)
        print(f"| {T} | " + " / ".join(f"{c:.1f}" for c in cells) + f" | {t2:.1f} | {err:.0e} |", flush=True)
    print("\n| T | hc_post_pre one launch µs | hc_post + hc_pre µs | rel err |\n|---:|---:|---:|---:|")
    for T in (1, 2, 4, 8):
        H = torch.randn(T, HC, D, device="cuda").bfloat16()
        a = torch.randn(T, D, device="cuda").bfloat16()
        _, post, comb = hc_pre_ref(H, fn, base, scale, **kw)
        r1 = hc_post_pre(a, H, post, comb, fn, base, scale, norm=norm, one_launch=True, **kw)
        r2 = hc_post_pre(a, H, post, comb, fn, base, scale, norm=norm, one_launch=False, **kw)
        err = max(_err(o, r) for o, r in zip(r1, r2))
        t1 = gpu_time(lambda i: hc_post_pre(a, H, post, comb, fn, base, scale, norm=norm, one_launch=True, **kw),
                      iters=20, reps=5)
        t2 = gpu_time(lambda i: hc_post_pre(a, H, post, comb, fn, base, scale, norm=norm, one_launch=False, **kw),
                      iters=20, reps=5)
        print(f"| {T} | {t1:.1f} | {t2:.1f} | {err:.0e} |", flush=True)


def main() -> int:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    section = sys.argv[sys.argv.index("--section") + 1] if "--section" in sys.argv else "all"
    for name, fn in (("attn", attn), ("order", order), ("mhc", mhc), ("fp8", fp8)):
        if section in ("all", name):
            fn()
    return 0


if __name__ == "__main__":
    sys.exit(main())
