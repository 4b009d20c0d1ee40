"""Test 1 (hard stop): the prompt format.

Every gold vector (36, made by DeepSeek's official encoder, `fixtures/golden/dsv4_prompts.json`) must come out
of our encoder, the real tokenizer, `apply_chat_template` with our template, and `prompt_ids`, byte/id-exact.
Negative controls: the legacy hand-rolled prompt differs (and the diff names the extra "\\n\\n" after <｜User｜>
and the missing <think>/</think>), and a template mutated to hand-roll that newline fails the gold comparison.
"""

from __future__ import annotations

import copy

import json
from pathlib import Path

import pytest
from jinja2.exceptions import TemplateError

from dsv4.diagnose import format_template_report, hand_rolled_ids, template_diff
from dsv4.encoding import EOS, THINK_END, encode_messages, parse_message_from_completion_text, prompt_ids
from dsv4.tokenizer import load_tokenizer

pytestmark = pytest.mark.hardstop

GOLD_PATH = Path(__file__).resolve().parents[2] / "fixtures" / "golden" / "dsv4_prompts.json"
GOLD = json.loads(GOLD_PATH.read_text(encoding="utf-8"))
BY_ID = {g["id"]: g for g in GOLD}
SEED = {"thinking": BY_ID["dsv4-seed-capital-france-thinking"], "chat": BY_ID["dsv4-seed-capital-france-chat"]}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _template_kwargs(g: dict) -> dict:
    return {"thinking": g["thinking_mode"] == "thinking", **g["kwargs"]}


def test_gold_file_is_complete():
    assert len(GOLD) == 36 and len(BY_ID) == 36, f"{GOLD_PATH}: expected 36 distinct vectors, got {len(GOLD)}"
    assert sum("hand_rolled_ids" in g for g in GOLD) >= 2


@pytest.mark.parametrize("gid", sorted(BY_ID))
def test_encoder_equals_gold_prompt(gid):
    g = BY_ID[gid]
    assert encode_messages(g["messages"], g["thinking_mode"], **g["kwargs"]) == g["prompt"]


@pytest.mark.parametrize("gid", sorted(BY_ID))
def test_tokenizer_ids_equal_gold_ids(tok, gid):
    g = BY_ID[gid]
    assert tok.encode(g["prompt"], add_special_tokens=False) == g["ids"]


@pytest.mark.parametrize("gid", sorted(BY_ID))
def test_apply_chat_template_equals_gold(tok, gid):
    g = BY_ID[gid]
    kw = _template_kwargs(g)
    text = tok.apply_chat_template(g["messages"], add_generation_prompt=True, tokenize=False, **kw)
    assert text == g["prompt"]
    ids = tok.apply_chat_template(g["messages"], add_generation_prompt=True, tokenize=True, return_dict=False, **kw)
    assert list(ids) == g["ids"]


@pytest.mark.parametrize("gid", sorted(BY_ID))
def test_prompt_ids_equals_apply_chat_template(tok, gid):
    g = BY_ID[gid]
    kw = _template_kwargs(g)
    via_template = tok.apply_chat_template(g["messages"], add_generation_prompt=True, tokenize=True,
                                           return_dict=False, **kw)
    thinking = kw.pop("thinking")
    assert prompt_ids(tok, g["messages"], thinking=thinking, **kw) == list(via_template) == g["ids"]


def _assistant_turns():
    """(gold id, message index, message) for every assistant turn in the gold vectors."""
    return [(g["id"], i, m) for g in GOLD for i, m in enumerate(g["messages"]) if m["role"] == "assistant"]


@pytest.mark.parametrize("gid,index,msg", _assistant_turns(), ids=lambda v: str(v) if not isinstance(v, dict) else "")
def test_parse_round_trip(gid, index, msg):
    """The rendered assistant turn, cut out of the gold prompt, parses back to the message."""
    g = BY_ID[gid]
    calls = encode_messages([{"role": "user", "content": "x"}, {**msg, "reasoning_content": None}], "chat",
                            add_default_bos_token=False)
    body = calls.split(THINK_END, 1)[1]  # content + tool calls (+ EOS), as the gold renders it
    with_reasoning = (msg.get("reasoning_content") or "") + THINK_END + body
    if g["thinking_mode"] == "thinking" and with_reasoning in g["prompt"]:
        text, mode, reasoning = with_reasoning, "thinking", msg.get("reasoning_content") or ""
    else:
        text, mode, reasoning = body, "chat", ""
    assert text in g["prompt"], f"{gid}: assistant turn {index} not found in the gold prompt"
    if msg.get("wo_eos"):
        text += EOS  # a prefill turn has no EOS in the prompt; a finished completion does
    parsed = parse_message_from_completion_text(text, mode)
    assert parsed["content"] == (msg.get("content") or "")
    assert parsed["reasoning_content"] == reasoning
    want = msg.get("tool_calls") or []
    assert [c["function"]["name"] for c in parsed["tool_calls"]] == [c["function"]["name"] for c in want]
    assert [json.loads(c["function"]["arguments"]) for c in parsed["tool_calls"]] == \
           [json.loads(c["function"]["arguments"]) for c in want]


def test_round_trip_covers_reasoning_and_tool_calls():
    turns = _assistant_turns()
    assert any(m.get("tool_calls") for _, _, m in turns) and any(m.get("reasoning_content") for _, _, m in turns)


@pytest.mark.parametrize("mode", ["thinking", "chat"])
def test_negative_control_hand_rolled_differs(tok, mode):
    g = SEED[mode]
    prompt = g["messages"][0]["content"]
    assert hand_rolled_ids(tok, prompt) == g["hand_rolled_ids"] != g["ids"]
    d = template_diff(tok, prompt, thinking=mode == "thinking")
    assert d.differs and d.template_ids == g["ids"] and d.hand_rolled_ids == g["hand_rolled_ids"]
    assert d.template_equals_encoder and d.template_text == g["prompt"]
    closer = (128821, "<think>") if mode == "thinking" else (128822, "</think>")
    assert [(o.op, o.hand_tokens, o.template_tokens) for o in d.ops] == [
        ("delete", [(271, "\n\n")], []),
        ("insert", [], [closer]),
    ]
    assert d.ops[0].hand_span == (2, 3) and d.ops[1].template_span == (10, 11)
    assert d.ops[0].description == 'extra in hand-rolled: "\\n\\n" (id 271) after "<｜User｜>"'
    assert d.ops[1].description == f'missing from hand-rolled: "{closer[1]}" (id {closer[0]}) at the end'


def test_every_single_turn_gold_hand_rolled_differs(tok):
    single = [g for g in GOLD if "hand_rolled_ids" in g and not g["kwargs"].get("reasoning_effort")
              and g["kwargs"].get("add_default_bos_token", True)]
    assert len(single) >= 8
    for g in single:
        assert hand_rolled_ids(tok, g["messages"][0]["content"]) == g["hand_rolled_ids"], g["id"]
        assert g["hand_rolled_ids"] != g["ids"], g["id"]


def test_mutated_template_fails_gold(tok):
    """The gold comparison catches the legacy bug when it sits in the template itself."""
    tmpl = tok.chat_template
    needle = "USER ~ (parts.l|join('\\n\\n')"
    assert tmpl.count(needle) == 1
    g = SEED["thinking"]
    mutated = copy.copy(tok)  # apply_chat_template(chat_template=...) is refused: the template attribute is swapped
    mutated.chat_template = tmpl.replace(needle, "USER ~ '\\n\\n' ~ (parts.l|join('\\n\\n')")
    bad = mutated.apply_chat_template(g["messages"], add_generation_prompt=True, tokenize=True, return_dict=False,
                                      thinking=True)
    assert tok.chat_template == tmpl
    assert list(bad) != g["ids"] and list(bad)[:3] == [0, 128803, 271]


def test_report_names_the_differences_and_the_source(tok):
    d = template_diff(tok, "What is the capital of France?", thinking=True)
    text = format_template_report(d)
    assert 'extra in hand-rolled: "\\n\\n" (id 271) after "<｜User｜>"' in text
    assert 'missing from hand-rolled: "<think>" (id 128821) at the end' in text
    assert "dsv4/chat_template.jinja" in text and text.endswith("differs as listed above")
    assert json.loads(json.dumps(d.to_json()))["differs"] is True


def test_report_does_not_hide_special_strings_in_the_prompt(tok):
    d = template_diff(tok, "hi <｜Assistant｜> there", thinking=False)
    assert d.special_in_prompt == ["<｜Assistant｜>"] and d.template_ids.count(128804) == 2
    assert "WARNING: the prompt contains special strings ['<｜Assistant｜>']" in format_template_report(d)


def test_enable_thinking_is_refused_not_ignored(tok):
    msgs = SEED["chat"]["messages"]
    with pytest.raises(TemplateError, match=r"enable_thinking: not a variable of the dsv4 template.*use thinking="):
        tok.apply_chat_template(msgs, enable_thinking=False, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(msgs, thinking=False, add_generation_prompt=True, tokenize=False) == \
        SEED["chat"]["prompt"]


BARE = [{"name": "f", "parameters": {"type": "object"}}]  # the function schema without the OpenAI wrapper


def test_tools_kwarg_shape_is_checked(tok):
    msgs = SEED["thinking"]["messages"]
    with pytest.raises(TemplateError, match=r'^tools\[0\]: expected \{"type": "function", "function": \{"name": str, '
                                            r'.*\(the OpenAI tool shape\), got keys \["name", "parameters"\]$'):
        tok.apply_chat_template(msgs, tools=BARE, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("tools", [BARE, [{"type": "function", "function": {"name": 5}}], [{"function": "f"}],
                                   {"type": "function"}, "f"], ids=["bare", "name_int", "fn_str", "dict", "str"])
def test_message_tools_shape_same_error_in_template_and_encoder(tok, tools):
    msgs = [{"role": "system", "content": "", "tools": tools}, *SEED["thinking"]["messages"]]
    with pytest.raises(ValueError) as enc:
        encode_messages(msgs, "thinking")
    with pytest.raises(TemplateError) as tmpl:
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert str(enc.value) == str(tmpl.value) and str(enc.value).startswith("messages[0].tools")



U = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("content", [b"hi", bytearray(b"hi")])
def test_bytes_content_is_refused_on_every_path(tok, content):
    """Bytes content used to reach the template, which rendered the literal text "<bytes>" in place of the user's
    words (no error). Every prompt path refuses it naming the message and field."""
    msgs = [{"role": "user", "content": content}]
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content: expected a string, got (bytes|bytearray)"):
        prompt_ids(tok, msgs)
    with pytest.raises(ValueError, match=r"^conversation\[0\]\.content: expected a string, got (bytes|bytearray)"):
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content: expected a string"):
        encode_messages(msgs, "thinking")
    assert tok.decode(prompt_ids(tok, U)).endswith("hi<｜Assistant｜><think>")  # control: a str goes through


def test_apply_chat_template_refuses_a_misspelled_keyword(tok):
    """transformers hands unknown keywords to the template, which ignored them: `reasoning_efort="max"` gave the
    default prompt without the maximum-effort preamble. Now an error naming the keyword; the right spelling
    still adds the preamble (control)."""
    with pytest.raises(ValueError, match=r"unknown keyword argument\(s\) 'reasoning_efort'"):
        tok.apply_chat_template(U, reasoning_efort="max", add_generation_prompt=True, tokenize=False)
    good = tok.apply_chat_template(U, reasoning_effort="max", add_generation_prompt=True, tokenize=False)
    plain = tok.apply_chat_template(U, add_generation_prompt=True, tokenize=False)
    assert good != plain and len(good) > len(plain)


def test_apply_chat_template_refuses_documents(tok):
    """`documents=` (transformers' RAG slot) reached the template, which has no place for it and dropped the
    documents without a word: the prompt was the one without them. Now an error; `documents=None` (transformers'
    default) goes through (control)."""
    docs = [{"title": "t", "text": "the answer is 42"}]
    with pytest.raises(ValueError, match=r"documents= is not part of the DeepSeek-V4 prompt format"):
        tok.apply_chat_template(U, documents=docs, add_generation_prompt=True, tokenize=False)
    for empty in (None, []):  # carry nothing
        assert tok.apply_chat_template(U, documents=empty, add_generation_prompt=True, tokenize=False) == \
            tok.apply_chat_template(U, add_generation_prompt=True, tokenize=False)


SWITCHES = [("drop_thinking", "no"), ("add_default_bos_token", 0), ("add_generation_prompt", "no"), ("thinking", None)]


@pytest.mark.parametrize("call,flag,value", [(c, f, v) for c in ("prompt_ids", "apply_chat_template", "encode_messages")
                                             for f, v in SWITCHES if c != "encode_messages" or f in
                                             ("drop_thinking", "add_default_bos_token")])  # encode_messages' two
def test_prompt_switches_must_be_bools(tok, call, flag, value):
    """A switch given as "no", 0 or None was read by its truth ("no" -> True, thinking=None -> thinking mode):
    each is refused naming the switch; True / False go through."""
    # two turns with reasoning, so that drop_thinking changes the prompt too
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"},
            {"role": "user", "content": "c"}]
    run = {"prompt_ids": lambda **kw: prompt_ids(tok, conv, **kw),
           "apply_chat_template": lambda **kw: tok.apply_chat_template(conv, tokenize=False,
                                                                       **{"add_generation_prompt": True, **kw}),
           "encode_messages": lambda **kw: encode_messages(conv, "thinking", **kw)}[call]
    with pytest.raises(ValueError, match=rf"^{flag}: expected a bool"):
        run(**{flag: value})
    assert run(**{flag: False}) != run(**{flag: True})  # control: the switch matters here


@pytest.mark.parametrize("field,value", [("wo_eos", "no"), ("reasoning_content", 0), ("reasoning_content", [])])
def test_message_fields_of_the_wrong_type_are_refused(tok, field, value):
    """`wo_eos: "no"` dropped the EOS and `reasoning_content: 0` / `[]` passed as empty text: each is refused
    naming the message index and field, on the template path and the official encoder's."""
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", field: value},
            {"role": "user", "content": "c"}]
    with pytest.raises(ValueError, match=rf"^messages\[1\]\.{field}: expected a"):
        prompt_ids(tok, msgs)
    with pytest.raises(ValueError, match=rf"^messages\[1\]\.{field}: expected a"):
        encode_messages(msgs, "thinking")


@pytest.mark.parametrize("calls", [{"function": {"name": "f", "arguments": "{}"}}, "f"])
def test_tool_calls_that_are_not_a_list_are_named_as_such(tok, calls):
    """A single tool call given as a dict (or a string) was iterated by keys / characters, so the error blamed
    `tool_calls[0]` = 'function' / 'f'; it now says that a list was expected, on every prompt path."""
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    want = rf"messages\[1\]\.tool_calls: expected a list of tool calls, got {type(calls).__name__}$"
    with pytest.raises(ValueError, match="^" + want):
        encode_messages(msgs, "chat")
    with pytest.raises(ValueError, match="^" + want):
        prompt_ids(tok, msgs)
    with pytest.raises(ValueError, match="^conversation" + want[len("messages"):]):
        tok.apply_chat_template(msgs, tokenize=False)


def test_apply_chat_template_leaves_non_dict_messages_to_transformers(tok):
    """The field checks apply to dict messages only: transformers normalises its other message forms (a dataclass
    here) itself, and a wo_eos of None (a key transformers drops) is not an error."""
    import dataclasses

    @dataclasses.dataclass
    class Msg:
        role: str
        content: str

    want = tok.apply_chat_template(U, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template([Msg("user", "hi")], add_generation_prompt=True, tokenize=False) == want
    assert prompt_ids(tok, [{"role": "user", "content": "hi", "wo_eos": None}]) == prompt_ids(tok, U)


@pytest.mark.parametrize("tools", ["get_weather", {"type": "function", "function": {"name": "f"}}])
def test_tools_that_are_not_a_list_are_refused_naming_tools(tok, tools):
    """A tools string or single dict reached transformers, whose error named no argument."""
    with pytest.raises(ValueError, match=rf"^tools: expected a list of OpenAI tool dicts .* got {type(tools).__name__}$"):
        prompt_ids(tok, U, tools=tools)
    with pytest.raises(ValueError, match=r"^tools: expected a list"):
        tok.apply_chat_template(U, tools=tools, add_generation_prompt=True, tokenize=False)
