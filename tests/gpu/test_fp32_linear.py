"""The bf16-weight fp32 linear (kernels/fp32_linear.py) against `fp32_linear_ref` at real sizes (CUDA only).

Flash / Pro head (129280 x 4096 / 7168), router gate (256 x 4096: split over K, semaphore merge) and CSA
compressor wkv (1024 x 4096), M = 1 / 8 / 32 (CUDA-core M = 1 and the bf16x3 tensor-core dots) and 300 (a prefill:
cuBLAS - fp32 for fp32 x, the bf16 GEMM with an fp32 output for bf16 x). Criterion: the fp32 summation
bound of tests/unit/test_fp32_linear.py (`within_fp32_sum_bound`); outputs NaN-poisoned through `out=`; the
reference runs with TF32 off (asserted). Also: a CUDA-graph capture of the launch replays to the same bits
(no host sync, the workspace semaphores reset), and a NaN row stays NaN.

    pytest -q tests/gpu/test_fp32_linear.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.hardstop,  # kernel / backend vs reference on CUDA (issue 22 item 4)
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]

SHAPES = [("flash_head", 129280, 4096), ("pro_head", 129280, 7168), ("router", 256, 4096),
          ("csa_compressor_wkv", 1024, 4096)]


@pytest.fixture(autouse=True)
def _fp32_reference():
    assert not torch.backends.cuda.matmul.allow_tf32, "TF32 matmul is on: the fp32 reference would be TF32"


@pytest.mark.parametrize("name,N,K", SHAPES, ids=[s[0] for s in SHAPES])
def test_real_sizes_within_fp32_sum_bound(name, N, K):
    from kernels.fp32_linear import fp32_linear, fp32_linear_ref
    from tests.unit.test_fp32_linear import within_fp32_sum_bound
    w = (torch.randn(N, K, device="cuda") * torch.logspace(1, -1, N, device="cuda")[:, None]).to(torch.bfloat16)
    for M in (1, 8, 32, 300):
        x = torch.randn(M, K, device="cuda") * torch.logspace(-2, 2, K, device="cuda")[None, :]
        y = torch.full((M, N), float("nan"), device="cuda")
        fp32_linear(x, w, out=y)
        within_fp32_sum_bound(y, fp32_linear_ref(x, w), x, w, f"{name} M={M}")
        xb = x.to(torch.bfloat16)
        yb = torch.full((M, N), float("nan"), device="cuda")
        fp32_linear(xb, w, out=yb)
        within_fp32_sum_bound(yb, fp32_linear_ref(xb, w), xb, w, f"{name} M={M} bf16 x")


def test_graph_capture_replays_the_eager_bits_and_nan_stays():
    from kernels.fp32_linear import fp32_linear
    w = torch.randn(256, 4096, device="cuda").to(torch.bfloat16)   # the router: split over K
    x = torch.randn(4, 4096, device="cuda")
    out = torch.empty(4, 256, device="cuda")
    eager = fp32_linear(x, w).clone()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fp32_linear(x, w, out=out)  # warm-up (compile) on the capture stream
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.graph(g, stream=s):
                fp32_linear(x, w, out=out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x[1, 7] = float("nan")
    g.replay()
    torch.cuda.synchronize()
    assert bool(out[1].isnan().all()) and not bool(out[[0, 2, 3]].isnan().any())


def test_prefill_rows_of_bf16_x_run_the_bf16_gemm(monkeypatch):
    """Above GEMV_MAX_M rows a bf16 x goes to cuBLAS's bf16 GEMM with an fp32 output (no fp32 copies of x and W:
    issue 27, 1.4 ms of a 4096-token Flash prefill layer were fp32 SIMT GEMMs), an fp32 x to the fp32 GEMM (its
    values are not bf16): the torch.mm call of each, and both within the fp32 bound of the reference."""
    from kernels.fp32_linear import GEMV_MAX_M, fp32_linear, fp32_linear_ref
    from tests.unit.test_fp32_linear import within_fp32_sum_bound
    calls = []
    mm = torch.mm

    def spy(a, b, **kw):
        calls.append((a.dtype, b.dtype, kw.get("out_dtype")))
        return mm(a, b, **kw)
    monkeypatch.setattr(torch, "mm", spy)
    w = torch.randn(1024, 4096, device="cuda").to(torch.bfloat16)
    M = GEMV_MAX_M + 1
    x = torch.randn(M, 4096, device="cuda")
    xb = x.to(torch.bfloat16)
    within_fp32_sum_bound(fp32_linear(xb, w), fp32_linear_ref(xb, w), xb, w, "bf16 x")
    assert calls[0] == (torch.bfloat16, torch.bfloat16, torch.float32), calls
    calls.clear()
    within_fp32_sum_bound(fp32_linear(x, w), fp32_linear_ref(x, w), x, w, "fp32 x")
    assert calls[0] == (torch.float32, torch.float32, None), calls
