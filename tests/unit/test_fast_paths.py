"""The triton backend's model-level entries (`kernels.gemm.linear` / `grouped_linear`,
`kernels.fp32_linear.fp32_linear_op`, `kernels.moe.moe_routed`; table in dsv4/backend.py) against the reference
entries, at tiny widths that
are multiples of 128 (so the FP8 / FP4 kernels run; Triton interpreter on CPU).

Tolerances (bf16 outputs): the fast linears multiply the same exact bf16 operands as the reference with fp32
accumulation in another order, so outputs differ by at most one bf16 rounding of the same fp32 value:
rtol 2^-7 (one bf16 ulp), atol 1e-6. The routed experts additionally round u, v and h to bf16 at the same points
as the reference; an activation that flips one FP8 code of h changes that slot's output by at most one e4m3 step
(2^-3 relative of that element), hence the looser rtol 2^-3 on the fp32 sum with a median check below one ulp.
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.testing import fill_random_quantized_
from dsv4.tiny import tiny_args
from kernels import fp32_linear as kfp32
from kernels import gemm as kgemm
from kernels import moe as kmoe
from kernels.gemm import grouped_linear_ref, linear_ref
from kernels.moe import moe_routed_ref

pytestmark = [pytest.mark.hardstop,  # kernel / fast path vs reference (issue 22 item 4)
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 (CPU) - CI sets it for the unit run")]

ULP = 2.0 ** -7


@pytest.fixture(scope="module")
def model():
    from dsv4.model import Transformer
    args = tiny_args(vocab_size=256, dim=128, moe_inter_dim=128, q_lora_rank=128, head_dim=128, rope_head_dim=64,
                     o_lora_rank=128, index_head_dim=128, n_layers=2, compress_ratios=(0, 4, 0))
    m = Transformer(args, dtype=torch.bfloat16, backend="triton", weights="quantized")
    fill_random_quantized_(m, seed=7)
    return m


def _close(a, b, rtol, what):
    err = (a.float() - b.float()).abs()
    bound = rtol * b.float().abs() + 1e-6
    assert bool((err <= bound).all()), f"{what}: max excess {(err - bound).max():.3e}"


def test_fp8_linear_matches_reference(model):
    attn = model.layers[0].attn
    for lin, k in ((attn.wq_a, 128), (attn.wo_b, 256), (model.layers[0].ffn.shared_experts.w2, 128)):
        x = torch.randn(3, 5, k).to(torch.bfloat16)
        assert lin.fmt == "fp8" and lin.kernel is kgemm.linear
        args = (lin.codes, lin.scales, lin.sim.act_block(x))
        _close(kgemm.linear(x, *args), linear_ref(x, *args), ULP, f"linear {tuple(lin.codes.shape)}")


@pytest.mark.parametrize("rows", [(2, 3), (1, 70)], ids=["decode_gemv", "prefill_mm"])
def test_fp32_linears_read_the_bf16_weight(model, rows, monkeypatch, seed):
    """Compressor wkv / wgate, head and router gate (held bf16 as on disk, weights="quantized") run
    `kernels.fp32_linear` (the spy counts launches up to GEMV_MAX_M rows; above, its torch.mm path - on the CPU
    the upcast + fp32 torch.mm, bitwise the reference; on CUDA bf16 x takes the bf16 GEMM with an fp32 output)
    and stay within the fp32 summation bound of `fp32_linear_ref` (tests/unit/test_fp32_linear.py); fp32 out."""
    import kernels.fp32_linear as kf
    from tests.unit.test_fp32_linear import within_fp32_sum_bound
    calls = []
    real = kf._bf16w_gemv_kernel
    monkeypatch.setattr(kf, "_bf16w_gemv_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: (lambda *a, **k: calls.append(1) or real[grid](*a, **k))})())
    comp, gate = model.layers[1].attn.compressor, model.layers[1].ffn.gate
    assert gate.kernel is kfp32.fp32_linear_op and gate.weight.dtype == torch.bfloat16
    for lin in (comp.wkv, comp.wgate, model.head):
        assert lin.fmt == "bf16" and lin.kernel is kgemm.linear
        x = torch.randn(*rows, 128).to(torch.bfloat16)
        y, want = kgemm.linear(x, lin.codes, fp32=True), linear_ref(x, lin.codes, fp32=True)
        w = lin.codes.float()
        within_fp32_sum_bound(y.reshape(-1, y.shape[-1]), want.reshape(-1, y.shape[-1]),
                              x.reshape(-1, 128).float(), w, f"{tuple(w.shape)} linear")
    x = torch.randn(rows[0] * rows[1], 128)
    within_fp32_sum_bound(gate.kernel(x, gate.weight), x @ gate.weight.float().T, x, gate.weight.float(), "gate")
    assert len(calls) == (4 if rows[0] * rows[1] <= kf.GEMV_MAX_M else 0)


def test_fp32_linear_of_an_fp32_weight_is_the_reference():
    """The dequantized model's fp32 weights keep the reference maths (fp32 cuBLAS / CPU GEMM), bitwise."""
    x, w = torch.randn(3, 64).to(torch.bfloat16), torch.randn(40, 64)
    assert torch.equal(kfp32.fp32_linear_op(x, w), x.float() @ w.T)


@pytest.mark.parametrize("rows", [(2, 3), (1, 70)], ids=["decode_gemv", "prefill_bmm"])
def test_grouped_wo_a_matches_reference(model, rows, monkeypatch, seed):
    """Both wo_a paths (FP8 grouped GEMV at b*s <= GEMV_MAX_M, dequant + bmm beyond) equal the reference within
    one bf16 rounding, and >= 90 % of outputs bitwise; the spy proves which path ran."""
    import kernels.gemm as kg
    from dsv4.testing import assert_mostly_bitwise
    calls = []
    real = kg.fp8_grouped_gemv
    monkeypatch.setattr(kg, "fp8_grouped_gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    attn = model.layers[0].attn
    o = torch.randn(*rows, attn.groups, attn.n_heads * attn.hd // attn.groups).to(torch.bfloat16)
    args = (attn.wo_a.codes, attn.wo_a.scales)
    got, want = kgemm.grouped_linear(o, *args), grouped_linear_ref(o, *args)
    assert len(calls) == (1 if rows[0] * rows[1] <= kg.GEMV_MAX_M else 0)
    _close(got, want, ULP, "grouped wo_a")
    assert_mostly_bitwise(got, want, "grouped wo_a")


def test_grouped_moe_matches_reference_loop(model):
    moe = model.layers[1].ffn
    assert moe.stacked is not None and moe.routed is kmoe.moe_routed
    x = torch.randn(9, 128).to(torch.bfloat16)
    w, ids = moe.gate(x, torch.randint(0, 256, (9,)))
    act = (moe.sim.act_block(x), moe.sim.act_block_of(moe.inter_dim))
    a, b = kmoe.moe_routed(x, w, ids, moe.stacked, moe.limit, act), moe_routed_ref(x, w, ids, moe.stacked, moe.limit, act)
    _close(a, b, 2.0 ** -3, "routed experts")
    rel = ((a - b).abs() / b.abs().clamp_min(1e-6)).median()
    assert rel <= ULP, f"median relative error {rel:.2e} > one bf16 ulp"
    # the same weights per expert (not stacked): the triton entry's loop, each GEMM through the triton `linear`
    held = moe.expert_weights()
    a = kmoe.moe_routed(x, w, ids, held, moe.limit, act)
    assert torch.equal(b, moe_routed_ref(x, w, ids, held, moe.limit, act)), "stacked views != per-expert weights"
    _close(a, b, 2.0 ** -3, "routed experts, per-expert loop")


def test_fp8_grouped_gemv_names_bad_input():
    from dsv4 import quant
    from kernels.gemm import fp8_grouped_gemv
    w, s = quant.fp8_block_quant(torch.randn(256, 128))
    x = torch.randn(3, 256).to(torch.bfloat16)
    with pytest.raises(ValueError, match="groups is 0"):
        fp8_grouped_gemv(x, w, s, 0)
    with pytest.raises(ValueError, match=r"x is shape \(3, 128\)"):
        fp8_grouped_gemv(x[:, :128], w, s, 2)
    with pytest.raises(ValueError, match="x is dtype torch.float32"):
        fp8_grouped_gemv(x.float(), w, s, 2)
    with pytest.raises(ValueError, match="at most GEMV_MAX_M"):
        fp8_grouped_gemv(torch.randn(65, 256).to(torch.bfloat16), w, s, 2)
    with pytest.raises(ValueError, match="N = 64 rows per group"):
        fp8_grouped_gemv(torch.randn(3, 512).to(torch.bfloat16), w, torch.full((2, 1), 127, dtype=torch.uint8).view(
            torch.float8_e8m0fnu), 4)


def test_fp8_grouped_gemv_refuses_empty_and_strided_input():
    from dsv4 import quant
    from kernels.gemm import fp8_grouped_gemv
    w, s = quant.fp8_block_quant(torch.randn(256, 128))
    with pytest.raises(ValueError, match="N = 0 rows per group"):
        fp8_grouped_gemv(torch.randn(3, 256).to(torch.bfloat16), w[:0], s[:0], 2)
    with pytest.raises(ValueError, match="non-contiguous"):
        fp8_grouped_gemv(torch.randn(256, 3).to(torch.bfloat16).T, w, s, 2)


def test_grouped_linear_refuses_a_weight_of_the_wrong_shape():
    """`grouped_linear` only checked the weight's element count (`.view(G, -1, i)`): a [512, 64] weight beside o
    [.., 2, 128] ran (garbage), a [256, 32] one beside o [.., 2, 64] changed the output width; a 3-D o failed in
    torch and an int64 o was run. Now ValueErrors naming o / the weight (bf16 bmm and FP8 paths); control: the
    per-group product."""
    from dsv4 import quant
    o = torch.randn(1, 1, 2, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"grouped_linear: weight is torch.bfloat16 shape \(512, 64\)"):
        kgemm.grouped_linear(o, torch.randn(512, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"grouped_linear: weight is torch.bfloat16 shape \(256, 32\)"):
        kgemm.grouped_linear(o[..., :64], torch.randn(256, 32).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"grouped_linear: weight is torch.float32 shape \(15, 8\)"):
        kgemm.grouped_linear(torch.randn(1, 2, 2, 8).to(torch.bfloat16), torch.randn(15, 8))
    w, s = quant.fp8_block_quant(torch.randn(256, 256))  # 256 inputs beside o's 128: the FP8 GEMV's x check
    with pytest.raises(ValueError, match=r"grouped_linear: weight is torch.float8_e4m3fn shape \(256, 256\)"):
        kgemm.grouped_linear(o, w, s)
    with pytest.raises(ValueError, match=r"grouped_linear: o is torch.bfloat16 shape \(1, 2, 128\)"):
        kgemm.grouped_linear(o[0], torch.randn(256, 128).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"grouped_linear: o is torch.int64 shape"):
        kgemm.grouped_linear(o.long(), torch.randn(256, 128).to(torch.bfloat16))
    w = torch.randn(6, 8).to(torch.bfloat16)  # control: 3 rows per group
    ob = torch.randn(1, 2, 2, 8).to(torch.bfloat16)
    got = kgemm.grouped_linear(ob, w)
    want = torch.stack([(ob[:, :, g].float() @ w[3 * g:3 * g + 3].float().T) for g in range(2)], 2).to(torch.bfloat16)
    assert got.shape == (1, 2, 2, 3) and torch.equal(got, want)


def test_linear_honours_act_block_and_refuses_what_linear_ref_refuses():
    """The triton `linear` quantized every 128-multiple width in blocks of 128 whatever act_block said (64 gave
    an error of 0.031 against `linear_ref`), and took act_block -1 / True / 128.0, fp32="yes" (misleading error
    from fp32_linear_ref) and an FP8 weight without scale ("scale is shape ()"). Now act_block is honoured (the
    reference's quantizer for blocks other than 128) and the bad values are ValueErrors naming the argument;
    control: act_block 64 and 128 give linear_ref's values and differ from each other."""
    from dsv4 import quant
    from kernels.numerics import act_quant_sim
    x = torch.randn(2, 256)
    x[:, :64] *= 1e-5  # 2^-17 below the rest of a 128 block: e4m3 flushes them to 0 there, not in their own block
    x = x.to(torch.bfloat16)
    w = torch.randn(128, 256)
    w[:, 64:] = 0  # the output is made of the first 64 channels only
    q, s = quant.fp8_block_quant(w)
    w = w.to(torch.bfloat16)
    y64 = kgemm.linear(x, w, None, 64)
    assert torch.equal(y64, (act_quant_sim(x, 64).float() @ w.float().T).to(torch.bfloat16))
    assert torch.equal(y64, linear_ref(x, w, None, 64))
    assert not torch.equal(y64, kgemm.linear(x, w, None, 128))
    _close(kgemm.linear(x, q, s, 64), linear_ref(x, q, s, 64), ULP, "FP8 weight, act_block 64")
    assert not torch.equal(kgemm.linear(x, q, s, 64), kgemm.linear(x, q, s, 128))
    for bad in (-1, True, 128.0):
        with pytest.raises(ValueError, match=rf"linear: act_block is {bad!r}; expected an int >= 0"):
            kgemm.linear(x, w, None, bad)
    with pytest.raises(ValueError, match=r"multiple of the block size 7"):
        kgemm.linear(x, w, None, 7)
    with pytest.raises(ValueError, match=r"linear: fp32 is 'yes'; expected a bool"):
        kgemm.linear(x, w, fp32="yes")
    with pytest.raises(ValueError, match=r"linear: scale is None; expected the float8_e8m0fnu scales"):
        kgemm.linear(x, q, None, 128)
    with pytest.raises(ValueError, match=r"fp8_linear: scale is None"):
        kgemm.fp8_linear(x, q, None)
    with pytest.raises(ValueError, match=r"linear: x is width 128"):
        kgemm.linear(x[:, :128], w, None, 128)
