"""docs/differences.md row M4: the quantization simulations at test-scale widths. The official kernels need widths
that are multiples of the block; dsv4's `_Sim` quantizes a width smaller than the block as one group spanning the
row (one ue8m0 scale for the whole row) and refuses any other width by name. Anchored by known values: the group's
scale is 2^ceil(log2(amax / 448)) (e4m3 max 448, reference spec §2), so a row whose amax sits just above a power
of two times 448 shows whether one or several groups were used."""

from __future__ import annotations

import pytest
import torch

from dsv4.model import _Sim
from dsv4.quant import act_quant_sim


def test_narrow_width_is_one_group_per_row():
    sim = _Sim(True)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 48, generator=g) * 0.002  # |x| < 2^-6: below half the row scale's smallest step   # 48 < 128: one group per row
    x[:, 0] = 448.0 * 2.0 ** 3 * 1.01            # amax of each row -> scale 2^4 for the whole row
    y = sim.act(x)
    assert torch.equal(y, act_quant_sim(x, 48)), "not one 48-wide group"
    # the small entries share the big scale, so they all round to 0 (e4m3's smallest subnormal * 2^4 = 2^-5);
    # per-16 groups would have kept them (negative control: the block size is visible)
    assert float(x[:, 1:].abs().max()) < 2.0 ** -6
    assert bool((y[:, 1:] == 0).all())
    assert int((act_quant_sim(x, 16)[:, 16:] == 0).sum()) == 0


@pytest.mark.parametrize("width,block,what", [(130, 128, "act"), (96, 64, "kv_nope"), (40, 32, "fp4")])
def test_other_widths_are_refused_by_name(width, block, what):
    with pytest.raises(ValueError, match=f"width {width} is neither a multiple of nor smaller than the block {block}"):
        getattr(_Sim(True), what)(torch.randn(2, width))


def test_fp32_mode_is_identity():
    x = torch.randn(3, 130)
    assert _Sim(False).act(x) is x and _Sim(False).fp4(x) is x
