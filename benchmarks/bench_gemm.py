"""Benchmark of the FP8 linear and grouped FP4 MoE kernels (issue 13, item 3) at Flash / Pro shapes on one GPU.

    python benchmarks/bench_gemm.py [--quick]
    python benchmarks/bench_gemm.py --sections gemv_sweep [--smoke]   # decode GEMV launch variants (GemvConfig)
    python benchmarks/bench_gemm.py --quick --sections invariant_sweep   # batch-invariant GEMV launches (issue 25)

Measured in the same run: copy bandwidth (a 2 GiB device-to-device copy, read + write bytes / time) and the bf16
GEMM peak (cuBLAS torch.mm 8192^3). Kernel times are GPU times of a CUDA graph of 20 calls, replayed (no Python
launch overhead: the model replays graphs at decode), with weights cycled over copies totalling > 256 MB so they
come from HBM, not the 50 MB L2. Decode rows: µs, GB/s of counted bytes (codes + scales + x + y) and % of copy
bandwidth. Prefill rows: TFLOP/s (2*M*N*K) and % of the bf16 peak, per method. "ref" = what Linear / MoE do today
(dequantize + act_quant_sim + fp32 matmul; MoE: the per-expert loop of moe_grouped_ref), timed eagerly.
Also probes which `torch.nn.functional.scaled_mm` block-scaling recipes this torch build accepts for
1x128 (x) x 128x128 (W). Prints a markdown table.

`--sections head` (the fp32-compute linears held bf16, `kernels.fp32_linear`): the bf16-weight fp32 GEMV against
`x @ W_fp32.T` (cuBLAS fp32, what the dequantized model runs) at the Flash / Pro head, router and compressor
shapes, M = 1 / 8 / 32, plus a (BN, BK, warps) sweep at the Flash head; correctness = max |y - y_exact| over the
fp32 summation bound 2 * K * 2^-24 * sum_k |x_k w_k| (fp64 exact product; <= 1 passes, as tests/unit). About 20 s
on one H200:

    python benchmarks/bench_gemm.py --sections head
    TRITON_INTERPRET=1 python benchmarks/bench_gemm.py --sections head --smoke   # CPU, tiny shapes, no timing
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--smoke" in sys.argv:  # before triton is imported: the interpreter runs the sweep on CPU at tiny shapes
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from dsv4 import quant
from kernels.gemm import fp8_linear, fp8_linear_ref
from kernels.moe import StackedExperts, moe_experts

DECODE = [("wq_a", 4096, 1024), ("wq_b", 1024, 32768), ("wkv", 4096, 512), ("wo_b", 8192, 4096),
          ("shared w1/w3", 4096, 2048), ("shared w2", 2048, 4096), ("pro wq_a", 7168, 1536),
          ("pro wq_b", 1536, 65536), ("pro shared w1", 7168, 3072), ("pro shared w2", 3072, 7168)]
PREFILL = [("wq_a", 4096, 1024), ("wq_b", 1024, 32768), ("wo_b", 8192, 4096), ("shared w1/w3", 4096, 2048),
           ("pro shared w2", 3072, 7168)]


def gpu_time(fn, iters: int = 20, reps: int = 5) -> float:
    """µs per call: best of `reps` replays of a CUDA graph holding `iters` calls of fn(i)."""
    for i in range(3):
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


def safe(timer, *a, **kw) -> float:
    """timer(*a, **kw), or NaN with the error's first line on stderr (a failing variant must not end the run)."""
    try:
        return timer(*a, **kw)
    except Exception as e:  # noqa: BLE001 - reported, shown as nan in the table
        print(f"  [{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}]", file=sys.stderr)
        return float("nan")


def eager_time(fn, iters: int = 5) -> float:
    fn(0)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for i in range(iters):
        fn(i)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / iters


def copy_bandwidth() -> tuple[float, float]:
    """(cudaMemcpy D2D via copy_, elementwise fp32 kernel dst = src + 0) GB/s, read + write bytes, 1 GiB each."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda").fill_(1.0)
    dst = torch.empty_like(src)
    memcpy = gpu_time(lambda i: dst.copy_(src), iters=10)
    kernel = gpu_time(lambda i: torch.add(src, 0.0, out=dst), iters=10)
    return 8 * src.numel() / memcpy * 1e-3, 8 * src.numel() / kernel * 1e-3


def bf16_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = gpu_time(lambda i: torch.mm(a, b), iters=10)
    return 2 * 8192 ** 3 / us * 1e-6  # TFLOP/s


def weights8(N: int, K: int, copies: int):
    out = []
    for _ in range(copies):
        mag = torch.randint(0, 0x7F, (N, K), dtype=torch.uint8, device="cuda")  # 0x7F / 0xFF are NaN in e4m3fn
        w = (mag | (torch.randint(0, 2, (N, K), dtype=torch.uint8, device="cuda") << 7)).view(torch.float8_e4m3fn)
        s = torch.randint(118, 126, (-(-N // 128), K // 128), dtype=torch.uint8, device="cuda")
        out.append((w, s.view(torch.float8_e8m0fnu)))
    return out


def probe_scaled_mm() -> list[str]:
    """Which F.scaled_mm blockwise recipes run here, and do they match the reference."""
    import torch.nn.functional as F
    rows = []
    M, K, N = 256, 1024, 512
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    (w, s), = weights8(N, K, 1)
    ref = fp8_linear_ref(x, w, s).float()
    q, sx = quant.act_quant(x, 128)
    sw = quant.e8m0_to_float(s)
    variants = {
        "1x128 x 128x128 (sx outer-major, sw.t())": lambda: F.scaled_mm(
            q, w.t(), sx.t().contiguous().t(), F.ScalingType.BlockWise1x128, sw.t(),
            F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16),
        "1x128 x 128x128 (sx contiguous, sw contiguous)": lambda: F.scaled_mm(
            q, w.t(), sx.contiguous(), F.ScalingType.BlockWise1x128, sw.contiguous(),
            F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16),
        "_scaled_mm legacy (sx outer-major, sw.t())": lambda: torch._scaled_mm(
            q, w.t(), sx.t().contiguous().t(), sw.t(), out_dtype=torch.bfloat16),
    }
    for name, fn in variants.items():
        try:
            y = fn().float()
            err = float((y - ref).abs().max() / ref.abs().max())
            rows.append(f"| {name} | runs | max rel err {err:.2e} |")
        except Exception as e:  # noqa: BLE001 - a probe: report what this build says
            rows.append(f"| {name} | {type(e).__name__} | {str(e).splitlines()[0][:120]} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-ref", action="store_true", help="skip the (slow, eager) reference timings")
    ap.add_argument("--sections", default="probe,decode,prefill,moe")
    ap.add_argument("--skip-bf16", action="store_true", help="skip the bf16-dot timings of the Triton kernels")
    ap.add_argument("--tile-shapes", default=None, help="moe_tiles: the variants to time against the default, "
                    "';'-separated bm,bn,kh,warps[,stages] (default: the sweep in bench_moe_tiles)")
    ap.add_argument("--geoms", default="flash,pro", help="moe_tiles: the geometries (flash, pro)")
    ap.add_argument("--tokens", default="1024,4096", help="moe_tiles: the token counts T")
    ap.add_argument("--smoke", action="store_true", help="the sections head / moe_tiles / moe_crossover / "
                    "gemv_sweep at tiny shapes on CPU under TRITON_INTERPRET=1, correctness only (no timing)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.smoke:
        smoke = {"head": lambda: bench_head(args, float("nan")), "moe_tiles": lambda: bench_moe_tiles(args),
                 "moe_crossover": lambda: bench_moe_crossover(args), "gemv_sweep": lambda: bench_gemv_sweep(args, None)}
        asked = args.sections.split(",")
        if not set(asked) <= set(smoke):
            ap.error(f"--smoke runs only the sections {sorted(smoke)}, not {sorted(set(asked) - set(smoke))}")
        for name in asked:
            smoke[name]()
        return 0
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    import triton
    print(f"triton {triton.__version__}")
    bw_memcpy, bw_kernel = copy_bandwidth()
    bw = max(bw_memcpy, bw_kernel)
    peak = bf16_peak()
    print(f"copy bandwidth {bw:.0f} GB/s (memcpy {bw_memcpy:.0f}, elementwise kernel {bw_kernel:.0f}); "
          f"bf16 cuBLAS peak {peak:.0f} TFLOP/s\n")
    sections = set(args.sections.split(","))
    if "probe" in sections:
        print("| scaled_mm variant | result | detail |\n|---|---|---|")
        print("\n".join(probe_scaled_mm()))
    if "decode" in sections:
        bench_decode(args, bw)
    if "prefill" in sections:
        bench_prefill(args, peak)
    if "moe" in sections:
        bench_moe(args, bw)
    if "moe_tiles" in sections:
        bench_moe_tiles(args)
    if "moe_crossover" in sections:
        bench_moe_crossover(args)
    if "head" in sections:
        bench_head(args, bw)
    if "gemv_sweep" in sections:
        bench_gemv_sweep(args, bw)
    if "invariant_sweep" in sections:
        bench_invariant_sweep(args)
    return 0


def bench_decode(args, bw: float) -> None:
    print("\n### FP8 linear, decode (µs per call in a CUDA graph; weights from HBM)\n")
    print("| linear | K->N | M | triton µs (fp8 dot) | GB/s | % copy BW | triton µs (bf16 dot) | ref µs (eager) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, K, N in DECODE[:3] if args.quick else DECODE:
        nbytes = N * K + (-(-N // 128)) * (K // 128)
        ws = weights8(N, K, max(1, -(-(256 << 20) // nbytes)))
        for M in (1, 8, 32):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
            us = safe(gpu_time, lambda i: fp8_linear(x, *ws[i % len(ws)], out=out, mma="fp8"))
            us16 = float("nan") if args.skip_bf16 else \
                safe(gpu_time, lambda i: fp8_linear(x, *ws[i % len(ws)], out=out, mma="bf16"))
            ref = float("nan") if args.no_ref else eager_time(lambda i: fp8_linear_ref(x, *ws[i % len(ws)]))
            gbs = (nbytes + 2 * M * (K + N)) / us * 1e-3
            print(f"| {name} | {K}->{N} | {M} | {us:.1f} | {gbs:.0f} | {100 * gbs / bw:.0f}% | {us16:.1f} | "
                  f"{ref:.0f} |")
        del ws


def bench_prefill(args, peak: float) -> None:
    print("\n### FP8 linear, prefill (TFLOP/s; % of the bf16 peak)\n")
    print("| linear | K->N | M | dequant+cuBLAS | scaled_mm | triton fp8 | default (prefill_method) "
          "| ref (fp32 matmul) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, K, N in PREFILL[:2] if args.quick else PREFILL:
        ws = weights8(N, K, 1)
        for M in (1024, 4096):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
            cells = []
            for method in ("dequant", "scaled_mm", "triton", None):
                try:
                    us = gpu_time(lambda i: fp8_linear(x, *ws[0], out=out, prefill=method), iters=5)
                    tf = 2 * M * N * K / us * 1e-6
                    cells.append(f"{tf:.0f} ({100 * tf / peak:.0f}%, {us:.0f} µs)")
                except Exception as e:  # noqa: BLE001 - report, do not hide, a method this build lacks
                    cells.append(f"{type(e).__name__}")
            ref = float("nan") if args.no_ref else eager_time(lambda i: fp8_linear_ref(x, *ws[0]), iters=3)
            cells.append(f"{2 * M * N * K / ref * 1e-6:.0f} ({ref:.0f} µs)")
            print(f"| {name} | {K}->{N} | {M} | " + " | ".join(cells) + " |")


def moe_inputs(E: int, D: int, I: int, device: str = "cuda") -> StackedExperts:
    parts = {}
    for n, (o, i) in {"1": (I, D), "3": (I, D), "2": (D, I)}.items():
        parts["w" + n] = torch.randint(-128, 128, (E, o, i // 2), dtype=torch.int8, device=device)
        parts["s" + n] = torch.randint(118, 126, (E, o, i // 32), dtype=torch.uint8,
                                       device=device).view(torch.float8_e8m0fnu)
    return StackedExperts(**parts)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref| (the tests' criterion scale: bf16 table relative to the output's magnitude)."""
    return float((y - ref).abs().max() / ref.abs().max())


# launch variants swept at Flash width (MoeConfig: path, block_m, block_n, block_kh, num_warps, num_stages)
GEMV_SWEEP = [(32, 256, 4), (16, 512, 4), (8, 256, 4), (16, 256, 8), (16, 128, 4)]
TILE_SWEEP = [(64, 128, 64, 4, 3), (64, 128, 128, 4, 3), (32, 128, 128, 4, 3), (64, 64, 64, 4, 3),
              (128, 128, 64, 8, 3), (32, 64, 64, 4, 3), (16, 128, 64, 4, 3)]


def bench_moe(args, bw: float) -> None:
    """Grouped MoE: default `moe_experts` per T (the kernels before the rewrite were timed at a25eefc, RESULTS.md
    "Grouped FP4 MoE"; `git show a25eefc:kernels/moe.py` holds them); then (Flash) the up / down split, a sweep
    of launch variants and the gemv / tiles crossover. Each variant's
    output is compared with the default's (max |diff| / max |y|; the default is tested against the reference)."""
    from kernels.gemm import act_quant
    from kernels.quant import act_quant_sim
    from kernels.moe import MoeConfig, moe_config, moe_down_gemv, moe_down_tiles, moe_route, moe_up_gemv, \
        moe_up_tiles
    print("\n### Grouped FP4 MoE (routed experts, top-6; µs per call in a CUDA graph)\n")
    print("| geometry | T | experts read | µs (default) | path | GB/s | % copy BW | TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for geom, (E, D, I) in {"flash": (256, 4096, 2048), "pro": (384, 7168, 3072)}.items():
        ex = moe_inputs(E, D, I)
        per_expert = 3 * I * D // 2 + 3 * I * D // 32
        Ts = (1, 8, 32, 1024, 4096) if geom == "flash" else (1, 8, 32, 1024)
        for T in Ts:
            x = (torch.randn(T, D, device="cuda") * 0.3).to(torch.bfloat16)
            idxs = [torch.rand(T, E, device="cuda").topk(6, dim=-1).indices for _ in range(8)]
            g = torch.rand(T, 6, device="cuda") + 0.1
            it, reps = (20, 5) if T <= 64 else (3, 3)
            us = safe(gpu_time, lambda i: moe_experts(x, g, idxs[i % 8], ex, 10.0), iters=it, reps=reps)
            n_exp = sum(int(ix.unique().numel()) for ix in idxs) / 8
            gbs = n_exp * per_expert / us * 1e-3
            tf = 2 * 3 * T * 6 * I * D / us * 1e-6
            print(f"| {geom} | {T} | {n_exp:.0f} | {us:.1f} | {moe_config(6 * T, E).path} | {gbs:.0f} | "
                  f"{100 * gbs / bw:.0f}% | {tf:.0f} |", flush=True)
        del ex
        torch.cuda.empty_cache()
    E, D, I = 256, 4096, 2048
    ex = moe_inputs(E, D, I)
    # up / down split of the default launches (no act_quant, sort or slot sum)
    print("\n| Flash T | path | up µs | down µs | up+down µs |\n|---|---|---|---|---|")
    for T in (1, 8, 1024):
        x = (torch.randn(T, D, device="cuda") * 0.3).to(torch.bfloat16)
        idxs = [torch.rand(T, E, device="cuda").topk(6, dim=-1).indices for _ in range(8)]
        g = torch.rand(T, 6, device="cuda") + 0.1
        cfg = moe_config(6 * T, E)
        xq = act_quant(x, sim=True)[0]
        it = 20 if T <= 64 else 3
        if cfg.path == "gemv":
            orders = [None] * 8  # pair order, as `moe_experts` launches them (no sort since the fifth session of 2026-12-06)
            hq = act_quant(moe_up_gemv(xq, g, idxs[0], orders[0], ex, 10.0, cfg), sim=True)[0]
            up = safe(gpu_time, lambda i: moe_up_gemv(xq, g, idxs[i % 8], orders[i % 8], ex, 10.0, cfg), iters=it)
            dn = safe(gpu_time, lambda i: moe_down_gemv(hq, idxs[i % 8], orders[i % 8], ex, cfg), iters=it)
        else:
            routes = [moe_route(ix, E, cfg.block_m) for ix in idxs]
            xh = act_quant_sim(x, 128, halves=True)  # the tile kernels' input layout
            hq = act_quant_sim(moe_up_tiles(xh, g, routes[0], ex, 10.0, cfg), 128, halves=True)
            up = safe(gpu_time, lambda i: moe_up_tiles(xh, g, routes[i % 8], ex, 10.0, cfg), iters=it, reps=3)
            dn = safe(gpu_time, lambda i: moe_down_tiles(hq, routes[0], ex, 6 * T, cfg), iters=it, reps=3)
        print(f"| {T} | {cfg.path} | {up:.1f} | {dn:.1f} | {up + dn:.1f} |", flush=True)
    # launch variants (whole moe_experts, forced config) and the crossover
    print("\n| Flash T | config (path, BM, BN, BKH, warps, stages) | µs | rel err vs default |\n|---|---|---|---|")
    runs = [(T, MoeConfig("gemv", 1, bn, bkh, w, 1)) for T in (1, 8) for bn, bkh, w in GEMV_SWEEP]
    runs += [(1024, MoeConfig("tiles", bm, bn, bkh, w, st)) for bm, bn, bkh, w, st in TILE_SWEEP]
    runs += [(4096, MoeConfig("tiles", bm, 128, 64, w, 3)) for bm, w in ((32, 4), (128, 8))]
    runs += [(T, moe_config(1000, E)) for T in (1, 8, 16, 32, 64)]           # 32-row tiles
    runs += [(T, MoeConfig("tiles", 16, 128, 64, 4, 3)) for T in (16, 32, 64, 128)]
    runs += [(T, moe_config(1, E)) for T in (128, 256)]                       # gemv
    for T, cfg in runs:
        torch.manual_seed(T)
        x = (torch.randn(T, D, device="cuda") * 0.3).to(torch.bfloat16)
        idxs = [torch.rand(T, E, device="cuda").topk(6, dim=-1).indices for _ in range(8)]
        g = torch.rand(T, 6, device="cuda") + 0.1
        it, reps = (20, 3) if T <= 64 else (3, 2)
        try:
            err = rel_err(moe_experts(x, g, idxs[0], ex, 10.0, config=cfg), moe_experts(x, g, idxs[0], ex, 10.0))
        except Exception as e:  # noqa: BLE001 - a variant that fails to build is reported, not fatal
            print(f"| {T} | {tuple(cfg)} | {type(e).__name__}: {str(e).splitlines()[0][:100]} | - |", flush=True)
            continue
        us = safe(gpu_time, lambda i: moe_experts(x, g, idxs[i % 8], ex, 10.0, config=cfg), iters=it, reps=reps)
        print(f"| {T} | {tuple(cfg)} | {us:.1f} | {err:.1e} |", flush=True)


def bench_moe_tiles(args) -> None:
    """Prefill tile path of `moe_experts` at Flash and Pro width (--geoms), T in --tokens (1024, 4096): the default
    tiles (`moe_config` at that T) against other tile shapes (--tile-shapes) (µs of the whole call in a CUDA graph; rel err = max |y - y_default| / max |y|, the default itself
    being tested against `moe_grouped_ref` in tests/gpu). The untransposed tile these replaced (32-row, mma.sync)
    was measured in the same sweep at 08b4564's successor 77ec9de (RESULTS.md). Ends with the fastest per row."""
    from kernels.moe import MoeConfig, moe_config
    smoke = args.smoke
    dev = "cpu" if smoke else "cuda"
    geoms = {"tiny": (8, 256, 128)} if smoke else {"flash": (256, 4096, 2048), "pro": (384, 7168, 3072)}
    if not smoke:
        geoms = {g: geoms[g] for g in args.geoms.split(",")}
    Ts = (24,) if smoke else tuple(int(t) for t in args.tokens.split(","))
    variants = []
    shapes = ((16, 32, 32, 4),) if smoke else ((64, 128, 64, 4), (32, 64, 64, 4), (64, 256, 64, 8))
    if getattr(args, "tile_shapes", None):
        shapes = tuple(tuple(int(v) for v in s.split(",")) for s in args.tile_shapes.split(";"))
    variants += [(f"bm{sh[0]} bn{sh[1]} kh{sh[2]} w{sh[3]} st{sh[4] if len(sh) > 4 else 3}",
                  MoeConfig("tiles", *sh[:4], (sh[4] if len(sh) > 4 else 3) if not smoke else 1)) for sh in shapes]
    print("\n### Grouped FP4 MoE, prefill tiles (µs per call in a CUDA graph)\n")
    print("| geometry | T | variant | config | µs | × default | rel err vs default |\n|---|---|---|---|---|---|---|")
    best = {}
    for geom, (E, D, I) in geoms.items():
        ex = moe_inputs(E, D, I, dev)
        for T in Ts:
            torch.manual_seed(T)
            x = (torch.randn(T, D, device=dev) * 0.3).to(torch.bfloat16)
            idxs = [torch.rand(T, E, device=dev).topk(6, dim=-1).indices for _ in range(2 if smoke else 8)]
            g = torch.rand(T, 6, device=dev) + 0.1
            default = moe_config(6 * T, E)
            if smoke:  # tiny widths: the 32 x 128 tiles at one stage
                default = MoeConfig("tiles", 32, 128, 64, 4, 1)
            y0 = moe_experts(x, g, idxs[0], ex, 10.0, config=default)
            t0 = None
            for name, cfg in [("default", default)] + variants:
                try:
                    err = rel_err(moe_experts(x, g, idxs[0], ex, 10.0, config=cfg), y0)
                except Exception as e:  # noqa: BLE001 - a variant that fails to build is reported, not fatal
                    print(f"| {geom} | {T} | {name} | {tuple(cfg)} | {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:100]} | - | - |", flush=True)
                    continue
                us = float("nan") if smoke else \
                    safe(gpu_time, lambda i: moe_experts(x, g, idxs[i % 8], ex, 10.0, config=cfg), iters=3, reps=3)
                t0 = us if t0 is None else t0
                print(f"| {geom} | {T} | {name} | {tuple(cfg)} | {us:.1f} | {t0 / us:.2f} | {err:.1e} |", flush=True)
                if err < 1e-2 and not us >= best.get((geom, T), (float("inf"),))[0]:
                    best[(geom, T)] = (us, name)
        del ex
    print("\nfastest: " + "; ".join(f"{g} T={t}: {n} ({u:.1f} µs)" for (g, t), (u, n) in best.items()))


def bench_moe_crossover(args) -> None:
    """The gemv / tiles crossover of `moe_experts` (GEMV_MAX_PAIRS) at decode batch sizes, Flash and Pro width:
    µs of the whole call in a CUDA graph per path / tile shape, rel err of 16-row tiles vs gemv."""
    from kernels.moe import MoeConfig, moe_config
    smoke = args.smoke
    dev = "cpu" if smoke else "cuda"
    geoms = {"tiny": (8, 256, 128)} if smoke else {"flash": (256, 4096, 2048), "pro": (384, 7168, 3072)}
    if args.quick and not smoke:
        geoms = {"flash": geoms["flash"]}
    print("\n| geometry | T | pairs | gemv µs | tiles bm32 bn128 µs | tiles bm16 bn128 µs | tiles bm16 bn64 µs | "
          "default path | rel err (tiles bm16 vs gemv) |\n|---|---|---|---|---|---|---|---|---|")
    cfgs = [moe_config(1, 256), MoeConfig("tiles", 32, 128, 64, 4, 3), MoeConfig("tiles", 16, 128, 64, 4, 3),
            MoeConfig("tiles", 16, 64, 64, 4, 3)]
    if smoke:
        cfgs = [MoeConfig("gemv", 1, 16, 32, 4, 1)] + [MoeConfig("tiles", 16, 32, 32, 4, 1)] * 3
    for geom, (E, D, I) in geoms.items():
        ex = moe_inputs(E, D, I, dev)
        for T in ((4,) if smoke else (1, 2, 4, 8, 16, 32, 64, 128)):
            torch.manual_seed(T)
            x = (torch.randn(T, D, device=dev) * 0.3).to(torch.bfloat16)
            idxs = [torch.rand(T, E, device=dev).topk(6, dim=-1).indices for _ in range(2 if smoke else 8)]
            g = torch.rand(T, 6, device=dev) + 0.1
            err = rel_err(moe_experts(x, g, idxs[0], ex, 10.0, config=cfgs[2]),
                          moe_experts(x, g, idxs[0], ex, 10.0, config=cfgs[0]))
            us = [float("nan") if smoke else
                  safe(gpu_time, lambda i: moe_experts(x, g, idxs[i % 8], ex, 10.0, config=c), iters=10, reps=3)
                  for c in cfgs]
            print(f"| {geom} | {T} | {6 * T} | " + " | ".join(f"{u:.1f}" for u in us) +
                  f" | {moe_config(6 * T, E).path} | {err:.1e} |", flush=True)
        del ex


# (name, N, K): the fp32-compute linears held bf16 (Flash dim 4096, Pro dim 7168; CSA compressor wkv 2 * 512)
HEAD_SHAPES = [("flash head", 129280, 4096), ("pro head", 129280, 7168), ("flash router gate", 256, 4096),
               ("pro router gate", 384, 7168), ("flash CSA compressor wkv", 1024, 4096)]
# launch variants (BN, BK, warps) at the Flash head per M: the first is the default (`DEFAULT_BLOCKS`)
# (BN, BK, warps, acc2d): acc2d None = the default (elementwise [BN, BK] accumulator at M = 1 only)
HEAD_SWEEP = {1: [(16, 256, 4, None), (16, 256, 4, False), (32, 128, 4, None), (8, 512, 4, None),
                  (16, 512, 8, None)],                                             # CUDA-core rows (M <= ROWS_MAX)
              8: [(128, 64, 4, None), (64, 64, 4, None), (128, 128, 8, None), (256, 64, 8, None)],
              32: [(128, 64, 4, None), (64, 64, 4, None), (128, 128, 8, None), (256, 64, 8, None)]}
              # M > ROWS_MAX: bf16x3 tensor-core dots


def _bound_ratio(y: torch.Tensor, x: torch.Tensor, wd: torch.Tensor) -> float:
    """max over outputs of |y - exact| / (2 K 2^-24 sum_k |x_k w_k|), exact = the fp64 product (wd: W in fp64)."""
    xd = x.double()
    exact = xd @ wd.T
    bound = 2 * x.shape[1] * 2.0 ** -24 * (xd.abs() @ wd.abs().T)
    return float(((y.double() - exact).abs() / bound.clamp_min(1e-300)).max())


def bench_head(args, bw: float) -> None:
    """The bf16-held fp32 linears (module docstring): `kernels.fp32_linear.fp32_linear` vs cuBLAS fp32."""
    from kernels.fp32_linear import fp32_linear
    smoke = args.smoke
    dev = "cpu" if smoke else "cuda"
    shapes = [("smoke head", 300, 256), ("smoke router", 16, 1024)] if smoke else HEAD_SHAPES
    print("\n### fp32 linears held bf16 (kernels.fp32_linear; µs per call in a CUDA graph; weights from HBM)\n")
    print("| linear | N x K | M | bf16-weight kernel µs | GB/s | % copy BW | cuBLAS fp32 µs (x @ W_fp32.T) | GB/s "
          "| % copy BW | speedup | err/bound kernel | err/bound cuBLAS |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, N, K in shapes:
        copies = 1 if smoke else max(1, -(-(256 << 20) // (2 * N * K)))
        w16 = [torch.randn(N, K, device=dev).to(torch.bfloat16) for _ in range(copies)]
        w32 = [w.float() for w in w16]
        wd = w16[0].double()
        for M in (1, 8, 32):
            x = torch.randn(M, K, device=dev)
            y = fp32_linear(x, w16[0])
            ok_k, ok_c = _bound_ratio(y, x, wd), _bound_ratio(x @ w32[0].T, x, wd)
            if smoke:
                print(f"| {name} | {N} x {K} | {M} | - | - | - | - | - | - | - | {ok_k:.1e} | {ok_c:.1e} |")
                continue
            out = torch.empty(M, N, device=dev)
            us = safe(gpu_time, lambda i: fp32_linear(x, w16[i % copies], out=out))
            usc = safe(gpu_time, lambda i: torch.mm(x, w32[i % copies].T, out=out))
            gb, gbc = (2 * N * K + 4 * M * (K + N)) / us * 1e-3, (4 * N * K + 4 * M * (K + N)) / usc * 1e-3
            print(f"| {name} | {N} x {K} | {M} | {us:.1f} | {gb:.0f} | {100 * gb / bw:.0f}% | {usc:.1f} | {gbc:.0f} "
                  f"| {100 * gbc / bw:.0f}% | {usc / us:.2f}x | {ok_k:.1e} | {ok_c:.1e} |", flush=True)
        del w16, w32, wd
    print("\n| Flash head M | (BN, BK, warps, acc2d) | µs | % copy BW | err/bound |\n|---|---|---|---|---|")
    N, K = (300, 256) if smoke else (129280, 4096)
    w16 = torch.randn(N, K, device=dev).to(torch.bfloat16)
    wd = w16.double()
    for M, sweep in HEAD_SWEEP.items():
        x = torch.randn(M, K, device=dev)
        for bn, bk, warps, acc in sweep:
            kw = dict(block=(bn, bk), num_warps=warps, acc2d=acc)
            try:
                err = _bound_ratio(fp32_linear(x, w16, **kw), x, wd)
            except Exception as e:  # noqa: BLE001 - a variant that fails to build is reported, not fatal
                print(f"| {M} | {(bn, bk, warps, acc)} | {type(e).__name__}: {str(e).splitlines()[0][:100]} | - | - |")
                continue
            if smoke:
                print(f"| {M} | {(bn, bk, warps, acc)} | - | - | {err:.1e} |")
                continue
            out = torch.empty(M, N, device=dev)
            us = safe(gpu_time, lambda i: fp32_linear(x, w16, out=out, **kw))
            gb = (2 * N * K + 4 * M * (K + N)) / us * 1e-3
            print(f"| {M} | {(bn, bk, warps, acc)} | {us:.1f} | {100 * gb / bw:.0f}% | {err:.1e} |", flush=True)


# decode GEMV sweep (`kernels.gemm.GemvConfig`): (name, K, N, G); G > 1 is the grouped wo_a (fp8_grouped_gemv)
GEMV_SHAPES = [("flash wq_a", 4096, 1024, 1), ("flash wq_b", 1024, 32768, 1), ("flash wkv", 4096, 512, 1),
               ("flash wo_a", 4096, 1024, 8), ("flash wo_b", 8192, 4096, 1), ("flash shared w1/w3", 4096, 2048, 1),
               ("flash shared w2", 2048, 4096, 1), ("flash indexer wq_b", 1024, 8192, 1),
               ("pro wq_a", 7168, 1536, 1), ("pro wq_b", 1536, 65536, 1), ("pro wkv", 7168, 512, 1),
               ("pro wo_a", 4096, 1024, 16), ("pro wo_b", 16384, 7168, 1), ("pro shared w1/w3", 7168, 3072, 1),
               ("pro shared w2", 3072, 7168, 1), ("pro indexer wq_b", 1536, 8192, 1)]
SMOKE_SHAPES = [("smoke", 384, 192, 1), ("smoke wo_a", 256, 128, 2)]


def gemv_variants(M: int) -> dict:
    """{label: GemvConfig or None (= the default `gemv_config`)} swept at M rows. u = K blocks per iteration,
    x = programs per SM of the split-K, w = warps, pq = x quantized once (act_quant_sim launch). About 30 Triton
    builds in all (per_sm is a runtime value; the kernel is not specialized on M: M = 1 and 8 share the dot
    builds), which with the timings keeps the sweep near 90 s on one H200."""
    from kernels.gemm import GemvConfig as C
    if M <= 16:
        return {"default": None, "dot u2": C(bn=64, unroll=2), "dot u2 x4": C(bn=64, unroll=2, per_sm=4),
                "dot u4 x4": C(bn=64, unroll=4, per_sm=4), "dot bn128 u2 w8": C(bn=128, unroll=2, num_warps=8),
                "core bn64 u2": C(dot=False, bn=64, unroll=2), "core bn64 u2 x4": C(dot=False, bn=64, unroll=2,
                                                                                   per_sm=4),
                "core bn64 u2 x8": C(dot=False, bn=64, unroll=2, per_sm=8),
                "core bn64 u4 x4": C(dot=False, bn=64, unroll=4, per_sm=4),
                "core bn128 u4 w8": C(dot=False, bn=128, unroll=4, num_warps=8),
                "core bn128 u4 w8 x4": C(dot=False, bn=128, unroll=4, num_warps=8, per_sm=4),
                "core bn64 u2 x4 pq": C(dot=False, bn=64, unroll=2, per_sm=4, prequant=True),
                "dot u2 x4 pq": C(bn=64, unroll=2, per_sm=4, prequant=True)}
    return {"default": None, "dot bn32 u2": C(bn=32, unroll=2), "dot bn32 u2 x4": C(bn=32, unroll=2, per_sm=4),
            "dot bn32 u4 x4": C(bn=32, unroll=4, per_sm=4), "dot bn64 u2 w8": C(bn=64, unroll=2, num_warps=8),
            "dot bn64 u4 x4": C(bn=64, unroll=4, per_sm=4), "dot bn32 u2 x4 pq": C(bn=32, unroll=2, per_sm=4,
                                                                                  prequant=True)}


def bench_gemv_sweep(args, bw: float | None) -> None:
    """Decode GEMV (`_fp8_gemv_kernel`) launch variants at every Flash / Pro decode shape and M = 1, 8, 32: µs per
    call in a CUDA graph (weights cycled over copies > 256 MB: from HBM), GB/s of counted bytes (codes + scales +
    x + y), % of copy bandwidth, and correctness: "bitwise" = the default's output exactly; else "tol" = within
    the tests' criterion (tests/unit/test_gemm_moe_kernels.py: bf16 rtol 1.6e-2 atol 1e-2 relative to max|ref|,
    ref = fp8_linear_ref / the wo_a einsum), the summation order having changed (CUDA-core rows, another split);
    "FAIL" outside it (the default too); then e = max|y - ref| / max|ref|; "NONDETERMINISTIC" if a second call
    differs bitwise. Ends with the fastest passing variant per (shape, M).
    bw None (--smoke): interpreter, tiny shapes, no timing."""
    from dsv4.testing import assert_close
    from kernels.gemm import fp8_grouped_gemv, gemv_config
    smoke = bw is None
    dev = "cpu" if smoke else "cuda"
    t0 = time.time()
    print("\n### Decode GEMV launch variants (µs per call in a CUDA graph; weights from HBM)\n")
    print("| linear | K->N (G) | M | variant | µs | GB/s | % copy BW | vs default | correctness |")
    print("|---|---|---|---|---|---|---|---|---|")
    best, paste = [], []
    shapes = SMOKE_SHAPES if smoke else (GEMV_SHAPES[:8] if args.quick else GEMV_SHAPES)
    for name, K, N, G in shapes:
        nbytes = G * N * K + G * (N // 128 + (N % 128 > 0)) * (K // 128)
        if smoke:
            (w, s), = weights8_on(G * N, K, 1, dev)
            ws = [(w, s)]
        else:
            ws = weights8_on(G * N, K, max(1, -(-(256 << 20) // nbytes)), dev)
        for M in (1, 8, 32):
            x = (torch.randn(M, G * K, device=dev) * torch.logspace(-2, 2, G * K // 128, device=dev)
                 .repeat_interleave(128)).to(torch.bfloat16)
            w0, s0 = ws[0]
            if G == 1:
                ref = fp8_linear_ref(x, w0, s0)
            else:
                wd = quant.fp8_block_dequant(w0, s0, out_dtype=torch.float32).view(G, N, K)
                ref = torch.einsum("mgk,gnk->mgn", x.float().view(M, G, K), wd).to(torch.bfloat16).reshape(M, -1)
            mag = float(ref.float().abs().max())

            def call(i, cfg, out):
                w, s = ws[i % len(ws)]
                if G == 1:
                    return fp8_linear(x, w, s, out=out, gemv=cfg)
                return fp8_grouped_gemv(x, w, s, G, gemv=cfg)

            out = torch.empty(M, G * N, dtype=torch.bfloat16, device=dev)
            default = call(0, None, out).clone()
            t_def, rows = float("nan"), []
            for label, cfg in gemv_variants(M).items():
                if cfg is not None and cfg.prequant and G > 1:
                    continue  # wo_a has no activation quantization
                try:
                    y = call(0, cfg, out).clone()
                except Exception as e:  # noqa: BLE001 - a variant that does not build is reported, not fatal
                    print(f"| {name} | {K}->{N} ({G}) | {M} | {label} | {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:100] if str(e) else ''} | | | | |", flush=True)
                    continue
                err = float((y.float() - ref.float()).abs().max()) / mag
                try:
                    assert_close(y.float() / mag, ref.float() / mag, label, dtype=torch.bfloat16)
                    ok = True
                except AssertionError:
                    ok = False
                same = torch.equal(y.view(torch.int16), default.view(torch.int16))
                verdict = ("bitwise" if same else "tol" if ok else "FAIL") + f" {err:.1e}"
                if not torch.equal(call(0, cfg, out).view(torch.int16), y.view(torch.int16)):
                    ok, verdict = False, verdict + " NONDETERMINISTIC"  # the split merge must not race
                us = float("nan") if smoke else safe(gpu_time, lambda i: call(i, cfg, out))
                if cfg is None:
                    t_def = us
                gbs = (nbytes + 2 * M * G * (K + N)) / us * 1e-3
                pct = float("nan") if smoke else 100 * gbs / bw
                print(f"| {name} | {K}->{N} ({G}) | {M} | {label} | {us:.1f} | {gbs:.0f} | {pct:.0f}% | "
                      f"{t_def / us:.2f}x | {verdict} |", flush=True)
                if ok:
                    rows.append((us, label, cfg))
            if rows:  # (under --smoke every time is nan: the last passing variant, to exercise the tables)
                us, label, cfg = rows[-1] if smoke else min(rows, key=lambda r: r[0] if r[0] == r[0] else float("inf"))
                cfg = gemv_config(M, N, K, G, torch.device(dev)) if cfg is None else cfg
                best.append(f"| {name} | {K}->{N} ({G}) | {M} | {label} | {us:.1f} | {t_def:.1f} | {cfg} |")
                if label != "default" and (smoke or us < 0.97 * t_def):  # a win beyond the timing noise
                    paste.append(f"    ({M}, {N}, {K}, {G}): {cfg},  # {name}: {t_def:.1f} -> {us:.1f} µs")
        del ws
        if not smoke:
            torch.cuda.empty_cache()
    print("\n### Best passing GEMV variant per (shape, M) (fill `kernels.gemm.gemv_config` from it)\n")
    print("| linear | K->N (G) | M | best | µs | default µs | GemvConfig |\n|---|---|---|---|---|---|---|")
    print("\n".join(best))
    print("\n`kernels.gemm.GEMV_TUNED` entries (winners >= 3 % faster than the default; keys (M, N, K, G)):\n")
    print("```python\nGEMV_TUNED = {\n" + "\n".join(paste) + "\n}\n```")
    print(f"\ngemv_sweep: {time.time() - t0:.0f} s")


def invariant_variants() -> dict:
    """{label: GemvConfig} for the batch-invariant GEMV (tensor-core dot on 16-row tiles, `kernels.gemm.
    INVARIANT_BM`): any of them is invariant (tile and split fixed per weight shape); the sweep picks the fastest."""
    from kernels.gemm import GemvConfig as C
    return {"bn64": C(bn=64), "bn64 u2": C(bn=64, unroll=2), "bn64 u2 x4": C(bn=64, unroll=2, per_sm=4),
            "bn64 u4 x4": C(bn=64, unroll=4, per_sm=4), "bn64 u2 x8": C(bn=64, unroll=2, per_sm=8),
            "bn128 u2 w8": C(bn=128, unroll=2, num_warps=8), "bn128 u2 w8 x4": C(bn=128, unroll=2, num_warps=8,
                                                                                per_sm=4),
            "bn32 u2 x4": C(bn=32, unroll=2, per_sm=4), "bn32 u4 x4": C(bn=32, unroll=4, per_sm=4),
            "bn64 u2 x4 pq": C(bn=64, unroll=2, per_sm=4, prequant=True)}


def bench_invariant_sweep(args) -> None:
    """The batch-invariant GEMV (`fp8_linear` / `fp8_grouped_gemv` with invariant=True) per Flash decode shape:
    each `invariant_variants` launch timed at M = 1, 8 and 32 in a CUDA graph (weights from HBM) against the default
    mode's launch at the same M (`gemv_config`), and checked on the GPU: row 0 of the M = 8 and 32 calls bitwise
    equal to the M = 1 call (the mode's guarantee; "NOT INVARIANT" otherwise, never picked). Ends with the
    `kernels.gemm.GEMV_INVARIANT_TUNED` entries: per shape the variant with the smallest worst ratio to the default
    over the three M."""
    from kernels import gemm as kgemm
    t0 = time.time()
    print("\n### Batch-invariant GEMV launches (µs per call in a CUDA graph; ratio to the default mode at that M)\n")
    print("| linear | K->N (G) | variant | M=1 µs | M=8 µs | M=32 µs | worst / default | invariant |")
    print("|---|---|---|---|---|---|---|---|")
    paste = []
    shapes = GEMV_SHAPES[:8] if args.quick else GEMV_SHAPES
    for name, K, N, G in shapes:
        nbytes = G * N * K + G * (N // 128 + (N % 128 > 0)) * (K // 128)
        ws = weights8_on(G * N, K, max(1, -(-(256 << 20) // nbytes)), "cuda")
        xs = {M: (torch.randn(M, G * K, device="cuda") * torch.logspace(-2, 2, G * K // 128, device="cuda")
                  .repeat_interleave(128)).to(torch.bfloat16) for M in (1, 8, 32)}
        for M in (8, 32):
            xs[M][0] = xs[1][0]

        def call(i, M, invariant):
            w, s = ws[i % len(ws)]
            if G == 1:
                return fp8_linear(xs[M], w, s, invariant=invariant)
            return kgemm.fp8_grouped_gemv(xs[M], w, s, G, invariant=invariant)

        t_def = {M: safe(gpu_time, lambda i, M=M: call(i, M, False)) for M in (1, 8, 32)}
        print(f"| {name} | {K}->{N} ({G}) | default mode | {t_def[1]:.1f} | {t_def[8]:.1f} | {t_def[32]:.1f} | "
              f"1.00 | |", flush=True)
        rows = []
        saved = kgemm.GEMV_INVARIANT_TUNED.get((N, K, G))
        for label, cfg in invariant_variants().items():
            if cfg.prequant and G > 1:
                continue
            kgemm.GEMV_INVARIANT_TUNED[(N, K, G)] = cfg
            try:
                one = call(0, 1, True).clone()
                inv = all(torch.equal(call(0, M, True)[0].view(torch.int16), one[0].view(torch.int16))
                          for M in (8, 32))
                t = {M: safe(gpu_time, lambda i, M=M: call(i, M, True)) for M in (1, 8, 32)}
            except Exception as e:  # noqa: BLE001 - a variant that does not build is reported, not fatal
                print(f"| {name} | {K}->{N} ({G}) | {label} | {type(e).__name__} | | | | |", flush=True)
                continue
            worst = max(t[M] / t_def[M] for M in (1, 8, 32))
            print(f"| {name} | {K}->{N} ({G}) | {label} | {t[1]:.1f} | {t[8]:.1f} | {t[32]:.1f} | {worst:.2f} | "
                  f"{'yes' if inv else 'NOT INVARIANT'} |", flush=True)
            if inv:
                rows.append((worst, label, cfg, t))
        if saved is None:
            kgemm.GEMV_INVARIANT_TUNED.pop((N, K, G), None)
        else:
            kgemm.GEMV_INVARIANT_TUNED[(N, K, G)] = saved
        if rows:
            worst, label, cfg, t = min(rows, key=lambda r: r[0])
            paste.append(f"    ({N}, {K}, {G}): {cfg},  # {name}: {label}, M=1/8/32 {t[1]:.1f}/{t[8]:.1f}/"
                         f"{t[32]:.1f} µs = {worst:.2f}x the default at worst")
        del ws
        torch.cuda.empty_cache()
    print("\n`kernels.gemm.GEMV_INVARIANT_TUNED` (keys (N, K, G)):\n")
    print("```python\nGEMV_INVARIANT_TUNED = {\n" + "\n".join(paste) + "\n}\n```")
    print(f"\ninvariant_sweep: {time.time() - t0:.0f} s")


def weights8_on(N: int, K: int, copies: int, device: str):
    """`weights8` on `device` (the interpreter sweep builds them on the CPU)."""
    if device == "cuda":
        return weights8(N, K, copies)
    out = []
    for _ in range(copies):
        w = (torch.randint(0, 0x7F, (N, K), dtype=torch.uint8) | (torch.randint(0, 2, (N, K), dtype=torch.uint8)
                                                                   << 7)).view(torch.float8_e4m3fn)
        s = torch.randint(118, 126, (-(-N // 128), K // 128), dtype=torch.uint8).view(torch.float8_e8m0fnu)
        out.append((w, s))
    return out


if __name__ == "__main__":
    sys.exit(main())
