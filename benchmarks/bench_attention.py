"""Decode sparse attention and indexer-scan benchmark at DeepSeek-V4 Flash/Pro shapes (H200), plus the index-set
builders the GPU tests share (STYLE §12).

Run: `PYTHONPATH=. python benchmarks/bench_attention.py --markdown out.md [--what attn,indexer,select]`
("select": the whole CSA selection, scores + top-k, issue 14; see `bench_selection`).

Shapes: Flash = 64 heads, window 128 + top-512 (CSA); Pro = 128 heads, window 128 + top-1024; hd 512 bf16,
batch 1-64, contexts 4k and 64k (the context only sizes the pool the top-k is drawn from). Indexer: 64 heads x 128,
n = context/4 keys. Bytes counted: every valid gathered KV row once (hd·2 B), q, o, idx (attention); keys, q,
weights, fp32 scores (indexer). Copy bandwidth = (read + write bytes) / time of a 1 GiB device-to-device copy in
the same run. Timing (benchmarks/graph_timing.py): "eager µs" = one launcher call under do_bench (L2 flushed;
host time when the launcher outlasts its kernels); "graph µs" = GPU time per call from a CUDA graph with an L2
flush before each call, flush subtracted (the GB/s and % columns use it); "hot µs" = graph replay back to back.
The launcher runs with its default `check_idx=False` (no host sync, in-kernel range guard). "best" = config
with the lowest graph µs. A speedup (reference eager µs ÷ Triton eager µs of the same config, and reference
eager µs ÷ best graph µs) is printed only for cases whose Triton output matched the reference (bf16 tolerance).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from kernels.attention import sparse_attn, sparse_attn_ref
from kernels.indexer import indexer_scores, indexer_scores_ref, indexer_select, indexer_topk, indexer_topk_ref

WINDOW = 128
HD = 512


def window_slots(pos: torch.Tensor) -> torch.Tensor:
    """Decode ring slots for query positions pos [b] (spec §5 index plumbing): all 128 slots once pos >= 127,
    else slots 0..pos then -1. Returns int64 [b, 128]."""
    j = torch.arange(WINDOW, device=pos.device)
    return torch.where((pos[:, None] >= WINDOW - 1) | (j[None, :] <= pos[:, None]), j[None, :], -1)


def decode_case(contexts: list[int], heads: int, kind: str, topk: int = 0, dtype=torch.bfloat16,
                device="cuda", generator: torch.Generator | None = None):
    """One decode step per sequence; sequence i has `contexts[i]` tokens including the current one.

    kind: "swa" (window only), "hca" (window + all entries w < c//128), "csa" (window + indexer top-k of the
    c//4 entries, picks from random scores via `indexer_topk_ref`, -1 padded). KV = [window ring | entries],
    compressed slot values = entry + 128. Returns (q [b,1,h,512], kv [b,128+E,512], sink [h] fp32,
    idx int64 [b,1,128+K]).
    """
    g = generator
    c = torch.tensor(contexts, device=device)
    b = len(contexts)
    ratio = {"swa": 0, "hca": 128, "csa": 4}[kind]
    n_ent = (c // ratio) if ratio else torch.zeros_like(c)
    e_max = int(n_ent.max())
    q = torch.randn(b, 1, heads, HD, device=device, generator=g).to(dtype)
    kv = torch.randn(b, WINDOW + e_max, HD, device=device, generator=g).to(dtype)
    sink = torch.randn(heads, device=device, generator=g)
    parts = [window_slots(c - 1)]
    if kind == "hca":
        w = torch.arange(e_max, device=device)
        parts.append(torch.where(w[None, :] < n_ent[:, None], w[None, :] + WINDOW, -1))
    elif kind == "csa":
        scores = torch.randn(b, 1, e_max, device=device, generator=g)
        picks = indexer_topk_ref(scores, topk, n_ent[:, None])[:, 0]
        parts.append(torch.where(picks >= 0, picks + WINDOW, -1))
    return q, kv, sink, torch.cat(parts, dim=1)[:, None, :]


def prefill_case(seqlen: int, heads: int, kind: str, topk: int = 0, dtype=torch.bfloat16, device="cuda",
                 generator: torch.Generator | None = None):
    """One prefill of `seqlen` tokens (batch 1), official plumbing: KV = [raw tokens | entries], window slots are
    positions max(0,t-127)..t (-1 before 0), entries offset by seqlen; HCA w < (t+1)//128, CSA top-k of (t+1)//4."""
    g = generator
    ratio = {"swa": 0, "hca": 128, "csa": 4}[kind]
    e = seqlen // ratio if ratio else 0
    q = torch.randn(1, seqlen, heads, HD, device=device, generator=g).to(dtype)
    kv = torch.randn(1, seqlen + e, HD, device=device, generator=g).to(dtype)
    sink = torch.randn(heads, device=device, generator=g)
    t = torch.arange(seqlen, device=device)
    pos = t[:, None] - (WINDOW - 1) + torch.arange(WINDOW, device=device)[None, :]
    parts = [torch.where(pos >= 0, pos, -1)]
    n_valid = (t + 1) // ratio if ratio else None
    if kind == "hca":
        w = torch.arange(e, device=device)
        parts.append(torch.where(w[None, :] < n_valid[:, None], w[None, :] + seqlen, -1))
    elif kind == "csa":
        scores = torch.randn(1, seqlen, e, device=device, generator=g)
        picks = indexer_topk_ref(scores, topk, n_valid[None, :])[0]
        parts.append(torch.where(picks >= 0, picks + seqlen, -1))
    return q, kv, sink, torch.cat(parts, dim=1)[None]


def attn_bytes(q, idx) -> int:
    rows = int((idx >= 0).sum())
    return rows * HD * 2 + 2 * q.numel() * q.element_size() + idx.numel() * idx.element_size()


# (label, sparse_attn keyword arguments). "default" = the launcher's defaults (path = `default_path`);
# "blocks ..." = the 16-head-block kernel (`_sparse_attn_kernel`, the kernel before issue 14 item 1);
# "heads ..." = `_sparse_decode_kernel` (64 heads per program). Keys: bh block_h, bn block_n, w num_warps,
# sp num_splits, dv output columns per program, no-pf prefetch=False, st num_stages.
CONFIGS = [("default", {}),
           ("blocks", dict(path="blocks")),
           ("blocks bh16 bn32 w4 sp2", dict(path="blocks", block_h=16, block_n=32, num_warps=4, num_splits=2)),
           ("heads", dict(path="heads")),
           ("heads st3", dict(path="heads", num_stages=3)),
           ("heads no-pf st3", dict(path="heads", prefetch=False, num_stages=3)),
           ("heads sp1", dict(path="heads", num_splits=1)),
           ("heads sp2", dict(path="heads", num_splits=2)),
           ("heads sp4", dict(path="heads", num_splits=4)),
           ("heads sp8", dict(path="heads", num_splits=8)),
           ("heads dv256", dict(path="heads", dv=256)),
           ("heads bn16", dict(path="heads", block_n=16)),
           ("heads dv128 w4", dict(path="heads", dv=128, num_warps=4))]


def smoke_us(fn) -> float:
    """Wall-clock µs of one call after one warm-up: the --smoke run under TRITON_INTERPRET=1 only checks that
    this script works; it is not a measurement."""
    import time
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


class Timing:
    """eager µs and (graph cold µs, graph hot µs) of a call: benchmarks/graph_timing.py on CUDA, wall clock
    (graph columns = eager) under --smoke."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        if self.cuda:
            from benchmarks.graph_timing import GraphTimer
            self.timer = GraphTimer()

    def eager(self, fn) -> float:
        if self.cuda:
            from benchmarks.graph_timing import eager_us
            return eager_us(fn)
        return smoke_us(fn)

    def graph(self, fn, estimate_us: float) -> tuple[float, float]:
        if self.cuda:
            return self.timer.time(fn, estimate_us)
        t = smoke_us(fn)
        return t, t


def bench_attention(emit, copy_bw: float, batches, contexts, timing: Timing, device="cuda", configs=None) -> None:
    """One row per (model, ctx, batch): the default config (eager and graph µs), the "blocks" kernel's default
    in the same run, and the best of `configs` by graph µs; every config's graph µs is printed to stdout."""
    from dsv4.testing import assert_close
    gen = torch.Generator(device=device).manual_seed(0)
    for name, heads, topk in (("Flash", 64, 512), ("Pro", 128, 1024)):
        for ctx in contexts:
            for b in batches:
                q, kv, sink, idx = decode_case([ctx] * b, heads, "csa", topk, device=device, generator=gen)
                scale = HD ** -0.5
                ref = sparse_attn_ref(q, kv, sink, idx, scale)
                t_ref = timing.eager(lambda: sparse_attn_ref(q, kv, sink, idx, scale))
                results = {}  # label -> (graph µs, hot µs)
                ok = True
                t_eager = float("nan")
                for label, kw in configs or CONFIGS:
                    call = lambda kw=kw: sparse_attn(q, kv, sink, idx, scale, **kw)  # noqa: E731
                    try:
                        out = call()
                    except Exception as exc:  # a config that does not compile/fit is reported, not hidden
                        print(f"  config {label} failed for {name} b={b}: {type(exc).__name__}: {exc}"[:300])
                        continue
                    try:
                        assert_close(out, ref, f"sparse_attn {name} b={b} cfg={label}", dtype=torch.bfloat16)
                    except AssertionError as exc:
                        ok = False
                        print(f"  WRONG: {exc}"[:300])
                    if label == "default":
                        t_eager = timing.eager(call)
                    results[label] = timing.graph(call, 20.0)
                    print(f"  {name} ctx={ctx} b={b} {label}: graph {results[label][0]:.1f} µs, hot "
                          f"{results[label][1]:.1f} µs", flush=True)
                nbytes = attn_bytes(q, idx)
                if not results:
                    emit(("attn", name, b, ctx, "-", "all configs failed") + ("",) * 10 + ("no",))
                    continue
                nan2 = (float("nan"), float("nan"))
                g_def = results.get("default", nan2)[0]
                g_old = results.get("blocks", nan2)[0]
                best = min(results, key=lambda k: results[k][0])
                g, hot = results[best]
                old_best = min((k for k in results if k.startswith("blocks")), key=lambda k: results[k][0],
                               default=None)
                g_old_best = results[old_best][0] if old_best else float("nan")

                def pct(us):
                    return f"{nbytes / (us * 1e-6) / 1e9 / copy_bw:.0%}" if us > 0 else "-"
                emit(("attn", name, b, ctx, f"{nbytes / 1e6:.2f}", f"{t_eager:.1f}", f"{g_def:.1f}", pct(g_def),
                      f"{g_old:.1f}", f"{g_old_best:.1f}", pct(g_old_best), f"{g:.1f} / {hot:.1f} ({best})", pct(g),
                      f"{g_old_best / g_def:.2f}x", f"{t_ref:.1f}", f"{t_ref / g_def:.1f}x" if ok else "-",
                      "yes" if ok else "NO"))


def _indexer_inputs(b: int, n: int, gen: torch.Generator, device) -> tuple:
    """Decode-shaped indexer inputs (Flash: 64 heads x 128): q [b, 1, 64, 128] bf16, weights [b, 1, 64] fp32 at
    the model's scale (head_dim^-0.5 * n_heads^-0.5), keys [b, n, 128] bf16."""
    q = torch.randn(b, 1, 64, 128, device=device, generator=gen).bfloat16()
    w = torch.randn(b, 1, 64, device=device, generator=gen) * (128 ** -0.5 * 64 ** -0.5)
    k = torch.randn(b, n, 128, device=device, generator=gen).bfloat16()
    return q, w, k


def bench_indexer(emit, copy_bw: float, batches, contexts, timing: Timing, device="cuda") -> None:
    from dsv4.testing import assert_close
    gen = torch.Generator(device=device).manual_seed(1)
    for ctx in contexts:
        for b in batches:
            n = ctx // 4
            q, w, k = _indexer_inputs(b, n, gen, device)
            ref = indexer_scores_ref(q, w, k)
            out = indexer_scores(q, w, k)
            try:
                assert_close(out, ref, "indexer_scores", dtype=torch.float32, rtol=1e-4,
                             atol=1e-4 * float(ref.abs().max()))
                ok = True
            except AssertionError as exc:
                ok = False
                print(f"  WRONG: {exc}"[:300])
            call = lambda: indexer_scores(q, w, k)  # noqa: E731
            t = timing.eager(call)
            g, hot = timing.graph(call, t)
            t_ref = timing.eager(lambda: indexer_scores_ref(q, w, k))
            topk = min(512, n)
            t_topk = timing.eager(lambda: indexer_topk_ref(out, topk, check=False))
            nbytes = k.numel() * 2 + q.numel() * 2 + w.numel() * 4 + out.numel() * 4
            gbs = nbytes / (g * 1e-6) / 1e9 if g > 0 else float("nan")
            emit(("indexer", "64x128", b, ctx, f"{nbytes / 1e6:.2f}", f"{t:.1f}", f"{g:.1f}",
                  f"hot {hot:.1f}; top-{topk} ref eager {t_topk:.1f}", f"{gbs:.0f}", f"{gbs / copy_bw:.0%}",
                  f"{t_ref:.1f}", f"{t_ref / t:.1f}x" if ok else "-", f"{t_ref / g:.1f}x" if ok else "-",
                  "yes" if ok else "NO"))


def bench_selection(emit_line, copy_bw: float, batches, contexts, timing: Timing, device="cuda") -> None:
    """The whole CSA selection (issue 14): decode, one query per sequence, all ctx/4 entries causal.
    Columns: "one launch" = `indexer_select` (scores + top-k); "2 launches" = `indexer_scores` then
    `indexer_topk`; "top-k" = `indexer_topk` alone on given scores; reference = `indexer_scores_ref` +
    `indexer_topk_ref(check=False)` (eager µs, and graph µs when it captures). MB = keys + q + weights read
    and idx written once (the fp32 scores stay in L2: not counted). Speedups only when the picks equal
    `indexer_topk_ref` on the kernel's own scores and the scores match the reference (fp32 tolerance)."""
    from dsv4.testing import assert_close, assert_equal
    cols = ("topk", "batch", "ctx", "MB", "one launch graph / hot µs", "one launch 16 warps graph µs",
            "2 launches graph µs", "top-k graph µs", "top-k unsorted graph µs", "ref top-k graph µs", "% of copy (one launch)", "ref eager µs",
            "ref graph µs", "× ref eager (one launch graph)", "× ref graph", "correct")
    for line in ("", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)):
        emit_line(line)
    gen = torch.Generator(device=device).manual_seed(2)
    for topk in (512, 1024):
        for ctx in contexts:
            for b in batches:
                n = ctx // 4
                q, w, k = _indexer_inputs(b, n, gen, device)
                nv = torch.full((b, 1), n, device=device, dtype=torch.int64)
                kk = min(topk, n)
                sc = torch.empty(b, 1, n, device=device)
                ref = lambda: indexer_topk_ref(indexer_scores_ref(q, w, k), kk, nv, check=False)  # noqa: E731
                one = lambda: indexer_select(q, w, k, kk, nv, scores=sc)  # noqa: E731
                two = lambda: indexer_topk(indexer_scores(q, w, k), kk, nv)  # noqa: E731
                scores = indexer_scores(q, w, k)
                alone = lambda: indexer_topk(scores, kk, nv)  # noqa: E731
                ref_alone = lambda: indexer_topk_ref(scores, kk, nv, check=False)  # noqa: E731
                one16 = lambda: indexer_select(q, w, k, kk, nv, scores=sc, num_warps=16)  # noqa: E731
                unsorted = lambda: indexer_topk(scores, kk, nv, sorted_picks=False)  # noqa: E731
                try:
                    got = one()
                    assert_close(sc, indexer_scores_ref(q, w, k), "scores", dtype=torch.float32, rtol=1e-4,
                                 atol=1e-4 * float(sc.abs().max()))
                    assert_equal(got, indexer_topk_ref(sc, kk, nv), "select picks")
                    assert_equal(alone(), indexer_topk_ref(scores, kk, nv), "top-k picks")
                    assert_equal(one16(), got, "select picks (16 warps)")
                    assert_equal(unsorted(), got.sort(-1).values, "unsorted picks (all valid: no -1)")
                    ok = True
                except AssertionError as exc:
                    ok = False
                    print(f"  WRONG: {exc}"[:300])
                t_ref = timing.eager(ref)
                try:
                    g_ref = timing.graph(ref, t_ref)[0]
                except Exception as exc:  # recorded, never hidden
                    print(f"  reference graph capture failed: {type(exc).__name__}: {exc}"[:200])
                    g_ref = float("nan")
                g1, h1 = timing.graph(one, 20.0)
                g2, _ = timing.graph(two, 20.0)
                ga, _ = timing.graph(alone, 10.0)
                g16, _ = timing.graph(one16, 20.0)
                gu, _ = timing.graph(unsorted, 10.0)
                try:
                    gra = f"{timing.graph(ref_alone, 100.0)[0]:.1f}"
                except Exception as exc:
                    gra = f"capture error {type(exc).__name__}"
                nbytes = k.numel() * 2 + q.numel() * 2 + w.numel() * 4 + b * kk * 8
                gbs = nbytes / (g1 * 1e-6) / 1e9 if g1 > 0 else float("nan")
                emit_line("| " + " | ".join(str(x) for x in (
                    topk, b, ctx, f"{nbytes / 1e6:.2f}", f"{g1:.1f} / {h1:.1f}", f"{g16:.1f}", f"{g2:.1f}",
                    f"{ga:.1f}", f"{gu:.1f}", gra,
                    f"{gbs / copy_bw:.0%}", f"{t_ref:.1f}", f"{g_ref:.1f}",
                    f"{t_ref / g1:.1f}x" if ok else "-", f"{g_ref / g1:.1f}x" if ok else "-",
                    "yes" if ok else "NO")) + " |")


def copy_bandwidth(device="cuda") -> float:
    """GB/s of a 1 GiB device-to-device copy (16 MiB in --smoke), counting read + write."""
    if device == "cuda":
        from benchmarks.graph_timing import copy_bandwidth as cuda_copy_bandwidth
        return cuda_copy_bandwidth()
    x = torch.empty(1 << 24, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() / (smoke_us(lambda: y.copy_(x)) * 1e-6) / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", help="write the result table here")
    p.add_argument("--batches", default="1,4,16,32,64")
    p.add_argument("--contexts", default="4096,65536")
    p.add_argument("--what", default="attn,indexer,select", help="tables to run: attn, indexer, select")
    p.add_argument("--configs", default="all", help="attention configs: 'all' or comma-separated CONFIGS labels")
    p.add_argument("--smoke", action="store_true",
                   help="CPU under TRITON_INTERPRET=1: batch 1, context 4096, default config only; checks the script")
    a = p.parse_args(argv)
    device = "cpu" if a.smoke else "cuda"
    if a.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        print("bench_attention: --smoke needs TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    if not a.smoke and not torch.cuda.is_available():
        print("bench_attention: CUDA is required (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    import triton
    batches = [1] if a.smoke else [int(x) for x in a.batches.split(",")]
    contexts = [4096] if a.smoke else [int(x) for x in a.contexts.split(",")]
    bw = copy_bandwidth(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (TRITON_INTERPRET=1 smoke, not a measurement)"
    head = (f"device {name}, torch {torch.__version__}, triton {triton.__version__}; "
            f"copy bandwidth {bw:.0f} GB/s (1 GiB D2D, read+write)")
    cols = ("op", "shape", "batch", "ctx", "MB moved", "default eager µs", "default graph µs", "default % of copy",
            "blocks default graph µs", "blocks best graph µs", "blocks best % of copy",
            "best graph / hot µs (config)", "best % of copy", "default × blocks best", "ref eager µs", "× ref eager (default graph)", "correct")
    out = open(a.markdown, "w") if a.markdown else None

    def emit_line(line: str) -> None:
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    emit_line(head)

    def emit(row) -> None:
        emit_line("| " + " | ".join(str(x) for x in row) + " |")

    timing = Timing(device)
    what = a.what.split(",")
    if "attn" in what:
        for line in ("", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)):
            emit_line(line)
        bench_attention(emit, bw, batches, contexts, timing, device,
                        configs=CONFIGS[:2] if a.smoke else (None if a.configs == "all" else
                                                                 [c for c in CONFIGS if c[0] in a.configs.split(",")]))
    if "indexer" in what:
        icols = ("op", "shape", "batch", "ctx", "MB moved", "eager µs", "graph µs", "hot µs; top-k ref eager µs",
                 "GB/s (graph)", "of copy BW", "ref eager µs", "× ref eager", "× ref (graph)", "correct")
        for line in ("", "| " + " | ".join(icols) + " |", "|" + "---|" * len(icols)):
            emit_line(line)
        bench_indexer(emit, bw, batches, contexts, timing, device)
    if "select" in what:
        bench_selection(emit_line, bw, batches, contexts, timing, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
