"""Triton mHC launchers vs the torch references at real sizes (CUDA only).

Outputs are NaN-poisoned through the launchers' `out=` argument, so an element the kernel never writes fails.
Inputs are fresh per test (seeded by test id) and non-zero. Tolerances per output (same as tests/unit, reasons
there): x / H_new / y bf16 rtol 1.6e-2 atol 1e-2; post / comb fp32 rtol 1e-5 atol 1e-5. The fp32 reference runs
with TF32 off (torch's default; the test asserts it), so it is a true fp32 projection.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.testing import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.hardstop,  # kernel / backend vs reference on CUDA (issue 22 item 4)
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]

HC, ITERS, EPS = 4, 20, 1e-6
TS = [1, 3, 64, 129, 4096, 4097]
DS = [96, 4096, 7168]
IDS = [f"T{t}" for t in TS]


@pytest.fixture(autouse=True)
def _fp32_reference():
    assert not torch.backends.cuda.matmul.allow_tf32, "TF32 matmul is on: the fp32 reference would be TF32"


def nan(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def make(T, D, n_mix, n_scale, dtype=torch.bfloat16):
    K = HC * D
    return (torch.randn(T, HC, D, device="cuda").to(dtype), torch.randn(n_mix, K, device="cuda") / math.sqrt(K),
            torch.randn(n_mix, device="cuda") * 0.5, torch.rand(n_scale, device="cuda") + 0.5)


@pytest.mark.parametrize("D", DS, ids=[f"D{d}" for d in DS])
@pytest.mark.parametrize("T", TS, ids=IDS)
def test_hc_pre_gpu(seed, T, D):
    from kernels.mhc import hc_pre, hc_pre_ref

    H, fn, base, scale = make(T, D, (2 + HC) * HC, 3)
    kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    rx, rpost, rcomb = hc_pre_ref(H, fn, base, scale, **kw)
    for one in (None, True):  # the default (two launches) and the fused kernel (`one_launch=True`)
        x, post, comb = hc_pre(H, fn, base, scale, out=(nan(T, D, dtype=H.dtype), nan(T, HC), nan(T, HC, HC)),
                               one_launch=one, **kw)
        assert_close(x, rx, f"x (one_launch={one})")
        assert_close(post, rpost, f"post (one_launch={one})")
        assert_close(comb, rcomb, f"comb (one_launch={one})")


@pytest.mark.parametrize("D", DS, ids=[f"D{d}" for d in DS])
@pytest.mark.parametrize("T", TS, ids=IDS)
def test_hc_head_gpu(seed, T, D):
    from kernels.mhc import hc_head, hc_head_ref

    H, fn, base, scale = make(T, D, HC, 1)
    ref = hc_head_ref(H, fn, base, scale, hc_eps=EPS, norm_eps=EPS)
    for one in (None, True):  # the default (two launches) and the fused kernel (`one_launch=True`)
        y = hc_head(H, fn, base, scale, hc_eps=EPS, norm_eps=EPS, out=nan(T, D, dtype=H.dtype), one_launch=one)
        assert_close(y, ref, f"y (one_launch={one})")


@pytest.mark.parametrize("D", DS, ids=[f"D{d}" for d in DS])
@pytest.mark.parametrize("T", TS, ids=IDS)
def test_hc_post_gpu(seed, T, D):
    from kernels.mhc import hc_post, hc_post_ref

    H = torch.randn(T, HC, D, device="cuda").bfloat16()
    a = torch.randn(T, D, device="cuda").bfloat16()
    post = torch.rand(T, HC, device="cuda") * 2
    comb = torch.rand(T, HC, HC, device="cuda")
    y = hc_post(a, H, post, comb, out=nan(T, HC, D, dtype=H.dtype))
    assert_close(y, hc_post_ref(a, H, post, comb), "H_new")


@pytest.mark.parametrize("T", [1, 257], ids=["T1", "T257"])
def test_fp32_streams_gpu(seed, T):
    from kernels.mhc import hc_post, hc_post_ref, hc_pre, hc_pre_ref

    D = 4096
    H, fn, base, scale = make(T, D, (2 + HC) * HC, 3, dtype=torch.float32)
    kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    got = hc_pre(H, fn, base, scale, out=(nan(T, D), nan(T, HC), nan(T, HC, HC)), **kw)
    want = hc_pre_ref(H, fn, base, scale, **kw)
    for name, g, w in zip(("x", "post", "comb"), got, want):
        assert_close(g, w, name)
    a = torch.randn(T, D, device="cuda")
    assert_close(hc_post(a, H, want[1], want[2], out=nan(T, HC, D)), hc_post_ref(a, H, want[1], want[2]), "H_new")


def test_launcher_rejects_mixed_devices():
    from kernels.mhc import hc_pre

    H, fn, base, scale = make(2, 64, (2 + HC) * HC, 3)
    with pytest.raises(ValueError, match="fn is on device cpu"):
        hc_pre(H, fn.cpu(), base, scale, sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)


@pytest.mark.parametrize("D", [4096, 7168], ids=["D4096", "D7168"])
@pytest.mark.parametrize("T", [1, 3, 8, 64], ids=["T1", "T3", "T8", "T64"])
def test_hc_post_pre_gpu(seed, T, D):
    """The fused layer boundary (issue 14): H_new against `hc_post_ref`; (x, post, comb) against `hc_pre_ref`
    of the kernel's own H_new (isolates the projection from H_new's one-ulp roundings) and against the
    two-launch path (hc_post then hc_pre kernels); all outputs NaN-poisoned; dtype tolerances as above."""
    from kernels.mhc import hc_post, hc_post_pre, hc_post_ref, hc_pre, hc_pre_ref

    H, fn0, base0, scale0 = make(T, D, (2 + HC) * HC, 3)
    kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    _, post, comb = hc_pre_ref(H, fn0, base0, scale0, **kw)
    _, fn, base, scale = make(T, D, (2 + HC) * HC, 3)
    a = torch.randn(T, D, device="cuda").bfloat16()
    out = (nan(T, HC, D, dtype=H.dtype), nan(T, D, dtype=H.dtype), nan(T, HC), nan(T, HC, HC))
    h_new, x, post2, comb2 = hc_post_pre(a, H, post, comb, fn, base, scale, out=out, one_launch=True, **kw)
    assert_close(h_new, hc_post_ref(a, H, post, comb), "H_new")
    for name, g, w in zip(("x", "post", "comb"), (x, post2, comb2), hc_pre_ref(h_new, fn, base, scale, **kw)):
        assert_close(g, w, name)
    two = hc_pre(hc_post(a, H, post, comb), fn, base, scale, **kw)
    for name, g, w in zip(("x", "post", "comb"), (x, post2, comb2), two):  # both within tol of the reference:
        r, t = (2e-5, 2e-5) if name != "x" else (None, None)               # twice the fp32 tolerance apart
        assert_close(g, w, f"{name} vs two launches", rtol=r, atol=t)


def test_hc_post_pre_is_one_launch():
    """hc_post_pre(one_launch=True) is ONE launch; the default (POST_PRE_ONE_LAUNCH_MAX_T = 0, measured faster)
    is hc_post then the two-launch hc_pre: three launches, in that order."""
    from kernels.mhc import hc_post_pre, hc_pre_ref

    T, D = 1, 4096
    H, fn, base, scale = make(T, D, (2 + HC) * HC, 3)
    kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    _, post, comb = hc_pre_ref(H, fn, base, scale, **kw)
    a = torch.randn(T, D, device="cuda").bfloat16()
    for one, want in ((True, ["_hc_post_pre_kernel"]), (None, ["_hc_post_kernel", "_hc_mix_kernel", "_hc_finish_kernel"])):
        hc_post_pre(a, H, post, comb, fn, base, scale, one_launch=one, **kw)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            hc_post_pre(a, H, post, comb, fn, base, scale, one_launch=one, **kw)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(names) == len(want) and all(w in n for w, n in zip(want, names)), (one, names)
