"""Activation quantization simulations in one launch: the official `act_quant(.., inplace)` (e4m3, ue8m0 scale per
`block` channels) and `fp4_act_quant(.., 32, inplace)` (e2m1, ue8m0 scale per 32 channels), quantize ->
dequantize, output in the input dtype.

Spec: `dsv4_reference_spec.md` §2 (activation quantization; the [F1] QAT simulation of the KV nope channels in
64-channel e4m3 blocks, and the FP4 rounding of the indexer's queries and keys in 32-channel blocks). The
references are `kernels.numerics.act_quant_sim` and `kernels.numerics.fp4_act_quant_sim` (re-exported by
`dsv4.quant`; pure torch: ~25 and ~40 small launches per call
on a GPU, six and two calls per decode step of a 4-layer Flash model). These kernels compute
the same values BITWISE (tests/unit/test_quant_kernels.py):
  * the scale exponent from the bits of amax, no division: e4m3 `k = ceil(log2(amax / 448))` as
    `kernels.gemm.act_scale`; e2m1 `k = ceil(log2(amax / 6))`: amax = m * 2^e with m in [1, 2), 6 = 1.5 * 2^2,
    so k = e - 2 + (m > 1.5), i.e. + (mantissa bits > 0x400000) (the fp32 division the reference rounds gives
    the same k: a quotient just above 1 rounds to 1 + 2^-23, never down to 1);
  * x * 2^-k is exact (power of two), then round to the grid: e4m3 by `kernels.gemm.round_e4m3`, e2m1 by
    round-half-even of |v| / step with step 0.5 / 1 / 2 on [0, 2) / [2, 4) / [4, 6] (the even integer is the
    even e2m1 code in every range), then times 2^k (exact) and one cast to x.dtype (exact: the value is on the
    format's grid times a power of two);
  * a block holding a NaN or an inf uses the scale 2^0 (torch's frexp gives exponent 0 for both, so the
    reference does), an inf saturates to +-448 / +-6 and a NaN stays NaN (in the e2m1 reference too, see
    `dsv4.quant.fp4_act_quant_sim`): a NaN activation reaches the model's output, never a plausible value.

Used by the triton backend's graph decode step (`dsv4/graph.py`) through `Backend.act_quant_sim` /
`Backend.fp4_act_quant_sim`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit_formats import _nonfinite_rows, act_apply, act_scale, cast_for_store
from kernels.launch import check_layout
from kernels.launch import fail as _fail

_FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126


@triton.jit
def _round_half_even(r):
    """Round r >= 0 (exactly representable, < 2^22) to the nearest integer, ties to even, as fp32."""
    f = tl.floor(r)
    d = r - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)


@triton.jit
def _fp4_sim_tile(x):
    """e2m1 quantize -> dequantize of an [R, B] fp32 tile, one ue8m0 scale per row (module docstring)."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 6.0 * 1.1754943508222875e-38)  # 6 * 2^-126
    ab = amax.to(tl.int32, bitcast=True)
    k = ((ab >> 23) & 0xFF) - 127 - 2 + ((ab & 0x7FFFFF) > 0x400000).to(tl.int32)
    k = tl.where(_nonfinite_rows(x), 0, k)  # NaN / inf in the block: scale 2^0, as the reference's frexp
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
    s = ((127 + k) << 23).to(tl.float32, bitcast=True)
    v = tl.minimum(tl.maximum(x * inv[:, None], -6.0), 6.0)
    a = tl.abs(v)
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    q = _round_half_even(a / step) * step
    # the sign as a bit, so a negative v rounded to 0 is -0.0 as in the reference: the GPU build of
    # `where(v < 0, -q, q)` returned +0.0 there (the interpreter kept the sign); integer ops no float rewrite touches
    qb = q.to(tl.int32, bitcast=True)
    q = tl.where(v < 0, qb | -2147483648, qb).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, q * s[:, None])


@triton.jit(do_not_specialize=["n_rows"])  # issue 29: the row count varies with the length and batch
def _quant_sim_kernel(x_ptr, y_ptr, n_rows, n, block, FP4: tl.constexpr, B: tl.constexpr, BR: tl.constexpr,
                      HALVES: tl.constexpr = False):
    """Grid (cdiv(rows, BR), n / block): rows of x viewed [rows, n], one `block`-channel group per program, held
    in a B = next_power_of_2(block) wide tile (masked columns load 0, which leaves amax unchanged). HALVES (B ==
    block, both even): y's row in the halves layout (`halves`): the group's even channels stored at
    [block / 2 * pid1, ...) and its odd ones n / 2 further."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    lane = tl.arange(0, B)
    cols = tl.program_id(1) * block + lane
    mask = (rows < n_rows)[:, None] & (lane < block)[None, :]
    offs = rows.to(tl.int64)[:, None] * n + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if FP4:
        y = _fp4_sim_tile(x)
    else:
        inv, s = act_scale(x)
        y = act_apply(x, inv) * s[:, None]
    if HALVES:
        ye, yo = tl.split(tl.reshape(y, (BR, B // 2, 2)))
        hmask = (rows < n_rows)[:, None]
        hoffs = rows.to(tl.int64)[:, None] * n + (tl.program_id(1) * (B // 2) + tl.arange(0, B // 2))[None, :]
        tl.store(y_ptr + hoffs, cast_for_store(ye, y_ptr), mask=hmask)
        tl.store(y_ptr + hoffs + n // 2, cast_for_store(yo, y_ptr), mask=hmask)
    else:
        tl.store(y_ptr + offs, cast_for_store(y, y_ptr), mask=mask)


def halves(x: torch.Tensor) -> torch.Tensor:
    """The halves layout of the last dim (the FP4 tile kernels' input, `kernels.moe`): x [..., n] (n even) ->
    [..., n] holding x[..., 0::2] then x[..., 1::2] - the inputs of the low nibbles, then those of the high ones,
    so a K chunk's even and odd inputs are each contiguous (16-byte loads and cp.async, instead of a 2-byte
    stride-2 gather). The torch form of `act_quant_sim(.., halves=True)`'s store; a copy in x.dtype."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] % 2:
        _fail("halves", "x", f"{type(x).__name__} shape {tuple(getattr(x, 'shape', ()))}",
              "a tensor [..., n] with n even")
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _launch(op: str, x: torch.Tensor, block: int, fp4: bool, split: bool = False) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float32) or x.dim() < 1:
        _fail(op, "x", f"{getattr(x, 'dtype', type(x))}", "a bf16 or float32 tensor [..., n]")
    n = x.shape[-1]
    if not isinstance(block, int) or isinstance(block, bool) or not 1 <= block <= 1024 or n % block:
        _fail(op, "block", repr(block), f"an int in 1..1024 dividing the width {n}")
    B = triton.next_power_of_2(block)
    if split and (B != block or block < 2):
        _fail(op, "block", repr(block), "a power of two >= 2 with halves=True")
    check_layout(op, {"x": x})
    y = torch.empty_like(x)
    rows = x.numel() // n if n else 0
    if rows:
        BR = max(1, min(16, 2048 // B))
        _quant_sim_kernel[(triton.cdiv(rows, BR), n // block)](x, y, rows, n, block, FP4=fp4, B=B, BR=BR,
                                                               HALVES=split, num_warps=4)
    return y


def act_quant_sim(x: torch.Tensor, block: int = 128, *, halves: bool = False) -> torch.Tensor:
    """`dsv4.quant.act_quant_sim(x, block)` (ue8m0 scales) in one launch, bitwise equal (module docstring).

    Args: x [..., n] bf16 / fp32 contiguous; block: channels per scale (1..1024), dividing n (the model's
    `_Sim._block`: 64 / 32 at real widths, the whole row at test-scale widths); halves: write the output in the
    halves layout (`halves(act_quant_sim(x, block))`, bitwise; block a power of two), the FP4 tile kernels'
    input. Returns: [..., n] in x.dtype.
    Raises: ValueError naming the wrong argument (dtype, block, layout, device)."""
    if not isinstance(halves, bool):
        _fail("act_quant_sim", "halves", repr(halves), "a bool")
    return _launch("act_quant_sim", x, block, False, halves)


def fp4_act_quant_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """`dsv4.quant.fp4_act_quant_sim(x, block)` in one launch, bitwise equal (module docstring).

    Args: x [..., n] bf16 / fp32 contiguous; block: channels per scale (1..1024), dividing n (the model's
    `_Sim._block`: 64 / 32 at real widths, the whole row at test-scale widths). Returns: [..., n] in x.dtype.
    Raises: ValueError naming the wrong argument (dtype, block, layout, device)."""
    return _launch("fp4_act_quant_sim", x, block, True)
