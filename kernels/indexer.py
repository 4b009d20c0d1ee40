"""Lightning-indexer scoring and top-k selection for CSA layers (spec §7).

Reading order (STYLE §1): `indexer_scores_ref`, `indexer_topk_ref` (plain torch, the executable spec), the
`@triton.jit` scoring kernel and its launcher `indexer_scores`, then (issue 14) the Triton top-k
`indexer_topk` and the one-launch selection `indexer_select`; last, the Hadamard rotation + FP4 rounding of the
indexer's q and keys (spec §7.1-7.3): `rotate_fp4_ref` and its one-launch kernel `rotate_fp4`.
`indexer_topk_ref` is THE tie rule: the Triton top-k returns its picks bitwise, order included (hard-stop tests
with exact ties, tests/unit and tests/gpu), so the reference model and the Triton backend select the same entries.

Dimension legend: b batch, s queries, H indexer heads (64), d indexer head dim (128), n compressed keys.
    scores[b, t, n] = sum_h weights[b, t, h] * ReLU(q[b, t, h] . k[b, n])      (fp32 maths, fp32 out)
The official model computes the score in bf16 (spec §7 step 3); this contract is fp32 (HF's precision).
"""

from __future__ import annotations

import functools
import math

import torch

from kernels.attention import _check_launch_device, _num_sms, dot_mode, triton, tl
from kernels.launch import interpreting, workspace
from kernels.numerics import FP4_BLOCK, fp4_act_quant_sim

_FLOAT_DTYPES = (torch.bfloat16, torch.float32)


def _check_scores_inputs(q, weights, k, where: str) -> None:
    """Shape/dtype/device checks shared by the reference and the launcher; ValueError names the argument."""
    for name, t in (("q", q), ("weights", weights), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"{where}: q must be [b, s, H, d], got shape {tuple(q.shape)}")
    b, s, h, d = q.shape
    if weights.shape != (b, s, h):
        raise ValueError(f"{where}: weights must be [b={b}, s={s}, H={h}], got {tuple(weights.shape)}")
    if k.dim() != 3 or k.shape[0] != b or k.shape[2] != d:
        raise ValueError(f"{where}: k must be [b={b}, n, d={d}], got shape {tuple(k.shape)}")
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype:
        raise ValueError(f"{where}: q and k must share a dtype in {_FLOAT_DTYPES}, got q {q.dtype}, k {k.dtype}")
    if weights.dtype not in (torch.float32, q.dtype):
        raise ValueError(f"{where}: weights must be float32 or q's dtype {q.dtype}, got {weights.dtype}")
    devices = {t.device for t in (q, weights, k)}
    if len(devices) != 1:
        raise ValueError(f"{where}: q, weights, k must be on one device, got {sorted(map(str, devices))}")


def indexer_scores_ref(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Reference indexer scores (spec §7 step 3) in fp32.

    Args:
        q: [b, s, H, d] bfloat16/float32 indexer queries (after RoPE/Hadamard/FP4 simulation, done by the caller).
        weights: [b, s, H] float32 or q.dtype per-head weights (already scaled by 128^-0.5 · 64^-0.5; any sign).
        k: [b, n, d] same dtype as q; compressed indexer keys.
    Returns:
        scores: [b, s, n] float32, every key scored (causal masking is the top-k's `n_valid`).
    Raises:
        ValueError: wrong rank/shape/dtype/device.
    """
    _check_scores_inputs(q, weights, k, "indexer_scores_ref")
    logits = torch.einsum("bshd,bnd->bshn", q.float(), k.float()).relu_()
    return torch.einsum("bshn,bsh->bsn", logits, weights.float())


def indexer_topk_ref(scores: torch.Tensor, k: int, n_valid: torch.Tensor | None = None, *,
                     check: bool = True, ratio: int = 0) -> torch.Tensor:
    """Deterministic top-k of indexer scores (spec §7 steps 4-7), identical on CPU and CUDA and for any n.

    Rule: larger score first; equal scores toward the LOWER entry index; picks returned in that order. -0.0
    equals +0.0; NaN ranks below every value, -inf included (a NaN score is an upstream bug; never preferred). The
    rule is made exact by ranking the unique int64 key (order-preserving bits of the score) * 2^32 + (n-1-i),
    so no tie is left for torch.topk to break; a row's picks therefore do not depend on entries outside
    its eligible prefix (prefill's full row and decode's row of the entries existing so far agree).

    Args:
        scores: [b, s, n] float32.
        k: number of slots to return (int >= 0); the caller passes min(index_topk, causal entries) or index_topk.
        n_valid: optional int32/int64 [b, s]: entries 0..n_valid-1 are eligible (causal); None = all n.
        ratio: 0, or the compression ratio r > 0 when n_valid holds each query's position p instead of a count:
            the count is then min((p + 1) // r, n), the entries completed up to p (spec §7.4; the decode step
            passes its positions, so no launch computes the counts).
        check: verify 0 <= n_valid <= n (one device sync: an aminmax read back).
    Returns:
        idx: [b, s, k] int64 entry indices; slots j >= min(n_valid, n) hold -1.
    Raises:
        ValueError: wrong dtype/shape/device, k < 0, or n_valid outside [0, n].
    """
    where = "indexer_topk_ref"
    if not isinstance(scores, torch.Tensor) or scores.dim() != 3 or scores.dtype != torch.float32:
        raise ValueError(f"{where}: scores must be float32 [b, s, n], got "
                         f"{getattr(scores, 'dtype', type(scores).__name__)} {tuple(getattr(scores, 'shape', ()))}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"{where}: k must be an int >= 0, got {k!r}")
    b, s, n = scores.shape
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 0 or (ratio and n_valid is None):
        raise ValueError(f"indexer_topk_ref: ratio={ratio!r}, expected an int >= 0 (> 0 only with n_valid "
                         "positions)")
    if ratio and isinstance(n_valid, torch.Tensor):
        n_valid = ((n_valid + 1) // ratio).clamp(max=scores.shape[-1])
    if n_valid is None:
        count = torch.full((b, s), n, dtype=torch.int64, device=scores.device)
    else:
        if (not isinstance(n_valid, torch.Tensor) or n_valid.shape != (b, s)
                or n_valid.dtype not in (torch.int32, torch.int64) or n_valid.device != scores.device):
            raise ValueError(f"{where}: n_valid must be int32/int64 [b={b}, s={s}] on {scores.device}, got "
                             f"{getattr(n_valid, 'dtype', type(n_valid).__name__)} "
                             f"{tuple(getattr(n_valid, 'shape', ()))}")
        if check and n_valid.numel():
            lo, hi = torch.stack(torch.aminmax(n_valid)).tolist()  # one device sync
            if lo < 0 or hi > n:
                raise ValueError(f"{where}: n_valid must lie in [0, n={n}], got min {lo} max {hi}")
        count = n_valid.long()
    kk = min(k, n)
    out = torch.full((b, s, k), -1, dtype=torch.int64, device=scores.device)
    if kk == 0:
        return out
    bits = (scores + 0.0).view(torch.int32)                                   # +0.0 turns -0.0 into +0.0
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()          # monotone in the score
    ordered = ordered.masked_fill(torch.isnan(scores), -(1 << 31))            # below -inf's key
    entry = torch.arange(n, device=scores.device)
    key = ordered * (1 << 32) + (n - 1 - entry)                               # unique per entry
    key = key.masked_fill(entry >= count[..., None], torch.iinfo(torch.int64).min)
    picks = torch.topk(key, kk, dim=-1, sorted=True).indices
    slot = torch.arange(kk, device=scores.device)
    out[..., :kk] = torch.where(slot < count[..., None], picks, -1)
    return out


if triton is not None:
    from kernels.attention import _dot

    @triton.jit
    def _score_chunk(Q, W, K, OUT, b, t, start, H, N, CHUNK, sqb, sqs, sqh, swb, sws, skb, skn, sob, sos,
                     D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
                     wscale=1.0, SCALED: tl.constexpr = False):
        """OUT[b, t, n] = sum_h w[b, t, h] * relu(q[b, t, h] . k[b, n]) for keys n in [start, start + CHUNK)
        (fp32 accumulation); all H heads of one query at once (BLOCK_H >= H). SCALED: W holds the raw bf16
        weights_proj output and w = bf16(w_raw * wscale) (fp32 product, one rounding: the model's bf16 multiply,
        spec §7.2)."""
        heads = tl.arange(0, BLOCK_H)
        hmask = heads < H
        dd = tl.arange(0, D)
        q = tl.load(Q + b * sqb + t * sqs + heads[:, None] * sqh + dd[None, :], mask=hmask[:, None], other=0.0)
        w = tl.load(W + b * swb + t * sws + heads, mask=hmask, other=0.0).to(tl.float32)
        if SCALED:
            w = round_bf16(w * wscale)
        end = tl.minimum(start + CHUNK, N)
        for n0 in range(start, end, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            nmask = offs < end
            kt = tl.load(K + b * skb + offs[:, None].to(tl.int64) * skn + dd[None, :], mask=nmask[:, None],
                         other=0.0)
            # ReLU keeping NaN (torch's relu does; the GPU's plain max would turn a NaN score into 0)
            sc = tl.maximum(_dot(q, tl.trans(kt), DOT), 0.0, propagate_nan=tl.PropagateNan.ALL) * w[:, None]
            tl.store(OUT + b * sob + t * sos + offs, tl.sum(sc, axis=0), mask=nmask)

    # Not specialized on the lengths (issue 29): S, N and the strides that carry them (weights and scores rows).
    @triton.jit(do_not_specialize=["S", "N", "swb", "sob", "sos"])
    def _indexer_scores_kernel(Q, W, K, OUT, S, H, N, CHUNK,
                               sqb, sqs, sqh, swb, sws, skb, skn, sob, sos, wscale,
                               D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                               DOT: tl.constexpr, SCALED: tl.constexpr):
        """One program: one query (b, t), all H heads (BLOCK_H >= H), keys [pid*CHUNK, (pid+1)*CHUNK)."""
        pid_bs = tl.program_id(0)
        b = (pid_bs // S).to(tl.int64)
        t = (pid_bs % S).to(tl.int64)
        _score_chunk(Q, W, K, OUT, b, t, tl.program_id(1) * CHUNK, H, N, CHUNK, sqb, sqs, sqh, swb, sws, skb, skn,
                     sob, sos, D, BLOCK_H, BLOCK_N, DOT, wscale, SCALED)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, *, out: torch.Tensor | None = None,
                   block_n: int = 64, num_warps: int = 4, programs_per_row: int | None = None,
                   weight_scale: float | None = None) -> torch.Tensor:
    """Triton indexer scores; same contract and result as `indexer_scores_ref` (fp32 accumulation and output).

    A program holds one query's H x d queries in registers and streams `block_n` keys at a time, so in decode
    each key byte is read once per query; rows are split over `programs_per_row` programs (default: enough to
    cover ~4 waves of SMs). H must be <= 128 and d a power of two >= 16.
    Args: as `indexer_scores_ref`, plus keyword-only `out` ([b, s, n] float32 contiguous; tests poison it) and
        `weight_scale` (`indexer_scores_scaled`: a finite float > 0; weights are then the raw bf16 weights_proj
        output, scaled and rounded to bf16 in the kernel).
    Returns: scores [b, s, n] float32.
    Raises: ValueError on any bad argument (named, with its value); RuntimeError without triton.
    """
    where = "kernels.indexer.indexer_scores"
    _check_scores_inputs(q, weights, k, where)
    _check_launch_device({"q": q, "weights": weights, "k": k}, where)
    b, s, h, d = q.shape
    n = k.shape[1]
    if d < 16 or d & (d - 1):
        raise ValueError(f"{where}: indexer head dim d must be a power of two >= 16, got {d}")
    if h > 128:
        raise ValueError(f"{where}: at most 128 indexer heads fit one program, got H={h}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{where}: block_n must be a power of two >= 16, got {block_n}")
    if out is None:
        out = torch.empty((b, s, n), dtype=torch.float32, device=q.device)
    elif (out.shape != (b, s, n) or out.dtype != torch.float32 or out.device != q.device
          or not out.is_contiguous()):
        raise ValueError(f"{where}: out must be contiguous float32 {(b, s, n)} on {q.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if weight_scale is not None and (isinstance(weight_scale, bool) or not isinstance(weight_scale, float)
                                     or not 0 < weight_scale < float("inf")):
        raise ValueError(f"{where}: weight_scale must be None or a finite float > 0, got {weight_scale!r}")
    if weight_scale is not None and weights.dtype != torch.bfloat16:
        raise ValueError(f"{where}: weight_scale needs the bf16 weights_proj output, got weights {weights.dtype}")
    if b * s == 0 or n == 0:
        return out
    tiles = triton.cdiv(n, block_n)
    if programs_per_row is None:
        programs_per_row = max(1, min(tiles, triton.cdiv(4 * _num_sms(q.device), b * s)))
    if not isinstance(programs_per_row, int) or programs_per_row < 1:
        raise ValueError(f"{where}: programs_per_row must be an int >= 1, got {programs_per_row!r}")
    chunk = triton.cdiv(tiles, programs_per_row) * block_n
    grid = (b * s, triton.cdiv(n, chunk))
    block_h = max(16, triton.next_power_of_2(h))
    _indexer_scores_kernel[grid](q, weights, k, out, s, h, n, chunk,
                                 q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
                                 k.stride(0), k.stride(1), out.stride(0), out.stride(1),
                                 1.0 if weight_scale is None else weight_scale,
                                 D=d, BLOCK_H=block_h, BLOCK_N=block_n, DOT=dot_mode(q.dtype),
                                 SCALED=weight_scale is not None, num_warps=num_warps)
    return out


def indexer_scores_scaled_ref(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                              weight_scale: float) -> torch.Tensor:
    """The indexer's scores from the raw weights_proj output (spec §7.2): `indexer_scores_ref(q, weights *
    weight_scale, k)` with the product in the weights' dtype (fp32 maths, one rounding), what `dsv4.model.Indexer`
    computes in two steps where the backend has no `indexer_scores_scaled`. Raises ValueError for a weight_scale
    that is not a finite float > 0 (as the triton entry)."""
    if isinstance(weight_scale, bool) or not isinstance(weight_scale, float) or not 0 < weight_scale < float("inf"):
        raise ValueError(f"indexer_scores_scaled_ref: weight_scale must be a finite float > 0, got {weight_scale!r}")
    return indexer_scores_ref(q, weights * weight_scale, k)


def indexer_scores_scaled(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                          weight_scale: float) -> torch.Tensor:
    """The triton backend's `indexer_scores_scaled` entry: `indexer_scores(q, weights, k, weight_scale=...)`, the
    head-weight scale applied in the scoring kernel (issue 27: the multiply's launch gone), bitwise
    `indexer_scores(q, weights * weight_scale, k)` for bf16 weights. q [b, s, h, d], weights [b, s, h] bf16 (the
    raw weights_proj output), k [b, n, d]; weight_scale a finite float > 0. Returns scores [b, s, n] fp32.
    Raises ValueError as `indexer_scores` (weight_scale None included)."""
    if weight_scale is None:
        raise ValueError("kernels.indexer.indexer_scores_scaled: weight_scale must be a finite float > 0, got None")
    return indexer_scores(q, weights, k, weight_scale=weight_scale)


# ---------------------------------------------------------------------------------------------------------
# Top-k selection on the GPU (issue 14): the exact rule of `indexer_topk_ref`, no host sync
# ---------------------------------------------------------------------------------------------------------

TOPK_ROW_IN_REGISTERS = 16384  # rows up to this many entries (64k context at ratio 4) stay in registers


if triton is not None:

    @triton.jit
    def _row_keys(row_ptr, offs, count):
        """uint32 key of entries `offs` of one score row: 0 for entries >= count (not eligible), else 1 + the
        score's order-preserving unsigned bits (-0.0 == +0.0; NaN -> 1, below -inf; as `indexer_topk_ref`).
        Loaded with `.cg` (L2): in the fused kernel other programs of the launch wrote the row."""
        ok = offs < count
        x = tl.load(row_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
        x = tl.where(x == 0.0, 0.0, x)                                   # -0.0 -> +0.0
        bits = x.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)          # monotone signed int32
        ordered = tl.where(x != x, -2147483648, ordered)                 # NaN: below -inf's key
        u = (ordered.to(tl.uint32, bitcast=True) ^ 2147483648) + 1      # unsigned order, >= 1 (max +inf + 1)
        return tl.where(ok, u, 0)

    @triton.jit
    def _count3(u, c1, c2, c3):
        """(#u >= c1, #u >= c2, #u >= c3) in ONE reduction: three 21-bit fields of an int64 sum (a chunk holds
        at most TOPK_ROW_IN_REGISTERS = 2^14 < 2^21 entries)."""
        packed = ((u >= c1).to(tl.int64) + ((u >= c2).to(tl.int64) << 21) + ((u >= c3).to(tl.int64) << 42))
        tot = tl.sum(packed, axis=0)
        return (tot & 0x1FFFFF).to(tl.int32), ((tot >> 21) & 0x1FFFFF).to(tl.int32), (tot >> 42).to(tl.int32)

    @triton.jit
    def _topk_row(row_ptr, out_ptr, count, k, N, BLOCK: tl.constexpr, KP: tl.constexpr,
                  IN_REGISTERS: tl.constexpr, SORTED: tl.constexpr, OFF=0):
        """Top-k of one row (scores at row_ptr, `count` eligible entries of N) written to out_ptr[0:k].

        Sync-free radix select: the k-th largest key `thr` is built two bits per pass (three counts packed in
        one reduction, 16 passes); keys > thr are taken, keys == thr in index order until k are chosen, so
        ties go to the lower index. SORTED: the picks in `indexer_topk_ref`'s order (score desc, index asc):
        the chosen (ordered key, index) pairs are compacted into out (scratch) and sorted descending by the
        unique int64 (ordered << 32) | (2^31 - 1 - index). Not SORTED: the same set in ascending index order
        (no sort). Slots >= min(k, count, N) hold -1. IN_REGISTERS: the row (N <= BLOCK) is loaded once and
        kept in registers; otherwise every pass re-reads it in BLOCK chunks. OFF: every pick is written as
        index + OFF (-1 stays -1): the attention's key slot of the entry (`indexer_topk(offset=)`)."""
        kk = tl.minimum(tl.minimum(k, count), N)
        offs0 = tl.arange(0, BLOCK)
        if IN_REGISTERS:
            u = _row_keys(row_ptr, offs0, count)
        thr = tl.zeros([], dtype=tl.uint32)
        for i in range(16):
            lo = (tl.full([], 30, tl.int32) - 2 * i).to(tl.uint32)
            c1 = thr | (tl.full([], 1, tl.uint32) << lo)
            c2 = thr | (tl.full([], 2, tl.uint32) << lo)
            c3 = thr | (tl.full([], 3, tl.uint32) << lo)
            if IN_REGISTERS:
                n1, n2, n3 = _count3(u, c1, c2, c3)
            else:
                n1 = tl.zeros([], dtype=tl.int32)
                n2 = tl.zeros([], dtype=tl.int32)
                n3 = tl.zeros([], dtype=tl.int32)
                for c0 in range(0, N, BLOCK):
                    m1, m2, m3 = _count3(_row_keys(row_ptr, c0 + offs0, count), c1, c2, c3)
                    n1 += m1
                    n2 += m2
                    n3 += m3
            thr = tl.where(n3 >= kk, c3, tl.where(n2 >= kk, c2, tl.where(n1 >= kk, c1, thr)))
        # kk >= 1 makes thr >= 1 (count(u >= 1) = count >= kk), so u == thr never matches an ineligible entry
        if IN_REGISTERS:
            gt = u > thr
            need_eq = kk - tl.sum(gt.to(tl.int32), axis=0)
            eq = u == thr
            sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= need_eq))
            pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
            if SORTED:
                ordered = ((u - 1) ^ 2147483648).to(tl.int32, bitcast=True)
                key = (ordered.to(tl.int64) << 32) | (2147483647 - offs0).to(tl.int64)
                tl.store(out_ptr + pos, key, mask=sel)
            else:
                tl.store(out_ptr + pos, offs0.to(tl.int64) + OFF, mask=sel)
        else:
            n_gt = tl.zeros([], dtype=tl.int32)
            for c0 in range(0, N, BLOCK):
                n_gt += tl.sum((_row_keys(row_ptr, c0 + offs0, count) > thr).to(tl.int32), axis=0)
            need_eq = kk - n_gt
            seen_eq = tl.zeros([], dtype=tl.int32)
            seen_sel = tl.zeros([], dtype=tl.int32)
            for c0 in range(0, N, BLOCK):
                offs = c0 + offs0
                uc = _row_keys(row_ptr, offs, count)
                eq = uc == thr
                sel = (uc > thr) | (eq & (seen_eq + tl.cumsum(eq.to(tl.int32), axis=0) <= need_eq))
                pos = seen_sel + tl.cumsum(sel.to(tl.int32), axis=0) - 1
                if SORTED:
                    ordered = ((uc - 1) ^ 2147483648).to(tl.int32, bitcast=True)
                    key = (ordered.to(tl.int64) << 32) | (2147483647 - offs).to(tl.int64)
                    tl.store(out_ptr + pos, key, mask=sel)
                else:
                    tl.store(out_ptr + pos, offs.to(tl.int64) + OFF, mask=sel)
                seen_eq += tl.sum(eq.to(tl.int32), axis=0)
                seen_sel += tl.sum(sel.to(tl.int32), axis=0)
        slot = tl.arange(0, KP)
        if SORTED:
            tl.debug_barrier()                   # compacted keys of all threads are in out before reloading
            v = tl.load(out_ptr + slot, mask=slot < kk, other=-9223372036854775807 - 1)
            v = tl.sort(v, descending=True)
            idx = 2147483647 - (v & 0xFFFFFFFF)
            tl.debug_barrier()                   # every thread has read its keys before any slot is rewritten
            tl.store(out_ptr + slot, tl.where(slot < kk, idx + OFF, -1), mask=slot < k)
        else:
            tl.store(out_ptr + slot, tl.full([KP], -1, tl.int64), mask=(slot >= kk) & (slot < k))

    @triton.jit(do_not_specialize=["S", "N", "k", "ssb", "sss", "snb", "sns", "sob", "sos", "OFF"])  # issue 29
    def _indexer_topk_kernel(SC, NV, OUT, S, N, k, ssb, sss, snb, sns, sob, sos, OFF,
                             HAS_NV: tl.constexpr, BLOCK: tl.constexpr, KP: tl.constexpr,
                             IN_REGISTERS: tl.constexpr, SORTED: tl.constexpr, RATIO: tl.constexpr = 0):
        """One program per query row (b, t). A count outside [0, N] (no host check) fills the row with -2:
        not a valid index and not the empty marker -1, so `sparse_attn`'s guard turns that query into NaN."""
        pid = tl.program_id(0)
        b = (pid // S).to(tl.int64)
        t = (pid % S).to(tl.int64)
        out_ptr = OUT + b * sob + t * sos
        if HAS_NV:
            count = tl.load(NV + b * snb + t * sns).to(tl.int32)
            if RATIO > 0:  # NV holds the query's position: the entries completed up to it (spec §7.4)
                count = tl.minimum((count + 1) // RATIO, N)
        else:
            count = N
        if (count < 0) | (count > N):
            slot = tl.arange(0, KP)
            tl.store(out_ptr + slot, tl.full([KP], -2, tl.int64), mask=slot < k)
        else:
            _topk_row(SC + b * ssb + t * sss, out_ptr, count, k, N, BLOCK, KP, IN_REGISTERS, SORTED, OFF)

    @triton.jit(do_not_specialize=["S", "N", "k", "swb", "sob", "sos", "snb", "sns", "sib", "sis"])  # issue 29
    def _indexer_select_kernel(Q, W, K, SC, NV, OUT, SEM, S, H, N, CHUNK, k,
                               sqb, sqs, sqh, swb, sws, skb, skn, sob, sos, snb, sns, sib, sis,
                               D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
                               HAS_NV: tl.constexpr, BLOCK: tl.constexpr, KP: tl.constexpr,
                               IN_REGISTERS: tl.constexpr, SORTED: tl.constexpr):
        """Scores + top-k in ONE launch: grid (b*s rows, chunks of CHUNK keys). Each program scores its chunk
        into SC (as `_indexer_scores_kernel`), then counts itself in SEM[row] (acq_rel atomic after a CTA
        barrier); the last program of a row selects its top-k (`_topk_row`, reading SC through L2) and resets
        the counter. No spin-wait, no host sync."""
        pid_bs = tl.program_id(0)
        b = (pid_bs // S).to(tl.int64)
        t = (pid_bs % S).to(tl.int64)
        _score_chunk(Q, W, K, SC, b, t, tl.program_id(1) * CHUNK, H, N, CHUNK, sqb, sqs, sqh, swb, sws, skb, skn,
                     sob, sos, D, BLOCK_H, BLOCK_N, DOT, 1.0, False)
        tl.debug_barrier()
        counter = SEM + pid_bs
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
            if HAS_NV:
                count = tl.load(NV + b * snb + t * sns).to(tl.int32)
            else:
                count = N
            out_ptr = OUT + b * sib + t * sis
            if (count < 0) | (count > N):
                slot = tl.arange(0, KP)
                tl.store(out_ptr + slot, tl.full([KP], -2, tl.int64), mask=slot < k)
            else:
                _topk_row(SC + b * sob + t * sos, out_ptr, count, k, N, BLOCK, KP, IN_REGISTERS, SORTED)
            tl.store(counter, 0)


def _check_topk_args(shape: tuple, device, k, n_valid, where: str) -> None:
    """k and n_valid checks shared by the top-k launchers (host metadata only, no sync)."""
    b, s, _ = shape
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"{where}: k must be an int >= 0, got {k!r}")
    if n_valid is not None and (not isinstance(n_valid, torch.Tensor) or n_valid.shape != (b, s)
                                or n_valid.dtype not in (torch.int32, torch.int64) or n_valid.device != device):
        raise ValueError(f"{where}: n_valid must be int32/int64 [b={b}, s={s}] on {device}, got "
                         f"{getattr(n_valid, 'dtype', type(n_valid).__name__)} {tuple(getattr(n_valid, 'shape', ()))}")


def _topk_out(out, b: int, s: int, k: int, device, where: str, strided: bool = False) -> torch.Tensor:
    """The top-k's output: new, or `out` checked (int64 [b, s, k] on device; contiguous, or with strided=True any
    row strides and contiguous picks: the entry columns of the attention's index tensor)."""
    if out is None:
        return torch.empty((b, s, k), dtype=torch.int64, device=device)
    if (out.shape != (b, s, k) or out.dtype != torch.int64 or out.device != device
            or not (out.is_contiguous() or (strided and (k <= 1 or out.stride(2) == 1)))):
        raise ValueError(f"{where}: out must be {'int64 with contiguous picks' if strided else 'contiguous int64'} "
                         f"{(b, s, k)} on {device}, got {out.dtype} {tuple(out.shape)} strides {out.stride()} on "
                         f"{out.device}")
    return out


TOPK_BLOCKS = (256, 1024, 4096, TOPK_ROW_IN_REGISTERS)  # register-tile widths of a row (issue 29)
TOPK_SORT_WIDTHS = (64, 512)  # sort widths KP for k up to 512; larger k: the next power of two


def _topk_config(n: int, k: int) -> tuple[int, int, bool]:
    """(BLOCK, KP, IN_REGISTERS): the whole row in one register tile up to TOPK_ROW_IN_REGISTERS entries (the
    smallest TOPK_BLOCKS width >= n), else chunks of 4096; KP = the smallest TOPK_SORT_WIDTHS width >= k (the
    sort width; k > 512: the next power of two).
    Issue 29: both come from fixed sets, not from next_power_of_2(n) / next_power_of_2(k), which made every new
    power of two of the prompt length (n = T // 4) a new build (1-2 s on an H200): at most 4 x 2 in-register
    builds (x S == 1 or not) for rows up to 16384 entries (64k tokens), one chunked build above. A wider tile
    than n costs masked lanes only (at most 4x the lanes of the smallest power of two)."""
    in_regs = n <= TOPK_ROW_IN_REGISTERS
    block = next(b for b in TOPK_BLOCKS if b >= n) if in_regs else 4096
    kp = next((w for w in TOPK_SORT_WIDTHS if w >= k), None) or triton.next_power_of_2(k)
    return block, kp, in_regs


def indexer_topk(scores: torch.Tensor, k: int, n_valid: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None, check: bool = False, num_warps: int | None = None,
                 sorted_picks: bool = True, ratio: int = 0, offset: int = 0) -> torch.Tensor:
    """Triton `indexer_topk_ref` (spec §7 steps 4-7): same arguments, same picks in the same order, bitwise.

    One program per query row: a radix select of the k-th largest key (16 passes of 3 packed counts over the
    row, kept in registers up to TOPK_ROW_IN_REGISTERS = 16384 entries, re-read in chunks beyond), the ties at
    that key taken toward the lower index, the k picks sorted by (score desc, index asc). One launch, no host
    sync unless check=True.

    Args: as `indexer_topk_ref` (scores [b, s, n] float32, stride 1 in n; k int >= 0; n_valid int32/int64
        [b, s] or None). Keyword-only: `out` int64 [b, s, k] contiguous (tests poison it); `check` True =
        verify 0 <= n_valid <= n on the host (one sync, ValueError); default False: a row whose n_valid lies
        outside [0, n] gets -2 in every slot (not an index and not the empty marker -1: `sparse_attn` turns
        such a query into NaN); `num_warps` default from the row length; `sorted_picks` False = the same set
        of picks in ascending entry order (skips the final sort; attention does not depend on the order);
        `ratio` as `indexer_topk_ref` (n_valid positions; the count min((p + 1) // ratio, n) computed in-kernel);
        `offset` int >= 0: every pick written as its entry index + offset (-1 and -2 unchanged), and `out` may
        then be a row-strided view with contiguous picks: the decode step writes its CSA key slots straight into
        the attention's index tensor (`kernels.attention.step_index`'s entry columns, issue 27).
    Returns: idx [b, s, k] int64 (out itself when given), slots j >= min(n_valid, n) hold -1.
    Raises: ValueError on any bad argument (named, with its value); RuntimeError without triton.
    """
    where = "kernels.indexer.indexer_topk"
    if not isinstance(scores, torch.Tensor) or scores.dim() != 3 or scores.dtype != torch.float32:
        raise ValueError(f"{where}: scores must be float32 [b, s, n], got "
                         f"{getattr(scores, 'dtype', type(scores).__name__)} {tuple(getattr(scores, 'shape', ()))}")
    _check_topk_args(tuple(scores.shape), scores.device, k, n_valid, where)
    _check_launch_device({"scores": scores, **({"n_valid": n_valid} if n_valid is not None else {})}, where)
    b, s, n = scores.shape
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 0 or (ratio and n_valid is None):
        raise ValueError(f"{where}: ratio={ratio!r}, expected an int >= 0 (> 0 only with n_valid positions)")
    if check and n_valid is not None and n_valid.numel():
        counts = ((n_valid + 1) // ratio).clamp(max=n) if ratio else n_valid
        lo, hi = torch.stack(torch.aminmax(counts)).tolist()  # one device sync (opt-in)
        if lo < 0 or hi > n:
            raise ValueError(f"{where}: n_valid must lie in [0, n={n}], got min {lo} max {hi}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"{where}: offset={offset!r}, expected an int >= 0")
    out = _topk_out(out, b, s, k, scores.device, where, strided=offset > 0)
    if b * s == 0 or k == 0:
        return out
    block, kp, in_regs = _topk_config(n, k)
    warps = num_warps or (max(4, min(16, block // 1024)) if in_regs else 16)
    nv = n_valid if n_valid is not None else scores
    _indexer_topk_kernel[(b * s,)](scores, nv, out, s, n, k, scores.stride(0), scores.stride(1),
                                   nv.stride(0), nv.stride(1), out.stride(0), out.stride(1), offset,
                                   HAS_NV=n_valid is not None, BLOCK=block, KP=kp, IN_REGISTERS=in_regs,
                                   SORTED=bool(sorted_picks), RATIO=ratio, num_warps=warps)
    return out


def indexer_select(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, k: int,
                   n_valid: torch.Tensor | None = None, *, scores: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, block_n: int = 64, num_warps: int = 8,
                   programs_per_row: int | None = None, sorted_picks: bool = True) -> torch.Tensor:
    """Whole CSA selection in ONE launch: `indexer_topk_ref(indexer_scores_ref(q, weights, keys), k, n_valid)`.

    The scoring programs of a query row write its fp32 scores (to `scores`, or the stream workspace), count
    themselves in a per-row semaphore, and the last one to arrive runs the top-k of that row (same kernel
    code as `indexer_topk`); no host sync. World size 1 only: with head-parallel indexers the partial scores
    must be summed across ranks before the top-k (`indexer_scores` + all-reduce + `indexer_topk`).

    Args: q, weights, keys as `indexer_scores_ref` (keys = its `k` [b, n, d]); k, n_valid as
        `indexer_topk_ref`. Keyword-only: `scores` optional contiguous float32 [b, s, n] receiving the scores;
        `out` optional contiguous int64 [b, s, k]; tuning block_n / num_warps / programs_per_row as
        `indexer_scores`; `sorted_picks` as `indexer_topk`. A row whose n_valid lies outside [0, n] gets -2
        in every slot (see `indexer_topk`).
    Returns: idx [b, s, k] int64 as `indexer_topk_ref`.
    Raises: ValueError on any bad argument (named, with its value); RuntimeError without triton.
    """
    where = "kernels.indexer.indexer_select"
    _check_scores_inputs(q, weights, keys, where)
    b, s, h, d = q.shape
    n = keys.shape[1]
    _check_topk_args((b, s, n), q.device, k, n_valid, where)
    tensors = {"q": q, "weights": weights, "keys": keys, **({"n_valid": n_valid} if n_valid is not None else {})}
    _check_launch_device(tensors, where)
    if d < 16 or d & (d - 1):
        raise ValueError(f"{where}: indexer head dim d must be a power of two >= 16, got {d}")
    if h > 128:
        raise ValueError(f"{where}: at most 128 indexer heads fit one program, got H={h}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{where}: block_n must be a power of two >= 16, got {block_n}")
    out = _topk_out(out, b, s, k, q.device, where)
    if b * s == 0 or k == 0:
        return out
    tiles = max(1, triton.cdiv(n, block_n))
    if programs_per_row is None:
        programs_per_row = max(1, min(tiles, triton.cdiv(4 * _num_sms(q.device), b * s)))
    if not isinstance(programs_per_row, int) or programs_per_row < 1:
        raise ValueError(f"{where}: programs_per_row must be an int >= 1, got {programs_per_row!r}")
    chunk = triton.cdiv(tiles, programs_per_row) * block_n
    grid = (b * s, max(1, triton.cdiv(n, chunk)))
    sem, ws = workspace(q.device, b * s, 0 if scores is not None else b * s * n)
    if scores is None:
        scores = ws[: b * s * n].view(b, s, n)
    elif (scores.shape != (b, s, n) or scores.dtype != torch.float32 or scores.device != q.device
          or not scores.is_contiguous()):
        raise ValueError(f"{where}: scores must be contiguous float32 {(b, s, n)} on {q.device}, got "
                         f"{scores.dtype} {tuple(scores.shape)} on {scores.device}")
    block, kp, in_regs = _topk_config(n, k)
    nv = n_valid if n_valid is not None else out
    _indexer_select_kernel[grid](q, weights, keys, scores, nv, out, sem, s, h, n, chunk, k,
                                 q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
                                 keys.stride(0), keys.stride(1), scores.stride(0), scores.stride(1),
                                 nv.stride(0), nv.stride(1), out.stride(0), out.stride(1),
                                 D=d, BLOCK_H=max(16, triton.next_power_of_2(h)), BLOCK_N=block_n,
                                 DOT=dot_mode(q.dtype), HAS_NV=n_valid is not None, BLOCK=block, KP=kp,
                                 IN_REGISTERS=in_regs, SORTED=bool(sorted_picks), num_warps=num_warps)
    return out


# ---------------------------------------------------------------------------------------------------------
# Hadamard rotation + FP4 rounding of the indexer's q and keys in ONE launch (spec §7.1-7.3)
# ---------------------------------------------------------------------------------------------------------

_ROTATE_BR = 16  # rows per program of `_rotate_fp4_kernel` (the tl.dot's M; >= 16)


def _sylvester(n: int, device=None) -> torch.Tensor:
    """Normalized Sylvester matrix fp32 [n, n], built exactly as `dsv4.model.hadamard_matrix` (kernels/ never
    imports dsv4): h = [[1]]; while len < n: h = [[h, h], [h, -h]]; h / sqrt(n) (same fp32 division, same values;
    tests/unit/test_indexer_kernels.py::test_rotate_fp4_ref_is_the_model_chain)."""
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / math.sqrt(n)).to(device)


def _check_rotate_input(x, where: str) -> None:
    """x: a bf16 tensor [..., n], n a power of two in 16..256 and a multiple of the FP4 block 32 (so 32..256)."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() < 1:
        raise ValueError(f"{where}: x must be a bfloat16 tensor [..., n], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    n = x.shape[-1]
    if n & (n - 1) or not 16 <= n <= 256:
        raise ValueError(f"{where}: x's last dim n must be a power of two in 16..256, got n={n}")
    if n % FP4_BLOCK:
        raise ValueError(f"{where}: x's last dim n must be a multiple of the FP4 block {FP4_BLOCK}, got n={n}")


def rotate_fp4_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference rotation + FP4 rounding (spec §7.1-7.3: the indexer's Hadamard rotation and FP4 rounding of q and
    of the indexer keys): `fp4_act_quant_sim((x.float() @ H.T).to(bfloat16), 32)` with H the normalized Sylvester
    matrix (`dsv4.model.hadamard_matrix(n)`), i.e. the chain of `Indexer.select` / the indexer `Compressor`.

    Args:
        x: [..., n] bfloat16, any leading shape (CPU or CUDA); n a power of two in 16..256 and a multiple of 32
            (V4: n = index_head_dim = 128).
    Returns:
        [..., n] bfloat16: each 32-channel block on the e2m1 grid times its power-of-two scale; a NaN anywhere in
        a row of x makes that whole row NaN (every output channel sums every input).
    Raises:
        ValueError: x not a bfloat16 tensor, or n not a power of two in 16..256, or n not a multiple of 32.
    """
    _check_rotate_input(x, "rotate_fp4_ref")
    h = _sylvester(x.shape[-1], x.device)
    return fp4_act_quant_sim((x.float() @ h.T).to(torch.bfloat16), FP4_BLOCK)


if triton is not None:
    from kernels.jit_formats import cast_for_store, round_bf16
    from kernels.quant import _fp4_sim_tile

    @triton.jit(do_not_specialize=["R", "S"])  # issue 29: the row count (tokens x heads) varies per step
    def _rotate_fp4_kernel(x_ptr, y_ptr, R, scale, pos_ptr=None, f_ptr=None, S=1, H=1, RD2=0,
                           N: tl.constexpr = 128, BR: tl.constexpr = 16, MMA: tl.constexpr = 1,
                           ROPE: tl.constexpr = False, PER_ROW: tl.constexpr = False):
        """BR rows of x [R, N] bf16 per program: y = fp4_sim(bf16(x @ S * scale)), S_kj = (-1)^popcount(k & j)
        built in registers (symmetric, so S = S^T), scale = the reference's fp32 1/sqrt(N). The products with +-1
        are exact; MMA 1: one bf16 tensor-core dot (x is bf16 already), MMA 0 (interpreter, whose bf16 dots and
        casts are not faithful): an fp32 "ieee" dot. The bf16 rounding is `round_bf16` (ties to even, also
        under the interpreter), the FP4 simulation `kernels.quant._fp4_sim_tile` on [BR * N / 32, 32] blocks.
        ROPE (`rope_rotate_fp4`): first the row's last 2*RD2 columns rotated at its token's position (row = (b*S +
        t)*H + h; pos[t], or pos[b, t] with PER_ROW) with `kernels.rope._rope_tail_kernel`'s operations (fp64
        angle, fp32 pair rotation, one rounding to bf16), so the result is bitwise `rope_tail_` then this."""
        rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        cols = tl.arange(0, N)
        mask = (rows < R)[:, None]
        offs = rows[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if ROPE:
            tok = rows // H
            if not PER_ROW:
                tok = tok % S
            p = tl.load(pos_ptr + tok, mask=rows < R, other=0)
            jr = cols - (N - 2 * RD2)
            isr = jr >= 0
            ang = p.to(tl.float64)[:, None] * tl.load(f_ptr + jr // 2, mask=isr, other=0.0)[None, :]
            c = tl.cos(ang).to(tl.float32)
            sn = tl.sin(ang).to(tl.float32)
            xf = x.to(tl.float32)
            xp = tl.load(x_ptr + rows[:, None] * N + (cols ^ 1)[None, :], mask=mask, other=0.0).to(tl.float32)
            rot = tl.where((cols % 2 == 0)[None, :], xf * c - xp * sn, xp * sn + xf * c)
            x = tl.where(isr[None, :], cast_for_store(rot, x_ptr), x)
        b = cols[:, None] & cols[None, :]
        par = b ^ (b >> 1)
        par = par ^ (par >> 2)
        par = par ^ (par >> 4)
        par = par ^ (par >> 8)
        sgn = tl.where((par & 1) == 1, -1.0, 1.0)
        if MMA == 1:
            acc = tl.dot(x, sgn.to(tl.bfloat16))
        else:
            acc = tl.dot(x.to(tl.float32), sgn, input_precision="ieee")
        z = round_bf16(acc * scale)
        y = tl.reshape(_fp4_sim_tile(tl.reshape(z, (BR * N // 32, 32))), (BR, N))
        # The sign bit as the reference's: negative iff z < 0, so a negative z rounded to 0 is -0.0 (integer bit
        # ops, which no float optimisation rewrites; `_fp4_sim_tile` now sets it the same way - this is the form
        # measured on the H200, kept as measured)
        yb = y.to(tl.int32, bitcast=True)
        y = tl.where(z < 0, yb | -2147483648, yb).to(tl.float32, bitcast=True)
        tl.store(y_ptr + offs, cast_for_store(y, y_ptr), mask=mask)


@functools.lru_cache(maxsize=None)
def _rotate_scale(n: int) -> float:
    """fp32(1 / sqrt(n)) as the reference's `h / math.sqrt(n)` computes it (= every entry of its H), once per n
    (a host computation: no launch, no per-call tensor)."""
    return float(torch.ones((), dtype=torch.float32) / math.sqrt(n))


def rope_rotate_fp4(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, rd: int) -> torch.Tensor:
    """The indexer query's RoPE and rotation in ONE launch (issue 27; the triton backend's `rope_rotate_fp4`
    entry): `rotate_fp4(kernels.rope.rope_tail_(x, pos, inv_freq, rd))`, bitwise (the tail's rotation is
    `_rope_tail_kernel`'s operations inside `_rotate_fp4_kernel`). x [b, s, h, n] bf16 contiguous; pos int64 [s] or
    [b, s] contiguous; inv_freq [rd/2] fp64; rd even <= n. Returns [b, s, h, n] bf16. Raises ValueError naming a bad
    argument (as `rotate_fp4`)."""
    where = "kernels.indexer.rope_rotate_fp4"
    _check_rotate_input(x, where)
    if x.dim() != 4:
        raise ValueError(f"{where}: x must be [b, s, h, n], got shape {tuple(x.shape)}")
    b, S, H, n = x.shape
    if isinstance(rd, bool) or not isinstance(rd, int) or rd <= 0 or rd % 2 or rd > n:
        raise ValueError(f"{where}: rd={rd!r}, expected an even int in 2..{n}")
    if (not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64 or tuple(pos.shape) not in ((S,), (b, S))
            or not pos.is_contiguous()):
        raise ValueError(f"{where}: pos must be contiguous int64 [{S}] or [{b}, {S}], got "
                         f"{getattr(pos, 'dtype', type(pos))} {tuple(getattr(pos, 'shape', ()))}"
                         + (f" strides {pos.stride()}" if isinstance(pos, torch.Tensor) else ""))
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dtype != torch.float64 or tuple(inv_freq.shape) != (rd // 2,):
        raise ValueError(f"{where}: inv_freq must be float64 [{rd // 2}], got "
                         f"{getattr(inv_freq, 'dtype', type(inv_freq))} {tuple(getattr(inv_freq, 'shape', ()))}")
    x = x.contiguous()
    _check_launch_device({"x": x, "pos": pos, "inv_freq": inv_freq}, where)
    if pos.device != x.device or inv_freq.device != x.device:
        raise ValueError(f"{where}: pos and inv_freq must be on x's device {x.device}, got {pos.device} / "
                         f"{inv_freq.device}")
    y = torch.empty_like(x)
    rows = x.numel() // n
    if rows:
        _rotate_fp4_kernel[(triton.cdiv(rows, _ROTATE_BR),)](x, y, rows, _rotate_scale(n), pos, inv_freq, S, H,
                                                             rd // 2, N=n, BR=_ROTATE_BR,
                                                             MMA=0 if interpreting() else 1, ROPE=True,
                                                             PER_ROW=pos.dim() == 2,
                                                             num_warps=4 if n <= 128 else 8)
    return y


def rotate_fp4(x: torch.Tensor) -> torch.Tensor:
    """Triton `rotate_fp4_ref` in ONE launch (replaces matmul, bf16 cast and the FP4 simulation's launches).

    Rows of 16 per program; the +-1 Sylvester matrix is built in registers, the fp32 dot of exact products is
    scaled by the reference's fp32 1/sqrt(n), rounded to bf16 (ties to even) and FP4-rounded per 32 channels by
    the same jit helper as `kernels.quant.fp4_act_quant_sim`. Equal to the reference up to the fp32 summation
    order before the bf16 rounding (and, for n = 32 / 128, one rounding of the scale: the reference multiplies
    every product by the inexact 1/sqrt(n), the kernel the sum): rarely a bf16 rounding boundary, then at most
    one e2m1 code (tests/unit/test_indexer_kernels.py::test_rotate_fp4_matches_ref).

    Args: x [..., n] bfloat16, any leading shape (made contiguous if it is not), CUDA (CPU under
        TRITON_INTERPRET=1); n a power of two in 16..256 and a multiple of 32.
    Returns: [..., n] bfloat16 (a new tensor; empty for an empty x).
    Raises: ValueError naming x and the bad dtype / width / device; RuntimeError without triton.
    """
    where = "kernels.indexer.rotate_fp4"
    _check_rotate_input(x, where)
    x = x.contiguous()
    _check_launch_device({"x": x}, where)
    n = x.shape[-1]
    y = torch.empty_like(x)
    rows = x.numel() // n
    if rows:
        scale = _rotate_scale(n)
        _rotate_fp4_kernel[(triton.cdiv(rows, _ROTATE_BR),)](x, y, rows, scale, N=n, BR=_ROTATE_BR,
                                                             MMA=0 if interpreting() else 1,
                                                             num_warps=4 if n <= 128 else 8)
    return y
