"""Number formats (spec §2): hand-made blocks with known values, then quantize -> dequantize bounds.

Expected values are written by hand from the format definitions (python floats, math.ldexp), never by the
code under test. Round-trip bounds follow from round-to-nearest: e4m3 (3 mantissa bits) errs by at most
2^-4 of a normal value and 2^-10 * scale in the subnormal range; e2m1 by at most max(s/4, |w|/4).
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4 import quant
from dsv4.testing import assert_equal

pytestmark = pytest.mark.hardstop  # checkpoint number formats (kills ue8m0_raw_byte, fp4_nibbles_swapped)

NAN = float("nan")


def _bytes(rows, dtype):
    return torch.tensor(rows, dtype=torch.uint8).view(dtype)


def test_e8m0_is_an_exponent_not_a_number():
    e = [0, 1, 119, 120, 126, 127, 128, 134, 200, 254, 255]
    got = quant.e8m0_to_float(_bytes(e, torch.float8_e8m0fnu))
    want = torch.tensor([math.ldexp(1.0, b - 127) if b != 255 else NAN for b in e], dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got[:-1], want[:-1])
    assert got[3].item() == 2.0 ** -7 and got[3].item() != 120.0  # the public-server bug: byte 120 read as 120.0
    # torch's own float8_e8m0fnu decode agrees (an independent implementation of the same format)
    assert torch.equal(got[:-1], _bytes(e, torch.float8_e8m0fnu)[:-1].float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_e8m0_rejects_numeric_scales(dtype):
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        quant.e8m0_to_float(torch.ones(2, 2, dtype=dtype))


def test_e8m0_encode_range():
    assert torch.equal(quant.float_to_e8m0(torch.tensor([-127, -7, 0, 127])).view(torch.uint8),
                       torch.tensor([0, 120, 127, 254], dtype=torch.uint8))
    with pytest.raises(ValueError, match="-127..127: min -128"):
        quant.float_to_e8m0(torch.tensor([-128, 3]))


def test_ceil_log2_exact_at_powers_of_two():
    x = torch.tensor([1.0, 2.0, 3.0, 0.5, 0.75, 448.0, 2.0 ** -30, 2.0 ** -30 * 1.0000001, 1e-4 / 448])
    assert quant.ceil_log2(x).tolist() == [0, 1, 2, -1, 0, 9, -30, -29, -22]


# e4m3 byte -> value, by the format (bias 7, 3 mantissa bits, 0x7F/0xFF NaN)
E4M3 = {0x00: 0.0, 0x80: -0.0, 0x7E: 448.0, 0xFE: -448.0, 0x01: 2.0 ** -9, 0x38: 1.0, 0xB8: -1.0,
        0x3C: 1.5, 0x08: 2.0 ** -6, 0x07: 7 * 2.0 ** -9, 0x77: 240.0, 0x6F: 120.0}


def test_fp8_block_dequant_hand_block():
    out, inp = 130, 200  # two partial blocks in each dimension
    codes = list(E4M3)
    raw = torch.tensor([[codes[(3 * i + 7 * j) % len(codes)] for j in range(inp)] for i in range(out)],
                       dtype=torch.uint8)
    sbytes = [[127, 120], [134, 60]]  # 1, 2^-7 | 2^7, 2^-67: exponents far from 127
    got = quant.fp8_block_dequant(raw.view(torch.float8_e4m3fn), _bytes(sbytes, torch.float8_e8m0fnu))
    want = torch.tensor([[math.ldexp(E4M3[int(raw[i, j])], sbytes[i // 128][j // 128] - 127) for j in range(inp)]
                         for i in range(out)], dtype=torch.float32)
    assert_equal(got, want, "fp8 dequant")
    assert got[0, 0].item() == 0.0 and got[129, 199].item() == math.ldexp(E4M3[int(raw[129, 199])], -67)
    bf = quant.fp8_block_dequant(raw.view(torch.float8_e4m3fn), _bytes(sbytes, torch.float8_e8m0fnu),
                                 out_dtype=torch.bfloat16)
    assert_equal(bf.float(), want, "fp8 dequant in bf16 is exact")


def test_fp8_block_dequant_rejects_bad_inputs():
    w = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"expected shape \(2, 1\).*got \(1, 1\)"):
        quant.fp8_block_dequant(w, torch.zeros(1, 1, dtype=torch.float8_e8m0fnu))
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        quant.fp8_block_dequant(w, torch.ones(2, 1))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        quant.fp8_block_dequant(w.float(), torch.zeros(2, 1, dtype=torch.float8_e8m0fnu))


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _nibble(c: int) -> float:
    return (-1.0 if c >> 3 else 1.0) * E2M1[c & 7]


def test_fp4_dequant_hand_block_both_nibbles():
    out, inp = 3, 64
    # 0x71: low 1 (0.5) then high 7 (6.0); 0xF8: -0 then -6; 0x9A: -1.0 then -0.5; 0x0F: -6 then 0
    pattern = [0x71, 0xF8, 0x9A, 0x0F, 0x25, 0x6E, 0xB3, 0x4C]
    packed = torch.tensor([[pattern[(k + 3 * i) % 8] for k in range(inp // 2)] for i in range(out)],
                          dtype=torch.uint8)
    sbytes = [[127, 130], [100, 200], [1, 250]]
    got = quant.fp4_dequant(packed.view(torch.int8), _bytes(sbytes, torch.float8_e8m0fnu))
    want = torch.empty(out, inp)
    for i in range(out):
        for j in range(inp):
            byte = int(packed[i, j // 2])
            c = byte & 0xF if j % 2 == 0 else byte >> 4
            want[i, j] = math.ldexp(_nibble(c), sbytes[i][j // 32] - 127)
    assert_equal(got, want, "fp4 dequant")
    assert got[0, :2].tolist() == [0.5, 6.0]  # low nibble is the even column
    with pytest.raises(ValueError, match=r"expected shape \(3, 2\)"):
        quant.fp4_dequant(packed.view(torch.int8), _bytes([[127]] * 3, torch.float8_e8m0fnu))


def test_e2m1_rounding_ties_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 5.01, -0.75, -5.0, 6.0, 0.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, -1.0, -4.0, 6.0, 0.0]
    codes = quant.e2m1_codes(x)
    assert [_nibble(int(c)) for c in codes] == want


def _spread(shape, rows, cols, g):
    """Gaussian values with each [rows, cols] block scaled by 2^k, k in -20..20 (scales over many binades)."""
    w = torch.randn(shape, generator=g)
    k = torch.randint(-20, 21, (-(-shape[0] // rows), -(-shape[1] // cols)), generator=g).float()
    return w * torch.exp2(k).repeat_interleave(rows, 0)[:shape[0]].repeat_interleave(cols, 1)[:, :shape[1]]


@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (7, 129)], ids=lambda s: "x".join(map(str, s)))
def test_fp8_roundtrip_bounds(shape, seed):
    w = _spread(shape, 128, 128, torch.Generator().manual_seed(seed))
    q, s = quant.fp8_block_quant(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert len(s.view(torch.uint8).unique()) > 1 or s.numel() == 1
    sf = quant.e8m0_to_float(s).repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[:, :shape[1]]
    amax_ratio = (w.abs() / sf).view(-1).max()
    assert amax_ratio <= 448  # no clamping ever happens
    err = (quant.fp8_block_dequant(q, s) - w).abs()
    bound = torch.maximum(w.abs() * 2.0 ** -4, sf * 2.0 ** -10)
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max())}"
    assert float(err.max()) > 0  # the round trip is lossy: a test of an identity would pass vacuously
    # the scale is the smallest power of two that fits each block's amax in 448
    blocks = torch.zeros(s.shape)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            blocks[bi, bj] = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].abs().max()
    r = blocks / quant.e8m0_to_float(s)
    assert bool(((r > 224) & (r <= 448)).all()), r


def test_fp4_roundtrip_bounds(seed):
    w = _spread((64, 256), 1, 32, torch.Generator().manual_seed(seed))
    q, s = quant.fp4_quant(w)
    assert q.shape == (64, 128) and q.dtype == torch.int8 and s.shape == (64, 8)
    assert len(s.view(torch.uint8).unique()) >= 20
    sf = quant.e8m0_to_float(s).repeat_interleave(32, 1)
    err = (quant.fp4_dequant(q, s) - w).abs()
    assert bool((err <= torch.maximum(sf / 4, w.abs() / 4)).all())
    r = w.abs().view(64, 8, 32).amax(-1) / quant.e8m0_to_float(s)
    assert bool(((r > 3) & (r <= 6)).all())
    with pytest.raises(ValueError, match="in % 32"):
        quant.fp4_quant(torch.ones(4, 48))


def test_act_quant_sim_known_values():
    x = torch.zeros(2, 128)
    x[0, :4] = torch.tensor([1.0, 0.99, 0.3, -0.3])  # amax 1 -> s = 2^ceil(log2(1/448)) = 2^-8
    got = quant.act_quant_sim(x, 128)
    # 0.99*256 = 253.44 -> 256 (e4m3 step 16 in [128, 256)); 0.3*256 = 76.8 -> 80 (step 8 in [64, 128))
    assert got[0, :4].tolist() == [1.0, 1.0, 0.3125, -0.3125]
    assert bool((got[0, 4:] == 0).all()) and bool((got[1] == 0).all())  # zero block: amax floor 1e-4, stays 0
    q, s = quant.act_quant(x, 128)
    assert s.tolist() == [[2.0 ** -8], [2.0 ** -22]]  # 1e-4/448 -> 2^ceil(-22.09)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape


def test_act_quant_sim_properties(seed):
    x = (torch.randn(3, 5, 256) * torch.exp2(torch.randint(-12, 12, (3, 5, 1)).float())).bfloat16()
    y = quant.act_quant_sim(x, 64)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(quant.act_quant_sim(y, 64), y)  # idempotent: values already on the grid
    assert bool(((y.float() - x.float()).abs() <= x.float().abs() * 2.0 ** -4 + 1e-30).all())
    assert not torch.equal(y, x)
    with pytest.raises(ValueError, match="not a multiple of the block size 128"):
        quant.act_quant_sim(torch.ones(2, 96), 128)


def test_fp4_act_quant_sim_known_values():
    x = torch.zeros(2, 32)
    x[0, :5] = torch.tensor([6.0, 0.3, 2.6, 5.2, -0.2])  # amax 6 -> s = 1
    x[1, :2] = torch.tensor([12.0, 5.0])  # amax 12 -> s = 2; 5/2 = 2.5 ties to even -> 2 -> 4.0
    y = quant.fp4_act_quant_sim(x.bfloat16(), 32)
    assert y.dtype == torch.bfloat16
    assert y[0, :5].float().tolist() == [6.0, 0.5, 3.0, 6.0, -0.0]
    assert y[1, :2].float().tolist() == [12.0, 4.0]


def test_fp8_block_dequant_of_a_part_is_the_narrow_of_the_whole():
    """The one torch FP8 block dequantization also serves a rank's part (rows or columns not starting on a block):
    the part with the scale blocks that cover it, at `origin` in the first block, equals the whole narrowed."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 260, generator=g)
    q, s = quant.fp8_block_quant(w)
    whole = quant.fp8_block_dequant(q, s)
    for dim, start, n in [(0, 100, 60), (0, 128, 128), (1, 33, 200), (1, 0, 260), (0, 299, 1)]:
        b0, b1 = start // 128, -(-(start + n) // 128)
        part, sp = q.narrow(dim, start, n), s.narrow(dim, b0, b1 - b0)
        origin = (start - b0 * 128, 0) if dim == 0 else (0, start - b0 * 128)
        assert torch.equal(quant.fp8_block_dequant(part, sp, origin=origin), whole.narrow(dim, start, n))
    with pytest.raises(ValueError, match="FP8 scale: expected shape"):
        quant.fp8_block_dequant(q[100:160], s[0:1], origin=(100, 0))  # rows 100..159 span blocks 0 and 1
    with pytest.raises(ValueError, match="origin"):
        quant.fp8_block_dequant(q, s, origin=(128, 0))


@pytest.mark.parametrize("x,block,match", [
    (torch.randn(2, 128), 0, r"act_quant: block=0, expected an int >= 1"),  # was a ZeroDivisionError
    (torch.randn(2, 128), True, r"act_quant: block=True, expected an int >= 1"),
    (torch.ones(2, 128, dtype=torch.int32), 128, r"act_quant: x must be a floating-point tensor"),  # was quantized
])
def test_reference_act_quant_refuses_a_bad_block_or_integer_input(x, block, match):
    from kernels.numerics import act_quant
    with pytest.raises(ValueError, match=match):
        act_quant(x, block)
    q, s = act_quant(torch.randn(2, 256), 128)  # control
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 2)


@pytest.mark.parametrize("kw,match", [
    (dict(weight=torch.rand(3, 64)), r"weight must be \[d\] = \[64\], got \(3, 64\)"),  # broadcast to 3 rows
    (dict(weight=torch.rand(1)), r"weight must be \[d\] = \[64\], got \(1,\)"),
    (dict(eps=-1.0), r"eps=-1.0, expected a finite number > 0"),
    (dict(eps=0.0), r"eps=0.0, expected a finite number > 0"),
    (dict(x=torch.ones(1, 64, dtype=torch.int32)), r"x must be a floating-point tensor"),
])
def test_reference_rms_norm_refuses_what_would_broadcast_or_divide_by_zero(kw, match):
    """`rms_norm_ref` broadcast a [3, d] or [1] weight and took eps <= 0 or an integer x (the Triton `rms_norm`
    refused each); now the same refusals, naming the argument."""
    from kernels.norm import rms_norm_ref
    args = dict(x=torch.randn(1, 64), weight=torch.rand(64), eps=1e-6)
    with pytest.raises(ValueError, match=match):
        rms_norm_ref(**{**args, **kw})
    y = rms_norm_ref(**args)  # control: the formula
    x, w = args["x"], args["weight"]
    assert torch.allclose(y, w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), rtol=1e-6, atol=0)


def test_reference_swiglu_and_moe_combine_refuse_shapes_that_would_broadcast():
    """`swiglu(u [2, 8], v [1, 8])` and `moe_combine_ref(y [2, 8], shared [1, 8])` broadcast one row over two; a
    routing weight [N] (not [N, 1]) would scale the columns. Each is now a ValueError; controls compute."""
    from kernels.moe import moe_combine_ref, swiglu
    u, v = torch.randn(2, 8), torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"swiglu: u, v"):
        swiglu(u, v[:1], 10.0)
    with pytest.raises(ValueError, match=r"swiglu: weight"):
        swiglu(u, v, 10.0, torch.rand(2))
    g = torch.rand(2, 1)
    want = torch.nn.functional.silu(u.clamp(max=10.0)) * v.clamp(-10.0, 10.0) * g
    assert torch.equal(swiglu(u, v, 10.0, g), want)
    y, sh = torch.randn(2, 8), torch.randn(2, 8).bfloat16()
    with pytest.raises(ValueError, match=r"moe_combine_ref: y, shared"):
        moe_combine_ref(y, sh[:1])
    with pytest.raises(ValueError, match=r"moe_combine_ref: y, shared"):
        moe_combine_ref(y.bfloat16(), sh)
    assert torch.equal(moe_combine_ref(y, sh), (y + sh.float()).bfloat16())


def test_reference_rope_tail_refuses_what_the_launcher_refuses():
    """`rope_tail_ref` took an odd / too-large rd, fractional (float) positions, an fp32 inv_freq of any length and
    tensors on two devices without a word (torch broadcast or failed deep inside); now the launcher's checks
    (`kernels.rope.check_rope_tail`), for any float x."""
    from kernels.numerics import apply_rope
    from kernels.rope import rope_tail_ref
    x, pos, f = torch.randn(2, 3, 64), torch.arange(3) * 1000, torch.rand(16, dtype=torch.float64)
    for kw, match in [(dict(rd=33), "rd is 33"), (dict(rd=True), "rd is True"), (dict(rd=66), "rd is 66"),
                      (dict(pos=pos.double() + 0.5), "pos is torch.float64"), (dict(pos=pos[:2]), r"shape \(2,\)"),
                      (dict(inv_freq=f.float()), "inv_freq is torch.float32"), (dict(inv_freq=f[:8]), r"\(8,\)"),
                      (dict(x=x.long()), "x is torch.int64"), (dict(inverse=1), "inverse is 1")]:
        args = dict(x=x, pos=pos, inv_freq=f, rd=32, inverse=False)
        with pytest.raises(ValueError, match=match):
            rope_tail_ref(**{**args, **kw})
    got = rope_tail_ref(x.half(), pos, f, 32, inverse=True)  # control: any float dtype, the formula
    assert torch.equal(got[..., :32], x.half()[..., :32])
    assert torch.equal(got[..., 32:], apply_rope(x.half()[..., 32:], pos, f, inverse=True))


def test_reference_linears_refuse_a_missing_scale_and_a_wrong_width():
    """`linear_ref` / `dequantize_ref` with FP8 codes and no scale raised AttributeError deep in the dequantizer,
    a scale beside a bf16 weight was ignored, x of the wrong width failed in the matmul; `fp32_linear_ref`
    likewise; each is now a ValueError naming the argument. Controls compute the formula."""
    from kernels.fp32_linear import fp32_linear_ref
    from kernels.gemm import dequantize_ref, linear_ref
    from kernels.numerics import fp8_block_quant
    w = torch.randn(256, 256)
    q, s = fp8_block_quant(w)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"dequantize_ref: scale is None"):
        linear_ref(x, q, None)
    with pytest.raises(ValueError, match=r"dequantize_ref: scale is given"):
        dequantize_ref(w.bfloat16(), s, torch.bfloat16)
    with pytest.raises(ValueError, match=r"dequantize_ref: weight is torch.int32"):
        dequantize_ref(w.int(), None, torch.bfloat16)
    with pytest.raises(ValueError, match=r"linear_ref: x is width 128"):
        linear_ref(x[:, :128], q, s)
    with pytest.raises(ValueError, match=r"linear_ref: act_block is -1"):
        linear_ref(x, q, s, act_block=-1)
    with pytest.raises(ValueError, match=r"linear_ref: fp32 is 1"):
        linear_ref(x, w, fp32=1)
    with pytest.raises(ValueError, match=r"fp32_linear_ref: x is torch.bfloat16 shape \(3, 128\)"):
        fp32_linear_ref(x[:, :128], w)
    with pytest.raises(ValueError, match=r"fp32_linear_ref: weight is torch.float16"):
        fp32_linear_ref(x, w.half())
    wd = dequantize_ref(q, s, torch.float32)
    assert torch.equal(linear_ref(x, q, s), (x.float() @ wd.bfloat16().float().T).bfloat16())
    assert torch.equal(fp32_linear_ref(x, w.bfloat16()), x.float() @ w.bfloat16().float().T)


def test_reference_grouped_linear_refuses_a_weight_of_the_wrong_shape():
    """`grouped_linear_ref` reshaped the weight with `.view(G, -1, i)` (element count only): a [512, 64] weight
    beside o [.., 2, 128] ran, a [256, 32] one changed the output width, a 3-D o failed inside einsum and an int64
    o returned int64. Now ValueErrors naming o / the weight; controls: the per-group product, FP8 and FP4 codes."""
    from kernels.gemm import dequantize_ref, grouped_linear_ref
    from kernels.numerics import fp4_quant, fp8_block_quant
    o = torch.randn(1, 1, 2, 128).bfloat16()
    for w, match in ((torch.randn(512, 64).bfloat16(), r"weight is torch.bfloat16 shape \(512, 64\)"),
                     (torch.randn(256, 32).bfloat16(), r"weight is torch.bfloat16 shape \(256, 32\)"),
                     (torch.randn(255, 128).bfloat16(), r"weight is torch.bfloat16 shape \(255, 128\)"),
                     (torch.randn(0, 128).bfloat16(), r"weight is torch.bfloat16 shape \(0, 128\)")):
        with pytest.raises(ValueError, match=r"grouped_linear_ref: " + match + r".*\[G\*o_rank, i\] = \[2\*o_rank, 128\]"):
            grouped_linear_ref(o, w)
    with pytest.raises(ValueError, match=r"grouped_linear_ref: o is torch.float32 shape \(2, 2, 8\)"):
        grouped_linear_ref(torch.randn(2, 2, 8), torch.randn(16, 8))
    with pytest.raises(ValueError, match=r"grouped_linear_ref: o is torch.int64 shape \(1, 2, 2, 8\)"):
        grouped_linear_ref(torch.randn(1, 2, 2, 8).long(), torch.randn(16, 8))
    o = torch.randn(1, 2, 2, 8)
    w = torch.randn(6, 8)  # control: 3 rows per group
    want = torch.stack([o[:, :, g] @ w[3 * g:3 * g + 3].T for g in range(2)], 2)
    torch.testing.assert_close(grouped_linear_ref(o, w), want, rtol=1e-6, atol=1e-6)
    q, s = fp8_block_quant(torch.randn(256, 128))
    ob = torch.randn(1, 1, 2, 128).bfloat16()
    wd = dequantize_ref(q, s, torch.float32)
    want = torch.stack([ob[:, :, g].float() @ wd[128 * g:128 * g + 128].T for g in range(2)], 2).bfloat16()
    assert torch.equal(grouped_linear_ref(ob, q, s), want)
    p, ps = fp4_quant(torch.randn(256, 128))  # packed FP4: [256, 64] int8 holds 128 inputs per row
    assert grouped_linear_ref(ob, p, ps).shape == (1, 1, 2, 128)


def test_reference_swiglu_joint_and_route_refuse_bad_arguments():
    """`swiglu_joint_ref` split an odd width unevenly and took a negative limit; `route_ref` raised torch's
    IndexError (or read past the row on CUDA) for a hash id outside [0, E). Now ValueErrors; controls compute."""
    from kernels.moe import swiglu, swiglu_joint_ref
    from kernels.router import route_ref
    uv = torch.randn(2, 16)
    with pytest.raises(ValueError, match=r"swiglu_joint_ref: uv"):
        swiglu_joint_ref(uv[:, :15], 10.0)
    with pytest.raises(ValueError, match=r"swiglu_joint_ref: limit is -1.0"):
        swiglu_joint_ref(uv, -1.0)
    assert torch.equal(swiglu_joint_ref(uv, 10.0), swiglu(uv[:, :8], uv[:, 8:], 10.0))
    logits = torch.randn(3, 8)
    for bad in (8, -1):
        ids = torch.tensor([[0, 1], [2, 3], [4, bad]])
        with pytest.raises(ValueError, match=rf"route_ref: hash_ids is ids in \[{min(bad, 0)}, {max(bad, 4)}\]"):
            route_ref(logits, None, ids, 2, "sqrtsoftplus", 1.5)
    ids = torch.tensor([[0, 7], [2, 3], [4, 5]])
    w, got = route_ref(logits, None, ids, 2, "sqrtsoftplus", 1.5)
    sc = torch.nn.functional.softplus(logits).sqrt().gather(1, ids)
    assert got is ids and torch.allclose(w, sc / sc.sum(1, keepdim=True) * 1.5, rtol=2 ** -21, atol=0)
