"""Per-kernel GPU time of the mHC prefill launchers (CUDA only): torch.profiler over 5 calls after warm-up.

Prints, for hc_pre / hc_head at T tokens and each D, every GPU kernel's name, calls and mean µs per call (L2
warm between calls: back-to-back calls). Shows which of the two prefill launches (mix, finish) dominates.

Usage:  PYTHONPATH=. python benchmarks/profile_mhc.py [--t 4096] [--ds 4096,7168]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from benchmarks.bench_mhc import cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", type=int, default=4096)
    ap.add_argument("--ds", default="4096,7168")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_mhc.py needs a CUDA GPU; none is visible")
    print("| op | D | T | kernel | calls | mean µs |\n|---|---|---|---|---|---|")
    for D in map(int, args.ds.split(",")):
        for op, tri_fn, _, fargs, fkw, _, _ in cases(args.t, D):
            if op.split(" ")[0] not in ("hc_pre", "hc_head"):  # the two prefill sites, new and before
                continue
            for _ in range(3):
                tri_fn(*fargs, **fkw)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    tri_fn(*fargs, **fkw)
                torch.cuda.synchronize()
            per = defaultdict(list)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per[e.name].append(e.time_range.elapsed_us())
            for name, ts in per.items():
                print(f"| {op} | {D} | {args.t} | {name[:60]} | {len(ts)} | {sum(ts) / len(ts):.1f} |", flush=True)


if __name__ == "__main__":
    main()
