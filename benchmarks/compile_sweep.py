"""Issue 29: Triton compiles (and first-call time) across a sweep of prefill lengths, decode positions and batch
sizes, on one GPU, Flash geometry (first `--layers` layers), bf16, weights="quantized", triton backend.

Run: `PYTHONPATH=. python benchmarks/compile_sweep.py [--warmup none|prefill256|full] [--lengths 1000,1001,...]
      [--decode] [--json out.json]`

  * warm-up: `none`; `prefill256` (the issue's: one 256-token prefill and 4 decode steps); `full` =
    `dsv4.warmup.warmup(model, ...)` (the documented warm-up; its time and compile count are printed).
  * per prefill length: wall time of the first, second and third call (synchronized), the compiles during the
    first call (`kernels.compiles.CompileLog`): kernel and the specialization that differs from the kernel's
    previous build; the caching allocator's new segments (cudaMalloc) in the first call and after it.
  * `--decode`: eager decode at many positions (a prefill, then steps), eager decode from synthetic states at
    several batch sizes, and CUDA-graph decode states (capture) at several batch sizes and max_len.
  * `--time4k`: median of 5 prefills of 4096 tokens (after the sweep).
  * `--profile-lengths 1500,1700`: after the sweep, for each of these (new) lengths, torch.profiler over the first
    and the second call; prints the ops whose host or GPU time differs most between the two (what a first call at a
    new length pays for that is not a compile).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_model import CONFIGS, build, synthetic_state  # noqa: E402
from dsv4.config import ModelArgs  # noqa: E402
from kernels.compiles import CompileLog  # noqa: E402

_LAST: dict[str, str] = {}


def _diff(name: str, spec: str) -> str:
    """The fields of `spec` that differ from the previous build of kernel `name` (all of it for a first build)."""
    prev = _LAST.get(name)
    _LAST[name] = spec
    if prev is None:
        return "first build: " + spec
    a, b = prev.split(", "), spec.split(", ")
    if len(a) != len(b):
        return spec
    return "; ".join(f"{x} -> {y}" for x, y in zip(a, b) if x != y)


def _note(log: CompileLog, quiet: bool = False) -> None:
    for e in log.events:
        d = _diff(e.name, e.spec)
        if not quiet:
            print(f"      {e.seconds:5.2f}s {e.name.split('.')[-1]}: {d}", flush=True)


def _call(fn) -> tuple[float, CompileLog]:
    torch.cuda.synchronize()
    with CompileLog() as log:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
    return t, log


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--warmup", choices=("none", "prefill256", "full"), default="prefill256")
    ap.add_argument("--lengths", default="1000,1001,1003,1500,2048,2049,3000,4096,4097,5000")
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--time4k", action="store_true")
    ap.add_argument("--profile-lengths", default="", help="profile the first and second call at these lengths")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    import triton
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=os.popen(f"git -C {ROOT} rev-parse --short HEAD 2>/dev/null").read().strip())
    print("==", meta, flush=True)
    args = ModelArgs.from_hf_config(CONFIGS["flash"]).with_layers(a.layers)
    t0 = time.perf_counter()
    model = build(args, "triton")
    torch.cuda.synchronize()
    print(f"== build {time.perf_counter() - t0:.1f}s", flush=True)
    V = args.vocab_size
    out: dict = {"meta": meta, "warmup": a.warmup, "prefill": {}, "decode": {}}
    if a.warmup == "prefill256":
        def w():
            st = model.new_state(1)
            model(torch.randint(0, V, (1, 256), device="cuda"), st)
            for _ in range(4):
                model(torch.randint(0, V, (1, 1), device="cuda"), st)
        t, log = _call(w)
        _note(log, quiet=True)
        print(f"== warm-up prefill256: {t:.1f}s, {log.count} compiles", flush=True)
        out["warmup_s"], out["warmup_compiles"] = t, log.count
    elif a.warmup == "full":
        from dsv4.warmup import warmup
        t, log = _call(lambda: print(warmup(model), flush=True))
        _note(log, quiet=True)
        print(f"== warm-up full: {t:.1f}s, {log.count} compiles ({log.seconds:.1f}s compiling)", flush=True)
        for k, n in sorted(log.by_kernel().items()):
            print(f"     {n:3d} {k}")
        out["warmup_s"], out["warmup_compiles"] = t, log.count
    print("== prefill sweep (length: first call, second call, compiles in the first)", flush=True)
    total = 0

    def segments() -> int:  # cudaMalloc calls of the caching allocator so far (a first call may grow the pool)
        return torch.cuda.memory_stats().get("segment.all.allocated", 0)

    for s in [int(x) for x in a.lengths.split(",") if x]:
        ids = torch.randint(0, V, (1, s), device="cuda")
        seg0 = segments()
        t1, log = _call(lambda: model(ids, model.new_state(1)))
        seg1 = segments()
        t2, log2 = _call(lambda: model(ids, model.new_state(1)))
        t3, log3 = _call(lambda: model(ids, model.new_state(1)))
        total += log.count + log2.count + log3.count
        print(f"  {s:6d}: {t1 * 1e3:9.1f} ms {t2 * 1e3:8.1f} ms {t3 * 1e3:8.1f} ms  compiles {log.count} "
              f"({log.seconds:.2f}s), new allocator segments {seg1 - seg0} / {segments() - seg1}"
              f"{' + ' + str(log2.count + log3.count) + ' later!' if log2.count + log3.count else ''}", flush=True)
        _note(log)
        out["prefill"][s] = dict(first_ms=t1 * 1e3, second_ms=t2 * 1e3, third_ms=t3 * 1e3, compiles=log.count,
                                 new_segments_first=seg1 - seg0, kernels=log.by_kernel())
    if a.decode:
        print("== eager decode: prefill 200, then 70 steps (positions 200..269)", flush=True)
        st = model.new_state(1)
        model(torch.randint(0, V, (1, 200), device="cuda"), st)
        n = 0
        for i in range(70):
            t, log = _call(lambda: model(torch.randint(0, V, (1, 1), device="cuda"), st))
            if log.count:
                print(f"  pos {st.pos - 1}: {log.count} compiles ({t * 1e3:.0f} ms)", flush=True)
                _note(log)
            n += log.count
        total += n
        out["decode"]["eager_positions"] = n
        for b in (1, 2, 3, 5, 8, 13, 16, 32):
            for ctx in (1024, 4096):
                st = synthetic_state(model, b, ctx)
                c = 0
                for i in range(3):
                    t, log = _call(lambda: model(torch.randint(0, V, (b, 1), device="cuda"), st))
                    c += log.count
                    if log.count:
                        print(f"  eager b={b} ctx={ctx} step {i}: {log.count} compiles ({t * 1e3:.0f} ms)",
                              flush=True)
                        _note(log)
                total += c
                out["decode"][f"eager_b{b}_ctx{ctx}"] = c
        print("== graph decode states (capture)", flush=True)
        for b, max_len in ((1, 4352), (8, 4352), (3, 8192), (32, 2048)):
            model.use_decode_graphs(max_len)
            st = model.new_state(b)

            def g():
                model(torch.randint(0, V, (b, 300), device="cuda"), st)
                for _ in range(3):
                    model(torch.randint(0, V, (b, 1), device="cuda"), st)
            t, log = _call(g)
            model.use_decode_graphs(None)
            print(f"  graph b={b} max_len={max_len}: {log.count} compiles ({t:.1f}s)", flush=True)
            _note(log)
            total += log.count
            out["decode"][f"graph_b{b}_{max_len}"] = log.count
            del st
    print(f"== TOTAL compiles after the warm-up: {total}", flush=True)
    out["total_after_warmup"] = total
    if a.time4k:
        ids = torch.randint(0, V, (1, 4096), device="cuda")
        ts = []
        for i in range(6):
            t, _ = _call(lambda: model(ids, model.new_state(1)))
            ts.append(t)
        print(f"== prefill 4096: median {statistics.median(ts[1:]) * 1e3:.1f} ms of {[round(x * 1e3, 1) for x in ts]}",
              flush=True)
        out["prefill4k_ms"] = statistics.median(ts[1:]) * 1e3
    for s in [int(x) for x in a.profile_lengths.split(",") if x]:
        out.setdefault("profiled", {})[s] = _profile_first(model, s)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


def _profile_first(model, s: int, rows: int = 12) -> dict:
    """torch.profiler over the first and the second prefill of length `s`; prints and returns the ops (by key) whose
    self host time or self GPU time differs most between the two calls (times in ms)."""
    from torch.profiler import ProfilerActivity, profile as tprof
    V = model.args.vocab_size
    with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):  # the profiler's own first-use cost
        model(torch.randint(0, V, (1, 8), device="cuda"), model.new_state(1))
        torch.cuda.synchronize()
    ids = torch.randint(0, V, (1, s), device="cuda")
    tabs, walls = [], []
    for _ in range(2):
        torch.cuda.synchronize()
        with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            t0 = time.perf_counter()
            model(ids, model.new_state(1))
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
        tabs.append({e.key: (e.count, e.self_cpu_time_total / 1e3, e.self_device_time_total / 1e3)
                     for e in p.key_averages()})
    a, b = tabs
    z = (0, 0.0, 0.0)
    keys = set(a) | set(b)
    res = {"wall_ms": walls, "host": [], "gpu": []}
    print(f"== profiled length {s}: first {walls[0]:.1f} ms, second {walls[1]:.1f} ms (under the profiler)", flush=True)
    for col, name in ((1, "host"), (2, "gpu")):
        for k in sorted(keys, key=lambda k: -abs(a.get(k, z)[col] - b.get(k, z)[col]))[:rows]:
            x, y = a.get(k, z), b.get(k, z)
            res[name].append((k, x, y))
            print(f"  {name:4s} {x[col]:9.2f} -> {y[col]:9.2f} ms  (n {x[0]} -> {y[0]})  {k[:100]}", flush=True)
    return res


if __name__ == "__main__":
    sys.exit(main())
