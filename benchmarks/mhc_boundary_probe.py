"""Probe (issue 27): the decode layer boundary `kernels.mhc.hc_post_pre(one_launch=True)` (one launch - not the
default since the fifth session of 2026-12-06 -: hc_post of one site, hc_pre
of the next with its RMSNorm) at T = 1 / 2 / 4 tokens, Flash width (D 4096, hc 4, 20 Sinkhorn iterations), µs per
call in a CUDA graph, for num_warps x block_d (the collapse width) variants; each variant's outputs against the
default's (max |diff| / max |x| of x; H_new, post and comb alike). Run on a GPU: `python benchmarks/mhc_boundary_probe.py`.
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))

from bench_gemm import gpu_time  # noqa: E402
from kernels.mhc import hc_post_pre, hc_pre_ref  # noqa: E402

HC, ITERS, EPS = 4, 20, 1e-6


class Norm:
    def __init__(self, D):
        self.weight = torch.rand(D, device="cuda") + 0.5
        self.eps = 1e-6

    def __call__(self, x):
        raise NotImplementedError


def main() -> int:
    torch.manual_seed(0)
    D = 4096
    K = HC * D
    print("| T | default µs | five fastest (warps, block_d): µs, rel err of x |\n|---:|---:|---|")
    for T in (1, 2, 4):
        H = torch.randn(T, HC, D, device="cuda").bfloat16()
        a = torch.randn(T, D, device="cuda").bfloat16()
        fn = torch.randn((2 + HC) * HC, K, device="cuda") / math.sqrt(K)
        base, scale = torch.randn((2 + HC) * HC, device="cuda") * 0.5, torch.rand(3, device="cuda") + 0.5
        kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
        _, post, comb = hc_pre_ref(H, fn, base, scale, **kw)
        norm = Norm(D)
        ref = hc_post_pre(a, H, post, comb, fn, base, scale, norm=norm, one_launch=True, **kw)
        rows = []
        for w in (1, 2, 4, 8):
            for bd in (None, 512, 1024, 2048, 4096):
                v = dict(num_warps=w, block_d=bd)
                try:
                    out = hc_post_pre(a, H, post, comb, fn, base, scale, norm=norm, one_launch=True, **kw, **v)
                    err = max(float((o.float() - r.float()).abs().max() / r.float().abs().max())
                              for o, r in zip(out, ref))
                    us = gpu_time(lambda i: hc_post_pre(a, H, post, comb, fn, base, scale, norm=norm, one_launch=True,
                                                        **kw, **v), iters=20, reps=5)
                    rows.append((us, (w, bd), err))
                except Exception as e:  # noqa: BLE001
                    print(f"  [{v}: {type(e).__name__}: {str(e).splitlines()[0][:120]}]", file=sys.stderr)
        default = [r[0] for r in rows if r[1] == (4, None)][0]
        rows.sort()
        print(f"| {T} | {default:.1f} | " + "; ".join(f"{c}: {u:.1f}, {e:.0e}" for u, c, e in rows[:5]) + " |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
