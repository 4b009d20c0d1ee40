"""`dsv4 diagnose`, the main job: both decisive tests in one report, exit 0 on pass, 3 on a hard stop, 2 on
bad input. The negative cases run the same entry point with the final norm bypassed and with a hand-rolled
prompt, and check that it stops and says why."""

from __future__ import annotations

import json

import pytest

from dsv4.cli import main
from dsv4.diagnose import EXIT_ERROR, EXIT_HARD_STOP, EXIT_PASS, hand_rolled_ids
from dsv4.model import Transformer


def _run(capsys, *args):
    status = main(["diagnose", *args])
    return status, capsys.readouterr().out


@pytest.mark.hardstop
def test_diagnose_passes_and_reports_both_halves(tiny_ckpt, tmp_path, capsys):
    out_json = tmp_path / "report.json"
    status, out = _run(capsys, "--ckpt", str(tiny_ckpt), "--json", str(out_json))
    assert status == EXIT_PASS, out
    for label in ("== Test 1: prompt format", "hand-rolled ids", "template ids", 'extra in hand-rolled: "\\n\\n" (id 271)',
                  '"<think>" (id 128821)', "greedy top-1 after switching to the template",
                  "== Test 2: final norm", "final norm applied before the LM head", "argmax_A", "argmax_B", "cos",
                  "rel_L2", "KL", "TEST_LAYERS in effect: 4", "config_sha256", "RESULT: PASS"):
        assert label in out, label
    rep = json.loads(out_json.read_text())
    assert rep["passed"] and rep["test1_template"]["passed"] and rep["test2_final_norm"]["passed"]
    assert rep["test1_template"]["fed_ids"][-1] == 128821
    assert rep["test2_final_norm"]["norm_calls"] == 3  # prefill + 2 decode steps
    spec = rep["test1_template"]["speculative"]  # issue 26 item 4: the continuation decoded speculatively
    assert spec["equal"] and spec["oracle"]["equal"] and spec["adversary"]["equal"], spec
    assert spec["tokens"] == len(rep["test1_template"]["continuation"]["template"]["ids"])
    assert spec["adversary"]["mean_accepted_length"] == 1.0 and spec["oracle"]["mean_accepted_length"] > 1
    assert "speculative decoding check" in out and "EQUAL to the plain continuation" in out


def test_diagnose_chat_mode_and_test_layers(tiny_ckpt, capsys, monkeypatch):
    monkeypatch.setenv("TEST_LAYERS", "2")
    status, out = _run(capsys, "--ckpt", str(tiny_ckpt), "--no-thinking", "--dtype", "fp32", "--decode-steps", "1")
    assert status == EXIT_PASS, out
    assert "TEST_LAYERS in effect: 2 of 4 main layers" in out
    assert '"</think>" (id 128822)' in out


@pytest.mark.hardstop
def test_diagnose_hard_stops_when_final_norm_bypassed(tiny_ckpt, capsys, monkeypatch):
    def no_norm(self, H):
        return self.head(self.hc_head(H, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.backend))

    monkeypatch.setattr(Transformer, "final_logits", no_norm)
    status, out = _run(capsys, "--ckpt", str(tiny_ckpt), "--dtype", "fp32")
    assert status == EXIT_HARD_STOP, out
    assert "final norm applied before the LM head (executions on the path, per step): NO (0 of 3 steps)" in out
    assert "RESULT: HARD STOP" in out


@pytest.mark.hardstop
def test_diagnose_hard_stops_on_hand_rolled_prompt(tiny_ckpt, capsys, monkeypatch):
    import dsv4.diagnose as d

    monkeypatch.setattr(d, "prompt_ids", lambda tok, messages, thinking=True, **kw:
                        hand_rolled_ids(tok, messages[-1]["content"]))
    status, out = _run(capsys, "--ckpt", str(tiny_ckpt), "--dtype", "fp32")
    assert status == EXIT_HARD_STOP, out
    assert "Test 1 HARD STOP: the ids fed to the model are not the official prompt format" in out


def test_special_string_in_the_prompt_is_warned_about_once(tiny_ckpt, capsys, caplog):
    """A prompt holding a format special string: the log warning (stderr) appeared twice per run, since diagnose
    built the official prompt twice; now once, plus the report's own WARNING line."""
    prompt = "hi <｜Assistant｜> there"
    with caplog.at_level("WARNING", logger="dsv4.encoding"):
        status, out = _run(capsys, "--ckpt", str(tiny_ckpt), "--dtype", "fp32", "--prompt", prompt,
                           "--continue-tokens", "1", "--decode-steps", "1")
    assert status == EXIT_PASS, out
    warned = [r.getMessage() for r in caplog.records if "special string" in r.getMessage()]
    assert warned == ["messages[0].content contains the special string '<｜Assistant｜>': it is tokenised as the "
                      "special token, as the official encoder does"]
    assert out.count("WARNING: the prompt contains special strings ['<｜Assistant｜>']") == 1


@pytest.mark.parametrize("value", ["0", "5", "two", "-1", "+2", "1_0", " 2", "02"])
def test_diagnose_rejects_bad_test_layers(tiny_ckpt, capsys, monkeypatch, value):
    monkeypatch.setenv("TEST_LAYERS", value)
    assert main(["diagnose", "--ckpt", str(tiny_ckpt)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"dsv4 diagnose: error: ") and f"TEST_LAYERS={value!r}" in err and "1..4" in err


def test_diagnose_missing_checkpoint(tmp_path, capsys):
    assert main(["diagnose", "--ckpt", str(tmp_path / "nope")]) == EXIT_ERROR
    assert "dsv4 diagnose: error: --ckpt=" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["diagnose", "TEST_LAYERS=10"], ["diagnose", "--decode-step", "2"],
                                  ["diagnose", "--decode-steps", "0"], ["generate", "--prompt", "x", "--max-token", "3"]])
def test_cli_rejects_unknown_or_abbreviated_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_diagnose_builds_a_tiny_checkpoint_by_default(capsys, monkeypatch):
    monkeypatch.delenv("DSV4_CKPT", raising=False)
    monkeypatch.delenv("TEST_LAYERS", raising=False)
    status, out = _run(capsys, "--dtype", "fp32", "--decode-steps", "1")
    assert status == EXIT_PASS, out
    assert "tiny checkpoint built on the fly" in out


@pytest.mark.parametrize("argv,msg", [
    (["generate", "--prompt", "x", "--temperature", "inf"], "not a finite number"),
    (["diagnose", "--device", "bogus"], "not a torch device"),
    (["diagnose", "--json", "/nonexistent-dir/r.json"], "does not exist"),
    (["diagnose", "--json", "/tmp"], "is a directory"),
    (["diagnose", "--prompt", "\udc80"], "not valid UTF-8"),
])
def test_cli_rejects_bad_values_before_loading(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_make_tiny_unwritable_target(capsys):
    assert main(["make-tiny", "/proc/dsv4-cannot-write-here"]) == 2
    assert "dsv4 make-tiny: error" in capsys.readouterr().err


def test_diagnose_with_quantized_resident_weights(tiny_ckpt, capsys):
    status, out = _run(capsys, "--ckpt", str(tiny_ckpt), "--weights", "quantized", "--dtype", "fp32",
                       "--decode-steps", "1")
    assert status == EXIT_PASS, out
    assert "weights quantized" in out


@pytest.mark.hardstop
def test_diagnose_is_inconclusive_not_pass_under_a_huge_eps(tiny_ckpt, copy_ckpt, tmp_path, capsys):
    """issue 22: `rms_norm_eps: 1e30` gave "Test 2 PASS" with cos 0.000 and rel L2 98.96 (the no-norm signature)
    against a tolerance of 1e35. Now: INCONCLUSIVE with its reason, exit status 4 (not 0), JSON not passed."""
    from dsv4.diagnose import EXIT_INCONCLUSIVE

    d = copy_ckpt(tiny_ckpt)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e30
    (d / "config.json").write_text(json.dumps(cfg))
    out_json = tmp_path / "r.json"
    status, out = _run(capsys, "--ckpt", str(d), "--dtype", "fp32", "--decode-steps", "1", "--continue-tokens", "8",
                       "--json", str(out_json))
    assert status == EXIT_INCONCLUSIVE == 4, out
    assert "Test 2 INCONCLUSIVE" in out and "RESULT: INCONCLUSIVE" in out and "RESULT: PASS" not in out
    assert "NOT rejected" in out
    rep = json.loads(out_json.read_text())
    assert rep["outcome"] == "INCONCLUSIVE" and rep["passed"] is False
    assert rep["test2_final_norm"]["outcome"] == "INCONCLUSIVE" and rep["test2_final_norm"]["passed"] is False


@pytest.mark.hardstop
def test_test1_is_anchored_to_the_official_special_ids(tiny_ckpt, capsys, monkeypatch):
    """Test 1 compares our template with our encoder through the same tokenizer; both would agree on a tokenizer
    with other special ids. The official ids anchor it: the real tokenizer matches them; a mismatch (here the
    expected table altered, as a tokenizer with other ids would look) is a HARD STOP naming the string."""
    import dsv4.diagnose as d
    from dsv4.tokenizer import load_tokenizer

    assert d.special_id_problems(load_tokenizer(tiny_ckpt)) == []
    assert d.OFFICIAL_SPECIAL_IDS[d.USER] == 128803 and d.OFFICIAL_SPECIAL_IDS[d.THINK_END] == 128822
    monkeypatch.setitem(d.OFFICIAL_SPECIAL_IDS, d.USER, 128804)
    status, out = _run(capsys, "--ckpt", str(tiny_ckpt), "--dtype", "fp32", "--decode-steps", "1",
                       "--continue-tokens", "8")
    assert status == EXIT_HARD_STOP, out
    assert 'problem: "<｜User｜>" encodes to [128803], expected the official [128804]' in out
    assert "Test 1 FAIL: the tokenizer's special ids are not DeepSeek-V4's official ones" in out


def test_speculative_check_reports_a_rollback_bug(tiny_ckpt, capsys, monkeypatch):
    """Negative control of the diagnose check: a rollback that keeps every rejected token (the state left after the
    whole verify step, positions reset) makes the adversary's decode differ, and the report says DIFFERS."""
    from dsv4.model import Transformer

    def no_rollback(self, state, record, keep):
        state.row_pos = [p + k for p, k in zip(record.pos0, keep)]
    monkeypatch.setattr(Transformer, "rollback", no_rollback)
    status, out = _run(capsys, "--ckpt", str(tiny_ckpt))
    assert "DIFFERS from the plain continuation" in out and "adversary drafter, k=2: first difference" in out
