"""Batch-invariant mode (issue 25) at Flash width on CUDA: the guarantee of `kernels.invariant`, and its negative
control (hard stop).

Model: Flash geometry, first 4 layers (SWA, SWA, CSA, HCA; `index_topk` 64 so a 300-token prompt selects),
bf16, weights="quantized" with random codes (`fill_random_quantized_`), triton backend built with
batch_invariant=True; the same codes in a default-mode twin. Checks (logits compared with torch.equal):
  * a request (300-token prompt, then 3 decode steps) alone in a batch-1 state == row 0 of batches of 2, 8, 32, 64
    whose other rows hold random prompts of 20..400 tokens (other positions, other entry counts), fed other
    tokens, in eager and CUDA-graph decode (`use_decode_graphs`) alike, every one against the eager batch-1 run;
  * a 4-token verify-sized step (`decode_step` with s = 4) == 4 single-token steps, at each position;
  * a 640-token prompt prefilled in chunks of > 64 tokens (boundaries inside compression windows) == prefilled at
    once: the last position's logits and 2 decode steps after;
  * negative controls: the default mode's row 0 of the batch of 32 differs from its batch-1 run (issue 25's table:
    0-3 of 1.16 M logits equal), and its chunked prefill differs from its whole prefill, so the comparisons can see
    what the mode removes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dsv4.config import ModelArgs
from dsv4.model import Transformer
from dsv4.testing import fill_random_quantized_

pytestmark = [pytest.mark.gpu, pytest.mark.hardstop,  # the batch-invariant guarantee at Flash width (issue 25)
              pytest.mark.flash_width,  # shares the GPU with at most one other (tests/gpu/conftest.py)
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]

FLASH = Path(__file__).resolve().parents[2] / "fixtures/configs/deepseek_v4_flash.config.json"
PROMPT, STEPS, MAX_LEN, VOCAB_DRAW = 300, 3, 512, 1000


@pytest.fixture(scope="module")
def models():
    args = dataclasses.replace(ModelArgs.from_hf_config(FLASH).with_layers(4), index_topk=64)
    bi = Transformer(args, dtype=torch.bfloat16, device="cuda", backend="triton", weights="quantized",
                     batch_invariant=True).eval()
    fill_random_quantized_(bi, seed=25)
    default = Transformer(args, dtype=torch.bfloat16, device="cuda", backend="triton", weights="quantized").eval()
    default.load_weights(bi.state_dict())
    return bi, default


def _ids(g, n):
    return torch.randint(0, VOCAB_DRAW, (n,), generator=g).cuda()


def _run(model, b: int, graph: bool, seed: int = 0) -> list[torch.Tensor]:
    """Row 0's logits [V] after its prompt and after each of STEPS decode steps, in a batch of b rows (rows 1..b-1:
    other prompts and tokens, drawn from `seed + b`)."""
    g0 = torch.Generator().manual_seed(seed)
    prompt, feed = _ids(g0, PROMPT), _ids(g0, STEPS)
    g = torch.Generator().manual_seed(seed + b)
    model.use_decode_graphs(MAX_LEN if graph else None)
    try:
        st = model.new_state(b, MAX_LEN)
        out = [model(prompt[None], st.row(0))[0]]
        for i in range(1, b):
            model(_ids(g, int(torch.randint(20, 400, (1,), generator=g)))[None], st.row(i))
        for j in range(STEPS):
            toks = torch.cat((feed[j:j + 1], _ids(g, b - 1))).view(b, 1)
            out.append(model(toks, st)[0])
    finally:
        model.use_decode_graphs(None)
    return out


@torch.no_grad()
def test_row_logits_independent_of_batch_eager_and_graph(models):
    bi, _ = models
    alone = _run(bi, 1, graph=False)
    for graph in (False, True):
        for b in ((1, 2, 8, 32, 64) if graph else (2, 8, 32, 64)):
            got = _run(bi, b, graph)
            for j, (x, y) in enumerate(zip(got[1:], alone[1:])):
                assert torch.equal(x, y), (f"batch_invariant: row 0 of batch {b} ({'graph' if graph else 'eager'}) "
                                           f"step {j}: {int((x != y).sum())} of {x.numel()} logits differ from "
                                           f"batch 1, max |d| {float((x - y).abs().max()):.3g}")


@torch.no_grad()
def test_verify_step_equals_single_steps(models):
    bi, _ = models
    g = torch.Generator().manual_seed(7)
    prompt, ids = _ids(g, PROMPT), _ids(g, 4)
    one = bi.new_state(1, MAX_LEN)
    bi(prompt[None], one)
    singles = [bi(ids[j].view(1, 1), one)[0] for j in range(4)]
    multi = bi.new_state(1, MAX_LEN)
    bi(prompt[None], multi)
    step = bi(ids[None], multi, all_logits=True)[0]
    for j in range(4):
        assert torch.equal(step[j], singles[j]), (f"batch_invariant: verify position {j}: "
                                                  f"{int((step[j] != singles[j]).sum())} logits differ")


CHUNKINGS = ((640,), (100, 300, 240), (128, 512), (65, 575))  # every chunk > 64 tokens (the stated unit)


def _chunked(model, prompt: torch.Tensor, chunks: tuple[int, ...], feed: torch.Tensor) -> list[torch.Tensor]:
    """Logits of the prompt's last position after prefilling it in `chunks` (appended calls into one state),
    then of each decode step feeding `feed` (the state the chunks left behind)."""
    st = model.new_state(1, 768)
    p = 0
    for c in chunks:
        last = model(prompt[None, p:p + c], st)[0]
        p += c
    out = [last]
    for j in range(feed.numel()):
        out.append(model(feed[j].view(1, 1), st)[0])
    return out


@torch.no_grad()
def test_chunked_prefill_equals_whole_prompt(models):
    """A 640-token prompt prefilled at once == prefilled in chunks of > 64 tokens whose boundaries fall anywhere
    (not on a window or compression boundary: 100 / 400 / 65 sit inside CSA windows of 4 and HCA windows of 128),
    bitwise: the last position's logits and 2 decode steps after it (the state the chunks wrote)."""
    bi, _ = models
    g = torch.Generator().manual_seed(11)
    prompt, feed = _ids(g, sum(CHUNKINGS[0])), _ids(g, 2)
    whole = _chunked(bi, prompt, CHUNKINGS[0], feed)
    for chunks in CHUNKINGS[1:]:
        got = _chunked(bi, prompt, chunks, feed)
        for j, (x, y) in enumerate(zip(got, whole)):
            assert torch.equal(x, y), (f"batch_invariant: prefill in chunks {chunks}, "
                                       f"{'prompt end' if j == 0 else f'decode step {j}'}: "
                                       f"{int((x != y).sum())} of {x.numel()} logits differ from the whole prompt, "
                                       f"max |d| {float((x - y).abs().max()):.3g}")


@torch.no_grad()
def test_chunked_prefill_default_mode_differs_negative_control(models):
    """The same chunked-vs-whole comparison in the default mode finds a difference (cuBLAS / tile paths by M),
    so the check above can see what the mode removes."""
    _, default = models
    g = torch.Generator().manual_seed(11)
    prompt, feed = _ids(g, sum(CHUNKINGS[0])), _ids(g, 2)
    whole = _chunked(default, prompt, CHUNKINGS[0], feed)
    diffs = [not torch.equal(x, y) for chunks in CHUNKINGS[1:]
             for x, y in zip(_chunked(default, prompt, chunks, feed), whole)]
    assert any(diffs), "negative control: the default mode's chunked prefill gave the whole prompt's logits bitwise"


@torch.no_grad()
def test_default_mode_differs_negative_control(models):
    _, default = models
    alone, batch = _run(default, 1, graph=False), _run(default, 32, graph=False)
    same = [torch.equal(x, y) for x, y in zip(batch[1:], alone[1:])]
    assert not all(same), ("negative control: the default mode gave row 0 of a batch of 32 bitwise its batch-1 "
                           "logits at every step (the comparison would be blind; issue 25 measured it differ)")
