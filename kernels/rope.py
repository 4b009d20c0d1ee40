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
from kernels.launch import check_layout
from kernels.launch import fail as _fail


def rope_tail_ref(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, rd: int,
                  inverse: bool = False) -> torch.Tensor:
    """The model's maths (the `rope_tail` entry of the reference backend): `torch.cat((x[..., :-rd],
    apply_rope(x[..., -rd:], pos, inv_freq, inverse)), -1)`, a new tensor (x untouched). Shapes as `rope_tail_`."""
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


def rope_tail_(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, rd: int,
               inverse: bool = False) -> torch.Tensor:
    """Rotate the last `rd` columns of x in place as `kernels.numerics.apply_rope` does (module docstring); returns x.

    Args: x [b, s, D] or [b, s, h, D] bf16 / fp32 contiguous; pos int64 on x's device, [s] (every row at the
    same positions) or [b, s] contiguous (each row its own: a ragged batch, issue 24); inv_freq [rd/2]
    fp64 (`dsv4.model.rope_inv_freq`, on x's device); rd even, <= D; inverse: rotate by -pos*f (de-rotation).
    Raises: ValueError naming the wrong argument (shape, dtype, layout, device, rd).
    """
    op = "rope_tail_"
    if not isinstance(inverse, bool):
        _fail(op, "inverse", repr(inverse), "a bool")
    if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4) or x.dtype not in (torch.bfloat16, torch.float32):
        _fail(op, "x", f"{getattr(x, 'dtype', type(x))} shape {tuple(getattr(x, 'shape', ()))}",
              "bf16 / float32 [b, s, D] or [b, s, h, D]")
    D, S = x.shape[-1], x.shape[1]
    if not isinstance(rd, int) or rd <= 0 or rd % 2 or rd > D:
        _fail(op, "rd", repr(rd), f"an even int in 2..{D}")
    if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64 or \
            tuple(pos.shape) not in ((S,), (x.shape[0], S)):
        _fail(op, "pos", f"{getattr(pos, 'dtype', type(pos))} shape {tuple(getattr(pos, 'shape', ()))}",
              f"int64 [{S}] or [{x.shape[0]}, {S}]")
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dtype != torch.float64 or \
            tuple(inv_freq.shape) != (rd // 2,):
        _fail(op, "inv_freq", f"{getattr(inv_freq, 'dtype', type(inv_freq))} shape "
              f"{tuple(getattr(inv_freq, 'shape', ()))}", f"float64 [{rd // 2}]")
    check_layout(op, {"x": x, "pos": pos, "inv_freq": inv_freq})
    H = x.shape[2] if x.dim() == 4 else 1
    rows = x.numel() // D
    if rows:
        _rope_tail_kernel[(rows,)](x, pos, inv_freq, D, S, H, rd // 2, -1.0 if inverse else 1.0,
                                   BR=max(16, triton.next_power_of_2(rd // 2)), PER_ROW=pos.dim() == 2,
                                   num_warps=1)
    return x
