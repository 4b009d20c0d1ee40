"""Ragged batches and continuous batching (issue 24 item 2): a row of a batch whose rows sit at different positions
gives the logits of the same conversation run alone.

The anchor is each conversation alone in a batch-1 state (prefill, then one token per call): the row's logits of
the ragged batch must equal them at every step, fp32 within 1e-5 of the largest |logit| (the only difference is
the batch size of the fp32 GEMMs; measured max |d| ~1e-6 on logits of ~4), with equal greedy tokens. Rows are
prefilled through their row views (`DecodeState.row`), then decoded together by the one decode step with each
row's own position (`pos_buf` [b]). On the tiny geometry (window 8, CSA ratio 4 with index_topk 4, HCA ratio 128;
layers 0/4/128/4) the prompt lengths 5, 125 and 18 put the rows at every phase of a ratio-4 window at every step,
row 1 across the HCA boundary (its entry completes at position 127 while the others do not), every row across the
window ring's wrap, and rows 1 and 2 past the indexer's top-k point (more than 4 entries). A ragged multi-token
append (3 tokens into every row at once) runs between the decode steps.
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.model import Transformer
from dsv4.tiny import random_state_dict, tiny_args

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.hardstop  # a row in a ragged batch == the same conversation alone (issue 24)
VOCAB = 512
REL = 1e-5  # fp32: max |d| <= REL * max |logit| (module docstring)
TRITON_REL = 1e-4  # triton (interpreter) vs the reference alone: the backends' fp32 distance (test_append.py)


def _model(seed: int = 24, backend: str = "reference") -> Transformer:
    args = tiny_args(vocab_size=VOCAB, index_topk=4)
    sd = {k: v for k, v in random_state_dict(args, seed=seed).items() if not k.startswith("mtp.")}
    m = Transformer(args, backend=backend)
    m.load_weights(sd)
    return m


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = REL) -> None:
    d = float((got - want).abs().max())
    scale = float(want.abs().max())
    assert d <= rel * scale, f"{what}: max |d| {d:.3g} > {rel:g} x max |logit| {scale:.3g}"
    assert torch.equal(got.argmax(-1), want.argmax(-1)), f"{what}: greedy tokens differ"


def _alone(model: Transformer, prompt: torch.Tensor, feeds: list[torch.Tensor]) -> list[torch.Tensor]:
    """One conversation in a batch-1 state: the prompt's last logits, then the logits after each feed [1, s]."""
    st = model.new_state(1)
    out = [model(prompt[None], st)]
    for f in feeds:
        out.append(model(f[None], st))
    return out


def _ragged_run(model: Transformer, prompts: list[torch.Tensor], feeds: list[torch.Tensor], max_len: int = 256
                ) -> list[torch.Tensor]:
    """All conversations in one state: each prompt into its row view, then each feed [b, s] for every row at
    once (s == 1: the decode step with per-row positions; s > 1: each row's append). Logits per call [b, V]."""
    st = model.new_state(len(prompts), max_len)
    first = torch.cat([model(p[None], st.row(i)) for i, p in enumerate(prompts)], 0)
    assert st.row_pos == [len(p) for p in prompts] and st.ragged
    out = [first]
    for f in feeds:
        out.append(model(f, st))
    assert st.row_pos == [len(p) + sum(f.shape[1] for f in feeds) for p in prompts]
    return out


def _data(lengths: list[int], schedule: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    feeds = [torch.randint(0, VOCAB, (len(lengths), s), generator=g) for s in schedule]
    return prompts, feeds


LENGTHS = [5, 125, 18]
SCHEDULE = [1, 1, 1, 3, 1, 8, 1, 2, 1]  # decode steps and ragged verify-sized steps of 3, 8 and 2 tokens


def test_ragged_rows_equal_each_conversation_alone(seed):
    m = _model()
    prompts, feeds = _data(LENGTHS, SCHEDULE, seed)
    got = _ragged_run(m, prompts, feeds)
    for i, p in enumerate(prompts):
        want = _alone(m, p, [f[i] for f in feeds])
        for step, (g, w) in enumerate(zip(got, want)):
            _assert_same(g[i:i + 1], w, f"row {i} (prompt {len(p)}) call {step}")


def test_continuous_batching_a_replaced_row_leaves_the_others_untouched(seed):
    """Row 1 finishes after 3 decode steps; `reset_row(1)` and a new request's prefill into its view take the slot
    (the other rows keep decoding in the same state). Every row's logits equal its conversation alone: row 0 and
    row 2 over the whole run, the new request from its prefill on. Negative control: without `reset_row` the new
    request's prefill sees the old request's compressor windows (a position-0 prefill over a dirty row) and
    differs."""
    m = _model()
    prompts, feeds = _data([9, 30, 14], [1, 1, 1], seed)
    g = torch.Generator().manual_seed(seed + 1)
    newcomer = torch.randint(0, VOCAB, (22,), generator=g)
    later = [torch.randint(0, VOCAB, (3, 1), generator=g) for _ in range(6)]
    st = m.new_state(3, 128)
    first = [m(p[None], st.row(i)) for i, p in enumerate(prompts)]
    steps = [m(f, st) for f in feeds]
    dirty = m.new_state(3, 128)  # the control: the same run, the slot reused without a reset
    [m(p[None], dirty.row(i)) for i, p in enumerate(prompts)]
    [m(f, dirty) for f in feeds]
    st.reset_row(1)
    assert st.row_pos == [12, 0, 17]
    new_first = m(newcomer[None], st.row(1))
    dirty.row_pos = [12, 0, 17]  # position reset only: the buffers keep the old request
    dirty_first = m(newcomer[None], dirty.row(1))
    steps += [m(f, st) for f in later]
    for i in (0, 2):
        want = _alone(m, prompts[i], [f[i] for f in feeds + later])
        for step, (gl, w) in enumerate(zip([first[i]] + [s[i:i + 1] for s in steps], want)):
            _assert_same(gl, w, f"row {i} call {step}")
    want = _alone(m, newcomer, [f[1] for f in later])
    for step, (gl, w) in enumerate(zip([new_first] + [s[1:2] for s in steps[3:]], want)):
        _assert_same(gl, w, f"new request in row 1, call {step}")
    d = float((dirty_first - want[0]).abs().max())
    assert d > 100 * REL * float(want[0].abs().max()), f"control: a slot reused without reset_row differs (|d| {d:.3g})"


@pytest.mark.skipif(not INTERP, reason="the triton backend on CPU needs TRITON_INTERPRET=1 (set before import)")
def test_triton_ragged_decode_equals_the_reference_alone(seed):
    """The triton backend's decode step (per-row positions through `compress_pool` / `compress_commit` /
    `rope_tail_` / `indexer_topk` / `sparse_attn`) on a ragged batch equals the reference backend alone, fp32
    within the backends' distance (1e-4). Short prompts (interpreter time): rows at positions 5 / 10 / 3 cross
    ratio-4 boundaries at different steps and the ring's wrap."""
    ref, tri = _model(), _model(backend="triton")
    prompts, feeds = _data([5, 10, 3], [1, 1, 3, 1, 1], seed)
    got = _ragged_run(tri, prompts, feeds, max_len=128)
    for i, p in enumerate(prompts):
        want = _alone(ref, p, [f[i] for f in feeds])
        for step, (gl, w) in enumerate(zip(got, want)):
            _assert_same(gl[i:i + 1], w, f"triton row {i} call {step}", TRITON_REL)


def test_ragged_state_api_names_misuse():
    m = _model()
    st = m.new_state(2, 128)
    m(torch.tensor([[1, 2, 3]]), st.row(0))
    assert st.row_pos == [3, 0] and st.ragged
    with pytest.raises(ValueError, match=r"different positions \[3, 0\]"):
        _ = st.pos
    with pytest.raises(IndexError, match=r"row 2: this state has rows 0..1"):
        st.row(2)
    with pytest.raises(IndexError, match="row -1"):
        st.reset_row(-1)
    for bad in ([1], "12", [1.7, 2.2], [True, 1], 3, None, [-1, 0]):  # nothing converted quietly
        with pytest.raises(ValueError, match=r"row_pos=.*: expected a list of 2 ints >= 0"):
            st.row_pos = bad
    with pytest.raises(ValueError, match=r"beyond this fixed state's max_len=128"):
        st.row_pos = [10 ** 6, 0]
    import numpy as np
    assert st.row(np.int64(1)).row_pos == [0]  # integer scalars are indices
    with pytest.raises(TypeError, match="not a bool"):
        st.row(True)
    with pytest.raises(TypeError, match="expected an int row index, got str"):
        st.reset_row("1")
    grow = m.new_state(2)  # growable: a reallocation makes earlier row views stale
    view = grow.row(1)
    m(torch.randint(0, VOCAB, (2, 200)), grow)
    with pytest.raises(ValueError, match="stale row view"):
        m(torch.tensor([[1]]), view)
    with pytest.raises(ValueError, match=r"max_len=128 tokens; position 3 \+ 126"):
        m(torch.randint(0, VOCAB, (1, 126)), st.row(0))
    st.pos = 5
    assert st.row_pos == [5, 5] and st.pos == 5 and not st.ragged


def test_lockstep_verify_step_equals_append(seed):
    """The decode step with s tokens per row (`Transformer.decode_step`, what a CUDA-graph state replays for a
    verify step) on rows at one position equals appending the same tokens (`Attention.extend`) at every one of
    the s positions (all_logits), fp32 within 1e-5, for s = 2, 5, 8 after a 126-token prompt (the HCA window
    completes inside the first call, ratio-4 windows inside and across every call, the ring wraps)."""
    m = _model()
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (2, 126), generator=g)
    st, ref = m.new_state(2, 256), m.new_state(2, 256)
    m(prompt, st), m(prompt, ref)
    for s in (2, 5, 8):
        x = torch.randint(0, VOCAB, (2, s), generator=g)
        want = m(x, ref, all_logits=True)
        with torch.no_grad():
            got = m.final_logits(st.decode_step(m, x))
        st.pos = st.pos + s
        _assert_same(got, want, f"verify step of {s} tokens at {st.pos - s}")
    assert st.pos == ref.pos == 126 + 15
