"""Benchmark the Triton mHC kernels (hc_pre, hc_post, hc_head) against the bandwidth floor (CUDA only).

Shapes: decode T ∈ {1, 8, 64, 256} and prefill T = 4096 at D ∈ {4096, 7168}, hc = 4, bf16 streams.
Ops: hc_pre, hc_post, hc_head, and (issue 14) the layer boundary hc_post_pre forced to one launch, as
hc_post + hc_pre (its fallback), and one launch with 8 warps / a 2048-wide collapse; `--ops` selects.
"hc_pre (tf32x3, before)" / "hc_head (tf32x3, before)": the same launchers with the projection used before
issue 14 item 2 (tf32x3 dot, `kernels.mhc._mix_sites(dot="tf32x3")`), selected by `--ops hc_pre` / `hc_head`
too. `--sweep`: the prefill projection's tiles instead (`SWEEP`, graph µs of the whole call).
Per call (see benchmarks/graph_timing.py): "eager µs" = one launcher call timed by do_bench (L2 flushed; host
time when the launcher's Python outlasts its kernels); "graph µs" = GPU time per call from a CUDA graph of the
call with an L2 flush before each call, flush time subtracted; "hot µs" = graph replay back to back, L2 warm.
Bytes actually required (read H, fn and small params once, write outputs once), achieved GB/s from graph µs and
its share of a device-to-device copy bandwidth measured in the same run, GPU kernels launched per call
(torch.profiler), and the speedup against the eager reference: "× ref eager" = ref eager µs ÷ Triton eager µs;
"× ref graph" = ref graph µs ÷ Triton graph µs (both GPU time). Optional: `torch.compile(dynamic=True)` of
the reference within a time budget. Each row is checked against the reference (tests/gpu tolerances) before
it is timed; a failing row says so and shows no speedup.

Usage:  PYTHONPATH=. python benchmarks/bench_mhc.py [--markdown FILE] [--compile-budget-s 0] [--ts 1,8,64]
        PYTHONPATH=. python benchmarks/bench_mhc.py --sweep --ts 4096
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import triton

from benchmarks.graph_timing import GraphTimer, copy_bandwidth, eager_us
from dsv4.testing import assert_close
from kernels.mhc import (ONE_LAUNCH_MAX_T, _mix_sites, hc_head, hc_head_ref, hc_post, hc_post_pre,
                         hc_post_pre_ref, hc_post_ref, hc_pre, hc_pre_ref)

HC, ITERS, EPS = 4, 20, 1e-6
TS = [1, 8, 64, 256, 4096]
DS = [4096, 7168]


def kernels_per_call(fn) -> int:
    """GPU kernels launched by one call (profiled after warm-up)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def cases(T: int, D: int, device: str = "cuda"):
    """(op, triton launcher, reference, args, kwargs, bytes required, checker) for the three sites at one shape."""
    K, e = HC * D, 2
    H = torch.randn(T, HC, D, device=device).bfloat16()
    a = torch.randn(T, D, device=device).bfloat16()
    fn = torch.randn((2 + HC) * HC, K, device=device) / math.sqrt(K)
    base, scale = torch.randn((2 + HC) * HC, device=device) * 0.5, torch.rand(3, device=device) + 0.5
    fh, bh, sh = torch.randn(HC, K, device=device) / math.sqrt(K), torch.randn(HC, device=device), \
        torch.rand(1, device=device) + 0.5
    kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    _, post, comb = hc_pre_ref(H, fn, base, scale, **kw)
    pre_bytes = T * K * e + fn.numel() * 4 + 27 * 4 + T * D * e + T * (HC + HC * HC) * 4
    post_bytes = T * D * e + T * K * e + T * (HC + HC * HC) * 4 + T * K * e
    head_bytes = T * K * e + fh.numel() * 4 + 5 * 4 + T * D * e

    def check_pre(got, want):
        for name, g, w in zip(("x", "post", "comb"), got, want):
            assert_close(g, w, name)

    def check_one(name):
        return lambda g, w: assert_close(g, w, name)

    fn2 = torch.randn((2 + HC) * HC, K, device=device) / math.sqrt(K)
    boundary_args = (a, H, post, comb, fn2, base, scale)
    boundary_bytes = post_bytes + fn2.numel() * 4 + 27 * 4 + T * D * e + T * (HC + HC * HC) * 4

    def check_boundary(got, want):  # H_new vs hc_post_ref; the rest vs hc_pre_ref of the kernel's own H_new
        assert_close(got[0], want[0], "H_new")
        for name, g, w in zip(("x", "post", "comb"), got[1:], hc_pre_ref(got[0], fn2, base, scale, **kw)):
            assert_close(g, w, name)

    def two_launches(*args, **kwargs):
        return hc_post_pre(*args, one_launch=False, **kwargs)

    def fused_8w(*args, **kwargs):
        return hc_post_pre(*args, one_launch=True, num_warps=8, block_d=2048, **kwargs)

    def pre_tf32x3(H, fn, base, scale, **k):  # the projection before issue 14 item 2 (tf32x3 on bf16 H)
        out = (torch.empty(T, D, dtype=H.dtype, device=device), torch.empty(T, HC, device=device),
               torch.empty(T, HC, HC, device=device))
        _mix_sites(H, fn, base, scale, *out, k["sinkhorn_iters"], k["hc_eps"], k["norm_eps"], False,
                   T <= ONE_LAUNCH_MAX_T, dot="tf32x3")
        return out

    def head_tf32x3(H, fn, base, scale, **k):
        y = torch.empty(T, D, dtype=H.dtype, device=device)
        _mix_sites(H, fn, base, scale, y, None, None, 1, k["hc_eps"], k["norm_eps"], True, T <= ONE_LAUNCH_MAX_T,
                   dot="tf32x3")
        return y

    return [
        ("hc_pre", hc_pre, hc_pre_ref, (H, fn, base, scale), kw, pre_bytes, check_pre),
        ("hc_pre (tf32x3, before)", pre_tf32x3, hc_pre_ref, (H, fn, base, scale), kw, pre_bytes, check_pre),
        ("hc_head (tf32x3, before)", head_tf32x3, hc_head_ref, (H, fh, bh, sh), dict(hc_eps=EPS, norm_eps=EPS),
         head_bytes, check_one("y")),
        ("hc_post", hc_post, hc_post_ref, (a, H, post, comb), {}, post_bytes, check_one("H_new")),
        ("hc_head", hc_head, hc_head_ref, (H, fh, bh, sh), dict(hc_eps=EPS, norm_eps=EPS), head_bytes,
         check_one("y")),
        ("hc_post_pre", lambda *x, **k: hc_post_pre(*x, one_launch=True, **k), hc_post_pre_ref, boundary_args, kw,
         boundary_bytes, check_boundary),
        ("hc_post+hc_pre (2 launches)", two_launches, hc_post_pre_ref, boundary_args, kw, boundary_bytes,
         check_boundary),
        ("hc_post_pre (8 warps, BD 2048)", fused_8w, hc_post_pre_ref, boundary_args, kw, boundary_bytes,
         check_boundary),
    ]


SWEEP = [(64, 64, 2, 4, 3), (64, 128, 2, 4, 3), (128, 64, 2, 8, 4), (64, 64, 4, 4, 4), (128, 128, 1, 8, 3)]


def sweep(T: int, ds: list[int], tiles: list[tuple], timer: GraphTimer, bw: float, emit) -> None:
    """Prefill projection tiles (BT, BK, waves, num_warps, num_stages) of the two-launch bf16x3 path: graph µs
    (cold L2) of the whole hc_pre / hc_head call, % of copy, each checked against the reference first."""
    emit(f"\n| op | D | T | tiles (BT, BK, waves, warps, stages) | graph µs | % of copy | correct |\n"
         "|---|---|---|---|---|---|---|")
    for D in ds:
        for op, _, ref_fn, fargs, fkw, nbytes, check in cases(T, D):
            if op not in ("hc_pre", "hc_head"):
                continue
            head = op == "hc_head"
            H, fn, base, scale = fargs
            outs = ((torch.empty(T, D, dtype=H.dtype, device="cuda"),) if head else
                    (torch.empty(T, D, dtype=H.dtype, device="cuda"), torch.empty(T, HC, device="cuda"),
                     torch.empty(T, HC, HC, device="cuda")))
            for tiles_ in tiles:
                def call(t=tiles_):
                    if head:
                        _mix_sites(H, fn, base, scale, outs[0], None, None, 1, EPS, EPS, True, False, tiles=t)
                        return outs[0]
                    _mix_sites(H, fn, base, scale, *outs, ITERS, EPS, EPS, False, False, tiles=t)
                    return outs
                try:
                    check(call(), ref_fn(*fargs, **fkw))
                    ok = "yes"
                except Exception as err:  # a tile that fails to compile or to match is recorded, never hidden
                    emit(f"| {op} | {D} | {T} | {tiles_} | - | - | NO: {type(err).__name__} {str(err)[:100]} |")
                    continue
                g, _ = timer.time(call, 100.0)
                gbs = nbytes / (g * 1e-6) / 1e9
                emit(f"| {op} | {D} | {T} | {tiles_} | {g:.1f} | {100 * gbs / bw:.0f}% | {ok} |")
        torch.cuda.empty_cache()


def compiled_refs():
    opts = dict(dynamic=True)
    return {"hc_pre": torch.compile(hc_pre_ref, **opts), "hc_post": torch.compile(hc_post_ref, **opts),
            "hc_head": torch.compile(hc_head_ref, **opts), "hc_post_pre": torch.compile(hc_post_pre_ref, **opts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", help="write the table here (row by row, so a killed run keeps its rows)")
    ap.add_argument("--compile-budget-s", type=float, default=0.0,
                    help="measure torch.compile of the reference until this many seconds have gone (0: never)")
    ap.add_argument("--ts", default=",".join(map(str, TS)), help="token counts T")
    ap.add_argument("--ds", default=",".join(map(str, DS)), help="model widths D")
    ap.add_argument("--ops", default="", help="comma-separated op names to run (default: all)")
    ap.add_argument("--sweep", action="store_true",
                    help="instead: prefill projection tiles of hc_pre / hc_head at the first T (graph µs)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mhc.py needs a CUDA GPU; none is visible")
    assert not torch.backends.cuda.matmul.allow_tf32
    start = time.time()
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    timer = GraphTimer()
    head = [f"device: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
            f"triton {triton.__version__}, CUDA {torch.version.cuda}",
            f"measured copy bandwidth (1 GiB D2D, read+write): {bw:.0f} GB/s", "",
            "| op | D | T | eager µs | graph µs | hot µs | MB required | GB/s (graph) | % of copy "
            "| kernels/call (triton, ref) | ref eager µs | × ref eager | ref graph µs | × ref graph "
            "| compile µs | correct |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    out = open(args.markdown, "w") if args.markdown else None

    def emit(line):
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    for line in head:
        emit(line)
    if args.sweep:
        sweep(int(args.ts.split(",")[0]), list(map(int, args.ds.split(","))), SWEEP, timer, bw, emit)
        emit(f"\ntotal sweep wall time {time.time() - start:.0f} s")
        return
    comp = compiled_refs() if args.compile_budget_s > 0 else {}
    for D in map(int, args.ds.split(",")):
        for T in map(int, args.ts.split(",")):
            for op, tri_fn, ref_fn, fargs, fkw, nbytes, check in cases(T, D):
                if args.ops and op.split(" ")[0] not in args.ops.split(","):
                    continue
                tri = lambda f=tri_fn, x=fargs, k=fkw: f(*x, **k)  # noqa: E731
                ref = lambda f=ref_fn, x=fargs, k=fkw: f(*x, **k)  # noqa: E731
                try:
                    check(tri(), ref())
                    ok = "yes"
                except AssertionError as err:
                    ok = f"NO: {str(err)[:120]}"
                t_tri, t_ref = eager_us(tri), eager_us(ref)
                g_tri, h_tri = timer.time(tri, t_tri)
                try:
                    g_ref = f"{timer.time(ref, t_ref, max_calls=10)[0]:.1f}"
                except Exception as err:  # recorded, never hidden
                    g_ref = f"capture error {type(err).__name__}"
                try:
                    n_txt = f"{kernels_per_call(tri)}, {kernels_per_call(ref)}"
                except Exception as err:  # the profiler is optional evidence; say why it is missing
                    n_txt = f"profiler error {type(err).__name__}"
                if comp and op in comp and time.time() - start < args.compile_budget_s:
                    try:
                        c_txt = f"{eager_us(lambda f=comp[op], x=fargs, k=fkw: f(*x, **k)):.1f}"
                    except Exception as err:  # recorded in the table, never hidden
                        c_txt = f"compile error {type(err).__name__}: {str(err)[:80]}"
                else:
                    c_txt = "not run"
                good = ok == "yes"
                x_eager = f"{t_ref / t_tri:.1f}" if good else "-"
                x_graph = f"{float(g_ref) / g_tri:.1f}" if good and g_tri > 0 and g_ref[0].isdigit() else "-"
                gbs = nbytes / (g_tri * 1e-6) / 1e9 if g_tri > 0 else float("nan")
                emit(f"| {op} | {D} | {T} | {t_tri:.1f} | {g_tri:.1f} | {h_tri:.1f} | {nbytes / 1e6:.2f} | "
                     f"{gbs:.0f} | {100 * gbs / bw:.0f}% | {n_txt} | {t_ref:.1f} | {x_eager} | {g_ref} | "
                     f"{x_graph} | {c_txt} | {ok} |")
            torch.cuda.empty_cache()
    emit(f"\ntotal bench wall time {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
