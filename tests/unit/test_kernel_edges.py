"""Kernel edge values (issue 17) under TRITON_INTERPRET=1 at small shapes: every constant term of each Triton
kernel dominates somewhere (cases and tolerances: `tests/kernel_edges.py`); tests/gpu/test_kernel_edges.py runs
the same cases at DeepSeek-V4 sizes. Both mHC paths (one launch, two launches) and both attention paths (one
program per query, split + merge) are covered."""

from __future__ import annotations

import os

import pytest
import torch

import triton
import triton.language as tl

from kernels.gemm import cast_for_store, round_bf16
from tests import kernel_edges as E

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP or not torch.cuda.is_available() else "cuda"
pytestmark = [pytest.mark.hardstop,  # kernel-only constant terms (kills hc_eps_dropped_in_kernel, sink_dropped_in_kernel)
              pytest.mark.skipif(not INTERP and not torch.cuda.is_available(),
                                 reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set before import)"),
              # sigmoid(-200) = 1 / (1 + exp(200)): the interpreter's numpy exp overflows to inf, as intended
              pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")]
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
PATHS = pytest.mark.parametrize("one_launch", [True, False], ids=["one_launch", "two_launch"])


@PATHS
@DTYPES
@pytest.mark.parametrize("iters", [1, E.ITERS])
def test_hc_pre_saturated(seed, dtype, one_launch, iters):
    E.check_hc_pre_edge("saturated", 3, 64, dtype, DEV, iters, one_launch)


@PATHS
@DTYPES
def test_hc_pre_tiny_residual(seed, dtype, one_launch):
    E.check_hc_pre_edge("tiny", 3, 64, dtype, DEV, E.ITERS, one_launch)


@PATHS
@DTYPES
@pytest.mark.parametrize("case", ["saturated", "tiny"])
def test_hc_head_edges(seed, dtype, one_launch, case):
    E.check_hc_head_edge(case, 3, 64, dtype, DEV, one_launch)


@DTYPES
def test_hc_post_exact(seed, dtype):
    E.check_hc_post_exact(5, 64, dtype, DEV)


@DTYPES
@pytest.mark.parametrize("splits", [1, 3])
def test_sparse_attn_edges(seed, dtype, splits):
    E.check_sparse_attn_edge(2, 4, 4, 32, 24, 20, dtype, DEV, splits)


@DTYPES
def test_indexer_scores_edges(seed, dtype):
    E.check_indexer_edge(2, 3, 5, 16, 40, dtype, DEV)


# fp32 bit patterns for the bf16 store rounding: NaNs whose integer rounding overflows (the GPU's canonical NaN
# 0x7FFFFFFF, its negative, the largest-mantissa quiet and signalling ones), ordinary NaNs, +-inf, the largest
# finite fp32 (rounds to inf), the largest value that rounds to the largest bf16, ties to even in both
# directions, a subnormal tie, -0.0 and +0.0.
_BF16_EDGE_BITS = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0xFFFF8000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                   0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x3F808000, 0x3F818000,
                   0x00008000, 0x00018000, 0x80000000, 0x00000000]


@triton.jit
def _store_kernel(x_ptr, y_ptr, r_ptr, n, BLOCK: tl.constexpr):
    """y = cast_for_store(x) into bf16, r = round_bf16(x) in fp32 (the helpers every kernel store goes through)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    tl.store(y_ptr + offs, cast_for_store(x, y_ptr), mask=m)
    tl.store(r_ptr + offs, round_bf16(x), mask=m)


def _naive_round_bits(bits: torch.Tensor) -> torch.Tensor:
    """The integer rounding without the NaN select, in int64 then wrapped to int32 as the kernel's int32 add."""
    b = bits.to(torch.int64)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & ~0xFFFF
    return ((r + 2**31) % 2**32 - 2**31).to(torch.int32).view(torch.float32)


def test_round_bf16_bit_patterns(seed):
    """`kernels.gemm.round_bf16` / `cast_for_store` (every bf16 store of the mHC, attention, GEMM and MoE kernels)
    equal torch's round-to-nearest-even cast on edge bit patterns and fresh random values, and keep every NaN a
    NaN. Found on the H200: the sparse-attention index guard's NaN (0x7FFFFFFF there) was stored as -0.0 in bf16
    because the integer add overflowed. Negative control: the same rounding without the NaN select loses them."""
    import triton

    edge = torch.tensor([b - 2**32 if b >= 2**31 else b for b in _BF16_EDGE_BITS], dtype=torch.int32)
    x = torch.cat([edge.view(torch.float32), torch.randn(4096) * torch.exp2(torch.randint(-130, 128, (4096,)).float()),
                   ]).to(DEV)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=DEV)
    r = torch.empty_like(x)
    _store_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, r, x.numel(), BLOCK=1024)
    want = x.to(torch.bfloat16)
    nan = torch.isnan(x)
    assert int(nan.sum()) == 7
    assert bool(torch.isnan(y[nan]).all()) and bool(torch.isnan(r[nan]).all()), "a NaN stored as a number"
    assert torch.equal(r[~nan], want[~nan].float()), "round_bf16 != torch's cast"
    # the interpreter's own fp32 -> bf16 cast mangles subnormals (0x00018000 -> 0x0000, not 0x0002) even when the
    # value is already on the bf16 grid, so there the store is compared on normal values and zeros only
    comp = ~nan if not INTERP else ~nan & ((x.abs() >= 2.0 ** -126) | (x == 0))
    assert torch.equal(y[comp].view(torch.int16), want[comp].view(torch.int16)), "bf16 store != torch's cast"
    naive = _naive_round_bits(x.cpu().view(torch.int32))
    assert int(torch.isnan(naive[nan.cpu()]).sum()) < 7, "negative control: the edge NaNs must break the naive rounding"


@pytest.mark.parametrize("head", [False, True], ids=["hc_pre", "hc_head"])
@pytest.mark.parametrize("one_launch", [True, False], ids=["one_launch", "two_launch"])
# norm_eps = 0: the masked padding rows of a token block (never stored) compute 0 / 0 in the interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                            "ignore:divide by zero:RuntimeWarning", "ignore:All-NaN slice encountered:RuntimeWarning")
def test_hc_lo_piece_decides(seed, one_launch, head):
    """issue 14 item 2: logits carried by the last 8 bits of fn (the bf16x3 split's lo piece), exact by
    construction (tests/kernel_edges.py::lo_piece_inputs); D 64 (K 256, n 1) and 96 (K 384, n 6 fillers)."""
    E.check_hc_lo_piece(5, 64, DEV, one_launch, head)
    E.check_hc_lo_piece(3, 96, DEV, one_launch, head)
