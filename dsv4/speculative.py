"""Speculative decoding, greedy (issue 26 items 2-3, without the MTP drafter yet): drafts checked by one verify step.

Each round: the drafter proposes k tokens after the context; the model runs one verify step of k + 1 tokens (the
last accepted token, then the drafts: `Transformer.verify`, the one decode step with s = k + 1 tokens per row)
and gives its greedy token at each of the k + 1 positions; the longest prefix of drafts equal to those tokens is
accepted, plus the model's token after it (the bonus: a round always yields >= 1 token). The state is rolled back
to the accepted prefix (`Transformer.rollback`: ring slots, the compressors' partial windows; no accepted token is
recomputed). Every token emitted is the model's own argmax at its position, so the output is plain greedy decoding
up to fp32 rounding of the verify step's batched positions: `tests/unit/test_speculative.py` checks it token for
token over 256+ tokens with four drafters, at near-ties (top two within the dtype's tolerance) counted, not
failed. A draft is never emitted unverified: an EOS draft ends the output only where the model's own token is EOS.

Drafters (`Drafter`: `draft(context, k) -> k token ids`): `ContinuationDrafter` proposes from a given token list
(the oracle, when the list is the model's own greedy continuation: every draft accepted), `AdversaryDrafter`
proposes a token different from a given continuation's (none accepted), `RandomDrafter` uniform random ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from dsv4.model import MAX_STEP_TOKENS, STATE_GRAIN, Transformer

__all__ = ["Drafter", "ContinuationDrafter", "AdversaryDrafter", "RandomDrafter", "SpeculativeResult",
           "speculative_greedy"]


class Drafter(Protocol):
    def draft(self, context: list[int], k: int) -> list[int]:
        """k proposed token ids following `context` (the prompt and every token emitted so far)."""


@dataclass
class ContinuationDrafter:
    """Proposes the tokens of `tokens` (a continuation of the prompt of length `prompt_len`) that follow the
    context; past its end, token 0. With the model's own greedy continuation it is the oracle."""

    prompt_len: int
    tokens: list[int]

    def draft(self, context: list[int], k: int) -> list[int]:
        i = len(context) - self.prompt_len
        return (self.tokens[i:i + k] + [0] * k)[:k]


@dataclass
class AdversaryDrafter:
    """Proposes, at every position, a token other than `tokens`' (the model's greedy continuation): none accepted."""

    prompt_len: int
    tokens: list[int]
    vocab_size: int

    def draft(self, context: list[int], k: int) -> list[int]:
        i = len(context) - self.prompt_len
        right = (self.tokens[i:i + k] + [0] * k)[:k]
        return [(t + 1) % self.vocab_size for t in right]


@dataclass
class RandomDrafter:
    """Uniform random token ids from a seeded generator."""

    vocab_size: int
    seed: int = 0
    _g: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._g = torch.Generator().manual_seed(self.seed)

    def draft(self, context: list[int], k: int) -> list[int]:
        return torch.randint(0, self.vocab_size, (k,), generator=self._g).tolist()


@dataclass
class SpeculativeResult:
    """ids: the emitted tokens (EOS included when produced); accepted: drafts accepted per verify round (0..k);
    stop: "eos" | "max_tokens"; mean_accepted_length: tokens emitted per verify round (accepted + the bonus)."""

    ids: list[int]
    accepted: list[int]
    stop: str

    @property
    def mean_accepted_length(self) -> float:
        return (sum(self.accepted) + len(self.accepted)) / max(1, len(self.accepted))


@torch.no_grad()
def speculative_greedy(model: Transformer, prompt: list[int], drafter: Drafter, *, k: int, max_tokens: int,
                       eos: int | None = None) -> SpeculativeResult:
    """Greedy decoding of `prompt` (token ids) with `k` drafts per verify step (1 <= k < MAX_STEP_TOKENS), batch 1,
    eager (module docstring). Stops at the model's EOS (`eos`, default the model's) or after max_tokens tokens
    (a round's tokens past it are dropped). Raises ValueError for k or max_tokens out of range, an empty prompt, or
    a drafter that returns other than k ints in the vocabulary."""
    if not isinstance(k, int) or not 1 <= k < MAX_STEP_TOKENS:
        raise ValueError(f"k={k!r}: expected 1..{MAX_STEP_TOKENS - 1} drafts per verify step")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}: expected an int >= 1")
    if not prompt:
        raise ValueError("prompt: expected at least one token id")
    eos = model.args.eos_token_id if eos is None else eos
    V, dev = model.args.vocab_size, model.device
    max_len = -(-(len(prompt) + max_tokens + k + 1) // STATE_GRAIN) * STATE_GRAIN
    state = model.new_state(1, max_len)
    out = [int(model(torch.tensor([prompt], device=dev), state).argmax(-1))]
    accepted: list[int] = []
    while out[-1] != eos and len(out) < max_tokens:
        drafts = drafter.draft(prompt + out, k)
        if len(drafts) != k or any(not isinstance(t, int) or not 0 <= t < V for t in drafts):
            raise ValueError(f"drafter returned {drafts!r}: expected {k} token ids in [0, {V})")
        logits, record = model.verify(torch.tensor([[out[-1]] + drafts], device=dev), state)
        pred = logits[0].argmax(-1).tolist()  # pred[j]: the model's token after out[-1] + drafts[:j]
        a = 0
        while a < k and drafts[a] == pred[a]:
            a += 1
        model.rollback(state, record, [a + 1])  # the last token and the a accepted drafts stay in the state
        accepted.append(a)
        for t in drafts[:a] + [pred[a]]:  # drafts[:a] == pred[:a]: every emitted token is the model's own
            out.append(t)
            if t == eos or len(out) >= max_tokens:
                break
    stop = "eos" if out[-1] == eos else "max_tokens"
    return SpeculativeResult(out[:max_tokens], accepted, stop)
