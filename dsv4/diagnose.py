"""`dsv4 diagnose`: the decisive tests behind the merge gate, as one report.

Test 1 (this part): the prompt format. The legacy hand-rolled prompt
`[BOS, <｜User｜>] + encode("\\n\\n" + prompt) + [<｜Assistant｜>]` is out of distribution for DeepSeek-V4; the
model's input must come from the official format (`dsv4.encoding.prompt_ids`, i.e. the dsv4 chat template,
equal to `encode_messages`). `template_diff` builds both, aligns the id sequences (difflib) and names every
difference with its token strings; for the seed prompt it reads: extra "\\n\\n" (id 271) after <｜User｜>, and
<think> (id 128821, thinking mode) / </think> (id 128822, chat mode) missing at the end.
Test 2 (the final norm) lives in `dsv4.final_norm` and is re-exported here; `run_diagnose` runs both.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from dsv4.final_norm import final_norm_check  # noqa: F401  (dsv4.diagnose.final_norm_check)
from dsv4.encoding import ASSISTANT, BOS, USER, encode_messages, prompt_ids, special_strings_in_messages

__all__ = ["TemplateDiff", "DiffOp", "template_diff", "format_template_report", "hand_rolled_ids", "run_diagnose",
           "final_norm_check", "format_final_norm_report", "EXIT_PASS", "EXIT_ERROR", "EXIT_HARD_STOP"]


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
        differs: hand-rolled ids != template ids.
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

    @property
    def differs(self) -> bool:
        return self.hand_rolled_ids != self.template_ids

    def to_json(self) -> dict:
        """A JSON-serialisable dict of every field plus `differs`."""
        d = dataclasses.asdict(self)
        d["differs"] = self.differs
        return d


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
        special_in_prompt=[sp for _, _, sp in special_strings_in_messages(messages)])


def format_template_report(diff: TemplateDiff) -> str:
    """The Test-1 half of the `dsv4 diagnose` report as plain text (one block, ends with a verdict line)."""
    mode = "thinking" if diff.thinking else "chat"
    lines = [f"== Test 1: prompt format ({mode} mode) ==",
             f"prompt:          {json.dumps(diff.prompt, ensure_ascii=False)}",
             f"template source: {diff.template_source}",
             f"hand-rolled ids ({len(diff.hand_rolled_ids)}): {diff.hand_rolled_ids}",
             f"hand-rolled str: {json.dumps(diff.hand_rolled_text, ensure_ascii=False)}",
             f"template ids ({len(diff.template_ids)}):    {diff.template_ids}",
             f"template str:    {json.dumps(diff.template_text, ensure_ascii=False)}",
             "alignment (pos | hand-rolled | template | op):"]
    for hp, ht, tp, tt, op in diff.alignment:
        cell = (lambda p, t: "-" if t is None else f"{p:>3} {t[0]:>6} {json.dumps(t[1], ensure_ascii=False)}")
        mark = "" if op == "equal" else f"   <-- {op}"
        lines.append(f"  {cell(hp, ht):<34} | {cell(tp, tt):<34}{mark}")
    lines.append("differences:" if diff.ops else "differences: none")
    lines += [f"  - {op.description}" for op in diff.ops]
    if diff.special_in_prompt:
        lines.append(f"WARNING: the prompt contains special strings {diff.special_in_prompt}; they are tokenised "
                     "as special tokens (the official encoder does not escape them)")
    lines.append(f"template == official encoder: {'yes' if diff.template_equals_encoder else 'NO'}")
    verdict = "PASS" if diff.template_equals_encoder else "FAIL"
    lines.append(f"Test 1 {verdict}: model input is built by the dsv4 template"
                 + ("; the hand-rolled prompt differs as listed above" if diff.differs else ""))
    return "\n".join(lines)


EXIT_PASS, EXIT_ERROR, EXIT_HARD_STOP = 0, 2, 3


def _checkpoint_identity(path: Path, built: bool) -> dict:
    """Where the weights come from: path, sha256 of config.json and of the index, total_size, layer count."""
    import hashlib

    from dsv4.config import ModelArgs

    def digest(p: Path) -> str | None:
        return hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.is_file() else None

    from dsv4.checkpoint import read_index

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
    return {"path": str(path), "source": source, "config_sha256": digest(path / "config.json"),
            "index_sha256": digest(idx), "total_size": total,
            "n_layers": ModelArgs.from_hf_config(path).n_layers}


def _top1(model, tokenizer, ids: list[int]) -> dict:
    import torch

    logits = model(torch.tensor([ids], device=model.device), model.new_state(1))
    return _token(tokenizer, int(logits.argmax(-1)))


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
        lines += [f"logits(X) vs logits({lab}):",
                  f"  argmax_A {c.argmax_A}  argmax_B {c.argmax_B}  cos {c.cosine:.9f}   (blind to a logit scale)",
                  f"  rel_L2 {c.rel_l2:.3e} (tol {c.rel_tol:.1e})  max|dlogit| {c.max_abs_diff:.3e}  "
                  f"KL {c.kl:.3e} (tol {c.kl_tol:.1e})  -> {'ok' if c.passed else 'FAIL'}"]
    lines += [f"rule: {r.rule}", f"Test 2 {r.verdict}"]
    return "\n".join(lines)


def run_diagnose(ckpt: Path | None, prompt: str, decode_steps: int, json_path: Path | None, thinking: bool,
                 device: str, dtype: str = "bf16", backend: str = "reference", weights: str = "dequantized") -> int:
    """See `_run_diagnose`; under torchrun only rank 0 prints and writes the JSON report (every rank computes)."""
    import contextlib
    import io

    from dsv4.generate import is_rank_zero

    if is_rank_zero():
        return _run_diagnose(ckpt, prompt, decode_steps, json_path, thinking, device, dtype, backend, weights)
    with contextlib.redirect_stdout(io.StringIO()):
        return _run_diagnose(ckpt, prompt, decode_steps, None, thinking, device, dtype, backend, weights)


def _run_diagnose(ckpt: Path | None, prompt: str, decode_steps: int, json_path: Path | None, thinking: bool,
                  device: str, dtype: str, backend: str, weights: str) -> int:
    """Entry point of `dsv4 diagnose`: both decisive tests on one checkpoint, printed as one labelled report.

    Checkpoint: `ckpt`, else `$DSV4_CKPT`, else a tiny random checkpoint built in a temporary directory.
    `TEST_LAYERS` (environment only) limits the main layers loaded. The tokenizer is the checkpoint's own
    `tokenizer.json` with the dsv4 template attached (`dsv4.tokenizer.load_tokenizer`).

    Returns 0 when both tests pass, 3 (EXIT_HARD_STOP) when either fails, 2 for bad input (missing
    checkpoint, invalid TEST_LAYERS, unreadable files), with the reason printed.
    """
    import tempfile

    import torch

    from dsv4.final_norm import final_norm_check
    from dsv4.generate import load_model, resolve_ckpt
    from dsv4.tiny import make_tiny
    from dsv4.tokenizer import load_tokenizer

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    with tempfile.TemporaryDirectory(prefix="dsv4-tiny-") as tmp:
        try:
            path = resolve_ckpt(ckpt)
            built = path is None
            if built:
                path = make_tiny(Path(tmp) / "ckpt", variant="fp8", seed=0)
            ident = _checkpoint_identity(path, built)
            tok = load_tokenizer(path)
            model, n_layers = load_model(path, device=device, dtype=torch_dtype, backend=backend, weights=weights)
        except (FileNotFoundError, ValueError, RuntimeError, OSError) as e:
            print(f"dsv4 diagnose: error: {e}")
            return EXIT_ERROR
        print("== Checkpoint ==")
        for k, v in ident.items():
            print(f"{k}: {v}")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        print(f"TEST_LAYERS in effect: {n_layers} of {ident['n_layers']} main layers | dtype {dtype} | "
              f"device {device} | backend {model.backend.name} | weights {weights} | world size {world}\n")
        diff = template_diff(tok, prompt, thinking=thinking)
        # the ids the model is actually fed must be the official ones (prompt_ids == template == encoder)
        fed = prompt_ids(tok, [{"role": "user", "content": prompt}], thinking=thinking)
        test1_ok = diff.template_equals_encoder and fed == diff.encoder_ids
        # Test 2 prefills the fed ids: its first greedy token is the template's top-1 (no second prefill)
        r = final_norm_check(model, fed, decode_steps=decode_steps, test_layers=n_layers)
        top_hand, top_tmpl = _top1(model, tok, diff.hand_rolled_ids), _token(tok, r.greedy_ids[0])
        print(format_template_report(diff))
        print(f"greedy top-1 with the hand-rolled prompt: {top_hand['id']} {json.dumps(top_hand['token'])}")
        print(f"greedy top-1 after switching to the template: {top_tmpl['id']} {json.dumps(top_tmpl['token'])}")
        if not test1_ok:
            print("Test 1 HARD STOP: the ids fed to the model are not the official prompt format")
        print()
        print(format_final_norm_report(r))
        passed = test1_ok and r.passed
        print()
        print("RESULT: PASS (both decisive tests)" if passed else
              "RESULT: HARD STOP - no kernel, mHC or residual change is authorized until these pass")
        if json_path is not None:
            report = {"checkpoint": ident, "test_layers": n_layers, "dtype": dtype, "device": device,
                      "backend": model.backend.name, "weights": weights,
                      "test1_template": {**diff.to_json(), "fed_ids": fed, "passed": test1_ok,
                                         "top1_hand_rolled": top_hand, "top1_template": top_tmpl},
                      "test2_final_norm": r.to_dict(), "passed": passed}
            Path(json_path).write_text(json.dumps(report, ensure_ascii=False, indent=1), encoding="utf-8")
        return EXIT_PASS if passed else EXIT_HARD_STOP
