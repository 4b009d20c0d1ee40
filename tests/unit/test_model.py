"""The reference model against independent anchors (issue 4):

* transformers' `DeepseekV4ForCausalLM` on identical weights (fp32): logits at every position and greedy
  continuations. Tolerance: atol 5e-5 on logits of magnitude ~4 (measured max |diff| ~4e-6; fp32 rounding
  through 4 blocks of ~40 ops each, with different summation orders, is of order 1e-6 relative).
* itself, prefill == incremental decode, at prompt lengths that straddle every boundary of the tiny config
  (window 8, CSA ratio 4, HCA ratio 128, 4 * index_topk = 16), including exact indexer ties.

Where transformers and the official reference differ, the reference wins: transformers breaks indexer top-k
ties with CPU `torch.topk`'s arbitrary order; the official CUDA path (and ours) picks the lowest entry index
(spec §7.7). `test_hf_parity_with_indexer_ties` therefore runs transformers with the spec's tie rule (with
the tiny config's top-4 and random weights, unpatched transformers differs at the few positions where the
4th and 5th best scores tie exactly, and at the positions downstream of them).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4.hf_adapter import build_hf_model
from dsv4.model import Transformer
from dsv4.testing import assert_close
from dsv4.tiny import random_state_dict, tiny_args

pytestmark = pytest.mark.hardstop  # the reference model's independent anchors (transformers parity, prefill == decode)

VOCAB = 512  # a small vocab keeps the HF oracle fast; the real-vocab tiny checkpoint is covered elsewhere
LOGIT_ATOL = 5e-5  # see module docstring
DECODE_ATOL = 2e-5  # same model, same ops; only the attention key order / summation length differ


def _models(seed: int, **over):
    args = tiny_args(vocab_size=VOCAB, **over)
    sd = {k: v for k, v in random_state_dict(args, seed=seed).items() if not k.startswith("mtp.")}
    ours = Transformer(args)
    ours.load_weights(sd)
    return args, sd, ours


@pytest.fixture(scope="module")
def all_selected():
    """index_topk 64 > entries at every test length: every causal entry is selected, ties cannot matter."""
    args, sd, ours = _models(11, index_topk=64)
    return args, ours, build_hf_model(args, sd)


@pytest.fixture(scope="module")
def topk4():
    """The tiny config's index_topk 4: selection (and ties) matter from 20 tokens on."""
    args, sd, ours = _models(12)
    return args, ours, build_hf_model(args, sd)


def _stable_topk(self, k, dim=-1, largest=True, sorted=True):
    """torch.topk with the spec §7.7 tie rule (equal scores -> lower index first)."""
    v, i = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((v.narrow(dim, 0, k), i.narrow(dim, 0, k)))


@pytest.mark.parametrize("length", [1, 4, 5, 9, 17, 131])
def test_hf_parity_prefill(all_selected, length, seed):
    args, ours, hf = all_selected
    ids = torch.randint(0, VOCAB, (1, length))
    mine = ours(ids, ours.new_state(1), all_logits=True)
    theirs = hf(ids).logits.float()
    assert mine.abs().max() > 1.0, "degenerate logits would make the comparison meaningless"
    assert_close(mine, theirs, f"logits[len={length}]", atol=LOGIT_ATOL, rtol=0)


def test_hf_parity_batch_of_two(all_selected):
    args, ours, hf = all_selected
    ids = torch.randint(0, VOCAB, (2, 23))
    assert_close(ours(ids, ours.new_state(2), all_logits=True), hf(ids).logits.float(), "logits[b=2]",
                 atol=LOGIT_ATOL, rtol=0)


def test_hf_parity_with_indexer_ties(topk4, monkeypatch):
    args, ours, hf = topk4
    ids = torch.randint(0, VOCAB, (1, 64))
    mine = ours(ids, ours.new_state(1), all_logits=True)
    monkeypatch.setattr(torch.Tensor, "topk", _stable_topk)
    theirs = hf(ids).logits.float()
    assert_close(mine, theirs, "logits[topk=4, spec tie rule]", atol=LOGIT_ATOL, rtol=0)


def test_hf_greedy_continuation_equal(all_selected):
    """transformers' own cached decode path as an independent anchor for our decode state."""
    args, ours, hf = all_selected
    prompt = torch.randint(0, VOCAB, (1, 7))
    st = ours.new_state(1)
    logits, mine = ours(prompt, st), []
    eos = hf.generation_config.eos_token_id
    assert eos == args.eos_token_id == 1
    for _ in range(12):
        # min_new_tokens=12 makes transformers mask EOS (logit -inf) for all 12 steps: mask it here too, or a
        # random prompt whose greedy token is EOS (about 1 in 13 prompts on this random model) fails spuriously
        logits[:, eos] = -float("inf")
        tok = logits.argmax(-1, keepdim=True)
        mine.append(int(tok))
        logits = ours(tok, st)
    theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, 7:].tolist()
    assert mine == theirs


EPS_REGIME = 1e-3  # embed and layer 0's wq_b scaled by this: mean squares ~1e-6, the size of norm_eps


@pytest.fixture(scope="module")
def eps_regime():
    """Weights of `all_selected` with embed and layer 0's attn.wq_b scaled by 1e-3: in layer 0 the inputs of the
    mHC mix rsqrt, attn_norm / kv_norm / q_norm (RMSNorm) and the per-head q RMS norm have mean squares of the
    order of norm_eps = 1e-6, so every eps term counts as much as the data it is added to. Random weights at
    their usual scale (the other parity tests) keep mean squares ~1, where the eps is 1e-6 of the result and a
    dropped or misplaced eps is invisible."""
    args, sd, _ = _models(11, index_topk=64)
    sd["embed.weight"] = sd["embed.weight"] * EPS_REGIME
    sd["layers.0.attn.wq_b.weight"] = sd["layers.0.attn.wq_b.weight"] * EPS_REGIME
    ours = Transformer(args)
    ours.load_weights(sd)
    return args, sd, ours, build_hf_model(args, sd)


def test_hf_parity_in_the_eps_regime(eps_regime, seed):
    """Every `+ eps` inside a norm (spec §2 RMSNorm `rsqrt(mean(x^2) + 1e-6)`, §4 mHC step 2, §5 per-head q RMS)
    where it is as large as the mean square: logits equal transformers' (atol 5e-5, as `test_hf_parity_prefill`;
    measured 5e-6). Kills an eps dropped or placed outside the root (`1 / (sqrt(ms) + eps)`), anywhere.
    The ids come from the test's own seed (the `seed` fixture), not from whatever the global generator holds after
    the fixtures: the kill margin of the RMSNorm mutant depends on the ids (1.7e-4 against the 5e-5 tolerance for
    these; a CI run with ids drawn from the unseeded state once let it pass), so a batch of 4 sequences is
    compared and every one must match."""
    args, sd, ours, hf = eps_regime
    ids = torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(seed))
    mine = ours(ids, ours.new_state(ids.shape[0]), all_logits=True)
    theirs = hf(ids).logits.float()
    assert mine.abs().max() > 1.0, "degenerate logits would make the comparison meaningless"
    assert_close(mine, theirs, "logits[eps regime]", atol=LOGIT_ATOL, rtol=0)
    # negative control: the same weights with norm_eps 1e-6 -> 1e-12 move the logits far beyond the tolerance
    no_eps = Transformer(dataclasses.replace(args, norm_eps=1e-12))
    no_eps.load_weights(sd)
    moved = (no_eps(ids, no_eps.new_state(ids.shape[0]), all_logits=True) - theirs).abs().max()
    assert moved > 100 * LOGIT_ATOL, f"eps changes the logits by only {float(moved):.2e}: not the eps regime"


def _decode_vs_prefill(model: Transformer, ids: torch.Tensor, prefill_len: int) -> None:
    full = model(ids, model.new_state(ids.shape[0]), all_logits=True)  # row t = logits after prefix t+1
    st = model.new_state(ids.shape[0])
    steps = [model(ids[:, :prefill_len], st)]
    for t in range(prefill_len, ids.shape[1]):
        steps.append(model(ids[:, t:t + 1], st))
    assert_close(torch.stack(steps, 1), full[:, prefill_len - 1:], f"decode after prefill {prefill_len}",
                 atol=DECODE_ATOL, rtol=0)


@pytest.mark.parametrize("prefill_len", [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17])
def test_prefill_equals_decode_short(topk4, prefill_len, seed):
    """Boundaries of the window (8), CSA ratio (4) and 4*index_topk (16) straddled by the prefill length,
    decoding to 26 tokens (top-k selection active from 20 tokens)."""
    args, ours, _ = topk4
    _decode_vs_prefill(ours, torch.randint(0, VOCAB, (1, 26)), prefill_len)


@pytest.mark.slow
@pytest.mark.parametrize("prefill_len", [1, 127, 128, 129])
def test_prefill_equals_decode_hca_boundary(topk4, prefill_len):
    """HCA entries complete at 128 tokens: prefill below, at and above it, decode past it."""
    args, ours, _ = topk4
    _decode_vs_prefill(ours, torch.randint(0, VOCAB, (1, 136)), prefill_len)


def test_fresh_prefill_of_each_prefix_equals_full_rows(topk4):
    """The all-positions rows used above equal genuinely fresh prefills of each prefix length."""
    args, ours, _ = topk4
    ids = torch.randint(0, VOCAB, (1, 30))
    full = ours(ids, ours.new_state(1), all_logits=True)
    for n in (1, 4, 8, 9, 17, 21, 30):
        assert_close(ours(ids[:, :n], ours.new_state(1)), full[:, n - 1], f"prefill[{n}]", atol=DECODE_ATOL,
                     rtol=0)


def test_prefill_equals_decode_with_exact_indexer_ties(seed):
    """Indexer queries of zero make every score exactly 0: all entries tie and only the tie rule decides the
    top-4. Prefill and decode must pick the same (lowest-index) entries."""
    args, sd, _ = _models(13)
    for k in [k for k in sd if k.endswith("indexer.wq_b.weight")]:
        sd[k] = torch.zeros_like(sd[k])  # deliberate: forces exact ties (inputs stay random)
    model = Transformer(args)
    model.load_weights(sd)
    _decode_vs_prefill(model, torch.randint(0, VOCAB, (1, 28)), 5)


def test_forward_rejects_bad_input(topk4):
    args, ours, _ = topk4
    with pytest.raises(ValueError, match="dtype torch.float32"):
        ours(torch.ones(1, 3), ours.new_state(1))
    with pytest.raises(ValueError, match="batch 2 != the state's batch 1"):
        ours(torch.ones(2, 3, dtype=torch.long), ours.new_state(1))
    with pytest.raises(ValueError, match=r"outside \[0, 512\)"):
        ours(torch.tensor([[1, 512]]), ours.new_state(1))
    st = ours.new_state(1, 128)  # a fixed state: a call past its max_len is refused (appending is allowed)
    ours(torch.tensor([[1, 2]]), st)
    with pytest.raises(ValueError, match="max_len=128 tokens; position 2 \\+ 127"):
        ours(torch.ones(1, 127, dtype=torch.long), st)
    assert st.pos == 2


def test_state_refuses_another_model_instance(tiny_ckpt):
    """issue 28: a DecodeState prefilled by one model instance continued on another of the same architecture
    (its caches hold the first model's keys and values). The state belongs to the model that made it."""
    from dsv4.generate import load_model

    a, _ = load_model(tiny_ckpt, progress=False)
    b, _ = load_model(tiny_ckpt, progress=False)
    st = a.new_state(1)
    ids = torch.tensor([[0, 128803, 3085, 128804]])
    a(ids, st)
    with pytest.raises(ValueError, match="belongs to another model instance"):
        b(ids[:, :1], st)
    a(ids[:, :1], st)  # its own model continues
    with pytest.raises(ValueError, match="belongs to another model instance"):
        b(ids, a.new_state(1))  # a fresh state of another model too


@pytest.mark.parametrize("bad", [torch.float32, torch.float64, torch.bool])
def test_load_weights_refuses_non_integer_tid2eid(tiny_ckpt, bad):
    """issue 28: a float tid2eid was truncated by the cast (1.7 -> 1). Integer buffers take integer tensors only."""
    from dsv4.checkpoint import load_checkpoint
    from dsv4.generate import load_model

    m, _ = load_model(tiny_ckpt, progress=False)
    _, sd = load_checkpoint(tiny_ckpt, progress=False)
    k = next(k for k in sd if k.endswith("tid2eid"))
    sd[k] = sd[k].to(bad) + 0.7 if bad.is_floating_point else sd[k].to(bad)
    with pytest.raises(RuntimeError, match=rf"{k}: dtype {bad} cannot load into the model's integer torch.int64"):
        m.load_weights(sd)
