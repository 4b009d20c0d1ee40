"""Where a decode step's and a prefill's GPU time goes, per kernel, at two depths (issue 27: profile before
optimising). Flash geometry, bf16, `weights="quantized"`, triton backend; one decode step at batch 1 / 8 / 32 on a
synthetic 4096-token state (a CUDA-graph replay, as `bench_model` times it; `--eager`: launched eagerly) and one
4096-token prefill, each under torch.profiler after a warm-up call, at
`--layers` 4 and 8: per kernel name, the GPU µs of the call at each depth and their difference divided by the
layers added (the per-layer cost; the head and the embedding cancel out), sorted by that.

    PYTHONPATH=. python benchmarks/layer_profile.py [--layers 4,8] [--batches 1,8,32] [--prefill 4096] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import CONFIGS, build, synthetic_state  # noqa: E402
from dsv4.config import ModelArgs  # noqa: E402


def kernel_times(fn) -> dict[str, tuple[int, float]]:
    """{kernel name: (launches, GPU µs)} of one call of fn (after one warm-up call)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    out: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rec = out[e.name[:70]]
            rec[0] += 1
            rec[1] += e.device_time
    return {k: (n, us) for k, (n, us) in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="4,8")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--eager", action="store_true", help="decode steps launched eagerly (no CUDA graph)")
    a = ap.parse_args(argv)
    lo, hi = (int(x) for x in a.layers.split(","))
    batches = [int(x) for x in a.batches.split(",") if x]
    full = ModelArgs.from_hf_config(CONFIGS["flash"])
    runs: dict = {}
    for n in (lo, hi):
        model = build(full.with_layers(n), "triton")
        if not a.eager:
            model.use_decode_graphs(a.ctx + 256)
        V = model.args.vocab_size
        for b in batches:
            st = synthetic_state(model, b, a.ctx)
            tok = torch.randint(0, V, (b, 1), device="cuda")
            pos = st.pos

            def step():
                st.pos = pos  # the same position every call
                model(tok, st)
            runs[(n, f"decode b={b}")] = kernel_times(step)
            del st
        if a.prefill:
            ids = torch.randint(0, V, (1, a.prefill), device="cuda")
            runs[(n, f"prefill {a.prefill}")] = kernel_times(lambda: model(ids, model.new_state(1)))
        del model
        gc.collect()
        torch.cuda.empty_cache()
    for what in [f"decode b={b}" for b in batches] + ([f"prefill {a.prefill}"] if a.prefill else []):
        A, B = runs[(lo, what)], runs[(hi, what)]
        rows = []
        for k in set(A) | set(B):
            na, ua = A.get(k, (0, 0.0))
            nb, ub = B.get(k, (0, 0.0))
            rows.append(((ub - ua) / (hi - lo), (nb - na) / (hi - lo), ua, ub, k))
        rows.sort(reverse=True)
        tot = sum(r[0] for r in rows)
        print(f"\n### {what}: GPU µs per layer {tot:.1f} (kernel sum, {lo} -> {hi} layers); "
              f"{sum(v[1] for v in A.values()):.0f} / {sum(v[1] for v in B.values()):.0f} µs at {lo} / {hi} layers\n")
        print("| kernel | per layer µs | launches per layer | share |\n|---|---:|---:|---:|")
        for per, cnt, ua, ub, k in rows[:a.top]:
            print(f"| `{k}` | {per:.1f} | {cnt:.2f} | {100 * per / tot:.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
