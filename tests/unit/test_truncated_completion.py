"""Completions cut by a token limit get a partial result, distinct from malformed text; the strict tool-call
parsing where the official parser is lenient by accident (each case documented in dsv4/encoding.py); and the
empty conversation, one named error in all three prompt entry points."""

from __future__ import annotations

import pytest

from dsv4.cli import main
from dsv4.encoding import (BOS, DSML, EOS, EmptyConversationError, TruncatedCompletion, encode_messages,
                           parse_message_from_completion_text, parse_truncated_completion, prompt_ids)
from dsv4.tokenizer import load_tokenizer

P_A = f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>'
P_B = f'<{DSML}parameter name="days" string="false">3</{DSML}parameter>'
BLOCK = (f"\n\n<{DSML}tool_calls>\n<{DSML}invoke name=\"weather\">\n{P_A}\n{P_B}\n</{DSML}invoke>\n"
         f"</{DSML}tool_calls>")
FULL = "plan</think>Let me look." + BLOCK


def test_the_full_block_parses():
    msg = parse_message_from_completion_text(FULL + EOS, "thinking")
    assert msg["tool_calls"] == [{"type": "function", "function": {"name": "weather",
                                                                    "arguments": '{"city": "Paris", "days": 3}'}}]


def _cut_after(piece: str, occurrence_end: bool = True) -> str:
    return FULL[:FULL.index(piece) + (len(piece) if occurrence_end else 0)]


# (name, text, what the official parser returns for it, the strict error dsv4 raises)
CASES = [
    ("block complete without EOS", FULL, "the call, as if the turn had ended",
     "missing the end-of-sentence token"),
    ("cut after the block opener", _cut_after(f"<{DSML}tool_calls"), "the message with no tool calls",
     "the text ends inside the tool-call block"),
    ("cut inside an invoke (after its header)", _cut_after('name="weather">\n'), "a call with no arguments",
     r"tool_calls\[0\]: missing '</｜DSML｜invoke'"),
    ("cut after a parameter", _cut_after(P_A + "\n"), "the call with only city (days missing)",
     r"tool_calls\[0\]: missing '</｜DSML｜invoke'"),
]


@pytest.mark.parametrize("name,text,official,error", CASES, ids=[c[0] for c in CASES])
def test_tool_call_block_cut_or_without_eos(name, text, official, error):
    # strict: never a (partial) tool call from an unfinished block (official: returns {official})
    with pytest.raises(ValueError, match=error):
        parse_message_from_completion_text(text, "thinking")
    # the same text, known to be cut by the token limit: a partial result, never a call
    t = parse_truncated_completion(text, "thinking")
    assert t == TruncatedCompletion("plan", "Let me look.", text[text.index("\n\n<") + len(f"\n\n<{DSML}tool_calls"):],
                                    "tool_calls", t.reason)
    assert not hasattr(t, "tool_calls")


@pytest.mark.parametrize("text,mode,want", [
    ("I think the capi", "thinking", TruncatedCompletion("I think the capi", "", "", "reasoning_content", "r")),
    ("plan</think>The capital is Par", "thinking", TruncatedCompletion("plan", "The capital is Par", "", "content", "r")),
    ("The capital is Par", "chat", TruncatedCompletion("", "The capital is Par", "", "content", "r")),
    (f"plan</think>Let me look.\n\n<{DSML}tool", "thinking",  # cut inside the opener itself
     TruncatedCompletion("plan", "Let me look.", "", "tool_calls", "r")),
    ("plan</think>ends with a blank line\n\n<", "thinking",  # not yet recognisable as the opener: content
     TruncatedCompletion("plan", "ends with a blank line\n\n<", "", "content", "r")),
])
def test_partial_result_says_what_was_generated_and_where_it_was_cut(text, mode, want):
    assert parse_truncated_completion(text, mode, reason="r") == want


@pytest.mark.parametrize("text,mode,match", [
    (f"plan</think>done{EOS}", "thinking", "holds the end-of-sentence token, so it is not truncated"),
    (f"pl{BOS}an", "thinking", r"reasoning_content: unexpected special token"),
    (f"plan</think>a<think>b", "thinking", r"content: unexpected special token '<think>'"),
    (f"plan\n\n<{DSML}tool_calls>\n", "thinking", "tool calls before </think>"),
    ("plan</think>x" + BLOCK + "junk", "thinking", "unexpected text after the tool calls"),
    ("x" + BLOCK.replace("Paris", "Pa</think>ris"), "chat", r"tool_calls: unexpected special token '</think>'"),
    ("x", "fast", "thinking_mode"),
])
def test_malformed_before_the_cut_is_still_an_error(text, mode, match):
    with pytest.raises(ValueError, match=match):
        parse_truncated_completion(text, mode)


# ---------------------------------------------------------------- generate on the tiny checkpoint

@pytest.fixture(scope="module")
def model_tok(tiny_ckpt):
    from dsv4.generate import load_model

    model, _ = load_model(tiny_ckpt, progress=False)
    return model, load_tokenizer(tiny_ckpt)


@pytest.mark.parametrize("thinking", [True, False])
def test_generate_cut_by_max_tokens_is_truncated_not_malformed(model_tok, thinking):
    from dsv4.generate import generate

    model, tok = model_tok
    res = generate(model, tok, [{"role": "user", "content": "What is the capital of France?"}], max_tokens=4,
                   thinking=thinking)
    assert res.stop == "max_tokens" and len(res.ids) == 4  # the tiny random model does not stop at 4 tokens
    assert res.message is None and res.parse_error is None
    t = res.truncated
    assert t.reason == "max_tokens=4 reached before the end-of-sentence token"
    assert t == parse_truncated_completion(res.text, "thinking" if thinking else "chat", reason=t.reason)
    assert t.reasoning_content + ("</think>" if t.cut_in != "reasoning_content" and thinking else "") + t.content \
        in res.text


def test_generate_cli_reports_a_partial_result(tiny_ckpt, capsys):
    assert main(["generate", "--ckpt", str(tiny_ckpt), "--prompt", "Hi", "--max-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "truncated (not malformed): max_tokens=3 reached before the end-of-sentence token" in err
    assert "did not parse" not in err and "missing </think>" not in err


def test_generate_at_eos_still_parses_strictly(model_tok, monkeypatch):
    """An EOS-terminated text goes through the strict parser (a malformed one is reported as malformed)."""
    import dsv4.generate as g
    from dsv4.generate import generate

    model, tok = model_tok
    real = g.sample
    monkeypatch.setattr(g, "sample", lambda logits, t, gen=None: real(logits, t, gen) * 0 + model.args.eos_token_id)
    res = generate(model, tok, [{"role": "user", "content": "Hi"}], max_tokens=4, thinking=True)
    assert res.stop == "eos" and res.truncated is None and res.message is None
    assert "missing </think>" in res.parse_error


# ---------------------------------------------------------------- the empty conversation

def test_empty_conversation_same_error_everywhere():
    tok = load_tokenizer()
    errors = []
    for call in (lambda: encode_messages([], "thinking"), lambda: encode_messages([], "chat", context=[]),
                 lambda: tok.apply_chat_template([], tokenize=False, add_generation_prompt=True),
                 lambda: tok.apply_chat_template([], tokenize=True), lambda: prompt_ids(tok, []),
                 lambda: prompt_ids(tok, [], thinking=False)):
        with pytest.raises(EmptyConversationError) as e:
            call()
        errors.append(str(e.value))
    assert len(set(errors)) == 1 and errors[0].startswith("messages: empty conversation")
    assert isinstance(EmptyConversationError(), ValueError)
    # one message is enough, and all three still agree on it
    one = [{"role": "user", "content": "Hi"}]
    assert prompt_ids(tok, one) == tok.encode(encode_messages(one, "thinking"), add_special_tokens=False) == \
        tok.apply_chat_template(one, tokenize=True, add_generation_prompt=True, return_dict=False)
