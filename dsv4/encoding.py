"""The official DeepSeek-V4 prompt format, implemented independently, with the official signatures.

`encode_messages` and `parse_message_from_completion_text` can be swapped for DeepSeek's
`encoding/encoding_dsv4.py` functions of the same names: on every input the official encoder accepts
they return the same string (checked on the 36 gold vectors in `fixtures/golden/dsv4_prompts.json`).
The format is the one DeepSeek ships beside the weights (`encoding/encoding_dsv4.py`); in short, a single
user turn is `BOS <｜User｜>TEXT<｜Assistant｜><think>` in thinking mode and `... <｜Assistant｜></think>`
in chat mode, with no newline after `<｜User｜>`.

Where the official encoder crashes (AttributeError/KeyError/TypeError) or silently emits garbage, this
module raises `ValueError` naming `messages[i].field` (or `context[i].field`) instead:
  * unknown role, thinking_mode, reasoning_effort or task; empty developer content;
  * a message key outside `MESSAGE_KEYS` (a misspelled `contents` / `reasoning_contnet`: the official encoder
    drops it silently), naming the key and listing the accepted ones;
  * a message without `content` (absent or None) unless it is an assistant message with tool_calls or a system
    message with tools / response_format (the official encoder renders an empty turn; `""` stays accepted, as
    officially);
  * content or reasoning_content that is not a string (tool content may also be a list of parts);
  * a tool call without `function.name`/`function.arguments`, or with `arguments` that is a number, list or
    bool (the official encoder renders those as one `arguments` parameter; no convention produces them);
  * `tools` that is not a list of OpenAI tools `{"type": "function", "function": {"name": str, ...}}` (a bare
    `{"name": ...}` would render as `null`/crash; the message names `messages[i].tools[j]`);
  * tool-call arguments holding a JSON object with a duplicate key (json would keep the last silently).
Deliberate extensions, identical in `dsv4/chat_template.jinja`:
  * `content: None` is treated as absent (transformers drops None-valued keys before the template): accepted
    where content may be omitted (an assistant message with tool_calls, a system message with tools or
    response_format), an error elsewhere;
  * transformers' `thinking` / `reasoning` message keys are read as `reasoning_content`, as transformers reads
    them (`REASONING_KEYS`: the first that is not None; two with different values are an error);
  * tool-call `arguments` given as a dict (the HuggingFace convention) render exactly as the same
    dict given as its JSON string, one parameter per key (the official encoder does not crash on a dict: its
    json.loads fails and it renders ONE parameter `arguments` holding the dict's JSON); arguments that are a
    JSON string but not an object render as one parameter named `arguments` holding the raw string (the
    official encoder crashes on those); `arguments: null` renders as officially, one parameter `arguments`
    holding null (docs/differences.md E1, E3).
  * an empty `messages` list raises `EmptyConversationError` (the official encoder returns a bare BOS;
    transformers' `apply_chat_template` raises its own error): `encode_messages([])`, `prompt_ids(tok, [])`
    and `tok.apply_chat_template([])` raise the same error (tests/unit/test_truncated_completion.py).
Deliberate differences of `parse_message_from_completion_text` (strict where the official parser is lenient
by accident; tests/unit/test_truncated_completion.py):
  * a tool-call block complete but not followed by EOS: the official parser accepts it; dsv4 raises
    "missing the end-of-sentence token" (the model never finished its turn);
  * a text cut right after the block opener `\n\n<｜DSML｜tool_calls`: the official parser returns the
    message with no tool calls; dsv4 raises;
  * a text cut inside an invoke, right after its header: the official parser returns a call with no
    arguments; dsv4 raises "missing </｜DSML｜invoke";
  * a text cut after a complete parameter: the official parser returns the call with only the parameters
    so far (a call with arguments missing); dsv4 raises.
  * a `string="false"` parameter whose value is not JSON (or has a duplicate key): the official parser pastes
    it into `arguments`, which then is not valid JSON; dsv4 raises naming the parameter
    (tests/unit/test_encoding.py::test_parse_malformed_raises).
  * opt-in, off by default: `implicit_think_end=True` reads a tool-call block reached before any `</think>`
    (thinking mode) as the end of the reasoning, as vLLM, SGLang and llama.cpp do; the official parser raises
    "missing </think>", which stays the default (docs/differences.md P4); `parse_truncated_completion` takes the
    same keyword for a cut completion.
  A completion stopped by a token limit is not malformed: `parse_truncated_completion` returns what was
  generated so far (`TruncatedCompletion`: reasoning, content, the raw tool-call markup, where the cut came
  and why), and never turns cut markup into tool calls. `dsv4.generate.generate` uses it when it stops at
  `max_tokens`.
Special-token strings inside message text are not escaped (neither does the official encoder): the
tokenizer maps them to their special ids. `special_strings_in_messages` finds them; `prompt_ids` logs them.

`prompt_ids` is the one way dsv4 builds model input from messages (CLI, generation, diagnostics).

The project-wide list of deliberate differences from the official code, with their tests, is
docs/differences.md (rows E1-P4 are the ones above). Public peer suites (DeepSeek's own tests, vLLM, SGLang,
llama.cpp, TensorRT-LLM) run as data against this module: fixtures/peer_suites/, tests/unit/test_peer_suites.py.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import TemplateError

from dsv4.config import UnsupportedRevisionError

__all__ = ["encode_messages", "MESSAGE_KEYS", "REASONING_KEYS", "parse_message_from_completion_text", "prompt_ids", "special_strings_in_messages",
           "EmptyConversationError", "TruncatedCompletion", "parse_truncated_completion",
           "PROMPT_KWARGS", "BOS", "EOS", "USER", "ASSISTANT", "THINK_START", "THINK_END", "DSML", "LATEST_REMINDER",
           "TASK_TOKENS", "SPECIAL_STRINGS"]

log = logging.getLogger(__name__)

BOS = "<｜begin▁of▁sentence｜>"          # id 0
EOS = "<｜end▁of▁sentence｜>"            # id 1
USER = "<｜User｜>"                      # id 128803
ASSISTANT = "<｜Assistant｜>"            # id 128804
THINK_START = "<think>"                  # id 128821
THINK_END = "</think>"                   # id 128822
DSML = "｜DSML｜"                         # id 128825
LATEST_REMINDER = "<｜latest_reminder｜>"  # id 128828
TASK_TOKENS = {"action": "<｜action｜>", "query": "<｜query｜>", "authority": "<｜authority｜>",
               "domain": "<｜domain｜>", "title": "<｜title｜>", "read_url": "<｜read_url｜>"}
SPECIAL_STRINGS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, DSML, LATEST_REMINDER,
                   *TASK_TOKENS.values())
ROLES = ("system", "user", "developer", "assistant", "tool", "latest_reminder")
MODES = ("chat", "thinking")
EFFORTS = (None, "high", "max")

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
TOOLS_HEAD = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by "
    f"writing a \"<{DSML}tool_calls>\" block like the following:\n\n"
    f"<{DSML}tool_calls>\n<{DSML}invoke name=\"$TOOL_NAME\">\n"
    f"<{DSML}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{DSML}parameter>\n"
    f"...\n</{DSML}invoke>\n<{DSML}invoke name=\"$TOOL_NAME2\">\n...\n</{DSML}invoke>\n</{DSML}tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
    "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n")
TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
TOOL_CALLS_OPEN = f"\n\n<{DSML}tool_calls>\n"
TOOL_CALLS_CLOSE = f"\n</{DSML}tool_calls>"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise _DuplicateKey(dup[0])
    return dict(pairs)


class _DuplicateKey(Exception):
    pass


def _not_json_constant(name: str):
    """`json.loads(parse_constant=)`: NaN, Infinity and -Infinity are not JSON (RFC 8259); refused."""
    raise ValueError(f"{name} is not a JSON value (RFC 8259 has no NaN / Infinity)")


class EmptyConversationError(ValueError):
    """`messages` is empty: there is no turn to render. Raised alike by `encode_messages([])`,
    `prompt_ids(tok, [])` and `tok.apply_chat_template([])` (tokenizer from `dsv4.tokenizer.load_tokenizer`).
    The official encoder returns a bare BOS here and transformers raises its own "empty conversation" error;
    dsv4 raises this one everywhere, so the three entry points agree."""

    def __init__(self) -> None:
        super().__init__("messages: empty conversation, nothing to render (give at least one message; the "
                         "official encoder would return a bare BOS, after which no assistant turn can follow)")


# ---------------------------------------------------------------- validation

def _content(msg: dict, where: str, *, allow_list: bool = False) -> Any:
    c = msg.get("content")
    if c is None or isinstance(c, str) or (allow_list and isinstance(c, list)):
        return "" if c is None else c
    raise ValueError(f"{where}.content: expected a string{' or a list of parts' if allow_list else ''}, "
                     f"got {type(c).__name__}")


def _check_tools(tools: Any, where: str) -> None:
    """The OpenAI tool shape; the same checks and messages as the template's `check_tools` macro."""
    if isinstance(tools, (str, dict)) or not isinstance(tools, (list, tuple)):
        raise ValueError(f'{where}: expected a list of tools [{{"type": "function", "function": {{...}}}}]')
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            got = f"keys {_json(list(t))}" if isinstance(t, dict) else "a non-object value"
            raise ValueError(f'{where}[{j}]: expected {{"type": "function", "function": {{"name": str, '
                             f'"description": str, "parameters": JSON schema}}}} (the OpenAI tool shape), got {got}')


MESSAGE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name", "tools",
                "response_format", "task", "wo_eos", "mask")
"""The keys a message may carry: those the official encoder reads (`name`, OpenAI's optional participant / tool
name, is accepted and, as officially, not rendered). Any other key is an error (`_check_text`): a misspelling
(`contents`, `reasoning_contnet`) would otherwise be dropped silently. transformers' aliases `thinking` /
`reasoning` of `reasoning_content` are accepted and read as transformers reads them (`REASONING_KEYS`).
An unknown key whose value is None or empty ("", [], {}) carries nothing and is accepted (`_empty_value`)."""

REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
"""The keys a message's reasoning may be given under, in transformers' order (`_alias_reasoning_fields`): the first
that is not None is the reasoning. `encode_messages` reads them alike (`_alias_reasoning`); two of them given with
different values is an error (transformers would take the first silently)."""
_REASONING_ALIASES = REASONING_KEYS[1:]


def _alias_reasoning(messages: Any) -> Any:
    """messages with each dict's reasoning under `reasoning_content` (the first non-None of `REASONING_KEYS`;
    shallow copies, the caller's dicts untouched); anything else returned as it is (for `_validate` to refuse)."""
    if not isinstance(messages, (list, tuple)):
        return messages
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("reasoning_content") is None:
            r = next((m[k] for k in _REASONING_ALIASES if m.get(k) is not None), None)
            if r is not None:
                m = {**m, "reasoning_content": r}
        out.append(m)
    return type(messages)(out) if isinstance(messages, list) else list(out)


def _empty_value(v: Any) -> bool:
    """An unknown message key whose value carries nothing (None, "", [], {}) is not refused: messages copied back
    from an OpenAI-style response hold such keys (`refusal: None`, `annotations: []`, `function_call: None`), and
    dropping them loses nothing. Any other value under an unknown key is an error (`_check_text`)."""
    return v is None or (isinstance(v, (str, list, tuple, dict)) and len(v) == 0)


def _content_optional(m: dict) -> bool:
    """Whether message m may omit `content` (or give None): an assistant message with tool calls (the OpenAI shape
    `{"role": "assistant", "content": null, "tool_calls": [...]}`) and a system message carrying tools or a
    response_format (a system turn has no wrapper: it renders exactly as with content ""); every other turn of
    the format has text."""
    role = m.get("role")
    return (role == "assistant" and bool(m.get("tool_calls"))) or \
        (role == "system" and bool(m.get("tools") or m.get("response_format")))


def _check_text(messages: list, name: str, dicts_only: bool = False) -> None:
    """Every message is a dict (dicts_only: other messages are skipped, for transformers to normalise - its
    dataclass / pydantic messages) and its `content` / `reasoning_content` strings are encodable text: a lone
    surrogate (e.g. undecodable bytes smuggled in through `surrogateescape`) cannot be tokenised, and the
    tokenizer's own error names neither the message nor the field. Also refused, because the template would read
    them silently: a key outside `MESSAGE_KEYS` (a misspelled `contents` rendered an empty turn), a message of a
    known role without `content` (or with `content: None`) other than an assistant message with tool_calls (an
    empty turn; `""` is accepted, as by the official encoder), bytes content ("<bytes>" in place of the text), a
    non-string reasoning_content (0 / [] read as empty), a wo_eos that is not a bool or None ("no" dropped the
    EOS), a tool_calls that is not a list."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            if dicts_only:
                continue
            raise ValueError(f"{name}[{i}]: expected a dict, got {type(m).__name__}")
        unknown = [k for k in m if k not in MESSAGE_KEYS and k not in _REASONING_ALIASES and not _empty_value(m[k])]
        given = [k for k in REASONING_KEYS if m.get(k) is not None]
        if len({repr(m[k]) for k in given}) > 1:
            raise ValueError(f"{name}[{i}]: the reasoning is given twice with different values, under "
                             f"{' and '.join(map(repr, given))}; expected one of {', '.join(REASONING_KEYS)}")
        for k in given:
            if k != "reasoning_content" and not isinstance(m[k], str):  # reasoning_content: checked below
                raise ValueError(f"{name}[{i}].{k}: expected a string (the reasoning), got {type(m[k]).__name__}")
        if unknown:
            k = unknown[0]
            close = difflib.get_close_matches(str(k), MESSAGE_KEYS, 1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{name}[{i}]: unknown key {k!r}{hint}; a message accepts only the keys "
                             f"{', '.join(MESSAGE_KEYS)}")
        if m.get("role") in ROLES and m.get("content") is None and not _content_optional(m):
            got = "content is None" if "content" in m else "no 'content' key"
            raise ValueError(f"{name}[{i}].content: missing ({got}); expected the {m['role']} message's text "
                             "(\"\" for an empty one); only an assistant message with tool_calls, or a system "
                             "message with tools / response_format, may omit it")
        if m.get("wo_eos") is not None and not isinstance(m["wo_eos"], bool):
            raise ValueError(f"{name}[{i}].wo_eos: expected a bool, got {m['wo_eos']!r}")
        if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], (list, tuple)):
            raise ValueError(f"{name}[{i}].tool_calls: expected a list of tool calls, got "
                             f"{type(m['tool_calls']).__name__}")
        for field in ("content", "reasoning_content"):
            v = m.get(field)
            if isinstance(v, (bytes, bytearray, memoryview)):  # the template would render "<bytes>", not the text
                raise ValueError(f"{name}[{i}].{field}: expected a string, got {type(v).__name__} (decode it first)")
            if field == "reasoning_content" and v is not None and not isinstance(v, str):  # 0 / [] read as empty
                raise ValueError(f"{name}[{i}].reasoning_content: expected a string, got {type(v).__name__}")
            if isinstance(v, str):
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(f"{name}[{i}].{field}: not valid Unicode text ({e.reason} {v[e.start]!r} at "
                                     f"index {e.start}); expected text that encodes as UTF-8") from None


def _validate(messages: list, name: str, check_arguments: bool) -> None:
    if not isinstance(messages, list):
        raise ValueError(f"{name}: expected a list of message dicts, got {type(messages).__name__}")
    _check_text(messages, name)
    for i, m in enumerate(messages):
        where = f"{name}[{i}]"
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role: {role!r} is not one of {ROLES}")
        task = m.get("task")
        if task is not None and task not in TASK_TOKENS:
            raise ValueError(f"{where}.task: {task!r} is not one of {tuple(TASK_TOKENS)}")
        if role == "developer" and not m.get("content"):
            raise ValueError(f"{where}.content: a developer message needs non-empty content")
        if role != "tool":
            _content(m, where)
        if m.get("reasoning_content") is not None and not isinstance(m["reasoning_content"], str):
            raise ValueError(f"{where}.reasoning_content: expected a string, got "
                             f"{type(m['reasoning_content']).__name__}")
        if role == "tool":
            _content(m, where, allow_list=True)
        if m.get("tools"):
            _check_tools(m["tools"], f"{where}.tools")
        for j, tc in enumerate(m.get("tool_calls") or []):
            fn = tc.get("function") if isinstance(tc, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or "arguments" not in fn:
                raise ValueError(f"{where}.tool_calls[{j}]: expected {{'function': {{'name': str, "
                                 f"'arguments': JSON string or dict}}}}, got {tc!r}")
            if fn["arguments"] is not None and not isinstance(fn["arguments"], (str, dict)):
                raise ValueError(f"{where}.tool_calls[{j}].function.arguments: expected a JSON string, a "
                                 f"dict or null, got {type(fn['arguments']).__name__}")
            if check_arguments and fn["arguments"] is not None:  # context is never rendered, so its arguments are never parsed
                _arguments(fn["arguments"], f"{where}.tool_calls[{j}].function.arguments")


# ---------------------------------------------------------------- pipeline steps (official order)

def _merge_tool_messages(messages: list[dict]) -> list[dict]:
    """Pipeline step 1: tool messages become tool_result blocks of user messages; user turns fuse."""
    out: list[dict] = []
    for msg in messages:
        msg = copy.deepcopy(msg)
        role = msg.get("role")
        prev_blocks = bool(out) and out[-1].get("role") == "user" and "content_blocks" in out[-1]
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id", ""),
                     "content": _content(msg, "tool", allow_list=True)}
            if prev_blocks:
                out[-1]["content_blocks"].append(block)
            else:
                out.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": _content(msg, "user")}
            if prev_blocks and out[-1].get("task") is None:
                out[-1]["content_blocks"].append(block)
            else:
                new = {"role": "user", "content": block["text"], "content_blocks": [block]}
                new.update({k: msg[k] for k in ("task", "wo_eos", "mask") if k in msg})
                out.append(new)
        else:
            out.append(msg)
    return out


def _sort_tool_results(messages: list[dict]) -> list[dict]:
    """Pipeline step 2: order tool results by the latest assistant's tool_calls (unknown ids → 0, stable)."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            order = {}
            for k, tc in enumerate(msg["tool_calls"]):
                tc_id = tc.get("id") or tc.get("function", {}).get("id", "")
                if tc_id:
                    order[tc_id] = k
        elif msg.get("role") == "user" and msg.get("content_blocks"):
            blocks = msg["content_blocks"]
            results = [b for b in blocks if b.get("type") == "tool_result"]
            if len(results) > 1 and order:
                it = iter(sorted(results, key=lambda b: order.get(b.get("tool_use_id", ""), 0)))
                msg["content_blocks"] = [next(it) if b.get("type") == "tool_result" else b for b in blocks]
    return messages


def _last_user_index(messages: list[dict]) -> int:
    return max((i for i, m in enumerate(messages) if m.get("role") in ("user", "developer")), default=-1)


def _drop_thinking(messages: list[dict]) -> list[dict]:
    """Pipeline step 5: before the last user/developer turn, assistants lose reasoning, developers vanish."""
    last = _last_user_index(messages)
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in ("user", "system", "tool", "latest_reminder") or i >= last:
            out.append(m)
        elif role == "assistant":
            out.append({k: v for k, v in m.items() if k != "reasoning_content"})
    return out


# ---------------------------------------------------------------- rendering

def _arguments(arguments: str | dict, where: str) -> dict | None:
    """The arguments object of a tool call, or None when the string is not a JSON object."""
    if isinstance(arguments, dict):
        try:
            return json.loads(_json(arguments), object_pairs_hook=_no_duplicate_keys)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: dict is not JSON-serialisable ({e})") from None
    try:
        value = json.loads(arguments, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as e:
        raise ValueError(f"{where}: duplicate key {e.args[0]!r} in the arguments JSON") from None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _render_tool_call(tc: dict) -> str:
    fn = tc["function"]
    # `arguments: null` renders as the official encoder does: one parameter `arguments` holding JSON null
    args = None if fn["arguments"] is None else _arguments(fn["arguments"], "tool_call")
    if args is None:
        args = {"arguments": fn["arguments"]}
    params = [f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
              f'{v if isinstance(v, str) else _json(v)}</{DSML}parameter>' for k, v in args.items()]
    return f'<{DSML}invoke name="{fn["name"]}">\n' + "\n".join(params) + f"\n</{DSML}invoke>"


def _tools_block(tools: list[dict]) -> str:
    return TOOLS_HEAD + "\n".join(_json(t["function"]) for t in tools) + TOOLS_TAIL


def _extras(msg: dict) -> str:
    out = ""
    if msg.get("tools"):
        out += "\n\n" + _tools_block(msg["tools"])
    if msg.get("response_format"):
        out += "\n\n" + RESPONSE_FORMAT + _json(msg["response_format"])
    return out


def _tool_result(block: dict) -> str:
    c = block.get("content", "")
    if isinstance(c, list):
        c = "\n\n".join(p.get("text", "") if p.get("type") == "text" else f"[Unsupported {p.get('type')}]"
                        for p in c)
    return f"<tool_result>{c}</tool_result>"


def _render(i: int, msgs: list[dict], mode: str, drop: bool, effort: str | None, last_user: int) -> str:
    msg = msgs[i]
    role = msg.get("role")
    out = REASONING_EFFORT_MAX if (i == 0 and mode == "thinking" and effort == "max") else ""
    if role == "system":
        out += (msg.get("content") or "") + _extras(msg)
    elif role == "developer":
        out += USER + msg["content"] + _extras(msg)
    elif role == "user":
        parts = []
        for b in msg.get("content_blocks") or []:
            t = b.get("type")
            parts.append(b.get("text", "") if t == "text" else _tool_result(b) if t == "tool_result"
                         else f"[Unsupported {t}]")
        out += USER + ("\n\n".join(parts) if msg.get("content_blocks") else (msg.get("content") or ""))
    elif role == "latest_reminder":
        out += LATEST_REMINDER + (msg.get("content") or "")
    elif role == "assistant":
        calls = ""
        if msg.get("tool_calls"):
            calls = TOOL_CALLS_OPEN + "\n".join(_render_tool_call(tc) for tc in msg["tool_calls"]) + TOOL_CALLS_CLOSE
        prev_task = i > 0 and msgs[i - 1].get("task") is not None
        think = ""
        if mode == "thinking" and not prev_task and (not drop or i > last_user):
            think = (msg.get("reasoning_content") or "") + THINK_END
        out += think + (msg.get("content") or "") + calls + ("" if msg.get("wo_eos") else EOS)
    else:  # a tool message reaching here means the merge step was skipped
        raise ValueError(f"messages[{i}].role: {role!r} cannot be rendered (tool messages must be merged first)")
    return out + _transition(i, msgs, mode, drop, last_user)


def _transition(i: int, msgs: list[dict], mode: str, drop: bool, last_user: int) -> str:
    """What follows message i: nothing, a task token, or `<｜Assistant｜>` + `<think>`/`</think>`."""
    if i + 1 < len(msgs) and msgs[i + 1].get("role") not in ("assistant", "latest_reminder"):
        return ""
    msg = msgs[i]
    task = msg.get("task")
    if task is not None:
        if task != "action":
            return TASK_TOKENS[task]
        return ASSISTANT + (THINK_START if mode == "thinking" else THINK_END) + TASK_TOKENS["action"]
    if msg.get("role") in ("user", "developer"):
        opens = mode == "thinking" and (not drop or i >= last_user)
        return ASSISTANT + (THINK_START if opens else THINK_END)
    return ""


def encode_messages(messages: list[dict], thinking_mode: str, context: list[dict] | None = None,
                    drop_thinking: bool = True, add_default_bos_token: bool = True,
                    reasoning_effort: str | None = None) -> str:
    """Render OpenAI-style messages into the DeepSeek-V4 prompt string (official `encode_messages`).

    Args:
        messages: dicts with `role` in system/user/developer/assistant/tool/latest_reminder and the
            OpenAI fields (`content`, `reasoning_content`, `tool_calls`, `tool_call_id`, `tools`,
            `response_format`) plus the format's own `task`, `wo_eos`.
        thinking_mode: "thinking" (the prompt ends in `<think>`) or "chat" (ends in `</think>`).
        context: messages already sent earlier; they are not rendered, only inform indices and ordering.
        drop_thinking: drop reasoning of assistant turns before the last user turn (forced False when any
            message carries `tools`).
        add_default_bos_token: emit BOS when `context` is empty.
        reasoning_effort: None, "high" or "max" ("max" adds the maximum-effort preamble in thinking mode).
    Returns:
        The prompt string; tokenise it with `add_special_tokens=False`.
    Raises:
        EmptyConversationError (a ValueError): `messages` is empty (the official encoder returns a bare BOS).
        ValueError: naming `messages[i].field` / `context[i].field` (see the module docstring: an unknown
            message key, a missing or None content outside an assistant message with tool_calls, ...), or the bad
            `thinking_mode` / `reasoning_effort` value, or a `drop_thinking` / `add_default_bos_token` that is
            not a bool.
    """
    if thinking_mode not in MODES:
        raise ValueError(f"thinking_mode: {thinking_mode!r} is not one of {MODES}")
    check_flags({"drop_thinking": drop_thinking, "add_default_bos_token": add_default_bos_token})
    if isinstance(messages, (list, tuple)) and not messages:
        raise EmptyConversationError()
    if reasoning_effort not in EFFORTS:
        raise ValueError(f"reasoning_effort: {reasoning_effort!r} is not one of {EFFORTS}")
    context = context or []
    _validate(context, "context", check_arguments=False)  # the messages as given (`_check_text` reads the aliases)
    _validate(messages, "messages", check_arguments=True)
    context = _alias_reasoning(context)  # transformers' `thinking` / `reasoning` keys, read as it reads them
    messages = _alias_reasoning(messages)
    msgs = _merge_tool_messages(messages)
    ctx = _sort_tool_results(_merge_tool_messages(context))
    full = _sort_tool_results(ctx + msgs)
    prompt = BOS if add_default_bos_token and not ctx else ""
    drop = drop_thinking and not any(m.get("tools") for m in full)
    n_ctx = len(ctx)
    if thinking_mode == "thinking" and drop:
        full = _drop_thinking(full)
        n_ctx = len(_drop_thinking(ctx))
    last_user = _last_user_index(full)
    for i in range(n_ctx, len(full)):
        prompt += _render(i, full, thinking_mode, drop, reasoning_effort, last_user)
    return prompt


# ---------------------------------------------------------------- parsing a completion

def _until(text: str, i: int, stops: list[str]) -> tuple[int, str, str | None]:
    """Read from i to the earliest stop string: (index after the stop, text before it, the stop or None)."""
    hits = [(text.find(s, i), s) for s in stops if text.find(s, i) != -1]
    if not hits:
        return len(text), text[i:], None
    pos, stop = min(hits)
    return pos + len(stop), text[i:pos], stop


def _parse_tool_calls(text: str, i: int) -> tuple[int, list[dict]]:
    calls = []
    end_tag, invoke, param, invoke_end = (f"</{DSML}tool_calls>", f"<{DSML}invoke", f"<{DSML}parameter",
                                          f"</{DSML}invoke")
    while True:
        i, gap, stop = _until(text, i, [invoke, end_tag])
        if stop is None:
            raise ValueError(f"completion.tool_calls: the text ends inside the tool-call block, missing {end_tag!r} "
                             "(cut off by a token limit? parse_truncated_completion reads such a text)")
        if gap != ">\n":
            raise ValueError(f"completion.tool_calls: expected '>\\n' before {stop!r}, got {gap!r}")
        if stop == end_tag:
            return i, calls
        i, head, stop = _until(text, i, [param, invoke_end])
        m = re.fullmatch(r'\s*name="(.*?)">\n\n?', head, flags=re.DOTALL)  # a call without parameters ends '\n\n'
        if m is None:
            raise ValueError(f"completion.tool_calls[{len(calls)}].name: malformed invoke header {head!r}")
        name, args = m.group(1), {}
        while stop == param:
            i, body, stop = _until(text, i, [f"/{DSML}parameter"])
            m = re.fullmatch(r' name="(.*?)" string="(true|false)">(.*?)<', body, flags=re.DOTALL)
            if m is None or stop is None:
                raise ValueError(f"completion.tool_calls[{len(calls)}].parameter: malformed {body!r}")
            key, flag, value = m.groups()
            if key in args:
                raise ValueError(f"completion.tool_calls[{len(calls)}].parameter: duplicate name {key!r}")
            if flag == "false":  # inserted as JSON text: it must be JSON, or `arguments` is not (difference P3)
                try:  # strict JSON: Python's json reads NaN / Infinity, which other JSON readers refuse
                    json.loads(value, object_pairs_hook=_no_duplicate_keys, parse_constant=_not_json_constant)
                except (ValueError, _DuplicateKey) as e:
                    raise ValueError(f"completion.tool_calls[{len(calls)}].parameter {key!r}: string=\"false\" "
                                     f"value {value!r} is not JSON ({e}); the arguments would not parse") from None
            args[key] = (value, flag)
            i, gap, stop = _until(text, i, [param, invoke_end])
            if gap != ">\n":
                raise ValueError(f"completion.tool_calls[{len(calls)}].parameter {key!r}: expected '>\\n' "
                                 f"after it, got {gap!r}")
        if stop is None:
            raise ValueError(f"completion.tool_calls[{len(calls)}]: missing {invoke_end!r}")
        body = ", ".join(f"{_json(k)}: {_json(v) if flag == 'true' else v}" for k, (v, flag) in args.items())
        calls.append({"type": "function", "function": {"name": name, "arguments": "{" + body + "}"}})


def parse_message_from_completion_text(text: str, thinking_mode: str, *, implicit_think_end: bool = False) -> dict:
    """Parse a generated completion back into an assistant message (official signature).

    Args:
        text: the decoded completion, starting right after the prompt and ending in EOS.
        thinking_mode: "thinking" (text starts with the reasoning, closed by `</think>`) or "chat".
        implicit_think_end: opt-in leniency (default False = the official strictness). In thinking mode, a
            tool-call block (`"\n\n<｜DSML｜tool_calls"`) reached before any `</think>` ends the reasoning: the
            reasoning is the text before the block, the content is "", and the block is parsed as usual. vLLM,
            SGLang and llama.cpp accept such output (the model emits it at long context); the official parser
            raises "missing </think>". Nothing else is relaxed (docs/differences.md P4).
    Returns:
        `{"role": "assistant", "content": str, "reasoning_content": str, "tool_calls": [OpenAI tool calls]}`;
        string parameters are JSON-encoded back into `arguments`, others are inserted as their JSON text.
    Raises:
        ValueError: naming the field — bad `thinking_mode`, missing `</think>` (reasoning_content), missing
            EOS, malformed/duplicate tool-call markup (tool_calls), text after the calls, or a special token
            (BOS/EOS/<think>/</think>/｜DSML｜) left inside content or reasoning_content.
    """
    if thinking_mode not in MODES:
        raise ValueError(f"thinking_mode: {thinking_mode!r} is not one of {MODES}")
    if not isinstance(text, str):
        raise ValueError(f"completion: expected a string, got {type(text).__name__}")
    calls_open = f"\n\n<{DSML}tool_calls"
    i, reasoning, calls = 0, "", []
    implicit = False
    if thinking_mode == "thinking":
        i, reasoning, stop = _until(text, 0, [THINK_END, calls_open])
        implicit = implicit_think_end and stop == calls_open
        if stop != THINK_END and not implicit:
            hint = (" (a tool-call block before </think>: implicit_think_end=True reads it as the end of the "
                    "reasoning)" if stop == calls_open else "")
            raise ValueError(f"completion.reasoning_content: missing </think> in thinking mode{hint}")
    if implicit:  # the block opener ended the reasoning: no content, the calls follow
        content, stop = "", calls_open
    else:
        i, content, stop = _until(text, i, [EOS, calls_open])
    if stop == calls_open:
        i, calls = _parse_tool_calls(text, i)
        i, tail, stop = _until(text, i, [EOS])
        if tail:
            raise ValueError(f"completion.tool_calls: unexpected text after the tool calls: {tail!r}")
    if stop != EOS:
        raise ValueError("completion: missing the end-of-sentence token")
    if i != len(text):
        raise ValueError(f"completion: unexpected text after EOS: {text[i:]!r}")
    for field, value in (("content", content), ("reasoning_content", reasoning)):
        for sp in (BOS, EOS, THINK_START, THINK_END, DSML):
            if sp in value:
                raise ValueError(f"completion.{field}: unexpected special token {sp!r}")
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": calls}


@dataclass(frozen=True)
class TruncatedCompletion:
    """A completion cut off by a token limit before its EOS: what was generated so far, and why it ends.

    Distinct from a malformed completion (which raises ValueError): a truncated text is a valid prefix so far.
    It is never a message to act on: `tool_calls_text` is kept raw and never parsed into tool calls (a call cut
    off after some parameters would run with arguments missing; see the module docstring).

    Attributes:
        reasoning_content: the reasoning so far (thinking mode; "" in chat mode).
        content: the content so far ("" when the cut came inside the reasoning).
        tool_calls_text: the raw tool-call markup after `"\n\n<｜DSML｜tool_calls"` ("" when none started).
        cut_in: where the limit struck: "reasoning_content", "content" or "tool_calls".
        reason: why the text ends, e.g. "max_tokens=64 reached before the end-of-sentence token".
    """
    reasoning_content: str
    content: str
    tool_calls_text: str
    cut_in: str
    reason: str


def _opener_piece(text: str, opener: str) -> int:
    """Length of the longest proper prefix of `opener` holding `｜DSML｜` that `text` ends with (0 if none)."""
    for k in range(len(opener) - 1, 0, -1):
        if DSML in opener[:k] and text.endswith(opener[:k]):
            return k
    return 0


def parse_truncated_completion(text: str, thinking_mode: str,
                               reason: str = "the token limit was reached before the end-of-sentence token",
                               *, implicit_think_end: bool = False) -> TruncatedCompletion:
    """The partial result of a completion stopped by a token limit (no EOS): reasoning / content so far.

    Same reading as `parse_message_from_completion_text` up to the cut: in thinking mode the reasoning runs to
    `</think>`; the content runs to `"\n\n<｜DSML｜tool_calls"`; a content tail that is a cut-off piece of that
    opener (holding `｜DSML｜`) counts as the start of the tool-call block.

    Args:
        text: the decoded generated text (no EOS in it).
        thinking_mode: "thinking" or "chat".
        reason: stored in `TruncatedCompletion.reason`.
        implicit_think_end: the same opt-in as `parse_message_from_completion_text` (default False = the official
            strictness). In thinking mode, a `"\n\n<｜DSML｜tool_calls"` reached before any `</think>` ends the
            reasoning (the text before it); the content is "" and the rest is the raw tool-call markup. A reasoning
            tail that is a cut-off piece of that opener (holding `｜DSML｜`) counts as the start of the block, as in
            the content (docs/differences.md P4).
    Returns:
        `TruncatedCompletion`.
    Raises:
        ValueError: bad `thinking_mode` or `text` not a string; `text` holds EOS (it is not truncated: use
            `parse_message_from_completion_text`); malformed before the cut: tool calls before `</think>` in
            thinking mode, a special token (BOS/EOS/<think>/</think>/｜DSML｜) inside reasoning or content, or
            BOS/<think>/</think> or text after `</｜DSML｜tool_calls>` in the tool-call markup.
    """
    if thinking_mode not in MODES:
        raise ValueError(f"thinking_mode: {thinking_mode!r} is not one of {MODES}")
    if not isinstance(text, str):
        raise ValueError(f"completion: expected a string, got {type(text).__name__}")
    if EOS in text:
        raise ValueError("completion: holds the end-of-sentence token, so it is not truncated "
                         "(parse it with parse_message_from_completion_text)")
    calls_open = f"\n\n<{DSML}tool_calls"
    i, reasoning, content, calls_text, cut_in = 0, "", "", "", "content"
    if thinking_mode == "thinking":
        i, reasoning, stop = _until(text, 0, [THINK_END, calls_open])
        if stop == calls_open and implicit_think_end:  # the opener ends the reasoning (P4): the calls follow
            cut_in, calls_text = "tool_calls", text[i:]
        elif stop == calls_open:
            raise ValueError("completion.reasoning_content: tool calls before </think> in thinking mode (a "
                             "tool-call block before </think>: implicit_think_end=True reads it as the end of the "
                             "reasoning)")
        elif stop is None:
            cut_in = "reasoning_content"
            k = _opener_piece(reasoning, calls_open) if implicit_think_end else 0
            if k:  # a cut inside the opener itself, before any </think>
                cut_in, reasoning = "tool_calls", reasoning[:-k]
    if cut_in == "content":
        i, content, stop = _until(text, i, [calls_open])
        if stop == calls_open:
            cut_in, calls_text = "tool_calls", text[i:]
        else:  # a cut inside the opener itself: "...\n\n<｜DSML｜tool"
            k = _opener_piece(content, calls_open)
            if k:
                cut_in, content = "tool_calls", content[:-k]
    for field, value in (("content", content), ("reasoning_content", reasoning)):
        for sp in (BOS, EOS, THINK_START, THINK_END, DSML):
            if sp in value:
                raise ValueError(f"completion.{field}: unexpected special token {sp!r}")
    for sp in (BOS, THINK_START, THINK_END):
        if sp in calls_text:
            raise ValueError(f"completion.tool_calls: unexpected special token {sp!r}")
    end_tag = f"</{DSML}tool_calls>"
    if end_tag in calls_text and calls_text.split(end_tag, 1)[1]:
        raise ValueError(f"completion.tool_calls: unexpected text after the tool calls: "
                         f"{calls_text.split(end_tag, 1)[1]!r}")
    return TruncatedCompletion(reasoning, content, calls_text, cut_in, reason)


# ---------------------------------------------------------------- the one prompt path

def special_strings_in_messages(messages: list[dict]) -> list[tuple[int, str, str]]:
    """(message index, field, special string) for every format special string found inside message text
    (`content`, `reasoning_content`). The encoder does not escape them: the tokenizer turns each into its
    special id, so user text can forge turns. Reported, never silently removed."""
    found = []
    for i, m in enumerate(messages):
        for field in ("content", "reasoning_content"):
            v = m.get(field) if isinstance(m, dict) else None
            if isinstance(v, str):
                found += [(i, field, sp) for sp in SPECIAL_STRINGS if sp in v]
    return found


PROMPT_KWARGS = ("reasoning_effort", "drop_thinking", "context", "add_default_bos_token", "tools",
                 "add_generation_prompt", "sanitize_control_tokens")

BOOL_KWARGS = ("thinking", "drop_thinking", "add_default_bos_token", "add_generation_prompt",
               "sanitize_control_tokens")
"""The prompt's switches: each must be a real bool where given (a string "no" or a 0 would be read by its truth)."""


def check_flags(kw: dict) -> None:
    """Raise ValueError naming the first of `BOOL_KWARGS` in kw whose value is not a bool (None included: the
    template reads None as False, `thinking=None` as thinking mode), or a `tools` that is not a list."""
    for k in BOOL_KWARGS:
        if k in kw and not isinstance(kw[k], bool):
            raise ValueError(f"{k}: expected a bool (True or False), got {kw[k]!r}")
    tools = kw.get("tools")
    if tools is not None and not isinstance(tools, (list, tuple)):  # transformers' message names no argument
        raise ValueError(f"tools: expected a list of OpenAI tool dicts ({{'type': 'function', 'function': ...}}), "
                         f"got {type(tools).__name__}")


def prompt_ids(tokenizer, messages: list[dict], thinking: bool = True, **kw) -> list[int]:
    """Token ids of the DeepSeek-V4 prompt for `messages` — the only way dsv4 builds model input.

    Goes through `tokenizer.apply_chat_template` with the dsv4 template (`dsv4/chat_template.jinja`,
    attached by `dsv4.tokenizer.load_tokenizer`), `add_generation_prompt=True` unless given; tests check it
    equals `tokenizer.encode(encode_messages(...), add_special_tokens=False)` on every gold vector.

    Args:
        tokenizer: a tokenizer from `dsv4.tokenizer.load_tokenizer` (attribute `dsv4_template_source`).
        messages: as for `encode_messages`.
        thinking: True → thinking mode (prompt ends in `<think>`), False → chat mode (`</think>`).
        **kw: `reasoning_effort`, `drop_thinking`, `context`, `add_default_bos_token`, `tools` (HF style),
            `add_generation_prompt` — forwarded to the template; `sanitize_control_tokens=True` (transformers)
            tokenises special strings inside message text as plain text — NOT what the official encoder does,
            so off by default. Any other keyword (a typo such as `reasoning_efort`, Qwen's `enable_thinking`)
            is an error: the template would silently ignore it.
    Returns:
        list[int] of length s (the prompt), ids < vocab size; no special tokens are added beyond the format's.
    Raises:
        EmptyConversationError (a ValueError): `messages` is empty (as `encode_messages([])`).
        UnsupportedRevisionError (a ValueError, `dsv4.config`): the tokenizer's checkpoint names a later
            revision (its config.json beside the tokenizer files): the April texts would be wrong for it.
        ValueError: an unknown keyword argument (names it and lists the accepted ones); a switch (`thinking`,
            `drop_thinking`, `add_default_bos_token`, `add_generation_prompt`, `sanitize_control_tokens`) that is
            not a bool, or a `tools` that is not a list (`check_flags`); the tokenizer does not carry the dsv4
            template; `messages` is not a list (or tuple) of dicts, a text field holds a lone surrogate or bytes,
            a key outside `MESSAGE_KEYS` is given (named, with the accepted keys), `content` is missing or None
            where the format needs text (every message but an assistant one with tool_calls), or a field has the
            wrong type (`_check_text`: reasoning_content, wo_eos, tool_calls); the messages
            are invalid (the template's error, naming the message index and field).
    """
    unknown = sorted(set(kw) - set(PROMPT_KWARGS))
    if unknown:
        hints = [f"{m[0]!r} for {k!r}" for k in unknown if k != "enable_thinking"
                 and (m := difflib.get_close_matches(k, PROMPT_KWARGS, 1))]
        if "enable_thinking" in unknown:
            hints.append("thinking=True/False for 'enable_thinking'")
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
        raise ValueError(f"prompt_ids: unknown keyword argument(s) {', '.join(map(repr, unknown))}{hint}; accepted: "
                         f"thinking, {', '.join(PROMPT_KWARGS)}")
    if getattr(tokenizer, "dsv4_template_source", None) is None:
        raise ValueError("prompt_ids: tokenizer has no dsv4 chat template attached (attribute "
                         "dsv4_template_source missing); load it with dsv4.tokenizer.load_tokenizer")
    if not isinstance(thinking, bool):
        raise ValueError(f"thinking: expected a bool, got {thinking!r}")
    check_flags(kw)
    revision = getattr(tokenizer.dsv4_template_source, "revision", None)
    if revision is not None:
        raise UnsupportedRevisionError(*revision)
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages: expected a list of message dicts, got {type(messages).__name__} (one "
                         "conversation; a single message goes in a list: [{'role': 'user', 'content': ...}])")
    if not messages:
        raise EmptyConversationError()
    _check_text(list(messages), "messages")  # dicts with encodable text, before the template sees them
    for i, field, sp in special_strings_in_messages(messages):
        log.warning("messages[%d].%s contains the special string %r: it is tokenised as the special token, "
                    "as the official encoder does", i, field, sp)
    kw.setdefault("add_generation_prompt", True)
    try:
        ids = tokenizer.apply_chat_template(messages, thinking=thinking, tokenize=True, return_dict=False, **kw)
    except TemplateError as e:
        raise ValueError(str(e)) from None
    return [int(t) for t in ids]
