"""dsv4.tokenizer and the chat template on inputs of our own: the template (run by transformers'
sandboxed Jinja through `apply_chat_template`) must equal `encode_messages` on edge cases — special-token
strings in user text, CJK/emoji, empty contents, long multi-turn tool conversations, JSON argument corner
cases, seeded random conversations — and `tools=` / `add_generation_prompt=False` must mean what is documented."""

from __future__ import annotations

import json
import random
import re
import shutil

import pytest
from transformers import PreTrainedTokenizerFast

from dsv4.encoding import ASSISTANT, BOS, USER, encode_messages, prompt_ids
from dsv4.tokenizer import TEMPLATE_NAME, chat_template_text, load_tokenizer, packaged_tokenizer_dir

TOOLS = [{"type": "function", "function": {"name": "get", "description": "Fetch ü 中",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def both(tok, msgs, thinking=True, **kw):
    """(encoder string, template string, template ids == encode(encoder string))."""
    enc = encode_messages(msgs, "thinking" if thinking else "chat", **kw)
    tmpl = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, thinking=thinking, **kw)
    ids = prompt_ids(tok, msgs, thinking=thinking, **kw)
    assert ids == tok.encode(enc, add_special_tokens=False)
    return enc, tmpl


# ---------------------------------------------------------------- loader

def test_packaged_tokenizer_is_fast_with_our_template(tok):
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok.chat_template == chat_template_text()
    src = tok.dsv4_template_source
    assert src.template == TEMPLATE_NAME and src.ignored == () and src.tokenizer_dir == str(packaged_tokenizer_dir())
    assert tok.convert_tokens_to_ids([BOS, USER, ASSISTANT, "<think>", "</think>"]) == [0, 128803, 128804, 128821, 128822]
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)  # no BOS added


def test_checkpoint_template_is_ignored_and_said(tmp_path, caplog):
    src = packaged_tokenizer_dir()
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["chat_template"] = "{{ 'THEIRS' }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    (tmp_path / "chat_template.jinja").write_text("{{ 'THEIRS2' }}", encoding="utf-8")
    with caplog.at_level("WARNING", logger="dsv4.tokenizer"):
        t = load_tokenizer(tmp_path)
    assert t.dsv4_template_source.ignored == ("tokenizer_config.json:chat_template", "chat_template.jinja")
    assert "ignored" in caplog.text and "THEIRS" not in t.apply_chat_template([{"role": "user", "content": "x"}],
                                                                                tokenize=False)


def test_missing_files_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("fname,text,match", [
    ("tokenizer.json", "{}", r"tokenizer.json: expected a HF tokenizers file with an 'added_tokens' list"),
    ("tokenizer.json", "[]", r"tokenizer.json: top level is a JSON list, expected a JSON object"),
    ("tokenizer.json", "{", r"tokenizer.json: not valid JSON"),
    ("tokenizer.json", '{"added_tokens": [], "model": {"type": 3}}',
     r"could not build a tokenizer from tokenizer.json \+ tokenizer_config.json \(Exception: "),
    ("tokenizer_config.json", "[]", r"tokenizer_config.json: top level is a JSON list, expected a JSON object"),
    ("tokenizer_config.json", '{"model_max_length": "x"}', r"cannot encode .*\(TypeError: "),
], ids=["tj_empty", "tj_list", "tj_broken", "tj_bad_model", "tc_list", "tc_max_len_str"])
def test_broken_tokenizer_files_raise_value_error_naming_the_file(tmp_path, fname, text, match):
    src = packaged_tokenizer_dir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, tmp_path / f)
    (tmp_path / fname).write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path))}.*{match}"):
        load_tokenizer(tmp_path)


def test_prompt_ids_refuses_a_tokenizer_without_our_template(tok):
    plain = PreTrainedTokenizerFast.from_pretrained(str(packaged_tokenizer_dir()))
    with pytest.raises(ValueError, match="no dsv4 chat template"):
        prompt_ids(plain, [{"role": "user", "content": "x"}])


# ---------------------------------------------------------------- template == encoder on our own inputs

@pytest.mark.parametrize("thinking", [True, False])
def test_special_strings_in_user_text_become_special_ids(tok, thinking):
    msgs = [{"role": "user", "content": f"a {USER} b </think> <｜end▁of▁sentence｜>"}]
    enc, tmpl = both(tok, msgs, thinking)
    assert enc == tmpl
    ids = prompt_ids(tok, msgs, thinking=thinking)
    assert ids.count(128803) == 2 and 128822 in ids[:-1] and 1 in ids  # forged turn markers are NOT escaped
    safe = prompt_ids(tok, msgs, thinking=thinking, sanitize_control_tokens=True)  # transformers' opt-in escape
    assert safe.count(128803) == 1 and 1 not in safe


@pytest.mark.parametrize("content", ["请用两句话介绍苏州园林 🍜✨👨‍👩‍👧", "", " \n\t ", "ñ" * 300, "\u200b\u2028x\x7f"])
@pytest.mark.parametrize("thinking", [True, False])
def test_unicode_and_empty_contents(tok, content, thinking):
    msgs = [{"role": "system", "content": content}, {"role": "user", "content": content},
            {"role": "assistant", "content": content, "reasoning_content": content}, {"role": "user", "content": content}]
    enc, tmpl = both(tok, msgs, thinking)
    assert enc == tmpl


def _long_tool_conversation(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You route requests.", "tools": TOOLS}]
    for t in range(turns):
        ids = [f"c{t}_{k}" for k in range(3)]
        msgs.append({"role": "user", "content": f"turn {t}: 查一下 {t} 🌧"})
        msgs.append({"role": "assistant", "content": "", "reasoning_content": f"r{t}",
                     "tool_calls": [{"id": i, "type": "function",
                                     "function": {"name": "get", "arguments": json.dumps({"q": i, "n": [t, 1.5]})}}
                                    for i in ids]})
        msgs += [{"role": "tool", "tool_call_id": i, "content": f"result {i}"} for i in reversed(ids)]
        msgs.append({"role": "assistant", "content": f"done {t}", "reasoning_content": f"s{t}"})
    return msgs + [{"role": "user", "content": "summarise"}]


@pytest.mark.parametrize("thinking", [True, False])
def test_long_multi_turn_tool_conversation(tok, thinking):
    msgs = _long_tool_conversation(25)
    enc, tmpl = both(tok, msgs, thinking)
    assert enc == tmpl and len(tok.encode(enc, add_special_tokens=False)) > 3000
    assert enc.index("result c3_0") < enc.index("result c3_1") < enc.index("result c3_2")  # reordered by call order


ARGS = ['{"a":1.50,"b":1e5,"c":-0,"d":1E400,"e":NaN,"f":-Infinity,"g":12345678901234567890123,"h":-0.0}',
        '{"s":"x\\ny\\t\\"q\\" \\\\ \\/ \\u00e9 \\u4e2d \\ud83c\\udf5c \\u0001 \\b\\f\\r"}',
        '{"n":{"s":"\\u0001\\u00e9\\ud83c\\udf5c","l":[1,2.0,{"k":"v"},[],{}],"t":true,"z":null}}',
        ' \n{ "a" : [ 1 , 2 ] , "b" : { } }\t', '{"k\\"q":"v","中文":"值 🍜"}', '{"a":1e-400,"b":0.1,"c":1e22}',
        '[1,2]', '5', '"str"', '', '{', '{"a":1,}', '{"a":01}', '{"a":1.}', '{"a":"x\ny"}', '{"a":tru}',
        '{"a":1}x', '{"a":"\\x"}', '{"a":"\\u12"}', '{}', '{"a":1 "b":2}', '{"a":-}',
        {"a": 1, "b": [1, "x", {"c": None}], "s": "raw\nstr"}]


@pytest.mark.parametrize("args", ARGS, ids=[f"args{i}" for i in range(len(ARGS))])
def test_tool_call_arguments_corner_cases(tok, args):
    msgs = [{"role": "system", "content": "", "tools": TOOLS}, {"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "type": "function",
                                                                 "function": {"name": "get", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "a", "content": "ok"}]
    enc, tmpl = both(tok, msgs)
    assert enc == tmpl


def test_duplicate_argument_keys_raise_in_both(tok):
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get", "arguments": '{"x":{"k":1,"k":2}}'}}]}]
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: duplicate key"):
        encode_messages(msgs, "chat")
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: duplicate key"):
        prompt_ids(tok, msgs)


@pytest.mark.parametrize("msgs,kw,match", [
    ([{"role": "bot", "content": "x"}], {}, r"messages\[0\]\.role"),
    ([{"role": "user", "content": "x", "task": "nope"}], {}, r"messages\[0\]\.task"),
    ([{"role": "user", "content": "x"}, {"role": "developer", "content": ""}], {}, r"messages\[1\]\.content"),
    ([{"role": "user", "content": "x"}], {"reasoning_effort": "low"}, r"reasoning_effort"),
])
def test_template_errors_name_index_and_field(tok, msgs, kw, match):
    with pytest.raises(ValueError, match=match):
        prompt_ids(tok, msgs, **kw)


@pytest.mark.parametrize("msgs,match", [
    ([{"role": "user", "contents": "What is 2+2?"}], r"\[0\]: unknown key 'contents' \(did you mean 'content'\?\); "
     r"a message accepts only the keys role, content, "),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning_contnet": "z"}],
     r"\[1\]: unknown key 'reasoning_contnet'"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning_content": "w",
                                           "reasoning": "z"}],
     r"\[1\]: the reasoning is given twice with different values, under 'reasoning_content' and 'reasoning'"),
    ([{"role": "user"}], r"\[0\]\.content: missing \(no 'content' key\)"),
])
def test_message_keys_and_content_refused_alike(tok, msgs, match):
    """encode_messages, prompt_ids and apply_chat_template refuse a misspelled message key and a missing content
    alike (the template would render an empty turn); an assistant message with tool calls may omit content."""
    with pytest.raises(ValueError, match="messages" + match):
        encode_messages(msgs, "thinking")
    with pytest.raises(ValueError, match="messages" + match):
        prompt_ids(tok, msgs)
    with pytest.raises(ValueError, match="conversation" + match):
        tok.apply_chat_template(msgs, tokenize=False)
    ok = [{"role": "user", "content": ""}, {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "name": "get", "content": "r"}]
    enc, tmpl = both(tok, ok)
    assert enc == tmpl and "<tool_result>r</tool_result>" in enc


def test_apply_chat_template_refuses_another_template_and_truncation(tok):
    """Our template is always the one rendered, and a truncated prompt (which loses <｜Assistant｜><think>) is refused;
    transformers' other arguments keep working."""
    msgs = [{"role": "user", "content": "hello there"}]
    with pytest.raises(ValueError, match=r"apply_chat_template: chat_template=\"\{\{ 'X' \}\}\" is refused: this "
                       r"tokenizer always renders the dsv4 template \(dsv4/chat_template\.jinja"):
        tok.apply_chat_template(msgs, chat_template="{{ 'X' }}", tokenize=False)
    for kw in ({"truncation": True, "max_length": 3}, {"truncation": "longest_first", "max_length": 3},
               {"tokenizer_kwargs": {"truncation": True, "max_length": 3}}):
        with pytest.raises(ValueError, match=r"truncation=('longest_first'|True) is refused: a truncated prompt is a "
                           r"wrong prompt .*shorten the messages instead"):
            tok.apply_chat_template(msgs, add_generation_prompt=True, **kw)
    full = prompt_ids(tok, msgs)
    assert full[-2:] == [128804, 128821] and len(full) > 3
    for kw in ({}, {"truncation": False}, {"max_length": 3}, {"chat_template": None}, {"padding": "max_length",
                                                                                      "max_length": len(full)},
               {"chat_template": tok.chat_template}):  # its own template, passed explicitly (lm-eval, vLLM do)
        enc = tok.apply_chat_template(msgs, add_generation_prompt=True, **kw)
        assert enc["input_ids"] == full, kw


def _random_conversation(rng: random.Random) -> list[dict]:
    msgs = []
    for _ in range(rng.randint(1, 8)):
        role = rng.choice(["system", "user", "user", "developer", "assistant", "assistant", "tool", "latest_reminder"])
        m = {"role": role, "content": rng.choice(["", "hi", "你好 🍜", "a\n\nb", "<think>x"])}
        if role == "developer":
            m["content"] = "dev"
        if role == "system" and rng.random() < 0.3:
            m["tools"] = TOOLS
        if role == "assistant":
            m["reasoning_content"] = rng.choice(["", "r", None])
            if rng.random() < 0.5:
                m["tool_calls"] = [{"id": rng.choice("abc"), "type": "function", "function": {
                    "name": "get", "arguments": rng.choice(['{"q":"1"}', '{"n":[1, 2]}', "bad", {"z": 1}])}}
                    for _ in range(rng.randint(1, 3))]
            m["wo_eos"] = rng.random() < 0.1
        if role == "tool":
            m["tool_call_id"] = rng.choice("abcz")
        if role == "user" and rng.random() < 0.1:
            m["task"] = rng.choice(["action", "query"])
        msgs.append(m)
    return msgs


@pytest.mark.parametrize("seed", range(4))
def test_random_conversations(tok, seed):
    rng = random.Random(seed)
    for _ in range(60):
        msgs = _random_conversation(rng)
        kw = {"drop_thinking": rng.random() < 0.7, "reasoning_effort": rng.choice([None, "high", "max"])}
        if rng.random() < 0.3:
            kw["context"] = _random_conversation(rng)
        enc, tmpl = both(tok, msgs, rng.random() < 0.5, **kw)
        assert enc == tmpl, (msgs, kw)


# ---------------------------------------------------------------- documented template arguments

def test_hf_tools_attach_to_system_or_a_new_first_system(tok):
    sys_msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    want = encode_messages([{**sys_msgs[0], "tools": TOOLS}, sys_msgs[1]], "thinking")
    assert tok.apply_chat_template(sys_msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True) == want
    no_sys = [{"role": "user", "content": "q"}]
    want = encode_messages([{"role": "system", "content": "", "tools": TOOLS}] + no_sys, "thinking")
    assert tok.apply_chat_template(no_sys, tools=TOOLS, tokenize=False, add_generation_prompt=True) == want
    assert prompt_ids(tok, no_sys, tools=TOOLS) == tok.encode(want, add_special_tokens=False)
    with pytest.raises(ValueError, match="tools: given both"):
        prompt_ids(tok, [{**sys_msgs[0], "tools": TOOLS}, sys_msgs[1]], tools=TOOLS)
    with pytest.raises(ValueError, match="tools: cannot be combined with context"):
        prompt_ids(tok, no_sys, tools=TOOLS, context=sys_msgs)


@pytest.mark.parametrize("thinking,suffix", [(True, ASSISTANT + "<think>"), (False, ASSISTANT + "</think>")])
def test_add_generation_prompt_false_drops_the_final_transition(tok, thinking, suffix):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    full = encode_messages(msgs, "thinking" if thinking else "chat")
    bare = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, thinking=thinking)
    assert full == bare + suffix
    done = msgs[:2]  # ending in an assistant turn there is no transition to drop
    assert tok.apply_chat_template(done, tokenize=False, add_generation_prompt=False, thinking=thinking) == \
        encode_messages(done, "thinking" if thinking else "chat")


def test_thinking_defaults_to_true_and_must_be_bool(tok):
    msgs = [{"role": "user", "content": "q"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True).endswith("<think>")
    with pytest.raises(ValueError, match="thinking: expected a bool"):
        prompt_ids(tok, msgs, thinking="yes")


@pytest.mark.parametrize("kw,match", [
    ({"reasoning_efort": "max"}, r"unknown keyword argument\(s\) 'reasoning_efort' \(did you mean 'reasoning_effort'"),
    ({"enable_thinking": False}, r"'enable_thinking' \(did you mean thinking=True/False"),
    ({"tokenize": False, "zzz": 1}, r"'tokenize', 'zzz'; accepted: thinking, reasoning_effort, drop_thinking, "
                                    r"context, add_default_bos_token, tools, add_generation_prompt"),
], ids=["typo", "enable_thinking", "two"])
def test_prompt_ids_rejects_unknown_keywords(tok, kw, match):
    msgs = [{"role": "user", "content": "q"}]
    with pytest.raises(ValueError, match=match):
        prompt_ids(tok, msgs, **kw)
    assert prompt_ids(tok, msgs, reasoning_effort="max") != prompt_ids(tok, msgs)  # the spelled-out one acts



def test_review_of_the_message_checks_legitimate_inputs_still_render(tok):
    """Inputs a first version of the message checks refused wrongly, each rendered alike by encode_messages,
    prompt_ids and apply_chat_template: a system message carrying only tools (no content key: a system turn has no
    wrapper, so it is the prompt with content ""); transformers' `thinking` / `reasoning` keys, read as
    `reasoning_content` (transformers' own reading: `_alias_reasoning_fields`); two different reasonings are an
    error, the same one under two keys is not."""
    sys_tools = [{"role": "system", "tools": TOOLS}, {"role": "user", "content": "hi"}]
    enc, tmpl = both(tok, sys_tools)
    assert enc == tmpl == both(tok, [{**sys_tools[0], "content": ""}, sys_tools[1]])[0] and "## Tools" in enc
    assert prompt_ids(tok, sys_tools) == tok.encode(enc, add_special_tokens=False)
    turn = [{"role": "user", "content": "a"}, None, {"role": "user", "content": "b"}]
    want = encode_messages([turn[0], {"role": "assistant", "content": "x", "reasoning_content": "hmm"}, turn[2]],
                           "thinking", drop_thinking=False)
    assert "<think>hmm</think>x" in want
    for key in ("thinking", "reasoning"):
        msgs = [turn[0], {"role": "assistant", "content": "x", key: "hmm"}, turn[2]]
        assert encode_messages(msgs, "thinking", drop_thinking=False) == want, key
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, drop_thinking=False) == want
        assert prompt_ids(tok, msgs, drop_thinking=False) == tok.encode(want, add_special_tokens=False)
        assert msgs[1] == {"role": "assistant", "content": "x", key: "hmm"}  # the caller's dict untouched
    same = [turn[0], {"role": "assistant", "content": "x", "reasoning_content": "hmm", "thinking": "hmm"}, turn[2]]
    assert encode_messages(same, "thinking", drop_thinking=False) == want
    bad = [turn[0], {"role": "assistant", "content": "x", "reasoning_content": "hmm", "thinking": "other"}, turn[2]]
    with pytest.raises(ValueError, match=r"messages\[1\]: the reasoning is given twice with different values, "
                                         r"under 'reasoning_content' and 'thinking'"):
        encode_messages(bad, "thinking")
    with pytest.raises(ValueError, match=r"conversation\[1\]: the reasoning is given twice"):
        tok.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ValueError, match=r"messages\[1\]\.reasoning: expected a string"):
        encode_messages([turn[0], {"role": "assistant", "content": "x", "reasoning": 5}], "thinking")
