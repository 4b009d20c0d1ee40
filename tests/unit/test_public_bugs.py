"""Bug classes from public reports on other DeepSeek-V4 / V3.2 implementations that no other dsv4 test covers.

docs/public_bugs.md maps every collected report to the dsv4 test that catches its class; the tests here are the
ones that had to be written for it (the others live beside the code they pin).
"""

from __future__ import annotations

import json
import shutil

import pytest

from dsv4.encoding import BOS, encode_messages, prompt_ids
from dsv4.tokenizer import load_tokenizer, packaged_tokenizer_dir

BOS_ID = 0


def _tokenizer_that_adds_bos(folder):
    """The packaged DeepSeek-V4 tokenizer files, edited the way DeepSeek-V3's were: `add_bos_token: true` and a
    post-processor that prepends BOS on `encode(..., add_special_tokens=True)`."""
    src = packaged_tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, folder / name)
    cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["add_bos_token"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False), encoding="utf-8")
    tj = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    add_bos = {"type": "TemplateProcessing",
               "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
               "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                        {"Sequence": {"id": "B", "type_id": 1}}],
               "special_tokens": {BOS: {"id": BOS, "ids": [BOS_ID], "tokens": [BOS]}}}
    tj["post_processor"] = {"type": "Sequence", "processors": [tj["post_processor"], add_bos]}
    (folder / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    return load_tokenizer(folder)


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "chat"])
def test_one_bos_even_when_the_checkpoint_tokenizer_adds_its_own(tmp_path, thinking):
    """Duplicated BOS: the template text already starts with BOS; tokenising that text with the tokenizer's
    own special tokens added prepends a second one (a common serving bug with DeepSeek templates). The model
    input must be the official prompt with exactly one BOS, whatever the checkpoint's tokenizer settings."""
    tok = _tokenizer_that_adds_bos(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 17 + 25?"}]
    text = encode_messages(messages, "thinking" if thinking else "chat")
    assert text.startswith(BOS)
    assert tok.encode(text)[:2] == [BOS_ID, BOS_ID], "power: this tokenizer adds a BOS of its own"
    want = load_tokenizer().encode(text, add_special_tokens=False)  # the packaged files: no BOS of their own
    for name, ids in (("prompt_ids", prompt_ids(tok, messages, thinking=thinking)),
                      ("apply_chat_template", tok.apply_chat_template(messages, thinking=thinking, tokenize=True,
                                                                      return_dict=False, add_generation_prompt=True))):
        ids = [int(t) for t in ids]
        assert ids == want, f"{name}: not the official prompt ids"
        assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1, f"{name}: {ids.count(BOS_ID)} BOS ids, expected one"
