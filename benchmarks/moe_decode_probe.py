"""Probe (issue 27): the routed experts of one decode step (`kernels.moe.moe_experts`, gemv path) at Flash and Pro
width for T = 1 / 8 / 32 tokens, µs per call in a CUDA graph over 8 routings (top-6 of random scores), for the
decode kernels' input forms and nibble decodes side by side in one process:

- "sim / fp16": act_quant_sim values and the fp16 decode route (`kernels.moe.GEMV_CODES = False`; at T = 1 the
  in-kernel quantization is used regardless, GEMV_QUANT_MAX_T);
- "codes / int": act_quant's codes and scales (T > 1) or the in-kernel quantization (T = 1), nibbles decoded by
  element-wise integer ops (mma "bf16");
- "codes / packed": the same with the packed PTX decode (mma "bf16x2"), bf16 lanes;
- "codes / packed f16": the packed decode in fp16 lanes (`kernels.moe.GEMV_PACKED_F16`);
- "default": mma None (packed, except element-wise at T = 1 below `GEMV_QUANT_PACKED_MIN_D`).

Every variant's output is compared bitwise with the first. Run: `python benchmarks/moe_decode_probe.py` on a GPU.

`--section stages`: the two decode kernels alone with their K loop software-pipelined over 1-4 stages
(`stages`); `--flash-only` / `--pro-only`, `--ts 1,8` (token counts), `--warps 2,4` (these warp counts, block_n
up to 64).

`--section shapes`: the whole `moe_experts` call with its default launch shapes (`gemv_shapes`) against the one
shape before them (`config=moe_config(P, E)`, both kernels alike) at T = 1 / 2 / 4 / 8 / 16 / 32, Flash and Pro:
is the new default slower anywhere?

`--section configs` (every shape unpipelined, against `moe_config`'s shape - the fourth session's sweep; the
stages are `--section stages`): the up and the down decode kernel each alone (`moe_up_gemv` / `moe_down_gemv` with the
default input form of that T: x quantized in the kernels at T = 1, act_quant's codes above), µs per call in a
CUDA graph, for launch shapes (block_n, block_kh, num_warps) around the default `moe_config(P, E)`; per (geometry,
T, kernel) the five fastest and the default, with max |y - y_default| / max |y_default| (block_kh sets the fp32
summation order, so other shapes are not bitwise the default).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import kernels.moe as km  # noqa: E402
from benchmarks.bench_gemm import gpu_time, moe_inputs  # noqa: E402
from kernels.moe import moe_experts  # noqa: E402

VARIANTS = (("sim / fp16", False, "bf16", False), ("codes / int", True, "bf16", False),
            ("codes / packed", True, "bf16x2", False), ("codes / packed f16", True, "bf16x2", True),
            ("default", True, None, None))


CONFIG_SWEEP = [(bn, bkh, w) for bn in (8, 16, 32) for bkh in (128, 256, 512) for w in (2, 4, 8)]


def _gemv_inputs(T: int, E: int, D: int, I: int):
    """Inputs of the two decode kernels alone, in the form `moe_experts` gives them at T tokens: 8 routings (top-6
    of random scores) idxs, gate weights g, then (x input, its keywords, h input, its keywords) - x / h themselves
    with quant=True at one token (GEMV_QUANT_MAX_T), act_quant's codes with their scales sx above."""
    from kernels.gemm import act_quant
    x = (torch.randn(T, D, device="cuda") * 0.3).to(torch.bfloat16)
    idxs = [torch.rand(T, E, device="cuda").topk(6, dim=-1).indices for _ in range(8)]
    g = torch.rand(T, 6, device="cuda") + 0.1
    h = (torch.randn(T * 6, I, device="cuda") * 0.3).to(torch.bfloat16)
    if T == 1:
        return idxs, g, x, dict(quant=True), h, dict(quant=True)
    (xq, sx), (hq, sh) = act_quant(x), act_quant(h)
    return idxs, g, xq, dict(sx=sx), hq, dict(sx=sh)


def configs() -> int:
    from kernels.moe import MoeConfig, moe_config, moe_down_gemv, moe_up_gemv
    torch.manual_seed(0)
    print("| geometry | T | kernel | default (BN, BKH, warps) µs | five fastest (BN, BKH, warps): µs, rel err |")
    print("|---|---:|---|---|---|")
    for geom, (E, D, I), Ts in (("flash", (256, 4096, 2048), (1, 8, 32)), ("pro", (384, 7168, 3072), (1, 32))):
        ex = moe_inputs(E, D, I)
        for T in Ts:
            idxs, g, xin, xkw, hin, hkw = _gemv_inputs(T, E, D, I)
            orders = [None] * 8  # pair order, as `moe_experts` launches them since the fifth session of 2026-12-06
            default = moe_config(6 * T, E)
            for kernel in ("up", "down"):
                def call(i, cfg):
                    if kernel == "up":
                        return moe_up_gemv(xin, g, idxs[i % 8], orders[i % 8], ex, 10.0, cfg, **xkw)
                    return moe_down_gemv(hin, idxs[i % 8], orders[i % 8], ex, cfg, **hkw)
                ref = call(0, default)
                t_def = gpu_time(lambda i: call(i, default), iters=16, reps=5)
                rows = []
                for bn, bkh, w in CONFIG_SWEEP:
                    cfg = MoeConfig("gemv", 1, bn, bkh, w, 1)
                    try:
                        y = call(0, cfg)
                        err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
                        rows.append((gpu_time(lambda i: call(i, cfg), iters=16, reps=5), (bn, bkh, w), err))
                    except Exception as e:  # noqa: BLE001 - a shape that does not build is reported, not fatal
                        print(f"  [{(bn, bkh, w)}: {type(e).__name__}: {str(e).splitlines()[0][:120]}]", file=sys.stderr)
                rows.sort()
                best = "; ".join(f"{c}: {u:.1f}, {e:.0e}" for u, c, e in rows[:5])
                print(f"| {geom} | {T} | {kernel} | {(default.block_n, default.block_kh, default.num_warps)} "
                      f"{t_def:.1f} | {best} |", flush=True)
        del ex
        torch.cuda.empty_cache()
    return 0


def stages() -> int:
    """`--section stages`: the up and the down decode kernel each alone (default input form of T, as `configs`) at
    their default shape (`gemv_shapes`, block_n / block_kh / warps) with the K loop software-pipelined over 1 (no
    pipelining) to 4 stages (`MoeConfig.num_stages`, `tl.range(num_stages=...)`: the next chunks' weight bytes in
    flight by cp.async while the current one is decoded), then shapes around it at 1, 2 and 3 stages; µs per call
    in a CUDA graph, and whether each output is bitwise the 1-stage output of its shape (pipelining moves loads,
    not sums)."""
    from kernels.moe import MoeConfig, gemv_shapes, moe_down_gemv, moe_up_gemv
    torch.manual_seed(0)
    geoms = (("flash", (256, 4096, 2048), (1, 8, 32)), ("pro", (384, 7168, 3072), (1, 32)))
    if "--flash-only" in sys.argv:
        geoms = geoms[:1]
    if "--pro-only" in sys.argv:
        geoms = geoms[1:]
    if "--ts" in sys.argv:  # token counts instead of each geometry's own
        ts = tuple(int(t) for t in sys.argv[sys.argv.index("--ts") + 1].split(","))
        geoms = tuple((g, dims, ts) for g, dims, _ in geoms)
    print("| geometry | T | kernel | (BN, BKH, warps) | stages: µs (bitwise = 1 stage) |\n|---|---:|---|---|---|")
    for geom, (E, D, I), Ts in geoms:
        ex = moe_inputs(E, D, I)
        for T in Ts:
            idxs, g, xin, xkw, hin, hkw = _gemv_inputs(T, E, D, I)
            for kernel, cfg0 in zip(("up", "down"), gemv_shapes(T, D, I, None)):
                def call(i, cfg):
                    if kernel == "up":
                        return moe_up_gemv(xin, g, idxs[i % 8], None, ex, 10.0, cfg, **xkw)
                    return moe_down_gemv(hin, idxs[i % 8], None, ex, cfg, **hkw)
                warps = [int(w) for w in sys.argv[sys.argv.index("--warps") + 1].split(",")] \
                    if "--warps" in sys.argv else [cfg0.num_warps]
                bns = (8, 16, 32, 64) if "--warps" in sys.argv else (8, 16, 32)
                shapes_ = [(cfg0.block_n, cfg0.block_kh, cfg0.num_warps, (1, 2, 3, 4))]
                shapes_ += [(bn, bkh, w, (1, 2, 3)) for w in warps for bn in bns for bkh in (128, 256, 512)
                            if (bn, bkh, w) != (cfg0.block_n, cfg0.block_kh, cfg0.num_warps)]
                for bn, bkh, w, sts in shapes_:
                    cells, ref = [], None
                    for st in sts:
                        cfg = MoeConfig("gemv", 1, bn, bkh, w, st)
                        try:
                            y = call(0, cfg)
                            ref = y if ref is None else ref
                            same = "=" if torch.equal(y, ref) else "DIFF"
                            cells.append(f"{st}: {gpu_time(lambda i: call(i, cfg), iters=16, reps=5):.1f} {same}")
                        except Exception as e:  # noqa: BLE001 - reported, not fatal
                            cells.append(f"{st}: {type(e).__name__}")
                    tag = " (default)" if len(sts) == 4 else ""
                    print(f"| {geom} | {T} | {kernel} | {(bn, bkh, w)}{tag} | {'; '.join(cells)} |", flush=True)
        del ex
        torch.cuda.empty_cache()
    return 0


def shapes() -> int:
    from kernels.moe import moe_config
    torch.manual_seed(0)
    print("| geometry | T | one shape (before) µs | gemv_shapes µs | ratio | rel err |\n|---|---:|---:|---:|---:|---:|")
    for geom, (E, D, I) in {"flash": (256, 4096, 2048), "pro": (384, 7168, 3072)}.items():
        ex = moe_inputs(E, D, I)
        for T in (1, 2, 4, 8, 16, 32):
            x = (torch.randn(T, D, device="cuda") * 0.3).to(torch.bfloat16)
            idxs = [torch.rand(T, E, device="cuda").topk(6, dim=-1).indices for _ in range(8)]
            g = torch.rand(T, 6, device="cuda") + 0.1
            old = moe_config(6 * T, E)
            y0 = moe_experts(x, g, idxs[0], ex, 10.0, config=old)
            y1 = moe_experts(x, g, idxs[0], ex, 10.0)
            err = float((y1 - y0).abs().max() / y0.abs().max())
            t0 = gpu_time(lambda i: moe_experts(x, g, idxs[i % 8], ex, 10.0, config=old), iters=16, reps=5)
            t1 = gpu_time(lambda i: moe_experts(x, g, idxs[i % 8], ex, 10.0), iters=16, reps=5)
            print(f"| {geom} | {T} | {t0:.1f} | {t1:.1f} | {t1 / t0:.3f} | {err:.0e} |", flush=True)
        del ex
        torch.cuda.empty_cache()
    return 0


def main() -> int:
    if "--section" in sys.argv and sys.argv[sys.argv.index("--section") + 1] == "configs":
        return configs()
    if "--section" in sys.argv and sys.argv[sys.argv.index("--section") + 1] == "shapes":
        return shapes()
    if "--section" in sys.argv and sys.argv[sys.argv.index("--section") + 1] == "stages":
        return stages()
    torch.manual_seed(0)
    print("| geometry | T | " + " | ".join(f"{v[0]} µs" for v in VARIANTS) + " | bitwise equal |")
    print("|---|---:|" + "---:|" * len(VARIANTS) + "---|")
    for geom, (E, D, I) in {"flash": (256, 4096, 2048), "pro": (384, 7168, 3072)}.items():
        ex = moe_inputs(E, D, I)
        for T in (1, 8, 32):
            x = (torch.randn(T, D, device="cuda") * 0.3).to(torch.bfloat16)
            idxs = [torch.rand(T, E, device="cuda").topk(6, dim=-1).indices for _ in range(8)]
            g = torch.rand(T, 6, device="cuda") + 0.1
            us, outs = [], []
            f16_default = km.GEMV_PACKED_F16
            for _, codes, mma, f16 in VARIANTS:
                km.GEMV_CODES = codes
                km.GEMV_PACKED_F16 = f16_default if f16 is None else f16
                outs.append(moe_experts(x, g, idxs[0], ex, 10.0, mma=mma))
                us.append(gpu_time(lambda i: moe_experts(x, g, idxs[i % 8], ex, 10.0, mma=mma), iters=16, reps=5))
            km.GEMV_CODES, km.GEMV_PACKED_F16 = True, f16_default
            same = all(torch.equal(outs[0], o) for o in outs[1:])
            print(f"| {geom} | {T} | " + " | ".join(f"{u:.1f}" for u in us) + f" | {same} |", flush=True)
        del ex
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
