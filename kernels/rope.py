"""RoPE of the last `rd` columns of a tensor, in place, in one launch (spec §5, pitfall 4: interleaved pairs).

`kernels.numerics.apply_rope` (the model's `apply_rope`) is the executable spec: angle = pos (fp64) * inv_freq (fp64), cos / sin in fp64 rounded
to fp32, pairs (2i, 2i+1) rotated in fp32, stored in x.dtype; the model applies it to the rope tail of q, kv and
the indexer's q (`torch.cat((x[..., :-rd], apply_rope(x[..., -rd:], ...)), -1)`) and with `inverse=True` to the
attention output. On a GPU that is ~14 small launches per call plus the cat; the graph decode step
(`dsv4/graph.py`, triton backend) calls it 3-4 times per layer. `rope_tail_` does the same maths in one launch and
writes the rotated tail back into x (the nope part untouched), so the cat disappears too.

Numerics: the same fp64 angle and fp64 cos / sin rounded to fp32; the rotation `x0*c - x1*s` may be contracted
to an FMA by the compiler (one fp32 rounding fewer), so fp32 results agree within 1-2 ulps and bf16 results are
bitwise equal in almost every element (tests/unit/test_rope_kernel.py).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the references stay importable without it; launching raises
    triton = None
    tl = None

from kernels import numerics
from kernels.attention import sparse_attn_ref, step_index_args
from kernels.norm import check_head_rms_rope, head_rms_rope_args, head_rms_rope_consts, rms_norm_ref, row_view
from kernels.launch import check_layout
from kernels.launch import fail as _fail


def check_rope_tail(op: str, x, pos, inv_freq, rd, inverse, torch_float: bool = False) -> None:
    """The argument checks of `rope_tail_` (x bf16 / fp32) and `rope_tail_ref` (torch_float: x any float dtype).
    Raises ValueError (`kernels.launch.fail`) naming the first wrong argument."""
    if not isinstance(inverse, bool):
        _fail(op, "inverse", repr(inverse), "a bool")
    if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4) or (
            not x.dtype.is_floating_point if torch_float else x.dtype not in (torch.bfloat16, torch.float32)):
        _fail(op, "x", f"{getattr(x, 'dtype', type(x))} shape {tuple(getattr(x, 'shape', ()))}",
              f"{'a float' if torch_float else 'bf16 / float32'} tensor [b, s, D] or [b, s, h, D]")
    D, S = x.shape[-1], x.shape[1]
    if isinstance(rd, bool) or not isinstance(rd, int) or rd <= 0 or rd % 2 or rd > D:
        _fail(op, "rd", repr(rd), f"an even int in 2..{D}")
    if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64 or \
            tuple(pos.shape) not in ((S,), (x.shape[0], S)):
        _fail(op, "pos", f"{getattr(pos, 'dtype', type(pos))} shape {tuple(getattr(pos, 'shape', ()))}",
              f"int64 [{S}] or [{x.shape[0]}, {S}]")
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dtype != torch.float64 or \
            tuple(inv_freq.shape) != (rd // 2,):
        _fail(op, "inv_freq", f"{getattr(inv_freq, 'dtype', type(inv_freq))} shape "
              f"{tuple(getattr(inv_freq, 'shape', ()))}", f"float64 [{rd // 2}]")


def rope_tail_ref(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, rd: int,
                  inverse: bool = False) -> torch.Tensor:
    """The model's maths (the `rope_tail` entry of the reference backend): `torch.cat((x[..., :-rd],
    apply_rope(x[..., -rd:], pos, inv_freq, inverse)), -1)`, a new tensor (x untouched). Shapes as `rope_tail_`
    (x any float dtype, any layout; every tensor on x's device). Raises ValueError naming the wrong argument."""
    check_rope_tail("rope_tail_ref", x, pos, inv_freq, rd, inverse, torch_float=True)
    if x.device != pos.device or x.device != inv_freq.device:
        _fail("rope_tail_ref", "pos / inv_freq", f"on {pos.device} / {inv_freq.device}", f"on x's device {x.device}")
    return torch.cat((x[..., :-rd], numerics.apply_rope(x[..., -rd:], pos, inv_freq, inverse=inverse)), -1)


if triton is not None:  # the kernels exist only where triton is installed (it is optional)
    from kernels.gemm import cast_for_store

    @triton.jit(do_not_specialize=["S"])  # issue 29: S is the token count of a call (prefill length)
    def _rope_tail_kernel(x_ptr, pos_ptr, f_ptr, D, S, H, RD2, SIGN, BR: tl.constexpr, PER_ROW: tl.constexpr):
        """One program per row of x viewed [rows, D] (row = ((b*S + t)*H + h)); rotates columns D-2*RD2 .. D-1.
        The position of token t of batch row b: pos[t] (pos [S]) or pos[b, t] (PER_ROW: pos [B, S])."""
        row = tl.program_id(0).to(tl.int64)
        t = (row // H) % S
        if PER_ROW:
            t = row // H  # b*S + t: the element of pos [B, S]
        offs = tl.arange(0, BR)
        mask = offs < RD2
        ang = tl.load(pos_ptr + t).to(tl.float64) * tl.load(f_ptr + offs, mask=mask, other=0.0)
        c = tl.cos(ang).to(tl.float32)
        s = tl.sin(ang).to(tl.float32) * SIGN
        base = x_ptr + row * D + (D - 2 * RD2)
        x0 = tl.load(base + 2 * offs, mask=mask, other=0.0).to(tl.float32)
        x1 = tl.load(base + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
        tl.store(base + 2 * offs, cast_for_store(x0 * c - x1 * s, x_ptr), mask=mask)
        tl.store(base + 2 * offs + 1, cast_for_store(x0 * s + x1 * c, x_ptr), mask=mask)


    from kernels.jit_formats import act_apply, act_scale, round_bf16
    from kernels.attention import _step_index_row
    from kernels.norm import _head_rms_row

    @triton.jit(do_not_specialize=["S"])
    def _kv_finish_kernel(x_ptr, w_ptr, pos_ptr, f_ptr, y_ptr, ring_ptr, D, S, eps, window, RD2, NB, block,
                          ring_sb, W, sx,
                          BD: tl.constexpr, BRD: tl.constexpr, NBP: tl.constexpr, BB: tl.constexpr,
                          ROUND_IN: tl.constexpr, OUT_BF16: tl.constexpr, PER_ROW: tl.constexpr,
                          QUANT: tl.constexpr, RING: tl.constexpr = False):
        """One row of x [rows, D] per program (`_kv_finish_row`)."""
        _kv_finish_row(tl.program_id(0).to(tl.int64), x_ptr, w_ptr, pos_ptr, f_ptr, y_ptr, ring_ptr, D, S, eps,
                       window, RD2, NB, block, ring_sb, W, sx, BD, BRD, NBP, BB, ROUND_IN, OUT_BF16, PER_ROW, QUANT,
                       RING)

    @triton.jit(do_not_specialize=["S", "QS", "RQ", "RKV", "IS", "IK", "IKC", "ioff"])
    def _qkv_finish_kernel(q_ptr, qy_ptr, qd, q_eps, qpos_ptr, qf_ptr, QS, QH, QRD2,
                           x_ptr, w_ptr, pos_ptr, f_ptr, y_ptr, ring_ptr, D, S, eps, window, RD2, NB, block,
                           ring_sb, W, sx,
                           ip_ptr, icomp_ptr, idx_ptr, IS, IW, IK, IKC, iratio, ioff, RQ, RKV,
                           QBD: tl.constexpr, QBF16: tl.constexpr, QPER_ROW: tl.constexpr, QBR: tl.constexpr,
                           BD: tl.constexpr, BRD: tl.constexpr, NBP: tl.constexpr, BB: tl.constexpr,
                           ROUND_IN: tl.constexpr, OUT_BF16: tl.constexpr, PER_ROW: tl.constexpr,
                           QUANT: tl.constexpr, RING: tl.constexpr, INDEX: tl.constexpr, IINPLACE: tl.constexpr,
                           IMODE: tl.constexpr, IBLOCK: tl.constexpr):
        """The attention's q and KV finish in ONE launch (`qkv_finish`): programs 0 .. RQ-1 are
        `kernels.norm._head_rms_row` of the q rows (head RMS + RoPE), RQ .. RKV-1 `_kv_finish_row` of the KV rows,
        and (INDEX) the rest `kernels.attention._step_index_row` of the step's queries - each kernel's own code, so
        each output is bitwise what its own kernel stores."""
        pid = tl.program_id(0).to(tl.int64)
        if pid < RQ:
            _head_rms_row(pid, q_ptr, qy_ptr, qd, q_eps, qpos_ptr, qf_ptr, QS, QH, QRD2, QBD, QBF16, True, QPER_ROW,
                          QBR)
        elif pid < RKV:
            _kv_finish_row(pid - RQ, x_ptr, w_ptr, pos_ptr, f_ptr, y_ptr, ring_ptr, D, S, eps, window, RD2, NB,
                           block, ring_sb, W, sx, BD, BRD, NBP, BB, ROUND_IN, OUT_BF16, PER_ROW, QUANT, RING)
        else:
            if INDEX:
                _step_index_row(pid - RKV, ip_ptr, icomp_ptr, idx_ptr, IS, IW, IK, IKC, iratio, ioff, IINPLACE,
                                IMODE, IBLOCK)

    @triton.jit
    def _kv_finish_row(row, x_ptr, w_ptr, pos_ptr, f_ptr, y_ptr, ring_ptr, D, S, eps, window, RD2, NB, block,
                       ring_sb, W, sx,
                       BD: tl.constexpr, BRD: tl.constexpr, NBP: tl.constexpr, BB: tl.constexpr,
                       ROUND_IN: tl.constexpr, OUT_BF16: tl.constexpr, PER_ROW: tl.constexpr,
                       QUANT: tl.constexpr, RING: tl.constexpr):
        """Row `row` of x [rows, D] (`kv_finish`): the RMSNorm scale of the whole row, then the nope
        columns (normed, rounded, e4m3-simulated per `block` in a [NBP, BB] tile) and the rope tail (normed,
        rounded, rotated at the row's position floored to `window`), each read from x and stored once; RING (S = 1):
        also stored into ring row (row, p % W) (ring batch stride ring_sb, rows of D contiguous)."""
        t = row % S
        if PER_ROW:
            t = row
        p = tl.load(pos_ptr + t)
        if RING:
            ring_row = ring_ptr + row * ring_sb + (p % W) * D
        cols = tl.arange(0, BD)
        x = tl.load(x_ptr + row * sx + cols, mask=cols < D, other=0.0).to(tl.float32)
        if ROUND_IN:
            x = round_bf16(x)
        r = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        # nope columns 0 .. D - 2*RD2 - 1, as [NB blocks, block] (padded to [NBP, BB])
        nope = D - 2 * RD2
        bi = tl.arange(0, NBP)[:, None]
        bj = tl.arange(0, BB)[None, :]
        c2 = bi * block + bj
        m2 = (bi < NB) & (bj < block) & (c2 < nope)
        xn = tl.load(x_ptr + row * sx + c2, mask=m2, other=0.0).to(tl.float32)
        if ROUND_IN:
            xn = round_bf16(xn)
        yn = (tl.load(w_ptr + c2, mask=m2, other=0.0) * xn) * r
        if OUT_BF16:
            yn = round_bf16(yn)
        if QUANT:
            inv, sc = act_scale(yn)
            yn = act_apply(yn, inv) * sc[:, None]
        tl.store(y_ptr + row * D + c2, cast_for_store(yn, y_ptr), mask=m2)
        if RING:
            tl.store(ring_row + c2, cast_for_store(yn, ring_ptr), mask=m2)
        # the rope tail: pairs (2i, 2i+1) of columns nope ..
        p = (p // window) * window
        i = tl.arange(0, BRD)
        mi = i < RD2
        ang = p.to(tl.float64) * tl.load(f_ptr + i, mask=mi, other=0.0)
        c = tl.cos(ang).to(tl.float32)
        sn = tl.sin(ang).to(tl.float32)
        ce = nope + 2 * i
        x0 = tl.load(x_ptr + row * sx + ce, mask=mi, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + row * sx + ce + 1, mask=mi, other=0.0).to(tl.float32)
        if ROUND_IN:
            x0 = round_bf16(x0)
            x1 = round_bf16(x1)
        y0 = (tl.load(w_ptr + ce, mask=mi, other=0.0) * x0) * r
        y1 = (tl.load(w_ptr + ce + 1, mask=mi, other=0.0) * x1) * r
        if OUT_BF16:
            y0 = round_bf16(y0)
            y1 = round_bf16(y1)
        tl.store(y_ptr + row * D + ce, cast_for_store(y0 * c - y1 * sn, y_ptr), mask=mi)
        tl.store(y_ptr + row * D + ce + 1, cast_for_store(y0 * sn + y1 * c, y_ptr), mask=mi)
        if RING:
            tl.store(ring_row + ce, cast_for_store(y0 * c - y1 * sn, ring_ptr), mask=mi)
            tl.store(ring_row + ce + 1, cast_for_store(y0 * sn + y1 * c, ring_ptr), mask=mi)


def rope_tail_(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, rd: int,
               inverse: bool = False) -> torch.Tensor:
    """Rotate the last `rd` columns of x in place as `kernels.numerics.apply_rope` does (module docstring); returns x.

    Args: x [b, s, D] or [b, s, h, D] bf16 / fp32 contiguous; pos int64 on x's device, [s] (every row at the
    same positions) or [b, s] contiguous (each row its own: a ragged batch, issue 24); inv_freq [rd/2]
    fp64 (`dsv4.model.rope_inv_freq`, on x's device); rd even, <= D; inverse: rotate by -pos*f (de-rotation).
    Raises: ValueError naming the wrong argument (shape, dtype, layout, device, rd).
    """
    op = "rope_tail_"
    check_rope_tail(op, x, pos, inv_freq, rd, inverse)
    D, S = x.shape[-1], x.shape[1]
    check_layout(op, {"x": x, "pos": pos, "inv_freq": inv_freq})
    H = x.shape[2] if x.dim() == 4 else 1
    rows = x.numel() // D
    if rows:
        _rope_tail_kernel[(rows,)](x, pos, inv_freq, D, S, H, rd // 2, -1.0 if inverse else 1.0,
                                   BR=max(16, triton.next_power_of_2(rd // 2)), PER_ROW=pos.dim() == 2,
                                   num_warps=1)
    return x


# ------------------------------------------------------------------------- a KV row's last steps (issue 27)
def kv_finish_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, pos: torch.Tensor, inv_freq: torch.Tensor,
                  rd: int, nope_block: int = 0, window: int = 1, dtype: torch.dtype | None = None,
                  ring: torch.Tensor | None = None) -> torch.Tensor:
    """The last steps of a KV row (spec §5.2, §5.3 kv_norm; §6.3 a compressed entry's norm and RoPE), as the model
    composes them: x [b, s, D] (the wkv output, or a compressor's pooled fp32 rows) rounded to `dtype` (default
    x.dtype), RMSNorm (`kernels.norm.rms_norm_ref`, weight [D] fp32, eps), RoPE of the last rd columns at
    (pos // window) * window (pos int64 [s] or [b, s]; window > 1: a compressed entry's first position,
    `dsv4.model.Compressor`), and with nope_block > 0 the e4m3 simulation of the other D - rd columns in blocks of
    nope_block (`numerics.act_quant_sim`; the official KV QAT, 0 = none: fp32 mode, the indexer's keys).
    ring [b, W, D] in dtype (s = 1 only; the decode step's window ring, `dsv4.state.LayerState.ring`): the row is
    also written to ring slot pos % W of its batch row (the token's KV, `dsv4.model.Attention.step`).
    Any layout and device kind (CPU included); the values are the launcher's (`check_kv_finish_values`): x bf16 /
    float32 [b, s, D], dtype bf16 / float32 no wider than x, weight float32 [D], eps a finite float > 0, pos int64
    [s] or [b, s], inv_freq float64 [rd/2], rd even in 2..D, nope_block 0 or an int <= 1024 dividing D - rd,
    window an int >= 1, ring dtype [b, W >= 1, D] on x's device with s = 1.
    Returns: [b, s, D] in dtype, a new tensor.
    Raises: ValueError naming the first wrong argument (`check_kv_finish_values`: window 0 used to raise
    ZeroDivisionError, window -4 and dtype float16 were taken, a ring of the wrong shape / dtype / batch or with
    s > 1 failed inside torch's scatter)."""
    dtype = check_kv_finish_values(x, weight, eps, pos, inv_freq, rd, nope_block, window, dtype, ring,
                                   "kv_finish_ref")
    y = rms_norm_ref(x.to(dtype or x.dtype), weight, eps)
    p = pos if window == 1 else (pos // window) * window
    y = rope_tail_ref(y, p, inv_freq, rd)
    if nope_block:
        y = torch.cat((numerics.act_quant_sim(y[..., :-rd].contiguous(), nope_block), y[..., -rd:]), -1)
    if ring is not None:
        b, W = ring.shape[0], ring.shape[1]
        ring.scatter_(1, (pos.reshape(-1, 1) % W).expand(b, 1).view(b, 1, 1).expand(b, 1, y.shape[-1]), y)
    return y


def kv_finish(x: torch.Tensor, weight: torch.Tensor, eps: float, pos: torch.Tensor, inv_freq: torch.Tensor,
              rd: int, nope_block: int = 0, window: int = 1, dtype: torch.dtype | None = None,
              ring: torch.Tensor | None = None) -> torch.Tensor:
    """`kv_finish_ref` in ONE launch (torch + the triton entries: 4 launches for the attention's KV row - norm,
    e4m3 simulation, the copy back, RoPE - and 7 for a compressed entry - the cast, the window floor's two, norm,
    RoPE, e4m3, copy): one program per row, the same fp32 operations in the same order as `rms_norm`, `rope_tail_`
    and `act_quant_sim` (each rounded to dtype where the chain stores), so the result equals the chain of the
    triton entries bitwise except for the order of the norm's sum of squares (tests/unit/test_rope_kernel.py).

    Args: as `kv_finish_ref`; x [b, s, D] bf16 / fp32, rows at one stride (contiguous, or a half of a joint
        projection, `dsv4.model.join_fp8`; fp32 with dtype bf16: rounded first), weight
        [D] fp32, pos int64 [s] or [b, s] contiguous on x's device, inv_freq [rd/2] fp64, rd even <= D,
        nope_block 0 or a block dividing D - rd (<= 1024), window >= 1; dtype bf16 / fp32, at most as wide as x;
        ring [b, W, D] in dtype with contiguous rows (any batch stride: a view of the state's keys), s = 1.
    Returns: [b, s, D] in dtype. Raises: ValueError naming a bad argument."""
    x2, dtype = check_kv_finish(x, weight, eps, pos, inv_freq, rd, nope_block, window, dtype, ring)
    b, S, D = x.shape
    y = torch.empty(b, S, D, dtype=dtype, device=x.device)
    rows = b * S
    if rows:
        args, consts = kv_finish_args(x, x2, weight, eps, pos, inv_freq, rd, nope_block, window, dtype, y, ring)
        _kv_finish_kernel[(rows,)](*args, **consts, num_warps=4)
    return y


def kv_finish_args(x, x2, weight, eps, pos, inv_freq, rd: int, nope_block: int, window: int, dtype, y,
                   ring) -> tuple[tuple, dict]:
    """(runtime arguments, constexprs) of `_kv_finish_row` for `kv_finish`'s checked arguments (x2 = x's rows,
    `check_kv_finish`) and output y (also `qkv_finish`'s KV part)."""
    b, S, D = x.shape
    nope = D - rd
    block = nope_block or max(nope, 1)
    NB = -(-nope // block) if nope else 0
    args = (x2, weight, pos, inv_freq, y, y if ring is None else ring, D, S, eps, window, rd // 2, NB, block,
            0 if ring is None else ring.stride(0), 1 if ring is None else ring.shape[1], x2.stride(0))
    consts = dict(RING=ring is not None, BD=triton.next_power_of_2(D), BRD=max(16, triton.next_power_of_2(rd // 2)),
                  NBP=max(1, triton.next_power_of_2(max(NB, 1))), BB=max(16, triton.next_power_of_2(block)),
                  ROUND_IN=x.dtype != dtype, OUT_BF16=dtype == torch.bfloat16, PER_ROW=pos.dim() == 2,
                  QUANT=nope_block > 0)
    return args, consts


def check_kv_finish_values(x, weight, eps, pos, inv_freq, rd, nope_block, window, dtype, ring, op: str,
                           names: tuple[str, str] = ("x", "eps")):
    """The argument checks `kv_finish` and `kv_finish_ref` share (types, dtypes, shapes, values; no layout or
    device-kind check: the reference takes CPU tensors of any layout). ValueError (`kernels.launch.fail`) naming
    the bad one (`names`: the caller's names of x and eps); returns dtype (x.dtype when None)."""
    xname, ename = names
    dtype = dtype or (x.dtype if isinstance(x, torch.Tensor) else None)
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.dtype not in (torch.bfloat16, torch.float32):
        _fail(op, xname, f"{getattr(x, 'dtype', type(x))} shape {tuple(getattr(x, 'shape', ()))}",
              "bf16 / float32 [b, s, D]")
    if dtype not in (torch.bfloat16, torch.float32) or (x.dtype == torch.bfloat16 and dtype == torch.float32):
        _fail(op, "dtype", str(dtype), "bf16 or float32, no wider than x")
    b, S, D = x.shape
    if isinstance(rd, bool) or not isinstance(rd, int) or rd <= 0 or rd % 2 or rd > D:
        _fail(op, "rd", repr(rd), f"an even int in 2..{D}")
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or tuple(weight.shape) != (D,):
        _fail(op, "weight", f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}",
              f"float32 [{D}]")
    if not isinstance(eps, float) or not 0 < eps < float("inf"):
        _fail(op, ename, repr(eps), "a finite float > 0")
    if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64 or tuple(pos.shape) not in ((S,), (b, S)):
        _fail(op, "pos", f"{getattr(pos, 'dtype', type(pos))} shape {tuple(getattr(pos, 'shape', ()))}",
              f"int64 [{S}] or [{b}, {S}]")
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dtype != torch.float64 or tuple(inv_freq.shape) != (rd // 2,):
        _fail(op, "inv_freq", f"{getattr(inv_freq, 'dtype', type(inv_freq))}", f"float64 [{rd // 2}]")
    nope = D - rd
    if (isinstance(nope_block, bool) or not isinstance(nope_block, int) or nope_block < 0 or nope_block > 1024
            or (nope_block and nope % nope_block)):
        _fail(op, "nope_block", repr(nope_block), f"0 or an int <= 1024 dividing D - rd = {nope}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        _fail(op, "window", repr(window), "an int >= 1")
    if ring is not None and (not isinstance(ring, torch.Tensor) or ring.dtype != dtype or ring.dim() != 3
                             or ring.shape[0] != b or ring.shape[1] < 1 or ring.shape[2] != D or S != 1
                             or ring.device != x.device):
        _fail(op, "ring", f"{getattr(ring, 'dtype', type(ring))} {tuple(getattr(ring, 'shape', ()))} with s={S}",
              f"{dtype} [{b}, W >= 1, {D}] on x's device, s = 1")
    return dtype


def check_kv_finish(x, weight, eps, pos, inv_freq, rd, nope_block, window, dtype, ring, op: str = "kv_finish",
                    names: tuple[str, str] = ("x", "eps")):
    """`kv_finish`'s argument checks (ValueError naming the bad one; `names`: the caller's names of x and eps):
    `check_kv_finish_values`, then the launch layout (ring rows contiguous, x's rows at one stride, contiguous
    CUDA tensors on one device). Returns (x's rows at one stride, dtype)."""
    xname = names[0]
    dtype = check_kv_finish_values(x, weight, eps, pos, inv_freq, rd, nope_block, window, dtype, ring, op, names)
    D = x.shape[-1]
    if ring is not None and (ring.stride(2) != 1 or ring.stride(1) != D):
        _fail(op, "ring", f"strides {ring.stride()}", f"contiguous rows of {D} values (any batch stride)")
    x2 = row_view(x)  # rows at one stride (a half of a joint projection) are read in place
    if x2 is None:
        _fail(op, xname, f"strides {x.stride()}", "rows of D contiguous values at one stride")
    check_layout(op, {"weight": weight, "pos": pos, "inv_freq": inv_freq})
    if x.device != weight.device:
        _fail(op, xname, f"on device {x.device}", f"weight's device, {weight.device}")
    return x2, dtype


def qkv_finish(q: torch.Tensor, q_eps: float, pos: torch.Tensor, inv_freq: torch.Tensor, rd: int, kv: torch.Tensor,
               weight: torch.Tensor, eps: float, nope_block: int = 0, ring: torch.Tensor | None = None,
               index: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The attention's q finish (`kernels.norm.head_rms_rope`) and KV finish (`kv_finish`, window 1, output in kv's
    dtype) in ONE launch (issue 27: one launch fewer per layer): `_qkv_finish_kernel` runs both kernels'
    row code side by side, so (q, kv) are bitwise `(head_rms_rope(q, ...), kv_finish(kv, ...))`.

    Args: q [b, s, h, d] and its eps, pos, inv_freq, rd as `head_rms_rope`; kv, weight, eps, nope_block, ring as
        `kv_finish` (the same pos, inv_freq and rd; window 1; the output in kv's dtype); index = (W, ratio,
        n_entries) or None: also the decode step's key slots `kernels.attention.step_index(pos, W, None, ratio,
        n_entries)` of a window-only (ratio 0) or HCA layer (pos [b, s]), in the same launch; (W, 0, 0, k): a
        CSA layer's window slots and k entry columns left for its top-k (`step_index_args` reserve).
    Returns: (q [b, s, h, d] in q.dtype, kv [b, s, D] in kv.dtype, idx [b, s, W + n_entries] int64 or None).
    Raises: ValueError naming a bad argument (as the launchers, under the name qkv_finish / step_index)."""
    op = "qkv_finish"
    qc = check_head_rms_rope(q, q_eps, pos, inv_freq, rd, op=op, names=("q", "q_eps"))
    x2, dtype = check_kv_finish(kv, weight, eps, pos, inv_freq, rd, nope_block, 1, None, ring, op=op,
                                names=("kv", "eps"))
    if qc.device != kv.device:
        _fail(op, "q", f"on device {qc.device}", f"kv's device, {kv.device}")
    if tuple(qc.shape[:2]) != tuple(kv.shape[:2]):
        _fail(op, "q", f"shape {tuple(qc.shape)}", f"[b, s, h, d] with kv's b, s = {tuple(kv.shape[:2])}")
    if index is not None and pos.dim() != 2:
        _fail(op, "pos", f"shape {tuple(pos.shape)}", "[b, s] with index= (the decode step's positions per row)")
    qy = torch.empty_like(qc)
    b, S, D = kv.shape
    y = torch.empty(b, S, D, dtype=dtype, device=kv.device)
    RQ, rows = qc.numel() // qc.shape[-1], b * S
    idx, iargs, ik, n_idx = None, (pos, pos, pos, 1, 1, 0, 0, 1, 0), dict(INPLACE=True, MODE=0, BLOCK=16), 0
    if index is not None:
        if not isinstance(index, tuple) or len(index) not in (3, 4):
            _fail(op, "index", repr(index), "None, (W, ratio, n_entries) or (W, 0, 0, top-k columns)")
        idx, iargs, ik = step_index_args(pos, index[0], None, index[1], index[2], *index[3:])
        n_idx = idx.shape[0] * idx.shape[1]
    if RQ + rows + n_idx:
        qargs = head_rms_rope_args(qc, qy, q_eps, pos, inv_freq, rd)
        qk = head_rms_rope_consts(qc, pos, rd)
        args, consts = kv_finish_args(kv, x2, weight, eps, pos, inv_freq, rd, nope_block, 1, dtype, y, ring)
        _qkv_finish_kernel[(RQ + rows + n_idx,)](*qargs, *args, *iargs, RQ, RQ + rows, QBD=qk["BD"], QBF16=qk["BF16"],
                                                 QPER_ROW=qk["PER_ROW"], QBR=qk["BR"], **consts,
                                                 INDEX=index is not None, IINPLACE=ik["INPLACE"], IMODE=ik["MODE"],
                                                 IBLOCK=ik["BLOCK"], num_warps=4 if qk["BD"] <= 4096 else 8)
    return qy, y, idx


def sparse_attn_rope_ref(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, idx: torch.Tensor,
                         softmax_scale: float, pos: torch.Tensor, inv_freq: torch.Tensor, rd: int) -> torch.Tensor:
    """The attention's output with its RoPE channels de-rotated (spec §5.4): `rope_tail_ref(sparse_attn_ref(q, kv,
    attn_sink, idx, softmax_scale), pos, inv_freq, rd, inverse=True)` - what `dsv4.model.Attention` computes in two
    steps where the backend has no `sparse_attn_rope` (the triton one: `kernels.attention.sparse_attn_rope`).
    Shapes and errors as the two functions. Here, beside `rope_tail_ref`: kernels.rope imports kernels.attention."""
    return rope_tail_ref(sparse_attn_ref(q, kv, attn_sink, idx, softmax_scale), pos, inv_freq, rd, inverse=True)
