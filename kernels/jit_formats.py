"""In-kernel number formats: the `@triton.jit` helpers every kernel module shares (ue8m0 / e4m3 decoding, the
e4m3 and bf16 rounding by bit arithmetic, the official act_quant scale, the fp8 dots).

They were the first section of `kernels.gemm` (which re-exports them); a module of their own so that
`kernels.quant` (the activation quantization kernels) and `kernels.gemm` (which launches them) import them without
an import cycle. Torch references of the same formats: `kernels.numerics`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e8m0_to_f32(e):
    """ue8m0 byte (int32 0..255) -> 2^(e-127) fp32 exactly (e=0: the subnormal 2^-127, e=255: NaN)."""
    bits = tl.where(e == 0, 0x400000, e << 23)
    bits = tl.where(e == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_e4m3(y):
    """Round fp32 `y` (|y| <= 448) to the nearest e4m3 value, ties to even, as fp32 (exact on the grid).

    Normal range (|y| >= 2^-6): keep 3 mantissa bits by integer round-half-even on the fp32 bits (a carry moves
    into the exponent, as it must). Subnormal range: multiples of 2^-9 via the fp32 add of 1.5*2^14 (whose ulp is
    2^-9; round-to-nearest-even by IEEE addition). Never uses the fp8 cast, whose interpreter emulation rounds ties
    away from zero and flushes subnormals."""
    bits = y.to(tl.int32, bitcast=True)
    keep = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF
    normal = keep.to(tl.float32, bitcast=True)
    r = (tl.abs(y) + 24576.0) - 24576.0
    # the sign BIT: -0.0 (also from an underflowed x * 2^-k) stays -0, as torch's cast; set by an integer op (the
    # GPU build of `where(bits < 0, -r, r)` returned +0.0 for a zero r, the interpreter -0.0)
    rb = r.to(tl.int32, bitcast=True)
    sub = tl.where(bits < 0, rb | -2147483648, rb).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(y) >= 0.015625, normal, sub)


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even) as fp32, by integer rounding of the bits; +-inf stay inf,
    finite values beyond the largest bf16 become inf (as the GPU's cast), and NaN stays NaN whatever its payload
    (quieted, so that a bf16 truncation of it is a NaN as well).
    The following `.to(tl.bfloat16)` is then exact everywhere; the triton 3.9 interpreter's own cast truncates.
    The NaN select matters: the integer add overflows for a NaN whose mantissa is >= 0x7F8000 (the GPU's
    canonical NaN 0x7FFFFFFF is one) and would turn it into -0.0 or +0.0, hiding exactly the NaN that the
    kernels' fail-loud guards produce (tests/unit/test_kernel_edges.py::test_round_bf16_bit_patterns)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & ~0xFFFF).to(tl.float32, bitcast=True)
    quiet = (bits | 0x400000).to(tl.float32, bitcast=True)  # NaN in the upper 16 bits too (signalling NaNs)
    return tl.where(x != x, quiet, rounded)


@triton.jit
def cast_for_store(x, ptr):
    """fp32 x -> the element type of `ptr` for a `tl.store`, rounding to the nearest bf16 (ties to even) through
    `round_bf16` when that type is bf16: the GPU's cast gives the same values, and the interpreter's own cast
    (which truncates) would otherwise make CPU results one ulp off the torch references in about half the
    elements, too coarse for the bitwise-fraction checks of the tests."""
    if ptr.dtype.element_ty == tl.bfloat16:
        x = round_bf16(x)
    return x.to(ptr.dtype.element_ty)


@triton.jit
def e4m3_to_f32(b):
    """float8e4nv tensor -> fp32 by integer decoding (exact, subnormals kept, the NaN codes 0x7F / 0xFF NaN; the
    interpreter-proof route)."""
    v = b.to(tl.uint8, bitcast=True).to(tl.int32)
    e = (v >> 3) & 15
    m = v & 7
    normal = (((v & 0x80) << 24) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    sub = tl.where((v & 0x80) != 0, -sub, sub)
    return tl.where((v & 0x7F) == 0x7F, float("nan"), tl.where(e == 0, sub, normal))  # 0x7F / 0xFF: e4m3fn NaN


@triton.jit
def dot_q_w(q, w, MMA: tl.constexpr):
    """`q @ w^T`, fp32 accumulation: q [R, C] fp32 values on the e4m3 grid, w [S, C] float8e4nv.
    MMA 2: e4m3 tensor-core dot (the official Hopper path); 1: both widened to bf16 (exact); 0: fp32 dot with
    input_precision="ieee" on integer-decoded values (the interpreter, whose bf16/fp8 casts and dots are not
    faithful in triton 3.9). All three multiply the same exact values."""
    if MMA == 2:
        return tl.dot(q.to(tl.float8e4nv), tl.trans(w))
    elif MMA == 1:
        return tl.dot(q.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
    else:
        return tl.dot(q, tl.trans(e4m3_to_f32(w)), input_precision="ieee")


@triton.jit
def dot_w_w(a, b, MMA: tl.constexpr):
    """`a @ b^T` of two float8e4nv tiles [R, C], [S, C] (fp32 accumulation), MMA as in `dot_q_w`."""
    if MMA == 2:
        return tl.dot(a, tl.trans(b))
    elif MMA == 1:
        return tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)))
    else:
        return tl.dot(e4m3_to_f32(a), tl.trans(e4m3_to_f32(b)), input_precision="ieee")


@triton.jit
def e4m3_bits(q):
    """e4m3 byte (int32 0..255) of an fp32 value already on the e4m3 grid (|q| <= 448): sign<<7 | exp<<3 | man,
    subnormals exp=0 man=q/2^-9. Bit assembly instead of the fp8 cast (the interpreter's cast flushes subnormals)."""
    bits = q.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    e = ((bits >> 23) & 0xFF) - 127 + 7
    normal = (e << 3) | ((bits >> 20) & 7)
    sub = (tl.abs(q) * 512.0).to(tl.int32)
    return tl.where(q != q, sign | 0x7F, sign | tl.where(e >= 1, normal, sub))  # NaN -> the e4m3fn NaN code


@triton.jit
def act_scale(x, AXIS: tl.constexpr = 1):
    """Official act_quant scale of one [R, 128] fp32 tile (spec §2): per row `amax = max(max|x|, 1e-4)`,
    `k = ceil(log2(amax / 448))`. Returns (2^-k, 2^k), both [R] fp32 (AXIS 0: x is one [128] block, both scalars).

    ceil(log2(amax/448)) without a division: amax = m * 2^e0 (m in [1, 2)), 448 = 1.75 * 2^8, so k = e0 - 8 + (m >
    1.75), i.e. + (mantissa bits > 0x600000) - exact, and equal to torch's fp32 `amax / 448` route. A row with a
    NaN or an inf gets k = 0, as the reference (`_nonfinite_rows`)."""
    return _scale_of_amax(tl.max(tl.abs(x), axis=AXIS), _nonfinite_rows(x, AXIS))


@triton.jit
def _scale_of_amax(m, bad):
    """`act_scale` from each block's max |x| m and whether it holds a NaN / inf (bad): (2^-k, 2^k) fp32."""
    amax = tl.maximum(m, 1e-4)
    ab = amax.to(tl.int32, bitcast=True)
    k = ((ab >> 23) & 0xFF) - 127 - 8 + ((ab & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.where(bad, 0, k)
    return ((127 - k) << 23).to(tl.float32, bitcast=True), ((127 + k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _nonfinite_rows(x, AXIS: tl.constexpr = 1):
    """[R] bool: the row of the [R, C] tile holds a NaN or an inf. The reference's scale is then 2^0 (torch's
    frexp gives exponent 0 for NaN and inf), so the kernels use k = 0 there too: an inf saturates to +-448 and
    the other values keep their scale-1 codes, exactly as `dsv4.quant.act_quant`; NaNs stay NaN (`act_apply`)."""
    return tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=AXIS) > 0


@triton.jit
def act_apply(x, inv, AXIS: tl.constexpr = 1):
    """`e4m3(clamp(x * inv, +-448))` as fp32 on the e4m3 grid; x [R, C], inv [R] from `act_scale` (AXIS 0: x
    [C], inv a scalar). A NaN stays NaN (the GPU's min / max would drop it and the bit rounding would make it a
    number: a NaN activation must reach the output, as in the reference)."""
    if AXIS == 1:
        inv = inv[:, None]
    return tl.where(x != x, x, round_e4m3(tl.minimum(tl.maximum(x * inv, -448.0), 448.0)))


@triton.jit
def act_quant_block(x):
    """Official act_quant of one [R, 128] fp32 tile: (q [R, 128] fp32 on the e4m3 grid, s = 2^k [R] fp32)."""
    inv, s = act_scale(x)
    return act_apply(x, inv), s


@triton.jit
def act_quant_codes_pairs(xe, xo, NB: tl.constexpr):
    """The official act_quant (128-input blocks) of NB consecutive blocks held as their even and odd inputs xe, xo
    [NB * 64] fp32 (the FP4 kernels' layout: low / high nibble): (qe, qo, s) with qe / qo the e4m3 code values
    e4m3(x / 2^k) (fp32, on the e4m3 grid, same layout) and s [NB] the blocks' scales 2^k; q * s is bitwise
    `kernels.quant.act_quant_sim`'s value. One block's scale from the max |x| of both halves; a block with a NaN or
    an inf gets k = 0 and a NaN stays NaN (`act_scale`, `act_apply`)."""
    e2 = tl.reshape(xe, (NB, 64))
    o2 = tl.reshape(xo, (NB, 64))
    m = tl.maximum(tl.max(tl.abs(e2), axis=1), tl.max(tl.abs(o2), axis=1))
    inv, sc = _scale_of_amax(m, _nonfinite_rows(e2) | _nonfinite_rows(o2))
    return tl.reshape(act_apply(e2, inv), (NB * 64,)), tl.reshape(act_apply(o2, inv), (NB * 64,)), sc
