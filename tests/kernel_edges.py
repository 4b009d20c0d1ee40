"""Edge-value cases for the Triton kernels (issue 17), shared by tests/unit (TRITON_INTERPRET=1, small shapes) and
tests/gpu (CUDA, DeepSeek-V4 sizes).

Random inputs keep the constant terms of a kernel (the `+ hc_eps` on the mHC pre weights, the eps inside every
Sinkhorn step, `norm_eps` in the RMS scale, the factor 2 of post, the attention sink in the softmax denominator,
the -1 slots, the indexer's ReLU) far below the comparison tolerance, so a kernel could drop one and still match
its reference. Each case below chooses inputs where that term DOMINATES the result, checks that it does on the
reference (so the case cannot silently stop being an edge case), then compares kernel and reference:

  mHC pre/head "saturated": base -200 on the pre logits (sigmoid underflows to exactly 0: pre = hc_eps, so
      x = hc_eps * sum_j H_j and nothing else), +200 on the post logits (post = 2 exactly), comb logits +-200 with
      every row one-hot on column 0 (the softmax is exactly one-hot; columns 1..hc-1 hold only eps, which the
      Sinkhorn normalises to eps / (hc eps + eps) = 1/(hc+1) after the first column step).
  mHC pre/head "tiny residual": H ~ 1e-5 so mean(X^2) ~ 1e-10 << norm_eps = 1e-6: the RMS scale is set by
      norm_eps (rsqrt(1e-6) = 1000 instead of ~1e5).
  hc_post: post in {0, 2} and comb a 0/1 permutation: every output is one exact sum, compared bitwise (bf16
      under the interpreter: within its truncating fp32 -> bf16 cast, one ulp).
  sparse attention: per head a sink 40 above every score (the output is e^-40 of a softmax average: the sink
      term is the whole denominator) or 80 below (negligible); rows with every slot -1 (output exactly 0), one
      valid slot, holes. Both the one-program and the split (flash-decoding merge) paths.
  indexer scores: small integers (exact in bf16 and in fp32 sums): a key with every q_h . k < 0 (the ReLU makes
      the score exactly 0 whatever the weights), negative / zero / large weights, a head count that is not a
      power of two (masked heads). Compared bitwise.

Tolerances: bf16 outputs rtol 1.6e-2 (dsv4.testing table) and fp32 outputs rtol 1e-5, both relative to the
magnitude of the row (max |reference| over the last axis), never an absolute floor that the tiny values of an
edge case would pass trivially; exact cases bitwise.
"""

from __future__ import annotations

import math

import torch

from kernels.launch import interpreting

HC, ITERS, EPS = 4, 20, 1e-6
SAT = 200.0  # |logit| at which fp32 sigmoid / softmax are exactly 0 or 1


def _rel_rows(got: torch.Tensor, want: torch.Tensor, rtol: float, name: str) -> None:
    """|got - want| <= rtol * max|want| over the last axis, per row; NaN never passes."""
    g, w = got.double().cpu(), want.double().cpu()
    scale = w.abs().amax(-1, keepdim=True)
    ok = torch.isfinite(g) & ((g - w).abs() <= rtol * scale)
    if not bool(ok.all()):
        i = tuple(int(v) for v in (~ok).nonzero()[0])
        raise AssertionError(f"{name}: {int((~ok).sum())}/{ok.numel()} elements off by more than {rtol:g} of their "
                             f"row's scale; first at {list(i)}: got {g[i].item()!r} want {w[i].item()!r} "
                             f"(row scale {scale[i[:-1]].item():.3e})")


def _rtol(dtype: torch.dtype) -> float:
    return 1.6e-2 if dtype == torch.bfloat16 else 1e-5


# ------------------------------------------------------------------------------------------------ mHC
def mhc_inputs(case: str, T: int, D: int, dtype, device, head: bool):
    """(H, fn, base, scale) for `case` in {"saturated", "tiny"}; fresh random values (torch's global RNG)."""
    K, n = HC * D, (HC if head else (2 + HC) * HC)
    scale = (torch.rand(1 if head else 3) + 0.5).to(device)
    if case == "saturated":
        H = torch.randn(T, HC, D).to(dtype).to(device)
        fn = (torch.randn(n, K) / math.sqrt(K)).to(device)
        base = torch.full((n,), -SAT)                     # pre logits: sigmoid -> 0, pre = hc_eps
        if not head:
            base[HC:2 * HC] = SAT                         # post = 2 * sigmoid(+200) = 2
            comb = torch.full((HC, HC), -SAT)
            comb[:, 0] = SAT                              # every row one-hot on column 0
            base[2 * HC:] = comb.flatten()
        return H, fn, base.to(device), scale
    if case == "tiny":
        H = (torch.randn(T, HC, D) * 1e-5).to(dtype).to(device)
        fn = (torch.randn(n, K) / math.sqrt(K) * 100).to(device)  # m = (fn X) rsqrt(mean X^2 + eps) ~ O(1)
        base = (torch.randn(n) * 0.5).to(device)
        return H, fn, base, scale
    raise ValueError(case)


def check_hc_pre_edge(case: str, T: int, D: int, dtype, device, iters: int, one_launch: bool) -> None:
    from kernels.mhc import hc_pre, hc_pre_ref

    H, fn, base, scale = mhc_inputs(case, T, D, dtype, device, head=False)
    kw = dict(sinkhorn_iters=iters, hc_eps=EPS, norm_eps=EPS)
    rx, rpost, rcomb = hc_pre_ref(H, fn, base, scale, **kw)
    nan = float("nan")
    out = (torch.full((T, D), nan, dtype=dtype, device=device), torch.full((T, HC), nan, device=device),
           torch.full((T, HC, HC), nan, device=device))
    x, post, comb = hc_pre(H, fn, base, scale, out=out, one_launch=one_launch, **kw)
    if case == "saturated":  # the constants dominate on the reference
        assert bool((rpost == 2.0).all()), "post logits +200 must give post = 2 exactly"
        want_x = (EPS * H.double().sum(1)).to(dtype).double()
        _rel_rows(rx, want_x, _rtol(dtype), "reference x = hc_eps * sum_j H_j")
        assert float(rx.double().abs().max()) > 0
        if iters == 1:  # columns 1.. hold only eps after the one-hot softmax: eps / (hc eps + eps)
            assert torch.allclose(rcomb[:, :, 1:].double(), torch.full_like(rcomb[:, :, 1:].double(), 1 / (HC + 1)),
                                  rtol=1e-5, atol=0)
        assert torch.equal(post, rpost), "post"
    else:
        X = H.double().reshape(T, -1)
        assert float(X.square().mean(-1).max()) < 0.01 * EPS, "mean(X^2) must be far below norm_eps"
        _rel_rows(post, rpost, 1e-5, "post")
    _rel_rows(x, rx, _rtol(dtype), f"x ({case})")
    _rel_rows(comb, rcomb, 1e-5, f"comb ({case})")


def check_hc_head_edge(case: str, T: int, D: int, dtype, device, one_launch: bool) -> None:
    from kernels.mhc import hc_head, hc_head_ref

    H, fn, base, scale = mhc_inputs(case, T, D, dtype, device, head=True)
    kw = dict(hc_eps=EPS, norm_eps=EPS)
    ry = hc_head_ref(H, fn, base, scale, **kw)
    y = hc_head(H, fn, base, scale, one_launch=one_launch,
                out=torch.full((T, D), float("nan"), dtype=dtype, device=device), **kw)
    if case == "saturated":
        _rel_rows(ry, (EPS * H.double().sum(1)).to(dtype).double(), _rtol(dtype), "reference y = hc_eps * sum_j H_j")
    else:
        assert float(H.double().reshape(T, -1).square().mean(-1).max()) < 0.01 * EPS
    _rel_rows(y, ry, _rtol(dtype), f"y ({case})")


def check_hc_post_exact(T: int, D: int, dtype, device) -> None:
    """post in {0, 2}, comb a 0/1 permutation (token-dependent): out[t, k] = post_k a_t + H[t, perm^-1(k)],
    one exact fp32 sum rounded once: kernel == reference bitwise, and == the hand value."""
    from kernels.mhc import hc_post, hc_post_ref

    H = torch.randn(T, HC, D).to(dtype).to(device)
    a = torch.randn(T, D).to(dtype).to(device)
    post = (torch.randint(0, 2, (T, HC)) * 2.0).to(device)
    comb = torch.zeros(T, HC, HC)
    for t in range(T):
        comb[t, torch.randperm(HC), torch.arange(HC)] = 1.0  # column k has exactly one source row
    comb = comb.to(device)
    got = hc_post(a, H, post, comb, out=torch.full((T, HC, D), float("nan"), dtype=dtype, device=device))
    want = hc_post_ref(a, H, post, comb)
    src = comb.argmax(1)  # [T, k] source stream of output k
    hand = (post[..., None] * a.float()[:, None] + torch.gather(H.float(), 1, src[..., None].expand(-1, -1, D)))
    assert torch.equal(want, hand.to(dtype)), "reference != hand value"
    if dtype == torch.bfloat16 and interpreting():
        # the Triton 3.9 interpreter casts fp32 -> bf16 toward zero (CUDA rounds to nearest even, as torch):
        # allow that one ulp here; tests/gpu compares bitwise
        ok = (got.double() - want.double()).abs() <= want.double().abs() * 2.0 ** -7
        assert bool(ok.all()), "hc_post != reference (beyond the interpreter's truncating bf16 cast)"
    else:
        assert torch.equal(got, want), "hc_post != reference on exact inputs"


NORM_EPS_EXACT = 2.0 ** -100  # `lo_piece_inputs`' norm_eps: > 0 (hc_pre / hc_head refuse 0), lost in mean(X²)


def lo_piece_inputs(T: int, D: int, device, head: bool, c: float = 4.0):
    """(H, fn, base, scale, g) where every mix logit is decided by the LOW 8 bits of an fp32 fn value (issue 14,
    item 2: the bf16x3 projection splits fn into bf16 hi/mid/lo; a kernel that drops or mis-rounds the lo piece,
    or multiplies in tf32/bf16, must fail here). Exact by construction, so any correct fp32 projection gives the
    same logits bit for bit:
      * K = hc·D = n·4^j with n as small as possible (n = 1 at D 64 / 4096, 7 at D 7168). Token t's stream row
        X_t is zero except n positions of value ±2: its carrier c_t (distinct per token) and n-1 shared filler
        positions Z where every fn row is 0. So mean(X²) = 4n/K = 4^(1-j) and, with norm_eps = NORM_EPS_EXACT
        (2^-100: far below half an fp32 ulp of mean(X²), so mean(X²) + norm_eps == mean(X²); norm_eps must be
        > 0), the RMS scale 2^(j-1) is exact, and fn·X_t is ONE exact product (the other terms are exact zeros).
      * fn[i, c_t] = s_t·(F_i + δ_it), s_t the sign of X_t's carrier, F_i with 16 significant bits in
        [2^e, 1.5·2^e), δ_it = g_it·2^(e-23) with g an integer in [-255, 255] (|δ| < one 16-bit ulp of F_i),
        so fn has 24 significant bits and its last 8 are g. Below 1.5·2^e, rounding fn to bf16 never carries
        into the next binade, so every partial sum of the pieces (lo, lo + mid, fn) lies within 24 bits of the
        larger addend: exact also in a tensor core that truncates what it aligns beyond fp32's width.
      * scale = c·2^(15-e-j) for every group and base_i = -F_i·2^(j-1)·2·scale (exact), so the logit of mix i at
        token t is m·scale + base = g_it·c/256 exactly: hi + mid alone (F_i, or F_i ± one 16-bit ulp when
        rounded to nearest) would give 0 or ±c instead.
    fn elsewhere is random fp32 (multiplied by X = 0). Returns g [T, n_mix] (the integer lo bits)."""
    K, n_mix = HC * D, (HC if head else (2 + HC) * HC)
    j = 0
    while K % (4 ** (j + 1)) == 0:
        j += 1
    n = K // 4 ** j
    if T + n - 1 > K:
        raise ValueError(f"lo_piece_inputs: T={T} carriers + {n - 1} fillers exceed K={K}")
    perm = torch.randperm(K)
    Z, carriers = perm[:n - 1], perm[n - 1:n - 1 + T]
    s = torch.randint(0, 2, (T,)) * 2.0 - 1.0
    X = torch.zeros(T, K)
    X[:, Z] = (torch.randint(0, 2, (T, n - 1)) * 2.0 - 1.0) * 2.0
    X[torch.arange(T), carriers] = 2.0 * s
    e = -math.ceil(math.log2(math.sqrt(K)))  # F ~ 1/sqrt(K), as a trained fn
    F = (1.0 + torch.randint(0, 2 ** 14, (n_mix,)).double() / 2 ** 15) * 2.0 ** e  # 16 significant bits, < 1.5·2^e
    g = torch.randint(-255, 256, (T, n_mix))
    vals = (F[None, :] + g.double() * 2.0 ** (e - 23)) * s.double()[:, None]       # 24 significant bits
    fn = torch.randn(n_mix, K) / math.sqrt(K)
    fn[:, Z] = 0.0
    fn[:, carriers] = vals.t().float()
    assert torch.equal(fn[:, carriers].double(), vals.t()), "fn values must be exact in fp32"
    sc = c * 2.0 ** (15 - e - j)
    base = -(F * 2.0 * 2.0 ** (j - 1) * sc)  # |X_carrier| · rms scale · scale · F
    assert torch.equal(base.float().double(), base), "base must be exact in fp32"
    scale = torch.full((1 if head else 3,), sc)
    H = X.reshape(T, HC, D).bfloat16()
    return H.to(device), fn.to(device), base.float().to(device), scale.float().to(device), g


def _two_piece(fn: torch.Tensor, rounding: str) -> torch.Tensor:
    """fn with only its leading 16 bits (hi + mid bf16 pieces), cut by truncation or by rounding to nearest."""
    if rounding == "nearest":
        hi = fn.bfloat16().float()
        return hi + (fn - hi).bfloat16().float()
    return (fn.view(torch.int32) & ~0xFF).view(torch.float32)


def check_hc_lo_piece(T: int, D: int, device, one_launch: bool, head: bool, dot: str | None = None) -> None:
    """hc_pre / hc_head on `lo_piece_inputs` (norm_eps NORM_EPS_EXACT, lost in mean(X²)): post and comb (pre) or y
    (head) against the reference
    (fp32 rtol 1e-5 / bf16 rtol 1.6e-2 of the row's scale), after checking on the reference that the case is an
    edge: its post logits are exactly g·c/256 and fn cut to its leading 16 bits (a projection that drops the lo
    piece) moves post by > 1e-2 (1000x the tolerance). `dot` forces the launcher's projection ("tf32x3": the
    negative control on CUDA, whose 22-bit weights must fail here); None = the public launchers."""
    from kernels import mhc
    from kernels.mhc import hc_head, hc_head_ref, hc_pre, hc_pre_ref

    if dot is not None:
        def hc_pre(H, fn, base, scale, *, out, one_launch, sinkhorn_iters, hc_eps, norm_eps):  # noqa: F811
            mhc._mix_sites(H, fn, base, scale, *out, sinkhorn_iters, hc_eps, norm_eps, False, one_launch, dot=dot)
            return out

        def hc_head(H, fn, base, scale, *, out, one_launch, hc_eps, norm_eps):  # noqa: F811
            mhc._mix_sites(H, fn, base, scale, out, None, None, 1, hc_eps, norm_eps, True, one_launch, dot=dot)
            return out

    H, fn, base, scale, g = lo_piece_inputs(T, D, device, head)
    if head:
        kw = dict(hc_eps=EPS, norm_eps=NORM_EPS_EXACT)
        ry = hc_head_ref(H, fn, base, scale, **kw)
        for rounding in ("truncate", "nearest"):
            cut = hc_head_ref(H, _two_piece(fn, rounding), base, scale, **kw)
            assert float((cut.double() - ry.double()).abs().max()) > 1e-2 * float(ry.double().abs().max()), \
                f"no power: dropping fn's lo piece ({rounding}) leaves y unchanged"
        y = hc_head(H, fn, base, scale, one_launch=one_launch,
                    out=torch.full((T, D), float("nan"), dtype=H.dtype, device=device), **kw)
        _rel_rows(y, ry, _rtol(H.dtype), "y (lo piece)")
        return
    kw = dict(sinkhorn_iters=ITERS, hc_eps=EPS, norm_eps=NORM_EPS_EXACT)
    rx, rpost, rcomb = hc_pre_ref(H, fn, base, scale, **kw)
    hand = 2.0 / (1.0 + torch.exp(-(g[:, HC:2 * HC].double() * 4.0 / 256)))
    assert torch.allclose(rpost.double().cpu(), hand, rtol=1e-6, atol=1e-6), "reference post != 2 sigmoid(g c/256)"
    for rounding in ("truncate", "nearest"):
        cut = hc_pre_ref(H, _two_piece(fn, rounding), base, scale, **kw)[1]
        assert float((cut - rpost).abs().max()) > 1e-2, f"no power: dropping fn's lo piece ({rounding}) keeps post"
    nan = float("nan")
    out = (torch.full((T, D), nan, dtype=H.dtype, device=device), torch.full((T, HC), nan, device=device),
           torch.full((T, HC, HC), nan, device=device))
    x, post, comb = hc_pre(H, fn, base, scale, out=out, one_launch=one_launch, **kw)
    _rel_rows(post, rpost, 1e-5, "post (lo piece)")
    _rel_rows(comb, rcomb, 1e-5, "comb (lo piece)")
    _rel_rows(x, rx, _rtol(H.dtype), "x (lo piece)")


# ------------------------------------------------------------------------------------------- attention
def check_sparse_attn_edge(b: int, s: int, h: int, hd: int, n: int, k: int, dtype, device, splits: int) -> None:
    """Rows (per batch): 0 all slots -1; 1 exactly one valid slot; 2.. random with holes. Heads: even ones have a
    sink 40 above every score of the case, odd ones 80 below every score."""
    from kernels.attention import sparse_attn, sparse_attn_ref

    assert s >= 3
    scale = hd ** -0.5
    q = torch.randn(b, s, h, hd).to(dtype).to(device)
    kv = torch.randn(b, n, hd).to(dtype).to(device)
    idx = torch.randint(0, n, (b, s, k))
    idx = idx.masked_fill(torch.rand(b, s, k) < 0.3, -1)
    idx[:, 0] = -1
    idx[:, 1] = -1
    idx[:, 1, k // 2] = torch.randint(0, n, (b,))
    idx = idx.to(device)
    logits = torch.einsum("bshd,bnd->bshn", q.float(), kv.float()) * scale
    hi, lo = float(logits.max()), float(logits.min())
    sink = torch.where(torch.arange(h) % 2 == 0, torch.tensor(hi + 40.0), torch.tensor(lo - 80.0)).to(device)
    want = sparse_attn_ref(q, kv, sink, idx, scale)
    got = sparse_attn(q, kv, sink, idx, scale, num_splits=splits, check_idx=True,
                      out=torch.full_like(q, float("nan")))
    # the edge terms dominate on the reference
    assert bool((want[:, 0] == 0).all()), "all -1 row must give exactly 0"
    big = want[:, 1:, 0::2].double().abs()
    assert float(big.max()) < 1e-14 * float(kv.double().abs().max()) and float(big.amax(-1).min()) > 0, \
        "sink-dominated heads: output must be ~e^-40 of the values, and not 0"
    single = kv.double()[torch.arange(b, device=kv.device), idx[:, 1, k // 2].long()]      # [b, hd]: the one valid row
    _rel_rows(want[:, 1, 1::2].double(), single[:, None].expand(-1, len(range(1, h, 2)), -1),
              _rtol(dtype), "one valid slot, negligible sink: output = that value row")
    assert torch.equal(got[:, 0], want[:, 0]), "all -1 row"
    _rel_rows(got, want, _rtol(dtype), f"sparse_attn edges (splits={splits})")


# ------------------------------------------------------------------------------------------- indexer
def check_indexer_edge(b: int, s: int, H: int, d: int, n: int, dtype, device) -> None:
    """Integer inputs (exact): q_h >= 1 elementwise; key 0 <= -1 elementwise (every q_h . k_0 < 0: score exactly
    0 by the ReLU whatever the weights); key 1 >= 1 (every dot > 0); other keys random in [-3, 3]. Weights in
    {-64, -1, 0, 1, 2, 64}: |score| <= 64 heads * 64 * 128 * 6 < 2^24 at d = 128, so every fp32 sum is exact."""
    from kernels.indexer import indexer_scores, indexer_scores_ref

    assert H * 64 * d * 6 < 2 ** 24, "integer scores must stay exact in fp32"
    q = torch.randint(1, 3, (b, s, H, d)).float()
    k = torch.randint(-3, 4, (b, n, d)).float()
    k[:, 0] = -torch.randint(1, 3, (b, d)).float()
    k[:, 1] = torch.randint(1, 3, (b, d)).float()
    w = torch.tensor([-64.0, -1.0, 0.0, 1.0, 2.0, 64.0])[torch.randint(0, 6, (b, s, H))]
    w[..., 0] = -64.0  # at least one negative weight on a positive dot
    q, k, w = q.to(dtype).to(device), k.to(dtype).to(device), w.to(device)
    want = indexer_scores_ref(q, w, k)
    got = indexer_scores(q, w, k, out=torch.full((b, s, n), float("nan"), device=device))
    assert bool((want[..., 0] == 0).all()), "key 0: every dot negative, the ReLU must zero the score"
    assert bool((want[..., 1] != 0).any()) and bool((want < 0).any()), "weights of both signs must matter"
    assert torch.equal(got, want), "indexer_scores != reference on exact integer inputs"
