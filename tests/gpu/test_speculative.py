"""Speculative greedy == plain greedy, bitwise, at Flash width (issue 26 item 3; hard stop).

In the batch-invariant mode (issue 25) a verify step of k + 1 tokens gives bitwise the logits of k + 1 single-token
steps (tests/gpu/test_batch_invariant.py), so speculative greedy decoding must emit plain greedy's tokens exactly:
no near-tie allowance (the fp32 unit test, tests/unit/test_speculative.py, needs one; this one does not).

Model: Flash geometry, first 4 layers (SWA, SWA, CSA, HCA; `index_topk` 64), bf16, weights="quantized" with random
codes, triton backend, batch_invariant=True, with the MTP block (`mtp=True`). A 300-token prompt, then 256 tokens:
the verify windows cross ratio-4 boundaries, the ratio-128 boundaries at 384 and 512, and the 128-slot window
ring's wrap many times. Drafters: the oracle (plain greedy's continuation: every draft accepted), an adversary
(every draft wrong: every round rolls back k tokens), a random one, and the MTP block; eager, and the oracle and the
adversary again through CUDA-graph verify steps (`use_decode_graphs`). Negative control: a rollback that keeps one
rejected token (issue 26's "a rollback that keeps one rejected token in a compressor window") must change the output.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dsv4.config import ModelArgs
from dsv4.model import Transformer
from dsv4.speculative import AdversaryDrafter, ContinuationDrafter, MTPDrafter, RandomDrafter, speculative_greedy
from dsv4.testing import fill_random_quantized_

pytestmark = [pytest.mark.gpu, pytest.mark.hardstop,  # speculative greedy == plain greedy bitwise (issue 26)
              pytest.mark.flash_width,  # shares the GPU with at most one other (tests/gpu/conftest.py)
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]

FLASH = Path(__file__).resolve().parents[2] / "fixtures/configs/deepseek_v4_flash.config.json"
PROMPT, N, MAX_LEN, VOCAB_DRAW, EOS = 300, 256, 1024, 1000, -1  # EOS -1: no token ends the run early


@pytest.fixture(scope="module")
def run():
    args = dataclasses.replace(ModelArgs.from_hf_config(FLASH).with_layers(4), index_topk=64)
    m = Transformer(args, dtype=torch.bfloat16, device="cuda", backend="triton", weights="quantized",
                    batch_invariant=True, mtp=True).eval()
    fill_random_quantized_(m, seed=26)
    prompt = torch.randint(0, VOCAB_DRAW, (PROMPT,), generator=torch.Generator().manual_seed(26)).tolist()
    st, out = m.new_state(1, MAX_LEN), []
    with torch.no_grad():
        lg = m(torch.tensor([prompt], device="cuda"), st)
        for _ in range(N):
            out.append(int(lg.argmax(-1)))
            lg = m(torch.tensor([[out[-1]]], device="cuda"), st)
    return m, prompt, out


def _first_difference(got: list[int], want: list[int]) -> str:
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"first difference at token {i} of {len(want)} (got {got[i:i + 4]}, plain greedy {want[i:i + 4]})"


def _drafter(name: str, m: Transformer, prompt: list[int], plain: list[int]):
    V = m.args.vocab_size
    return {"oracle": lambda: ContinuationDrafter(len(prompt), plain),
            "adversary": lambda: AdversaryDrafter(len(prompt), plain, V),
            "random": lambda: RandomDrafter(VOCAB_DRAW, seed=3),
            "mtp": lambda: MTPDrafter(m)}[name]()


@pytest.mark.parametrize("name,k,graph", [("oracle", 3, False), ("adversary", 3, False), ("random", 2, False),
                                          ("mtp", 3, False), ("oracle", 4, True), ("adversary", 1, True)])
def test_speculative_greedy_equals_plain_greedy_bitwise(run, name, k, graph):
    m, prompt, plain = run
    m.use_decode_graphs(MAX_LEN if graph else None)
    try:
        res = speculative_greedy(m, prompt, _drafter(name, m, prompt, plain), k=k, max_tokens=N, eos=EOS)
    finally:
        m.use_decode_graphs(None)
    assert res.ids == plain, f"{name} k={k} {'graph' if graph else 'eager'}: " + _first_difference(res.ids, plain)
    if name == "oracle":
        assert all(a == k for a in res.accepted[:-1]), f"the oracle's drafts must all be accepted: {res.accepted}"
    if name == "adversary":
        assert set(res.accepted) == {0} and len(res.accepted) == N - 1, f"adversary accepted {set(res.accepted)}"
    print(f"{name} k={k} {'graph' if graph else 'eager'}: {len(res.accepted)} rounds, mean accepted length "
          f"{res.mean_accepted_length:.2f}")


def test_rollback_keeping_a_rejected_token_is_seen_negative_control(run, monkeypatch):
    """The bug class the test exists for: the rollback keeps one more token than accepted (a rejected draft stays
    in the ring / compressor window and the position runs one ahead). The same comparison must see it."""
    m, prompt, plain = run
    rollback = m.rollback

    def keeps_one_rejected(state, record, keep):
        return rollback(state, record, [min(n + 1, record.s) for n in keep])

    monkeypatch.setattr(m, "rollback", keeps_one_rejected)
    # 16 tokens: each round's extra kept token moves the position one further than the state's tokens; the state
    # (prompt + 16 + k + 1 rounded up to 128 slots: 384) holds the 16 extra positions
    res = speculative_greedy(m, prompt, _drafter("adversary", m, prompt, plain), k=2, max_tokens=16, eos=EOS)
    assert res.ids != plain[:16], "negative control: a rollback keeping a rejected token gave plain greedy's tokens"
