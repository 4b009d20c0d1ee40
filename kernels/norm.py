"""Weighted RMSNorm in one launch (spec §2): `y = cast_in(w * x_f32 * rsqrt(mean(x_f32^2) + eps))`.

Reading order (STYLE §1): the reference, the kernel, the launcher, the triton backend's entry (`rms_norm_op`).
`rms_norm_ref` is the executable spec (the reference backend's `rms_norm` entry, what every `dsv4.model.RMSNorm` computes with the reference backend: upcast,
`pow`, `mean`, `rsqrt`, two multiplies, downcast: eight launches on a GPU). The triton backend's `RMSNorm` runs
`rms_norm` instead (through `rms_norm_op`, its backend entry): one program per row, the row in registers, the same
operations in the same order in fp32 (w * x first, then * rsqrt), the store rounded once to x.dtype (`kernels.gemm.cast_for_store`).
Only the order of the sum of squares differs, so the fp32 results agree within a few ulps and bf16 outputs are
bitwise equal in almost every element (tests/unit/test_norm_kernel.py). Used at every norm of the model: the
block's attn_norm / ffn_norm, the attention's q_norm / kv_norm, the compressors' norms and the final norm.

`head_rms` (issue 27) is the attention's unweighted per-head RMS of q (spec §5.3) in one launch instead of torch's
five (square, mean, add, rsqrt, mul): the triton backend's `head_rms` entry in both modes (the batch-invariant
mode's `kernels.invariant.head_rms` is this kernel: its sum of squares has one order for every row count).
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

MAX_DIM = 16384   # a row must fit in one program's registers (DeepSeek-V4: 7168 at most)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference RMSNorm (spec §2; the `rms_norm` entry of the reference backend).

    Args: x [..., d] any float dtype, any layout; weight [d] fp32 (`RMSNorm.weight`); eps > 0 (norm_eps).
    Returns: `weight * x * rsqrt(mean(x^2) + eps)` computed in fp32, [..., d] in x.dtype.
    Raises: ValueError naming the argument: x not a floating-point tensor, weight not [d] (a weight of another
    shape would broadcast: [3, d] made [3, d] outputs from one row, [1] scaled every channel alike), eps not a
    finite number > 0 (0 or less gives inf / NaN for a zero row).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"rms_norm_ref: x must be a floating-point tensor [..., d], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"rms_norm_ref: weight must be [d] = [{x.shape[-1]}], got "
                         f"{tuple(getattr(weight, 'shape', ())) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"rms_norm_ref: eps={eps!r}, expected a finite number > 0 (norm_eps)")
    xf = x.float()
    return (weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


if triton is not None:  # the kernels exist only where triton is installed (it is optional)
    from kernels.gemm import cast_for_store

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, d, eps, sx, BD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BD)
        mask = offs < d
        x = tl.load(x_ptr + row * sx + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        ms = tl.sum(x * x, axis=0) / d
        y = (w * x) * tl.math.rsqrt(ms + eps)
        tl.store(y_ptr + row * d + offs, cast_for_store(y, y_ptr), mask=mask)

    from kernels.jit_formats import round_bf16

    @triton.jit(do_not_specialize=["S"])  # issue 29: S is the token count of a call (prefill length)
    def _head_rms_kernel(x_ptr, y_ptr, d, eps, pos_ptr, f_ptr, S, H, RD2, BD: tl.constexpr, BF16: tl.constexpr,
                         ROPE: tl.constexpr = False, PER_ROW: tl.constexpr = False, BR: tl.constexpr = 16):
        """One row of d values per program (`_head_rms_row`)."""
        _head_rms_row(tl.program_id(0).to(tl.int64), x_ptr, y_ptr, d, eps, pos_ptr, f_ptr, S, H, RD2, BD, BF16,
                      ROPE, PER_ROW, BR)

    @triton.jit
    def _head_rms_row(row, x_ptr, y_ptr, d, eps, pos_ptr, f_ptr, S, H, RD2, BD: tl.constexpr, BF16: tl.constexpr,
                      ROPE: tl.constexpr, PER_ROW: tl.constexpr, BR: tl.constexpr):
        """Row `row` of d values: `x * rsqrt(mean(x^2) + eps)`; BF16: a bf16 rounding after each torch
        op of the official chain (square, mean (fp32 sum / d), + eps, rsqrt, the product), else all in fp32.
        ROPE: then the last 2*RD2 columns rotated as `kernels.rope.rope_tail_` does (row = ((b*S + t)*H + h); the
        position pos[t], or pos[b, t] with PER_ROW), stored once (the norm's store skips them). Shared by
        `_head_rms_kernel` and `kernels.rope._qkv_finish_kernel`."""
        offs = tl.arange(0, BD)
        mask = offs < d
        x = tl.load(x_ptr + row * d + offs, mask=mask, other=0.0).to(tl.float32)
        if BF16:
            sq = round_bf16(x * x)
            mean = round_bf16(tl.sum(sq, axis=0) / d)
            r = round_bf16(tl.math.rsqrt(round_bf16(mean + eps)))
            y = round_bf16(x * r)
        else:
            r = tl.math.rsqrt(tl.sum(x * x, axis=0) / d + eps)
            y = x * r
        if ROPE:
            tl.store(y_ptr + row * d + offs, y.to(y_ptr.dtype.element_ty), mask=offs < d - 2 * RD2)
            t = (row // H) % S
            if PER_ROW:
                t = row // H
            i = tl.arange(0, BR)
            mi = i < RD2
            ang = tl.load(pos_ptr + t).to(tl.float64) * tl.load(f_ptr + i, mask=mi, other=0.0)
            c = tl.cos(ang).to(tl.float32)
            sn = tl.sin(ang).to(tl.float32)
            ce = d - 2 * RD2 + 2 * i
            y0 = tl.load(x_ptr + row * d + ce, mask=mi, other=0.0).to(tl.float32) * r
            y1 = tl.load(x_ptr + row * d + ce + 1, mask=mi, other=0.0).to(tl.float32) * r
            if BF16:
                y0 = round_bf16(y0)
                y1 = round_bf16(y1)
            tl.store(y_ptr + row * d + ce, cast_for_store(y0 * c - y1 * sn, y_ptr), mask=mi)
            tl.store(y_ptr + row * d + ce + 1, cast_for_store(y0 * sn + y1 * c, y_ptr), mask=mi)
        else:
            tl.store(y_ptr + row * d + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_ref` in one Triton launch (module docstring); no host sync (CUDA-graph capturable).

    Args: x [..., d] bf16 / fp32 whose rows share one stride (contiguous, or the columns of a wider tensor: a half
        of a joint projection, `dsv4.model.join_fp8`); weight [d] fp32; eps > 0 (norm_eps); d <= MAX_DIM.
    Returns: [..., d] in x.dtype.
    Raises: ValueError naming the wrong argument (dtype, shape, layout, device, eps).
    """
    op = "rms_norm"
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float32) or x.dim() < 1:
        _fail(op, "x", f"{getattr(x, 'dtype', type(x))}", "a bf16 or float32 tensor [..., d]")
    d = x.shape[-1]
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or tuple(weight.shape) != (d,):
        _fail(op, "weight", f"{getattr(weight, 'dtype', type(weight))} shape "
              f"{tuple(getattr(weight, 'shape', ()))}", f"float32 [{d}]")
    if not 0 < d <= MAX_DIM:
        _fail(op, "x", f"width {d}", f"1..{MAX_DIM}")
    if not isinstance(eps, float) or not 0 < eps < float("inf"):
        _fail(op, "eps", repr(eps), "a finite float > 0")
    x2 = row_view(x)
    if x2 is None:
        _fail(op, "x", f"strides {x.stride()} for shape {tuple(x.shape)}", "rows of d contiguous values at one stride")
    check_layout(op, {"weight": weight})  # (x's rows need not be contiguous with each other: checked above)
    if x.device != weight.device:
        _fail(op, "x", f"on device {x.device}", f"weight's device, {weight.device}")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows:
        BD = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows,)](x2, weight, y, d, eps, x2.stride(0), BD=BD, num_warps=4 if BD <= 4096 else 8)
    return y


def row_view(x: torch.Tensor) -> torch.Tensor | None:
    """x [..., d] as [rows, d] rows at one stride with contiguous columns (a view, no copy), or None when its
    layout has no such view (the caller copies or refuses)."""
    if x.dim() < 1 or (x.shape[-1] > 1 and x.stride(-1) != 1):
        return None
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The triton backend's `rms_norm` entry (every `dsv4.model.RMSNorm.forward`), the signature of `rms_norm_ref`:
    `rms_norm` (one launch) on x [..., d] bf16 / fp32 in any layout (rows at one stride read in place, others
    made contiguous), weight [d] fp32, eps > 0; the same fp32 maths as the reference up to the order of the sum of
    squares; x.dtype out, contiguous. Raises ValueError as `rms_norm`."""
    return rms_norm(x if row_view(x) is not None else x.contiguous(), weight, eps)


def check_head_rms(op: str, x, eps, max_dim: int | None = MAX_DIM) -> None:
    """The argument checks of `head_rms` and `head_rms_ref`: x a bf16 or float32 tensor [..., d] with d >= 1
    (and d <= max_dim; the reference passes None: no register limit), eps a finite float > 0 (norm_eps; a bool or
    an int, a tensor, 0, a negative, inf or NaN refused). Raises ValueError (`kernels.launch.fail`)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float32) or x.dim() < 1:
        _fail(op, "x", f"{getattr(x, 'dtype', type(x))}", "a bf16 or float32 tensor [..., d]")
    d = x.shape[-1]
    if d < 1 or (max_dim is not None and d > max_dim):
        _fail(op, "x", f"width {d}", f"1..{max_dim}" if max_dim is not None else ">= 1")
    if not isinstance(eps, float) or not 0 < eps < float("inf"):
        _fail(op, "eps", repr(eps), "a finite float > 0")


def head_rms_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The attention's unweighted per-head RMS norm of q (spec §5.3; official `q *= torch.rsqrt(q.square().mean(-1,
    keepdim=True) + eps)`, in the activation dtype: bf16 roundings after each op in bf16 mode): x [..., d] ->
    [..., d], x.dtype. The reference backend's `head_rms` entry (what `dsv4.model.Attention` computes).
    Args: x [..., d] bf16 or float32, any layout, d >= 1; eps a finite float > 0 (norm_eps).
    Raises: ValueError naming x (not a bf16 / float32 tensor - fp16 or an integer x included -, width 0) or eps
    (not a finite float > 0: 0 or a negative gave NaN, a tensor or an int was taken) - `check_head_rms`, what the
    launcher `head_rms` refuses except its register limit on d."""
    check_head_rms("head_rms_ref", x, eps, max_dim=None)
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def head_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`head_rms_ref` in one Triton launch: one program per row, the sum of squares in one fixed order (the same
    for every row count), a bf16 rounding after each op of the torch chain for bf16 x (fp32 x: fp32 throughout).
    Equal to the torch chain up to the fp32 order of the sum of squares (and rsqrt's last fp32 bit) before its
    rounding: bf16 outputs within 2 bf16 ulps, equal in most elements (tests/unit/test_norm_kernel.py,
    tests/unit/test_batch_invariant.py::test_fixed_order_helpers). No host sync.

    Args: x [..., d] bf16 or float32 (any layout: made contiguous); eps a finite float > 0 (norm_eps).
    Returns: [..., d] in x.dtype.
    Raises: ValueError naming x (dtype, width outside 1..MAX_DIM) or eps.
    """
    check_head_rms("head_rms", x, eps)
    d = x.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    rows = x.numel() // d
    if rows:
        BD = triton.next_power_of_2(d)
        _head_rms_kernel[(rows,)](x, y, d, eps, x, x, 1, 1, 0, BD=BD, BF16=x.dtype == torch.bfloat16,
                                  num_warps=4 if BD <= 4096 else 8)
    return y


def head_rms_rope(x: torch.Tensor, eps: float, pos: torch.Tensor, inv_freq: torch.Tensor, rd: int) -> torch.Tensor:
    """The attention's q finish in ONE launch (issue 27; two before): `head_rms` then `kernels.rope.rope_tail_` of
    the last rd columns - the same operations, rounded where the chain stores (bitwise that chain,
    tests/unit/test_norm_kernel.py). x [b, s, h, d] bf16 / fp32; pos int64 [s] or [b, s] contiguous; inv_freq
    [rd/2] fp64; rd even <= d. Returns [b, s, h, d] in x.dtype. Raises ValueError naming a bad argument."""
    x = check_head_rms_rope(x, eps, pos, inv_freq, rd)
    d = x.shape[-1]
    y = torch.empty_like(x)
    rows = x.numel() // d
    if rows:
        BD = triton.next_power_of_2(d)
        _head_rms_kernel[(rows,)](*head_rms_rope_args(x, y, eps, pos, inv_freq, rd),
                                  **head_rms_rope_consts(x, pos, rd), num_warps=4 if BD <= 4096 else 8)
    return y


def head_rms_rope_args(x: torch.Tensor, y: torch.Tensor, eps: float, pos: torch.Tensor, inv_freq: torch.Tensor,
                       rd: int) -> tuple:
    """The runtime arguments of `_head_rms_row` for `head_rms_rope`'s checked x [b, s, h, d] and output y (also
    `kernels.rope.qkv_finish`'s q part)."""
    b, S, H, d = x.shape
    return x, y, d, eps, pos, inv_freq, S, H, rd // 2


def head_rms_rope_consts(x: torch.Tensor, pos: torch.Tensor, rd: int) -> dict:
    """The constexprs of `_head_rms_row` for `head_rms_rope` (see `head_rms_rope_args`)."""
    return dict(BD=triton.next_power_of_2(x.shape[-1]), BF16=x.dtype == torch.bfloat16, ROPE=True,
                PER_ROW=pos.dim() == 2, BR=max(16, triton.next_power_of_2(rd // 2)))


def check_head_rms_rope(x: torch.Tensor, eps: float, pos: torch.Tensor, inv_freq: torch.Tensor, rd: int,
                        op: str = "head_rms_rope", names: tuple[str, str] = ("x", "eps")) -> torch.Tensor:
    """`head_rms_rope`'s argument checks (ValueError naming the bad one; `names`: the caller's names of x and eps);
    returns x contiguous."""
    xn, en = names
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 4:
        _fail(op, xn, f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}",
              "a bf16 or float32 tensor [b, s, h, d]")
    b, S, H, d = x.shape
    if not 0 < d <= MAX_DIM:
        _fail(op, xn, f"width {d}", f"1..{MAX_DIM}")
    if not isinstance(eps, float) or not 0 < eps < float("inf"):
        _fail(op, en, repr(eps), "a finite float > 0")
    if isinstance(rd, bool) or not isinstance(rd, int) or rd <= 0 or rd % 2 or rd > d:
        _fail(op, "rd", repr(rd), f"an even int in 2..{d}")
    if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64 or tuple(pos.shape) not in ((S,), (b, S)):
        _fail(op, "pos", f"{getattr(pos, 'dtype', type(pos))} {tuple(getattr(pos, 'shape', ()))}",
              f"int64 [{S}] or [{b}, {S}]")
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dtype != torch.float64 or tuple(inv_freq.shape) != (rd // 2,):
        _fail(op, "inv_freq", f"{getattr(inv_freq, 'dtype', type(inv_freq))}", f"float64 [{rd // 2}]")
    x = x.contiguous()
    check_layout(op, {"x": x, "pos": pos, "inv_freq": inv_freq})
    return x
