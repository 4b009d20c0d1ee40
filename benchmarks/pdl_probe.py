"""Probe: what Programmatic Dependent Launch (PDL) saves per kernel boundary in a CUDA graph (issue 27).

A chain of N small Triton kernels (each reads the previous one's output: a dependent chain like a decode step's
launches) captured in one CUDA graph, timed with and without `launch_pdl=True` (+ `gdc_wait` /
`gdc_launch_dependents` at the kernel's start). Prints µs per kernel for a few sizes. Also checks the chain's
result (every element must equal N after N increments), so an unsafe overlap shows as a wrong value.

Run: `python benchmarks/pdl_probe.py` on a GPU (sm_90+).
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _inc_kernel(src, dst, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m) + 1.0, mask=m)


def chain(bufs, n_kernels: int, n: int, pdl: bool) -> None:
    BLOCK = 1024
    grid = (triton.cdiv(n, BLOCK),)
    for i in range(n_kernels):
        a, b = bufs[i % 2], bufs[(i + 1) % 2]
        _inc_kernel[grid](a, b, n, PDL=pdl, BLOCK=BLOCK, launch_pdl=pdl)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    K = 200
    for n in (4096, 1 << 20, 8 << 20):
        row = []
        for pdl in (False, True):
            bufs = [torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")]
            chain(bufs, 2, n, pdl)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                with torch.cuda.graph(g):
                    chain(bufs, K, n, pdl)
            bufs[0].zero_()
            bufs[1].zero_()
            g.replay()
            torch.cuda.synchronize()
            ok = bool((bufs[K % 2] == K).all())
            ts = []
            for _ in range(5):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                g.replay()
                e1.record()
                torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e3 / K)
            row.append(f"pdl={pdl}: {min(ts):.2f} µs/kernel (chain value ok: {ok})")
        print(f"n={n} ({n * 8 / 1e6:.2f} MB moved per kernel): " + "; ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
