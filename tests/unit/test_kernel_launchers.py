"""Launch plumbing of the Triton kernels (issues 6/7): the one-launch path of hc_pre / hc_head (`one_launch=True`;
the default runs the two launches at every T since the fifth session of 2026-12-06), the
in-launch split merge of sparse_attn, the self-resetting semaphores of `kernels.launch.workspace`, and the
sync-free index guard of sparse_attn (out-of-range index -> NaN) next to the opt-in host check.

Runs under TRITON_INTERPRET=1 on CPU (or on CUDA when present), small shapes. Tolerances (dsv4.testing table):
bf16 outputs rtol 1.6e-2 / atol 1e-2, fp32 outputs rtol/atol 1e-5 against the reference. The one-launch and
two-launch mHC paths use the same split count, the same dot-row position per token and the same fixed-order
partial sum, so they must agree bitwise (assert_equal), as must two calls of the same path.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from dsv4.testing import assert_close, assert_equal
from kernels.launch import sm_count, workspace
from kernels.mhc import hc_head, hc_head_ref, hc_pre, hc_pre_ref

pytestmark = pytest.mark.hardstop  # kernel launch paths agree with the references

HC, ITERS, EPS = 4, 20, 1e-6
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP or not torch.cuda.is_available() else "cuda"
needs_triton = pytest.mark.skipif(not INTERP and not torch.cuda.is_available(),
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set before import)")


def make_mix(T: int, D: int, head: bool):
    """Fresh non-zero mHC inputs on DEV: H ~ N(0,1) bf16, fn ~ N(0, 1/K), base and scale non-zero."""
    K, n = HC * D, (HC if head else (2 + HC) * HC)
    H = torch.randn(T, HC, D, device=DEV).bfloat16()
    fn = torch.randn(n, K, device=DEV) / math.sqrt(K)
    return H, fn, torch.randn(n, device=DEV) * 0.5, torch.rand(1 if head else 3, device=DEV) + 0.5


def sems_zero() -> bool:
    """Every semaphore of this stream's workspace is back at 0 (kernels must reset what they count)."""
    return bool((workspace(torch.device(DEV), 1, 1)[0] == 0).all())


@needs_triton
@pytest.mark.parametrize("T", [1, 5, 40], ids=["T1", "T5", "T40"])
def test_hc_pre_one_launch_equals_two_launch_and_ref(seed, T):
    H, fn, base, scale = make_mix(T, 64, head=False)
    kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    nan = lambda *shape, dtype=torch.float32: torch.full(shape, float("nan"), dtype=dtype, device=DEV)  # noqa
    one = hc_pre(H, fn, base, scale, out=(nan(T, 64, dtype=H.dtype), nan(T, HC), nan(T, HC, HC)), one_launch=True,
                 **kw)  # forced: the default is the two launches (ONE_LAUNCH_MAX_T = 0, measured)
    assert sems_zero(), "the one-launch kernel must reset its per-token-block counters"
    two = hc_pre(H, fn, base, scale, **kw)
    again = hc_pre(H, fn, base, scale, one_launch=True, **kw)
    for name, a, b, c, want in zip(("x", "post", "comb"), one, two, again, hc_pre_ref(H, fn, base, scale, **kw)):
        assert_close(a, want, name)
        assert_equal(a, b, f"{name}: one launch vs two launches")
        assert_equal(c, a, f"{name}: second one-launch call (semaphores reused)")


@needs_triton
@pytest.mark.parametrize("T", [3, 67], ids=["T3", "T67-forced"])
def test_hc_head_one_launch(seed, T):
    H, fn, base, scale = make_mix(T, 96, head=True)
    y = hc_head(H, fn, base, scale, hc_eps=EPS, norm_eps=EPS, one_launch=True,
                out=torch.full((T, 96), float("nan"), dtype=H.dtype, device=DEV))
    assert sems_zero()
    assert_close(y, hc_head_ref(H, fn, base, scale, hc_eps=EPS, norm_eps=EPS), "y")
    assert_equal(y, hc_head(H, fn, base, scale, hc_eps=EPS, norm_eps=EPS, one_launch=False), "y one vs two")


@needs_triton
def test_one_launch_flag_is_checked():
    H, fn, base, scale = make_mix(2, 16, head=True)
    with pytest.raises(ValueError, match="hc_head: one_launch is 1; expected None"):
        hc_head(H, fn, base, scale, hc_eps=EPS, norm_eps=EPS, one_launch=1)


def test_workspace_is_reused_and_grows_zeroed():
    dev = torch.device(DEV)
    sem, ws = workspace(dev, 8, 100)
    assert sem.dtype == torch.int32 and ws.dtype == torch.float32 and sem.numel() >= 8 and ws.numel() >= 100
    assert workspace(dev, 8, 100)[0].data_ptr() == sem.data_ptr(), "same stream, fits: the cached pair"
    big_sem, big_ws = workspace(dev, sem.numel() + 1, ws.numel() + 1)
    assert big_sem.numel() > sem.numel() and big_ws.numel() > ws.numel() and bool((big_sem == 0).all())
    assert sm_count(torch.device("cpu"), cpu_default=7) == 7


# ---- sparse_attn: one launch with in-launch merge, sync-free range guard ----------------------------------

def attn_case(b, s, h, n, k, dtype=torch.float32):
    q = torch.randn(b, s, h, 64, device=DEV).to(dtype)
    kv = torch.randn(b, n, 64, device=DEV).to(dtype)
    idx = torch.randint(0, n, (b, s, k), device=DEV)
    idx[..., ::5] = -1
    return q, kv, torch.randn(h, device=DEV), idx


@needs_triton
@pytest.mark.parametrize("splits", [1, 3], ids=["nosplit", "split3"])
def test_sparse_attn_bad_index_poisons_only_its_query(seed, splits):
    from kernels.attention import sparse_attn, sparse_attn_ref
    q, kv, sink, idx = attn_case(2, 2, 3, 20, 40)
    good = sparse_attn_ref(q, kv, sink, idx, 0.125)
    bad = idx.clone()
    bad[1, 0, 7] = 20                                            # == n: one past the end
    got = sparse_attn(q, kv, sink, bad, 0.125, num_splits=splits, block_n=16)
    assert sems_zero()
    assert bool(torch.isnan(got[1, 0]).all()), "the query holding the bad index must be NaN (all heads)"
    mask = torch.ones(2, 2, dtype=torch.bool)
    mask[1, 0] = False
    assert_close(got[mask], good[mask], "sparse_attn other queries", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"idx values must be -1 \(empty\) or in \[0, n=20\), got min -1 max 20"):
        sparse_attn(q, kv, sink, bad, 0.125, num_splits=splits, block_n=16, check_idx=True)
    bad[1, 0, 7] = -2
    assert bool(torch.isnan(sparse_attn(q, kv, sink, bad, 0.125, num_splits=splits, block_n=16)[1, 0]).all())


@needs_triton
def test_sparse_attn_split_merge_reuses_workspace(seed):
    """Back-to-back split launches share the stream's workspace; each must leave it ready for the next."""
    from kernels.attention import sparse_attn, sparse_attn_ref
    cases = [attn_case(1, 1, 2, 30, 37), attn_case(2, 1, 20, 25, 50, torch.bfloat16)]
    for q, kv, sink, idx in cases + cases:
        got = sparse_attn(q, kv, sink, idx, 0.125, num_splits=4, block_n=16, check_idx=True)
        assert_close(got, sparse_attn_ref(q, kv, sink, idx, 0.125), "sparse_attn split 4", dtype=q.dtype)
        assert sems_zero()
