"""Batch-invariant mode (issue 25; `kernels.invariant`), kernel by kernel at tiny shapes (Triton interpreter on CPU,
or CUDA): with `invariant=True` a row computed alone (M = 1) and the same row inside M = 2..64 rows of fresh random
neighbours, at a random place, are bitwise equal. Negative controls: the default launches of the same kernels
differ somewhere over the same rows (their tile / split / path follows M), so the check can see a difference
(grouped GEMV, fp32 GEMV, hc_pre, sparse attention); and the catalogue mutant `invariant_split_follows_m` (the
mode's split-K count derived from M) is killed by `test_fp32_linear_rows_invariant[invariant]`.

The model-level check (a row's logits alone vs in a ragged batch, a 3-token verify step vs 3 single steps) is
`tests/unit/test_batch_invariant_model.py`; the Flash-width GPU check `tests/gpu/test_batch_invariant.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4 import quant

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP or not torch.cuda.is_available() else "cuda"
pytestmark = [pytest.mark.hardstop,  # the batch-invariant mode's guarantee, kernel by kernel (issue 25)
              pytest.mark.skipif(not INTERP and not torch.cuda.is_available(),
                                 reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set before import)")]

MS = (2, 5, 17, 33, 64)  # batch sizes around every default switch (bn at 16, M buckets 8 / 32, BM powers of two)


def _rows(fn, make, ms=MS, seed=0, first=1) -> list[tuple[int, int]]:
    """fn(rows [M, ...]) -> out [M, ...]; make(M, gen) -> M fresh random rows. Computes one row alone (first = 1;
    or as row 0 of `first` rows: the prefill side, > 64 rows), then inside each M of `ms` at a random place among
    fresh rows; returns the (M, place) pairs where it differs bitwise."""
    g = torch.Generator().manual_seed(seed)
    row = make(first, g)
    alone = fn(row)[0]
    bad = []
    for m in ms:
        batch = make(m, g)
        p = int(torch.randint(0, m, (1,), generator=g))
        batch[p] = row[0]
        got = fn(batch)[p]
        if not torch.equal(got, alone):
            bad.append((m, p))
    return bad


def _bf16(m, g, k):
    """[m, k] bf16, each 128-block at a random scale over 2^-8..2^8 (the fp32 sums of exact products are then
    inexact, so a change of summation order shows)."""
    return (torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-8, 9, (m, k // 128), generator=g)
            .repeat_interleave(128, 1)).to(torch.bfloat16).to(DEV)


def _cancelling(m, g, k, groups=1):
    """`_bf16` rows whose second half of every k-wide group is minus the first half, plus one small random block:
    against `_w8(..., halves=True)` weights each output is a small remainder of large cancelling partial sums, so
    a change of the fp32 summation order (a split) moves it by far more than one bf16 ulp (without it the bf16
    rounding of the output hides most order changes)."""
    x = _bf16(m, g, groups * k).float().cpu().view(m, groups, k)
    x[..., k // 2:] = -x[..., :k // 2]
    x[..., -128:] += torch.randn(m, groups, 128, generator=g) * 2.0 ** -6
    return x.view(m, groups * k).to(torch.bfloat16).to(DEV)


def _w8(n, k, seed=1, halves=False):
    """FP8 codes + ue8m0 block scales of an [n, k] weight over 2^-13..2^13 along k; `halves`: the second half of
    the inputs is a copy of the first (for `_cancelling` rows)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-4, 4, k)[None, :]
    if halves:
        w[:, k // 2:] = w[:, :k // 2]
    q, s = quant.fp8_block_quant(w)
    return q.to(DEV), s.to(DEV)


# N = 128, K = 2048: the default GEMV's bn (64 up to 16 rows, 32 above) changes the grid and so the split-K count
N8, K8 = 128, 2048


def test_fp8_linear_rows_invariant():
    """No default control here: the W8A8 products have <= 8 significant bits on the e4m3 grid, and under the
    interpreter the fp32 sums of this GEMV came out exact for every split tried (splits 8 vs 4, measured), so an
    order change does not show in its bf16 output; the grouped wo_a (bf16 x, not quantized) carries the GEMV's
    control below, the GPU test the model-level one."""
    from kernels.gemm import fp8_linear
    w, s = _w8(N8, K8, halves=True)
    bad = _rows(lambda x: fp8_linear(x, w, s, invariant=True), lambda m, g: _cancelling(m, g, K8))
    assert not bad, f"fp8_linear(invariant=True): the row differs inside (M, place) {bad}"


def test_fp8_linear_invariant_above_64_rows():
    """The prefill side of the mode (> 64 rows: the 128 x 128 tiles, no split-K): a row of a 65-row call equals
    the same row inside 70 and 200 rows (another tile count, another place in its tile). (The decode side and
    the prefill side are not claimed equal: README "Batch-invariant mode".)"""
    from kernels.gemm import fp8_linear
    w, s = _w8(N8, 512)
    bad = _rows(lambda x: fp8_linear(x, w, s, invariant=True), lambda m, g: _bf16(m, g, 512), ms=(70, 200), first=65)
    assert not bad, f"fp8_linear(invariant=True), > 64 rows: differs inside (M, place) {bad}"


def test_grouped_and_fp32_linear_invariant_above_64_rows():
    """The prefill side of the grouped wo_a GEMV and of the fp32 GEMV (> 64 rows: 64-row tiles): a row of a 65-row
    call equals the row inside 70 rows and, for the fp32 GEMV, 1100 rows (a second launch,
    INVARIANT_LAUNCH_ROWS = 1024)."""
    from kernels.fp32_linear import fp32_linear
    from kernels.gemm import fp8_grouped_gemv
    G, n, k = 2, 128, 256
    w, s = _w8(G * n, k, halves=True)
    bad = _rows(lambda x: fp8_grouped_gemv(x, w, s, G, invariant=True), lambda m, g: _cancelling(m, g, k, G),
                ms=(70,), first=65)
    assert not bad, f"fp8_grouped_gemv(invariant=True), > 64 rows: differs inside (M, place) {bad}"
    w32 = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEV)
    make = lambda m, g: torch.randn(m, 256, generator=g).to(DEV)  # noqa: E731
    bad = _rows(lambda x: fp32_linear(x, w32, invariant=True), make, ms=(70, 1100), first=65)
    assert not bad, f"fp32_linear(invariant=True), > 64 rows: differs inside (M, place) {bad}"


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "default-control"])
def test_fp8_grouped_gemv_rows_invariant(invariant):
    from kernels.gemm import fp8_grouped_gemv
    G, n, k = 2, 128, 1024
    w, s = _w8(G * n, k, halves=True)
    bad = _rows(lambda x: fp8_grouped_gemv(x, w, s, G, invariant=invariant), lambda m, g: _cancelling(m, g, k, G))
    if invariant:
        assert not bad, f"fp8_grouped_gemv(invariant=True): differs inside (M, place) {bad}"
    else:
        assert bad, "negative control: the default grouped GEMV gave the same row at every M"


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "default-control"])
def test_fp32_linear_rows_invariant(invariant):
    from kernels.fp32_linear import fp32_linear
    g0 = torch.Generator().manual_seed(3)
    w = torch.randn(192, 512, generator=g0).to(torch.bfloat16).to(DEV)
    make = lambda m, g: torch.randn(m, 512, generator=g).to(DEV)  # noqa: E731
    bad = _rows(lambda x: fp32_linear(x, w, invariant=invariant), make, ms=MS)
    if invariant:
        assert not bad, f"fp32_linear(invariant=True): differs inside (M, place) {bad}"
    else:
        assert bad, "negative control: the default fp32 GEMV gave the same row at every M"


def _hc_params(hc, D, head, seed=4):
    g = torch.Generator().manual_seed(seed)
    n = hc if head else (2 + hc) * hc
    fn = (torch.randn(n, hc * D, generator=g) * 0.05).to(DEV)
    base = (torch.randn(n, generator=g) * 0.1).to(DEV)
    scale = (0.5 + torch.rand(1 if head else 3, generator=g)).to(DEV)
    return fn, base, scale


@pytest.mark.parametrize("site,invariant", [("pre", True), ("head", True), ("pre", False)],
                         ids=["invariant-pre", "invariant-head", "default-control-pre"])
def test_mhc_rows_invariant(site, invariant):
    """hc_pre / hc_head tokens alone and among T tokens. The control runs on hc_pre, whose fp32 post / comb show a
    changed split (hc_head's bf16 y hides most: the same `_mix_sites` launch)."""
    from kernels import mhc
    hc, D = 4, 512
    fn, base, scale = _hc_params(hc, D, site == "head")
    make = lambda m, g: torch.randn(m, hc, D, generator=g).to(torch.bfloat16).to(DEV)  # noqa: E731
    if site == "pre":
        def f(H):
            x, post, comb = mhc.hc_pre(H, fn, base, scale, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6,
                                       invariant=invariant)
            return torch.cat((x.float(), post, comb.flatten(1)), 1)
    else:
        def f(H):
            return mhc.hc_head(H, fn, base, scale, hc_eps=1e-6, norm_eps=1e-6, invariant=invariant)
    bad = _rows(f, make, ms=(2, 17, 64, 70))
    if invariant:
        assert not bad, f"hc_{site}(invariant=True): differs inside (T, place) {bad}"
    elif DEV == "cuda" and not bad:
        pytest.skip("on the GPU the default hc_pre's splits at these tiny shapes happen to agree (measured on an "
                    "H200); the GPU negative control is tests/gpu/test_batch_invariant.py at Flash width")
    else:
        assert bad, f"negative control: the default hc_{site} gave the same token at every T"


def _attn_inputs(b, s, h, hd, n, k, g):
    q = torch.randn(b, s, h, hd, generator=g).to(torch.bfloat16).to(DEV)
    kv = torch.randn(b, n, hd, generator=g).to(torch.bfloat16).to(DEV)
    idx = torch.randint(-1, n, (b, s, k), generator=g).to(DEV)
    return q, kv, idx


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "default-control"])
def test_sparse_attn_query_invariant(invariant):
    """A query (its q, its row's kv and its index row) alone, then as query t of a verify-sized s = 3 step in a
    batch of b rows; the invariant batch also carries 64 trailing -1 slots (a longer index row, as a state with
    more entry slots gives)."""
    from kernels import attention
    h, hd, n, k = 16, 64, 300, 200
    g = torch.Generator().manual_seed(5)
    sink = torch.randn(h, generator=g).to(DEV)
    fn = attention.invariant_sparse_attn if invariant else attention.sparse_attn
    q1, kv1, idx1 = _attn_inputs(1, 1, h, hd, n, k, g)
    alone = fn(q1, kv1, sink, idx1, 0.125)[0, 0]
    bad = []
    for b, s in ((2, 1), (8, 1), (3, 3), (16, 1)):
        q, kv, idx = _attn_inputs(b, s, h, hd, n, k, g)
        r, t = int(torch.randint(0, b, (1,), generator=g)), s - 1
        q[r, t], kv[r], idx[r, t] = q1[0, 0], kv1[0], idx1[0, 0]
        if invariant:
            idx = torch.cat((idx, torch.full((b, s, 64), -1, dtype=idx.dtype, device=DEV)), -1)
        if not torch.equal(fn(q, kv, sink, idx, 0.125)[r, t], alone):
            bad.append((b, s))
    if invariant:
        assert not bad, f"invariant_sparse_attn: the query differs inside (b, s) {bad}"
    elif DEV == "cuda" and not bad:
        pytest.skip("on the GPU the default sparse_attn's splits at these tiny shapes happen to agree (measured on "
                    "an H200); the GPU negative control is tests/gpu/test_batch_invariant.py at Flash width")
    else:
        assert bad, "negative control: the default sparse_attn gave the same query at every (b, s)"


def test_sparse_attn_split_size_names_bad_input():
    from kernels import attention
    g = torch.Generator().manual_seed(6)
    q, kv, idx = _attn_inputs(1, 1, 16, 64, 40, 40, g)
    sink = torch.zeros(16, device=DEV)
    with pytest.raises(ValueError, match="split_size"):
        attention.sparse_attn(q, kv, sink, idx, 0.1, split_size=48)
    with pytest.raises(ValueError, match="num_splits or split_size"):
        attention.sparse_attn(q, kv, sink, idx, 0.1, split_size=64, num_splits=2)


def test_moe_token_invariant(monkeypatch):
    """A token's routed output alone and among T tokens that share its experts (k = 4 of 6 experts: T = 17 is
    68 pairs, above GEMV_MAX_PAIRS - lowered to 48 here, a test-speed measure: the interpreter runs every program
    of the 196 pairs the real 192 would need - where the default switches to the tiles); and on the prefill side
    (> 64 tokens: `kernels.moe.INVARIANT_TILES`) as row 0 of 65 tokens and inside 80. No default control here:
    under the interpreter the tiles' and the gemv's fp32 sums of these exact FP4 x e4m3 products round alike
    (measured); the GPU test's model-level control covers the MoE there."""
    import kernels.moe as km
    from kernels.moe import StackedExperts, moe_experts
    monkeypatch.setattr(km, "GEMV_MAX_PAIRS", 48)
    E, D, I, k = 6, 128, 128, 4
    invariant = True
    g0 = torch.Generator().manual_seed(7)
    parts = {}
    for nme, (o, i) in {"1": (I, D), "3": (I, D), "2": (D, I)}.items():
        qs = [quant.fp4_quant(torch.randn(o, i, generator=g0)) for _ in range(E)]
        parts["w" + nme] = torch.stack([q for q, _ in qs]).to(DEV)
        parts["s" + nme] = torch.stack([s for _, s in qs]).to(DEV)
    ex = StackedExperts(**parts)

    def make(m, g):
        x = torch.randn(m, D, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(m)]).float()
        w = torch.rand(m, k, generator=g)
        return torch.cat((x, ids, w), 1)  # one tensor per token, so `_rows` can place it

    def f(rows):
        x = rows[:, :D].to(torch.bfloat16).to(DEV).contiguous()
        ids = rows[:, D:D + k].long().to(DEV).contiguous()
        w = rows[:, D + k:].float().to(DEV).contiguous()
        return moe_experts(x, w, ids, ex, 10.0, invariant=invariant)

    assert km.moe_config(17 * k, E).path == "tiles"  # the default would switch at T = 17
    bad = _rows(f, make, ms=(3, 17))
    assert not bad, f"moe_experts(invariant=True): the token differs inside (T, place) {bad}"
    bad = _rows(f, make, ms=(80,), first=65)  # the prefill side (> 64 tokens): the fixed tiles
    assert not bad, f"moe_experts(invariant=True), > 64 tokens: the token differs inside (T, place) {bad}"


def test_fixed_order_helpers():
    """`kernels.invariant.hadamard` is x @ hadamard_matrix(n).T up to the fp32 order (bound: n * 2^-24 * sum |x|
    per element, the textbook bound of an n-term fp32 sum of exact products, times n^-0.5); `head_rms` is the
    official bf16 chain `q * rsqrt(q.square().mean(-1) + eps)` up to the fp32 order of the sum of squares before
    its bf16 rounding (so within one bf16 ulp of the mean: at most 2 bf16 ulps of the output, and equal in most
    elements); each row's result is bitwise the same alone and among 1..70 other rows. Negative control: a
    per-row scale of 2^-3 on a hadamard row changes that row only (so the check sees a row's own values)."""
    from kernels.invariant import hadamard, head_rms
    from dsv4.model import hadamard_matrix
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(37, 128, generator=g) * 2.0 ** torch.randint(-6, 7, (37, 1), generator=g)).to(DEV)
    hx = hadamard(x)
    want = x @ hadamard_matrix(128, x.device).T
    # n terms, unit roundoff 2^-23 (the GPU's tensor-core accumulation truncates; the interpreter's fp32 rounds)
    bound = 128 * 2.0 ** -23 * x.abs().sum(-1, keepdim=True) * 128 ** -0.5
    assert ((hx - want).abs() <= bound).all() and not torch.equal(hx, torch.zeros_like(hx))
    q = (torch.randn(3, 5, 7, 512, generator=g) * 2.0 ** torch.randint(-4, 5, (3, 5, 7, 1), generator=g)
         ).to(torch.bfloat16).to(DEV)
    eps = 1e-6
    want = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)
    got = head_rms(q, eps)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    ulp = 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp_min(2.0 ** -120))) - 7)
    assert ((got.float() - want.float()).abs() <= 2 * ulp).all()
    assert (got == want).float().mean() > 0.9
    q2 = q.reshape(-1, 512)
    for f, t in ((hadamard, x), (lambda r: head_rms(r, eps), q2)):
        alone = f(t[5:6])
        for m in (2, 17, 70):
            rows = t[torch.randint(0, t.shape[0], (m,), generator=g)].clone()
            rows[m // 2] = t[5]
            assert torch.equal(f(rows)[m // 2], alone[0])
    scaled = x.clone()
    scaled[3] *= 2.0 ** -3
    diff = (hadamard(scaled) != hx).any(-1)
    assert diff.tolist() == [i == 3 for i in range(37)]
    with pytest.raises(ValueError, match="power of two"):
        hadamard(torch.zeros(2, 96, device=DEV))
    with pytest.raises(ValueError, match="float32"):
        hadamard(torch.zeros(2, 128, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="non-bf16"):
        head_rms(torch.zeros(2, 128, device=DEV), eps)
    with pytest.raises(ValueError, match="eps"):
        head_rms(q, 0.0)


def test_pool_windows_is_the_softmax_pooling_in_a_fixed_order():
    """`kernels.invariant.pool_windows` (the mode's compressor prefill pooling) equals `(Z.softmax(2) * A).sum(2)`
    within fp32 summation error (w = 8 and 128 rows per window: the CSA and HCA widths; -inf scores of a fresh
    state's rows get weight 0), and a window's result is bitwise the same pooled with 1 or 6 windows in the call
    (the chunked prefill's property). Negative control: a window's own scores move its result."""
    from kernels.invariant import pool_windows
    g = torch.Generator().manual_seed(9)
    for w in (8, 128):
        Z = (torch.randn(2, 6, w, 32, generator=g) * 3).to(DEV)
        A = (torch.randn(2, 6, w, 32, generator=g) * 2.0 ** torch.randint(-4, 5, (2, 6, 1, 32), generator=g)).to(DEV)
        Z[:, 0, : w // 2] = -float("inf")  # the first window's previous-window half: a fresh state's rows
        want = (Z.softmax(2) * A).sum(2)
        got = pool_windows(Z, A)
        bound = 2 * w * 2.0 ** -24 * A.abs().amax(2) + 1e-30
        assert got.shape == (2, 6, 32) and ((got - want).abs() <= bound).all()
        assert torch.equal(pool_windows(Z[:, :1], A[:, :1])[:, 0], got[:, 0])
        Z2 = Z.clone()
        Z2[:, 3, 1] += 1.0
        moved = (pool_windows(Z2, A) != got).any(-1).any(0)
        assert moved.tolist() == [i == 3 for i in range(6)]


def test_modes_name_bad_input():
    from dsv4.backend import get_backend
    from kernels.fp32_linear import fp32_linear
    from kernels.gemm import GemvConfig, fp8_linear
    w, s = _w8(128, 256)
    x = _bf16(2, torch.Generator().manual_seed(9), 256)
    with pytest.raises(ValueError, match="gemv / prefill"):
        fp8_linear(x, w, s, invariant=True, gemv=GemvConfig())
    with pytest.raises(ValueError, match="invariant"):
        fp32_linear(x, w.to(torch.bfloat16), invariant=True, block=(64, 64))
    with pytest.raises(ValueError, match="batch_invariant=True needs backend='triton'"):
        get_backend("reference", torch.device("cpu"), batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant"):
        get_backend("triton", torch.device("cpu"), batch_invariant="yes")


def test_invariant_linear_honours_act_block_and_grouped_linear_checks_the_weight():
    """`kernels.invariant.linear` quantized every 128-multiple width in blocks of 128 whatever act_block said and
    took act_block -1 / True / 128.0 or fp32="yes"; `invariant.grouped_linear` only checked the weight's element
    count. Now as `kernels.gemm.linear` / `grouped_linear`: act_block honoured (the reference quantizer for other
    blocks), bad values and a wrong weight shape are ValueErrors naming the argument. Controls: linear_ref's
    values for act_block 64, the per-group product for a [G*3, i] weight."""
    from kernels import invariant as kinv
    from kernels.gemm import linear_ref
    x = torch.randn(2, 256)
    x[:, :64] *= 1e-5  # flushed to 0 in a 128 block, kept in their own 64 block
    x = x.to(torch.bfloat16)
    w = torch.randn(128, 256)
    w[:, 64:] = 0
    q, s = quant.fp8_block_quant(w)
    y64 = kinv.linear(x.to(DEV), q.to(DEV), s.to(DEV), 64)
    assert torch.equal(y64.cpu(), linear_ref(x, q, s, 64))
    assert not torch.equal(y64, kinv.linear(x.to(DEV), q.to(DEV), s.to(DEV), 128))
    for bad in (-1, True, 128.0):
        with pytest.raises(ValueError, match=rf"invariant.linear: act_block is {bad!r}; expected an int >= 0"):
            kinv.linear(x, q, s, bad)
    with pytest.raises(ValueError, match=r"invariant.linear: fp32 is 'yes'; expected a bool"):
        kinv.linear(x, q, s, 128, fp32="yes")
    o = torch.randn(1, 2, 2, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"invariant.grouped_linear: weight is torch.bfloat16 shape \(8, 16\)"):
        kinv.grouped_linear(o, torch.randn(8, 16).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"invariant.grouped_linear: o is torch.bfloat16 shape \(2, 2, 8\)"):
        kinv.grouped_linear(o[0], torch.randn(6, 8).to(torch.bfloat16))
    wg = torch.randn(6, 8).to(torch.bfloat16)
    got = kinv.grouped_linear(o.to(DEV), wg.to(DEV)).cpu()
    want = torch.stack([o[:, :, g].float() @ wg[3 * g:3 * g + 3].float().T for g in range(2)], 2).to(torch.bfloat16)
    assert got.shape == (1, 2, 2, 3) and torch.equal(got, want)
