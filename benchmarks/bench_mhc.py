"""Benchmark the Triton mHC kernels (hc_pre, hc_post, hc_head) against the bandwidth floor (CUDA only).

Shapes: decode T ∈ {1, 8, 64, 256} and prefill T = 4096 at D ∈ {4096, 7168}, hc = 4, bf16 streams.
Per call: median time (triton.testing.do_bench, L2 flushed between reps), bytes actually required (read H, fn and
small params once, write outputs once), achieved GB/s and its share of a device-to-device copy bandwidth measured
in the same run, GPU kernels launched per call (torch.profiler), speedup against the eager reference and against
`torch.compile(dynamic=True)` of the reference. Each row is checked against the reference (tests/gpu tolerances)
before it is timed; a failing row says so and its speedups do not count.

Usage:  PYTHONPATH=. python benchmarks/bench_mhc.py [--markdown FILE] [--compile-budget-s 200]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import triton
from triton.testing import do_bench

from dsv4.testing import assert_close
from kernels.mhc import hc_head, hc_head_ref, hc_post, hc_post_ref, hc_pre, hc_pre_ref

HC, ITERS, EPS = 4, 20, 1e-6
TS = [1, 8, 64, 256, 4096]
DS = [4096, 7168]


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB: GB/s counting read + write."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9


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

    return [
        ("hc_pre", hc_pre, hc_pre_ref, (H, fn, base, scale), kw, pre_bytes, check_pre),
        ("hc_post", hc_post, hc_post_ref, (a, H, post, comb), {}, post_bytes, check_one("H_new")),
        ("hc_head", hc_head, hc_head_ref, (H, fh, bh, sh), dict(hc_eps=EPS, norm_eps=EPS), head_bytes,
         check_one("y")),
    ]


def compiled_refs():
    opts = dict(dynamic=True)
    return {"hc_pre": torch.compile(hc_pre_ref, **opts), "hc_post": torch.compile(hc_post_ref, **opts),
            "hc_head": torch.compile(hc_head_ref, **opts)}


def bench(fn) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3  # µs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", help="write the table here (row by row, so a killed run keeps its rows)")
    ap.add_argument("--compile-budget-s", type=float, default=200.0,
                    help="stop measuring torch.compile once this many seconds have gone (rows say 'skipped')")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mhc.py needs a CUDA GPU; none is visible")
    assert not torch.backends.cuda.matmul.allow_tf32
    start = time.time()
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    head = [f"device: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
            f"triton {triton.__version__}, CUDA {torch.version.cuda}",
            f"measured copy bandwidth (1 GiB D2D, read+write): {bw:.0f} GB/s", "",
            "| op | D | T | triton µs | MB required | GB/s | % of copy | kernels/call (triton, eager) "
            "| eager µs | × eager | compile µs | × compile | correct |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    out = open(args.markdown, "w") if args.markdown else None

    def emit(line):
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    for line in head:
        emit(line)
    comp = compiled_refs()
    for D in DS:
        for T in TS:
            for op, tri_fn, ref_fn, fargs, fkw, nbytes, check in cases(T, D):
                tri = lambda f=tri_fn, x=fargs, k=fkw: f(*x, **k)  # noqa: E731
                ref = lambda f=ref_fn, x=fargs, k=fkw: f(*x, **k)  # noqa: E731
                try:
                    check(tri(), ref())
                    ok = "yes"
                except AssertionError as err:
                    ok = f"NO: {str(err)[:120]}"
                t_tri, t_ref = bench(tri), bench(ref)
                try:
                    n_txt = f"{kernels_per_call(tri)}, {kernels_per_call(ref)}"
                except Exception as err:  # the profiler is optional evidence; say why it is missing
                    n_txt = f"profiler error {type(err).__name__}"
                if time.time() - start < args.compile_budget_s:
                    try:
                        t_c = bench(lambda f=comp[op], x=fargs, k=fkw: f(*x, **k))
                        c_txt, cx_txt = f"{t_c:.1f}", f"{t_c / t_tri:.1f}"
                    except Exception as err:  # recorded in the table, never hidden
                        c_txt, cx_txt = f"compile error {type(err).__name__}: {str(err)[:80]}", "-"
                else:
                    c_txt = cx_txt = "skipped (time budget)"
                gbs = nbytes / (t_tri * 1e-6) / 1e9
                emit(f"| {op} | {D} | {T} | {t_tri:.1f} | {nbytes / 1e6:.2f} | {gbs:.0f} | {100 * gbs / bw:.0f}% | "
                     f"{n_txt} | {t_ref:.1f} | {t_ref / t_tri:.1f} | {c_txt} | {cx_txt} | {ok} |")
            torch.cuda.empty_cache()
    emit(f"\ntotal bench wall time {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
