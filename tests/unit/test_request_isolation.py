"""A request's result does not depend on the request before it (docs/differences.md row M1).

The official inference code keeps the compressors' `kv_state` / `score_state` as module buffers that are never
reset between requests (reference spec §6, §12, pitfall §14.10): the first compressed entry of a new prompt then
pools the previous request's overlap window. dsv4 makes the state explicit and fresh per sequence. Anchor: the
same prompt from a fresh model. Negative control: carrying the previous request's compressor state over (the
official behaviour) changes the logits by far more than the tolerance, so the equality checks below can fail.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.model import Transformer
from dsv4.tiny import random_state_dict, tiny_args

pytestmark = pytest.mark.hardstop

VOCAB = 512


@pytest.fixture(scope="module")
def model() -> Transformer:
    args = tiny_args(vocab_size=VOCAB)
    assert 4 in args.compress_ratios, "the tiny config must hold an overlapping CSA compressor"
    m = Transformer(args)  # fp32: the exact mode, so equal means bitwise equal
    m.load_weights({k: v for k, v in random_state_dict(args, seed=5).items() if not k.startswith("mtp.")})
    return m.eval()


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _storages(state) -> set[int]:
    """Addresses of the state's non-empty buffers (empty tensors all report address 0)."""
    out = set()
    for ls in state.layers:
        for t in (ls.ring, ls.entries, ls.index_keys):
            if t is not None:
                out.add(t.untyped_storage().data_ptr())
        for c in (ls.compressor, ls.index_compressor):
            if c is not None:
                out |= {c.kv.untyped_storage().data_ptr(), c.score.untyped_storage().data_ptr()}
    out.discard(0)
    return out


def _request_b(model, state) -> torch.Tensor:
    """Request B: a 2-token prefill (shorter than the CSA ratio 4, where the official buffers leak) then 10
    teacher-forced decode steps across two compressor windows -> logits [11, V]."""
    ids = _ids(12, seed=2)
    out = [model(ids[:, :2], state)]
    for t in range(2, 12):
        out.append(model(ids[:, t:t + 1], state))
    return torch.cat(out)


@torch.no_grad()
def test_second_request_equals_fresh_model(model):
    fresh = _request_b(model, model.new_state(1))
    s_a = model.new_state(1)
    model(_ids(23, seed=1), s_a)          # request A: prefill + two decode steps
    model(torch.tensor([[7]]), s_a)
    model(torch.tensor([[9]]), s_a)
    s_b = model.new_state(1)
    assert not (_storages(s_b) & _storages(s_a)), "a new state shares buffers with the previous request's"
    after = _request_b(model, s_b)
    assert torch.equal(after, fresh), f"max |delta| {float((after - fresh).abs().max()):.3e}"

    # negative control: the official leak (compressor buffers carried over from request A) is visible
    leaked = model.new_state(1)
    for ls_new, ls_old in zip(leaked.layers, s_a.layers):
        for name in ("compressor", "index_compressor"):
            new, old = getattr(ls_new, name), getattr(ls_old, name)
            if new is not None:
                new.kv.copy_(old.kv)
                new.score.copy_(old.score)
    wrong = _request_b(model, leaked)
    assert float((wrong - fresh).abs().max()) > 1e-3, "leaked compressor state left the logits unchanged"


@torch.no_grad()
def test_generate_makes_a_fresh_state_per_request(model, monkeypatch):
    """`dsv4.generate.generate` takes a new state from the model for every call (never a cached one)."""
    from dsv4 import encoding
    from dsv4 import generate as gen

    made = []
    real = model.new_state

    def spy(batch: int = 1):
        made.append(real(batch))
        return made[-1]

    monkeypatch.setattr(model, "new_state", spy)

    class _Tok:  # the smallest tokenizer generate needs: fixed ids in, ids out
        eos_token_id = VOCAB - 1

        def decode(self, ids, **kw):
            return " ".join(map(str, ids))

    monkeypatch.setattr(encoding, "prompt_ids", lambda tok, messages, **kw: [3, 4, 5, 6, 7, 8, 9, 10, 11])
    msgs = [{"role": "user", "content": "x"}]
    gen.generate(model, _Tok(), msgs, max_tokens=3)
    gen.generate(model, _Tok(), msgs, max_tokens=3)
    assert len(made) == 2 and made[0] is not made[1]
    assert not (_storages(made[0]) & _storages(made[1]))
