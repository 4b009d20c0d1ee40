"""Kernel edge values (issue 17) at DeepSeek-V4 sizes on CUDA: the cases of `tests/kernel_edges.py` (every constant
term of each Triton kernel dominates somewhere; tolerances there) with Flash / Pro widths (D 4096 / 7168, 64 / 128
heads of 512, indexer 64 x 128), decode- and prefill-sized token counts, both mHC launch paths and both attention
paths (one program per query; split + merge, the heuristic's choice). tests/unit/test_kernel_edges.py runs the
same cases in the interpreter at small shapes."""

from __future__ import annotations

import pytest
import torch

from tests import kernel_edges as E

pytestmark = [pytest.mark.gpu, pytest.mark.hardstop,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
PATHS = pytest.mark.parametrize("one_launch", [True, False], ids=["one_launch", "two_launch"])
DS = pytest.mark.parametrize("D", [4096, 7168], ids=["D4096", "D7168"])
TS = pytest.mark.parametrize("T", [1, 3, 129], ids=["T1", "T3", "T129"])


@pytest.fixture(autouse=True)
def _fp32_reference():
    assert not torch.backends.cuda.matmul.allow_tf32, "TF32 matmul is on: the fp32 reference would be TF32"


@PATHS
@DTYPES
@DS
@TS
@pytest.mark.parametrize("case,iters", [("saturated", 1), ("saturated", E.ITERS), ("tiny", E.ITERS)],
                         ids=["saturated-1", "saturated-20", "tiny"])
def test_hc_pre_edges_gpu(seed, case, iters, T, D, dtype, one_launch):
    E.check_hc_pre_edge(case, T, D, dtype, "cuda", iters, one_launch)


@PATHS
@DTYPES
@DS
@TS
@pytest.mark.parametrize("case", ["saturated", "tiny"])
def test_hc_head_edges_gpu(seed, case, T, D, dtype, one_launch):
    E.check_hc_head_edge(case, T, D, dtype, "cuda", one_launch)


@DTYPES
@DS
@TS
def test_hc_post_exact_gpu(seed, T, D, dtype):
    E.check_hc_post_exact(T, D, dtype, "cuda")


@DTYPES
@pytest.mark.parametrize("splits", [1, None], ids=["one_program", "split"])
@pytest.mark.parametrize("heads", [64, 128])
def test_sparse_attn_edges_gpu(seed, heads, splits, dtype):
    # b 2 x s 3 queries, 4096 KV rows, 640 slots (window 128 + top-k 512)
    E.check_sparse_attn_edge(2, 3, heads, 512, 4096, 640, dtype, "cuda", splits)


@DTYPES
def test_indexer_scores_edges_gpu(seed, dtype):
    E.check_indexer_edge(2, 3, 64, 128, 4096, dtype, "cuda")


@pytest.mark.parametrize("head", [False, True], ids=["hc_pre", "hc_head"])
@DS
@pytest.mark.parametrize("T", [3, 129, 4097], ids=["T3", "T129", "T4097"])
def test_hc_lo_piece_decides_gpu(seed, T, D, head):
    """issue 14 item 2: every mix logit carried by the last 8 bits of fn (tests/kernel_edges.py::lo_piece_inputs,
    exact by construction); one launch forced at T 3 (the default there: two), two launches with 16- / 64-row
    tiles above."""
    E.check_hc_lo_piece(T, D, "cuda", T <= 64, head)


@DS
def test_hc_lo_piece_catches_tf32x3_gpu(seed, D):
    """Negative control: the former tf32x3 projection (22-bit weights) fails the lo-piece case on the GPU."""
    with pytest.raises(AssertionError, match="lo piece"):
        E.check_hc_lo_piece(4097, D, "cuda", False, False, dot="tf32x3")
