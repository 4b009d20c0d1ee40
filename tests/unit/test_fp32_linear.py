"""The bf16-weight fp32 linear (kernels/fp32_linear.py) against `fp32_linear_ref` (Triton interpreter on CPU).

The kernel computes the official fp32 linear of the head / router / compressor (x fp32 . W^T, W = the exact fp32
upcast of the bf16 weight held as on disk). Criterion (`within_fp32_sum_bound`): per output element
|y - y_ref| <= 2 * K * (2^-24 * sum_k |x_k w_k| + 2^-149) - each side is an fp32 sum of the K exact-or-once-rounded
products in its own order, each within K * 2^-24 * sum |x_k w_k| of the exact value (the textbook recursive-sum
bound). Rounding x to bf16 (what a bf16 tensor-core dot would do) breaks it by orders of magnitude: the negative
control below. Inputs: fresh per check, magnitudes over 8 binades along K and 4 along N (no zeros), so every
product matters; shapes cover each path (CUDA-core M = 1, bf16x3 dots 1 < M <= 64, torch.mm above), split
over K (small N, long K) and not (large N), K not a multiple of the tile (masked), x fp32 and bf16.
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.testing import assert_equal
from kernels.fp32_linear import GEMV_MAX_M, ROWS_MAX, fp32_linear, fp32_linear_ref

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP or not torch.cuda.is_available() else "cuda"
pytestmark = [pytest.mark.hardstop,  # kernel / fast path vs reference (issue 22 item 4)
              pytest.mark.skipif(not INTERP and not torch.cuda.is_available(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set before import)")]


def fp32_sum_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N] fp64: 2 * K * (2^-24 * |x| @ |w|^T + 2^-149) (module docstring; the 2^-149 term is fp32's
    subnormal spacing, which bounds a rounding where the products or sums underflow, as relative terms cannot)."""
    K = x.shape[1]
    return 2 * K * (2.0 ** -24 * (x.double().abs() @ w.double().abs().T) + 2.0 ** -149)


def within_fp32_sum_bound(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    err = (y.double() - ref.double()).abs()
    bound = fp32_sum_bound(x, w)
    assert y.dtype == torch.float32 and y.shape == ref.shape, f"{what}: {y.dtype} {tuple(y.shape)}"
    assert bool((err <= bound).all()), f"{what}: max err/bound {float((err / bound).max()):.3g} > 1"


def make(M: int, N: int, K: int, seed: int, x_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-4, 4, K)[None, :]
    w = torch.randn(N, K, generator=g) * torch.logspace(2, -2, N)[:, None]
    return x.to(x_dtype).to(DEV), w.to(torch.bfloat16).to(DEV)


@pytest.mark.parametrize("M,N,K", [(1, 40, 96), (3, 300, 512), (8, 33, 300), (2, 16, 1024), (1, 24, 2100),
                                   (9, 70, 256), (33, 16, 1024), (64, 50, 200)],
                         ids=lambda v: str(v))
def test_matches_reference_within_fp32_sum_bound(M, N, K):
    seed = M * 1000 + N + K
    x, w = make(M, N, K, seed)
    y = torch.full((M, N), float("nan"), device=DEV)  # NaN-poisoned: every element must be written
    fp32_linear(x, w, out=y)
    within_fp32_sum_bound(y, fp32_linear_ref(x, w), x, w, f"M={M} N={N} K={K}")
    assert torch.equal(fp32_linear(x, w), y), "not deterministic (split-K merge order or a stale semaphore)"


def test_bf16_x_and_prefill_path():
    x, w = make(5, 40, 256, 11, torch.bfloat16)
    within_fp32_sum_bound(fp32_linear(x, w), fp32_linear_ref(x, w), x, w, "bf16 x")
    x, w = make(GEMV_MAX_M + 6, 40, 256, 12)
    assert_equal(fp32_linear(x, w), fp32_linear_ref(x, w), "M > GEMV_MAX_M: upcast + torch.mm is the reference")


def test_negative_control_bf16_rounded_x_fails_the_bound():
    """The criterion sees the bug a plain bf16 tensor-core dot would make (x rounded to bf16 = only the hi piece of
    the bf16x3 split), on both paths."""
    for M in (1, 2, ROWS_MAX + 4):
        x, w = make(M, 40, 512, 20 + M)
        y = fp32_linear(x.to(torch.bfloat16), w)
        with pytest.raises(AssertionError, match="err/bound"):
            within_fp32_sum_bound(y, fp32_linear_ref(x, w), x, w, "x rounded to bf16")


@pytest.mark.parametrize("M", [3, 20, 70], ids=["rows", "dot", "mm"])
def test_nan_row_stays_nan(M):
    """A NaN activation makes its row all NaN, an inf gives NaN / inf exactly where the reference does (the
    model must show such a failure, docs/differences.md M6); the other rows stay within the bound."""
    x, w = make(M, 48, 256, 30 + M)
    x[1, 10] = float("nan")
    x[2, 200] = float("inf")
    y, ref = fp32_linear(x, w), fp32_linear_ref(x, w)
    assert bool(torch.isnan(y[1]).all()) and bool(torch.isnan(ref[1]).all())
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))
    ok = torch.ones(M, dtype=torch.bool)
    ok[1:3] = False
    within_fp32_sum_bound(y[ok], ref[ok], x[ok], w, "finite rows")


@pytest.mark.parametrize("M", [1, 2, 20], ids=["cuda-core", "bf16x3-2", "bf16x3-20"])
def test_extreme_x_within_the_bound(M):
    """Subnormal x, tiny normal x and x next to the fp32 maximum stay within the bound on every path: the bf16x3
    split truncates (a round-to-nearest split would make hi = inf near the maximum, and the interpreter's casts
    got subnormal pieces wrong by orders of magnitude)."""
    _, w = make(M, 24, 256, 40 + M)
    w = (w.float() / w.float().abs().max() * 0.9).to(torch.bfloat16)  # |w| < 1: no product overflows
    big = torch.randn(M, 256, device=DEV)
    big[:, 200], big[:, 201] = 3.3961e38, -3.3e38           # next to the fp32 maximum (3.4028e38)
    for what, x in (("subnormal", torch.randn(M, 256, device=DEV) * 1e-40),
                    ("tiny normal", torch.randn(M, 256, device=DEV) * 1e-36), ("near max", big)):
        y, ref = fp32_linear(x, w), fp32_linear_ref(x, w)
        assert bool(torch.isfinite(ref).all()), f"control: the reference is finite ({what})"
        within_fp32_sum_bound(y, ref, x, w, f"{what} x, M={M}")


def test_empty_sum_and_kernel_options_where_no_kernel_runs():
    """K = 0 gives zeros (the empty sum), as the reference; tuning options for M > GEMV_MAX_M (torch.mm) or an
    impossible num_warps are refused by name, never ignored."""
    x, w = torch.randn(3, 0, device=DEV), torch.randn(5, 0, device=DEV).to(torch.bfloat16)
    assert_equal(fp32_linear(x, w), fp32_linear_ref(x, w), "K = 0")
    x, w = make(GEMV_MAX_M + 1, 16, 64, 3)
    for kw in ({"block": (16, 64)}, {"acc2d": False}, {"num_warps": 8}):
        with pytest.raises(ValueError, match=r"block / acc2d / num_warps"):
            fp32_linear(x, w, **kw)
    with pytest.raises(ValueError, match=r"num_warps is 0"):
        fp32_linear(x[:2], w, num_warps=0)


def test_names_bad_input():
    x, w = make(2, 16, 64, 1)
    cases = [((x, w.float()), r"weight is dtype torch.float32; expected torch.bfloat16"),
             ((x.half(), w), r"x is dtype torch.float16"),
             ((x[:, :32].contiguous(), w), r"weight is shape \(16, 64\); expected \[N, 32\]"),
             ((x[None], w), r"x is shape \(1, 2, 64\); expected a 2-D"),
             ((x.t().contiguous().t(), w), r"x is non-contiguous")]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fp32_linear(*args)
    with pytest.raises(ValueError, match=r"block is \(24, 64\)"):
        fp32_linear(x, w, block=(24, 64))
    with pytest.raises(ValueError, match=r"out is torch.bfloat16"):
        fp32_linear(x, w, out=torch.empty(2, 16, dtype=torch.bfloat16, device=DEV))


def test_single_row_accumulators():
    """M = 1: the elementwise [BN, BK] accumulator (default) and the per-tile sum both stay within the bound
    (K masked and not); the elementwise one is refused for more rows."""
    for K in (1024, 2100):
        x, w = make(1, 40, K, K)
        ref = fp32_linear_ref(x, w)
        for acc in (None, True, False):
            within_fp32_sum_bound(fp32_linear(x, w, acc2d=acc), ref, x, w, f"K={K} acc2d={acc}")
    x, w = make(2, 16, 64, 2)
    with pytest.raises(ValueError, match=r"acc2d is True; expected False or None for M = 2"):
        fp32_linear(x, w, acc2d=True)
