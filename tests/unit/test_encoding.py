"""dsv4.encoding on inputs of our own: pipeline rules spelled out as exact strings, errors naming index and
field, completion parsing (valid and malformed). The gold vectors live in test_chat_template.py."""

from __future__ import annotations

import json

import pytest

from dsv4.encoding import (ASSISTANT, BOS, DSML, EOS, USER, encode_messages, parse_message_from_completion_text,
                           special_strings_in_messages)

U = {"role": "user", "content": "q"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def _call(cid, args, name="f"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def _params(prompt: str) -> list[str]:
    return [line for line in prompt.split("\n") if line.startswith(f"<{DSML}parameter")]


# ---------------------------------------------------------------- rendering rules

def test_single_turn_both_modes():
    assert encode_messages([U], "thinking") == f"{BOS}{USER}q{ASSISTANT}<think>"
    assert encode_messages([U], "chat") == f"{BOS}{USER}q{ASSISTANT}</think>"
    assert encode_messages([U], "chat", add_default_bos_token=False) == f"{USER}q{ASSISTANT}</think>"


def test_tool_results_reordered_by_call_order_and_fused_with_user():
    msgs = [U, {"role": "assistant", "content": "", "tool_calls": [_call("a", "{}"), _call("b", "{}")]},
            {"role": "tool", "tool_call_id": "b", "content": "RB"}, {"role": "tool", "tool_call_id": "a", "content": "RA"},
            {"role": "user", "content": "next"}]
    out = encode_messages(msgs, "chat")
    assert out.endswith(f"{EOS}{USER}<tool_result>RA</tool_result>\n\n<tool_result>RB</tool_result>\n\nnext"
                        f"{ASSISTANT}</think>")


def test_tool_result_list_content_and_unknown_parts():
    msgs = [U, {"role": "assistant", "tool_calls": [_call("a", "{}")]},
            {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "t1"}, {"type": "image"}]}]
    assert encode_messages(msgs, "chat").endswith(f"{USER}<tool_result>t1\n\n[Unsupported image]</tool_result>"
                                                  f"{ASSISTANT}</think>")


def test_drop_thinking_removes_old_developer_and_reasoning():
    msgs = [{"role": "developer", "content": "DEV"}, {"role": "assistant", "content": "A", "reasoning_content": "R"},
            {"role": "user", "content": "u2"}]
    assert encode_messages(msgs, "thinking") == f"{BOS}A{EOS}{USER}u2{ASSISTANT}<think>"
    kept = encode_messages(msgs, "thinking", drop_thinking=False)
    assert kept == f"{BOS}{USER}DEV{ASSISTANT}<think>R</think>A{EOS}{USER}u2{ASSISTANT}<think>"
    # tools anywhere switch drop_thinking off
    with_tools = [{"role": "system", "content": "", "tools": [{"type": "function", "function": {"name": "f"}}]}] + msgs
    assert "DEV" in encode_messages(with_tools, "thinking") and "<think>R</think>" in encode_messages(with_tools, "thinking")


def test_context_is_not_rendered_and_suppresses_bos():
    ctx = [{"role": "system", "content": "S"}, U, {"role": "assistant", "content": "A", "reasoning_content": "R"}]
    assert encode_messages([{"role": "user", "content": "u2"}], "thinking", context=ctx) == f"{USER}u2{ASSISTANT}<think>"


def test_tasks_latest_reminder_and_wo_eos():
    action = encode_messages([{"role": "user", "content": "q", "task": "action"}], "thinking")
    assert action == f"{BOS}{USER}q{ASSISTANT}<think><｜action｜>"
    assert encode_messages([{"role": "user", "content": "q", "task": "title"}], "chat") == f"{BOS}{USER}q<｜title｜>"
    # the answer to a task turn carries no reasoning block even in thinking mode
    after = encode_messages([{"role": "user", "content": "q", "task": "query"},
                             {"role": "assistant", "content": "A", "reasoning_content": "R"}], "thinking")
    assert after == f"{BOS}{USER}q<｜query｜>A{EOS}"
    lr = encode_messages([U, {"role": "latest_reminder", "content": "LR"}], "chat")
    assert lr == f"{BOS}{USER}q{ASSISTANT}</think><｜latest_reminder｜>LR"
    pre = encode_messages([U, {"role": "assistant", "content": "pre", "wo_eos": True}], "thinking")
    assert pre == f"{BOS}{USER}q{ASSISTANT}<think></think>pre"


def test_effort_max_only_in_thinking_mode_and_first_message():
    assert encode_messages([U], "thinking", reasoning_effort="max").startswith(BOS + "Reasoning Effort: Absolute")
    assert encode_messages([U], "chat", reasoning_effort="max") == encode_messages([U], "chat")
    assert encode_messages([U], "thinking", reasoning_effort="high") == encode_messages([U], "thinking")


@pytest.mark.parametrize("args,want", [
    ('{"a":1.50,"b":1e2,"c":-0,"d":[1,{"x":"y"}],"e":"x\\u00e9\\n","f":null}',
     ['"a" string="false">1.5<', '"b" string="false">100.0<', '"c" string="false">0<',
      '"d" string="false">[1, {"x": "y"}]<', '"e" string="true">xé', '"f" string="false">null<']),
    ('not json', ['"arguments" string="true">not json<']),
    ('[1, 2]', ['"arguments" string="true">[1, 2]<']),
    ('{}', []),
])
def test_tool_call_arguments_rendering(args, want):
    out = encode_messages([U, {"role": "assistant", "tool_calls": [_call("a", args)]}], "chat")
    joined = out.replace(f"</{DSML}parameter>", "<")
    for w in want:
        assert f'<{DSML}parameter name={w}' in joined, (w, out)
    if not want:
        assert f'<{DSML}invoke name="f">\n\n</{DSML}invoke>' in out


def test_dict_arguments_equal_their_json_string():
    args = {"city": "Tromsø", "days": 3, "opts": {"u": [1, 2.5]}}
    a = encode_messages([U, {"role": "assistant", "tool_calls": [_call("a", args)]}], "chat")
    b = encode_messages([U, {"role": "assistant", "tool_calls": [_call("a", json.dumps(args))]}], "chat")
    assert a == b and '<｜DSML｜parameter name="city" string="true">Tromsø</｜DSML｜parameter>' in a


def test_null_arguments_render_as_the_official_encoder():
    """`arguments: null`: the official encoder's json.loads(None) fails and it writes one parameter `arguments`
    holding null (docs/differences.md E3); dsv4 raised here before. The template agrees
    (test_peer_suites.py::test_template_equals_encoder_on_peer_cases)."""
    out = encode_messages([U, {"role": "assistant", "tool_calls": [_call("a", None)]}], "chat")
    assert _params(out) == [f'<{DSML}parameter name="arguments" string="false">null</{DSML}parameter>']
    # a missing `arguments` (the official KeyError) stays a named error
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]"):
        encode_messages([U, {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}]}], "chat")


def test_special_strings_are_not_escaped_and_are_reported():
    msgs = [{"role": "user", "content": f"a {USER} b</think>"}]
    assert encode_messages(msgs, "chat") == f"{BOS}{USER}a {USER} b</think>{ASSISTANT}</think>"
    assert special_strings_in_messages(msgs) == [(0, "content", USER), (0, "content", "</think>")]
    assert special_strings_in_messages([U]) == []


def test_empty_and_none_contents():
    # "" is an empty turn, as the official encoder renders it; None / a missing content only where the format
    # allows no text (an assistant message with tool_calls): elsewhere an error (test_message_keys_and_content)
    assert encode_messages([{"role": "system", "content": ""}, {"role": "user", "content": ""}], "chat") == \
        f"{BOS}{USER}{ASSISTANT}</think>"
    calls = {"role": "assistant", "content": None, "tool_calls": [_call("a", "{}")]}
    assert encode_messages([U, calls], "chat") == encode_messages([U, {**calls, "content": ""}], "chat")
    with pytest.raises(ValueError, match=r"messages\[0\]\.content: missing \(content is None\)"):
        encode_messages([{"role": "system", "content": None}, {"role": "user"}], "chat")
    # encode_messages([]) raises EmptyConversationError (the official encoder returns BOS): see
    # tests/unit/test_truncated_completion.py::test_empty_conversation_same_error_everywhere


# ---------------------------------------------------------------- errors name the index and the field

@pytest.mark.parametrize("msgs,kw,match", [
    ([U, {"role": "bot", "content": "x"}], {}, r"messages\[1\]\.role: 'bot'"),
    ([{"role": "user", "content": "x", "task": "nope"}], {}, r"messages\[0\]\.task: 'nope'"),
    ([U, {"role": "developer", "content": ""}], {}, r"messages\[1\]\.content: a developer message"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], {}, r"messages\[0\]\.content: expected a string"),
    ([U, {"role": "assistant", "tool_calls": [{"id": "a"}]}], {}, r"messages\[1\]\.tool_calls\[0\]"),
    ([U, {"role": "assistant", "tool_calls": [_call("a", 5)]}], {}, r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"),
    ([U, {"role": "assistant", "tool_calls": [_call("a", '{"k":1,"k":2}')]}], {}, r"duplicate key 'k'"),
    ([U, {"role": "assistant", "content": ["a"]}], {}, r"messages\[1\]\.content: expected a string"),
    ([U, {"role": "assistant", "content": "a", "reasoning_content": 3}], {}, r"messages\[1\]\.reasoning_content"),
    ([U], {"context": [{"role": "oops"}]}, r"context\[0\]\.role"),
    ([U], {"reasoning_effort": "low"}, r"reasoning_effort: 'low'"),
    ([{"role": "system", "content": "", "tools": [{"name": "f"}]}, U], {},
     r'messages\[0\]\.tools\[0\]: expected \{"type": "function", "function": \{"name": str.*got keys \["name"\]'),
    ([{"role": "system", "content": "", "tools": [TOOL, "f"]}, U], {}, r"messages\[0\]\.tools\[1\]: .*got a non-object"),
    ([{"role": "system", "content": "", "tools": [{"function": {"description": "no name"}}]}, U], {},
     r'messages\[0\]\.tools\[0\]: expected .*got keys \["function"\]'),
    ([{"role": "system", "content": "", "tools": TOOL}, U], {}, r"messages\[0\]\.tools: expected a list of tools"),
    ([U], {"context": [{"role": "system", "content": "", "tools": [{"name": "f"}]}]}, r"context\[0\]\.tools\[0\]"),
])
def test_invalid_input_raises_value_error(msgs, kw, match):
    with pytest.raises(ValueError, match=match):
        encode_messages(msgs, "chat", **kw)


@pytest.mark.parametrize("msg,match", [
    ({"role": "user", "contents": "What is 2+2?"},
     r"messages\[1\]: unknown key 'contents' \(did you mean 'content'\?\); a message accepts only the keys role, "
     r"content, reasoning_content, tool_calls, tool_call_id, name, tools, response_format, task, wo_eos, mask"),
    ({"role": "assistant", "content": "a", "reasoning_contnet": "r"},
     r"messages\[1\]: unknown key 'reasoning_contnet' \(did you mean 'reasoning_content'\?\)"),
    ({"role": "assistant", "content": "a", "thinking": "r", "reasoning": "s"}, r"messages\[1\]: the reasoning is "
     r"given twice with different values, under 'thinking' and 'reasoning'"),
    ({"role": "user"}, r"messages\[1\]\.content: missing \(no 'content' key\); expected the user message's text"),
    ({"role": "user", "content": None}, r"messages\[1\]\.content: missing \(content is None\)"),
    ({"role": "assistant", "reasoning_content": "r"}, r"messages\[1\]\.content: missing"),
    ({"role": "tool", "tool_call_id": "a"}, r"messages\[1\]\.content: missing"),
])
def test_message_keys_and_content(msg, match):
    """A misspelled key (the official encoder drops it: `contents` gave an empty user turn) and a missing content
    are errors naming messages[i]; every key of MESSAGE_KEYS, "" content and an assistant message with tool calls
    and no content still render, as does an unknown key whose value is None or empty (an OpenAI response's
    `refusal: None`, `annotations: []` copied back into the conversation: nothing is lost)."""
    with pytest.raises(ValueError, match=match):
        encode_messages([U, msg], "chat")
    with pytest.raises(ValueError, match=match.replace("messages", "context")):
        encode_messages([U], "chat", context=[U, msg])
    full = [{"role": "system", "content": "s", "tools": [TOOL], "response_format": {"type": "json_object"}},
            {"role": "user", "content": "", "name": "ann", "mask": 0},
            {"role": "assistant", "tool_calls": [_call("a", '{"x": 1}')], "reasoning_content": "r"},
            {"role": "tool", "tool_call_id": "a", "name": "f", "content": "ok"},
            {"role": "assistant", "content": "done", "wo_eos": False, "refusal": None, "annotations": []},
            {"role": "user", "content": "q", "task": "query"}]
    text = encode_messages(full, "thinking")
    assert text.startswith(f"{BOS}s") and "<tool_result>ok</tool_result>" in text and text.endswith("q<｜query｜>")


def test_invalid_mode_raises():
    with pytest.raises(ValueError, match=r"thinking_mode: 'think'"):
        encode_messages([U], "think")
    with pytest.raises(ValueError, match=r"thinking_mode"):
        parse_message_from_completion_text("x" + EOS, "fast")


# ---------------------------------------------------------------- parsing completions

def test_parse_thinking_content_and_tool_calls():
    text = (f"plan</think>Sure.\n\n<{DSML}tool_calls>\n<{DSML}invoke name=\"f\">\n"
            f"<{DSML}parameter name=\"s\" string=\"true\">a \"q\" é</{DSML}parameter>\n"
            f"<{DSML}parameter name=\"n\" string=\"false\">[1, 2]</{DSML}parameter>\n</{DSML}invoke>\n"
            f"<{DSML}invoke name=\"g\">\n\n</{DSML}invoke>\n</{DSML}tool_calls>{EOS}")
    p = parse_message_from_completion_text(text, "thinking")
    assert (p["reasoning_content"], p["content"]) == ("plan", "Sure.")
    assert [c["function"]["name"] for c in p["tool_calls"]] == ["f", "g"]
    assert json.loads(p["tool_calls"][0]["function"]["arguments"]) == {"s": 'a "q" é', "n": [1, 2]}
    assert json.loads(p["tool_calls"][1]["function"]["arguments"]) == {}
    assert parse_message_from_completion_text("Hi" + EOS, "chat") == \
        {"role": "assistant", "content": "Hi", "reasoning_content": "", "tool_calls": []}


def test_implicit_think_end_is_opt_in():
    """A tool-call block before any </think> (thinking mode): an error by default, as officially; with
    implicit_think_end=True the block ends the reasoning (docs/differences.md P4). Nothing else is relaxed."""
    block = (f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="f">\n<{DSML}parameter name="a" string="true">1'
             f'</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>{EOS}')
    with pytest.raises(ValueError, match=r"missing </think>.*implicit_think_end=True"):
        parse_message_from_completion_text("plan" + block, "thinking")
    p = parse_message_from_completion_text("plan" + block, "thinking", implicit_think_end=True)
    assert (p["reasoning_content"], p["content"]) == ("plan", "")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in p["tool_calls"]] == [("f", {"a": "1"})]
    # an explicit </think> reads the same with or without the option; chat mode ignores it
    text = "plan</think>ok" + block
    assert parse_message_from_completion_text(text, "thinking", implicit_think_end=True) == \
        parse_message_from_completion_text(text, "thinking")
    assert parse_message_from_completion_text("hi" + EOS, "chat", implicit_think_end=True)["content"] == "hi"
    for bad in ("plan" + block.lstrip("\n"), "plan" + block.replace(f"</{DSML}tool_calls>", ""), "plan" + EOS):
        with pytest.raises(ValueError):  # no blank line before the block, a cut block, no block at all
            parse_message_from_completion_text(bad, "thinking", implicit_think_end=True)



def test_truncated_completion_takes_implicit_think_end_too():
    """parse_truncated_completion reads a cut completion as parse_message_from_completion_text reads a whole one:
    by default a tool-call block before </think> is an error; with implicit_think_end=True the opener ends the
    reasoning and the markup stays raw (never parsed into calls); a cut inside the opener counts as its start.
    Nothing else is relaxed (docs/differences.md P4, P2)."""
    from dsv4.encoding import parse_truncated_completion
    cut = f'plan\n\n<{DSML}tool_calls>\n<{DSML}invoke name="f">\n<{DSML}parameter name="a" string="true">1'
    with pytest.raises(ValueError, match=r"before </think>.*implicit_think_end=True"):
        parse_truncated_completion(cut, "thinking")
    t = parse_truncated_completion(cut, "thinking", implicit_think_end=True)
    assert (t.reasoning_content, t.content, t.cut_in) == ("plan", "", "tool_calls")
    assert t.tool_calls_text == cut[len("plan\n\n<" + DSML + "tool_calls"):]
    # the whole completion, once finished, parses to the same reasoning under the same option
    whole = cut + f"</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>{EOS}"
    assert parse_message_from_completion_text(whole, "thinking", implicit_think_end=True)["reasoning_content"] == "plan"
    # a cut inside the opener, before any </think>: an error by default (｜DSML｜ in the reasoning), the block's start under the option
    piece = f"plan\n\n<{DSML}tool"
    with pytest.raises(ValueError, match="reasoning_content: unexpected special token"):
        parse_truncated_completion(piece, "thinking")
    t = parse_truncated_completion(piece, "thinking", implicit_think_end=True)
    assert (t.reasoning_content, t.content, t.tool_calls_text, t.cut_in) == ("plan", "", "", "tool_calls")
    # unchanged where the option does not apply: an explicit </think>, plain reasoning, chat mode
    for text, mode in (("plan</think>ok" + cut[4:], "thinking"), ("still thinking", "thinking"), ("hi\n\n<" + DSML + "tool", "chat")):
        assert parse_truncated_completion(text, mode, implicit_think_end=True) == parse_truncated_completion(text, mode)
    # nothing else is relaxed: no blank line before the block, or </think> inside the markup, is still an error
    for bad in (f"plan<{DSML}tool_calls>\n", cut + "</think>"):
        with pytest.raises(ValueError):
            parse_truncated_completion(bad, "thinking", implicit_think_end=True)


_CALL = f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="f">\n<{DSML}parameter name="a" string="true">1</{DSML}parameter>\n'


@pytest.mark.parametrize("text,mode,match", [
    ("no closer" + EOS, "thinking", r"reasoning_content: missing </think>"),
    ("no eos", "chat", r"missing the end-of-sentence"),
    ("a" + EOS + "tail", "chat", r"unexpected text after EOS"),
    (f"a<think>b{EOS}", "chat", r"content: unexpected special token '<think>'"),
    (_CALL + f"</{DSML}invoke>\n</{DSML}tool_calls>junk{EOS}", "chat", r"unexpected text after the tool calls"),
    (_CALL + f'<{DSML}parameter name="a" string="true">2</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>{EOS}',
     "chat", r"duplicate name 'a'"),
    (_CALL.replace('string="true"', 'string="maybe"') + f"</{DSML}invoke>\n</{DSML}tool_calls>{EOS}", "chat",
     r"parameter: malformed"),
    (f"\n\n<{DSML}tool_calls>\n<{DSML}invoke nom=\"f\">\n</{DSML}invoke>\n</{DSML}tool_calls>{EOS}", "chat",
     r"tool_calls\[0\]\.name: malformed"),
    # string="false" values are pasted into `arguments` as JSON text: a value that is not JSON (public reports of
    # clients receiving unparseable tool arguments, docs/public_bugs.md) is refused by name (difference P3)
    (_CALL.replace('string="true">1', 'string="false">ls -la') + f"</{DSML}invoke>\n</{DSML}tool_calls>{EOS}",
     "chat", r"parameter 'a': string=\"false\" value 'ls -la' is not JSON"),
    (_CALL.replace('string="true">1', 'string="false">{"p": 1') + f"</{DSML}invoke>\n</{DSML}tool_calls>{EOS}",
     "chat", r"parameter 'a': string=\"false\" value '\{\"p\": 1' is not JSON"),
    (_CALL.replace('string="true">1', 'string="false">{"p": 1, "p": 2}') +
     f"</{DSML}invoke>\n</{DSML}tool_calls>{EOS}", "chat", r"parameter 'a': string=\"false\" value .* is not JSON"),
    # NaN / Infinity: Python's json reads them, strict JSON readers (a client's) do not
    (_CALL.replace('string="true">1', 'string="false">NaN') + f"</{DSML}invoke>\n</{DSML}tool_calls>{EOS}",
     "chat", r"parameter 'a': string=\"false\" value 'NaN' is not JSON \(NaN is not a JSON value"),
    (_CALL.replace('string="true">1', 'string="false">{"p": -Infinity}') +
     f"</{DSML}invoke>\n</{DSML}tool_calls>{EOS}", "chat", r"value '\{\"p\": -Infinity\}' is not JSON"),
])
def test_parse_malformed_raises(text, mode, match):
    with pytest.raises(ValueError, match=match):
        parse_message_from_completion_text(text, mode)
