"""F32 tensors on disk (hc_* mixing weights, attn_sink, compressor ape, gate.bias) are fp32 parameters in the
official model in every mode: loading a bf16 model must not round them to bf16 on the way (a quiet dtype cast
that changes the bf16 model's mHC mixing, sinks and routing bias). Anchored by the on-disk bits themselves."""

from __future__ import annotations

import pytest
import torch

from dsv4.checkpoint import Checkpoint, load_checkpoint
from dsv4.generate import load_model

pytestmark = pytest.mark.hardstop


def _f32_names(ck: Checkpoint) -> list[str]:
    return [n for n in ck.keys() if ck.info(n)[1] == "F32" and not n.startswith("mtp.")]


def test_bf16_load_keeps_f32_tensors_bitwise(tiny_ckpt):
    ck = Checkpoint(tiny_ckpt)
    names = _f32_names(ck)
    assert {n.rsplit(".", 1)[-1] for n in names} >= {"attn_sink", "ape", "bias", "hc_attn_fn", "hc_head_fn"}
    _, sd = load_checkpoint(tiny_ckpt, dtype=torch.bfloat16, progress=False)
    narrowed = 0
    for n in names:
        raw = ck.get(n, dequantize=False)
        assert sd[n].dtype == torch.float32, f"{n}: loaded as {sd[n].dtype}, expected float32 (F32 on disk)"
        assert torch.equal(sd[n], raw), f"{n}: values changed on load"
        narrowed += int(not torch.equal(raw.to(torch.bfloat16).float(), raw))
    # negative control: rounding to bf16 would have changed most of them, so the equality above can fail
    assert narrowed >= len(names) // 2, f"only {narrowed} of {len(names)} F32 tensors differ from their bf16 rounding"


@pytest.mark.parametrize("weights", ["dequantized", "quantized"])
def test_bf16_model_holds_the_on_disk_f32_bits(tiny_ckpt, weights):
    model, _ = load_model(tiny_ckpt, dtype=torch.bfloat16, progress=False, weights=weights)
    ck = Checkpoint(tiny_ckpt)
    own = model.state_dict()
    for n in _f32_names(ck):
        if n in own:
            assert own[n].dtype == torch.float32 and torch.equal(own[n], ck.get(n, dequantize=False)), n
