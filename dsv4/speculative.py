"""Speculative decoding, greedy (issue 26 items 1-3): drafts checked by one verify step.

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
proposes a token different from a given continuation's (none accepted), `RandomDrafter` uniform random ids, and
`MTPDrafter` the model's MTP block (spec §10), chained k times on its own streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from dsv4.model import MAX_STEP_TOKENS, STATE_GRAIN, Transformer

__all__ = ["Drafter", "ContinuationDrafter", "AdversaryDrafter", "RandomDrafter", "MTPDrafter", "SpeculativeResult",
           "speculative_greedy", "accept_or_resample", "speculative_sample"]


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


class MTPDrafter:
    """The model's own MTP block `mtp.0` as drafter (spec §10; the model built with `mtp=True`). The block keeps
    its own sliding-window state at the main model's positions: position t reads the main model's last streams
    H_t and the token at t + 1 and predicts the token at t + 2. `speculative_greedy` calls `begin` after the
    prefill (H of every prompt position) and `accepted` after each round (H of the positions the round kept and
    the tokens after them). A draft of k chains the block k - 1 times on its own streams, at the positions that
    follow, on a copy of its window ring taken before and put back after (nothing of a draft stays). Its drafts
    on random weights are random: acceptance means nothing there; the output is plain greedy whatever it drafts.
    Raises ValueError for a model without MTP blocks."""

    def __init__(self, model: Transformer):
        if getattr(model, "mtp", None) is None:
            raise ValueError("MTPDrafter: the model has no MTP block (build it with Transformer(..., mtp=True) / "
                             "load_model(..., mtp=True))")
        self.model, self.block = model, model.mtp[0]
        self.st = None
        self.pos = 0
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # (logits [1, V], streams [1, 1, hc, dim])

    def _predict(self, H: torch.Tensor, next_ids: list[int], pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        ids = torch.tensor([next_ids], device=m.device)
        return self.block.predict(H, m.embed(ids), pos, ids, self.st, m.backend, m.head)

    def begin(self, prompt: list[int], H: torch.Tensor, first: int, max_len: int) -> None:
        m = self.model
        self.st = self.block.attn.new_state(1, max_len, m.dtype, m.device)
        logits, X = self._predict(H, prompt[1:] + [first], 0)
        self.pos, self.last = len(prompt), (logits[:, -1], X[:, -1:])

    def accepted(self, H: torch.Tensor, next_ids: list[int]) -> None:
        logits, X = self._predict(H, next_ids, self.pos)
        self.pos, self.last = self.pos + len(next_ids), (logits[:, -1], X[:, -1:])

    def draft(self, context: list[int], k: int) -> list[int]:
        logits, X = self.last
        out = [int(logits.argmax(-1))]
        if k > 1:
            ring = self.st.ring.clone()
            for j in range(k - 1):
                lg, X = self._predict(X, [out[-1]], self.pos + j)
                out.append(int(lg[:, -1].argmax(-1)))
            self.st.ring.copy_(ring)
        return out


@dataclass
class SpeculativeResult:
    """ids: the emitted tokens (EOS included when produced); accepted: drafts accepted per verify round (0..k);
    stop: "eos" | "max_tokens"; mean_accepted_length: tokens emitted per verify round (accepted + the bonus)."""

    ids: list[int]
    accepted: list[int]
    stop: str

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per verify step; None when no verify step ran (the first token ended the output)."""
        if not self.accepted:
            return None
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted)


def _check_call(model: Transformer, prompt, k, max_tokens) -> None:
    """ValueError naming the first bad argument of a speculative decode."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < MAX_STEP_TOKENS:
        raise ValueError(f"k={k!r}: expected an int in 1..{MAX_STEP_TOKENS - 1} (drafts per verify step)")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}: expected an int >= 1")
    V = model.args.vocab_size
    if not isinstance(prompt, (list, tuple)) or not prompt or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V for t in prompt):
        raise ValueError(f"prompt: expected a non-empty list of token ids in [0, {V}) (ints), got "
                         f"{type(prompt).__name__}")


def _check_drafts(drafts, k: int, V: int) -> list[int]:
    if not isinstance(drafts, (list, tuple)) or len(drafts) != k or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V for t in drafts):
        raise ValueError(f"drafter returned {drafts!r}: expected a list of {k} token ids (ints) in [0, {V})")
    return list(drafts)


def _speculate(model: Transformer, prompt: list[int], drafter: Drafter, k: int, max_tokens: int, eos: int | None,
               first: Callable[[torch.Tensor], int], choose: Callable[[torch.Tensor, list[int]], list[int]]
               ) -> SpeculativeResult:
    """The loop both decoders share: prefill (its first token `first(logits [V])`), then rounds of k drafts, one
    verify step of k + 1 tokens, `choose(logits [k + 1, V], drafts)` -> the emitted tokens (the accepted drafts
    then the model's token after them; len - 1 = drafts accepted), the rollback to the kept prefix, the drafter's
    update, until EOS or max_tokens."""
    _check_call(model, prompt, k, max_tokens)
    eos = model.args.eos_token_id if eos is None else eos
    V, dev = model.args.vocab_size, model.device
    max_len = -(-(len(prompt) + max_tokens + k + 1) // STATE_GRAIN) * STATE_GRAIN
    state = model.new_state(1, max_len)
    logits, H = model(torch.tensor([prompt], device=dev), state, streams=True)
    out = [first(logits[0])]
    if hasattr(drafter, "begin"):  # a drafter with state of its own (`MTPDrafter`) reads the prompt's streams
        drafter.begin(list(prompt), H, out[0], max_len)
    accepted: list[int] = []
    while out[-1] != eos and len(out) < max_tokens:
        drafts = _check_drafts(drafter.draft(list(prompt) + out, k), k, V)
        logits, record = model.verify(torch.tensor([[out[-1]] + drafts], device=dev), state)
        emitted = choose(logits[0], drafts)
        a = len(emitted) - 1
        model.rollback(state, record, [a + 1])  # the last token and the a accepted drafts stay in the state
        accepted.append(a)
        if hasattr(drafter, "accepted"):  # the kept positions' streams and the tokens after them
            drafter.accepted(record.streams[:, :a + 1], emitted)
        for t in emitted:
            out.append(t)
            if t == eos or len(out) >= max_tokens:
                break
    return SpeculativeResult(out[:max_tokens], accepted, "eos" if out[-1] == eos else "max_tokens")


@torch.no_grad()
def speculative_greedy(model: Transformer, prompt: list[int], drafter: Drafter, *, k: int, max_tokens: int,
                       eos: int | None = None) -> SpeculativeResult:
    """Greedy decoding of `prompt` (token ids) with `k` drafts per verify step (1 <= k < MAX_STEP_TOKENS), batch 1,
    eager (module docstring). Stops at the model's EOS (`eos`, default the model's) or after max_tokens tokens
    (a round's tokens past it are dropped). Raises ValueError for k or max_tokens out of range, an empty prompt, or
    a drafter that returns other than k ints in the vocabulary."""
    eos_id = model.args.eos_token_id if eos is None else eos

    def choose(logits: torch.Tensor, drafts: list[int]) -> list[int]:
        pred = logits.argmax(-1).tolist()  # pred[j]: the model's token after the last token + drafts[:j]
        a = 0
        while a < k and drafts[a] == pred[a]:
            a += 1
        return drafts[:a] + [pred[a]]  # drafts[:a] == pred[:a]: every emitted token is the model's own

    return _speculate(model, prompt, drafter, k, max_tokens, eos_id, lambda lg: int(lg.argmax(-1)), choose)


def accept_or_resample(p: torch.Tensor, draft: int, generator: torch.Generator | None = None) -> tuple[bool, int]:
    """Lossless speculative sampling for a point-mass draft (Leviathan et al. 2023, "Fast Inference from
    Transformers via Speculative Decoding", §2.3, with the draft distribution q = one-hot(draft): the drafters
    here propose their argmax): accept the draft with probability min(1, p(draft) / q(draft)) = p(draft); on
    rejection draw from the residual norm(max(0, p - q)) = p with the draft's mass removed, renormalised. The
    token returned is distributed exactly as p. p: [V] probabilities (fp32, sum 1) of the target model at the
    draft's position. Returns (accepted, token)."""
    u = torch.rand((), generator=generator, device=p.device)
    if bool(u < p[draft]):
        return True, draft
    r = p.clone()
    r[draft] = 0
    return False, int(torch.multinomial(r / r.sum(), 1, generator=generator))


@torch.no_grad()
def speculative_sample(model: Transformer, prompt: list[int], drafter: Drafter, *, k: int, max_tokens: int,
                       temperature: float, seed: int = 0, eos: int | None = None) -> SpeculativeResult:
    """Speculative decoding at temperature T > 0 (batch 1, eager): each verify step's drafts are accepted or
    replaced by `accept_or_resample` on softmax(logits / T) at their positions, in order, until the first
    rejection; when every draft is accepted a bonus token is drawn at the next position. The tokens are
    distributed as plain sampling at T (the rule's test: tests/unit/test_speculative.py, a chi-square test at a
    stated false-alarm rate); not the same draws as `generate`'s exponential race (another use of the random
    numbers). Seeded by `seed` (a generator on the model's device). Raises ValueError as `speculative_greedy`,
    and for a temperature that is not a finite number > 0."""
    if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and
                                             0 < temperature < float("inf")):
        raise ValueError(f"temperature={temperature!r}: expected a finite number > 0 (0: speculative_greedy)")
    eos_id = model.args.eos_token_id if eos is None else eos
    gen = torch.Generator(device=model.device).manual_seed(seed)

    def probs(logits: torch.Tensor) -> torch.Tensor:
        return (logits.float() / temperature).softmax(-1)

    def choose(logits: torch.Tensor, drafts: list[int]) -> list[int]:
        emitted = []
        for j, d in enumerate(drafts):
            ok, t = accept_or_resample(probs(logits[j]), d, gen)
            emitted.append(t)
            if not ok or t == eos_id:
                return emitted
        return emitted + [int(torch.multinomial(probs(logits[k]), 1, generator=gen))]  # all accepted: the bonus

    return _speculate(model, prompt, drafter, k, max_tokens, eos_id,
                      lambda lg: int(torch.multinomial(probs(lg), 1, generator=gen)), choose)
