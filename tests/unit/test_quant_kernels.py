"""`kernels.quant.act_quant_sim` / `fp4_act_quant_sim` (the graph decode's quantization simulations) against
`dsv4.quant` BITWISE, under TRITON_INTERPRET=1 (tests/gpu/test_kernel_launchers.py repeats it on CUDA).

Edge values, chosen so every term of the formulas matters: amax exactly at fmt_max * 2^j (the scale boundary:
m == 1.5 / 1.75) and one ulp either side; values exactly at the e2m1 midpoints (0.25, 0.75, ..., 5: ties to the
even code) and at e4m3 ties; values that saturate at +-6 / +-448 only after the scale rounding; blocks whose
amax is below the floors (1e-4 for e4m3, 6 * 2^-126 for e2m1); zeros and -0.0; several binades per row."""

from __future__ import annotations

import os

import pytest
import torch

from dsv4 import quant

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP or not torch.cuda.is_available() else "cuda"
pytestmark = [pytest.mark.hardstop,  # kernel / fast path vs reference (issue 22 item 4)
              pytest.mark.skipif(not INTERP and not torch.cuda.is_available(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set before import)")]


def _edge_rows(block: int, fmax: float) -> torch.Tensor:
    rows = []
    for j in (-3, 0, 5):
        top = fmax * 2.0 ** j
        for amax in (top, torch.nextafter(torch.tensor(top), torch.tensor(0.0)).item(),
                     torch.nextafter(torch.tensor(top), torch.tensor(1e30)).item()):
            r = torch.randn(block) * amax / 4
            r[0] = amax
            r[1] = -amax * 0.99
            mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0]) * 2.0 ** j
            r[2:2 + len(mids)] = mids
            rows.append(r)
    # below both amax floors, yet normal numbers (the interpreter flushes bf16 subnormals on load; on CUDA
    # subnormal inputs are added as well)
    tiny = torch.sign(torch.randn(block)) * (1.2e-38 + 4.8e-38 * torch.rand(block))
    tiny[0] = 0.0
    tiny[1] = -0.0
    rows += [tiny, torch.zeros(block), torch.randn(block) * torch.logspace(-30, 30, block)]
    if DEV == "cuda":
        rows.append(torch.randn(block) * 1e-40)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt,block", [("e4m3", 64), ("e4m3", 128), ("e2m1", 32), ("e4m3", 48), ("e2m1", 24)])
def test_quant_sim_bitwise(seed, dtype, fmt, block):
    from kernels import quant as kq
    fmax = 448.0 if fmt == "e4m3" else 6.0
    x = torch.cat([_edge_rows(block, fmax), torch.randn(5, block) * 3]).repeat(1, 3).to(dtype).to(DEV)
    x = x.unsqueeze(1)                                       # [rows, 1, n]: the decode layout
    ref = quant.act_quant_sim(x, block) if fmt == "e4m3" else quant.fp4_act_quant_sim(x, block)
    got = kq.act_quant_sim(x, block) if fmt == "e4m3" else kq.fp4_act_quant_sim(x, block)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got.view(torch.int32 if dtype == torch.float32 else torch.int16),
                       ref.view(torch.int32 if dtype == torch.float32 else torch.int16)), \
        f"{fmt} sim differs in {int((got != ref).sum())} of {got.numel()} elements"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_act_quant_sim_halves_layout_bitwise(seed, dtype):
    """`act_quant_sim(x, 128, halves=True)` (the FP4 tile kernels' input, `kernels.moe`) is the reference's values
    with each row's even channels first and its odd ones n / 2 further, bitwise; rows not a multiple of the
    kernel's row block and three 128-channel groups per row, so a group's halves land at offsets 64 * g and
    n / 2 + 64 * g. Negative controls: the natural layout and the halves taken within each 128-channel group (a
    plausible misreading of the layout) differ from it."""
    from kernels import quant as kq
    x = torch.cat([_edge_rows(128, 448.0), torch.randn(5, 128) * 3]).repeat(1, 3)
    x = (x * torch.rand(1, 384).add(0.5)).to(dtype).to(DEV)  # the three groups' values differ
    ref = quant.act_quant_sim(x, 128)
    got = kq.act_quant_sim(x, 128, halves=True)
    n = ref.shape[1]
    want = ref[:, torch.cat((torch.arange(0, n, 2), torch.arange(1, n, 2))).to(ref.device)]
    assert torch.equal(kq.halves(ref), want)  # the torch form, against explicit indices
    iv = torch.int32 if dtype == torch.float32 else torch.int16
    assert got.shape == x.shape and torch.equal(got.view(iv), want.view(iv)), \
        f"halves layout differs in {int((got != want).sum())} of {got.numel()} elements"
    assert not torch.equal(got, ref), "the halves layout must differ from the natural one"
    per_group = ref.view(ref.shape[0], 3, 64, 2).transpose(2, 3).reshape(ref.shape)
    assert not torch.equal(got, per_group), "halves of the whole row, not of each 128-channel group"
    with pytest.raises(ValueError, match="block is 48; expected a power of two >= 2 with halves=True"):
        kq.act_quant_sim(torch.randn(2, 96, device=DEV), 48, halves=True)
    with pytest.raises(ValueError, match="halves is 'no'; expected a bool"):
        kq.act_quant_sim(torch.randn(2, 128, device=DEV), 128, halves="no")
    with pytest.raises(ValueError, match=r"halves: x is Tensor shape \(2, 5\); expected a tensor \[..., n\] with n even"):
        kq.halves(torch.randn(2, 5))
    with pytest.raises(ValueError, match="halves: x is list"):
        kq.halves([1.0, 2.0])


def test_fp4_sim_negative_controls(seed):
    """The edge rows separate the rules: ties away from zero, or a scale from the rounded-up division, change
    the result (so the bitwise test above would catch a kernel doing either)."""
    x = _edge_rows(32, 6.0)
    ref = quant.fp4_act_quant_sim(x, 32)
    g = x.view(-1, 32)
    s = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1).clamp_min(6 * 2.0 ** -126) / 6)))[:, None]
    a = (g / s).clamp(-6, 6).abs()
    grid = torch.tensor(quant.E2M1_VALUES)
    away = grid[(a[..., None] - grid).abs().argmin(-1)]          # nearest, ties to the LOWER (argmin first)
    lower = (torch.where(g < 0, -away, away) * s).view_as(x)
    assert not torch.equal(lower, ref), "ties must matter in the edge rows"


def test_quant_sim_names_bad_input():
    from kernels import quant as kq
    with pytest.raises(ValueError, match="block is 64; expected an int in 1..1024 dividing the width 96"):
        kq.act_quant_sim(torch.randn(2, 96, device=DEV), 64)
    with pytest.raises(ValueError, match="x is torch.float16"):
        kq.fp4_act_quant_sim(torch.randn(2, 64, device=DEV).half(), 32)
    with pytest.raises(ValueError, match="non-contiguous"):
        kq.fp4_act_quant_sim(torch.randn(64, 4, device=DEV).T, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nonfinite_blocks_match_the_reference(seed, dtype):
    """A block with a NaN keeps the NaN where it was (never a plausible number), a block with an inf saturates it
    to the format's max; both use the scale 2^0 as the reference does (docs/differences.md M6). Negative control:
    the NaN must not vanish from either output."""
    from kernels import quant as kq
    x = torch.randn(4, 64, device=DEV) * 3
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    x[2, 9] = -float("inf")
    x = x.to(dtype)
    iv = torch.int32 if dtype == torch.float32 else torch.int16
    for ours, ref, block in ((kq.act_quant_sim, quant.act_quant_sim, 32), (kq.fp4_act_quant_sim,
                                                                          quant.fp4_act_quant_sim, 32)):
        got, want = ours(x, block), ref(x, block)
        assert bool(torch.isnan(want[0, 5])) and bool(torch.isnan(got[0, 5])), ours.__name__
        assert torch.equal(torch.isnan(got), torch.isnan(want)), ours.__name__
        fin = ~torch.isnan(want)
        assert torch.equal(got.view(iv)[fin], want.view(iv)[fin]), ours.__name__
