"""Test 2 on CUDA (hard stop): the final norm runs and logits are invariant to |X|.

Runs on the tiny checkpoint built for the session (fp32) and on the real-width checkpoint (bf16 numerics):
DSV4_CKPT when set (released weights), else a Flash-geometry checkpoint of 4 layers built once per session on the
GPU (tests/gpu/real_width.py; skipped with the reason when disk or GPU memory is too small). Both backends, both
weight modes. TEST_LAYERS (environment only) limits the main layers loaded. Works alone:

    DSV4_CKPT=/path/to/DeepSeek-V4-Flash TEST_LAYERS=2 pytest tests/gpu/test_final_norm.py -k real

(A full Flash/Pro checkpoint needs the multi-GPU model; on one GPU use a small TEST_LAYERS.) At full depth, under
torchrun, on a synthetic source (each rank generates its tensors as it loads them; issue 16, docs/multi_gpu.md):

    DSV4_CKPT=synth:pro:61 TEST_LAYERS=61 torchrun --nproc_per_node 8 -m pytest -q tests/gpu/test_final_norm.py \
        -k "real and not dequantized"
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dsv4.final_norm import final_norm_check
from dsv4.generate import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.flash_width, pytest.mark.hardstop,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]

PROMPT = [0, 128803, 3085, 344, 270, 6102, 294, 8760, 33, 128804, 128821]  # gold ids of the seed prompt


@pytest.fixture(scope="module", params=["tiny", "real"])
def ckpt(request) -> tuple[Path, torch.dtype]:
    """(checkpoint, dtype): the tiny one in fp32 (exact mode), the real-width one in bf16 (official numerics)."""
    if request.param == "tiny":
        ws = int(os.environ.get("WORLD_SIZE", "1") or "1")
        if ws > 1:
            from dsv4.parallel import attention_args
            from dsv4.tiny import tiny_args
            try:
                attention_args(tiny_args(), ws)
            except ValueError as e:
                pytest.skip(f"the tiny checkpoint cannot be split over WORLD_SIZE={ws}: {e}")
        return request.getfixturevalue("tiny_ckpt"), torch.float32
    return request.getfixturevalue("real_ckpt"), torch.bfloat16


def _load(ckpt, backend: str, weights: str):
    path, dtype = ckpt
    if dtype == torch.bfloat16:  # real width: load_model holds the state dict beside the model at world size 1;
        from tests.gpu.real_width import require_gpu_memory  # under torchrun each rank streams its own part
        ws = int(os.environ.get("WORLD_SIZE", "1") or "1")
        require_gpu_memory(path, weights, world_size=ws, streamed=ws > 1)
    model, n = load_model(path, device="cuda", dtype=dtype, backend=backend, progress=False, weights=weights)
    return model, n


@pytest.mark.parametrize("weights", ["dequantized", "quantized"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_final_norm_on_cuda(ckpt, backend, weights):
    model, n = _load(ckpt, backend, weights)
    r = final_norm_check(model, PROMPT, decode_steps=2, test_layers=n)
    assert r.passed, f"{r.verdict}; problems={r.chain_problems}; comparisons={r.comparisons}"
    assert r.norm_calls == 3


def test_negative_control_on_cuda(ckpt):
    """The same check fails on CUDA when the final norm is removed (guards against a check that cannot fail)."""
    from torch import nn
    model, n = _load(ckpt, "reference", "quantized")
    model.norm = nn.Identity()
    r = final_norm_check(model, PROMPT, decode_steps=1, test_layers=n)
    assert not r.passed and r.comparisons[0].rel_l2 > 0.5
