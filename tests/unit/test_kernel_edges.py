"""Kernel edge values (issue 17) under TRITON_INTERPRET=1 at small shapes: every constant term of each Triton
kernel dominates somewhere (cases and tolerances: `tests/kernel_edges.py`); tests/gpu/test_kernel_edges.py runs
the same cases at DeepSeek-V4 sizes. Both mHC paths (one launch, two launches) and both attention paths (one
program per query, split + merge) are covered."""

from __future__ import annotations

import os

import pytest
import torch

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
