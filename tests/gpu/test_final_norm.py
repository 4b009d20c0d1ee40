"""Test 2 on CUDA (hard stop): the final norm runs and logits are invariant to |X|.

Runs on the checkpoint named by DSV4_CKPT (real weights; bf16 numerics) or, when unset, on the tiny
checkpoint built for the session. TEST_LAYERS (environment only) limits the main layers loaded. Works alone:

    DSV4_CKPT=/path/to/DeepSeek-V4-Flash TEST_LAYERS=2 pytest tests/gpu/test_final_norm.py

(A full Flash/Pro checkpoint needs the multi-GPU model of issue 9; on one GPU use a small TEST_LAYERS.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dsv4.final_norm import final_norm_check
from dsv4.generate import CKPT_ENV, load_model

pytestmark = [pytest.mark.gpu, pytest.mark.hardstop,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]

PROMPT = [0, 128803, 3085, 344, 270, 6102, 294, 8760, 33, 128804, 128821]  # gold ids of the seed prompt


@pytest.fixture(scope="module")
def ckpt(request) -> Path:
    env = os.environ.get(CKPT_ENV)
    if env:
        return Path(env)
    return request.getfixturevalue("tiny_ckpt")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_final_norm_on_cuda(ckpt, backend):
    real = bool(os.environ.get(CKPT_ENV))
    dtype = torch.bfloat16 if real else torch.float32
    model, n = load_model(ckpt, device="cuda", dtype=dtype, backend=backend, progress=real)
    r = final_norm_check(model, PROMPT, decode_steps=2, test_layers=n)
    assert r.passed, f"{r.verdict}; problems={r.chain_problems}; comparisons={r.comparisons}"
    assert r.norm_calls == 3


def test_negative_control_on_cuda(ckpt):
    """The same check fails on CUDA when the final norm is removed (guards against a check that cannot fail)."""
    from torch import nn
    model, n = load_model(ckpt, device="cuda", dtype=torch.float32 if not os.environ.get(CKPT_ENV) else torch.bfloat16,
                          progress=False)
    model.norm = nn.Identity()
    r = final_norm_check(model, PROMPT, decode_steps=1, test_layers=n)
    assert not r.passed and r.comparisons[0].rel_l2 > 0.5
