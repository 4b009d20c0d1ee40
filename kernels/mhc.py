"""mHC (manifold-constrained hyper-connections): `hc_pre`, `hc_post`, `hc_head` and their torch references.

Spec: `dsv4_reference_spec.md` §4 (per-block pre/post, Sinkhorn) and §9 (hc_head), pitfalls §14.1–3.
Reading order (STYLE §1): the plain-torch `*_ref` functions (the executable spec, CPU-importable, called by the
reference model as THE mHC maths), then the `@triton.jit` kernels, then the launchers.

Dimension legend: T tokens (the model flattens [b, s] to T), hc residual streams (4 in DeepSeek-V4),
D model width, K = hc·D flattened stream-major width (index j·D + c), M = (2+hc)·hc mixes per token.
All inputs are exactly 3-D `[T, hc, D]`; callers flatten leading dims themselves.

Kernel plan (pre and head): a split-K mix kernel computes, per token block and K-slice, the partial projections
`fn @ X` and the partial sum of squares into an fp32 workspace (tensor cores: bf16 streams in bf16x3, fn split
in-kernel into three exact bf16 pieces so every product is exact (`_dot_bf16x3`, issue 14 item 2); fp32
streams in tf32x3, ≈fp32 accuracy); a finish kernel (grid tokens × D-blocks) sums the partials in a fixed
order (deterministic), applies the RMS scale, sigmoids and the Sinkhorn, writes post/comb once (D-block 0) and collapses its D-block of H. Two launches per
pre/head site at every T by default (ONE_LAUNCH_MAX_T = 0, measured faster: below); H is read twice (the second
read walks tokens in reverse so the tail still in L2 is reused). `one_launch=True` runs both in one launch:
tokens go in blocks of ONE_LAUNCH_TOK, the split-K programs of a block count themselves in its semaphore and the
last one to arrive finishes and collapses those tokens (`_hc_fused_kernel`).
`hc_post` is one single-pass launch. Launchers never synchronise with the device: every check is on shapes,
dtypes, devices and layouts (host metadata); the SM count is cached per device (`kernels.launch`).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the references stay importable without it; launching raises
    triton = None
    tl = None

from kernels.launch import check_layout as _check_layout
from kernels.launch import fail as _fail
from kernels.launch import interpreting
from kernels.launch import sm_count, workspace

_H_DTYPES = (torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# Validation shared by references and launchers
# ---------------------------------------------------------------------------------------------------------

def _check(op: str, name: str, t, shape: tuple, dtype) -> None:
    """Type, shape and dtype of one tensor argument."""
    if not isinstance(t, torch.Tensor):
        _fail(op, name, type(t).__name__, "a torch.Tensor")
    if tuple(t.shape) != tuple(shape):
        _fail(op, name, f"shape {tuple(t.shape)}", f"shape {tuple(shape)}")
    if t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        _fail(op, name, f"dtype {t.dtype}", f"dtype {dtype}")


def _check_stack(op: str, H) -> tuple[int, int, int]:
    if not isinstance(H, torch.Tensor) or H.dim() != 3:
        _fail(op, "H", f"shape {tuple(getattr(H, 'shape', ()))}", "exactly 3-D [T, hc, D]")
    if H.dtype not in _H_DTYPES:
        _fail(op, "H", f"dtype {H.dtype}", "torch.bfloat16 or torch.float32")
    T, hc, D = H.shape
    if hc < 1 or D < 1:
        _fail(op, "H", f"shape {tuple(H.shape)}", "hc >= 1 and D >= 1")
    return T, hc, D


def _check_mix_args(op, H, fn, base, scale, head, strict, **eps) -> tuple[int, int, int]:
    """Checks for pre (`head=False`: fn [(2+hc)·hc, hc·D], scale [3]) or head (fn [hc, hc·D], scale [1]); the
    keyword values: sinkhorn_iters an int >= 1, norm_eps a finite number > 0, hc_eps a number >= 0 (bools refused)."""
    T, hc, D = _check_stack(op, H)
    n_mix, n_scale = (hc, 1) if head else ((2 + hc) * hc, 3)
    _check(op, "fn", fn, (n_mix, hc * D), torch.float32)
    _check(op, "base", base, (n_mix,), torch.float32)
    _check(op, "scale", scale, (n_scale,), torch.float32)
    for name, v in eps.items():
        if name == "sinkhorn_iters":
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(op, name, repr(v), "an int >= 1")
        elif name == "norm_eps":  # the RMS scale rsqrt(mean(X^2) + norm_eps): 0 makes an all-zero H NaN
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
                _fail(op, name, repr(v), "a finite float > 0 (rms_norm_eps)")
        elif not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
            _fail(op, name, repr(v), "a float >= 0")  # hc_eps: 0 is legitimate (sinkhorn_ref's eps >= 0)
    if strict:
        _check_layout(op, {"H": H, "fn": fn, "base": base, "scale": scale})
    return T, hc, D


# ---------------------------------------------------------------------------------------------------------
# References (plain torch, fp32 maths): the executable spec
# ---------------------------------------------------------------------------------------------------------

def sinkhorn_ref(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn projection of comb logits (spec §4 step 4, pitfall §14.2).

    logits `[T, hc, hc]` fp32 (row j = source stream, column k = output stream). `C = softmax(logits, -1) + eps`,
    column-normalise `C[j,k] /= Σ_j C[j,k] + eps`, then `iters-1` × (row-normalise, column-normalise): the last
    step is a column step, so columns sum to ≈1. Returns `[T, hc, hc]` fp32. Raises ValueError on a non-fp32 or
    non-3-D input, iters not an int >= 1 (a bool included) or eps not a finite number >= 0.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[1] != logits.shape[2]:
        _fail("sinkhorn_ref", "logits", f"shape {tuple(getattr(logits, 'shape', ()))}", "[T, hc, hc]")
    if logits.dtype != torch.float32:
        _fail("sinkhorn_ref", "logits", f"dtype {logits.dtype}", "torch.float32")
    if not isinstance(iters, int) or isinstance(iters, bool) or iters < 1:
        _fail("sinkhorn_ref", "iters", repr(iters), "an int >= 1")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        _fail("sinkhorn_ref", "eps", repr(eps), "a finite number >= 0 (hc_eps)")  # NaN made comb NaN
    c = logits.softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def _mixes_ref(H: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """`m = (fn @ X) · rsqrt(mean(X²) + norm_eps)`, X = H flattened stream-major in fp32 → `[T, n_mix]` fp32."""
    X = H.flatten(1).float()  # also for T = 0 (reshape(0, -1) is ambiguous)
    return (X @ fn.t()) * torch.rsqrt(X.square().mean(-1, keepdim=True) + norm_eps)


def hc_pre_ref(H: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
               sinkhorn_iters: int, hc_eps: float, norm_eps: float, norm: tuple | None = None):
    """mHC pre-mix of one block site (spec §4 steps 1–5).

    H `[T, hc, D]` bf16|fp32 residual streams; fn `[(2+hc)·hc, hc·D]` fp32; base `[(2+hc)·hc]` fp32;
    scale `[3]` fp32 (pre, post, comb). Returns `(x, post, comb)`:
    x `[T, D]` H.dtype = Σ_j pre_j·H_j in fp32, rounded once, with pre = sigmoid(m·scale0 + base) + hc_eps;
    post `[T, hc]` fp32 = 2·sigmoid(m·scale1 + base) (no eps);
    comb `[T, hc, hc]` fp32 = sinkhorn_ref(m·scale2 + base, sinkhorn_iters, hc_eps), comb[t, j, k] mixes source
    stream j into output stream k (columns sum to ≈1).
    norm: the site's RMSNorm or None - any callable x -> normed x with `.weight` [D] fp32 and `.eps` (the block's
    attn_norm / ffn_norm module, `dsv4.model.RMSNorm`): x leaves as norm(x) (spec §4: mHC pre -> norm -> sub-block;
    the triton backend fuses it at decode sizes, its other paths and this reference call the module).
    Raises ValueError naming a bad argument: a shape / dtype of H, fn, base, scale; sinkhorn_iters not an int
    >= 1; norm_eps not a finite number > 0 (0 made an all-zero H NaN); hc_eps not a number >= 0; a bad norm.
    """
    T, hc, D = _check_mix_args("hc_pre_ref", H, fn, base, scale, False, False,
                               sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps)
    _check_norm("hc_pre_ref", norm, D, H)
    m = _mixes_ref(H, fn, norm_eps)
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(T, hc, hc)
    comb = sinkhorn_ref(logits, sinkhorn_iters, hc_eps)
    x = (pre.unsqueeze(-1) * H.float()).sum(1).to(H.dtype)
    if norm is not None:
        x = norm(x)
    return x, post, comb


def _check_norm(op: str, norm, D: int, H: torch.Tensor) -> None:
    """`norm` of hc_pre / hc_post_pre: None or a callable with `.weight` [D] fp32 contiguous on H's device and
    `.eps` a float > 0 (an RMSNorm module). Raises ValueError naming what is wrong."""
    if norm is None:
        return
    w, eps = getattr(norm, "weight", None), getattr(norm, "eps", None)
    if not callable(norm) or not (isinstance(w, torch.Tensor) and w.dtype == torch.float32 and tuple(w.shape) == (D,)
                                  and w.is_contiguous() and w.device == H.device):
        _fail(op, "norm", f"{type(norm).__name__} with weight {getattr(w, 'dtype', None)} "
              f"{tuple(getattr(w, 'shape', ()))} strides {w.stride() if isinstance(w, torch.Tensor) else None} on "
              f"{getattr(w, 'device', None)}",
              f"None or an RMSNorm: callable, weight [{D}] fp32 contiguous on {H.device}, eps")
    if not isinstance(eps, float) or not 0 < eps < float("inf"):
        _fail(op, "norm.eps", repr(eps), "a finite float > 0 (the RMSNorm's eps)")


def hc_post_ref(a: torch.Tensor, H: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC expand + mix (spec §4 step 7, pitfall §14.1): `H_new[t,k] = post[t,k]·a[t] + Σ_j comb[t,j,k]·H[t,j]`.

    a `[T, D]` H.dtype (sub-block output); H `[T, hc, D]` bf16|fp32; post `[T, hc]` fp32; comb `[T, hc, hc]` fp32.
    fp32 maths, one rounding. Returns H_new `[T, hc, D]` H.dtype. Raises ValueError naming a bad argument.
    """
    T, hc, D = _check_stack("hc_post_ref", H)
    _check("hc_post_ref", "a", a, (T, D), H.dtype)
    _check("hc_post_ref", "post", post, (T, hc), torch.float32)
    _check("hc_post_ref", "comb", comb, (T, hc, hc), torch.float32)
    mixed = torch.einsum("tjk,tjd->tkd", comb, H.float())
    return (post.unsqueeze(-1) * a.float().unsqueeze(1) + mixed).to(H.dtype)


def hc_head_ref(H: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final stream collapse (spec §9): `y = Σ_j pre_j·H_j`, pre = sigmoid(m·scale + base) + hc_eps (no 2, no Sinkhorn).

    H `[T, hc, D]` bf16|fp32; fn `[hc, hc·D]` fp32; base `[hc]` fp32; scale `[1]` fp32. Returns y `[T, D]` H.dtype
    (fp32 sum, one rounding). Raises ValueError naming a bad argument (norm_eps not a finite number > 0, hc_eps
    not >= 0, shapes / dtypes).
    """
    T, hc, D = _check_mix_args("hc_head_ref", H, fn, base, scale, True, False, hc_eps=hc_eps, norm_eps=norm_eps)
    pre = torch.sigmoid(_mixes_ref(H, fn, norm_eps) * scale[0] + base) + hc_eps
    return (pre.unsqueeze(-1) * H.float()).sum(1).to(H.dtype)


def hc_post_pre_ref(a: torch.Tensor, H: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                    base: torch.Tensor, scale: torch.Tensor, *, sinkhorn_iters: int, hc_eps: float,
                    norm_eps: float, norm: tuple | None = None):
    """A layer-site boundary (spec §4 step 7 then steps 1–5 of the next site): `hc_post_ref` of one site
    followed by `hc_pre_ref` of the next, on the rounded H_new. Returns `(H_new, x, post_next, comb_next)`,
    shapes and dtypes as those two functions (`fn`, `base`, `scale`, `norm` are the next site's). Raises
    ValueError naming a bad argument."""
    H_new = hc_post_ref(a, H, post, comb)
    return (H_new, *hc_pre_ref(H_new, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps,
                               norm_eps=norm_eps, norm=norm))


# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------

if triton is not None:  # the kernels exist only where triton is installed (it is optional)
    from kernels.gemm import cast_for_store

    @triton.jit
    def _dot_bf16x3(x, xf, w, acc, MMA: tl.constexpr):
        """`acc + X @ W` with X bf16-exact (x: the bf16 tile, xf: the same values in fp32) and W [BK, NP] fp32, every
        product exact, for bf16 streams (prefill and decode mHC projections).

        Exactness: W is split into three bf16 pieces, hi = bf16(W), mid = bf16(W - hi), lo = bf16(W - hi - mid).
        W has a 24-bit significand; hi takes its leading 8 bits, W - hi is exact in fp32 (a residual below hi's
        last bit, ≤ 16 significant bits), mid takes 8 of those, and the rest (≤ 8 bits) is lo exactly, so
        hi + mid + lo == W bit for bit. This holds whether the cast rounds to nearest (GPU) or truncates (the
        Triton 3.9 interpreter); the only loss is a lo piece below bf16's normal range (|W| < 2^-110), far below
        any weight. X is bf16 already (H is bf16), so each product x·piece has ≤ 8 + 8 significant bits and is
        exact in fp32; the tensor core accumulates in fp32, so the dot is an fp32 dot of the exact products
        (3 native bf16 MMAs, no split of X), tighter than tf32x3, which keeps only 22 of W's 24 bits (two 11-bit
        pieces). Pieces are summed small-first (lo, mid, hi).
        Accumulation: callers pass a zero `acc` per K-tile and add the tile's sum into their running fp32 sum in
        registers (round to nearest). Measured on an H200 (RESULTS.md, issue 14 item 2): one tensor-core
        accumulator carried over 90 K-tiles x 3 MMAs (D 7168, 5 splits) put hc_pre's post 3.2e-5 off the fp32
        reference (163 of 16384 elements beyond 1e-5); the tensor core's in-MMA additions are evidently not
        round-to-nearest fp32, so the long chain stays in the registers (as in Triton's own tf32x3 lowering, whose
        three dots start from zero per tile).
        MMA 1: bf16 tensor-core dots (GPU). MMA 0: fp32 dots with input_precision="ieee" on the same exact piece
        values (the interpreter, whose bf16 dots are not faithful in triton 3.9); both multiply the same values."""
        hi = w.to(tl.bfloat16)
        r = w - hi.to(tl.float32)
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
        if MMA == 1:
            acc = tl.dot(x, lo, acc)
            acc = tl.dot(x, mid, acc)
            acc = tl.dot(x, hi, acc)
        else:
            acc = tl.dot(xf, lo.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(xf, mid.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(xf, hi.to(tl.float32), acc, input_precision="ieee")
        return acc


    @triton.jit
    def _mix_partial(h_ptr, fn_ptr, mix_ptr, ss_ptr, pid_t, pid_s, n_split, T, K, K_PER_SPLIT,
                     N_MIX: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, TOK: tl.constexpr,
                     SPLIT3: tl.constexpr, MMA: tl.constexpr):
        """Partial `fn @ X` and Σ X² of tokens [pid_t·TOK, pid_t·TOK + TOK) over K-slice pid_s → mix[t, pid_s, :],
        ss[t, pid_s]. The dot has BT >= 16 rows (tensor-core minimum; BT a multiple of TOK); a token sits in row
        t mod BT whatever TOK is, the other rows are masked (never loaded), so TOK < BT computes every token's row
        exactly as TOK = BT does (bitwise; the interpreter's numpy dot rounds by row position too).
        SPLIT3 (bf16 H): `_dot_bf16x3` on the bf16 tile (exact products); else (fp32 H, not bf16-exact) tf32x3."""
        offs_t = (pid_t * TOK // BT) * BT + tl.arange(0, BT)
        mask_t = (offs_t < T) & (offs_t >= pid_t * TOK) & (offs_t < pid_t * TOK + TOK)
        offs_n = tl.arange(0, NP)
        mask_n = offs_n < N_MIX
        row = offs_t.to(tl.int64) * K
        k_lo = pid_s * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        acc = tl.zeros([BT, NP], dtype=tl.float32)
        ss = tl.zeros([BT], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            offs_k = k0 + tl.arange(0, BK)
            mask_k = offs_k < k_hi
            x = tl.load(h_ptr + row[:, None] + offs_k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
            xf = x.to(tl.float32)
            w = tl.load(fn_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None],
                        mask=mask_n[None, :] & mask_k[:, None], other=0.0)
            if SPLIT3:  # this K-tile's 3 MMAs from zero, then one fp32 register add (see `_dot_bf16x3`)
                acc += _dot_bf16x3(x, xf, w, tl.zeros([BT, NP], dtype=tl.float32), MMA)
            else:
                acc = tl.dot(xf, w, acc, input_precision="tf32x3")
            ss += tl.sum(xf * xf, axis=1)
        out_row = offs_t.to(tl.int64) * n_split + pid_s
        tl.store(mix_ptr + out_row[:, None] * NP + offs_n[None, :], acc, mask=mask_t[:, None])
        tl.store(ss_ptr + out_row, ss, mask=mask_t)


    @triton.jit
    def _finish_tokens(h_ptr, mix_ptr, ss_ptr, base_ptr, scale_ptr, x_ptr, post_ptr, comb_ptr, t_first,
                       T, D, S, iters, hc_eps, norm_eps, inv_k, d_lo, d_hi, write_pc,
                       HC: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr, IS_HEAD: tl.constexpr,
                       BTF: tl.constexpr, BD: tl.constexpr, HCACHE: tl.constexpr,
                       nw_ptr=None, rms_eps=0.0, NORM: tl.constexpr = False):
        """Tokens t_first + [0, BTF) below T: sum the S split partials in a fixed order, RMS scale, sigmoids (+ Sinkhorn unless IS_HEAD;
        post/comb written when write_pc), then collapse columns [d_lo, d_hi) of H in BD steps. Partials are read
        with `.cg` (L2, not L1): in the one-launch kernel other programs wrote them during this launch; HCACHE is
        the cache modifier of the H loads (".cg" when other programs of this launch wrote H, else "").
        NORM (one-launch kernels only: [d_lo, d_hi) = [0, D)): the site's RMSNorm on the collapsed row, in place
        (`rms_norm_ref`: x = cast(w * x_f32 * rsqrt(mean(x_f32^2) + rms_eps)) of the rounded x; nw_ptr the norm
        weight [D] fp32): a second pass over the row this program just wrote (a CTA barrier first: other threads
        wrote some of its elements)."""
        offs_t = t_first + tl.arange(0, BTF)
        mask_t = offs_t < T
        j = tl.arange(0, HC)
        sp = tl.arange(0, SP)  # all split partials of a token at once, summed in a fixed order
        row = offs_t.to(tl.int64)[:, None] * S + sp[None, :]  # [BTF, SP]
        mask_ts = mask_t[:, None] & (sp < S)[None, :]
        p = mix_ptr + row * NP
        m_pre = tl.sum(tl.load(p[:, :, None] + j[None, None, :], mask=mask_ts[:, :, None], other=0.0,
                               cache_modifier=".cg"), axis=1)
        ss = tl.sum(tl.load(ss_ptr + row, mask=mask_ts, other=0.0, cache_modifier=".cg"), axis=1)
        rs = 1.0 / tl.sqrt_rn(ss * inv_k + norm_eps)
        pre = tl.sigmoid(m_pre * rs[:, None] * tl.load(scale_ptr) + tl.load(base_ptr + j)[None, :]) + hc_eps
        if not IS_HEAD:
            if write_pc:
                m_post = tl.sum(tl.load(p[:, :, None] + HC + j[None, None, :], mask=mask_ts[:, :, None], other=0.0,
                                        cache_modifier=".cg"), axis=1)
                jj = tl.arange(0, HC * HC)
                m_comb = tl.reshape(tl.sum(tl.load(p[:, :, None] + 2 * HC + jj[None, None, :],
                                                   mask=mask_ts[:, :, None], other=0.0, cache_modifier=".cg"),
                                           axis=1), (BTF, HC, HC))
                post = 2.0 * tl.sigmoid(m_post * rs[:, None] * tl.load(scale_ptr + 1)
                                        + tl.load(base_ptr + HC + j)[None, :])
                tl.store(post_ptr + offs_t[:, None].to(tl.int64) * HC + j[None, :], post, mask=mask_t[:, None])
                c = (m_comb * rs[:, None, None] * tl.load(scale_ptr + 2)
                     + tl.load(base_ptr + 2 * HC + j[:, None] * HC + j[None, :])[None, :, :])
                c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
                c = c / tl.sum(c, axis=2)[:, :, None] + hc_eps
                c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
                for _ in range(iters - 1):
                    c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
                    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
                tl.store(comb_ptr + offs_t[:, None, None].to(tl.int64) * (HC * HC) + j[None, :, None] * HC
                         + j[None, None, :], c, mask=mask_t[:, None, None])
        hrow = offs_t.to(tl.int64) * (HC * D)
        ssx = tl.zeros([BTF], dtype=tl.float32)
        for d0 in range(d_lo, d_hi, BD):
            offs_d = d0 + tl.arange(0, BD)
            mask_d = offs_d < d_hi
            hv = tl.load(h_ptr + hrow[:, None, None] + j[None, :, None] * D + offs_d[None, None, :],
                         mask=mask_t[:, None, None] & mask_d[None, None, :], other=0.0,
                         cache_modifier=HCACHE).to(tl.float32)
            x = cast_for_store(tl.sum(pre[:, :, None] * hv, axis=1), x_ptr)
            tl.store(x_ptr + offs_t[:, None].to(tl.int64) * D + offs_d[None, :], x,
                     mask=mask_t[:, None] & mask_d[None, :])
            if NORM:
                xf = tl.where(mask_d[None, :], x.to(tl.float32), 0.0)
                ssx += tl.sum(xf * xf, axis=1)
        if NORM:
            rinv = tl.math.rsqrt(ssx / D + rms_eps)
            tl.debug_barrier()
            for d0 in range(0, D, BD):
                offs_d = d0 + tl.arange(0, BD)
                m2 = mask_t[:, None] & (offs_d < D)[None, :]
                xp = x_ptr + offs_t[:, None].to(tl.int64) * D + offs_d[None, :]
                xv = tl.load(xp, mask=m2, other=0.0).to(tl.float32)
                w = tl.load(nw_ptr + offs_d, mask=offs_d < D, other=0.0)
                tl.store(xp, cast_for_store((w[None, :] * xv) * rinv[:, None], x_ptr), mask=m2)


    # Issue 29: the token count T (and the finish kernel's split count S) are not specialized: one build per tile
    # set, never one per prompt length (see `_mix_sites`).
    @triton.jit(do_not_specialize=["T"])
    def _hc_mix_kernel(h_ptr, fn_ptr, mix_ptr, ss_ptr, T, K, K_PER_SPLIT,
                       N_MIX: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                       SPLIT3: tl.constexpr, MMA: tl.constexpr):
        """Prefill launch 1 of 2: grid (token blocks, splits), one `_mix_partial` each (bf16x3 dot for bf16 H)."""
        _mix_partial(h_ptr, fn_ptr, mix_ptr, ss_ptr, tl.program_id(0), tl.program_id(1), tl.num_programs(1),
                     T, K, K_PER_SPLIT, N_MIX, NP, BT, BK, BT, SPLIT3, MMA)


    @triton.jit(do_not_specialize=["T", "S"])
    def _hc_finish_kernel(h_ptr, mix_ptr, ss_ptr, base_ptr, scale_ptr, x_ptr, post_ptr, comb_ptr,
                          T, D, S, iters, hc_eps, norm_eps, inv_k,
                          HC: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr, IS_HEAD: tl.constexpr,
                          BT: tl.constexpr, BD: tl.constexpr):
        """Prefill launch 2 of 2: grid (token blocks of BT, D-blocks of BD); D-block 0 also writes post/comb."""
        pid_t = tl.num_programs(0) - 1 - tl.program_id(0)  # reverse order: reuse the tail of H left in L2
        pid_d = tl.program_id(1)
        d_lo = pid_d * BD
        _finish_tokens(h_ptr, mix_ptr, ss_ptr, base_ptr, scale_ptr, x_ptr, post_ptr, comb_ptr,
                       pid_t * BT, T, D, S, iters, hc_eps, norm_eps, inv_k,
                       d_lo, tl.minimum(d_lo + BD, D), pid_d == 0, HC, NP, SP, IS_HEAD, BT, BD, "", x_ptr, 0.0,
                       False)


    @triton.jit(do_not_specialize=["T"])
    def _hc_fused_kernel(h_ptr, fn_ptr, base_ptr, scale_ptr, x_ptr, post_ptr, comb_ptr, ws_ptr, sem_ptr, nw_ptr,
                         T, D, K, K_PER_SPLIT, iters, hc_eps, norm_eps, inv_k, rms_eps,
                         HC: tl.constexpr, N_MIX: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr,
                         IS_HEAD: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, TOK: tl.constexpr,
                         BD: tl.constexpr, SPLIT3: tl.constexpr, MMA: tl.constexpr, NORM: tl.constexpr):
        """ONE launch (`one_launch=True`; not the default): grid (token blocks of TOK tokens, splits). Every program
        writes its split partial, then counts itself in sem[token block] (acq_rel atomic after a CTA barrier, so
        the partials of all its threads are visible first); the program that arrives last finishes and collapses its TOK tokens (all D)
        and resets the counter to 0 for the next launch. No spin-wait: it never deadlocks, also not in the
        interpreter's sequential grid. TOK is small (2) so that many programs share the collapse; the price is
        that fn is re-read (from L2) once per token block. NORM: x leaves as the site's RMSNorm of the collapsed
        row (`_finish_tokens`; nw_ptr [D] fp32, rms_eps)."""
        pid_t = tl.program_id(0)
        n_split = tl.num_programs(1)
        mix_ptr = ws_ptr
        ss_ptr = ws_ptr + T * n_split * NP
        _mix_partial(h_ptr, fn_ptr, mix_ptr, ss_ptr, pid_t, tl.program_id(1), n_split, T, K, K_PER_SPLIT,
                     N_MIX, NP, BT, BK, TOK, SPLIT3, MMA)
        tl.debug_barrier()
        arrived = tl.atomic_add(sem_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
        if arrived == n_split - 1:
            _finish_tokens(h_ptr, mix_ptr, ss_ptr, base_ptr, scale_ptr, x_ptr, post_ptr, comb_ptr,
                           pid_t * TOK, T, D, n_split, iters, hc_eps, norm_eps, inv_k,
                           0, D, True, HC, NP, SP, IS_HEAD, TOK, BD, "", nw_ptr, rms_eps, NORM)
            tl.store(sem_ptr + pid_t, 0)


    @triton.jit(do_not_specialize=["T"])
    def _hc_post_kernel(a_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, T, D,
                        HC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        """out[t, k, d] = post[t, k]·a[t, d] + Σ_j comb[t, j, k]·H[t, j, d] (fp32), one pass over a and H."""
        offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
        offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
        mask_t = offs_t < T
        mask = mask_t[:, None] & (offs_d < D)[None, :]
        j = tl.arange(0, HC)
        t64 = offs_t.to(tl.int64)
        a = tl.load(a_ptr + t64[:, None] * D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        hrow = t64 * (HC * D)
        hv = tl.load(h_ptr + hrow[:, None, None] + j[None, :, None] * D + offs_d[None, None, :],
                     mask=mask[:, None, :], other=0.0).to(tl.float32)
        for k in tl.static_range(HC):
            pk = tl.load(post_ptr + t64 * HC + k, mask=mask_t, other=0.0)
            ck = tl.load(comb_ptr + t64[:, None] * (HC * HC) + j[None, :] * HC + k, mask=mask_t[:, None], other=0.0)
            y = pk[:, None] * a + tl.sum(ck[:, :, None] * hv, axis=1)
            tl.store(out_ptr + hrow[:, None] + k * D + offs_d[None, :], cast_for_store(y, out_ptr), mask=mask)


    @triton.jit(do_not_specialize=["T"])
    def _hc_post_pre_kernel(a_ptr, h_ptr, post_ptr, comb_ptr, hn_ptr, fn_ptr, base_ptr, scale_ptr, x_ptr, post2_ptr,
                            comb2_ptr, ws_ptr, sem_ptr, nw_ptr, T, D, K, COLS, iters, hc_eps, norm_eps, inv_k,
                            rms_eps, HC: tl.constexpr, N_MIX: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr,
                            BT: tl.constexpr, BC: tl.constexpr, TOK: tl.constexpr, BD: tl.constexpr,
                            NORM: tl.constexpr):
        """Decode layer boundary, ONE launch: hc_post of one site and hc_pre of the next (issue 14).

        Grid (token blocks of TOK tokens, column splits of COLS columns of D). A program computes H_new (= the
        hc_post formula of `_hc_post_kernel`, fp32, rounded once to H's dtype and written) for its tokens, all
        hc streams and its columns, and from those rounded values the partial projection `fn @ X` (tf32x3) and
        Σ X² of the next hc_pre (X = H_new stream-major, so stream k of column c is K-index k·D + c). It writes
        the partials like `_mix_partial`, counts itself in sem[token block] (acq_rel atomic after a CTA barrier),
        and the last program of a block finishes it (`_finish_tokens`, reading H_new through L2) and resets the
        counter. Token rows sit in a BT >= 16 row dot, other rows masked (as in `_mix_partial`). NORM: x leaves
        as the next site's RMSNorm of the collapsed row (`_finish_tokens`)."""
        pid_t = tl.program_id(0)
        pid_s = tl.program_id(1)
        n_split = tl.num_programs(1)
        offs_t = (pid_t * TOK // BT) * BT + tl.arange(0, BT)
        mask_t = (offs_t < T) & (offs_t >= pid_t * TOK) & (offs_t < pid_t * TOK + TOK)
        t64 = offs_t.to(tl.int64)
        offs_n = tl.arange(0, NP)
        mask_n = offs_n < N_MIX
        j = tl.arange(0, HC)
        c_lo = pid_s * COLS
        c_hi = tl.minimum(c_lo + COLS, D)
        acc = tl.zeros([BT, NP], dtype=tl.float32)
        ss = tl.zeros([BT], dtype=tl.float32)
        hrow = t64 * (HC * D)
        for c0 in range(c_lo, c_hi, BC):
            cols = c0 + tl.arange(0, BC)
            mc = cols < c_hi
            m2 = mask_t[:, None] & mc[None, :]
            a = tl.load(a_ptr + t64[:, None] * D + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            hv = tl.load(h_ptr + hrow[:, None, None] + j[None, :, None] * D + cols[None, None, :],
                         mask=m2[:, None, :], other=0.0).to(tl.float32)
            for k in tl.static_range(HC):
                pk = tl.load(post_ptr + t64 * HC + k, mask=mask_t, other=0.0)
                ck = tl.load(comb_ptr + t64[:, None] * (HC * HC) + j[None, :] * HC + k, mask=mask_t[:, None],
                             other=0.0)
                y = cast_for_store(pk[:, None] * a + tl.sum(ck[:, :, None] * hv, axis=1), hn_ptr)
                tl.store(hn_ptr + hrow[:, None] + k * D + cols[None, :], y, mask=m2)
                yf = y.to(tl.float32)
                w = tl.load(fn_ptr + offs_n[None, :].to(tl.int64) * K + k * D + cols[:, None],
                            mask=mask_n[None, :] & mc[:, None], other=0.0)
                acc = tl.dot(yf, w, acc, input_precision="tf32x3")
                ss += tl.sum(yf * yf, axis=1)
        mix_ptr = ws_ptr
        ss_ptr = ws_ptr + T * n_split * NP
        out_row = t64 * n_split + pid_s
        tl.store(mix_ptr + out_row[:, None] * NP + offs_n[None, :], acc, mask=mask_t[:, None])
        tl.store(ss_ptr + out_row, ss, mask=mask_t)
        tl.debug_barrier()
        if tl.atomic_add(sem_ptr + pid_t, 1, sem="acq_rel", scope="gpu") == n_split - 1:
            _finish_tokens(hn_ptr, mix_ptr, ss_ptr, base_ptr, scale_ptr, x_ptr, post2_ptr, comb2_ptr,
                           pid_t * TOK, T, D, n_split, iters, hc_eps, norm_eps, inv_k,
                           0, D, True, HC, NP, SP, False, TOK, BD, ".cg", nw_ptr, rms_eps, NORM)
            tl.store(sem_ptr + pid_t, 0)


    # ---------------------------------------------------------------------------------------------------------
    # Launchers (same signatures and results as the references; optional `out=` lets tests poison outputs)
    # ---------------------------------------------------------------------------------------------------------

def _check_hc(op: str, hc: int) -> None:
    if hc & (hc - 1):
        _fail(op, "H", f"hc={hc}", "a power-of-two stream count (tl.arange needs it; DeepSeek-V4 uses 4)")


def _out(op: str, name: str, out, shape: tuple, dtype, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    _check(op, name, out, shape, dtype)
    _check_layout(op, {"H": like, name: out})
    return out


# The one-launch kernels' default range: none. hc_pre / hc_head run mix + finish (+ the site's RMSNorm launch) and
# hc_post_pre runs hc_post then that hc_pre at every T: measured on one H100 (`benchmarks/decode_knobs_probe.py
# --section mhc`, µs per call in a CUDA graph, Flash width, RESULTS.md, fifth session of 2026-12-06): hc_pre with
# its norm, one launch -> two launches + norm: T 1 16.0 -> 11.3, T 8 20.1 -> 11.7, T 32 35.5 -> 12.7, T 64 47.4 ->
# 14.5 (the fused kernel's last-arriving program collapses its tokens' D columns alone; the finish launch splits
# D over 4 programs); hc_post_pre one launch 16.7 / 19.9 at T 1 / 8 against ~13 / ~14 for hc_post + the two-launch
# hc_pre. (On an H200 at issue 14, before the fused norm, one launch was measured faster up to T 64 / T 4.) The
# fused kernels stay for `one_launch=True` (tests, benchmarks).
ONE_LAUNCH_MAX_T = 0  # hc_pre / hc_head use the one-launch kernel up to this many tokens by default
POST_PRE_ONE_LAUNCH_MAX_T = 0  # hc_post_pre fuses up to this many tokens by default (0: `Transformer` never defers)


ONE_LAUNCH_TOK = 2  # tokens per block of the one-launch hc_pre / hc_head: each last-arriving program collapses
                    # only these tokens (many programs share the collapses; fn is re-read once per block). Issue
                    # 14's value, not re-tuned: the probe of the fifth session of 2026-12-06 found 1 faster at T
                    # <= 8 and 4 at T >= 16, every one of them slower than the two launches (RESULTS.md)


SPLIT_MAX = 128  # most K splits of the mHC projection; also the finish's partial width SP (issue 29: one build)


def _split_k(T: int, K: int, BT: int, BK: int, device: torch.device, waves: int = 2) -> tuple[int, int]:
    """(K elements per split, split count S ≤ SPLIT_MAX): enough (token block, split) programs for ~`waves` waves."""
    n_tb, n_kb = triton.cdiv(T, BT), triton.cdiv(K, BK)
    target = waves * sm_count(device, cpu_default=4)  # interpreter: 8, enough to exercise the split-K path
    per_split = triton.cdiv(n_kb, max(1, min(n_kb, SPLIT_MAX, triton.cdiv(target, n_tb)))) * BK
    return per_split, triton.cdiv(K, per_split)


# Projection tiles of the two-launch path (every T by default): (BT token rows, BK K-elements per step,
# waves of programs for the split count, num_warps, num_stages). BT 64 at T >= 1024 so Hopper's wgmma applies
# (M = 64); 16 below (fewer padded rows at T ~ 100). Chosen on an H200, see RESULTS.md "issue 14, item 2".
PREFILL_TILES_LONG = (64, 64, 4, 4, 4)
PREFILL_TILES_SHORT = (16, 64, 2, 4, 3)


def _mix_sites(H, fn, base, scale, x, post, comb, iters, hc_eps, norm_eps, is_head, one_launch, *,
               dot: str = "auto", tiles: tuple | None = None, invariant: bool = False, norm: tuple | None = None):
    """Launch hc_pre (is_head False) or hc_head: one fused launch, or mix + finish (two launches).

    dot: "auto" = "bf16x3" for bf16 H (`_dot_bf16x3`, exact products), "tf32x3" for fp32 H; a name forces it
    (benchmarks compare against the former tf32x3 path; "bf16x3" on fp32 H raises: X would not be exact).
    tiles: the two-launch path's (BT, BK, waves, num_warps, num_stages) (benchmark sweeps), None = defaults.
    invariant: the batch-invariant mode: PREFILL_TILES_SHORT (16-row dots, as the one-launch kernel) at every T and
    the split of one token block (`_split_k(1, ...)`: a function of K and the device, never of T), so a token's
    x / post / comb are bitwise independent of T and of the other tokens (either path: both sum the same
    K-slices in the same order).
    norm: (weight, eps) fused into the one-launch kernel's collapse (`_finish_tokens` NORM); one_launch only."""
    T, hc, D = H.shape
    assert norm is None or one_launch, "the two-launch path's finish splits D: no fused norm"
    K, n_mix = hc * D, (hc if is_head else (2 + hc) * hc)
    if dot == "auto":
        dot = "bf16x3" if H.dtype == torch.bfloat16 else "tf32x3"
    if dot not in ("bf16x3", "tf32x3") or (dot == "bf16x3" and H.dtype != torch.bfloat16):
        _fail("hc_pre/hc_head", "dot", f"{dot!r} with H {H.dtype}", "'bf16x3' (bf16 H only) or 'tf32x3'")
    split3 = dot == "bf16x3"
    mma = 0 if interpreting() else 1
    np_ = max(16, triton.next_power_of_2(n_mix))
    post = x if post is None else post  # post/comb pointers are unused when IS_HEAD
    comb = x if comb is None else comb
    consts = dict(HC=hc, NP=np_, IS_HEAD=is_head)
    scalars = (iters, float(hc_eps), float(norm_eps), 1.0 / K)
    if invariant:
        tiles = PREFILL_TILES_SHORT
    BT, BK, waves, warps, stages = tiles or (PREFILL_TILES_LONG if T >= 1024 else PREFILL_TILES_SHORT)
    # The split count is that of the two-launch path (token blocks of BT) in both paths: every token's partial
    # sums then cover the same K-slices in the same order, so both paths give bitwise the same outputs under
    # the interpreter. (Splits sized for 2-token blocks made each program walk 50 K-tiles serially: 47-93 µs
    # at T = 64, see RESULTS.md.)
    per_split, S = _split_k(1 if invariant else T, K, BT, BK, H.device, waves)
    # Issue 29: the split count S follows T, so the partial width SP is the fixed SPLIT_MAX (masked beyond S), not
    # next_power_of_2(S): one build per tile set instead of one per power of two of S (1.5 s each on an H200).
    # Builds per process: `_hc_mix_kernel` one per tile set (PREFILL_TILES_SHORT / _LONG) and site kind,
    # `_hc_finish_kernel` one per site kind (hc_pre, hc_head), `_hc_fused_kernel` likewise.
    if one_launch:
        TOK = ONE_LAUNCH_TOK
        n_tb = triton.cdiv(T, TOK)
        sem, ws = workspace(H.device, n_tb, T * S * (np_ + 1))
        _hc_fused_kernel[(n_tb, S)](H, fn, base, scale, x, post, comb, ws, sem, x if norm is None else norm[0],
                                    T, D, K, per_split, *scalars, 0.0 if norm is None else float(norm[1]),
                                    N_MIX=n_mix, SP=SPLIT_MAX, BT=16, BK=BK, TOK=TOK,
                                    BD=min(1024, triton.next_power_of_2(D)), SPLIT3=split3, MMA=mma,
                                    NORM=norm is not None, num_warps=4, **consts)
        return
    mix = torch.empty((T, S, np_), dtype=torch.float32, device=H.device)
    ss = torch.empty((T, S), dtype=torch.float32, device=H.device)
    _hc_mix_kernel[(triton.cdiv(T, BT), S)](H, fn, mix, ss, T, K, per_split, N_MIX=n_mix, NP=np_, BT=BT, BK=BK,
                                            SPLIT3=split3, MMA=mma, num_warps=warps, num_stages=stages)
    BTF, BD = 2, min(1024, triton.next_power_of_2(D))
    _hc_finish_kernel[(triton.cdiv(T, BTF), triton.cdiv(D, BD))](
        H, mix, ss, base, scale, x, post, comb, T, D, S, *scalars, SP=SPLIT_MAX, BT=BTF, BD=BD,
        num_warps=4, **consts)


def _check_invariant(op: str, invariant) -> None:
    if not isinstance(invariant, bool):
        _fail(op, "invariant", repr(invariant), "a bool (the batch-invariant mode's launch)")


def _one_launch(op: str, one_launch, T: int) -> bool:
    if one_launch is None:
        return T <= ONE_LAUNCH_MAX_T
    if not isinstance(one_launch, bool):
        _fail(op, "one_launch", repr(one_launch), f"None (automatic: T <= ONE_LAUNCH_MAX_T = {ONE_LAUNCH_MAX_T}) or a bool")
    return one_launch


def hc_pre(H: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
           sinkhorn_iters: int, hc_eps: float, norm_eps: float, out=None, one_launch: bool | None = None,
           invariant: bool = False, norm: tuple | None = None):
    """Triton `hc_pre_ref` (spec §4): same arguments, shapes, dtypes and results.

    H `[T, hc, D]` bf16|fp32 contiguous CUDA (CPU under TRITON_INTERPRET=1), hc a power of two; fn, base, scale as
    in `hc_pre_ref`, fp32 contiguous on H's device. `out=(x, post, comb)` optionally supplies the outputs
    (checked like inputs). `one_launch`: None = one fused launch when T <= ONE_LAUNCH_MAX_T (0: never, measured), else
    split-K mix + finish (two launches); True/False forces a path (tests). No host-device sync; the one-launch
    path uses the stream's cached workspace (`kernels.launch.workspace`). `invariant`: the batch-invariant mode's
    tiles and split (`_mix_sites`): each token's outputs bitwise independent of T. `norm` as `hc_pre_ref` (x leaves
    as the site's RMSNorm): its weight and eps fused into the one-launch kernel (issue 27: one launch fewer per
    site), else (the two-launch path, or invariant: the norm's sum order must not follow T) norm(x) after it (the
    module: the model's backend `rms_norm`).
    Returns `(x [T, D] H.dtype, post [T, hc] fp32, comb [T, hc, hc] fp32)`.
    Raises ValueError naming the argument and the bad value (as `hc_pre_ref`: norm_eps must be > 0; also
    one_launch not None / a bool, invariant not a bool, hc not a power of two, a wrong `out`); never falls back
    to the reference.
    """
    T, hc, D = _check_mix_args("hc_pre", H, fn, base, scale, False, True,
                               sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps)
    _check_invariant("hc_pre", invariant)
    _check_hc("hc_pre", hc)
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 3):
        _fail("hc_pre", "out", type(out).__name__, "a tuple (x, post, comb)")
    ox, op, oc = out if out is not None else (None, None, None)
    x = _out("hc_pre", "out[0] (x)", ox, (T, D), H.dtype, H)
    post = _out("hc_pre", "out[1] (post)", op, (T, hc), torch.float32, H)
    comb = _out("hc_pre", "out[2] (comb)", oc, (T, hc, hc), torch.float32, H)
    _check_norm("hc_pre", norm, D, H)
    fused = _one_launch("hc_pre", one_launch, T)
    fuse_norm = fused and not invariant
    if T:
        _mix_sites(H, fn, base, scale, x, post, comb, sinkhorn_iters, hc_eps, norm_eps, False, fused,
                   invariant=invariant, norm=(norm.weight, norm.eps) if fuse_norm and norm is not None else None)
        if norm is not None and not fuse_norm:
            xn = norm(x)
            x = x.copy_(xn) if ox is not None else xn
    return x, post, comb


def hc_post(a: torch.Tensor, H: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *, out=None) -> torch.Tensor:
    """Triton `hc_post_ref` (spec §4 step 7): `H_new[t,k] = post[t,k]·a[t] + Σ_j comb[t,j,k]·H[t,j]`, one launch.

    a `[T, D]` H.dtype; H `[T, hc, D]` bf16|fp32; post `[T, hc]` fp32; comb `[T, hc, hc]` fp32; all contiguous
    on one CUDA device (CPU under TRITON_INTERPRET=1). `out` optionally supplies H_new `[T, hc, D]` H.dtype
    (must not alias H). Returns H_new. Raises ValueError naming the argument and the bad value.
    """
    T, hc, D = _check_stack("hc_post", H)
    _check_hc("hc_post", hc)
    _check("hc_post", "a", a, (T, D), H.dtype)
    _check("hc_post", "post", post, (T, hc), torch.float32)
    _check("hc_post", "comb", comb, (T, hc, hc), torch.float32)
    _check_layout("hc_post", {"H": H, "a": a, "post": post, "comb": comb})
    y = _out("hc_post", "out", out, (T, hc, D), H.dtype, H)
    if out is not None and out.data_ptr() == H.data_ptr():
        _fail("hc_post", "out", "H itself", "a separate buffer (program blocks read all streams of H)")
    if T == 0:
        return y
    BT, BD = (2 if T < 4 else 4), min(512, triton.next_power_of_2(D))
    _hc_post_kernel[(triton.cdiv(T, BT), triton.cdiv(D, BD))](a, H, post, comb, y, T, D, HC=hc, BT=BT, BD=BD,
                                                              num_warps=4)
    return y


def hc_head(H: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
            hc_eps: float, norm_eps: float, out=None, one_launch: bool | None = None,
            invariant: bool = False) -> torch.Tensor:
    """Triton `hc_head_ref` (spec §9): same arguments and result.

    H `[T, hc, D]` bf16|fp32 contiguous CUDA (CPU under TRITON_INTERPRET=1); fn `[hc, hc·D]`, base `[hc]`,
    scale `[1]` fp32. `out` optionally supplies y `[T, D]` H.dtype. `one_launch` as in `hc_pre` (default: two
    launches at every T), `invariant` as in `hc_pre`. Returns y. Raises ValueError naming the argument and the bad
    value (norm_eps not a finite number > 0, hc_eps not >= 0, one_launch / invariant not a bool, shapes, out).
    """
    T, hc, D = _check_mix_args("hc_head", H, fn, base, scale, True, True, hc_eps=hc_eps, norm_eps=norm_eps)
    _check_invariant("hc_head", invariant)
    _check_hc("hc_head", hc)
    y = _out("hc_head", "out", out, (T, D), H.dtype, H)
    fused = _one_launch("hc_head", one_launch, T)
    if T:
        _mix_sites(H, fn, base, scale, y, None, None, 1, hc_eps, norm_eps, True, fused, invariant=invariant)
    return y


def hc_post_pre(a: torch.Tensor, H: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                base: torch.Tensor, scale: torch.Tensor, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                out=None, one_launch: bool | None = None, num_warps: int = 4, block_d: int | None = None,
                norm: tuple | None = None):
    """Triton `hc_post_pre_ref`: one site's hc_post fused with the next site's hc_pre (issue 14).

    a `[T, D]`, H `[T, hc, D]`, post `[T, hc]`, comb `[T, hc, hc]` as `hc_post`; fn, base, scale the next
    site's, as `hc_pre`. `out=(H_new, x, post_next, comb_next)` optionally supplies the outputs (H_new must not
    alias H). `one_launch`: None = ONE launch (`_hc_post_pre_kernel`) when T <= POST_PRE_ONE_LAUNCH_MAX_T (0: never, measured),
    else `hc_post` then `hc_pre` (its own path choice); True/False forces a path. Equal to the two launches
    within the dtype tolerance (the projection's partial sums are split differently). No host-device sync.
    Tuning: `num_warps` of the fused kernel, `block_d` its collapse width (default min(1024, D)). `norm` as
    `hc_pre` (the next site's RMSNorm on x, inside the one launch).
    Returns `(H_new [T, hc, D] H.dtype, x [T, D] H.dtype, post_next [T, hc] fp32, comb_next [T, hc, hc] fp32)`.
    Raises ValueError naming the argument and the bad value.
    """
    op = "hc_post_pre"
    T, hc, D = _check_mix_args(op, H, fn, base, scale, False, True,
                               sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps)
    _check_hc(op, hc)
    _check_norm(op, norm, D, H)
    _check(op, "a", a, (T, D), H.dtype)
    _check(op, "post", post, (T, hc), torch.float32)
    _check(op, "comb", comb, (T, hc, hc), torch.float32)
    _check_layout(op, {"H": H, "a": a, "post": post, "comb": comb})
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 4):
        _fail(op, "out", type(out).__name__, "a tuple (H_new, x, post_next, comb_next)")
    oh, ox, op_, oc = out if out is not None else (None, None, None, None)
    h_new = _out(op, "out[0] (H_new)", oh, (T, hc, D), H.dtype, H)
    if oh is not None and oh.data_ptr() == H.data_ptr():
        _fail(op, "out[0] (H_new)", "H itself", "a separate buffer (programs read all streams of H)")
    x = _out(op, "out[1] (x)", ox, (T, D), H.dtype, H)
    post2 = _out(op, "out[2] (post_next)", op_, (T, hc), torch.float32, H)
    comb2 = _out(op, "out[3] (comb_next)", oc, (T, hc, hc), torch.float32, H)
    if T == 0:
        return h_new, x, post2, comb2
    if block_d is not None and (not isinstance(block_d, int) or block_d < 16 or block_d & (block_d - 1)):
        _fail(op, "block_d", repr(block_d), "None or a power of two >= 16")
    if one_launch is None:
        one_launch = T <= POST_PRE_ONE_LAUNCH_MAX_T
    if not _one_launch(op, one_launch, T):
        hc_post(a, H, post, comb, out=h_new)
        x, post2, comb2 = hc_pre(h_new, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps,
                                 norm_eps=norm_eps, out=(x, post2, comb2), norm=norm)
        return h_new, x, post2, comb2
    n_mix = (2 + hc) * hc
    np_ = max(16, triton.next_power_of_2(n_mix))
    TOK, BC = 2, 64
    n_tb, n_ct = triton.cdiv(T, TOK), triton.cdiv(D, BC)
    target = 2 * sm_count(H.device, cpu_default=4)
    cols = triton.cdiv(n_ct, max(1, min(n_ct, 128, triton.cdiv(target, n_tb)))) * BC
    S = triton.cdiv(D, cols)
    sem, ws = workspace(H.device, n_tb, T * S * (np_ + 1))
    _hc_post_pre_kernel[(n_tb, S)](a, H, post, comb, h_new, fn, base, scale, x, post2, comb2, ws, sem,
                                   x if norm is None else norm.weight, T, D, hc * D, cols, sinkhorn_iters,
                                   float(hc_eps), float(norm_eps), 1.0 / (hc * D),
                                   0.0 if norm is None else float(norm.eps), HC=hc, N_MIX=n_mix, NP=np_,
                                   SP=triton.next_power_of_2(S), BT=16, BC=BC, TOK=TOK,
                                   BD=block_d or min(1024, triton.next_power_of_2(D)), NORM=norm is not None,
                                   num_warps=num_warps)
    return h_new, x, post2, comb2
