"""HF-style `tools=` of the chat template (issue 17): where the tools land is pinned against the official encoder.

The 36 gold vectors come from DeepSeek's encoder, which has no `tools=` keyword (tools ride on a system message),
so they say nothing about where `apply_chat_template(messages, tools=T)` puts T. dsv4 documents it (README, the
template header, `dsv4.tokenizer`): T is attached to `messages[0]` when that is a system message, else to a new
empty system message put FIRST. This test pins exactly that: the template with `tools=T` equals
`encode_messages` of the same conversation with T on that system message, character for character and id for
id, with and without a system message, single and multi-turn, in both modes. A template that puts the new
system message anywhere else (or attaches T elsewhere) renders another string.
"""

from __future__ import annotations

import pytest

from dsv4.encoding import encode_messages, prompt_ids
from dsv4.tokenizer import load_tokenizer

pytestmark = pytest.mark.hardstop  # the template's tools= placement (kills hf_tools_misplaced)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "now", "description": "Current time", "parameters": {}}}]

CONVERSATIONS = {
    "no_system": [{"role": "user", "content": "Weather in Paris?"}],
    "no_system_multi": [{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
                        {"role": "user", "content": "Weather in Paris?"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}],
    "system_multi": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
                     {"role": "user", "content": "Time?"}],
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def documented_placement(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The documented rule, written independently of the template: tools on messages[0] if it is a system
    message, else on a new empty system message inserted first."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "tools": tools}, *messages[1:]]
    return [{"role": "system", "content": "", "tools": tools}, *messages]


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "chat"])
@pytest.mark.parametrize("conv", list(CONVERSATIONS))
def test_tools_kwarg_equals_encoder_with_documented_system_message(tok, conv, thinking):
    msgs = CONVERSATIONS[conv]
    want = encode_messages(documented_placement(msgs, TOOLS), "thinking" if thinking else "chat")
    assert "## Tools" in want and '"get_weather"' in want
    got = tok.apply_chat_template(msgs, tools=TOOLS, thinking=thinking, add_generation_prompt=True, tokenize=False)
    assert got == want, f"tools= placed unlike the documented rule:\n got: {got!r}\nwant: {want!r}"
    assert prompt_ids(tok, msgs, thinking=thinking, tools=TOOLS) == tok.encode(want, add_special_tokens=False)
    # negative controls: other placements render differently (the comparison can fail)
    mode = "thinking" if thinking else "chat"
    assert encode_messages([*msgs, {"role": "system", "content": "", "tools": TOOLS}], mode) != want
    if msgs[0]["role"] == "system":
        assert encode_messages([{"role": "system", "content": "", "tools": TOOLS}, *msgs], mode) != want
