"""Test 1 at the generation path (hard stop): what `generate` feeds the model is the official prompt.

The template tests (`test_chat_template.py`) pin `prompt_ids` to the gold vectors made by DeepSeek's encoder,
but a server can still hand-roll its prompt in the generation path and never call the template there. This
test records the ids of every forward call `generate` makes on a tiny real-vocabulary model and requires the
prefill to be exactly the gold ids of the seed prompt (thinking and chat mode), then one sampled token per step.
Negative control: the legacy hand-rolled ids differ from the gold ids (so equality is a real check).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4.diagnose import hand_rolled_ids
from dsv4.generate import generate
from dsv4.model import Transformer
from dsv4.tiny import random_state_dict, tiny_args
from dsv4.tokenizer import load_tokenizer

pytestmark = pytest.mark.hardstop

GOLD = {g["id"]: g for g in json.loads((Path(__file__).resolve().parents[2] / "fixtures" / "golden"
                                        / "dsv4_prompts.json").read_text(encoding="utf-8"))}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def model():
    """One-block tiny model with the real vocabulary (129,280), so real prompt ids are valid input."""
    args = tiny_args().with_layers(1)
    m = Transformer(args)
    m.load_weights(random_state_dict(args, seed=31, include_mtp=False))
    return m


@pytest.mark.parametrize("mode", ["thinking", "chat"])
def test_generate_feeds_the_official_prompt(tok, model, mode, monkeypatch):
    g = GOLD[f"dsv4-seed-capital-france-{mode}"]
    calls: list[list[list[int]]] = []
    forward = model.forward

    def recording_forward(input_ids, state, **kw):
        calls.append(input_ids.tolist())
        return forward(input_ids, state, **kw)

    monkeypatch.setattr(model, "forward", recording_forward)
    res = generate(model, tok, g["messages"], max_tokens=3, thinking=mode == "thinking")
    assert calls[0] == [g["ids"]], "prefill ids differ from the gold prompt ids"
    assert res.prompt_ids == g["ids"]
    assert len(calls) == len(res.ids) and calls[1:] == [[[t]] for t in res.ids[:-1]]
    # negative control: the legacy construction is a different id sequence
    assert hand_rolled_ids(tok, g["messages"][-1]["content"]) != g["ids"]


def test_generate_rejects_zero_tokens(tok, model):
    with pytest.raises(ValueError, match="max_tokens=0"):
        generate(model, tok, [{"role": "user", "content": "x"}], max_tokens=0)
