"""Later DeepSeek-V4 revisions fail early and by name: at config time (before any weight is read) the error
says which revision it is, that dsv4 implements the April release, and what differs; a tokenizer from such a
checkpoint refuses to render April prompts. The April configs are the negative control."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dsv4.cli import main
from dsv4.config import IMPLEMENTED_RELEASE, ModelArgs, UnsupportedRevisionError, detect_revision
from dsv4.diagnose import EXIT_ERROR
from dsv4.encoding import prompt_ids
from dsv4.tokenizer import load_tokenizer, packaged_tokenizer_dir

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"
FLASH = json.loads((CONFIGS / "deepseek_v4_flash.config.json").read_text())
PRO = json.loads((CONFIGS / "deepseek_v4_pro.config.json").read_text())
DSPARK_0731 = {"dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [40, 41, 42],
               "dspark_markov_rank": 256}


def flash_0731() -> dict:
    """The V4-Flash-0731 config as published: base Flash plus the dspark_* keys and 46 compress_ratios."""
    return {**FLASH, **DSPARK_0731, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0, 0, 0]}


def v41() -> dict:
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
            "text_config": {"model_type": "deepseek_v41_text", "hidden_size": 4096}, "vision_config": {}}


@pytest.mark.parametrize("cfg,revision,evidence", [
    (flash_0731(), "DeepSeek-V4-Flash-0731", ["'dspark_block_size'", "46 entries for 43 main layers + 1 MTP"]),
    ({**PRO, **DSPARK_0731, "compress_ratios": PRO["compress_ratios"] + [0, 0]}, "DeepSeek-V4-Pro-0813",
     ["'dspark_markov_rank'", "64 entries for 61 main layers"]),
    (v41(), "DeepSeek-V4.1", ["deepseek_v41"]),
    ({**FLASH, "compress_ratios": FLASH["compress_ratios"] + [0]}, "a later DeepSeek-V4 revision",
     ["45 entries for 43 main layers + 1 MTP block(s), the April layout has 44"]),
])
def test_later_revision_named_at_config_time(cfg, revision, evidence, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedRevisionError) as e:
        ModelArgs.from_hf_config(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: this is {revision}") and e.value.revision.startswith(revision)
    assert f"dsv4 implements {IMPLEMENTED_RELEASE}" in msg and "What differs: " in msg
    for piece in evidence:
        assert piece in msg, piece
    assert isinstance(e.value, ValueError)  # every caller that reports bad input keeps working


def test_dspark_difference_names_the_drafter_and_the_encoder():
    name, _, differs = detect_revision(flash_0731())
    assert "markov_head" in differs and "mtp.0..2" in differs
    assert "reasoning_effort" in differs and "'max' preamble" in differs


@pytest.mark.parametrize("cfg", [FLASH, PRO, {**FLASH, "expert_dtype": None}], ids=["flash", "pro", "flash-F0"])
def test_april_configs_are_not_flagged(cfg):
    cfg = {k: v for k, v in cfg.items() if v is not None}
    assert detect_revision(cfg) is None
    ModelArgs.from_hf_config(cfg)


def _with_config(src: Path, dst: Path, cfg: dict) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_tokenizer_of_a_later_revision_refuses_april_prompts(tmp_path):
    tok = load_tokenizer(_with_config(packaged_tokenizer_dir(), tmp_path / "ckpt-0731", flash_0731()))
    msgs = [{"role": "user", "content": "Hi"}]
    for render in (lambda: prompt_ids(tok, msgs), lambda: prompt_ids(tok, msgs, thinking=False),
                   lambda: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)):
        with pytest.raises(UnsupportedRevisionError, match="this is DeepSeek-V4-Flash-0731"):
            render()
    assert tok.decode([0, 128803]) == "<｜begin▁of▁sentence｜><｜User｜>"  # decoding stays possible
    # negative control: the same tokenizer files beside the April config render normally
    april = load_tokenizer(_with_config(packaged_tokenizer_dir(), tmp_path / "ckpt-april", FLASH))
    assert april.dsv4_template_source.revision is None
    assert prompt_ids(april, msgs) == [0, 128803, *april.encode("Hi", add_special_tokens=False), 128804, 128821]


def test_diagnose_stops_before_reading_any_weight(tiny_ckpt, copy_ckpt, capsys, monkeypatch):
    import dsv4.checkpoint

    ck = copy_ckpt(tiny_ckpt)
    cfg = json.loads((ck / "config.json").read_text())
    cfg.update(DSPARK_0731, compress_ratios=cfg["compress_ratios"] + [0, 0])
    (ck / "config.json").write_text(json.dumps(cfg))

    def no_weights(*a, **k):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(dsv4.checkpoint, "load_checkpoint", no_weights)
    monkeypatch.setattr(dsv4.checkpoint.Checkpoint, "get", no_weights, raising=False)
    assert main(["diagnose", "--ckpt", str(ck)]) == EXIT_ERROR
    captured = capsys.readouterr()
    assert captured.err.startswith(f"dsv4 diagnose: error: {ck / 'config.json'}: this is a DSpark revision")
    assert "a weight was read" not in captured.err and captured.out == ""
