"""Generation: messages -> ids (through the one prompt path) -> prefill -> greedy or sampled decode.

Follows the official `generate.py` loop (reference spec §12): one prefill, then one token per step; greedy at
temperature 0, otherwise the exponential race `argmax(softmax(l/T) / Exp(1))`; stop at the first generated EOS or
after `max_tokens`. Unlike the official code, a call starts from a fresh `DecodeState` (spec §6: stale compressor
state otherwise leaks between requests) unless it is given the `ChatState` a previous turn of the same
conversation ended with and the new prompt's token ids extend the ids that state holds (checked token by token):
then only the new tokens are appended (`Transformer.forward` at the state's position; every split of a sequence
gives the logits of one prefill, tests/unit/test_append.py). Where DeepSeek-V4's format rewrites earlier tokens
(the reasoning of earlier turns dropped by `drop_thinking`, a re-tokenized assistant text) the state is rebuilt
from the whole prompt, and `GenerationResult.reuse` says which happened and why.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import dsv4.checkpoint  # called as dsv4.checkpoint.load_checkpoint (looked up per call)
from dsv4.config import SymlinkLoopError, check_has_mtp, layers_from_env, symlink_loop
import dsv4.encoding  # prompt_ids / parse_* looked up per call (a seam the tests replace)
from dsv4.launch import LaunchEnvError, launch_from_env
from dsv4.memory_plan import LimitError, MAX_BATCH, check_fits, max_context
from dsv4.model import DecodeState, Transformer, check_batch_invariant
from dsv4.parallel import comm_from_env, load_distributed_model
from dsv4.resident import WEIGHTS
from dsv4.speculative import MTPDrafter, plan_rows, speculative_greedy, speculative_sample
from dsv4.state import check_device
from dsv4.synth import check_seed, checkpoint_args, is_synth_source, parse_source, tokenizer_folder
from dsv4.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from dsv4.encoding import TruncatedCompletion

__all__ = ["is_rank_zero", "ResidualTrace", "GenerationResult", "ChatState", "reuse_plan", "generate", "generate_batch", "load_model", "run_generate", "CKPT_ENV"]

CKPT_ENV = "DSV4_CKPT"


def is_rank_zero() -> bool:
    """False on the non-zero ranks of a torchrun launch (they compute but do not print reports). Reads the launch
    through `dsv4.launch.launch_from_env`: an inconsistent RANK / WORLD_SIZE / LOCAL_RANK (a stray `RANK=1`
    without WORLD_SIZE) raises `LaunchEnvError` instead of silencing the process."""

    return launch_from_env().is_rank_zero


@dataclass
class ResidualTrace:
    """Observer recording, per forward call (step 0 = prefill), each layer's residual magnitude of the last
    position: `max_abs[step][layer]` = max |H| and `rms[step][layer]` = RMS over the hc streams (fp32 units of
    the residual). With `capture_last=True` it keeps the last layer's streams of the last position,
    `last_residual` [b, hc, dim] (a detached copy, in the model dtype) of the most recent step."""

    capture_last: bool = False
    max_abs: list[list[float]] = field(default_factory=list)
    rms: list[list[float]] = field(default_factory=list)
    last_residual: torch.Tensor | None = None
    _n_layers: int | None = None

    def start_step(self) -> None:
        self.max_abs.append([])
        self.rms.append([])

    def __call__(self, layer_id: int, H: torch.Tensor) -> None:
        if not self.max_abs or len(self.max_abs[-1]) > layer_id:
            self.start_step()
        h = H[:, -1].float()
        self.max_abs[-1].append(float(h.abs().max()))
        self.rms[-1].append(float(h.pow(2).mean().sqrt()))
        if self.capture_last and self._n_layers is not None and layer_id == self._n_layers - 1:
            self.last_residual = H[:, -1].detach().clone()

    def bind(self, model: Transformer) -> "ResidualTrace":
        self._n_layers = len(model.layers)
        return self


@dataclass
class ChatState:
    """A conversation's decode state between `generate` calls: `state` has processed exactly the token ids `ids`
    (the prompts and generated tokens so far, the last sampled token excepted: it was never fed), for `model`."""

    state: DecodeState
    ids: list[int]

    def __post_init__(self) -> None:
        if not isinstance(self.ids, list):
            raise ValueError(f"ChatState.ids: expected a list of int token ids, got {type(self.ids).__name__}")
        for i, t in enumerate(self.ids):
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"ChatState.ids[{i}] is {t!r}; expected a token id, an int >= 0")
        if self.state.pos != len(self.ids):
            raise ValueError(f"ChatState: the state is at position {self.state.pos} but holds {len(self.ids)} ids")


def reuse_plan(model: Transformer, chat: ChatState | None, new_ids: list[int]) -> tuple[int, str]:
    """How much of `chat` a prompt `new_ids` can keep: (n, note). n = len(chat.ids) when `chat.ids` is a proper
    prefix of new_ids and the state is this model's with batch 1 (append new_ids[n:]), else 0 (rebuild: a fresh
    state and the whole prompt); note says which and why ("fresh", "reused N tokens, appended M", "rebuilt: ...").
    Raises ValueError when `chat` is neither None nor a `ChatState`, its ids are not token ids of this model, or
    it was already used by a turn (its state advanced past its ids: the given ChatState is consumed by the call)."""
    if chat is None:
        return 0, "fresh"
    if not isinstance(chat, ChatState):
        raise ValueError(f"chat: expected a ChatState (a previous turn's GenerationResult.chat) or None, got "
                         f"{type(chat).__name__}")
    if chat.state.pos != len(chat.ids):  # the state advanced under this ChatState: it was consumed by a turn
        raise ValueError(f"chat: this ChatState was already used by a generate call (its state advanced to position "
                         f"{chat.state.pos}, past its {len(chat.ids)} ids): a ChatState serves one next turn; pass "
                         "the newer GenerationResult.chat, or chat=None to start from a fresh state")
    owner = chat.state.owner() if chat.state.owner is not None else None
    if owner is not model:
        return 0, "rebuilt: the chat state belongs to another model instance"
    if chat.state.batch != 1:
        return 0, f"rebuilt: the chat state has batch {chat.state.batch}, generate runs batch 1"
    V = model.args.vocab_size
    bad = next((i for i, t in enumerate(chat.ids) if t >= V), None)
    if bad is not None:
        raise ValueError(f"ChatState.ids[{bad}] is {chat.ids[bad]}; expected a token id in 0..{V - 1} (this "
                         "model's vocab_size): the chat state was not made by this model's generate")
    old = chat.ids
    common = next((i for i, (a, b) in enumerate(zip(old, new_ids)) if a != b), min(len(old), len(new_ids)))
    if common < len(old):
        where = (f"differ at position {common} (state {old[common]}, prompt {new_ids[common]})"
                 if common < len(new_ids) else f"end at {len(new_ids)}, before the state's {len(old)} tokens")
        return 0, f"rebuilt: the prompt's ids {where}; the format rewrote earlier tokens"
    if len(new_ids) == len(old):
        return 0, "rebuilt: the prompt adds no token to the chat state"
    return len(old), f"reused {len(old)} tokens, appended {len(new_ids) - len(old)}"


@dataclass
class GenerationResult:
    """prompt_ids and generated ids (EOS included when it was produced), the decoded text of the generated
    ids, the parsed assistant message (`reasoning_content`, `content`, `tool_calls`), stop reason
    ("eos" | "max_tokens"), and the residual trace.

    Exactly one of three outcomes: `message` (stopped at EOS, well formed); `truncated` (stopped at
    `max_tokens` before EOS: a `dsv4.encoding.TruncatedCompletion` with the reasoning / content so far, where
    the cut came and why; never a message to act on); or `parse_error` (the text is malformed: at EOS it does
    not parse, or before the cut it already breaks the format)."""

    prompt_ids: list[int]
    ids: list[int]
    text: str
    message: dict | None
    parse_error: str | None
    stop: str
    trace: ResidualTrace
    truncated: "TruncatedCompletion | None" = None
    chat: ChatState | None = None  # the state after this turn: give it to the next turn's `generate(chat=...)`
    reuse: str = "fresh"           # `reuse_plan`'s note: fresh, reused N tokens, or rebuilt and why


TEMPERATURE_MIN = 1e-5
"""The smallest sampling temperature > 0 (the official generate.py clamps to it: below, logits / T overflow to inf
and softmax gives NaN). 0 < T < TEMPERATURE_MIN is refused, never clamped: use temperature=0 for greedy."""


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [b, V] fp32 -> token ids [b]. T == 0: argmax; T >= TEMPERATURE_MIN (1e-5): argmax(softmax(logits/T) /
    Exp(1)) (spec §12).
    Raises ValueError for a negative or non-finite temperature, or one in (0, TEMPERATURE_MIN) (the official code
    clamps it to 1e-5 silently; dsv4 says to use temperature=0 for greedy)."""
    _check_temperature(temperature)
    if temperature == 0:
        return logits.argmax(-1)
    probs = (logits / temperature).softmax(-1)
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(-1)


@torch.no_grad()
def generate(model: Transformer, tokenizer, messages: list[dict], *, max_tokens: int = 64,
             temperature: float = 0.0, thinking: bool = True, seed: int = 0,
             on_token: Callable[[int, str], None] | None = None, trace: ResidualTrace | None = None,
             chat: ChatState | None = None) -> GenerationResult:
    """Generate one assistant turn for `messages` (OpenAI-style dicts) with batch 1.

    The result carries the parsed message (stopped at EOS), or the partial result of a completion cut by
    `max_tokens` (`GenerationResult.truncated`), or why the text is malformed (`parse_error`), and the state it
    ended with (`chat`). `chat`: a previous turn's `GenerationResult.chat` of the same conversation; it is
    continued when the new prompt's ids extend its ids (`reuse_plan`; the result's `reuse` says what happened;
    the given ChatState is consumed: its state advances).

    Raises (all before any model work):
        ValueError: max_tokens not an int >= 1; temperature negative, not finite, or in (0, 1e-5)
            (`TEMPERATURE_MIN`: use 0 for greedy); seed outside 0..2**64-1 (as the CLI's --seed); `on_token`
            neither None nor callable, `trace` neither None nor a ResidualTrace; an empty prompt: the conversation ends in a user message whose content
            is "" or blank (an earlier empty turn is allowed, as in `encode_messages`); a finished conversation:
            it ends in an assistant reply without `wo_eos`, so the prompt ends in the end-of-sentence token
            (`_check_open_end`), or in a system message (no assistant turn follows it); `chat` not a ChatState;
            prompt errors from `dsv4.encoding.prompt_ids` (an empty conversation, an unknown message key, a missing
            content, ...).
        LimitError: the prompt + max_tokens exceed the model's context.
    """

    _check_max_tokens(max_tokens)
    _check_sampling(temperature, seed)
    _check_callable(on_token, "on_token")
    if trace is not None and not isinstance(trace, ResidualTrace):  # it is called per layer and bound to the model
        raise ValueError(f"trace={trace!r}: expected None or a ResidualTrace, got {type(trace).__name__}")
    ids = dsv4.encoding.prompt_ids(tokenizer, messages, thinking=thinking)
    _check_not_blank(messages)
    _check_open_end(messages, ids, model.args.eos_token_id)
    ctx = max_context(model.args)
    if len(ids) + max_tokens > ctx:  # the same limit as generate_batch (dsv4.speculative.plan_rows)
        raise LimitError(f"the prompt ({len(ids)} tokens) + max_tokens {max_tokens} exceed the model's context of "
                         f"{ctx} tokens per row (original_seq_len x rope_factor); shorten one")
    trace = (trace or ResidualTrace()).bind(model)
    gen = torch.Generator(device=model.device).manual_seed(seed) if temperature > 0 else None
    keep, reuse = reuse_plan(model, chat, ids)
    state = chat.state if keep else model.new_state(1)
    x = torch.tensor([ids[keep:]], dtype=torch.long, device=model.device)
    out: list[int] = []
    stop = "max_tokens"
    eos = model.args.eos_token_id
    for _ in range(max_tokens):
        logits = model(x, state, observer=trace)
        tok = int(sample(logits, temperature, gen)[0])
        out.append(tok)
        if on_token is not None:
            on_token(tok, tokenizer.decode([tok]))
        if tok == eos:
            stop = "eos"
            break
        x = torch.tensor([[tok]], dtype=torch.long, device=model.device)
    # the state holds the prompt and every generated token but the last (sampled, never fed)
    return _result(tokenizer, ids, out, stop, thinking, max_tokens, trace,
                   chat=ChatState(state, ids + out[:-1]), reuse=reuse)


def _check_max_tokens(m, name: str = "max_tokens") -> None:
    """ValueError naming a max_tokens that is not an int >= 1 (bool refused)."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"{name}={m!r}: expected an int >= 1")


def _check_temperature(temperature) -> None:
    """ValueError naming a temperature that is not a finite number >= 0, or one in (0, TEMPERATURE_MIN)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            0 <= temperature < float("inf")):
        raise ValueError(f"temperature={temperature!r}: expected a finite number >= 0")
    if 0 < temperature < TEMPERATURE_MIN:
        raise ValueError(f"temperature={temperature!r}: expected 0 (greedy) or a number >= {TEMPERATURE_MIN} (below "
                         "it logits / T overflow; the official code clamps it silently); use temperature=0 for greedy")


def _check_sampling(temperature, seed) -> None:
    """ValueError naming a bad temperature (`_check_temperature`) or a seed outside 0..2**64-1 (the CLI's --seed
    rule, `dsv4.synth.check_seed`: a negative seed, or one torch cannot take)."""
    _check_temperature(temperature)
    check_seed(seed)


def _check_callable(value, name: str) -> None:
    """ValueError naming a callback argument that is neither None nor callable (checked before any model work)."""
    if value is not None and not callable(value):
        raise ValueError(f"{name}={value!r}: expected None or a callable, got {type(value).__name__}")


def _check_not_blank(messages, name: str = "messages") -> None:
    """ValueError when the conversation ends in a user message whose content is empty or blank: nothing to answer
    (the CLI refuses a blank --prompt alike). `encode_messages` / `prompt_ids` accept it, as the official encoder."""
    last = messages[-1] if isinstance(messages, (list, tuple)) and messages else None
    if isinstance(last, dict) and last.get("role") == "user" and isinstance(last.get("content"), str) \
            and not last["content"].strip():
        raise ValueError(f"{name}[{len(messages) - 1}].content: {last['content']!r} is an empty prompt (the "
                         "conversation ends in a blank user message, nothing to answer; an unset variable?); expected "
                         "the user's text")


def _check_open_end(messages, ids: list[int], eos: int, name: str = "messages") -> None:
    """ValueError when the prompt ends in the end-of-sentence token: the conversation ends in a finished assistant
    reply (the format closes every assistant turn with `<｜end▁of▁sentence｜>` unless it sets `wo_eos`), so a
    completion would continue past the end of the conversation (public report vllm#46256: silent empty or garbled
    output). `encode_messages` / `prompt_ids` render it, as the official encoder (the text of a finished
    conversation is a valid training example); only the generation entries refuse it. An assistant message with
    `wo_eos: True` is the way to continue a reply (its prompt ends in the reply's text). Likewise a conversation
    ending in a system message without a `task`: the format opens an assistant turn only after a user, developer
    or tool message (or a task token), so the completion would continue the system text."""
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    if last.get("role") == "system" and last.get("task") is None:
        raise ValueError(f"{name}[{len(messages) - 1}] (role 'system'): the conversation ends in a system message, "
                         "after which the format opens no assistant turn (only a user, developer or tool message, "
                         "or a task, does): the completion would continue the system text; expected a last message "
                         "from the user or a tool")
    if ids and ids[-1] == eos:
        i = len(messages) - 1
        role = messages[i].get("role") if isinstance(messages[i], dict) else None
        raise ValueError(f"{name}[{i}] (role {role!r}): the conversation ends in a finished reply (the prompt ends "
                         f"in the end-of-sentence token, id {eos}): there is nothing to answer; expected a last "
                         "message from the user or a tool, or an assistant message with wo_eos=True to continue "
                         "that reply")


def _result(tokenizer, ids: list[int], out: list[int], stop: str, thinking: bool, max_tokens: int,
            trace: ResidualTrace, **extra) -> GenerationResult:
    """The GenerationResult of a finished completion: the text, then the parsed message (stop "eos"), the partial
    result of a completion cut by max_tokens, or why the text is malformed."""
    text = tokenizer.decode(out, skip_special_tokens=False)
    mode = "thinking" if thinking else "chat"
    message, err, partial = None, None, None
    try:
        if stop == "eos":
            message = dsv4.encoding.parse_message_from_completion_text(text, mode)
        else:  # cut by the limit: not malformed, a partial result (unless it already broke the format)
            partial = dsv4.encoding.parse_truncated_completion(
                text, mode, reason=f"max_tokens={max_tokens} reached before the end-of-sentence token")
    except ValueError as e:  # a tiny random model rarely produces a well-formed completion; report why
        err = str(e)
    return GenerationResult(ids, out, text, message, err, stop, trace, partial, **extra)


@torch.no_grad()
def generate_batch(model: Transformer, tokenizer, conversations: list[list[dict]], *,
                   max_tokens: int | list[int] = 64, temperature: float = 0.0, thinking: bool = True,
                   seed: int = 0, max_batch: int | None = None, progress: bool = True,
                   chats: list[ChatState | None] | None = None, keep_chats: bool = False) -> list[GenerationResult]:
    """Generate one assistant turn for each conversation (OpenAI-style message lists) in one ragged batch, with
    continuous batching (issue 24 item 2); returns one `GenerationResult` per conversation, in order.

    Up to `max_batch` (default: all, at most `dsv4.memory_plan.MAX_BATCH`) conversations hold a row of one decode
    state. Each request is prefilled into its row (`DecodeState.row`: a batch-1 call, the same maths as
    `generate`), then every running row decodes one token per step in one call of the decode step, each row at its
    own position (`DecodeState.row_pos`). A row stops at its EOS or its own `max_tokens` (an int, or one per
    conversation); the next waiting conversation then takes the row (`DecodeState.reset_row`, then its prefill)
    while the other rows continue. Free rows still run in the step (at position 0, their output unused, their
    buffers reset before reuse). Sampling: request i draws from its own generator seeded with `seed`, as `generate`
    does, so a request's draws do not depend on its neighbours.

    The guarantee (tests/unit/test_generate_batch.py): each conversation's tokens equal `generate` run on it alone,
    except from a step where the two runs' logits put the top two tokens within the dtype's tolerance of each
    other (the batched GEMMs round in another order: fp32 1e-5, bf16 1e-2 of the largest |logit|); the test counts
    such steps and fails on any other difference. No residual trace per row (`trace` of each result is empty).

    Multi-turn (issue 24 item 3): `chats[i]` (a previous turn's `GenerationResult.chat`, or None) is continued as
    `generate` does (`reuse_plan`: only when the new prompt's ids extend the ids it holds; `reuse` of the result
    says which happened): its buffers are copied into the request's row (`DecodeState.load_row`; the given
    ChatState is left as it was) and only the new ids are prefilled. `keep_chats=True` returns each result's
    `chat` (its row copied out when it finishes, `DecodeState.copy_row`: one batch-1 state per conversation, the
    memory of a row each); otherwise `chat` is None.

    A progress bar on stderr (rich) counts the generated tokens against the most that can be generated; off with
    progress=False. Limits are checked before any model work (`dsv4.speculative.plan_rows`, then
    `dsv4.memory_plan.check_serving`): LimitError for a batch over MAX_BATCH, a row over the model's context (the
    conversation's index and its real total, prompt + max_tokens, never the state's rounded size), a decode state
    larger than the device has available.
    Raises ValueError for an empty list, a bad max_tokens or max_batch (named, with the conversation's index), a
    temperature or seed `generate` refuses (0 < T < 1e-5; a seed outside 0..2**64-1), a conversation ending in an
    empty or blank user message, in a finished assistant reply or in a system message (as `generate`); prompt
    errors come from `dsv4.encoding` with the conversation's
    index added."""
    if not isinstance(conversations, (list, tuple)) or not conversations:
        raise ValueError("conversations: expected a non-empty list of message lists")
    n = len(conversations)
    limits = [max_tokens] * n if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) else max_tokens
    if not isinstance(limits, (list, tuple)) or len(limits) != n:
        raise ValueError(f"max_tokens={max_tokens!r}: expected an int >= 1 or a list of {n} of them")
    for i, m in enumerate(limits):
        _check_max_tokens(m, f"max_tokens[{i}]")
    _check_sampling(temperature, seed)
    if max_batch is not None and (not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1):
        raise ValueError(f"max_batch={max_batch!r}: expected None or an int >= 1")
    prompts = []
    for i, conv in enumerate(conversations):
        try:
            prompts.append(dsv4.encoding.prompt_ids(tokenizer, conv, thinking=thinking))
            _check_not_blank(conv)
            _check_open_end(conv, prompts[-1], model.args.eos_token_id)
        except ValueError as e:  # the same exception (type and fields), its message naming the conversation
            e.args = (f"conversations[{i}]: {e}",) + e.args[1:]
            raise
    if chats is not None and (not isinstance(chats, (list, tuple)) or len(chats) != n or any(
            c is not None and not isinstance(c, ChatState) for c in chats)):
        raise ValueError(f"chats: expected None or a list of {n} ChatState-or-None (one per conversation)")
    plans = [reuse_plan(model, chats[i], prompts[i]) if chats is not None else (0, "fresh") for i in range(n)]
    chat_out: list[ChatState | None] = [None] * n
    rows = min(n, max_batch or min(n, MAX_BATCH))
    max_len = plan_rows(model, rows, [(f"conversations[{i}]", len(p), f"prompt {len(p)} + max_tokens {m}",
                                       len(p) + m) for i, (p, m) in enumerate(zip(prompts, limits))])
    state = model.new_state(rows, None if model.decode_graph_max_len is not None else max_len)

    eos = model.args.eos_token_id
    gens = [torch.Generator(device=model.device).manual_seed(seed) if temperature > 0 else None for _ in range(n)]
    outs: list[list[int]] = [[] for _ in range(n)]
    stops: list[str | None] = [None] * n
    slot: list[int | None] = [None] * rows  # the request each row serves
    waiting = list(range(n))[::-1]  # pop() takes the lowest index first

    def take(req: int, logits: torch.Tensor, r: int) -> bool:
        """Sample request req's next token from its logits [1, V] (row r); True when the request is finished
        (its row copied out first with keep_chats: it holds the prompt and every token but the last)."""
        tok = int(sample(logits, temperature, gens[req])[0])
        outs[req].append(tok)
        if tok == eos:
            stops[req] = "eos"
        elif len(outs[req]) >= limits[req]:
            stops[req] = "max_tokens"
        if stops[req] is not None and keep_chats:
            chat_out[req] = ChatState(state.copy_row(r), prompts[req] + outs[req][:-1])
        return stops[req] is not None

    console = Console(stderr=True, quiet=not progress)
    with Progress(TextColumn("generate_batch"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                  TextColumn("{task.fields[done]}/" + str(n) + " done"), TimeElapsedColumn(), console=console,
                  disable=not progress) as bar:
        task = bar.add_task("generate", total=sum(limits), done=0)
        while True:
            for r in range(rows):  # admit: a free row takes the next waiting request (prefill into its row)
                while slot[r] is None and waiting:
                    req = waiting.pop()
                    state.reset_row(r)
                    keep = plans[req][0]
                    if keep:  # a previous turn's state: copied into the row, only the new ids prefilled
                        state.load_row(r, chats[req].state)
                    x = torch.tensor([prompts[req][keep:]], dtype=torch.long, device=model.device)
                    finished = take(req, model(x, state.row(r)), r)
                    bar.update(task, advance=1)
                    if finished:
                        bar.update(task, advance=limits[req] - len(outs[req]),
                                   done=sum(st is not None for st in stops))
                        continue
                    slot[r] = req
            running = [r for r in range(rows) if slot[r] is not None]
            if not running:
                break
            feed = [outs[slot[r]][-1] if slot[r] is not None else 0 for r in range(rows)]
            logits = model(torch.tensor(feed, dtype=torch.long, device=model.device)[:, None], state)
            for r in running:
                req = slot[r]
                if take(req, logits[r:r + 1], r):
                    bar.update(task, advance=1 + limits[req] - len(outs[req]))
                    slot[r] = None
                else:
                    bar.update(task, advance=1)
            bar.update(task, done=sum(st is not None for st in stops))
            pos = state.row_pos  # free rows stay at position 0 (their buffers are reset before reuse)
            state.row_pos = [p if slot[r] is not None else 0 for r, p in enumerate(pos)]
    return [_result(tokenizer, prompts[i], outs[i], stops[i], thinking, limits[i], ResidualTrace().bind(model),
                    chat=chat_out[i], reuse=plans[i][1]) for i in range(n)]


MODEL_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""The model dtypes, by the CLI's --dtype names: bf16 = the official numerics, fp32 = the exact mode."""


def model_dtype(dtype) -> torch.dtype:
    """torch.bfloat16 / torch.float32 as given, or the CLI's name "bf16" / "fp32" mapped to it. ValueError naming
    dtype and the accepted values otherwise (torch.float16 included: not a dsv4 model dtype)."""
    if isinstance(dtype, str) and dtype in MODEL_DTYPES:
        return MODEL_DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in MODEL_DTYPES.values():
        return dtype
    raise ValueError(f"dtype={dtype!r}: expected torch.bfloat16 or torch.float32 (or the CLI's names 'bf16' / "
                     "'fp32')")


def load_model(ckpt: Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
               backend: str = "reference", progress: bool = True, weights: str = "dequantized",
               mtp: bool = False, batch_invariant: bool = False) -> tuple[Transformer, int]:
    """Load the checkpoint directory `ckpt` (or a synthetic source `synth:GEOMETRY[:LAYERS[:SEED]]`, generated on
    load: `dsv4.synth.SynthCheckpoint`) honouring TEST_LAYERS; returns (model, effective layer count).

    `dtype`: torch.bfloat16 or torch.float32, or "bf16" / "fp32" as the CLI's --dtype (`model_dtype`).
    `mtp`: also load the MTP block `mtp.0` (spec §10; the drafter of `dsv4.speculative.MTPDrafter`; world size 1
    only: ValueError under torchrun). `weights`: "dequantized" (FP8/FP4 weights dequantized to `dtype` at load) or
    "quantized" (kept FP8/FP4 +
    ue8m0 scales on `device`, dequantized per use; same logits bit for bit, see `dsv4.resident`).
    Under a torchrun launch (WORLD_SIZE > 1) this rank's tensor/expert-parallel model is loaded instead
    (`dsv4.parallel.load_distributed_model`; each rank reads only its shards of the tensors, and on CUDA uses
    the device of its LOCAL_RANK). Before any weight is read, the memory plan is compared with what the device
    has available: `dsv4.memory_plan.DeviceMemoryError` (a ValueError, with the numbers) when the weights cannot
    fit. Raises what `dsv4.checkpoint.load_checkpoint`, `layers_from_env` and `dsv4.parallel.comm_from_env`
    raise; CheckpointError for weights="quantized" on a bf16 checkpoint; ValueError naming a `device` that is not
    'cpu', 'cuda' or 'cuda:N' or a CUDA device not visible here (`dsv4.state.check_device`, as the CLI's --device),
    a `dtype` that is not torch.bfloat16 / torch.float32 or the CLI's names "bf16" / "fp32" (`model_dtype`),
    and `dsv4.config.NoMTPBlockError` (a ValueError) for mtp=True on a checkpoint without an MTP block
    (num_nextn_predict_layers 0: speculative decoding with the MTP drafter needs it). `batch_invariant`: the
    batch-invariant mode (`Transformer(batch_invariant=True)`, `kernels.invariant`; world size 1 only: ValueError
    under torchrun, where the all-reduce order is outside its guarantee); ValueError for a `ckpt` that is not a
    str / path (None included) or is empty.
    """

    if not isinstance(ckpt, (str, os.PathLike)) or not str(ckpt):
        raise ValueError(f"load_model: ckpt={ckpt!r}: expected a checkpoint directory (str or Path) or a synthetic "
                         "source 'synth:GEOMETRY[:LAYERS[:SEED]]' (resolve_ckpt reads --ckpt / $DSV4_CKPT)")
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}: expected one of {WEIGHTS}")
    dtype = model_dtype(dtype)
    check_device(device)  # before torch's own parse: its error names neither the argument nor dsv4's devices
    if not is_synth_source(ckpt):  # placeholder data (a dry run) and a broken index / header are named before the
        dsv4.checkpoint.Checkpoint(ckpt)  # memory plan, whose advice (TEST_LAYERS, ...) would not help them

    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    if launch_from_env().distributed:
        if mtp:
            raise ValueError("load_model(mtp=True): the MTP block is loaded at world size 1 only (not yet sharded)")
        if batch_invariant:
            raise ValueError("load_model(batch_invariant=True): world size 1 only (the all-reduce order of a "
                             "tensor / expert-parallel run is outside the mode's guarantee, kernels.invariant)")
        comm, rank_device = comm_from_env(device)
        full = checkpoint_args(ckpt)
        check_fits(full, layers_from_env(full.n_layers), device=rank_device, dtype_bytes=dtype_bytes,
                   weights=weights, world_size=comm.world_size, what=f"rank {comm.rank}'s part of the model")
        model, n = load_distributed_model(ckpt, comm, device=rank_device, dtype=dtype, backend=backend,
                                          weights=weights)
        return model.eval().requires_grad_(False), n

    full = checkpoint_args(ckpt)  # config.json, or the geometry of a `synth:` source
    if mtp:
        check_has_mtp(full, f"{ckpt}: this checkpoint")
    if batch_invariant:  # what the model refuses from the config alone, before any weight is read
        check_batch_invariant(full, dtype, weights)
    n = layers_from_env(full.n_layers)
    # the memory plan before any weight is read or generated: a named error with the numbers, not an allocator
    # error minutes later (dsv4.memory_plan.check_fits)
    check_fits(full, n, device=device, dtype_bytes=dtype_bytes, weights=weights, include_mtp=mtp)
    args, sd = dsv4.checkpoint.load_checkpoint(ckpt, n_layers=n, dtype=dtype, progress=progress,
                               dequantize=weights == "dequantized", device=device,  # dequantized on `device`
                               include_mtp=mtp)
    model = Transformer(args, dtype=dtype, device=device, backend=backend, weights=weights, mtp=mtp,
                        batch_invariant=batch_invariant)
    model.load_weights({k: v.to(device) for k, v in sd.items()})
    return model.eval().requires_grad_(False), n


def resolve_ckpt(ckpt: Path | None) -> Path | None:
    """--ckpt, else $DSV4_CKPT, else None. Raises ValueError when $DSV4_CKPT is set but empty (a script's unset
    variable: never read as "no checkpoint", which diagnose would run on random weights); FileNotFoundError naming the source and the path when it is not a
    directory, saying why (missing, a broken link, a file); `SymlinkLoopError` (a FileNotFoundError) when it is a
    symbolic link loop.
    A synthetic source `synth:GEOMETRY[:LAYERS[:SEED]]` (`dsv4.synth.parse_source`) is returned as given after
    parsing: ValueError naming the option and the bad field."""
    if ckpt is None and os.environ.get(CKPT_ENV) == "":  # `DSV4_CKPT=$UNSET dsv4 diagnose`: not "no checkpoint"
        raise ValueError(f"${CKPT_ENV} is set but empty; expected a checkpoint directory (unset it to run without "
                         "one: diagnose then builds a tiny random checkpoint)")
    if ckpt is None and os.environ.get(CKPT_ENV):
        ckpt, src = Path(os.environ[CKPT_ENV]), f"${CKPT_ENV}"
    else:
        src = "--ckpt"

    if is_synth_source(ckpt):
        try:
            parse_source(ckpt)
        except ValueError as e:
            raise ValueError(f"{src}: {e}") from None
        return ckpt
    if ckpt is not None and not ckpt.is_dir():
        if symlink_loop(ckpt):
            raise SymlinkLoopError(f"{src}={ckpt}: symbolic link loop (the link resolves back to itself), expected "
                                   "a checkpoint directory; fix or remove the link")
        what = ("a broken symbolic link (its target does not exist)" if ckpt.is_symlink() else "does not exist") \
            if not ckpt.exists() else "a file" if ckpt.is_file() else "not a directory"
        raise FileNotFoundError(f"{src}={ckpt}: not a checkpoint directory ({what})")
    return ckpt


def run_generate(*, ckpt: Path | None, prompt: str, max_tokens: int, temperature: float, thinking: bool,
                 seed: int, device: str, dtype: str = "bf16", backend: str = "reference",
                 weights: str = "dequantized", speculative: int = 0, batch_invariant: bool = False) -> int:
    """`dsv4 generate`: stream the completion to stdout, then the parsed message. Exit status 0, 2 on bad input
    (an inconsistent RANK / WORLD_SIZE / LOCAL_RANK is checked first: `dsv4.launch.launch_from_env`)."""

    try:
        launch_from_env()
    except LaunchEnvError as e:
        print(f"dsv4 generate: error: {e}", file=sys.stderr)
        return 2

    console = Console(stderr=True, quiet=not is_rank_zero(), soft_wrap=True)  # no wrapping inside a line
    try:
        path = resolve_ckpt(ckpt)
        if path is None:
            raise FileNotFoundError(f"no checkpoint: pass --ckpt DIR or set {CKPT_ENV} "
                                    "(`dsv4 make-tiny DIR` writes a tiny random one)")
        torch_dtype = model_dtype(dtype)
        model, n = load_model(path, device=device, dtype=torch_dtype, backend=backend, weights=weights,
                              mtp=speculative > 0, batch_invariant=batch_invariant)

        tok = load_tokenizer(tokenizer_folder(path))  # a `synth:` source: the packaged tokenizer files
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as e:
        print(f"dsv4 generate: error: {e}", file=sys.stderr)
        return 2
    if is_synth_source(path):
        console.print(f"weights: SYNTHETIC ({path}: random weights at the released geometry, generated on load; "
                      "not a trained model, the text is meaningless)", markup=False)
    console.print(f"checkpoint {path} | TEST_LAYERS={n} of {checkpoint_args(path).n_layers} | "
                  f"thinking={thinking} | T={temperature} | {dtype} | {backend} | weights {weights}")
    if speculative:
        return _run_speculative(model, tok, prompt, thinking, max_tokens, speculative, console, temperature, seed)
    res = generate(model, tok, [{"role": "user", "content": prompt}], max_tokens=max_tokens,
                   temperature=temperature, thinking=thinking, seed=seed,
                   on_token=lambda i, s: (sys.stdout.write(s), sys.stdout.flush()) if is_rank_zero() else None)
    if is_rank_zero():
        sys.stdout.write("\n")
    console.print(f"stop={res.stop} tokens={len(res.ids)} max|X| per layer (last step)="
                  f"{[round(v, 2) for v in res.trace.max_abs[-1]]}")
    _print_outcome(console, res)
    return 0


def _run_speculative(model: Transformer, tok, prompt: str, thinking: bool, max_tokens: int, k: int,
                     console: Console, temperature: float = 0.0, seed: int = 0) -> int:
    """`dsv4 generate --speculative K`: speculative decoding with the MTP drafter (`dsv4.speculative`): greedy at
    temperature 0, else lossless speculative sampling at `temperature` seeded by `seed` (`speculative_sample`: the
    tokens are distributed as plain sampling, not the same draws as `generate`'s); the completion on stdout, the
    accepted drafts per verify step and their mean on stderr."""
    ids = dsv4.encoding.prompt_ids(tok, [{"role": "user", "content": prompt}], thinking=thinking)
    if temperature > 0:
        res = speculative_sample(model, ids, MTPDrafter(model), k=k, max_tokens=max_tokens,
                                 temperature=temperature, seed=seed)
    else:
        res = speculative_greedy(model, ids, MTPDrafter(model), k=k, max_tokens=max_tokens)
    if is_rank_zero():
        sys.stdout.write(tok.decode(res.ids, skip_special_tokens=False) + "\n")
    mean = res.mean_accepted_length
    console.print(f"stop={res.stop} tokens={len(res.ids)} speculative k={k}: {len(res.accepted)} verify steps, "
                  f"accepted drafts per step {res.accepted}, " +
                  ("no verify step (the first token ended the output)" if mean is None else
                   f"mean accepted length {mean:.2f} tokens per step") +
                  " (on random weights the MTP block's acceptance means nothing)", markup=False)
    _print_outcome(console, _result(tok, ids, res.ids, res.stop, thinking, max_tokens, ResidualTrace()))
    return 0


def _print_outcome(console: Console, res: GenerationResult) -> None:
    """The parsed message, the partial result of a truncated completion, or why the text is malformed (stderr)."""
    if res.message is not None:
        console.print(f"reasoning={res.message.get('reasoning_content')!r}\ncontent={res.message.get('content')!r}",
                      markup=False)
    elif res.truncated is not None:
        t = res.truncated
        console.print(f"truncated (not malformed): {t.reason}; cut inside {t.cut_in}. So far:\n"
                      f"reasoning={t.reasoning_content!r}\ncontent={t.content!r}"
                      + (f"\ntool-call markup (incomplete, not executed)={t.tool_calls_text!r}"
                         if t.tool_calls_text else ""), markup=False)
    else:
        console.print(f"malformed completion (does not parse as an assistant message): {res.parse_error}",
                      markup=False)
