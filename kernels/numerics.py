"""Number formats of DeepSeek-V4 (reference spec §2) and the RoPE reference (§5): the one leaf module both
the model (`dsv4`) and the kernels (`kernels/`) use. Pure torch, no triton, no dsv4 import; CPU or CUDA.
`dsv4.quant` re-exports the number formats (`dsv4.config` the block sizes, `dsv4.model` `apply_rope`): the
definitions live here, once.

    ue8m0 (F8_E8M0)  one byte e, value 2^(e-127); e = 255 is NaN. A scale is an EXPONENT, never a number:
                     the byte 120 means 2^-7, not 120.0.
    e4m3 (F8_E4M3)   float8_e4m3fn: bias 7, max 448, no inf.
    e2m1 (FP4)       nibble c: magnitude [0, .5, 1, 1.5, 2, 3, 4, 6][c & 7], sign c >> 3; two per byte on disk
                     (I8), element 2k in the LOW nibble, 2k+1 in the HIGH nibble.

Weights:  FP8 `[out, in]` with one ue8m0 scale per 128x128 block `[ceil(out/128), ceil(in/128)]`;
          FP4 `[out, in/2]` packed with one ue8m0 scale per 32 inputs per row `[out, in/32]`.
Activations (`act_quant*`, `fp4_act_quant_sim`) follow the official kernels' quantize -> dequantize maths.
Every quantizer picks the power-of-two scale `s = 2^ceil(log2(amax / fmt_max))` (ue8m0), so that
`|x / s| <= fmt_max` and the scale round-trips exactly through one e8m0 byte.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128  # FP8 weights: one ue8m0 scale per FP8_BLOCK x FP8_BLOCK block (config weight_block_size)
FP4_BLOCK = 32   # FP4 experts: one ue8m0 scale per FP4_BLOCK inputs of a row

__all__ = ["E4M3_MAX", "E2M1_MAX", "E2M1_VALUES", "FP8_BLOCK", "FP4_BLOCK", "e8m0_to_float", "float_to_e8m0",
           "ceil_log2", "fp8_block_dequant", "fp8_block_quant", "fp4_dequant", "fp4_quant", "e2m1_codes",
           "act_quant", "act_quant_sim", "fp4_act_quant_sim", "apply_rope"]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
ACT_AMAX_FLOOR = 1e-4               # official act_quant: amax = max(max|x|, 1e-4)
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126  # official fp4_act_quant: amax = max(max|x|, 6 * 2^-126)


def _as_bytes(t: torch.Tensor, what: str) -> torch.Tensor:
    """The raw bytes of an 8-bit tensor as uint8 (a bit reinterpretation, never a numeric cast)."""
    if t.element_size() != 1 or t.is_floating_point() and t.dtype not in (torch.float8_e8m0fnu,
                                                                         torch.float8_e4m3fn):
        raise TypeError(f"{what}: expected a 1-byte tensor (float8_e8m0fnu / int8 / uint8), got {t.dtype}")
    return t.view(torch.uint8)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode ue8m0 scales: byte e -> 2^(e-127) exactly (float32; e=0 -> 2^-127 subnormal, e=255 -> NaN).

    Args: scale: any shape, `torch.float8_e8m0fnu` (or uint8 holding the raw bytes).
    Returns: float32, same shape. Raises TypeError for any other dtype (a bf16/fp32 "scale" is the bug this
    format invites: reading the byte as a number).
    """
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"ue8m0 scale: expected dtype float8_e8m0fnu (F8_E8M0) or uint8 bytes, got {scale.dtype}")
    e = _as_bytes(scale, "ue8m0 scale").to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)  # 2^-127 is the fp32 subnormal 0x00400000
    out = bits.view(torch.float32)
    return torch.where(e == 255, torch.full_like(out, float("nan")), out)


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact `ceil(log2(x))` for positive finite float32 `x` (int32, same shape); no libm rounding involved."""
    m, e = torch.frexp(x.float())  # x = m * 2^e, m in [0.5, 1)
    return torch.where(m == 0.5, e - 1, e).to(torch.int32)


def float_to_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Encode integer exponents k (scale 2^k) as ue8m0 bytes `k + 127` (`torch.float8_e8m0fnu`).

    Raises ValueError if any k is outside the representable -127..127.
    """
    k = exponent.to(torch.int32)
    if k.numel() and (int(k.min()) < -127 or int(k.max()) > 127):
        raise ValueError(f"ue8m0 exponent out of range -127..127: min {int(k.min())}, max {int(k.max())}")
    return (k + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k exactly (float32) for the exponents the quantizers compute: `ceil_log2(max(amax, floor) / fmt_max)`
    lies in -126..126 for every finite amax (the floors are >= 2^-126 * fmt_max), and NaN / inf give k = 0, so
    no range check is needed here (a check would read k back to the host: a device sync on every activation
    quantization, which the sync-free decode path cannot have). `float_to_e8m0` keeps its check for callers."""
    return e8m0_to_float((k.to(torch.int32) + 127).to(torch.uint8).view(torch.float8_e8m0fnu))


_CONSTS: dict[tuple, torch.Tensor] = {}


def _const(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant table on `device`, made once per (values, dtype, device): an uncached
    `torch.tensor(..., device=cuda)` is a blocking host-to-device copy per call (a sync, and illegal inside
    CUDA-graph capture)."""
    key = (values, dtype, str(device))
    t = _CONSTS.get(key)
    if t is None:
        t = _CONSTS[key] = torch.tensor(values, dtype=dtype, device=device)
    return t


# ----------------------------------------------------------------------------------------------- FP8 blocks
def fp8_block_dequant(weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                      block: int = FP8_BLOCK, *, origin: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """`W[i, j] = float(Wq[i, j]) * 2^(S[i // 128, j // 128] - 127)`; spec §2. The one torch FP8 block dequantization
    (whole weights, resident linears, and the part of a weight a tensor-parallel rank reads).

    Args:
        weight: [out, in] float8_e4m3fn.
        scale: [ceil(out/128), ceil(in/128)] float8_e8m0fnu.
        origin: for a part of a larger weight (rows / columns a rank reads): where the part's element [0, 0] lies
            inside the first block of `scale` (each in 0..block-1); `scale` then holds the blocks covering the part,
            [ceil((origin[0] + out)/128), ceil((origin[1] + in)/128)].
    Returns: [out, in] `out_dtype` (exact in fp32 and bf16: a 3-bit mantissa times a power of two).
    Raises: TypeError / ValueError naming the wrong dtype or shape.
    """
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 weight: expected float8_e4m3fn, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"FP8 weight: expected 2-D [out, in], got shape {tuple(weight.shape)}")
    out, inp = weight.shape
    r0, c0 = origin
    if not (0 <= r0 < block and 0 <= c0 < block):
        raise ValueError(f"FP8 part: origin {tuple(origin)} is not inside one {block}x{block} block")
    want = (-(-(r0 + out) // block), -(-(c0 + inp) // block))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scale: expected shape {want} for weight {tuple(weight.shape)} with {block}x{block} "
                         f"blocks{f' (a part at origin {tuple(origin)} in its first block)' if r0 or c0 else ''}, "
                         f"got {tuple(scale.shape)}")
    s = e8m0_to_float(scale).repeat_interleave(block, 0)[r0:r0 + out].repeat_interleave(block, 1)[:, c0:c0 + inp]
    return (weight.float() * s).to(out_dtype)


def fp8_block_quant(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [out, in] floats to (e4m3 [out, in], ue8m0 [ceil(out/128), ceil(in/128)]), per-block amax.

    Scale `2^ceil(log2(amax / 448))` (amax floored at 448 * 2^-127, the smallest ue8m0 scale, so only an
    all-zero block gets it); values rounded to nearest e4m3 (never clamped: amax / scale <= 448). Inverse of
    `fp8_block_dequant` up to e4m3 rounding: |error| <= max(2^-4 |w|, 2^-10 * scale).
    Raises ValueError for non-2-D or non-finite input.
    """
    if w.dim() != 2 or not bool(torch.isfinite(w).all()):
        raise ValueError(f"fp8_block_quant: expected a finite 2-D tensor, got shape {tuple(w.shape)}")
    out, inp = w.shape
    ob, ib = -(-out // block), -(-inp // block)
    padded = w.new_zeros(ob * block, ib * block, dtype=torch.float32)
    padded[:out, :inp] = w.float()
    amax = padded.view(ob, block, ib, block).abs().amax(dim=(1, 3)).clamp_min(E4M3_MAX * 2.0 ** -127)
    k = ceil_log2(amax / E4M3_MAX)
    sf = _pow2(k).repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]
    q = (w.float() / sf).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, float_to_e8m0(k)


# ------------------------------------------------------------------------------------------------ FP4 e2m1
def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values in [-6, 6] to the nearest e2m1 code (ties to the even code), uint8 nibbles."""
    a = x.abs().float()
    mids = _const(_E2M1_MIDPOINTS, torch.float32, x.device)
    lo = (a[..., None] > mids).sum(-1)   # count of midpoints < a
    hi = (a[..., None] >= mids).sum(-1)  # count of midpoints <= a
    code = torch.where((lo != hi) & (hi % 2 == 0), hi, lo)  # on a tie take the even code
    return (code + torch.where(x < 0, 8, 0)).to(torch.uint8)


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    lut = _const(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), torch.float32, codes.device)
    return lut[codes.long()]


def fp4_dequant(weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                block: int = FP4_BLOCK) -> torch.Tensor:
    """`W[i, j] = e2m1(nibble(Wp[i, j // 2])) * 2^(S[i, j // 32] - 127)`, low nibble = even j; spec §2.

    Args:
        weight: [out, in/2] int8 (or uint8 / float4_e2m1fn_x2), two e2m1 codes per byte.
        scale: [out, in/32] float8_e8m0fnu.
    Returns: [out, in] `out_dtype` (exact in fp32 and bf16).
    """
    if weight.dtype not in (torch.int8, torch.uint8, torch.float4_e2m1fn_x2):
        raise TypeError(f"FP4 weight: expected packed int8 (I8), got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"FP4 weight: expected 2-D [out, in/2], got shape {tuple(weight.shape)}")
    out, half = weight.shape
    inp = 2 * half
    if inp % block or tuple(scale.shape) != (out, inp // block):
        raise ValueError(f"FP4 scale: expected shape {(out, inp // block)} for packed weight {(out, half)} "
                         f"(in={inp}, one scale per {block}), got {tuple(scale.shape)}")
    b = weight.view(torch.uint8)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(out, inp)
    s = e8m0_to_float(scale).repeat_interleave(block, 1)
    return (_e2m1_decode(codes) * s).to(out_dtype)


def fp4_quant(w: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [out, in] floats to (packed int8 [out, in/2], ue8m0 [out, in/32]); inverse of `fp4_dequant`.

    Scale per row and 32 inputs `2^ceil(log2(max(amax, 6*2^-126) / 6))`; round to nearest e2m1, ties to even.
    Raises ValueError unless `w` is finite, 2-D and in % 32 == 0.
    """
    if w.dim() != 2 or w.shape[1] % block or not bool(torch.isfinite(w).all()):
        raise ValueError(f"fp4_quant: expected a finite 2-D tensor with in % {block} == 0, got {tuple(w.shape)}")
    out, inp = w.shape
    g = w.float().view(out, inp // block, block)
    k = ceil_log2(g.abs().amax(-1).clamp_min(FP4_AMAX_FLOOR) / E2M1_MAX)
    codes = e2m1_codes((g / _pow2(k)[..., None]).clamp(-E2M1_MAX, E2M1_MAX)).view(out, inp)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), float_to_e8m0(k)


# --------------------------------------------------------------------------------------------- activations
def _groups(x: torch.Tensor, block: int, what: str) -> torch.Tensor:
    """x [..., n] -> fp32 [..., n / block, block]. Raises ValueError for a non-float tensor (an integer x would be
    quantized as if it were activations), a block that is not an int >= 1, or n not a multiple of block."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"{what}: x must be a floating-point tensor [..., n], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"{what}: block={block!r}, expected an int >= 1 (channels per scale)")
    if x.shape[-1] % block:
        raise ValueError(f"{what}: last dim {x.shape[-1]} is not a multiple of the block size {block}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def act_quant(x: torch.Tensor, block: int = 128, scale_fmt: str | None = "ue8m0"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token activation quantization of the official `act_quant` (spec §2).

    For each contiguous `block` channels: `amax = max(max|x|, 1e-4)`, `s = 2^ceil(log2(amax/448))` (ue8m0) or
    `amax/448` (`scale_fmt=None`), `xq = e4m3(clamp(x/s, -448, 448))`.

    Args: x: [..., n] any float dtype, n % block == 0.
    Returns: (xq [..., n] float8_e4m3fn, s [..., n/block] float32).
    """
    if scale_fmt not in ("ue8m0", None):
        raise ValueError(f"act_quant: scale_fmt={scale_fmt!r}, expected 'ue8m0' or None")
    g = _groups(x, block, "act_quant")
    amax = g.abs().amax(-1).clamp_min(ACT_AMAX_FLOOR)
    s = _pow2(ceil_log2(amax / E4M3_MAX)) if scale_fmt == "ue8m0" else amax / E4M3_MAX
    q = (g / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), s


def act_quant_sim(x: torch.Tensor, block: int = 128, scale_fmt: str | None = "ue8m0") -> torch.Tensor:
    """Quantize -> dequantize through `act_quant` (the in-place "QAT simulation", [F1] revision; spec §2).

    Args: x: [..., n] float, n % block == 0. Returns: [..., n] in `x.dtype` = `float(xq) * s`.
    """
    q, s = act_quant(x, block, scale_fmt)
    g = q.float().reshape(*x.shape[:-1], x.shape[-1] // block, block) * s[..., None]
    return g.reshape(x.shape).to(x.dtype)


def fp4_act_quant_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Official `fp4_act_quant(v, 32, inplace)`: per `block` channels `amax = max(max|x|, 6*2^-126)`,
    `s = 2^ceil(log2(amax/6))`, `v <- e2m1(clamp(v/s, +-6)) * s` (round to nearest, ties to even); spec §2.
    A NaN input stays NaN (the nearest-code search would map it to code 0: a quiet 0; dsv4 keeps it loud, see
    docs/differences.md).

    Args: x: [..., n] float, n % block == 0. Returns: [..., n] in `x.dtype`.
    """
    g = _groups(x, block, "fp4_act_quant_sim")
    s = _pow2(ceil_log2(g.abs().amax(-1).clamp_min(FP4_AMAX_FLOOR) / E2M1_MAX))[..., None]
    v = _e2m1_decode(e2m1_codes((g / s).clamp(-E2M1_MAX, E2M1_MAX))) * s
    v = torch.where(torch.isnan(g), g, v)  # e2m1 has no NaN code: a NaN input stays NaN, never a quiet 0
    return v.reshape(x.shape).to(x.dtype)


# ----------------------------------------------------------------------------------------------------- RoPE
def apply_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the interleaved pairs (2i, 2i+1) of the last dim of `x` by angle pos*f_i (spec §5, pitfall 4).

    x [b, s, rd] or [b, s, h, rd], any float dtype; pos int64 absolute positions, [s] (every row at the same
    positions) or [b, s] (a ragged batch: each row's own, issue 24); computed in fp32, returned in x.dtype.
    `inverse=True` rotates by -pos*f_i (the output de-rotation).
    """
    ang = pos.to(torch.float64)[..., None] * inv_freq.to(pos.device)  # [(b,) s, rd/2]
    cos, sin = ang.cos().float(), ang.sin().float()
    if inverse:
        sin = -sin
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)
