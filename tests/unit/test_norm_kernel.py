"""`kernels.norm.rms_norm` (the triton backend's RMSNorm) against `kernels.norm.rms_norm_ref`, under
TRITON_INTERPRET=1 at small widths; the GPU run of tests/gpu/test_model_backends.py covers real widths inside the
model, tests/gpu/test_kernel_launchers.py the kernel alone.

Tolerances: the same fp32 operations in the same order except the sum of squares: fp32 outputs within 4 ulps
(rtol 2^-21); bf16 outputs within one bf16 rounding (rtol 2^-7) and >= 90 % bitwise equal (one rounding of nearly
the same fp32 value; `dsv4.testing.assert_mostly_bitwise`). Edge values: rows whose mean square is far below eps
(eps dominates: a dropped or misplaced eps changes them by far more than the tolerance, checked as a negative
control), rows near 1e15 (squares near 1e30: no overflow in fp32), a weight over several binades."""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.model import RMSNorm
from kernels.norm import rms_norm_ref
from dsv4.testing import assert_mostly_bitwise

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP or not torch.cuda.is_available() else "cuda"
pytestmark = [pytest.mark.hardstop,  # kernel / fast path vs reference (issue 22 item 4)
              pytest.mark.skipif(not INTERP and not torch.cuda.is_available(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set before import)")]


def _rows(n, d):
    x = torch.randn(n, d, device=DEV)
    x[0] *= 1e-5                                   # mean square 1e-10 << eps = 1e-6
    x[1] *= 1e15
    x[2] *= 3e-4                                   # mean square ~ eps: both terms matter
    return x


def _norm(d):
    m = RMSNorm(d, 1e-6).to(DEV).requires_grad_(False)
    with torch.no_grad():
        m.weight.copy_(torch.randn(d, device=DEV) * torch.logspace(-2, 2, d, device=DEV))
    return m


@pytest.mark.parametrize("d", [64, 300, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_matches_reference(seed, d, dtype):
    from kernels.norm import rms_norm
    m = _norm(d)
    x = _rows(7, d).to(dtype).view(7, 1, d)
    got, want = rms_norm(x, m.weight, m.eps), rms_norm_ref(x, m.weight, m.eps)
    assert got.dtype == dtype and got.shape == x.shape
    rtol = 2.0 ** -21 if dtype == torch.float32 else 2.0 ** -7
    err = (got.float() - want.float()).abs()
    assert bool((err <= rtol * want.float().abs() + 1e-30).all()), f"max rel {(err / want.float().abs()).max():.2e}"
    if dtype == torch.bfloat16:
        assert_mostly_bitwise(got, want, f"rms_norm bf16 d={d}")
    # negative control: these rows make eps matter far beyond the tolerance
    no_eps = (m.weight * x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True))).to(dtype)
    assert float(((no_eps.float() - want.float()).abs() / want.float().abs()).max()) > 100 * rtol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_nan_and_inf_rows_match_the_reference(seed, dtype):
    """A NaN in a row makes the whole row NaN (mean of squares NaN); an inf makes its row's mean square inf, so
    the row becomes +-0 and the inf element itself NaN (inf * rsqrt(inf) = inf * 0): the kernel's NaN pattern
    equals the reference's, the finite elements keep the one-rounding criterion. Negative control: the
    reference really has the NaN row and the NaN at the inf (a kernel turning them into numbers fails)."""
    from kernels.norm import rms_norm
    m = _norm(96)
    x = (torch.randn(5, 96, device=DEV) * 3).to(dtype)
    x[1, 7], x[3, 50] = float("nan"), float("inf")
    got, want = rms_norm(x, m.weight, m.eps), rms_norm_ref(x, m.weight, m.eps)
    assert bool(torch.isnan(want[1]).all()) and bool(torch.isnan(want[3, 50])), "control"
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    fin = ~torch.isnan(want)
    rtol = 2.0 ** -21 if dtype == torch.float32 else 2.0 ** -7
    err = (got.float() - want.float()).abs()[fin]
    assert bool((err <= rtol * want.float().abs()[fin] + 1e-30).all())


def test_rms_norm_names_bad_input():
    from kernels.norm import rms_norm
    w = torch.ones(8, device=DEV)
    with pytest.raises(ValueError, match="x is torch.float16"):
        rms_norm(torch.ones(2, 8, device=DEV, dtype=torch.float16), w, 1e-6)
    with pytest.raises(ValueError, match=r"weight is torch.float32 shape \(4,\)"):
        rms_norm(torch.ones(2, 8, device=DEV), w[:4], 1e-6)
    with pytest.raises(ValueError, match="eps is 0.0"):
        rms_norm(torch.ones(2, 8, device=DEV), w, 0.0)
    with pytest.raises(ValueError, match="rows of d contiguous values at one stride"):
        rms_norm(torch.ones(8, 2, device=DEV).T, w, 1e-6)


def test_triton_backend_norms_run_the_kernel():
    """Every RMSNorm of a triton-backend model is bound to the kernel entry, of a reference model to the ref."""
    from dsv4.model import Transformer
    from dsv4.tiny import tiny_args
    from kernels.norm import rms_norm_op
    args = tiny_args(n_layers=2, compress_ratios=(0, 4, 0))
    for backend, entry in (("triton", rms_norm_op), ("reference", rms_norm_ref)):
        m = Transformer(args, dtype=torch.bfloat16, backend=backend, device=DEV)  # DEV: CUDA off the interpreter
        norms = [n for n in m.modules() if isinstance(n, RMSNorm)]
        assert len(norms) >= 7 and all(n.kernel is entry for n in norms), backend


@pytest.mark.parametrize("d", [64, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_rms_matches_reference(seed, d, dtype):
    """`kernels.norm.head_rms` (the triton backend's q head-RMS, one launch) against `head_rms_ref` (the official
    torch chain in the activation dtype). Tolerance: the sum of squares in another fp32 order -> fp32 within
    4 ulps (rtol 2^-21); bf16 within 2 bf16 ulps (one ulp of the rounded mean, one of the product: rtol 2^-6) and
    >= 90 % bitwise. Rows with mean square far below / near eps make eps matter; negative controls: the chain
    without eps, and without the bf16 rounding of the mean (bf16 only), are rejected by the same check."""
    from kernels.norm import head_rms, head_rms_ref
    x = _rows(60, d).view(4, 15, d)  # 60 rows: a row whose mean rounds the other way differs in most elements
    x = (x * 2.0 ** torch.randint(-4, 5, (4, 15, 1), device=DEV)).to(dtype)
    eps = 1e-6
    got, want = head_rms(x, eps), head_rms_ref(x, eps)
    assert got.dtype == dtype and got.shape == x.shape
    rtol = 2.0 ** -21 if dtype == torch.float32 else 2.0 ** -6

    def close(a):
        return bool(((a.float() - want.float()).abs() <= rtol * want.float().abs() + 1e-30).all())
    assert close(got), f"max rel {((got.float() - want.float()).abs() / want.float().abs()).max():.2e}"
    xf = x.float()
    if dtype == torch.bfloat16:
        # bitwise against the chain with each op in fp32 and rounded to bf16 (what CUDA's torch computes; the CPU's
        # bf16 rsqrt is not correctly rounded: measured 17.375 for rsqrt(0.0032806) = 17.459, bf16 17.5)
        def r(t):
            return t.to(torch.bfloat16).float()
        chain = r(xf * r(torch.rsqrt(r(r(r(xf * xf).sum(-1, keepdim=True) / d) + eps))))
        assert_mostly_bitwise(got, chain.to(torch.bfloat16), f"head_rms bf16 d={d}")
    no_eps = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True))).to(dtype)
    assert not close(no_eps), "negative control: a missing eps must fail the check"
    if dtype == torch.bfloat16:  # the mean kept in fp32: off by up to 2^-8 relative, above 2 bf16 ulps somewhere
        unrounded = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(dtype)
        assert not torch.equal(unrounded, want)


def test_head_rms_names_bad_input():
    from kernels.norm import head_rms
    with pytest.raises(ValueError, match="x"):
        head_rms(torch.ones(2, 8, device=DEV, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        head_rms(torch.ones(2, 8, device=DEV), 0.0)
    with pytest.raises(ValueError, match="width"):
        head_rms(torch.ones(2, 0, device=DEV), 1e-6)



def test_head_rms_ref_refuses_what_the_launcher_refuses():
    """`head_rms_ref` took eps -1.0 (NaN out), eps 0.0, an int / tensor eps and fp16 x, and an int64 x failed
    inside torch's mean(); the launcher `head_rms` refuses them all. Now the same ValueErrors (`check_head_rms`)
    from both; control: the formula for fp32 and bf16 x, and the launcher within its tolerance."""
    from kernels.norm import head_rms, head_rms_ref
    x = torch.randn(2, 3, 8)
    for fn in (head_rms_ref, head_rms):
        name = fn.__name__
        for eps in (-1.0, 0.0, float("inf"), float("nan"), 1, True, torch.tensor(1e-6)):
            with pytest.raises(ValueError, match=rf"{name}: eps is .*; expected a finite float > 0"):
                fn(x.to(DEV), eps)
        for bad in (x.half(), x.long(), x.double()):
            with pytest.raises(ValueError, match=rf"{name}: x is {bad.dtype}; expected a bf16 or float32 tensor"):
                fn(bad.to(DEV), 1e-6)
        with pytest.raises(ValueError, match=rf"{name}: x is width 0"):
            fn(x[..., :0].to(DEV), 1e-6)
    for xx in (x, x.bfloat16(), x.transpose(0, 1)):  # any layout in the reference
        want = xx * torch.rsqrt(xx.square().mean(-1, keepdim=True) + 1e-6)
        assert torch.equal(head_rms_ref(xx, 1e-6), want)
    torch.testing.assert_close(head_rms(x.to(DEV), 1e-6).cpu(), head_rms_ref(x, 1e-6), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("per_row", [False, True], ids=["shared-pos", "per-row-pos"])
def test_head_rms_rope_is_the_two_kernels(seed, dtype, per_row):
    """`head_rms_rope` (one launch) is bitwise `head_rms` then `rope_tail_` (the same operations; the norm's store
    skips the tail the rotation stores). Positions up to 2^20 (large angles), ragged rows. Negative control: the
    unrotated tail (head_rms alone) differs."""
    from dsv4.model import rope_inv_freq
    from dsv4.tiny import tiny_args
    from kernels.norm import head_rms, head_rms_rope
    from kernels.rope import rope_tail_
    f = rope_inv_freq(tiny_args(rope_head_dim=64, index_head_dim=64), 4, 64).to(DEV)
    q = (torch.randn(2, 3, 4, 192, device=DEV) * 2.0 ** torch.randint(-4, 5, (2, 3, 4, 1), device=DEV)).to(dtype)
    pos = torch.tensor([[7, 8, 9], [(1 << 20) + 1, (1 << 20) + 2, (1 << 20) + 3]], device=DEV)
    if not per_row:
        pos = pos[1]
    got = head_rms_rope(q, 1e-6, pos, f, 64)
    plain = head_rms(q, 1e-6)
    assert got.dtype == dtype and torch.equal(got, rope_tail_(plain.clone(), pos, f, 64))
    assert not torch.equal(got, plain)
    with pytest.raises(ValueError, match="rd"):
        head_rms_rope(q, 1e-6, pos, f, 63)


def test_norm_kernels_read_strided_rows(seed):
    """`rms_norm` and `kv_finish` read x whose rows share a stride wider than d (a half of a joint projection,
    `dsv4.model.join_fp8`, issue 27) in place: bitwise their result on the contiguous copy; a layout with no
    such row view (a transposed x) is refused by name."""
    from dsv4.model import rope_inv_freq
    from dsv4.tiny import tiny_args
    from kernels.norm import rms_norm, rms_norm_op
    from kernels.rope import kv_finish
    y = (torch.randn(3, 2, 1536, device=DEV) * 3).to(torch.bfloat16)
    qa, kva = y[..., :1024], y[..., 1024:]
    assert not qa.is_contiguous() and not kva.is_contiguous()
    w = torch.randn(1024, device=DEV)
    assert torch.equal(rms_norm(qa, w, 1e-6), rms_norm(qa.contiguous(), w, 1e-6))
    assert torch.equal(rms_norm_op(qa, w, 1e-6), rms_norm(qa.contiguous(), w, 1e-6))
    f = rope_inv_freq(tiny_args(rope_head_dim=64, index_head_dim=64), 0, 64).to(DEV)
    pos = torch.tensor([[5, 6], [9, 10], [130, 131]], device=DEV)
    w2 = torch.randn(512, device=DEV)
    assert torch.equal(kv_finish(kva, w2, 1e-6, pos, f, 64, 64), kv_finish(kva.contiguous(), w2, 1e-6, pos, f, 64, 64))
    with pytest.raises(ValueError, match="x"):
        rms_norm(torch.randn(1024, 6, device=DEV).T, w, 1e-6)
