"""Appending tokens to a decode state (issue 24 item 1): any split of a sequence into calls gives the logits of one
prefill of the whole sequence.

`Transformer.forward(ids [b, s], state)` takes any s >= 1 at the state's position: the first call is the prefill,
a later one appends s tokens (`Attention.extend`; s == 1 is the decode step). The anchor is one prefill of every
token (`all_logits`): row t of it must equal the logits the split run gives at position t, for every t, in fp32
within 1e-5 of the largest |logit| (the only difference is the order of fp32 sums over the attention keys; the
model's logits are ~4 in magnitude, measured max |d| ~1e-6), with equal greedy tokens. The splits are chosen so
that, on the tiny geometry (window 8, CSA ratio 4 with index_topk 4, HCA ratio 128, 4 layers 0/4/128/4), chunks
end inside a ratio-4 window, exactly on a ratio-4 boundary and on the ratio-128 boundary, start inside one, wrap
the window ring within one call and across calls (chunks longer and shorter than the window), and cross the
indexer's top-k point (more than 4 entries from 20 tokens on). Exact indexer ties (zero queries: every score 0)
must pick the same entries whatever the split (the lowest-index rule). The triton backend (interpreter) appends
against the reference backend's one prefill at 1e-4 (the backends' fp32 distance, tests/unit/test_graph_decode.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.model import Transformer
from dsv4.tiny import random_state_dict, tiny_args

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.hardstop  # the model's state handling: any split of a sequence == one prefill
VOCAB = 512
REL = 1e-5  # fp32: max |d| <= REL * max |logit| of the one-prefill rows (module docstring)


def _model(seed: int = 21, backend: str = "reference", zero_index_queries: bool = False, **over) -> Transformer:
    args = tiny_args(vocab_size=VOCAB, index_topk=4, **over)
    sd = {k: v for k, v in random_state_dict(args, seed=seed).items() if not k.startswith("mtp.")}
    if zero_index_queries:  # deliberate: every indexer score exactly 0, only the tie rule decides (inputs random)
        sd = {k: (torch.zeros_like(v) if k.endswith("indexer.wq_b.weight") else v) for k, v in sd.items()}
    m = Transformer(args, backend=backend)
    m.load_weights(sd)
    return m


def _split_run(model: Transformer, ids: torch.Tensor, chunks: list[int], state=None) -> torch.Tensor:
    """Feed `ids` [b, n] in calls of the given sizes -> logits at every position [b, n, V] (all_logits)."""
    assert sum(chunks) == ids.shape[1]
    st = model.new_state(ids.shape[0]) if state is None else state
    out, p = [], 0
    for c in chunks:
        out.append(model(ids[:, p:p + c], st, all_logits=True))
        p += c
    assert st.pos == ids.shape[1]
    return torch.cat(out, 1)


def _assert_same(got: torch.Tensor, full: torch.Tensor, what: str, rel: float = REL) -> None:
    d = float((got - full).abs().max())
    scale = float(full.abs().max())
    assert d <= rel * scale, f"{what}: max |d| {d:.3g} > {rel:g} x max |logit| {scale:.3g}"
    assert torch.equal(got.argmax(-1), full.argmax(-1)), f"{what}: greedy tokens differ"


CHUNKINGS = {
    "inside-window": [5, 3, 2, 11, 140 - 21],           # ends at 5, 8 (ratio-4 boundary), 10, 21 (inside)
    "ring-wrap": [3, 13, 1, 9, 17, 97],                  # chunks longer / shorter than the window (8)
    "ratio128-boundary": [120, 8, 12],                   # ends exactly at 128 (the HCA entry completes)
    "across-128": [126, 5, 9],                           # the HCA window completes inside a call
    "topk-boundary": [18, 1, 1, 2, 118],                 # more than index_topk = 4 entries from 20 tokens on
    "token-by-token-then-chunk": [1] * 23 + [117],
}


@pytest.fixture(scope="module")
def model_and_full():
    m = _model()
    ids = torch.randint(0, VOCAB, (2, 140), generator=torch.Generator().manual_seed(140))
    return m, ids, m(ids, m.new_state(2), all_logits=True)


@pytest.mark.parametrize("name", list(CHUNKINGS))
def test_any_split_equals_one_prefill(model_and_full, name):
    m, ids, full = model_and_full
    _assert_same(_split_run(m, ids, CHUNKINGS[name]), full, f"split {name} {CHUNKINGS[name]}")


def test_negative_control_a_lost_partial_window_is_seen(model_and_full, monkeypatch):
    """The criterion has power: a compressor that forgets the tokens of a partial window from an earlier call
    (only the new call's tokens pooled: the class of a verify step corrupting the CSA compressor state) fails it."""
    import math

    from dsv4.model import Compressor
    m, ids, full = model_and_full
    orig = Compressor.extend

    def forgetful(self, x, p, st, out, backend):
        if p % self.ratio:
            st.kv[:, (self.ratio if self.overlap else 0):] = 0
            st.score[:, (self.ratio if self.overlap else 0):] = -math.inf
        return orig(self, x, p, st, out, backend)

    monkeypatch.setattr(Compressor, "extend", forgetful)
    got = _split_run(m, ids, CHUNKINGS["inside-window"])
    assert float((got - full).abs().max()) > 100 * REL * float(full.abs().max())


def test_split_with_exact_indexer_ties_picks_the_same_entries():
    """Zero indexer queries: every score is exactly 0, so the top-4 of each query is decided by the tie rule
    alone (lowest index); chunked calls must pick what the one prefill picks."""
    m = _model(seed=13, zero_index_queries=True)
    ids = torch.randint(0, VOCAB, (1, 44), generator=torch.Generator().manual_seed(44))
    full = m(ids, m.new_state(1), all_logits=True)
    _assert_same(_split_run(m, ids, [6, 1, 13, 2, 22]), full, "tied indexer scores, split [6, 1, 13, 2, 22]")


def test_append_grows_the_state_and_respects_a_fixed_one():
    """A chunk that needs more room reallocates a growable state (contents kept); a fixed state refuses a chunk
    past its max_len, naming it, and is left as it was (the next call within room still works)."""
    m = _model()
    ids = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(200))
    full = m(ids, m.new_state(1), all_logits=True)
    st = m.new_state(1)
    got = _split_run(m, ids, [100, 60, 40], st)
    assert st.max_len == 256
    _assert_same(got, full, "split [100, 60, 40] across the growth 128 -> 256")
    fixed = m.new_state(1, 128)
    m(ids[:, :100], fixed)
    with pytest.raises(ValueError, match="max_len=128 tokens; position 100 \\+ 60 new token"):
        m(ids[:, 100:160], fixed)
    assert fixed.pos == 100
    _assert_same(m(ids[:, 100:128], fixed, all_logits=True), full[:, 100:128], "the fixed state after a refusal")


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")
def test_triton_append_equals_reference_prefill():
    """The triton backend's multi-token calls after the prefill (attention over ring + call + entries, the
    indexer over the state's key slots) against one reference prefill: 1e-4 of max |logit|."""
    ref = _model(seed=22)
    tri = _model(seed=22, backend="triton")
    # 13 tokens: calls end inside a window (5), on a ratio-4 boundary (8) and past the third entry (13); the
    # interpreter costs ~4 s per triton call of the 4-layer model, so the split is short
    ids = torch.randint(0, VOCAB, (1, 13), generator=torch.Generator().manual_seed(24))
    full = ref(ids, ref.new_state(1), all_logits=True)
    _assert_same(_split_run(tri, ids, [5, 3, 5]), full, "triton split [5, 3, 5]", rel=1e-4)
