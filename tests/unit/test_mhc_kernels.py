"""mHC references against a float64 hand computation, and the Triton launchers against the references.

Reference checks run anywhere. Triton checks run under TRITON_INTERPRET=1 on CPU (CI sets it for the whole unit
run) or on CUDA when present; otherwise they skip with the reason. Small shapes only (the interpreter is slow);
tests/gpu covers the real sizes.

Tolerances per output:
    x, H_new, y (bf16):  rtol 1.6e-2 atol 1e-2 (dsv4.testing bf16): both sides round one fp32 value once; a
                         different summation order can move it across a rounding boundary (1 ulp = 2^-8 rel).
    post, comb (fp32):   rtol 1e-5 atol 1e-5: same fp32 formulas; the projection differs only by summation order
                         and tf32x3 (≈2^-21 rel per product); sigmoid (slope ≤ 1/4, ×2 for post) and Sinkhorn do
                         not amplify it, and both outputs are bounded in (0, 2).
    reference vs fp64:   fp32 table (rtol 1e-5 atol 1e-5).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from dsv4.testing import assert_close, assert_mostly_bitwise
from kernels.mhc import hc_head, hc_head_ref, hc_post, hc_post_ref, hc_pre, hc_pre_ref, sinkhorn_ref

HC, ITERS, EPS = 4, 20, 1e-6
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP or not torch.cuda.is_available() else "cuda"
needs_triton = pytest.mark.skipif(not INTERP and not torch.cuda.is_available(),
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set before import)")
pytestmark = pytest.mark.hardstop  # kernel / fast path vs reference (issue 22 item 4)


def make_pre(T: int, D: int, dtype=torch.bfloat16, device="cpu", head: bool = False):
    """Fresh non-zero inputs: H ~ N(0,1); fn ~ N(0, 1/K) so m·scale ~ O(1); base, scale non-zero."""
    K, n = HC * D, (HC if head else (2 + HC) * HC)
    H = torch.randn(T, HC, D, device=device).to(dtype)
    fn = torch.randn(n, K, device=device) / math.sqrt(K)
    base = torch.randn(n, device=device) * 0.5
    scale = torch.rand(1 if head else 3, device=device) + 0.5
    return H, fn, base, scale


# ---- float64 hand computation (loops, spec §4/§9 written out) -------------------------------------------

def sinkhorn_hand(c0: list[list[float]], iters: int, eps: float) -> list[list[float]]:
    n = len(c0)
    c = []
    for row in c0:
        mx = max(row)
        e = [math.exp(v - mx) for v in row]
        c.append([v / sum(e) + eps for v in e])

    def col(c):
        s = [sum(c[j][k] for j in range(n)) for k in range(n)]
        return [[c[j][k] / (s[k] + eps) for k in range(n)] for j in range(n)]

    c = col(c)
    for _ in range(iters - 1):
        c = [[v / (sum(row) + eps) for v in row] for row in c]
        c = col(c)
    return c


def pre_hand(H, fn, base, scale, iters, eps):
    """Per token: X flattened stream-major, m = (fn·X)·rsqrt(mean X² + eps), split, sigmoids, Sinkhorn, collapse."""
    xs, posts, combs = [], [], []
    for t in range(H.shape[0]):
        X = H[t].double().reshape(-1)
        r = 1.0 / math.sqrt(float((X * X).sum()) / X.numel() + eps)
        m = [float(fn[i].double() @ X) * r for i in range(fn.shape[0])]
        pre = [1 / (1 + math.exp(-(m[j] * scale[0].item() + base[j].item()))) + eps for j in range(HC)]
        posts.append([2 / (1 + math.exp(-(m[HC + k] * scale[1].item() + base[HC + k].item()))) for k in range(HC)])
        c0 = [[m[2 * HC + HC * j + k] * scale[2].item() + base[2 * HC + HC * j + k].item() for k in range(HC)]
              for j in range(HC)]
        combs.append(sinkhorn_hand(c0, iters, eps))
        xs.append(sum(pre[j] * H[t, j].double() for j in range(HC)))
    return torch.stack(xs), torch.tensor(posts, dtype=torch.float64), torch.tensor(combs, dtype=torch.float64)


def check_sinkhorn(comb: torch.Tensor, logits: torch.Tensor, iters: int) -> None:
    """Columns sum to ≈1 and the matrix equals the fp64 hand Sinkhorn (which ends on a column step).

    A column step leaves column sums S/(S+eps) = 1 - eps/S for a pre-step column mass S; with logits of spread ~3
    S can be ~1e-3, hence atol 1e-3 on the sums; the elementwise fp64 comparison is the tight check.
    """
    assert_close(comb.sum(1), torch.ones_like(comb.sum(1)), "comb column sums", rtol=0, atol=1e-3)
    hand = torch.tensor([sinkhorn_hand(l.tolist(), iters, EPS) for l in logits.double()], dtype=torch.float64)
    assert_close(comb, hand, "comb vs fp64 hand Sinkhorn", dtype=torch.float32)


def test_pre_ref_takes_zero_tokens():
    """T = 0: the reference crashed in an ambiguous reshape where the kernels return empty outputs; now
    x [0, D], post [0, hc], comb [0, hc, hc]."""
    H, fn, base, scale = make_pre(3, 8, dtype=torch.float32)
    x, post, comb = hc_pre_ref(H[:0], fn, base, scale, sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    assert (x.shape, post.shape, comb.shape) == ((0, 8), (0, HC), (0, HC, HC))


def test_pre_ref_matches_fp64_hand(seed):
    H, fn, base, scale = make_pre(3, 8, dtype=torch.float32)
    x, post, comb = hc_pre_ref(H, fn, base, scale, sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    hx, hpost, hcomb = pre_hand(H, fn, base, scale, ITERS, EPS)
    assert x.dtype == torch.float32 and post.dtype == torch.float32 and comb.dtype == torch.float32
    assert_close(x, hx, "x", dtype=torch.float32)
    assert_close(post, hpost, "post", dtype=torch.float32)
    assert_close(comb, hcomb, "comb", dtype=torch.float32)
    assert_close(comb.sum(2), torch.ones(3, HC, dtype=torch.float64), "comb row sums", atol=1e-3, rtol=0)
    xb, _, _ = hc_pre_ref(H.bfloat16(), fn, base, scale, sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    assert xb.dtype == torch.bfloat16


@pytest.mark.parametrize("iters", [1, 3, 20])
def test_sinkhorn_ends_on_column_step(seed, iters):
    logits = torch.randn(4, HC, HC) * 3  # spread: 3 iterations are far from converged
    check_sinkhorn(sinkhorn_ref(logits, iters, EPS), logits, iters)
    # negative case: a mutant that ends on a row step must fail the same check
    mutant = sinkhorn_ref(logits, iters, EPS)
    mutant = mutant / (mutant.sum(-1, keepdim=True) + EPS)
    if iters < 20:  # at 20 iterations rows and columns have both converged past fp32 resolution
        with pytest.raises(AssertionError):
            check_sinkhorn(mutant, logits, iters)


def test_post_ref_orientation_on_asymmetric_comb(seed):
    T, D = 2, 5
    H = torch.randn(T, HC, D)
    a = torch.randn(T, D)
    post = torch.rand(T, HC) * 2
    comb = torch.rand(T, HC, HC)
    assert not torch.allclose(comb, comb.transpose(1, 2))
    out = hc_post_ref(a, H, post, comb)
    hand = torch.zeros(T, HC, D, dtype=torch.float64)
    for t in range(T):
        for k in range(HC):  # output stream k gathers sources j through column k
            hand[t, k] = post[t, k].double() * a[t].double()
            for j in range(HC):
                hand[t, k] += comb[t, j, k].double() * H[t, j].double()
    assert_close(out, hand, "H_new")
    # negative case: mixing with comb itself instead of its transpose must fail the same check
    wrong = post.unsqueeze(-1) * a.unsqueeze(1) + torch.einsum("tkj,tjd->tkd", comb, H)
    with pytest.raises(AssertionError):
        assert_close(wrong, hand, "H_new (C·H mutant)")


def test_head_ref_matches_fp64_hand(seed):
    H, fn, base, scale = make_pre(3, 8, dtype=torch.float32, head=True)
    y = hc_head_ref(H, fn, base, scale, hc_eps=EPS, norm_eps=EPS)
    Xf = H.double().reshape(3, -1)
    r = torch.rsqrt((Xf * Xf).mean(-1, keepdim=True) + EPS)
    pre = torch.sigmoid((Xf @ fn.double().t()) * r * scale.double() + base.double()) + EPS
    assert_close(y, (pre.unsqueeze(-1) * H.double()).sum(1), "y", dtype=torch.float32)


def _rounded_once(got: torch.Tensor, hand: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """bool: bf16 `got` is the one rounding of the fp64 `hand` value: |got - hand| <= half a bf16 ulp of hand
    (2^(floor(log2|hand|) - 8)) + 2^-20 * mass, where mass = the sum of |terms| bounds the fp32 (or tf32x3)
    accumulation error before that rounding (~2^-22 relative each, a few terms)."""
    hand = hand.double()
    half_ulp = torch.exp2(torch.floor(torch.log2(hand.abs().clamp_min(1e-30))) - 8)
    return (got.double() - hand).abs() <= half_ulp + 2.0 ** -20 * mass.double()


def test_bf16_outputs_rounded_once(seed):
    """Spec §4 / §9: with bf16 streams, x = Σ pre_j H_j (pre), H_new = post·a + Σ comb·H (post) and y = Σ pre_j H_j
    (head) are fp32 sums rounded ONCE to bf16. The float32-stream tests cannot see an extra rounding (each product
    or partial sum rounded to bf16 first), and the Triton-vs-reference tests compare within bf16 tolerances, so
    here every element of the bf16 output must be the rounding of the fp64 hand value (tolerance in
    `_rounded_once`); rounding each term first errs by ~2^-9 of the terms (negative control below).
    References here; the kernels' bf16 outputs are held to these references by `assert_mostly_bitwise` in the
    Triton tests below (their stores round to nearest through `kernels.gemm.cast_for_store`, also under the
    interpreter, whose own cast truncates)."""
    pre_f, post_f, head_f = hc_pre_ref, hc_post_ref, hc_head_ref
    T, D = 4, 64
    H, fn, base, scale = make_pre(T, D)
    x, _, _ = pre_f(H, fn, base, scale, sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    hx = pre_hand(H.cpu(), fn.cpu(), base.cpu(), scale.cpu(), ITERS, EPS)[0]
    mass = H.cpu().double().abs().sum(1)  # pre_j < 1 + eps
    ok = _rounded_once(x.cpu(), hx, mass)
    assert bool(ok.all()), f"hc_pre x: {int((~ok).sum())} of {ok.numel()} elements are not bf16(fp64 sum)"
    a = torch.randn(T, D).bfloat16()
    post = torch.rand(T, HC) * 2
    comb = torch.rand(T, HC, HC)
    hn = post_f(a, H, post, comb)
    Hd, ad, pd, cd = H.cpu().double(), a.cpu().double(), post.cpu().double(), comb.cpu().double()
    hand = pd[..., None] * ad[:, None, :] + torch.einsum("tjk,tjd->tkd", cd, Hd)
    mass = pd[..., None] * ad.abs()[:, None, :] + torch.einsum("tjk,tjd->tkd", cd, Hd.abs())
    ok = _rounded_once(hn.cpu(), hand, mass)
    assert bool(ok.all()), f"hc_post H_new: {int((~ok).sum())} of {ok.numel()} elements are not bf16(fp64 sum)"
    # negative control: each term rounded to bf16 first, summed in fp64, rounded again
    bad = (pd[..., None] * ad[:, None, :]).bfloat16().double() + sum(
        (cd[:, j, :, None] * Hd[:, j, None, :]).bfloat16().double() for j in range(HC))
    assert int((~_rounded_once(bad.bfloat16(), hand, mass)).sum()) > 20, "an extra rounding passes: no power"
    H, fn, base, scale = make_pre(T, D, head=True)
    y = head_f(H, fn, base, scale, hc_eps=EPS, norm_eps=EPS)
    Xf = H.cpu().double().reshape(T, -1)
    r = torch.rsqrt((Xf * Xf).mean(-1, keepdim=True) + EPS)
    pre = torch.sigmoid((Xf @ fn.cpu().double().t()) * r * scale.cpu().double() + base.cpu().double()) + EPS
    ok = _rounded_once(y.cpu(), (pre[..., None] * H.cpu().double()).sum(1), H.cpu().double().abs().sum(1))
    assert bool(ok.all()), f"hc_head y: {int((~ok).sum())} of {ok.numel()} elements are not bf16(fp64 sum)"


# ---- Triton (interpreter on CPU, or CUDA) vs reference --------------------------------------------------

SHAPES = [(1, 64), (3, 96), (5, 64), (67, 64)]


def site_norm(D: int, device):
    """A block site's RMSNorm module as hc_pre's `norm` (`dsv4.model.RMSNorm`, the reference backend's rms_norm):
    weight ~ 1 + N(0, 1/4) (every element scales its column differently) and an eps (3e-6) unlike the mix's
    norm_eps, so a kernel using the wrong one is seen at the small-row tokens below."""
    from dsv4.model import RMSNorm
    n = RMSNorm(D, 3e-6).to(device)
    with torch.no_grad():
        n.weight.copy_(1.0 + 0.5 * torch.randn(D, device=device))
    return n


@needs_triton
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("T,D", SHAPES, ids=[f"T{t}-D{d}" for t, d in SHAPES])
def test_hc_pre_triton(seed, T, D, norm):
    """x / post / comb against `hc_pre_ref`, by both paths: the default (mix + finish, two launches: ONE_LAUNCH_MAX_T
    = 0, measured faster) and the one fused launch (`one_launch=True`); norm: x leaves as the site's RMSNorm
    (`kernels.norm.rms_norm` after the two launches; fused into the one launch's collapse), against `rms_norm_ref`
    of the reference row. One token's row is scaled by 1e-3 so eps (and the mean of squares) matter there."""
    H, fn, base, scale = make_pre(T, D, device=DEV)
    H[0] = (H[0].float() * 1e-3).to(H.dtype)
    kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    nrm = site_norm(D, DEV) if norm else None
    rx, rpost, rcomb = hc_pre_ref(H, fn, base, scale, norm=nrm, **kw)
    for one_launch in (None, True):
        out = (torch.full((T, D), float("nan"), dtype=H.dtype, device=DEV),
               torch.full((T, HC), float("nan"), device=DEV), torch.full((T, HC, HC), float("nan"), device=DEV))
        x, post, comb = hc_pre(H, fn, base, scale, out=out, norm=nrm, one_launch=one_launch, **kw)
        what = f"(one_launch={one_launch})"
        assert x.data_ptr() == out[0].data_ptr()
        assert_close(x, rx, f"x {what}")
        assert_mostly_bitwise(x, rx, f"x (one bf16 rounding) {what}")
        assert_close(post, rpost, f"post {what}")
        assert_close(comb, rcomb, f"comb {what}")
        if norm:  # the norm is really applied: the rms of each normed row / weight is ~1 (not row 0: eps decides)
            rms = ((x[1:].float() / nrm.weight.detach()) ** 2).mean(-1).sqrt()
            assert_close(rms, torch.ones_like(rms), f"normed rows' rms {what}", rtol=0, atol=2e-2)


@needs_triton
@pytest.mark.parametrize("T,D", SHAPES, ids=[f"T{t}-D{d}" for t, d in SHAPES])
def test_hc_head_triton(seed, T, D):
    H, fn, base, scale = make_pre(T, D, device=DEV, head=True)
    y = hc_head(H, fn, base, scale, hc_eps=EPS, norm_eps=EPS,
                out=torch.full((T, D), float("nan"), dtype=H.dtype, device=DEV))
    ref = hc_head_ref(H, fn, base, scale, hc_eps=EPS, norm_eps=EPS)
    assert_close(y, ref, "y")
    assert_mostly_bitwise(y, ref, "y (one bf16 rounding)")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T,D", SHAPES, ids=[f"T{t}-D{d}" for t, d in SHAPES])
def test_hc_post_triton(seed, T, D, dtype):
    H = torch.randn(T, HC, D, device=DEV).to(dtype)
    a = torch.randn(T, D, device=DEV).to(dtype)
    post = torch.rand(T, HC, device=DEV) * 2
    comb = torch.rand(T, HC, HC, device=DEV)
    y = hc_post(a, H, post, comb, out=torch.full((T, HC, D), float("nan"), dtype=dtype, device=DEV))
    assert_close(y, hc_post_ref(a, H, post, comb), "H_new")
    if dtype == torch.bfloat16:  # fp32 outputs carry the summation order in their last bit
        assert_mostly_bitwise(y, hc_post_ref(a, H, post, comb), "H_new (one bf16 rounding)")


@needs_triton
def test_hc_pre_triton_fp32_streams(seed):
    H, fn, base, scale = make_pre(3, 96, dtype=torch.float32, device=DEV)
    kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    for name, got, want in zip(("x", "post", "comb"), hc_pre(H, fn, base, scale, **kw),
                               hc_pre_ref(H, fn, base, scale, **kw)):
        assert_close(got, want, name)


# ---- launcher argument checks (raise before any launch) -------------------------------------------------

def test_launchers_name_the_bad_value():
    H, fn, base, scale = make_pre(2, 16)
    kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    cases = [
        (lambda: hc_pre(H, fn.double(), base, scale, **kw), "fn is dtype torch.float64"),
        (lambda: hc_pre(H.unsqueeze(0), fn, base, scale, **kw), "exactly 3-D"),
        (lambda: hc_pre(H.transpose(0, 1).contiguous().transpose(0, 1), fn, base, scale, **kw), "non-contiguous"),
        (lambda: hc_pre(H, fn, base, scale[:2], **kw), "scale is shape (2,)"),
        (lambda: hc_pre(H, fn, base, scale, sinkhorn_iters=0, hc_eps=EPS, norm_eps=EPS), "sinkhorn_iters is 0"),
        (lambda: hc_pre(H.half(), fn, base, scale, **kw), "H is dtype torch.float16"),
        (lambda: hc_post(torch.zeros(2, 16), H, torch.zeros(2, 4), torch.zeros(2, 4, 4)),
         "a is dtype torch.float32"),
        (lambda: hc_post(H[:, 0].contiguous(), H, torch.zeros(2, 3), torch.zeros(2, 4, 4)), "post is shape (2, 3)"),
        (lambda: hc_head(H, fn, base, scale, hc_eps=EPS, norm_eps=EPS), "fn is shape (24, 64)"),
        (lambda: hc_pre_ref(H, fn, base, scale, sinkhorn_iters=2.5, hc_eps=EPS, norm_eps=EPS),
         "sinkhorn_iters is 2.5"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            call()
    if not INTERP:
        with pytest.raises(ValueError, match="H is on device cpu"):
            hc_pre(H, fn, base, scale, **kw)


# ---- the fused layer boundary hc_post -> next hc_pre (issue 14) ------------------------------------------

@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("T,D", [(1, 96), (3, 200), (5, 64)], ids=["T1-D96", "T3-D200", "T5-D64"])
def test_hc_post_pre_triton(seed, T, D, dtype, norm):
    """One launch (forced: the default runs hc_post + hc_pre, `POST_PRE_ONE_LAUNCH_MAX_T` = 0): H_new against
    hc_post_ref, (x, post, comb) against hc_pre_ref of the kernel's own H_new
    (H_new may differ from the reference by one rounding, which the next projection would amplify past the
    fp32 tolerance of post/comb), and against the two-launch path. All outputs NaN-poisoned. norm: the next
    site's RMSNorm on x (fused into the one launch; `site_norm`)."""
    from kernels.mhc import hc_post_pre
    H, fn0, base, scale = make_pre(T, D, dtype=dtype, device=DEV)
    kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS, norm=site_norm(D, DEV) if norm else None)
    _, post, comb = hc_pre_ref(H, fn0, base, scale, **kw)
    fn = torch.randn_like(fn0) / math.sqrt(HC * D)
    a = torch.randn(T, D, device=DEV).to(dtype)
    H[0], a[0] = (H[0].float() * 1e-3).to(dtype), (a[0].float() * 1e-3).to(dtype)  # eps matters in row 0

    def nan(*shape, dt=torch.float32):
        return torch.full(shape, float("nan"), dtype=dt, device=DEV)

    got = hc_post_pre(a, H, post, comb, fn, base, scale, out=(nan(T, HC, D, dt=dtype), nan(T, D, dt=dtype),
                                                              nan(T, HC), nan(T, HC, HC)), one_launch=True, **kw)
    assert_close(got[0], hc_post_ref(a, H, post, comb), "H_new")
    if dtype == torch.bfloat16:  # fp32 outputs carry the summation order in their last bit
        assert_mostly_bitwise(got[0], hc_post_ref(a, H, post, comb), "H_new (one bf16 rounding)")
    for name, g, w in zip(("x", "post", "comb"), got[1:], hc_pre_ref(got[0], fn, base, scale, **kw)):
        assert_close(g, w, name)
    two = hc_post_pre(a, H, post, comb, fn, base, scale, one_launch=False, **kw)
    for name, g, w in zip(("H_new", "x", "post", "comb"), got, two):
        assert_close(g, w, f"{name} vs two launches")


def test_hc_post_pre_names_the_bad_value():
    from kernels.mhc import hc_post_pre
    H, fn, base, scale = make_pre(2, 16)
    kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    a, post, comb = H[:, 0].contiguous(), torch.rand(2, HC), torch.rand(2, HC, HC)
    with pytest.raises(ValueError, match=r"comb is shape \(2, 4\)"):
        hc_post_pre(a, H, post, comb[:, 0], fn, base, scale, **kw)
    with pytest.raises(ValueError, match="H_new"):
        hc_post_pre(a, H, post, comb, fn, base, scale, out=(H, None, None, None), **kw)
    from dsv4.model import RMSNorm
    with pytest.raises(ValueError, match=r"hc_post_pre: norm is RMSNorm with weight torch.float32 \(15,\).*"
                                         r"expected None or an RMSNorm: callable, weight \[16\] fp32"):
        hc_post_pre(a, H, post, comb, fn, base, scale, norm=RMSNorm(15, 1e-6), **kw)
    with pytest.raises(ValueError, match="hc_pre: norm.eps is 0"):
        hc_pre(H, fn, base, scale, norm=RMSNorm(16, 0), **kw)
    with pytest.raises(ValueError, match="hc_pre_ref: norm is tuple"):
        hc_pre_ref(H, fn, base, scale, norm=(torch.ones(16), 1e-6), **kw)


@needs_triton
def test_hc_post_pre_check_catches_untransposed_comb(seed):
    """Negative control for test_hc_post_pre_triton: the same comparison fails when the boundary mixes with
    comb untransposed (the `comb_untransposed` failure class), so the hard-stop test can fail on that bug."""
    from kernels.mhc import hc_post_pre
    T, D = 2, 64
    H, fn, base, scale = make_pre(T, D, dtype=torch.float32, device=DEV)
    kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS)
    _, post, comb = hc_pre_ref(H, fn, base, scale, **kw)
    a = torch.randn(T, D, device=DEV)
    wrong = hc_post_pre(a, H, post, comb.transpose(1, 2).contiguous(), fn, base, scale, **kw)
    with pytest.raises(AssertionError):
        assert_close(wrong[0], hc_post_ref(a, H, post, comb), "H_new")


@pytest.mark.parametrize("iters,eps,match", [(True, EPS, "iters"), (ITERS, float("nan"), "eps"),
                                             (ITERS, -0.5, "eps"), (ITERS, float("inf"), "eps")])
def test_sinkhorn_ref_refuses_a_bool_iters_and_a_bad_eps(iters, eps, match):
    """iters=True ran one iteration and eps NaN / -0.5 gave a NaN or sign-flipped comb: each is now refused."""
    logits = torch.randn(2, HC, HC)
    with pytest.raises(ValueError, match=rf"sinkhorn_ref: {match}"):
        sinkhorn_ref(logits, iters, eps)
    c = sinkhorn_ref(logits, ITERS, EPS)  # control: columns sum to ~1
    assert torch.allclose(c.sum(1), torch.ones(2, HC), atol=1e-3)


@needs_triton
def test_norm_eps_zero_and_non_bool_invariant_are_refused():
    """hc_pre_ref / hc_pre / hc_head(_ref) / hc_post_pre(_ref) took norm_eps = 0 (checked >= 0): an all-zero H
    then gives rsqrt(0) * 0 = NaN in post and comb (the model's rms_norm_eps must be > 0, the config refuses 0);
    hc_head / hc_pre took invariant=1. Now ValueErrors naming the argument; hc_eps = 0 stays legitimate. Controls:
    the fp64 hand formula with hc_eps = 0, and an all-zero H with norm_eps > 0 gives post = 2 sigmoid(base)."""
    from kernels.mhc import hc_head_ref, hc_post_pre, hc_post_pre_ref
    dev = "cpu" if INTERP else "cuda"
    H, fn, base, scale = make_pre(2, 16, dtype=torch.float32, device=dev)
    Hh, fnh, baseh, scaleh = make_pre(2, 16, dtype=torch.float32, device=dev, head=True)
    a, post0, comb0 = H[:, 0].contiguous(), torch.rand(2, HC, device=dev), torch.rand(2, HC, HC, device=dev)
    for eps in (0.0, 0, -1e-6, float("inf"), float("nan"), True):
        kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=eps)
        for name, call in (("hc_pre_ref", lambda: hc_pre_ref(H, fn, base, scale, **kw)),
                           ("hc_pre", lambda: hc_pre(H, fn, base, scale, **kw)),
                           ("hc_post_pre_ref", lambda: hc_post_pre_ref(a, H, post0, comb0, fn, base, scale, **kw)),
                           ("hc_post_pre", lambda: hc_post_pre(a, H, post0, comb0, fn, base, scale, **kw)),
                           ("hc_head_ref", lambda: hc_head_ref(Hh, fnh, baseh, scaleh, hc_eps=EPS, norm_eps=eps)),
                           ("hc_head", lambda: hc_head(Hh, fnh, baseh, scaleh, hc_eps=EPS, norm_eps=eps))):
            op = "hc_pre_ref" if name == "hc_post_pre_ref" else name  # the reference composes hc_post_ref, hc_pre_ref
            with pytest.raises(ValueError, match=rf"{op}: norm_eps is {eps!r}; expected a finite float > 0"):
                call()
    for inv in (1, 0, "yes", None):
        with pytest.raises(ValueError, match=rf"hc_head: invariant is {inv!r}; expected a bool"):
            hc_head(Hh, fnh, baseh, scaleh, hc_eps=EPS, norm_eps=EPS, invariant=inv)
        with pytest.raises(ValueError, match=rf"hc_pre: invariant is {inv!r}; expected a bool"):
            hc_pre(H, fn, base, scale, sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=EPS, invariant=inv)
    # controls: hc_eps = 0 is accepted and computes the formula; an all-zero H is finite with norm_eps > 0
    x, post, comb = hc_pre_ref(H, fn, base, scale, sinkhorn_iters=ITERS, hc_eps=0.0, norm_eps=1e-6)
    hx, hpost, hcomb = pre_hand(H.cpu(), fn.cpu(), base.cpu(), scale.cpu(), ITERS, 0.0)
    # (pre_hand uses one eps for both; at hc_eps 0 its norm eps is 0 too: 1e-6 vs 0 moves m by ~1e-6 relative)
    assert_close(post.cpu().double(), hpost, "post, hc_eps 0", rtol=1e-5, atol=1e-5)
    assert_close(comb.cpu().double(), hcomb, "comb, hc_eps 0", rtol=1e-4, atol=1e-5)
    Z = torch.zeros_like(H)
    for got in (hc_pre_ref(Z, fn, base, scale, sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=1e-6),
                hc_pre(Z, fn, base, scale, sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=1e-6)):
        want = (2 * torch.sigmoid(base[HC:2 * HC])).expand(2, HC)
        assert torch.equal(got[0], torch.zeros(2, 16, device=dev))
        torch.testing.assert_close(got[1], want, rtol=1e-6, atol=1e-6)
        assert bool(torch.isfinite(got[2]).all())
    y = hc_head(Hh, fnh, baseh, scaleh, hc_eps=EPS, norm_eps=EPS, invariant=True)
    assert_close(y, hc_head_ref(Hh, fnh, baseh, scaleh, hc_eps=EPS, norm_eps=EPS), "hc_head invariant=True",
                 dtype=torch.float32)
