"""`kernels.rope.rope_tail_` (the graph decode's RoPE) against `dsv4.model.apply_rope` on the tail + cat, under
TRITON_INTERPRET=1; edge values: positions up to 2^20 (large angles: the fp64 angle matters), both inverse
directions, 3-d and 4-d layouts, the YaRN inverse frequencies of a compressed layer.

Tolerances: fp32 within 2 ulps of max|x| per row pair (rtol 2^-22 relative to the pair's magnitude, the FMA
contraction), bf16 within one rounding and >= 90 % bitwise; the nope columns bitwise untouched."""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.model import apply_rope, rope_inv_freq
from dsv4.testing import assert_mostly_bitwise
from dsv4.tiny import tiny_args

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP or not torch.cuda.is_available() else "cuda"
pytestmark = [pytest.mark.hardstop,  # kernel / fast path vs reference (issue 22 item 4)
              pytest.mark.skipif(not INTERP and not torch.cuda.is_available(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set before import)")]


def _want(x, pos, f, rd, inverse):
    return torch.cat((x[..., :-rd], apply_rope(x[..., -rd:], pos, f, inverse=inverse)), -1)


@pytest.mark.parametrize("shape", [(2, 3, 96), (2, 1, 4, 96), (2, 3, 4, 96)], ids=["bsD", "bshD", "bshD-multi"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ratio", [0, 4])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail_matches_apply_rope(seed, shape, dtype, ratio, inverse):
    from kernels.rope import rope_tail_
    args = tiny_args()
    rd = 32
    f = rope_inv_freq(args, ratio, rd).to(DEV)
    x = (torch.randn(shape, device=DEV) * 5).to(dtype)
    pos = torch.tensor([3, 1 << 20, 0][:shape[1]], device=DEV, dtype=torch.int64)
    want = _want(x, pos, f, rd, inverse)
    got = rope_tail_(x.clone(), pos, f, rd, inverse)
    assert torch.equal(got[..., :-rd], x[..., :-rd]), "nope columns changed"
    mag = want.float().abs().amax(-1, keepdim=True)
    tol = (2.0 ** -22 if dtype == torch.float32 else 2.0 ** -7) * 2 * mag
    assert bool(((got.float() - want.float()).abs() <= tol).all()), "rope tail"
    if dtype == torch.bfloat16:
        assert_mostly_bitwise(got, want, "rope bf16")
    # negative control: the tail really rotates (a kernel that leaves it alone fails the check above)
    assert float((want[..., -rd:].float() - x[..., -rd:].float()).abs().max()) > float(tol.max())


def test_multi_token_rope_with_heads_rotates_each_token_by_its_position(seed):
    """Several tokens WITH heads (a prefill-shaped [b, s, h, D] call; decode takes one token, so a kernel that
    takes the token index from the wrong part of the row index, or rotates every token by token 0's position,
    passes every one-token case): each (token, head) row equals `apply_rope` at that token's position, bf16
    within one rounding and >= 90 % bitwise, fp32 within 2 ulps of the pair's magnitude. Negative control: the
    rows rotated by token 0's position differ from the right answer beyond that tolerance."""
    from kernels.rope import rope_tail_
    rd = 32
    f = rope_inv_freq(tiny_args(), 4, rd).to(DEV)
    pos = torch.tensor([5, 130, 1 << 16, 7], device=DEV, dtype=torch.int64)     # 4 tokens, 3 heads
    for dtype, rtol in ((torch.float32, 2.0 ** -22), (torch.bfloat16, 2.0 ** -7)):
        x = (torch.randn(2, 4, 3, 80, device=DEV) * 3).to(dtype)
        want = _want(x, pos, f, rd, False)
        got = rope_tail_(x.clone(), pos, f, rd)
        tol = rtol * 2 * want.float().abs().amax(-1, keepdim=True)
        assert bool(((got.float() - want.float()).abs() <= tol).all()), f"multi-token rope {dtype}"
        if dtype == torch.bfloat16:
            assert_mostly_bitwise(got, want, "multi-token rope bf16")
        token0 = _want(x, pos[:1].expand(4).contiguous(), f, rd, False)
        assert bool(((token0.float() - want.float()).abs() > tol).any()), "control: positions must matter"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_tail_nan_and_inf_stay_where_the_reference_has_them(seed, dtype):
    """A NaN in a rotated pair makes both outputs of that pair NaN, an inf gives inf / NaN as the reference's
    products do (inf * 0 = NaN where a cos or sin is 0), NaN in the nope columns stays untouched: the NaN
    pattern equals the reference's and the finite elements keep the tolerance of the main test."""
    from kernels.rope import rope_tail_
    rd = 32
    f = rope_inv_freq(tiny_args(), 0, rd).to(DEV)
    pos = torch.tensor([0, 9, 1 << 12], device=DEV, dtype=torch.int64)
    x = (torch.randn(1, 3, 2, 64, device=DEV) * 3).to(dtype)
    x[0, 0, 0, 40], x[0, 1, 1, 63], x[0, 2, 0, 5] = float("nan"), float("inf"), float("nan")
    want = _want(x, pos, f, rd, False)
    got = rope_tail_(x.clone(), pos, f, rd)
    assert bool(torch.isnan(want[0, 0, 0, 40:42]).all()) and bool(torch.isnan(got[0, 2, 0, 5])), "control"
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    tol = (2.0 ** -22 if dtype == torch.float32 else 2.0 ** -7) * 2 * want.float().nan_to_num(0, 0, 0).abs().amax()
    assert bool(((got.float() - want.float()).abs()[fin] <= tol).all())


def test_rope_tail_names_bad_input():
    from kernels.rope import rope_tail_
    f = torch.ones(16, dtype=torch.float64, device=DEV)
    x = torch.randn(1, 2, 64, device=DEV)
    pos = torch.arange(2, device=DEV)
    with pytest.raises(ValueError, match="rd is 33"):
        rope_tail_(x, pos, f, 33)
    with pytest.raises(ValueError, match=r"pos is torch.int32 shape \(2,\)"):
        rope_tail_(x, pos.int(), f, 32)
    with pytest.raises(ValueError, match="inv_freq is torch.float32"):
        rope_tail_(x, pos, f.float(), 32)
    with pytest.raises(ValueError, match="x is torch.float16"):
        rope_tail_(x.half(), pos, f, 32)


def test_rope_and_norm_refuse_non_bool_and_non_finite():
    from kernels.norm import rms_norm
    from kernels.rope import rope_tail_
    f = torch.ones(16, dtype=torch.float64, device=DEV)
    with pytest.raises(ValueError, match="inverse is 'no'"):
        rope_tail_(torch.randn(1, 2, 64, device=DEV), torch.arange(2, device=DEV), f, 32, inverse="no")
    with pytest.raises(ValueError, match="eps is inf"):
        rms_norm(torch.randn(2, 8, device=DEV), torch.ones(8, device=DEV), float("inf"))


@pytest.mark.parametrize("shape", [(3, 1, 4, 96), (3, 2, 80)], ids=["bshD-decode", "bsD-two"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_per_row_positions_rotate_each_row_by_its_own(seed, shape, dtype):
    """pos [b, s] (a ragged batch's decode step, issue 24): row i of the kernel's output equals the reference on
    row i alone with pos[i] [s] (bitwise for the reference itself: `apply_rope` with pos [b, s] against its
    per-row form), the kernel within the tolerances above. Negative control: row 0's positions for every row
    differ beyond the tolerance."""
    from kernels.rope import rope_tail_
    rd = 32
    f = rope_inv_freq(tiny_args(), 4, rd).to(DEV)
    b, s = shape[0], shape[1]
    pos = torch.tensor([[5, 130], [1 << 16, 7], [0, 64]], device=DEV, dtype=torch.int64)[:, :s].contiguous()
    x = (torch.randn(shape, device=DEV) * 3).to(dtype)
    want = torch.cat([_want(x[i:i + 1], pos[i], f, rd, False) for i in range(b)], 0)
    assert torch.equal(_want(x, pos, f, rd, False), want), "apply_rope with pos [b, s] != row by row"
    got = rope_tail_(x.clone(), pos, f, rd)
    rtol = 2.0 ** -22 if dtype == torch.float32 else 2.0 ** -7
    tol = rtol * 2 * want.float().abs().amax(-1, keepdim=True)
    assert bool(((got.float() - want.float()).abs() <= tol).all()), "per-row rope"
    row0 = torch.cat([_want(x[i:i + 1], pos[0], f, rd, False) for i in range(b)], 0)
    assert bool(((row0.float() - want.float()).abs() > tol).any()), "control: each row's positions must matter"
    with pytest.raises(ValueError, match=r"pos is torch.int64 shape \(2, 1\)"):
        rope_tail_(x.clone(), pos[:2, :1].contiguous(), f, rd)


# ------------------------------------------------------------------ a KV row's last steps in one launch (issue 27)
_KV_CASES = [  # (x dtype, out dtype, D, rd, nope_block, window, per-row positions): the attention's kv (bf16, e4m3
    # nope), a CSA entry (fp32 pooled -> bf16, window 4), an HCA entry (window 128), an indexer entry (no e4m3),
    # fp32 mode (no roundings), a narrow test width (nope 48 < 64: one block)
    (torch.bfloat16, torch.bfloat16, 192, 64, 64, 1, True),
    (torch.float32, torch.bfloat16, 192, 64, 64, 4, True),
    (torch.float32, torch.bfloat16, 192, 64, 64, 128, False),
    (torch.float32, torch.bfloat16, 128, 64, 0, 4, True),
    (torch.float32, torch.float32, 192, 64, 0, 1, False),
    (torch.bfloat16, torch.bfloat16, 64, 16, 48, 1, True),
]


@pytest.mark.parametrize("case", _KV_CASES, ids=["kv", "csa-entry", "hca-entry", "indexer-entry", "fp32", "narrow"])
def test_kv_finish_equals_the_chain(seed, case):
    """`kv_finish` (one launch) against (a) the chain of the triton entries it replaces (cast, `rms_norm`,
    `rope_tail_` at the floored position, `act_quant_sim` on the nope channels) - bitwise: the same fp32
    operations, the norm's sum in the same order - and (b) `kv_finish_ref` (the torch chain the model runs with the
    reference backend): fp32 within 4 ulps of the element and its row's largest; bf16 mostly bitwise, every element within one e4m3 step (2^-3
    relative: a norm output one bf16 ulp apart can round to the neighbouring e4m3 code). Rows of several binades,
    positions up to 2^20 (large angles), ragged per-row positions. Negative controls: the position not floored to
    the window, and the fp32 input not rounded to bf16 before the norm, each fail (a)."""
    from kernels import norm as kn
    from kernels import quant as kq
    from kernels.rope import kv_finish, kv_finish_ref, rope_tail_
    xdt, dt, D, rd, nb, window, per_row = case
    args = tiny_args(rope_head_dim=rd, head_dim=max(64, rd), index_head_dim=max(64, rd))
    f = rope_inv_freq(args, 4, rd).to(DEV)
    b, s = 3, 2
    x = (torch.randn(b, s, D, device=DEV) * 2.0 ** torch.randint(-6, 7, (b, s, 1), device=DEV)).to(xdt)
    w = torch.randn(D, device=DEV) * torch.logspace(-1, 1, D, device=DEV)
    pos = torch.tensor([[5, 6], [130, 131], [(1 << 20) + 3, (1 << 20) + 4]], device=DEV, dtype=torch.int64)
    if not per_row:
        pos = pos[1]

    def chain(p_floor=True, round_in=True):
        y = kn.rms_norm((x.to(dt) if round_in else x).contiguous(), w, 1e-6).to(dt)
        p = (pos // window) * window if p_floor else pos
        y = rope_tail_(y, p, f, rd)
        if nb:
            y[..., :-rd] = kq.act_quant_sim(y[..., :-rd].contiguous(), nb)
        return y
    got = kv_finish(x, w, 1e-6, pos, f, rd, nb, window, dt)
    assert got.dtype == dt and got.shape == x.shape
    assert torch.equal(got, chain()), "kv_finish != the chain of the triton entries"
    want = kv_finish_ref(x.cpu(), w.cpu(), 1e-6, pos.cpu(), f.cpu(), rd, nb, window, dt).to(DEV)
    if dt == torch.float32:
        # a rotated pair near cancellation (x0 c - x1 s << |x|): a few ulps of the pair's magnitude, so the bound
        # adds 2^-21 of the row's largest element (rope_tail's own criterion)
        assert bool(((got - want).abs() <= 2.0 ** -21 * (want.abs() + want.abs().amax(-1, keepdim=True))).all())
    else:
        assert bool(((got.float() - want.float()).abs() <= 2.0 ** -3 * want.float().abs() + 1e-30).all())
        assert_mostly_bitwise(got, want, f"kv_finish {case}")
    if window > 1:
        assert not torch.equal(got, chain(p_floor=False)), "negative control: the unfloored position must differ"
    if xdt != dt:
        assert not torch.equal(got, chain(round_in=False)), "negative control: the unrounded input must differ"


def test_kv_finish_names_bad_input():
    from kernels.rope import kv_finish
    args = tiny_args(rope_head_dim=64, index_head_dim=64)
    f = rope_inv_freq(args, 4, 64).to(DEV)
    x, w = torch.randn(1, 2, 192, device=DEV), torch.ones(192, device=DEV)
    pos = torch.tensor([1, 2], device=DEV)
    for kw, match in ((dict(nope_block=100), "nope_block"), (dict(window=0), "window"), (dict(rd=63), "rd"),
                      (dict(dtype=torch.float16), "dtype")):
        a = dict(x=x, weight=w, eps=1e-6, pos=pos, inv_freq=f, rd=64)
        a.update(kw)
        with pytest.raises(ValueError, match=match):
            kv_finish(**a)
    with pytest.raises(ValueError, match="pos"):
        kv_finish(x, w, 1e-6, pos[:1], f, 64)
    with pytest.raises(ValueError, match="weight"):
        kv_finish(x, w[:64], 1e-6, pos, f, 64)


def test_kv_finish_ref_refuses_what_the_launcher_refuses():
    """`kv_finish_ref` raised ZeroDivisionError for window 0, took window -4 and dtype float16 (the launcher
    refuses both), and a ring with s = 2, the wrong D, bf16 beside fp32 rows or another batch failed in torch's
    scatter / expand. Now both run `check_kv_finish_values` and raise the same ValueErrors; the reference still
    takes CPU tensors of any layout. Control: the reference's ring write and values equal the launcher's."""
    from kernels.rope import kv_finish, kv_finish_ref
    args = tiny_args(rope_head_dim=64, index_head_dim=64)
    f = rope_inv_freq(args, 4, 64).to(DEV)
    x, w = torch.randn(2, 1, 192, device=DEV), torch.randn(192, device=DEV)
    pos = torch.tensor([[5], [9]], device=DEV)
    ring = torch.zeros(2, 4, 192, device=DEV)
    for fn in (kv_finish_ref, kv_finish):
        op = fn.__name__
        for kw, match in ((dict(window=0), r"window is 0; expected an int >= 1"),
                          (dict(window=-4), r"window is -4; expected an int >= 1"),
                          (dict(window=True), r"window is True"),
                          (dict(dtype=torch.float16), r"dtype is torch.float16; expected bf16 or float32"),
                          (dict(rd=True), r"rd is True"),
                          (dict(eps=0.0), r"eps is 0.0"),
                          (dict(nope_block=100), r"nope_block is 100"),
                          (dict(x=x.half()), r"x is torch.float16"),
                          (dict(x=torch.randn(2, 2, 192, device=DEV), pos=pos.expand(2, 2).contiguous()),
                           r"ring is torch.float32 \(2, 4, 192\) with s=2"),
                          (dict(ring=ring[..., :128].contiguous()), r"ring is torch.float32 \(2, 4, 128\)"),
                          (dict(ring=ring.bfloat16()), r"ring is torch.bfloat16 \(2, 4, 192\)"),
                          (dict(ring=ring[:1]), r"ring is torch.float32 \(1, 4, 192\)"),
                          (dict(ring=ring[:, :0]), r"ring is torch.float32 \(2, 0, 192\)")):
            a = dict(x=x, weight=w, eps=1e-6, pos=pos, inv_freq=f, rd=64, nope_block=64, window=1, ring=ring)
            a.update(kw)
            with pytest.raises(ValueError, match=rf"{op}: " + match):
                fn(**a)
    ring_k, ring_r = ring.clone(), ring.clone()
    xs = torch.randn(192, 2, 1, device=DEV).permute(1, 2, 0)  # any layout in the reference
    got = kv_finish(xs.contiguous(), w, 1e-6, pos, f, 64, 64, 4, ring=ring_k)
    want = kv_finish_ref(xs, w, 1e-6, pos, f, 64, 64, 4, ring=ring_r)
    assert_mostly_bitwise(got, want, "kv_finish vs kv_finish_ref (window 4)")
    for i, p in enumerate((5, 9)):
        assert torch.equal(ring_r[i, p % 4], want[i, 0]) and torch.equal(ring_k[i, p % 4], got[i, 0])
        assert bool((ring_r[i, [j for j in range(4) if j != p % 4]] == 0).all())


def test_kv_finish_writes_the_ring_slot(seed):
    """With `ring` (the decode step, one token per row): the kernel writes each row's result into its ring slot
    pos % W of a ring that is a view of the state's keys (batch stride W + n_e rows) and nothing else; the
    reference (`kv_finish_ref`) writes the same slots. Rows at positions that wrap the ring differently."""
    from kernels.rope import kv_finish, kv_finish_ref
    args = tiny_args(rope_head_dim=64, index_head_dim=64)
    f = rope_inv_freq(args, 0, 64).to(DEV)
    b, W, n_e, D = 3, 8, 5, 192
    x = (torch.randn(b, 1, D, device=DEV) * 3).to(torch.bfloat16)
    w = torch.randn(D, device=DEV)
    pos = torch.tensor([[3], [8], [29]], device=DEV, dtype=torch.int64)
    keys = torch.randn(b, W + n_e, D, device=DEV).to(torch.bfloat16)
    keys_ref = keys.clone()
    got = kv_finish(x, w, 1e-6, pos, f, 64, 64, ring=keys[:, :W])
    want = kv_finish_ref(x, w, 1e-6, pos, f, 64, 64, ring=keys_ref[:, :W])
    expect = keys_ref.clone()
    for i, p in enumerate(pos[:, 0].tolist()):
        expect[i, p % W] = got[i, 0]
        assert torch.equal(keys_ref[i, p % W], want[i, 0])
    assert torch.equal(keys, expect), "only each row's slot pos % W changes, to the row's result"
    with pytest.raises(ValueError, match="ring"):
        kv_finish(x.expand(b, 2, D).contiguous(), w, 1e-6, pos.expand(b, 2).contiguous(), f, 64, 64,
                  ring=keys[:, :W])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("per_row", [False, True], ids=["pos-s", "pos-bs"])
def test_qkv_finish_is_the_two_launches(seed, dtype, per_row):
    """`qkv_finish` (the attention's q and KV finish in one launch, issue 27) returns bitwise
    `head_rms_rope(q)` and `kv_finish(kv)` (e4m3 nope blocks of 64, a ring written at pos % W when one token per
    row), for one position vector of both: [s] or [b, s] (rows at different positions, s = 1 with the ring)."""
    from kernels.norm import head_rms_rope
    from kernels.rope import kv_finish, qkv_finish
    args = tiny_args(rope_head_dim=64, index_head_dim=64)
    f = rope_inv_freq(args, 0, 64).to(DEV)
    b, s, h, d, W = 3, 1 if per_row else 2, 4, 192, 8
    q = (torch.randn(b, s, h, d, device=DEV) * torch.logspace(-2, 1, h, device=DEV)[:, None]).to(dtype)
    kv = (torch.randn(b, s, d, device=DEV) * 3).to(dtype)
    w = torch.randn(d, device=DEV)
    pos = torch.tensor([[3], [8], [29]], device=DEV) if per_row else torch.tensor([5, 6], device=DEV)
    ring = torch.randn(b, W + 2, d, device=DEV).to(dtype) if per_row else None
    ring2 = None if ring is None else ring.clone()
    index = (W, 4, 5) if per_row else None  # an HCA-like layer's key slots with the decode step (pos [b, 1])
    gq, gkv, gidx = qkv_finish(q, 1e-6, pos, f, 64, kv, w, 1e-5, 64, ring=None if ring is None else ring[:, :W],
                               index=index)
    if per_row:
        from kernels.attention import step_index_ref
        assert torch.equal(gidx, step_index_ref(pos, W, None, 4, 5)), "idx vs step_index_ref"
        assert torch.equal(qkv_finish(q, 1e-6, pos, f, 64, kv, w, 1e-5, 64, index=(W, 0, 0))[2],
                           step_index_ref(pos, W)), "window-only idx vs step_index_ref"
    else:
        assert gidx is None
    wq = head_rms_rope(q, 1e-6, pos, f, 64)
    wkv = kv_finish(kv, w, 1e-5, pos, f, 64, 64, ring=None if ring2 is None else ring2[:, :W])
    assert gq.dtype == dtype and torch.equal(gq, wq), "q vs head_rms_rope"
    assert gkv.dtype == dtype and torch.equal(gkv, wkv), "kv vs kv_finish"
    assert ring is None or torch.equal(ring, ring2), "ring write vs kv_finish's"
    assert not torch.equal(gq[..., -64:], head_rms_rope(q, 1e-6, pos * 0, f, 64)[..., -64:]), "RoPE is applied"


def test_qkv_finish_names_bad_input():
    from kernels.rope import qkv_finish
    args = tiny_args(rope_head_dim=64, index_head_dim=64)
    f = rope_inv_freq(args, 0, 64).to(DEV)
    q, kv, w = torch.randn(1, 2, 4, 192, device=DEV), torch.randn(1, 2, 192, device=DEV), torch.randn(192, device=DEV)
    pos = torch.tensor([0, 1], device=DEV)
    with pytest.raises(ValueError, match=r"qkv_finish: pos is torch.int32"):
        qkv_finish(q, 1e-6, pos.int(), f, 64, kv, w, 1e-6)
    with pytest.raises(ValueError, match=r"qkv_finish: weight is torch.float32 \(191,\)"):
        qkv_finish(q, 1e-6, pos, f, 64, kv, w[:191], 1e-6)
    with pytest.raises(ValueError, match=r"qkv_finish: q is torch.float16"):
        qkv_finish(q.half(), 1e-6, pos, f, 64, kv, w, 1e-6)
    with pytest.raises(ValueError, match=r"qkv_finish: kv is torch.float16"):
        qkv_finish(q, 1e-6, pos, f, 64, kv.half(), w, 1e-6)
    with pytest.raises(ValueError, match=r"qkv_finish: q_eps is 0.0"):
        qkv_finish(q, 0.0, pos, f, 64, kv, w, 1e-6)
    with pytest.raises(ValueError, match=r"qkv_finish: q is shape \(1, 2, 4, 192\); expected \[b, s, h, d\] with "
                                         r"kv's b, s = \(2, 2\)"):
        qkv_finish(q, 1e-6, pos, f, 64, torch.cat((kv, kv)), w, 1e-6)
    with pytest.raises(ValueError, match=r"qkv_finish: pos is shape \(2,\); expected \[b, s\] with index="):
        qkv_finish(q, 1e-6, pos, f, 64, kv, w, 1e-6, index=(8, 0, 0))
