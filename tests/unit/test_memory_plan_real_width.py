"""dsv4.memory_plan at the released width: the per-rank weight bytes it predicts are exactly the bytes the
tensor + expert parallel model holds, for Flash and Pro geometry, both residencies, world sizes 1, 2 and 8.

The models are built on the meta device (shapes and dtypes only, no memory), so the check runs on CPU at real
width; the GPU measurement (benchmarks/measure_real_width.py) adds what only a GPU can show (allocator, peak).
"""

from __future__ import annotations

import pytest
import torch

from dsv4.memory_plan import rank_memory
from dsv4.parallel import Comm, build_model
from dsv4.synth import geometry_args

PLANS = {"dequantized": "bf16", "quantized": "quantized"}


@pytest.mark.parametrize("geometry,layers", [("flash", 4), ("pro", 1)])
@pytest.mark.parametrize("weights", list(PLANS))
def test_plan_weights_equal_the_model_at_real_width(geometry, layers, weights):
    args = geometry_args(geometry, layers)
    for world in (1, 2, 8):
        rank = world - 1
        m = build_model(args, Comm(rank, world), dtype=torch.bfloat16, device="meta", weights=weights)
        held = sum(t.numel() * t.element_size() for t in m.state_dict().values())
        plan = rank_memory(args, world, rank, PLANS[weights])
        assert held == plan.weights, (geometry, weights, world, held, plan.weights)
        assert plan.weights > (2 << 30) // world  # real width: GiB, not MB
