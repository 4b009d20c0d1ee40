"""benchmarks/bench_model.py's per-layer table (issue 27 item 1): the slope and the full-depth projection are
arithmetic on measured rows; a wrong formula would mislead RESULTS.md, so it is checked on rows whose answer is
known (time = intercept + per-layer cost x depth, exactly)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_model as bm  # noqa: E402


def _rows(per_layer_s: float, head_s: float, depths=(4, 12)):
    meta = dict(copy_GBps=4000.0, gemm_TFLOPs=800.0)
    geos, res = {}, {}
    for L in depths:
        geos[f"flash-{L}L"] = dict(name="flash", layers=L, full_layers=43, ctx=4096, prefills=[1024], batches=[1],
                                   prefill_flops={1024: 2e12 + 4e11 * L},        # 0.5 ms per layer at 800 TF/s
                                   decode_bytes={1: 1e9 + 2.4e8 * L},            # 60 µs per layer at 4000 GB/s
                                   launches={1: 40 + 70 * L})
        res[(f"flash-{L}L:triton", "decode", 1)] = head_s + per_layer_s * L
        res[(f"flash-{L}L:triton", "prefill", 1024)] = 0.01 + 0.004 * L
    return res, meta, geos


def test_slope_rows_are_the_per_layer_cost_and_projection():
    res, meta, geos = _rows(per_layer_s=390e-6, head_s=0.3e-3)
    md = bm.slope_markdown(res, meta, geos)
    decode = next(line for line in md.splitlines() if "decode b=1" in line)
    cells = [c.strip() for c in decode.strip("|").split("|")]
    # per layer 390 µs, floor 60 µs, 6.5x, 70 launches, projection 0.3 ms + 390 µs x 43 = 17.07 ms
    assert cells[3:8] == ["390 µs", "60 µs", "6.5x", "70", "17.1 ms (43L)"], cells
    prefill = next(line for line in md.splitlines() if "prefill 1024" in line)
    cells = [c.strip() for c in prefill.strip("|").split("|")]
    assert cells[3:6] == ["4.00 ms", "0.50 ms", "8.0x"], cells
    assert cells[7] == f"{(0.01 + 0.004 * 43) * 1e3:.0f} ms (43L)"


def test_one_depth_gives_no_slope_table():
    res, meta, geos = _rows(per_layer_s=390e-6, head_s=0.3e-3, depths=(4,))
    assert bm.slope_markdown(res, meta, geos) == ""


@pytest.mark.parametrize("spec", ["4,x", "0,4", "4,4", ""])
def test_depths_refuses_bad_specs(spec):
    with pytest.raises(ValueError, match="layers"):
        bm._depths(spec)


def test_depths_sorted():
    assert bm._depths("12,4") == [4, 12]
