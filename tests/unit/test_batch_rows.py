"""Rows of a batch are independent sequences, in prefill and in decode (docs/public_bugs.md, "batch rows").

Public DeepSeek-V3.2 / V4 ports broke batched serving in ways a batch-of-one test cannot see: indexer state
sized or padded across the batch, a compressor state shared between sequences, sparse-index plumbing that
mixes rows. The anchors elsewhere are batch-1 (prefill == decode, transformers' greedy decode) or prefill-only
(`test_model.py::test_hf_parity_batch_of_two`, with every compressed entry selected, so the indexer's per-row
top-k never matters there). Here a batch of three different sequences is prefilled and decoded past the point
where the indexer's top-4 is active (20 tokens; tiny config: window 8, CSA ratio 4, HCA ratio 128), and every
row must equal the same sequence run alone.

Invariance, fp32: the batched and the single-row runs do the same operations on the same values; only the
batch size of the matmuls differs (CPU GEMM blocking, summation order), so the logits (magnitude ~4) agree to
fp32 rounding through 4 blocks: atol 2e-5, as `test_model.py` DECODE_ATOL.
"""

from __future__ import annotations

import torch

from dsv4.model import Transformer
from dsv4.testing import assert_close
from dsv4.tiny import random_state_dict, tiny_args

VOCAB = 512  # small vocab: cheap head, same architecture
ATOL = 2e-5  # see module docstring
ROWS, LENGTH = 3, 26


def _model() -> Transformer:
    args = tiny_args(vocab_size=VOCAB)  # index_topk 4: top-k selection is active from 20 tokens on
    sd = {k: v for k, v in random_state_dict(args, seed=21).items() if not k.startswith("mtp.")}
    model = Transformer(args)
    model.load_weights(sd)
    return model


def _run(model: Transformer, ids: torch.Tensor, prefill_len: int) -> torch.Tensor:
    """Prefill `prefill_len` tokens, then decode the rest one token per call -> logits [b, steps, V]."""
    st = model.new_state(ids.shape[0])
    steps = [model(ids[:, :prefill_len], st)]
    steps += [model(ids[:, t:t + 1], st) for t in range(prefill_len, ids.shape[1])]
    return torch.stack(steps, 1)


def test_batched_prefill_and_decode_equal_each_row_alone():
    model = _model()
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH))
    for prefill_len in (3, 9):  # a CSA window remainder at the prefill -> decode boundary; past the window
        batched = _run(model, ids, prefill_len)
        for r in range(ROWS):
            assert not torch.equal(ids[r], ids[(r + 1) % ROWS]), "rows must be different sequences"
            alone = _run(model, ids[r:r + 1], prefill_len)[0]
            assert_close(batched[r], alone, f"row {r} of a batch of {ROWS} vs alone (prefill {prefill_len})",
                         atol=ATOL, rtol=0)
        # power: the rows' logits really differ, so a row computed from another row's state cannot pass
        for r in range(ROWS):
            gap = (batched[r] - batched[(r + 1) % ROWS]).abs().amax()
            assert gap > 100 * ATOL, f"rows {r} and {(r + 1) % ROWS} give near-identical logits ({gap:.2e})"
