"""Lightning-indexer scoring and top-k selection for CSA layers (spec §7).

Reading order (STYLE §1): `indexer_scores_ref`, `indexer_topk_ref` (plain torch, the executable spec), the
`@triton.jit` scoring kernel and its launcher `indexer_scores`. Top-k has no Triton kernel: `indexer_topk_ref`
is THE selection used by the reference model and the Triton backend alike, so the tie rule cannot drift.

Dimension legend: b batch, s queries, H indexer heads (64), d indexer head dim (128), n compressed keys.
    scores[b, t, n] = sum_h weights[b, t, h] * ReLU(q[b, t, h] . k[b, n])      (fp32 maths, fp32 out)
The official model computes the score in bf16 (spec §7 step 3); this contract is fp32 (HF's precision).
"""

from __future__ import annotations

import torch

from kernels.attention import _check_launch_device, _num_sms, dot_mode, triton, tl

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
                     check: bool = True) -> torch.Tensor:
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
    def _indexer_scores_kernel(Q, W, K, OUT, S, H, N, CHUNK,
                               sqb, sqs, sqh, swb, sws, skb, skn, sob, sos,
                               D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                               DOT: tl.constexpr):
        """One program: one query (b, t), all H heads (BLOCK_H >= H), keys [pid*CHUNK, (pid+1)*CHUNK)."""
        pid_bs = tl.program_id(0)
        pid_n = tl.program_id(1)
        b = (pid_bs // S).to(tl.int64)
        t = (pid_bs % S).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)
        hmask = heads < H
        dd = tl.arange(0, D)
        q = tl.load(Q + b * sqb + t * sqs + heads[:, None] * sqh + dd[None, :], mask=hmask[:, None], other=0.0)
        w = tl.load(W + b * swb + t * sws + heads, mask=hmask, other=0.0).to(tl.float32)
        start = pid_n * CHUNK
        end = tl.minimum(start + CHUNK, N)
        for n0 in range(start, end, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            nmask = offs < end
            kt = tl.load(K + b * skb + offs[:, None].to(tl.int64) * skn + dd[None, :], mask=nmask[:, None],
                         other=0.0)
            sc = tl.maximum(_dot(q, tl.trans(kt), DOT), 0.0) * w[:, None]
            tl.store(OUT + b * sob + t * sos + offs, tl.sum(sc, axis=0), mask=nmask)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, *, out: torch.Tensor | None = None,
                   block_n: int = 64, num_warps: int = 4, programs_per_row: int | None = None) -> torch.Tensor:
    """Triton indexer scores; same contract and result as `indexer_scores_ref` (fp32 accumulation and output).

    A program holds one query's H x d queries in registers and streams `block_n` keys at a time, so in decode
    each key byte is read once per query; rows are split over `programs_per_row` programs (default: enough to
    cover ~4 waves of SMs). H must be <= 128 and d a power of two >= 16.
    Args: as `indexer_scores_ref`, plus keyword-only `out` ([b, s, n] float32 contiguous; tests poison it).
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
                                 D=d, BLOCK_H=block_h, BLOCK_N=block_n, DOT=dot_mode(q.dtype), num_warps=num_warps)
    return out
