"""`kernels.compressor.softmax_pool` (the graph decode's compressor pooling) against `softmax_pool_ref` (= the
model's `(Z.softmax(1) * A).sum(1, keepdim=True)`), under TRITON_INTERPRET=1 at the real slot counts (CSA 2r = 8,
HCA r = 128) and small widths; tests/gpu/test_kernel_launchers.py runs real widths.

Tolerance: fp32 maths in another order (one division instead of n): rtol 1e-6, atol 1e-7 of max|A| (module
docstring). Edge values: partially filled windows (-inf scores, as the decode state holds them), one dominant
slot, scores around +-80 so the max subtraction matters (exp overflows without it), and an all -inf column
(NaN in both)."""

from __future__ import annotations

import os

import pytest
import torch

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP or not torch.cuda.is_available() else "cuda"
pytestmark = [pytest.mark.skipif(not INTERP and not torch.cuda.is_available(),
                                 reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set before import)"),
              # the interpreter's numpy evaluates -inf - -inf and 0/0 of the masked / empty columns, as intended
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def _close(got, want, what):
    both_nan = torch.isnan(got) & torch.isnan(want)
    err = (got - want).abs()
    bound = 1e-6 * want.abs() + 1e-7 * float(want[~torch.isnan(want)].abs().max())
    assert bool(((err <= bound) | both_nan).all()), f"{what}: max excess {(err - bound)[~both_nan].max():.3e}"
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN pattern differs"


@pytest.mark.parametrize("b,n,d", [(1, 8, 96), (3, 128, 64), (2, 5, 300)])
def test_softmax_pool_matches_reference(seed, b, n, d):
    from kernels.compressor import softmax_pool, softmax_pool_ref
    Z = torch.randn(b, n, d, device=DEV) * 3 + 80.0           # exp(80+) overflows without the max subtraction
    A = torch.randn(b, n, d, device=DEV)
    Z[:, n // 2:, : d // 2] = float("-inf")                   # a partially filled window
    Z[0, 0, -1] = 200.0                                       # one dominant slot
    got, want = softmax_pool(Z, A), softmax_pool_ref(Z, A)
    assert got.shape == (b, 1, d) and got.dtype == torch.float32
    assert not bool(torch.isnan(want).any())
    _close(got, want, f"pool {b}x{n}x{d}")
    Z[-1, :, 3] = float("-inf")                               # an empty column: NaN in both (0/0)
    _close(softmax_pool(Z, A), softmax_pool_ref(Z, A), "all -inf column")
    assert bool(torch.isnan(softmax_pool(Z, A)[-1, 0, 3]))


def test_softmax_pool_names_bad_input():
    from kernels.compressor import softmax_pool
    Z = torch.randn(1, 8, 16, device=DEV)
    with pytest.raises(ValueError, match=r"softmax_pool: A is shape \(1, 4, 16\)"):
        softmax_pool(Z, Z[:, :4].contiguous())
    with pytest.raises(ValueError, match="Z is torch.bfloat16"):
        softmax_pool(Z.to(torch.bfloat16), Z)
    with pytest.raises(ValueError, match="non-contiguous"):
        softmax_pool(Z.transpose(1, 2).contiguous().transpose(1, 2), Z)
