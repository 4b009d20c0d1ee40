"""The KV compressor's decode step as two launches (spec §6), for the CUDA-graph decode (`dsv4/graph.py`).

Spec: `dsv4_reference_spec.md` §6 (KV compressor). At each decode position p (window r, c = 2 for the
overlapping CSA compressor, else 1; state kv / score fp32 [b, c*r, c*d]):
  1. the token's row a = wkv(x), z = wgate(x) + ape[p % r] goes to slot (r if c == 2 else 0) + p % r;
  2. the pooled entry of the window: `softmax over slots(Z) * A` summed over the slots, where A / Z are the
     slots' kv / score rows (CSA: slots 0..r-1 give their first d columns, slots r..2r-1 their last d);
  3. the entry (after `Compressor._finish`: norm, RoPE, quantization simulation) is stored at entry p // r only
     where (p + 1) % r == 0, and then the CSA window shifts (slots r..2r-1 -> 0..r-1) and the current window's
     scores reset to -inf.
The position is one device value for the batch (pos [1]) or one per row (pos [b]: a ragged batch whose rows sit at
different positions, issue 24; every row then pools, commits and resets at its own window boundary).
The references `compress_pool_ref` (1-2) and `compress_commit_ref` (3) are the decode step's torch code
(`dsv4.model.Compressor.step` on the reference backend), branch-free on a device position (`torch.where`); the
decode step equals the prefill's whole-window pooling (tests/unit/test_graph_decode.py). `compress_pool` / `compress_commit` do the same in one launch each: in torch it is ~20
launches per compressor per step, among them torch's softmax over the middle (slot) axis, which runs its
"spatial" kernel (39 µs for [1, 128, 512] on an H200, benchmarks/RESULTS.md).

Numerics: the slot write and the ape add are the same fp32 operations (bitwise); the pooling subtracts the max and
divides the weighted sum once by the sum of exponentials (torch divides each weight first), so pooled values
agree within a few fp32 ulps (tests: rtol 1e-6); a window whose scores are all -inf gives NaN in both (0 / 0).

Dimension legend: b batch, r ratio, c series (2 for CSA), d entry width, W = c*d state width, n = c*r slots.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the references stay importable without it; launching raises
    triton = None
    tl = None

from kernels.launch import check_layout
from kernels.launch import fail as _fail


def softmax_pool_ref(Z: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """The model's pooling: Z, A fp32 [b, n, d] -> [b, 1, d] fp32 = (Z.softmax(1) * A).sum(1, keepdim=True).
    Raises ValueError (`kernels.launch.fail`) naming Z or A when either is not a 3-D float32 tensor or their
    shapes differ (torch would broadcast a [b, n, 1] A over d, or pool in another dtype)."""
    for name, t in (("Z", Z), ("A", A)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.dtype != torch.float32:
            _fail("softmax_pool_ref", name, f"{getattr(t, 'dtype', type(t))} shape {tuple(getattr(t, 'shape', ()))}",
                  "a float32 tensor [b, n, d]")
    if A.shape != Z.shape:
        _fail("softmax_pool_ref", "A", f"shape {tuple(A.shape)}", f"Z's shape {tuple(Z.shape)} (no broadcasting)")
    return (Z.softmax(1) * A).sum(1, keepdim=True)


def _check(op: str, a, z, ape, pos, kv, score, ratio: int, overlap: bool) -> tuple[int, int, int]:
    """(b, d, W) after checking every argument; ValueError naming the first wrong one."""
    if not isinstance(ratio, int) or isinstance(ratio, bool) or not 1 <= ratio <= 1024:
        _fail(op, "ratio", repr(ratio), "an int in 1..1024")
    if not isinstance(overlap, bool):
        _fail(op, "overlap", repr(overlap), "a bool (True for the CSA compressor, r = 4)")
    for name, t in (("kv", kv), ("score", score)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.dtype != torch.float32:
            _fail(op, name, f"{getattr(t, 'dtype', type(t))} shape {tuple(getattr(t, 'shape', ()))}",
                  "float32 [b, c*r, c*d]")
    c = 2 if overlap else 1
    b, n, W = kv.shape
    if n != c * ratio or W % c or tuple(score.shape) != (b, n, W):
        _fail(op, "kv/score", f"shapes {tuple(kv.shape)} / {tuple(score.shape)}",
              f"[b, {c * ratio}, c*d] (ratio {ratio}, overlap {overlap}), equal")
    for name, t in (("a", a), ("z", z)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (b, W)
                              or t.dtype != torch.float32):
            _fail(op, name, f"{getattr(t, 'dtype', type(t))} shape {tuple(getattr(t, 'shape', ()))}",
                  f"float32 [{b}, {W}]")
    if ape is not None and (not isinstance(ape, torch.Tensor) or tuple(ape.shape) != (ratio, W)
                            or ape.dtype != torch.float32):
        _fail(op, "ape", f"{getattr(ape, 'dtype', type(ape))} shape {tuple(getattr(ape, 'shape', ()))}",
              f"float32 [{ratio}, {W}]")
    if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64 or tuple(pos.shape) not in ((1,), (b,)):
        _fail(op, "pos", f"{getattr(pos, 'dtype', type(pos))} shape {tuple(getattr(pos, 'shape', ()))}",
              f"int64 [1] or [{b}] (the decode position of the batch or of each row, on the device)")
    return b, W // c, W


# ---------------------------------------------------------------------------------------------------------
# References (plain torch: the graph step's code)
# ---------------------------------------------------------------------------------------------------------

def compress_pool_ref(a: torch.Tensor, z: torch.Tensor, ape: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor,
                      score: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """Steps 1-2 of the module docstring: writes the token's row into kv / score (in place) and returns the
    window's pooled entry [b, 1, d] fp32. a, z [b, W] fp32 (wkv(x), wgate(x) without ape); ape [r, W] fp32;
    pos int64 [1] (every row) or [b] (each row's own); kv, score fp32 [b, c*r, W]. Raises ValueError naming a
    wrong argument."""
    b, d, _ = _check("compress_pool_ref", a, z, ape, pos, kv, score, ratio, overlap)
    r = ratio
    p = pos.expand(b)
    rows = torch.arange(b, device=kv.device)
    slot = (r if overlap else 0) + p % r  # [b]
    kv[rows, slot] = a
    score[rows, slot] = z + ape.index_select(0, p % r)
    if overlap:
        A = torch.cat((kv[:, :r, :d], kv[:, r:, d:]), 1)
        Z = torch.cat((score[:, :r, :d], score[:, r:, d:]), 1)
    else:
        A, Z = kv, score
    return softmax_pool_ref(Z, A)


def compress_commit_ref(new: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor, score: torch.Tensor,
                        out: torch.Tensor, ratio: int, overlap: bool) -> None:
    """Step 3, per row (pos [1]: every row at that position; pos [b]: each row's own): where (pos + 1) % r == 0,
    out[row, pos // r] = new[row] (new [b, 1, d], out's dtype), the row's CSA window shifts and its current scores
    reset to -inf; elsewhere nothing changes. out [b, n_out >= 1, d] float (may be a strided view); every position
    must lie in 0 <= pos and pos // r < n_out (checked on the host: one read back of pos, a device sync on CUDA;
    the launcher `compress_commit` reads no device value and so checks neither bound).
    Raises: ValueError naming the wrong argument: `_check`'s (ratio, overlap, kv / score, pos dtype and shape),
    out not a float [b, n_out >= 1, d] tensor, new not [b, 1, d] in out's dtype, a negative position (negative
    indexing would overwrite the last entry) or one past out's last entry (it used to be clamped into it)."""
    op = "compress_commit_ref"
    b, d, _ = _check(op, None, None, None, pos, kv, score, ratio, overlap)
    if not isinstance(out, torch.Tensor) or out.dim() != 3 or not out.dtype.is_floating_point \
            or out.shape[0] != b or out.shape[2] != d or out.shape[1] < 1:
        _fail(op, "out", f"{getattr(out, 'dtype', type(out))} shape {tuple(getattr(out, 'shape', ()))}",
              f"a float tensor [{b}, n_out >= 1, {d}]")
    if not isinstance(new, torch.Tensor) or tuple(new.shape) != (b, 1, d) or new.dtype != out.dtype:
        _fail(op, "new", f"{getattr(new, 'dtype', type(new))} shape {tuple(getattr(new, 'shape', ()))}",
              f"{out.dtype} [{b}, 1, {d}] (out's dtype)")
    r = ratio
    lo, hi = (int(v) for v in torch.aminmax(pos))  # the reference's host check (one read back)
    if lo < 0 or hi // r >= out.shape[1]:
        _fail(op, "pos", f"min {lo} max {hi} (shape {tuple(pos.shape)})",
              f"positions in 0..{out.shape[1] * r - 1} (entry pos // {r} < n_out = {out.shape[1]})")
    p = pos.expand(b)
    done = ((p + 1) % r == 0).view(b, 1, 1)
    rows = torch.arange(b, device=kv.device)
    w = p // r
    out[rows, w] = torch.where(done[:, 0], new[:, 0], out[rows, w])
    if overlap:
        kv[:, :r] = torch.where(done, kv[:, r:], kv[:, :r])
        score[:, :r] = torch.where(done, score[:, r:], score[:, :r])
    off = r if overlap else 0
    score[:, off:] = torch.where(done, torch.full_like(score[:, off:], -math.inf), score[:, off:])


# ---------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------

if triton is not None:  # the kernels exist only where triton is installed (it is optional)
    @triton.jit
    def _compress_pool_kernel(a_ptr, z_ptr, ape_ptr, pos_ptr, kv_ptr, sc_ptr, out_ptr, d, W, R, SA,
                              OVERLAP: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PER_ROW: tl.constexpr):
        """Grid (b, cdiv(d, BD)); the position pos[0], or pos[b] (PER_ROW). Reads the window's slots for pooled columns j (CSA: rows < R at column j, rows >= R
        at column d + j), with the token's new row substituted in registers (no read-after-write), pools, stores
        pooled [b, 1, d], then writes the token's row (columns j, and d + j for CSA) into the state. a and z are
        rows at the stride SA (W when contiguous; 2W for the halves of the joint wkv | wgate projection)."""
        b = tl.program_id(0).to(tl.int64)
        offs_j = tl.program_id(1) * BD + tl.arange(0, BD)
        mj = offs_j < d
        if PER_ROW:
            pos = tl.load(pos_ptr + b)
        else:
            pos = tl.load(pos_ptr)
        ok = pos >= 0  # a negative position (never made by the graph step) writes nothing and pools NaN: loud
        p = tl.where(ok, pos, 0) % R
        if OVERLAP:
            n = 2 * R
            slot = R + p
            newcol = offs_j + d
        else:
            n = R
            slot = p
            newcol = offs_j
        rows = tl.arange(0, BN)
        mask = (rows < n)[:, None] & mj[None, :]
        if OVERLAP:
            col = tl.where(rows[:, None] < R, offs_j[None, :], offs_j[None, :] + d)
        else:
            col = offs_j[None, :] + rows[:, None] * 0
        base = b * n * W
        A = tl.load(kv_ptr + base + rows[:, None] * W + col, mask=mask, other=0.0)
        Z = tl.load(sc_ptr + base + rows[:, None] * W + col, mask=mask, other=float("-inf"))
        an = tl.load(a_ptr + b * SA + newcol, mask=mj, other=0.0)
        zn = tl.load(z_ptr + b * SA + newcol, mask=mj, other=0.0) + tl.load(ape_ptr + p * W + newcol, mask=mj,
                                                                           other=0.0)
        is_slot = (rows == slot)[:, None]
        A = tl.where(is_slot, an[None, :], A)
        Z = tl.where(is_slot, zn[None, :], Z)
        m = tl.max(Z, axis=0)
        e = tl.where(mask, tl.exp(Z - m[None, :]), 0.0)
        pooled = tl.sum(e * A, axis=0) / tl.sum(e, axis=0)
        tl.store(out_ptr + b * d + offs_j, tl.where(ok, pooled, float("nan")), mask=mj)
        srow = base + slot * W
        mw = mj & ((offs_j * 0 + pos) >= 0)
        tl.store(kv_ptr + srow + newcol, an, mask=mw)
        tl.store(sc_ptr + srow + newcol, zn, mask=mw)
        if OVERLAP:  # the first half of the slot's row (pooled only once the window has shifted)
            a0 = tl.load(a_ptr + b * SA + offs_j, mask=mj, other=0.0)
            z0 = tl.load(z_ptr + b * SA + offs_j, mask=mj, other=0.0) + tl.load(ape_ptr + p * W + offs_j, mask=mj,
                                                                               other=0.0)
            tl.store(kv_ptr + srow + offs_j, a0, mask=mw)
            tl.store(sc_ptr + srow + offs_j, z0, mask=mw)


    @triton.jit(do_not_specialize=["n_out"])  # issue 29: n_out = max_len // r varies per graph state
    def _compress_commit_kernel(new_ptr, pos_ptr, kv_ptr, sc_ptr, out_ptr, d, W, R, n_out, so_b, so_n,
                                OVERLAP: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, PER_ROW: tl.constexpr):
        """Grid (b, cdiv(W, BD)); does nothing unless (pos + 1) % R == 0 (a uniform branch on a device value); the
        position pos[0], or pos[b] (PER_ROW: each row commits at its own boundary)."""
        b = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BD + tl.arange(0, BD)
        if PER_ROW:
            pos = tl.load(pos_ptr + b)
        else:
            pos = tl.load(pos_ptr)
        if (pos >= 0) & ((pos + 1) % R == 0):
            w = tl.minimum(pos // R, n_out - 1)
            md = offs < d
            v = tl.load(new_ptr + b * d + offs, mask=md)
            tl.store(out_ptr + b * so_b + w * so_n + offs, v, mask=md)
            rows = tl.arange(0, BR)
            mask = (rows < R)[:, None] & (offs < W)[None, :]
            if OVERLAP:
                n = 2 * R
            else:
                n = R
            base = b * n * W + rows[:, None] * W + offs[None, :]
            if OVERLAP:
                cur_kv = tl.load(kv_ptr + base + R * W, mask=mask)
                cur_sc = tl.load(sc_ptr + base + R * W, mask=mask)
                tl.store(kv_ptr + base, cur_kv, mask=mask)
                tl.store(sc_ptr + base, cur_sc, mask=mask)
                tl.debug_barrier()
                tl.store(sc_ptr + base + R * W, tl.full((BR, BD), float("-inf"), tl.float32), mask=mask)
            else:
                tl.store(sc_ptr + base, tl.full((BR, BD), float("-inf"), tl.float32), mask=mask)


    # ---------------------------------------------------------------------------------------------------------
    # Launchers
    # ---------------------------------------------------------------------------------------------------------

def compress_pool(a: torch.Tensor, z: torch.Tensor, ape: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor,
                  score: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """`compress_pool_ref` in one launch (same arguments, same state writes; pooled within a few fp32 ulps).

    Args: a, z fp32 [b, W] (contiguous rows at one common row stride: the halves of the joint wkv | wgate
    projection are read in place, `dsv4.model.Compressor.join_wkv_wgate`); ape fp32 [r, W]; pos int64 [1] or [b]
    (per row) >= 0 (device values: a negative one is not read back,
    it makes pooled NaN and writes nothing); kv, score fp32 [b, c*r, W] (c = 2 iff overlap); ratio r; overlap
    bool. The other tensors contiguous, all on one CUDA device (CPU under TRITON_INTERPRET=1); no host sync.
    Returns: pooled [b, 1, W / c] fp32. Raises: ValueError naming the wrong argument."""
    op = "compress_pool"
    for name, t in (("a", a), ("z", z), ("ape", ape)):
        if not isinstance(t, torch.Tensor):
            _fail(op, name, type(t).__name__, "a float32 tensor")
    b, d, W = _check(op, a, z, ape, pos, kv, score, ratio, overlap)
    check_layout(op, {"ape": ape, "pos": pos, "kv": kv, "score": score})
    sa = a.stride(0) if b > 1 else W
    for name, t in (("a", a), ("z", z)):
        if t.device != kv.device or (W > 1 and t.stride(1) != 1) or (b > 1 and t.stride(0) != sa):
            _fail(op, name, f"strides {t.stride()} on {t.device}", f"rows of {W} contiguous values at one common "
                  f"row stride (a's {sa}), on {kv.device}")
    out = torch.empty(b, 1, d, dtype=torch.float32, device=kv.device)
    BN = max(2, triton.next_power_of_2(kv.shape[1]))
    BD = max(16, min(triton.next_power_of_2(d), 8192 // BN))
    _compress_pool_kernel[(b, triton.cdiv(d, BD))](a, z, ape, pos, kv, score, out, d, W, ratio, sa,
                                                  OVERLAP=overlap, BN=BN, BD=BD, PER_ROW=pos.shape[0] != 1,
                                                  num_warps=4)
    return out


def compress_commit(new: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor, score: torch.Tensor, out: torch.Tensor,
                    ratio: int, overlap: bool) -> None:
    """`compress_commit_ref` in one launch: new [b, 1, d] contiguous in out's dtype; pos int64 [1] or [b] (per
    row); kv, score as `compress_pool`; out [b, n_out >= 1, d] with a contiguous last dim (a view into the static
    key buffer). Returns None (writes in place).
    Positions are device values and are NOT checked here: the decode step calls this launcher at every step,
    eagerly and inside CUDA-graph capture, and a host check would read pos back (a device sync per compressor per
    step; illegal while capturing). `compress_commit_ref` refuses both cases below; here (the kernel, unchanged):
    a negative position commits nothing (the state is left as it is); a position with pos // r >= n_out is
    clamped into out's last entry (it overwrites that entry). The model never makes either (positions are
    < max_len, out holds max_len // r entries).
    Raises: ValueError naming the wrong argument (ratio, overlap, kv / score, pos dtype / shape, out, new, layout,
    device)."""
    op = "compress_commit"
    b, d, W = _check(op, None, None, None, pos, kv, score, ratio, overlap)
    if not isinstance(out, torch.Tensor) or out.dim() != 3 or out.shape[0] != b or out.shape[2] != d \
            or out.shape[1] < 1 or out.stride(2) != 1:
        _fail(op, "out", f"shape {tuple(getattr(out, 'shape', ()))}",
              f"[{b}, n_out >= 1, {d}] with a contiguous last dim")
    if not isinstance(new, torch.Tensor) or tuple(new.shape) != (b, 1, d) or new.dtype != out.dtype:
        _fail(op, "new", f"{getattr(new, 'dtype', type(new))} shape {tuple(getattr(new, 'shape', ()))}",
              f"{out.dtype} [{b}, 1, {d}]")
    check_layout(op, {"new": new, "pos": pos, "kv": kv, "score": score})
    BR = max(2, triton.next_power_of_2(ratio))
    BD = max(16, min(triton.next_power_of_2(W), 8192 // BR))
    _compress_commit_kernel[(b, triton.cdiv(W, BD))](new, pos, kv, score, out, d, W, ratio, out.shape[1],
                                                    out.stride(0), out.stride(1), OVERLAP=overlap, BR=BR, BD=BD,
                                                    PER_ROW=pos.shape[0] != 1, num_warps=4)
