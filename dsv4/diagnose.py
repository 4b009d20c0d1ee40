"""`dsv4 diagnose`: the decisive tests behind the merge gate, as one report.

Test 1 (this part): the prompt format. The legacy hand-rolled prompt
`[BOS, <｜User｜>] + encode("\\n\\n" + prompt) + [<｜Assistant｜>]` is out of distribution for DeepSeek-V4; the
model's input must come from the official format (`dsv4.encoding.prompt_ids`, i.e. the dsv4 chat template,
equal to `encode_messages`). `template_diff` builds both, aligns the id sequences (difflib) and names every
difference with its token strings; for the seed prompt it reads: extra "\\n\\n" (id 271) after <｜User｜>, and
<think> (id 128821, thinking mode) / </think> (id 128822, chat mode) missing at the end. Test 1's decision
("the prompt was the bug": after switching to the template the expected answer comes back and the loop is
gone) is automated: `greedy_continuation` continues both prompts, `loop_measure` measures each for loops, and
`continuation_verdict` states the verdict in one line (reported, not gated); when the template's greedy continuation
loops, `sampled_continuations` continues it again at the model card's temperature, so that greedy decoding's own
repetition is not mistaken for an implementation bug.
Test 2 (the final norm) lives in `dsv4.final_norm` and is re-exported here; `run_diagnose` runs both. The
report also says what produced it (`environment`: versions, git commit, world size).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import difflib
import hashlib
import importlib
import io
import json
import logging
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch

import dsv4
import dsv4.final_norm
import dsv4.generate  # load_model, final_norm_check, make_tiny looked up per call (the run's seams)
import dsv4.tiny
from dsv4.checkpoint import expected_tensors, placeholder_evidence, read_index
from dsv4.config import ModelArgs, layers_from_env
from dsv4.encoding import (ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER, encode_messages, prompt_ids,
                           special_strings_in_messages)
from dsv4.final_norm import final_norm_check  # noqa: F401  (dsv4.diagnose.final_norm_check)
from dsv4.generate import CKPT_ENV, resolve_ckpt
from dsv4.launch import LaunchEnvError, launch_from_env
from dsv4.memory_plan import GiB, check_context, check_fits, load_bytes, max_new_tokens
from dsv4.model import STATE_GRAIN
from dsv4.speculative import AdversaryDrafter, ContinuationDrafter, speculative_greedy
from dsv4.report import (EXIT_BAD_INPUT, ReportFile, ReportPathError, SCHEMA_VERSION, command_line, outcome_of,
                         release_frames)
from dsv4.synth import (checkpoint_args, geometry_config, is_synth_source, parse_source, source_provenance,
                        tokenizer_folder)
from dsv4.tokenizer import load_tokenizer

__all__ = ["TemplateDiff", "DiffOp", "template_diff", "format_template_report", "hand_rolled_ids", "run_diagnose",
           "final_norm_check", "format_final_norm_report", "EXIT_PASS", "EXIT_ERROR", "EXIT_HARD_STOP", "EXIT_INCONCLUSIVE",
           "LoopMeasure", "loop_measure", "Continuation", "greedy_continuation", "sampled_continuations",
           "answer_text", "contains_answer", "SAMPLED_TEMPERATURE", "SAMPLED_SEEDS", "continuation_verdict",
           "format_continuation_report", "speculative_check", "format_speculative_check", "environment", "DEFAULT_CONTINUE_TOKENS", "OFFICIAL_SPECIAL_IDS",
           "special_id_problems", "LOOP_MIN_TOKENS", "VERDICTS", "check_lengths", "SPECULATIVE_CHECK_K",
           "synthesis_note"]

DEFAULT_CONTINUE_TOKENS = 32


@dataclass(frozen=True)
class DiffOp:
    """One non-equal stretch of the alignment hand-rolled → template.

    Attributes:
        op: "delete" (only in the hand-rolled ids), "insert" (only in the template ids) or "replace".
        hand_span / template_span: [start, end) positions in each id list.
        hand_tokens / template_tokens: (id, decoded text) of the tokens in each span.
        description: one line, e.g. `extra "\\n\\n" (id 271) after "<｜User｜>"`.
    """
    op: str
    hand_span: tuple[int, int]
    template_span: tuple[int, int]
    hand_tokens: list[tuple[int, str]]
    template_tokens: list[tuple[int, str]]
    description: str


@dataclass(frozen=True)
class TemplateDiff:
    """Test 1 result for one user prompt (all id lists are token ids of the real tokenizer, [s] ints).

    Attributes:
        prompt, thinking: the inputs.
        hand_rolled_ids / hand_rolled_text: the legacy construction and its decoded string.
        template_ids / template_text: `prompt_ids(...)` and the template's rendered string.
        encoder_ids: `tokenizer.encode(encode_messages(...), add_special_tokens=False)`.
        template_equals_encoder: template ids == encoder ids (the pass criterion of the template itself).
        alignment: every aligned position (hand position or None, hand (id, text) or None, template
            position or None, template (id, text) or None, "equal" | op name).
        ops: the non-equal stretches, described.
        template_source: where the tokenizer and template came from (`tok.dsv4_template_source`).
        special_in_prompt: format special strings found in the prompt text (tokenised as special ids).
        special_id_problems: the format's special strings whose tokenizer id is not the official one
            (`OFFICIAL_SPECIAL_IDS`), each described; empty when all match.
        differs: hand-rolled ids != template ids.
        outcome: "PASS", "HARD STOP" (template != encoder, or a special id is not the official one) or
            "INCONCLUSIVE" (the hand-rolled control equals the template: the comparison cannot tell them apart).
    """
    prompt: str
    thinking: bool
    hand_rolled_ids: list[int]
    hand_rolled_text: str
    template_ids: list[int]
    template_text: str
    encoder_ids: list[int]
    template_equals_encoder: bool
    alignment: list[tuple]
    ops: list[DiffOp]
    template_source: str
    special_in_prompt: list[str] = field(default_factory=list)
    special_id_problems: list[str] = field(default_factory=list)

    @property
    def differs(self) -> bool:
        return self.hand_rolled_ids != self.template_ids

    @property
    def outcome(self) -> str:
        if not self.template_equals_encoder or self.special_id_problems:
            return "HARD STOP"
        return "INCONCLUSIVE" if not self.differs else "PASS"

    def to_json(self) -> dict:
        """A JSON-serialisable dict of every field plus `differs` and `outcome`. Every row is an object with named
        fields: `alignment` rows {"hand_pos", "hand_id", "hand_token", "template_pos", "template_id",
        "template_token", "op"} (None where a side has no token), tokens {"id", "token"}."""
        d = dataclasses.asdict(self)
        d["alignment"] = [alignment_row(row) for row in self.alignment]
        d["ops"] = [{**o, "hand_span": list(o["hand_span"]), "template_span": list(o["template_span"]),
                     "hand_tokens": [{"id": i, "token": t} for i, t in o["hand_tokens"]],
                     "template_tokens": [{"id": i, "token": t} for i, t in o["template_tokens"]]} for o in d["ops"]]
        d["differs"], d["outcome"] = self.differs, self.outcome
        return d


def alignment_row(row: tuple) -> dict:
    """One alignment tuple (hand pos, (id, text), template pos, (id, text), op) as a labelled JSON object."""
    hp, ht, tp, tt, op = row
    return {"hand_pos": hp, "hand_id": None if ht is None else ht[0], "hand_token": None if ht is None else ht[1],
            "template_pos": tp, "template_id": None if tt is None else tt[0],
            "template_token": None if tt is None else tt[1], "op": op}


# The official ids of the format's special strings (DeepSeek-V4's tokenizer; the gold vectors of
# fixtures/golden/dsv4_prompts.json carry them): Test 1 is anchored to these numbers, not only to our own
# template and encoder agreeing through the same tokenizer (a tokenizer that splits `<｜User｜>` into pieces
# would make both agree on the wrong ids).
OFFICIAL_SPECIAL_IDS = {BOS: 0, EOS: 1, USER: 128803, ASSISTANT: 128804, THINK_START: 128821, THINK_END: 128822}


def special_id_problems(tokenizer) -> list[str]:
    """Each special string of `OFFICIAL_SPECIAL_IDS` that the tokenizer does not encode as exactly its official
    id (one line each, naming the string, the expected id and what the tokenizer gives); [] when all match."""
    out = []
    for text, want in OFFICIAL_SPECIAL_IDS.items():
        got = tokenizer.encode(text, add_special_tokens=False)
        if got != [want]:
            out.append(f"{json.dumps(text, ensure_ascii=False)} encodes to {got}, expected the official [{want}]")
    return out


def hand_rolled_ids(tokenizer, prompt: str) -> list[int]:
    """The legacy construction `[BOS, <｜User｜>] + encode("\\n\\n" + prompt) + [<｜Assistant｜>]` ([s] ids).
    Kept only as Test 1's negative control; never use it to build model input."""
    bos, user, assistant = tokenizer.convert_tokens_to_ids([BOS, USER, ASSISTANT])
    return [bos, user] + tokenizer.encode("\n\n" + prompt, add_special_tokens=False) + [assistant]


def _tok(tokenizer, ids: list[int]) -> list[tuple[int, str]]:
    return [(int(i), tokenizer.decode([i])) for i in ids]


def _describe(op: str, hand: list[tuple[int, str]], tmpl: list[tuple[int, str]], i1: int, i2: int, j2: int,
              n_tmpl: int) -> str:
    def show(toks):
        return " ".join(f"{json.dumps(t, ensure_ascii=False)} (id {i})" for i, t in toks)

    if op == "delete":
        where = f"after {json.dumps(hand[i1 - 1][1], ensure_ascii=False)}" if i1 > 0 else "at the start"
        return f"extra in hand-rolled: {show(hand[i1:i2])} {where}"
    if op == "insert":
        where = "at the end" if j2 == n_tmpl else f"at template position {j2 - 1}"
        return f"missing from hand-rolled: {show(tmpl)} {where}"
    return f"hand-rolled has {show(hand[i1:i2])} where the template has {show(tmpl)}"


def template_diff(tokenizer, prompt: str, thinking: bool = True) -> TemplateDiff:
    """Test 1: the hand-rolled prompt vs the official-format prompt for one user turn.

    Args:
        tokenizer: from `dsv4.tokenizer.load_tokenizer` (carries the dsv4 template).
        prompt: the user text (special strings inside it are kept and reported in `special_in_prompt`).
        thinking: True → thinking mode (template ends in <think>), False → chat mode (</think>).
    Returns:
        `TemplateDiff` (see its attributes); `differs` is True for every prompt, since the official prompt
        always ends in <think>/</think>.
    Raises:
        ValueError: `prompt` is not a string, or the tokenizer has no dsv4 template.
    """
    if not isinstance(prompt, str):
        raise ValueError(f"prompt: expected a string, got {type(prompt).__name__}")
    messages = [{"role": "user", "content": prompt}]
    hand = hand_rolled_ids(tokenizer, prompt)
    tmpl = prompt_ids(tokenizer, messages, thinking=thinking)
    text = tokenizer.apply_chat_template(messages, thinking=thinking, add_generation_prompt=True, tokenize=False)
    enc = tokenizer.encode(encode_messages(messages, "thinking" if thinking else "chat"), add_special_tokens=False)
    hand_t, tmpl_t = _tok(tokenizer, hand), _tok(tokenizer, tmpl)
    alignment, ops = [], []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, hand, tmpl, autojunk=False).get_opcodes():
        if op == "equal":
            alignment += [(i1 + k, hand_t[i1 + k], j1 + k, tmpl_t[j1 + k], "equal") for k in range(i2 - i1)]
            continue
        for k in range(max(i2 - i1, j2 - j1)):
            h, t = i1 + k, j1 + k
            alignment.append((h if h < i2 else None, hand_t[h] if h < i2 else None,
                              t if t < j2 else None, tmpl_t[t] if t < j2 else None, op))
        ops.append(DiffOp(op, (i1, i2), (j1, j2), hand_t[i1:i2], tmpl_t[j1:j2],
                          _describe(op, hand_t, tmpl_t[j1:j2], i1, i2, j2, len(tmpl))))
    return TemplateDiff(
        prompt=prompt, thinking=thinking, hand_rolled_ids=hand, hand_rolled_text=tokenizer.decode(hand),
        template_ids=tmpl, template_text=text, encoder_ids=enc, template_equals_encoder=enc == tmpl,
        alignment=alignment, ops=ops, template_source=str(getattr(tokenizer, "dsv4_template_source", None)),
        special_in_prompt=[sp for _, _, sp in special_strings_in_messages(messages)],
        special_id_problems=special_id_problems(tokenizer))


# Bounds of the text report (a 20k-token prompt once gave a 2.1 MB report: every id printed three times). The
# JSON report keeps every id, string and alignment row.
TEXT_IDS_EDGE = 16         # id lists longer than 2x this show the first and last this many, with the count between
TEXT_CHARS_EDGE = 400      # strings longer than 2x this show their first and last this many characters
ALIGNMENT_CONTEXT = 3      # equal rows shown around each difference (and at both ends)
ALIGNMENT_MAX_ROWS = 200   # at most this many alignment rows in the text


def _bounded_ids(ids: list[int]) -> str:
    """`[0, 1, 2]`, or for a long list its head and tail with the number of ids left out between them."""
    if len(ids) <= 2 * TEXT_IDS_EDGE:
        return str(list(ids))
    head, tail = ", ".join(map(str, ids[:TEXT_IDS_EDGE])), ", ".join(map(str, ids[-TEXT_IDS_EDGE:]))
    return f"[{head}, ... {len(ids) - 2 * TEXT_IDS_EDGE} ids not shown (a --json report holds them all) ..., {tail}]"


def _bounded_text(text: str) -> str:
    """The JSON-quoted string, or for a long one its first and last characters with the count left out."""
    if len(text) <= 2 * TEXT_CHARS_EDGE:
        return json.dumps(text, ensure_ascii=False)
    head, tail = json.dumps(text[:TEXT_CHARS_EDGE], ensure_ascii=False), json.dumps(text[-TEXT_CHARS_EDGE:],
                                                                                  ensure_ascii=False)
    return (f"{head} ... {len(text) - 2 * TEXT_CHARS_EDGE} characters not shown (a --json report holds them all) ... "
            f"{tail}")


def _alignment_rows_shown(alignment: list[tuple]) -> list[int]:
    """Indices of the alignment rows the text report prints: all of a short alignment; of a long one, every
    difference with ALIGNMENT_CONTEXT equal rows around it and at both ends, at most ALIGNMENT_MAX_ROWS."""
    n = len(alignment)
    if n <= ALIGNMENT_MAX_ROWS // 2:
        return list(range(n))
    keep = set(range(min(ALIGNMENT_CONTEXT, n))) | set(range(max(0, n - ALIGNMENT_CONTEXT), n))
    for k, row in enumerate(alignment):
        if row[4] != "equal":
            keep.update(range(max(0, k - ALIGNMENT_CONTEXT), min(n, k + ALIGNMENT_CONTEXT + 1)))
    return sorted(keep)[:ALIGNMENT_MAX_ROWS]


def format_template_report(diff: TemplateDiff) -> str:
    """The Test-1 half of the `dsv4 diagnose` report as plain text (one block, ends with a verdict line)."""
    mode = "thinking" if diff.thinking else "chat"
    lines = [f"== Test 1: prompt format ({mode} mode) ==",
             f"prompt:          {_bounded_text(diff.prompt)}",
             f"template source: {diff.template_source}",
             f"hand-rolled ids ({len(diff.hand_rolled_ids)}): {_bounded_ids(diff.hand_rolled_ids)}",
             f"hand-rolled str: {_bounded_text(diff.hand_rolled_text)}",
             f"template ids ({len(diff.template_ids)}):    {_bounded_ids(diff.template_ids)}",
             f"template str:    {_bounded_text(diff.template_text)}",
             "alignment (pos | hand-rolled | template | op):"]
    cell = (lambda p, t: "-" if t is None else f"{p:>3} {t[0]:>6} {json.dumps(t[1], ensure_ascii=False)}")
    shown = _alignment_rows_shown(diff.alignment)
    prev = -1
    for k in shown:
        if k > prev + 1:
            lines.append(f"  ... {k - prev - 1} equal row(s) not shown (a --json report holds the full alignment)")
        hp, ht, tp, tt, op = diff.alignment[k]
        mark = "" if op == "equal" else f"   <-- {op}"
        lines.append(f"  {cell(hp, ht):<34} | {cell(tp, tt):<34}{mark}")
        prev = k
    if prev < len(diff.alignment) - 1:
        lines.append(f"  ... {len(diff.alignment) - 1 - prev} more row(s) not shown (a --json report holds the "
                     "full alignment)")
    lines.append("differences:" if diff.ops else "differences: none")
    lines += [f"  - {op.description}" for op in diff.ops]
    if diff.special_in_prompt:
        lines.append(f"WARNING: the prompt contains special strings {diff.special_in_prompt}; they are tokenised "
                     "as special tokens (the official encoder does not escape them)")
    lines.append(f"template == official encoder: {'yes' if diff.template_equals_encoder else 'NO'}")
    lines.append("special ids == official (" + ", ".join(f"{v}" for v in OFFICIAL_SPECIAL_IDS.values()) + "): "
                 + ("yes" if not diff.special_id_problems else "NO"))
    lines += [f"  problem: {p}" for p in diff.special_id_problems]
    if diff.outcome == "PASS":
        lines.append("Test 1 PASS: model input is built by the dsv4 template; the hand-rolled prompt differs as "
                     "listed above")
    elif diff.outcome == "INCONCLUSIVE":
        lines.append("Test 1 INCONCLUSIVE: the hand-rolled prompt equals the template here, so the comparison "
                     "cannot tell a hand-rolled prompt from the official one (the official prompt ends in "
                     "<think> or </think>: is the tokenizer's vocabulary DeepSeek-V4's?)")
    else:
        lines.append("Test 1 FAIL: " + ("the template differs from the official encoder"
                                        if not diff.template_equals_encoder else
                                        "the tokenizer's special ids are not DeepSeek-V4's official ones"))
    return "\n".join(lines)


# ---------------------------------------------------------------- Test 1's decision: continuation and loops

@dataclass(frozen=True)
class LoopMeasure:
    """How much a generated id sequence repeats itself (Test 1's loop measure).

    Definitions (n = number of generated ids, EOS excluded):
        distinct_share: |set(ids)| / n (1.0 = no id twice; a loop on one word tends to 1/n).
        period, run_length: the longest stretch ids[a:b] that repeats with some period p, i.e.
            ids[i] == ids[i - p] for every a + p <= i < b, with at least two full periods (b - a >= 2p);
            the longest wins, ties go to the shorter period. period = 0, run_length = 0 when there is none.
        repeats: run_length / period (how many times the repeating unit occurs in that stretch).
        looping: run_length >= max(4, n / 2) and repeats >= 3, or (n >= 16 and distinct_share < 0.25).
    Why these thresholds: the degeneration this project exists for is "a wrong first token, then a loop on one
    word": a period-1 stretch over most of the continuation (repeats ~ n). A phrase loop (period up to n/6)
    also covers half the window three times over. Benign repetition does not: a doubled word ("very very")
    is 2 tokens, 2 repeats; an answer that restates a phrase once is 2 repeats, not 3; lists ("1, 2, 3") and
    recurring function words are not periodic. Natural text of 16+ tokens keeps well over half its ids
    distinct; below a quarter every id recurs four times on average, which is degenerate even without a clean
    period (e.g. alternating among three ids at random).
    """
    n_tokens: int
    distinct_share: float
    period: int
    run_length: int
    repeats: float
    looping: bool

    def describe(self) -> str:
        """One line, e.g. `LOOP: period 1 x 29 of 32 tokens; distinct 0.09`."""
        per = (f"period {self.period} x {self.repeats:.3g} ({self.run_length} of {self.n_tokens} tokens)"
               if self.period else f"no periodic stretch ({self.n_tokens} tokens)")
        return f"{'LOOP' if self.looping else 'no loop'}: {per}; distinct share {self.distinct_share:.2f}"


def loop_measure(ids: list[int]) -> LoopMeasure:
    """`LoopMeasure` of a generated id sequence (see its docstring for the definitions and thresholds).

    Args:
        ids: generated token ids (ints), EOS already removed. O(n^2) in len(ids); n is tens of tokens.
    Raises:
        ValueError: `ids` is not a list of ints (the message names the first bad entry's index).
    """
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"ids: expected a list of int token ids, got {type(ids).__name__}")
    for j, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise ValueError(f"ids[{j}] is {t!r} ({type(t).__name__}); expected an int token id")
    n = len(ids)
    best_len, best_p = 0, 0
    for p in range(1, n // 2 + 1):
        run = 0  # consecutive i with ids[i] == ids[i - p]
        for i in range(p, n):
            run = run + 1 if ids[i] == ids[i - p] else 0
            if run >= p and run + p > best_len:  # >= two full periods
                best_len, best_p = run + p, p
    repeats = best_len / best_p if best_p else 0.0
    distinct = len(set(ids)) / n if n else 1.0
    looping = (best_p > 0 and best_len >= max(4, n / 2) and repeats >= 3) or (n >= 16 and distinct < 0.25)
    return LoopMeasure(n, distinct, best_p, best_len, repeats, looping)


@dataclass(frozen=True)
class Continuation:
    """A greedy (or sampled: `sampled_continuations`) continuation of one prompt.

    Attributes:
        ids: generated ids (fresh decode state), at most the requested count, EOS included if reached.
        text: their decoded text (special tokens kept).
        stop: "eos" or "max_tokens".
        loop: `loop_measure` of the ids without EOS.
        contains_expected: None without `--expect`, else whether the text without special tokens contains it
            (`answer_text`, `contains_answer`: case-insensitive, as a whole word where it begins / ends with a
            letter or digit).
    """
    ids: list[int]
    text: str
    stop: str
    loop: LoopMeasure
    contains_expected: bool | None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def answer_text(tokenizer, ids: list[int]) -> str:
    """The text of generated `ids` that `--expect` is looked for in: every added token of the tokenizer left out
    (the format's markup: `<think>`, `</think>`, EOS, the DSML tool-call tokens ...; they are not words of the
    answer, and `--expect think` must not be found in `<think>`)."""
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return tokenizer.decode([i for i in ids if i not in added], skip_special_tokens=True)


def contains_answer(text: str, expect: str) -> bool:
    """Whether `text` contains the expected answer `expect`, case-insensitively (str.casefold), and not as a piece
    of a longer word or number: where `expect` begins (ends) with a letter or digit, the character before (after)
    the match must not be one. "Paris" is in "The capital is Paris." but not in "comparison"; "4" is in "2+2 = 4"
    but not in "14" or "2024". An answer in a script written without spaces (Chinese, Japanese) is a plain
    substring match wherever its edge characters are such letters too, e.g. "巴黎" in "首都是巴黎。": only an
    edge that is an ASCII letter or digit is held to a word boundary. Raises ValueError for an empty or blank
    `expect` (every text contains it: a check that cannot fail)."""
    if not expect.strip():
        raise ValueError(f"expect={expect!r}: an empty expected answer is contained in every text; give the "
                         "answer's text or leave it out")
    word = r"[0-9A-Za-z]"
    lead = rf"(?<!{word})" if re.match(word, expect[0]) else ""
    tail = rf"(?!{word})" if re.match(word, expect[-1]) else ""
    return re.search(lead + re.escape(expect.casefold()) + tail, text.casefold()) is not None


def greedy_continuation(model, tokenizer, prompt: list[int], n_tokens: int, expect: str | None = None,
                        on_token=None, *, temperature: float = 0.0, seed: int = 0) -> Continuation:
    """Greedy decode of `n_tokens` ids after `prompt` ([s] ids) from a fresh decode state, stopping at EOS.

    The first id equals the prompt's greedy top-1. `on_token(k)` (optional) is called after the k-th generated
    id (progress). `temperature` > 0 samples instead (`dsv4.generate.sample`, a torch.Generator seeded with
    `seed`: `sampled_continuations`). Raises ValueError if n_tokens < 1 or the prompt is empty, or for a
    temperature / seed `dsv4.generate.generate` refuses.
    """

    if n_tokens < 1 or not prompt:
        raise ValueError(f"greedy_continuation: need n_tokens >= 1 (got {n_tokens}) and a non-empty prompt")
    dsv4.generate._check_sampling(temperature, seed)
    gen = torch.Generator(device=model.device).manual_seed(seed) if temperature > 0 else None
    eos = model.args.eos_token_id
    state = model.new_state(1)
    x = torch.tensor([prompt], dtype=torch.long, device=model.device)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n_tokens):
            logits = model(x, state)
            tok = int(logits.argmax(-1)[0] if gen is None else dsv4.generate.sample(logits, temperature, gen)[0])
            out.append(tok)
            if on_token is not None:
                on_token(len(out))
            if tok == eos:
                break
            x = torch.tensor([[tok]], dtype=torch.long, device=model.device)
    text = tokenizer.decode(out, skip_special_tokens=False)
    body = out[:-1] if out and out[-1] == eos else out
    found = None if expect is None else contains_answer(answer_text(tokenizer, out), expect)
    return Continuation(out, text, "eos" if out[-1] == eos else "max_tokens", loop_measure(body), found)


SAMPLED_TEMPERATURE = 1.0  # the released models' recommended sampling (model card, spec §1.1: T 1.0, top_p 1.0)
SAMPLED_SEEDS = (0, 1, 2)


def sampled_continuations(model, tokenizer, prompt: list[int], n_tokens: int, expect: str | None = None,
                          on_token=None, *, temperature: float = SAMPLED_TEMPERATURE,
                          seeds: tuple[int, ...] = SAMPLED_SEEDS) -> list[Continuation]:
    """Continuations of `prompt` sampled at `temperature` (plain sampling, top_p 1.0), one per seed: Test 1's
    check that a loop of the greedy continuation is more than greedy decoding's own repetition.

    Why: greedy decoding of the released V4 models can fall into repetition loops that sampling at the model
    card's settings does not show (public reports: QwenLM/qwen-code#9765, antirez/ds4#1045). A greedy loop alone
    would then read as "still degenerate" and send a team hunting an implementation bug that is not there.
    `on_token(k)` counts the generated ids over all seeds. Raises ValueError as `greedy_continuation`, and for
    an empty `seeds`."""
    if not seeds:
        raise ValueError("sampled_continuations: expected at least one seed")
    done = 0

    def tick(k):
        if on_token is not None:
            on_token(done + k)

    out = []
    for s in seeds:
        out.append(greedy_continuation(model, tokenizer, prompt, n_tokens, expect, tick, temperature=temperature,
                                       seed=s))
        done += len(out[-1].ids)
    return out


SPECULATIVE_CHECK_K = 3  # drafts per verify step of the oracle drafter in `speculative_check` (the adversary: k - 1)


def speculative_check(model, prompt: list[int], plain: Continuation, k: int = SPECULATIVE_CHECK_K) -> dict:
    """Decode the template continuation again with speculative decoding (`dsv4.speculative.speculative_greedy`:
    verify steps of k + 1 tokens and their rollbacks) with two drafters that need no MTP block: the oracle (the
    plain continuation itself: every draft accepted, so every verify window is kept whole) and the adversary
    (every draft wrong, so every verify is rolled back to its first token). Both must give the plain
    continuation's ids: a degeneration caused by the verify / rollback state shows here and nowhere else (the
    class of the public MTP bugs: a compressor keeping rejected tokens, a corrupt row after a partial accept).
    Returns {"k", "equal", "oracle": {...}, "adversary": {...}} with each drafter's ids equal or not, the first
    differing index, the verify steps and the mean accepted length. Reported, not gated (bf16 near-ties may flip
    a token between a verify step and a one-token step)."""
    n = len(plain.ids)
    out = {"k": k, "tokens": n}
    V = model.args.vocab_size
    for name, drafter, kk in (("oracle", ContinuationDrafter(len(prompt), plain.ids), k),
                              ("adversary", AdversaryDrafter(len(prompt), plain.ids, V), max(1, k - 1))):
        res = speculative_greedy(model, prompt, drafter, k=kk, max_tokens=n)
        diff = next((i for i, (a, b) in enumerate(zip(res.ids, plain.ids)) if a != b),
                    None if len(res.ids) == n else min(len(res.ids), n))
        out[name] = {"k": kk, "equal": diff is None, "first_difference": diff, "verify_steps": len(res.accepted),
                     "mean_accepted_length": (None if res.mean_accepted_length is None
                                              else round(res.mean_accepted_length, 3))}
    out["equal"] = out["oracle"]["equal"] and out["adversary"]["equal"]
    return out


def format_speculative_check(c: dict) -> str:
    """One line per drafter of `speculative_check`."""
    lines = [f"speculative decoding check (verify steps + rollback; the template continuation, {c['tokens']} "
             "tokens, decoded again): " + ("EQUAL to the plain continuation" if c["equal"] else
                                           "DIFFERS from the plain continuation (reported, not gated)")]
    for name in ("oracle", "adversary"):
        d = c[name]
        lines.append(f"  {name} drafter, k={d['k']}: " + ("equal" if d["equal"] else
                     f"first difference at token {d['first_difference']}") +
                     f"; {d['verify_steps']} verify steps, mean accepted length {d['mean_accepted_length']}")
    return "\n".join(lines)


VERDICTS = ("prompt fixed", "still degenerate", "expected answer absent", "no degeneration with either prompt",
            "inconclusive", "greedy loop only")
LOOP_MIN_TOKENS = 8  # a continuation cut by max_tokens shorter than this cannot show a loop (see loop_measure)


def continuation_verdict(hand: Continuation, tmpl: Continuation, expect: str | None,
                         sampled: list[Continuation] | None = None) -> tuple[str, str]:
    """Test 1's decision from the two continuations: (verdict, one-line explanation).

    `sampled`: continuations of the template prompt sampled at the model card's temperature
    (`sampled_continuations`; diagnose runs them only when the template's greedy continuation loops).

    Rule (the procedure's "the prompt was the bug" = after switching to the template the expected answer
    comes back and the loop is gone):
        template continuation loops, `sampled` given and none of them loops
                                                          -> "greedy loop only" (greedy decoding's repetition, not
                                                             by itself evidence of an implementation bug)
        template continuation loops                       -> "still degenerate" (the prompt is not the only bug)
        else `expect` given and absent from the template  -> "expected answer absent"
        else a continuation stopped by max_tokens with fewer than LOOP_MIN_TOKENS ids (too short for the loop
             measure to see a loop: "no loop" would be vacuous)  -> "inconclusive"
        else hand-rolled loops or lacks `expect`          -> "prompt fixed"
        else                                              -> "no degeneration with either prompt"
    Raises ValueError for an empty or all-whitespace `expect` (every text "contains" it: a vacuous check).
    """
    if expect is not None and not expect.strip():
        raise ValueError(f"expect={expect!r}: an empty expected answer is contained in every text; give the "
                         "answer's text or leave it out")

    def what(c: Continuation) -> str:
        parts = [f"loops (period {c.loop.period} x {c.loop.repeats:.3g}, distinct {c.loop.distinct_share:.2f})"
                 if c.loop.looping else "no loop"]
        if expect is not None:
            parts.append(f"{'contains' if c.contains_expected else 'lacks'} {json.dumps(expect, ensure_ascii=False)}")
        return ", ".join(parts)

    detail = f"template: {what(tmpl)} | hand-rolled: {what(hand)}"
    if tmpl.loop.looping:
        if sampled:
            n_loop = sum(c.loop.looping for c in sampled)
            detail += f" | sampled at T {SAMPLED_TEMPERATURE:g}: {n_loop} of {len(sampled)} loop"
            if n_loop == 0:
                return VERDICTS[5], (f"{VERDICTS[5]}: the greedy continuation loops with the official prompt, but "
                                     f"none of {len(sampled)} continuations sampled at the model card's T "
                                     f"{SAMPLED_TEMPERATURE:g} does: greedy decoding's own repetition, not by itself "
                                     "evidence that the implementation is wrong (Test 2 and the parity tests decide "
                                     f"that); decode with sampling ({detail})")
        return VERDICTS[1], (f"{VERDICTS[1]}: the continuation still loops with the official prompt, so the prompt "
                             f"is not (only) what breaks decode ({detail})")
    if expect is not None and not tmpl.contains_expected:
        return VERDICTS[2], (f"{VERDICTS[2]}: no loop with the official prompt, but the continuation lacks the "
                             f"expected answer ({detail})")
    short = [name for name, c in (("template", tmpl), ("hand-rolled", hand))
             if c.stop == "max_tokens" and len(c.ids) < LOOP_MIN_TOKENS]
    if short:
        return VERDICTS[4], (f"{VERDICTS[4]}: the {' and '.join(short)} continuation stopped at max_tokens after "
                             f"fewer than {LOOP_MIN_TOKENS} tokens, too short for the loop measure to see a loop "
                             f"(use --continue-tokens {LOOP_MIN_TOKENS} or more) ({detail})")
    if hand.loop.looping or (expect is not None and not hand.contains_expected):
        return VERDICTS[0], (f"{VERDICTS[0]}: the hand-rolled prompt degenerates and the official one does not "
                             f"({detail})")
    return VERDICTS[3], (f"{VERDICTS[3]}: neither continuation loops{' and both contain the expected answer' if expect is not None else ''}, "
                         f"so the prompt format did not show as the cause here ({detail})")


def format_continuation_report(hand: Continuation, tmpl: Continuation, expect: str | None, n_tokens: int,
                               verdict_line: str, sampled: list[Continuation] | None = None) -> str:
    """The continuation block of Test 1 (plain text, ends with the verdict line); `sampled`: the template's
    sampled continuations, one line pair per seed (`SAMPLED_SEEDS`)."""
    lines = [f"greedy continuation ({n_tokens} tokens max, stops at EOS), loop measure (longest periodic "
             "stretch with >= 2 periods; LOOP = it covers >= half the tokens 3+ times over, or < 25% distinct ids):"]
    rows = [("hand-rolled", hand), ("template", tmpl)]
    rows += [(f"sampled {s}", c) for s, c in zip(SAMPLED_SEEDS, sampled or [])]
    for name, c in rows:
        lines += [f"  {name + ':':<12} {_bounded_text(c.text)}",
                  f"  {'':<12} {len(c.ids)} tokens, stop {c.stop}; {c.loop.describe()}"]
    if sampled:
        lines.append(f"the template's greedy continuation loops: continued again with sampling (T "
                     f"{SAMPLED_TEMPERATURE:g}, top_p 1.0, the model card's settings), seeds {list(SAMPLED_SEEDS)}")
    if expect is not None:
        lines.append(f"expected answer {json.dumps(expect, ensure_ascii=False)} (case-insensitive): hand-rolled "
                     f"{'yes' if hand.contains_expected else 'no'}, template {'yes' if tmpl.contains_expected else 'no'}")
    lines.append(f"Test 1 verdict: {verdict_line}")
    return "\n".join(lines)


# ---------------------------------------------------------------- environment of a report

def _git_commit() -> tuple[str | None, bool | None]:
    """(HEAD commit, dirty) of the checkout dsv4 runs from; (None, None) when dsv4 is not run from a git
    checkout (an installed copy inside some other repository does not count: the top level must hold it)."""

    pkg = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", str(pkg), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != pkg.parent:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "HEAD"), None if status is None else bool(status)


def _import_version(module: str) -> str | None:
    """The version the imported module reports about itself (`torch.__version__` = "2.14.1+cu130", with the
    build tag), not the distribution's metadata ("2.14.1"); None when it is not installed or does not import."""

    try:
        mod = importlib.import_module(module)
    except Exception:  # not installed, or an install that fails to import: it did not produce this report
        return None
    v = getattr(mod, "__version__", None)
    if v is None:
        try:
            return metadata.version(module)
        except metadata.PackageNotFoundError:
            return None
    return str(v)


def _accelerator() -> dict:
    """torch's CUDA build (`torch.version.cuda`, None on a CPU build), whether CUDA is usable, and the name of
    every visible GPU ([] when none)."""

    gpus: list[str] = []
    available = bool(torch.cuda.is_available())
    if available:
        try:
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        except Exception as e:  # a driver problem must not hide the report
            gpus = [f"unknown ({type(e).__name__}: {e})"]
    return {"torch_cuda": torch.version.cuda, "cuda_available": available, "gpus": gpus}


def environment() -> dict:
    """What produced a report: dsv4 version, git commit (+ dirty) when run from a checkout, the versions of
    Python, torch, triton and transformers as the imported modules report them (`__version__`, with the build
    tag: "2.13.0+cpu", "2.14.1+cu130"; None when not installed), torch's CUDA version (None on a CPU build), the
    visible GPUs' names, the platform, the CPU count, when the report was made (UTC) and the world size
    ($WORLD_SIZE, 1 if unset)."""

    commit, dirty = _git_commit()
    return {"dsv4": dsv4.__version__, "git_commit": commit, "git_dirty": dirty, "python": platform.python_version(),
            "torch": _import_version("torch"), "triton": _import_version("triton"),
            "transformers": _import_version("transformers"), **_accelerator(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "world_size": _world_size()}


def _world_size() -> int:
    return launch_from_env().world_size


def format_environment(env: dict) -> str:
    """Two lines: `software: dsv4 0.1.0 (git 0123abcd4567, clean) | python 3.12.3 | torch 2.13.0+cpu | ...` and
    `hardware: CUDA 13.0, 1 GPU (NVIDIA H200) | 16 CPUs | Linux-...`."""
    git = ("not run from a git checkout" if env["git_commit"] is None else
           f"git {env['git_commit'][:12]}{'' if env['git_dirty'] is None else ', dirty' if env['git_dirty'] else ', clean'}")
    cuda = env.get("torch_cuda")
    gpus = env.get("gpus") or []
    accel = ((f"torch built with CUDA {cuda}" if cuda else "torch CPU build") + ", "
             + (f"{len(gpus)} GPU(s) ({', '.join(gpus)})" if gpus else "no GPU visible"))
    return (f"software: dsv4 {env['dsv4']} ({git}) | python {env['python']} | torch {env['torch']} | "
            f"triton {env['triton'] or 'not installed'} | transformers {env['transformers']}\n"
            f"hardware: {accel} | {env.get('cpu_count')} CPUs | {env.get('platform')}")


EXIT_PASS, EXIT_ERROR, EXIT_HARD_STOP, EXIT_INCONCLUSIVE = 0, 2, 3, 4


def _checkpoint_identity(path: Path, built: bool) -> dict:
    """Where the weights come from: path, sha256 of config.json and of the index, total_size, layer count."""

    def digest(p: Path) -> str | None:
        return hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.is_file() else None

    if is_synth_source(path):  # `--ckpt synth:...`: no files, the weights are generated on load
        return _synthetic_source_identity(path)
    idx = path / "model.safetensors.index.json"
    total = read_index(idx)[1] if idx.is_file() else None
    source = "tiny checkpoint built on the fly (random weights, seed 0)" if built else "given checkpoint"
    prov = path / "dsv4_synth.json"  # written by `dsv4 make-checkpoint` (dsv4.synth.PROVENANCE_FILE)
    if not built and prov.is_file():
        try:
            p = json.loads(prov.read_text())
            source = (f"synthetic checkpoint by dsv4 make-checkpoint ({p['geometry']} geometry, {p['layers']} layers, "
                      f"seed {p['seed']}: random weights, not a trained model)")
        except (ValueError, KeyError, TypeError):
            source = f"given checkpoint ({prov.name} present but unreadable)"

    evidence = [] if built else placeholder_evidence(path)
    if evidence:  # `make-checkpoint --dry-run`: no weights at all (the reader refuses it; say so here too)
        source = ("PLACEHOLDER data, not weights: the layout of `dsv4 make-checkpoint --dry-run`, tensor data left as "
                  f"holes that read as zeros ({'; '.join(evidence)})")
    ident = {"path": str(path), "source": source, "config_sha256": digest(path / "config.json"),
             "index_sha256": digest(idx), "total_size": total,
             "n_layers": ModelArgs.from_hf_config(path).n_layers}
    if built:  # the temporary directory is deleted when the run ends: say how to get the same bytes back
        ident["rebuild"] = f"{TINY_REBUILD} (same config_sha256 and index_sha256; this path is deleted at exit)"
    return ident


TINY_REBUILD = "dsv4 make-tiny DIR --variant fp8 --seed 0"


def _synthetic_source_identity(path) -> dict:
    """`_checkpoint_identity` of a synthetic source `synth:GEOMETRY[:LAYERS[:SEED]]`: says the weights are
    synthetic (random, generated on each rank as it loads them) and which make-checkpoint call writes the same
    bytes; config_sha256 is that of the config.json make-checkpoint would write."""

    src = parse_source(path)
    cfg = json.dumps(geometry_config(src.geometry, src.layers), indent=2) + "\n"
    return {"path": str(src), "source": f"SYNTHETIC weights generated on load ({src.geometry} geometry, {src.layers} "
                                        f"layers, seed {src.seed}: random weights, not a trained model; no file)",
            "config_sha256": hashlib.sha256(cfg.encode()).hexdigest()[:16], "index_sha256": None,
            "total_size": None, "n_layers": src.layers, "synthetic": source_provenance(src),
            "rebuild": f"dsv4 make-checkpoint DIR --geometry {src.geometry} --layers {src.layers} --seed {src.seed} "
                       "(the same tensors, bit for bit, on disk)"}


def _token(tokenizer, tok: int) -> dict:
    return {"id": tok, "token": tokenizer.decode([tok])}


def format_final_norm_report(r) -> str:
    """The Test-2 half of the report as plain text, every field labelled, ending with the verdict."""
    lines = ["== Test 2: final norm (X -> hc_head -> RMSNorm -> head) ==",
             f"final norm applied before the LM head (executions on the path, per step): "
             f"{'yes' if r.chain_ok else 'NO'} ({r.norm_calls} of {r.steps} steps)"]
    lines += [f"  problem: {p}" for p in r.chain_problems]
    lines += [f"captured X reproduces the model's logits: {'yes' if r.logits_match_model else 'NO'}",
              f"|X| at the last decode step: max {r.x_max_abs:.4g}, rms {r.x_rms:.4g}, per-stream rms "
              f"{[round(v, 4) for v in r.x_stream_rms]}",
              f"residual max|X| per layer (last step): {[round(v, 3) for v in r.residual_max_abs_per_layer]}",
              f"TEST_LAYERS in effect: {r.test_layers}"]
    for c in r.comparisons:
        lab = f"X*{c.factor:g}" if c.factor >= 1 else f"X/{1 / c.factor:g}"
        flip = ""
        if c.argmax_A != c.argmax_B:
            flip = (f"   near-tie flip (gap {c.flip_gap:.2e} <= {c.tie_tol:.2e}): counted, not failed" if c.near_tie
                    else f"   argmax flip (gap {c.flip_gap:.2e}) beyond the near-tie tolerance {c.tie_tol:.2e}")
        lines += [f"logits(X) vs logits({lab}):",
                  f"  argmax_A {c.argmax_A}  argmax_B {c.argmax_B}  cos {c.cosine:.9f}   (blind to a logit scale){flip}",
                  f"  rel_L2 {c.rel_l2:.3e} (tol {c.rel_tol:.1e})  max|dlogit| {c.max_abs_diff:.3e}  "
                  f"KL {c.kl:.3e} (tol {c.kl_tol:.1e})  -> {'ok' if c.passed else 'FAIL'}",
                  f"  power: without a final norm rel_L2 {c.nonorm_rel_l2:.3e}, KL {c.nonorm_kl:.3e} -> "
                  + ("rejected: decisive" if c.decisive else f"NOT rejected: {c.power_reason}")]
    lines += [f"rule: {r.rule}", f"Test 2 {r.verdict}"]
    return "\n".join(lines)


def _prompt_lengths(tokenizer, prompt: str, thinking: bool) -> tuple[int, int]:
    """(hand-rolled, official template) token counts of `prompt`, without the special-string warning of
    `prompt_ids` (it comes once, when `template_diff` builds the prompt the model is fed)."""
    log = logging.getLogger("dsv4.encoding")
    was, log.disabled = log.disabled, True
    try:
        fed = prompt_ids(tokenizer, [{"role": "user", "content": prompt}], thinking=thinking)
    finally:
        log.disabled = was
    return len(hand_rolled_ids(tokenizer, prompt)), len(fed)


def check_lengths(args: ModelArgs, *, template_tokens: int, hand_rolled_tokens: int, decode_steps: int,
                  continue_tokens: int, k: int = SPECULATIVE_CHECK_K) -> None:
    """Refuse, before any model work, a `dsv4 diagnose` run whose rows exceed the model's context
    (`dsv4.memory_plan.check_context`: the rule of `dsv4.generate.generate`, prompt + generated tokens <=
    original_seq_len x rope_factor):
        Test 2            the template prompt + `decode_steps` + 1 generated tokens (one after the prefill, one per
                          decode step);
        continuations     each prompt (hand-rolled, template) + `continue_tokens`;
        speculative check the template prompt + `continue_tokens` + k + 1 (a verify step past the last token), in a
                          decode state of whole `dsv4.model.STATE_GRAIN` blocks (`dsv4.speculative`).
    Raises `dsv4.memory_plan.LimitError` naming the option, the numbers and the largest value of it that fits
    (for --continue-tokens the tightest of its three rows), or that the prompt alone leaves no room."""
    check_context(args, prompt_tokens=template_tokens, value=decode_steps, option="--decode-steps",
                  prompt_label="Test 2: the prompt", overhead=1,
                  overhead_why="the token after the prefill: Test 2 generates --decode-steps + 1 tokens")
    rows = [dict(prompt_label="Test 1: the hand-rolled prompt", prompt_tokens=hand_rolled_tokens),
            dict(prompt_label="Test 1: the prompt", prompt_tokens=template_tokens),
            dict(prompt_label="Test 1: the prompt", prompt_tokens=template_tokens, overhead=k + 1,
                 overhead_why=f"the speculative decoding check decodes the continuation again in verify steps of "
                              f"k + 1 = {k + 1} tokens", grain=STATE_GRAIN)]
    tightest = min(rows, key=lambda r: max_new_tokens(args, r["prompt_tokens"], overhead=r.get("overhead", 0),
                                                      grain=r.get("grain", 1)))
    check_context(args, value=continue_tokens, option="--continue-tokens", **tightest)


SYNTH_VALUES_PER_S = 1e7  # order of magnitude of dsv4.synth on a few CPU cores (synth:flash:1: 100+ s for embed/head)


def synthesis_note(source, n_layers: int, *, device: str, dtype_bytes: int, weights: str,
                   include_mtp: bool = False) -> str:
    """The status line printed before a synthetic source (`synth:GEOMETRY[:LAYERS[:SEED]]`) is loaded, by `dsv4
    diagnose` and `dsv4 generate`: which weights are generated (the canonical spec, the device, tensors, values,
    main layers, GiB as held by the memory plan) and, on CPU, that it is slow: every value is computed
    (`dsv4.synth`), roughly SYNTH_VALUES_PER_S values per second, and the first tensors are the largest, so the
    progress bar shows nothing for a while (`synth:flash:1` once showed no progress for 100+ s).
    Raises ValueError for a malformed spec or an `n_layers` outside 1..the source's layers."""
    src = parse_source(source)
    args = checkpoint_args(source)
    inv = expected_tensors(args, n_layers, include_mtp)
    values = sum(math.prod(shape) * (2 if dt == "I8" else 1) for shape, dt in inv.values())  # FP4: 2 per byte
    tensors = sum(1 for name in inv if weights == "quantized" or not name.endswith(".scale"))  # as the bar counts
    try:
        held = load_bytes(args, n_layers, dtype_bytes=dtype_bytes, weights=weights, include_mtp=include_mtp)
        held = f", {held / GiB:.1f} GiB as held"
    except ValueError:
        held = ""
    text = (f"generating the synthetic weights of {src} on {device} ({tensors} tensors, {values / 1e9:.2f} billion "
            f"values, {n_layers} main layer(s){', MTP block' if include_mtp else ''}{held}): random values computed "
            "from (seed, tensor name), nothing is read from a file")
    if torch.device(device).type == "cpu":
        est = values / SYNTH_VALUES_PER_S
        when = f"~{est / 60:.0f} min" if est >= 90 else f"~{max(est, 1):.0f} s"
        text += (f"; slow on CPU: of the order of {SYNTH_VALUES_PER_S:.0e} values per second on a few cores ({when} "
                 "here), and no progress shows while the first, largest tensors are generated")
    return text


PROGRESS_EVERY_S = 2.0  # a running step reports on stderr at most this often


class Progress:
    """Progress of the run's steps on stderr (stdout keeps the report): `step(label)` prints `dsv4 diagnose:
    LABEL ...` when it starts and `... done in X s` when it ends; `tick(k, n)` inside a step prints `k/n` at most
    every PROGRESS_EVERY_S seconds."""

    def __init__(self, command: str = "diagnose", stream=None) -> None:
        self.command, self._stream = command, stream
        self._label, self._t0, self._last = "", 0.0, 0.0

    def _say(self, text: str) -> None:
        stream = self._stream or sys.stderr
        print(f"dsv4 {self.command}: {text}", file=stream, flush=True)

    def say(self, text: str) -> None:
        """One status line `dsv4 COMMAND: TEXT` on stderr, outside any step."""
        self._say(text)

    def step(self, label: str):
        @contextlib.contextmanager
        def run():
            self._label, self._t0 = label, time.perf_counter()
            self._last = self._t0
            self._say(f"{label} ...")
            yield self
            self._say(f"{label}: done in {time.perf_counter() - self._t0:.1f} s")

        return run()

    def tick(self, k: int, n: int, unit: str = "tokens") -> None:
        now = time.perf_counter()
        if now - self._last >= PROGRESS_EVERY_S and k < n:
            self._last = now
            self._say(f"{self._label}: {k}/{n} {unit} ({now - self._t0:.1f} s)")


def run_diagnose(ckpt: Path | None, prompt: str, decode_steps: int, json_path: Path | None, thinking: bool,
                 device: str, dtype: str = "bf16", backend: str = "reference", weights: str = "dequantized",
                 continue_tokens: int = DEFAULT_CONTINUE_TOKENS, expect: str | None = None,
                 batch_invariant: bool = False) -> int:
    """See `_run_diagnose` (`batch_invariant`: `Transformer(batch_invariant=True)`, issue 25); under torchrun only rank 0 prints and writes the JSON report (every rank computes).

    The launch (RANK / WORLD_SIZE / LOCAL_RANK, `dsv4.launch.launch_from_env`) and the report path (`json_path`:
    `dsv4.report.check_report_path`, never inside or over the checkpoint read) are checked before any work: exit 2
    with the reason on stderr. The report file is tied to this run (`dsv4.report.ReportFile`): replaced by an
    incomplete report at the start, by the complete report at the end, or by a failure report (`"passed":
    false`, `"error"`: the run's error line, `"exit_status"`) when the run fails or raises. The failure report's
    exit status is always the process's: the status returned, or for an exception the one `dsv4.cli.main` ends
    with (`dsv4.report.outcome_of`: 2 for a named bad-input error or running out of memory, 130 for Ctrl-C, 141 for a
    closed stdout, 1 for any other exception, which propagates as a traceback).
    """

    try:
        rank_zero = launch_from_env().is_rank_zero
        report = None
        if json_path is not None and rank_zero:
            report = ReportFile(Path(json_path), "diagnose",
                                ckpt if ckpt is not None else os.environ.get(CKPT_ENV) or None)
    except (LaunchEnvError, ReportPathError) as e:
        print(f"dsv4 diagnose: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    args = (ckpt, prompt, decode_steps, report, thinking, device, dtype, backend, weights, continue_tokens, expect,
            batch_invariant)
    if not rank_zero:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return _run_diagnose(*args[:3], None, *args[4:])
    if report is None:
        return _run_diagnose(*args)
    try:
        report.begin()
    except OSError as e:
        print(f"dsv4 diagnose: error: --json {json_path}: cannot write the report ({e})", file=sys.stderr)
        return EXIT_ERROR
    err = _ErrorLines(sys.stderr)
    try:
        with contextlib.redirect_stderr(err):
            rc = _run_diagnose(*args)
    except BaseException as e:  # an exception, Ctrl-C, a closed stdout: the report must not claim anything
        status, message = outcome_of(e)  # the status `dsv4.cli.main` ends the process with
        _report_failure(report, message if status == EXIT_BAD_INPUT else
                        f"{type(e).__name__}: {e}" if str(e) else type(e).__name__, status)
        raise
    if rc != EXIT_PASS and report.doc is None:  # failed before the report was complete: say why, in the file
        _report_failure(report, err.last_error or f"dsv4 diagnose ended with exit status {rc} before writing its "
                                                  "report", rc)
    else:
        try:
            report.finish(rc)
        except OSError as e:
            print(f"dsv4 diagnose: error: --json {json_path}: cannot write the report ({e})", file=sys.stderr)
            _report_failure(report, f"cannot write the report ({e})", EXIT_ERROR)
            return EXIT_ERROR
    return rc


class _ErrorLines:
    """stderr as it is, remembering the last `dsv4 diagnose: error: ...` message (for the failure report)."""

    PREFIX = "dsv4 diagnose: error: "

    def __init__(self, stream) -> None:
        self._stream, self._text, self.last_error = stream, "", None

    def write(self, s: str) -> int:
        self._text = (self._text + s)[-65536:]
        at = self._text.rfind(self.PREFIX)
        if at >= 0:
            self.last_error = self._text[at + len(self.PREFIX):].split("\n", 1)[0] or self.last_error
        return self._stream.write(s)

    def __getattr__(self, name):  # flush, isatty, fileno, encoding ... of the real stream
        return getattr(self._stream, name)


def _report_failure(report, error: str, exit_status: int | None) -> None:
    """Replace the report file by a failure report; if even that cannot be written, remove the file (a report of
    an earlier run, or this run's incomplete one, must not stay behind looking like a result)."""
    try:
        report.fail(error, exit_status)
    except OSError:
        try:
            os.unlink(report.path)
        except OSError:
            pass


def _run_diagnose(ckpt: Path | None, prompt: str, decode_steps: int, json_path: Path | None, thinking: bool,
                  device: str, dtype: str, backend: str, weights: str, continue_tokens: int,
                  expect: str | None, batch_invariant: bool = False) -> int:
    """Entry point of `dsv4 diagnose`: both decisive tests on one checkpoint, printed as one labelled report.

    Checkpoint: `ckpt`, else `$DSV4_CKPT`, else a tiny random checkpoint built in a temporary directory.
    `TEST_LAYERS` (environment only) limits the main layers loaded. The tokenizer is the checkpoint's own
    `tokenizer.json` with the dsv4 template attached (`dsv4.tokenizer.load_tokenizer`).
    Test 1 also continues both prompts greedily for `continue_tokens` tokens and states its decision
    (`continuation_verdict`; `expect` = the answer the prompt should produce, e.g. "Paris"). That verdict is
    reported, not gated: it does not change the exit status (a random tiny checkpoint cannot answer).

    Before any model work (before the tiny checkpoint is built, before any weight is read or generated) the token
    counts are checked against the model's context (`check_lengths`: the prompt + `decode_steps` for Test 2, the
    prompt + `continue_tokens` for the continuations and the speculative check). A synthetic source gets a stderr
    line saying what is generated (`synthesis_note`) before the slow load.

    Returns 0 when both tests pass, 3 (EXIT_HARD_STOP) when either fails, 4 (EXIT_INCONCLUSIVE) when neither
    fails but one could not decide (Test 2's power check, Test 1's special-id / control check), 2 for bad input (missing
    checkpoint, invalid TEST_LAYERS, a later revision, unreadable files, a prompt + token counts over the model's
    context: `dsv4.memory_plan.LimitError`), with the reason on stderr.
    """

    if expect is not None and not expect.strip():
        print(f"dsv4 diagnose: error: --expect {expect!r}: an empty expected answer is contained in every text "
              "(a check that cannot fail); give the answer's text or leave --expect out", file=sys.stderr)
        return EXIT_ERROR
    torch_dtype = dsv4.generate.model_dtype(dtype)
    progress = Progress("diagnose")
    with tempfile.TemporaryDirectory(prefix="dsv4-tiny-") as tmp:
        try:
            path = resolve_ckpt(ckpt)
            built = path is None
            if built:  # its config and tokenizer files are known before it is built: the lengths are checked first
                full, tok = dsv4.tiny.tiny_args(), load_tokenizer(dsv4.tiny.tokenizer_dir())
            else:
                ident = _checkpoint_identity(path, built)
                full = checkpoint_args(path)
                tok = load_tokenizer(tokenizer_folder(path))  # a `synth:` source: the packaged tokenizer files
            hand_n, fed_n = _prompt_lengths(tok, prompt, thinking)
            check_lengths(full, template_tokens=fed_n, hand_rolled_tokens=hand_n, decode_steps=decode_steps,
                          continue_tokens=continue_tokens)
            if built:
                path = dsv4.tiny.make_tiny(Path(tmp) / "ckpt", variant="fp8", seed=0)
                ident = _checkpoint_identity(path, built)
                tok = load_tokenizer(tokenizer_folder(path))
            load = contextlib.nullcontext()
            if is_synth_source(path):  # every value is computed: say what, and that it is slow on CPU, first
                n, dtype_bytes = layers_from_env(full.n_layers), torch.empty((), dtype=torch_dtype).element_size()
                if not launch_from_env().distributed:  # a load that cannot fit is refused before the note
                    check_fits(full, n, device=device, dtype_bytes=dtype_bytes, weights=weights)
                progress.say(synthesis_note(path, n, device=device, dtype_bytes=dtype_bytes, weights=weights))
                load = progress.step(f"generating the weights of {parse_source(path)}")
            with load:
                model, n_layers = dsv4.generate.load_model(path, device=device, dtype=torch_dtype, backend=backend,
                                                           weights=weights, batch_invariant=batch_invariant)
        except (FileNotFoundError, ValueError, RuntimeError, OSError) as e:
            release_frames(e)  # a progress bar the failed load left open ends before the line
            print(f"dsv4 diagnose: error: {e}", file=sys.stderr)
            return EXIT_ERROR
        env = environment()

        print("== Checkpoint ==")
        for k, v in ident.items():
            print(f"{k}: {v}")
        print(format_environment(env))
        print(f"run: {env['timestamp']} | command: {shlex.join(command_line())} | report schema {SCHEMA_VERSION}")
        print(f"TEST_LAYERS in effect: {n_layers} of {ident['n_layers']} main layers | dtype {dtype} | "
              f"device {device} | backend {model.backend.name} | weights {weights} | world size "
              f"{env['world_size']}\n")
        diff = template_diff(tok, prompt, thinking=thinking)
        # the ids the model is actually fed must be the official ones (prompt_ids == template == encoder); they are
        # the template ids template_diff got from prompt_ids (a second call would log its special-string warning
        # twice)
        fed = diff.template_ids
        test1_outcome = "HARD STOP" if fed != diff.encoder_ids else diff.outcome
        # Test 2 prefills the fed ids: its first greedy token is the template's top-1 (no second prefill)
        with progress.step(f"Test 2: final norm (prefill {len(fed)} tokens + {decode_steps} decode step(s))"):
            r = dsv4.final_norm.final_norm_check(model, fed, decode_steps=decode_steps, test_layers=n_layers)
        with progress.step(f"Test 1: greedy continuation of the hand-rolled prompt (up to {continue_tokens} "
                           "tokens)") as pr:
            cont_hand = greedy_continuation(model, tok, diff.hand_rolled_ids, continue_tokens, expect,
                                            on_token=lambda k: pr.tick(k, continue_tokens))
        with progress.step(f"Test 1: greedy continuation of the template prompt (up to {continue_tokens} "
                           "tokens)") as pr:
            cont_tmpl = greedy_continuation(model, tok, fed, continue_tokens, expect,
                                            on_token=lambda k: pr.tick(k, continue_tokens))
        sampled = None
        if cont_tmpl.loop.looping:  # greedy decoding's own repetition, or a loop that sampling shows too?
            total = continue_tokens * len(SAMPLED_SEEDS)
            with progress.step(f"Test 1: the template continuation loops: sampled continuations (T "
                               f"{SAMPLED_TEMPERATURE:g}, {len(SAMPLED_SEEDS)} seeds)") as pr:
                sampled = sampled_continuations(model, tok, fed, continue_tokens, expect,
                                                on_token=lambda k: pr.tick(k, total))
        with progress.step("speculative decoding check (the template continuation again, verify steps + "
                           "rollback)"):
            spec = speculative_check(model, fed, cont_tmpl)
        verdict, verdict_line = continuation_verdict(cont_hand, cont_tmpl, expect, sampled)
        top_hand, top_tmpl = _token(tok, cont_hand.ids[0]), _token(tok, r.greedy_ids[0])
        print(format_template_report(diff))
        print(f"greedy top-1 with the hand-rolled prompt: {top_hand['id']} {json.dumps(top_hand['token'])}")
        print(f"greedy top-1 after switching to the template: {top_tmpl['id']} {json.dumps(top_tmpl['token'])}")
        print(format_continuation_report(cont_hand, cont_tmpl, expect, continue_tokens, verdict_line, sampled))
        print(format_speculative_check(spec))
        if cont_tmpl.ids[0] != r.greedy_ids[0]:  # same ids, same model, fresh state: a near-tie flipped
            print(f"note: the continuation's first token {cont_tmpl.ids[0]} differs from Test 2's greedy top-1 "
                  f"{r.greedy_ids[0]} for the same prompt (non-deterministic kernels and a near-tie)")
        if test1_outcome == "HARD STOP":
            print("Test 1 HARD STOP: the ids fed to the model are not the official prompt format")
        print()
        print(format_final_norm_report(r))
        outcomes = (test1_outcome, r.outcome)
        outcome = ("HARD STOP" if "HARD STOP" in outcomes else "INCONCLUSIVE" if "INCONCLUSIVE" in outcomes
                   else "PASS")
        passed = outcome == "PASS"
        print()
        print({"PASS": "RESULT: PASS (both decisive tests)",
               "HARD STOP": "RESULT: HARD STOP - no kernel, mHC or residual change is authorized until these pass",
               "INCONCLUSIVE": "RESULT: INCONCLUSIVE - a decisive test could not decide on this input (see its "
                               "reason); this is not a pass (exit status 4)"}[outcome])
        exit_status = {"PASS": EXIT_PASS, "HARD STOP": EXIT_HARD_STOP, "INCONCLUSIVE": EXIT_INCONCLUSIVE}[outcome]
        print(f"exit status: {exit_status}")
        if json_path is not None:
            report = {"environment": env, "checkpoint": ident, "test_layers": n_layers, "dtype": dtype,
                      "device": device, "backend": model.backend.name, "weights": weights,
                      "world_size": env["world_size"],
                      "test1_template": {**diff.to_json(), "fed_ids": fed, "passed": test1_outcome == "PASS",
                                         "outcome": test1_outcome,
                                         "top1_hand_rolled": top_hand, "top1_template": top_tmpl,
                                         "continuation": {"tokens_requested": continue_tokens, "expect": expect,
                                                          "hand_rolled": cont_hand.to_json(),
                                                          "template": cont_tmpl.to_json(),
                                                          "template_sampled": None if sampled is None else {
                                                              "temperature": SAMPLED_TEMPERATURE,
                                                              "seeds": list(SAMPLED_SEEDS),
                                                              "continuations": [c.to_json() for c in sampled]},
                                                          "verdict": verdict, "verdict_line": verdict_line},
                                         "speculative": spec},
                      "test2_final_norm": r.to_dict(), "outcome": outcome, "passed": passed,
                      "exit_status": exit_status}
            try:  # atomically, tied to this run (dsv4.report.ReportFile; a plain path gets one)

                (json_path if isinstance(json_path, ReportFile) else ReportFile(Path(json_path), "diagnose")).write(report)
            except OSError as e:  # the CLI checked the path up front; it can still vanish or fill up
                print(f"dsv4 diagnose: error: --json {json_path}: cannot write the report ({e})", file=sys.stderr)
                return EXIT_ERROR
        return exit_status
