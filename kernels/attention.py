"""Sparse attention with a per-head sink over a gathered index set (spec §5), shared K=V (MQA, one KV head).

Reading order (STYLE §1): `sparse_attn_ref` (plain torch, the executable spec), the `@triton.jit` kernels, the
launcher `sparse_attn`.

Dimension legend: b batch, s queries per sequence, h heads (64 Flash / 128 Pro), hd head dim (512),
n rows of the KV tensor, k index slots per query (window 128 + compressed entries).

Maths for query t, head h, selected slot set J = {j : idx[b, t, j] != -1} (spec §5 "Attention sink"):
    s_j = scale * (q[b,t,h] . kv[b, idx_j]),   m = max_j s_j,
    o[b,t,h] = sum_J e^(s_j - m) kv[b, idx_j] / (sum_J e^(s_j - m) + e^(sink_h - m)).
Both implementations take the max over {s_j} ∪ {sink_h} instead of {s_j}: the quotient is mathematically
identical and nothing overflows. Documented edge cases:
  * a query whose slots are all -1 gets o = 0 exactly (only the sink, whose value vector is zero);
  * a duplicated index is two keys: it enters numerator and denominator twice (as the official kernel does;
    callers never duplicate, spec §5 "nothing is deduplicated" refers to window vs compressed rows, which are
    distinct rows of kv).
"""

from __future__ import annotations

import math

import torch

from kernels.launch import interpreting, sm_count, workspace

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference stays importable without triton; the launcher raises.
    triton = None
    tl = None

_LOG2E = 1.4426950408889634
_FLOAT_DTYPES = (torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_inputs(q, kv, attn_sink, idx, softmax_scale, where: str) -> None:
    """Shared shape/dtype/value checks; raise ValueError naming the argument, the value and the expectation."""
    for name, t in (("q", q), ("kv", kv), ("attn_sink", attn_sink), ("idx", idx)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"{where}: q must be [b, s, h, hd], got shape {tuple(q.shape)}")
    b, s, h, hd = q.shape
    if kv.dim() != 3 or kv.shape[0] != b or kv.shape[2] != hd:
        raise ValueError(f"{where}: kv must be [b={b}, n, hd={hd}], got shape {tuple(kv.shape)}")
    if q.dtype not in _FLOAT_DTYPES or kv.dtype != q.dtype:
        raise ValueError(f"{where}: q and kv must share a dtype in {_FLOAT_DTYPES}, got q {q.dtype}, kv {kv.dtype}")
    if attn_sink.shape != (h,) or attn_sink.dtype != torch.float32:
        raise ValueError(f"{where}: attn_sink must be float32 [h={h}], got {attn_sink.dtype} {tuple(attn_sink.shape)}")
    if idx.dim() != 3 or idx.shape[:2] != (b, s) or idx.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{where}: idx must be int32/int64 [b={b}, s={s}, k], got {idx.dtype} {tuple(idx.shape)}")
    if (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
            or not math.isfinite(softmax_scale) or softmax_scale <= 0):  # True was read as 1.0
        raise ValueError(f"{where}: softmax_scale must be a finite positive float, got {softmax_scale!r}")
    devices = {t.device for t in (q, kv, attn_sink, idx)}
    if len(devices) != 1:
        raise ValueError(f"{where}: q, kv, attn_sink, idx must be on one device, got {sorted(map(str, devices))}")


def _check_index_range(idx: torch.Tensor, n: int, where: str) -> None:
    """Indices must be -1 (empty) or in [0, n). One device sync (one aminmax read back); opt-in in the launcher."""
    if idx.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(idx)).tolist()
    if lo < -1 or hi >= n:
        raise ValueError(f"{where}: idx values must be -1 (empty) or in [0, n={n}), got min {lo} max {hi}")


def sparse_attn_ref(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, idx: torch.Tensor,
                    softmax_scale: float) -> torch.Tensor:
    """Reference sparse attention with sink (spec §5), fp32 maths, output in q.dtype.

    Numerics follow the official kernel: fp32 logits, max and sums; for bf16 inputs the probabilities are
    rounded to bf16 before the P.V product (fp32 accumulation), as the official kernel does; fp32 inputs stay
    fp32 throughout (the exact mode).

    Args:
        q: [b, s, h, hd] bfloat16 or float32 queries.
        kv: [b, n, hd] same dtype; shared key and value rows (window ring / raw tokens, then compressed entries).
        attn_sink: [h] float32 per-head sink logit (value vector zero).
        idx: [b, s, k] int32/int64 rows of kv per query; -1 = empty slot.
        softmax_scale: positive float (the model uses hd**-0.5 = 512**-0.5).
    Returns:
        o: [b, s, h, hd] in q.dtype. All-empty rows give exactly 0; duplicated indices count twice.
    Raises:
        ValueError: wrong rank/shape/dtype/device, a scale that is not a finite float > 0 (a bool included),
            or an index outside {-1} ∪ [0, n).
    """
    _check_inputs(q, kv, attn_sink, idx, softmax_scale, "sparse_attn_ref")
    _check_index_range(idx, kv.shape[1], "sparse_attn_ref")
    b, s, h, hd = q.shape
    valid = idx >= 0                                                           # [b, s, k]
    safe = idx.clamp(min=0).long()
    k = idx.shape[2]
    if kv.shape[1] == 0:  # no rows at all (every index is -1, checked above): nothing to gather
        rows = kv.new_zeros(b, s, k, hd, dtype=torch.float32)
    else:  # the shapes spelled out: s = 0 or k = 0 leave reshape's -1 ambiguous
        rows = torch.gather(kv, 1, safe.reshape(b, s * k, 1).expand(-1, -1, hd)).reshape(b, s, k, hd).float()
    logits = torch.einsum("bshd,bskd->bshk", q.float(), rows) * softmax_scale  # [b, s, h, k]
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    sink = attn_sink.float().view(1, 1, h, 1)
    m = torch.maximum(logits.amax(dim=-1, keepdim=True), sink) if logits.shape[-1] else sink.expand(b, s, h, 1)
    p = torch.exp(logits - m)                                                  # exp(-inf) = 0 for empty slots
    denom = p.sum(dim=-1, keepdim=True) + torch.exp(sink - m)
    pv = p.to(torch.bfloat16).float() if q.dtype == torch.bfloat16 else p        # official: bf16 P before P.V
    o = torch.einsum("bshk,bskd->bshd", pv, rows) / denom
    return o.to(q.dtype)


if triton is not None:
    from kernels.gemm import cast_for_store

    @triton.jit
    def _dot(a, b, DOT: tl.constexpr):
        """a @ b with fp32 accumulation. DOT 0: native (bf16 tensor cores); 1: fp32 inputs, exact ("ieee", no
        tf32); 2: bf16 inputs upcast to fp32 first: only under TRITON_INTERPRET=1, whose create_dot multiplies the
        raw uint16 storage of bf16 (triton 3.9); bf16 x bf16 products are exact in fp32, so the result is the same
        maths as DOT 0."""
        if DOT == 0:
            return tl.dot(a, b)
        elif DOT == 1:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")

    @triton.jit
    def _merge_splits(O, PACC, PML, pid_bs, heads, hmask, sink, dcol, dv, b, t, H, NSPLIT, NDV, sob, sos, soh,
                      HD: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr):
        """Merge the NSPLIT partials of query pid_bs for `heads` and output columns `dcol` (column slice dv of
        NDV), add the sink (log2 domain), write o. Partials are read with `.cg` (L2, not L1): other programs of
        this launch wrote them. Shared by both kernels (the head-block kernel: NDV 1, dv 0, DV = HD)."""
        mm = sink
        ll = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, DV], dtype=tl.float32)
        for sp in range(0, NSPLIT):
            base = (pid_bs.to(tl.int64) * NSPLIT + sp) * H
            mlb = ((pid_bs.to(tl.int64) * NSPLIT + sp) * NDV + dv) * H
            m_i = tl.load(PML + (mlb + heads) * 2, mask=hmask, other=0.0, cache_modifier=".cg")
            l_i = tl.load(PML + (mlb + heads) * 2 + 1, mask=hmask, other=0.0, cache_modifier=".cg")
            a_i = tl.load(PACC + (base + heads[:, None]) * HD + dcol[None, :], mask=hmask[:, None], other=0.0,
                          cache_modifier=".cg")
            m_new = tl.maximum(mm, m_i)
            alpha = tl.exp2(mm - m_new)
            beta = tl.exp2(m_i - m_new)
            ll = ll * alpha + l_i * beta
            acc = acc * alpha[:, None] + a_i * beta[:, None]
            mm = m_new
        o = acc / (ll + tl.exp2(sink - mm))[:, None]
        tl.store(O + b * sob + t * sos + heads[:, None] * soh + dcol[None, :], cast_for_store(o, O),
                 mask=hmask[:, None])

    @triton.jit
    def _rope_out(O, b, t, S, heads, hmask, sob, sos, soh, POS, FREQ, RD2, HD: tl.constexpr, BR: tl.constexpr,
                  PER_ROW: tl.constexpr):
        """The inverse RoPE of the output's last 2*RD2 columns (spec §5.4: de-rotation by the query's position
        pos[t], or pos[b, t] with PER_ROW), in place on the o rows this program just stored (a CTA barrier first:
        other threads stored them): the operations of `kernels.rope._rope_tail_kernel` with SIGN -1 (cos / sin of
        the fp64 angle, the pair rotation in fp32, one rounding to o's dtype), so o is bitwise `sparse_attn` then
        `rope_tail_(inverse=True)`."""
        tl.debug_barrier()
        i = tl.arange(0, BR)
        mi = i < RD2
        if PER_ROW:
            p = tl.load(POS + b * S + t)
        else:
            p = tl.load(POS + t)
        ang = p.to(tl.float64) * tl.load(FREQ + i, mask=mi, other=0.0)
        c = tl.cos(ang).to(tl.float32)[None, :]
        sn = (tl.sin(ang).to(tl.float32) * -1.0)[None, :]
        ptr = O + b * sob + t * sos + heads[:, None] * soh + (HD - 2 * RD2) + 2 * i[None, :]
        m2 = hmask[:, None] & mi[None, :]
        x0 = tl.load(ptr, mask=m2, other=0.0).to(tl.float32)
        x1 = tl.load(ptr + 1, mask=m2, other=0.0).to(tl.float32)
        tl.store(ptr, cast_for_store(x0 * c - x1 * sn, O), mask=m2)
        tl.store(ptr + 1, cast_for_store(x0 * sn + x1 * c, O), mask=m2)

    # Not specialized on the lengths (issue 29): S, N, K, NSPLIT and the index strides vary with the prompt length,
    # the position and the batch; CHUNK (a multiple of BLOCK_N) and the q / kv / o strides (multiples of HD) keep
    # their divisibility by 16 whatever the length, so they stay specialized (vector loads of q and the rows).
    @triton.jit(do_not_specialize=["S", "N", "K", "NSPLIT", "sib", "sis"])
    def _sparse_attn_kernel(Q, KV, SINK, IDX, O, PACC, PML, SEM,
                            S, H, N, K, CHUNK, NSPLIT,
                            sqb, sqs, sqh, skb, skn, sib, sis, sob, sos, soh,
                            qk_scale, POS, FREQ, RD2,
                            HD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                            SPLIT: tl.constexpr, DOT: tl.constexpr, ROPE: tl.constexpr, PER_ROW: tl.constexpr,
                            BR: tl.constexpr):
        """One program: one query (b, t), BLOCK_H heads, index slots [sp*CHUNK, (sp+1)*CHUNK).

        Online softmax in the log2 domain, m initialised to the sink so no -inf - -inf appears. SPLIT=False
        writes o. SPLIT=True writes the unnormalised partial (acc, m, l), counts itself in SEM[query, head
        block] (acq_rel atomic after a CTA barrier) and the last split to arrive merges all partials
        (`_merge_splits`) and resets the counter: one launch either way, no spin-wait.
        Range guard without a host sync: an index outside {-1} ∪ [0, N) is never loaded; it makes l NaN, so
        every output row of that query and head block is NaN (loud, never a plausible value).
        ROPE: the program that writes o then de-rotates its last 2*RD2 columns (`_rope_out`; POS, FREQ, PER_ROW).
        """
        pid_bs = tl.program_id(0)
        pid_h = tl.program_id(1)
        sp = tl.program_id(2)
        b = (pid_bs // S).to(tl.int64)
        t = (pid_bs % S).to(tl.int64)
        heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < H
        d = tl.arange(0, HD)
        q = tl.load(Q + b * sqb + t * sqs + heads[:, None] * sqh + d[None, :], mask=hmask[:, None], other=0.0)
        sink = tl.load(SINK + heads, mask=hmask, other=0.0) * 1.4426950408889634
        m = sink
        l = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, HD], dtype=tl.float32)
        n_bad = tl.zeros([BLOCK_N], dtype=tl.int32)
        start = sp * CHUNK
        end = tl.minimum(start + CHUNK, K)
        for j0 in range(start, end, BLOCK_N):
            offs = j0 + tl.arange(0, BLOCK_N)
            ix = tl.load(IDX + b * sib + t * sis + offs, mask=offs < end, other=-1).to(tl.int64)
            valid = (ix >= 0) & (ix < N)
            n_bad += ((ix < -1) | (ix >= N)).to(tl.int32)
            rows = tl.load(KV + b * skb + ix[:, None] * skn + d[None, :], mask=valid[:, None], other=0.0)
            sc = _dot(q, tl.trans(rows), DOT)
            sc = tl.where(valid[None, :], sc * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            pv = _dot(p.to(rows.dtype), rows, DOT)
            acc = acc * alpha[:, None] + pv
            m = m_new
        l = l + tl.where(tl.sum(n_bad, axis=0) > 0, float("nan"), 0.0)
        if SPLIT:
            base = (pid_bs.to(tl.int64) * NSPLIT + sp) * H
            tl.store(PACC + (base + heads[:, None]) * HD + d[None, :], acc, mask=hmask[:, None])
            tl.store(PML + (base + heads) * 2, m, mask=hmask)
            tl.store(PML + (base + heads) * 2 + 1, l, mask=hmask)
            tl.debug_barrier()
            counter = SEM + pid_bs * tl.num_programs(1) + pid_h
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == NSPLIT - 1:
                _merge_splits(O, PACC, PML, pid_bs, heads, hmask, sink, d, 0, b, t, H, NSPLIT, 1, sob, sos, soh,
                              HD, HD, BLOCK_H)
                if ROPE:
                    _rope_out(O, b, t, S, heads, hmask, sob, sos, soh, POS, FREQ, RD2, HD, BR, PER_ROW)
                tl.store(counter, 0)
        else:
            o = acc / (l + tl.exp2(sink - m))[:, None]
            tl.store(O + b * sob + t * sos + heads[:, None] * soh + d[None, :], cast_for_store(o, O),
                     mask=hmask[:, None])
            if ROPE:
                _rope_out(O, b, t, S, heads, hmask, sob, sos, soh, POS, FREQ, RD2, HD, BR, PER_ROW)

    @triton.jit(do_not_specialize=["S", "N", "K", "NSPLIT", "sib", "sis"])  # as `_sparse_attn_kernel` (issue 29)
    def _sparse_decode_kernel(Q, KV, SINK, IDX, O, PACC, PML, SEM,
                              S, H, N, K, CHUNK, NSPLIT,
                              sqb, sqs, sqh, skb, skn, sib, sis, sob, sos, soh,
                              qk_scale, POS, FREQ, RD2,
                              HD: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                              SPLIT: tl.constexpr, DOT: tl.constexpr, PREFETCH: tl.constexpr, ROPE: tl.constexpr,
                              PER_ROW: tl.constexpr, BR: tl.constexpr):
        """Decode and prefill (the default for >= 64 heads at every s): one program = one query (b, t), BLOCK_H
        heads (all 64 of Flash; 64 of Pro's 128: a
        [128, 512] fp32 accumulator does not fit one SM's registers), output columns [dv*DV, (dv+1)*DV) and
        index slots [sp*CHUNK, (sp+1)*CHUNK). Every gathered KV row is loaded once for all BLOCK_H heads and
        both dots have M = BLOCK_H = 64, so Hopper runs them as wgmma.

        Same maths as `_sparse_attn_kernel` (log2-domain online softmax, m starts at the sink, bf16 P before
        P.V, fp32 accumulation, the sync-free range guard: an index outside {-1} ∪ [0, N) is never loaded and
        makes every output of its query NaN). DV < HD splits the output columns over HD // DV programs: each
        computes the full scores (K = HD) and accumulates only its DV columns (no merge needed for that
        split; all of them compute bitwise the same m and l). SPLIT=True: partials (acc, m, l) go to
        PACC [b*s, NSPLIT, H, HD] / PML [b*s, NSPLIT, HD//DV, H, 2], the program counts itself in
        SEM[query, head block, dv] and the last one merges all partials (read back through L2), adds the sink
        and writes o, then resets the counter (one launch, no spin-wait). PREFETCH: the indices of tile j+1 are
        loaded during tile j, so Triton's pipeliner can issue the rows' gather num_stages - 1 tiles ahead.
        ROPE: the program that writes the last column slice (dv = HD // DV - 1; 2*RD2 <= DV) then de-rotates its
        last 2*RD2 columns (`_rope_out`).
        """
        pid_bs = tl.program_id(0)
        pid_hd = tl.program_id(1)
        sp = tl.program_id(2)
        NDV: tl.constexpr = HD // DV
        pid_h = pid_hd // NDV
        dv = pid_hd % NDV
        b = (pid_bs // S).to(tl.int64)
        t = (pid_bs % S).to(tl.int64)
        heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < H
        d = tl.arange(0, HD)
        dcol = dv * DV + tl.arange(0, DV)
        q = tl.load(Q + b * sqb + t * sqs + heads[:, None] * sqh + d[None, :], mask=hmask[:, None], other=0.0)
        sink = tl.load(SINK + heads, mask=hmask, other=0.0) * 1.4426950408889634
        m = sink
        l = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, DV], dtype=tl.float32)
        n_bad = tl.zeros([BLOCK_N], dtype=tl.int32)
        start = sp * CHUNK
        end = tl.minimum(start + CHUNK, K)
        ibase = IDX + b * sib + t * sis
        kvb = KV + b * skb
        if PREFETCH:  # indices one tile ahead in registers: the rows' gather then pipelines num_stages - 1 deep
            offs = start + tl.arange(0, BLOCK_N)
            ix_n = tl.load(ibase + offs, mask=offs < end, other=-1).to(tl.int64)
        for j0 in range(start, end, BLOCK_N):
            if PREFETCH:
                ix = ix_n
                offs1 = j0 + BLOCK_N + tl.arange(0, BLOCK_N)
                ix_n = tl.load(ibase + offs1, mask=offs1 < end, other=-1).to(tl.int64)
                valid = (ix >= 0) & (ix < N)
                rows = tl.load(kvb + ix[:, None] * skn + d[None, :], mask=valid[:, None], other=0.0)
            else:
                offs = j0 + tl.arange(0, BLOCK_N)
                ix = tl.load(ibase + offs, mask=offs < end, other=-1).to(tl.int64)
                valid = (ix >= 0) & (ix < N)
                rows = tl.load(kvb + ix[:, None] * skn + d[None, :], mask=valid[:, None], other=0.0)
            n_bad += ((ix < -1) | (ix >= N)).to(tl.int32)
            sc = _dot(q, tl.trans(rows), DOT)
            sc = tl.where(valid[None, :], sc * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if DV == HD:
                vals = rows
            else:
                vals = tl.load(kvb + ix[:, None] * skn + dcol[None, :], mask=valid[:, None], other=0.0)
            pv = _dot(p.to(vals.dtype), vals, DOT)
            acc = acc * alpha[:, None] + pv
            m = m_new
        l = l + tl.where(tl.sum(n_bad, axis=0) > 0, float("nan"), 0.0)
        if SPLIT:
            base = (pid_bs.to(tl.int64) * NSPLIT + sp) * H
            tl.store(PACC + (base + heads[:, None]) * HD + dcol[None, :], acc, mask=hmask[:, None])
            mlb = ((pid_bs.to(tl.int64) * NSPLIT + sp) * NDV + dv) * H
            tl.store(PML + (mlb + heads) * 2, m, mask=hmask)
            tl.store(PML + (mlb + heads) * 2 + 1, l, mask=hmask)
            tl.debug_barrier()
            counter = SEM + pid_bs * tl.num_programs(1) + pid_hd
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == NSPLIT - 1:
                _merge_splits(O, PACC, PML, pid_bs, heads, hmask, sink, dcol, dv, b, t, H, NSPLIT, NDV, sob, sos,
                              soh, HD, DV, BLOCK_H)
                if ROPE:
                    if dv == NDV - 1:
                        _rope_out(O, b, t, S, heads, hmask, sob, sos, soh, POS, FREQ, RD2, HD, BR, PER_ROW)
                tl.store(counter, 0)
        else:
            o = acc / (l + tl.exp2(sink - m))[:, None]
            tl.store(O + b * sob + t * sos + heads[:, None] * soh + dcol[None, :], cast_for_store(o, O),
                     mask=hmask[:, None])
            if ROPE:
                if dv == NDV - 1:
                    _rope_out(O, b, t, S, heads, hmask, sob, sos, soh, POS, FREQ, RD2, HD, BR, PER_ROW)


    @triton.jit
    def _step_index_kernel(P, COMP, IDX, S, W, K, KC, ratio, off, INPLACE: tl.constexpr, MODE: tl.constexpr,
                           BLOCK: tl.constexpr):
        """One (row, query) per program (`step_index`; `_step_index_row`)."""
        _step_index_row(tl.program_id(0).to(tl.int64), P, COMP, IDX, S, W, K, KC, ratio, off, INPLACE, MODE, BLOCK)

    @triton.jit
    def _step_index_row(r, P, COMP, IDX, S, W, K, KC, ratio, off, INPLACE: tl.constexpr, MODE: tl.constexpr,
                        BLOCK: tl.constexpr):
        """(row, query) r of `step_index`: the W window slots then the K entry columns of idx. Shared by
        `_step_index_kernel` and `kernels.rope._qkv_finish_kernel`."""
        b = r // S
        p = tl.load(P + r)
        p0 = tl.load(P + b * S)
        if INPLACE:
            p0 = p + 1
        j = tl.arange(0, BLOCK)
        u = p - (W - 1) + j
        win = tl.where(u < 0, -1, tl.where(u < p0, u % W, W + u - p0))
        w = j - W
        if MODE == 1:  # the indexer's picks
            c = tl.load(COMP + r * KC + w, mask=(j >= W) & (w < KC), other=-1)
        else:  # HCA: every entry completed up to this query, w < (p + 1) // ratio
            c = tl.where(w < (p + 1) // ratio, w, -1)
        ent = tl.where(c >= 0, c + off, -1)
        if MODE == 2:  # the window slots only: the K entry columns are the top-k kernel's (indexer_topk offset=)
            tl.store(IDX + r * (W + K) + j, win, mask=j < W)
        else:
            tl.store(IDX + r * (W + K) + j, tl.where(j < W, win, ent), mask=j < W + K)


# `kernels.targets.compile_all` builds these too (name, jit function, pointer dtypes, float args, constexprs).
TARGET_SPECS = () if triton is None else (
    ("attention._sparse_decode_kernel", _sparse_decode_kernel,
     dict(Q="*bf16", KV="*bf16", SINK="*fp32", IDX="*i64", O="*bf16", PACC="*fp32", PML="*fp32", SEM="*i32",
          POS="*i64", FREQ="*fp64"),
     ["qk_scale"], dict(HD=512, DV=512, BLOCK_H=64, BLOCK_N=32, SPLIT=True, DOT=0, PREFETCH=True, ROPE=True,
                        PER_ROW=True, BR=32)),
)


def _check_launch_device(tensors: dict, where: str) -> None:
    """Triton needs CUDA tensors (CPU tensors only under TRITON_INTERPRET=1) whose innermost dimension is
    contiguous (stride 1); outer strides are passed to the kernels, so broadcast (stride-0) batch axes work."""
    if triton is None:
        raise RuntimeError(f"{where}: triton is not installed; use the *_ref function or install dsv4[triton]")
    for name, t in tensors.items():
        if not (t.is_cuda or interpreting()):
            raise ValueError(f"{where}: {name} is on {t.device}; Triton needs CUDA (or TRITON_INTERPRET=1)")
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{where}: {name} must be contiguous in its last dimension (stride 1), got strides "
                             f"{t.stride()} for {tuple(t.shape)}")


def dot_mode(dtype: torch.dtype) -> int:
    """`_dot` mode for operands of `dtype`: 1 for fp32 (exact), 2 for bf16 under the interpreter, else 0."""
    if dtype == torch.float32:
        return 1
    return 2 if interpreting() else 0


def _num_sms(device: torch.device) -> int:
    """SM count, cached per device (`kernels.launch.sm_count`); 4 under the interpreter (exercises both paths)."""
    return sm_count(device, cpu_default=4)


# "heads" path tuning (measured on the H200, benchmarks/RESULTS.md "Sparse decode attention, all heads per
# program"): 64 heads per program (a [64, 512] fp32 accumulator is 128 registers per thread at 8 warps; 128
# heads would need 256); its default k-split fills one wave of one program per SM, never with a split shorter
# than `decode_min_split_tiles`. When b*s*ceil(h/64) <=
# DECODE_DV_MAX_PROGRAMS (Flash batch <= 16, Pro batch <= 8) the output columns are split too: DECODE_DV columns
# per program (measured: Flash b 16 25.0 µs vs 45.4 µs with full columns; Pro b 16 with 32 programs is faster
# with full columns, 52.9 vs 56.9 µs; Pro b 2-8 and Flash b 2-15 are not measured), at DECODE_DV_WARPS warps.
# DECODE_DV_WARPS = 8 (was 4), measured on one H100 (`benchmarks/attn_decode_probe.py`, the call with its RoPE
# epilogue in a CUDA graph, Flash 64 heads at a 4096 context; RESULTS.md, fourth session of 2026-12-06), µs 4 -> 8
# warps: b 1 CSA 36.6 -> 29.4, HCA 26.9 -> 21.4, SWA 26.2 -> 20.9; b 8 CSA 34.1 -> 32.0, HCA (4 splits) 27.9 ->
# 24.5, SWA 27.4 -> 22.8; the same outputs (the warps change no summation order).
DECODE_BLOCK_H = 64
DECODE_DV = 128
DECODE_DV_MAX_PROGRAMS = 16
DECODE_DV_WARPS = 8


def decode_min_split_tiles(block_h: int, dv: int, hd: int, block_n: int, kv_bytes: int) -> int:
    """Key tiles a split of the "heads" path must hold by default (>= 1): a split writes a partial of block_h x dv
    fp32 (and its merge reads it back) beside the block_n x hd keys per tile it reads, so a split shorter than
    block_h * dv * 4 / (block_n * hd * kv_bytes) tiles moves more partial bytes than key bytes. Flash at hd 512,
    64 heads, bf16 keys in tiles of 32: 4 tiles with all columns (dv 512), 1 with the column split (dv 128, batch
    <= 16: unchanged). Measured on one H100 (`benchmarks/decode_knobs_probe.py --section attn`, RESULTS.md, fifth
    session of 2026-12-06): HCA (160 keys) and SWA (128) at Flash batch 32 / 64 and Pro batch 16 / 32, 2-4 splits
    before, 1 now (-25 to -42 % per call); every other probed case keeps its split count."""
    return max(1, triton.cdiv(block_h * dv * 4, block_n * hd * kv_bytes))


def default_path(b: int, s: int, h: int, hd: int) -> str:
    """The kernel `sparse_attn` runs when `path` is None: "heads" (`_sparse_decode_kernel`) with at least
    DECODE_BLOCK_H heads, at every s (decode, verify steps, appends and prefill), else "blocks"
    (`_sparse_attn_kernel`). Chosen by measurement (benchmarks/RESULTS.md): decode since "Sparse decode attention,
    all heads per program"; prefill since the ninth session of 2026-12-06 (`benchmarks/attn_prefill_probe.py`, one
    H100, 4096 tokens, µs per call with the RoPE epilogue, head-block -> all-heads: Flash CSA 3627 -> 2380, HCA
    1230 -> 995, SWA 1053 -> 891; Pro 6958 -> 4512, 2400 -> 1928, 2089 -> 1755: a program of 64 heads gathers a
    query's KV rows once, where the head-block kernel gathered them once per 16 heads, and both dots run with
    M = 64). b and hd are part of the signature for launch choices that follow them; this one does not."""
    return "heads" if h >= DECODE_BLOCK_H else "blocks"


INVARIANT_SPLIT_SIZE = 128
"""k slots per split of the batch-invariant mode (`invariant_sparse_attn`): 4 tiles of 32 (bf16). Flash CSA (k = 128
window + 512 top-k): 5 splits per query at every batch (the default: 20 at batch 1, 4 at batch 32)."""


def invariant_sparse_attn(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, idx: torch.Tensor,
                          softmax_scale: float) -> torch.Tensor:
    """`sparse_attn` in the batch-invariant mode (the triton backend's `sparse_attn` entry when built with
    batch_invariant=True): the kernel fixed by the head count alone ("heads" when h >= DECODE_BLOCK_H, else
    "blocks", for every s, as the default does since the ninth session of 2026-12-06), all output columns per
    program (dv = hd: the default splits them by b*s) and splits of INVARIANT_SPLIT_SIZE slots (the default
    derives the split count from b*s, the SM count and k: `decode_min_split_tiles`). Same arguments, result and
    errors as `sparse_attn`."""
    h, hd = q.shape[2], q.shape[3]
    path = "heads" if h >= DECODE_BLOCK_H else "blocks"
    return sparse_attn(q, kv, attn_sink, idx, softmax_scale, path=path, dv=hd if path == "heads" else None,
                       split_size=INVARIANT_SPLIT_SIZE)


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, idx: torch.Tensor,
                softmax_scale: float, *, out: torch.Tensor | None = None, num_splits: int | None = None,
                block_h: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                check_idx: bool = False, path: str | None = None, dv: int | None = None,
                num_stages: int | None = None, prefetch: bool = True, split_size: int | None = None,
                rope: tuple | None = None) -> torch.Tensor:
    """Triton sparse attention with sink; same contract and result as `sparse_attn_ref` (spec §5).

    A program owns one query and `block_h` heads (and `dv` output columns), so the gathered KV tile is loaded
    once for those heads. When b*s*ceil(h/block_h) programs cannot fill the GPU (decode), the k slots are
    split over `num_splits` programs (flash-decoding); the last split program of each (query, head block)
    merges the partials and adds the sink in the same launch. Always ONE launch; the partials live in the
    stream's cached workspace (`kernels.launch.workspace`); no host-device sync unless check_idx=True.

    Two kernels (`path`): "blocks" = `_sparse_attn_kernel`, a program per (query, 16-head block): the default
    for fewer than DECODE_BLOCK_H heads; "heads" = `_sparse_decode_kernel`, a program per (query, 64 heads = all of
    Flash, half of Pro, optionally a slice of the output columns `dv`): each gathered KV row is read once per
    64 heads and both dots run with M = 64 (wgmma on Hopper). Default (path=None): `default_path(b, s, h, hd)`,
    chosen by measurement: decode on the H200 (benchmarks/RESULTS.md, "Sparse decode attention, all heads per
    program"), prefill on an H100 (RESULTS.md, "Ninth session of 2026-12-06").

    Args: as `sparse_attn_ref`; hd must be a power of two >= 16. Keyword-only tuning/plumbing:
        out: optional [b, s, h, hd] q.dtype contiguous tensor to write (tests poison it with NaN).
        num_splits: split count of the k axis (default: heuristic from the SM count; the "heads" path also never
            splits shorter than `decode_min_split_tiles`); >= 1.
        split_size: instead of num_splits, the k slots per split (a positive multiple of block_n): the split
            boundaries then fall at multiples of split_size whatever b, s and k are, the batch-invariant mode's
            rule (README "Batch-invariant mode"; `invariant_sparse_attn`). A query's result is then bitwise
            independent of b, s, its neighbours and of trailing -1 slots: the merge is in split order, an
            all -1 split merges as (m = sink, l = 0, acc = 0), which leaves the sums unchanged, and one split
            merged equals the unsplit kernel's o = acc / (l + 2^(sink - m)).
        block_h: heads per program (default 16 "blocks" / 64 "heads"; a power of two >= 16 for tensor cores);
        block_n: slots per tile (default 32; 16 for fp32 on the "heads" path: shared memory); num_warps
        (default 4 "blocks", 8 "heads", DECODE_DV_WARPS with the default column split); num_stages: Triton
        software-pipeline depth (default: Triton's on "blocks", see below on "heads").
        path: "blocks", "heads" or None (default_path). dv ("heads" only): output columns per program, a
            power of two >= 16 dividing hd (default: DECODE_DV = 128 when b*s*ceil(h/block_h) <=
            DECODE_DV_MAX_PROGRAMS and hd >= 256, else hd: no column split). prefetch ("heads" only): True = the
            kernel loads the indices one tile ahead, so the rows' gather does not wait on an index load in the
            same iteration and Triton's pipeliner keeps num_stages - 1 row tiles in flight (measured: without
            it the pipeliner waits for every gather before computing); False = plain loop. num_stages default
            on the "heads" path: 3 (bf16; 4 measured ~1 % slower), 2 (fp32: q alone takes 128 KB of shared
            memory).
        check_idx: True = verify idx ∈ {-1} ∪ [0, n) on the host and raise ValueError (one device sync: an
            aminmax read back; not allowed inside CUDA-graph capture). Default False (decode hot path, CUDA
            graphs): the kernel guards the range itself without a sync: an out-of-range index is never read
            and turns every output of its query and head block into NaN. Tests run with check_idx=True.
        rope: (pos, inv_freq, rd) or None: the output's last rd columns de-rotated in the same launch
            (`sparse_attn_rope`; pos int64 [s] or [b, s] contiguous, inv_freq [rd/2] fp64, rd even <= dv; the
            default dv never splits the columns below rd).
    Returns: o [b, s, h, hd] in q.dtype (fp32 accumulation; bf16 inputs multiply P in bf16, as official).
    Raises: ValueError on any bad argument (named, with its value: softmax_scale not a finite float > 0 - a bool
    included -, check_idx / prefetch not a bool, a tuning value not None or an int - a bool included -, shapes,
    dtypes, devices, path, dv, block sizes, split, rope, out); RuntimeError without triton.
    """
    where = "kernels.attention.sparse_attn"
    _check_inputs(q, kv, attn_sink, idx, softmax_scale, where)
    for name, v in (("check_idx", check_idx), ("prefetch", prefetch)):
        if not isinstance(v, bool):
            raise ValueError(f"{where}: {name} must be a bool, got {v!r}")
    for name, v in (("num_splits", num_splits), ("split_size", split_size), ("block_h", block_h),
                    ("block_n", block_n), ("num_warps", num_warps), ("num_stages", num_stages), ("dv", dv)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"{where}: {name} must be None or an int, got {v!r}")
    _check_launch_device({"q": q, "kv": kv, "attn_sink": attn_sink, "idx": idx}, where)
    b, s, h, hd = q.shape
    n, k = kv.shape[1], idx.shape[2]
    if hd < 16 or hd & (hd - 1):
        raise ValueError(f"{where}: head dim hd must be a power of two >= 16, got {hd}")
    if check_idx:
        _check_index_range(idx, n, where)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or not out.is_contiguous():
        raise ValueError(f"{where}: out must be contiguous {q.dtype} {tuple(q.shape)} on {q.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if path is None:
        path = default_path(b, s, h, hd)
    if path not in ("blocks", "heads"):
        raise ValueError(f"{where}: path must be 'blocks', 'heads' or None, got {path!r}")
    heads_path = path == "heads"
    block_h = block_h or (DECODE_BLOCK_H if heads_path else 16)
    block_n = block_n or (16 if heads_path and q.dtype == torch.float32 else 32)
    if dv is None:  # measured: few (query, head block) programs -> split the output columns instead of keys only
        rd_rope = rope[2] if isinstance(rope, tuple) and len(rope) == 3 and isinstance(rope[2], int) else 0
        few = heads_path and hd >= 2 * DECODE_DV and b * s * triton.cdiv(h, block_h) <= DECODE_DV_MAX_PROGRAMS \
            and rd_rope <= DECODE_DV  # a rope tail wider than one column slice: no column split
        dv = DECODE_DV if few else hd
        num_warps = num_warps or (DECODE_DV_WARPS if few else None)
    num_warps = num_warps or (8 if heads_path else 4)
    if not heads_path and dv != hd:
        raise ValueError(f"{where}: dv (output column split) needs path='heads', got dv={dv} with path={path!r}")
    if dv < 16 or dv & (dv - 1) or hd % dv:
        raise ValueError(f"{where}: dv must be a power of two >= 16 dividing hd={hd}, got {dv}")
    for name, v, lo in (("block_h", block_h, 16), ("block_n", block_n, 16)):
        if v < lo or v & (v - 1):
            raise ValueError(f"{where}: {name} must be a power of two >= {lo}, got {v}")
    rargs, rconsts = _rope_args(rope, q, dv, where)
    if b * s == 0 or h == 0:
        return out
    n_hblk = triton.cdiv(h, block_h)
    n_dv = hd // dv
    programs = b * s * n_hblk * n_dv
    n_tiles = max(1, triton.cdiv(k, block_n))
    if split_size is not None:
        if num_splits is not None:
            raise ValueError(f"{where}: give num_splits or split_size, not both (got {num_splits}, {split_size})")
        if not isinstance(split_size, int) or split_size < block_n or split_size % block_n:
            raise ValueError(f"{where}: split_size must be a positive multiple of block_n={block_n}, got "
                             f"{split_size!r}")
        num_splits = n_tiles  # replaced below by cdiv(k, chunk)
    if num_splits is None:
        if heads_path:  # one wave: one program per SM (shared memory), never more programs than SMs, and
            # never a split whose partials outweigh the keys it reads (`decode_min_split_tiles`)
            num_splits = max(1, min(n_tiles // decode_min_split_tiles(block_h, dv, hd, block_n, kv.element_size()),
                                    _num_sms(q.device) // programs))
        else:
            num_splits = max(1, min(n_tiles, triton.cdiv(2 * _num_sms(q.device), programs)))
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"{where}: num_splits must be an int >= 1, got {num_splits!r}")
    chunk = split_size or triton.cdiv(n_tiles, num_splits) * block_n
    num_splits = max(1, triton.cdiv(k, chunk))
    split = num_splits > 1
    sem = pacc = pml = out  # unused placeholders when not splitting
    if split:
        n_acc = b * s * num_splits * h * hd  # partials [b*s, splits, h, hd] then (m, l) [b*s, splits, n_dv, h, 2]
        sem, ws = workspace(q.device, b * s * n_hblk * n_dv, n_acc + b * s * num_splits * n_dv * h * 2)
        pacc, pml = ws, ws[n_acc:]
    if num_stages is None and heads_path:  # shared memory: q [64, hd] + num_stages row tiles (+ dv tiles)
        num_stages = 2 if q.dtype == torch.float32 else 3
    extra = {} if num_stages is None else {"num_stages": num_stages}
    if heads_path:
        _sparse_decode_kernel[(b * s, n_hblk * n_dv, num_splits)](
            q, kv, attn_sink, idx, out, pacc, pml, sem, s, h, n, k, chunk, num_splits,
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), idx.stride(0), idx.stride(1),
            out.stride(0), out.stride(1), out.stride(2), float(softmax_scale) * _LOG2E, *rargs,
            HD=hd, DV=dv, BLOCK_H=block_h, BLOCK_N=block_n, SPLIT=split, DOT=dot_mode(q.dtype),
            PREFETCH=bool(prefetch), **rconsts, num_warps=num_warps, **extra)
        return out
    _sparse_attn_kernel[(b * s, n_hblk, num_splits)](
        q, kv, attn_sink, idx, out, pacc, pml, sem, s, h, n, k, chunk, num_splits,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), idx.stride(0), idx.stride(1),
        out.stride(0), out.stride(1), out.stride(2), float(softmax_scale) * _LOG2E, *rargs,
        HD=hd, BLOCK_H=block_h, BLOCK_N=block_n, SPLIT=split, DOT=dot_mode(q.dtype), **rconsts,
        num_warps=num_warps, **extra)
    return out


def _rope_args(rope, q: torch.Tensor, dv: int, where: str) -> tuple[tuple, dict]:
    """(POS, FREQ, RD2) and (ROPE, PER_ROW, BR) of the kernels for `sparse_attn`'s `rope` (checked: ValueError)."""
    if rope is None:
        return (q, q, 0), dict(ROPE=False, PER_ROW=False, BR=16)
    b, s = q.shape[:2]
    if not isinstance(rope, tuple) or len(rope) != 3:
        raise ValueError(f"{where}: rope must be None or (pos, inv_freq, rd), got {type(rope).__name__}")
    pos, inv_freq, rd = rope
    if isinstance(rd, bool) or not isinstance(rd, int) or rd <= 0 or rd % 2 or rd > dv:
        raise ValueError(f"{where}: rope rd={rd!r}, expected an even int in 2..{dv} (the columns of one program)")
    if (not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64 or tuple(pos.shape) not in ((s,), (b, s))
            or not pos.is_contiguous() or pos.device != q.device):
        raise ValueError(f"{where}: rope pos must be contiguous int64 [{s}] or [{b}, {s}] on {q.device}, got "
                         f"{getattr(pos, 'dtype', type(pos))} {tuple(getattr(pos, 'shape', ()))}"
                         + ("" if not isinstance(pos, torch.Tensor) else
                            f" strides {pos.stride()} on {pos.device}"))
    if (not isinstance(inv_freq, torch.Tensor) or inv_freq.dtype != torch.float64
            or tuple(inv_freq.shape) != (rd // 2,) or inv_freq.device != q.device):
        raise ValueError(f"{where}: rope inv_freq must be float64 [{rd // 2}] on {q.device}, got "
                         f"{getattr(inv_freq, 'dtype', type(inv_freq))} {tuple(getattr(inv_freq, 'shape', ()))}")
    return (pos, inv_freq, rd // 2), dict(ROPE=True, PER_ROW=pos.dim() == 2,
                                          BR=max(16, triton.next_power_of_2(rd // 2)))


def sparse_attn_rope(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, idx: torch.Tensor,
                     softmax_scale: float, pos: torch.Tensor, inv_freq: torch.Tensor, rd: int) -> torch.Tensor:
    """The triton backend's `sparse_attn_rope` entry: `sparse_attn(..., rope=(pos, inv_freq, rd))`, ONE launch
    (issue 27: the de-rotation's launch folded into the attention's epilogue), bitwise `sparse_attn` followed by
    `kernels.rope.rope_tail_(inverse=True)`. q [b, s, h, hd], kv, attn_sink, idx, softmax_scale as `sparse_attn`;
    pos int64 [s] or [b, s] (the queries' positions; made contiguous), inv_freq [rd/2] fp64, rd even <= hd.
    Returns o [b, s, h, hd] in q.dtype. Raises ValueError as `sparse_attn` (pos not a tensor included)."""
    if not isinstance(pos, torch.Tensor):
        raise ValueError(f"kernels.attention.sparse_attn_rope: pos must be an int64 tensor, got {type(pos).__name__}")
    return sparse_attn(q, kv, attn_sink, idx, softmax_scale, rope=(pos.contiguous(), inv_freq, rd))


# ------------------------------------------------------------------------------ the decode step's index set
def window_slots(P: torch.Tensor, p0: int | torch.Tensor, W: int) -> torch.Tensor:
    """The sliding window of queries at positions P [..., s] int64 of a call that starts at p0 (an int, or per row
    [..., 1, 1]), as slots of the keys [ring before the call (W slots, position u at u % W) | the call's KV]:
    query t sees u = t-W+1..t (spec §5.5) -> [..., s, W] int64: -1 where u < 0, ring slot u % W where u < p0,
    W + u - p0 (the call's own KV) otherwise. `dsv4.model.Attention.extend` and `step_index_ref`."""
    u = P[..., None] - (W - 1) + torch.arange(W, device=P.device)
    return torch.where(u < 0, -1, torch.where(u < p0, u % W, W + u - p0))


def _check_step_index(P, W, comp, ratio, n_entries) -> None:
    where = "step_index"
    if not isinstance(P, torch.Tensor) or P.dim() != 2 or P.dtype != torch.int64 or P.shape[1] < 1:
        raise ValueError(f"{where}: P must be int64 [b, s >= 1], got {getattr(P, 'dtype', type(P))} "
                         f"{tuple(getattr(P, 'shape', ()))}")
    for name, v in (("W", W), ("ratio", ratio), ("n_entries", n_entries)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "W" else 0):
            raise ValueError(f"{where}: {name}={v!r}, expected an int >= {1 if name == 'W' else 0}")
    if comp is not None:
        if (not isinstance(comp, torch.Tensor) or comp.dtype != torch.int64 or comp.dim() != 3
                or tuple(comp.shape[:2]) != tuple(P.shape) or comp.device != P.device):
            raise ValueError(f"{where}: comp must be int64 [b, s, k] = [{P.shape[0]}, {P.shape[1]}, k] on {P.device}, "
                             f"got {getattr(comp, 'dtype', type(comp))} {tuple(getattr(comp, 'shape', ()))}")
        if ratio or n_entries:
            raise ValueError(f"{where}: give the indexer's picks (comp) or an HCA ratio / n_entries, not both "
                             f"(ratio={ratio}, n_entries={n_entries})")
    elif n_entries and not ratio:
        raise ValueError(f"{where}: n_entries={n_entries} with ratio=0: an HCA layer's entries need its ratio > 0")


def step_index_ref(P: torch.Tensor, W: int, comp: torch.Tensor | None = None, ratio: int = 0,
                   n_entries: int = 0) -> torch.Tensor:
    """The key slots each query of a decode step reads (spec §5.5, §6, §7; `dsv4.model.Attention.step`).

    P [b, s] int64: each query's position (row i's s tokens at P[i, 0] .. P[i, 0] + s - 1). The keys the attention
    reads: s == 1, [ring (position u at slot u % W, this token already written) | entry slots]; s > 1, [ring
    before the call | the call's s KV rows | entry slots] (the call's tokens would overwrite ring slots its earlier
    queries still see). Columns: the W window slots of positions t-W+1..t in position order (`window_slots`),
    then the entries: comp [b, s, k] int64, the indexer's picks (CSA; -1 = none), or with ratio r > 0 and
    n_entries >= 0 slots (HCA) every entry w < (t + 1) // r, -1 after; entry w at key row off + w, off = W (s == 1)
    or W + s. A window-only layer: comp None, ratio = n_entries = 0.
    Returns: idx [b, s, W + k] int64 (-1 = empty slot), for `sparse_attn`.
    Raises: ValueError naming a bad argument (`_check_step_index`)."""
    _check_step_index(P, W, comp, ratio, n_entries)
    b, s = P.shape
    inplace = s == 1
    idx = window_slots(P, P.view(b, s, 1) + 1 if inplace else P[:, :1, None], W)
    off = W if inplace else W + s
    if comp is None and ratio:
        w = torch.arange(n_entries, device=P.device)
        comp = torch.where(w < ((P + 1) // ratio)[..., None], w, -1)
    if comp is None:
        return idx
    return torch.cat((idx, torch.where(comp >= 0, comp + off, -1)), -1)


def step_index(P: torch.Tensor, W: int, comp: torch.Tensor | None = None, ratio: int = 0,
               n_entries: int = 0) -> torch.Tensor:
    """`step_index_ref` in one launch (issue 27: the decode step's index set was ~8-13 torch launches per layer):
    one program per query, the same integers (bitwise equal, tests/unit/test_attention_kernels.py). No host sync.
    Args, returns, raises: as `step_index_ref`; P and comp on CUDA (or CPU under TRITON_INTERPRET=1)."""
    idx, args, consts = step_index_args(P, W, comp, ratio, n_entries)
    _step_index_kernel[(idx.shape[0] * idx.shape[1],)](*args, **consts)
    return idx


def step_index_args(P: torch.Tensor, W: int, comp: torch.Tensor | None = None, ratio: int = 0,
                    n_entries: int = 0, reserve: int = 0) -> tuple[torch.Tensor, tuple, dict]:
    """`step_index`'s checks (ValueError), its output idx [b, s, W + k] int64 (uninitialised) and the runtime
    arguments / constexprs of `_step_index_row` (b*s rows) - also `kernels.rope.qkv_finish`'s index part.
    reserve k > 0 (comp None, no ratio): idx gets k entry columns that the row code leaves unwritten, for the
    CSA top-k to fill in place (`kernels.indexer.indexer_topk(out=idx[..., W:], offset=...)`; `step_index_offset`)."""
    _check_step_index(P, W, comp, ratio, n_entries)
    if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0 or (reserve and (
            comp is not None or ratio or n_entries)):
        raise ValueError(f"step_index: reserve={reserve!r}, expected an int >= 0 (> 0 only without comp, ratio and "
                         f"n_entries: the top-k's columns)")
    tensors = {"P": P} if comp is None else {"P": P, "comp": comp}
    _check_launch_device(tensors, "step_index")
    b, s = P.shape
    K = comp.shape[2] if comp is not None else (reserve or n_entries)
    idx = torch.empty(b, s, W + K, dtype=torch.int64, device=P.device)
    P = P.contiguous()
    comp_c = comp.contiguous() if comp is not None else P
    args = (P, comp_c, idx, s, W, K, K if comp is not None else 0, max(ratio, 1), step_index_offset(W, s))
    consts = dict(INPLACE=s == 1, MODE=1 if comp is not None else (2 if reserve else 0),
                  BLOCK=triton.next_power_of_2(W + K))
    return idx, args, consts


def step_index_offset(W: int, s: int) -> int:
    """The key row of entry 0 in a decode step of s tokens per row (`step_index_ref`): W (s = 1: [ring | entries])
    or W + s ([ring | the call's KV | entries])."""
    return W if s == 1 else W + s
