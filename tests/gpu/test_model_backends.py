"""The Triton backend against the reference backend at model level on CUDA (tiny checkpoint).

fp32 (exact mode): logits within atol 1e-4 (measured ~3e-6 under the interpreter) and greedy tokens equal.
bf16 (official numerics): the quantization simulations make one-ulp kernel differences flip FP8/FP4 codes
and expert picks on a random tiny model, so the criterion is relative: the Triton backend must be no further
from the bf16 reference than twice the bf16 reference's distance from the fp32 reference (mean over positions
of the max |delta logit|): kernel error of the order of the model's own bf16 quantization noise, the "at most
~2x the same computation in the same dtype" criterion of STYLE §8 applied at model level. (Measured on an
H200: 0.69 vs noise 0.62 for one prompt - equal order, as expected from one-ulp code flips.)
"""

from __future__ import annotations

import pytest
import torch

from dsv4.generate import load_model
from dsv4.testing import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.hardstop,  # kernel / backend vs reference on CUDA (issue 22 item 4)
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]


def _greedy(model, ids, steps):
    st = model.new_state(ids.shape[0])
    logits, out, all_logits = model(ids, st), [], []
    for _ in range(steps):
        tok = logits.argmax(-1, keepdim=True)
        out.append(tok)
        all_logits.append(logits)
        logits = model(tok, st)
    return torch.cat(out, 1), torch.stack(all_logits, 1)


@pytest.mark.parametrize("length", [1, 5, 21, 140])
def test_triton_equals_reference_fp32(tiny_ckpt, length):
    ref, _ = load_model(tiny_ckpt, device="cuda", progress=False)
    tri, _ = load_model(tiny_ckpt, device="cuda", backend="triton", progress=False)
    ids = torch.randint(0, 129280, (2, length), device="cuda")
    assert_close(tri(ids, tri.new_state(2), all_logits=True), ref(ids, ref.new_state(2), all_logits=True),
                 f"prefill logits [len={length}]", atol=1e-4, rtol=0)
    t_ids, t_logits = _greedy(tri, ids, 8)
    r_ids, r_logits = _greedy(ref, ids, 8)
    assert torch.equal(t_ids, r_ids)
    assert_close(t_logits, r_logits, "decode logits", atol=1e-4, rtol=0)


def test_triton_bf16_within_model_noise(tiny_ckpt, seed):
    ids = torch.randint(0, 129280, (1, 40), generator=torch.Generator().manual_seed(seed)).cuda()
    f32, _ = load_model(tiny_ckpt, device="cuda", progress=False)
    ref, _ = load_model(tiny_ckpt, device="cuda", dtype=torch.bfloat16, progress=False)
    tri, _ = load_model(tiny_ckpt, device="cuda", dtype=torch.bfloat16, backend="triton", progress=False)
    a = f32(ids, f32.new_state(1), all_logits=True)
    b = ref(ids, ref.new_state(1), all_logits=True)
    c = tri(ids, tri.new_state(1), all_logits=True)
    assert torch.isfinite(c).all()
    kernel_err = (c - b).abs().amax(-1).mean()
    model_noise = (b - a).abs().amax(-1).mean()
    assert kernel_err <= 2 * model_noise, f"triton-vs-reference {kernel_err:.3f} > 2 x bf16-vs-fp32 {model_noise:.3f}"
