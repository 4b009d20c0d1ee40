"""Speculative decoding (issue 26 items 1-3): drafts checked by one verify step.

Each round: the drafter proposes k tokens after the context; the model runs one verify step of k + 1 tokens (the
last accepted token, then the drafts: `Transformer.verify`, the one decode step with s = k + 1 tokens per row)
and gives its greedy token at each of the k + 1 positions; the longest prefix of drafts equal to those tokens is
accepted, plus the model's token after it (the bonus: a round always yields >= 1 token). The state is rolled back
to the accepted prefix (`Transformer.rollback`: ring slots, the compressors' partial windows; no accepted token is
recomputed). Every token emitted is the model's own argmax at its position, so the output is plain greedy decoding
up to fp32 rounding of the verify step's batched positions: `tests/unit/test_speculative.py` checks it token for
token over 256+ tokens with four drafters, at near-ties (top two within the dtype's tolerance) counted, not
failed. A draft is never emitted unverified: an EOS draft ends the output only where the model's own token is EOS.

A batch (`speculative_greedy_batch`, `speculative_sample_batch`; the batch-1 functions are batches of one): rows
with prompts of any lengths (ragged positions), one drafter each, one verify step of k + 1 tokens for all rows
per round; each row accepts against its own logits and `Transformer.rollback` keeps each row's length. A row
stops at its EOS or its max_tokens; a stopped row runs on in the step on dummy ids and keeps nothing.

Drafters (`Drafter`: `draft(context, k) -> k token ids`): `ContinuationDrafter` proposes from a given token list
(the oracle, when the list is the model's own greedy continuation: every draft accepted), `AdversaryDrafter`
proposes a token different from a given continuation's (none accepted), `RandomDrafter` uniform random ids, and
`MTPDrafter` the model's MTP block (spec §10), chained k times on its own streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from dsv4.config import check_has_mtp
from dsv4.memory_plan import LimitError, check_serving, max_context
from dsv4.model import MAX_STEP_TOKENS, STATE_GRAIN, Transformer
from dsv4.synth import check_seed

__all__ = ["Drafter", "ContinuationDrafter", "AdversaryDrafter", "RandomDrafter", "MTPDrafter", "SpeculativeResult",
           "speculative_greedy", "speculative_greedy_batch", "accept_or_resample", "speculative_sample",
           "speculative_sample_batch"]


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
    Raises ValueError for a model built without its MTP blocks; `dsv4.config.NoMTPBlockError` (a ValueError) for a
    model whose checkpoint has none (num_nextn_predict_layers 0)."""

    def __init__(self, model: Transformer):
        if getattr(model, "mtp", None) is None:
            raise ValueError("MTPDrafter: the model has no MTP block (build it with Transformer(..., mtp=True) / "
                             "load_model(..., mtp=True))")
        if len(model.mtp) == 0:
            check_has_mtp(model.args, "MTPDrafter: this model's checkpoint")
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


def _bad_token_ids(ids, V: int, name: str) -> str | None:
    """Why `ids` is not a non-empty list of token ids in [0, V) (ints; a bool is not one), naming the first bad id
    and its index; None when it is one."""
    if not isinstance(ids, (list, tuple)):
        return f"got {type(ids).__name__}"
    if not ids:
        return f"got an empty {type(ids).__name__}"
    bad = [i for i, t in enumerate(ids) if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V]
    if not bad:
        return None
    t = ids[bad[0]]
    kind = "" if isinstance(t, int) and not isinstance(t, bool) else f" ({type(t).__name__})"
    return f"got {name}[{bad[0]}]={t!r}{kind} ({len(bad)} bad of {len(ids)})"


def _check_call(model: Transformer, prompt, k, max_tokens, name: str = "prompt") -> None:
    """ValueError naming the first bad argument of a speculative decode (a bad prompt id: its value and index)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < MAX_STEP_TOKENS:
        raise ValueError(f"k={k!r}: expected an int in 1..{MAX_STEP_TOKENS - 1} (drafts per verify step)")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}: expected an int >= 1")
    V = model.args.vocab_size
    why = _bad_token_ids(prompt, V, name)
    if why is not None:
        raise ValueError(f"{name}: expected a non-empty list of token ids in [0, {V}) (ints), {why}")


def _check_batch(model: Transformer, prompts, drafters, k, max_tokens) -> list[int]:
    """ValueError naming the first bad argument of a batch speculative decode -> max_tokens per row."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts: expected a non-empty list of prompts (lists of token ids), got "
                         f"{type(prompts).__name__ if prompts else 'an empty ' + type(prompts).__name__}")
    n = len(prompts)
    limits = [max_tokens] * n if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) else max_tokens
    if not isinstance(limits, (list, tuple)) or len(limits) != n:
        raise ValueError(f"max_tokens={max_tokens!r}: expected an int >= 1 or a list of {n} of them")
    for i, (p, m) in enumerate(zip(prompts, limits)):
        try:
            _check_call(model, p, k, m, f"prompts[{i}]")
        except ValueError as e:
            raise ValueError(f"{e} (row {i})" if str(e).startswith("max_tokens") else str(e)) from None
    want = f"a list of {n} drafters (objects with draft(context, k)), one per prompt"
    if not isinstance(drafters, (list, tuple)):
        raise ValueError(f"drafters: expected {want}, got {type(drafters).__name__}")
    if len(drafters) != n:
        raise ValueError(f"drafters: expected {want}, got a {type(drafters).__name__} of {len(drafters)} for "
                         f"{n} prompt(s)")
    for j, d in enumerate(drafters):
        if not callable(getattr(d, "draft", None)):
            raise ValueError(f"drafters[{j}]: expected a drafter (an object with draft(context, k)), got "
                             f"{type(d).__name__}")
    stateful = [id(d) for d in drafters if hasattr(d, "begin") or hasattr(d, "accepted")]
    if len(set(stateful)) != len(stateful):
        raise ValueError("drafters: one drafter object serves two rows; a drafter with state of its own "
                         "(MTPDrafter) follows one row: give each row its own")
    return list(limits)


def _check_eos(model: Transformer, eos) -> int:
    """The EOS id of a speculative decode: `eos`, the model's when None, -1 for none (every row runs to its
    max_tokens); ValueError naming any other value than a token id in [0, V) (another id outside the vocabulary
    would never match either, so a typo would silently run to max_tokens)."""
    V = model.args.vocab_size
    if eos is None:
        return model.args.eos_token_id
    if isinstance(eos, bool) or not isinstance(eos, int) or not -1 <= eos < V:
        raise ValueError(f"eos={eos!r}: expected None (the model's EOS, {model.args.eos_token_id}), a token id in "
                         f"[0, {V}) (an int), or -1 (no EOS: run to max_tokens)")
    return eos


def _check_drafts(drafts, k: int, V: int, row: int = 0) -> list[int]:
    """The k drafts a drafter returned, as a list; ValueError naming the row and the first bad id (its index)."""
    if not isinstance(drafts, (list, tuple)) or len(drafts) != k:
        got = f"a {type(drafts).__name__} of {len(drafts)}" if isinstance(drafts, (list, tuple)) else \
            type(drafts).__name__
        raise ValueError(f"drafter returned {drafts!r:.200}: expected a list of {k} token ids (ints) in [0, {V}), "
                         f"got {got} (row {row})")
    why = _bad_token_ids(drafts, V, "drafts")
    if why is not None:
        raise ValueError(f"drafter returned {drafts!r}: expected a list of {k} token ids (ints) in [0, {V}), {why} "
                         f"(row {row})")
    return list(drafts)


def plan_rows(model: Transformer, batch: int, rows: list[tuple[str, int, str, int]]) -> int:
    """The max_len of a decode state for `batch` rows of a batched decode (`dsv4.generate.generate_batch`, the
    speculative decoders), after the serving limits, checked before any model work: `rows` holds one
    (label, prompt length, what it adds up, tokens it needs) per request. Returns the tokens a row needs, rounded
    up to a multiple of `STATE_GRAIN` (what the state holds), or the capture's max_len of a model that decodes
    through CUDA graphs.

    Raises `dsv4.memory_plan.LimitError` naming the request and its real total (not the rounded state size) when
    a row needs more than the model's context (original_seq_len x rope_factor) or than a CUDA-graph model's
    max_len; what `check_serving` raises (batch over MAX_BATCH; a decode state larger than the device has
    available, with the rounded size a row's state holds added when it differs from the real total)."""
    ctx = max_context(model.args)
    for label, plen, parts, n in rows:
        if n > ctx:
            raise LimitError(f"{label}: a row needs {n} tokens ({parts}), over the model's context of {ctx} tokens "
                             f"per row (original_seq_len {model.args.original_seq_len} x rope_factor "
                             f"{model.args.rope_factor}); shorten the prompt ({plen} tokens) or lower max_tokens")
    label, _, parts, need = max(rows, key=lambda r: r[3])
    held = -(-need // STATE_GRAIN) * STATE_GRAIN
    graph = model.decode_graph_max_len
    if graph is not None:  # a graph state has the capture's max_len
        if need > graph:
            raise LimitError(f"{label}: a row needs {need} tokens ({parts}); this model decodes through CUDA graphs "
                             f"of max_len={graph} (use_decode_graphs)")
        held = graph
    try:
        check_serving(model.args, batch=batch, max_len=need if graph is None else graph, device=model.device,
                      dtype_bytes=torch.empty((), dtype=model.dtype).element_size())
    except LimitError as e:
        if graph is None and held != need and str(e).startswith("the decode state"):
            raise LimitError(f"{e}; each row's state holds {held} tokens ({need} rounded up to a multiple of "
                             f"STATE_GRAIN = {STATE_GRAIN})") from None
        raise
    return held


def _speculate(model: Transformer, prompts: list[list[int]], drafters: list[Drafter], k: int, max_tokens,
               eos: int | None, first: Callable[[int, torch.Tensor], int],
               choose: Callable[[int, torch.Tensor, list[int]], list[int]]) -> list[SpeculativeResult]:
    """The loop every speculative decoder shares, for a batch of b rows (one prompt each; ragged: rows at their
    own positions): the prefill (row i's first token `first(i, logits [V])`), then rounds of k drafts per
    running row, ONE verify step of k + 1 tokens for all rows, `choose(i, logits [k + 1, V] of row i, drafts of
    row i)` -> row i's emitted tokens (its accepted drafts then the model's token after them; len - 1 = drafts
    accepted), one rollback with each row's kept length, each drafter's update, until every row stopped (its EOS
    or its max_tokens). A finished row still runs in the verify step (the batch is fixed) on a dummy input; it
    keeps nothing (its position is put back each round) and its outputs are not read, so it changes no other
    row's tokens."""
    limits = _check_batch(model, prompts, drafters, k, max_tokens)
    eos = _check_eos(model, eos)
    V, dev, b = model.args.vocab_size, model.device, len(prompts)
    prompts = [list(p) for p in prompts]
    max_len = plan_rows(model, b, [
        (f"prompts[{i}]", len(p), f"prompt {len(p)} + max_tokens {m} + {k + 1} (k + 1 for the verify step)",
         len(p) + m + k + 1) for i, (p, m) in enumerate(zip(prompts, limits))])
    state = model.new_state(b, None if model.decode_graph_max_len is not None else max_len)
    if len({len(p) for p in prompts}) == 1:  # one prefill call for rows of one length
        logits, H = model(torch.tensor(prompts, device=dev), state, streams=True)
        streams = [H[i:i + 1] for i in range(b)]
    else:  # ragged: each row's prefill on its row view (`DecodeState.row`)
        outs = [model(torch.tensor([p], device=dev), state.row(i), streams=True) for i, p in enumerate(prompts)]
        logits, streams = torch.cat([o[0] for o in outs]), [o[1] for o in outs]
    out = [[first(i, logits[i])] for i in range(b)]
    for i, d in enumerate(drafters):
        if hasattr(d, "begin"):  # a drafter with state of its own (`MTPDrafter`) reads the prompt's streams
            d.begin(prompts[i], streams[i], out[i][0], max_len)
    accepted: list[list[int]] = [[] for _ in range(b)]
    running = [out[i][-1] != eos and len(out[i]) < limits[i] for i in range(b)]
    while any(running):
        drafts = [_check_drafts(drafters[i].draft(prompts[i] + out[i], k), k, V, i) if running[i] else [0] * k
                  for i in range(b)]
        ids = torch.tensor([[out[i][-1]] + drafts[i] for i in range(b)], device=dev)
        logits, record = model.verify(ids, state)
        keep, emitted = [1] * b, [[] for _ in range(b)]
        for i in range(b):
            if running[i]:
                emitted[i] = choose(i, logits[i], drafts[i])
                keep[i] = len(emitted[i])  # the last token and the accepted drafts stay in the state
        model.rollback(state, record, keep)
        if not all(running):  # finished rows keep nothing
            state.row_pos = [p if running[i] else record.pos0[i] for i, p in enumerate(state.row_pos)]
        for i in range(b):
            if not running[i]:
                continue
            accepted[i].append(keep[i] - 1)
            if hasattr(drafters[i], "accepted"):  # the kept positions' streams and the tokens after them
                drafters[i].accepted(record.streams[i:i + 1, :keep[i]], emitted[i])
            for t in emitted[i]:
                out[i].append(t)
                if t == eos or len(out[i]) >= limits[i]:
                    running[i] = False
                    break
    return [SpeculativeResult(out[i][:limits[i]], accepted[i], "eos" if out[i][-1] == eos else "max_tokens")
            for i in range(b)]


@torch.no_grad()
def speculative_greedy(model: Transformer, prompt: list[int], drafter: Drafter, *, k: int, max_tokens: int,
                       eos: int | None = None) -> SpeculativeResult:
    """Greedy decoding of `prompt` (token ids) with `k` drafts per verify step (1 <= k < MAX_STEP_TOKENS), batch 1
    (module docstring; `speculative_greedy_batch` of one row). Stops at the model's EOS (`eos`, default the
    model's; -1: none) or after max_tokens tokens (a round's tokens past it are dropped). Raises ValueError for k
    or max_tokens out of range, an empty prompt or one holding other than token ids in [0, V) (the first bad id
    and its index named), an `eos` that is neither such an id nor -1, or a drafter that returns other than k ints
    in the vocabulary; LimitError as `speculative_greedy_batch`."""
    _check_call(model, prompt, k, max_tokens)
    return speculative_greedy_batch(model, [prompt], [drafter], k=k, max_tokens=max_tokens, eos=eos)[0]


@torch.no_grad()
def speculative_greedy_batch(model: Transformer, prompts: list[list[int]], drafters: list[Drafter], *, k: int,
                             max_tokens: int | list[int], eos: int | None = None) -> list[SpeculativeResult]:
    """Greedy speculative decoding of a batch: `prompts` (b lists of token ids, any lengths: rows sit at their own
    positions), `drafters` (b drafters, one per row: a drafter with state, `MTPDrafter`, may not serve two rows),
    `k` drafts per row per verify step (1 <= k < MAX_STEP_TOKENS), `max_tokens` an int or one per row, `eos`
    (default the model's; -1: no EOS, every row runs to its max_tokens). Every round runs ONE verify step of
    k + 1 tokens for all b rows (`Transformer.verify`, logits fp32 [b, k + 1, V]); row i accepts its own drafts
    against its own logits (rows accept different lengths) and `Transformer.rollback` keeps each row's prefix. A row stops at its EOS or its max_tokens; a
    finished row keeps running in the step on dummy ids and keeps nothing. Returns one `SpeculativeResult` per
    prompt, in order.

    The guarantee (tests/unit/test_speculative.py): each row's tokens equal plain greedy decoding of that prompt
    alone, token for token, except from a step where the alone run's top two logits lie within the dtype's
    tolerance (fp32 1e-5 of the largest |logit|: the batched verify step sums in another order), counted.

    Raises ValueError naming the argument for an empty prompt list, a bad prompt (its index, and the first id
    outside [0, V) with its index), k, max_tokens, an `eos` other than a token id or -1, drafters not one per prompt
    (the count given and expected; a drafter without draft() by index; one stateful drafter shared), or a drafter
    returning other than k ints in the vocabulary (its row, the first bad id); `dsv4.memory_plan.LimitError` for a
    batch over MAX_BATCH = 64 rows or a row over the model's context (the row, its prompt length and what it
    needs: prompt + max_tokens + k + 1; before any model work, `check_serving`), or over the max_len of a model
    that decodes through CUDA graphs (`Transformer.use_decode_graphs`: the verify steps then replay a capture,
    `dsv4.graph`)."""
    eos_id = _check_eos(model, eos)

    def choose(i: int, logits: torch.Tensor, drafts: list[int]) -> list[int]:
        pred = logits.argmax(-1).tolist()  # pred[j]: the model's token after the last token + drafts[:j]
        a = 0
        while a < k and drafts[a] == pred[a]:
            a += 1
        return drafts[:a] + [pred[a]]  # drafts[:a] == pred[:a]: every emitted token is the model's own

    return _speculate(model, prompts, drafters, k, max_tokens, eos_id, lambda i, lg: int(lg.argmax(-1)), choose)


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


def _check_temperature(temperature) -> None:
    if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and
                                             0 < temperature < float("inf")):
        raise ValueError(f"temperature={temperature!r}: expected a finite number > 0 (0: speculative_greedy)")


@torch.no_grad()
def speculative_sample(model: Transformer, prompt: list[int], drafter: Drafter, *, k: int, max_tokens: int,
                       temperature: float, seed: int = 0, eos: int | None = None) -> SpeculativeResult:
    """Speculative decoding at temperature T > 0 (batch 1; `speculative_sample_batch` of one row): each verify
    step's drafts are accepted or replaced by `accept_or_resample` on softmax(logits / T) at their positions, in
    order, until the first rejection; when every draft is accepted a bonus token is drawn at the next position.
    The tokens are distributed as plain sampling at T (tests/unit/test_speculative.py: the rule's chi-square
    test, and the whole loop's first three tokens against the model's exact probabilities, both at a stated
    false-alarm rate); not the same draws as `generate`'s exponential race (another use of the random numbers).
    Seeded by `seed` (a generator on the model's device). Raises ValueError as `speculative_greedy`, and for a
    temperature that is not a finite number > 0."""
    _check_temperature(temperature)
    _check_call(model, prompt, k, max_tokens)
    return speculative_sample_batch(model, [prompt], [drafter], k=k, max_tokens=max_tokens,
                                    temperature=temperature, seed=seed, eos=eos)[0]


@torch.no_grad()
def speculative_sample_batch(model: Transformer, prompts: list[list[int]], drafters: list[Drafter], *, k: int,
                             max_tokens: int | list[int], temperature: float, seed: int | list[int] = 0,
                             eos: int | None = None) -> list[SpeculativeResult]:
    """Speculative sampling of a batch (arguments and rounds as `speculative_greedy_batch`; the acceptance rule
    of `speculative_sample` per row). Row i draws every random number from its own generator seeded with
    `seed` (an int: every row, as `dsv4.generate.generate_batch` does) or seed[i] (a list, one per prompt), so a
    row's tokens do not depend on its neighbours: row i equals `speculative_sample` of prompts[i] with its seed
    alone (up to a draw that falls within fp32 rounding of a probability boundary). Raises ValueError as
    `speculative_greedy_batch`, for a temperature that is not a finite number > 0, and for seeds that are not an
    int or a list of b ints, or a seed outside 0..2**64-1 (`dsv4.synth.check_seed`, the CLI's --seed rule)."""
    _check_temperature(temperature)
    n = len(prompts) if isinstance(prompts, (list, tuple)) else 0
    seeds = [seed] * n if isinstance(seed, int) and not isinstance(seed, bool) else seed
    if not isinstance(seeds, (list, tuple)) or len(seeds) != n or any(
            isinstance(s, bool) or not isinstance(s, int) for s in seeds):
        raise ValueError(f"seed={seed!r}: expected an int or a list of {n} ints (one per prompt)")
    for i, s in enumerate(seeds):  # the CLI's rule (--seed): a 64-bit seed, not torch's overflow error
        check_seed(s, "seed" if isinstance(seed, int) else f"seed[{i}]")
    eos_id = _check_eos(model, eos)
    gens = [torch.Generator(device=model.device).manual_seed(s) for s in seeds]

    def probs(logits: torch.Tensor) -> torch.Tensor:
        return (logits.float() / temperature).softmax(-1)

    def choose(i: int, logits: torch.Tensor, drafts: list[int]) -> list[int]:
        emitted = []
        for j, d in enumerate(drafts):
            ok, t = accept_or_resample(probs(logits[j]), d, gens[i])
            emitted.append(t)
            if not ok or t == eos_id:
                return emitted
        return emitted + [int(torch.multinomial(probs(logits[k]), 1, generator=gens[i]))]  # all accepted: bonus

    return _speculate(model, prompts, drafters, k, max_tokens, eos_id,
                      lambda i, lg: int(torch.multinomial(probs(lg), 1, generator=gens[i])), choose)
