"""Batch-invariant mode (issue 25) at model level: the tiny bf16 triton model with weights="quantized" (widths
multiples of 128, so every fast path runs its kernel; Triton interpreter on CPU), built with batch_invariant=True.

  * a request's logits are bitwise equal decoded alone (a batch-1 state) and as row 0 of a ragged batch of 3 whose
    other rows hold other prompts at other positions, in a state of another max_len (more entry slots: longer
    attention index rows ending in -1), over decode steps that cross the window ring's wrap (window 8) and the
    ratio-4 compressor boundaries;
  * a 3-token verify-sized step (`decode_step` with s = 3) gives, at each of its positions, bitwise the logits of
    3 single-token steps.
The kernel-level checks and their default-mode controls are tests/unit/test_batch_invariant.py; the Flash-width
GPU check (eager and CUDA graph, batches 2 / 8 / 32, default-mode control) tests/gpu/test_batch_invariant.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.model import Transformer
from dsv4.testing import fill_random_quantized_
from dsv4.tiny import tiny_args

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [pytest.mark.hardstop,  # the batch-invariant guarantee, model level (issue 25)
              pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 (CPU) - CI sets it for the unit run")]

ARGS = dict(vocab_size=256, dim=128, moe_inter_dim=128, q_lora_rank=128, head_dim=128, rope_head_dim=64,
            o_lora_rank=128, index_head_dim=128, n_layers=2, compress_ratios=(4, 4, 0))


@pytest.fixture(scope="module")
def model():
    m = Transformer(tiny_args(**ARGS), dtype=torch.bfloat16, backend="triton", weights="quantized",
                    batch_invariant=True)
    fill_random_quantized_(m, seed=11)
    return m


def _prompts(seed: int, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


def test_row_alone_equals_row_in_ragged_batch(model):
    (p0, p1, p2), feeds = _prompts(1, (6, 10, 3)), _prompts(2, (3, 3, 3))
    alone = model.new_state(1, 128)
    got_alone = [model(p0[None], alone)[0]]
    batch = model.new_state(3, 256)
    first = [model(p[None], batch.row(i))[0] for i, p in enumerate((p0, p1, p2))]
    got_batch = [first[0]]
    for j in range(3):  # row 0 at positions 6..8: a ratio-4 window completes at 7, the ring (window 8) wraps at 8;
        # row 1 (past its ring's wrap) completes one at 11, row 2 at 3
        got_alone.append(model(feeds[0][j].view(1, 1), alone)[0])
        got_batch.append(model(torch.stack([f[j] for f in feeds]).view(3, 1), batch)[0])
    assert batch.row_pos == [9, 13, 6]
    for j, (a, b) in enumerate(zip(got_alone[1:], got_batch[1:])):
        assert torch.equal(a, b), (f"decode step {j}: row 0 alone vs in the ragged batch differ in "
                                   f"{int((a != b).sum())} logits, max |d| {float((a - b).abs().max()):.3g}")


def test_verify_step_equals_single_steps(model):
    (p,), (ids,) = _prompts(3, (7,)), _prompts(4, (3,))
    one = model.new_state(1, 128)
    model(p[None], one)
    multi = one.copy_row(0)  # the same prefilled state, its buffers copied (one 7-token prefill, not two)
    singles = [model(ids[j].view(1, 1), one)[0] for j in range(3)]
    step = model(ids[None], multi, all_logits=True)[0]  # [3, V]: the decode step with s = 3
    assert one.row_pos == multi.row_pos == [10]
    for j in range(3):
        assert torch.equal(step[j], singles[j]), (f"verify position {j}: {int((step[j] != singles[j]).sum())} "
                                                  "logits differ from the single-token step")


def test_batch_invariant_refuses_what_it_does_not_cover():
    with pytest.raises(ValueError, match="batch_invariant=True needs dtype=torch.bfloat16"):
        Transformer(tiny_args(**ARGS), dtype=torch.float32, backend="triton", weights="quantized",
                    batch_invariant=True)
    with pytest.raises(ValueError, match="backend='triton'"):
        Transformer(tiny_args(**ARGS), dtype=torch.bfloat16, backend="reference", weights="quantized",
                    batch_invariant=True)
    with pytest.raises(ValueError, match="grouped FP4 kernel"):  # dim 64: the experts are too narrow to stack
        Transformer(tiny_args(), dtype=torch.bfloat16, backend="triton", weights="quantized", batch_invariant=True)


def test_load_model_refuses_a_batch_invariant_geometry_before_reading_weights(tiny_ckpt, monkeypatch):
    """`load_model(batch_invariant=True)` on a checkpoint whose experts the grouped FP4 kernel cannot take read
    every tensor, then refused without the widths; now it refuses from config.json alone, naming expert_dtype,
    dim and moe_inter_dim (control: the config's values are in the message)."""
    import dsv4.checkpoint
    from dsv4.synth import checkpoint_args
    from dsv4.generate import load_model
    args = checkpoint_args(tiny_ckpt)
    monkeypatch.setattr(dsv4.checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ValueError, match=rf"grouped FP4 kernel, which needs expert_dtype 'fp4' and dim / "
                                         rf"moe_inter_dim multiples of 128; this config has expert_dtype "
                                         rf"'{args.expert_dtype}', dim {args.dim}, moe_inter_dim {args.moe_inter_dim}"):
        load_model(tiny_ckpt, dtype=torch.bfloat16, backend="triton", weights="quantized", batch_invariant=True)
    with pytest.raises(ValueError, match="needs dtype=torch.bfloat16 and weights='quantized'"):
        load_model(tiny_ckpt, dtype=torch.float32, backend="triton", weights="quantized", batch_invariant=True)
